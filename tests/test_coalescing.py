"""Runs are as few as the layouts allow, and coalescing never changes which bytes go where."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge import (
    CacheSpec,
    DType,
    KVLayout,
    Pairing,
    ParallelLayout,
    Placement,
    Side,
    build_memory,
)
from kvbridge.model.spec import attention_layer
from kvbridge.planner.runs import Runs, coalesce
from tiers import examples

SPEC = CacheSpec("q", tuple(attention_layer(8, 16, DType.BFLOAT16) for _ in range(6)))


def plan_runs(
    tp_p: int, tp_d: int, layout: KVLayout, shuffled: bool, n: int = 1024, page: int = 16
) -> tuple[int, int]:
    def side(tp: int) -> Side:
        par = ParallelLayout.even(SPEC.num_layers, tp)
        return Side(
            SPEC,
            par,
            build_memory(SPEC, par, page_size=page, num_pages=2 * n // page, kv_layout=layout),
        )

    pr = Pairing(side(tp_p), side(tp_d))
    need = n // page
    rng = np.random.default_rng(0)
    ids = rng.permutation(2 * need)[:need] if shuffled else np.arange(need)
    p = Placement.simple(n, ids)
    plan = pr.plan(p, p, last=False)
    return plan.total_runs, sum(x.runs.descriptors for x in plan.pairs)


def test_contiguous_same_layout_is_one_run_per_buffer() -> None:
    for layout in KVLayout:
        assert plan_runs(1, 1, layout, shuffled=False) == (12, 12)


def test_nhd_head_slices_are_one_strided_run_per_buffer() -> None:
    runs, flat = plan_runs(4, 1, KVLayout.NHD, shuffled=False)
    assert runs == 4 * 12  # four pairs, twelve buffers (6 layers x K,V)
    assert flat == 4 * 12 * 1024  # a flat-only transport still needs one per token


def test_hnd_needs_at_most_per_token_over_page_size() -> None:
    per_token = 4 * 12 * 1024
    for shuffled in (False, True):
        _, flat = plan_runs(4, 1, KVLayout.HND, shuffled=shuffled)
        assert flat <= per_token // 16


@st.composite
def run_lists(draw: st.DrawFn) -> Runs:
    """Runs over a 4 KiB space laid out so that many neighbours can merge."""
    n = draw(st.integers(1, 30))
    size = draw(st.sampled_from([4, 8, 16]))
    step_s = draw(st.sampled_from([size, 2 * size, 3 * size]))
    step_d = draw(st.sampled_from([size, 2 * size]))
    jumps = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    src, dst, s, d = [], [], 0, 0
    for j in jumps:
        src.append(s)
        dst.append(d)
        s += step_s + (64 if j else 0)
        d += step_d + (32 if j else 0)
    z = np.zeros(n, dtype=np.int64)
    return Runs(
        z,
        np.array(src, dtype=np.int64),
        z.copy(),
        np.array(dst, dtype=np.int64),
        z + size,
        z + 1,
        z.copy(),
        z.copy(),
    )


def byte_map(r: Runs) -> dict[int, int]:
    f = r.flat()
    out: dict[int, int] = {}
    triples = zip(f.src_offset.tolist(), f.dst_offset.tolist(), f.nbytes.tolist(), strict=True)
    for so, do, n in triples:
        for i in range(n):
            assert do + i not in out
            out[do + i] = so + i
    return out


@settings(max_examples=examples(200), deadline=None)
@given(run_lists())
def test_coalescing_keeps_the_byte_mapping(r: Runs) -> None:
    c = coalesce(r)
    assert len(c) <= len(r)
    assert byte_map(c) == byte_map(r)
    assert coalesce(c).descriptors == c.descriptors  # idempotent in what it expands to
