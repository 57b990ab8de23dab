"""CacheSpecs from Hugging Face ``config.json`` files, and presets of published models.

Entry points: :func:`spec_from_config` (a config dict), :func:`load_spec` (a preset name, a
``config.json`` path or a model directory: :mod:`kvbridge.model.modelconfig` reads the dict behind
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
  :mod:`kvbridge.model.spec` take the kernel width and drop the column the next token brings).
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
* **Llama 4's chunked local attention layers are sliding layers whose window is the chunk**
  (``attention_chunk_size``, C). A token at position p attends to ``[p // C * C, p]``, which
  always lies inside the last C tokens: transformers' cache keeps C - 1 of them for such a
  layer (``DynamicSlidingWindowLayer``) and SGLang's sliding-window pool keeps C (its window for
  Llama 4 is the chunk size). Which layers are chunked: ``layer_types``, else
  ``no_rope_layers`` (1 = a RoPE layer = chunked), else every layer but each
  ``no_rope_layer_interval``-th (4), as transformers' ``Llama4TextConfig`` decides.
* Multimodal wrappers (Gemma 3, Qwen3.5, Llama 4) are read through their ``text_config``.

A missing or malformed field, or an unknown ``model_type``, raises :class:`SpecError` naming the
model type, the field and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvbridge.errors import SpecError
from kvbridge.model.hf.builders import BUILDERS
from kvbridge.model.hf.families import ARCHITECTURES, FAMILIES
from kvbridge.model.hf.fields import Ctx, Fields, Mixer
from kvbridge.model.modelconfig import load_config
from kvbridge.model.spec import CacheSpec, DType, LayerSpec

__all__ = [
    "layer_origins",
    "load_spec",
    "spec_from_config",
    "supported_model_types",
]


def supported_model_types() -> list[str]:
    """The ``model_type`` values :func:`spec_from_config` understands."""
    return sorted(FAMILIES)


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
        known = [ARCHITECTURES[a] for a in names if isinstance(a, str) and a in ARCHITECTURES]
        if not known:
            raise SpecError(
                f"config has no 'model_type' and no known 'architectures' "
                f"(got {archs!r}); expected one of {supported_model_types()}"
            )
        model_type = known[0]
    if model_type not in FAMILIES:
        raise SpecError(
            f"unsupported model_type {model_type!r}; expected one of {supported_model_types()}"
        )
    return str(model_type), fields


def _build(
    config: Mapping[str, object], dtype: DType | None, ssm_dtype: DType | None
) -> tuple[Fields, list[tuple[int, LayerSpec]]]:
    model_type, fields = _text_config(config)
    f = Fields(fields, model_type)
    if dtype is None:
        raw = f.get("torch_dtype", "dtype", default="bfloat16")
        dtype = DType.parse(str(raw))
    if ssm_dtype is None:
        raw = f.get("mamba_ssm_dtype", "mamba_ssm_cache_dtype", default="float32")
        ssm_dtype = DType.parse(str(raw))
    ctx = Ctx(f, dtype, ssm_dtype)
    built: dict[Mixer, LayerSpec] = {}  # layers of one kind are identical; build each once
    layers: list[tuple[int, LayerSpec]] = []
    for i, mixers in enumerate(FAMILIES[model_type](f)):
        for m in mixers:
            if m is Mixer.NONE:
                continue
            if m not in built:
                built[m] = BUILDERS[m](ctx)
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
