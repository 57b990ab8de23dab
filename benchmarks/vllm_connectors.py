"""kvbridge's vLLM connector beside vLLM's own NixlConnector, on the same machine, one run.

    "$(bash scripts/vllm_env.sh | tail -n 1)" benchmarks/vllm_connectors.py \
        [--tokens 256,1024] [--requests 8] [--out DIR]

For each connector in turn, a prefill server and a decode server (vLLM's CPU build, a tiny
random Llama in float32, block 32 on both: NixlConnector needs equal block sizes; a core per
engine) run behind
``kvbridge proxy`` (the request flow is vLLM's disaggregated one, so the one proxy serves both).
kvbridge runs a second way too: a proxy told the prefill's bootstrap service sends both legs at
once, and the prefill streams each layer as its forward computes it ("kvbridge, at once").
Then, for each prompt length, ``--requests`` sequential requests for one token each: the time
from the client's request to the answer is the TTFT of a disaggregated request (prefill, KV
hand-over, the decode's first step); the same prompts for 8 tokens check that every way
produces the same tokens as an undisturbed instance. Printed: median TTFT per way and length,
and each kvbridge way / NixlConnector as a ratio of the medians of this run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvbridge.integrations.vllm import launch

ROOT = Path(__file__).resolve().parents[1]


def deployment(
    python: Path, work: Path, model: Path, name: str, max_model_len: int = 2048
) -> tuple[list[launch.Server], dict[str, launch.Server]]:
    """The servers, and the proxy of each way to serve through them."""
    common = [
        str(model),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        "32",
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
    else:
        pre_cfg, dec_cfg = launch.nixl_config("kv_producer"), launch.nixl_config("kv_consumer")
        for env in (env_p, env_d):
            env.update(
                VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(launch.free_port()),
            )
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


def measure(
    pre: launch.Server, proxy: launch.Server, model: Path, lengths: list[int], requests: int
) -> tuple[dict[int, list[float]], dict[int, list[int]]]:
    ttft: dict[int, list[float]] = {}
    tokens: dict[int, list[int]] = {}
    for n in lengths:
        body = {"model": str(model), "max_tokens": 1, "temperature": 0}
        launch.post(f"{proxy.url}/v1/completions", dict(body, prompt=prompt(n, 999)))  # warm
        ttft[n] = []
        for i in range(requests):
            t0 = time.perf_counter()
            status, got = launch.post(
                f"{proxy.url}/v1/completions", dict(body, prompt=prompt(n, i)), timeout=60
            )
            ttft[n].append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"{n} tokens: {got}")
        status, got = launch.post(
            f"{proxy.url}/v1/completions",
            {
                "model": str(model),
                "prompt": prompt(n, 12345),
                "max_tokens": 8,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        _, want = launch.post(
            f"{pre.url}/v1/completions",
            {
                "model": str(model),
                "prompt": prompt(n, 12345),
                "max_tokens": 8,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        tokens[n] = got["choices"][0]["token_ids"]
        if tokens[n] != want["choices"][0]["token_ids"]:
            raise RuntimeError(
                f"{n} tokens: disaggregated {tokens[n]} != undisturbed "
                f"{want['choices'][0]['token_ids']}"
            )
    return ttft, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="256,1024")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="logs here (default: a temp dir)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    work = args.out or Path(tempfile.mkdtemp(prefix="kvbridge-vllm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    python = Path(sys.executable)
    model = tiny_model(work)
    results = {}
    for name in ("kvbridge", "nixl"):
        servers, proxies = deployment(python, work, model, name)
        try:
            for way, proxy in proxies.items():
                results[way] = measure(servers[0], proxy, model, lengths, args.requests)
        except (RuntimeError, OSError) as e:  # say what failed
            print(f"{name}: failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        finally:
            for s in servers:
                s.kill()
    ways = ["kvbridge", "kvbridge, at once"]
    print(
        f"{'prompt tokens':>14} | "
        + " | ".join(f"{w + ' TTFT':>23}" for w in ways)
        + f" | {'NixlConnector TTFT':>18} | "
        + " | ".join(f"{w + ' / Nixl':>24}" for w in ways)
        + " | same tokens"
    )
    for n in lengths:
        nixl = statistics.median(results["nixl"][0][n])
        ours = [statistics.median(results[w][0][n]) for w in ways]
        same = all(results[w][1][n] == results["nixl"][1][n] for w in ways)
        print(
            f"{n:>14} | "
            + " | ".join(f"{t * 1e3:>20.1f} ms" for t in ours)
            + f" | {nixl * 1e3:>15.1f} ms | "
            + " | ".join(f"{t / nixl:>24.2f}" for t in ours)
            + f" | {same}"
        )
    print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
