"""CUDA device memory: pools kvbridge allocates, engine tensors wrapped in place, ordering.

torch is imported only when a function here is called (the package imports without it).

* :func:`cuda_unavailable` says why CUDA cannot be used in this process (None when it can);
  :func:`require_cuda` raises :class:`~kvbridge.errors.DeviceError` with that reason.
* :class:`DevicePool` allocates a rank's regions on one device, in one allocation (one IPC
  handle and one registration per pool, however many layers): the device twin of
  :class:`~kvbridge.memory.pools.HostPool`.
* :func:`wrap_tensor` describes an engine's tensor (CUDA or CPU) in place, by address, size
  and device; the tensor is kept alive by the region.
* :func:`tensors_location` says where an engine's KV tensors are (one device, or the host).
* :func:`tensor_of` gives a uint8 tensor over a device region's bytes, whoever allocated them
  (through ``__cuda_array_interface__``, which torch documents for ``torch.as_tensor``).
* :func:`bind_thread` makes a device current in the calling thread: UCX and the CUDA driver
  calls need a context in every thread that registers, hands shakes or posts.
* :func:`wait_event` waits for a CUDA event an engine recorded (its forward's writes), with a
  deadline, before a sender reads what the forward wrote.
* :func:`expandable_segments` tells whether torch's allocator hands out VMM memory, whose legacy
  IPC handles do not work (see the transports that refuse it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvbridge.errors import DeviceError, LayoutError
from kvbridge.memory.location import HOST, Location, MemoryKind, cuda
from kvbridge.memory.pools import Pool, RegionMemory, pool_view
from kvbridge.planner.layout import Region

_ALIGN = 4096  # regions at page-aligned offsets, as in HostPool: descriptors stay aligned
_POLL = 50e-6  # first sleep between polls of an event; doubles up to _MAX_POLL
_MAX_POLL = 2e-3
_ALLOC_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise DeviceError(f"CUDA device memory needs torch: {e}") from e
    return torch


def cuda_unavailable() -> str | None:
    """Why CUDA device memory cannot be used in this process, or None if it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    try:
        count = torch.cuda.device_count()
    except Exception as e:  # a driver that fails to load
        return f"CUDA is not usable: {type(e).__name__}: {e}"
    if count < 1 or not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return None


def require_cuda(location: Location | None = None) -> Any:
    """torch, once CUDA (and device ``location``, if given) is usable here; else DeviceError."""
    why = cuda_unavailable()
    if why is not None:
        raise DeviceError(f"CUDA device memory asked for, but {why}")
    torch = _torch()
    if location is not None and location.is_device:
        count = torch.cuda.device_count()
        if location.device >= count:
            raise DeviceError(f"no CUDA device {location.device}: this process sees {count}")
    return torch


def bind_thread(location: Location) -> None:
    """Make ``location``'s device current in this thread (a no-op for host memory)."""
    if location.is_device:
        torch = require_cuda(location)
        torch.cuda.set_device(location.device)
        # set_device returns early when the device is already the thread's (device 0 in a new
        # thread), leaving no context current for the driver API (CUDA IPC, UCX); a runtime
        # call on the device makes its primary context current here.
        torch.cuda.synchronize(location.device)


def expandable_segments() -> bool:
    """Whether torch's caching allocator is set to hand out expandable (VMM) segments."""
    for env in _ALLOC_ENVS:
        for item in os.environ.get(env, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


def refuse_expandable_segments(transport: str) -> None:
    """DeviceError where the allocator's expandable segments would break ``transport``'s IPC
    (legacy CUDA IPC handles do not cover VMM memory; NIXL's bundled UCX then silently falls
    back to TCP loopback at well under 1 GB/s)."""
    if expandable_segments():
        raise DeviceError(
            f"transport {transport!r} shares device memory through CUDA IPC handles, which do "
            f"not work on expandable (VMM) segments: unset expandable_segments in "
            f"PYTORCH_CUDA_ALLOC_CONF for the processes whose KV it moves"
        )


def wrap_tensor(name: str, tensor: Any) -> RegionMemory:
    """Describe a contiguous torch tensor (CUDA or CPU) as a region, in place: its address,
    its size in bytes and its device. The region keeps the tensor alive."""
    if not tensor.is_contiguous():
        raise LayoutError(f"region {name!r}: the tensor must be contiguous")
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    if tensor.is_cuda:
        return RegionMemory(
            name, int(tensor.data_ptr()), nbytes, owner=tensor, location=cuda(tensor.get_device())
        )
    flat = tensor.reshape(-1).view(_torch().uint8).numpy()  # shares the tensor's memory
    return RegionMemory(name, int(tensor.data_ptr()), nbytes, owner=flat, location=HOST)


def tensors_location(tensors: Iterable[Any]) -> Location:
    """The one place an engine's tensors live: HOST, or the CUDA device they are all on
    (a rank's KV on two devices, or partly on the host, is refused)."""
    found = {cuda(t.get_device()) if t.is_cuda else HOST for t in tensors}
    if len(found) != 1:
        got = ", ".join(sorted(map(str, found))) or "no tensor"
        raise DeviceError(f"a rank's KV tensors must all be on one device; got {got}")
    return found.pop()


class _CudaBytes:
    """``nbytes`` device bytes at ``address`` as a ``__cuda_array_interface__`` (version 3)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
            # No stream: the caller orders its own work (kvbridge copies on its own streams).
            "stream": None,
        }


def tensor_at(address: int, nbytes: int, location: Location) -> Any:
    """A uint8 CUDA tensor over ``nbytes`` device bytes at ``address`` (not owned: the
    caller keeps the memory allocated while the tensor is used)."""
    torch = require_cuda(location)
    return torch.as_tensor(_CudaBytes(address, nbytes), device=f"cuda:{location.device}")


def tensor_of(region: RegionMemory) -> Any:
    """A uint8 tensor over a device region's bytes (a slice of its owner tensor when it has
    one, so that the owner's allocation stays referenced)."""
    if not region.on_device:
        raise DeviceError(f"region {region.name!r} is host memory, not a device's")
    owner = region.owner
    torch = require_cuda(region.location)
    if isinstance(owner, torch.Tensor) and owner.is_cuda:
        whole = owner.reshape(-1).view(torch.uint8)
        start = region.address - int(whole.data_ptr())
        if start >= 0 and start + region.nbytes <= whole.numel():
            return whole[start : start + region.nbytes]
    return tensor_at(region.address, region.nbytes, region.location)


class DevicePool(Pool):
    """The named regions of one rank in one allocation on CUDA device ``location``."""

    def __init__(self, regions: Sequence[Region], location: Location) -> None:
        if not location.is_device:
            raise LayoutError(f"a DevicePool is device memory; got {location}")
        if not regions:
            raise LayoutError("a DevicePool needs at least one region")
        names = [r.name for r in regions]
        if len(set(names)) != len(names):
            raise LayoutError(f"region names must be unique, got {names}")
        torch = require_cuda(location)
        offsets: dict[str, int] = {}
        total = 0
        for r in regions:
            offsets[r.name] = total
            total += (r.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.location = location
        self.nbytes = total
        self._whole: Any = torch.empty(total, dtype=torch.uint8, device=str(location))
        base = int(self._whole.data_ptr())
        self._regions = {
            r.name: RegionMemory(
                r.name, base + offsets[r.name], r.nbytes, owner=self._whole, location=location
            )
            for r in regions
        }
        self._views = {
            n: self._whole[offsets[n] : offsets[n] + self._regions[n].nbytes] for n in names
        }

    def view(self, name: str) -> Any:
        """The region's bytes as a uint8 CUDA tensor (zero-copy)."""
        return pool_view(self._views, name, self._whole is None, "DevicePool")

    def regions(self) -> tuple[RegionMemory, ...]:
        return tuple(self._regions.values())

    def close(self) -> None:
        """Drop the pool's reference; the memory goes once no region or transport holds it."""
        self._views.clear()
        self._whole = None


def wait_event(event: Any, deadline: float) -> bool:
    """Wait until a CUDA event (anything with ``query()``) has completed, polling so that the
    wait ends at ``deadline`` (``time.monotonic()``) even if the GPU never gets there. True
    once it completed; None waits for nothing (host memory, or an engine with no event)."""
    if event is None:
        return True
    nap = _POLL
    while not event.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(nap)
        nap = min(2 * nap, _MAX_POLL)
    return True


def location_of(regions: Sequence[RegionMemory]) -> Location:
    """The one device these regions' device memory is on (HOST if none is device memory).
    A rank's device regions on two devices is refused: a rank is one GPU."""
    devices = {r.location for r in regions if r.location.kind is MemoryKind.CUDA}
    if len(devices) > 1:
        raise DeviceError(
            f"a rank's device regions must be on one device; got {sorted(map(str, devices))}"
        )
    return devices.pop() if devices else HOST
