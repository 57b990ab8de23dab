"""Entering a network namespace (``/run/netns/NAME``, as ``ip netns add`` makes it): what a
server forked into a host does before it opens a socket (:mod:`.forkserver`), and what the
hosts of :mod:`kvbridge.deploy.netns` do. Linux only; needs CAP_SYS_ADMIN (root). Unlike
``ip netns exec`` it mounts nothing: ``/sys/class/net`` still shows the machine's interfaces
and ``/etc/netns/NAME`` is not bound over ``/etc``; sockets, and netlink (how engines find
their interfaces and addresses), are the namespace's."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000
# Looked up at import, not in a freshly forked child: the lookup takes the dynamic loader's
# lock, which another thread of the process that forked may have held at the fork.
_SETNS = ctypes.CDLL(None, use_errno=True).setns


def setns(fd: int) -> None:
    """Move the calling thread into the network namespace open as ``fd`` (the whole process
    where it has one thread). OSError, with the kernel's reason, where it cannot."""
    if _SETNS(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def enter(netns: str) -> None:
    """Move the calling thread into namespace ``netns`` for good (OSError where it cannot:
    no such namespace, no privilege)."""
    path = f"/run/netns/{netns}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise OSError(e.errno, f"no network namespace {netns!r} ({path} does not exist)") from None
    try:
        setns(fd)
    finally:
        os.close(fd)
