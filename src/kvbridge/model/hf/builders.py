"""One LayerSpec builder per mixer, from the config's fields."""

from __future__ import annotations

from collections.abc import Callable

from kvbridge.model.hf.families import linear_attn
from kvbridge.model.hf.fields import Ctx, Fields, Mixer
from kvbridge.model.spec import (
    DType,
    LayerSpec,
    attention_layer,
    gdn_layer,
    kda_layer,
    mamba1_layer,
    mamba2_layer,
    mla_layer,
    short_conv_layer,
)

_INDEXER_SCALE_BLOCK = 128  # fp8 indexer keys carry one fp32 scale per 128 elements


def _head_dim(f: Fields) -> int:
    if f.raw.get("head_dim") is not None or f.raw.get("attention_head_dim") is not None:
        return f.integer("head_dim", "attention_head_dim")
    hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    if hidden % heads:
        raise f.error(
            ("head_dim",),
            f"absent, and hidden_size {hidden} is not a multiple of num_attention_heads {heads}",
        )
    return hidden // heads


def _attention(c: Ctx, window: int | None = None) -> LayerSpec:
    kv = c.f.integer("num_key_value_heads", "num_attention_heads")
    return attention_layer(kv, _head_dim(c.f), c.dtype, window=window)


def _kernel(f: Fields, *names: str) -> int:
    # The cache keeps kernel - 1 columns, so a kernel of 1 would cache nothing.
    return f.integer(*names, minimum=2)


def _mamba2(c: Ctx) -> LayerSpec:
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


def _mamba1(c: Ctx) -> LayerSpec:
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


def _gdn(c: Ctx) -> LayerSpec:
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


def _kda(c: Ctx) -> LayerSpec:
    f = c.f
    if f.raw.get("linear_attn_config") is not None:  # the checkpoint's names
        sub = linear_attn(f)
        heads, dim = sub.integer("num_heads"), sub.integer("head_dim")
        kernel = _kernel(sub, "short_conv_kernel_size")
    else:  # transformers' saved config
        heads, dim = f.integer("linear_num_heads"), f.integer("linear_head_dim")
        kernel = _kernel(f, "linear_conv_kernel_dim")
    return kda_layer(heads, dim, kernel, conv_dtype=c.dtype, state_dtype=c.ssm_dtype)


def _mla(c: Ctx, indexer: bool) -> LayerSpec:
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


BUILDERS: dict[Mixer, Callable[[Ctx], LayerSpec]] = {
    Mixer.FULL: _attention,
    Mixer.SLIDING: lambda c: _attention(c, window=c.f.integer("sliding_window")),
    # A token at p attends to [p // C * C, p]: always inside the last C tokens (C =
    # attention_chunk_size), which is what transformers' cache (C - 1 of them) and SGLang's
    # sliding-window pool (C, its scheduler's window for Llama 4) keep.
    Mixer.CHUNKED: lambda c: _attention(c, window=c.f.integer("attention_chunk_size")),
    Mixer.MLA: lambda c: _mla(c, indexer=False),
    Mixer.MLA_INDEXER: lambda c: _mla(c, indexer=True),
    Mixer.MAMBA1: _mamba1,
    Mixer.MAMBA2: _mamba2,
    Mixer.GDN: _gdn,
    Mixer.KDA: _kda,
    Mixer.SHORT_CONV: lambda c: short_conv_layer(
        c.f.integer("hidden_size"), _kernel(c.f, "conv_L_cache") - 1, dtype=c.dtype
    ),
}
