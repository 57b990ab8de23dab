"""Shared-memory transport: processes of one host, one copy, no staging.

The receiver's regions live in POSIX shared-memory segments (``HostPool(shared=True)`` or
:func:`~kvbridge.memory.wrap_shared_memory`); its metadata names them. A sender maps each
segment of a peer once, at :meth:`ShmTransport.add_peer` (the mapping is cached and
pre-faulted), and its worker threads copy straight from its own regions into the mapping.
numpy releases the GIL while it copies, so ``post`` returns at once and several workers copy
in parallel; a batch is split over the workers by bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import queue
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from kvbridge.copy import execute, split
from kvbridge.errors import TransportError
from kvbridge.memory import RegionMemory, map_segment
from kvbridge.runs import Runs
from kvbridge.transports._common import (
    METADATA_VERSION,
    AgentMetadata,
    LocalRegions,
    checked_sources,
    decode_metadata,
    encode_metadata,
    known_peer,
)
from kvbridge.transports.base import Transport, XferHandle

# Below this a batch is not worth splitting across workers.
_MIN_PART_BYTES = 8 << 20
_IDLE_WAIT = 1.0  # how often an idle worker looks whether the transport closed


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


class ShmTransport(Transport):
    """Options: ``workers`` copy threads; ``prefault`` peer mappings at add_peer;
    ``allow_private`` lets private memory be registered as send-only (no peer can write it)."""

    name: ClassVar[str] = "shm"

    def __init__(self, agent: str, *, workers: int = 2, prefault: bool = True,
                 allow_private: bool = False) -> None:
        super().__init__(agent)
        if workers < 1:
            raise TransportError(f"shm: workers must be >= 1, got {workers}")
        self._workers_n = workers
        self._prefault = prefault
        self._allow_private = allow_private
        self._host = host_id()
        self._local = LocalRegions()
        self._peers: dict[str, _Peer] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._work, name=f"kvbridge-shm-{agent}-{i}",
                                          daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    # ---- memory and peers -----------------------------------------------------------------

    def register(self, regions: Sequence[RegionMemory]) -> bytes:
        self._check_open()
        private = [r.name for r in regions if not r.shared]
        if private and not self._allow_private:
            raise TransportError(
                f"shm transport: regions {private[:8]} are private memory, which a peer process "
                f"cannot write; allocate them with HostPool(shared=True) or wrap a SharedMemory "
                f"segment (wrap_shared_memory), or pass allow_private=True to register them as "
                f"send-only")
        self._local.add(regions)
        return encode_metadata(AgentMetadata(METADATA_VERSION, self.name, self.agent,
                                             self._local.infos(), host_id=self._host))

    def add_peer(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        meta = decode_metadata(metadata, self.name, peer)
        if meta.host_id != self._host:
            raise TransportError(f"shm peer {peer!r} is on another host (host id "
                                 f"{meta.host_id!r}, ours {self._host!r}); use tcp")
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
                whole = np.frombuffer(maps[r.segment], dtype=np.uint8)
                if r.offset + r.nbytes > whole.nbytes:
                    raise TransportError(f"peer {peer!r}: region {r.name!r} [{r.offset}, "
                                         f"{r.offset + r.nbytes}) is past the end of segment "
                                         f"{r.segment!r} ({whole.nbytes} bytes)")
                views[r.name] = whole[r.offset:r.offset + r.nbytes]
        except TransportError:
            views.clear()
            for seg in opened:
                with contextlib.suppress(BufferError):
                    maps[seg].close()
            raise
        with self._lock:
            self._maps.update({s: maps[s] for s in opened})
            old = self._peers.get(peer)
            if old is not None:
                old.removed = True
            self._peers[peer] = _Peer(meta, views)
            self._drop_unused_maps()

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
            if old is not None:
                old.removed = True  # queued jobs for it end FAILED
            self._drop_unused_maps()

    def _drop_unused_maps(self) -> None:
        used = {r.segment for p in self._peers.values() for r in p.meta.regions}
        for seg in [s for s in self._maps if s not in used]:
            mm = self._maps.pop(seg)
            # A job still copying holds a view: the mapping then goes with that view.
            with contextlib.suppress(BufferError):
                mm.close()

    # ---- transfers ------------------------------------------------------------------------

    def post(self, peer: str, src_regions: Sequence[str], dst_regions: Sequence[str],
             runs: Runs) -> XferHandle:
        self._check_open()
        p = known_peer(self._peers, self._lock, peer)
        src = checked_sources(self._local, p.meta, peer, src_regions, dst_regions, runs)
        private = [n for n in dst_regions if n not in p.views]
        if private:
            raise TransportError(f"regions {private} of peer {peer!r} are private memory; the "
                                 f"shm transport writes only into shared segments")
        dst = [p.views[n] for n in dst_regions]
        parts = split(runs, self._workers_n, _MIN_PART_BYTES)
        handle = XferHandle(self, peer, runs.total_bytes, len(parts))
        with self._lock:  # close() cannot slip between the check and the queueing
            self._check_open()
            for part in parts:
                self._jobs.put(_Job(handle, p, part, src, dst))
        return handle

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_IDLE_WAIT)
            except queue.Empty:
                if self._closed:
                    return
                continue
            if job is None:
                return
            if self._closed:
                job.handle.part_done(f"shm agent {self.agent!r} closed before the copy started")
            elif job.peer.removed:
                job.handle.part_done(f"peer {job.handle.peer!r} was removed before the copy "
                                     f"started")
            elif job.handle.failing:
                job.handle.part_done("another part of this transfer failed")
            else:
                try:
                    execute(job.runs, job.src, job.dst, checked=True)
                except Exception as e:  # a worker must survive anything and report it
                    job.handle.part_done(f"shm copy failed: {type(e).__name__}: {e}")
                else:
                    job.handle.part_done()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            # A copy in progress finishes (it cannot be interrupted); jobs behind it fail.
            t.join(timeout=30.0)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.handle.part_done(f"shm agent {self.agent!r} closed")
        with self._lock:
            for p in self._peers.values():
                p.removed = True
            self._peers.clear()
            self._drop_unused_maps()
        self._local.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"shm agent {self.agent!r} is closed")
