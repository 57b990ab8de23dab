"""Processes shielded from the terminal's Ctrl-C, and ended with the command.

Ctrl-C sends SIGINT to the terminal's whole process group: the command and every process it
started. A child that takes it dies wherever it is, printing its own KeyboardInterrupt
traceback (a rank importing kvbridge, a fork server importing torch). Children started here
ignore SIGINT (a disposition kept through fork and exec): the command alone is interrupted,
and its cleanup ends them (:func:`running` kills them at once when its block raises).

A spawned child inherits SIG_IGN, set while it is forked (a start that returns at once: a
Ctrl-C in that instant is lost). A fork server's child inherits the server's disposition (the
server is started ignoring SIGINT, before its preload imports anything); its start waits for
the server, seconds while the server imports torch, so a Ctrl-C meanwhile is held and raised
once every process has started and has a pid to kill (raised halfway, it would leave a child
reading what its dead parent sent, which fails with a traceback of its own).
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext, ForkServerProcess
from multiprocessing.process import BaseProcess
from typing import Any

from kvbridge.wire.liveness import stopped

# A process has one fork server, started by whichever of its users comes first with the preload
# set then: so every user asks for all of them. The demo's workers import torch and transformers
# (seconds a rank, where the server started without them: a test module of demo runs 14 -> 40 s
# after a module of chaos ranks); the cluster's and the chaos ranks' import kvbridge alone. The
# server skips a module that cannot be imported (the demo's extras not installed). A command
# process whose command runs none of the demo's ranks leaves them out (:func:`without_demo`).
PRELOAD = (
    "kvbridge.deploy.cluster",
    "kvbridge.runtime",
    "kvbridge.planner.reference",
    "kvbridge.chaos.process",
    "kvbridge.demo.run",
    "kvbridge.demo.workers",
)


DEMO = ("kvbridge.demo.workers",)  # torch and transformers
_command_process = False
_demo = True  # whether the fork server imports the demo's modules


def command_process() -> None:
    """This process runs one ``kvbridge`` command and exits (its console script, ``python -m
    kvbridge``): its fork server may import only what that command's ranks run."""
    global _command_process
    _command_process = True


def without_demo() -> None:
    """The command running runs none of the demo's ranks (``bench``, ``chaos``): in a command
    process, its fork server, started after this, leaves out torch and transformers (7-8 s of
    CPU; a one-request bench 11.2 -> 3.4 core-s). A command called inside another process (a
    test's in-process call) changes nothing: that process's later demo ranks would come from
    the same fork server, and each import torch (a test module of demo cases 78 -> 1,156
    core-s)."""
    global _demo
    if _command_process:
        _demo = False


def preload() -> tuple[str, ...]:
    """What a fork server started now imports: :data:`PRELOAD`, less the demo's after
    :func:`without_demo` in a command process."""
    return PRELOAD if _demo else tuple(m for m in PRELOAD if m not in DEMO)


def fork_context() -> ForkServerContext:
    """The fork server's context, with every user's preload (:func:`preload`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload()))
    return ctx


def start(*procs: BaseProcess) -> None:
    """Start ``procs``, none of which Ctrl-C reaches."""
    if threading.current_thread() is not threading.main_thread():
        for p in procs:  # only the main thread handles signals; commands start from it
            p.start()
        return
    held: list[int] = []
    served = all(isinstance(p, ForkServerProcess) for p in procs)
    if served:
        _fork_server()
    previous: Any = signal.signal(
        signal.SIGINT, (lambda *_: held.append(1)) if served else signal.SIG_IGN
    )
    try:
        for p in procs:
            p.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and callable(previous):
        previous(signal.SIGINT, None)  # what the command had: KeyboardInterrupt by default


def _fork_server() -> None:
    """Start the fork server (with the preload set on its context) ignoring SIGINT, if it is
    not running: a child exec'd while a handler is set would get the default back."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()  # returns at once; the server imports in the background
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def running(*procs: BaseProcess, grace: float = 10.0) -> Iterator[None]:
    """``procs`` started for the block. After it, they have ``grace`` seconds, together, to
    end before those left are killed (not each: a demo case with two stopped ranks waited
    twice its grace), a stopped one (SIGSTOP) at once: it cannot end by itself; if the block
    raises (Ctrl-C included), each is killed at once."""
    try:
        start(*procs)
        yield
    except BaseException:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
        raise
    finally:
        deadline = time.monotonic() + grace
        for p in procs:  # before any wait: a live one may be waiting on a stopped peer
            if p.pid is not None and p.exitcode is None and stopped(p.pid):
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
                p.join(5)
