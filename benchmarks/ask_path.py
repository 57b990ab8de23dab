"""The decode's ask to the prefill's poll, between two processes: kvbridge's control channel
beside a bare ZeroMQ PUSH/PULL message of the same size (what SGLang's Mooncake backend sends).

    python benchmarks/ask_path.py [--requests 300] [--ways kvbridge,zmq]

A prefill process and a decode process, each with its main thread pinned to a core of its own
(the first two this process may use) as an engine's scheduler is, its other threads free
(kvbridge's backends start their threads so). The prefill's main thread polls for the request
the way SGLang's scheduler loop does (``time.sleep(0)`` between looks, which gives the
interpreter to the other threads); the decode asks, one request at a time:

- kvbridge: two Bridges over tcp (a 2-layer cache, 64 tokens in 4 pages); the decode's
  ``Receiver.init`` sends the ask; the prefill polls ``Bridge.asked`` (as kvbridge's SGLang
  sender does), then sends the pages and both wait for success;
- zmq: the decode sends the room and its page indices on a PUSH socket; a thread of the prefill
  receives them (as Mooncake's backend's does) and the main thread polls a dict.

Printed per way, medians (and quartiles) in microseconds after the first 20 requests: the ask's
arrival in the prefill process and the prefill's poll seeing it, each from the start of the
decode's call that sends it (``time.monotonic()``: one clock for the host's processes). That
call is kvbridge's whole ``Receiver.init`` (checking the placement, starting the request), but
only the socket's send of the bare message: its sender's own preparation is left out. Needs two
cores.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time
from typing import Any

import numpy as np

WARMUP = 20
PATIENCE = 30.0  # seconds a side waits for the other before it gives up


def _bridge(role: Any, name: str, bootstrap: str) -> Any:  # a Role -> a started Bridge
    from kvbridge import CacheSpec, DType, ParallelLayout, build_memory
    from kvbridge.config import Settings
    from kvbridge.memory.pools import HostPool
    from kvbridge.model.spec import attention_layer
    from kvbridge.runtime import Bridge

    spec = CacheSpec("m", tuple(attention_layer(2, 8, DType.BFLOAT16) for _ in range(2)))
    par = ParallelLayout.even(2, 1)
    mem = build_memory(spec, par, page_size=16, num_pages=64)
    return Bridge(
        role=role,
        spec=spec,
        parallel=par,
        rank=0,
        memory=mem,
        regions=HostPool(mem.regions, shared=False),
        transport="tcp",
        bootstrap=bootstrap,
        engine_id=name,
        settings=Settings.from_env(),
    ).start()


def _waited(since: float, what: str) -> None:
    if time.monotonic() - since > PATIENCE:
        raise SystemExit(f"no {what} within {PATIENCE:.0f} s")


def kvbridge_prefill(n: int, core: int, addr: Any, out: Any) -> None:
    from kvbridge import Placement
    from kvbridge.bootstrap import BootstrapServer
    from kvbridge.runtime.prefill import parked
    from kvbridge.runtime.status import KVPoll
    from kvbridge.wire.protocol import Role

    arrived: dict[int, float] = {}
    park = parked.Parked.park

    def timed_park(self: Any, msg: Any, limit: int) -> bool:  # the ask's arrival, any thread
        arrived[msg.room] = time.monotonic()
        return park(self, msg, limit)

    parked.Parked.park = timed_park  # type: ignore[method-assign]
    with BootstrapServer() as server:
        addr.put(server.address)
        p = _bridge(Role.PREFILL, "p", server.address)
        os.sched_setaffinity(0, {core})  # this thread only: the bridge's threads stay free
        seen: dict[int, float] = {}
        for room in range(1, n + 1):
            t0 = time.monotonic()
            while p.asked(room) is None:
                _waited(t0, "ask")
                time.sleep(0)
            seen[room] = time.monotonic()
            s = p.sender(room, Placement.simple(64, [1, 2, 3, 4]))
            s.send(64)
            if s.wait(10) is not KVPoll.SUCCESS:
                raise SystemExit(f"room {room}: {s.failure}")
        out.put(("prefill", arrived, seen))
        time.sleep(0.5)  # the decode's last success confirmed before this side closes
        p.close()


def kvbridge_decode(n: int, core: int, addr: Any, out: Any) -> None:
    from kvbridge import Placement
    from kvbridge.runtime.status import KVPoll
    from kvbridge.wire.protocol import Role

    d = _bridge(Role.DECODE, "d", addr.get(timeout=PATIENCE))
    os.sched_setaffinity(0, {core})
    sent: dict[int, float] = {}
    for room in range(1, n + 1):
        r = d.receiver(room)
        t0 = time.monotonic()
        while r.poll() is not KVPoll.WAITING_FOR_INPUT:
            _waited(t0, "link to the prefill")
            time.sleep(0.0002)
        time.sleep(0.002)  # the prefill polls in its loop meanwhile
        sent[room] = time.monotonic()
        r.init(Placement.simple(64, [5, 6, 7, 8]))
        if r.wait(10) is not KVPoll.SUCCESS:
            raise SystemExit(f"room {room}: {r.failure}")
    out.put(("decode", sent, {}))
    d.close()


def zmq_prefill(n: int, core: int, addr: Any, out: Any) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PULL)
    addr.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    arrived: dict[int, float] = {}
    lock = threading.Lock()

    def receive() -> None:
        while True:
            room = int(sock.recv_multipart()[0])
            with lock:
                arrived[room] = time.monotonic()
            if room == n:
                return

    threading.Thread(target=receive, daemon=True).start()
    os.sched_setaffinity(0, {core})
    seen: dict[int, float] = {}
    for room in range(1, n + 1):
        t0 = time.monotonic()
        while True:
            with lock:
                if room in arrived:
                    break
            _waited(t0, "message")
            time.sleep(0)
        seen[room] = time.monotonic()
    out.put(("prefill", arrived, seen))


def zmq_decode(n: int, core: int, addr: Any, out: Any) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PUSH)
    sock.connect(f"tcp://127.0.0.1:{addr.get(timeout=PATIENCE)}")
    os.sched_setaffinity(0, {core})
    pages = np.arange(4, dtype=np.int32).tobytes()
    sent: dict[int, float] = {}
    for room in range(1, n + 1):
        time.sleep(0.004)  # about one kvbridge request's time: the same pace
        sent[room] = time.monotonic()
        sock.send_multipart([str(room).encode(), b"127.0.0.1", b"session", pages, b"0", b"1"])
    out.put(("decode", sent, {}))
    time.sleep(0.5)


WAYS = {"kvbridge": (kvbridge_prefill, kvbridge_decode), "zmq": (zmq_prefill, zmq_decode)}


def measure(way: str, n: int, cores: list[int]) -> str:
    ctx = mp.get_context("fork")
    addr, out = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=f, args=(n, core, addr, out), daemon=True)
        for f, core in zip(WAYS[way], cores, strict=True)
    ]
    for p in procs:
        p.start()
    got: dict[str, tuple[dict[int, float], dict[int, float]]] = {}
    while len(got) < len(procs):
        try:
            side, a, b = out.get(timeout=0.5)
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise SystemExit(f"{way}: a side ended with exit code {failed[0]}") from None
            continue
        got[side] = (a, b)
    for p in procs:
        p.join(10)
    arrived, seen = got["prefill"]
    sent = got["decode"][0]
    rooms = sorted(seen)[WARMUP:]

    def us(xs: list[float]) -> str:
        q = statistics.quantiles(xs, n=4)
        return f"{q[1] * 1e6:.0f} ({q[0] * 1e6:.0f}-{q[2] * 1e6:.0f})"

    return (
        f"{way}: arrived {us([arrived[r] - sent[r] for r in rooms])} us, "
        f"polled {us([seen[r] - sent[r] for r in rooms])} us after the decode's call "
        f"({len(rooms)} requests)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="requests a way")
    ap.add_argument("--ways", default="kvbridge,zmq", help="comma-separated: kvbridge, zmq")
    ap.add_argument("--rounds", type=int, default=2, help="each way this many times, alternating")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:2]  # the prefill's, the decode's
    if len(cores) < 2:
        raise SystemExit("ask_path.py needs two cores")
    for _ in range(args.rounds):
        for way in args.ways.split(","):
            print(measure(way, args.requests, cores), flush=True)


if __name__ == "__main__":
    main()
