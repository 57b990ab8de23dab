"""kvbridge.memory.copy: execute matches a one-block-at-a-time reference; check refuses every run
that leaves its region, names it, and cannot be fooled by int64 overflow; split keeps every byte."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import TransportError
from kvbridge.memory.copy import check, execute, progressions, split
from kvbridge.planner.runs import Runs


def z(*a: int) -> np.ndarray:
    return np.asarray(a, dtype=np.int64)


def reference(runs: Runs, src: list[np.ndarray], dst: list[np.ndarray]) -> None:
    f = runs.flat()
    for i in range(len(f)):
        s, d, n = int(f.src_offset[i]), int(f.dst_offset[i]), int(f.nbytes[i])
        dst[int(f.dst_region[i])][d : d + n] = src[int(f.src_region[i])][s : s + n]


def random_runs(rng: np.random.Generator, n: int, size: int) -> Runs:
    """Runs into disjoint destination slots (flat, strided, negative strides, sizes around the
    small/large threshold), from anywhere in the source."""
    nbytes = rng.choice([1, 7, 64, 512, 4096, 70_000], n)
    # Strided runs of a few blocks (copied as flat blocks) and of many (one strided copy each).
    count = np.where(rng.random(n) < 0.4, rng.choice([2, 3, 5, 16, 40], n), 1)
    nbytes = np.where(count > 1, np.minimum(nbytes, 4096), nbytes)
    dst_stride = np.where(count > 1, nbytes * rng.choice([1, 2, -3], n), 0)
    span = (count - 1) * np.abs(dst_stride) + nbytes
    slot = np.cumsum(span + 8) - span  # disjoint, in run order
    dst_offset = np.where(dst_stride < 0, slot + (count - 1) * -dst_stride, slot)
    src_stride = np.where(count > 1, rng.integers(-5000, 5000, n), 0)
    lo = np.maximum(0, -(count - 1) * src_stride)
    hi = size - nbytes - np.maximum(0, (count - 1) * src_stride)
    src_offset = lo + (rng.random(n) * (hi - lo)).astype(np.int64)
    return Runs(
        z(*rng.integers(0, 2, n)),
        src_offset.astype(np.int64),
        z(*np.zeros(n, int)),
        dst_offset.astype(np.int64),
        nbytes.astype(np.int64),
        count.astype(np.int64),
        src_stride.astype(np.int64),
        dst_stride.astype(np.int64),
    )


def test_execute_matches_reference() -> None:
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, 1 << 20, dtype=np.uint8) for _ in range(2)]
    runs = random_runs(rng, 400, 1 << 20)
    need = int(
        (runs.dst_offset + (runs.count - 1) * np.maximum(runs.dst_stride, 0) + runs.nbytes).max()
    )
    got, want = [np.zeros(need + 64, np.uint8)], [np.zeros(need + 64, np.uint8)]
    execute(runs, src, got)
    reference(runs, src, want)
    assert np.array_equal(got[0], want[0])
    # Split into parts and executed part by part: the same bytes.
    again = [np.zeros(need + 64, np.uint8)]
    parts = split(runs, 3, min_bytes=1)
    assert sum(p.total_bytes for p in parts) == runs.total_bytes
    for p in parts:
        execute(p, src, again)
    assert np.array_equal(again[0], want[0])


def test_many_equal_small_runs_are_grouped_correctly() -> None:
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 256, 1 << 16, dtype=np.uint8)]
    n = 5000
    s_off = rng.integers(0, (1 << 16) - 40, n)
    d_off = rng.permutation(n) * 40
    runs = Runs(
        z(*[0] * n),
        s_off.astype(np.int64),
        z(*[0] * n),
        d_off.astype(np.int64),
        z(*[40] * n),
        z(*[1] * n),
        z(*[0] * n),
        z(*[0] * n),
    )
    got, want = [np.zeros(n * 40, np.uint8)], [np.zeros(n * 40, np.uint8)]
    execute(runs, src, got)
    reference(runs, src, want)
    assert np.array_equal(got[0], want[0])


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        (
            Runs(z(0), z(0), z(0), z(4000), z(97), z(1), z(0), z(0)),
            r"run 0: dst region 0 'd' of 4096 bytes: bytes \[4000, 4097\) do not fit",
        ),
        (Runs(z(0), z(0), z(1), z(0), z(1), z(1), z(0), z(0)), "region index 1, but there are 1"),
        (Runs(z(0), z(0), z(0), z(0), z(64), z(2), z(64), z(32)), "overlap each other"),
        (Runs(z(0), z(0), z(0), z(0), z(8), z(1 << 61), z(0), z(1 << 61)), "do not fit"),
        (Runs(z(0), z(0), z(0), z(100), z(8), z(1 << 40), z(0), z(-(1 << 40))), "do not fit"),
    ],
)
def test_check_names_the_run_and_bound(runs: Runs, message: str) -> None:
    with pytest.raises(TransportError, match=message):
        check(runs, [4096], [4096], src_names=["s"], dst_names=["d"])


def test_nothing_is_written_when_any_run_is_bad() -> None:
    src, dst = [np.ones(100, np.uint8)], [np.zeros(100, np.uint8)]
    runs = Runs(z(0, 0), z(0, 0), z(0, 0), z(0, 90), z(10, 11), z(1, 1), z(0, 0), z(0, 0))
    with pytest.raises(TransportError, match="run 1"):
        execute(runs, src, dst)
    assert not dst[0].any()


def test_split_cuts_a_single_large_run() -> None:
    one = Runs(z(0), z(0), z(0), z(0), z(1 << 30), z(1), z(0), z(0))
    parts = split(one, 4, min_bytes=1 << 20)
    assert len(parts) == 4 and [p.total_bytes for p in parts] == [1 << 28] * 4
    strided = Runs(z(0), z(0), z(0), z(0), z(512), z(1 << 16), z(2048), z(1024))
    parts = split(strided, 2, min_bytes=1)
    assert [int(p.count.sum()) for p in parts] == [1 << 15] * 2
    assert int(parts[1].dst_offset[0]) == (1 << 15) * 1024


def _progressions_looped(*offsets: np.ndarray, min_len: int) -> list[tuple[int, int]]:
    """progressions' rule as a loop over every span of equal steps (a run ends one
    progression or starts the next)."""
    if len(offsets[0]) < min_len:
        return []
    steps = [np.diff(o).tolist() for o in offsets]
    out: list[tuple[int, int]] = []
    a = 0
    for m in range(1, len(steps[0]) + 1):  # steps [a, m) are equal; m ends the span
        if m < len(steps[0]) and all(st[m] == st[a] for st in steps):
            continue
        lo = max(a, out[-1][1] if out else 0)
        if m + 1 - lo >= min_len and all(st[lo] != 0 for st in steps):
            out.append((lo, m + 1))
        a = m
    return out


@pytest.mark.parametrize("seed", range(40))
def test_progressions_are_every_long_enough_span_of_one_step(seed: int) -> None:
    """The vectorized search (it looks only at spans long enough: scattered pages have a span
    a run) finds what a loop over every span finds, with zero steps and several arrays."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        n, min_len = int(rng.integers(2, 90)), int(rng.integers(2, 20))
        arrays = []
        for _ in range(int(rng.integers(1, 4))):
            step = rng.choice([0, 1, 2, 5, -3], n - 1)
            if rng.random() < 0.6:  # repeated steps: progressions to find
                step = np.repeat(step, int(rng.integers(2, 12)))[: n - 1]
            arrays.append(np.concatenate(([0], np.cumsum(step))).astype(np.int64))
        got = progressions(*arrays, min_len=min_len)
        assert got == _progressions_looped(*arrays, min_len=min_len), (arrays, min_len)
