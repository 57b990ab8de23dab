"""A prefill rank's chunk notice (``ChunkDone``), taken by the decode rank.

A notice counts only from the prefill rank it claims to come from, for a request whose
metadata was sent. A staged chunk counts only once every one of its segments was scattered
(:mod:`.landing`); in integrity mode the chunk's bytes must match the notice's checksums.
Then its tokens and parts are recorded in the request's
:class:`~kvbridge.runtime.status.Completion`; the notice that completes it makes the request
succeed: the admission of its writes closes and every writer hears ``Delivered`` (its sender
succeeds only on that).
"""

from __future__ import annotations

import logging
import threading

from kvbridge.errors import FailureKind, ProtocolError
from kvbridge.memory.integrity import verify
from kvbridge.planner.transferplan import PartKind
from kvbridge.runtime.contracts import Rank
from kvbridge.runtime.decode.landing import Releasing, StagingArea
from kvbridge.runtime.decode.receiver import Receiver
from kvbridge.runtime.metrics import trace
from kvbridge.runtime.status import Completion
from kvbridge.runtime.timeline import Phase
from kvbridge.staging.cost import Path
from kvbridge.wire.protocol import ChunkDone, Delivered

log = logging.getLogger("kvbridge.receiver")


class ChunkNotices:
    """Takes chunk notices for the decode role ``role`` (which fails and releases requests)."""

    def __init__(self, bridge: Rank, role: Releasing, staging: StagingArea | None) -> None:
        self.b, self.role, self.staging = bridge, role, staging
        self.settings = bridge.settings
        self.rank = bridge.rank
        self._lock = threading.Lock()

    def take(self, r: Receiver, rank: int, msg: ChunkDone) -> str | None:
        """Take prefill rank ``rank``'s notice of a chunk of ``r``; why it is refused, if it
        is (None: taken, or ignored, or the request failed because of it). Notices come on
        the control thread, the landing thread and the transport's receiving threads (those
        its writes carry): one at a time."""
        with self._lock:
            return self._take(r, rank, msg)

    def _take(self, r: Receiver, rank: int, msg: ChunkDone) -> str | None:
        completion, placement, pairing = r.completion, r.placement, r.linked.pairing
        if completion is None or placement is None or pairing is None:
            log.warning(
                "%s: chunk notice for room %d before its metadata; ignored", self.b.agent, r.room
            )
            return None
        if msg.prefill_rank != rank:
            return f"it claims prefill rank {msg.prefill_rank}, its rank is {rank}"
        if msg.staged:
            why = (
                self.staging.unscattered(r, rank, msg)
                if self.staging is not None
                else "this rank has no staging region"
            )
            if why is not None:
                self.role.fail(r, FailureKind.RECEIVER_ERROR, why)
                return None
        try:
            parts = [PartKind(p) for p in msg.parts]
            if self.settings.integrity:
                last = PartKind.AUX in parts or PartKind.STATE in parts
                bad = verify(
                    pairing,
                    placement,
                    msg.start,
                    msg.stop,
                    last,
                    rank,
                    self.rank,
                    self.b.views,
                    msg.checksums,
                    msg.layer_range(),
                    PartKind.AUX in parts,
                )
                if bad:
                    self.role.fail(r, FailureKind.INTEGRITY, bad)
                    return None
            completion.record(rank, msg.start, msg.stop, parts, msg.layer_range())
        except (ValueError, ProtocolError) as e:
            return f"bad chunk notice: {e}"
        nbytes = max(0, msg.nbytes)
        r.received_bytes += nbytes
        r.status.timeline.mark(Phase.FIRST_NOTICE)
        path = Path.STAGED if msg.staged else Path.DIRECT
        self.b.metrics.received(nbytes, path)
        trace(
            r.room,
            "chunk",
            role="decode",
            rank=self.rank,
            prefill_rank=rank,
            tokens=[msg.start, msg.stop],
            layers=list(msg.layers) if msg.layers else None,
            bytes=nbytes,
            path=path.value,
        )
        if completion.done and r.status.succeed():
            self._succeeded(r, completion)
        return None

    def _succeeded(self, r: Receiver, completion: Completion) -> None:
        # Every writer reported after its writes ended: nothing is in flight. Close the
        # admission, and let the writers' senders succeed.
        link = r.linked
        self.b.transport.fence((link.session, r.room), 0.0)
        # Released before any writer hears Delivered: a prefill's success means the decode has
        # already let the request's pages go (its engine may reuse them from then on).
        self.role.maybe_release(r)
        for p in completion.expected:
            self.b.send(
                link.infos[p].agent,
                Delivered(
                    sender=self.b.agent, session=link.session, room=r.room, decode_rank=self.rank
                ),
            )
