"""What plain sockets move when the bytes are scattered: a 1 GiB stream over loopback, each
connection's share written with ``sendall`` and read with ``recv_into``, either straight from
and into contiguous memory (``raw``, as ``kvbridge bench``'s raw tcp) or gathered on the sender
and scattered on the receiver through a 1 MiB buffer, each piece one head of four in a page
(``bounce``: the least a copy through a bounce buffer costs, with no protocol at all).

    python benchmarks/tcp_bounce.py [--pieces 32768,512] [--connections 2] [--repeat 3]

Best of ``--repeat`` GB/s for each, one after the other in one run: the ceiling of any
transport that gathers into and scatters out of a bounce buffer on this host, beside which
kvbridge's tcp on the same pieces (``python -m kvbridge.bench.engines tcp``) is read.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import threading
import time
from typing import Any

import numpy as np

TOTAL = 1 << 30
CHUNK = 1 << 20
BUFFER = 4 << 20  # socket buffers, as kvbridge's tcp sets them


def _heads(buf: np.ndarray, piece: int) -> np.ndarray:
    """One head of four in each page: pieces of ``piece`` bytes at a stride of four."""
    return buf.reshape(-1, 4, piece)[:, 0, :]


def _receive(piece: int, conns: int, port_q: Any, done_q: Any) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    dst = np.empty(TOTAL * (4 if piece else 1), np.uint8)
    dst.fill(0)  # its pages faulted in before the sender's clock starts, as the bench's pools are
    port_q.put(srv.getsockname()[1])

    def one(i: int) -> None:
        c, _ = srv.accept()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
        share = TOTAL // conns
        bounce = np.empty(CHUNK, np.uint8)
        for k in range(share // CHUNK):
            lo = i * share + k * CHUNK
            into = memoryview(bounce) if piece else memoryview(dst)[lo : lo + CHUNK]
            got = 0
            while got < CHUNK:
                got += c.recv_into(into[got:])
            if piece:
                first, rows = lo // piece, CHUNK // piece
                _heads(dst, piece)[first : first + rows] = bounce.reshape(rows, piece)
        c.sendall(b"k")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done_q.put(True)


def _send(piece: int, conns: int, port: int) -> float:
    src = np.ones(TOTAL * (4 if piece else 1), np.uint8)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(conns)]
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)

    def one(i: int) -> None:
        share = TOTAL // conns
        bounce = np.empty(CHUNK, np.uint8)
        for k in range(share // CHUNK):
            lo = i * share + k * CHUNK
            if piece:
                first, rows = lo // piece, CHUNK // piece
                bounce.reshape(rows, piece)[:] = _heads(src, piece)[first : first + rows]
                socks[i].sendall(bounce.data)
            else:
                socks[i].sendall(memoryview(src)[lo : lo + CHUNK])
        socks[i].recv(1)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return TOTAL / (time.perf_counter() - t0) / 1e9


def best(piece: int, conns: int, repeat: int) -> float:
    ctx = mp.get_context("spawn")
    fastest = 0.0
    for _ in range(repeat):
        port_q, done_q = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_receive, args=(piece, conns, port_q, done_q), daemon=True)
        p.start()
        fastest = max(fastest, _send(piece, conns, port_q.get(timeout=120)))
        done_q.get(timeout=60)
        p.join(10)
    return fastest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pieces", default="32768,512", help="piece sizes, bytes, comma-separated")
    ap.add_argument("--connections", type=int, default=2, help="as kvbridge's tcp (its default)")
    ap.add_argument("--repeat", type=int, default=3, help="timed streams a case (best reported)")
    args = ap.parse_args()
    raw = best(0, args.connections, args.repeat)
    print(f"raw, contiguous: {raw:.2f} GB/s", flush=True)
    for piece in (int(p) for p in args.pieces.split(",")):
        got = best(piece, args.connections, args.repeat)
        print(f"bounce, {piece} B pieces: {got:.2f} GB/s ({got / raw:.2f}x raw)", flush=True)


if __name__ == "__main__":
    main()
