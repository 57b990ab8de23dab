"""vLLM's KV cache memory, described as kvbridge buffers: the engine's tensors, wrapped in place.

vLLM (0.32) gives a connector one tensor per attention layer, all of logical shape
``[num_blocks, kv_heads, block_size, 2 * head_size]`` (``[B, H, N, 2D]``), views of one
allocation. What the bytes of a block mean depends on the backend:

* ``CPU`` (the CPU attention backend): each (block, head) slab holds K transposed,
  ``[head_size][block_size]``, then V as ``[block_size][head_size]`` (../shared/facts/vllm-cpu.md,
  checked against the HF model's K and V). K's elements are ``block_size`` elements apart: a
  transposed buffer.
* ``NHD`` (CUDA backends, vLLM layout ``LBNHC``): a block is ``[block_size][kv_heads][2D]``,
  K then V in the last dim of each (token, head).
* ``HND`` (``LBHNC``, what NIXL asks for): a block is ``[kv_heads][block_size][2D]``.

Block-major layouts (``BL*``, every layer inside one block) are not described: their layers
interleave in one allocation. A layer's tensor is one region (``L{i}``); its K and V are two
buffers in it. Aux has no counterpart in vLLM (the decode instance recomputes the last prompt
token): a small region of kvbridge's own carries it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvbridge.errors import LayoutError
from kvbridge.layout import AUX, BufferLayout, Dim, Region, SideMemory
from kvbridge.shard import local_units
from kvbridge.spec import CacheSpec, LayerKind


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
    raise LayoutError(f"a KV tensor of shape {shape} with strides {strides} is neither LBNHC "
                      f"(NHD) nor LBHNC (HND); kvbridge does not describe it yet")


def vllm_memory(spec: CacheSpec, tp: int, *, num_blocks: int, block_size: int,
                layout: VllmLayout, layer_names: Sequence[str] | None = None,
                aux_slots: int = 64) -> SideMemory:
    """The buffers of one rank of TP ``tp`` whose layer ``i`` is the tensor ``layer_names[i]``
    (default ``L{i}``), laid out as ``layout``. Every layer must be attention (full or sliding)
    with K and V of one head size, as vLLM's paged attention keeps them."""
    if num_blocks < 1 or block_size < 1:
        raise LayoutError(f"num_blocks and block_size must be >= 1, got {num_blocks}, "
                          f"{block_size}")
    names = list(layer_names) if layer_names is not None else \
        [f"L{i}" for i in range(spec.num_layers)]
    if len(names) != spec.num_layers or len(set(names)) != len(names) or AUX in names:
        raise LayoutError(f"need {spec.num_layers} distinct layer names (not {AUX!r}), got "
                          f"{names}")
    regions: list[Region] = []
    buffers: dict[tuple[int, str], BufferLayout] = {}
    for li, layer in enumerate(spec.layers):
        if layer.kind not in (LayerKind.FULL, LayerKind.SLIDING):
            raise LayoutError(f"layer {li} is {layer.kind.value}: vLLM's paged KV layouts hold "
                              f"attention layers only")
        k, v = (layer.component(n) for n in ("k", "v"))
        (seg,) = k.segments
        if v.segments[0].unit_size != seg.unit_size or k.dtype != v.dtype:
            raise LayoutError(f"layer {li}: K and V differ in head size or dtype; vLLM keeps "
                              f"one head_size")
        heads, d, isz = local_units(seg, tp), seg.unit_size, k.dtype.itemsize
        block = heads * block_size * 2 * d * isz
        regions.append(Region(names[li], num_blocks * block))
        page = Dim("page", num_blocks, block)
        if layout is VllmLayout.CPU:
            slab = 2 * block_size * d * isz  # one (block, head)
            unit = Dim("unit", heads, slab)
            kb = BufferLayout(names[li], 0, (page, unit, Dim("token", block_size, isz),
                                             Dim("elem", d, block_size * isz)), "kv", isz)
            vb = BufferLayout(names[li], block_size * d * isz,
                              (page, unit, Dim("token", block_size, d * isz),
                               Dim("elem", d, isz)), "kv")
        else:
            if layout is VllmLayout.NHD:
                token, unit = Dim("token", block_size, heads * 2 * d * isz), \
                    Dim("unit", heads, 2 * d * isz)
            else:
                unit, token = Dim("unit", heads, block_size * 2 * d * isz), \
                    Dim("token", block_size, 2 * d * isz)
            dims = (page, unit, token, Dim("elem", d, isz))
            kb = BufferLayout(names[li], 0, dims, "kv")
            vb = BufferLayout(names[li], d * isz, dims, "kv")
        buffers[(li, "k")], buffers[(li, "v")] = kb, vb
    regions.append(Region(AUX, aux_slots * spec.aux_bytes))
    aux = BufferLayout(AUX, 0, (Dim("slot", aux_slots, spec.aux_bytes),
                                Dim("elem", spec.aux_bytes, 1)), AUX)
    return SideMemory(tuple(regions), buffers, aux)
