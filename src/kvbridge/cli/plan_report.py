"""What ``kvbridge plan`` prints: a request's plan, one row per (prefill rank, decode rank)
pair (what it carries, its runs and bytes, where ``staging=auto`` stages it), as a table or as
JSON."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from kvbridge.model.spec import CacheSpec
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.plan import Pairing
from kvbridge.planner.runs import Runs
from kvbridge.planner.sidespec import SideOptions
from kvbridge.planner.transferplan import TransferPlan
from kvbridge.runtime.status import ranges_text
from kvbridge.transports import HOST_NAMES as TRANSPORTS


def human(n: float) -> str:
    """A byte count in binary units: 832 B, 64.00 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def paths(runs: Runs) -> dict[str, str]:
    """The path ``staging=auto`` takes for these runs on each transport (its cost model, with
    the default segment size)."""
    from kvbridge.config import Settings
    from kvbridge.staging import StagingMode, choose
    from kvbridge.transports import transport_class

    segment = Settings().staging_slot_bytes
    return {
        t: choose(runs, transport_class(t).cost, StagingMode.AUTO, segment).value
        for t in TRANSPORTS
    }


def rank_label(par: ParallelLayout, rank: int) -> str:
    """An engine rank and, where the side has them, its PP stage, CP group and DCP rank."""
    stage, cp_rank, tp_rank = par.coords(rank)
    where = [f"pp{stage}"] if par.pp > 1 else []
    where += [f"cp{cp_rank}"] if par.cp > 1 else []
    where += [f"dcp{tp_rank % par.dcp}"] if par.dcp > 1 else []
    return f"{rank} ({' '.join(where)})" if where else str(rank)


def plan_rows(pairing: Pairing, plan: TransferPlan) -> list[dict[str, Any]]:
    rows = []
    for pair in plan.pairs:
        carried = pairing.carried(pair.prefill_rank, pair.decode_rank)
        layers = carried.pop(("layers", ""), frozenset())
        units = {
            f"{c}.{s}" if s not in ("heads", "latent") else c: ranges_text(u)
            for (c, s), u in sorted(carried.items())
        }
        rows.append(
            {
                "prefill_rank": pair.prefill_rank,
                "decode_rank": pair.decode_rank,
                "prefill": rank_label(pairing.prefill.parallel, pair.prefill_rank),
                "decode": rank_label(pairing.decode.parallel, pair.decode_rank),
                "bytes": pair.runs.total_bytes,
                "runs": len(pair.runs),
                "descriptors": pair.runs.descriptors,
                "parts": [str(p) for p in pair.parts],
                "layers": ranges_text(layers),
                "units": units,
                "paths": paths(pair.runs),
            }
        )
    return rows


def report(
    spec: CacheSpec,
    po: SideOptions,
    do: SideOptions,
    tokens: int,
    pairing: Pairing,
    result: TransferPlan,
    as_json: bool,
) -> None:
    """Print ``result`` (the plan of a ``tokens``-token request between sides ``po`` and
    ``do``) as JSON or as a table."""
    rows = plan_rows(pairing, result)
    groups = ""
    if po.dp > 1 or do.dp > 1:
        groups = (
            f"each request lives in one of {po.dp} prefill and one of {do.dp} decode DP "
            f"groups; every (prefill group, decode group) pairing routes as below"
        )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "model": spec.model,
                    "tokens": tokens,
                    "prefill": po.describe(spec),
                    "dp_groups": groups,
                    "decode": do.describe(spec),
                    "pairs": rows,
                    "total_bytes": result.total_bytes,
                    "total_runs": result.total_runs,
                },
                indent=2,
            )
        )
        return
    out = Console()
    table = Table(
        title=f"{spec.model}: {tokens} tokens, prefill {po.describe(spec)} "
        f"-> decode {do.describe(spec)}"
    )
    right = ("runs", "descriptors", "bytes")
    for col in ("prefill", "decode", "layers", "units", "parts", *right, "staged on"):
        table.add_column(col, justify="right" if col in right else "left")
    for r in rows:
        units = " ".join(f"{k}[{v}]" for k, v in r["units"].items())
        staged = ",".join(t for t, p in r["paths"].items() if p == "staged") or "-"
        table.add_row(
            r["prefill"],
            r["decode"],
            r["layers"],
            units,
            " ".join(r["parts"]),
            f"{r['runs']:,}",
            f"{r['descriptors']:,}",
            human(r["bytes"]),
            staged,
        )
    table.add_section()
    table.add_row(
        "total",
        "",
        "",
        "",
        "",
        f"{result.total_runs:,}",
        f"{sum(p.runs.descriptors for p in result.pairs):,}",
        human(result.total_bytes),
        "",
    )
    table.caption = ((groups + ".\n") if groups else "") + (
        "staged on: the transports on which staging=auto stages this pair (their cost models: "
        "descriptor cost vs copy bandwidth); the others write directly"
    )
    out.print(table)
