"""Every decoder of outside input (kvbridge.chaos.fuzz.TARGETS), fuzzed with hypothesis: random
bytes, the targets' own valid inputs with bytes flipped, inserted, cut, and for the JSON
decoders their valid inputs with any field replaced by any JSON value. Each input must end in
a result or a KVBridgeError naming what is wrong, nothing else. ``benchmarks/fuzz.py`` runs the
same targets for longer (coverage-guided with atheris) and reports the counts."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.chaos import fuzz
from tiers import examples

BY_NAME = {t.name: t for t in fuzz.TARGETS}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated_bytes(draw: st.DrawFn, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["flip", "insert", "delete", "cut", "repeat"]))
        if op == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif op == "cut":
            del data[at:]
        elif op == "repeat":
            data[at:at] = data[at : at + draw(st.integers(1, 64))]
    return bytes(data)


@st.composite
def mutated_json(draw: st.DrawFn, value: Any) -> Any:
    """``value`` with any of its parts replaced by any JSON value, or kept."""
    if draw(st.integers(0, 4)) == 0:
        return draw(json_values)
    if isinstance(value, dict):
        out = {k: draw(mutated_json(v)) for k, v in value.items() if draw(st.integers(0, 9))}
        return out | draw(st.dictionaries(st.text(max_size=8), json_values, max_size=2))
    if isinstance(value, list):
        return [draw(mutated_json(v)) for v in value] + draw(st.lists(json_values, max_size=2))
    return value


def inputs(target: fuzz.Target) -> st.SearchStrategy[bytes]:
    seeds = st.sampled_from(target.seeds)
    ways = [st.binary(max_size=512), seeds.flatmap(mutated_bytes)]
    if target.json:
        structured = seeds.map(json.loads).flatmap(mutated_json)
        ways.append(structured.map(lambda v: json.dumps(v).encode()))
    return st.one_of(ways)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_every_decoder_answers_bad_input_with_a_typed_error(name: str) -> None:
    target = BY_NAME[name]
    for seed in target.seeds:  # the valid inputs decode
        target.run(json.loads(seed) if target.json else seed)

    @settings(
        max_examples=examples(600),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=inputs(target))
    def fuzzed(data: bytes) -> None:
        fuzz.run(target, data)

    fuzzed()
