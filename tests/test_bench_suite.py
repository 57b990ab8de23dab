"""``kvbridge bench`` (the suite) runs end to end on a tiny shape: measured rows for the
embedded transports (direct and staged), a skipped row with the reason for an engine that
cannot load."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from kvbridge import transports
from kvbridge.bench import suite
from kvbridge.bench.transfer import CASES
from kvbridge.errors import KVBridgeError


@pytest.mark.slow  # the whole benchmark suite over real transports: 8-10 s
def test_suite_measures_transports_and_records_unavailable_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = transports.unavailable

    def fake(name: str) -> str | None:
        return "nixl library made unavailable by the test" if name == "nixl" else real(name)

    monkeypatch.setattr(transports, "unavailable", fake)
    rows = suite.run_suite(
        tokens=[256],
        layers=2,
        transports=["shm", "tcp", "nixl", "bogus"],
        repeat=1,
        warmup=0,
        cases=CASES[:2],
        console=Console(file=None, quiet=True),
        quiet=True,
    )
    by: dict[tuple[str, str], dict[str, Any]] = {(r["case"], r["transport"]): r for r in rows}
    for case in CASES[:2]:
        assert by[case.name, "memcpy"]["gbps"] > 0
        for t in ("shm", "tcp"):
            r = by[case.name, t]
            assert r["status"] == "ok", r["status"]
            assert r["gbps"] > 0 and r["x_memcpy"] > 0 and r["bytes"] > 0
            assert r["descriptors"] >= r["runs"] >= 1
            # The staged column beside direct; auto stays direct at copy speed.
            assert r["staged_status"] == "ok" and r["staged_gbps"] > 0, r["staged_status"]
            assert r["staged_descriptors"] >= 1 and r["auto"] == "direct"
            assert r["auto_gbps"] == r["gbps"] and r["x_contiguous"] > 0
        # tcp beside plain sockets moving the same bytes (kvbridge.bench.rawtcp).
        raw = by[case.name, "raw tcp"]
        assert raw["status"] == "ok" and raw["gbps"] > 0, raw
        assert by[case.name, "tcp"]["x_raw"] == by[case.name, "tcp"]["gbps"] / raw["gbps"]
        assert (case.name, "raw shm") not in by
        nixl = by[case.name, "nixl"]
        assert nixl["status"] == "skipped: nixl library made unavailable by the test"
        assert "gbps" not in nixl and (case.name, "raw nixl") not in by
        assert by[case.name, "bogus"]["status"].startswith("skipped: unknown transport")
    # The table renders every row, failed or skipped ones included.
    out = Console(record=True, width=200, file=None)
    out.print(suite.table(rows, 1))
    assert "nixl library made unavailable" in out.export_text()


def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(KVBridgeError, match=r"pip install 'kvbridge\[bench\]'"):
        suite.require_matplotlib()
