"""What the byte tests of SGLang's pools share: the two sides paired, the stops of SGLang's sends
of one request, and a plan executed between the ranks' numpy pools (each rank has ``d``, its
:class:`~kvbridge.integrations.sglang.pools.Description`, and ``view(region)``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvbridge.memory.copy import execute
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.plan import Pairing, Side
from kvbridge.planner.transferplan import TransferPlan


def pairing(prefill: Sequence[Any], decode: Sequence[Any]) -> Pairing:
    """The prefill ranks' side paired with the decode ranks' (every layer on every rank)."""
    sides = []
    for ranks in (prefill, decode):
        d = ranks[0].d
        sides.append(Side(d.spec, ParallelLayout(len(ranks), ((0, d.spec.num_layers),)), d.memory))
    return Pairing(*sides)


def sends(tokens: int, start: int, chunk: int, page: int) -> Iterator[int]:
    """Where each of SGLang's sends of a request stops: from the decode's prefix, chunks of
    ``chunk`` tokens (0: one send) ending on prefill pages, the last at the request's end."""
    last = start
    for stop in [tokens] if not chunk else [*range(start + chunk, tokens, chunk), tokens]:
        stop = stop if stop == tokens else stop // page * page
        if stop > last:
            yield stop
            last = stop


def run(plan: TransferPlan, prefill: Sequence[Any], decode: Sequence[Any]) -> None:
    """Every prefill rank's part of ``plan``, executed into the decode ranks' pools."""
    for pair in plan.pairs:
        names_s, names_d, runs = pair.runs.restricted(plan.src_regions, plan.dst_regions)
        execute(
            runs,
            [prefill[pair.prefill_rank].view(x) for x in names_s],
            [decode[pair.decode_rank].view(x) for x in names_d],
        )
