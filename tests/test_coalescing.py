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
from kvbridge.planner.pieces import Repeat, assemble
from kvbridge.planner.runs import FIELDS, Runs, _links, coalesce
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
    assert len(coalesce(c)) == len(c)  # idempotent: nothing left to merge


@st.composite
def repeats(draw: st.DrawFn) -> list[tuple[Runs, Repeat]]:
    """A pair's parts as the planner makes them, each with its template before coalescing:
    coalesced templates repeated over members whose regions are often their neighbours'
    (then runs may merge across a junction) and whose bases often continue the one before."""
    parts, at = [], 0
    for _ in range(draw(st.integers(1, 3))):
        raw = draw(run_lists())
        span = int((raw.src_offset + raw.nbytes * raw.count).max())
        m = draw(st.integers(1, 4))
        regs = draw(st.lists(st.integers(0, 1), min_size=2 * m, max_size=2 * m))
        steps = [draw(st.sampled_from([span, span + 64])) for _ in range(m)]
        bases = at + np.cumsum(steps) - steps[0]  # one byte of a region is written once
        at = int(bases[-1]) + span
        parts.append(
            (
                raw,
                Repeat(
                    coalesce(raw),
                    np.array(regs[:m], dtype=np.int64),
                    bases.astype(np.int64),
                    np.array(regs[m:], dtype=np.int64),
                    (bases * 2).astype(np.int64),
                ),
            )
        )
    return parts


def region_map(r: Runs) -> dict[tuple[int, int], tuple[int, int]]:
    """Each destination byte (region, offset) -> the source byte it gets."""
    f = r.flat()
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for sr, so, dr, do, n in zip(
        *(getattr(f, x).tolist() for x in ("src_region", "src_offset", "dst_region", "dst_offset")),
        f.nbytes.tolist(),
        strict=True,
    ):
        for i in range(n):
            assert (dr, do + i) not in out
            out[(dr, do + i)] = (sr, so + i)
    return out


def repeated(t: Runs, p: Repeat) -> Runs:
    """``t`` repeated as ``p`` repeats its template, one array at a time."""
    m = len(p.src_base)
    return Runs(
        np.repeat(p.src_reg, len(t)),
        np.add.outer(p.src_base, t.src_offset).ravel(),
        np.repeat(p.dst_reg, len(t)),
        np.add.outer(p.dst_base, t.dst_offset).ravel(),
        *(np.tile(getattr(t, f), m) for f in FIELDS[4:]),
    )


@settings(max_examples=examples(300), deadline=None)
@given(repeats())
def test_assembled_runs_are_the_whole_coalesced(parts: list[tuple[Runs, Repeat]]) -> None:
    """:func:`assemble` writes each repeat in place and coalesces again only where a
    junction between two blocks keeps both regions. Where none does, what it gives is run
    for run the whole request's runs coalesced in one pass (coalescing a run never depends
    on runs it cannot link with); either way the bytes go where the whole's go, and nothing
    is left to merge."""
    got = assemble([p for _, p in parts])
    whole = Runs.concat([repeated(raw, p) for raw, p in parts])
    assert region_map(got) == region_map(whole)
    assert len(coalesce(got)) == len(got)  # nothing left to merge, across junctions too
    blocks = [(p.src_reg[k], p.dst_reg[k]) for _, p in parts for k in range(len(p.src_base))]
    if all(a[0] != b[0] or a[1] != b[1] for a, b in zip(blocks, blocks[1:], strict=False)):
        want = coalesce(whole)
        for f in FIELDS:
            assert np.array_equal(getattr(got, f), getattr(want, f)), f


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=40))
def test_links_are_the_greedy_recurrence(pairs: list[tuple[bool, bool]]) -> None:
    """Chaining, solved without a loop, is the greedy rule run pair by pair: a linkable pair
    links unless the pair before it linked with another step."""
    cand = np.array([c for c, _ in pairs], dtype=bool)
    same = np.array([s for _, s in pairs[1:]], dtype=bool)  # pair i steps as pair i - 1
    want: list[bool] = []
    for i, c in enumerate(cand.tolist()):
        want.append(c and (i == 0 or not want[-1] or bool(same[i - 1])))
    assert _links(cand, same).tolist() == want
