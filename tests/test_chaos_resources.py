"""The soak's leak check (kvbridge.chaos.resources): samples of real processes, and a slope
told from a level."""

from __future__ import annotations

import subprocess
import sys

from kvbridge.chaos.resources import MIN_SAMPLES, TOLERANCE, Sample, rising, sample


def _run(n: int, threads=lambda i: 40, rss=lambda i: 500 << 20) -> list[Sample]:
    return [Sample(100 * i, rss(i), threads(i), 200, 6) for i in range(n)]


def _child(threads: int) -> subprocess.Popen[str]:
    """A process running ``threads`` threads besides its main one, once it says so."""
    code = (
        "import sys, threading; e = threading.Event(); "
        f"[threading.Thread(target=e.wait, daemon=True).start() for _ in range({threads})]; "
        "print('up', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "up\n"
    return child


def test_a_sample_reads_a_live_process_and_counts_a_gone_one_as_nothing() -> None:
    # Processes of their own: this test process's threads come and go with other tests'.
    bare, busy = _child(0), _child(3)
    try:
        one, four = sample(0, [bare.pid], []), sample(1, [busy.pid], [])
    finally:
        for child in (bare, busy):
            child.communicate("")
    assert one.rss > 0 and one.fds > 0
    assert (one.threads, four.threads) == (1, 4)
    assert sample(2, [2**22 + 12345], []) == Sample(2, 0, 0, 0, 0)  # no such process


def test_a_flat_run_and_a_warm_up_pass() -> None:
    assert rising(_run(50), ranks=6) == []
    # the first fifth climbs (pools faulted in, connections opened): warm-up, not a leak
    assert rising(_run(50, threads=lambda i: 10 + 3 * min(i, 9)), ranks=6) == []


def test_a_thread_a_round_is_a_leak_and_noise_within_tolerance_is_not() -> None:
    (leak,) = rising(_run(50, threads=lambda i: 40 + i), ranks=6)
    assert leak.startswith("threads kept rising") and "for 6 ranks" in leak
    wobble = TOLERANCE["threads"] * 6
    assert rising(_run(50, threads=lambda i: 40 + (i % 2) * wobble), ranks=6) == []


def test_memory_that_keeps_growing_is_named() -> None:
    (leak,) = rising(_run(60, rss=lambda i: (500 << 20) + i * (4 << 20)), ranks=6)
    assert leak.startswith("rss kept rising")


def test_too_short_a_run_is_not_judged() -> None:
    assert rising(_run(MIN_SAMPLES - 1, threads=lambda i: 40 + 100 * i), ranks=6) == []


def test_the_report_names_each_resource_with_its_own_figures() -> None:
    from kvbridge.chaos.soak import ChaosConfig, Report

    samples = [Sample(i, 300 << 20, 40 + (i >= 16), 200, 6) for i in range(20)]
    rows = dict(Report(ChaosConfig(), samples=samples).rows())
    assert rows["ranks' threads, 2nd -> last fifth"] == "40 -> 41"
    assert rows["ranks' file descriptors, 2nd -> last fifth"] == "200 -> 200"
    assert rows["ranks' shm segments, 2nd -> last fifth"] == "6 -> 6"
    assert rows["ranks' resident memory, 2nd -> last fifth"] == "300.0 -> 300.0 MiB"
