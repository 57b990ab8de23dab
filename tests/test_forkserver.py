"""kvbridge.integrations.forkserver: a server asked of it runs forked from a process that
imported its modules once, as it would run under ``python -m kvbridge.integrations.forked``
(its argv, environment, directory, cores, log, a session of its own), and its exit status comes
back; a bad request is refused and the fork server serves on; it leaves with its parent."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvbridge.integrations import forkserver

pytestmark = pytest.mark.slow  # starts processes: the fast tier's are in-process

# Imported by the fork server: a server forked from it reports the pid that imported it.
PRELOADED = """
import os
IMPORTED_BY = os.getpid()
"""

# A process's signal handlers: a server's must be what a process started afresh from here has
# (Python's own where the signals were not ignored: a write to a closed socket raises
# BrokenPipeError instead of killing it, Ctrl-C raises KeyboardInterrupt).
HANDLERS = """
import signal

def handlers():
    return [str(signal.getsignal(s)) for s in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM)]
"""

ENGINE = """
import json, multiprocessing as mp, os, sys

import preloaded
from handlers import handlers

def child(q):
    q.put(preloaded.IMPORTED_BY)

if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)  # as SGLang's launcher does: forked instead
    q = mp.Queue()
    p = mp.Process(target=child, args=(q,))
    p.start()
    print(json.dumps({
        "argv": sys.argv[1:],
        "imported_by": preloaded.IMPORTED_BY,
        "me": os.getpid(),
        "child_saw": q.get(timeout=60),
        "group": os.getpgid(0),
        "cwd": os.getcwd(),
        "mark": os.environ.get("MARK"),
        "cores": sorted(os.sched_getaffinity(0)),
        "stdin": sys.stdin.read(),
        "signals": handlers(),
        "title": open("/proc/self/cmdline", "rb").read().decode(),
    }), flush=True)
    p.join(60)
    sys.exit(int(os.environ.get("EXIT", "0")))
"""

SLEEPER = """
import time
time.sleep(600)
"""


@pytest.fixture
def modules(tmp_path: Path) -> Path:
    files = [("preloaded", PRELOADED), ("engine", ENGINE), ("sleeper", SLEEPER)]
    for name, text in [*files, ("handlers", HANDLERS)]:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    return tmp_path


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    return {"PYTHONPATH": str(tmp), "PATH": os.environ["PATH"], **extra}


CORE = min(os.sched_getaffinity(0))


def _start(
    tmp: Path, module: str, log: str, cpus: list[int] | None = None, **env: str
) -> forkserver.Child:
    return forkserver.start(
        Path(sys.executable),
        [module, "--port", "8000"],
        _env(tmp, **env),
        tmp / log,
        ["preloaded"],
        cpus=cpus or [CORE],
        cwd=tmp,
    )


def _fork_server(tmp: Path) -> forkserver._Server:
    """The fork server :func:`_start` asks (its own, for this test's modules)."""
    return forkserver._SERVERS[forkserver._key(Path(sys.executable), ["preloaded"], _env(tmp))]


def test_a_server_runs_forked_from_the_imports_as_asked(modules: Path) -> None:
    child = _start(modules, "engine", "a.log", MARK="a", EXIT="3")
    assert child.wait(120) == 3, (modules / "a.log").read_text()
    got = json.loads((modules / "a.log").read_text().splitlines()[-1])
    assert got["imported_by"] != got["me"]  # imported before it was forked, by the fork server
    assert got["child_saw"] == got["imported_by"]  # what it spawned was forked too
    assert got["argv"] == ["--port", "8000"]
    assert got["group"] == got["me"] == child.pid  # a session and process group of its own
    assert (got["cwd"], got["mark"], got["cores"], got["stdin"]) == (str(modules), "a", [CORE], "")
    fresh = subprocess.run(
        [sys.executable, "-c", "import handlers; print(handlers.handlers())"],
        env=_env(modules),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert str(got["signals"]) == fresh.stdout.strip(), fresh.stderr
    assert got["title"].startswith(f"{sys.executable} -m engine --port 8000")  # not the fork server
    other = _start(modules, "engine", "b.log", MARK="b")
    assert other.wait(120) == 0
    again = json.loads((modules / "b.log").read_text().splitlines()[-1])
    assert again["imported_by"] == got["imported_by"]  # the same fork server
    assert again["mark"] == "b"


def test_a_killed_server_reports_its_signal_and_poll_waits_for_it(modules: Path) -> None:
    child = _start(modules, "sleeper", "s.log")
    assert os.getpgid(child.pid) == child.pid  # set up before start() returns: killable at once
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    assert child.poll() == child.returncode == -signal.SIGKILL


def test_an_import_time_setting_gets_a_fork_server_of_its_own(modules: Path) -> None:
    a = _start(modules, "engine", "a.log", TORCH_COMPILE_DISABLE="1")
    b = _start(modules, "engine", "b.log")
    assert a.wait(120) == b.wait(120) == 0
    imported = [
        json.loads((modules / f"{n}.log").read_text().splitlines()[-1])["imported_by"] for n in "ab"
    ]
    assert imported[0] != imported[1]


def test_a_malformed_request_is_refused_and_the_server_serves_on(modules: Path) -> None:
    first = _start(modules, "engine", "a.log")
    assert first.wait(120) == 0
    server = _fork_server(modules)
    good = {"argv": ["engine"], "env": _env(modules), "cwd": str(modules), "cpus": None}
    for payload, fds, why in [
        (b"not json", [0], "JSONDecodeError"),
        (json.dumps({"argv": []}).encode(), [0], "KeyError: 'env'"),
        (json.dumps(good).encode(), [], "ValueError: expected the log's descriptor, got 0"),
    ]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(server.path)
            socket.send_fds(conn, [payload], fds)
            assert conn.recv(4096).decode().startswith(f"error: {why}")
    assert _start(modules, "engine", "b.log").wait(120) == 0
    assert server.proc.poll() is None


def test_a_server_that_cannot_be_set_up_is_refused_saying_why(modules: Path) -> None:
    with pytest.raises(forkserver.ForkServerError, match="could not set the server up: OSError"):
        _start(modules, "engine", "a.log", cpus=[4096])
    assert _start(modules, "engine", "b.log").wait(120) == 0


def test_a_server_outliving_its_fork_server_can_still_be_waited_for(modules: Path) -> None:
    child = _start(modules, "sleeper", "s.log")
    _fork_server(modules).proc.kill()
    _fork_server(modules).proc.wait()
    assert child.poll() is None  # alive: its own pidfd says so
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(30) == forkserver.LOST  # ended; its status went with the fork server
    assert _start(modules, "engine", "b.log").wait(120) == 0  # a new fork server


def test_a_fork_server_that_cannot_import_says_why(tmp_path: Path) -> None:
    with pytest.raises(forkserver.ForkServerError, match="No module named 'not_a_module'"):
        forkserver.start(
            Path(sys.executable), ["x"], _env(tmp_path), tmp_path / "x.log", ["not_a_module"]
        )


def test_the_fork_server_leaves_with_the_process_that_started_it(modules: Path) -> None:
    # A process that starts a fork server and a server, then dies without a word.
    code = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        from kvbridge.integrations import forkserver
        tmp = Path({str(modules)!r})
        child = forkserver.start(Path(sys.executable), ["sleeper"],
                                 {{"PYTHONPATH": str(tmp), "PATH": os.environ["PATH"]}},
                                 tmp / "s.log", ["preloaded"])
        server = next(iter(forkserver._SERVERS.values()))
        print(server.proc.pid, child.pid, flush=True)
        os._exit(0)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    fork_server, sleeper = (int(x) for x in done.stdout.split())
    try:
        deadline = time.monotonic() + 30
        while _alive(fork_server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(fork_server)
    finally:
        os.killpg(sleeper, signal.SIGKILL)  # a server outlives it, as one started alone would


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


INTERFACES = """
import socket
print(sorted(name for _, name in socket.if_nameindex()), flush=True)
"""


def test_a_server_asked_into_a_network_namespace_runs_there(modules: Path) -> None:
    """A server forked into a host (a network namespace) sees that host's interfaces, not the
    fork server's; a namespace that does not exist is refused saying so."""
    from kvbridge.deploy.netns import unavailable

    if why := unavailable():
        pytest.skip(why)
    (modules / "interfaces.py").write_text(INTERFACES)
    name = f"kvbfs{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        args = (Path(sys.executable), ["interfaces"], _env(modules))
        child = forkserver.start(*args, modules / "i.log", ["preloaded"], netns=name)
        assert child.wait(60) == 0, (modules / "i.log").read_text()
        assert (modules / "i.log").read_text().splitlines()[-1] == "['lo']"
        here = forkserver.start(*args, modules / "h.log", ["preloaded"])
        assert here.wait(60) == 0
        mine = sorted(name for _, name in socket.if_nameindex())
        assert (modules / "h.log").read_text().splitlines()[-1] == str(mine)
        with pytest.raises(forkserver.ForkServerError, match="no network namespace 'nosuchnetns'"):
            forkserver.start(*args, modules / "x.log", ["preloaded"], netns="nosuchnetns")
    finally:
        subprocess.run(["ip", "netns", "del", name], timeout=30)
