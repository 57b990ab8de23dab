"""Builders of the recurrent layers that are none of the Mamba family's (Mamba1/2, GDN, KDA,
short conv, in :mod:`kvbridge.model.spec`): linear attention's accumulated ``K^T V`` (MiniMax's
lightning attention), xLSTM's matrix memory, RWKV-4's time and channel mix, RecurrentGemma's
RG-LRU (a conv and a recurrence over block-diagonal gates), the short convolutions around an
attention layer (Inkling's), ZAYA's compressed convolutional attention (CCA), and the keys and
values of positions a model caches before every request's tokens (CPM-Ant's), and the hidden
states a layer was given (XLNet's memory), and DeepSeek V4's compressed KV entries. Each is
sharded as a tensor-parallel engine splits these layers: by head (a head's state is computed
from that head's projections only), RWKV's recurrence by channel, what every rank holds whole
(the residual stream) replicated."""

from __future__ import annotations

from kvbridge.errors import SpecError
from kvbridge.model.spec import Component, DType, LayerKind, LayerSpec, Scope, Segment, conv_steps


def lightning_layer(heads: int, head_dim: int, dtype: DType) -> LayerSpec:
    """Linear attention without a conv: one ``[head_dim, head_dim]`` state a head, the decayed
    sum of ``k^T v`` over the tokens so far (MiniMax-Text-01's lightning attention layers)."""
    kv = Component("kv", Scope.STATE, (Segment("heads", heads, head_dim * head_dim),), dtype)
    return LayerSpec(LayerKind.LIGHTNING, (kv,))


def prefix_layer(positions: int, kv_heads: int, head_dim: int, dtype: DType) -> LayerSpec:
    """The keys and values of ``positions`` positions a model caches before every request's
    tokens (CPM-Ant's ``prompt_length`` learned prompt positions: the same ids every request,
    but keys and values of the request, as its attention is bidirectional over the first
    forward's input): a fixed size a request, sharded by KV head as the attention's own K/V is.
    The attention layer of the request's tokens is a FULL layer beside it."""
    heads = (Segment("heads", kv_heads, head_dim),)
    k, v = (Component(n, Scope.STATE, heads, dtype, rows=positions) for n in ("k", "v"))
    return LayerSpec(LayerKind.PREFIX, (k, v))


def hidden_layer(hidden: int, dtype: DType, *, window: int | None = None) -> LayerSpec:
    """XLNet's memory (``mems``): the hidden state each token gave a layer as its input, which
    the layer's next tokens attend to (their keys and values are projected from it at every
    step, so the cache is the residual stream, not K/V). Every rank holds the residual stream
    whole, so it is replicated. With ``window`` (XLNet's ``mem_len``) only the last ``window``
    tokens' are kept: a SLIDING layer of that one component."""
    mems = Component("mems", Scope.TOKEN, (Segment("hidden", 1, hidden),), dtype)
    if window is not None:
        return LayerSpec(LayerKind.SLIDING, (mems,), window=window)
    return LayerSpec(LayerKind.HIDDEN, (mems,))


def compressed_layer(
    rate: int, head_dim: int, dtype: DType, *, indexer_dim: int | None = None
) -> LayerSpec:
    """DeepSeek V4's compressed attention (beside the layer's sliding window, a SLIDING layer
    of its own). Its compressor emits one KV entry of ``head_dim`` for each window of ``rate``
    tokens (``kv``: one entry every ``rate`` tokens, :class:`~kvbridge.model.spec.Component`'s
    ``stride``) and keeps the projections and gates of the tokens of the window not yet closed
    (``kv_buffer``, ``kv_buffer_gate``: ``tokens % rate`` of at most ``rate - 1`` rows). With
    ``indexer_dim`` it is compressed sparse attention (CSA): its windows overlap, so each
    projection is two series (twice as wide) and the last closed window's first series is kept
    (``kv_overlap``, ``kv_overlap_gate``: ``rate`` rows, once a window has closed), and its
    lightning indexer compresses its keys the same way (``index_k`` and its buffers and
    overlap, ``indexer_dim`` wide). The keys and values are one shared head, so every rank
    holds all of it: replicated."""
    if rate < 2:
        raise SpecError(f"compressed attention: one entry every {rate} tokens compresses nothing")
    csa = indexer_dim is not None

    def stream(entry: str, dim: int) -> list[Component]:
        one, wide = (Segment(entry, 1, dim),), (Segment(entry, 1, dim * (2 if csa else 1)),)
        out = [Component(entry, Scope.TOKEN, one, dtype, stride=rate)]
        out += [
            Component(f"{entry}_{n}", Scope.STATE, wide, dtype, rows=rate - 1)
            for n in ("buffer", "buffer_gate")
        ]
        if csa:
            out += [
                Component(f"{entry}_{n}", Scope.STATE, one, dtype, rows=rate)
                for n in ("overlap", "overlap_gate")
            ]
        return out

    comps = stream("kv", head_dim)
    if indexer_dim is not None:  # (CSA)
        comps += stream("index_k", indexer_dim)
    return LayerSpec(LayerKind.COMPRESSED, tuple(comps))


def mlstm_layer(heads: int, qk_dim: int, v_dim: int, dtype: DType) -> LayerSpec:
    """xLSTM's mLSTM cell, a head: the matrix memory ``C`` (``[qk_dim, v_dim]``), the
    normaliser ``n`` (``[qk_dim]``) and the log-space stabiliser ``m`` (one number)."""
    return LayerSpec(
        LayerKind.MLSTM,
        (
            Component("c", Scope.STATE, (Segment("heads", heads, qk_dim * v_dim),), dtype),
            Component("n", Scope.STATE, (Segment("heads", heads, qk_dim),), dtype),
            Component("m", Scope.STATE, (Segment("heads", heads, 1),), dtype),
        ),
    )


def rwkv_layer(hidden: int, *, shift_dtype: DType, state_dtype: DType) -> LayerSpec:
    """RWKV-4: the previous token's hidden state, as its time mix and its channel mix each
    keep it (``att_x``, ``ffn_x``: the input every rank's projections read, so replicated on
    every rank), and the WKV recurrence's numerator, denominator and running max, one number a
    channel each (split by channel)."""
    shift = (Segment("hidden", 1, hidden),)
    channels = (Segment("channels", hidden, 1),)
    return LayerSpec(
        LayerKind.RWKV,
        (
            Component("ffn_x", Scope.STATE, shift, shift_dtype),
            Component("att_x", Scope.STATE, shift, shift_dtype),
            *(Component(n, Scope.STATE, channels, state_dtype) for n in ("num", "den", "max")),
        ),
    )


def rglru_layer(
    width: int, heads: int, d_conv: int, *, conv_dtype: DType, state_dtype: DType
) -> LayerSpec:
    """RecurrentGemma's recurrent block: a conv over the ``width`` channels (its last
    ``d_conv - 1`` inputs) and the RG-LRU's state (one number a channel). Its gates are
    block-diagonal over ``heads`` blocks, so both are sharded by those blocks."""
    if heads < 1 or width % heads:
        raise SpecError(f"rg_lru: {width} channels do not split into {heads} equal blocks")
    block = width // heads
    conv = Component(
        "conv", Scope.STATE, (Segment("heads", heads, block),), conv_dtype, rows=conv_steps(d_conv)
    )
    state = Component("recurrent", Scope.STATE, (Segment("heads", heads, block),), state_dtype)
    return LayerSpec(LayerKind.RG_LRU, (conv, state))


def attention_convs_layer(
    kv_heads: int, head_dim: int, hidden: int, d_conv_kv: int, d_conv: int, *, dtype: DType
) -> LayerSpec:
    """Short causal convolutions around one attention layer (Inkling's), each keeping its last
    ``d_conv - 1`` inputs: over the key and the value projections (``k``, ``v``: ``kv_heads``
    heads of ``head_dim`` channels, sharded as the KV heads are, a rank convolving the channels
    of the heads it projects) and over the residual stream after the attention and after the
    MLP (``attn``, ``mlp``: ``hidden`` channels, which every rank holds whole once the layer's
    outputs are reduced, so replicated). A SHORT_CONV layer: the same depthwise short conv as
    LFM2's, four of them."""
    heads = (Segment("heads", kv_heads, head_dim),)
    stream = (Segment("hidden", 1, hidden),)
    kv_rows, rows = conv_steps(d_conv_kv), conv_steps(d_conv)
    return LayerSpec(
        LayerKind.SHORT_CONV,
        (
            Component("k", Scope.STATE, heads, dtype, rows=kv_rows),
            Component("v", Scope.STATE, heads, dtype, rows=kv_rows),
            Component("attn", Scope.STATE, stream, dtype, rows=rows),
            Component("mlp", Scope.STATE, stream, dtype, rows=rows),
        ),
    )


def cca_layer(heads: int, kv_heads: int, head_dim: int, d_conv: int, *, dtype: DType) -> LayerSpec:
    """ZAYA's compressed convolutional attention (CCA) beside its attention layer: the causal
    convolutions over the query and key projections (``conv``: ``heads`` query heads then
    ``kv_heads`` key heads of ``head_dim`` channels, the last ``d_conv - 1`` inputs; depthwise,
    then grouped one head a group, so sharded by head, a rank convolving the heads it projects),
    and the previous token's delayed value projection (``v_delayed``: ``kv_heads x head_dim /
    2`` channels, which become the second half of the value channels taken together, not a part
    of each KV head, so no split by KV head gives a rank its own: every rank keeps it whole,
    replicated). A SHORT_CONV layer: ``v_delayed`` is a short conv's single step."""
    if kv_heads * head_dim % 2:
        raise SpecError(f"cca: {kv_heads} x {head_dim} value channels do not split in halves")
    conv = Component(
        "conv",
        Scope.STATE,
        (Segment("q", heads, head_dim), Segment("k", kv_heads, head_dim)),
        dtype,
        rows=conv_steps(d_conv),
    )
    delayed = (Segment("hidden", 1, kv_heads * head_dim // 2),)
    return LayerSpec(
        LayerKind.SHORT_CONV, (conv, Component("v_delayed", Scope.STATE, delayed, dtype))
    )
