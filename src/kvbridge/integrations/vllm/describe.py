"""vLLM's KV cache on one worker rank, in kvbridge's terms: the engine's tensors and KV cache
groups -> a :class:`~kvbridge.model.spec.CacheSpec`, a :class:`~kvbridge.planner.layout.SideMemory`
over the tensors' own memory (wrapped in place, never copied), and the block table of each group.

Dense models: one group of attention layers, a region per layer tensor. Hybrid models (vLLM's
hybrid allocator): the spec comes from the model's Hugging Face config (:mod:`kvbridge.model.hf`),
each vLLM group is a block table of its own (pages for attention, one state block a request for
Mamba), and layers that share an allocation share a region (:mod:`.memory`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import LayoutError
from kvbridge.integrations.vllm.memory import VllmLayout, layout_of, state_bytes, vllm_memory
from kvbridge.model.hf import layer_origins, spec_from_config
from kvbridge.model.spec import CacheSpec, DType, LayerSpec, attention_layer
from kvbridge.planner.layout import ConvLayout, SideMemory
from kvbridge.planner.shard import local_axis_elems

_DTYPES = {
    "torch.float32": DType.FLOAT32,
    "torch.bfloat16": DType.BFLOAT16,
    "torch.float16": DType.FLOAT16,
    "torch.float8_e4m3fn": DType.FLOAT8_E4M3,
    "torch.uint8": DType.UINT8,
}


def dtype_of(torch_dtype: object) -> DType:
    """kvbridge's name for a torch dtype of vLLM's (its ``str()``), or a refusal naming it."""
    dtype = _DTYPES.get(str(torch_dtype))
    if dtype is None:
        raise LayoutError(
            f"KV cache dtype {torch_dtype} is not one kvbridge moves; known: {sorted(_DTYPES)}"
        )
    return dtype


@dataclass(frozen=True)
class StatePart:
    """One state of a Mamba layer as vLLM allocates it for one request on this rank (its
    MambaSpec's shape and dtype): the model's config says what the state is, vLLM how it is
    stored."""

    elements: int
    dtype: DType

    @property
    def nbytes(self) -> int:
        return self.elements * self.dtype.itemsize


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: its layers, and whether it keeps per-request states
    (Mamba: one block a request) rather than per-token pages."""

    layers: tuple[str, ...]
    state: bool
    states: tuple[StatePart, ...] = ()  # a Mamba group's states, in vLLM's order
    window: int | None = None  # a sliding-window attention group's window
    speculative_blocks: int = 0  # a Mamba group's scratch blocks for speculative decoding
    chunk: int | None = None  # a chunked local attention group's chunk (Llama 4)


@dataclass(frozen=True)
class WorkerPlace:
    """Where this worker sits in its engine (read from vLLM by the connector)."""

    model: str
    total_kv_heads: int
    num_layers: int
    tp: int
    tp_rank: int
    pp_ranges: tuple[tuple[int, int], ...]  # layer range of each PP stage
    pp_rank: int
    engine_id: str
    cpu: bool
    groups: tuple[KVGroup, ...] = ()
    hf_config: Mapping[str, Any] | None = None  # the text model's config, for hybrids


@dataclass(frozen=True)
class Description:
    spec: CacheSpec
    memory: SideMemory
    regions: tuple[tuple[str, int, int], ...]  # (name, address, bytes) of each allocation
    groups: tuple[tuple[str, bool], ...]  # per vLLM group: kvbridge block table, is a state
    layers: Mapping[str, int]  # vLLM layer name -> its layer in the spec
    pp_ranges: tuple[tuple[int, int], ...]  # spec layers of each PP stage
    layout: VllmLayout
    num_blocks: int
    block_size: int
    pages: tuple[tuple[Any, ...], ...] = ()  # per vLLM group: its attention layers' tensors


def layer_index(name: str) -> int:
    """vLLM's layer names carry the layer's index: ``model.layers.12.self_attn.attn``."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    if not found:
        raise LayoutError(f"cannot tell the layer index of KV cache tensor {name!r}")
    return int(found[0])


def describe(
    kv_caches: Mapping[str, Any], place: WorkerPlace, layout: VllmLayout | None, aux_slots: int
) -> Description:
    """This rank's KV cache as kvbridge describes it (``layout``: the option, if given)."""
    groups = place.groups or (KVGroup(tuple(kv_caches), False),)
    state_layers = {n for g in groups if g.state for n in g.layers}
    chunked = [g.layers[0] for g in groups if g.chunk]
    if chunked:
        # vLLM frees a chunked layer's blocks before the current chunk: described as full
        # attention, those pages would be its null block on both sides.
        raise LayoutError(
            f"kvbridge's vLLM connector does not serve chunked local attention yet (Llama 4: "
            f"{chunked[0]} ...)"
        )
    if any(g.speculative_blocks for g in groups):
        # A request's state is then not its last block (vLLM keeps scratch blocks after it).
        raise LayoutError(
            "kvbridge's vLLM connector does not serve Mamba layers with speculative decoding yet"
        )
    if len(place.pp_ranges) > 1 and len(groups) > 1:
        # Each stage sees only its own layers' groups; every rank must describe the whole
        # model alike.
        raise LayoutError(
            f"{len(groups)} KV cache groups under pipeline parallelism: not "
            f"served yet; run vLLM with --disable-hybrid-kv-cache-manager"
        )
    attention = [t for n, t in sorted(kv_caches.items()) if n not in state_layers]
    if not attention:
        raise LayoutError(
            "a model without attention layers: kvbridge's vLLM connector needs "
            "one to know the block size"
        )
    first = attention[0]
    num_blocks, heads, block_size, two_d = (int(x) for x in first.shape)  # [B, H, N, 2D]
    layout = layout or (
        VllmLayout.CPU if place.cpu else layout_of(tuple(first.stride()), tuple(first.shape))
    )
    dtype = dtype_of(first.dtype)
    want = heads * place.tp if place.total_kv_heads >= place.tp else place.total_kv_heads
    if want != place.total_kv_heads:
        raise LayoutError(
            f"{heads} KV heads per rank at TP {place.tp} do not make the "
            f"model's {place.total_kv_heads}"
        )
    tables = tuple((f"g{gi}", g.state) for gi, g in enumerate(groups))
    pages = tuple(
        () if g.state else tuple(kv_caches[n] for n in g.layers if n in kv_caches) for g in groups
    )  # this PP stage's own layers only
    if not state_layers:  # attention only; a region per layer tensor (this PP stage's only)
        # Each layer in its group's block table, with its window (a sliding-window group's
        # early blocks may be vLLM's null block: only the last `window` tokens travel).
        # Layers of other PP stages are described like this stage's and never addressed.
        by_index = {layer_index(n): gi for gi, g in enumerate(groups) for n in g.layers}
        gis = [by_index.get(i, 0) for i in range(place.num_layers)]
        spec = CacheSpec(
            place.model,
            tuple(
                attention_layer(place.total_kv_heads, two_d // 2, dtype, window=groups[gi].window)
                for gi in gis
            ),
        )
        memory = vllm_memory(
            spec,
            place.tp,
            num_blocks=num_blocks,
            block_size=block_size,
            layout=layout,
            aux_slots=aux_slots,
            groups=[f"g{gi}" for gi in gis],
        )
        regions = tuple(
            (f"L{layer_index(n)}", int(t.data_ptr()), int(t.numel() * t.element_size()))
            for n, t in kv_caches.items()
        )
        return Description(
            spec,
            memory,
            regions,
            tables,
            {n: layer_index(n) for n in kv_caches},
            place.pp_ranges,
            layout,
            num_blocks,
            block_size,
            pages,
        )
    spec, names = _hybrid_spec(kv_caches, place, dtype)
    group_of = {n: f"g{gi}" for gi, g in enumerate(groups) for n in g.layers}
    stored = {n: g.states for g in groups if g.state for n in g.layers}
    spec = CacheSpec(
        spec.model,
        tuple(
            _as_stored(layer, name, stored[name], place.tp) if name in stored else layer
            for layer, name in zip(spec.layers, names, strict=True)
        ),
        spec.aux_bytes,
    )
    conv = ConvLayout(os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "SD").lower())
    # One region per allocation: layers of different groups share one.
    region_of: dict[int, str] = {}
    where: list[str] = []
    strides: list[int] = []
    for li, name in enumerate(names):
        t = kv_caches[name]
        if int(t.shape[0]) != num_blocks:
            raise LayoutError(f"{name}: {t.shape[0]} blocks, the attention layers {num_blocks}")
        region_of.setdefault(int(t.data_ptr()), f"L{li}")
        where.append(region_of[int(t.data_ptr())])
        strides.append(int(t.stride(0)) * int(t.element_size()))
    memory = vllm_memory(
        spec,
        place.tp,
        num_blocks=num_blocks,
        block_size=block_size,
        layout=layout,
        aux_slots=aux_slots,
        regions=where,
        groups=[group_of[n] for n in names],
        block_bytes=strides,
        conv=conv,
    )
    regions = tuple((name, ptr, memory.region(name).nbytes) for ptr, name in region_of.items())
    return Description(
        spec,
        memory,
        regions,
        tables,
        {n: i for i, n in enumerate(names)},
        ((0, spec.num_layers),),
        layout,
        num_blocks,
        block_size,
        pages,
    )


def _as_stored(layer: LayerSpec, name: str, parts: tuple[StatePart, ...], tp: int) -> LayerSpec:
    """A state layer of the model's config with each state in the dtype vLLM stores it in.

    The dtypes are vLLM's to choose (``--mamba-ssm-cache-dtype``, the model's dtype, its
    transformers release's defaults: one vLLM release kept a GDN's recurrent state in fp32,
    another resolved beside other packages in bf16); the element counts are the model's. Only
    a count that differs is a real mismatch."""
    config_bytes = state_bytes(layer, tp)
    wanted = [c.rows * local_axis_elems(c.segments, tp) for c in layer.components]
    if [p.elements for p in parts] != wanted:
        raise LayoutError(
            f"{name}: vLLM keeps {sum(p.nbytes for p in parts)} bytes of state a request "
            f"({[p.elements for p in parts]} elements), the model's config makes "
            f"{config_bytes} ({wanted} elements: {layer.kind.value} at TP {tp})"
        )
    comps = tuple(
        dataclasses.replace(c, dtype=p.dtype) for c, p in zip(layer.components, parts, strict=True)
    )
    return dataclasses.replace(layer, components=comps)


def _hybrid_spec(
    kv_caches: Mapping[str, Any], place: WorkerPlace, dtype: DType
) -> tuple[CacheSpec, list[str]]:
    """The spec of a hybrid model from its HF config, and the vLLM layer of each spec layer."""
    if len(place.pp_ranges) > 1:
        raise LayoutError(
            "kvbridge's vLLM connector does not serve hybrid models under pipeline parallelism yet"
        )
    if place.hf_config is None:
        raise LayoutError("a hybrid model's KV cache needs its Hugging Face config")
    spec = spec_from_config(place.hf_config, name=place.model, dtype=dtype)
    by_index = {layer_index(n): n for n in kv_caches}
    if len(by_index) != len(kv_caches):  # e.g. mtp.layers.0 beside model.layers.0
        raise LayoutError(f"KV cache tensors whose layer indices collide: {sorted(kv_caches)}")
    origins = layer_origins(place.hf_config)
    missing = [o for o in origins if o not in by_index]
    if missing or len(by_index) != len(origins):
        raise LayoutError(
            f"the model's config keeps a cache in layers {list(origins)}, vLLM "
            f"registered layers {sorted(by_index)}"
        )
    return spec, [by_index[o] for o in origins]
