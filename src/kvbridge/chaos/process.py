"""A rank in a process of its own, driven by commands over a pipe.

:class:`RankProcess` starts a process that builds one object (``factory(*args)``) and then
runs its methods as the parent asks, replying with the result or the error. The parent may
stall (SIGSTOP), resume or kill the process between any two commands: that is what the chaos
soak and the fencing tests need from a rank.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvbridge.deploy import shield
from kvbridge.wire import liveness

# Ranks fork from a server that has kvbridge imported already (a spawned rank spends most of
# a second of CPU importing it; the chaos and fencing tests start hundreds). What a rank needs
# comes in its arguments: the server's environment is the one it started with.
_CTX = shield.fork_context()


class RankError(RuntimeError):
    """A command raised inside the rank's process."""


def _serve(
    conn: Connection, factory: Callable[..., Any], args: tuple[Any, ...], netns: str | None
) -> None:
    import logging

    if netns:  # onto its host before anything opens a socket
        from kvbridge.deploy.netns import enter

        enter(netns)

    if os.environ.get("KVBRIDGE_RANK_LOG"):
        logging.basicConfig(
            level=os.environ["KVBRIDGE_RANK_LOG"].upper(),
            format="%(relativeCreated)d %(name)s %(message)s",
        )
    else:  # faults are the point here: a peer declared dead is no news on the terminal,
        # an error is (a handler that raised: what the soak then reports needs its traceback)
        handler = logging.StreamHandler()
        handler.setLevel(logging.ERROR)
        logging.getLogger("kvbridge").addHandler(handler)
    try:
        obj = factory(*args)
    except Exception as e:
        _reply(conn, ("err", f"{type(e).__name__}: {e}"))
        return
    if not _reply(conn, ("ok", None)):
        return
    while True:
        try:
            name, a, kw = conn.recv()
        except (EOFError, OSError):  # the parent is gone (its end closed, or reset: killed)
            return
        try:
            result = getattr(obj, name)(*a, **kw)
        except Exception as e:  # the parent sees the error as a reply
            reply: tuple[str, Any] = ("err", f"{type(e).__name__}: {e}")
        else:
            reply = ("ok", result)
        if not _reply(conn, reply) or name == "close":
            return


def _reply(conn: Connection, reply: tuple[str, Any]) -> bool:
    """Send ``reply``; False where the parent is gone (killed, or its end closed): nobody is
    left to answer, and a traceback would only reach the terminal it was interrupted on."""
    try:
        conn.send(reply)
    except OSError:
        return False
    return True


class RankProcess:
    """One process (forked from the fork server) serving ``factory(*args)``; :meth:`call` runs
    a method there. With ``netns``, the process runs in that network namespace (a host of
    :class:`kvbridge.deploy.netns.Network`)."""

    def __init__(
        self, name: str, factory: Callable[..., Any], *args: Any, netns: str | None = None
    ) -> None:
        self.name = name
        self._conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(
            target=_serve, args=(child, factory, args, netns), daemon=True, name=name
        )
        shield.start(self.proc)
        child.close()
        self.gone = False
        self._pending = 1  # the start-up reply

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def started(self, timeout: float = 60.0) -> RankProcess:
        self.drain(timeout)
        return self

    def start(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Send a command without waiting for its reply (collect it with :meth:`result`)."""
        self._conn.send((name, args, kwargs))
        self._pending += 1

    def result(self, timeout: float = 60.0) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.name} did not answer in {timeout} s")
        try:
            reply = self._conn.recv()
        except EOFError:
            raise RankError(f"{self.name} exited") from None
        self._pending -= 1
        if reply[0] == "err":
            raise RankError(f"{self.name}: {reply[1]}")
        return reply[1]

    def drain(self, timeout: float = 60.0) -> None:
        while self._pending:
            self.result(timeout)

    def call(self, name: str, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
        self.drain(timeout)
        self.start(name, *args, **kwargs)
        return self.result(timeout)

    def stopped(self) -> bool:
        """The process is stopped (SIGSTOP): state T in /proc."""
        return liveness.stopped(self.pid)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.join(10)
            self.gone = True

    def close(self, timeout: float = 30.0) -> None:
        if self.gone:
            return
        self.gone = True
        try:
            if self.stopped():
                os.kill(self.pid, signal.SIGCONT)
            self._pending = 0  # whatever was outstanding no longer matters
            self.call("close", timeout=timeout)
        except (TimeoutError, RankError, OSError, EOFError):
            pass
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)
