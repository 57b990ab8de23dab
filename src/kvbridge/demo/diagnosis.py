"""What a demo case that gave no result was waiting on, asked of its rank processes while they
wait (afterwards nothing says): every thread's stack, and each rank's requests.

A rank process arms two signals as it starts (:func:`arm`): SIGUSR1 has :mod:`faulthandler`
write every thread's stack (from C, whatever the interpreter is doing), SIGUSR2 has a thread
write :meth:`kvbridge.runtime.Bridge.describe` of its bridge once it has one (:func:`watch`;
a thread, since the main thread the signal interrupts may hold a lock the description takes).
On a case's timeout the runner signals the ranks that did not answer and puts what they wrote
in the case's problem (:func:`ask`); the files go when the case ends (:func:`removing`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

WAIT = 1.0  # seconds the ranks get to write, at most, once signalled


def _file(pid: int, what: str) -> Path:
    return Path(tempfile.gettempdir()) / f"kvbridge-demo-{pid}.{what}"


def arm() -> None:
    """In a rank process, first thing: SIGUSR1 writes its stacks. (Before anything else: the
    default action of SIGUSR1 ends the process.) Without a temp dir the case runs the same."""
    with contextlib.suppress(OSError):
        dump = open(_file(os.getpid(), "stacks"), "w")  # noqa: SIM115 (the process's life)
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # until the bridge is there (watch)


def watch(bridge: Any) -> None:
    """SIGUSR2 writes ``bridge``'s requests and their state (a thread does: see above)."""
    path = _file(os.getpid(), "state")

    def write() -> None:
        with contextlib.suppress(OSError):
            path.write_text(bridge.describe())

    signal.signal(signal.SIGUSR2, lambda *_: threading.Thread(target=write, daemon=True).start())


def ask(procs: dict[tuple[str, int], Any], frames: int = 4) -> str:
    """The innermost ``frames`` of every thread of each live process of ``procs`` (those of
    the threading and multiprocessing modules left out), then its requests' state."""
    live = {k: p for k, p in procs.items() if p.exitcode is None and p.pid is not None}
    for p in live.values():
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
    _written(live.values())
    out = []
    for (role, index), p in live.items():
        out.append(f"\n--- {role} rank {index} (pid {p.pid}):")
        stacks = _read(p.pid, "stacks")
        for thread in stacks.split("\n\n"):
            head, *calls = thread.strip().splitlines() or [""]
            ours = [c for c in calls if "/threading.py" not in c and "/multiprocessing/" not in c]
            out.extend([head, *ours[:frames]])
        out.append(_read(p.pid, "state"))
    return "\n".join(out)


def _written(procs: Iterable[Any]) -> None:
    """Returns once each process wrote both files, or WAIT seconds on (a process stopped, or
    in a C call that never gives the interpreter back, writes nothing)."""
    end = time.monotonic() + WAIT
    while time.monotonic() < end and not all(
        _size(p.pid, what) for p in procs for what in ("stacks", "state")
    ):
        time.sleep(0.02)


def _size(pid: int, what: str) -> int:
    try:
        return _file(pid, what).stat().st_size
    except OSError:
        return 0


def _read(pid: int, what: str) -> str:
    try:
        text = _file(pid, what).read_text()
    except FileNotFoundError:
        text = ""
    except OSError as e:
        return f"(no {what}: {e})"
    # Nothing: SIGSTOPped, or a C call that never gives the interpreter back.
    return text if text.strip() else f"(no {what} written within {WAIT:g} s)"


@contextlib.contextmanager
def removing(procs: Iterable[Any]) -> Iterator[None]:
    """The block (which ends ``procs``), then their files removed, on an error and Ctrl-C
    too."""
    try:
        yield
    finally:
        for p in procs:
            for what in ("stacks", "state"):
                if p.pid is not None:
                    with contextlib.suppress(OSError):
                        _file(p.pid, what).unlink()
