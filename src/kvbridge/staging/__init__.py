"""Staged transfer: a fragmented pair's bytes gathered, moved in a few large writes, scattered.

Some engines pay per descriptor (NIXL, Mooncake: one descriptor per contiguous block). A P4 ->
D1 plan over NHD pools writes every token's head slice as a block of its own: millions of
descriptors for a 1 GiB request. Staging moves the same bytes in a few segment-sized writes:

1. the sender **gathers** a segment of the pair's runs into a slot of its own staging region
   (registered with the transport once, at start);
2. it **writes** the slot into a slot of the decode rank's staging region that the decode rank
   granted it (one descriptor);
3. the decode rank **scatters** the slot into its pages, and only then may the chunk count as
   delivered.

The modules, in reading order:

==========  ================================================================================
cost        :class:`StagingMode` (the setting), :class:`CostModel` (a transport's descriptor
            cost and bandwidth) and :func:`choose`: direct or staged, per pair and chunk
layout      :func:`segments`, :func:`gather`, :func:`scatter`: both orders derived from the
            planner's runs (segment ``k`` holds bytes ``[k*T, (k+1)*T)`` of the pair's runs
            packed end to end); no slicing logic of its own
ring        :class:`SlotRing`: fixed slots of a staging region, granted in the order asked
==========  ================================================================================

These are pure. The request runtime uses them (and allocates each rank's staging region,
:mod:`kvbridge.runtime.staging_pool`): the prefill half's
:mod:`kvbridge.runtime.prefill.staged` asks for slots, gathers, writes and reports each
segment; the decode half's :mod:`kvbridge.runtime.decode.landing` grants slots, scatters for
live requests only, and frees a slot when its bytes are scattered or its request is released.

Fencing is unchanged: a slot granted to a request is reused only once its bytes were
scattered, or once the request is released (no writer can write any more); a request held or
quarantined keeps its slots. The decode rank scatters only for a live request, and its
release waits for a scatter in progress to end.
"""

from kvbridge.staging.cost import CostModel, Path, StagingMode, choose
from kvbridge.staging.layout import gather, scatter, segments

__all__ = ["CostModel", "Path", "StagingMode", "choose", "gather", "scatter", "segments"]
