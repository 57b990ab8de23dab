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
        aux = self.memory.aux
        if aux.dim("slot") is None or aux.size("elem") * aux.stride("elem") != self.spec.aux_bytes:
            raise LayoutError(
                f"aux buffer must be [slot, elem] with {self.spec.aux_bytes} bytes "
                f"a slot, got dims {aux.dims}"
            )
