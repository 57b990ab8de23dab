"""``kvbridge bench plan``: how long planning takes, and how few runs it produces."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvbridge.bench.transfer import check_rounds
from kvbridge.model.hf import load_spec
from kvbridge.planner.layout import KVLayout
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Pairing
from kvbridge.planner.sidespec import SideOptions, check_tokens


def run_plan_bench(
    *,
    model: str,
    tokens: int,
    repeat: int,
    console: Console,
    page: int = 64,
    tp_p: int = 4,
    tp_d: int = 1,
) -> list[dict[str, Any]]:
    check_tokens(tokens)
    check_rounds(repeat, 0)
    spec = load_spec(model)
    table = Table(title=f"planning {model}, {tokens} tokens, P{tp_p} -> D{tp_d}, page {page}")
    for col in (
        "layout",
        "pages",
        "plan (ms)",
        "per pair (ms)",
        "one rank (ms)",
        "runs",
        "flat descriptors",
        "per-token descriptors",
        "per-token / flat",
    ):
        table.add_column(col, justify="left" if col in ("layout", "pages") else "right")
    rows: list[dict[str, Any]] = []
    need = -(-tokens // page)
    for layout in KVLayout:
        for shuffled in (False, True):
            po = SideOptions(tp=tp_p, page=page, layout=layout, pages=2 * need)
            do = SideOptions(tp=tp_d, page=page, layout=layout, pages=2 * need)
            pairing = Pairing(po.side(spec, tokens), do.side(spec, tokens))
            rng = np.random.default_rng(0)
            ids = [
                rng.permutation(2 * need)[:need] if shuffled else np.arange(need) for _ in range(2)
            ]
            src, dst = Placement.simple(tokens, ids[0]), Placement.simple(tokens, ids[1])
            plan = pairing.plan(src, dst)  # warm caches, as a serving engine would be
            # Each round a new request (new placements): what a request pays, not what a
            # plan of the same placements again (another layer group of it) would.
            rounds = [(_again(src), _again(dst)) for _ in range(2 * repeat)]
            t0 = time.perf_counter()
            for s, d in rounds[:repeat]:
                plan = pairing.plan(s, d)
            full = (time.perf_counter() - t0) / repeat
            t0 = time.perf_counter()
            for s, d in rounds[repeat:]:
                pairing.plan(s, d, prefill_rank=0)
            one = (time.perf_counter() - t0) / repeat
            token_buffers = sum(
                1 for layer in spec.layers for c in layer.components if c.scope.value == "token"
            )
            # A per-token slicer issues one descriptor per token, buffer and pair; against
            # it, the flat descriptors of the same token buffers (a plan without the state
            # and aux that travel with the last chunk).
            per_token = tokens * token_buffers * len(plan.pairs)
            flat = sum(p.runs.descriptors for p in pairing.plan(src, dst, last=False).pairs)
            row: dict[str, Any] = {
                "layout": layout.value,
                "pages": "shuffled" if shuffled else "contiguous",
                "plan_ms": full * 1e3,
                "per_pair_ms": full * 1e3 / len(plan.pairs),
                "one_rank_ms": one * 1e3,
                "runs": plan.total_runs,
                "flat": flat,
                "per_token": per_token,
            }
            rows.append(row)
            table.add_row(
                row["layout"],
                row["pages"],
                f"{full * 1e3:.2f}",
                f"{full * 1e3 / len(plan.pairs):.2f}",
                f"{one * 1e3:.2f}",
                f"{plan.total_runs:,}",
                f"{flat:,}",
                f"{per_token:,}",
                f"{per_token / flat:.0f}x",
            )
    console.print(table)
    return rows


def _again(p: Placement) -> Placement:
    """The same placement as a new object (a new request's)."""
    return Placement(p.tokens, dict(p.pages), dict(p.slots))
