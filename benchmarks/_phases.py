"""kvbridge's per-request phases read from running servers (a module the benchmarks import,
not a script): each server's bridge serves its metrics on ``KVBRIDGE_METRICS_PORT``, whose
``kvbridge_phase_seconds`` histograms sum every request's time in each phase
(:mod:`kvbridge.runtime.timeline`). A benchmark reads the sums before and after one request,
outside its timed window, and prints the medians with :func:`budget`."""

from __future__ import annotations

import re
import statistics
import time
import urllib.request

_PHASE = re.compile(
    r'^kvbridge_phase_seconds_(sum|count)\{[^}]*phase="(\w+)"[^}]*\} (\S+)$', re.MULTILINE
)
# Each side's phases in the order a request goes through them.
ORDER = [f"decode.{p}" for p in ("ask", "first_write", "end")] + [
    f"prefill.{p}" for p in ("told", "ready", "post", "writes", "notice", "end")
]


def phase_totals(ports: dict[str, int]) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds so far in each phase, summed over requests, as ``side.phase``, and how many
    requests each phase counted; ``ports``: each side's metrics port."""
    total: dict[str, float] = {}
    count: dict[str, float] = {}
    for side, port in ports.items():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for m in _PHASE.finditer(text):
            into = total if m.group(1) == "sum" else count
            key = f"{side}.{m.group(2)}"
            into[key] = into.get(key, 0.0) + float(m.group(3))
    return total, count


def phases_after(
    ports: dict[str, int], before: tuple[dict[str, float], dict[str, float]], wait: float = 5.0
) -> dict[str, float]:
    """Each phase's seconds in the request that ended since ``before``, once every side
    counted its end (a prefill may count it a moment after the answer left)."""
    end = time.monotonic() + wait
    while True:
        total, count = phase_totals(ports)
        done = all(count.get(f"{s}.end", 0.0) > before[1].get(f"{s}.end", 0.0) for s in ports)
        if done or time.monotonic() > end:
            return {k: v - before[0].get(k, 0.0) for k, v in total.items()}
        time.sleep(0.01)


def budget(lengths: list[int], phases: dict[int, list[dict[str, float]]]) -> str:
    """A markdown table: each phase's median ms over the requests of each prompt length."""
    cols = [c for c in ORDER if any(c in d for n in lengths for d in phases[n])]
    lines = [
        "| prompt tokens | " + " | ".join(cols) + " |",
        "| ---: | " + " | ".join("---:" for _ in cols) + " |",
    ]
    for n in lengths:
        cells = [f"{statistics.median(d.get(c, 0.0) for d in phases[n]) * 1e3:.2f}" for c in cols]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
