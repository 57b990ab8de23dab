"""``kvbridge bench``: every transport and the raw engines against memcpy, in one run.

For each token count and case (P1 -> D1 contiguous; P4 -> D1 sliced, NHD and HND) of one
model, the suite measures, on the same request shape:

* ``memcpy``: the limit (:class:`~kvbridge.bench.memcpy.Memcpy`, flat or sliced as the case,
  the better of one thread and two; flat in calls of one layer's K or V, as any transport
  copies a request's tensors);
* each kvbridge transport: a whole request between real rank processes
  (:func:`~kvbridge.bench.rounds.measure`, so planning and the completion protocol count),
  twice: written directly (``staging=never``) and staged (``staging=always``); the row also
  says which of the two ``staging=auto`` takes (the transport's cost model), and that path's
  figure against the same transport's contiguous case (``x contig``: the issue's target);
* for nixl and mooncake, the raw engine moving the same bytes without kvbridge
  (:class:`~kvbridge.bench.engines.Workload` made from the same plan).

A transport whose library cannot load is skipped with the reason from
:func:`kvbridge.transports.unavailable`; ``inproc`` is skipped (it cannot join ranks that live
in processes of their own); slow engines (mooncake: ~45 us per descriptor over TCP) skip cases
of more than ``max_descriptors`` descriptors. A measurement that raises is recorded in its row
as ``failed: <reason>``; the bench goes on.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbridge import transports as _transports
from kvbridge.bench import engines
from kvbridge.bench.memcpy import GB, Memcpy
from kvbridge.bench.rounds import measure, placement
from kvbridge.bench.transfer import (
    CASES,
    Case,
    _job,
    _request_bytes,
    auto_layers,
    check_memory,
    check_rounds,
    first_layers,
)
from kvbridge.config import Settings
from kvbridge.deploy.cluster import Job, build_side
from kvbridge.errors import KVBridgeError
from kvbridge.model.spec import CacheSpec
from kvbridge.planner.plan import Pairing
from kvbridge.staging import StagingMode, choose

TRANSPORTS = ("inproc", "shm", "tcp", "nixl", "mooncake")
SLOW = frozenset({"mooncake"})  # engines that --max-descriptors applies to
INPROC_NOTE = "in-process only: this bench runs every rank in a process of its own"
PLOT_HINT = "--plot needs matplotlib: pip install 'kvbridge[bench]'"


def _reason(e: BaseException) -> str:
    """The first line of an error, short enough for a table cell."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _unavailable(name: str) -> str | None:
    if name == "inproc":
        return INPROC_NOTE
    try:
        return _transports.unavailable(name)
    except Exception as e:  # an unknown name: a reason like any other
        return _reason(e)


def _memcpy(memcpy: Memcpy, case: Case, repeat: int) -> dict[str, Any]:
    memcpy.measure(repeat)
    g = memcpy.limit(case.sliced)
    one = memcpy.sliced if case.sliced else memcpy.flat
    return {"gbps": g, "gbps_median": g, "one_thread_gbps": one, "descriptors": None, "runs": None}


def _tensor_bytes(spec: CacheSpec, tokens: int, page: int) -> int:
    """The bytes of a contiguous request's typical run, whatever the cases' order: one
    layer's K or V (the flat memcpy baseline copies in calls of this size, as a transport
    of the contiguous case must), from that case's plan."""
    job = _job(spec, next(c for c in CASES if not c.sliced), "shm", tokens, page)
    plan = Pairing(build_side(job, job.prefill), build_side(job, job.decode)).plan(
        placement(job, job.prefill, False, 0), placement(job, job.decode, False, 1)
    )
    sizes = np.concatenate([p.runs.nbytes * p.runs.count for p in plan.pairs])
    return int(np.median(sizes))


def _kvbridge(job: Job, nbytes: int, warmup: int, repeat: int, prefix: str = "") -> dict[str, Any]:
    got = measure(job, warmup + repeat)[warmup:]
    secs = [r.seconds for r in got]
    return {
        f"{prefix}gbps": nbytes / min(secs) / GB,
        f"{prefix}gbps_median": nbytes / statistics.median(secs) / GB,
        f"{prefix}latency_ms": statistics.median(r.latency for r in got) * 1e3,
    }


def _staging(job: Job, mode: StagingMode) -> Job:
    both = {"staging": mode}
    return replace(
        job,
        prefill_settings={**job.prefill_settings, **both},
        decode_settings={**job.decode_settings, **both},
    )


def _raw(engine: str, w: engines.Workload, warmup: int, repeat: int) -> dict[str, Any]:
    res = engines.RAW[engine](w, repeat=repeat, warmup=warmup)
    return {
        "gbps": res.gbps,
        "gbps_median": res.gbps_median,
        "descriptors": res.descriptors,
        "runs": len(w.runs),
    }


def run_suite(
    *,
    model: str = "qwen3-32b",
    tokens: Sequence[int] = (4096,),
    layers: int | None = None,
    transports: Sequence[str] = TRANSPORTS,
    repeat: int = 3,
    warmup: int = 1,
    page: int = 64,
    max_descriptors: int = 100_000,
    cases: Sequence[Case] = CASES,
    console: Console | None = None,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Measure memcpy, every transport and the raw engines per (tokens, case); print one
    table (unless ``quiet``) and return its rows. Never raises for one failed measurement."""
    from kvbridge.model.hf import load_spec

    check_rounds(repeat, warmup)
    console = console or Console()
    full = load_spec(model)
    shapes = [(n, first_layers(full, layers or auto_layers(full, n, page))) for n in tokens]
    for n, spec in shapes:
        check_memory(spec, n, page)
    skip = {t: _unavailable(t) for t in transports}
    raws = [t for t in transports if t in engines.RAW and skip[t] is None]
    rows: list[dict[str, Any]] = []
    segment = Settings().staging_slot_bytes
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=quiet,
    ) as progress:
        steps = len(shapes) * len(cases) * (1 + 2 * len(transports) + len(raws))
        bar = progress.add_task("", total=steps)

        def step(
            label: str,
            fn: Callable[[], dict[str, Any]],
            base: dict[str, Any],
            status: str = "status",
            add: bool = True,
        ) -> None:
            progress.update(bar, description=label)
            try:
                base.update(fn())
                base[status] = "ok"
            except KVBridgeError as e:
                base[status] = f"failed: {_reason(e)}"
            except Exception as e:  # an engine's own error: still one row, not the bench
                base[status] = f"failed: {type(e).__name__}: {_reason(e)}"
            if add:
                rows.append(base)
            progress.advance(bar)

        for n, spec in shapes:
            memcpy: Memcpy | None = None
            try:
                for case in cases:
                    job = _job(spec, case, "shm", n, page)
                    pre, dec = build_side(job, job.prefill), build_side(job, job.decode)
                    plan = Pairing(pre, dec).plan(
                        placement(job, job.prefill, False, 0),
                        placement(job, job.decode, False, 1),
                    )
                    if memcpy is None:
                        memcpy = Memcpy(_request_bytes(job), _tensor_bytes(spec, n, page))
                    desc = sum(p.runs.descriptors for p in plan.pairs)
                    shape = {
                        "model": full.model,
                        "tokens": n,
                        "layers": spec.num_layers,
                        "case": case.name,
                        "bytes": plan.total_bytes,
                        "descriptors": desc,
                        "runs": plan.total_runs,
                    }
                    label = f"{n} tokens, {case.name}"

                    step(
                        f"{label}: memcpy",
                        partial(_memcpy, memcpy, case, repeat),
                        {**shape, "transport": "memcpy", "kind": "memcpy"},
                    )
                    limit = rows[-1].get("gbps")
                    for t in transports:
                        row = {**shape, "transport": t, "kind": "kvbridge"}
                        if skip[t] is not None:
                            row["status"] = row["staged_status"] = f"skipped: {skip[t]}"
                            rows.append(row)
                            progress.advance(bar, 2 + (t in raws))
                            continue
                        cost = _transports.transport_class(t).cost
                        row["staged_descriptors"] = sum(
                            cost.staged_descriptors(p.runs, segment) for p in plan.pairs
                        )
                        row["auto"] = (
                            "staged"
                            if any(
                                choose(p.runs, cost, StagingMode.AUTO, segment).value == "staged"
                                for p in plan.pairs
                            )
                            else "direct"
                        )
                        job = _job(spec, case, t, n, page)
                        step(
                            f"{label}: kvbridge {t} staged",
                            partial(
                                _kvbridge,
                                _staging(job, StagingMode.ALWAYS),
                                plan.total_bytes,
                                warmup,
                                repeat,
                                "staged_",
                            ),
                            row,
                            "staged_status",
                            add=False,
                        )
                        if t in SLOW and desc > max_descriptors:
                            row["status"] = (
                                f"skipped: {desc:,} descriptors > "
                                f"--max-descriptors {max_descriptors:,} for {t}"
                            )
                            rows.append(row)
                            progress.advance(bar, 1 + (t in raws))
                            continue
                        step(
                            f"{label}: kvbridge {t}",
                            partial(
                                _kvbridge,
                                _staging(job, StagingMode.NEVER),
                                plan.total_bytes,
                                warmup,
                                repeat,
                            ),
                            row,
                        )
                        if t in raws:
                            w = engines.Workload.from_plan(case.name, plan, pre, dec)
                            step(
                                f"{label}: raw {t}",
                                partial(_raw, t, w, warmup, repeat),
                                {**shape, "transport": f"raw {t}", "kind": "raw"},
                            )
                            if rows[-1]["status"] == "ok" and row["status"] == "ok":
                                row["x_raw"] = row["gbps"] / rows[-1]["gbps"]
                    for r in rows:
                        if r["case"] == case.name and r["tokens"] == n and limit:
                            if r.get("gbps"):
                                r["x_memcpy"] = r["gbps"] / limit
                            if r.get("staged_gbps"):
                                r["staged_x_memcpy"] = r["staged_gbps"] / limit
                    _against_contiguous(rows, n)
            finally:
                if memcpy is not None:
                    memcpy.close()
    if not quiet:
        console.print(table(rows, repeat))
    return rows


def _against_contiguous(rows: list[dict[str, Any]], tokens: int) -> None:
    """Each kvbridge row's figure on the path ``auto`` takes (``auto_gbps``) and its ratio to
    the same transport's first (contiguous) case: the issue's target, read in one run."""
    base: dict[str, float] = {}
    for r in rows:
        if r["kind"] != "kvbridge" or r["tokens"] != tokens:
            continue
        key = "staged_gbps" if r.get("auto") == "staged" else "gbps"
        if r.get(key) is None:
            continue
        r["auto_gbps"] = r[key]
        base.setdefault(r["transport"], r[key])
        r["x_contiguous"] = r[key] / base[r["transport"]]


def _count(n: int) -> str:
    return f"{n:,}" if n < 100_000 else f"{n / 1e6:.1f}M"


def table(rows: Sequence[dict[str, Any]], repeat: int) -> Table:
    """The rows as one rich table; skip and failure reasons as numbered notes below it."""
    shapes = list(dict.fromkeys((r["tokens"], r["layers"]) for r in rows))
    notes: list[str] = []
    seen: dict[tuple[str, str, str], int] = {}
    t = Table(
        title=f"kvbridge bench: {rows[0]['model'] if rows else ''}, "
        + ", ".join(f"{n} tokens ({k} layers)" for n, k in shapes),
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in (
        "case",
        "transport",
        "direct GB/s",
        "staged GB/s",
        "auto",
        "x contig",
        "x memcpy",
        "x raw",
        "desc/runs",
        "staged desc",
        "compl ms",
    ):
        t.add_column(
            col,
            justify="left" if col in ("case", "transport") else "right",
            no_wrap=col != "case",
            min_width=10 if col == "case" else None,
        )
    last = None
    for r in rows:
        first = (r["tokens"], r["case"]) != last
        if first and last is not None:
            t.add_section()
        last = (r["tokens"], r["case"])

        def f(key: str, fmt: str, r: dict[str, Any] = r) -> str:
            return format(r[key], fmt) if r.get(key) is not None else "-"

        def cell(status: str, key: str, r: dict[str, Any] = r) -> str:
            if status not in r:
                return "-"
            if r[status] == "ok":
                return format(r[key], ".2f")
            kind, _, why = r[status].partition(": ")
            note = (r["case"], r["transport"], r[status])  # one note for both paths' reason
            if note not in seen:
                both = r.get("status") == r.get("staged_status")
                path = " staged" if status.startswith("staged") and not both else ""
                notes.append(
                    f"[{len(notes) + 1}] {r['case']}, {r['transport']}{path}: {kind}: {why}"
                )
                seen[note] = len(notes)
            return f"[yellow]{kind[:4]} [{seen[note]}][/yellow]"

        desc = (
            "-"
            if r.get("descriptors") is None
            else f"{_count(r['descriptors'])}/{_count(r['runs'])}"
        )
        case = "" if not first else r["case"] if len(shapes) == 1 else f"{r['tokens']}: {r['case']}"
        latency = "staged_latency_ms" if r.get("auto") == "staged" else "latency_ms"
        t.add_row(
            case,
            r["transport"],
            cell("status", "gbps"),
            cell("staged_status", "staged_gbps"),
            r.get("auto", "-"),
            f("x_contiguous", ".2f"),
            f("x_memcpy", ".2f"),
            f("x_raw", ".2f"),
            desc,
            "-" if r.get("staged_descriptors") is None else _count(r["staged_descriptors"]),
            f(latency, ".2f"),
        )
    t.caption = "\n".join(
        [
            f"GB/s = 1e9 B/s, best of {repeat}; direct: staging=never, staged: staging=always. "
            "auto: the path staging=auto takes (the transport's cost model); x contig: that "
            "path's GB/s / the same transport's on the contiguous case. x memcpy (direct): "
            "against np.copyto of the same bytes by one thread or two, the better (in calls "
            "of one layer's K or V for the contiguous case, 512 B pieces for sliced cases). "
            "x raw: "
            "kvbridge direct / the engine alone on the same descriptors. desc: flat descriptors "
            "written directly / runs; staged desc: what the staged path gives the transport. "
            "compl.: decode Success - last prefill writes DONE, median, on the auto path.",
            *notes,
        ]
    )
    t.caption_justify = "left"
    return t


def require_matplotlib() -> None:
    """Raise a one-line error naming the extra if matplotlib is missing (before a long run)."""
    from importlib.util import find_spec

    if find_spec("matplotlib") is None:
        raise KVBridgeError(PLOT_HINT)


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Grouped bars: GB/s per case (and token count) per transport; memcpy as a line."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["tokens"], r["case"]) for r in rows))
    series = list(
        dict.fromkeys(
            r["transport"]
            for r in rows  # measured at least once
            if r["kind"] != "memcpy" and r["status"] == "ok"
        )
    )
    by = {(r["tokens"], r["case"], r["transport"]): r for r in rows}
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(8.0, 2.2 * len(groups) + 2), 5))
    for k, name in enumerate(series):
        xs, ys = [], []
        for g, (n, case) in enumerate(groups):
            r = by.get((n, case, name))
            if r is not None and r["status"] == "ok":
                xs.append(g - 0.4 + width * (k + 0.5))
                ys.append(r["gbps"])
        ax.bar(xs, ys, width, label=name)
    for g, (n, case) in enumerate(groups):
        m = by.get((n, case, "memcpy"))
        if m is not None and m["status"] == "ok":
            ax.hlines(
                m["gbps"],
                g - 0.45,
                g + 0.45,
                colors="black",
                linestyles="--",
                label="memcpy" if g == 0 else "_nolegend_",
            )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{case}\n{n} tokens" for n, case in groups])
    ax.set_ylabel("GB/s (1e9 B/s)")
    ax.set_title(
        f"kvbridge bench: {rows[0]['model'] if rows else ''} (missing bar: skipped or failed)"
    )
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
