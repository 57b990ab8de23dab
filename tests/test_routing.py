"""Expected senders are derived from the plan: the regressions of the seed bugs.

seed 000/002: PP=1 heterogeneous TP hung because completion was keyed on pp_rank; here every
sender is named by engine rank and every prefill rank holding needed heads is expected.
seed 003: dense models hung because aux was only sent with state; here aux is always owed,
by exactly one sender per decode rank, and state is owed only where the model has state.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvbridge import (
    CacheSpec,
    DType,
    Pairing,
    ParallelLayout,
    PartKind,
    Placement,
    Side,
    build_memory,
)
from kvbridge.model.spec import attention_layer, mamba2_layer, mla_layer

KV, STATE, AUX = PartKind.KV, PartKind.STATE, PartKind.AUX


def pairing(spec: CacheSpec, tp_p: int, tp_d: int, pp_p: int = 1, pp_d: int = 1) -> Pairing:
    def side(tp: int, pp: int) -> Side:
        par = ParallelLayout.even(spec.num_layers, tp, pp)
        return Side(spec, par, build_memory(spec, par, page_size=4, num_pages=32))

    return Pairing(side(tp_p, pp_p), side(tp_d, pp_d))


def dense(heads: int = 8, layers: int = 4) -> CacheSpec:
    return CacheSpec(
        "dense", tuple(attention_layer(heads, 8, DType.BFLOAT16) for _ in range(layers))
    )


def test_p4_d1_expects_every_prefill_rank_by_engine_rank() -> None:
    pr = pairing(dense(), 4, 1)
    senders = pr.senders_of(0)
    assert sorted(senders) == [0, 1, 2, 3]
    assert all(KV in k and STATE not in k for k in senders.values())
    assert sum(AUX in k for k in senders.values()) == 1


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "pp_p", "pp_d"),
    [(1, 4, 1, 1), (4, 1, 1, 1), (2, 3, 2, 1), (8, 2, 1, 2), (1, 1, 4, 2)],
)
def test_dense_models_owe_aux_always_and_state_never(
    tp_p: int, tp_d: int, pp_p: int, pp_d: int
) -> None:
    pr = pairing(dense(heads=24, layers=4), tp_p, tp_d, pp_p, pp_d)
    for d in range(tp_d * pp_d):
        senders = pr.senders_of(d)
        aux = [p for p, k in senders.items() if AUX in k]
        assert len(aux) == 1
        assert aux[0] // tp_p == pp_p - 1  # the last stage holds the sampled token
        assert not any(STATE in k for k in senders.values())


def test_state_is_owed_only_by_ranks_holding_state_layers() -> None:
    spec = CacheSpec(
        "hyb",
        (
            attention_layer(4, 8, DType.BFLOAT16),
            mamba2_layer(8, 4, 2, 4, 4, conv_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32),
        ),
    )
    pr = pairing(spec, 2, 4, pp_p=2)
    for d in range(4):
        senders = pr.senders_of(d)
        assert [p for p, k in senders.items() if STATE in k] == [2 + d // 2]
        assert all(p < 2 for p, k in senders.items() if KV in k)


def test_routes_are_the_same_from_both_ends() -> None:
    pr = pairing(dense(heads=6), 2, 3, pp_p=2)
    from_decode = {(p, d): k for d in range(3) for p, k in pr.senders_of(d).items()}
    from_prefill = {(p, d): k for p in range(4) for d, k in pr.receivers_of(p).items()}
    assert from_decode == from_prefill == pr.routes()


def test_every_chunk_names_every_kv_pair_even_without_bytes() -> None:
    # A sliding-only model: the early chunk carries no bytes, yet its notices are owed.
    spec = CacheSpec(
        "swa", tuple(attention_layer(4, 8, DType.BFLOAT16, window=4) for _ in range(2))
    )
    pr = pairing(spec, 2, 1)
    p = Placement.simple(40, np.arange(10))
    early = pr.plan(p, p, 0, 8)
    assert {(x.prefill_rank, x.decode_rank) for x in early.pairs} == {(0, 0), (1, 0)}
    assert early.total_bytes == 0
    assert all(
        x.parts[0].kind is KV and (x.parts[0].start, x.parts[0].stop) == (0, 8) for x in early.pairs
    )


@pytest.mark.parametrize(
    ("spec", "tp_p"),
    [
        (CacheSpec("mla", tuple(mla_layer(16, 4, DType.BFLOAT16) for _ in range(8))), 4),
        (dense(heads=2, layers=8), 8),
    ],
)
def test_replicated_units_are_sent_by_every_replica_in_turn(spec: CacheSpec, tp_p: int) -> None:
    pr = pairing(spec, tp_p, 1)
    p = Placement.simple(16, np.arange(4))
    plan = pr.plan(p, p, 0, 16, last=False)
    sent = Counter({x.prefill_rank: x.runs.total_bytes for x in plan.pairs})
    assert len(sent) == tp_p
    assert max(sent.values()) == min(sent.values())
