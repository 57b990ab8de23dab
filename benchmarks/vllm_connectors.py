"""kvbridge's vLLM connector beside vLLM's own NixlConnector, on the same machine, one run,
alternating.

    "$(bash scripts/vllm_env.sh | tail -n 1)" benchmarks/vllm_connectors.py \
        [--tokens 256,1024,2000] [--blocks N] [--rounds 4] [--nixl-poll-us US] [--out DIR]

For each connector, a prefill server and a decode server (vLLM's CPU build, a tiny random Llama
in float32, block 32 on both: NixlConnector needs equal block sizes; the prefill engine on core
0, the decode engine on core 1) behind ``kvbridge proxy`` (the request flow is vLLM's
disaggregated one, so the one proxy serves both). kvbridge runs a second way too: a proxy told
the prefill's bootstrap service sends both legs at once, and the prefill streams each layer as
its forward computes it ("kvbridge, at once").

One deployment is up at a time: an idle NixlConnector deployment keeps this 2-core machine busy
(NIXL's UCX progress thread in each vLLM worker polls without waiting, a core each: measured,
docs/benchmarks.md), so the other deployment cannot be measured beside it. ``--nixl-poll-us``
adds a third connector, NixlConnector with that thread waiting up to that long for an event
between its looks (``nixl_poll/sitecustomize.py``). The connectors alternate in ``--blocks``
blocks (kvbridge, NIXL, NIXL, kvbridge; with three, A B C C B A; repeated): each block
starts its deployment, warms it with a request per way and length, runs ``--rounds`` rounds (in
each, for each prompt length, one request for one token through each of its ways, their order
rotating), checks that each way's 8 tokens for one prompt per length equal an undisturbed
instance's, and stops it. Every block sends the same prompts. The time from the client's request
to the answer is the TTFT of a disaggregated request (prefill, KV hand-over, the decode's first
step). Printed: each way's median TTFT and its interquartile range per length over every block,
each kvbridge way / NixlConnector as a ratio of the medians, and whether their ranges overlap
(then the spread covers the difference); and kvbridge's phases of each request on both sides
(its servers' metrics, ``KVBRIDGE_METRICS_PORT``, read outside the timed window: ``_phases.py``),
median ms per way and length.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _phases import budget, phases_after, settled_phases
from _spread import Spread

from kvbridge.integrations.vllm import launch

ROOT = Path(__file__).resolve().parents[1]


# Put first on a NixlConnector server's PYTHONPATH: NIXL's progress thread waits between looks.
NIXL_POLL = Path(__file__).resolve().parent / "nixl_poll"


def connectors(nixl_poll_us: int) -> list[str]:
    """The deployments to measure: kvbridge's, NixlConnector's, and with ``nixl_poll_us``
    NixlConnector's with NIXL's progress thread waiting."""
    return ["kvbridge", "nixl"] + (["nixl-poll"] if nixl_poll_us else [])


def add_nixl_poll_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--nixl-poll-us",
        type=int,
        default=0,
        help="also NixlConnector with NIXL's progress thread waiting up to this long between "
        "looks (its own way spins a core a worker)",
    )


def label(way: str, nixl_poll_us: int) -> str:
    """How the tables name a way."""
    return {
        "nixl": "NixlConnector",
        "nixl-poll": f"NixlConnector, {nixl_poll_us} us waits",
    }.get(way, way)


def deployment(
    python: Path,
    work: Path,
    model: Path,
    name: str,
    max_model_len: int = 2048,
    nixl_poll_us: int = 1000,
    metrics: dict[str, int] | None = None,
) -> tuple[list[launch.Server], dict[str, launch.Server]]:
    """The servers, and the proxy of each way to serve through them. ``name``: "kvbridge",
    "nixl", or "nixl-poll": NixlConnector with NIXL's progress thread waiting up to
    ``nixl_poll_us`` for an event between its looks instead of none (``nixl_poll/``).
    ``metrics``: the ports kvbridge's prefill and decode serve their metrics on (its phases)."""
    common = [
        str(model),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        "32",
        # Off: kvbridge's two ways share one deployment and are sent the same prompt in a round,
        # and a load test replays its prompts at each rate; a prefix cache would serve all but
        # the first from its blocks (the prefill's forward and the transfer both skipped).
        "--no-enable-prefix-caching",
    ]
    # A core per engine, as the README advises for engines sharing a host, for both
    # connectors alike (unbound, NixlConnector's TTFT was ~1.3 s: its threads starve behind
    # the other engine's spinning OpenMP threads).
    env_p = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    env_d = {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    bootstrap = launch.free_port()
    if name == "kvbridge":
        pre_cfg = launch.kvbridge_config("kv_producer", bootstrap)
        dec_cfg = launch.kvbridge_config("kv_consumer")
        if metrics:
            env_p["KVBRIDGE_METRICS_PORT"] = str(metrics["prefill"])
            env_d["KVBRIDGE_METRICS_PORT"] = str(metrics["decode"])
    else:
        pre_cfg, dec_cfg = launch.nixl_config("kv_producer"), launch.nixl_config("kv_consumer")
        for env in (env_p, env_d):
            env.update(
                VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(launch.free_port()),
            )
            if name == "nixl-poll":
                path = os.pathsep.join(filter(None, [str(NIXL_POLL), os.environ.get("PYTHONPATH")]))
                env.update(PYTHONPATH=path, KVBRIDGE_BENCH_NIXL_POLL_US=str(nixl_poll_us))
    pre = launch.start(
        python, work, f"{name}-prefill", [*common, "--kv-transfer-config", pre_cfg], env_p
    )
    dec = launch.start(
        python, work, f"{name}-decode", [*common, "--kv-transfer-config", dec_cfg], env_d
    )
    legs = ["proxy", "--prefill", pre.url, "--decode", dec.url]
    proxies = {name: launch.start(python, work, f"{name}-proxy", legs)}
    if name == "kvbridge":
        proxies["kvbridge, at once"] = launch.start(
            python,
            work,
            f"{name}-proxy-at-once",
            [*legs, "--prefill-bootstrap", f"127.0.0.1:{bootstrap}"],
        )
    servers = [pre, dec, *proxies.values()]
    try:
        launch.wait_healthy(servers)
    except BaseException:
        for s in servers:
            s.kill()
        raise
    return servers, proxies


def tiny_model(work: Path) -> Path:
    """The tiny random Llama the benchmarks serve, written under ``work``."""
    model = work / "tiny-llama"
    subprocess.run(
        [sys.executable, str(ROOT / "tests/vllm_model.py"), str(model)],
        check=True,
        capture_output=True,
    )
    return model


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 500 + 4 for i in range(n)]


def completion(url: str, model: Path, ids: list[int], max_tokens: int) -> list[int]:
    status, got = launch.post(
        f"{url}/v1/completions",
        {
            "model": str(model),
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        },
        timeout=120,
    )
    if status != 200:
        raise RuntimeError(f"{len(ids)} tokens through {url}: {got}")
    return list(got["choices"][0]["token_ids"])


def measure(
    proxies: dict[str, launch.Server],
    model: Path,
    lengths: list[int],
    rounds: int,
    ttft: dict[str, dict[int, list[float]]],
    phases: dict[str, dict[int, list[dict[str, float]]]],
    metrics: dict[str, int] | None = None,
) -> None:
    """Each way's TTFTs by length into ``ttft``, the ways interleaved (their order rotating each
    round), after a warm-up request per way and length; with ``metrics`` (the deployment's
    kvbridge metrics ports), each request's kvbridge phases into ``phases``, read outside the
    timed window."""
    ways = list(proxies)
    for n in lengths:
        for way in ways:  # warm: NixlConnector's first handshake takes ~30 s here
            completion(proxies[way].url, model, prompt(n, 999), 1)
    for r in range(rounds):
        for n in lengths:
            ids = prompt(n, r * len(lengths) + lengths.index(n))
            for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
                before = settled_phases(metrics) if metrics else None
                t0 = time.perf_counter()
                completion(proxies[way].url, model, ids, 1)
                ttft.setdefault(way, {}).setdefault(n, []).append(time.perf_counter() - t0)
                spent = phases_after(metrics, before) if metrics and before else None
                if spent is not None:
                    phases.setdefault(way, {}).setdefault(n, []).append(spent)


def check_tokens(
    pre: launch.Server, proxies: dict[str, launch.Server], model: Path, lengths: list[int]
) -> None:
    """Every way's 8 tokens equal an undisturbed instance's (the prefill server's own)."""
    for n in lengths:
        want = completion(pre.url, model, prompt(n, 12345), 8)
        for way, proxy in proxies.items():
            got = completion(proxy.url, model, prompt(n, 12345), 8)
            if got != want:
                raise RuntimeError(f"{way}, {n} tokens: {got} != undisturbed {want}")


def table(lengths: list[int], ttft: dict[str, dict[int, list[float]]], nixl_poll_us: int) -> str:
    ours = [w for w in ttft if w != "nixl"]
    names = [label(w, nixl_poll_us) for w in ours]
    lines = [
        "| prompt tokens | "
        + " | ".join(f"{w} ms (IQR)" for w in (*names, "NixlConnector"))
        + " | "
        + " | ".join(f"{w} / NixlConnector (ranges overlap)" for w in names)
        + " |",
        "| ---: |" + " ---: |" * (2 * len(ours) + 1),
    ]
    for n in lengths:
        theirs = Spread.of(ttft["nixl"][n])
        mine = [Spread.of(ttft[w][n]) for w in ours]
        cells = [m.ms() for m in (*mine, theirs)]
        ratios = [
            f"{m.median / theirs.median:.2f} ({'yes' if m.overlaps(theirs) else 'no'})"
            for m in mine
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="256,1024,2000")
    ap.add_argument(
        "--blocks",
        type=int,
        default=0,
        help="deployments started, the connectors alternating: a multiple of twice their "
        "number (default: twice their number)",
    )
    ap.add_argument("--rounds", type=int, default=4, help="rounds a block")
    ap.add_argument("--out", type=Path, default=None, help="logs here (default: a temp dir)")
    add_nixl_poll_option(ap)
    args = ap.parse_args()
    names = connectors(args.nixl_poll_us)
    n = len(names)
    blocks = args.blocks or 2 * n
    if blocks <= 0 or blocks % (2 * n):
        ap.error(f"--blocks {blocks}: a multiple of {2 * n}, each connector as often early as late")
    lengths = [int(x) for x in args.tokens.split(",")]
    work = args.out or Path(tempfile.mkdtemp(prefix="kvbridge-vllm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    python = Path(sys.executable)
    model = tiny_model(work)
    ttft: dict[str, dict[int, list[float]]] = {}
    phases: dict[str, dict[int, list[dict[str, float]]]] = {}
    # A B B A (A B C C B A with three), repeated.
    order = [names[b % n] if (b // n) % 2 == 0 else names[n - 1 - b % n] for b in range(blocks)]
    for b, name in enumerate(order):
        block = work / f"block{b}"
        block.mkdir(exist_ok=True)
        ports = (
            {"prefill": launch.free_port(), "decode": launch.free_port()}
            if name == "kvbridge"
            else None
        )
        servers, proxies = deployment(
            python, block, model, name, nixl_poll_us=args.nixl_poll_us, metrics=ports
        )
        try:
            measure(proxies, model, lengths, args.rounds, ttft, phases, ports)
            check_tokens(servers[0], proxies, model, lengths)
        except (RuntimeError, OSError) as e:  # say what failed
            print(f"{name}, block {b}: failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        finally:
            for s in servers:
                s.kill()
    print(table(lengths, ttft, args.nixl_poll_us))
    print("same tokens as an undisturbed instance: every way, every length, every block")
    for way, by_length in phases.items():
        print(f"\nkvbridge's phases, {way}: median ms a request (time since the phase before)")
        print(budget(lengths, by_length))
    print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
