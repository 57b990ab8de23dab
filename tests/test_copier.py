"""A rank's copies between its own regions (kvbridge.memory.copier), as the staged path makes
them: a request's runs cut into segments, each gathered into a staging slot and scattered out
of it. The torch copier (a device rank's; here on CPU tensors over the same memory) lands the
bytes the numpy one does, byte for byte, and both refuse a run outside its region before any
byte moves."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import TransportError
from kvbridge.memory.copier import Copier, HostCopier, TorchCopier
from kvbridge.memory.location import HOST
from kvbridge.planner.runs import Runs
from kvbridge.staging.layout import gather, scatter, segments
from tiers import examples

torch = pytest.importorskip("torch", reason="the demo extra installs torch")

SRC, DST, SLOT = ("a", "b"), ("c", "d"), "kvbridge.staging"
UNITS = 48  # each region's size in units


@st.composite
def requests(draw: st.DrawFn) -> tuple[int, int, Runs]:
    """(unit bytes, segment bytes, runs): flat runs from two source regions into two
    destination regions, each destination unit written once (segments cut them anew)."""
    unit = draw(st.sampled_from([1, 8, 64, 512]))
    free = draw(st.permutations([(d, u) for d in range(2) for u in range(UNITS)]))
    n = draw(st.integers(1, 40))
    cols: list[list[int]] = [[] for _ in range(8)]
    for d, u in free[:n]:
        cols[0].append(draw(st.integers(0, 1)))
        cols[1].append(draw(st.integers(0, UNITS - 1)) * unit)
        cols[2].append(d)
        cols[3].append(u * unit)
        cols[4].append(unit)
        cols[5].append(1)
        cols[6].append(0)
        cols[7].append(0)
    runs = Runs(*(np.array(c, dtype=np.int64) for c in cols))
    return unit, draw(st.integers(1, 4)) * unit + draw(st.sampled_from([0, 1])), runs


def memory() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    views = {n: rng.integers(0, 256, UNITS * 512, dtype=np.uint8) for n in SRC}
    views |= {n: np.full(UNITS * 512, 0xA5, dtype=np.uint8) for n in DST}
    views[SLOT] = np.zeros(4 * 512 + 1, dtype=np.uint8)
    return views


def staged(copier: Copier, runs: Runs, segment: int) -> None:
    """Every segment gathered into the slot, then scattered out of it, as the two ranks do."""
    for seg in segments(runs, segment):
        copier.copy(gather(seg, 0), SRC, (SLOT,))
        copier.copy(scatter(seg, 0), (SLOT,), DST)


@settings(max_examples=examples(150), deadline=None)
@given(requests())
def test_the_torch_copier_stages_what_the_numpy_one_does(job: tuple[int, int, Runs]) -> None:
    _, segment, runs = job
    host, mine = memory(), memory()
    staged(HostCopier(host), runs, segment)
    staged(
        TorchCopier({n: torch.from_numpy(v) for n, v in mine.items()}, torch, HOST), runs, segment
    )
    for n in DST:
        assert np.array_equal(host[n], mine[n]), n
    direct = memory()
    HostCopier(direct).copy(runs, SRC, DST)
    for n in DST:  # staged or not, the same bytes land
        assert np.array_equal(host[n], direct[n]), n


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_run_outside_its_region_is_refused_before_any_byte_moves(kind: str) -> None:
    views = memory()
    before = {n: v.copy() for n, v in views.items()}
    one = np.ones(2, dtype=np.int64)
    runs = Runs(
        0 * one,
        np.array([0, UNITS * 512 - 8]),
        0 * one,
        np.array([0, 64]),
        16 * one,
        one,
        0 * one,
        0 * one,
    )
    copier: Copier = (
        HostCopier(views)
        if kind == "numpy"
        else TorchCopier({n: torch.from_numpy(v) for n, v in views.items()}, torch, HOST)
    )
    with pytest.raises(TransportError, match="outside|past|beyond|region"):
        copier.copy(runs, SRC[:1], DST[:1])
    for n, v in views.items():
        assert np.array_equal(v, before[n]), n
