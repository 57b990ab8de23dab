"""Agents for the transport contract tests: one transport agent, driven by commands.

:class:`LocalAgent` runs the commands in this process (for ``inproc``); :class:`ProcessAgent`
runs them in a process of its own (spawned), over a Pipe. Both have the same ``call``.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.errors import TransportError, TransportUnavailable
from kvbridge.memory.device import DevicePool
from kvbridge.memory.location import Location
from kvbridge.memory.pools import HostPool
from kvbridge.planner.layout import Region
from kvbridge.planner.runs import FIELDS, Runs
from kvbridge.transports import Transport, XferHandle, create
from kvbridge.transports import tcp_wire as wire

_ERRORS: dict[str, type[Exception]] = {
    "TransportError": TransportError,
    "TransportUnavailable": TransportUnavailable,
}


class Commands:
    """What a test can ask an agent to do."""

    def __init__(self, transport: str, agent: str, options: dict[str, Any]) -> None:
        self.t: Transport = create(transport, agent, **options)
        self.pools: list[Any] = []  # HostPool, or DevicePool for regions on a device
        self.views: dict[str, Any] = {}  # each region's bytes: an array, or a device tensor
        self.handles: dict[int, XferHandle] = {}

    def pid(self) -> int:
        return os.getpid()

    def pool(
        self,
        regions: list[tuple[str, int]],
        shared: bool,
        fill: int | None = None,
        seed: int | None = None,
        prefault: bool = True,
        device: str | None = None,
    ) -> bytes:
        """Allocate and fill regions (a canary byte, or random bytes), register them; on CUDA
        device ``device`` (e.g. "cuda:0") if given, else in host memory."""
        if device is None:
            p: Any = HostPool([Region(n, s) for n, s in regions], shared=shared, prefault=prefault)
        else:
            p = DevicePool([Region(n, s) for n, s in regions], Location.parse(device))
        self.pools.append(p)
        rng = np.random.default_rng(seed)
        for n, _ in regions:
            v = self.views[n] = p.view(n)
            if fill is not None:
                v[:] = fill
            elif seed is not None:
                random = rng.integers(0, 256, v.nbytes, dtype=np.uint8)
                v[:] = random if device is None else tensor_like(v, random)
        return self.t.register(p.regions())

    def segments(self) -> list[str]:
        return [p.segment for p in self.pools if p.segment is not None]

    def add_peer(self, peer: str, blob: bytes) -> None:
        self.t.add_peer(peer, blob)

    def post(
        self,
        peer: str,
        src: list[str],
        dst: list[str],
        runs: dict[str, np.ndarray],
        wait: float | None = None,
        key: tuple[int, int] | None = None,
    ) -> tuple[int, str, str | None]:
        h = self.t.post(peer, src, dst, Runs(*(runs[f] for f in FIELDS)), key=key)
        self.handles[h.id] = h
        state = self.t.wait(h, wait) if wait is not None else self.t.poll(h)
        return h.id, state.name, h.error

    def wait(self, hid: int, timeout: float) -> tuple[str, str | None, float]:
        t0 = time.monotonic()
        state = self.t.wait(self.handles[hid], timeout)
        return state.name, self.handles[hid].error, time.monotonic() - t0

    def read(self, region: str, start: int = 0, stop: int | None = None) -> bytes:
        return host_bytes(self.views[region][start:stop]).tobytes()

    def count(self, region: str, value: int) -> int:
        """How many bytes of ``region`` hold ``value``."""
        return int(np.count_nonzero(host_bytes(self.views[region]) == value))

    def fill(self, region: str, value: int) -> None:
        self.views[region][:] = value

    def admit(self, key: tuple[int, int]) -> None:
        self.t.admit(key)

    def fence(self, key: tuple[int, int], timeout: float) -> bool:
        return self.t.fence(key, timeout)

    def attr(self, name: str) -> Any:
        """A transport attribute (a counter, an address)."""
        return getattr(self.t, name)

    def close_transport(self) -> None:
        """Close the transport only: the process (and its memory) stays."""
        self.t.close()

    def threads(self) -> tuple[int, int]:
        """Python threads, and the process's threads as the kernel counts them."""
        with open("/proc/self/status") as f:
            kernel = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
        return threading.active_count(), kernel

    def close(self) -> None:
        self.t.close()
        self.views.clear()
        for p in self.pools:
            p.close()
        self.pools.clear()


def tensor_like(device_bytes: Any, host: np.ndarray) -> Any:
    """``host``'s bytes as a tensor on ``device_bytes``'s device."""
    import torch

    return torch.from_numpy(host).to(device_bytes.device)


def host_bytes(v: Any) -> np.ndarray:
    """A region's bytes on the host (copied from the device for device memory)."""
    return v if isinstance(v, np.ndarray) else v.cpu().numpy()


def serve(conn: Connection, transport: str, agent: str, options: dict[str, Any]) -> None:
    """A process's main loop: run commands until ``close``."""
    cmds = Commands(transport, agent, options)
    while True:
        name, args, kwargs = conn.recv()
        try:
            result = getattr(cmds, name)(*args, **kwargs)
        except Exception as e:
            conn.send(("err", type(e).__name__, str(e)))
        else:
            conn.send(("ok", result))
        if name == "close":
            return


class LocalAgent:
    def __init__(self, transport: str, agent: str, options: dict[str, Any] | None = None):
        self.agent = agent
        self._cmds = Commands(transport, agent, options or {})

    def call(self, name: str, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
        return getattr(self._cmds, name)(*args, **kwargs)

    def close(self) -> None:
        self._cmds.close()


class ProcessAgent:
    def __init__(
        self, ctx: Any, transport: str, agent: str, options: dict[str, Any] | None = None
    ) -> None:
        self.agent = agent
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=serve,
            args=(child, transport, agent, options or {}),
            daemon=True,
            name=f"agent-{agent}",
        )
        self.proc.start()
        child.close()
        self.closed = False

    def call(self, name: str, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
        self._conn.send((name, args, kwargs))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"agent {self.agent} did not answer {name} in {timeout} s")
        reply = self._conn.recv()
        if reply[0] == "err":
            raise _ERRORS.get(reply[1], RuntimeError)(
                f"{reply[1]}: {reply[2]}" if reply[1] not in _ERRORS else reply[2]
            )
        return reply[1]

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        self.closed = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.call("close", timeout=60)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)


def raw_connect(
    address: tuple[str, int], agent: str, token: str = "", timeout: float = 5.0
) -> socket.socket:
    """A plain socket to a tcp agent, authenticated as ``agent`` (what a hand-made sender
    needs before its batches are read)."""
    s = socket.create_connection(address, timeout=timeout)
    try:
        head = recv_exact(s, wire.CHALLENGE.size, "the challenge")
        s.sendall(wire.encode_answer(token, wire.decode_challenge(head), agent))
        welcome = recv_exact(s, wire.WELCOME.size, "the welcome: handshake refused")
    except ConnectionError:
        s.close()
        raise
    assert welcome == wire.WELCOME_BYTES
    return s


def recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    """Exactly ``n`` bytes from a raw socket; ConnectionError if the peer closes first."""
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            raise ConnectionError(f"closed before {what}")
        got += chunk
    return got


def read_reply(sock: socket.socket, timeout: float) -> tuple[int, wire.Status, str]:
    """One reply of the tcp data port: (batch seq, status, message)."""
    sock.settimeout(timeout)
    seq, status, mlen = wire.decode_reply(recv_exact(sock, wire.REPLY.size, "a reply"))
    return seq, status, recv_exact(sock, mlen, "the reply's message").decode()
