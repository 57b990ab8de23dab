"""vLLM's KV cache memory, described as kvbridge buffers: the engine's tensors, wrapped in place.

vLLM (0.32) gives a connector one tensor per attention layer, all of logical shape
``[num_blocks, kv_heads, block_size, 2 * head_size]`` (``[B, H, N, 2D]``), views of one
allocation. What the bytes of a block mean depends on the backend:

* ``CPU`` (the CPU attention backend): each (block, head) slab holds K transposed,
  ``[head_size][block_size]``, then V as ``[block_size][head_size]`` (checked against the HF
  model's K and V: docs/notes-vllm-connector.md, section 7). K's elements are ``block_size``
  elements apart: a transposed buffer.
* ``NHD`` (CUDA backends, vLLM layout ``LBNHC``): a block is ``[block_size][kv_heads][2D]``,
  K then V in the last dim of each (token, head).
* ``HND`` (``LBHNC``, what NIXL asks for): a block is ``[kv_heads][block_size][2D]``.

Block-major layouts (``BL*``, every layer inside one block) are not described: their layers
interleave in one allocation. A layer's tensor is one region (``L{i}``); its K and V are two
buffers in it. Aux has no counterpart in vLLM (the decode instance recomputes the last prompt
token): a small region of kvbridge's own carries it.

Hybrid models (vLLM's hybrid allocator: attention and Mamba layers in KV cache groups of their
own) share allocations: a Mamba layer and an attention layer of other groups may be views of
one buffer, a block id belonging to one group at a time, every block of it the same (padded)
size. A Mamba or GDN layer's block holds its states one after the other (conv, then the
SSM or recurrent state), the conv state in vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT`` order; a
request's state is one block (a slot).
``regions`` names the allocation of each layer, ``groups`` its block table, ``block_bytes`` its
block stride (docs/notes-vllm-connector.md, section 10).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvbridge.errors import LayoutError
from kvbridge.model.spec import CacheSpec, LayerKind, LayerSpec
from kvbridge.planner.layout import (
    AUX,
    BufferLayout,
    ConvLayout,
    Dim,
    Region,
    SideMemory,
    state_dims,
)
from kvbridge.planner.shard import local_units

# State layers whose vLLM state shapes (MambaStateShapeCalculator: conv over the rank's own
# channels of each segment, then the SSM or recurrent state by head) are kvbridge's, and which
# are served by tests with real vLLM servers.
STATE_KINDS = (LayerKind.MAMBA2, LayerKind.GDN)


class VllmLayout(enum.Enum):
    CPU = "cpu"
    NHD = "nhd"
    HND = "hnd"


def layout_of(strides: tuple[int, ...], shape: tuple[int, ...]) -> VllmLayout:
    """The CUDA layout of a layer tensor ``[B, H, N, 2D]`` from its strides (in elements)."""
    _, h, n, c = shape
    if strides[3] == 1 and strides[1] == c and strides[2] == h * c:
        return VllmLayout.NHD
    if strides[3] == 1 and strides[2] == c and strides[1] == n * c:
        return VllmLayout.HND
    raise LayoutError(
        f"a KV tensor of shape {shape} with strides {strides} is neither LBNHC "
        f"(NHD) nor LBHNC (HND); kvbridge does not describe it yet"
    )


def vllm_memory(
    spec: CacheSpec,
    tp: int,
    *,
    num_blocks: int,
    block_size: int,
    layout: VllmLayout,
    layer_names: Sequence[str] | None = None,
    aux_slots: int = 64,
    regions: Sequence[str] | None = None,
    groups: Sequence[str] | None = None,
    block_bytes: Sequence[int] | None = None,
    conv: ConvLayout = ConvLayout.SD,
) -> SideMemory:
    """The buffers of one rank of TP ``tp`` whose layer ``i`` is the tensor ``layer_names[i]``
    (default ``L{i}``), laid out as ``layout``; attention layers (full or sliding, K and V of one
    head size as vLLM's paged attention keeps them), Mamba2 and GDN layers. ``regions``: the
    allocation of each layer (default: its own name); ``groups``: its block table (default
    ``kv`` for attention, ``state`` for states); ``block_bytes``: its block stride (default:
    an attention block, unpadded)."""
    if num_blocks < 1 or block_size < 1:
        raise LayoutError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
    n = spec.num_layers
    names = list(layer_names) if layer_names is not None else [f"L{i}" for i in range(n)]
    if len(names) != n or len(set(names)) != len(names) or AUX in names:
        raise LayoutError(f"need {n} distinct layer names (not {AUX!r}), got {names}")
    where = list(regions) if regions is not None else names
    for what, values in (("regions", where), ("groups", groups), ("block_bytes", block_bytes)):
        if values is not None and len(values) != n:
            raise LayoutError(f"{what}: one per layer ({n}), got {len(values)}")
    sizes: dict[str, int] = {}
    buffers: dict[tuple[int, str], BufferLayout] = {}
    for li, layer in enumerate(spec.layers):
        if layer.kind not in (LayerKind.FULL, LayerKind.SLIDING, *STATE_KINDS):
            raise LayoutError(
                f"layer {li} is {layer.kind.value}: kvbridge describes vLLM's "
                f"attention, Mamba2 and gated-delta-net layers only"
            )
        held = sorted(c.name for c in layer.components)
        if layer.kind in (LayerKind.FULL, LayerKind.SLIDING) and held != ["k", "v"]:
            raise LayoutError(
                f"layer {li} is {layer.kind.value} attention caching {held} (a sliding MLA "
                f"latent): vLLM's paged attention layouts hold K and V"
            )
        state = layer.kind in STATE_KINDS
        used = state_bytes(layer, tp) if state else _attention_block(layer, li, tp, block_size)
        stride = block_bytes[li] if block_bytes is not None else used
        group = groups[li] if groups is not None else "state" if state else "kv"
        bufs = (
            _states(layer, tp, where[li], num_blocks, stride, group, conv)
            if state
            else _attention(layer, tp, where[li], num_blocks, block_size, stride, group, layout)
        )
        if used > stride:
            raise LayoutError(
                f"layer {li} ({names[li]}): a block of {stride} bytes cannot hold its {used} bytes"
            )
        if sizes.setdefault(where[li], num_blocks * stride) != num_blocks * stride:
            raise LayoutError(
                f"region {where[li]!r}: layers in one allocation must have one "
                f"block size, got {stride} bytes for layer {li}"
            )
        buffers.update(((li, name), buf) for name, buf in bufs.items())
    out = [Region(name, nbytes) for name, nbytes in sizes.items()]
    out.append(Region(AUX, aux_slots * spec.aux_bytes))
    aux = BufferLayout(
        AUX, 0, (Dim("slot", aux_slots, spec.aux_bytes), Dim("elem", spec.aux_bytes, 1)), AUX
    )
    return SideMemory(tuple(out), buffers, aux)


def _attention_block(layer: LayerSpec, li: int, tp: int, block_size: int) -> int:
    k, v = (layer.component(n) for n in ("k", "v"))
    (seg,) = k.segments
    if v.segments[0].unit_size != seg.unit_size or k.dtype != v.dtype:
        raise LayoutError(
            f"layer {li}: K and V differ in head size or dtype; vLLM keeps one head_size"
        )
    return local_units(seg, tp) * block_size * 2 * seg.unit_size * k.dtype.itemsize


def _attention(
    layer: LayerSpec,
    tp: int,
    region: str,
    num_blocks: int,
    block_size: int,
    stride: int,
    group: str,
    layout: VllmLayout,
) -> dict[str, BufferLayout]:
    k = layer.component("k")
    (seg,) = k.segments
    heads, d, isz = local_units(seg, tp), seg.unit_size, k.dtype.itemsize
    page = Dim("page", num_blocks, stride)
    if layout is VllmLayout.CPU:
        slab = 2 * block_size * d * isz  # one (block, head)
        unit = Dim("unit", heads, slab)
        return {
            "k": BufferLayout(
                region,
                0,
                (page, unit, Dim("token", block_size, isz), Dim("elem", d, block_size * isz)),
                group,
                isz,
            ),
            "v": BufferLayout(
                region,
                block_size * d * isz,
                (page, unit, Dim("token", block_size, d * isz), Dim("elem", d, isz)),
                group,
            ),
        }
    if layout is VllmLayout.NHD:
        token, unit = Dim("token", block_size, heads * 2 * d * isz), Dim("unit", heads, 2 * d * isz)
    else:
        unit, token = (
            Dim("unit", heads, block_size * 2 * d * isz),
            Dim("token", block_size, 2 * d * isz),
        )
    dims = (page, unit, token, Dim("elem", d, isz))
    return {
        "k": BufferLayout(region, 0, dims, group),
        "v": BufferLayout(region, d * isz, dims, group),
    }


def state_bytes(layer: LayerSpec, tp: int) -> int:
    """Bytes of one request's states of a Mamba layer on one rank of TP ``tp``."""
    return sum(state_dims(comp, tp, 1)[1] for comp in layer.components)


def _states(
    layer: LayerSpec,
    tp: int,
    region: str,
    num_blocks: int,
    stride: int,
    group: str,
    conv: ConvLayout,
) -> dict[str, BufferLayout]:
    """A Mamba layer's states, one after the other in each block (a block: one request's)."""
    out: dict[str, BufferLayout] = {}
    offset = 0
    for comp in layer.components:
        dims, nbytes = state_dims(comp, tp, 1, conv)
        out[comp.name] = BufferLayout(
            region,
            offset,
            (Dim("slot", num_blocks, stride), *dims[1:]),
            group,
            itemsize=comp.dtype.itemsize,
        )
        offset += nbytes
    return out
