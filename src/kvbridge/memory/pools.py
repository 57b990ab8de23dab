"""Memory a rank registers with a transport: host pools here, device memory described.

* :class:`RegionMemory` says where one named region lives: its address and size, its
  :class:`~kvbridge.memory.location.Location` (host, or a CUDA device: device memory has no host
  view and is moved by the transports that take it, see :mod:`kvbridge.memory.device`), and, when it
  lies in a POSIX shared-memory segment, the segment's name and the region's offset in it (the
  shm transport needs that to map it from another process).
* :class:`HostPool` allocates the regions of one rank, private (an anonymous mapping) or shared
  (one POSIX shared-memory segment for the whole pool), pre-faulted, and unlinks what it
  created on :meth:`HostPool.close`, by a finalizer, or (for a killed process) through
  multiprocessing's resource tracker.
* :func:`wrap_array`, :func:`wrap_address` and :func:`wrap_shared_memory` describe memory an
  engine already owns.
* :func:`map_segment` maps a peer's segment (what the shm transport's sender does);
  :func:`unlink_segment` removes one left by a killed process, and every new shared pool
  first sweeps the segments of kvbridge processes that no longer exist.

One segment per pool rather than one per region: a pool has one segment name to publish, one
mapping for a peer to open and cache, one name to unlink, one resource-tracker entry, whatever
the number of layers; regions sit at page-aligned offsets inside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import secrets
import sys
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from typing import Any, TypeVar

import numpy as np

from kvbridge.errors import DeviceError, LayoutError, TransportError
from kvbridge.memory.location import HOST, Location
from kvbridge.planner.layout import Region

try:  # CPython's POSIX shm calls (what multiprocessing.shared_memory uses); no type stub.
    import _posixshmem  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

SEGMENT_PREFIX = "kvb_"
_PAGE = max(mmap.PAGESIZE, 4096)
# MADV_POPULATE_WRITE (Linux >= 5.14) faults every page in writable in one call; Python 3.11
# has no constant for it. Older kernels answer EINVAL and we touch the pages instead.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else 0)


@dataclass(frozen=True)
class RegionMemory:
    """One registered region: ``nbytes`` bytes at ``address``.

    ``segment``/``segment_offset`` name the POSIX shared-memory segment the region lies in
    (``None`` for private memory). ``owner`` keeps the backing object (an mmap, an array)
    alive for as long as the region is referenced, and views are taken through it so that the
    mapping cannot be unmapped under a transport that still writes into it. ``location``:
    host memory, or a CUDA device's (then ``address`` is a device pointer, never read here).
    """

    name: str
    address: int
    nbytes: int
    segment: str | None = None
    segment_offset: int = 0
    owner: Any = field(default=None, compare=False, repr=False)
    location: Location = HOST

    def __post_init__(self) -> None:
        if not self.name:
            raise LayoutError("a region needs a name")
        if self.nbytes < 1 or self.address <= 0 or self.segment_offset < 0:
            raise LayoutError(
                f"region {self.name!r}: need nbytes >= 1, a non-null address and "
                f"segment_offset >= 0; got nbytes={self.nbytes}, "
                f"address={self.address:#x}, offset={self.segment_offset}"
            )
        if not isinstance(self.location, Location):
            raise LayoutError(f"region {self.name!r}: location must be a Location")
        if self.location.is_device and self.segment is not None:
            raise LayoutError(
                f"region {self.name!r} is device memory ({self.location}): it cannot lie in "
                f"the shared-memory segment {self.segment!r}"
            )

    @property
    def shared(self) -> bool:
        return self.segment is not None

    @property
    def on_device(self) -> bool:
        return self.location.is_device

    def view(self) -> np.ndarray:
        """A writable uint8 array over the region's bytes (zero-copy). Host memory only: a
        device pointer read as a host address would read some other process's bytes or
        crash, so device memory is refused here (see :mod:`kvbridge.memory.device`)."""
        if self.location.is_device:
            raise DeviceError(
                f"region {self.name!r} is device memory ({self.location}): it has no host view"
            )
        if self.owner is not None:
            whole = np.frombuffer(self.owner, dtype=np.uint8)
            start = self.address - int(whole.ctypes.data)
            if start < 0 or start + self.nbytes > whole.nbytes:
                raise LayoutError(f"region {self.name!r} lies outside its owner's buffer")
            return whole[start : start + self.nbytes]
        # Raw address: the caller keeps the memory alive (documented in wrap_address).
        ptr = ctypes.cast(self.address, ctypes.POINTER(ctypes.c_uint8))
        return np.ctypeslib.as_array(ptr, shape=(self.nbytes,))


def wrap_array(
    name: str, array: np.ndarray, *, segment: str | None = None, segment_offset: int = 0
) -> RegionMemory:
    """Describe a caller-owned, C-contiguous, writable array as a region (any dtype).

    Pass ``segment``/``segment_offset`` when the array lies in a shared-memory segment you
    created; :func:`wrap_shared_memory` does that for a ``SharedMemory`` object.
    """
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise LayoutError(f"region {name!r}: the array must be C-contiguous and writable")
    flat = array.reshape(-1).view(np.uint8)
    return RegionMemory(
        name, int(flat.ctypes.data), int(flat.nbytes), segment, segment_offset, owner=flat
    )


def wrap_address(
    name: str,
    address: int,
    nbytes: int,
    *,
    segment: str | None = None,
    segment_offset: int = 0,
    location: Location = HOST,
) -> RegionMemory:
    """Describe raw memory (a pool tensor's ``data_ptr()``; for a CUDA tensor pass its
    ``location``, or use :func:`kvbridge.memory.device.wrap_tensor`). The caller keeps it allocated
    for as long as any transport has it registered."""
    return RegionMemory(name, address, nbytes, segment, segment_offset, location=location)


def wrap_shared_memory(
    name: str, shm: Any, offset: int = 0, nbytes: int | None = None
) -> RegionMemory:
    """Describe bytes ``[offset, offset + nbytes)`` of a ``multiprocessing.shared_memory.
    SharedMemory`` the caller created (and will unlink)."""
    buf = np.frombuffer(shm.buf, dtype=np.uint8)
    size = buf.nbytes - offset if nbytes is None else nbytes
    if offset < 0 or size < 1 or offset + size > buf.nbytes:
        raise LayoutError(
            f"region {name!r}: [{offset}, {offset + size}) is outside the "
            f"{buf.nbytes}-byte segment {shm.name!r}"
        )
    return wrap_array(
        name, buf[offset : offset + size], segment=str(shm.name).lstrip("/"), segment_offset=offset
    )


def _populate(mm: mmap.mmap, view: np.ndarray) -> None:
    """Fault every page in writable now, so the first transfer does not pay for it."""
    if _MADV_POPULATE_WRITE:
        try:
            mm.madvise(_MADV_POPULATE_WRITE)
            return
        except OSError:
            pass  # kernel before 5.14: fall back to touching
    # Read-modify-write one byte a page: faults the page in writable, keeps its contents.
    view[::_PAGE] |= 0


def sweep_stale_segments() -> list[str]:
    """Unlink the segments of kvbridge processes that no longer exist (a rank killed with -9
    runs no finalizer, and its resource tracker may outlive it: a restarted engine would
    leave a pool's worth of /dev/shm behind on every crash). A peer that still maps one keeps
    its mapping; only the name goes. Returns the names unlinked."""
    if _posixshmem is None or not os.path.isdir("/dev/shm"):  # pragma: no cover
        return []
    gone = []
    for entry in os.listdir("/dev/shm"):
        pid_text = entry[len(SEGMENT_PREFIX) :].partition("_")[0]
        if not entry.startswith(SEGMENT_PREFIX) or not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                _posixshmem.shm_unlink("/" + entry)
                gone.append(entry)
        except PermissionError:  # alive, another user's
            pass
    return gone


def _create_segment(nbytes: int, reserve: bool) -> tuple[str, mmap.mmap]:
    if _posixshmem is None:  # pragma: no cover - Windows
        raise TransportError("POSIX shared memory is not available on this platform")
    sweep_stale_segments()
    name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
    fd = int(_posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        os.ftruncate(fd, nbytes)
        if reserve and hasattr(os, "posix_fallocate"):  # not on macOS
            # Reserve the tmpfs pages now: a full /dev/shm is an error here, not a SIGBUS on
            # some later write.
            os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except OSError as e:
        _posixshmem.shm_unlink("/" + name)
        raise TransportError(f"cannot create a {nbytes}-byte shared-memory segment: {e}") from e
    finally:
        os.close(fd)
    # If this process is killed, the resource tracker unlinks the segment.
    resource_tracker.register("/" + name, "shared_memory")
    return name, mm


def unlink_segment(name: str) -> None:
    """Unlink a segment (and forget it in the resource tracker): what a pool's close does,
    and how to clean up after a process that was killed."""
    if _posixshmem is None:  # pragma: no cover
        return
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)
    resource_tracker.unregister("/" + name, "shared_memory")


def _release(pid: int, segment: str | None, mm: mmap.mmap) -> None:
    """Finalizer body: must not reference the pool."""
    if segment is not None and os.getpid() == pid:  # a forked child must not unlink ours
        unlink_segment(segment)
    # Views still alive (a transport's, a caller's) keep the mapping: it is freed with them.
    with contextlib.suppress(BufferError):
        mm.close()


def map_segment(segment: str, *, populate: bool = True) -> mmap.mmap:
    """Map a peer's shared-memory segment read-write (not tracked: the peer owns it).

    ``populate`` builds the page tables now (MAP_POPULATE) so that the first copy into the
    mapping is not slowed by a minor fault per page.
    """
    if _posixshmem is None:  # pragma: no cover
        raise TransportError("POSIX shared memory is not available on this platform")
    try:
        fd = int(_posixshmem.shm_open("/" + segment, os.O_RDWR, 0o600))
    except OSError as e:
        raise TransportError(
            f"cannot open shared-memory segment {segment!r}: {e}; is the peer "
            f"on this host and alive?"
        ) from e
    try:
        size = os.fstat(fd).st_size
        if size < 1:
            raise TransportError(f"shared-memory segment {segment!r} is empty")
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, size, flags=flags)
    except OSError as e:
        raise TransportError(f"cannot map shared-memory segment {segment!r}: {e}") from e
    finally:
        os.close(fd)


def _align(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


_V = TypeVar("_V")


def pool_view(views: Mapping[str, _V], name: str, closed: bool, kind: str) -> _V:
    """A pool's view of region ``name`` (host or device pools alike), or why there is none."""
    if closed:
        raise LayoutError(f"this {kind} is closed")
    v = views.get(name)
    if v is None:
        raise LayoutError(f"no region {name!r} in this pool; it has {sorted(views)}")
    return v


_P = TypeVar("_P", bound="Pool")


class Pool(ABC):
    """The named regions of one rank, allocated together, in host or device memory: what a
    Bridge takes as its ``regions`` whichever kind allocated them."""

    @abstractmethod
    def regions(self) -> tuple[RegionMemory, ...]: ...

    @abstractmethod
    def view(self, name: str) -> Any:
        """The region's bytes, zero-copy: a numpy array (host) or a uint8 tensor (device)."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HostPool(Pool):
    """The named regions of one rank, allocated together.

    ``shared=True`` puts them in one POSIX shared-memory segment (needed to be written by the
    shm transport); ``shared=False`` in one anonymous private mapping. ``prefault`` faults
    every page in now: an untouched destination page makes its first write ~50x slower.
    """

    def __init__(self, regions: Sequence[Region], shared: bool, prefault: bool = True) -> None:
        if not regions:
            raise LayoutError("a HostPool needs at least one region")
        names = [r.name for r in regions]
        if len(set(names)) != len(names):
            raise LayoutError(f"region names must be unique, got {names}")
        offsets: dict[str, int] = {}
        total = 0
        for r in regions:
            offsets[r.name] = total
            total += _align(r.nbytes)
        self.shared = shared
        self.nbytes = total
        self.segment: str | None = None
        if shared:
            self.segment, mm = _create_segment(total, reserve=prefault)
        else:
            mm = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._mm: mmap.mmap | None = mm
        self._finalizer = weakref.finalize(self, _release, os.getpid(), self.segment, mm)
        whole = np.frombuffer(mm, dtype=np.uint8)
        if prefault:
            _populate(mm, whole)
        base = int(whole.ctypes.data)
        self._regions = {
            r.name: RegionMemory(
                r.name, base + offsets[r.name], r.nbytes, self.segment, offsets[r.name], owner=mm
            )
            for r in regions
        }
        self._views = {
            n: whole[offsets[n] : offsets[n] + self._regions[n].nbytes] for n in self._regions
        }

    def view(self, name: str) -> np.ndarray:
        """The region's bytes as a writable uint8 array (zero-copy)."""
        return pool_view(self._views, name, self._mm is None, "HostPool")

    def regions(self) -> tuple[RegionMemory, ...]:
        return tuple(self._regions.values())

    def close(self) -> None:
        """Unlink the segment now. The mapping itself goes when its last view does."""
        self._views.clear()
        self._mm = None
        self._finalizer()
