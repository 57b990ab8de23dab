"""What the transports share: the metadata blob, the local region table, post's checks."""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np

from kvbridge.errors import DeviceNotSupported, TransportError
from kvbridge.memory.copy import check
from kvbridge.memory.device import tensor_of
from kvbridge.memory.location import HOST, MAX_DEVICES, Location
from kvbridge.memory.pools import RegionMemory
from kvbridge.planner.runs import Runs

P = TypeVar("P")

METADATA_VERSION = 2  # 2: each region says where it lives (host, or a CUDA device)
MAX_REGION_BYTES = 1 << 56  # far past any pool; keeps every offset sum inside int64

Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_REGION_BYTES)]
Offset = Annotated[int, msgspec.Meta(ge=0, le=MAX_REGION_BYTES)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Address = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # a user-space address
Device = Annotated[int, msgspec.Meta(ge=-1, lt=MAX_DEVICES)]  # -1: host memory


class RegionInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One region as peers see it. ``segment``/``offset``: where it lies in shared memory;
    ``address``: its virtual address in the agent's process (what RDMA-style engines such as
    NIXL and Mooncake take in their descriptors); ``device``: the CUDA device it is on in
    the agent's process, -1 for host memory (:class:`~kvbridge.memory.location.Location`)."""

    name: Name
    nbytes: Size
    segment: Name | None = None
    offset: Offset = 0
    address: Address = 0
    device: Device = -1


class AgentMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An agent's metadata blob. Fields past ``regions`` are used by some transports only:
    ``host``/``port`` by tcp and mooncake, ``host_id`` by shm (peers must share the host's
    memory), ``engine`` by nixl (its agent metadata, base64)."""

    version: int
    transport: Name
    agent: Name
    regions: tuple[RegionInfo, ...]
    host: str = ""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    host_id: str = ""
    engine: str = ""


class _Versioned(msgspec.Struct):
    version: int


# Decoders built once, at import. msgspec builds a Struct type's decoding info on the type's
# first typed decode; two threads decoding a type for the first time at once can read the info
# half built and crash the process (msgspec 0.22: a segfault, seen when two prefill ranks of
# one process took their first hello together). A Decoder builds it in its constructor.
_VERSIONED = msgspec.json.Decoder(_Versioned)
_METADATA = msgspec.json.Decoder(AgentMetadata)


def encode_metadata(meta: AgentMetadata) -> bytes:
    return msgspec.json.encode(meta)


def decode_metadata(blob: bytes, transport: str, peer: str) -> AgentMetadata:
    """Validate a peer's blob: JSON, our version, our transport, the peer's own id, unique
    region names. Anything else is a TransportError saying what was wrong."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TransportError(f"metadata of peer {peer!r} must be bytes, got {type(blob).__name__}")
    try:
        version = _VERSIONED.decode(blob).version
    except msgspec.MsgspecError as e:
        raise TransportError(f"malformed metadata from peer {peer!r}: {e}") from e
    if version != METADATA_VERSION:
        raise TransportError(
            f"metadata of peer {peer!r} has version {version}; this kvbridge "
            f"speaks version {METADATA_VERSION}"
        )
    try:
        meta = _METADATA.decode(blob)
    except msgspec.MsgspecError as e:
        raise TransportError(f"malformed metadata from peer {peer!r}: {e}") from e
    if meta.transport != transport:
        raise TransportError(
            f"metadata of peer {peer!r} is for transport {meta.transport!r}, not {transport!r}"
        )
    if meta.agent != peer:
        raise TransportError(f"metadata names agent {meta.agent!r}, but was added as {peer!r}")
    names = [r.name for r in meta.regions]
    if len(set(names)) != len(names):
        raise TransportError(f"metadata of peer {peer!r} repeats region names")
    return meta


DEVICE_TRANSPORTS = (
    "nixl or mooncake (any hosts), tcp (any hosts, through pinned host memory), or cudaipc "
    "(processes of one host)"
)


def refuse_device(
    transport: str, regions: Sequence[RegionMemory], instead: str, location: Location = HOST
) -> None:
    """Refuse device memory other than ``location``'s at registration, before anything is
    registered: a transport that copies with the CPU would read a device pointer as a host
    address, and one set up for a device moves that device's memory only."""
    device = [r for r in regions if r.on_device and r.location != location]
    if not device:
        return
    r = device[0]
    if not location.is_device:
        raise DeviceNotSupported(
            f"transport {transport!r} was set up for host memory; region {r.name!r} is device "
            f"memory ({r.location}). For device memory use {instead}"
        )
    raise DeviceNotSupported(
        f"transport {transport!r} was set up for {location}; region {r.name!r} is on "
        f"{r.location}: a rank's device memory is on one device"
    )


class LocalRegions:
    """This agent's registered regions and their bytes, each taken once: a uint8 array of each
    host region (at registration), a uint8 tensor of each device region (when first asked
    for: only transports that copy device bytes themselves ask, and it needs CUDA)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, RegionMemory] = {}
        self._views: dict[str, Any] = {}

    def add(self, regions: Sequence[RegionMemory]) -> None:
        with self._lock:
            names = [r.name for r in regions]
            clash = set(names) & set(self._regions)
            if clash or len(set(names)) != len(names):
                raise TransportError(
                    f"region names already registered or repeated: {sorted(clash) or names}"
                )
            # validates owners before committing
            views = {r.name: r.view() for r in regions if not r.on_device}
            for r in regions:
                self._regions[r.name] = r
            self._views.update(views)

    def infos(self) -> tuple[RegionInfo, ...]:
        with self._lock:
            return tuple(
                RegionInfo(r.name, r.nbytes, r.segment, r.segment_offset, 0, r.location.device)
                for r in self._regions.values()
            )

    def views(self, names: Sequence[str], side: str = "source") -> list[Any]:
        with self._lock:
            for r in _registered(self._regions, names, side):
                if r.name not in self._views:
                    self._views[r.name] = tensor_of(r)
            return [self._views[n] for n in names]

    def addressed_infos(self) -> tuple[RegionInfo, ...]:
        """:meth:`infos` with each region's address (for engines that write by address)."""
        with self._lock:
            return tuple(
                RegionInfo(
                    r.name, r.nbytes, r.segment, r.segment_offset, r.address, r.location.device
                )
                for r in self._regions.values()
            )

    def addresses(self, names: Sequence[str]) -> np.ndarray:
        """The base addresses of registered regions ``names`` (int64, in that order)."""
        with self._lock:
            return np.array([self._regions[n].address for n in names], dtype=np.int64)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {n: r.nbytes for n, r in self._regions.items()}

    def regions(self, names: Sequence[str], side: str = "source") -> list[RegionMemory]:
        """The registered regions ``names``, in that order (device ones included)."""
        with self._lock:
            return _registered(self._regions, names, side)

    def clear(self) -> None:
        with self._lock:
            self._regions.clear()
            self._views.clear()


def peer_sizes(meta: AgentMetadata, peer: str, names: Sequence[str]) -> list[int]:
    sizes = {r.name: r.nbytes for r in meta.regions}
    try:
        return [sizes[n] for n in names]
    except KeyError as e:
        raise TransportError(
            f"peer {peer!r} registered no region {e.args[0]!r}; it has {sorted(sizes)[:16]}"
        ) from None


def check_post(
    runs: Runs,
    src_names: Sequence[str],
    src_sizes: Sequence[int],
    dst_names: Sequence[str],
    dst_sizes: Sequence[int],
) -> None:
    """post()'s check: every run inside the local sources and the peer's destinations."""
    check(runs, src_sizes, dst_sizes, src_names=src_names, dst_names=dst_names)


def known_peer(peers: Mapping[str, P], lock: threading.Lock, peer: str) -> P:
    """The state a transport keeps for ``peer``; an unknown peer is the caller's error."""
    with lock:
        p = peers.get(peer)
    if p is None:
        raise TransportError(f"unknown peer {peer!r}; add_peer it first")
    return p


def checked_sources(
    local: LocalRegions,
    meta: AgentMetadata,
    peer: str,
    src_names: Sequence[str],
    dst_names: Sequence[str],
    runs: Runs,
) -> list[Any]:
    """Every host-copying transport's post() preamble: the local source views, once every run
    is known to lie inside them and inside the sizes the peer registered (nothing has moved
    yet)."""
    checked_regions(local, meta, peer, src_names, dst_names, runs)
    return local.views(src_names)


def checked_regions(
    local: LocalRegions,
    meta: AgentMetadata,
    peer: str,
    src_names: Sequence[str],
    dst_names: Sequence[str],
    runs: Runs,
) -> list[RegionMemory]:
    """:func:`checked_sources` for transports that write by address (device memory too): the
    local source regions, once every run is known to lie inside them and the peer's."""
    src = local.regions(src_names)
    check_post(
        runs, src_names, [r.nbytes for r in src], dst_names, peer_sizes(meta, peer, dst_names)
    )
    return src


def fail_queued(jobs: queue.Queue[Any], why: str) -> None:
    """A closing agent's queued jobs, failed with ``why`` (a job is anything with a
    ``handle``; None is the worker's stop mark)."""
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return
        if job is not None:
            job.handle.part_done(why)


_T = TypeVar("_T")


def _registered(by_name: Mapping[str, _T], names: Sequence[str], side: str) -> list[_T]:
    try:
        return [by_name[n] for n in names]
    except KeyError as e:
        raise TransportError(
            f"{side} region {e.args[0]!r} is not registered on this agent; registered: "
            f"{sorted(by_name)[:16]}"
        ) from None


def peer_devices(meta: AgentMetadata, names: Sequence[str]) -> np.ndarray:
    """The device index (-1: host) of each of the peer's regions ``names``."""
    by_name = {r.name: r.device for r in meta.regions}
    return np.array([by_name[n] for n in names], dtype=np.int64)


def peer_addresses(meta: AgentMetadata, names: Sequence[str]) -> np.ndarray:
    """The base addresses the peer registered for regions ``names`` (validated before)."""
    by_name = {r.name: r.address for r in meta.regions}
    return np.array([by_name[n] for n in names], dtype=np.int64)


def flat_descriptors(
    runs: Runs, src_base: np.ndarray, dst_base: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs as flat (local address, remote address, length) arrays, strided runs expanded:
    what engines that take one descriptor per contiguous block are given. Vectorised: no
    Python loop over runs."""
    f = runs.flat()
    return (src_base[f.src_region] + f.src_offset, dst_base[f.dst_region] + f.dst_offset, f.nbytes)


def transfer_budget(io_timeout: float, nbytes: int, min_rate: float = 100e6) -> float:
    """Seconds a posted batch may take before it is declared stuck: ``io_timeout`` plus its
    bytes at ``min_rate`` bytes/s (so a large batch is not failed for being large)."""
    return io_timeout + nbytes / min_rate
