"""The demo's models: tiny configs of real architectures, and the CacheSpec of their HF caches.

Every case is a real ``transformers`` architecture built from a small config with random weights
from a fixed seed (float32, eager attention, byte-level vocabulary of 256, ``initializer_range``
0.2: at HF's default 0.02, and still at 0.1 for some of these sizes, greedy text degenerates
into one repeated token; untied embeddings, without which Gemma's text is not varied either).

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
                                    (``[intermediate, d_state]``), both by channel
``LinearAttentionLayer`` (LFM2)     SHORT_CONV: ``conv`` (``[hidden, L_cache]``), by channel
``DynamicIndexedLayer``             MLA_INDEXER (DeepSeek-V3.2): the MLA latent as above, and
                                    ``index_k`` = ``indexer_keys[0, t]`` (one head), unsharded
``LinearAttentionAndFullAttention``  two spec layers, FULL then MAMBA2 (Falcon-H1)
``DummyLayer`` (MLP / MoE)          no spec layer (Nemotron-H)
==================================  =========================================================

This module imports torch and transformers only inside the functions that need them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import SpecError
from kvbridge.spec import (
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

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "initializer_range": 0.2,
    "dtype": "float32",
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class ModelCase:
    name: str
    title: str  # architecture, for people
    model_type: str  # the HF model_type
    config: Mapping[str, Any]
    topologies: tuple[tuple[str, str], ...]  # the default matrix: (topology, transport)
    # HF's Mamba1 (without its CUDA kernels) starts each multi-token forward from a zero SSM
    # state, so a chunked prefill is wrong: such a model prefills its prompt in one forward.
    chunked: bool = True
    full_size: bool = False  # a user's config at its real dimensions (no size check)


CASES: dict[str, ModelCase] = {
    c.name: c
    for c in (
        ModelCase(
            "llama",
            "Llama (dense GQA, 6 KV heads)",
            "llama",
            {
                "hidden_size": 96,
                "intermediate_size": 192,
                "num_hidden_layers": 2,
                "num_attention_heads": 12,
                "num_key_value_heads": 6,
                "head_dim": 16,
            },
            (("tp2-tp3", "shm"), ("page64-16", "tcp"), ("pp2-pp1", "shm")),
        ),
        ModelCase(
            "qwen3",
            "Qwen3 (dense GQA, 2 KV heads: replicated at TP4)",
            "qwen3",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
            },
            (("tp4-tp1", "shm"), ("tp1-tp4", "shm"), ("nhd-hnd", "tcp"), ("cp2-tp2", "tcp")),
        ),
        ModelCase(
            "deepseek-v3",
            "DeepSeek-V3 (MLA latent, MoE)",
            "deepseek_v3",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "kv_lora_rank": 32,
                "q_lora_rank": 48,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 1,
            },
            (
                ("tp4-tp1", "shm"),
                ("tp2-tp3", "tcp"),
                ("pp2-pp1", "shm"),
                ("dp2-dp2", "tcp"),
                ("tp1-dcp2", "shm"),
            ),
        ),
        ModelCase(
            "qwen3-next",
            "Qwen3-Next (gated delta net + attention, MoE)",
            "qwen3_next",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
            },
            (("tp1-tp4", "shm"), ("tp4-tp1", "tcp"), ("pp2-pp1", "shm"), ("cp2xtp2-tp1", "shm")),
        ),
        ModelCase(
            "bamba",
            "Bamba (Mamba2 + attention)",
            "bamba",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "attn_layer_indices": [1],
                "mamba_n_heads": 4,
                "mamba_d_head": 32,
                "mamba_n_groups": 2,
                "mamba_d_state": 16,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
            },
            (("tp4-tp1", "shm"), ("tp1-tp4", "tcp"), ("pp2-pp1", "shm")),
        ),
        ModelCase(
            "gemma3",
            "Gemma 3 (sliding window 16 + global)",
            "gemma3_text",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "sliding_window": 16,
                "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            },
            (("tp4-tp1", "shm"), ("page64-16", "shm"), ("nhd-hnd", "tcp")),
        ),
        ModelCase(
            "gpt-oss",
            "gpt-oss (sliding window 16 / full, sinks, MoE)",
            "gpt_oss",
            {
                "hidden_size": 64,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "sliding_window": 16,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
            },
            (("tp2-tp1", "shm"),),
        ),
        ModelCase(
            "nemotron-h",
            "Nemotron-H (Mamba2, attention, MLP-only layers)",
            "nemotron_h",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "hybrid_override_pattern": "M-*-M",
                "mamba_num_heads": 4,
                "mamba_head_dim": 32,
                "n_groups": 2,
                "ssm_state_size": 16,
                "conv_kernel": 4,
                "expand": 2,
            },
            (("tp1-tp2", "shm"),),
        ),
        ModelCase(
            "falcon-h1",
            "Falcon-H1 (attention and Mamba2 in every layer)",
            "falcon_h1",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "mamba_n_heads": 4,
                "mamba_d_head": 32,
                "mamba_n_groups": 2,
                "mamba_d_state": 16,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_d_ssm": 128,
            },
            (("tp2-tp1", "tcp"),),
        ),
        ModelCase(
            "mamba",
            "Mamba (Mamba1: conv and SSM state by channel)",
            "mamba",
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "state_size": 16,
                "expand": 2,
                "conv_kernel": 4,
                "time_step_rank": 8,
            },
            (("tp1-tp4", "shm"), ("tp2-tp1", "tcp")),
            chunked=False,
        ),
        ModelCase(
            "lfm2",
            "LFM2 (gated short convolutions + attention)",
            "lfm2",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "conv_L_cache": 3,
                "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            },
            (("tp1-tp4", "shm"), ("tp2-tp1", "tcp")),
        ),
        ModelCase(
            "deepseek-v3.2",
            "DeepSeek-V3.2 (MLA latent + sparse-attention indexer keys)",
            "deepseek_v32",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "kv_lora_rank": 32,
                "q_lora_rank": 48,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 1,
                "index_head_dim": 32,
                "index_n_heads": 4,
                "index_topk": 8,
            },
            (("tp4-tp1", "shm"), ("tp1-tp2", "tcp")),
        ),
    )
}


def get_case(name: ModelCase | str) -> ModelCase:
    if isinstance(name, ModelCase):
        return name
    try:
        return CASES[name]
    except KeyError:
        raise SpecError(f"unknown demo model {name!r}; known: {', '.join(CASES)}") from None


# ---- building a model ---------------------------------------------------------------------------


def preload() -> None:
    """Import every case's modeling module now (transformers imports them lazily, which costs
    each new process seconds): the fork server calls this once, before any rank is forked."""
    import importlib

    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.utils import logging

    logging.set_verbosity_error()  # not one "falling back to the PyTorch kernel" line per rank

    for case in CASES.values():
        module = model_type_to_module_name(case.model_type)
        importlib.import_module(f"transformers.models.{module}.configuration_{module}")
        importlib.import_module(f"transformers.models.{module}.modeling_{module}")


def hf_config(case: ModelCase) -> Any:
    """The case's transformers config; SpecError, with transformers' reason in one line, where
    the class refuses its fields (the demo's size breaks a constraint of the class)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(case.model_type, **{**_COMMON, **case.config})
    except (StrictDataclassError, ValueError, TypeError) as e:
        raise SpecError(f"{case.name}: transformers refuses the config: {one_line(e)}") from None
    config._attn_implementation = "eager"
    return config


def one_line(e: BaseException) -> str:
    """An error's message on one line: its first line, and the next where the first only
    introduces it (transformers' validation errors: "... validator 'x':" then the reason)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    text = " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return text[:300]


def build_model(case: ModelCase, seed: int) -> Any:
    """The model in eval mode, its weights drawn from ``seed`` (the same in every process)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(case)
    try:
        if not case.full_size:  # weighed first, without memory: a field left at full size
            with torch.device("meta"):
                _check_size(case, AutoModelForCausalLM.from_config(config, dtype=torch.float32))
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.float32
        )
    except SpecError:
        raise
    except ValueError as e:  # not a causal LM (an encoder, a vision model...)
        raise SpecError(
            f"{case.name}: transformers builds no causal LM from a "
            f"{case.model_type} config: {str(e).splitlines()[0]}"
        ) from None
    return model.eval()


MAX_PARAMS = 64_000_000  # the scaled models are under a few million parameters


def _check_size(case: ModelCase, model: Any) -> None:
    """SpecError if the scaled model is still large: a field of its family the demo does not
    scale (named by the largest parameter), which would take the machine's memory."""
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    if total > MAX_PARAMS:
        name, big = max(params.items(), key=lambda kv: kv[1].numel())
        raise SpecError(
            f"{case.name}: scaled down, the model still has {total / 1e6:.0f}M parameters "
            f"({name}: {tuple(big.shape)}): a field of {case.model_type} the demo does not "
            f"scale; --full-size builds it as it is"
        )


def weights_digest(model: Any) -> str:
    """A hash of every parameter and buffer: every process checks it builds the same model."""
    h = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()[:16]


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


def _attention(config: Any, window: int | None) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    heads = _field(config, "num_attention_heads")
    # Without num_key_value_heads a model is multi-head: a KV head per attention head.
    kv = _field(config, "num_key_value_heads", "num_attention_heads")
    hd = getattr(config, "head_dim", None) or _field(config, "hidden_size") // heads
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


def _mamba1(config: Any) -> tuple[LayerSpec, dict[str, tuple[int, ...]]]:
    inner = _field(config, "intermediate_size")
    d_state, kernel = _field(config, "state_size"), _field(config, "conv_kernel")
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
    if config.model_type in ("mamba", "falcon_mamba"):
        return _mamba1(config)
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
