"""``kvbridge bench transfer`` runs end to end on a tiny shape and reports sane numbers."""

from __future__ import annotations

import math

from rich.console import Console

from kvbridge.bench.transfer import CASES, run_transfer_bench


def test_bench_transfer_reports_rows_with_bandwidth_and_latency() -> None:
    rows = run_transfer_bench(tokens=[256], layers=4, transports=["shm"], repeat=1, warmup=0,
                              console=Console(file=None, quiet=True))
    assert [r["case"] for r in rows] == [c.name for c in CASES]
    for r in rows:
        assert r["transport"] == "shm" and r["layers"] == 4 and r["bytes"] > 0
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["ratio"] > 0
        assert math.isfinite(r["latency_ms"])
