"""The README's TP 2 -> TP 1 vLLM deployment, cold, with kvbridge's default settings.

    "$(bash scripts/vllm_env.sh | tail -n 1)" benchmarks/vllm_cold_start.py [--at-once] [--out DIR]

A TP 2 prefill server (a core per worker, OpenMP waiting passively) and a TP 1 decode server
(unbound), a tiny random Llama, block 64 -> 32, behind ``kvbridge proxy`` (``--at-once``: both
legs at once). No ``KVBRIDGE_*`` variable is set. As soon as the three are healthy, six
requests of 60-260 tokens go at once; printed: each one's status and seconds, and how many
failed (with the reason, which names the setting to raise where a deadline passed).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import tempfile
import time
from pathlib import Path

from kvbridge.integrations.vllm import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_connectors import tiny_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--at-once", action="store_true", help="the proxy sends both legs at once")
    ap.add_argument("--out", type=Path, help="keep the servers' logs here")
    args = ap.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="kvbridge-cold-"))
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_model(work)
    python = Path(sys.executable)
    common = [str(model), "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    port = launch.free_port()
    pre = launch.start(
        python,
        work,
        "prefill",
        [
            *common,
            "--block-size",
            "64",
            "-tp",
            "2",
            "--kv-transfer-config",
            launch.kvbridge_config("kv_producer", port),
        ],
        {"VLLM_CPU_OMP_THREADS_BIND": "0|1", **passive},
    )
    dec = launch.start(
        python,
        work,
        "decode",
        [
            *common,
            "--block-size",
            "32",
            "--kv-transfer-config",
            launch.kvbridge_config("kv_consumer"),
        ],
        {"VLLM_CPU_OMP_THREADS_BIND": "nobind", **passive},
    )
    legs = ["proxy", "--prefill", pre.url, "--decode", dec.url]
    if args.at_once:
        legs += ["--prefill-bootstrap", f"127.0.0.1:{port}"]
    proxy = launch.start(python, work, "proxy", legs)
    try:
        t0 = time.monotonic()
        launch.wait_healthy([pre, dec, proxy])
        print(f"healthy after {time.monotonic() - t0:.0f} s; logs in {work}", flush=True)
        prompts = [[(7 * i + k) % 500 + 4 for i in range(60 + 40 * k)] for k in range(6)]

        def one(prompt: list[int]) -> tuple[int, float, str]:
            t = time.monotonic()
            status, answer = launch.post(
                f"{proxy.url}/v1/completions",
                {"model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0},
                timeout=300,
            )
            return status, time.monotonic() - t, "" if status == 200 else str(answer)[:300]

        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(one, prompts))
        for (status, seconds, why), prompt in zip(got, prompts, strict=True):
            print(f"{len(prompt):4d} tokens: {status} in {seconds:.1f} s {why}")
        failed = sum(status != 200 for status, _, _ in got)
        print(f"failed: {failed} of {len(got)}")
        for line in dec.log.read_text(errors="replace").splitlines():
            if "KV load failed" in line:
                print(line)
        return 1 if failed else 0
    finally:
        for s in (pre, dec, proxy):
            s.kill()


if __name__ == "__main__":
    sys.exit(main())
