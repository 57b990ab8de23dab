"""Fuzz every decoder of outside input (kvbridge.chaos.fuzz.TARGETS) for a while and report how
many inputs each took.

    python benchmarks/fuzz.py [--seconds 60] [--target NAME ...] [--json]

Each target runs in a process of its own, coverage-guided by atheris (libFuzzer over
kvbridge's Python code, instrumented on import) where atheris is installed (``pip install
'kvbridge[fuzz]'``); without it, by random mutation of the target's valid inputs, and the
report says which. An input counts where it is of the decoder's kind (the JSON decoders take
JSON); any exception other than a KVBridgeError is a finding: the process stops there, and
the report shows the input and the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _worker(name: str, seconds: float, out: Path) -> None:
    try:
        import atheris
    except ImportError:
        atheris = None
    if atheris is not None:
        with atheris.instrument_imports(include=["kvbridge"]):
            from kvbridge.chaos import fuzz
    else:
        from kvbridge.chaos import fuzz
    target = {t.name: t for t in fuzz.TARGETS}[name]
    counts = {"runs": 0, "inputs": 0, "engine": "atheris" if atheris else "random mutation"}
    end = time.monotonic() + seconds

    def finish(finding: dict[str, str] | None = None) -> None:
        out.write_text(json.dumps({**counts, "finding": finding}))
        os._exit(0)

    def one(data: bytes) -> None:
        counts["runs"] += 1
        try:
            counts["inputs"] += fuzz.run(target, data)
        except Exception:
            finish({"input": data[:2000].hex(), "traceback": traceback.format_exc()[-3000:]})
        if time.monotonic() > end:
            finish()

    if atheris is not None:
        with tempfile.TemporaryDirectory() as corpus:
            for i, seed in enumerate(target.seeds):
                Path(corpus, f"seed{i}").write_bytes(seed)
            atheris.Setup([sys.argv[0], corpus, "-max_len=4096"], one)
            atheris.Fuzz()
    rng = random.Random(0)
    while True:
        data = bytearray(rng.choice(target.seeds))
        for _ in range(rng.randint(1, 8)):
            at = rng.randint(0, len(data))
            op = rng.randrange(4)
            if op == 0 and at < len(data):
                data[at] ^= 1 << rng.randrange(8)
            elif op == 1:
                data[at:at] = rng.randbytes(rng.randint(1, 16))
            elif op == 2:
                del data[at : at + rng.randint(1, 16)]
            else:
                data[at:at] = data[at : at + rng.randint(1, 64)]
        one(bytes(data))


def main() -> None:
    from kvbridge.chaos.fuzz import TARGETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="per target")
    ap.add_argument("--target", action="append", choices=[t.name for t in TARGETS])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.seconds, args.out)
        return
    rows = []
    for t in TARGETS:
        if args.target and t.name not in args.target:
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            done = subprocess.run(
                [sys.executable, __file__, "--worker", t.name, "--seconds", str(args.seconds)]
                + ["--out", out.name],
                capture_output=True,
                text=True,
                timeout=args.seconds + 120,
            )
            text = Path(out.name).read_text()
        if not text:
            raise SystemExit(f"{t.name}: the fuzzer died: {done.stderr[-3000:]}")
        rows.append({"target": t.name, "what": t.what, **json.loads(text)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'decoder':14} {'inputs':>10} {'runs':>10}  engine, {args.seconds:.0f} s each")
    for r in rows:
        print(f"{r['target']:14} {r['inputs']:>10,} {r['runs']:>10,}  {r['engine']}")
    for r in rows:
        if r["finding"]:
            print(f"\nFINDING in {r['target']} ({r['what']}): input {r['finding']['input']}")
            print(r["finding"]["traceback"])
    if any(r["finding"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
