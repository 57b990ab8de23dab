"""Per-request histograms read from running servers' Prometheus pages (a module the benchmarks
import, not a script): kvbridge's phases (each server's bridge serves ``kvbridge_phase_seconds``
on ``KVBRIDGE_METRICS_PORT``: :mod:`kvbridge.runtime.timeline`) and SGLang's own stages
(``sglang:per_stage_req_latency_seconds``). A histogram's sum grows by each request's seconds;
a benchmark reads the sums before and after one request, outside its timed window, and prints
the medians with :func:`budget`."""

from __future__ import annotations

import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable

from kvbridge.bench.latency import DECODE, PREFILL

# Seconds so far and requests counted, by "page.label" (e.g. "decode.ask").
Totals = tuple[dict[str, float], dict[str, float]]

ORDER = [f"decode.{p}" for p in DECODE] + [f"prefill.{p}" for p in PREFILL]


def read(pages: dict[str, str], metric: str, label: str) -> Totals:
    """Histogram ``metric``'s sums and counts by the value of its ``label``, over each page
    (name -> metrics URL), keyed ``name.value``."""
    line = re.compile(
        rf'^{re.escape(metric)}_(sum|count)\{{[^}}]*{label}="(\w+)"[^}}]*\}} (\S+)$', re.MULTILINE
    )
    total: dict[str, float] = {}
    count: dict[str, float] = {}
    for name, url in pages.items():
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        for m in line.finditer(text):
            into = total if m.group(1) == "sum" else count
            key = f"{name}.{m.group(2)}"
            into[key] = into.get(key, 0.0) + float(m.group(3))
    return total, count


def _when(
    now: Callable[[], Totals], done: Callable[[dict[str, float]], bool], wait: float, why: str
) -> Totals | None:
    """``now()`` once ``done`` says its counts are there; None, with ``why`` on standard error,
    where they were not within ``wait`` seconds (the sample would be partial: left out)."""
    end = time.monotonic() + wait
    while True:
        got = now()
        if done(got[1]):
            return got
        if time.monotonic() > end:
            print(f"{why} within {wait:g} s: a request left out", file=sys.stderr)
            return None
        time.sleep(0.01)


def spent(
    now: Callable[[], Totals],
    before: Totals,
    counted: Callable[[dict[str, float]], bool],
    wait: float = 5.0,
) -> dict[str, float] | None:
    """The seconds added since ``before`` once ``counted(counts)`` says the request was
    counted everywhere (a server may count it a moment after the answer left)."""
    got = _when(now, counted, wait, "the request was not counted everywhere")
    return None if got is None else {k: v - before[0].get(k, 0.0) for k, v in got[0].items()}


def settled(now: Callable[[], Totals], keys: list[str], wait: float = 5.0) -> Totals | None:
    """The totals once the counts of ``keys`` (each server's last stage of a request) agree:
    an earlier request still ending on one server is not taken for the next one's."""
    return _when(
        now, lambda count: len({count.get(k, 0.0) for k in keys}) == 1, wait, f"{keys} disagreed"
    )


def _phases_now(ports: dict[str, int]) -> Totals:
    pages = {side: f"http://127.0.0.1:{port}/metrics" for side, port in ports.items()}
    return read(pages, "kvbridge_phase_seconds", "phase")


def _ends(count: dict[str, float], ports: dict[str, int]) -> list[float]:
    return [count.get(f"{side}.end", 0.0) for side in ports]


def settled_phases(ports: dict[str, int]) -> Totals | None:
    """kvbridge's phase totals once every side (``ports``: each side's metrics port) counted
    the same requests' ends (:func:`settled`)."""
    return settled(lambda: _phases_now(ports), [f"{side}.end" for side in ports])


def phases_after(ports: dict[str, int], before: Totals) -> dict[str, float] | None:
    """Each kvbridge phase's seconds in the one request since ``before``
    (:func:`settled_phases`), once every side counted its end."""
    want = max(_ends(before[1], ports)) + 1
    return spent(
        lambda: _phases_now(ports),
        before,
        lambda count: all(n == want for n in _ends(count, ports)),
    )


def median_ms(samples: list[dict[str, float]], key: str) -> str:
    """The median of ``key`` over ``samples`` in ms, "-" where no sample was kept."""
    if not samples:
        return "-"
    return f"{statistics.median(d.get(key, 0.0) for d in samples) * 1e3:.2f}"


def budget(lengths: list[int], phases: dict[int, list[dict[str, float]]]) -> str:
    """A markdown table: each phase's median ms over the requests of each prompt length."""
    cols = [c for c in ORDER if any(c in d for n in lengths for d in phases.get(n, []))]
    lines = [
        "| prompt tokens | " + " | ".join(cols) + " |",
        "| ---: | " + " | ".join("---:" for _ in cols) + " |",
    ]
    for n in lengths:
        cells = [median_ms(phases.get(n, []), c) for c in cols]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
