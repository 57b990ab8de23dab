"""``kvbridge bench transfer``: one real request between real processes, next to memcpy.

For each case (P1 -> D1 contiguous; P4 -> D1 sliced, NHD and HND) and each transport, rounds
of one request run between freshly spawned rank processes (:mod:`.rounds`: how a round is
timed). GB/s = request bytes / the round's seconds (1 GB = 1e9 bytes); the completion latency
is the decode Success time minus the last prefill rank's "writes DONE" time.

GB/s is the best round, latency the median round. memcpy (:mod:`.memcpy`) is ``np.copyto`` of
the same number of bytes in the parent (one thread), measured before every case while no rank
process runs; the best figure of the run is kept (this host is shared: noise only ever slows a
copy down).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbridge.bench.memcpy import GB, SLICE, SLICE_STRIDE, THREADS, Memcpy
from kvbridge.bench.rounds import Forward, Round, measure, placement
from kvbridge.deploy.cluster import Job, build_side
from kvbridge.errors import KVBridgeError
from kvbridge.model.spec import CacheSpec
from kvbridge.planner.layout import KVLayout
from kvbridge.planner.plan import Pairing
from kvbridge.planner.sidespec import SideOptions

__all__ = [  # GB, Memcpy, Forward, Round and measure: re-exported
    "CASES",
    "GB",
    "MAX_ROUNDS",
    "Case",
    "Forward",
    "Memcpy",
    "Round",
    "auto_layers",
    "check_memory",
    "check_rounds",
    "first_layers",
    "measure",
    "run_transfer_bench",
]

POOL_BUDGET = 3 << 29  # 1.5 GiB: what one side's pools may take when --layers is not given
MAX_ROUNDS = 1000  # --repeat and --warmup: more rounds only narrow a figure already stable


@dataclass(frozen=True)
class Case:
    name: str
    prefill_tp: int
    layout: KVLayout
    sliced: bool  # compared with the sliced memcpy (else the contiguous one)


CASES = (
    Case("P1->D1 contiguous", 1, KVLayout.NHD, False),
    Case("P4->D1 NHD sliced", 4, KVLayout.NHD, True),
    Case("P4->D1 HND sliced", 4, KVLayout.HND, True),
)


# ---- shapes ----------------------------------------------------------------------------------


def first_layers(spec: CacheSpec, layers: int) -> CacheSpec:
    """The spec of the model's first ``layers`` layers (the whole spec if that is all)."""
    if not 1 <= layers <= spec.num_layers:
        raise KVBridgeError(f"--layers must be in [1, {spec.num_layers}], got {layers}")
    if layers == spec.num_layers:
        return spec
    return CacheSpec(f"{spec.model}[:{layers}]", spec.layers[:layers], spec.aux_bytes)


def auto_layers(spec: CacheSpec, tokens: int, page: int, budget: int = POOL_BUDGET) -> int:
    """All layers if one side's pools fit ``budget``, else the largest power of two that does."""
    side = build_side(_job(spec, CASES[0], "shm", tokens, page), SideOptions(page=page))
    per_layer = sum(r.nbytes for r in side.memory.regions) / spec.num_layers
    fit = int(budget // per_layer)
    if fit >= spec.num_layers:
        return spec.num_layers
    if fit < 1:
        raise KVBridgeError(
            f"--tokens: one layer of {tokens} tokens needs "
            f"{per_layer / 2**30:.1f} GiB, past the {budget / 2**30:.1f} GiB "
            f"budget; use fewer tokens"
        )
    return 1 << (fit.bit_length() - 1)


def check_rounds(repeat: int, warmup: int) -> None:
    if not 1 <= repeat <= MAX_ROUNDS or not 0 <= warmup <= MAX_ROUNDS:
        raise KVBridgeError(
            f"need --repeat in [1, {MAX_ROUNDS}] and --warmup in "
            f"[0, {MAX_ROUNDS}], got {repeat}, {warmup}"
        )


def check_memory(spec: CacheSpec, tokens: int, page: int) -> None:
    """Refuse, before allocating anything, a shape whose pools and memcpy buffers (each side's
    pools, twice the request for memcpy) do not fit this host's memory."""
    side = build_side(_job(spec, CASES[0], "shm", tokens, page), SideOptions(page=page))
    need = 4 * sum(r.nbytes for r in side.memory.regions)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise KVBridgeError(
            f"--tokens {tokens} over {spec.num_layers} layers (--layers) needs "
            f"~{need / 2**30:.1f} GiB of pools and buffers; this host has "
            f"{have / 2**30:.1f} GiB"
        )


def _job(spec: CacheSpec, case: Case, transport: str, tokens: int, page: int) -> Job:
    return Job(
        spec=spec,
        transport=transport,
        tokens=tokens,
        verify=False,
        prefill=SideOptions(tp=case.prefill_tp, page=page, layout=case.layout),
        decode=SideOptions(tp=1, page=page, layout=case.layout),
    )


# ---- the bench -------------------------------------------------------------------------------


def run_transfer_bench(
    *,
    model: str = "qwen3-32b",
    tokens: Sequence[int] = (4096, 32768),
    layers: int | None = None,
    transports: Sequence[str] = ("shm", "tcp"),
    repeat: int = 5,
    warmup: int = 1,
    page: int = 64,
    shuffled: bool = False,
    cases: Sequence[Case] = CASES,
    console: Console | None = None,
    as_json: bool = False,
) -> list[dict[str, Any]]:
    """Measure every (tokens, case, transport); print a table per token count (unless
    ``as_json``: the caller prints the rows) and return the rows."""
    from kvbridge.model.hf import load_spec

    check_rounds(repeat, warmup)
    console = console or Console()
    full = load_spec(model)
    shapes = [(n, first_layers(full, layers or auto_layers(full, n, page))) for n in tokens]
    for n, spec in shapes:
        check_memory(spec, n, page)
    rounds = warmup + repeat
    runs = len(cases) * len(transports)
    rows: list[dict[str, Any]] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} rounds"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        bar = progress.add_task("", total=len(shapes) * runs * rounds)
        for n, spec in shapes:
            measured: list[tuple[Case, str, int, int, list[Round]]] = []
            memcpy = Memcpy(_request_bytes(_job(spec, cases[0], transports[0], n, page)))
            try:
                for case in cases:
                    for transport in transports:
                        progress.update(bar, description=f"{n} tokens: memcpy")
                        memcpy.measure(repeat)
                        progress.update(bar, description=f"{n} tokens: {case.name}, {transport}")
                        job = _job(spec, case, transport, n, page)
                        pairing = Pairing(build_side(job, job.prefill), build_side(job, job.decode))
                        plan = pairing.plan(
                            placement(job, job.prefill, shuffled, 0),
                            placement(job, job.decode, shuffled, 1),
                        )
                        got = measure(
                            job, rounds, shuffled=shuffled, on_round=lambda: progress.advance(bar)
                        )[warmup:]
                        measured.append((case, transport, plan.total_bytes, plan.total_runs, got))
            finally:
                memcpy.close()
            table = _table(full, spec, n, repeat, page, shuffled)
            for case, transport, nbytes, nruns, got in measured:
                base = memcpy.limit(case.sliced)
                gbps = nbytes / min(r.seconds for r in got) / GB
                row = {
                    "model": full.model,
                    "tokens": n,
                    "layers": spec.num_layers,
                    "case": case.name,
                    "transport": transport,
                    "page": page,
                    "pages": "shuffled" if shuffled else "contiguous",
                    "bytes": nbytes,
                    "runs": nruns,
                    "gbps": gbps,
                    "gbps_median": nbytes / statistics.median(r.seconds for r in got) / GB,
                    "memcpy_gbps": base,
                    "memcpy": "sliced" if case.sliced else "flat",
                    "memcpy_flat_gbps": memcpy.flat,
                    "memcpy_sliced_gbps": memcpy.sliced,
                    "memcpy_flat2_gbps": memcpy.flat2,
                    "memcpy_sliced2_gbps": memcpy.sliced2,
                    "ratio": gbps / base,
                    "latency_ms": statistics.median(r.latency for r in got) * 1e3,
                    "latency_ms_max": max(r.latency for r in got) * 1e3,
                    "repeats": len(got),
                }
                rows.append(row)
                table.add_row(
                    case.name,
                    transport,
                    f"{nbytes / 2**30:.3f} GiB",
                    f"{gbps:.2f}",
                    f"{base:.2f} {row['memcpy']}",
                    f"{row['ratio']:.2f}",
                    f"{row['latency_ms']:.2f}",
                )
            if not as_json:
                console.print(table)
    return rows


def _request_bytes(job: Job) -> int:
    side = build_side(job, job.decode)
    return (
        Pairing(side, side)
        .plan(placement(job, job.decode, False, 0), placement(job, job.decode, False, 1))
        .total_bytes
    )


def _table(
    full: CacheSpec, spec: CacheSpec, tokens: int, repeat: int, page: int, shuffled: bool
) -> Table:
    subset = (
        ""
        if spec is full
        else f", only the first {spec.num_layers} of {full.num_layers} layers (memory)"
    )
    table = Table(
        title=f"{full.model}: {tokens} tokens{subset}; page {page}, "
        f"{'shuffled' if shuffled else 'contiguous'} pages",
        caption=f"GB/s = 1e9 B/s, best of {repeat} rounds. completion = decode Success "
        f"- last prefill writes DONE, median. memcpy = the best np.copyto in this run, by "
        f"one thread or {THREADS} (the better), flat or as {SLICE} B pieces at a "
        f"{SLICE_STRIDE // 1024} KiB stride.",
    )
    for col in ("case", "transport", "bytes", "GB/s", "memcpy GB/s", "x memcpy", "completion ms"):
        table.add_column(col, justify="left" if col in ("case", "transport") else "right")
    return table
