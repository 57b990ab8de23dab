"""cudaipc transport: CUDA device memory between processes of one host (the GPU's ``shm``).

``register`` exports a CUDA IPC handle for each region's allocation (:mod:`._ipc_handles`)
and publishes them, with the process id and the host's boot id, beside kvbridge's region
table. ``add_peer`` opens a peer's handles once (in the same process it uses the addresses
themselves: a handle cannot be opened where it was exported). ``post`` queues the runs; one
copy thread per agent enqueues them as device-to-device copies on kvbridge's own CUDA stream,
records an event after them and reports DONE only once that event has completed: the bytes
are in the peer's memory before its ``ChunkDone`` can be sent.

Writes are one-sided (``Fencing.NONE``), as with shm. Refused at start-up: a process without
CUDA (the transport is unavailable), host memory (use shm), torch's expandable segments (no
legacy IPC handle). Peers must number their visible devices the same way.

A job's runs are copied by :func:`kvbridge.memory.gather.copy_runs`: a few runs one ``copy_``
each; many runs between two regions as rows of their common divisor, in one gather and one scatter
kernel, so that a fragmented plan is not one launch from Python (~10 us) per descriptor.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from kvbridge.errors import TransportError, TransportUnavailable
from kvbridge.memory import device as cuda_device
from kvbridge.memory.gather import copy_runs
from kvbridge.memory.location import HOST, Location
from kvbridge.memory.pools import RegionMemory
from kvbridge.planner.runs import Runs
from kvbridge.staging.cost import CostModel
from kvbridge.transports import _ipc_handles as ipc
from kvbridge.transports._common import (
    METADATA_VERSION,
    AgentMetadata,
    LocalRegions,
    checked_regions,
    decode_metadata,
    encode_metadata,
    fail_queued,
    known_peer,
    transfer_budget,
)
from kvbridge.transports.base import FenceKey, Transport, TransportOptions, XferHandle
from kvbridge.transports.shm import host_id


def load_api() -> Any:
    """torch, where CUDA is usable; else TransportUnavailable saying why."""
    why = cuda_device.cuda_unavailable()
    if why is not None:
        raise TransportUnavailable(f"transport 'cudaipc' needs CUDA, but {why}")
    return cuda_device.require_cuda()


class _IpcRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    handle: str  # base64 of the 64-byte handle of the region's allocation
    offset: int  # the region's offset in that allocation


class _IpcInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pid: int
    regions: tuple[_IpcRegion, ...]


# Built once at import: a first typed decode of a Struct in two threads at once can crash
# (kvbridge.transports._common says why).
_INFO = msgspec.json.Decoder(_IpcInfo)


@dataclass(eq=False)
class _Peer:
    meta: AgentMetadata
    tensors: dict[str, Any]  # region name -> uint8 tensor over the mapped bytes
    opened: list[int] = field(default_factory=list)  # bases to close once nothing copies
    removed: bool = False


@dataclass(eq=False)
class _Job:
    handle: XferHandle
    peer: _Peer
    src: list[Any]  # uint8 tensors of the local source regions
    dst: list[Any]
    runs: Runs


class CudaIpcTransport(Transport):
    """Options: ``io_timeout`` (a copy still running after it, plus its bytes at 100 MB/s, is
    reported FAILED once it ended); ``device``, the rank's CUDA device."""

    name: ClassVar[str] = "cudaipc"
    # One copy launch per contiguous run; device memory bandwidth once runs are large. An
    # estimate until measured on a GPU (docs/gpu.md).
    # A descriptor is a few rows of index built by numpy (not a launch).
    cost: ClassVar[CostModel] = CostModel(per_descriptor=0.1e-6, bandwidth=500e9, strided=False)

    @classmethod
    def options(cls, given: TransportOptions) -> dict[str, Any]:
        return {"io_timeout": given.io_timeout, "device": given.device}

    def __init__(self, agent: str, *, io_timeout: float = 30.0, device: Location = HOST) -> None:
        super().__init__(agent)
        if io_timeout <= 0:
            raise TransportError(f"cudaipc: io_timeout must be > 0, got {io_timeout}")
        self._torch = load_api()
        cuda_device.refuse_expandable_segments(self.name)
        self.io_timeout = io_timeout
        self._device = device if device.is_device else Location.from_index(0)
        cuda_device.require_cuda(self._device)
        self._host = host_id()
        self._local = LocalRegions()
        self._exported: list[_IpcRegion] = []
        self._peers: dict[str, _Peer] = {}
        self._retired: list[_Peer] = []
        self._lock = threading.Lock()
        self._closed = False
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._stream: Any = None  # made in the copy thread, on the rank's device
        self._thread = threading.Thread(
            target=self._copy_loop, daemon=True, name=f"kvbridge-cudaipc-{agent}"
        )
        self._thread.start()

    # ---- memory and peers -----------------------------------------------------------------

    def register(self, regions: Sequence[RegionMemory]) -> bytes:
        self._check_open()
        host = [r.name for r in regions if not r.on_device]
        if host:
            raise TransportError(
                f"cudaipc moves CUDA device memory only; regions {host[:8]} are host memory: "
                f"use shm for host memory"
            )
        where = cuda_device.location_of(regions)
        if regions and where != self._device:
            raise TransportError(f"cudaipc agent {self.agent!r} is on {self._device}, not {where}")
        cuda_device.bind_thread(self._device)
        exported = []
        for r in regions:
            handle, offset = ipc.export(r.address)
            exported.append(_IpcRegion(r.name, base64.b64encode(handle).decode(), offset))
        self._local.add(regions)
        self._exported.extend(exported)
        info = msgspec.json.encode(_IpcInfo(os.getpid(), tuple(self._exported)))
        return encode_metadata(
            AgentMetadata(
                METADATA_VERSION,
                self.name,
                self.agent,
                self._local.addressed_infos(),
                host_id=self._host,
                engine=base64.b64encode(info).decode(),
            )
        )

    def add_peer(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        meta = decode_metadata(metadata, self.name, peer)
        if meta.host_id != self._host:
            raise TransportError(
                f"cudaipc peer {peer!r} is on another host (boot id {meta.host_id!r}, ours "
                f"{self._host!r}); use nixl or mooncake"
            )
        with self._lock:
            old = self._peers.get(peer)
            if old is not None and old.meta == meta:
                return  # a repeated hello
        try:
            info = _INFO.decode(base64.b64decode(meta.engine, validate=True))
        except (binascii.Error, ValueError, msgspec.MsgspecError) as e:
            raise TransportError(f"cudaipc metadata of peer {peer!r} is malformed: {e}") from None
        cuda_device.bind_thread(self._device)
        fresh = self._open(peer, meta, info)
        with self._lock:
            old = self._peers.get(peer)
            self._peers[peer] = fresh
            if old is not None:  # it restarted or re-registered: its queued copies fail
                old.removed = True
                self._retired.append(old)

    def _open(self, peer: str, meta: AgentMetadata, info: _IpcInfo) -> _Peer:
        regions = {r.name: r for r in meta.regions}
        handles = {r.name: r for r in info.regions}
        if set(handles) != set(regions):
            raise TransportError(f"cudaipc metadata of peer {peer!r}: handles and regions differ")
        same = info.pid == os.getpid()
        p = _Peer(meta, {})
        bases: dict[bytes, int] = {}
        try:
            for name, r in regions.items():
                if r.device < 0 or r.address == 0:
                    raise TransportError(f"cudaipc peer {peer!r}: region {name!r} is not device")
                where = Location.from_index(r.device)
                if same:  # our own address space: the handle cannot be opened here
                    address = r.address
                else:
                    raw = base64.b64decode(handles[name].handle, validate=True)
                    if raw not in bases:
                        bases[raw] = ipc.open_handle(raw)
                        p.opened.append(bases[raw])
                    address = bases[raw] + handles[name].offset
                p.tensors[name] = cuda_device.tensor_at(address, r.nbytes, where)
        except (binascii.Error, ValueError) as e:
            self._close_peer(p)
            raise TransportError(f"cudaipc metadata of peer {peer!r}: bad handle: {e}") from None
        except BaseException:
            self._close_peer(p)
            raise
        return p

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
            if old is not None:
                old.removed = True
                self._retired.append(old)  # closed once the copy thread is idle

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
        src = checked_regions(self._local, p.meta, peer, src_regions, dst_regions, runs)
        handle = XferHandle(self, peer, runs.total_bytes, 1 if len(runs) else 0)
        if not len(runs):
            return handle
        job = _Job(
            handle,
            p,
            [cuda_device.tensor_of(r) for r in src],
            [p.tensors[n] for n in dst_regions],
            runs,
        )
        with self._lock:
            self._check_open()
            self._jobs.put(job)
        return handle

    def _copy_loop(self) -> None:
        torch = self._torch
        cuda_device.bind_thread(self._device)
        self._stream = torch.cuda.Stream(device=str(self._device))
        while True:
            try:
                job = self._jobs.get(timeout=0.5)
            except queue.Empty:
                self._close_retired()
                continue
            if job is None:
                return
            job.handle.part_done(self._copy(job))

    def _copy(self, job: _Job) -> str | None:
        """Enqueue the job's copies on kvbridge's stream and wait for them; the error, if any."""
        if self._closed or job.peer.removed:
            return f"peer {job.handle.peer!r} was removed or the agent closed before the copy"
        torch = self._torch
        try:
            with torch.cuda.stream(self._stream):
                copy_runs(torch, job.dst, job.src, job.runs)
                done = torch.cuda.Event()
                done.record(self._stream)
        except Exception as e:  # a CUDA error while enqueueing: nothing more is queued
            with contextlib.suppress(Exception):  # a sticky error fails this too
                self._stream.synchronize()
            return f"cudaipc copy to peer {job.handle.peer!r} failed: {e}"
        budget = transfer_budget(self.io_timeout, job.handle.nbytes)
        if cuda_device.wait_event(done, time.monotonic() + budget):
            return None
        # A copy cannot be cancelled: FAILED is reported only once it ended (the contract).
        done.synchronize()
        return f"cudaipc copy of {job.handle.nbytes} bytes took more than {budget:.1f} s"

    def _close_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        for p in retired:
            self._close_peer(p)

    def _close_peer(self, p: _Peer) -> None:
        p.tensors.clear()
        for base in p.opened:
            # On failure the peer's memory stays mapped until this process exits.
            with contextlib.suppress(TransportError):
                ipc.close_handle(base)
        p.opened.clear()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        self._thread.join(timeout=self.io_timeout)
        fail_queued(self._jobs, f"cudaipc agent {self.agent!r} closed")
        if self._thread.is_alive():
            return  # a copy is still running: its mappings must stay open
        with self._lock:
            self._retired.extend(self._peers.values())
            self._peers.clear()
        cuda_device.bind_thread(self._device)  # closing a mapping needs a context here too
        self._close_retired()
        self._local.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"cudaipc agent {self.agent!r} is closed")
