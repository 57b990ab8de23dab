"""The cudaipc transport's copies (kvbridge.memory.gather), on CPU tensors: many runs as
rows of their common divisor in one gather and one scatter, few or narrow ones one by one;
byte for byte what copying each run alone gives, with every byte outside the runs kept."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.memory.gather import FEW, MIN_ROW, copy_runs
from kvbridge.planner.runs import Runs
from tiers import examples

torch = pytest.importorskip("torch", reason="the demo extra installs torch")


@st.composite
def jobs(draw: st.DrawFn) -> tuple[list[int], list[int], Runs]:
    """Regions on both sides, and runs in units of ``unit`` bytes whose destinations are
    disjoint (each destination unit written at most once), sources anywhere."""
    unit = draw(st.sampled_from([1, 2, 8, MIN_ROW, 64, 4096]))
    src_units = draw(st.lists(st.integers(1, 96), min_size=1, max_size=2))
    dst_units = draw(st.lists(st.integers(1, 96), min_size=1, max_size=2))
    free = [(d, u) for d, n in enumerate(dst_units) for u in range(n)]
    order = draw(st.permutations(free))
    wanted = draw(st.integers(1, 4 * FEW))  # runs: a few, or enough to be gathered
    fields: list[list[int]] = [[], [], [], [], []]
    i = 0
    while i < len(order) and len(fields[0]) < wanted:
        d, u = order[i]
        length = 1  # extend over the next destination units of the same region, if free
        while i + length < len(order) and order[i + length] == (d, u + length) and length < 4:
            length += 1
        s = draw(st.integers(0, len(src_units) - 1))
        start = draw(st.integers(0, max(0, src_units[s] - length)))
        length = min(length, src_units[s] - start)
        for f, v in zip(fields, (s, start * unit, d, u * unit, length * unit), strict=True):
            f.append(v)
        i += length
    arrays = [np.array(f, dtype=np.int64) for f in fields]
    ones, zeros = np.ones(len(arrays[0]), np.int64), np.zeros(len(arrays[0]), np.int64)
    runs = Runs(*arrays, ones, zeros, zeros.copy())
    return [n * unit for n in src_units], [n * unit for n in dst_units], runs


@settings(max_examples=examples(150), deadline=None)
@given(jobs(), st.integers(0, 7))
def test_the_runs_land_as_copied_one_by_one(
    job: tuple[list[int], list[int], Runs], shift: int
) -> None:
    src_sizes, dst_sizes, runs = job
    rng = np.random.default_rng(len(runs))
    # Tensors at odd offsets into their storage too: the rows' element width must follow.
    src = [
        torch.from_numpy(rng.integers(0, 256, n + shift, dtype=np.uint8))[shift:] for n in src_sizes
    ]
    dst = [torch.full((n + shift,), 0xA5, dtype=torch.uint8)[shift:] for n in dst_sizes]
    want = [d.numpy().copy() for d in dst]
    for s, so, d, do, n in zip(
        runs.src_region, runs.src_offset, runs.dst_region, runs.dst_offset, runs.nbytes, strict=True
    ):
        want[d][do : do + n] = src[s].numpy()[so : so + n]
    copy_runs(torch, dst, src, runs)
    for d, w in zip(dst, want, strict=True):
        assert np.array_equal(d.numpy(), w)


def test_strided_runs_are_expanded_and_gathered() -> None:
    # 64 blocks of 256 bytes, every other one, into consecutive places: one gather of 64 rows.
    src = torch.arange(64 * 512, dtype=torch.int64).view(torch.uint8)[: 64 * 512]
    dst = torch.zeros(64 * 256, dtype=torch.uint8)
    one = np.ones(1, np.int64)
    runs = Runs(0 * one, 0 * one, 0 * one, 0 * one, 256 * one, 64 * one, 512 * one, 256 * one)
    copy_runs(torch, [dst], [src], runs)
    want = src.numpy().reshape(64, 512)[:, :256].ravel()
    assert np.array_equal(dst.numpy(), want)
