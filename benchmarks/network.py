"""``python benchmarks/network.py``: kvbridge between two hosts over a shaped link, next to
that link's capacity.

Three network namespaces on one switch (kvbridge.deploy.netns): the bootstrap service, one
prefill rank and one decode rank, each on its own host. For each round-trip time (both hosts
hold what they receive half of it: kvbridge.deploy.linkdelay) and each loss rate (of what the
decode host receives), in one run:

- **link**: the request's bytes sent raw from the prefill host to the decode host over one TCP
  connection, and over two at once (as kvbridge's tcp transport opens to each peer): the
  better is the shaped link's capacity as TCP sees it;
- each transport: one request of a Qwen3-8B-shaped cache (36 layers, 8 KV heads x 128, bf16,
  144 KiB a token) between real rank processes (``kvbridge bench transfer``'s rounds: the
  best round's GB/s, the median completion latency: from the last write done to the decode
  side's success).

Needs root, iproute2 and iptables (delay and loss). One run, noisy: the delay holder is a
Python process on the same two cores as the ranks.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace

from kvbridge.bench.transfer import measure
from kvbridge.deploy.cluster import Job
from kvbridge.deploy.netns import Network, unavailable
from kvbridge.model.hf import load_spec
from kvbridge.planner.sidespec import SideOptions
from kvbridge.transports import unavailable as transport_unavailable

TOKEN = "bench-network"

_SINK = """
import socket, sys, threading
def take(c):
    n = int.from_bytes(c.recv(8), "big"); got = 0
    while got < n:
        got += len(c.recv(1 << 20))
    c.sendall(b"k"); c.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 9100)); s.listen(); print("ready", flush=True)
while True:
    threading.Thread(target=take, args=(s.accept()[0],)).start()
"""

# ``streams`` connections at once, each carrying its share of the bytes; prints the seconds.
_SOURCE = """
import socket, sys, threading, time
host, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]); data = bytes(1 << 20)
def give(share):
    c = socket.create_connection((host, 9100)); c.sendall(share.to_bytes(8, "big"))
    while share:
        c.sendall(data[: min(share, len(data))]); share -= min(share, len(data))
    c.recv(1)
t = time.perf_counter()
ts = [threading.Thread(target=give, args=(n // k,)) for _ in range(k)]
[x.start() for x in ts]; [x.join() for x in ts]
print(time.perf_counter() - t)
"""


def link_gbps(net: Network, nbytes: int, rounds: int, streams: int) -> float:
    """The best of ``rounds`` sends of ``nbytes`` from prefill to decode over ``streams`` raw
    TCP connections at once, GB/s."""
    best = float("inf")
    for _ in range(rounds):
        done = subprocess.run(
            ["ip", "netns", "exec", net["prefill"].netns, sys.executable, "-c", _SOURCE]
            + [net["decode"].address, str(nbytes), str(streams)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode:
            raise RuntimeError(done.stderr[-500:])
        best = min(best, float(done.stdout))
    return nbytes / best / 1e9


def shape(net: Network, rtt_ms: float, loss: float) -> None:
    for h in ("prefill", "decode"):
        net.delay(h, rtt_ms / 2)
    net.loss("decode", loss)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="request length (144 KiB a token)")
    ap.add_argument("--rtt", type=float, nargs="+", default=[0, 1, 5, 10], help="ms")
    ap.add_argument("--loss", type=float, nargs="+", default=[0, 0.1], help="percent")
    ap.add_argument("--transports", nargs="+", default=["tcp", "mooncake", "nixl"])
    ap.add_argument("--repeat", type=int, default=3, help="rounds a cell (best GB/s)")
    ap.add_argument("--json", action="store_true", help="rows as JSON lines")
    args = ap.parse_args()
    # Killed (SIGTERM), the run still deletes its namespaces and stops its holders.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    reason = unavailable()
    if reason:
        print(f"network bench: cannot run here: {reason}", file=sys.stderr)
        return 2
    spec = load_spec("qwen3-8b")
    transports = [t for t in args.transports if not transport_unavailable(t)]
    with Network(["bootstrap", "prefill", "decode"]) as net:
        sink = net.popen(
            "decode", [sys.executable, "-c", _SINK, net["decode"].address], stdout=subprocess.PIPE
        )
        assert sink.stdout is not None and sink.stdout.readline().strip() == b"ready"
        hosts = (net["bootstrap"], net["prefill"], net["decode"])
        settings = {"token": TOKEN, "transfer_timeout": 300.0}
        for rtt in args.rtt:
            for loss in args.loss:
                shape(net, rtt, loss)
                job = Job(
                    spec,
                    SideOptions(tp=1, page=16),
                    SideOptions(tp=1, page=16),
                    tokens=args.tokens,
                    verify=False,
                    prefill_settings=settings,
                    decode_settings=settings,
                    hosts=hosts,
                )
                nbytes = args.tokens * 144 * 1024
                row: dict[str, float] = {"rtt_ms": rtt, "loss_pct": loss, "MiB": nbytes >> 20}
                # One stream, and two as kvbridge's tcp opens to each peer: the link's
                # capacity is the better of them.
                for k in (1, 2):
                    row[f"link x{k} GB/s"] = round(link_gbps(net, nbytes, args.repeat, k), 3)
                link = max(row["link x1 GB/s"], row["link x2 GB/s"])
                for t in transports:
                    # The hosts share a kernel: UCX would use cross-memory attach, not the link.
                    opts = {"ucx_tls": "tcp"} if t == "nixl" else {}
                    got = measure(replace(job, transport=t, transport_options=opts), args.repeat)
                    gbps = nbytes / min(r.seconds for r in got) / 1e9
                    row[f"{t} GB/s"] = round(gbps, 3)
                    row[f"{t} / link"] = round(gbps / link, 2)
                    row[f"{t} completion ms"] = round(
                        1e3 * statistics.median(r.latency for r in got), 2
                    )
                print(json.dumps(row) if args.json else row, flush=True)
                time.sleep(0.5)
    return 0


if __name__ == "__main__":  # the guard matters: rank processes are spawned, re-importing this
    sys.exit(main())
