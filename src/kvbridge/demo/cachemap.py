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
                                    attends to) plus ``cumulative_length``, which travels in aux;
                                    dots3's sliding MLA layers: the MLA latent as below
``LinearAttentionLayer`` (Mamba2)   MAMBA2: ``conv`` = ``conv_states[0][0]`` (``[conv_dim,
                                    kernel]``: HF keeps all ``kernel`` columns, where vLLM and
                                    SGLang keep ``kernel - 1``), x|B|C segments; ``ssm`` =
                                    ``recurrent_states[0][0]`` (``[heads, head_dim, d_state]``)
``LinearAttentionLayer`` (GDN)      GDN: ``conv`` (``[q|k|v channels, kernel]``), ``recurrent``
                                    (``[v_heads, k_head_dim, v_head_dim]``)
``LinearAttentionLayer`` (Mamba1)   MAMBA1: ``conv`` (``[intermediate, kernel]``), ``ssm``
                                    (``[intermediate, d_state]``), both by channel (Jamba's
                                    Mamba layers too: intermediate = expand x hidden); Zamba1's
                                    multi-head Mamba1 by head (``ssm`` ``[heads, dim, d_state]``)
``LinearAttentionLayer`` (KDA)      KDA (Kimi Linear): ``conv`` (``[q|k|v channels, kernel]``),
                                    ``recurrent`` (``[heads, head_dim, head_dim]``)
``LinearAttentionLayer`` (LFM2)     SHORT_CONV: ``conv`` (``[hidden, L_cache]``), by channel
``LinearAttentionAnd...`` (Inkling)  the attention, then SHORT_CONV of its four conv states
                                    (``conv_states[0..3]``, each ``[channels, kernel]``): ``k``
                                    and ``v`` (``[kv_heads x head_dim]``, by KV head; a sliding
                                    layer's are its ``swa_`` heads), ``attn`` and ``mlp``
                                    (``[hidden]``, the residual stream, replicated)
``LinearAttentionAnd...`` (ZAYA)    the attention, then SHORT_CONV of its CCA: ``conv`` =
                                    ``conv_states[0][0]`` (``[q|k channels, kernel]``, by
                                    head), ``v_delayed`` = ``recurrent_states[0][0]`` (the
                                    previous token's delayed value projection, replicated)
``LinearAttentionLayer`` (MiniMax)  LIGHTNING: ``kv`` (``[heads, head_dim, head_dim]``), by head;
                                    kept in ``MiniMaxCache.linear_cache``
``LinearAttentionLayer`` (Griffin)  RG_LRU (RecurrentGemma): ``conv`` (``[lru_width, kernel -
                                    1]``), ``recurrent`` (``[lru_width]``), by the RG-LRU's
                                    head blocks; kept in the model's modules
(RWKV-4, every block)               RWKV: ``ffn_x``, ``att_x`` (the previous token, replicated),
                                    ``num``, ``den``, ``max`` (by channel); kept in its state list
(XLNet, every layer)                HIDDEN: ``mems`` per token = ``mems[i][t, 0]`` (the hidden state
                                    the layer was given, ``[d_model]``), replicated; SLIDING of
                                    it with ``mem_len``; kept in the list :mod:`.hfcache` keeps
(xLSTM, every block)                MLSTM: ``c`` (``[heads, qk_dim, v_dim]``), ``n``
                                    (``[heads, qk_dim]``), ``m`` (``[heads, 1]``), by head;
                                    kept in ``xLSTMCache.rnn_state``
``DynamicIndexedLayer``             MLA_INDEXER (DeepSeek-V3.2): the MLA latent as above, and
                                    ``index_k`` = ``indexer_keys[0, t]`` (one head), unsharded;
                                    a ``"shared"`` layer of ``indexer_types`` (Hy-V4), which
                                    reuses the last full layer's top-k: MLA (no indexer keys)
``LinearAttentionAndFullAttention``  two spec layers, FULL then the recurrent one (Falcon-H1:
                                    MAMBA2; Zamba1's hybrid layers: MAMBA1)
``DeepseekV4HCACache``, ``...CSA...``  DeepSeek V4: SLIDING of its window's ``kv`` (its keys are its
                                    values), then COMPRESSED: the compressor's entries, one every
                                    ``compress_rate`` tokens, its unclosed window and overlap,
                                    and CSA's indexer's: :mod:`.compressed`
``DynamicLayer`` (CPM-Ant)          PREFIX: ``k``/``v`` of its ``prompt_length`` prompt positions
                                    (``keys[0, :, :prompt_length]``), by head; then FULL of the
                                    request's tokens after them
``DummyLayer`` (MLP / MoE)          no spec layer (Nemotron-H); nor Mllama's cross-attention
                                    layers, empty in a text-only request
==================================  =========================================================

This module imports transformers only inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.demo import compressed
from kvbridge.demo.models import ModelCase, hf_config, on_meta, one_line
from kvbridge.errors import SpecError
from kvbridge.model.spec import (
    CacheSpec,
    DType,
    LayerKind,
    LayerSpec,
    attention_layer,
    gdn_layer,
    kda_layer,
    mamba1_layer,
    mamba2_layer,
    mla_layer,
    short_conv_layer,
)
from kvbridge.model.states import (
    attention_convs_layer,
    cca_layer,
    hidden_layer,
    lightning_layer,
    mlstm_layer,
    prefix_layer,
    rglru_layer,
    rwkv_layer,
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
    # A layer of several conv states (Inkling's): its conv components, in HF's state order.
    convs: tuple[str, ...] = ()
    # Positions the HF layer holds before the request's tokens (CPM-Ant's prompt): a PREFIX
    # layer's, then the FULL layer's tokens after them.
    lead: int = 0


@dataclass(frozen=True)
class CacheMap:
    spec: CacheSpec
    layers: tuple[HFLayer, ...]  # one per spec layer


# Families whose sliding-window layers hold more KV heads than the config says, by a factor
# their modeling code fixes (MiMo-V2-Flash: modeling_mimo_v2_flash, "num_key_value_heads * 2
# if is_swa").
_SWA_KV_FACTOR = {"mimo_v2_flash": 2}


def _kv_heads(config: Any, sliding: bool) -> tuple[int, int]:
    """(KV heads, head dim) of an attention layer, sliding or not."""
    if sliding and getattr(config, "swa_num_key_value_heads", None) is not None:
        # Inkling: its sliding layers' own KV heads and head dim
        return _field(config, "swa_num_key_value_heads"), _field(config, "swa_head_dim")
    heads = _field(config, "num_attention_heads")
    # Without num_key_value_heads a model is multi-head (a KV head per attention head), or
    # multi-query (one, for every attention head: Falcon's multi_query).
    decoder = getattr(config, "decoder_attention_heads", None)
    if getattr(config, "is_encoder_decoder", False) and isinstance(decoder, int):
        # the causal LM of an encoder-decoder config is its decoder (Whisper's, BART's),
        # whose heads the standard names do not map to: they read the encoder's
        heads = kv = decoder
    elif getattr(config, "multi_query", False) and not getattr(
        config, "new_decoder_architecture", 0
    ):
        kv = 1
    else:
        kv = _field(config, "num_key_value_heads", "num_kv_heads", "num_attention_heads")
    if sliding:
        kv *= _SWA_KV_FACTOR.get(config.model_type, 1)
    hd = int(
        getattr(config, "head_dim", None)
        or getattr(config, "dim_head", None)  # CPM-Ant
        or _field(config, "hidden_size") // heads
    )
    return kv, hd


def _attention(config: Any, window: int | None) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    kv, hd = _kv_heads(config, window is not None)
    v_hd = int(getattr(config, "v_head_dim", None) or hd)  # MiMo-V2-Flash: 192 and 128
    return (
        attention_layer(kv, hd, DType.FLOAT32, v_head_dim=v_hd, window=window),
        {"k": (kv, hd), "v": (kv, v_hd)},
    )


def _mla(
    config: Any, indexed: bool, window: int | None = None
) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    rank, rope = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
    shapes: dict[str, tuple[int, ...]] = {"keys": (rank,), "values": (rope,)}
    if not indexed:
        return mla_layer(rank, rope, DType.FLOAT32, window=window), shapes
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


# Families whose recurrent layers are Mamba1's (a state per channel; Zamba1's by head).
_MAMBA1 = ("mamba", "falcon_mamba", "jamba", "zamba")


def _mamba1(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    # Mamba's own configs state the inner width; a hybrid's (Jamba, Zamba) says expand x hidden.
    expand = getattr(config, "mamba_expand", None)
    inner = (
        expand * _field(config, "hidden_size") if expand else _field(config, "intermediate_size")
    )
    d_state = _field(config, "state_size", "mamba_d_state")
    kernel = _field(config, "conv_kernel", "mamba_d_conv")
    heads = getattr(config, "n_mamba_heads", None) or 1  # Zamba1: HF keeps [heads, dim, state]
    layer = mamba1_layer(
        inner, d_state, kernel + 1, conv_dtype=DType.FLOAT32, ssm_dtype=DType.FLOAT32, heads=heads
    )  # kernel + 1: as for Mamba2 above
    ssm = (inner, d_state) if heads == 1 else (heads, inner // heads, d_state)
    return layer, {"conv": (inner, kernel), "ssm": ssm}


def _short_conv(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    hidden, cache = int(config.hidden_size), int(config.conv_L_cache)
    return short_conv_layer(hidden, cache, dtype=DType.FLOAT32), {"conv": (hidden, cache)}


# The conv states of a layer that keeps several, in HF's order (its ``state_idx``): Inkling's
# short convolutions of the keys, the values, the attention's output and the MLP's.
ATTENTION_CONVS = ("k", "v", "attn", "mlp")


def _attention_convs(config: Any, sliding: bool) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    kv, hd = _kv_heads(config, sliding)
    hidden, kernel = _field(config, "hidden_size"), _field(config, "conv_kernel_size")
    kv_kernel = _field(config, "sconv_kernel_size", "conv_kernel_size")
    layer = attention_convs_layer(
        kv, hd, hidden, kv_kernel + 1, kernel + 1, dtype=DType.FLOAT32
    )  # kernel + 1: as for Mamba2 above
    return layer, {
        "k": (kv * hd, kv_kernel),
        "v": (kv * hd, kv_kernel),
        "attn": (hidden, kernel),
        "mlp": (hidden, kernel),
    }


def _cca(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    heads, kv = _field(config, "num_attention_heads"), _field(config, "num_key_value_heads")
    hd = _field(config, "head_dim")
    # its two convs in a row (depthwise, then grouped) need the last (t0 - 1) + (t1 - 1) inputs
    kernel = _field(config, "cca_time0") - 1 + _field(config, "cca_time1") - 1
    layer = cca_layer(heads, kv, hd, kernel + 1, dtype=DType.FLOAT32)  # HF keeps kernel steps
    return layer, {"conv": ((heads + kv) * hd, kernel), "v_delayed": (kv * hd // 2,)}


def _gdn(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    kh, vh = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    kd, vd = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
    kernel = int(config.linear_conv_kernel_dim)
    layer = gdn_layer(
        kh, vh, kd, vd, kernel + 1, conv_dtype=DType.FLOAT32, state_dtype=DType.FLOAT32
    )  # kernel + 1: as for Mamba2 above
    return layer, {"conv": (2 * kh * kd + vh * vd, kernel), "recurrent": (vh, kd, vd)}


def _kda(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    heads, dim = int(config.linear_num_heads), int(config.linear_head_dim)
    kernel = int(config.linear_conv_kernel_dim)
    layer = kda_layer(
        heads, dim, kernel + 1, conv_dtype=DType.FLOAT32, state_dtype=DType.FLOAT32
    )  # kernel + 1: as for Mamba2 above
    return layer, {"conv": (3 * heads * dim, kernel), "recurrent": (heads, dim, dim)}


def _lightning(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    heads = _field(config, "num_attention_heads")
    dim = getattr(config, "head_dim", None) or _field(config, "hidden_size") // heads
    return lightning_layer(heads, dim, DType.FLOAT32), {"kv": (heads, dim, dim)}


def _rglru(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    width, heads = _field(config, "lru_width"), _field(config, "num_attention_heads")
    kernel = _field(config, "conv1d_width")
    layer = rglru_layer(
        width, heads, kernel, conv_dtype=DType.FLOAT32, state_dtype=DType.FLOAT32
    )  # HF keeps kernel - 1 steps here, as the spec does
    return layer, {"conv": (width, kernel - 1), "recurrent": (width,)}


def _mlstm(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    heads, qk, v = int(config.num_heads), int(config.qk_head_dim), int(config.v_head_dim)
    return mlstm_layer(heads, qk, v, DType.FLOAT32), {
        "c": (heads, qk, v),
        "n": (heads, qk),
        "m": (heads, 1),
    }


def _rwkv(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    hidden = _field(config, "hidden_size")
    layer = rwkv_layer(hidden, shift_dtype=DType.FLOAT32, state_dtype=DType.FLOAT32)
    return layer, {name: (hidden,) for name in ("ffn_x", "att_x", "num", "den", "max")}


def _mems(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    """XLNet's memory: its layers' input hidden states, the last ``mem_len`` tokens' where it
    has one (0 or None: all). With ``reuse_len`` it keeps a forward's first tokens instead (a
    pretraining device), which no decode can continue from."""
    if getattr(config, "reuse_len", None):
        raise SpecError(
            f"{config.model_type}: reuse_len={config.reuse_len} keeps the first tokens of each "
            f"forward in its memory, not the last: no cache a decode continues from"
        )
    hidden, window = _field(config, "d_model"), getattr(config, "mem_len", None) or None
    return hidden_layer(hidden, DType.FLOAT32, window=window), {"mems": (hidden,)}


# Families whose every layer is one kind the DynamicCache of their config does not say, by
# model type (DynamicCache(config) says attention for them).
_EVERY_LAYER = {"xlstm": _mlstm, "rwkv": _rwkv, "xlnet": _mems}


def _prompted(config: Any) -> list[tuple[LayerSpec, dict[str, tuple[int, ...]]]]:
    """CPM-Ant's layer: the keys and values of its ``prompt_length`` learned prompt positions,
    which it prepends to every input (a PREFIX layer), then the request's tokens' (FULL)."""
    heads, hd = _field(config, "num_attention_heads"), _field(config, "dim_head")
    shapes: dict[str, tuple[int, ...]] = {"k": (heads, hd), "v": (heads, hd)}
    prefix = prefix_layer(_field(config, "prompt_length"), heads, hd, DType.FLOAT32)
    return [(prefix, shapes), (attention_layer(heads, hd, DType.FLOAT32), shapes)]


# Families whose LinearAttentionLayer is none of the Mamba kinds, by model type.
_OWN_LINEAR = {"minimax": _lightning, "recurrent_gemma": _rglru, "zaya": _cca}


# Families whose hybrid layers keep short convolutions around their attention, by model type.
_ATTENTION_CONVS = ("inkling_text", "inkling2_text")


def _linear(config: Any, sliding: bool = False) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    """Which recurrent mixer a ``LinearAttentionLayer`` caches, from the config's fields
    (``sliding``: beside a sliding attention layer)."""
    if config.model_type in _ATTENTION_CONVS:
        return _attention_convs(config, sliding)
    if getattr(config, "linear_num_key_heads", None) is not None:
        return _gdn(config)
    if getattr(config, "linear_num_heads", None) is not None:
        return _kda(config)
    if getattr(config, "conv_L_cache", None) is not None:
        return _short_conv(config)
    if config.model_type in _MAMBA1:
        return _mamba1(config)
    if config.model_type in _OWN_LINEAR:
        return _OWN_LINEAR[config.model_type](config)
    try:
        return _mamba2(config)
    except SpecError as e:
        raise SpecError(
            f"{config.model_type}: its recurrent layers are none the demo describes (GDN, "
            f"KDA, short conv, Mamba1, Mamba2, lightning, mLSTM or RG-LRU): {e}"
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
        # (transformers' heterogeneous configs raise a RuntimeError for those); unless
        # transformers itself builds no model of the config (Qwen4-Exp's defaults): that is
        # the reason then.
        on_meta(case)
        raise SpecError(
            f"{case.name}: cannot describe its cache: {type(e).__name__}: {one_line(e)}"
        ) from None


def _own_indexer(config: Any, i: int) -> bool:
    """Whether indexed layer ``i`` runs an indexer of its own: a ``"shared"`` layer of
    ``indexer_types`` (Hy-V4, GLM-MoE-DSA) reuses the previous full layer's top-k and leaves
    its cache layer's indexer keys empty, an MLA layer without them."""
    types = getattr(config, "indexer_types", None)
    return not (isinstance(types, (list, tuple)) and i < len(types) and types[i] == "shared")


def _convs(spec: LayerSpec) -> tuple[str, ...]:
    names = tuple(c.name for c in spec.components)
    return names if names == ATTENTION_CONVS else ()


# Layers that hold nothing in a text-only request, by model type: the config field that lists
# them. Mllama's cross-attention layers cache the image's keys and values (as many as its
# vision tokens); with no image transformers skips those layers and leaves their cache empty,
# so they are no spec layer, as a DummyLayer is not.
_EMPTY_WITHOUT_IMAGE = {"mllama_text_model": "cross_attention_layers"}


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
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = config if config is not None else hf_config(case)
    listed = _EMPTY_WITHOUT_IMAGE.get(config.model_type)
    empty = set(getattr(config, listed) or ()) if listed else set()
    # A model's own cache layer classes (DeepSeek V4's) register as its module is imported:
    # the look-up of its class imports it (a decode rank describes the cache before building
    # the model).
    MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    try:  # the cache the model's forward (and its generate) builds from its config
        held = DynamicCache(config=config)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        # (BLT: its config keeps its stacks' layer counts in sub-configs, which transformers'
        # cache does not read: the model's cached forward and its generate fail alike), unless
        # transformers builds no model of the config at all: that is the reason then
        on_meta(case)
        raise SpecError(
            f"{case.name}: transformers' own cache fails to build from this config, as its "
            f"cached forward and generate build it: {type(e).__name__}: {one_line(e)}"
        ) from None
    built: list[tuple[LayerSpec, HFLayer]] = []
    for i, layer in enumerate(held.layers):
        # A heterogeneous config (Gemma 4, dots3) holds each layer's own sizes apart.
        own = (
            config.per_layer_config[i] if getattr(config, "per_layer_attributes", None) else config
        )
        mla = getattr(own, "kv_lora_rank", None) is not None
        parts: list[tuple[LayerSpec, dict[str, tuple[int, ...]]]] = []
        if isinstance(layer, DummyLayer) or i in empty:
            continue
        lead = 0
        if config.model_type in _EVERY_LAYER:
            parts = [_EVERY_LAYER[config.model_type](config)]
        elif config.model_type == "cpmant":
            parts, lead = _prompted(config), int(config.prompt_length)
        elif compressed.is_compressed(layer):  # (DeepSeek V4's: a sliding layer's subclass)
            parts = compressed.specs(own, layer)
        elif isinstance(layer, LinearAttentionAndFullAttentionLayer):
            parts = [_attention(own, None), _linear(own)]
        elif isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
            parts = [_attention(own, int(layer.sliding_window) - 1), _linear(own, sliding=True)]
        elif isinstance(layer, LinearAttentionLayer):
            parts = [_linear(own)]
        elif isinstance(layer, DynamicSlidingWindowLayer):
            window = int(layer.sliding_window) - 1
            parts = [_mla(own, indexed=False, window=window) if mla else _attention(own, window)]
        elif isinstance(layer, DynamicIndexedLayer):
            parts = [_mla(own, indexed=_own_indexer(config, i))]
        elif isinstance(layer, DynamicLayer):
            parts = [_mla(own, indexed=False) if mla else _attention(own, None)]
        else:
            raise SpecError(
                f"{case.name}: HF cache layer {i} is a {type(layer).__name__}, "
                f"which the demo does not know"
            )
        built += [
            (spec, HFLayer(i, spec.kind, shapes, _convs(spec), lead)) for spec, shapes in parts
        ]
    spec = CacheSpec(model=f"hf-{case.name}", layers=tuple(s for s, _ in built))
    return CacheMap(spec, tuple(h for _, h in built))
