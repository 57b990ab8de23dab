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
What the runtime libraries fixed when loaded is the fork server's too: OpenMP's default thread
count follows the fork server's cores, not a server's ``cpus`` (set ``OMP_NUM_THREADS`` where
servers are pinned, as the tests do).

``python -m kvbridge.integrations.forkserver SOCKET MODULE...`` runs one: it imports the
modules, listens on the Unix socket, answers each request (argv, environment, directory, cores,
network namespace, and the log as a passed descriptor) with the pid of the server it forked
once that is set up (or with why it could not be), and, on the same connection, with its exit
status once it ended. It exits when its standard input closes (the process that started it is
gone).
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

from kvbridge.integrations import forked, namespace

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
_REPLY_TIMEOUT = 120.0  # a fork and a few calls, on a loaded machine


class ForkServerError(RuntimeError):
    """A fork server that could not start, or that is gone before its server ended."""


# ---- the fork server's side ----------------------------------------------------------------


def _serve(path: str, modules: Sequence[str]) -> None:
    try:
        _serve_in(path, modules)
    finally:  # its directory is its own (its client may be gone without a word)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _serve_in(path: str, modules: Sequence[str]) -> None:
    # The client reads one line from our standard output: whatever the imports or the servers
    # print goes to the log instead, never into a pipe nobody reads after that line.
    ready = os.dup(1)
    os.dup2(2, 1)
    with contextlib.suppress(ImportError):  # it finds the command line to retitle only while
        importlib.import_module("setproctitle").getproctitle()  # the environment is whole
    forked.patch()  # before the engine's modules bind multiprocessing's functions
    for name in modules:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "listener")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    os.write(ready, _READY)
    os.close(ready)
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # whoever started us is gone
            elif key.data == "listener":
                conn, _ = listener.accept()
                try:
                    _answer(conn, sel)
                except OSError:  # one request's failure (a fork refused, its client gone)
                    traceback.print_exc()
                    conn.close()
            else:
                pid, conn = key.data
                sel.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # its client may be gone
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                conn.close()


def _answer(conn: socket.socket, sel: selectors.BaseSelector) -> None:
    """Fork the server ``conn`` asks for and send its pid once it is set up (its session, log,
    cores, directory and environment), or why it could not be; watch it to send its exit
    status on ``conn`` too."""
    fds: list[int] = []
    try:
        data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 1)
        req = json.loads(data)
        argv, env, cwd, cpus = req["argv"], req["env"], req["cwd"], req["cpus"]
        netns = req.get("netns")  # (None: the fork server's own)
        if len(fds) != 1:
            raise ValueError(f"expected the log's descriptor, got {len(fds)}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        for fd in fds:
            os.close(fd)
        conn.send(f"error: {type(e).__name__}: {e}".encode())
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    setup, done = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server: never returns into this loop, whatever happens
        try:
            os.close(setup)
            for key in list(sel.get_map().values()):
                if key.data == "listener":
                    key.fileobj.close()  # type: ignore[union-attr]
                elif key.data != "stdin":
                    os.close(key.fd)  # another server's pidfd, and its client's connection
                    key.data[1].close()
            sel.close()
            conn.close()
            _become(argv, env, cwd, cpus, netns, fds[0], done)
        finally:
            os._exit(1)
    os.close(done)
    os.close(fds[0])
    with os.fdopen(setup, "rb") as why:
        error = why.read().decode(errors="replace")  # nothing: it closed its end once set up
    if error:
        os.waitpid(pid, 0)
        conn.send(f"error: {error}".encode())
        conn.close()
        return
    sel.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
    with contextlib.suppress(OSError):  # its client may be gone: it learns of its end alone
        conn.send(str(pid).encode())


def _become(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    cpus: list[int] | None,
    netns: str | None,
    log: int,
    done: int,
) -> NoReturn:
    """Set this forked process up as the server (saying why on ``done`` where it cannot, and
    closing ``done`` once it is), then run it. Its signal handlers are the fork server's, which
    it never changes: those of a process its client starts afresh (Python's own: SIGPIPE
    ignored, a write to a closed socket an error; SIGINT a KeyboardInterrupt unless ignored)."""
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)  # first: what fails below is in the server's log too
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.setsid()  # a process group of its own, as the launch helpers start servers
        if netns:  # a host of its own, as `ip netns exec` would run it (its sockets there)
            namespace.enter(netns)
        if cpus:
            os.sched_setaffinity(0, cpus)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        with contextlib.suppress(ImportError):  # ps shows the server, not its fork server
            title = importlib.import_module("setproctitle")
            title.setproctitle(" ".join([sys.executable, "-m", *argv]))
    except BaseException as e:
        os.write(done, f"could not set the server up: {type(e).__name__}: {e}".encode())
        os._exit(1)
    os.close(done)
    code = 1
    try:
        sys.modules.pop(argv[0], None)  # run afresh as __main__, as `python -m` runs it
        forked.main(argv)
        code = 0
        for t in threading.enumerate():  # as an interpreter's exit: its threads end first
            if t is not threading.current_thread() and not t.daemon:
                t.join()
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

# The status of a server whose fork server went before it: it ended, with a status nobody can
# know any more (255, as ssh reports a lost remote status).
LOST = 255


@dataclass
class Child:
    """A server a fork server started: not our child, so its status comes from the fork server
    (on the connection that asked for it), and where that is gone, only whether it ended (its
    own pidfd: ``LOST``). ``poll``, ``wait`` and ``returncode`` as :class:`subprocess.Popen`'s."""

    pid: int
    conn: socket.socket
    pidfd: int | None  # None: it ended before we could open one (its status is on conn)
    returncode: int | None = None
    lost: bool = False

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return code

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not self.lost:
            self.conn.settimeout(timeout)
            try:
                data = self.conn.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            except OSError:
                data = b""
            if data:
                return self._ended(int(data))
            self.lost = True
        if self.pidfd is not None and not select.select([self.pidfd], [], [], timeout)[0]:
            return None
        return self._ended(LOST)

    def _ended(self, code: int) -> int:
        self.returncode = code
        self.conn.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        return code


@dataclass
class _Server:
    proc: subprocess.Popen[bytes]
    path: str


_Key = tuple[str, tuple[str, ...], tuple[str | bool | None, ...]]
_SERVERS: dict[_Key, _Server] = {}
_LOCK = threading.Lock()  # (held while one starts: who asks for another waits, not two start)


def start(
    python: Path,
    argv: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    preload: Sequence[str],
    cpus: Sequence[int] | None = None,
    cwd: Path | None = None,
    netns: str | None = None,
) -> Child:
    """``python -m kvbridge.integrations.forked ARGV`` with ``env``, its output written to
    ``log``, on ``cpus`` if given, in network namespace ``netns`` if given (entered before
    it runs: its sockets are that host's), forked from a fork server of ``python`` that imported
    ``preload`` (started at the first call, with this call's environment, and kept until this
    process exits). Returns once the server is set up (its session, log, cores)."""
    key = _key(python, preload, env)
    request = {
        "argv": list(argv),
        "env": dict(env),
        "cwd": str(cwd or Path.cwd()),
        "cpus": list(cpus) if cpus else None,
        "netns": netns,
    }
    with _LOCK:
        server = _SERVERS.get(key)
        if server is None or server.proc.poll() is not None:
            if server is not None:
                _stop(server)
            server = _SERVERS[key] = _start_server(python, preload, env, log)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn, open(log, "wb") as out:
        conn.connect(server.path)
        socket.send_fds(conn, [json.dumps(request).encode()], [out.fileno()])
        conn.settimeout(_REPLY_TIMEOUT)
        reply = conn.recv(4096).decode()
        if not reply.isdigit():
            raise ForkServerError(f"the fork server of {python} refused {argv[:1]}: {reply}")
        pid = int(reply)
        try:
            pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = None
        return Child(pid, conn.dup(), pidfd)


def _key(python: Path, preload: Sequence[str], env: Mapping[str, str]) -> _Key:
    values = tuple(env.get(v) for v in IMPORT_TIME_VARIABLES)
    return (str(python), tuple(preload), (*values, "PROMETHEUS_MULTIPROC_DIR" in env))


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
    with proc.stdout:
        ready = b""
        if select.select([proc.stdout], [], [], _START_TIMEOUT)[0]:
            ready = proc.stdout.readline()
    server = _Server(proc, path)
    if ready != _READY:
        proc.kill()
        _stop(server)
        tail = errors.read_text(errors="replace")[-3000:]
        raise ForkServerError(f"the fork server of {python} did not start:\n{tail}")
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
    shutil.rmtree(os.path.dirname(server.path), ignore_errors=True)  # (where it could not)


if __name__ == "__main__":
    main(sys.argv[1:])
