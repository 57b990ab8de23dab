"""Memory layouts: where each cached tensor of a rank lives, described, never owned.

A rank registers *regions* (named byte ranges: a pool tensor, a shared-memory segment). A
:class:`BufferLayout` places one component of one layer inside a region, with named dims and
byte strides, like DLPack:

* per-token components: ``page``, ``token`` (slot in page), optional ``row``, optional ``unit``
  (a KV head), ``elem``. NHD is ``[page, token, elem]`` (heads packed along elem); HND is
  ``[page, unit, token, elem]``.
* per-request components (state, aux): ``slot``, optional ``row``, optional ``unit``, ``elem``.
  A conv state's rows are its time steps; engines keep them first (``[state_len, dim]``) or
  last (``[dim, state_len]``): :class:`ConvLayout`, a matter of strides.

``elem`` spans one unit when ``unit`` is present, else the rank's whole local axis (all its
segments, packed in order). Its elements are usually contiguous (stride = itemsize); an
engine that stores a tensor transposed (vLLM's CPU backend keeps K as ``[head_dim, block]``)
gives ``elem`` a larger stride and the buffer its ``itemsize``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvbridge.errors import LayoutError
from kvbridge.model.spec import CacheSpec, Component, LayerSpec, Scope
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.shard import local_axis_elems, local_units

TOKEN_DIMS = frozenset({"page", "token", "row", "unit", "elem"})
STATE_DIMS = frozenset({"slot", "row", "unit", "elem"})
AUX = "aux"


class KVLayout(enum.Enum):
    NHD = "nhd"  # [page, token, head, elem]
    HND = "hnd"  # [page, head, token, elem]


class ConvLayout(enum.Enum):
    """The order of a per-request state of several rows (a conv state: one row per kept time
    step), in vLLM's names (``VLLM_SSM_CONV_STATE_LAYOUT``)."""

    SD = "sd"  # [state_len, dim]: vLLM's default, SGLang's pools
    DS = "ds"  # [dim, state_len]: vLLM's other choice, and transformers' own cache


@dataclass(frozen=True)
class Dim:
    name: str
    size: int
    stride: int  # bytes

    def __post_init__(self) -> None:
        # A zero stride over several indices would alias bytes: two tokens, one address.
        if self.size < 1 or self.stride < 0 or (self.size > 1 and self.stride == 0):
            raise LayoutError(
                f"dim {self.name!r}: size must be >= 1 and stride > 0 (>= 0 for "
                f"size 1), got size={self.size}, stride={self.stride}"
            )


@dataclass(frozen=True)
class Region:
    name: str
    nbytes: int

    def __post_init__(self) -> None:
        if self.nbytes < 1:
            raise LayoutError(f"region {self.name!r}: nbytes must be >= 1, got {self.nbytes}")


@dataclass(frozen=True)
class BufferLayout:
    """One component of one layer inside a region. ``group`` names its page table (per-token
    components) or its slot kind (per-request ones) in a
    :class:`~kvbridge.planner.placement.Placement`."""

    region: str
    offset: int
    dims: tuple[Dim, ...]
    group: str
    itemsize: int = 0  # bytes of one element; 0: the elem stride (contiguous elements)

    def __post_init__(self) -> None:
        if self.itemsize < 0:
            raise LayoutError(f"buffer in {self.region!r}: negative itemsize {self.itemsize}")
        names = [d.name for d in self.dims]
        if len(set(names)) != len(names):
            raise LayoutError(f"buffer in {self.region!r}: duplicate dims {names}")
        if self.offset < 0:
            raise LayoutError(f"buffer in {self.region!r}: negative offset {self.offset}")

    def dim(self, name: str) -> Dim | None:
        for d in self.dims:
            if d.name == name:
                return d
        return None

    def size(self, name: str) -> int:
        d = self.dim(name)
        return 1 if d is None else d.size

    def stride(self, name: str) -> int:
        d = self.dim(name)
        return 0 if d is None else d.stride

    @property
    def scope(self) -> Scope:
        return Scope.TOKEN if self.dim("page") is not None else Scope.STATE

    @property
    def elem_size(self) -> int:
        """Bytes of one element."""
        if self.itemsize:
            return self.itemsize
        elem = self.dim("elem")
        return elem.stride if elem is not None else 1

    @property
    def contiguous_elems(self) -> bool:
        return self.stride("elem") == self.elem_size

    def end(self) -> int:
        """One past the last byte this buffer may touch."""
        return self.offset + sum((d.size - 1) * d.stride for d in self.dims) + self.elem_size


@dataclass(frozen=True)
class SideMemory:
    """Every buffer of one side: ``buffers[(layer, component)]`` and the aux slots.

    Region names are unique across the side; each rank holds the regions of its own layers
    (see :meth:`regions_of`) and the aux region.
    """

    regions: tuple[Region, ...]
    buffers: Mapping[tuple[int, str], BufferLayout]
    aux: BufferLayout
    _by_name: dict[str, Region] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {r.name: r for r in self.regions}
        if len(by_name) != len(self.regions):
            raise LayoutError("region names must be unique")
        object.__setattr__(self, "_by_name", by_name)
        for key, buf in [*self.buffers.items(), (AUX, self.aux)]:
            region = by_name.get(buf.region)
            if region is None:
                raise LayoutError(
                    f"buffer {key}: region {buf.region!r} is not registered; "
                    f"known: {sorted(by_name)[:8]}"
                )
            if buf.end() > region.nbytes:
                raise LayoutError(
                    f"buffer {key} ends at byte {buf.end()}, past the end of region "
                    f"{buf.region!r} ({region.nbytes} bytes)"
                )

    def region(self, name: str) -> Region:
        return self._by_name[name]

    def regions_of(self, layers: Iterable[int]) -> tuple[Region, ...]:
        """The regions one rank holds: those of its layers, then aux."""
        names: dict[str, None] = {}
        wanted = set(layers)
        for (layer, _), buf in self.buffers.items():
            if layer in wanted:
                names[buf.region] = None
        names[self.aux.region] = None
        return tuple(self._by_name[n] for n in names)


def check_buffer(buf: BufferLayout, comp: Component, tp: int, where: str) -> None:
    """Raise LayoutError unless ``buf`` can hold ``comp`` as one rank of TP ``tp`` holds it."""
    allowed = TOKEN_DIMS if comp.scope is Scope.TOKEN else STATE_DIMS
    names = {d.name for d in buf.dims}
    required = {"page", "token", "elem"} if comp.scope is Scope.TOKEN else {"slot", "elem"}
    if not required <= names or not names <= allowed:
        raise LayoutError(
            f"{where}: dims {sorted(names)} for a {comp.scope.value} component; "
            f"expected {sorted(required)} plus optional "
            f"{sorted(allowed - required)}"
        )
    isz = comp.dtype.itemsize
    elem = buf.dim("elem")
    if elem is None or buf.elem_size != isz or elem.stride % isz:
        raise LayoutError(
            f"{where}: elements of {isz} bytes need an elem stride that is a "
            f"multiple of {isz}, got itemsize {buf.elem_size} and stride "
            f"{elem.stride if elem else None}"
        )
    if buf.size("row") != comp.rows:
        raise LayoutError(f"{where}: row dim has {buf.size('row')} rows, spec has {comp.rows}")
    if buf.dim("unit") is not None:
        unit = comp.uniform_unit_size
        n_units = sum(local_units(s, tp) for s in comp.segments)
        if unit is None:
            raise LayoutError(
                f"{where}: a unit dim needs segments of one unit size, got "
                f"{[s.unit_size for s in comp.segments]}"
            )
        if buf.size("unit") != n_units or elem.size != unit:
            raise LayoutError(
                f"{where}: unit x elem is {buf.size('unit')} x {elem.size}; "
                f"at TP {tp} a rank holds {n_units} units of {unit}"
            )
    else:
        want = local_axis_elems(comp.segments, tp)
        if elem.size != want:
            raise LayoutError(
                f"{where}: elem dim has {elem.size} elements; at TP {tp} a rank "
                f"holds {want} (of {comp.axis_elems} in all)"
            )


# ---- builders for the layouts engines use ----------------------------------------------------


def token_dims(
    comp: Component, tp: int, page_size: int, num_pages: int, kv_layout: KVLayout
) -> tuple[tuple[Dim, ...], int]:
    """Dims of a paged per-token buffer and its size in bytes. A component of one entry every
    ``stride`` tokens keeps, in each page of ``page_size`` tokens, those tokens' entries (its
    pages follow the same page table)."""
    if page_size % comp.stride:
        raise LayoutError(
            f"component {comp.name!r}: a page of {page_size} tokens holds no whole number of its "
            f"entries (one every {comp.stride} tokens): use a page size that {comp.stride} divides"
        )
    page_size //= comp.stride
    isz = comp.dtype.itemsize
    axis = local_axis_elems(comp.segments, tp)
    token_bytes = comp.rows * axis * isz
    page_bytes = page_size * token_bytes
    unit = comp.uniform_unit_size
    dims: tuple[Dim, ...]
    if kv_layout is KVLayout.HND and unit is not None:
        n_units = axis // unit
        dims = (
            Dim("page", num_pages, page_bytes),
            Dim("unit", n_units, page_size * comp.rows * unit * isz),
            Dim("token", page_size, comp.rows * unit * isz),
            Dim("row", comp.rows, unit * isz),
            Dim("elem", unit, isz),
        )
    else:
        dims = (
            Dim("page", num_pages, page_bytes),
            Dim("token", page_size, token_bytes),
            Dim("row", comp.rows, axis * isz),
            Dim("elem", axis, isz),
        )
    return dims, num_pages * page_bytes


def state_dims(
    comp: Component, tp: int, slots: int, conv: ConvLayout = ConvLayout.SD
) -> tuple[tuple[Dim, ...], int]:
    """Dims of a per-request buffer and its size in bytes. With ``DS`` a row's elements are
    ``rows`` apart (the buffer's itemsize is then the dtype's)."""
    isz = comp.dtype.itemsize
    axis = local_axis_elems(comp.segments, tp)
    slot_bytes = comp.rows * axis * isz
    if conv is ConvLayout.DS and comp.rows > 1:
        return (
            Dim("slot", slots, slot_bytes),
            Dim("row", comp.rows, isz),
            Dim("elem", axis, comp.rows * isz),
        ), slots * slot_bytes
    return (
        Dim("slot", slots, slot_bytes),
        Dim("row", comp.rows, axis * isz),
        Dim("elem", axis, isz),
    ), slots * slot_bytes


def default_group(layer: LayerSpec, comp: Component) -> str:
    return "kv" if comp.scope is Scope.TOKEN else "state"


def window_pool_group(layer: LayerSpec, comp: Component) -> str:
    """Sliding-window layers in a pool of their own ("swa"), as hybrid-SWA engines keep them."""
    if comp.scope is Scope.STATE:
        return "state"
    return "swa" if layer.window is not None else "kv"


def build_memory(
    spec: CacheSpec,
    parallel: ParallelLayout,
    *,
    page_size: int,
    num_pages: int,
    kv_layout: KVLayout = KVLayout.NHD,
    state_slots: int = 8,
    aux_slots: int = 8,
    group_of: Callable[[LayerSpec, Component], str] = default_group,
    conv_layout: ConvLayout = ConvLayout.SD,
) -> SideMemory:
    """One region per (layer, component), plus one for aux: how engines register pools."""
    if page_size < 1 or num_pages < 1:
        raise LayoutError(f"page_size and num_pages must be >= 1, got {page_size}, {num_pages}")
    regions: list[Region] = []
    buffers: dict[tuple[int, str], BufferLayout] = {}
    for li, layer in enumerate(spec.layers):
        for comp in layer.components:
            name = f"L{li}.{comp.name}"
            if comp.scope is Scope.TOKEN:
                dims, nbytes = token_dims(comp, parallel.tp, page_size, num_pages, kv_layout)
            else:
                dims, nbytes = state_dims(comp, parallel.tp, state_slots, conv_layout)
            regions.append(Region(name, nbytes))
            buffers[(li, comp.name)] = BufferLayout(
                name, 0, dims, group_of(layer, comp), itemsize=comp.dtype.itemsize
            )
    regions.append(Region(AUX, aux_slots * spec.aux_bytes))
    aux = BufferLayout(
        AUX, 0, (Dim("slot", aux_slots, spec.aux_bytes), Dim("elem", spec.aux_bytes, 1)), AUX
    )
    return SideMemory(tuple(regions), buffers, aux)
