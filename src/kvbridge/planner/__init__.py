"""The planner: one pure function from two sides' layouts to copy runs, for every transport.

==============  ============================================================================
shard           the one sharding rule (units split or replicated per segment) and who sends
                which units to whom
tokenmap        which context-parallel token shard holds each token, at which local index
parallel        :class:`ParallelLayout`: TP, PP layer ranges, CP groups, DCP ranks
layout          memory layouts: regions, buffers with named dims and byte strides
placement       where one request lives: page ids, slots, the first token its side takes
runs            :class:`Runs`: flat and strided copy runs; ``coalesce``
transferplan    what a plan says: the parts a pair delivers, runs per pair
pieces          the byte arithmetic: pieces of a token, page offsets, shared token segments
side            one side checked on its own
pairitems       what a pairing plans over, found once
plan            :class:`Pairing` (two sides checked once), ``routes``/``senders_of`` (what
                completion waits for), ``plan`` (one chunk -> runs per rank pair)
reference       the byte oracle: logical cache -> rank shards, slow and obviously correct
sidespec        a side from the command line's few options (``tp=4,page=16,...``)
==============  ============================================================================

Each module imports only those above it in this table (``tests/test_architecture.py``).
"""
