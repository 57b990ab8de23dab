"""The seeds' hybrid deployments through kvbridge's SGLang backend and through SGLang's own
Mooncake backend (over TCP): which outputs are right, one run.

    KVBRIDGE_SGLANG_PY=... python benchmarks/sglang_hybrid_backends.py \
        [--archs qwen3_next,nemotron_h] [--pairs 2:1,1:2] [--backends kvbridge,mooncake]

For each model (tests/sglang_hybrid_models.py: a tiny random Qwen3-Next with gated delta net,
a tiny random Nemotron-H with Mamba2, float32), each prefill:decode TP pair and each backend in
turn, a prefill and a decode server (SGLang's CPU build with the test-only stand-in kernels of
tests/sglang_standins/, pages of 16), six prompts of 3-300 tokens at once, both legs of each as
SGLang's router sends them; each answer is compared with transformers' own greedy ids for the
checkpoint (independent of SGLang and of both backends). Printed: a markdown table of prompts
exact / answered / asked per model, pair and backend, and what a failed request said.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvbridge.integrations.sglang import launch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from sglang_hybrid_models import HYBRID_ARGS, make_hybrid_model, reference_ids  # noqa: E402
from sglang_servers import PROMPTS  # noqa: E402

MAX_NEW = 12
ENV = {"qwen3_next": {"SGLANG_MAMBA_CONV_DTYPE": "float32"}, "nemotron_h": {}}


def cores(tp: int, side: str) -> str:
    return "0,1" if tp == 2 else ("0" if side == "prefill" else "1")


def run_pair(
    python: Path, work: Path, model: Path, arch: str, tps: tuple[int, int], backend: str
) -> list[tuple[int, dict[str, Any]]]:
    """Both servers of one deployment, every prompt at once; the answers."""
    work.mkdir(parents=True, exist_ok=True)
    common = {"model": model, "backend": backend, "page_size": 16, "env": ENV[arch]}
    pre = launch.serve(
        python,
        work,
        "prefill",
        mode="prefill",
        tp=tps[0],
        core=cores(tps[0], "prefill"),
        args=[*HYBRID_ARGS, "--chunked-prefill-size", "64"],
        **common,
    )
    dec = launch.serve(
        python,
        work,
        "decode",
        mode="decode",
        tp=tps[1],
        core=cores(tps[1], "decode"),
        args=list(HYBRID_ARGS),
        **common,
    )
    with launch.killed_after(pre, dec):
        launch.wait_healthy([pre, dec], 600)
        with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
            return list(ex.map(lambda p: launch.generate_pd(pre, dec, p, MAX_NEW, 300), PROMPTS))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default="qwen3_next,nemotron_h")
    ap.add_argument("--pairs", default="2:1,1:2", help="prefill TP:decode TP, comma-separated")
    ap.add_argument("--backends", default="kvbridge,mooncake")
    ap.add_argument("--out", type=Path, default=None, help="logs here (default: a temp dir)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.out or Path(tempfile.mkdtemp(prefix="kvbridge-sglang-hybrid-"))
    python = launch.sglang_python(ROOT)
    rows = [
        "| model | prefill TP -> decode TP | backend | exact / answered / asked | a failure said |"
    ]
    rows.append("|---|---|---|---|---|")
    for arch in args.archs.split(","):
        model = make_hybrid_model(python, work, arch)
        want = reference_ids(python, model, PROMPTS, MAX_NEW)
        for pair in args.pairs.split(","):
            tps = (int(pair.split(":")[0]), int(pair.split(":")[1]))
            for backend in args.backends.split(","):
                where = work / f"{arch}-{tps[0]}to{tps[1]}-{backend}"
                try:
                    got = run_pair(python, where, model, arch, tps, backend)
                except (RuntimeError, OSError) as e:
                    rows.append(f"| {arch} | {tps[0]} -> {tps[1]} | {backend} | - | {e} |")
                    continue
                ok = [s == 200 for s, _ in got]
                exact = sum(
                    s == 200 and launch.output_ids(a) == w
                    for (s, a), w in zip(got, want, strict=True)
                )
                said = next((str(a)[:120] for s, a in got if s != 200), "")
                rows.append(
                    f"| {arch} | {tps[0]} -> {tps[1]} | {backend} | "
                    f"{exact} / {sum(ok)} / {len(got)} | {said} |"
                )
                print(rows[-1], flush=True)
    print("\n".join(rows))
    print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
