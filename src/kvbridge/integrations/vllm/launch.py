"""Start real ``vllm serve`` processes (and ``kvbridge proxy``) on loopback, for the connector's
tests and benchmark: each in its own process group with its own log, health-checked, killed as
a group. A process of its own per server: nothing of vLLM is imported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge.integrations import forkserver

CONNECTOR = "kvbridge.integrations.vllm.connector"
# What a fork server of vLLM's python imports once for every server forked from it: the CLI,
# the API server, the engine core and the CPU worker it runs, and kvbridge's connector.
PRELOAD = (
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.core",
    "vllm.v1.worker.cpu_worker",
    CONNECTOR,
)


def _ephemeral() -> range:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low, high = (int(x) for x in text.split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


# Ports handed out by this process: each once (two servers started together are each given a
# port that is free now and bound later: the same one twice would fail the later).
_GIVEN: set[int] = set()
# SGLang picks the ports it binds later (its torch.distributed store: --nccl-port) in
# [22000, 30000) when not told one: ours stay out of that range.
_SGLANG_OWN = range(22000, 30000)


def free_port() -> int:
    """A loopback port free now, outside the kernel's ephemeral range: a server binds it only
    once it has started (kvbridge's bootstrap service, tens of seconds later), and ports that
    other processes take meanwhile with bind(0), as vLLM's engines do, come from that range.
    Never one this process handed out before, nor one of SGLang's own picks."""
    ephemeral = _ephemeral()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, 65536)
        if port in ephemeral or port in _SGLANG_OWN or port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.add(port)
            return port
    raise OSError("no free loopback port outside the ephemeral range after 200 tries")


def kvbridge_config(role: str, bootstrap_port: int | None = None, host: str = "127.0.0.1") -> str:
    """``--kv-transfer-config`` for kvbridge's connector (``kv_producer`` or ``kv_consumer``);
    a producer serves its bootstrap service at ``host:bootstrap_port``."""
    extra = {"bootstrap": f"{host}:{bootstrap_port}"} if bootstrap_port else {}
    return json.dumps(
        {
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": CONNECTOR,
            "kv_role": role,
            "kv_connector_extra_config": extra,
        }
    )


def nixl_config(role: str) -> str:
    """``--kv-transfer-config`` for vLLM's own NixlConnector on host memory."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes] | forkserver.Child
    log: Path
    bootstrap: str | None = None  # a kvbridge producer's bootstrap service, host:port
    host: str = "127.0.0.1"  # the address it listens on

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def tail(self, n: int = 40) -> str:
        """The log's last ``n`` lines, after the exceptions it names (a tail of nested
        tracebacks ends in the wrapper, e.g. vLLM's "Engine core initialization failed. See
        root cause above", and the cause scrolls out)."""
        lines = self.log.read_text(errors="replace").splitlines()
        errors = [ln for ln in lines[:-n] if _EXCEPTION.match(ln)]
        cause = ["exceptions above the tail:", *dict.fromkeys(errors)] if errors else []
        return "\n".join([*cause[-11:], *lines[-n:]])

    def kill(self) -> None:
        """Kill the server's process group and leave nothing of it in /dev/shm (a hundred
        segments and semaphores a run of the suite, before): its multiprocessing resource
        trackers are killed last, after a moment to unlink what the dead processes had
        registered with them, as they do when their clients are gone; then the segments its
        processes had mapped that no live process maps any more are unlinked (vLLM's message
        queues' segments, which its engine unlinks only when it shuts down)."""
        if self.proc.poll() is not None:
            return
        group = _members(self.proc.pid)
        mapped = _shared_segments(set(group))
        trackers = {pid for pid, args in group.items() if "resource_tracker import main" in args}
        for pid in set(group) - trackers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while trackers & set(_members(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # and whatever was started meanwhile
        self.proc.wait(30)
        for path in mapped - _shared_segments(None):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _members(pgid: int) -> dict[int, str]:
    """pid -> command line of the live processes of process group ``pgid``."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # (the group is the fifth field of stat, after the command's parenthesis)
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out[int(proc.name)] = (proc / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return out


def _shared_segments(pids: set[int] | None) -> set[Path]:
    """The /dev/shm files mapped by processes ``pids`` (None: by every process)."""
    out: set[Path] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or (pids is not None and int(proc.name) not in pids):
            continue
        try:
            maps = (proc / "maps").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[5:]
            if path and path[0].startswith("/dev/shm/") and not path[0].endswith("(deleted)"):
                out.add(Path(path[0]))
    return out


# "ValueError: ..." or "(EngineCore pid=12) torch.OutOfMemoryError: ..." at a line's start.
_EXCEPTION = re.compile(r"^(\(\S+ pid=\d+\) )?[\w.]*(Error|Exception)\b: ")


def start(
    python: Path,
    workdir: Path,
    name: str,
    args: Sequence[str],
    env: dict[str, str] | None = None,
    *,
    host: str = "127.0.0.1",
    netns: str | None = None,
    fork: bool = False,
) -> Server:
    """``vllm serve ARGS`` (or, when ``args[0] == "proxy"``, ``kvbridge proxy ARGS``) with
    ``python``, on a free port of ``host``, logging to ``workdir/NAME.log``; in network
    namespace ``netns`` if given (a host of :class:`kvbridge.deploy.netns.Network`), where
    kvbridge binds ``host`` too (``KVBRIDGE_HOST``). ``fork``: the server forked from a fork
    server that imported vLLM once (:mod:`kvbridge.integrations.forkserver`), and vLLM's engine
    core and workers forked from it, not spawned (:mod:`kvbridge.integrations.forked`)."""
    port = free_port()
    log = workdir / f"{name}.log"
    e = {
        **os.environ,
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": host,
        "KVBRIDGE_HOST": host,
        **(env or {}),
    }
    if args[0] == "proxy":
        cmd = [str(python), "-m", "kvbridge.cli", *args, "--host", host, "--port", str(port)]
    else:
        cmd = ["vllm.entrypoints.cli.main", "serve", *args, "--host", host, "--port", str(port)]
        if fork:
            child = forkserver.start(python, cmd, e, log, PRELOAD, netns=netns)
            return Server(name, port, child, log, host=host)
        cmd = [str(python), "-m", *cmd]  # spawned, as vLLM starts its processes for users
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=e, start_new_session=True
        )
    return Server(name, port, proc, log, host=host)


def wait_healthy(servers: Sequence[Server], timeout: float = 420) -> None:
    end = time.monotonic() + timeout
    pending = list(servers)
    while pending and time.monotonic() < end:
        for s in list(pending):
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited ({s.proc.returncode}):\n{s.tail()}")
            try:
                with urllib.request.urlopen(f"{s.url}/health", timeout=2) as r:
                    if r.status == 200:
                        pending.remove(s)
            except OSError:
                pass
        time.sleep(1)
    if pending:
        raise RuntimeError(
            "not healthy in time: " + "; ".join(f"{s.name}:\n{s.tail()}" for s in pending)
        )


def post(url: str, body: Any, timeout: float = 120) -> tuple[int, dict[str, Any]]:
    """POST JSON; (status, JSON answer), errors included."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body or b"{}")
        except ValueError:  # a plain-text error page (a proxy whose upstream died)
            return e.code, {"error": body.decode(errors="replace")}
