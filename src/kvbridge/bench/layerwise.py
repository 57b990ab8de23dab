"""``kvbridge bench layerwise``: how much of the transfer layer-wise sending hides behind the
prefill forward.

One request of a model of 32 layers or more, P1 -> D1, between real processes on each
transport, two ways: *bulk*, the forward computes every layer and then the request is sent
whole; *layer-wise*, each layer is handed to kvbridge as soon as it is computed
(``sender.send(stop, layers=range(i, i + 1))``). **The forward is simulated**: each layer
"computes" for ``layer_ms`` (a sleep; an engine whose forward runs on a GPU leaves its CPU, and
so kvbridge's threads, as free meanwhile); no model runs.

Per transport (median over rounds): *tail* = decode Success - the last layer computed;
*TTFT (transfer)* = decode Success - forward start (the decode side's own first step is not
counted); *one layer's transfer*, two ways: the bulk tail / layers (its bytes alone: every
layer moves the same bytes), and a request of one layer moved on its own, end to end (its
bytes and the fixed cost every send pays: planning, the completion notice). The target: a
layer-wise tail of at most 2x one layer's transfer, against the whole request's in bulk.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbridge.bench.rounds import Forward, measure
from kvbridge.bench.transfer import (
    CASES,
    _job,
    _request_bytes,
    check_memory,
    check_rounds,
    first_layers,
)
from kvbridge.errors import KVBridgeError


def run_layerwise_bench(
    *,
    model: str = "llama-3.1-8b",
    tokens: int = 2048,
    layer_ms: float = 4.0,
    transports: Sequence[str] = ("shm", "tcp"),
    repeat: int = 5,
    warmup: int = 1,
    page: int = 64,
    layers: int | None = None,
    console: Console | None = None,
    as_json: bool = False,
) -> list[dict[str, Any]]:
    from kvbridge.model.hf import load_spec

    check_rounds(repeat, warmup)
    if not 0 <= layer_ms <= 10_000:
        raise KVBridgeError(f"--layer-ms must be in [0, 10000], got {layer_ms}")
    full = load_spec(model)
    spec = first_layers(full, layers or full.num_layers)
    check_memory(spec, tokens, page)
    console = console or Console()
    rows: list[dict[str, Any]] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} rounds"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        bar = progress.add_task("", total=3 * len(transports) * (warmup + repeat))
        for transport in transports:
            job = _job(spec, CASES[0], transport, tokens, page)
            single = _job(first_layers(spec, 1), CASES[0], transport, tokens, page)
            got = {}
            for mode, j, layerwise in (
                ("bulk", job, False),
                ("layer-wise", job, True),
                ("one layer", single, False),
            ):
                progress.update(bar, description=f"{transport}, {mode}")
                got[mode] = measure(
                    j,
                    warmup + repeat,
                    forward=Forward(layer_ms / 1e3, layerwise),
                    on_round=lambda: progress.advance(bar),
                )[warmup:]
            bulk_tail = statistics.median(r.tail for r in got["bulk"])
            tail = statistics.median(r.tail for r in got["layer-wise"])
            one = bulk_tail / spec.num_layers
            alone = statistics.median(r.tail for r in got["one layer"])
            rows.append(
                {
                    "model": full.model,
                    "layers": spec.num_layers,
                    "tokens": tokens,
                    "transport": transport,
                    "bytes": _request_bytes(job),
                    "layer_ms": layer_ms,
                    "bulk_tail_ms": bulk_tail * 1e3,
                    "layerwise_tail_ms": tail * 1e3,
                    "one_layer_ms": one * 1e3,
                    "tail_vs_one_layer": tail / one,
                    "one_layer_alone_ms": alone * 1e3,
                    "tail_vs_one_layer_alone": tail / alone,
                    "bulk_ttft_ms": statistics.median(r.seconds for r in got["bulk"]) * 1e3,
                    "layerwise_ttft_ms": statistics.median(r.seconds for r in got["layer-wise"])
                    * 1e3,
                    "rounds": repeat,
                }
            )
    if not as_json:
        console.print(_table(rows, full.model, spec.num_layers, tokens, layer_ms, repeat))
    return rows


def _table(
    rows: list[dict[str, Any]], model: str, layers: int, tokens: int, layer_ms: float, repeat: int
) -> Table:
    t = Table(
        title=f"{model}: {tokens} tokens, {layers} layers, P1 -> D1; forward simulated "
        f"at {layer_ms:g} ms a layer",
        caption=f"median of {repeat} rounds. tail = decode Success - last layer "
        f"computed; one layer: bulk tail / layers, and a one-layer request on "
        f"its own; TTFT = decode Success - forward start (transfer part only)",
    )
    for col in (
        "transport",
        "bytes",
        "bulk tail ms",
        "layer-wise tail ms",
        "one layer ms (bytes / alone)",
        "tail / one layer (bytes / alone)",
        "bulk TTFT ms",
        "layer-wise TTFT ms",
    ):
        t.add_column(col, justify="left" if col == "transport" else "right")
    for r in rows:
        t.add_row(
            r["transport"],
            f"{r['bytes'] / 2**20:.0f} MiB",
            f"{r['bulk_tail_ms']:.1f}",
            f"{r['layerwise_tail_ms']:.1f}",
            f"{r['one_layer_ms']:.2f} / {r['one_layer_alone_ms']:.2f}",
            f"{r['tail_vs_one_layer']:.2f} / {r['tail_vs_one_layer_alone']:.2f}",
            f"{r['bulk_ttft_ms']:.1f}",
            f"{r['layerwise_ttft_ms']:.1f}",
        )
    return t
