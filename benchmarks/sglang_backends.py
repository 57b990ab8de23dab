"""kvbridge's SGLang transfer backend beside SGLang's own Mooncake backend, on the same
deployment, one run, interleaved.

    KVBRIDGE_SGLANG_PY=... python benchmarks/sglang_backends.py \
        [--tokens 64,512,2048] [--repeat 10] [--kvbridge-transport tcp|mooncake] \
        [--optimistic-prefill N] [--json PATH] [--out DIR]

Both backends' deployments at once, alike: for each, a prefill server on core 0 and a decode
server on core 1 (SGLang's CPU build, ``--disaggregation-transfer-backend`` kvbridge or
mooncake, Mooncake over TCP; kvbridge over its own tcp transport, or with
``--kvbridge-transport mooncake`` over Mooncake's transfer engine, the same engine SGLang's
backend drives), a tiny random Qwen3 in float32, SGLang's router (mini-lb) in
front. Servers sleep when idle (``--sleep-on-idle``), so the deployment not being measured
leaves the cores to the one that is. Once all are healthy, ``--warmup`` untimed requests to
each, then ``--repeat`` rounds: in each, for each prompt length, one ``/generate`` through each
backend's router for one token, the backends in turn (A-B in even rounds, B-A in odd ones), the
same prompt to both: the wall time from the client's request to the answer is the TTFT of a
disaggregated request (prefill, KV hand-over, the decode's first step). Every round's prompts
are distinct from their first token on (no radix-cache hit). Printed: a markdown table of each
backend's median TTFT and its interquartile range per length, kvbridge / mooncake as a ratio of
the medians, whether the two ranges overlap (then the spread covers the difference: read the
ratio as noise), the median of kvbridge's TTFT over Mooncake's round by round (the same prompt)
with its 95% bootstrap interval ("level" where it holds 1), and whether both answered the same
tokens.

``--optimistic-prefill N`` starts both prefill servers with SGLang's
``--optimistic-prefill-attempts N``: the prefill computes a request before the decode's
metadata arrived (SGLang keeps the forward's pages and sends them once it has), so the
bootstrap is no longer on the request's path, for both backends alike.

The SGLang venv's python: ``KVBRIDGE_SGLANG_PY``, else what ``scripts/sglang_env.sh`` builds or
reuses (its last stdout line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from _phases import (
    Totals,
    budget,
    median_ms,
    phases_after,
    read,
    settled,
    settled_phases,
    spent,
)
from _spread import Paired, Spread

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


# The stage each server ends a request with: both are counted once it is.
LAST_STAGE = {"prefill": "prefill_transfer_kv_cache", "decode": "decode_transferred"}


class Pair:
    """One backend's deployment: prefill (core 0), decode (core 1), router."""

    def __init__(
        self,
        python: Path,
        work: Path,
        model: Path,
        backend: str,
        transport: str = "tcp",
        args: tuple[str, ...] = (),
        src: Path | None = None,
        prefill_args: tuple[str, ...] = (),
    ) -> None:
        """``src``: a kvbridge source tree (a ``git worktree`` of another commit) the servers
        import instead of the installed one: kvbridge before and after a change, side by side."""
        work.mkdir(parents=True, exist_ok=True)
        self.backend = backend
        self.label = backend if src is None else f"{backend}@{src.name}"
        # kvbridge's per-phase histograms of each server, on a port of its own.
        self.metrics = (
            {"prefill": launch.free_port(), "decode": launch.free_port()}
            if backend == "kvbridge"
            else {}
        )

        def serve(mode: Literal["prefill", "decode"], core: str) -> Server:
            env = (
                {
                    "KVBRIDGE_METRICS_PORT": str(self.metrics[mode]),
                    "KVBRIDGE_SGLANG_TRANSPORT": transport,
                }
                if self.metrics
                else {}
            ) | ({"PYTHONPATH": str(src / "src")} if src else {})
            return launch.serve(
                python,
                work,
                mode,
                model,
                mode=mode,
                backend=backend,
                core=core,
                env=env,
                args=("--enable-metrics", *args, *(prefill_args if mode == "prefill" else ())),
            )

        self.prefill = serve("prefill", "0")
        self.decode = serve("decode", "1")
        self.router = launch.router(python, work, self.prefill, self.decode)
        self.servers = (self.prefill, self.decode, self.router)

    def settled_stages(self) -> Totals | None:
        """SGLang's stage totals once both servers counted the same requests' last stages."""
        return settled(self.stage_seconds, [f"{s}.{stage}" for s, stage in LAST_STAGE.items()])

    def stage_seconds(self) -> Totals:
        """SGLang's seconds so far in each stage of its disaggregated requests, summed over
        requests (``server.stage``), and how many requests each stage counted."""
        pages = {s.name: f"{s.url}/metrics" for s in (self.prefill, self.decode)}
        return read(pages, "sglang:per_stage_req_latency_seconds", "stage")

    def stages_after(self, before: Totals) -> dict[str, float] | None:
        """Each stage's seconds in the request that just ended, once both servers counted it."""
        return spent(
            self.stage_seconds,
            before,
            lambda count: all(
                count.get(f"{side}.{stage}", 0.0) > before[1].get(f"{side}.{stage}", 0.0)
                for side, stage in LAST_STAGE.items()
            ),
        )

    def request(self, ids: list[int], timeout: float) -> tuple[float, int]:
        try:
            return request(self.router, ids, timeout)
        except (RuntimeError, OSError) as e:
            tails = "\n".join(f"--- {s.name} ({s.log}):\n{s.tail()}" for s in self.servers)
            raise RuntimeError(f"{self.backend}: {type(e).__name__}: {e}\n{tails}") from None


def measure(pairs: list[Pair], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The rounds, interleaved: each backend's TTFTs and first tokens by prompt length."""
    seed = 0
    for _ in range(args.warmup):
        for pair in pairs:
            pair.request(prompt(max(args.lengths), seed), args.timeout)
        seed += 1
    out: dict[str, dict[str, Any]] = {
        p.backend: {
            what: {n: [] for n in args.lengths} for what in ("ttft_s", "tokens", "phases", "stages")
        }
        for p in pairs
    }
    for r in range(args.repeat):
        for n in args.lengths:
            ids = prompt(n, seed)
            seed += 1
            for pair in pairs if r % 2 == 0 else pairs[::-1]:
                before = settled_phases(pair.metrics) if pair.metrics else None
                stages = pair.settled_stages()
                took, token = pair.request(ids, args.timeout)
                out[pair.backend]["ttft_s"][n].append(took)
                out[pair.backend]["tokens"][n].append(token)
                # Outside the timed window; a request not counted everywhere is left out.
                if stages is not None and (spent_in := pair.stages_after(stages)) is not None:
                    out[pair.backend]["stages"][n].append(spent_in)
                if before is not None and (phases := phases_after(pair.metrics, before)):
                    out[pair.backend]["phases"][n].append(phases)
    return out


def table(lengths: list[int], results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| prompt tokens | kvbridge median ms (IQR) | mooncake median ms (IQR) "
        "| kvbridge / mooncake (medians) | ranges overlap | paired ratio (95% CI) | same tokens |",
        "| ---: | ---: | ---: | ---: | :---: | ---: | :---: |",
    ]
    for n in lengths:
        mine, other = (results[b]["ttft_s"][n] for b in BACKENDS)
        ours, theirs = Spread.of(mine), Spread.of(other)
        overlap = "yes" if ours.overlaps(theirs) else "no"
        ratio = ours.median / theirs.median
        paired = Paired.of([[pair] for pair in zip(mine, other, strict=True)])  # round by round
        same = results["kvbridge"]["tokens"][n] == results["mooncake"]["tokens"][n]
        lines.append(
            f"| {n} | {ours.ms()} | {theirs.ms()} | {ratio:.2f} | {overlap} | {paired} | {same} |"
        )
    return "\n".join(lines)


def stage_table(lengths: list[int], results: dict[str, dict[str, Any]]) -> str:
    """SGLang's own stages (median ms over the rounds), each backend beside the other."""
    seen = {k for b in BACKENDS for n in lengths for d in results[b]["stages"][n] for k in d}
    rows = sorted(seen, key=lambda k: (not k.startswith("prefill"), k))
    lines = [
        "| stage | " + " | ".join(f"{n} tokens: {b}" for n in lengths for b in BACKENDS) + " |",
        "| --- | " + " | ".join("---:" for _ in lengths for _ in BACKENDS) + " |",
    ]
    for k in rows:
        cells = [median_ms(results[b]["stages"][n], k) for n in lengths for b in BACKENDS]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,512,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--repeat", type=int, default=10, help="rounds (a request per length each)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed requests first")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a request may take")
    ap.add_argument("--start-timeout", type=float, default=420, help="seconds to turn healthy")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--out", type=Path, default=None, help="logs here (default: a temp dir)")
    ap.add_argument(
        "--kvbridge-transport",
        choices=("tcp", "mooncake"),
        default="tcp",
        help="kvbridge's transport (KVBRIDGE_SGLANG_TRANSPORT): its own tcp, or Mooncake's "
        "transfer engine over TCP, the engine SGLang's own backend drives",
    )
    ap.add_argument(
        "--optimistic-prefill",
        type=int,
        default=0,
        metavar="N",
        help="both prefill servers compute before the decode's metadata arrives "
        "(SGLang's --optimistic-prefill-attempts N; 0: SGLang's default, they wait for it)",
    )
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.tokens.split(",")]
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
    optimistic = (
        ("--optimistic-prefill-attempts", str(args.optimistic_prefill))
        if args.optimistic_prefill
        else ()
    )
    t0 = time.perf_counter()
    pairs: list[Pair] = []
    with contextlib.ExitStack() as stack:
        for backend in BACKENDS:
            pair = Pair(
                python,
                work / backend,
                model,
                backend,
                args.kvbridge_transport,
                prefill_args=optimistic,
            )
            stack.enter_context(launch.killed_after(*pair.servers))
            pairs.append(pair)
        # The routers' /health answers at once: the pairs' say the routes are ready.
        launch.wait_healthy([s for p in pairs for s in p.servers], args.start_timeout)
        start_s = time.perf_counter() - t0
        try:
            results = measure(pairs, args)
        except RuntimeError as e:
            print(f"failed: {e}", file=sys.stderr)
            return 1
    print(table(args.lengths, results))
    print()
    print("SGLang's own stages of each request, median ms (--enable-metrics):")
    print(stage_table(args.lengths, results))
    print()
    print("kvbridge's phases, median ms a request (the time since the phase before it):")
    print(budget(args.lengths, results["kvbridge"]["phases"]))
    print()
    print(f"kvbridge's transport: {args.kvbridge_transport}")
    print(f"optimistic prefill attempts (both prefills): {args.optimistic_prefill}")
    print(f"both deployments' start (launch to healthy, routers included): {start_s:.1f} s")
    print(f"logs: {work}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "lengths": args.lengths,
                    "repeat": args.repeat,
                    "warmup": args.warmup,
                    "interleaved": True,
                    "kvbridge_transport": args.kvbridge_transport,
                    "optimistic_prefill": args.optimistic_prefill,
                    "backends": results,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
