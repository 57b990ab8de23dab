"""The models users bring (``kvbridge demo --model``): every causal LM of the installed
transformers, from its own defaults and variations, runs exact or is refused in one line
(:mod:`kvbridge.demo.sweep`); the configs that failed users before run; the coverage tables in
the docs are rendered from the sweep's record."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the demo needs torch: pip install -e '.[demo]'")
transformers = pytest.importorskip(
    "transformers", reason="the demo needs transformers: pip install -e '.[demo]'"
)

from kvbridge.demo import sweep  # noqa: E402
from kvbridge.demo.cachemap import cache_map  # noqa: E402
from kvbridge.demo.configs import case_from_raw, is_structure_field  # noqa: E402
from kvbridge.demo.models import build_model, weigh  # noqa: E402
from kvbridge.demo.run import logged  # noqa: E402
from kvbridge.model.spec import LayerKind  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def record() -> tuple[str, list[sweep.Result]]:
    return sweep.from_json(sweep.RECORD.read_text())


# ---- the configs users brought (issue 21) -----------------------------------------------------


def test_an_infinite_float_default_as_saved_is_read_back() -> None:
    """save_pretrained writes Mamba2's infinite ``time_step_limit`` as ``{"__float__":
    "Infinity"}``: read back as the float, the scaled config validates and builds."""
    saved = sweep.saved_defaults("mamba2")
    assert {"__float__": "Infinity"} in saved["time_step_limit"]
    case = case_from_raw(saved, "mamba2 as saved", "mamba2")
    assert case.config["time_step_limit"][1] == float("inf")
    assert {layer.kind for layer in cache_map(case).spec.layers} == {LayerKind.MAMBA2}


def test_special_token_ids_of_a_real_vocabulary_never_index_past_the_demos() -> None:
    """A real model's pad/bos/eos ids (or the class defaults, when a config leaves them out)
    would index past the demo's 256-token vocabulary (``Padding_idx must be within
    num_embeddings``): the model builds, with no id past it."""
    for raw in (
        {"model_type": "llama", "pad_token_id": 151643, "eos_token_id": [151645, 151643]},
        {"model_type": "qwen2"},  # the class defaults: a real vocabulary's ids
    ):
        case = case_from_raw(raw, "a user's config", "user")
        ids = [v for k, v in case.config.items() if k.endswith("_token_id") and v is not None]
        assert all(0 <= i < 256 for i in ids), case.config
        model = build_model(case, 1)
        assert model.get_input_embeddings().num_embeddings == 256


def test_a_mamba_head_count_of_another_name_is_read() -> None:
    """Zamba2 names its Mamba heads ``n_mamba_heads`` (and head dim, groups otherwise too)."""
    case = case_from_raw(sweep.saved_defaults("zamba2"), "zamba2", "zamba2")
    kinds = {layer.kind for layer in cache_map(case).spec.layers}
    assert LayerKind.MAMBA2 in kinds


def test_a_models_sub_models_are_scaled_by_their_own_classes_rules() -> None:
    """Git's causal LM holds a vision encoder (its ``vision_config``: 86M parameters at its
    default size), given or left to the class: scaled by the encoder's own class's rules, the
    whole model is small and its text cache runs exact."""
    for raw in ({"model_type": "git"}, sweep.saved_defaults("git")):
        case = case_from_raw(raw, "git", "git")
        vision = case.config["vision_config"]
        assert vision["hidden_size"] <= 128 and vision["intermediate_size"] <= 64, vision
        weigh(case)  # (SpecError over MAX_PARAMS)
    got = sweep.check("git", "defaults", {**sweep.saved_defaults("git"), "num_hidden_layers": 2})
    assert got.outcome is sweep.Outcome.EXACT, got


def test_a_composite_models_causal_lm_is_built_from_its_own_part() -> None:
    """The part of a composite config its causal LM is built from: Emu3's text config, which
    AutoModelForCausalLM does not map (its own Emu3ForCausalLM is used), and MusicGen's
    ``decoder`` (not ``text_config``)."""
    got = sweep.check(
        "emu3", "defaults", {"model_type": "emu3", "text_config": {"num_hidden_layers": 2}}
    )
    assert got.outcome is sweep.Outcome.EXACT, got
    case = case_from_raw(sweep.saved_defaults("musicgen"), "musicgen", "musicgen")
    assert case.model_type == "musicgen_decoder", case.model_type


def test_mllamas_cross_attention_layers_hold_nothing_without_an_image_the_rest_is_exact() -> None:
    """Mllama's cross-attention layers cache the image's keys and values; a text-only request
    (the demo's) has none, and transformers skips those layers: they are no spec layer, and the
    self-attention layers between them travel exactly."""
    case = case_from_raw({"model_type": "mllama"}, "mllama", "mllama")
    cross = case.config["cross_attention_layers"]  # the text config, the causal LM's part
    layers = cache_map(case).layers
    assert cross and not {hf.hf_index for hf in layers} & set(cross), cross
    assert len(layers) + len(cross) == case.config["num_hidden_layers"]
    got = sweep.check("mllama", "model_type only", {"model_type": "mllama"})
    assert got.outcome is sweep.Outcome.EXACT, got


def test_a_workers_traceback_becomes_one_line_and_a_log_file() -> None:
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad pad\n'
    line = logged(trace)
    assert "\n" not in line and line.startswith("raised ValueError: bad pad")
    path = re.search(r"full log: (\S+)\)", line)
    assert path and Path(path.group(1)).read_text() == trace


# ---- the record and the tables rendered from it ----------------------------------------------


def test_the_docs_tables_are_rendered_from_the_record() -> None:
    version, results = record()
    md = sweep.RECORD.with_suffix(".md").read_text()
    assert md == sweep.markdown(results, version), "run: python -m kvbridge.demo.sweep --write"
    readme = (ROOT / "README.md").read_text()
    assert sweep.families(results) in readme, "README's coverage table is not the record's"


def test_the_record_is_of_the_installed_transformers_and_has_no_broken_case() -> None:
    version, results = record()
    assert version == transformers.__version__, "rerun the sweep for this transformers"
    assert {r.model_type for r in results} == set(sweep.causal_lm_types())
    assert not [r for r in results if r.outcome is sweep.Outcome.BROKEN]
    assert all("\n" not in r.detail for r in results)


# ---- the sweep, run again ------------------------------------------------------------------


@pytest.mark.slow  # every causal LM's configs through the demo's scaling: some 10 s
def test_every_config_is_taken_or_refused_in_one_line_as_recorded() -> None:
    """Every model type and variant, as far as the demo decides before any process starts:
    none breaks (an error other than a one-line refusal), and each agrees with the record
    (refused for the same reason; taken with the same cache kinds, where the record's run
    went further and found it exact, taken, or refused by transformers' own model)."""
    _, results = record()
    recorded = {(r.model_type, r.variant): r for r in results}
    taken = (sweep.Outcome.EXACT, sweep.Outcome.ACCEPTED)
    for got in sweep.sweep():
        want = recorded[(got.model_type, got.variant)]
        assert got.outcome in (sweep.Outcome.ACCEPTED, sweep.Outcome.REFUSED), got
        if got.outcome is sweep.Outcome.REFUSED:
            assert (want.outcome, want.detail) == (got.outcome, got.detail), got
        elif want.outcome in taken:
            assert want.kinds == got.kinds, got


def _one_per_family() -> list[str]:
    """Of each set of cache kinds the record calls exact and the demo's own models do not run
    (tests/test_demo.py runs those, in one process and deployed), the architecture with the
    fewest layers by default (the run's cost is the layers': Mamba2's 64 take half a minute)."""
    from kvbridge.demo.models import CASES
    from kvbridge.demo.scaling import declared_defaults

    _, results = record()
    families: dict[tuple[str, ...], list[str]] = {}
    for r in results:
        if r.outcome is sweep.Outcome.EXACT:
            families.setdefault(r.kinds, []).append(r.model_type)
    own = {c.model_type for c in CASES.values()}
    families = {k: ts for k, ts in families.items() if not own & set(ts)}

    def layers(t: str) -> int:
        n = declared_defaults(t).get("num_hidden_layers")
        return n if isinstance(n, int) else 1 << 10

    return sorted({min(types, key=lambda t: (layers(t), t)) for types in families.values()})


@pytest.mark.slow  # a model a family, built and run: some 30 s
@pytest.mark.parametrize("model_type", _one_per_family())
def test_one_architecture_of_each_cache_family_runs_exact(model_type: str) -> None:
    """The whole path (prefill, shard, plan, execute, reassemble, decode) for the first
    architecture of each set of cache kinds the record calls exact, from its saved defaults;
    at most 8 layers where no field lists the layers one by one (Mamba2's 64 layers cost a
    minute here, and every layer is of the same kind)."""
    config = sweep.saved_defaults(model_type)
    n = config.get("num_hidden_layers")
    per_layer = any(isinstance(v, list) and len(v) == n for v in config.values())
    if isinstance(n, int) and n > 8 and not per_layer:
        # (and the layer count under another name: xLSTM's num_blocks)
        layer_counts = {"num_hidden_layers"} | {k for k, v in config.items() if v == n}
        config.update(
            {k: 8 for k in layer_counts if k == "num_hidden_layers" or is_structure_field(k)}
        )
    got = sweep.check(model_type, "defaults", config)
    assert got.outcome is sweep.Outcome.EXACT, got
    _, results = record()
    want = next(r for r in results if (r.model_type, r.variant) == (model_type, "defaults"))
    assert got.kinds == want.kinds, "fewer layers lost a cache kind of the family"
