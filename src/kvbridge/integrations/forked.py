"""``python -m kvbridge.integrations.forked MODULE [ARGS]``: run ``python -m MODULE ARGS`` with
the processes it starts by spawn started by fork instead. For engine servers on CPU only.

Why: SGLang sets the spawn start method, and vLLM's CPU platform spawns its engine core and
workers, so each process of a server imports the engine afresh: 6-8 s of CPU each on this
project's 2-core machines. A forked one starts from its parent's imports. A TP 2 SGLang prefill
beside a TP 1 decode: 78 core-s and 42 s to healthy spawned, 37 core-s and 21 s forked
(docs/testing.md). Never on a GPU: CUDA does not survive fork, which is why engines spawn. The
engines load their plugins (kvbridge's) once per process: a forked child finds them loaded and
their hooks applied.

What a forked child inherits that a spawned one recomputes: what its modules derived at import
from variables the engine sets later. One such matters: prometheus_client picks its
multiprocess mode at import from ``PROMETHEUS_MULTIPROC_DIR``, which SGLang sets after its
launcher imported it, so forked schedulers' metrics never reach ``/metrics`` unless the
variable is set before (:func:`kvbridge.integrations.sglang.launch.serve` sets it). Not for
vLLM: given the variable, vLLM serves only file-backed metrics, none of its connectors' own.
"""

from __future__ import annotations

import multiprocessing
import runpy
import sys
from multiprocessing.context import BaseContext

_set_start_method = multiprocessing.set_start_method
_get_context = multiprocessing.get_context


def _fork_for_spawn(method: str | None) -> str | None:
    return "fork" if method == "spawn" else method


def _set_start_method_forking(method: str | None, force: bool = False) -> None:
    _set_start_method(_fork_for_spawn(method), force=force)


def _get_context_forking(method: str | None = None) -> BaseContext:
    return _get_context(_fork_for_spawn(method))


def patch() -> None:
    """Make this process start by fork what it asks to spawn. Before the engine runs: the
    engines call these through the module, or bind them when their own modules are imported,
    after this (:mod:`kvbridge.integrations.forkserver` calls it before it imports them)."""
    setattr(multiprocessing, "set_start_method", _set_start_method_forking)  # noqa: B010
    setattr(multiprocessing, "get_context", _get_context_forking)  # noqa: B010 (overloaded)


def main(argv: list[str]) -> None:
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m kvbridge.integrations.forked MODULE [ARGS]")
    patch()
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
