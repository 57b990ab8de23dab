"""Shared-memory transport: processes of one host, one copy, no staging.

The receiver's regions live in POSIX shared-memory segments (``HostPool(shared=True)`` or
:func:`~kvbridge.memory.pools.wrap_shared_memory`); its metadata names them. A sender maps each
segment of a peer once, at :meth:`ShmTransport.add_peer` (the mapping is cached and
pre-faulted), and its worker threads copy straight from its own regions into the mapping.
numpy releases the GIL while it copies, so ``post`` returns at once and several workers copy
in parallel; a batch is split over the workers by bytes. A batch too small to split (under
8 MiB, a millisecond's copy) and of few runs is copied by ``post`` itself, on the caller's
thread.

A mapping lives exactly as long as a peer uses it. Only the peer's record and the jobs of its
transfers hold views into it; a worker lets go of a job before it reports the part ended, and
``remove_peer`` takes the peer's queued jobs out of the queue. A segment no peer uses is
unmapped at once, or, when a copy still writes into it (a copy cannot be interrupted), as soon
as that copy ends: a dead peer's segment does not stay mapped in this process.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import socket
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kvbridge.errors import TransportError
from kvbridge.memory.copy import execute, split
from kvbridge.memory.pools import RegionMemory, map_segment
from kvbridge.planner.runs import Runs
from kvbridge.transports._common import (
    DEVICE_TRANSPORTS,
    METADATA_VERSION,
    AgentMetadata,
    LocalRegions,
    checked_sources,
    decode_metadata,
    encode_metadata,
    known_peer,
    refuse_device,
)
from kvbridge.transports.base import FenceKey, Transport, TransportOptions, XferHandle

log = logging.getLogger(__name__)

# Below this a batch is not worth splitting across workers.
_MIN_PART_BYTES = 8 << 20
# A batch of at most _MIN_PART_BYTES and this many runs is copied by post() itself (a
# millisecond's copy at most); one of more runs (a fragmented layout's thousands: one numpy
# call each where they are strided) is queued for a worker, so that post() returns at once.
_INLINE_RUNS = 256
_IDLE_WAIT = 1.0  # how often an idle worker closes retired mappings and looks for close()
_JOIN_TIMEOUT = 30.0  # a copy in progress cannot be interrupted; close() waits this long


def host_id() -> str:
    """Identifies this host's memory: the kernel's boot id (shared by containers of the host),
    else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


@dataclass
class _Peer:
    meta: AgentMetadata
    views: dict[str, np.ndarray]  # writable regions only
    removed: bool = False


@dataclass(frozen=True)
class _Job:
    handle: XferHandle
    peer: _Peer
    runs: Runs
    src: list[np.ndarray]
    dst: list[np.ndarray]


class _JobQueue:
    """The workers' FIFO. Unlike ``queue.Queue``, a removed peer's jobs can be taken out at
    once, so that they stop holding views into its mapping while the workers are busy."""

    def __init__(self) -> None:
        self._items: deque[_Job] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._stopped = False

    def put(self, jobs: Sequence[_Job]) -> None:
        with self._cond:
            self._items.extend(jobs)
            self._cond.notify(len(jobs))

    def get(self, timeout: float) -> _Job | None:
        """The next job; None after ``timeout`` idle seconds, or at once when stopped."""
        with self._cond:
            if not self._items and not self._stopped:
                self._cond.wait(timeout)
            return self._items.popleft() if self._items else None

    def take(self, peer: _Peer | None) -> list[_Job]:
        """Take out the queued jobs of ``peer`` (every job when None)."""
        with self._cond:
            taken = [j for j in self._items if peer is None or j.peer is peer]
            if taken:
                self._items = deque(
                    j for j in self._items if peer is not None and j.peer is not peer
                )
            return taken

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


def _fail(jobs: list[_Job], reason: str) -> None:
    """End jobs that never started; the list is emptied, so no view outlives this call."""
    handles = [j.handle for j in jobs]
    jobs.clear()
    for h in handles:
        h.part_done(reason)


class ShmTransport(Transport):
    """Options: ``workers`` copy threads; ``prefault`` peer mappings at add_peer;
    ``allow_private`` lets private memory be registered as send-only (no peer can write it)."""

    name: ClassVar[str] = "shm"
    posts_at_once: ClassVar[bool] = True  # a small batch copied, a larger one queued

    @classmethod
    def options(cls, given: TransportOptions) -> dict[str, Any]:
        return {"allow_private": given.allow_private}

    def __init__(
        self, agent: str, *, workers: int = 2, prefault: bool = True, allow_private: bool = False
    ) -> None:
        super().__init__(agent)
        if workers < 1:
            raise TransportError(f"shm: workers must be >= 1, got {workers}")
        self._workers_n = workers
        self._prefault = prefault
        self._allow_private = allow_private
        self._host = host_id()
        self._local = LocalRegions()
        self._peers: dict[str, _Peer] = {}
        self._maps: dict[str, mmap.mmap] = {}  # segment -> mapping, while a peer uses it
        # Mappings no peer uses any more that a copy still wrote into when they were dropped:
        # closed when that copy ends (or on a worker's idle tick).
        self._retired: list[tuple[str, mmap.mmap]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._copying = 0  # copies post() is making on its callers' threads
        self._copied = threading.Condition(self._lock)
        self._jobs = _JobQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"kvbridge-shm-{agent}-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    # ---- memory and peers -----------------------------------------------------------------

    def register(self, regions: Sequence[RegionMemory]) -> bytes:
        self._check_open()
        refuse_device(self.name, regions, DEVICE_TRANSPORTS)
        private = [r.name for r in regions if not r.shared]
        if private and not self._allow_private:
            raise TransportError(
                f"shm transport: regions {private[:8]} are private memory, which a peer process "
                f"cannot write; allocate them with HostPool(shared=True) or wrap a SharedMemory "
                f"segment (wrap_shared_memory), or pass allow_private=True to register them as "
                f"send-only"
            )
        self._local.add(regions)
        return encode_metadata(
            AgentMetadata(
                METADATA_VERSION, self.name, self.agent, self._local.infos(), host_id=self._host
            )
        )

    def add_peer(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        meta = decode_metadata(metadata, self.name, peer)
        if meta.host_id != self._host:
            raise TransportError(
                f"shm peer {peer!r} is on another host (host id "
                f"{meta.host_id!r}, ours {self._host!r}); use tcp"
            )
        with self._lock:
            known = self._peers.get(peer)
            if known is not None and known.meta == meta:
                return  # a repeated hello: keep the mappings and what is queued
            maps = dict(self._maps)
        views: dict[str, np.ndarray] = {}
        opened: list[str] = []
        try:
            for r in meta.regions:
                if r.segment is None:
                    continue  # the peer's send-only memory
                if r.segment not in maps:
                    maps[r.segment] = map_segment(r.segment, populate=self._prefault)
                    opened.append(r.segment)
                size = len(maps[r.segment])
                if r.offset + r.nbytes > size:
                    raise TransportError(
                        f"peer {peer!r}: region {r.name!r} [{r.offset}, "
                        f"{r.offset + r.nbytes}) is past the end of segment "
                        f"{r.segment!r} ({size} bytes)"
                    )
                views[r.name] = np.frombuffer(
                    maps[r.segment], dtype=np.uint8, count=r.nbytes, offset=r.offset
                )
        except TransportError:
            views.clear()
            for seg in opened:
                with contextlib.suppress(BufferError):
                    maps[seg].close()
            raise
        with self._lock:
            for seg in opened:
                if seg in self._maps:  # mapped meanwhile by another add_peer: ours goes with
                    self._retired.append((seg, maps[seg]))  # this peer's views
                else:
                    self._maps[seg] = maps[seg]
            old = self._peers.get(peer)
            self._peers[peer] = _Peer(meta, views)
        del maps, views
        if old is not None:  # re-registered or restarted: what was queued for it fails
            self._forget(old, f"peer {peer!r} re-registered before the copy started")

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
        if old is not None:
            self._forget(old, f"peer {peer!r} was removed before the copy started")

    def _forget(self, old: _Peer, reason: str) -> None:
        """``old`` is no longer in ``_peers``: fail its queued jobs, unmap what nobody uses."""
        with self._lock:
            old.removed = True  # post() no longer queues for it; a worker skips its jobs
        _fail(self._jobs.take(old), reason)
        old.views.clear()  # in-flight posts hold ``old`` itself, not this dict
        with self._lock:
            self._drop_unused_maps()

    def _drop_unused_maps(self) -> None:
        """Under the lock: unmap every segment no peer uses. One a copy still writes into
        cannot be closed yet; it is retired, and closed once that copy has ended."""
        used = {r.segment for p in self._peers.values() for r in p.meta.regions}
        for seg in [s for s in self._maps if s not in used]:
            self._retired.append((seg, self._maps.pop(seg)))
        self._close_retired()

    def _close_retired(self) -> None:
        """Under the lock."""
        if not self._retired:
            return
        busy: list[tuple[str, mmap.mmap]] = []
        for seg, mm in self._retired:
            try:
                mm.close()
            except BufferError:  # a job in progress still holds a view into it
                busy.append((seg, mm))
        self._retired = busy

    def mapped_segments(self) -> list[str]:
        """The peer segments this agent still maps (in use, or waiting for a copy to end)."""
        with self._lock:
            return sorted({*self._maps, *(seg for seg, _ in self._retired)})

    # ---- transfers ------------------------------------------------------------------------

    def post(
        self,
        peer: str,
        src_regions: Sequence[str],
        dst_regions: Sequence[str],
        runs: Runs,
        *,
        key: FenceKey | None = None,
    ) -> XferHandle:
        self._check_open()
        p = known_peer(self._peers, self._lock, peer)
        src = checked_sources(self._local, p.meta, peer, src_regions, dst_regions, runs)
        private = [n for n in dst_regions if n not in p.views]
        if private and not p.removed:
            raise TransportError(
                f"regions {private} of peer {peer!r} are private memory; the "
                f"shm transport writes only into shared segments"
            )
        parts = split(runs, self._workers_n, _MIN_PART_BYTES)
        handle = XferHandle(self, peer, runs.total_bytes, len(parts))
        with self._lock:  # neither close() nor remove_peer() can slip between check and queue
            self._check_open()
            removed = p.removed
            if not removed:
                dst = [p.views[n] for n in dst_regions]
                jobs = [_Job(handle, p, part, src, dst) for part in parts]
                del dst
                if len(jobs) != 1 or not _copied_by_post(runs):  # (none: an empty batch)
                    self._jobs.put(jobs)
                    return handle
                self._copying += 1
        if removed:
            for _ in parts:
                handle.part_done(f"peer {peer!r} was removed before the copy started")
            return handle
        # A batch one worker would copy alone is copied here, on the posting thread: the same
        # copy, without waking a worker, which on an interpreter an engine's loop keeps busy
        # waits up to a switch interval (5 ms) to run, and again to report. As a worker does,
        # it holds the job's views (the peer's mapping) until the copy ended, and lets go of
        # them before the part is reported.
        error: str | None = "the copy was interrupted"
        try:
            error = self._copy(jobs[0])
        finally:
            del jobs
            with self._lock:
                self._close_retired()
                self._copying -= 1
                self._copied.notify_all()
            handle.part_done(error)
        return handle

    def _work(self) -> None:
        while True:
            job = self._jobs.get(_IDLE_WAIT)
            if job is None:
                if self._closed:
                    return
                with self._lock:
                    self._close_retired()
                continue
            handle, error = job.handle, self._copy(job)
            # Let go of the job's views before anyone can learn that the part ended: a peer
            # removed meanwhile is unmapped now, and one removed after it can be at once.
            del job
            with self._lock:
                self._close_retired()
            handle.part_done(error)

    def _copy(self, job: _Job) -> str | None:
        """Run one part; the reason it failed, or None."""
        if self._closed:
            return f"shm agent {self.agent!r} closed before the copy started"
        if job.peer.removed:
            return f"peer {job.handle.peer!r} was removed before the copy started"
        if job.handle.failing:
            return "another part of this transfer failed"
        try:
            execute(job.runs, job.src, job.dst, checked=True)
        except Exception as e:  # a worker must survive anything and report it
            return f"shm copy failed: {type(e).__name__}: {e}"
        return None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._jobs.stop()  # workers fail what is queued, then return
        for t in self._threads:
            t.join(timeout=_JOIN_TIMEOUT)  # a copy in progress finishes; it cannot be cut
        with self._lock:  # and so does one post() makes on its caller's thread
            self._copied.wait_for(lambda: not self._copying, _JOIN_TIMEOUT)
        _fail(self._jobs.take(None), f"shm agent {self.agent!r} closed")
        with self._lock:
            for p in self._peers.values():
                p.removed = True
                p.views.clear()
            self._peers.clear()
            self._drop_unused_maps()
            busy = [seg for seg, _ in self._retired]
        if busy:  # a copy outlived the join: its mapping goes when it ends
            log.warning(
                "shm agent %r closed while a copy still ran after %.0f s; segments %s "
                "stay mapped until it ends",
                self.agent,
                _JOIN_TIMEOUT,
                busy,
            )
        self._local.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"shm agent {self.agent!r} is closed")


def _copied_by_post(runs: Runs) -> bool:
    """Whether ``post`` copies ``runs`` itself (whatever the number of workers)."""
    return runs.total_bytes <= _MIN_PART_BYTES and len(runs) <= _INLINE_RUNS
