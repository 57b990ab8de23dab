"""A fork server for engine servers on CPU: one process of an engine's environment imports the
engine once, and every server of that engine asked of it afterwards is forked from it, already
imported. For the tests and benchmarks that start many servers on one machine; never on a GPU
(CUDA does not survive fork).

Why: :mod:`kvbridge.integrations.forked` starts a server's own processes by fork, but each
server's first process still imports its engine: ``sglang.launch_server`` with the modules its
server runs 15-16 s of CPU on this project's 2-core machines, vLLM's ``serve`` 13-14 s, most of
what a forked server costs to start (docs/testing.md). Started by this fork server, a server
runs as it would under ``python -m kvbridge.integrations.forked MODULE ARGS`` (its own session
and process group, its environment, its log, its cores), from a process that imported it.

What a server inherits that it would otherwise compute itself: what the engine's modules read
from the environment when imported. The fork server imports them with the environment of the
first server asked of it (a private ``PROMETHEUS_MULTIPROC_DIR`` in place of that server's,
whose multiprocess mode prometheus_client picks at import: see
:mod:`kvbridge.integrations.forked`), so servers whose import-time settings differ (e.g.
``TORCH_COMPILE_DISABLE``) need fork servers of their own: :func:`start` keys them by those.

``python -m kvbridge.integrations.forkserver SOCKET MODULE...`` runs one: it imports the
modules, listens on the Unix socket, answers each request (argv, environment, directory, cores,
and the log as a passed descriptor) with the pid of the server it forked, and, on the same
connection, with its exit status once it ended. It exits when its standard input closes (the
process that started it is gone).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from kvbridge.integrations import forked

# Variables an engine's modules read when imported, which a forked server keeps from the fork
# server: servers that differ in one get fork servers of their own.
IMPORT_TIME_VARIABLES = (
    "PYTHONPATH",
    "TORCH_COMPILE_DISABLE",
    "OMP_NUM_THREADS",
    "SGLANG_USE_CPU_ENGINE",
)
_READY = b"ready\n"
_MAX_REQUEST = 1 << 20
_START_TIMEOUT = 600.0  # its imports: 15 s on an idle 2-core machine


class ForkServerError(RuntimeError):
    """A fork server that could not start, or that is gone before its server ended."""


# ---- the fork server's side ----------------------------------------------------------------


def _serve(path: str, modules: Sequence[str]) -> None:
    try:
        _serve_in(path, modules)
    finally:  # its directory is its own (its client may be gone without a word)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _serve_in(path: str, modules: Sequence[str]) -> None:
    forked.patch()  # before the engine's modules bind multiprocessing's functions
    for name in modules:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "listener")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    os.write(sys.stdout.fileno(), _READY)
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # whoever started us is gone
            elif key.data == "listener":
                conn, _ = listener.accept()
                pid = _launch(conn, sel)
                if pid is None:
                    conn.close()
                else:
                    pidfd = os.pidfd_open(pid)
                    sel.register(pidfd, selectors.EVENT_READ, (pid, conn))
            else:
                pid, conn = key.data
                sel.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # its client may be gone
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                conn.close()


def _launch(conn: socket.socket, sel: selectors.BaseSelector) -> int | None:
    """Fork the server ``conn`` asks for; its pid (sent back on ``conn`` too), or None where
    the request was malformed (said on ``conn``). The server keeps none of the fork server's
    descriptors (``sel``'s: the listener, the other servers' connections and pidfds)."""
    fds: list[int] = []
    try:
        data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 1)
        req = json.loads(data)
        argv, env, cwd, cpus = req["argv"], req["env"], req["cwd"], req["cpus"]
        if len(fds) != 1:
            raise ValueError(f"expected the log's descriptor, got {len(fds)}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.send(f"error: {type(e).__name__}: {e}".encode())
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the server: never returns
        for key in list(sel.get_map().values()):
            if key.data == "listener":
                key.fileobj.close()  # type: ignore[union-attr]
            elif key.data != "stdin":
                os.close(key.fd)  # another server's pidfd, and its client's connection
                key.data[1].close()
        sel.close()
        conn.close()
        _become(argv, env, cwd, cpus, fds[0])
    os.close(fds[0])
    with contextlib.suppress(OSError):  # its client may be gone: it learns of its end alone
        conn.send(str(pid).encode())
    return pid


def _become(
    argv: list[str], env: dict[str, str], cwd: str, cpus: list[int] | None, log: int
) -> NoReturn:
    code = 1
    try:
        os.setsid()  # a process group of its own, as the launch helpers start servers
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        if cpus:
            os.sched_setaffinity(0, cpus)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        with contextlib.suppress(ImportError):  # (the engines' venvs have it) ps shows the
            title = importlib.import_module("setproctitle")  # server, not its fork server
            title.setproctitle(" ".join([sys.executable, "-m", *argv]))
        forked.main(argv)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def main(argv: list[str]) -> None:
    if len(argv) < 1 or argv[0].startswith("-"):
        raise SystemExit("usage: python -m kvbridge.integrations.forkserver SOCKET [MODULE...]")
    _serve(argv[0], argv[1:])


# ---- the client's side ---------------------------------------------------------------------


@dataclass
class Child:
    """A server a fork server started: not our child, so its status comes from the fork server
    (on the connection that asked for it). ``poll``, ``wait`` and ``returncode`` as
    :class:`subprocess.Popen`'s."""

    pid: int
    conn: socket.socket
    returncode: int | None = None

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return code

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self.conn.settimeout(timeout)
            try:
                data = self.conn.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            if not data:
                raise ForkServerError(f"the fork server of pid {self.pid} is gone before it")
            self.returncode = int(data)
            self.conn.close()
        return self.returncode


@dataclass
class _Server:
    proc: subprocess.Popen[bytes]
    path: str


_Key = tuple[str, tuple[str, ...], tuple[str | None, ...]]
_SERVERS: dict[_Key, _Server] = {}
_LOCK = threading.Lock()


def start(
    python: Path,
    argv: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    preload: Sequence[str],
    cpus: Sequence[int] | None = None,
    cwd: Path | None = None,
) -> Child:
    """``python -m kvbridge.integrations.forked ARGV`` with ``env``, its output written to
    ``log``, on ``cpus`` if given, forked from a fork server of ``python`` that imported
    ``preload`` (started at the first call, with this call's environment, and kept until this
    process exits)."""
    key = _key(python, preload, env)
    with _LOCK:
        server = _SERVERS.get(key)
        if server is None or server.proc.poll() is not None:
            server = _SERVERS[key] = _start_server(python, preload, env, log)
    request = {
        "argv": list(argv),
        "env": dict(env),
        "cwd": str(cwd or Path.cwd()),
        "cpus": list(cpus) if cpus else None,
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with open(log, "wb") as out:
        conn.connect(server.path)
        socket.send_fds(conn, [json.dumps(request).encode()], [out.fileno()])
    reply = conn.recv(4096).decode()
    if not reply.isdigit():
        conn.close()
        raise ForkServerError(f"the fork server of {python} refused {argv[:1]}: {reply or 'EOF'}")
    return Child(int(reply), conn)


def _key(python: Path, preload: Sequence[str], env: Mapping[str, str]) -> _Key:
    return (str(python), tuple(preload), tuple(env.get(v) for v in IMPORT_TIME_VARIABLES))


def _start_server(
    python: Path, preload: Sequence[str], env: Mapping[str, str], log: Path
) -> _Server:
    tmp = tempfile.mkdtemp(prefix="kvbridge-forkserver-")  # the fork server removes it
    path = os.path.join(tmp, "socket")
    e = dict(env)
    if "PROMETHEUS_MULTIPROC_DIR" in e:  # its own: not the first server's
        os.mkdir(metrics := os.path.join(tmp, "metrics"))
        e["PROMETHEUS_MULTIPROC_DIR"] = metrics
    errors = log.with_name(f"{log.stem}.forkserver.log")
    with open(errors, "wb") as err:
        proc = subprocess.Popen(
            [str(python), "-m", "kvbridge.integrations.forkserver", path, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=e,
            start_new_session=True,  # a Ctrl-C of the tests is not its
        )
    assert proc.stdout is not None
    ready = b""
    if select.select([proc.stdout], [], [], _START_TIMEOUT)[0]:
        ready = proc.stdout.readline()
    if ready != _READY:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        tail = errors.read_text(errors="replace")[-3000:]
        raise ForkServerError(f"the fork server of {python} did not start:\n{tail}")
    server = _Server(proc, path)
    atexit.register(_stop, server)
    return server


def _stop(server: _Server) -> None:
    assert server.proc.stdin is not None
    with contextlib.suppress(OSError):
        server.proc.stdin.close()  # it exits at the end of its input
    try:
        server.proc.wait(10)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        shutil.rmtree(os.path.dirname(server.path), ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
