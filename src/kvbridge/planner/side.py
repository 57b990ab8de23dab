"""One side of a deployment (prefill or decode): its cache spec, parallel layout and memory
layout, checked to fit together on their own, before any other side is met."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import LayoutError
from kvbridge.model.spec import CacheSpec, Scope
from kvbridge.planner.layout import SideMemory, check_buffer
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.shard import check_dcp, check_segment


@dataclass(frozen=True)
class Side:
    """One side of a deployment. Validates that its memory can hold its spec at its layout."""

    spec: CacheSpec
    parallel: ParallelLayout
    memory: SideMemory

    def __post_init__(self) -> None:
        if self.parallel.num_layers != self.spec.num_layers:
            raise LayoutError(
                f"the PP stages cover {self.parallel.num_layers} layers; the model "
                f"{self.spec.model!r} has {self.spec.num_layers}"
            )
        for li, layer in enumerate(self.spec.layers):
            for comp in layer.components:
                where = f"layer {li} {comp.name}: "
                for seg in comp.segments:
                    check_segment(seg, self.parallel.tp, where)
                    if comp.scope is Scope.TOKEN:
                        check_dcp(seg, self.parallel.tp, self.parallel.dcp, where)
                buf = self.memory.buffers.get((li, comp.name))
                if buf is None:
                    raise LayoutError(f"{where}no buffer in the memory layout")
                check_buffer(buf, comp, self.parallel.tp, where.rstrip(": "))
        self._check_strided_pages()
        aux = self.memory.aux
        if aux.dim("slot") is None or aux.size("elem") * aux.stride("elem") != self.spec.aux_bytes:
            raise LayoutError(
                f"aux buffer must be [slot, elem] with {self.spec.aux_bytes} bytes "
                f"a slot, got dims {aux.dims}"
            )

    def _check_strided_pages(self) -> None:
        """A page table indexes every buffer of its group alike: where one holds entries of
        one every ``stride`` tokens, each of the group's pages must cover as many tokens in
        every buffer (``page_size / stride`` entries beside ``page_size`` tokens), else the
        entries would be read from another page than their tokens'."""
        per_page: dict[str, dict[int, str]] = {}
        strided: set[str] = set()
        for li, layer in enumerate(self.spec.layers):
            for comp in layer.components:
                if comp.scope is not Scope.TOKEN:
                    continue
                buf = self.memory.buffers[(li, comp.name)]
                covers = buf.size("token") * comp.stride
                per_page.setdefault(buf.group, {}).setdefault(covers, f"layer {li} {comp.name}")
                if comp.stride > 1:
                    strided.add(buf.group)
        for group in sorted(strided):
            if len(per_page[group]) > 1:
                seen = ", ".join(f"{w}: {t} tokens" for t, w in sorted(per_page[group].items()))
                raise LayoutError(
                    f"page group {group!r}: its pages cover different numbers of tokens in its "
                    f"buffers ({seen}); a buffer of one entry every few tokens holds a page's "
                    f"tokens' entries"
                )
