"""CacheSpecs built from Hugging Face configs: presets of published models, and refusals.

The numbers asserted per preset are those of the models' published config.json files.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kvbridge.errors import LayoutError, SpecError
from kvbridge.model.hf import layer_origins, load_spec, spec_from_config, supported_model_types
from kvbridge.model.modelconfig import list_presets, load_config
from kvbridge.model.spec import CacheSpec, DType, LayerKind, Scope
from kvbridge.planner.shard import check_segment

EXPECTED_PRESETS = {
    "qwen3-32b",
    "qwen3-8b",
    "qwen3-0.6b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "deepseek-v3",
    "deepseek-v2-lite",
    "deepseek-v3.2",
    "qwen3-next-80b-a3b",
    "gpt-oss-120b",
    "gpt-oss-20b",
    "gemma-3-27b",
    "mistral-7b-v0.1",
    "nemotron-h-8b",
    "falcon-h1-7b",
    "bamba-9b",
}


def kinds(spec: CacheSpec) -> Counter[LayerKind]:
    return Counter(layer.kind for layer in spec.layers)


def heads(spec: CacheSpec, i: int) -> tuple[int, int]:
    """(KV heads, head_dim) of attention layer ``i``."""
    (seg,) = spec.layers[i].component("k").segments
    return seg.units, seg.unit_size


# ---- every preset ------------------------------------------------------------------------------


def test_every_expected_preset_ships() -> None:
    assert set(list_presets()) >= EXPECTED_PRESETS


@pytest.mark.parametrize("preset", list_presets())
def test_preset_loads_and_round_trips(preset: str) -> None:
    spec = load_spec(preset)
    assert spec.num_layers > 0
    assert CacheSpec.from_dict(spec.to_dict()).fingerprint == spec.fingerprint
    assert spec.model == load_config(preset)["_name_or_path"]
    assert len(layer_origins(load_config(preset))) == spec.num_layers


# (preset, layers, kv heads, head_dim) of dense full-attention models.
DENSE = [
    ("qwen3-32b", 64, 8, 128),
    ("qwen3-8b", 36, 8, 128),
    ("qwen3-0.6b", 28, 8, 128),
    ("llama-3.1-8b", 32, 8, 128),  # head_dim absent: 4096 / 32
    ("llama-3.1-70b", 80, 8, 128),  # head_dim absent: 8192 / 64
]


@pytest.mark.parametrize(("preset", "layers", "kv", "head_dim"), DENSE)
def test_dense_presets(preset: str, layers: int, kv: int, head_dim: int) -> None:
    spec = load_spec(preset)
    assert spec.num_layers == layers
    assert kinds(spec) == {LayerKind.FULL: layers}
    assert heads(spec, 0) == (kv, head_dim)
    assert spec.layers[0].component("v").dtype is DType.BFLOAT16
    assert not spec.has_state
    assert layer_origins(load_config(preset)) == tuple(range(layers))


def test_qwen3_32b_kv_bytes_per_token() -> None:
    spec = load_spec("qwen3-32b")
    # K and V: 8 heads x 128 x 2 bytes each, 64 layers.
    assert sum(c.item_bytes for layer in spec.layers for c in layer.components) == 64 * 2 * 2048


def test_mistral_slides_on_every_layer() -> None:
    spec = load_spec("mistral-7b-v0.1")
    assert spec.num_layers == 32
    assert {(layer.kind, layer.window) for layer in spec.layers} == {(LayerKind.SLIDING, 4096)}
    assert heads(spec, 0) == (8, 128)


@pytest.mark.parametrize(("preset", "layers"), [("gpt-oss-120b", 36), ("gpt-oss-20b", 24)])
def test_gpt_oss_alternates_sliding_and_full(preset: str, layers: int) -> None:
    spec = load_spec(preset)
    assert spec.num_layers == layers
    for i, layer in enumerate(spec.layers):
        if i % 2 == 0:
            assert (layer.kind, layer.window) == (LayerKind.SLIDING, 128)
        else:
            assert layer.kind is LayerKind.FULL
    assert heads(spec, 0) == (8, 64)


def test_mellum_slides_where_its_layer_types_say() -> None:
    """Mellum (SGLang gives it its hybrid sliding-window pool): the layers layer_types names
    sliding keep the config's window, the others are full; without layer_types every layer is
    full (transformers' MellumConfig)."""
    config = {
        "model_type": "mellum",
        "num_hidden_layers": 4,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 40,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "torch_dtype": "float32",
    }
    spec = spec_from_config(config)
    assert [(layer.kind, layer.window) for layer in spec.layers] == [
        (LayerKind.SLIDING, 40),
        (LayerKind.FULL, None),
    ] * 2
    assert heads(spec, 0) == (2, 32)
    del config["layer_types"]
    assert kinds(spec_from_config(config)) == {LayerKind.FULL: 4}
    del config["model_type"]
    config["architectures"] = ["MellumForCausalLM"]
    assert kinds(spec_from_config(config)) == {LayerKind.FULL: 4}


def test_gemma3_27b_five_local_one_global() -> None:
    spec = load_spec("gemma-3-27b")
    assert spec.num_layers == 62
    assert kinds(spec) == {LayerKind.SLIDING: 52, LayerKind.FULL: 10}
    full = [i for i, layer in enumerate(spec.layers) if layer.kind is LayerKind.FULL]
    assert full == list(range(5, 62, 6))
    assert spec.layers[0].window == 1024
    assert heads(spec, 0) == (16, 128)


@pytest.mark.parametrize(("preset", "layers"), [("deepseek-v3", 61), ("deepseek-v2-lite", 27)])
def test_deepseek_mla_one_unsharded_latent(preset: str, layers: int) -> None:
    spec = load_spec(preset)
    assert spec.num_layers == layers
    assert kinds(spec) == {LayerKind.MLA: layers}
    (latent,) = spec.layers[0].components
    (seg,) = latent.segments
    assert (seg.units, seg.unit_size) == (1, 512 + 64)
    assert latent.item_bytes == 576 * 2


def test_deepseek_v32_indexer_keys_are_fp8_plus_scale_bytes() -> None:
    spec = load_spec("deepseek-v3.2")
    assert spec.num_layers == 61
    assert kinds(spec) == {LayerKind.MLA_INDEXER: 61}
    index = spec.layers[0].component("index_k")
    assert index.dtype is DType.UINT8
    (seg,) = index.segments
    assert (seg.units, seg.unit_size) == (1, 128 + 4)  # 128 fp8 keys + one fp32 scale
    assert spec.layers[0].component("latent").segments[0].unit_size == 576


def test_qwen3_next_three_gdn_then_one_full() -> None:
    spec = load_spec("qwen3-next-80b-a3b")
    assert spec.num_layers == 48
    assert kinds(spec) == {LayerKind.GDN: 36, LayerKind.FULL: 12}
    for i, layer in enumerate(spec.layers):
        assert layer.kind is (LayerKind.FULL if i % 4 == 3 else LayerKind.GDN)
    assert heads(spec, 3) == (2, 256)
    conv = spec.layers[0].component("conv")
    # q|k|v channels of the conv state, over kernel - 1 = 3 kept steps.
    assert [(s.name, s.units, s.unit_size) for s in conv.segments] == [
        ("q", 16, 128),
        ("k", 16, 128),
        ("v", 32, 128),
    ]
    assert conv.rows == 3
    assert conv.dtype is DType.BFLOAT16
    rec = spec.layers[0].component("recurrent")
    assert [(s.units, s.unit_size) for s in rec.segments] == [(32, 128 * 128)]
    assert rec.dtype is DType.FLOAT32 and rec.scope is Scope.STATE


def test_nemotron_h_8b_counts_match_its_pattern() -> None:
    config = load_config("nemotron-h-8b")
    pattern = config["hybrid_override_pattern"]
    assert isinstance(pattern, str) and len(pattern) == 52
    spec = load_spec("nemotron-h-8b")
    assert kinds(spec) == {LayerKind.MAMBA2: pattern.count("M"), LayerKind.FULL: pattern.count("*")}
    assert kinds(spec) == {LayerKind.MAMBA2: 24, LayerKind.FULL: 4}
    # MLP layers ('-') are no spec layers; the origins say which HF layer each one is.
    origins = layer_origins(config)
    assert [pattern[i] for i in origins] == [ch for ch in pattern if ch in "M*"]
    attn = [i for i, layer in enumerate(spec.layers) if layer.kind is LayerKind.FULL]
    assert [origins[i] for i in attn] == [i for i, ch in enumerate(pattern) if ch == "*"]
    assert heads(spec, attn[0]) == (8, 128)  # attention_head_dim
    conv = spec.layers[0].component("conv")
    assert [(s.name, s.units, s.unit_size) for s in conv.segments] == [
        ("x", 128, 64),
        ("B", 8, 128),
        ("C", 8, 128),
    ]
    assert conv.rows == 3
    assert spec.layers[0].component("ssm").segments[0].unit_size == 64 * 128


def test_falcon_h1_attention_then_mamba2_per_layer() -> None:
    config = load_config("falcon-h1-7b")
    spec = load_spec("falcon-h1-7b")
    assert spec.num_layers == 2 * 44
    assert [layer.kind for layer in spec.layers[:4]] == [
        LayerKind.FULL,
        LayerKind.MAMBA2,
        LayerKind.FULL,
        LayerKind.MAMBA2,
    ]
    assert layer_origins(config) == tuple(i for i in range(44) for _ in range(2))
    assert heads(spec, 0) == (2, 128)
    conv = spec.layers[1].component("conv")
    assert [(s.name, s.units, s.unit_size) for s in conv.segments] == [
        ("x", 24, 128),
        ("B", 1, 256),
        ("C", 1, 256),
    ]
    assert conv.rows == 3


def test_bamba_attention_at_its_indices() -> None:
    spec = load_spec("bamba-9b")
    assert spec.num_layers == 32
    attn = [i for i, layer in enumerate(spec.layers) if layer.kind is LayerKind.FULL]
    assert attn == [9, 18, 27]
    assert kinds(spec)[LayerKind.MAMBA2] == 29


# ---- sharding of real hybrids -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "tps"),
    [
        ("bamba-9b", (1, 2, 4, 8)),  # 1 group: B and C replicated on every rank
        ("falcon-h1-7b", (1, 2, 4, 8)),
        ("nemotron-h-8b", (1, 2, 4, 8, 16)),  # 8 groups at TP 16: each on two ranks
        ("qwen3-next-80b-a3b", (1, 2, 4, 8, 16)),
    ],
)
def test_hybrid_with_fewer_groups_than_ranks_shards(preset: str, tps: tuple[int, ...]) -> None:
    spec = load_spec(preset)
    for tp in tps:
        for i, layer in enumerate(spec.layers):
            for comp in layer.components:
                for seg in comp.segments:
                    check_segment(seg, tp, where=f"{preset} layer {i} {comp.name}: ")


def test_groups_that_cannot_spread_over_tp_are_refused() -> None:
    config = dict(load_config("bamba-9b"), mamba_n_groups=3, mamba_n_heads=96)
    seg = spec_from_config(config).layers[0].component("conv").segments[1]
    with pytest.raises(LayoutError, match="'B' has 3 units"):
        check_segment(seg, 2)


# ---- dtypes -----------------------------------------------------------------------------------


def test_dtype_from_config_and_override() -> None:
    config = dict(load_config("qwen3-8b"), torch_dtype="float16")
    assert spec_from_config(config).layers[0].component("k").dtype is DType.FLOAT16
    del config["torch_dtype"]
    assert spec_from_config(config).layers[0].component("k").dtype is DType.BFLOAT16
    spec = spec_from_config(config, dtype=DType.FLOAT8_E4M3)
    assert spec.layers[0].component("k").dtype is DType.FLOAT8_E4M3


def test_ssm_dtype_default_config_field_and_override() -> None:
    config = load_config("nemotron-h-8b")
    ssm = spec_from_config(config).layers[0].component("ssm")
    assert ssm.dtype is DType.FLOAT32
    assert spec_from_config(config).layers[0].component("conv").dtype is DType.BFLOAT16
    from_config = spec_from_config(dict(config, mamba_ssm_cache_dtype="bfloat16"))
    assert from_config.layers[0].component("ssm").dtype is DType.BFLOAT16
    override = spec_from_config(config, ssm_dtype=DType.FLOAT16)
    assert override.layers[0].component("ssm").dtype is DType.FLOAT16


# ---- families without a preset, and config shapes -----------------------------------------------


def qwen2(**extra: object) -> dict[str, object]:
    return {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "num_hidden_layers": 28,
        "max_window_layers": 20,
        "sliding_window": 131072,
        "use_sliding_window": False,
    } | extra


def test_qwen2_sliding_window_is_off_unless_used() -> None:
    assert kinds(spec_from_config(qwen2())) == {LayerKind.FULL: 28}
    spec = spec_from_config(qwen2(use_sliding_window=True, sliding_window=4096))
    assert kinds(spec) == {LayerKind.FULL: 20, LayerKind.SLIDING: 8}
    assert spec.layers[20].window == 4096
    assert heads(spec, 0) == (4, 128)


def test_qwen3_5_is_read_through_its_text_config() -> None:
    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {
            "model_type": "qwen3_5_text",
            "dtype": "bfloat16",
            "num_hidden_layers": 8,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "mamba_ssm_dtype": "float32",
        },
    }
    spec = spec_from_config(config, name="qwen3.5-tiny")
    assert spec.model == "qwen3.5-tiny"
    assert kinds(spec) == {LayerKind.GDN: 6, LayerKind.FULL: 2}
    assert heads(spec, 3) == (4, 256)


def test_lfm2_short_conv_and_attention() -> None:
    config = {
        "model_type": "lfm2",
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_hidden_layers": 4,
        "conv_L_cache": 3,
        "layer_types": ["conv", "conv", "full_attention", "conv"],
    }
    spec = spec_from_config(config)
    assert [layer.kind for layer in spec.layers] == [
        LayerKind.SHORT_CONV,
        LayerKind.SHORT_CONV,
        LayerKind.FULL,
        LayerKind.SHORT_CONV,
    ]
    conv = spec.layers[0].component("conv")
    assert [(s.units, s.unit_size) for s in conv.segments] == [(1024, 1)]
    assert conv.rows == 2  # conv_L_cache - 1 kept steps
    assert heads(spec, 2) == (8, 64)


def test_model_type_from_architectures_when_absent() -> None:
    config = dict(load_config("llama-3.1-8b"))
    del config["model_type"]
    assert spec_from_config(config).fingerprint == load_spec("llama-3.1-8b").fingerprint


def test_num_key_value_heads_defaults_to_attention_heads() -> None:
    config = {
        "model_type": "llama",
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_hidden_layers": 2,
    }
    assert heads(spec_from_config(config), 0) == (16, 128)


def test_load_config_from_file_and_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = load_config("qwen3-0.6b")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_config(tmp_path) == config
    assert load_config(tmp_path / "config.json") == config
    assert load_spec(tmp_path, name="x").model == "x"


# ---- malformed configs --------------------------------------------------------------------------


def test_unknown_model_type_names_it_and_the_known_ones() -> None:
    with pytest.raises(SpecError, match=r"unsupported model_type 'rwkv6'.*'qwen3'"):
        spec_from_config({"model_type": "rwkv6", "num_hidden_layers": 24})


def test_no_model_type_and_unknown_architecture() -> None:
    with pytest.raises(SpecError, match="no 'model_type'.*RwkvForCausalLM"):
        spec_from_config({"architectures": ["RwkvForCausalLM"]})


def test_missing_field_is_named_with_the_model_type() -> None:
    config = dict(load_config("deepseek-v3"))
    del config["kv_lora_rank"]
    with pytest.raises(SpecError, match="deepseek_v3 config: field 'kv_lora_rank'.*required"):
        spec_from_config(config)


def test_missing_mamba_field_names_its_aliases() -> None:
    config = dict(load_config("nemotron-h-8b"))
    del config["ssm_state_size"]
    with pytest.raises(
        SpecError, match="nemotron_h config: field 'mamba_d_state' \\(or 'ssm_state_size'\\)"
    ):
        spec_from_config(config)


def test_wrong_types_are_refused() -> None:
    with pytest.raises(SpecError, match=r"num_hidden_layers.*integer in \[1, 4096\], got True"):
        spec_from_config(dict(load_config("qwen3-8b"), num_hidden_layers=True))
    with pytest.raises(SpecError, match="num_key_value_heads.*got '8'"):
        spec_from_config(dict(load_config("qwen3-8b"), num_key_value_heads="8"))
    with pytest.raises(SpecError, match="must be a dict"):
        spec_from_config([1, 2])  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="unknown dtype 'int4'"):
        spec_from_config(dict(load_config("qwen3-8b"), torch_dtype="int4"))


def test_bad_hybrid_patterns_are_refused() -> None:
    config = load_config("nemotron-h-8b")
    with pytest.raises(SpecError, match=r"unknown letters \['Z'\]"):
        spec_from_config(dict(config, hybrid_override_pattern="M*Z-"))
    with pytest.raises(SpecError, match="entry 1 is 'mamba'"):
        spec_from_config(
            dict(
                load_config("gpt-oss-20b"),
                num_hidden_layers=2,
                layer_types=["full_attention", "mamba"],
            )
        )
    with pytest.raises(SpecError, match="has 3 entries but num_hidden_layers is 24"):
        spec_from_config(dict(load_config("gpt-oss-20b"), layer_types=["full_attention"] * 3))
    with pytest.raises(SpecError, match=r"attn_layer_indices.*\[40\]"):
        spec_from_config(dict(load_config("bamba-9b"), attn_layer_indices=[9, 40]))
    with pytest.raises(SpecError, match="full_attention_interval.*one of them is required"):
        config = dict(load_config("qwen3-next-80b-a3b"))
        del config["full_attention_interval"]
        spec_from_config(config)


def test_a_conv_kernel_of_one_is_refused() -> None:
    with pytest.raises(SpecError, match=r"conv_kernel.*integer in \[2, "):
        spec_from_config(dict(load_config("nemotron-h-8b"), conv_kernel=1))


def test_bad_names_and_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SpecError, match="neither a preset.*qwen3-32b"):
        load_config("no-such-model")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_config(bad)
    bad.write_text("[1]")
    with pytest.raises(SpecError, match="expected a JSON object"):
        load_config(bad)


def test_supported_model_types_cover_the_presets() -> None:
    types = set(supported_model_types())
    for preset in list_presets():
        config = load_config(preset)
        text = config.get("text_config")
        model_type = text["model_type"] if isinstance(text, dict) else config["model_type"]
        assert model_type in types


def test_kimi_linear_kda_and_mla_from_either_config_form() -> None:
    """Kimi Linear as its checkpoint lists the KDA layers (1-based, in ``linear_attn_config``)
    and as transformers' own ``KimiLinearConfig`` saves it (``layer_types``): one spec."""
    transformers = pytest.importorskip("transformers")
    checkpoint = {
        "model_type": "kimi_linear",
        "num_hidden_layers": 8,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "torch_dtype": "bfloat16",
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 5, 6, 7],
            "full_attn_layers": [4, 8],
            "num_heads": 32,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
    }
    spec = spec_from_config(checkpoint)
    assert [layer.kind for layer in spec.layers] == (
        [LayerKind.KDA] * 3 + [LayerKind.MLA] + [LayerKind.KDA] * 3 + [LayerKind.MLA]
    )
    conv = spec.layers[0].component("conv")
    assert [(s.name, s.units, s.unit_size) for s in conv.segments] == [
        ("q", 32, 128),
        ("k", 32, 128),
        ("v", 32, 128),
    ]
    assert (conv.rows, conv.dtype) == (3, DType.BFLOAT16)
    rec = spec.layers[0].component("recurrent")
    assert [(s.units, s.unit_size) for s in rec.segments] == [(32, 128 * 128)]
    assert rec.dtype is DType.FLOAT32
    assert spec.layers[3].component("latent").segments[0].unit_size == 512 + 64

    saved = transformers.KimiLinearConfig(**checkpoint).to_dict()
    saved.pop("linear_attn_config", None)  # transformers' form alone
    assert spec_from_config(saved, name=spec.model).layers == spec.layers

    with pytest.raises(SpecError, match="linear_attn_config"):
        spec_from_config({**checkpoint, "linear_attn_config": [1, 2]})


LLAMA4_TEXT = {
    "model_type": "llama4_text",
    "num_hidden_layers": 8,
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "attention_chunk_size": 64,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    "form",
    [
        {},  # transformers' default: a NoPE (full) layer every 4th
        {"no_rope_layers": []},  # as published: empty means the default
        {"no_rope_layers": [1, 0, 1, 1, 0, 1, 1, 1]},
        {"no_rope_layer_interval": 2},
        {"layer_types": ["full_attention", "chunked_attention"] * 4},
    ],
    ids=["default", "empty-no-rope", "no-rope-list", "interval-2", "layer-types"],
)
def test_llama4_chunked_layers_are_windows_of_the_chunk_where_transformers_says(
    form: dict[str, object],
) -> None:
    """Llama 4: its chunked (RoPE) layers slide with a window of attention_chunk_size, its NoPE
    layers are full; which are which is transformers' Llama4TextConfig's own decision, and its
    cache keeps the chunked layers as sliding windows of the chunk (C - 1 tokens: inside the
    window kvbridge gives them)."""
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    config = {**LLAMA4_TEXT, **form}
    spec = spec_from_config(config)
    hf = transformers.Llama4TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    want = [
        (LayerKind.SLIDING, 64) if t == "chunked_attention" else (LayerKind.FULL, None)
        for t in hf.layer_types
    ]
    assert [(layer.kind, layer.window) for layer in spec.layers] == want
    assert LayerKind.SLIDING in {k for k, _ in want} and LayerKind.FULL in {k for k, _ in want}
    assert heads(spec, 0) == (2, 32)
    cache = DynamicCache(config=hf)
    for layer, (kind, _) in zip(cache.layers, want, strict=True):
        sliding = isinstance(layer, DynamicSlidingWindowLayer)
        assert sliding == (kind is LayerKind.SLIDING)
        assert not sliding or layer.sliding_window == 64


def test_llama4_is_read_through_its_text_config_or_its_architecture() -> None:
    """The published checkpoints are Llama4ForConditionalGeneration (model_type llama4, the
    language model in text_config); a text-only one is Llama4ForCausalLM (llama4_text)."""
    wrapped = {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "torch_dtype": "bfloat16",
        "text_config": {k: v for k, v in LLAMA4_TEXT.items() if k != "torch_dtype"},
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 64},
    }
    spec = spec_from_config(wrapped)
    assert [layer.window for layer in spec.layers] == [64, 64, 64, None] * 2
    assert spec.layers[0].component("k").dtype is DType.BFLOAT16
    bare = {k: v for k, v in LLAMA4_TEXT.items() if k != "model_type"}
    for arch in ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"):
        assert spec_from_config({**bare, "architectures": [arch]}).layers == spec.layers


def test_llama4_refusals_name_the_field() -> None:
    with pytest.raises(SpecError, match="llama4_text config: field 'attention_chunk_size'"):
        spec_from_config({**LLAMA4_TEXT, "attention_chunk_size": None})
    with pytest.raises(SpecError, match="no_rope_layers.*at least 8 entries"):
        spec_from_config({**LLAMA4_TEXT, "no_rope_layers": [1, 0, 1]})
    with pytest.raises(SpecError, match="no_rope_layers.*each 0 or 1"):
        spec_from_config({**LLAMA4_TEXT, "no_rope_layers": [1, 2] * 4})
    with pytest.raises(SpecError, match="entry 0 is 'sliding_attention'"):
        spec_from_config({**LLAMA4_TEXT, "layer_types": ["sliding_attention"] * 8})
