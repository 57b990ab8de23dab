"""Per model family: the mixers of each HF layer, read from the family's config fields."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvbridge.model.hf.fields import MAX_LAYERS, Fields, Mixer

Kinds = list[tuple[Mixer, ...]]


def _num_layers(f: Fields) -> int:
    return f.integer("num_hidden_layers", maximum=MAX_LAYERS)


def _from_layer_types(f: Fields, field: str, names: Mapping[str, Mixer]) -> Kinds:
    types = f.items(field)
    if f.raw.get("num_hidden_layers") is not None and len(types) != _num_layers(f):
        raise f.error(
            (field,), f"has {len(types)} entries but num_hidden_layers is {_num_layers(f)}"
        )
    out: Kinds = []
    for i, t in enumerate(types):
        if not isinstance(t, str) or t not in names:
            raise f.error((field,), f"entry {i} is {t!r}; expected one of {sorted(names)}")
        out.append((names[t],))
    return out


_ATTENTION_TYPES = {"full_attention": Mixer.FULL, "sliding_attention": Mixer.SLIDING}


def _kinds_llama(f: Fields) -> Kinds:
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(f, "layer_types", _ATTENTION_TYPES)
    return [(Mixer.FULL,)] * _num_layers(f)


def _kinds_mistral(f: Fields) -> Kinds:
    # Mistral (and Mixtral) slide on every layer whenever a window is set.
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(f, "layer_types", _ATTENTION_TYPES)
    kind = Mixer.FULL if f.raw.get("sliding_window") is None else Mixer.SLIDING
    return [(kind,)] * _num_layers(f)


def _kinds_qwen(f: Fields) -> Kinds:
    # Qwen2/Qwen3 ship a sliding_window that is off unless use_sliding_window; when on, the
    # layers from max_window_layers up slide (HF's rule).
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(f, "layer_types", _ATTENTION_TYPES)
    n = _num_layers(f)
    if not f.raw.get("use_sliding_window") or f.raw.get("sliding_window") is None:
        return [(Mixer.FULL,)] * n
    first = f.integer("max_window_layers", minimum=0)
    return [(Mixer.SLIDING if i >= first else Mixer.FULL,) for i in range(n)]


def _kinds_gemma3(f: Fields) -> Kinds:
    # Older configs give sliding_window_pattern: every p-th layer is global, the rest slide.
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(f, "layer_types", _ATTENTION_TYPES)
    if f.raw.get("sliding_window_pattern") is None:
        raise f.error(("layer_types", "sliding_window_pattern"), "one of them is required")
    p = f.integer("sliding_window_pattern")
    return [(Mixer.SLIDING if (i + 1) % p else Mixer.FULL,) for i in range(_num_layers(f))]


def _kinds_gpt_oss(f: Fields) -> Kinds:
    # Without layer_types, HF's GptOssConfig alternates sliding, full, sliding, ...
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(f, "layer_types", _ATTENTION_TYPES)
    return [(Mixer.SLIDING if i % 2 == 0 else Mixer.FULL,) for i in range(_num_layers(f))]


def _kinds_llama4(f: Fields) -> Kinds:
    # transformers' Llama4TextConfig: layer_types if given, else no_rope_layers (1: a RoPE
    # layer, which attends within its chunk; 0: a NoPE layer, full attention), else a NoPE
    # layer every no_rope_layer_interval layers (4 by default).
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(
            f, "layer_types", {"chunked_attention": Mixer.CHUNKED, "full_attention": Mixer.FULL}
        )
    n = _num_layers(f)
    rope = f.raw.get("no_rope_layers")
    if rope:  # an empty list means the default, as in transformers
        flags = f.items("no_rope_layers")
        if len(flags) < n or any(x not in (0, 1) or isinstance(x, bool) for x in flags):
            raise f.error(
                ("no_rope_layers",),
                f"expected at least {n} entries (num_hidden_layers), each 0 or 1, got {flags!r}",
            )
        return [(Mixer.CHUNKED if flags[i] else Mixer.FULL,) for i in range(n)]
    every = f.integer("no_rope_layer_interval", default=4)
    return [(Mixer.CHUNKED if (i + 1) % every else Mixer.FULL,) for i in range(n)]


def _kinds_gdn(f: Fields) -> Kinds:
    # Qwen3-Next / Qwen3.5: gated delta net layers, and full attention every Nth layer.
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(
            f, "layer_types", {"linear_attention": Mixer.GDN, "full_attention": Mixer.FULL}
        )
    if f.raw.get("full_attention_interval") is None:
        raise f.error(("layer_types", "full_attention_interval"), "one of them is required")
    every = f.integer("full_attention_interval")
    return [(Mixer.FULL if (i + 1) % every == 0 else Mixer.GDN,) for i in range(_num_layers(f))]


_NEMOTRON_PATTERN = {"M": Mixer.MAMBA2, "*": Mixer.FULL, "-": Mixer.NONE, "E": Mixer.NONE}
_NEMOTRON_BLOCKS = {
    "mamba": Mixer.MAMBA2,
    "linear_attention": Mixer.MAMBA2,
    "attention": Mixer.FULL,
    "full_attention": Mixer.FULL,
    "mlp": Mixer.NONE,
    "moe": Mixer.NONE,
}


def _kinds_nemotron_h(f: Fields) -> Kinds:
    # The block list decides the depth, as in HF's NemotronHConfig (num_hidden_layers is stale
    # in some published configs).
    if f.raw.get("layers_block_type") is not None:
        types = f.items("layers_block_type")
        bad = [t for t in types if not isinstance(t, str) or t not in _NEMOTRON_BLOCKS]
        if bad:
            raise f.error(
                ("layers_block_type",),
                f"unknown block types {bad}; expected one of {sorted(_NEMOTRON_BLOCKS)}",
            )
        return [(_NEMOTRON_BLOCKS[str(t)],) for t in types]
    pattern = f.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern:
        raise f.error(
            ("hybrid_override_pattern",),
            f"expected a non-empty string like 'M-M*-', got {pattern!r}",
        )
    letters = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
    if letters:
        raise f.error(
            ("hybrid_override_pattern",),
            f"unknown letters {letters}; expected M (mamba2), * (attention), - (MLP), E (MoE)",
        )
    return [(_NEMOTRON_PATTERN[ch],) for ch in pattern]


def _kinds_falcon_h1(f: Fields) -> Kinds:
    return [(Mixer.FULL, Mixer.MAMBA2)] * _num_layers(f)


def _kinds_bamba(f: Fields) -> Kinds:
    n = _num_layers(f)
    attn = f.items("attn_layer_indices")
    bad = [i for i in attn if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise f.error(("attn_layer_indices",), f"entries {bad} are not layer indices in [0, {n})")
    return [(Mixer.FULL if i in attn else Mixer.MAMBA2,) for i in range(n)]


def _kinds_lfm2(f: Fields) -> Kinds:
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(
            f, "layer_types", {"conv": Mixer.SHORT_CONV, "full_attention": Mixer.FULL}
        )
    full = f.items("full_attn_idxs")
    return [(Mixer.FULL if i in full else Mixer.SHORT_CONV,) for i in range(_num_layers(f))]


def _kinds_mamba1(f: Fields) -> Kinds:
    return [(Mixer.MAMBA1,)] * _num_layers(f)


def _kinds_kimi_linear(f: Fields) -> Kinds:
    # Kimi Linear: KDA layers, and MLA (or plain attention) in the others. The checkpoint lists
    # the KDA layers 1-based in linear_attn_config; transformers' own saved config, layer_types.
    attention = Mixer.MLA if f.raw.get("kv_lora_rank") is not None else Mixer.FULL
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(
            f, "layer_types", {"linear_attention": Mixer.KDA, "full_attention": attention}
        )
    kda = linear_attn(f).items("kda_layers")
    return [(Mixer.KDA if i + 1 in kda else attention,) for i in range(_num_layers(f))]


def linear_attn(f: Fields) -> Fields:
    """Kimi Linear's ``linear_attn_config`` sub-dict, as fields of its own."""
    sub = f.get("linear_attn_config")
    if not isinstance(sub, Mapping):
        raise f.error(("linear_attn_config",), f"expected a dict, got {type(sub).__name__}")
    return Fields(sub, f"{f.model_type} linear_attn_config")


def _kinds_mla(f: Fields) -> Kinds:
    return [(Mixer.MLA,)] * _num_layers(f)


def _kinds_mla_indexer(f: Fields) -> Kinds:
    return [(Mixer.MLA_INDEXER,)] * _num_layers(f)


FAMILIES: dict[str, Callable[[Fields], Kinds]] = {
    "llama": _kinds_llama,
    "mistral": _kinds_mistral,
    "mixtral": _kinds_mistral,
    "qwen2": _kinds_qwen,
    "qwen2_moe": _kinds_qwen,
    "qwen3": _kinds_qwen,
    "qwen3_moe": _kinds_qwen,
    "gemma3": _kinds_gemma3,
    "gemma3_text": _kinds_gemma3,
    "gpt_oss": _kinds_gpt_oss,
    # Mellum: layer_types says which layers slide (MellumConfig: every layer full without it).
    "mellum": _kinds_llama,
    # Llama 4: read through text_config (llama4_text); "llama4" for a config whose text part
    # does not name its model_type.
    "llama4": _kinds_llama4,
    "llama4_text": _kinds_llama4,
    "deepseek_v2": _kinds_mla,
    "deepseek_v3": _kinds_mla,
    "kimi_k2": _kinds_mla,
    "deepseek_v32": _kinds_mla_indexer,
    "kimi_linear": _kinds_kimi_linear,
    "qwen3_next": _kinds_gdn,
    "qwen3_5": _kinds_gdn,
    "qwen3_5_text": _kinds_gdn,
    "qwen3_5_moe": _kinds_gdn,
    "qwen3_5_moe_text": _kinds_gdn,
    "nemotron_h": _kinds_nemotron_h,
    "falcon_h1": _kinds_falcon_h1,
    "bamba": _kinds_bamba,
    "lfm2": _kinds_lfm2,
    "mamba": _kinds_mamba1,
    "falcon_mamba": _kinds_mamba1,
}

# Used only when a config has no model_type.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "MellumForCausalLM": "mellum",
    "Llama4ForConditionalGeneration": "llama4",
    "Llama4ForCausalLM": "llama4_text",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "KimiLinearForCausalLM": "kimi_linear",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "NemotronHForCausalLM": "nemotron_h",
    "FalconH1ForCausalLM": "falcon_h1",
    "BambaForCausalLM": "bamba",
    "Lfm2ForCausalLM": "lfm2",
    "MambaForCausalLM": "mamba",
    "FalconMambaForCausalLM": "falcon_mamba",
}
