"""Issue 33: a config transformers runs never breaks ``kvbridge demo --model``.

Scaling a config down must keep every relation between its fields (a layer-type list and the
layer ids derived from it, heads and their groups, key and value head dims), and before any
process starts the parent proves that transformers runs the scaled config: the cache
described, the model built and run on a few tokens as the reference runs it. What fails is
refused in one line, naming the field or the error; it never reaches a worker.

The issue's Zamba2 config, written as a user would (4 layers with its own layer pattern; its
RecurrentGemma runs now: tests/test_demo_families.py), and sweeps of generated variations of
every architecture of the installed transformers (layer counts with the layer lists, id lists,
patterns, periods that must move with them; head/group ratios), so that the next such break is
found here.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the demo needs torch: pip install -e '.[demo]'")
pytest.importorskip("transformers", reason="the demo needs transformers: pip install -e '.[demo]'")

from kvbridge.demo import configs, forward, scaling, sweep, variants  # noqa: E402
from kvbridge.demo.configs import (  # noqa: E402
    _floats,
    case_from_config,
    case_from_raw,
    layer_structure,
)
from kvbridge.demo.matrix import cells  # noqa: E402
from kvbridge.demo.models import hf_config, weights_digest  # noqa: E402
from kvbridge.errors import SpecError  # noqa: E402
from kvbridge.model.spec import CacheSpec, LayerKind  # noqa: E402

# The issue's configs, as a new user wrote them: transformers builds and runs both unscaled.
ZAMBA2 = {
    "model_type": "zamba2",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
    "hybrid_layer_ids": [1, 3],
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_mamba_heads": 8,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_ngroups": 1,
    "num_mem_blocks": 1,
    "vocab_size": 1000,
}


def _written(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _as_transformers_builds(config: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    fields = _floats(config)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _one_line(e: pytest.ExceptionInfo[SpecError]) -> str:
    message = str(e.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert not multiprocessing.active_children(), "refused after a process started"
    return message


# ---- the issue's two configs -------------------------------------------------------------------


@pytest.mark.slow  # some 4 s of CPU here: past the fast tier's budget
def test_zamba2s_layer_ids_move_with_its_layer_types(tmp_path: Path) -> None:
    """The break: scaling passed Zamba2's ``layers_block_type`` by its standard name
    (``layer_types``), which reaches the class after its ``__post_init__`` derived
    ``hybrid_layer_ids`` from the default 54-layer pattern: ``KeyError: 1`` in the shared
    transformer block. The class's own field name keeps the derivation the config's."""
    case = case_from_config(_written(tmp_path, ZAMBA2))
    small = hf_config(case)
    assert small.layers_block_type == ["linear_attention", "hybrid"] * 2
    assert small.hybrid_layer_ids == [1, 3]
    assert layer_structure(small) == layer_structure(_as_transformers_builds(ZAMBA2))


def test_zamba2_is_proven_before_any_process_starts(tmp_path: Path) -> None:
    """``cells`` (what the CLI calls before it starts anything) builds the scaled model and
    runs a few tokens through it in this process: the Zamba2 config passes."""
    todo = cells(_written(tmp_path, ZAMBA2), "tp2-tp1")
    assert not multiprocessing.active_children()
    assert [c.topology for c in todo] == ["tp2-tp1"]
    spec = forward.prove(todo[0].case)
    assert [layer.kind for layer in spec.layers] == [
        LayerKind.MAMBA2,
        LayerKind.FULL,
        LayerKind.MAMBA2,
        LayerKind.MAMBA2,
        LayerKind.FULL,
        LayerKind.MAMBA2,
    ]


def test_a_bfloat16_buffer_is_hashed() -> None:
    """Every process checks its weights by a hash of every parameter and buffer; RecurrentGemma
    keeps a bfloat16 buffer, which numpy cannot hold (``Got unsupported ScalarType BFloat16``
    in the reference run)."""
    module = torch.nn.Module()
    module.register_buffer("normalizer", torch.tensor(16.0, dtype=torch.bfloat16))
    other = torch.nn.Module()
    other.register_buffer("normalizer", torch.tensor(8.0, dtype=torch.bfloat16))
    assert weights_digest(module) != weights_digest(other)


# ---- what scaling misses, the parent refuses in one line ------------------------------------


def test_a_scaling_that_breaks_a_derived_field_is_refused_naming_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Had scaling still passed Zamba2's layer types by their standard name, the config would
    be refused when read, naming the field that no longer follows."""
    monkeypatch.setattr(scaling, "_own_names", lambda config, model_type, params: config)
    with pytest.raises(SpecError) as e:
        case_from_config(_written(tmp_path, ZAMBA2))
    assert "changed hybrid_layer_ids ([1, 3] as given, [6, 12, 18" in _one_line(e)


def test_what_the_config_checks_miss_the_forward_refuses_before_any_process_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last line of defence: with both the fix and the structure check taken away, the
    parent's few-token forward still refuses the config, naming transformers' error, before
    any process starts (where the issue saw ``0 of 1 cases token-exact``)."""
    monkeypatch.setattr(scaling, "_own_names", lambda config, model_type, params: config)
    monkeypatch.setattr(configs, "same_structure", lambda raw, case, where: None)
    with pytest.raises(SpecError) as e:
        cells(_written(tmp_path, ZAMBA2))
    message = _one_line(e)
    assert "transformers' own forward fails on the demo's scaled config" in message
    assert message.endswith("KeyError: 1")


# ---- widths that must stay related ----------------------------------------------------------


def test_head_sizes_the_config_has_equal_stay_equal() -> None:
    """LongCat-Flash's head_dim is its rotary width, equal to qk_rope_head_dim (64): scaled
    apart (16 and 8), its rotary embedding no longer fits the queries' rotated part and
    transformers' forward fails; kept equal, it runs."""
    config = {**sweep.saved_defaults("longcat_flash"), "num_layers": 2}
    small = case_from_raw(config, "t", "longcat_flash").config
    assert small["head_dim"] == small["qk_rope_head_dim"] == 8
    assert small["qk_nope_head_dim"] == small["v_head_dim"] == 16  # equal as given, too
    forward.prove(case_from_raw(config, "t", "longcat_flash"))


def test_an_attention_width_the_class_ties_to_the_hidden_size_stays_tied(tmp_path: Path) -> None:
    """Helium's output projection maps the hidden size to itself, so its heads x head_dim must
    be its hidden size, as the config has them (20 x 128 = 2560): the demo's usual scaling
    (hidden 4 a head, head_dim 16) fails in transformers' forward, and the parent scales it
    again with the two tied, before any process starts."""
    config = {**sweep.saved_defaults("helium"), "num_hidden_layers": 2}
    with pytest.raises(SpecError) as e:
        forward.prove(case_from_raw(config, "t", "helium"))
    assert "transformers' own forward fails" in _one_line(e)
    case = cells(_written(tmp_path, config), "tp2-tp1")[0].case
    small = case.config
    assert small["num_attention_heads"] * small["head_dim"] == small["hidden_size"] == 320


def test_an_encoder_decoders_causal_lm_has_its_decoders_heads() -> None:
    """Whisper's and BART's causal LM is their decoder, while the standard head counts name the
    encoder's (Whisper's ``encoder_attention_heads`` is both num_attention_heads and
    num_key_value_heads): described, scaled and run by the decoder's own heads."""
    config = {**sweep.saved_defaults("whisper"), "decoder_attention_heads": 3}
    got = sweep.check("whisper", "decoder heads", config)
    assert got.outcome is sweep.Outcome.EXACT, got
    spec = forward.describe(case_from_raw(config, "t", "whisper", full_size=True))
    assert [s.units for s in spec.layers[0].components[0].segments] == [3]


# ---- generated variations: fields that must move together ----------------------------------

# The hybrids and patterns the demo runs (and Jamba's period and offset): fast enough for every
# run of the suite (config objects only, some 3 s); the slow test takes every architecture.
LAYERED = (
    "zamba2",
    "bamba",
    "jamba",
    "nemotron_h",
    "lfm2",
    "qwen3_next",
    "gemma3_text",
    "granitemoehybrid",
)
GROUPED = (
    "qwen3",
    "bamba",
    "nemotron_h",
    "qwen3_next",
    "zamba2",
    "falcon_h1",
    "mimo_v2_flash",
    "whisper",
)


def _taken(model_type: str, i: int, name: str, config: dict[str, Any]) -> bool:
    """Whether the demo takes ``config`` (as far as it decides from the config): never
    broken, never refused for a field scaling left behind."""
    r = sweep.check(model_type, f"variant {i}", config, sweep.Depth.CONFIG)
    assert r.outcome in (sweep.Outcome.ACCEPTED, sweep.Outcome.REFUSED), (name, r)
    assert "was not scaled with it" not in r.detail, (name, r.detail)
    return r.outcome is sweep.Outcome.ACCEPTED


def _check_layer_variants(model_type: str) -> int:
    taken = 0
    for i, (name, config) in enumerate(variants.derived_variants(model_type)):
        if not _taken(model_type, i, name, config):
            continue
        small = hf_config(case_from_raw(config, model_type, model_type))
        given = layer_structure(_as_transformers_builds(config))
        assert layer_structure(small) == given, name
        taken += 1
    return taken


def _units(spec: CacheSpec) -> list[Any]:
    """Per layer, its kind and (where they are heads or groups, which scaling keeps) the units
    of every sharded segment; Mamba1 and short-conv states are sharded by channel, which
    scaling shrinks with the hidden size."""
    return [
        (
            layer.kind,
            None
            if layer.kind in (LayerKind.MAMBA1, LayerKind.SHORT_CONV)
            else [[s.units for s in c.segments] for c in layer.components],
        )
        for layer in spec.layers
    ]


def _check_group_variants(model_type: str) -> int:
    taken = 0
    for i, (name, config) in enumerate(variants.group_variants(model_type)):
        if not _taken(model_type, i, name, config):
            continue
        small = forward.describe(case_from_raw(config, model_type, model_type))
        try:
            full = forward.describe(case_from_raw(config, model_type, model_type, full_size=True))
        except SpecError as e:  # the real model is refused: so must its scaled stand-in be
            pytest.fail(f"{name}: taken scaled, refused at full size: {e}")
        assert _units(small) == _units(full), name
        taken += 1
    return taken


@pytest.mark.parametrize("model_type", LAYERED)
def test_layer_lists_and_ids_move_together_when_scaled(model_type: str) -> None:
    """Random layer counts with layer-type lists, patterns, id lists, periods and offsets
    drawn to match, as saved, by standard names and as sources alone: the scaled config says
    of every layer what the config as given says (and the cache's layer classes are the same)."""
    assert _check_layer_variants(model_type) > 0


@pytest.mark.parametrize("model_type", GROUPED)
def test_head_groups_and_ratios_survive_scaling(model_type: str) -> None:
    """Every divisor of the heads as the group count (GQA 1:1 to MQA, Mamba2 groups, GDN key
    heads): the scaled model's cache has the same layer kinds and the same units on every
    sharded axis as the real model's, and a real model the demo cannot describe (MiMo-V2-Flash:
    keys and values of different head dims) is refused scaled too."""
    _check_group_variants(model_type)


# (every causal LM type: those without such fields have no variants, and pass at once)
@pytest.mark.slow  # every architecture of the installed transformers: some 30 s
@pytest.mark.parametrize("model_type", sweep.causal_lm_types())
def test_every_architectures_layer_lists_move_together_when_scaled(model_type: str) -> None:
    _check_layer_variants(model_type)


@pytest.mark.slow  # every architecture of the installed transformers: some 60 s
@pytest.mark.parametrize("model_type", sweep.causal_lm_types())
def test_every_architectures_head_groups_survive_scaling(model_type: str) -> None:
    _check_group_variants(model_type)


@pytest.mark.slow  # tiny models built and run in this process (no rank processes): some 30 s
@pytest.mark.parametrize("model_type", LAYERED)
def test_layer_variants_the_demo_takes_run_through_the_proof(model_type: str) -> None:
    """What the demo takes of the generated layer patterns is built and run on a few tokens
    (the parent's proof, :func:`kvbridge.demo.forward.prove`) without a refusal: each pattern
    the class accepts, transformers runs at the demo's size. (But a hybrid drawn without an
    attention layer: transformers' hybrid classes do not run one at any size, "`get_seq_length`
    can only be called on Attention layers", as the record says of Bamba's defaults.)"""
    attention = {LayerKind.FULL, LayerKind.SLIDING, LayerKind.MLA, LayerKind.MLA_INDEXER}
    proven = 0
    for i, (name, config) in enumerate(variants.derived_variants(model_type)):
        if not name.endswith("sources only") or not _taken(model_type, i, name, config):
            continue
        case = case_from_raw(config, model_type, model_type)
        if not attention & {layer.kind for layer in forward.describe(case).layers}:
            continue
        try:
            forward.prove(case)
        except SpecError as e:
            pytest.fail(f"{name}: {e}")
        proven += 1
    assert proven > 0


@pytest.mark.slow  # one real deployment (a process per rank): some 15 s
def test_the_issues_zamba2_config_runs_disaggregated_exactly(tmp_path: Path) -> None:
    """Where the issue saw ``0 of 1 cases token-exact``: token-exact and cache-bitwise."""
    from kvbridge.demo.run import Runner

    (cell,) = cells(_written(tmp_path, ZAMBA2), "tp2-tp1")
    r = Runner().run(cell.case, cell.topology, "shm", new_tokens=6)
    assert r.ok, r.problem
