"""Packets off the loopback interface, for the tests that check what travels: a raw packet
socket (Linux, root; the tests skip, saying why, where it cannot be opened), and the TCP
streams the frames carry, reassembled. The machine's own loopback carries the other tests'
transfers (the other pytest-xdist worker's: gigabytes a second), more than the capture's reader
keeps up with (once 136,713 frames dropped): a test whose traffic must be seen whole runs it on
a host of its own (:func:`private_host`) and captures that host's loopback."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import pytest

from kvbridge.deploy import netns

ETH_P_ALL = 0x0003
SOL_PACKET, PACKET_STATISTICS = 263, 6  # <linux/if_packet.h>


@contextmanager
def private_host() -> Iterator[netns.Network]:
    """A network of one host, ``"host"`` (a namespace of its own, its loopback up): nothing but
    what the test starts there travels on its loopback. Skips, saying why, where namespaces
    cannot be made."""
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"no host of its own for the capture: {why}")
    with netns.Network(["host"]) as net:
        yield net


@contextmanager
def capture(interface: str = "lo", namespace: str | None = None) -> Iterator[list[bytes]]:
    """Every frame on ``interface`` (of network namespace ``namespace``, else this thread's)
    until the block ends (the list fills as they come); fails the test if the kernel dropped
    any, since a dropped frame could be the one that leaks."""
    try:
        with netns.inside(namespace) if namespace else nullcontext():
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
    except (AttributeError, PermissionError, OSError) as e:
        pytest.skip(f"no raw packet socket here ({type(e).__name__}: {e}); needs Linux and root")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    sock.bind((interface, 0))
    sock.settimeout(0.2)
    frames: list[bytes] = []
    stop = threading.Event()
    ended = [0.0]  # when the block ended

    def drain() -> None:
        # Until the block ended and the socket then stayed empty for a timeout: the frames
        # queued when the block ended are read too (a loopback frame is queued as it is sent).
        # Other tests' traffic on loopback may never let it stay empty: then until 2 s after
        # the block ended, by when what was queued then has long been read.
        while not (stop.is_set() and time.monotonic() > ended[0] + 2.0):
            try:
                frames.append(sock.recv(1 << 16))
            except TimeoutError:
                if stop.is_set():
                    return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        yield frames
    finally:
        ended[0] = time.monotonic()
        stop.set()
        reader.join(10)
        assert not reader.is_alive(), "the capture's reader did not stop"
        _, drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
        sock.close()
    assert drops == 0, f"the kernel dropped {drops} frames: the capture is incomplete"


def stream_to(frames: list[bytes], port: int) -> bytes:
    """The bytes sent to TCP ``port`` over IPv4 in ``frames`` (one connection: segments ordered
    by sequence number; loopback frames are seen twice, once each way)."""
    segments: dict[int, bytes] = {}
    for f in frames:
        if len(f) < 34 or f[12:14] != b"\x08\x00" or f[23] != 6:  # Ethernet, IPv4, TCP
            continue
        ip = f[14:]
        ihl, total = (ip[0] & 0x0F) * 4, struct.unpack("!H", ip[2:4])[0]
        tcp = ip[ihl:total]
        if struct.unpack("!H", tcp[2:4])[0] != port:
            continue
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if payload:
            segments[struct.unpack("!I", tcp[4:8])[0]] = payload
    return b"".join(segments[s] for s in sorted(segments))
