"""Mooncake transport: the contract over Mooncake's Transfer Engine (its TCP protocol here;
host or CUDA device memory, which the engine recognises by its address).

A thin adapter. Each agent is one ``TransferEngine`` started with ``P2PHANDSHAKE`` metadata,
so no etcd or metadata server is needed: peers find each other by the ``host:port`` of the
engine's RPC endpoint, which kvbridge's own metadata blob carries with the region table.
``post`` turns runs into flat (local address, peer address, length) descriptors, cuts them
into batches and returns at once; worker threads run each batch with
``batch_transfer_sync_write`` (the engine's batch API that frees the GIL while it waits; its
``get_batch_transfer_status`` also blocks, and ``transfer_check_status`` only reads the first
entry of a batch). Workers run at the lowest CPU priority: that call spins while it waits.

Failure handling, and why:

* The engine answers a batch with 0 or -1; -1 becomes FAILED with what it can mean.
* A batch can hang after a failed one (seen with a full TCP lane queue), so every running
  batch has a budget (``io_timeout`` plus its bytes at 100 MB/s). ``poll``/``wait`` fail one
  past it and start a replacement worker; the stuck thread is abandoned (the engine's own
  ``MC_TRANSFER_TIMEOUT`` ends it eventually).
* The engine's TCP lanes refuse a peer's transfers past ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``
  and ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` (1,024 by default; batches of a few thousand
  descriptors fail, and the queue stays full for later ones). Both are raised to 65,535 (the
  most it takes) before the engine starts, unless set, and batches are cut so that all
  workers' batches in flight stay under the limit.
* ``MC_LOG_LEVEL`` defaults to ERROR (its INFO lines are per batch).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvbridge.errors import TransportError, TransportUnavailable
from kvbridge.memory import device as cuda_device
from kvbridge.memory.copy import split
from kvbridge.memory.pools import RegionMemory
from kvbridge.planner.runs import Runs
from kvbridge.staging.cost import CostModel
from kvbridge.transports._common import (
    METADATA_VERSION,
    AgentMetadata,
    LocalRegions,
    checked_regions,
    decode_metadata,
    encode_metadata,
    flat_descriptors,
    known_peer,
    peer_addresses,
    transfer_budget,
)
from kvbridge.transports.base import FenceKey, Transport, TransportOptions, XferHandle, XferState

QUEUE_LIMITS = ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER")
MAX_QUEUE_LIMIT = 65535
_MIN_PART_BYTES = 8 << 20  # below this a batch is not spread over workers
_TICK = 0.25  # how often wait() looks for batches past their budget
_IDLE = 1.0  # how often an idle worker looks whether the transport closed
_ORPHANS: list[Any] = []  # engines a stuck batch still uses at close: never freed under it


def load_api() -> Any:
    """Mooncake's ``TransferEngine`` class, or TransportUnavailable naming the extra."""
    for name, value in (
        *((n, str(MAX_QUEUE_LIMIT)) for n in QUEUE_LIMITS),
        ("MC_LOG_LEVEL", "ERROR"),
    ):
        os.environ.setdefault(name, value)
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped,unused-ignore]
    except ImportError as e:  # the package, or a library it links (libibverbs) is missing
        raise TransportUnavailable(
            f"transport 'mooncake' needs Mooncake's transfer engine: pip install "
            f"'kvbridge[mooncake]' (and, on Debian, apt-get install libibverbs1); could not "
            f"import mooncake.engine: {e}"
        ) from e
    return TransferEngine


def queue_limit() -> int:
    """The per-peer queue limit the engine will run with (the lower of the two)."""
    values = []
    for name in QUEUE_LIMITS:
        raw = os.environ.get(name, "1024")
        try:
            value = int(raw)
        except ValueError:
            raise TransportError(f"mooncake: {name}={raw!r} is not an integer") from None
        # The engine ignores a value past its maximum and keeps its default, 1,024.
        values.append(value if 1 <= value <= MAX_QUEUE_LIMIT else 1024)
    return min(values)


@dataclass(eq=False)
class _Peer:
    meta: AgentMetadata
    segment: str  # the engine's name for it: host:port of its RPC endpoint
    removed: bool = False


@dataclass(eq=False)
class _Batch:
    handle: XferHandle
    peer: _Peer
    src: list[int]
    dst: list[int]
    lengths: list[int]
    nbytes: int
    deadline: float = 0.0  # set when a worker starts it
    ended: bool = False


class MooncakeTransport(Transport):
    """Options: ``host`` the engine listens on and peers reach it at; ``workers`` threads
    running batches (each spins while its batch runs: more than one only pays with cores to
    spare); ``max_batch`` descriptors a batch (default and most: the engine's queue limit
    shared by the workers); ``io_timeout`` (s) a batch may take, plus its bytes at 100 MB/s."""

    name: ClassVar[str] = "mooncake"
    # One descriptor per contiguous block (measured here over TCP: ~12 us each, ~2.3 GB/s).
    cost: ClassVar[CostModel] = CostModel(per_descriptor=12e-6, bandwidth=2.3e9, strided=False)

    @classmethod
    def options(cls, given: TransportOptions) -> dict[str, Any]:
        # Mooncake's engine names itself by the host it is given: peers connect there.
        return {"io_timeout": given.io_timeout, "host": given.advertise or given.host}

    def __init__(
        self,
        agent: str,
        *,
        host: str = "127.0.0.1",
        workers: int = 1,
        max_batch: int | None = None,
        io_timeout: float = 30.0,
    ) -> None:
        super().__init__(agent)
        if workers < 1 or (max_batch is not None and max_batch < 1) or io_timeout <= 0:
            raise TransportError(
                f"mooncake: need workers >= 1, max_batch >= 1, io_timeout > 0; "
                f"got {workers}, {max_batch}, {io_timeout}"
            )
        engine_cls = load_api()
        # The engine's own wait for a batch (at least 5 s): ours is the budget, its the backstop.
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(io_timeout))))
        self.io_timeout, self.workers = io_timeout, workers
        fits = max(1, queue_limit() // workers)  # all workers' batches in flight fit the queue
        self.max_batch = min(max_batch or fits, fits)
        self._engine = engine_cls()
        if self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise TransportError(
                f"mooncake: the transfer engine of agent {agent!r} did not "
                f"start on {host} (see its log above)"
            )
        self.host, self.port = host, int(self._engine.get_rpc_port())
        self._local = LocalRegions()
        self._registered: list[int] = []
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._jobs: queue.Queue[_Batch | None] = queue.Queue()
        self._running: dict[threading.Thread, _Batch] = {}
        self._threads: list[threading.Thread] = []
        self._abandoned: list[threading.Thread] = []  # stuck inside the engine
        for _ in range(workers):
            self._spawn()

    # ---- memory and peers -----------------------------------------------------------------

    def register(self, regions: Sequence[RegionMemory]) -> bytes:
        self._check_open()
        # Device memory needs no location: the engine classifies a pointer with
        # cudaPointerGetAttributes ("cuda:<dev>"), and its TCP protocol stages it through host
        # memory itself. A context is made current here for that call.
        cuda_device.bind_thread(cuda_device.location_of(regions))
        self._local.add(regions)
        for r in regions:
            if self._engine.register_memory(r.address, r.nbytes) != 0:
                raise TransportError(
                    f"mooncake: the engine refused to register region "
                    f"{r.name!r} ({r.nbytes} bytes at {r.address:#x})"
                )
            self._registered.append(r.address)
        return encode_metadata(
            AgentMetadata(
                METADATA_VERSION,
                self.name,
                self.agent,
                self._local.addressed_infos(),
                host=self.host,
                port=self.port,
            )
        )

    def add_peer(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        meta = decode_metadata(metadata, self.name, peer)
        if not meta.host or not meta.port or any(r.address == 0 for r in meta.regions):
            raise TransportError(
                f"metadata of mooncake peer {peer!r} has no engine address "
                f"or lacks a region address"
            )
        with self._lock:
            old = self._peers.get(peer)
            if old is not None and old.meta == meta:
                return  # a repeated hello: what is in flight goes on
            if old is not None:
                old.meta = meta  # more memory registered: queued batches are still valid
                old.segment = f"{meta.host}:{meta.port}"
            else:
                self._peers[peer] = _Peer(meta, f"{meta.host}:{meta.port}")

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
            if old is not None:
                old.removed = True  # its queued batches fail when a worker takes them

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
        checked_regions(self._local, p.meta, peer, src_regions, dst_regions, runs)
        src_base = self._local.addresses(src_regions)
        dst_base = peer_addresses(p.meta, dst_regions)
        batches: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        # Spread over the workers by bytes, then cut each part to the engine's batch limit.
        for part in split(runs, self.workers, _MIN_PART_BYTES):
            laddr, raddr, nbytes = flat_descriptors(part, src_base, dst_base)
            for k in range(0, len(laddr), self.max_batch):
                cut = slice(k, k + self.max_batch)
                batches.append((laddr[cut], raddr[cut], nbytes[cut]))
        handle = XferHandle(self, peer, runs.total_bytes, len(batches))
        with self._lock:  # close() cannot slip between the check and the queueing
            self._check_open()
            for laddr, raddr, nbytes in batches:
                self._jobs.put(
                    _Batch(
                        handle,
                        p,
                        laddr.tolist(),
                        raddr.tolist(),
                        nbytes.tolist(),
                        int(nbytes.sum()),
                    )
                )
        return handle

    def poll(self, handle: XferHandle) -> XferState:
        self._own(handle)
        self._expire()
        return handle.state

    def wait(self, handle: XferHandle, timeout: float) -> XferState:
        self._own(handle)
        end = time.monotonic() + max(0.0, timeout)
        while True:
            self._expire()
            left = end - time.monotonic()
            if handle.wait_ended(min(left, _TICK)) or left <= 0:
                return handle.state

    def _spawn(self) -> None:
        t = threading.Thread(
            target=self._work,
            daemon=True,
            name=f"kvbridge-mooncake-{self.agent}-{len(self._threads)}",
        )
        self._threads.append(t)
        t.start()

    def _work(self) -> None:
        me = threading.current_thread()
        # The engine's batch call spins on its status until the batch ends; at the lowest
        # priority that spin yields the cores to the engine's own I/O threads (measured on 2
        # cores: P4 -> D1 HND at 1.3-1.4 GB/s instead of 0.7-0.9).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while me in self._threads:
            try:
                b = self._jobs.get(timeout=_IDLE)
            except queue.Empty:
                if self._closed:
                    return
                continue
            if b is None:
                return
            if self._closed:
                self._end(b, f"mooncake agent {self.agent!r} closed before the batch started")
            elif b.peer.removed:
                self._end(b, f"peer {b.handle.peer!r} was removed before the batch started")
            elif b.handle.failing:
                self._end(b, "another batch of this transfer failed")
            else:
                self._run(me, b)

    def _run(self, me: threading.Thread, b: _Batch) -> None:
        with self._lock:
            b.deadline = time.monotonic() + transfer_budget(self.io_timeout, b.nbytes)
            self._running[me] = b
        try:
            rc = self._engine.batch_transfer_sync_write(b.peer.segment, b.src, b.dst, b.lengths)
        except Exception as e:  # a binding error must fail the batch, not kill the worker
            rc, why = -1, f"{type(e).__name__}: {e}"
        else:
            why = f"returned {rc}"
        with self._lock:
            self._running.pop(me, None)
        self._end(
            b,
            None
            if rc == 0
            else f"mooncake batch of {len(b.lengths)} descriptors ({b.nbytes} bytes) to peer "
            f"{b.handle.peer!r} at {b.peer.segment} failed ({why}): the peer is gone or "
            f"refused the write, or the engine's queue is full (its log says which)",
        )

    def _expire(self) -> None:
        """Fail batches past their budget; their stuck workers are replaced."""
        now = time.monotonic()
        with self._lock:
            stuck = [(t, b) for t, b in self._running.items() if now > b.deadline]
            for t, _ in stuck:
                del self._running[t]
                self._threads.remove(t)  # it exits once the engine lets it go
                self._abandoned.append(t)
                if not self._closed:
                    self._spawn()
        for _, b in stuck:
            self._end(
                b,
                f"mooncake batch of {b.nbytes} bytes to peer {b.handle.peer!r} did "
                f"not end within {transfer_budget(self.io_timeout, b.nbytes):.1f} s "
                f"(peer stuck, or the engine hung after a failed batch)",
            )

    def _end(self, b: _Batch, error: str | None) -> None:
        with self._lock:
            if b.ended:
                return
            b.ended = True
        b.handle.part_done(error)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
            for _ in threads:
                self._jobs.put(None)
        end = time.monotonic() + self.io_timeout
        for t in threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        while True:
            try:
                b = self._jobs.get_nowait()
            except queue.Empty:
                break
            if b is not None:
                self._end(b, f"mooncake agent {self.agent!r} closed")
        self._expire()
        with self._lock:
            busy = any(t.is_alive() for t in (*threads, *self._abandoned))
            for p in self._peers.values():
                p.removed = True
            self._peers.clear()
        if busy:  # a thread is still inside the engine: freeing it would crash the process
            _ORPHANS.append(self._engine)
        else:
            for address in self._registered:
                with contextlib.suppress(Exception):
                    self._engine.unregister_memory(address)
        self._registered.clear()
        self._local.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"mooncake agent {self.agent!r} is closed")
