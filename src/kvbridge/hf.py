"""CacheSpecs from Hugging Face ``config.json`` files, and presets of published models.

Entry points: :func:`spec_from_config` (a config dict), :func:`load_spec` (a preset name, a
``config.json`` path or a model directory: :mod:`kvbridge.modelconfig` reads the dict behind
it and lists the presets), and :func:`layer_origins` (which HF layer each spec layer comes
from).

Conventions, the same for every family:

* **Only layers that keep a cache are spec layers.** Nemotron-H's MLP (``-``) and MoE (``E``)
  layers hold no KV and no state, so they are left out; ``layer_origins(config)[i]`` is the HF
  layer index of spec layer ``i``, which is what an engine calls the layer.
* **Falcon-H1 runs attention and Mamba2 side by side in every layer.** A LayerSpec has one
  kind, so each HF layer becomes two consecutive spec layers, attention then Mamba2, both with
  the same origin. A Falcon-H1 spec therefore has ``2 * num_hidden_layers`` layers.
* **Conv states keep ``d_conv - 1`` columns**, as vLLM and SGLang store them (the builders in
  :mod:`kvbridge.spec` take the kernel width and drop the column the next token brings).
  LFM2's short conv keeps ``conv_L_cache - 1`` for the same reason.
* **dtypes.** The cache dtype is ``dtype`` if given, else the config's ``torch_dtype`` (or
  ``dtype``), else bfloat16. Conv states are in that dtype. Mamba1/Mamba2 SSM states and
  gated-delta-net recurrent states are ``ssm_dtype`` if given, else the config's
  ``mamba_ssm_dtype`` / ``mamba_ssm_cache_dtype``, else float32: SGLang's default
  ``--mamba-ssm-dtype``, and what these models' own configs ask for; an engine keeping them
  in bf16 must pass ``ssm_dtype``.
* **DeepSeek-V3.2 indexer keys** are stored as raw bytes (uint8), as the engines keep them:
  ``index_head_dim`` fp8 keys plus one fp32 scale per 128-element block, so 128 + 4 = 132
  bytes per token per layer for the published model.
* Multimodal wrappers (Gemma 3, Qwen3.5) are read through their ``text_config``.

A missing or malformed field, or an unknown ``model_type``, raises :class:`SpecError` naming the
model type, the field and what was expected.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbridge.errors import SpecError
from kvbridge.modelconfig import load_config
from kvbridge.spec import (
    CacheSpec,
    DType,
    LayerSpec,
    attention_layer,
    gdn_layer,
    mamba1_layer,
    mamba2_layer,
    mla_layer,
    short_conv_layer,
)

__all__ = [
    "layer_origins",
    "load_spec",
    "spec_from_config",
    "supported_model_types",
]

_INDEXER_SCALE_BLOCK = 128  # fp8 indexer keys carry one fp32 scale per 128 elements
_MISSING = object()
# Bounds far above any real model, so that a corrupt config is refused before anything is
# sized from it.
_MAX_DIM = 1 << 24
_MAX_LAYERS = 4096


class _Mixer(enum.Enum):
    """What one (part of an) HF layer caches; NONE layers become no spec layer."""

    FULL = "full"
    SLIDING = "sliding"
    MLA = "mla"
    MLA_INDEXER = "mla_indexer"
    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GDN = "gdn"
    SHORT_CONV = "short_conv"
    NONE = "none"


@dataclass(frozen=True)
class _Fields:
    """Typed reads of a config dict; every failure names the model type and the field."""

    raw: Mapping[str, object]
    model_type: str

    def get(self, *names: str, default: object = _MISSING) -> object:
        """The first of ``names`` present and not null (aliases of one field)."""
        for n in names:
            if self.raw.get(n) is not None:
                return self.raw[n]
        if default is _MISSING:
            raise self.error(names, "it is required")
        return default

    def integer(
        self, *names: str, default: int | None = None, minimum: int = 1, maximum: int = _MAX_DIM
    ) -> int:
        value = self.get(*names, default=_MISSING if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise self.error(names, f"expected an integer in [{minimum}, {maximum}], got {value!r}")
        return value

    def items(self, name: str) -> list[object]:
        value = self.get(name)
        if not isinstance(value, list):
            raise self.error((name,), f"expected a list, got {type(value).__name__}")
        return value

    def error(self, names: Sequence[str], why: str) -> SpecError:
        alias = f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
        return SpecError(f"{self.model_type} config: field {names[0]!r}{alias}: {why}")


@dataclass(frozen=True)
class _Ctx:
    f: _Fields
    dtype: DType  # KV, latents and conv states
    ssm_dtype: DType  # Mamba2 SSM and GDN recurrent states


# ---- per-family layer kinds: one tuple of mixers per HF layer --------------------------------

_Kinds = list[tuple[_Mixer, ...]]


def _num_layers(f: _Fields) -> int:
    return f.integer("num_hidden_layers", maximum=_MAX_LAYERS)


def _from_layer_types(f: _Fields, field: str, names: Mapping[str, _Mixer]) -> _Kinds:
    types = f.items(field)
    if f.raw.get("num_hidden_layers") is not None and len(types) != _num_layers(f):
        raise f.error(
            (field,), f"has {len(types)} entries but num_hidden_layers is {_num_layers(f)}"
        )
    out: _Kinds = []
    for i, t in enumerate(types):
        if not isinstance(t, str) or t not in names:
            raise f.error((field,), f"entry {i} is {t!r}; expected one of {sorted(names)}")
        out.append((names[t],))
    return out


_ATTENTION_TYPES = {"full_attention": _Mixer.FULL, "sliding_attention": _Mixer.SLIDING}


def _kinds_llama(f: _Fields) -> _Kinds:
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(f, "layer_types", _ATTENTION_TYPES)
    return [(_Mixer.FULL,)] * _num_layers(f)


def _kinds_mistral(f: _Fields) -> _Kinds:
    # Mistral (and Mixtral) slide on every layer whenever a window is set.
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(f, "layer_types", _ATTENTION_TYPES)
    kind = _Mixer.FULL if f.raw.get("sliding_window") is None else _Mixer.SLIDING
    return [(kind,)] * _num_layers(f)


def _kinds_qwen(f: _Fields) -> _Kinds:
    # Qwen2/Qwen3 ship a sliding_window that is off unless use_sliding_window; when on, the
    # layers from max_window_layers up slide (HF's rule).
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(f, "layer_types", _ATTENTION_TYPES)
    n = _num_layers(f)
    if not f.raw.get("use_sliding_window") or f.raw.get("sliding_window") is None:
        return [(_Mixer.FULL,)] * n
    first = f.integer("max_window_layers", minimum=0)
    return [(_Mixer.SLIDING if i >= first else _Mixer.FULL,) for i in range(n)]


def _kinds_gemma3(f: _Fields) -> _Kinds:
    # Older configs give sliding_window_pattern: every p-th layer is global, the rest slide.
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(f, "layer_types", _ATTENTION_TYPES)
    if f.raw.get("sliding_window_pattern") is None:
        raise f.error(("layer_types", "sliding_window_pattern"), "one of them is required")
    p = f.integer("sliding_window_pattern")
    return [(_Mixer.SLIDING if (i + 1) % p else _Mixer.FULL,) for i in range(_num_layers(f))]


def _kinds_gpt_oss(f: _Fields) -> _Kinds:
    # Without layer_types, HF's GptOssConfig alternates sliding, full, sliding, ...
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(f, "layer_types", _ATTENTION_TYPES)
    return [(_Mixer.SLIDING if i % 2 == 0 else _Mixer.FULL,) for i in range(_num_layers(f))]


def _kinds_gdn(f: _Fields) -> _Kinds:
    # Qwen3-Next / Qwen3.5: gated delta net layers, and full attention every Nth layer.
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(
            f, "layer_types", {"linear_attention": _Mixer.GDN, "full_attention": _Mixer.FULL}
        )
    if f.raw.get("full_attention_interval") is None:
        raise f.error(("layer_types", "full_attention_interval"), "one of them is required")
    every = f.integer("full_attention_interval")
    return [(_Mixer.FULL if (i + 1) % every == 0 else _Mixer.GDN,) for i in range(_num_layers(f))]


_NEMOTRON_PATTERN = {"M": _Mixer.MAMBA2, "*": _Mixer.FULL, "-": _Mixer.NONE, "E": _Mixer.NONE}
_NEMOTRON_BLOCKS = {
    "mamba": _Mixer.MAMBA2,
    "linear_attention": _Mixer.MAMBA2,
    "attention": _Mixer.FULL,
    "full_attention": _Mixer.FULL,
    "mlp": _Mixer.NONE,
    "moe": _Mixer.NONE,
}


def _kinds_nemotron_h(f: _Fields) -> _Kinds:
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


def _kinds_falcon_h1(f: _Fields) -> _Kinds:
    return [(_Mixer.FULL, _Mixer.MAMBA2)] * _num_layers(f)


def _kinds_bamba(f: _Fields) -> _Kinds:
    n = _num_layers(f)
    attn = f.items("attn_layer_indices")
    bad = [i for i in attn if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise f.error(("attn_layer_indices",), f"entries {bad} are not layer indices in [0, {n})")
    return [(_Mixer.FULL if i in attn else _Mixer.MAMBA2,) for i in range(n)]


def _kinds_lfm2(f: _Fields) -> _Kinds:
    if f.raw.get("layer_types") is not None:
        return _from_layer_types(
            f, "layer_types", {"conv": _Mixer.SHORT_CONV, "full_attention": _Mixer.FULL}
        )
    full = f.items("full_attn_idxs")
    return [(_Mixer.FULL if i in full else _Mixer.SHORT_CONV,) for i in range(_num_layers(f))]


def _kinds_mamba1(f: _Fields) -> _Kinds:
    return [(_Mixer.MAMBA1,)] * _num_layers(f)


def _kinds_mla(f: _Fields) -> _Kinds:
    return [(_Mixer.MLA,)] * _num_layers(f)


def _kinds_mla_indexer(f: _Fields) -> _Kinds:
    return [(_Mixer.MLA_INDEXER,)] * _num_layers(f)


_FAMILIES: dict[str, Callable[[_Fields], _Kinds]] = {
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
    "deepseek_v2": _kinds_mla,
    "deepseek_v3": _kinds_mla,
    "kimi_k2": _kinds_mla,
    "deepseek_v32": _kinds_mla_indexer,
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
_ARCHITECTURES = {
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
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
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


def supported_model_types() -> list[str]:
    """The ``model_type`` values :func:`spec_from_config` understands."""
    return sorted(_FAMILIES)


# ---- layer builders, one per mixer ------------------------------------------------------------


def _head_dim(f: _Fields) -> int:
    if f.raw.get("head_dim") is not None or f.raw.get("attention_head_dim") is not None:
        return f.integer("head_dim", "attention_head_dim")
    hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    if hidden % heads:
        raise f.error(
            ("head_dim",),
            f"absent, and hidden_size {hidden} is not a multiple of num_attention_heads {heads}",
        )
    return hidden // heads


def _attention(c: _Ctx, window: int | None = None) -> LayerSpec:
    kv = c.f.integer("num_key_value_heads", "num_attention_heads")
    return attention_layer(kv, _head_dim(c.f), c.dtype, window=window)


def _kernel(f: _Fields, *names: str) -> int:
    # The cache keeps kernel - 1 columns, so a kernel of 1 would cache nothing.
    return f.integer(*names, minimum=2)


def _mamba2(c: _Ctx) -> LayerSpec:
    f = c.f
    heads = f.integer("mamba_n_heads", "mamba_num_heads")
    head_dim = f.get("mamba_d_head", "mamba_head_dim", default="auto")
    if head_dim == "auto":
        # HF's rule: the mixer's inner width (mamba_d_ssm, else expand * hidden) over the heads.
        inner = (
            f.integer("mamba_d_ssm")
            if f.raw.get("mamba_d_ssm") is not None
            else f.integer("mamba_expand", "expand") * f.integer("hidden_size")
        )
        if inner % heads:
            raise f.error(
                ("mamba_d_head",),
                f"'auto', but the mamba width {inner} is not a multiple of {heads} heads",
            )
        head_dim = inner // heads
    else:
        head_dim = f.integer("mamba_d_head", "mamba_head_dim")
    return mamba2_layer(
        heads,
        head_dim,
        f.integer("mamba_n_groups", "n_groups", "mamba_num_groups"),
        f.integer("mamba_d_state", "ssm_state_size"),
        _kernel(f, "mamba_d_conv", "conv_kernel"),
        conv_dtype=c.dtype,
        ssm_dtype=c.ssm_dtype,
    )


def _mamba1(c: _Ctx) -> LayerSpec:
    f = c.f
    inner = (
        f.integer("intermediate_size")
        if f.raw.get("intermediate_size") is not None
        else f.integer("expand") * f.integer("hidden_size")
    )  # HF's rule
    return mamba1_layer(
        inner,
        f.integer("state_size"),
        _kernel(f, "conv_kernel"),
        conv_dtype=c.dtype,
        ssm_dtype=c.ssm_dtype,
    )


def _gdn(c: _Ctx) -> LayerSpec:
    f = c.f
    return gdn_layer(
        f.integer("linear_num_key_heads"),
        f.integer("linear_num_value_heads"),
        f.integer("linear_key_head_dim"),
        f.integer("linear_value_head_dim"),
        _kernel(f, "linear_conv_kernel_dim"),
        conv_dtype=c.dtype,
        state_dtype=c.ssm_dtype,
    )


def _mla(c: _Ctx, indexer: bool) -> LayerSpec:
    f = c.f
    if not indexer:
        return mla_layer(f.integer("kv_lora_rank"), f.integer("qk_rope_head_dim"), c.dtype)
    dim = f.integer("index_head_dim")
    scales = -(-dim // _INDEXER_SCALE_BLOCK)
    return mla_layer(
        f.integer("kv_lora_rank"),
        f.integer("qk_rope_head_dim"),
        c.dtype,
        indexer_dim=dim + 4 * scales,
        indexer_dtype=DType.UINT8,
    )


_BUILDERS: dict[_Mixer, Callable[[_Ctx], LayerSpec]] = {
    _Mixer.FULL: _attention,
    _Mixer.SLIDING: lambda c: _attention(c, window=c.f.integer("sliding_window")),
    _Mixer.MLA: lambda c: _mla(c, indexer=False),
    _Mixer.MLA_INDEXER: lambda c: _mla(c, indexer=True),
    _Mixer.MAMBA1: _mamba1,
    _Mixer.MAMBA2: _mamba2,
    _Mixer.GDN: _gdn,
    _Mixer.SHORT_CONV: lambda c: short_conv_layer(
        c.f.integer("hidden_size"), _kernel(c.f, "conv_L_cache") - 1, dtype=c.dtype
    ),
}


# ---- assembling a spec -----------------------------------------------------------------------


def _text_config(config: Mapping[str, object]) -> tuple[str, dict[str, object]]:
    """(model_type, the fields describing the language model), unwrapping ``text_config``."""
    if not isinstance(config, Mapping):
        raise SpecError(
            f"a config must be a dict (a parsed config.json), got {type(config).__name__}"
        )
    fields = dict(config)
    text = config.get("text_config")
    if isinstance(text, Mapping):
        # The dtype of a multimodal checkpoint is often given only at the top level.
        fields = {k: config[k] for k in ("torch_dtype", "dtype") if k in config} | dict(text)
    model_type = fields.get("model_type") or config.get("model_type")
    if model_type is None:
        archs = config.get("architectures") or fields.get("architectures")
        names = archs if isinstance(archs, list) else []
        known = [_ARCHITECTURES[a] for a in names if isinstance(a, str) and a in _ARCHITECTURES]
        if not known:
            raise SpecError(
                f"config has no 'model_type' and no known 'architectures' "
                f"(got {archs!r}); expected one of {supported_model_types()}"
            )
        model_type = known[0]
    if model_type not in _FAMILIES:
        raise SpecError(
            f"unsupported model_type {model_type!r}; expected one of {supported_model_types()}"
        )
    return str(model_type), fields


def _build(
    config: Mapping[str, object], dtype: DType | None, ssm_dtype: DType | None
) -> tuple[_Fields, list[tuple[int, LayerSpec]]]:
    model_type, fields = _text_config(config)
    f = _Fields(fields, model_type)
    if dtype is None:
        raw = f.get("torch_dtype", "dtype", default="bfloat16")
        dtype = DType.parse(str(raw))
    if ssm_dtype is None:
        raw = f.get("mamba_ssm_dtype", "mamba_ssm_cache_dtype", default="float32")
        ssm_dtype = DType.parse(str(raw))
    ctx = _Ctx(f, dtype, ssm_dtype)
    built: dict[_Mixer, LayerSpec] = {}  # layers of one kind are identical; build each once
    layers: list[tuple[int, LayerSpec]] = []
    for i, mixers in enumerate(_FAMILIES[model_type](f)):
        for m in mixers:
            if m is _Mixer.NONE:
                continue
            if m not in built:
                built[m] = _BUILDERS[m](ctx)
            layers.append((i, built[m]))
    if not layers:
        raise SpecError(f"{model_type} config: no layer keeps a cache; nothing to transfer")
    return f, layers


def spec_from_config(
    config: Mapping[str, object],
    *,
    name: str | None = None,
    dtype: DType | None = None,
    ssm_dtype: DType | None = None,
) -> CacheSpec:
    """The CacheSpec of the model a Hugging Face config describes.

    ``name`` defaults to the config's ``_name_or_path``, else its ``model_type``. ``dtype``
    overrides the cache dtype, ``ssm_dtype`` the dtype of Mamba2/GDN recurrent states (see the
    module docstring for the defaults).
    """
    f, layers = _build(config, dtype, ssm_dtype)
    model = name or str(f.raw.get("_name_or_path") or config.get("_name_or_path") or f.model_type)
    return CacheSpec(model=model, layers=tuple(layer for _, layer in layers))


def layer_origins(config: Mapping[str, object]) -> tuple[int, ...]:
    """For each layer of ``spec_from_config(config)``, the HF layer index it comes from.

    Equal to ``range(num_hidden_layers)`` except where layers without a cache are skipped
    (Nemotron-H) or one HF layer gives two spec layers (Falcon-H1).
    """
    _, layers = _build(config, DType.BFLOAT16, DType.FLOAT32)
    return tuple(i for i, _ in layers)


# ---- a spec from a preset, a file or a directory ---------------------------------------------


def load_spec(
    name_or_path: str | Path,
    *,
    name: str | None = None,
    dtype: DType | None = None,
    ssm_dtype: DType | None = None,
) -> CacheSpec:
    """The CacheSpec of a preset, a ``config.json`` file, or a model directory."""
    return spec_from_config(load_config(name_or_path), name=name, dtype=dtype, ssm_dtype=ssm_dtype)
