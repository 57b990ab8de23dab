"""The C allocator's thresholds, as a long-running process has them.

glibc's ``malloc`` serves a block above its mmap threshold (128 KiB in a new process) with a
mapping of its own, faulted in page by page on first touch, and gives the top of its heap back
to the kernel whenever more than its trim threshold (128 KiB too) lies free there. Each time a
mapped block is freed it raises the mmap threshold to that block's size and the trim threshold
to twice it (up to 32 MiB and 64 MiB). An engine that has run a while has freed such a block
long ago (loading weights, its first batches); a new process has not, and there each large
request's plan (arrays of a few MiB: a request of scattered pages has a run a page, layer and
K or V) was fresh memory, faulted in anew every time (docs/benchmarks.md, "The post of a
scattered request"). Past the raised thresholds (a block over 30 MiB, or more than 60 MiB of
them freed together) a request's arrays are fresh memory again, as in any process.
"""

from __future__ import annotations

import ctypes
import threading

# Just under glibc's cap on its dynamic threshold (32 MiB on 64-bit): a block it still learns from.
_BLOCK = 30 << 20
_lock = threading.Lock()
_done = False


def raise_thresholds() -> None:
    """Free one 30 MiB block, once per process: glibc then keeps blocks up to it in its heap
    and the heap's free top up to twice it, as after any large free. Nothing else changes (a
    threshold set by the user, ``MALLOC_MMAP_THRESHOLD_``, stays; another C library ignores
    it); only the block's header is written, so it costs two system calls and a page fault."""
    global _done
    with _lock:
        if _done:
            return
        _done = True
        try:
            libc = ctypes.CDLL(None)
            libc.malloc.restype = ctypes.c_void_p
            libc.free.argtypes = (ctypes.c_void_p,)
        except (OSError, AttributeError):  # pragma: no cover - no C library to speak to
            return
        block = libc.malloc(_BLOCK)
        if block:
            libc.free(block)
