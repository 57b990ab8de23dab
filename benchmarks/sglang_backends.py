"""kvbridge's SGLang transfer backend beside SGLang's own Mooncake backend, on the same
deployment, one run.

    KVBRIDGE_SGLANG_PY=... python benchmarks/sglang_backends.py \
        [--tokens 64,512,2048] [--repeat 5] [--json PATH] [--out DIR]

For each backend in turn (never both at once: a core per server), a prefill server on core 0
and a decode server on core 1 (SGLang's CPU build, ``--disaggregation-transfer-backend``
kvbridge or mooncake, Mooncake over TCP), a tiny random Qwen3 in float32, SGLang's router
(mini-lb) in front. Once all three are healthy (the time from launch to healthy is the pair's
start time), ``--warmup`` untimed requests, then, for each prompt length, ``--repeat``
sequential ``/generate`` requests through the router for one token each: the wall time from the
client's request to the answer is the TTFT of a disaggregated request (prefill, KV hand-over,
the decode's first step). Every prompt is distinct from its first token on (no radix-cache
hit); the same prompts go to both backends, whose first tokens are compared. Printed: a
markdown table of the median and min TTFT per backend and length, and kvbridge / mooncake as a
ratio of the medians of this run.

The SGLang venv's python: ``KVBRIDGE_SGLANG_PY``, else what ``scripts/sglang_env.sh`` builds or
reuses (its last stdout line).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.integrations.sglang import launch
from kvbridge.integrations.sglang.launch import Server

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("kvbridge", "mooncake")
CONTEXT = int(launch.CPU_ARGS[launch.CPU_ARGS.index("--max-total-tokens") + 1])


def tiny_model(python: Path, work: Path) -> Path:
    """The tiny random Qwen3 (tests/vllm_model.py), saved by the SGLang venv's transformers."""
    model = work / "tiny-qwen3"
    subprocess.run(
        [str(python), str(ROOT / "tests/vllm_model.py"), str(model), "--arch", "qwen3"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # Its context is 2048 tokens, and SGLang refuses a prompt that fills it (the token to
    # generate must fit too): the benchmark's copy takes as many as the KV pool holds
    # (launch.CPU_ARGS' --max-total-tokens). Rotary positions have no table to outgrow.
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids in 4..511 (0-3 are the model's special tokens); distinct seeds below 508
    give distinct first tokens, so no two prompts share a cached prefix."""
    return [(seed * 31 + 7 * i) % 508 + 4 for i in range(n)]


def request(rt: Server, ids: list[int], timeout: float) -> tuple[float, int]:
    """One /generate through the router for one token: (seconds, the token)."""
    t0 = time.perf_counter()
    status, got = launch.generate(rt.url, ids, max_new_tokens=1, timeout=timeout)
    took = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"{len(ids)} tokens: HTTP {status}: {got}")
    out = launch.output_ids(got)
    if len(out) != 1:
        raise RuntimeError(f"{len(ids)} tokens: {len(out)} output ids, not 1: {got}")
    return took, out[0]


def run_backend(
    python: Path, work: Path, model: Path, backend: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Start the pair and the router, measure, kill them: the backend's result."""
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    pre = launch.serve(python, work, "prefill", model, mode="prefill", backend=backend, core="0")
    dec = launch.serve(python, work, "decode", model, mode="decode", backend=backend, core="1")
    with launch.killed_after(pre, dec):
        rt = launch.router(python, work, pre, dec)
        with launch.killed_after(rt):
            # The router's /health answers at once: the pair's says the route is ready.
            launch.wait_healthy([pre, dec, rt], args.start_timeout)
            start_s = time.perf_counter() - t0
            seed = 0
            try:
                for _ in range(args.warmup):
                    request(rt, prompt(max(args.lengths), seed), args.timeout)
                    seed += 1
                ttft: dict[int, list[float]] = {}
                tokens: dict[int, list[int]] = {}
                for n in args.lengths:
                    ttft[n], tokens[n] = [], []
                    for _ in range(args.repeat):
                        took, token = request(rt, prompt(n, seed), args.timeout)
                        seed += 1
                        ttft[n].append(took)
                        tokens[n].append(token)
            except (RuntimeError, OSError) as e:
                tails = "\n".join(f"--- {s.name} ({s.log}):\n{s.tail()}" for s in (pre, dec, rt))
                raise RuntimeError(f"{type(e).__name__}: {e}\n{tails}") from None
    return {"start_s": start_s, "ttft_s": ttft, "tokens": tokens}


def table(lengths: list[int], results: dict[str, dict[str, Any]]) -> str:
    def cell(backend: str, n: int, f: Any) -> str:
        r = results.get(backend, {})
        return f"{f(r['ttft_s'][n]) * 1e3:.1f}" if "ttft_s" in r else "n/a"

    lines = [
        "| prompt tokens | kvbridge median ms | kvbridge min ms | mooncake median ms "
        "| mooncake min ms | kvbridge / mooncake (medians) | same tokens |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    both = all("ttft_s" in results.get(b, {}) for b in BACKENDS)
    for n in lengths:
        if both:
            ours, theirs = (statistics.median(results[b]["ttft_s"][n]) for b in BACKENDS)
            ratio = f"{ours / theirs:.2f}"
            same = str(results["kvbridge"]["tokens"][n] == results["mooncake"]["tokens"][n])
        else:
            ratio = same = "n/a"
        lines.append(
            f"| {n} | {cell('kvbridge', n, statistics.median)} | {cell('kvbridge', n, min)} "
            f"| {cell('mooncake', n, statistics.median)} | {cell('mooncake', n, min)} "
            f"| {ratio} | {same} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,512,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--repeat", type=int, default=5, help="timed requests per length")
    ap.add_argument("--warmup", type=int, default=2, help="untimed requests first")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="which, in this order")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a request may take")
    ap.add_argument("--start-timeout", type=float, default=420, help="seconds to turn healthy")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--out", type=Path, default=None, help="logs here (default: a temp dir)")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.tokens.split(",")]
    backends = [b for b in args.backends.split(",") if b]
    if max(args.lengths) >= CONTEXT:
        ap.error(f"a prompt and its token must fit {CONTEXT} tokens (the KV pool)")
    if len(args.lengths) * args.repeat + args.warmup > 508:
        ap.error("more than 508 prompts: they would share first tokens")
    # Servers run in sessions of their own: a SIGTERM must still unwind the killed_after blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.out or Path(tempfile.mkdtemp(prefix="kvbridge-sglang-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    python = launch.sglang_python(ROOT)
    model = tiny_model(python, work)
    results: dict[str, dict[str, Any]] = {}
    failed = False
    for backend in backends:
        try:
            results[backend] = run_backend(python, work / backend, model, backend, args)
        except (RuntimeError, OSError) as e:
            print(f"{backend}: failed: {e}", file=sys.stderr)
            results[backend] = {"error": str(e)}
            failed = True
    print(table(args.lengths, results))
    print()
    for b in backends:
        if "start_s" in results[b]:
            start = results[b]["start_s"]
            print(f"{b} pair start (launch to healthy, router included): {start:.1f} s")
        else:
            print(f"{b}: failed (see stderr)")
    print(f"logs: {work}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "lengths": args.lengths,
                    "repeat": args.repeat,
                    "warmup": args.warmup,
                    "backends": results,
                },
                indent=2,
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
