"""kvbridge's vLLM connector under load, beside vLLM's NixlConnector, on one deployment, one run.

    "$(bash scripts/vllm_env.sh | tail -n 1)" benchmarks/vllm_serving.py \
        [--rates 1,2,4] [--prompts 32] [--nixl-poll-us US] [--out DIR]

The deployment of ``benchmarks/vllm_connectors.py`` (a prefill and a decode server of vLLM's
CPU build, a tiny random Llama in float32, block 32, a core per engine, behind ``kvbridge
proxy``), once per connector. Against each way to serve (kvbridge one leg after the other,
kvbridge with both legs at once, NixlConnector), vLLM's own load generator, ``vllm bench
serve``, sends ``--prompts`` random prompts of 256-4096 tokens (32 tokens out, streamed) at each
request rate (Poisson arrivals, seed 0: the same prompts and arrival times for every way).
``--nixl-poll-us`` adds NixlConnector with NIXL's progress thread waiting between its looks
(``benchmarks/vllm_connectors.py`` says why). Printed: TTFT p50/p99, inter-token latency
p50/p99, output tokens/s and completed requests per way and rate, and each other way's p99
TTFT and throughput over NixlConnector's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kvbridge.integrations.vllm import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_connectors import (  # noqa: E402
    add_nixl_poll_option,
    connectors,
    deployment,
    label,
    tiny_model,
)

INPUT, RANGE, OUTPUT = 2176, 0.8824, 32  # prompts of 256..4096 tokens


def bench(
    python: Path, proxy: launch.Server, model: Path, rate: float, prompts: int, out: Path
) -> dict[str, float]:
    """One ``vllm bench serve`` run; its summary."""
    subprocess.run(
        [
            str(python),
            "-m",
            "vllm.entrypoints.cli.main",
            "bench",
            "serve",
            "--backend",
            "vllm",
            "--base-url",
            proxy.url,
            "--endpoint",
            "/v1/completions",
            "--model",
            str(model),
            "--tokenizer",
            str(model),
            "--dataset-name",
            "random",
            "--random-input-len",
            str(INPUT),
            "--random-range-ratio",
            str(RANGE),
            "--random-output-len",
            str(OUTPUT),
            "--ignore-eos",
            "--num-prompts",
            str(prompts),
            "--request-rate",
            str(rate),
            "--seed",
            "0",
            "--percentile-metrics",
            "ttft,itl",
            "--metric-percentiles",
            "50,99",
            "--save-result",
            "--result-dir",
            str(out.parent),
            "--result-filename",
            out.name,
            "--disable-tqdm",
        ],
        check=True,
        capture_output=True,
        timeout=900,
    )
    got: dict[str, float] = json.loads(out.read_text())
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1,2,4", help="requests per second, comma-separated")
    ap.add_argument("--prompts", type=int, default=32, help="requests per rate")
    ap.add_argument("--out", type=Path, default=None, help="logs and results here")
    add_nixl_poll_option(ap)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    work = args.out or Path(tempfile.mkdtemp(prefix="kvbridge-vllm-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    python = Path(sys.executable)
    model = tiny_model(work)
    # Random weights: a longer context is as valid as the default one (prompts up to 4096).
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (model / "config.json").write_text(json.dumps(config))
    results: dict[tuple[str, float], dict[str, float]] = {}
    names = connectors(args.nixl_poll_us)
    for name in names:
        servers, proxies = deployment(
            python, work, model, name, max_model_len=4608, nixl_poll_us=args.nixl_poll_us
        )
        try:
            for way, proxy in proxies.items():
                # A first request: NixlConnector's first handshake takes ~30 s here.
                launch.post(
                    f"{proxy.url}/v1/completions",
                    {"model": str(model), "prompt": [5] * 64, "max_tokens": 2},
                    timeout=300,
                )
                for rate in rates:
                    tag = way.replace(", ", "-").replace(" ", "-")
                    results[(way, rate)] = bench(
                        python, proxy, model, rate, args.prompts, work / f"{tag}-{rate}.json"
                    )
        except (subprocess.CalledProcessError, OSError) as e:
            print(f"{name}: failed: {e}", file=sys.stderr)
            return 1
        finally:
            for s in servers:
                s.kill()
    ways = ["kvbridge", "kvbridge, at once", *names[1:]]
    print(
        "| way | rate (req/s) | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | output tok/s "
        "| completed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for rate in rates:
        for way in ways:
            r = results[(way, rate)]
            print(
                f"| {label(way, args.nixl_poll_us)} | {rate:g} | "
                f"{r['p50_ttft_ms']:.0f} ms | {r['p99_ttft_ms']:.0f} ms | "
                f"{r['p50_itl_ms']:.1f} ms | {r['p99_itl_ms']:.1f} ms | "
                f"{r['output_throughput']:.0f} | {r['completed']}/{args.prompts} |"
            )
    print()
    print("| rate | way | p99 TTFT / NixlConnector's | throughput / NixlConnector's |")
    print("|---|---|---|---|")
    for rate in rates:
        nixl = results[("nixl", rate)]
        for way in (w for w in ways if w != "nixl"):
            r = results[(way, rate)]
            p99 = r["p99_ttft_ms"] / nixl["p99_ttft_ms"]
            tps = r["output_throughput"] / nixl["output_throughput"]
            print(f"| {rate:g} | {label(way, args.nixl_poll_us)} | {p99:.2f} | {tps:.2f} |")
    print(f"logs and results: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
