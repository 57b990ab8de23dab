"""The HF cache and kvbridge's bytes, both ways.

* Prefill: :func:`hf_to_logical` turns the model's cache object into the request's logical
  tensors (per token ``[tokens, rows, axis_bytes]``, per request ``[rows, axis_bytes]``); each
  rank then writes its shard with :func:`kvbridge.planner.reference.fill`, which cuts it with
  :func:`kvbridge.planner.reference.local_bytes`, the one sharding rule.
* Decode: :func:`read_received` reads every decode rank's pools back through their memory
  layouts and puts each rank's local axis where :func:`~kvbridge.planner.reference.local_bytes` says
  it came from (checking that replicas held by several ranks agree); :func:`logical_to_hf`
  rebuilds the model's cache object from that.
* :func:`snapshot` and :func:`compare` are the bitwise check; :func:`pack_aux` is the aux slot:
  the first sampled token and the request's length (the sliding layers' cumulative length).

torch and transformers are imported inside the functions that build or read cache objects.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.demo import compressed, hfcache
from kvbridge.demo.cachemap import CacheMap, HFLayer
from kvbridge.demo.hfcache import OWN_STATE
from kvbridge.errors import SpecError
from kvbridge.model.spec import Component, DType, LayerKind, LayerSpec, Scope
from kvbridge.planner.layout import BufferLayout
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Side
from kvbridge.planner.reference import LogicalCache, Pools, local_bytes, needed_tokens
from kvbridge.planner.shard import local_axis_elems

_AUX = struct.Struct("<4sHxxqq")  # magic, version, first sampled token, request tokens
_MAGIC = b"KVBD"


def pack_aux(first_token: int, tokens: int, aux_bytes: int) -> np.ndarray:
    out = np.zeros(aux_bytes, dtype=np.uint8)
    out[: _AUX.size] = np.frombuffer(_AUX.pack(_MAGIC, 1, first_token, tokens), dtype=np.uint8)
    return out


def unpack_aux(raw: np.ndarray) -> tuple[int, int]:
    """``(first_token, tokens)``; ValueError if the slot does not hold what prefill wrote."""
    magic, version, first, tokens = _AUX.unpack(raw[: _AUX.size].tobytes())
    if magic != _MAGIC or version != 1:
        raise ValueError(f"the aux slot holds no demo record (starts with {magic!r})")
    return int(first), int(tokens)


# ---- HF cache -> logical tensors (prefill) ----------------------------------------------------


def _hf_tensor(where: HFLayer, cache: Any, name: str) -> Any:
    """The HF tensor behind a component, without batch; per-token ones have tokens first."""
    import torch

    kind = where.kind
    if name == "mems":  # XLNet: [tokens, batch, d_model]
        return cache[where.hf_index][:, 0]
    if kind is LayerKind.COMPRESSED:  # DeepSeek V4's
        return compressed.tensor(cache.layers[where.hf_index], name, *where.shapes[name])
    if kind in OWN_STATE:
        held = hfcache.tensors(kind, cache, where.hf_index)[name][0]
        rg_lru_conv = kind is LayerKind.RG_LRU and name == "conv"
        return held.T if rg_lru_conv else held  # HF: [channels, steps]
    layer = cache.layers[where.hf_index]
    if name == "latent":  # MLA, MLA_INDEXER, a sliding MLA layer (dots3)
        return torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)  # [S, rank + rope]
    if kind in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.PREFIX):
        held = (layer.keys if name == "k" else layer.values)[0].transpose(0, 1)  # [S, H, D]
        return held[: where.lead] if kind is LayerKind.PREFIX else held[where.lead :]
    if name == "index_k":
        return layer.indexer_keys[0]  # [S, index_head_dim]
    convs = _convs(where)
    if name in convs:  # HF keeps [dim, kernel]; the spec's rows are the kernel's steps
        return layer.conv_states[convs[name]][0].T
    return layer.recurrent_states[0][0]


def _convs(where: HFLayer) -> dict[str, int]:
    """A recurrent layer's conv components, and the HF conv state (``state_idx``) of each."""
    return {name: i for i, name in enumerate(where.convs or ("conv",))}


def _conv_key(i: int) -> str:
    return "conv_states" if i == 0 else f"conv_states[{i}]"


def _raw(t: Any) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().contiguous().numpy()).view(np.uint8)


def hf_to_logical(
    cmap: CacheMap,
    cache: Any,
    tokens: int,
    done: int,
    aux: np.ndarray,
    layers: Sequence[int] | None = None,
) -> LogicalCache:
    """The request's logical cache after its first ``done`` tokens went through the model
    (of ``layers`` only, if given).

    Tokens the HF cache no longer holds (a sliding layer keeps only its window) are zeros:
    the decode side never needs them.
    """
    token, state = {}, {}
    for li, (layer, where) in enumerate(zip(cmap.spec.layers, cmap.layers, strict=True)):
        if layers is not None and li not in layers:
            continue
        for comp in layer.components:
            raw = _raw(_hf_tensor(where, cache, comp.name))
            width = comp.axis_elems * comp.dtype.itemsize
            if comp.scope is Scope.TOKEN:  # (entries, for one every `stride` tokens)
                held, total, upto = raw.shape[0], tokens // comp.stride, done // comp.stride
                arr = np.zeros((total, comp.rows, width), dtype=np.uint8)
                arr[upto - held : upto] = raw.reshape(held, comp.rows, width)
                token[(li, comp.name)] = arr
            else:
                state[(li, comp.name)] = raw.reshape(comp.rows, width)
    return LogicalCache(tokens, token, state, aux)


_RECURRENT = (
    LayerKind.MAMBA2,
    LayerKind.GDN,
    LayerKind.KDA,
    LayerKind.MAMBA1,
    LayerKind.SHORT_CONV,
)


def _hf_tensors(where: HFLayer, cache: Any) -> dict[str, Any]:
    kind = where.kind
    if "mems" in where.shapes:
        return {"mems": cache[where.hf_index]}
    if kind is LayerKind.COMPRESSED:
        return compressed.hf_tensors(cache.layers[where.hf_index])
    if kind in OWN_STATE:
        return hfcache.tensors(kind, cache, where.hf_index)
    layer = cache.layers[where.hf_index]
    if kind is LayerKind.SHORT_CONV:
        out = {_conv_key(i): layer.conv_states[i] for i in _convs(where).values()}
        if _recurrent(where) is not None:  # ZAYA's delayed value
            out["recurrent_states"] = layer.recurrent_states[0]
        return out
    if kind in _RECURRENT:
        return {"conv_states": layer.conv_states[0], "recurrent_states": layer.recurrent_states[0]}
    if kind is LayerKind.MLA_INDEXER:
        return {"keys": layer.keys, "values": layer.values, "indexer_keys": layer.indexer_keys}
    if kind is LayerKind.PREFIX:  # the positions before the request's tokens (CPM-Ant's prompt)
        lead = slice(None, where.lead)
        return {"prefix keys": layer.keys[:, :, lead], "prefix values": layer.values[:, :, lead]}
    if where.lead:  # the request's tokens after a PREFIX layer's
        return {"keys": layer.keys[:, :, where.lead :], "values": layer.values[:, :, where.lead :]}
    return {"keys": layer.keys, "values": layer.values}


def _hf_shapes(
    layer: LayerSpec, where: HFLayer, held: int, tokens: int
) -> dict[str, tuple[int, ...]]:
    """The shapes (with batch 1) of the HF tensors of one spec layer, from the spec's side,
    after ``tokens`` tokens of which it holds ``held``."""
    s = where.shapes
    if where.kind is LayerKind.COMPRESSED:
        return compressed.hf_shapes(s, layer.components[0].stride, tokens)
    if "mems" in s:
        return {"mems": (held, 1, *s["mems"])}
    if where.kind is LayerKind.SHORT_CONV:  # (Inkling's convs have a "k" too)
        out = {_conv_key(i): (1, *s[name]) for name, i in _convs(where).items()}
        if (state := _recurrent(where)) is not None:
            out["recurrent_states"] = (1, *s[state])
        return out
    if where.kind is LayerKind.PREFIX:
        k, v = s["k"], s["v"]
        return {
            "prefix keys": (1, k[0], where.lead, k[1]),
            "prefix values": (1, v[0], where.lead, v[1]),
        }
    if where.kind is LayerKind.SLIDING and "kv" in s:  # DeepSeek V4's: keys are values
        s = {"k": s["kv"], "v": s["kv"]}
    if "k" in s:  # FULL, SLIDING
        return {"keys": (1, s["k"][0], held, s["k"][1]), "values": (1, s["v"][0], held, s["v"][1])}
    if "keys" in s:  # MLA, MLA_INDEXER, a sliding MLA layer
        out = {"keys": (1, 1, held, *s["keys"]), "values": (1, 1, held, *s["values"])}
        if "indexer_keys" in s:
            out["indexer_keys"] = (1, held, *s["indexer_keys"])
        return out
    if where.kind in OWN_STATE:
        return {name: (1, *shape) for name, shape in s.items()}
    return {"conv_states": (1, *s["conv"]), "recurrent_states": (1, *s[_state_name(where)])}


def _state_name(where: HFLayer) -> str:
    return "recurrent" if where.kind in (LayerKind.GDN, LayerKind.KDA) else "ssm"


def _recurrent(where: HFLayer) -> str | None:
    """The component a recurrent layer keeps in ``recurrent_states[0]``: a SHORT_CONV layer's
    one beside its convs (ZAYA's delayed value), if it has one."""
    if where.kind is not LayerKind.SHORT_CONV:
        return _state_name(where)
    rest = [name for name in where.shapes if name not in _convs(where)]
    return rest[0] if rest else None


def check_filled(cmap: CacheMap, cache: Any) -> None:
    """SpecError unless the model wrote the cache it was given: some models keep their KV
    elsewhere (their own past structure), and leave every layer of a DynamicCache empty."""
    for where in cmap.layers:
        try:
            empty = any(t is None for t in _hf_tensors(where, cache).values())
        except (AttributeError, IndexError, TypeError):
            empty = True
        if empty:
            raise SpecError(
                f"{cmap.spec.model}: HF cache layer {where.hf_index} is empty after a prefill: "
                f"the model keeps its KV elsewhere than the cache it is given"
            )


def check_cache(cmap: CacheMap, cache: Any, tokens: int) -> None:
    """Raise SpecError unless every HF tensor has the shape and dtype the spec says."""
    import torch

    for li, (layer, where) in enumerate(zip(cmap.spec.layers, cmap.layers, strict=True)):
        held = tokens if layer.window is None else min(tokens, layer.window)
        what = f"{cmap.spec.model} layer {li} ({where.kind.value}, HF layer {where.hf_index})"
        for comp in layer.components:
            if comp.dtype is not DType.FLOAT32:
                raise SpecError(
                    f"{what}: the demo runs float32 models, the spec has "
                    f"{comp.name} in {comp.dtype.value}"
                )
            n = int(
                np.prod(
                    _hf_tensor(where, cache, comp.name).shape[
                        1 if comp.scope is Scope.TOKEN else 0 :
                    ]
                )
            )
            if n != comp.rows * comp.axis_elems:
                raise SpecError(
                    f"{what} {comp.name}: HF holds {n} elements a "
                    f"{'token' if comp.scope is Scope.TOKEN else 'request'}, the "
                    f"spec {comp.rows * comp.axis_elems}"
                )
        want = _hf_shapes(layer, where, held, tokens)
        for name, t in _hf_tensors(where, cache).items():
            if tuple(t.shape) != want[name] or t.dtype != torch.float32:
                raise SpecError(
                    f"{what}: the installed transformers holds {name} "
                    f"{tuple(t.shape)} {t.dtype}; the spec says {want[name]} "
                    f"torch.float32"
                )


# ---- decode pools -> logical tensors ------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Received:
    """What the decode ranks' pools hold, reassembled: per token only the needed tokens."""

    tokens: int
    first_token: int
    token: dict[tuple[int, str], np.ndarray]  # [needed tokens, rows, axis_bytes]
    state: dict[tuple[int, str], np.ndarray]  # [rows, axis_bytes]
    problems: tuple[str, ...]  # replicas that disagree


def _item_offsets(buf: BufferLayout, comp: Component, local_elems: int) -> np.ndarray:
    """Byte offsets, from one token's (or slot's) base, of its local ``[rows, bytes]``."""
    isz, es = comp.dtype.itemsize, buf.stride("elem")
    e = np.arange(local_elems, dtype=np.int64)
    unit = buf.dim("unit")
    if unit is None:
        elem = e * es
    else:
        us = buf.size("elem")
        elem = (e // us) * unit.stride + (e % us) * es
    byte = (elem[:, None] + np.arange(isz, dtype=np.int64)[None, :]).ravel()
    return np.arange(comp.rows, dtype=np.int64)[:, None] * buf.stride("row") + byte[None, :]


def read_local(
    buf: BufferLayout,
    comp: Component,
    tp: int,
    region: np.ndarray,
    placement: Placement,
    tokens: Sequence[int],
) -> np.ndarray:
    """One rank's local tensor as its memory layout holds it: ``[tokens, rows, bytes]`` or
    ``[rows, bytes]`` (the inverse of :func:`kvbridge.planner.reference.fill`'s writes)."""
    offs = _item_offsets(buf, comp, local_axis_elems(comp.segments, tp))
    if comp.scope is Scope.STATE:
        index = buf.offset + placement.slot(buf.group) * buf.stride("slot") + offs
    else:
        t = np.asarray(tokens, dtype=np.int64)
        ps = buf.size("token")
        pages = placement.page_ids(buf.group)[t // ps]
        base = buf.offset + pages * buf.stride("page") + (t % ps) * buf.stride("token")
        index = base[:, None, None] + offs[None]
    out: np.ndarray = region[index]
    return out


def read_received(side: Side, placement: Placement, pools: Pools) -> Received:
    """Reassemble the request from every decode rank's pools (``pools[engine_rank]``): each
    rank's local axis where its TP rank holds it, each token from the shard holding it (the
    placement is the one every shard shares)."""
    spec, par, mem = side.spec, side.parallel, side.memory
    aux = mem.aux
    off = aux.offset + placement.slot(aux.group) * aux.stride("slot")
    first, tokens = unpack_aux(pools[0][aux.region][off : off + spec.aux_bytes])
    if tokens != placement.tokens:
        raise ValueError(f"the aux slot says {tokens} tokens, the request has {placement.tokens}")
    token: dict[tuple[int, str], np.ndarray] = {}
    state: dict[tuple[int, str], np.ndarray] = {}
    problems: list[str] = []
    for li, layer in enumerate(spec.layers):
        stage = par.stage_of_layer(li)
        needed = needed_tokens(spec, li, tokens)
        for comp in layer.components:
            # (entries, for one every `stride` tokens: never context parallel)
            (lo, hi), (_, count) = comp.entries(needed.start, tokens), comp.entries(0, tokens)
            need = np.arange(lo, hi, dtype=np.int64)
            owner = par.tokens.owner(need, count)
            buf = mem.buffers[(li, comp.name)]
            width = comp.axis_elems * comp.dtype.itemsize
            per_token = comp.scope is Scope.TOKEN
            lead = (len(need),) if per_token else ()
            out = np.zeros((*lead, comp.rows, width), dtype=np.uint8)
            seen = np.zeros((*lead, width), dtype=bool)  # bytes some rank gave already
            for cp_rank in range(par.cp):
                for tp_rank in range(par.tp):
                    region = pools[par.engine_rank(stage, tp_rank, cp_rank)][buf.region]
                    idx = local_bytes(comp, par.tp, tp_rank, np.arange(width))
                    if per_token:  # the tokens of its shard, at their local indices
                        sel = np.flatnonzero(owner == par.shard(cp_rank, tp_rank))
                        local = read_local(
                            buf,
                            comp,
                            par.tp,
                            region,
                            placement,
                            par.tokens.local(need[sel], count).tolist(),
                        )
                        at: tuple[Any, ...] = np.ix_(sel, np.arange(comp.rows), idx)
                        given: tuple[Any, ...] = np.ix_(sel, idx)
                        again = seen[given][:, None, :]
                    else:
                        local = read_local(buf, comp, par.tp, region, placement, [])
                        at, given = (slice(None), idx), (idx,)
                        again = seen[given][None, :]
                    if np.any((out[at] != local) & again):  # a replica: it must agree
                        problems.append(
                            f"layer {li} {comp.name}: rank {tp_rank} of CP group "
                            f"{cp_rank} holds a replica that differs from another's"
                        )
                    out[at] = local
                    seen[given] = True
            (token if per_token else state)[(li, comp.name)] = out
    return Received(tokens, first, token, state, tuple(problems))


def received(cmap: CacheMap, cache: Any, done: int) -> Received:
    """The HF cache of the first ``done`` tokens in the form :func:`logical_to_hf` takes: what
    a context-parallel prefill rank hands the rank computing the next tokens."""
    logical = hf_to_logical(cmap, cache, done, done, np.zeros(cmap.spec.aux_bytes, np.uint8))
    token = {
        (li, c): arr[needed_tokens(cmap.spec, li, done).start :]
        for (li, c), arr in logical.token.items()
    }
    return Received(done, 0, token, logical.state, ())


# ---- logical tensors -> HF cache (decode) ---------------------------------------------------


def logical_to_hf(cmap: CacheMap, config: Any, got: Received, device: str = "cpu") -> Any:
    """The model's cache object, as the undisturbed prefill left it, on ``device``."""
    import torch

    def _tensor(raw: np.ndarray, shape: tuple[int, ...]) -> Any:
        host = torch.from_numpy(np.ascontiguousarray(raw).view(np.float32).reshape(shape).copy())
        return host.to(device)

    cache = hfcache.new_cache(config, device)
    for li, (layer, where) in enumerate(zip(cmap.spec.layers, cmap.layers, strict=True)):
        if isinstance(cache, hfcache.Mems):  # XLNet's every layer, in order
            raw = got.token[(li, "mems")]
            cache.append(_tensor(raw, (raw.shape[0], 1, *where.shapes["mems"])))
        elif where.kind in OWN_STATE:
            given = {}
            for comp in layer.components:
                shape, raw = where.shapes[comp.name], got.state[(li, comp.name)]
                rg_lru_conv = where.kind is LayerKind.RG_LRU and comp.name == "conv"
                given[comp.name] = (
                    _tensor(raw, shape[::-1]).T[None].contiguous()  # HF: [channels, steps]
                    if rg_lru_conv
                    else _tensor(raw, (1, *shape))
                )
            hfcache.put(where.kind, cache, where.hf_index, given, got.tokens)
        elif where.kind is LayerKind.PREFIX:  # first: the FULL layer's tokens follow
            kv = []
            for comp in layer.components:
                heads, dim = where.shapes[comp.name]
                rows = _tensor(got.state[(li, comp.name)], (comp.rows, heads, dim))
                kv.append(rows.transpose(0, 1)[None].contiguous())
            cache.update(kv[0], kv[1], where.hf_index)
        elif where.kind is LayerKind.COMPRESSED:  # DeepSeek V4's: after its SLIDING layer
            given = {}
            for comp in layer.components:
                rows, width = where.shapes[comp.name]
                if comp.scope is Scope.TOKEN:
                    raw = got.token[(li, comp.name)]
                    given[comp.name] = _tensor(raw, (1, raw.shape[0], width))
                else:
                    given[comp.name] = _tensor(got.state[(li, comp.name)], (1, rows, width))
            compressed.put(cache.layers[where.hf_index], given, got.tokens)
        elif where.kind not in _RECURRENT:
            kv, index = [], None
            for comp in layer.components:
                raw = got.token[(li, comp.name)]
                n = raw.shape[0]
                if comp.name == "latent":
                    lat = _tensor(raw, (n, comp.axis_elems))
                    rank = where.shapes["keys"][0]
                    kv = [
                        lat[None, None, :, :rank].contiguous(),
                        lat[None, None, :, rank:].contiguous(),
                    ]
                elif comp.name == "index_k":
                    index = _tensor(raw, (1, n, comp.axis_elems))
                else:
                    heads, dim = where.shapes[comp.name]
                    kv.append(_tensor(raw, (n, heads, dim)).transpose(0, 1)[None].contiguous())
            # (MiniMax's cache adds its layers here; DeepSeek V4's keys are its values: one)
            cache.update(kv[0], kv[-1], where.hf_index)
            hf = cache.layers[where.hf_index]
            if index is not None:
                hf.update_indexer(index)
            if where.kind is LayerKind.SLIDING:
                hf.cumulative_length = got.tokens
        else:
            hf = cache.layers[where.hf_index]
            for name, i in _convs(where).items():
                dim, kernel = where.shapes[name]
                conv = _tensor(got.state[(li, name)], (kernel, dim)).T[None].contiguous()
                hf.update_conv_state(conv, i, conv_kernel_size=kernel)
            if (state := _recurrent(where)) is not None:
                hf.update_recurrent_state(
                    _tensor(got.state[(li, state)], (1, *where.shapes[state])), 0
                )
    return cache


# ---- the bitwise check ----------------------------------------------------------------------


def snapshot(cmap: CacheMap, cache: Any) -> dict[str, np.ndarray]:
    """Every tensor (and sliding length) of the HF cache layers the spec covers, copied."""
    out: dict[str, np.ndarray] = {}
    for where in cmap.layers:
        name = f"HF layer {where.hf_index}"
        for key, t in _hf_tensors(where, cache).items():
            out[f"{name} {key}"] = t.detach().cpu().contiguous().numpy().copy()
        if where.kind is LayerKind.SLIDING and not isinstance(cache, hfcache.Mems):
            length = cache.layers[where.hf_index].cumulative_length
            out[f"{name} cumulative_length"] = np.array([length], dtype=np.int64)
        if where.kind is LayerKind.COMPRESSED:
            for key, n in compressed.counts(cache.layers[where.hf_index]).items():
                out[f"{name} {key}"] = np.array([n], dtype=np.int64)
    return out


def compare(want: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> str | None:
    """None if every tensor is bitwise equal, else what differs first."""
    for name in sorted(set(want) | set(got)):
        a, b = want.get(name), got.get(name)
        if a is None or b is None:
            return f"{name}: present on one side only"
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: {b.shape} {b.dtype}, expected {a.shape} {a.dtype}"
        if a.tobytes() != b.tobytes():
            diff = int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8)))
            return f"{name}: {diff} of {a.nbytes} bytes differ"
    return None
