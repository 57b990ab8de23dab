"""CUDA IPC memory handles through the CUDA driver API (``libcuda.so.1``, via ctypes).

Why the driver API rather than torch's storage sharing: torch shares only blocks of its own
caching allocator and ties them to its reference-count files, while kvbridge registers any
device memory an engine hands it (a ``data_ptr()``). The driver needs nothing but the
address: :func:`export` finds the allocation the address lies in (``cuMemGetAddressRange``)
and returns the handle of that whole allocation with the address's offset in it; a peer
process :func:`open_handle`\\ s it once and adds the offset. The rules (CUDA driver docs):

* a handle cannot be opened in the process that exported it (the transport uses the
  address itself there);
* a handle is opened once per context and process (opening again only counts), and is
  closed before the exporter frees the allocation, or the result is undefined;
* memory from CUDA's VMM API (torch's expandable segments) has no legacy IPC handle.

Every call needs a current context in the calling thread
(:func:`kvbridge.memory.device.bind_thread`).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from kvbridge.errors import TransportError

HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
_LAZY_ENABLE_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

_lock = threading.Lock()
_lib: Any = None


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


def _driver() -> Any:
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise TransportError(f"cudaipc: cannot load the CUDA driver: {e}") from e
            lib.cuMemGetAddressRange_v2.argtypes = [
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_size_t),
                ctypes.c_uint64,
            ]
            lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
            lib.cuIpcOpenMemHandle_v2.argtypes = [
                ctypes.POINTER(ctypes.c_uint64),
                _Handle,
                ctypes.c_uint,
            ]
            lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _lib = lib
        return _lib


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        name = text.value.decode() if text.value else "unknown error"
        raise TransportError(f"cudaipc: {what} failed: CUDA error {result} ({name})")


def export(address: int) -> tuple[bytes, int]:
    """The IPC handle of the allocation holding device ``address``, and the offset of
    ``address`` in it."""
    lib = _driver()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(
        lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address),
        f"cuMemGetAddressRange({address:#x})",
    )
    handle = _Handle()
    _check(
        lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), f"cuIpcGetMemHandle({address:#x})"
    )
    # string_at, not .reserved: a c_char array field reads as bytes cut at the first NUL.
    return ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES), address - base.value


def open_handle(handle: bytes) -> int:
    """Map a peer's allocation into this process; its base address here."""
    if len(handle) != HANDLE_BYTES:
        raise TransportError(f"cudaipc: a handle has {HANDLE_BYTES} bytes, got {len(handle)}")
    h = _Handle()
    ctypes.memmove(ctypes.addressof(h), handle, HANDLE_BYTES)
    ptr = ctypes.c_uint64()
    _check(
        _driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS),
        "cuIpcOpenMemHandle (is the peer alive, on this host, in this PID namespace, and its "
        "memory not from expandable segments?)",
    )
    return int(ptr.value)


def close_handle(base: int) -> None:
    """Unmap what :func:`open_handle` mapped."""
    _check(_driver().cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")
