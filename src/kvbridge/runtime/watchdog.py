"""A rank's stall watchdog: every thread's Python stack, written when the rank stops ticking.

A rank whose control thread misses its ticks for seconds sends no heartbeats, and its peers
declare it dead: after the fact, the rank logs only that it "was paused". What held it (the
interpreter lock kept by a C call, a lock, a blocking call on a thread that must not block)
is visible only while it lasts. With ``KVBRIDGE_STALL_DUMP`` set, each tick re-arms
:func:`faulthandler.dump_traceback_later`, whose timer thread is C code that needs no
interpreter lock: a tick late by that many seconds writes every thread's stack to stderr (the
engine server's log), again every as many seconds while the stall lasts.

The timer is the process's one: several ranks in a process re-arm the same timer, so it fires
only when none of them ticks (which is what a frozen process looks like).
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_armed: set[int] = set()  # ids of the ranks that keep the timer armed
_broken = False  # no stderr with a file descriptor: said once, then never armed


def tick(owner: object, seconds: float) -> None:
    """``owner`` is alive now: the dump fires if no owner ticks within ``seconds``. Never
    raises: it runs on the thread that sends the rank's heartbeats."""
    global _broken
    if seconds <= 0 or _broken:
        return
    with _lock:
        if id(owner) not in _armed:
            _armed.add(id(owner))
            log.info(
                "stall watchdog armed: every thread's stack goes to stderr when this "
                "process's kvbridge ranks miss their ticks for %g s (KVBRIDGE_STALL_DUMP)",
                seconds,
            )
        for out in (sys.stderr, sys.__stderr__):  # an engine may have replaced sys.stderr
            if out is None:
                continue
            try:
                faulthandler.dump_traceback_later(seconds, repeat=True, file=out)
                return
            except (AttributeError, ValueError, OSError, RuntimeError):
                continue  # no file descriptor behind it
        _broken = True
        log.warning("stall watchdog off: this process's stderr has no file descriptor")


def stop(owner: object) -> None:
    """``owner`` ticks no more; the timer stops with the last owner."""
    with _lock:
        if id(owner) not in _armed:
            return
        _armed.discard(id(owner))
        if not _armed:
            faulthandler.cancel_dump_traceback_later()


def threads() -> str:
    """Which thread is which, for reading a dump (faulthandler names them by ident only)."""
    return ", ".join(f"{t.ident:#018x} {t.name}" for t in threading.enumerate())
