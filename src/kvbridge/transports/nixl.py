"""NIXL transport: the contract over a NIXL agent (UCX backend, host or CUDA device memory).

A thin adapter. ``register`` registers regions with the agent (host memory as ``DRAM``, CUDA
device memory as ``VRAM`` with its device index) and publishes the agent's own metadata
(base64) beside kvbridge's region table, which says each region's device; ``add_peer`` loads a
peer's NIXL metadata; ``post`` turns runs into NIXL WRITEs (flat descriptors, built with numpy,
no notification: completion is kvbridge's own protocol), one per pair of memory types (a NIXL
descriptor list has one), and returns at once.

Device memory (``device`` option, the rank's :class:`~kvbridge.memory.location.Location`):

* A CUDA context must be current in every thread that creates the agent, registers, loads a
  peer or posts (UCX disables CUDA IPC where it finds none): the device is made current in
  the constructor's thread, in ``register``'s and ``add_peer``'s, and in the driver thread.
* ``UCX_TLS`` defaults to ``cuda_ipc,cuda_copy,tcp,cma``: ``cuda_ipc`` writes one GPU's memory
  from another process of the node, ``cuda_copy`` stages host<->device. kvbridge writes
  (UCX PUT); it never reads, whose CUDA-IPC lane UCX disables without NVLink.
* Torch's expandable segments are refused: their memory has no legacy IPC handle and UCX
  (as bundled with nixl-cu13 1.5.1) silently falls back to TCP.

One driver thread per agent makes every data-path call. It posts queued transfers, polls the
active ones (NIXL's ``DONE``/``PROC``/``ERR`` become DONE/PENDING/FAILED here), releases each
NIXL request as soon as it ends, and fails one still ``PROC`` past its budget (``io_timeout``
plus its bytes at 100 MB/s) after asking NIXL to cancel it.

Configuration, and why:

* NIXL's progress thread is off: it spins a core even when idle (~70% measured), which on a
  small host halves throughput. The driver thread makes progress instead: while transfers are
  active it polls them; while idle it still calls into the agent every ``idle_progress``
  seconds, because a peer's connection setup needs this (target) side to progress: without
  it the peer's first write stays ``PROC`` forever.
* ``UCX_TLS`` (read by UCX when the agent is created, so set before) defaults to
  ``tcp,cma``: ``cma`` writes host memory between processes of one host in one copy, ``tcp``
  carries UCX's active messages (connection setup; shared-memory-only sets have none and
  fail) and the writes between hosts. A ``UCX_TLS`` already set is kept if it has ``tcp``.
* ``UCX_MODULES`` defaults to ``^ib,rdmacm`` when ``UCX_TLS`` names no RDMA transport
  (:func:`configure_ucx`), and ``UCX_MEM_MMAP_HOOK_MODE`` to ``none`` for a host agent over
  tcp, cma or posix shared memory only: the hooks keep UCX's registration cache current, which
  those do not use, and installing them (patching ``mmap``'s code) cost a process 0.43 s of CPU
  (0.03 s without them). The first agent decides for its process.
* ``NIXL_LOG_LEVEL`` defaults to WARN (its INFO lines go to stdout).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import importlib
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
from kvbridge.memory.location import HOST, Location
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
    fail_queued,
    flat_descriptors,
    known_peer,
    peer_addresses,
    peer_devices,
    transfer_budget,
)
from kvbridge.transports.base import FenceKey, Transport, TransportOptions, XferHandle

# The NIXL wheels name their module after the CUDA variant; the ``nixl`` meta package picks
# one at import and fails on a host without a GPU driver, so the variants come first.
API_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")
DEFAULT_UCX_TLS = "tcp,cma"
DEFAULT_DEVICE_UCX_TLS = "cuda_ipc,cuda_copy,tcp,cma"
# Transports that register no memory with UCX (knem and xpmem, in the sm/shm groups, do), and
# those that need no RDMA NIC (UCX's InfiniBand modules are then not loaded).
_UNCACHED_TLS = {"tcp", "cma", "posix", "sysv", "self"}
_HOST_TLS = _UNCACHED_TLS | {"sm", "shm", "knem", "xpmem", "cuda_ipc", "cuda_copy", "cuda"}
_SPIN_POLLS = 64  # polls of an active transfer before the driver starts to sleep between them
_MAX_NAP = 0.0005  # longest sleep between polls of an active transfer


def load_api() -> Any:
    """The NIXL Python API module, or TransportUnavailable naming the extra."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    errors = []
    for name in API_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:  # a missing module, or a wheel whose libraries cannot load
            errors.append(f"{name}: {e}")
    raise TransportUnavailable(
        "transport 'nixl' needs the NIXL Python API: pip install 'kvbridge[nixl]' (or "
        "pip install --no-deps nixl-cu12 numpy, which skips its torch requirement); could not "
        "import " + "; ".join(errors)
    )


_SET_HERE: set[str] = set()  # our defaults: never a later (device) agent's choice


def configure_ucx(ucx_tls: str | None, device: bool = False) -> None:
    """Set ``UCX_TLS`` (and where it allows ``UCX_MODULES``, ``UCX_MEM_MMAP_HOOK_MODE``) for this
    process's next agents (the module doc); ``device``: the agent moves CUDA device memory."""
    default = DEFAULT_DEVICE_UCX_TLS if device else DEFAULT_UCX_TLS
    given = None if os.environ.get("UCX_TLS") in _SET_HERE else os.environ.get("UCX_TLS")
    tls = ucx_tls or given or default
    names = [t.strip() for t in tls.split(",")]
    listed = not tls.startswith("^")  # (not "all but these")
    if listed and "all" not in names and "tcp" not in names:
        raise TransportError(
            f"nixl: UCX_TLS={tls!r} has no 'tcp': UCX then has no transport for its active "
            f"messages and connections fail; add tcp (e.g. {default!r})"
        )
    os.environ["UCX_TLS"] = tls
    if not ucx_tls and not given:
        _SET_HERE.add(tls)
    if listed and set(names) <= _HOST_TLS:
        # No RDMA: no InfiniBand modules. They load the system's libibverbs providers (where
        # Mooncake needs libibverbs1) beside the NIXL wheel's copy, and the two libnl-route
        # copies crash the process at exit.
        os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")
    if listed and not device and set(names) <= _UNCACHED_TLS:
        # No registration cache to keep current: no memory hooks (see the module doc).
        os.environ.setdefault("UCX_MEM_MMAP_HOOK_MODE", "none")


_MEM = ("DRAM", "VRAM")  # NIXL's memory type, by whether the memory is a device's


def _dev(devices: np.ndarray) -> np.ndarray:
    """Descriptors' device ids as NIXL takes them: the CUDA device, 0 for host memory."""
    out: np.ndarray = np.maximum(devices, 0).astype(np.uint64)
    return out


@dataclass(eq=False)
class _Peer:
    meta: AgentMetadata
    removed: bool = False


@dataclass(eq=False)
class _Xfer:
    handle: XferHandle
    peer: _Peer
    local: np.ndarray  # (n, 3) uint64: address, length, device id
    remote: np.ndarray
    local_mem: str = "DRAM"  # NIXL's memory type of each list: DRAM or VRAM
    remote_mem: str = "DRAM"
    req: Any = None  # the NIXL request, once posted
    deadline: float = 0.0


class NixlTransport(Transport):
    """Options: ``io_timeout`` (a transfer still in progress after it, plus its bytes at
    100 MB/s, fails); ``ucx_tls`` (default ``$UCX_TLS``, else ``tcp,cma``, or
    ``cuda_ipc,cuda_copy,tcp,cma`` for device memory); ``idle_progress``, how often (s) an idle
    agent lets peers progress their connections to it; ``device``, where the rank's memory is."""

    name: ClassVar[str] = "nixl"
    # One descriptor per contiguous block (measured here: ~1.3 us each through UCX's cma
    # transport, whose single copy thread moves ~7 GB/s).
    cost: ClassVar[CostModel] = CostModel(per_descriptor=1.3e-6, bandwidth=7e9, strided=False)

    @classmethod
    def options(cls, given: TransportOptions) -> dict[str, Any]:
        return {"io_timeout": given.io_timeout, "device": given.device}

    def __init__(
        self,
        agent: str,
        *,
        io_timeout: float = 30.0,
        ucx_tls: str | None = None,
        idle_progress: float = 0.01,
        device: Location = HOST,
    ) -> None:
        super().__init__(agent)
        if io_timeout <= 0 or idle_progress <= 0:
            raise TransportError(
                f"nixl: io_timeout and idle_progress must be > 0, got "
                f"{io_timeout} and {idle_progress}"
            )
        self.io_timeout, self._idle = io_timeout, idle_progress
        api = load_api()
        self._device = device
        if device.is_device:
            cuda_device.refuse_expandable_segments(self.name)
            cuda_device.bind_thread(device)  # the agent is created with a context current
        configure_ucx(ucx_tls, device.is_device)
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            # register/add_peer come from callers' threads, the data path from the driver.
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self._agent = api.nixl_agent(agent, config)
        except Exception as e:
            raise TransportError(f"nixl: cannot create agent {agent!r}: {e}") from e
        if "UCX" not in self._agent.backends:
            raise TransportError(
                f"nixl: agent {agent!r} has no UCX backend (plugins found: "
                f"{self._agent.get_plugin_list()})"
            )
        self._local = LocalRegions()
        self._reg: list[Any] = []  # NIXL registration lists, deregistered at close
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._jobs: queue.Queue[_Xfer | None] = queue.Queue()
        self._leaked: list[Any] = []  # requests NIXL would not cancel; retried at close
        self._driver = threading.Thread(
            target=self._drive, daemon=True, name=f"kvbridge-nixl-{agent}"
        )
        self._driver.start()

    # ---- memory and peers -----------------------------------------------------------------

    def register(self, regions: Sequence[RegionMemory]) -> bytes:
        self._check_open()
        where = cuda_device.location_of(regions)
        if where.is_device:
            if self._device.is_device and where != self._device:
                raise TransportError(
                    f"nixl agent {self.agent!r} serves {self._device}; got regions on {where}"
                )
            cuda_device.refuse_expandable_segments(self.name)
            self._device = where
            cuda_device.bind_thread(where)
        self._local.add(regions)
        # One registration per memory type: a NIXL list holds one.
        for mem, group in (
            ("DRAM", [r for r in regions if not r.on_device]),
            ("VRAM", [r for r in regions if r.on_device]),
        ):
            if not group:
                continue
            descs = np.array(
                [[r.address, r.nbytes, max(0, r.location.device)] for r in group],
                dtype=np.uint64,
            )
            try:
                self._reg.append(self._agent.register_memory(descs, mem))
            except Exception as e:
                raise TransportError(
                    f"nixl: registering {[r.name for r in group][:8]} as {mem} "
                    f"failed: {type(e).__name__}: {e}"
                ) from e
        blob = base64.b64encode(self._agent.get_agent_metadata()).decode()
        return encode_metadata(
            AgentMetadata(
                METADATA_VERSION, self.name, self.agent, self._local.addressed_infos(), engine=blob
            )
        )

    def add_peer(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        meta = decode_metadata(metadata, self.name, peer)
        cuda_device.bind_thread(self._device)  # UCX's wire-up may touch CUDA here
        try:
            engine = base64.b64decode(meta.engine, validate=True)
        except (binascii.Error, ValueError) as e:
            raise TransportError(
                f"nixl metadata of peer {peer!r} has no valid agent metadata: {e}"
            ) from None
        if not engine or any(r.address == 0 for r in meta.regions):
            raise TransportError(
                f"nixl metadata of peer {peer!r} lacks its agent metadata or a region address"
            )
        with self._lock:
            old = self._peers.get(peer)
            if old is not None and old.meta == meta:
                return  # a repeated hello: what is in flight goes on
            try:
                # NIXL updates a known agent in place (it registered more memory), so writes
                # in flight to it go on; a peer that restarted under the same name is loaded
                # afresh once the old connection is dropped.
                try:
                    loaded = self._agent.add_remote_agent(engine)
                except Exception:
                    if old is None:
                        raise
                    old.removed = True
                    self._peers.pop(peer, None)
                    self._agent.remove_remote_agent(peer)
                    loaded = self._agent.add_remote_agent(engine)
            except Exception as e:
                raise TransportError(
                    f"nixl: cannot load the agent metadata of peer {peer!r}: "
                    f"{type(e).__name__}: {e}"
                ) from e
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != peer:
                if name not in self._peers:  # never drop a known peer for another's blob
                    with contextlib.suppress(Exception):
                        self._agent.remove_remote_agent(name)
                raise TransportError(f"nixl metadata of peer {peer!r} is agent {name!r}'s")
            if old is not None and not old.removed:
                old.meta = meta  # the same peer, more memory: its transfers keep their entry
            else:
                self._peers[peer] = _Peer(meta)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
            if old is None:
                return
            old.removed = True  # the driver fails its transfers
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer)

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
        laddr, raddr, nbytes = flat_descriptors(
            runs, self._local.addresses(src_regions), peer_addresses(p.meta, dst_regions)
        )
        # Each descriptor's device on either side (-1: host), from its region's.
        f = runs.flat()
        ldev = np.array([r.location.device for r in src], dtype=np.int64)[f.src_region]
        rdev = peer_devices(p.meta, dst_regions)[f.dst_region]
        code = 2 * (ldev >= 0) + (rdev >= 0)  # which (local, remote) memory types
        kinds = [(int(c) // 2, int(c) % 2) for c in np.unique(code)]
        handle = XferHandle(self, peer, runs.total_bytes, len(kinds) if len(laddr) else 0)
        if not len(laddr):
            return handle
        jobs = []
        for lvram, rvram in kinds:  # one WRITE per (local, remote) memory type
            pick = code == 2 * lvram + rvram
            n = nbytes[pick].astype(np.uint64)
            local = np.stack([laddr[pick].astype(np.uint64), n, _dev(ldev[pick])], axis=1)
            remote = np.stack([raddr[pick].astype(np.uint64), n, _dev(rdev[pick])], axis=1)
            jobs.append(_Xfer(handle, p, local, remote, _MEM[lvram], _MEM[rvram]))
        with self._lock:  # close() cannot slip between the check and the queueing
            self._check_open()
            for job in jobs:
                self._jobs.put(job)
        return handle

    def _drive(self) -> None:
        active: list[_Xfer] = []
        polls = 0
        bound = HOST
        while True:
            if self._device != bound:  # device memory registered: this thread needs a context
                bound = self._device
                cuda_device.bind_thread(bound)
            try:
                job = self._jobs.get(timeout=self._idle) if not active else self._jobs.get_nowait()
            except queue.Empty:
                job = None
                if not active:
                    if self._closed:
                        return
                    self._serve_peers()
                    continue
            if job is None and not active and self._closed:
                return
            if job is not None:
                self._start(job, active)
                polls = 0
            for x in list(active):
                if self._poll(x):
                    active.remove(x)
            polls += 1
            if active and polls > _SPIN_POLLS:
                time.sleep(min(_MAX_NAP, 1e-5 * (polls - _SPIN_POLLS)))

    def _serve_peers(self) -> None:
        # Progresses the UCX worker (no notifications are used); a failure is retried next tick.
        with contextlib.suppress(Exception):
            self._agent.get_new_notifs()

    def _start(self, x: _Xfer, active: list[_Xfer]) -> None:
        if self._closed:
            x.handle.part_done(f"nixl agent {self.agent!r} closed before the write started")
            return
        if x.peer.removed:
            x.handle.part_done(f"peer {x.handle.peer!r} was removed before the write started")
            return
        a = self._agent
        try:
            x.req = a.initialize_xfer(
                "WRITE",
                a.get_xfer_descs(x.local, x.local_mem),
                a.get_xfer_descs(x.remote, x.remote_mem),
                x.handle.peer,
            )
            state = a.transfer(x.req)
        except Exception as e:
            self._end(
                x,
                f"nixl could not post the write to peer {x.handle.peer!r}: {type(e).__name__}: {e}",
            )
            return
        x.deadline = time.monotonic() + transfer_budget(self.io_timeout, x.handle.nbytes)
        if not self._settle(x, state):
            active.append(x)

    def _poll(self, x: _Xfer) -> bool:
        """Advance one active transfer; True once it has ended."""
        if x.peer.removed or self._closed:
            why = "was removed" if x.peer.removed else "lost its agent (closed)"
            self._end(x, f"peer {x.handle.peer!r} {why} while the write was in progress")
            return True
        try:
            state = self._agent.check_xfer_state(x.req)
        except Exception as e:
            state = f"ERR ({type(e).__name__}: {e})"
        if self._settle(x, state):
            return True
        if time.monotonic() > x.deadline:
            self._end(
                x,
                f"nixl write of {x.handle.nbytes} bytes to peer {x.handle.peer!r} "
                f"still in progress after "
                f"{transfer_budget(self.io_timeout, x.handle.nbytes):.1f} s",
            )
            return True
        return False

    def _settle(self, x: _Xfer, state: str) -> bool:
        """Map NIXL's state at the boundary: DONE and ERR end the transfer, PROC does not."""
        if state == "DONE":
            self._end(x, None)
            return True
        if state == "PROC":
            return False
        self._end(
            x,
            f"nixl reported {state} for the write to peer {x.handle.peer!r} (a dead "
            f"peer, or memory it no longer has registered)",
        )
        return True

    def _end(self, x: _Xfer, error: str | None) -> None:
        if x.req is not None:
            try:
                x.req.release()  # cancels a request still in progress, where UCX can
            except Exception as e:
                self._leaked.append(x.req)
                if error is not None:
                    error += f"; nixl could not cancel it ({e}): its source must stay intact"
            x.req = None
        x.handle.part_done(error)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        # A write inside NIXL's post is a bounded copy; everything else fails at its next poll.
        self._driver.join(timeout=self.io_timeout)
        fail_queued(self._jobs, f"nixl agent {self.agent!r} closed")
        for req in self._leaked:
            with contextlib.suppress(Exception):
                req.release()
        self._leaked.clear()
        with self._lock:
            for name, p in self._peers.items():
                p.removed = True
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
            self._peers.clear()
        for reg in self._reg:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(reg)
        self._reg.clear()
        self._local.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"nixl agent {self.agent!r} is closed")
