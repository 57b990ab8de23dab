"""The CacheSpec of the cache HF builds for a demo model.

:func:`cache_map` describes **exactly the cache the installed transformers builds** (checked
against real tensors by :func:`kvbridge.demo.cache_io.check_cache` on every run), layer by HF
cache layer class:

==================================  =========================================================
HF cache layer                      spec layer(s) and how the HF tensors map to them
==================================  =========================================================
``DynamicLayer`` (attention)        FULL: ``k``/``v`` per token = ``keys/values[0, :, t, :]``
                                    (``[kv_heads, head_dim]``), sharded by KV head
``DynamicLayer`` (DeepSeek MLA)     MLA: transformers >= 5 caches the latent, not per-head K/V:
                                    ``keys`` = normalised ``kv_lora_rank`` latent, ``values`` =
                                    roped ``qk_rope_head_dim`` key; ``latent`` per token =
                                    ``keys | values``, unsharded (replicated on every rank)
``DynamicSlidingWindowLayer``       SLIDING with window ``sliding_window - 1``: HF keeps only
                                    the last ``sliding_window - 1`` tokens (all the next token
                                    attends to) plus ``cumulative_length``, which travels in aux
``LinearAttentionLayer`` (Mamba2)   MAMBA2: ``conv`` = ``conv_states[0][0]`` (``[conv_dim,
                                    kernel]``: HF keeps all ``kernel`` columns, where vLLM and
                                    SGLang keep ``kernel - 1``), x|B|C segments; ``ssm`` =
                                    ``recurrent_states[0][0]`` (``[heads, head_dim, d_state]``)
``LinearAttentionLayer`` (GDN)      GDN: ``conv`` (``[q|k|v channels, kernel]``), ``recurrent``
                                    (``[v_heads, k_head_dim, v_head_dim]``)
``LinearAttentionLayer`` (Mamba1)   MAMBA1: ``conv`` (``[intermediate, kernel]``), ``ssm``
                                    (``[intermediate, d_state]``), both by channel (Jamba's
                                    Mamba layers too: intermediate = expand x hidden)
``LinearAttentionLayer`` (LFM2)     SHORT_CONV: ``conv`` (``[hidden, L_cache]``), by channel
``DynamicIndexedLayer``             MLA_INDEXER (DeepSeek-V3.2): the MLA latent as above, and
                                    ``index_k`` = ``indexer_keys[0, t]`` (one head), unsharded
``LinearAttentionAndFullAttention``  two spec layers, FULL then MAMBA2 (Falcon-H1)
``DummyLayer`` (MLP / MoE)          no spec layer (Nemotron-H)
==================================  =========================================================

This module imports transformers only inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.demo.models import ModelCase, hf_config, one_line
from kvbridge.errors import SpecError
from kvbridge.model.spec import (
    CacheSpec,
    DType,
    LayerKind,
    LayerSpec,
    attention_layer,
    gdn_layer,
    mamba1_layer,
    mamba2_layer,
    mla_layer,
    short_conv_layer,
)

# ---- the cache HF builds, as a CacheSpec ---------------------------------------------------------


@dataclass(frozen=True)
class HFLayer:
    """Where spec layer ``i`` lives in the HF cache, and the shapes of its tensors there.

    ``shapes[component]`` is the HF tensor's shape without batch (and without the token axis
    for per-token components): ``(kv_heads, head_dim)``, ``(kv_lora_rank,)``,
    ``(conv_dim, kernel)``, ``(heads, head_dim, d_state)``...
    """

    hf_index: int
    kind: LayerKind
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheMap:
    spec: CacheSpec
    layers: tuple[HFLayer, ...]  # one per spec layer


# Families whose sliding-window layers hold more KV heads than the config says, by a factor
# their modeling code fixes (MiMo-V2-Flash: modeling_mimo_v2_flash, "num_key_value_heads * 2
# if is_swa").
_SWA_KV_FACTOR = {"mimo_v2_flash": 2}


def _attention(config: Any, window: int | None) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    heads = _field(config, "num_attention_heads")
    # Without num_key_value_heads a model is multi-head (a KV head per attention head), or
    # multi-query (one, for every attention head: Falcon's multi_query).
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", 0):
        kv = 1
    else:
        kv = _field(config, "num_key_value_heads", "num_kv_heads", "num_attention_heads")
    if window is not None:
        kv *= _SWA_KV_FACTOR.get(config.model_type, 1)
    hd = getattr(config, "head_dim", None) or _field(config, "hidden_size") // heads
    v_hd = getattr(config, "v_head_dim", None)
    if v_hd is not None and int(v_hd) != int(hd):
        raise SpecError(
            f"{config.model_type}: keys and values of different head dims (head_dim {hd}, "
            f"v_head_dim {v_hd}): not described"
        )
    return (
        attention_layer(kv, int(hd), DType.FLOAT32, window=window),
        {"k": (kv, int(hd)), "v": (kv, int(hd))},
    )


def _mla(config: Any, indexed: bool) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    rank, rope = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
    shapes: dict[str, tuple[int, ...]] = {"keys": (rank,), "values": (rope,)}
    if not indexed:
        return mla_layer(rank, rope, DType.FLOAT32), shapes
    index = int(config.index_head_dim)
    return (
        mla_layer(rank, rope, DType.FLOAT32, indexer_dim=index, indexer_dtype=DType.FLOAT32),
        {**shapes, "indexer_keys": (index,)},
    )


def _field(config: Any, *names: str) -> int:
    """The first of ``names`` the config has: families spell the same size differently."""
    for name in names:
        if getattr(config, name, None) is not None:
            return int(getattr(config, name))
    raise SpecError(f"{config.model_type}: the config has none of {', '.join(names)}")


def _mamba2(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    heads = _field(config, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads")
    hd = _field(config, "mamba_d_head", "mamba_head_dim", "mamba_headdim", "head_dim")
    groups = _field(config, "mamba_n_groups", "n_groups", "mamba_ngroups")
    d_state = _field(config, "mamba_d_state", "ssm_state_size", "state_size")
    kernel = _field(config, "mamba_d_conv", "conv_kernel")
    # The builder keeps d_conv - 1 columns (what serving engines store); HF keeps all `kernel`.
    layer = mamba2_layer(
        heads, hd, groups, d_state, kernel + 1, conv_dtype=DType.FLOAT32, ssm_dtype=DType.FLOAT32
    )
    return layer, {"conv": (heads * hd + 2 * groups * d_state, kernel), "ssm": (heads, hd, d_state)}


# Families whose recurrent layers are none of the above, which HF still caches in a
# LinearAttentionLayer: refused by name rather than by a field the Mamba2 reader misses.
_NOT_DESCRIBED = {"recurrent_gemma": "RG-LRU (RecurrentGemma's real-gated linear recurrence)"}

# Families whose recurrent layers are Mamba1's (no heads: a state per channel).
_MAMBA1 = ("mamba", "falcon_mamba", "jamba")


def _mamba1(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    # Mamba's own configs state the inner width; a hybrid's (Jamba) says expand x hidden.
    expand = getattr(config, "mamba_expand", None)
    inner = (
        expand * _field(config, "hidden_size") if expand else _field(config, "intermediate_size")
    )
    d_state = _field(config, "state_size", "mamba_d_state")
    kernel = _field(config, "conv_kernel", "mamba_d_conv")
    layer = mamba1_layer(
        inner, d_state, kernel + 1, conv_dtype=DType.FLOAT32, ssm_dtype=DType.FLOAT32
    )  # kernel + 1: as for Mamba2 above
    return layer, {"conv": (inner, kernel), "ssm": (inner, d_state)}


def _short_conv(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    hidden, cache = int(config.hidden_size), int(config.conv_L_cache)
    return short_conv_layer(hidden, cache, dtype=DType.FLOAT32), {"conv": (hidden, cache)}


def _gdn(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    kh, vh = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    kd, vd = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
    kernel = int(config.linear_conv_kernel_dim)
    layer = gdn_layer(
        kh, vh, kd, vd, kernel + 1, conv_dtype=DType.FLOAT32, state_dtype=DType.FLOAT32
    )  # kernel + 1: as for Mamba2 above
    return layer, {"conv": (2 * kh * kd + vh * vd, kernel), "recurrent": (vh, kd, vd)}


def _linear(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    """Which recurrent mixer a ``LinearAttentionLayer`` caches, from the config's fields."""
    if getattr(config, "linear_num_key_heads", None) is not None:
        return _gdn(config)
    if getattr(config, "conv_L_cache", None) is not None:
        return _short_conv(config)
    if config.model_type in _MAMBA1:
        return _mamba1(config)
    for model_type, mixer in _NOT_DESCRIBED.items():
        if config.model_type == model_type:
            raise SpecError(
                f"{model_type}: its recurrent layers are {mixer}, whose state the demo does not "
                f"describe yet (it describes GDN, short conv, Mamba1 and Mamba2)"
            )
    try:
        return _mamba2(config)
    except SpecError as e:
        raise SpecError(
            f"{config.model_type}: its recurrent layers are none the demo describes (GDN, "
            f"short conv, Mamba1 or Mamba2): {e}"
        ) from None


def cache_map(case: ModelCase, config: Any | None = None) -> CacheMap:
    """The CacheSpec of the cache HF builds for ``case``, from the cache's own layer classes;
    SpecError, in one line, for a cache or a config it cannot describe."""
    try:
        return _cache_map(case, config)
    except SpecError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError) as e:
        # A field the demo reads that this family names otherwise, or holds per layer
        # (transformers' heterogeneous configs raise a RuntimeError for those).
        raise SpecError(
            f"{case.name}: cannot describe its cache: {type(e).__name__}: {one_line(e)}"
        ) from None


def _cache_map(case: ModelCase, config: Any | None) -> CacheMap:
    from transformers.cache_utils import (
        DummyLayer,
        DynamicCache,
        DynamicIndexedLayer,
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionAndSlidingWindowAttentionLayer,
        LinearAttentionLayer,
    )

    config = config if config is not None else hf_config(case)
    built: list[tuple[LayerSpec, HFLayer]] = []
    for i, layer in enumerate(DynamicCache(config=config).layers):
        parts: list[tuple[LayerSpec, dict[str, tuple[int, ...]]]] = []
        mla = getattr(config, "kv_lora_rank", None) is not None
        if isinstance(layer, DummyLayer):
            continue
        if isinstance(layer, LinearAttentionAndFullAttentionLayer):
            parts = [_attention(config, None), _linear(config)]
        elif isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
            parts = [_attention(config, int(layer.sliding_window) - 1), _linear(config)]
        elif isinstance(layer, LinearAttentionLayer):
            parts = [_linear(config)]
        elif isinstance(layer, DynamicSlidingWindowLayer):
            parts = [_attention(config, int(layer.sliding_window) - 1)]
        elif isinstance(layer, DynamicIndexedLayer):
            parts = [_mla(config, indexed=True)]
        elif isinstance(layer, DynamicLayer):
            parts = [_mla(config, indexed=False) if mla else _attention(config, None)]
        else:
            raise SpecError(
                f"{case.name}: HF cache layer {i} is a {type(layer).__name__}, "
                f"which the demo does not know"
            )
        built += [(spec, HFLayer(i, spec.kind, shapes)) for spec, shapes in parts]
    spec = CacheSpec(model=f"hf-{case.name}", layers=tuple(s for s, _ in built))
    return CacheMap(spec, tuple(h for _, h in built))
