"""KVBRIDGE_STALL_DUMP: a rank whose process stops running Python (here: a C call that keeps
the interpreter lock, as a hung extension would) writes every thread's stack to stderr while
the stall lasts, its control thread's among them; unset, or once the rank is closed, nothing
is written. Each case is a process of its own: the watchdog's timer is the process's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

RANK = textwrap.dedent(
    """
    import ctypes, logging, time
    logging.basicConfig(level=logging.INFO)
    from kvbridge import CacheSpec, DType, ParallelLayout, build_memory
    from kvbridge.memory.pools import HostPool
    from kvbridge.model.spec import attention_layer
    from kvbridge.runtime import Bridge
    from kvbridge.wire.protocol import Role

    spec = CacheSpec("m", (attention_layer(2, 8, DType.BFLOAT16),))
    par = ParallelLayout.even(1, 1)
    mem = build_memory(spec, par, page_size=4, num_pages=4)
    pool = HostPool(mem.regions, shared=False)
    bridge = Bridge(
        role=Role.DECODE, spec=spec, parallel=par, rank=0, memory=mem, regions=pool,
        transport="inproc",
    ).start()
    time.sleep(1.0)  # ticks: the watchdog is armed
    hold = ctypes.PyDLL(None).sleep  # PyDLL keeps the interpreter lock through the call
    print("stalling", flush=True)
    hold({stall})
    print("closing", flush=True)
    bridge.close()
    hold({after})
    print("done", flush=True)
    """
)
HELD_LINE = RANK.splitlines().index("hold({stall})") + 1


def run(stall: int, after: int, dump: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_STALL_DUMP"}
    if dump is not None:
        env["KVBRIDGE_STALL_DUMP"] = dump
    return subprocess.run(
        [sys.executable, "-c", RANK.format(stall=stall, after=after)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow  # processes that stall for seconds: 4-25 s
def test_a_rank_frozen_with_the_interpreter_held_writes_every_threads_stack() -> None:
    got = run(stall=3, after=0, dump="1")
    assert got.returncode == 0, got.stderr
    assert "stall watchdog armed" in got.stderr
    dumps = got.stderr.split("Timeout (0:00:01)!")[1:]
    assert len(dumps) >= 2, got.stderr  # again every second while it lasts
    # The frozen control thread and the thread that holds the interpreter, in every dump.
    for d in dumps:
        assert "kvbridge/runtime/control.py" in d, d
        assert f'"<string>", line {HELD_LINE}' in d, d  # the main thread's held call


@pytest.mark.slow
def test_unset_or_closed_nothing_is_written() -> None:
    off = run(stall=2, after=0, dump=None)
    assert off.returncode == 0, off.stderr
    assert "Timeout" not in off.stderr and "armed" not in off.stderr
    closed = run(stall=0, after=2, dump="1")
    assert closed.returncode == 0, closed.stderr
    assert "stall watchdog armed" in closed.stderr
    assert "Timeout" not in closed.stderr, closed.stderr


@pytest.mark.slow  # starts processes: the fast tier's are in-process
@pytest.mark.parametrize("bad", ["-1", "soon"])
def test_a_bad_value_is_refused_naming_the_variable(bad: str) -> None:
    got = run(stall=0, after=0, dump=bad)
    assert got.returncode != 0
    assert "KVBRIDGE_STALL_DUMP" in got.stderr or "stall_dump" in got.stderr, got.stderr


def test_a_stderr_without_a_descriptor_turns_it_off_and_the_tick_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The tick arms the watchdog on the thread that sends heartbeats: where the engine has
    replaced stderr with something that has no file descriptor, it says so once and is off,
    never raising there."""
    import io
    import logging

    from kvbridge.runtime import watchdog

    monkeypatch.setattr(watchdog, "_broken", False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setattr(sys, "__stderr__", io.StringIO())
    caplog.set_level(logging.WARNING, logger="kvbridge.runtime.watchdog")
    owner = object()
    try:
        for _ in range(3):
            watchdog.tick(owner, 1.0)
    finally:
        watchdog.stop(owner)
    off = [r for r in caplog.records if "stall watchdog off" in r.getMessage()]
    assert len(off) == 1, caplog.records
