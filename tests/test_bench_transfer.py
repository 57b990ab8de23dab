"""``kvbridge bench transfer`` runs end to end on a tiny shape and reports sane numbers."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from kvbridge.bench.transfer import CASES, run_transfer_bench
from process_group import members

pytestmark = pytest.mark.slow  # benchmarks over real transports: 2-3 s each


def test_bench_transfer_reports_rows_with_bandwidth_and_latency() -> None:
    rows = run_transfer_bench(
        tokens=[256],
        layers=4,
        transports=["shm"],
        repeat=1,
        warmup=0,
        console=Console(file=None, quiet=True),
    )
    assert [r["case"] for r in rows] == [c.name for c in CASES]
    for r in rows:
        assert r["transport"] == "shm" and r["layers"] == 4 and r["bytes"] > 0
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["ratio"] > 0
        assert math.isfinite(r["latency_ms"])


def test_memcpy_baselines_copy_every_byte_by_one_thread_and_by_two() -> None:
    """Each way of copying moves the whole buffer: flat, the destination equals the source;
    sliced, every token's 512-byte piece of every source sits where the sliced layout puts it;
    whether one thread copies or two (each its share). The limit is the better of the two."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from kvbridge.bench.memcpy import SLICE, SLICE_STRIDE, Memcpy

    m = Memcpy(5 * SLICE_STRIDE * 2 + 100)  # rounded down to whole tokens per thread
    ways = SLICE_STRIDE // SLICE
    try:
        assert m.nbytes == 5 * SLICE_STRIDE * 2
        src, dst = m._pool.view("src"), m._pool.view("dst")
        src[:] = np.arange(m.nbytes, dtype=np.uint64).astype(np.uint8) | 1  # no zero byte
        with ThreadPoolExecutor(2) as pool:
            for threads in (1, 2):
                dst[:] = 0
                m.copy(False, threads, pool)
                assert (dst == src).all(), threads
                dst[:] = 0
                m.copy(True, threads, pool)
                pieces = dst.reshape(-1, ways, SLICE).transpose(1, 0, 2)
                assert (pieces == src.reshape(ways, -1, SLICE)).all(), threads
        m.measure(1)
        assert min(m.flat, m.sliced, m.flat2, m.sliced2) > 0
        assert m.limit(False) == max(m.flat, m.flat2) and m.limit(True) == max(m.sliced, m.sliced2)
    finally:
        m.close()


def test_bench_layerwise_reports_both_ways_and_the_tail() -> None:
    from kvbridge.bench.layerwise import run_layerwise_bench

    rows = run_layerwise_bench(
        tokens=256,
        layers=4,
        layer_ms=2.0,
        transports=["shm"],
        repeat=1,
        warmup=0,
        console=Console(file=None, quiet=True),
    )
    (r,) = rows
    assert r["layers"] == 4 and r["bytes"] > 0 and r["layer_ms"] == 2.0
    for key in (
        "bulk_tail_ms",
        "layerwise_tail_ms",
        "one_layer_ms",
        "one_layer_alone_ms",
        "bulk_ttft_ms",
        "layerwise_ttft_ms",
    ):
        assert math.isfinite(r[key]) and r[key] > 0, key
    # the simulated forward (4 layers x 2 ms) is inside both TTFTs
    assert r["bulk_ttft_ms"] > 8.0 and r["layerwise_ttft_ms"] > 8.0


def test_bench_latency_gives_each_sides_phases_adding_up_to_the_request() -> None:
    from kvbridge.bench.latency import DECODE, PREFILL, run_latency_bench

    rows = run_latency_bench(
        tokens=[16, 64],
        transports=["shm"],
        repeat=2,
        warmup=0,
        console=Console(file=None, quiet=True),
    )
    assert [(r["transport"], r["tokens"]) for r in rows] == [("shm", 16), ("shm", 64)]
    for r in rows:
        decode, prefill = r["phases"]["decode"], r["phases"]["prefill"]
        assert set(decode) == set(DECODE) and set(prefill) == set(PREFILL)
        # The decode waits for the bytes (first_write) and both sides end after them.
        assert decode["first_write"] > 0 and prefill["writes"] > 0
        assert all(v >= 0 for v in (*decode.values(), *prefill.values()))
        # The decode's phases are its whole request (from its receiver to its end), which
        # holds the prefill's send -> end.
        assert sum(decode.values()) >= r["request_s"] * 0.5
    assert rows[1]["bytes"] > 3 * rows[0]["bytes"]  # 4x the tokens (aux aside)


def test_bench_latency_busy_polls_from_the_command_line() -> None:
    """``--busy`` reaches the ranks: with engine threads polling, the tcp request still ends
    in success with every phase, and the rows say the mode they were measured in (here on
    shuffled single-token pages, a busy server's)."""
    got = subprocess.run(
        [sys.executable, "-m", "kvbridge", "bench", "latency", "--tokens", "16"]
        + ["--transports", "tcp", "--repeat", "2", "--warmup", "0", "--busy", "--json"]
        + ["--page", "1", "--shuffled"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr
    (row,) = json.loads(got.stdout)
    assert row["busy"] is True and row["repeats"] == 2
    assert row["phases"]["decode"]["first_write"] > 0 and row["phases"]["prefill"]["writes"] > 0


# A bench that runs many rounds of a small request and says when they started, with the pids
# of its ranks (the prefill rank first: processes are named in the order they were made).
BENCH = """
import multiprocessing, sys
sys.path.insert(0, sys.argv[1])
from kvbridge.bench.rounds import measure
from kvbridge.bench.transfer import CASES, _job, first_layers
from kvbridge.model.hf import load_spec

def ranks():
    procs = sorted(multiprocessing.active_children(), key=lambda p: int(p.name.split("-")[-1]))
    return " ".join(str(p.pid) for p in procs)

if __name__ == "__main__":
    job = _job(first_layers(load_spec("qwen3-32b"), 2), CASES[0], "shm", 256, 64)
    measure(job, 100_000, on_round=lambda: print("round", ranks(), flush=True))
"""


def start_bench(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """A bench (its own process group) five rounds in, and its ranks' pids: prefill, decode."""
    script = tmp_path / "bench.py"
    script.write_text(BENCH)
    src = str(Path(__file__).resolve().parents[1] / "src")
    bench = subprocess.Popen(
        [sys.executable, str(script), src],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert bench.stdout is not None
    try:
        for _ in range(5):  # rounds are running
            line = bench.stdout.readline().split()
            assert line[:1] == ["round"], f"the bench said {line} (exit {bench.poll()})"
    except BaseException:
        bench.kill()
        raise
    return bench, [int(pid) for pid in line[1:]]


def gone_within(seconds: float, pgid: int, pids: set[str] | None = None) -> list[str]:
    """Those of group ``pgid``'s processes (of ``pids``, where given) still there after
    ``seconds``."""
    end = time.monotonic() + seconds
    while True:
        left = [line for line in members(pgid) if pids is None or line.split()[0] in pids]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.2)


def test_a_bench_killed_mid_run_leaves_no_rank_behind(tmp_path: Path) -> None:
    """Its rank processes notice the bench is gone and exit, without waiting for their results
    to be read (once they stayed blocked at exit for good). One of them is stopped (SIGSTOP)
    first: the other, waiting for it (the prefill rank for the decode rank to ask for the next
    round's request, unless it already had), still looks while it waits whether the bench is
    there, and leaves within seconds, not at the wait's limit (120 s; such a rank once outlived
    its bench by 30 s in CI). The stopped one, continued, leaves too."""
    bench, (prefill, decode) = start_bench(tmp_path)
    try:
        os.kill(decode, signal.SIGSTOP)
        time.sleep(1)  # the prefill rank now waits for the decode rank
        bench.kill()
        bench.wait(10)
        left = gone_within(10, bench.pid, {str(prefill)})
        assert not left, f"the prefill rank outlived the bench: {left}"
        with contextlib.suppress(ProcessLookupError):  # (its request failed: killed by now)
            os.kill(decode, signal.SIGCONT)
        left = gone_within(15, bench.pid)
        assert not left, f"ranks outlived the bench: {left}"
    finally:
        bench.kill()
        for line in members(bench.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)


def test_bench_plan_counts_runs_and_descriptors_for_each_layout() -> None:
    """``kvbridge bench plan``: a row for each memory layout with contiguous and shuffled
    pages; contiguous pages coalesce into fewer runs than shuffled ones, the flat descriptors
    are never more than a per-token slicer's, and the command line's options reach it."""
    from click.testing import CliRunner

    from kvbridge.bench.planning import run_plan_bench
    from kvbridge.cli import main
    from kvbridge.planner.layout import KVLayout

    rows = run_plan_bench(
        model="qwen3-0.6b", tokens=512, repeat=1, console=Console(file=None, quiet=True)
    )
    assert {(r["layout"], r["pages"]) for r in rows} == {
        (layout.value, pages) for layout in KVLayout for pages in ("contiguous", "shuffled")
    }
    for layout in KVLayout:
        got = {r["pages"]: r for r in rows if r["layout"] == layout.value}
        assert got["contiguous"]["runs"] < got["shuffled"]["runs"], layout
    for r in rows:
        assert 0 < r["flat"] <= r["per_token"]
        assert r["plan_ms"] > 0 and r["one_rank_ms"] > 0
    out = CliRunner().invoke(
        main, ["bench", "plan", "--model", "qwen3-0.6b", "--tokens", "64", "--repeat", "1"]
    )
    assert out.exit_code == 0, out.output
    assert "64 tokens, P4 -> D1" in out.output
    refused = CliRunner().invoke(main, ["bench", "plan", "--repeat", "0"])
    assert refused.exit_code == 2 and "--repeat" in refused.output
