"""kvbridge: move the KV cache of LLM requests from prefill ranks to decode ranks.

Public names are re-exported here; modules are one concept each (see docs/architecture.md).
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import CodeType, ModuleType
from typing import Any

from kvbridge.config import Settings
from kvbridge.errors import (
    BootstrapError,
    FailureKind,
    IncompatibleError,
    KVBridgeError,
    LayoutError,
    PlacementError,
    ProtocolError,
    SpecError,
    TransferFailed,
    TransportError,
    TransportUnavailable,
)
from kvbridge.memory.pools import HostPool, RegionMemory
from kvbridge.model.spec import CacheSpec, Component, DType, LayerKind, LayerSpec, Scope, Segment
from kvbridge.planner.layout import BufferLayout, Dim, KVLayout, Region, SideMemory, build_memory
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Pairing, Side, plan
from kvbridge.planner.runs import Runs
from kvbridge.planner.transferplan import PairPlan, Part, PartKind, TransferPlan
from kvbridge.runtime import Bridge
from kvbridge.runtime.status import KVPoll
from kvbridge.wire.protocol import Role

# The modules that moved into the layer packages on 2026-11-27 still import from their old
# paths (``from kvbridge.layout import KVLayout``), as the same module objects, with a
# DeprecationWarning that names the new path. (``kvbridge.memory`` is a package now and
# re-exports the old module's names.)
_MOVED = {
    "spec": "model.spec",
    "modelconfig": "model.modelconfig",
    "hf": "model.hf",
    "shard": "planner.shard",
    "tokenmap": "planner.tokenmap",
    "parallel": "planner.parallel",
    "layout": "planner.layout",
    "placement": "planner.placement",
    "runs": "planner.runs",
    "transferplan": "planner.transferplan",
    "pieces": "planner.pieces",
    "side": "planner.side",
    "pairitems": "planner.pairitems",
    "plan": "planner.plan",
    "reference": "planner.reference",
    "sidespec": "planner.sidespec",
    "location": "memory.location",
    "device": "memory.device",
    "copy": "memory.copy",
    "integrity": "memory.integrity",
    "liveness": "wire.liveness",
    "protocol": "wire.protocol",
    "status": "runtime.status",
    "timeline": "runtime.timeline",
    "staging.pool": "runtime.staging_pool",
    "groups": "bootstrap.groups",
    "cluster": "deploy.cluster",
    "shield": "deploy.shield",
    "chaos.netns": "deploy.netns",
    "chaos.linkdelay": "deploy.linkdelay",
    "options": "cli.options",
    "plan_report": "cli.plan_report",
    "configref": "cli.configref",
    "bench.cli": "cli.bench",
}


def _new_path(name: str) -> str | None:
    """The new dotted path of an old one, or None where ``name`` did not move."""
    if not name.startswith("kvbridge."):
        return None
    rest = name.removeprefix("kvbridge.")
    for old in sorted(_MOVED, key=len, reverse=True):
        if rest == old or rest.startswith(old + "."):
            return "kvbridge." + _MOVED[old] + rest.removeprefix(old)
    return None


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and hands back the module at its new one (which it never touches:
    the import system takes what ``exec_module`` leaves in ``sys.modules``)."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return None if _new_path(name) is None else importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder, replaced in exec_module

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = _moved(module.__name__)

    def get_code(self, fullname: str) -> CodeType | None:
        """``python -m OLD``: the new module's code, run as ``__main__``."""
        new = _moved(fullname, imported=False)
        spec = importlib.util.find_spec(new)
        loader = spec.loader if spec is not None else None
        return loader.get_code(new) if isinstance(loader, importlib.abc.InspectLoader) else None

    def is_package(self, fullname: str) -> bool:
        spec = importlib.util.find_spec(_new_path(fullname) or fullname)
        return spec is not None and spec.submodule_search_locations is not None


def _moved(old: str, *, imported: bool = True) -> Any:
    """The module (or, not ``imported``, the name) at ``old``'s new path, warning of it."""
    new = _new_path(old)
    assert new is not None
    module = importlib.import_module(new) if imported else new
    warnings.warn(f"{old} moved to {new}", DeprecationWarning, stacklevel=3)
    return module


if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
    sys.meta_path.insert(0, _OldPaths())
# ``kvbridge.plan`` is the planner's function too: imported through the finder, the import
# system would bind the module over it.
sys.modules.setdefault("kvbridge.plan", sys.modules["kvbridge.planner.plan"])

__version__ = "0.1.0"

__all__ = [
    "BootstrapError",
    "Bridge",
    "BufferLayout",
    "CacheSpec",
    "Component",
    "DType",
    "Dim",
    "FailureKind",
    "HostPool",
    "IncompatibleError",
    "KVBridgeError",
    "KVLayout",
    "KVPoll",
    "LayerKind",
    "LayerSpec",
    "LayoutError",
    "PairPlan",
    "Pairing",
    "ParallelLayout",
    "Part",
    "PartKind",
    "Placement",
    "PlacementError",
    "ProtocolError",
    "Region",
    "RegionMemory",
    "Role",
    "Runs",
    "Scope",
    "Segment",
    "Settings",
    "Side",
    "SideMemory",
    "SpecError",
    "TransferFailed",
    "TransferPlan",
    "TransportError",
    "TransportUnavailable",
    "build_memory",
    "plan",
]
