"""Imported at start-up by the NixlConnector servers of the vLLM benchmarks' ``--nixl-poll-us``
way (this folder first on their ``PYTHONPATH``): NIXL's UCX progress thread waits up to
``KVBRIDGE_BENCH_NIXL_POLL_US`` microseconds for its workers' events between looks, instead of
not at all.

Why: NIXL's Python API builds its agent with ``pthrDelay = 0`` whatever the caller asks, and
its UCX backend's progress thread then calls ``poll()`` with a timeout of 0, in a loop: a whole
core per vLLM worker, busy whether or not anything moves (docs/benchmarks.md measures it). vLLM
exposes no setting for it. The delay is rounded up to whole milliseconds by NIXL; the thread
still wakes at once on a worker's event. A benchmark's tool, not kvbridge's code. (First on
the path, it hides any other ``sitecustomize`` there; neither engine venv has one.)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

DELAY_US = int(os.environ.get("KVBRIDGE_BENCH_NIXL_POLL_US", "1000"))


class _PatchNixl(importlib.abc.MetaPathFinder):
    """Finds NIXL's ``_api`` module (``nixl_cu12._api`` and the like) as Python would, and
    patches it once loaded: its agent's config never takes a progress delay under
    ``DELAY_US``."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not (name.startswith("nixl") and name.endswith("._api")):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            bind = getattr(module, "nixlBind", None)
            if bind is None:  # not NIXL's bindings (another nixl* package): left as loaded
                return
            base = bind.nixlAgentConfig

            class Config(base):  # type: ignore[misc, valid-type]
                @property
                def pthrDelay(self) -> int:  # (NIXL's name)
                    return base.pthrDelay.__get__(self)  # type: ignore[no-any-return]

                @pthrDelay.setter
                def pthrDelay(self, us: int) -> None:
                    base.pthrDelay.__set__(self, max(us, DELAY_US))

            bind.nixlAgentConfig = Config
            print(f"kvbridge bench: NIXL's progress thread waits {DELAY_US} us", file=sys.stderr)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchNixl())
