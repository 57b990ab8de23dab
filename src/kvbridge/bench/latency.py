"""``kvbridge bench latency``: where one request's time goes, phase by phase, on both sides.

One request at a time (prefill TP 1 -> decode TP 1, real processes, :func:`.transfer.measure`
as ``kvbridge bench transfer`` runs it: the decode asks first, then the prefill sends the whole
prompt as one chunk), at several prompt lengths. Each side's rank records its request's
phases (:mod:`kvbridge.runtime.timeline`); the table gives each phase's median over the rounds, in
milliseconds, with the request's median time from the prefill's send to the decode's end
beside the time memcpy takes for the same bytes in this process (the floor of any transfer on
one host). Medians of a few rounds on a shared machine: a phase under ~0.1 ms is noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from kvbridge.bench.transfer import CASES, Memcpy, _job, _request_bytes, check_rounds, measure

# The phases in the order a request goes through them here (kvbridge.runtime.timeline.Phase values).
DECODE = ("ask", "first_write", "end")
PREFILL = ("told", "ready", "post", "writes", "notice", "end")


def run_latency_bench(
    *,
    model: str = "llama-3.1-8b",
    tokens: Sequence[int] = (64, 512, 2048),
    transports: Sequence[str] = ("shm", "tcp"),
    repeat: int = 20,
    warmup: int = 3,
    page: int = 16,
    shuffled: bool = False,
    console: Console | None = None,
    as_json: bool = False,
    busy: bool = False,
) -> list[dict[str, Any]]:
    """Measure every (transport, tokens); print the table (unless ``as_json``) and return the
    rows: per side, each phase's median seconds. ``busy``: each rank's engine thread polls in
    a Python loop, as a serving engine's scheduler does, instead of blocking. ``shuffled``:
    each side's pages in a random order (a busy server's free pages), not in order."""
    from kvbridge.model.hf import load_spec

    check_rounds(repeat, warmup)
    # Fourteen columns: wider than a terminal's default where the output is not one.
    console = console or Console(width=None if Console().is_terminal else 160)
    spec = load_spec(model)
    rows: list[dict[str, Any]] = []
    for transport in transports:
        for n in tokens:
            job = _job(spec, CASES[0], transport, n, page)
            nbytes = _request_bytes(job)
            memcpy = Memcpy(nbytes)
            try:
                memcpy.measure(repeat)
            finally:
                memcpy.close()
            got = measure(job, warmup + repeat, shuffled=shuffled, busy=busy)[warmup:]
            rows.append(
                {
                    "model": spec.model,
                    "transport": transport,
                    "tokens": n,
                    "bytes": nbytes,
                    "request_s": statistics.median(r.seconds for r in got),
                    "memcpy_s": nbytes / (memcpy.limit(False) * 1e9),
                    "phases": {
                        side: {
                            p: statistics.median(r.phases[side].get(p, 0.0) for r in got)
                            for p in names
                        }
                        for side, names in (("decode", DECODE), ("prefill", PREFILL))
                    },
                    "repeats": len(got),
                    "busy": busy,
                    "pages": "shuffled" if shuffled else "contiguous",
                }
            )
    if not as_json:
        console.print(_table(rows, repeat, page, busy, shuffled))
    return rows


def _table(
    rows: Sequence[dict[str, Any]], repeat: int, page: int, busy: bool, shuffled: bool
) -> Table:
    t = Table(
        title=f"kvbridge bench latency: one request at a time, TP 1 -> 1, "
        f"{'shuffled ' if shuffled else ''}pages of {page}, "
        f"median of {repeat} rounds, ms (decode phases | prefill phases)"
        + (", engine threads polling (--busy)" if busy else "")
    )
    for col in ("transport", "tokens", "MiB", "memcpy", "send -> end"):
        t.add_column(col, justify="right")
    for p in DECODE:
        t.add_column(f"d:{p}", justify="right")
    for p in PREFILL:
        t.add_column(f"p:{p}", justify="right")
    for r in rows:
        t.add_row(
            r["transport"],
            str(r["tokens"]),
            f"{r['bytes'] / 2**20:.1f}",
            f"{r['memcpy_s'] * 1e3:.2f}",
            f"{r['request_s'] * 1e3:.2f}",
            *(f"{r['phases']['decode'][p] * 1e3:.2f}" for p in DECODE),
            *(f"{r['phases']['prefill'][p] * 1e3:.2f}" for p in PREFILL),
        )
    return t
