"""kvbridge's SGLang transfer backend under load, beside SGLang's own Mooncake backend, on the
same deployment, one run, interleaved.

    KVBRIDGE_SGLANG_PY=... python benchmarks/sglang_serving.py \\
        [--rates 1,2,4] [--prompts 24] [--rounds 2] [--baseline SRC] [--json PATH] [--out DIR]

The deployment of ``benchmarks/sglang_backends.py`` (both backends' pairs up at once, alike: a
prefill server on core 0, a decode server on core 1, SGLang's router in front, servers asleep
when idle; Mooncake over TCP, kvbridge over its tcp), with a KV pool of 32,768 tokens so that
several long prompts fit at once. At each request rate, ``--prompts`` requests arrive at
Poisson times (seed: the round), each a random prompt of 256-4096 tokens and 32 tokens out
(``ignore_eos``), streamed through the router; the backends take turns, A-B in even rounds and
B-A in odd ones, the same prompts and arrival times for both within a round and new prompts
each round (no radix-cache hit from an earlier round). Per backend and rate, over all rounds:
TTFT p50 and p99 (request sent to first token streamed), output tokens/s (a run's tokens over
its first arrival to its last answer, the median of the rounds), failed requests; kvbridge's
p50, p99 and throughput over Mooncake's, whether the two TTFT interquartile ranges overlap
(then the spread covers the difference), the median of kvbridge's TTFT over Mooncake's prompt by
prompt with its 95% bootstrap interval (rounds drawn, then prompts within them; "level" where it
holds 1), and whether every prompt got the same tokens from both (greedy, float32).

``--baseline SRC``: kvbridge at another commit (``git worktree add SRC REV``: its servers import
``SRC/src``) in Mooncake's place, so that a change's cost under load is measured against the code
before it, interleaved the same way.

The SGLang venv's python: ``KVBRIDGE_SGLANG_PY``, else what ``scripts/sglang_env.sh`` builds or
reuses (its last stdout line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _spread import Paired, Spread
from sglang_backends import ROOT, Pair, tiny_model

from kvbridge.integrations.sglang import launch

POOL = 32768  # KV slots a server: a few 4k prompts at once
LOW, HIGH, OUT = 256, 4096, 32  # prompt lengths and tokens out


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the run starts
    ids: list[int]


@dataclass
class Answer:
    ttft: float = float("nan")
    end: float = float("nan")
    ids: list[int] = field(default_factory=list)
    error: str | None = None


def workload(rate: float, n: int, seed: int) -> list[Request]:
    """``n`` requests, Poisson arrivals at ``rate``/s, prompts of LOW..HIGH random token ids in
    4..511 (0-3 are the model's special tokens)."""
    rng = np.random.default_rng(seed)
    at = np.cumsum(rng.exponential(1 / rate, n))
    lengths = rng.integers(LOW, HIGH + 1, n)
    return [
        Request(float(t), rng.integers(4, 512, int(m)).tolist())
        for t, m in zip(at, lengths, strict=True)
    ]


def stream(url: str, ids: list[int], t0: float, timeout: float) -> Answer:
    """One streamed /generate: when its first token came, when it ended, its tokens."""
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": OUT, "ignore_eos": True},
        "stream": True,
    }
    req = urllib.request.Request(
        f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    a = Answer()
    chunks: list[list[int]] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                got = json.loads(line[5:])
                if "error" in got:
                    a.error = str(got["error"])[:200]
                    break
                out = [int(i) for i in got.get("output_ids", [])]
                if out and math.isnan(a.ttft):  # the first token
                    a.ttft = time.perf_counter() - t0
                chunks.append(out)
    except OSError as e:
        a.error = f"{type(e).__name__}: {e}"[:200]
    a.end = time.perf_counter()
    # SGLang streams each chunk's ids cumulatively unless told to stream increments.
    last = chunks[-1] if chunks else []
    a.ids = last if len(last) == OUT else [i for c in chunks for i in c]
    if a.error is None and len(a.ids) != OUT:
        a.error = f"{len(a.ids)} tokens out, not {OUT}"
    return a


def run(pair: Pair, requests: list[Request], timeout: float) -> tuple[list[Answer], float]:
    """Send every request at its time, each on a thread of its own; the answers and the run's
    output tokens a second."""
    answers = [Answer() for _ in requests]
    start = time.perf_counter()

    def one(i: int, r: Request) -> None:
        time.sleep(max(0.0, start + r.at - time.perf_counter()))
        answers[i] = stream(pair.router.url, r.ids, time.perf_counter(), timeout)

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = start + requests[0].at
    tokens = sum(len(a.ids) for a in answers if a.error is None)
    return answers, tokens / (max(a.end for a in answers) - first)


def stage_means(results: dict[str, dict[float, dict[str, Any]]], rates: list[float]) -> str:
    """A table of each SGLang stage's mean per request, by rate and backend: where a backend's
    requests spend the time the other's do not."""
    cols = [(rate, b) for rate in rates for b in results]
    stages = sorted({k for rate, b in cols for k in results[b][rate]["stages"][0]})
    lines = [
        "| stage | " + " | ".join(f"{rate:g}/s: {b}" for rate, b in cols) + " |",
        "| --- |" + " ---: |" * len(cols),
    ]
    for k in stages:
        cells = []
        for rate, b in cols:
            total, count = (results[b][rate]["stages"][i].get(k, 0.0) for i in (0, 1))
            cells.append(f"{total / count * 1e3:.2f}" if count else "-")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1,2,4", help="requests per second, comma-separated")
    ap.add_argument("--prompts", type=int, default=24, help="requests per rate and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per rate (A-B, then B-A)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a request may take")
    ap.add_argument("--start-timeout", type=float, default=420, help="seconds to turn healthy")
    ap.add_argument("--baseline", type=Path, default=None, help="kvbridge src tree, not Mooncake")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--out", type=Path, default=None, help="logs here (default: a temp dir)")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    if args.baseline and not (args.baseline / "src/kvbridge/__init__.py").is_file():
        ap.error(f"--baseline {args.baseline}: no src/kvbridge/__init__.py there")
    contenders = [("kvbridge", None)] + (
        [("kvbridge", args.baseline.resolve())] if args.baseline else [("mooncake", None)]
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.out or Path(tempfile.mkdtemp(prefix="kvbridge-sglang-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    python = launch.sglang_python(ROOT)
    model = tiny_model(python, work)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = HIGH + OUT  # random weights: any context is as valid
    (model / "config.json").write_text(json.dumps(config, indent=2))
    results: dict[str, dict[float, dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        pairs = []
        for i, (backend, src) in enumerate(contenders):
            pair = Pair(
                python,
                work / f"{i}-{backend}",
                model,
                backend,
                args=("--max-total-tokens", str(POOL)),
                src=src,
            )
            stack.enter_context(launch.killed_after(*pair.servers))
            pairs.append(pair)
            results[pair.label] = {
                r: {
                    "ttft": [],
                    "rounds": [],  # each round's TTFTs in request order, None where it failed
                    "tps": [],
                    "failed": [],
                    "ids": [],
                    "stages": ({}, {}),
                }
                for r in rates
            }
        launch.wait_healthy([s for p in pairs for s in p.servers], args.start_timeout)
        for pair in pairs:  # a first request each: connections, first plans
            stream(pair.router.url, list(range(4, 260)), time.perf_counter(), args.timeout)
        for rate in rates:
            for rnd in range(args.rounds):
                requests = workload(rate, args.prompts, seed=1000 * rnd + int(rate * 10))
                for pair in pairs if rnd % 2 == 0 else pairs[::-1]:
                    before = pair.settled_stages()
                    answers, tps = run(pair, requests, args.timeout)
                    after = pair.settled_stages()
                    got = results[pair.label][rate]
                    if before is not None and after is not None:  # the rounds' stages, summed
                        for total, now, then in zip(got["stages"], after, before, strict=True):
                            for k, v in now.items():
                                total[k] = total.get(k, 0.0) + v - then.get(k, 0.0)
                    got["ttft"] += [a.ttft for a in answers if a.error is None]
                    got["rounds"].append([a.ttft if a.error is None else None for a in answers])
                    got["failed"] += [a.error for a in answers if a.error is not None]
                    got["ids"] += [a.ids for a in answers]
                    got["tps"].append(tps)
                    ok = [a.ttft for a in answers if a.error is None]
                    print(
                        f"rate {rate:g}, round {rnd}, {pair.label}: p50 "
                        f"{pct(ok, 50) * 1e3:.0f} ms, {tps:.0f} tok/s, "
                        f"{len(answers) - len(ok)} failed",
                        file=sys.stderr,
                    )
    print(
        "| rate (req/s) | backend | TTFT p50 ms | TTFT p99 ms | output tok/s (median of rounds) "
        "| failed |"
    )
    print("|---|---|---|---|---|---|")
    for rate in rates:
        for b, by_rate in results.items():
            g = by_rate[rate]
            print(
                f"| {rate:g} | {b} | {pct(g['ttft'], 50) * 1e3:.0f} | "
                f"{pct(g['ttft'], 99) * 1e3:.0f} | {statistics.median(g['tps']):.0f} | "
                f"{len(g['failed'])}/{args.prompts * args.rounds} |"
            )
    print()
    ours, theirs = results
    print(
        f"| rate | {ours} / {theirs}: TTFT p50 | TTFT IQRs overlap | paired TTFT ratio (95% CI) "
        "| TTFT p99 | output tok/s | same tokens |"
    )
    print("|---|---|---|---|---|---|---|")
    for rate in rates:
        k, m = results[ours][rate], results[theirs][rate]
        same = sum(a == b for a, b in zip(k["ids"], m["ids"], strict=True))
        overlap = "yes" if Spread.of(k["ttft"]).overlaps(Spread.of(m["ttft"])) else "no"
        pairs = [
            [(a, b) for a, b in zip(ka, ma, strict=True) if a is not None and b is not None]
            for ka, ma in zip(k["rounds"], m["rounds"], strict=True)
        ]
        print(
            f"| {rate:g} | {pct(k['ttft'], 50) / pct(m['ttft'], 50):.2f} | {overlap} | "
            f"{Paired.of(pairs)} | {pct(k['ttft'], 99) / pct(m['ttft'], 99):.2f} | "
            f"{statistics.median(k['tps']) / statistics.median(m['tps']):.2f} | "
            f"{same}/{len(k['ids'])} |"
        )
    print()
    print("SGLang's own stages under load, mean ms a request (--enable-metrics):")
    print(stage_means(results, rates))
    for b in results:
        for rate in rates:
            for why in sorted(set(results[b][rate]["failed"]))[:3]:
                print(f"{b} at {rate:g}/s failed: {why}")
    print(f"logs: {work}")
    if args.json:
        by_rate = {b: {str(r): v for r, v in d.items()} for b, d in results.items()}
        args.json.write_text(json.dumps(by_rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
