"""Socket calls that keep the interpreter while they need not wait.

Every ``socket`` method gives the interpreter lock away around its system call, even when the
bytes are already there to read or there is room to write them. Beside an engine thread that
polls in a Python loop (every serving engine's scheduler), a thread that gives the lock away
may wait up to the interpreter's switch interval (5 ms) to get it back. The engine's own
thread, which moves small writes itself (:mod:`.tcp_stream`, :meth:`.tcp_serve.Server.progress`),
must not: here the call is made through ctypes' ``PyDLL``, which keeps the lock, with
``MSG_DONTWAIT`` so that it cannot block; only where it would have to wait (nothing to read
yet, the send buffer full) does the socket's own method wait, the lock given away as it must
be. That is for small calls: :func:`recv_some` and :func:`send_all` give the lock away for a
copy of more than ``HELD_MAX`` bytes, which other threads' copies must be able to run beside.
Where libc's calls cannot be had (not Linux), the socket's methods do it all.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

IOV_MAX = 512  # buffers one sendmsg takes here at most (Linux: 1024)
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)


class _IOVec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


class _MsgHdr(ctypes.Structure):
    _fields_ = (
        ("name", ctypes.c_void_p),
        ("namelen", ctypes.c_uint32),
        ("iov", ctypes.POINTER(_IOVec)),
        ("iovlen", ctypes.c_size_t),
        ("control", ctypes.c_void_p),
        ("controllen", ctypes.c_size_t),
        ("flags", ctypes.c_int),
    )


_FIONREAD = 0x541B  # Linux: the bytes a socket holds, ready to read


@dataclass(frozen=True)
class _Calls:
    recv: Any
    sendmsg: Any
    ioctl: Any
    flags: int  # MSG_DONTWAIT | MSG_NOSIGNAL


def _libc() -> _Calls | None:
    if os.uname().sysname != "Linux":
        return None
    try:
        libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: its calls keep the interpreter
        recv, sendmsg, ioctl = libc.recv, libc.sendmsg, libc.ioctl
    except (OSError, AttributeError):
        return None
    recv.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    recv.restype = ctypes.c_ssize_t
    sendmsg.argtypes = (ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int)
    sendmsg.restype = ctypes.c_ssize_t
    ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.POINTER(ctypes.c_int))
    ioctl.restype = ctypes.c_int
    return _Calls(recv, sendmsg, ioctl, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)


_LIBC = _libc()
HELD = _LIBC is not None  # whether the calls here keep the interpreter (else they give it away)


def _address(view: memoryview) -> int:
    """Where a contiguous buffer's bytes are (read-only ones too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _result(n: int) -> int | None:
    """A call's result: its count, None where it would have had to wait (or a signal came
    first: the caller's socket method then does it), OSError for an error."""
    if n >= 0:
        return n
    err = ctypes.get_errno()
    if err in _AGAIN or err == errno.EINTR:
        return None
    raise OSError(err, os.strerror(err))


def recv_now(sock: socket.socket, view: memoryview, peek: bool = False) -> int | None:
    """Read what is there into ``view`` without waiting, the interpreter kept: the bytes
    read (0: the peer closed), or None where nothing is there yet. ``peek``: leave them
    in the socket."""
    if _LIBC is None or not len(view):
        return None
    flags = _LIBC.flags | (socket.MSG_PEEK if peek else 0)
    return _result(_LIBC.recv(sock.fileno(), _address(view), len(view), flags))


def pending(sock: socket.socket) -> int:
    """The bytes ``sock`` holds ready to read (0 where that cannot be known here)."""
    if _LIBC is None:
        return 0
    n = ctypes.c_int(0)
    return n.value if _LIBC.ioctl(sock.fileno(), _FIONREAD, ctypes.byref(n)) == 0 else 0


def send_now(sock: socket.socket, views: Sequence[memoryview]) -> int | None:
    """Write what the send buffer takes of ``views`` (at most IOV_MAX of them) without
    waiting, the interpreter kept: the bytes written, or None where none could be."""
    if _LIBC is None:
        return None
    vecs = (_IOVec * len(views))(*(_IOVec(_address(v), len(v)) for v in views))
    msg = _MsgHdr(None, 0, vecs, len(views), None, 0, 0)
    return _result(_LIBC.sendmsg(sock.fileno(), ctypes.byref(msg), _LIBC.flags))


# Past this many bytes a call gives the interpreter away whatever it finds: the copy between
# the kernel and user memory is the call's cost, and kept under the interpreter lock it runs
# one thread at a time. tcp's two receiving workers and two sending streams each held it
# through 4 MiB copies and moved 0.42-0.63x what plain sockets move (docs/benchmarks.md).
HELD_MAX = 256 << 10


def recv_some(sock: socket.socket, view: memoryview) -> int:
    """Bytes read into ``view`` (at least one; 0: the peer closed): what is there, without
    giving the interpreter away where ``view`` is small; else as the socket reads (its
    timeout bounds the wait)."""
    got = recv_now(sock, view) if len(view) <= HELD_MAX else None
    return sock.recv_into(view) if got is None else got


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view``; each wait is bounded by the socket's timeout. EOF -> ConnectionError."""
    pos, n = 0, len(view)
    while pos < n:
        got = recv_some(sock, view[pos:])
        if got == 0:
            raise ConnectionError(f"connection closed after {pos} of {n} bytes")
        pos += got


def advance(views: list[memoryview], n: int) -> list[memoryview]:
    """What is left of ``views`` once their first ``n`` bytes went."""
    k = 0
    while k < len(views) and n >= len(views[k]):
        n -= len(views[k])
        k += 1
    rest = views[k:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def views_of(bufs: Sequence[Any]) -> list[memoryview]:
    """Byte views of ``bufs``, the empty ones left out."""
    return [v for v in (memoryview(b).cast("B") for b in bufs) if len(v)]


def send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Write every byte of ``views`` (:func:`views_of`), in order, in as few calls as the
    socket takes; the interpreter kept only for calls of at most ``HELD_MAX`` bytes."""
    while views:
        batch = views[:IOV_MAX]
        sent = send_now(sock, batch) if sum(len(v) for v in batch) <= HELD_MAX else None
        if sent is None:
            sent = sock.sendmsg(batch)
        views = advance(views, sent)
