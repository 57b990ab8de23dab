"""The cache object a model takes, and the HF tensors of one spec layer in it.

Most models keep their cache in transformers' ``DynamicCache`` (one cache layer an HF layer).
Five families keep theirs elsewhere, and :func:`new_cache`, :func:`tensors` and
:func:`put` hide where:

==================  =====================================================================
family              where its recurrent state lives
==================  =====================================================================
MiniMax             ``MiniMaxCache.linear_cache[i]``: the lightning layer's ``[heads,
                    head_dim, head_dim]`` state (attention layers: the ``DynamicCache`` part)
xLSTM               ``xLSTMCache.rnn_state[i]``: ``(C, n, m)`` a block, and ``seqlen_offset``
RWKV                a list of five ``[batch, hidden, layers]`` tensors the model updates in
                    place (the previous token of each mix; the WKV numerator, denominator, max)
RecurrentGemma      in the model's modules (each recurrent block's ``conv1d_state`` and its
                    RG-LRU's ``recurrent_states``): its cache holds them while no forward
                    runs, and :func:`attached` lends them to the modules for each forward, so that
                    two caches of one model (the reference's and the transferred one) never
                    share a state
XLNet               a :class:`Mems`: each layer's input hidden states ``[tokens, 1,
                    d_model]``, which its forward returns as a new tuple rather than
                    writing into what it is given (the demo's forward refills the list)
==================  =====================================================================

torch and transformers are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvbridge.errors import SpecError
from kvbridge.model.spec import LayerKind

# The kinds whose HF tensors are named as their components (and shaped [1, *component shape]).
OWN_STATE = (LayerKind.LIGHTNING, LayerKind.MLSTM, LayerKind.RG_LRU, LayerKind.RWKV)
# RWKV-4's state: five [batch, hidden, layers] tensors, in this order (transformers' RwkvModel)
_RWKV = ("ffn_x", "att_x", "num", "den", "max")


class Mems(list[Any]):
    """XLNet's memory, a tensor a layer: what its forward returns as ``mems``, given back at
    the next step (:func:`kvbridge.demo.forward.prefill_steps` refills it in place, so that it
    is one cache object from the first chunk to the last decode step, as every other model's)."""


def new_cache(config: Any, device: str = "cpu") -> Any:
    """An empty cache of the kind the model of ``config`` takes."""
    import torch
    from transformers.cache_utils import DynamicCache

    if config.model_type == "xlnet":
        return Mems()
    if config.model_type == "minimax":
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        return MiniMaxCache()
    if config.model_type == "xlstm":
        from transformers.models.xlstm.modeling_xlstm import xLSTMCache

        return xLSTMCache(config, 1, dtype=torch.float32, device=device)
    if config.model_type == "rwkv":  # as RwkvModel makes its own: the running max at -1e30
        shape = (1, config.hidden_size, config.num_hidden_layers)
        state = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in _RWKV]
        state[4] -= 1e30
        return state
    cache = DynamicCache(config=config)
    if config.model_type == "recurrent_gemma":
        # The attention layers' cache, and each recurrent block's (conv1d_state,
        # recurrent_states) by HF layer while no forward borrows them (:func:`attached`).
        cache.kvbridge_blocks = {}
    return cache


def decoder_layers(model: Any, cache_layers: int | None = None) -> Any:
    """The model's decoder layers, in order: its base model's ``layers`` (xLSTM's
    ``blocks``), else the list of its modules whose layers hold the modules that use the
    cache (those given a ``layer_idx``: GPT-2's ``h``, BART's ``decoder.layers``, Git's
    ``encoder.layer`` beside its vision encoder's layers), else the first list of as many
    modules as the cache has layers (``cache_layers``: GPT-Neo's ``h``, whose attention
    names its index otherwise)."""
    import torch

    base = model.base_model
    for name in ("layers", "blocks"):
        if isinstance(getattr(base, name, None), torch.nn.ModuleList):
            return getattr(base, name)
    lists = [m for m in base.modules() if isinstance(m, torch.nn.ModuleList)]
    best, most = None, 0
    for module in lists:  # (an outer list before the lists inside its layers)
        indexed = sum(bool(_indices(layer)) for layer in module)
        if indexed > most:
            best, most = module, indexed
    if best is None:
        best = next((m for m in lists if len(m) == cache_layers), None)
    if best is None:
        raise SpecError(f"{model.config.model_type}: no list of decoder layers found in the model")
    return best


def _indices(layer: Any) -> list[int]:
    """The cache layer indices of the modules inside ``layer`` (not its own)."""
    return [
        m.layer_idx
        for m in layer.modules()
        if m is not layer and type(getattr(m, "layer_idx", None)) is int
    ]


def _owners(model: Any, layers: Any, hf_indices: Sequence[int]) -> list[int]:
    """The decoder layer (of ``layers``) after whose forward each HF cache layer of
    ``hf_indices`` is written: the same index, where the cache has a layer a decoder layer;
    else the layer holding the module of that cache index (LongCat-Flash's two attentions a
    layer cache layers 2i and 2i+1). SpecError for a cache layer no decoder layer holds."""
    if max(hf_indices, default=-1) < len(layers):
        return list(hf_indices)
    owners: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for index in _indices(layer):
            owners.setdefault(index, i)
    missing = sorted(set(hf_indices) - set(owners))
    if missing:
        raise SpecError(
            f"{model.config.model_type}: its cache has layers {missing[:4]} that none of its "
            f"{len(layers)} decoder layers holds a module of (a layer run in several cycles, "
            f"writing several cache layers?): the demo's prefill ranks send each cache layer "
            f"when the decoder layer that writes it returns"
        )
    return [owners[i] for i in hf_indices]


class LayerHooks:
    """Forward hooks on a model's decoder layers, as a serving engine's layer-wise sends see
    its forward: once decoder layer ``d`` returns (its state first copied into the cache,
    :func:`layer_done`), ``after(d, layers)`` with the cache layers of ``wanted`` (indices
    into ``hf_indices``) that it wrote, where it wrote any. ``cache``: the forward's cache,
    set by the caller before each forward.

    Where no decoder layer can be named for each cache layer (HRM runs its stacks in cycles,
    each decoder layer writing several cache layers), there are no hooks: ``layerwise`` is
    False, ``why`` says so, and the caller reads the layers once the forward is done."""

    def __init__(
        self,
        model: Any,
        hf_indices: Sequence[int],
        wanted: Sequence[int],
        after: Callable[[int, list[int]], None],
    ) -> None:
        self.by_decoder: dict[int, list[int]] = {}  # decoder layer -> layers of ``wanted``
        self.cache: Any = None
        self._after = after
        self._hooks: list[Any] = []
        if model.config.model_type == "xlnet":
            self.layerwise = False
            self.why = "XLNet's forward returns its memory as it ends, not a layer at a time"
            return
        try:
            layers = decoder_layers(model, max(hf_indices) + 1)
            owners = _owners(model, layers, hf_indices)
        except SpecError as e:
            self.layerwise, self.why = False, str(e)
            return
        self.layerwise, self.why = True, ""
        for li in wanted:
            self.by_decoder.setdefault(owners[li], []).append(li)
        self._hooks = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def _hook(self, decoder_layer: int) -> Callable[[Any, Any, Any], None]:
        def after(_module: Any, _args: Any, output: Any) -> None:
            layer_done(self.cache, decoder_layer, output)
            layers = self.by_decoder.get(decoder_layer)
            if layers:
                self._after(decoder_layer, layers)

        return after

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def recurrent_blocks(model: Any) -> dict[int, Any]:
    """RecurrentGemma's recurrent blocks, by HF layer (none for another model)."""
    return {
        i: block
        for i, layer in enumerate(decoder_layers(model))
        if hasattr(block := getattr(layer, "temporal_block", None), "rg_lru")
    }


@contextmanager
def attached(model: Any, cache: Any) -> Iterator[None]:
    """For the length of one forward, the model's modules hold ``cache``'s recurrent states
    (RecurrentGemma); a no-op for every other model."""
    blocks = getattr(cache, "kvbridge_blocks", None)
    if blocks is None:
        yield
        return
    modules = recurrent_blocks(model)
    for i, block in modules.items():
        block.conv1d_state, block.rg_lru.recurrent_states = blocks.get(i, (None, None))
    cache.kvbridge_lent = modules  # read there meanwhile (a layer-wise send reads mid-forward)
    try:
        yield
    finally:
        for i, block in modules.items():
            blocks[i] = (block.conv1d_state, block.rg_lru.recurrent_states)
            block.conv1d_state = block.rg_lru.recurrent_states = None
        cache.kvbridge_lent = {}


def layer_done(cache: Any, hf_index: int, output: Any) -> None:
    """Called with what decoder layer ``hf_index`` returned, before the model goes on: xLSTM
    copies a block's new state into its cache only after the block returns, so a layer-wise
    send would read the state before it; it is copied here first (the model then copies the
    same values)."""
    if hasattr(cache, "rnn_state") and isinstance(output, tuple) and output[-1] is not None:
        for held, new in zip(cache.rnn_state[hf_index], output[-1], strict=True):
            held.copy_(new)


def tensors(kind: LayerKind, cache: Any, hf_index: int) -> dict[str, Any]:
    """The HF tensors of an :data:`OWN_STATE` layer, by component name (None where the
    model left it empty; xLSTM's cache starts at zeros, so what its model did not write reads
    as zeros: the bitwise check against the reference catches that, not ``check_filled``)."""
    if kind is LayerKind.LIGHTNING:
        held = cache.linear_cache[hf_index] if hf_index < len(cache.linear_cache) else None
        return {"kv": held if held is not None and len(held) else None}
    if kind is LayerKind.MLSTM:
        c, n, m = cache.rnn_state[hf_index]
        return {"c": c, "n": n, "m": m}
    if kind is LayerKind.RWKV:
        return {name: held[:, :, hf_index] for name, held in zip(_RWKV, cache, strict=True)}
    lent = getattr(cache, "kvbridge_lent", {}).get(hf_index)
    if lent is not None:
        conv, recurrent = lent.conv1d_state, lent.rg_lru.recurrent_states
    else:
        conv, recurrent = cache.kvbridge_blocks.get(hf_index, (None, None))
    return {"conv": conv, "recurrent": recurrent}


def put(kind: LayerKind, cache: Any, hf_index: int, given: dict[str, Any], tokens: int) -> None:
    """Set an :data:`OWN_STATE` layer's tensors (shaped as :func:`tensors` gives them) in a
    cache that held ``tokens`` tokens."""
    import torch

    if kind is LayerKind.LIGHTNING:
        cache.set_linear_cache(hf_index, given["kv"])
    elif kind is LayerKind.RWKV:
        for name, held in zip(_RWKV, cache, strict=True):
            held[:, :, hf_index] = given[name]
    elif kind is LayerKind.MLSTM:
        for held, name in zip(cache.rnn_state[hf_index], ("c", "n", "m"), strict=True):
            held.copy_(given[name])
        cache.seqlen_offset = torch.tensor([tokens], device=given["c"].device)
    else:
        cache.kvbridge_blocks[hf_index] = (given["conv"], given["recurrent"])
