"""Where kvbridge's threads may run inside an engine's process."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def any_core() -> Iterator[None]:
    """Run with the calling thread free to use every core, so that the threads it starts are.
    Engines pin their threads to cores (vLLM each CPU worker thread; SGLang's servers under
    taskset or its own CPU binding) and a thread inherits its creator's pin: kvbridge's threads
    (heartbeats, control, transfers, the bootstrap service), started from the engine's thread,
    would share its core with OpenMP threads that spin, and starve (on 2 cores: bootstrap and
    heartbeats silent 30 s under vLLM; SGLang prefill ranks declared dead after 3 s)."""
    if not hasattr(os, "sched_setaffinity"):  # pragma: no cover - not Linux
        yield
        return
    pinned = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:  # a cpuset narrower than the machine: keep what we have
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
