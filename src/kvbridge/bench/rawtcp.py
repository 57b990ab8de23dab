"""Raw TCP: the wire's limit that kvbridge's ``tcp`` transport is measured against.

The same bytes as a workload, with the transport's defaults that bear on throughput (two
connections, 4 MiB socket buffers), and nothing else: the sources read in order as one byte
string, cut into one share a connection, each share written with ``sendall`` and read with
``recv_into`` straight into the destination in order, one byte back once a share is in. No
scatter, no framing past a share's start and length, no completion protocol: what a transport
adds to that is its cost. :mod:`kvbridge.bench.engines` runs the two ends as it runs NIXL's
and Mooncake's (a receiver process and a sender process, ``warmup + repeat`` rounds).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.planner.runs import Runs
from kvbridge.transports.sockio import recv_exact

STREAMS = 2  # the tcp transport's default connections per peer
SOCKBUF = 4 << 20  # and its default socket buffers
_SHARE = struct.Struct("!QQ")  # a connection's share: its first byte and its length


def shares(nbytes: int, streams: int) -> list[tuple[int, int]]:
    """``nbytes`` cut into ``streams`` (start, length) shares, the first ones a byte longer."""
    if nbytes < 0 or streams < 1:
        raise KVBridgeError(f"raw tcp: {nbytes} bytes over {streams} connections")
    step, extra = divmod(nbytes, streams)
    out, start = [], 0
    for i in range(streams):
        length = step + (i < extra)
        out.append((start, length))
        start += length
    return out


def slices(views: Sequence[memoryview], start: int, length: int) -> list[memoryview]:
    """Bytes ``start`` to ``start + length`` of ``views`` read end to end, and from their
    start again past their end: a plan's workload holds one prefill rank's regions, and its
    bytes are every rank's (the count is what a baseline needs, not whose bytes they are)."""
    total = sum(len(v) for v in views)
    if length and not total:
        raise KVBridgeError(f"raw tcp: {length} bytes of empty regions")
    out: list[memoryview] = []
    pos, end = start, start + length
    while pos < end:
        base, at = 0, pos % total
        for v in views:
            if base <= at < base + len(v):
                piece = v[at - base : at - base + min(end - pos, base + len(v) - at)]
                out.append(piece)
                pos += len(piece)
                break
            base += len(v)
    return out


def _views(pool: Any) -> list[memoryview]:
    return [memoryview(pool.view(r.name)).cast("B") for r in pool.regions()]


def _tuned(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKBUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKBUF)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    """A share's header or an acknowledgement (the payload goes by plain ``recv_into``)."""
    data = bytearray(n)
    recv_exact(sock, memoryview(data))
    return bytes(data)


def _serve(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """One connection: its share, then that share's bytes every round, acknowledged."""
    with sock:
        start, length = _SHARE.unpack(_recv_exactly(sock, _SHARE.size))
        pieces = slices(views, start, length)
        while True:
            for piece in pieces:
                done = 0
                while done < len(piece):
                    got = sock.recv_into(piece[done:])
                    if not got:
                        return  # the sender is done
                    done += got
            sock.sendall(b"\x01")


def receiver(conn: Any, pool: Any) -> Callable[[], Any]:
    views = _views(pool)
    listener = _tuned(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    listener.bind(("127.0.0.1", 0))
    listener.listen(STREAMS)

    def accept() -> None:
        for _ in range(STREAMS):
            sock, _ = listener.accept()
            threading.Thread(target=_serve, args=(_tuned(sock), views), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    conn.send(("ok", listener.getsockname()))
    return lambda: listener  # the connections' threads serve


def sender(pool: Any, runs: Runs, peer: Any) -> Callable[[], None]:
    views = _views(pool)
    work = []
    for start, length in shares(runs.total_bytes, STREAMS):
        sock = _tuned(socket.create_connection(tuple(peer)))
        sock.sendall(_SHARE.pack(start, length))
        work.append((sock, slices(views, start, length)))
    pool_threads = ThreadPoolExecutor(STREAMS)

    def one(sock: socket.socket, pieces: list[memoryview]) -> None:
        for piece in pieces:
            sock.sendall(piece)
        if _recv_exactly(sock, 1) != b"\x01":
            raise KVBridgeError("raw tcp: the receiver answered other than its acknowledgement")

    def once() -> None:
        for f in [pool_threads.submit(one, s, p) for s, p in work]:
            f.result()

    return once
