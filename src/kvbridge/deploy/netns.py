"""Several network hosts on this machine: Linux network namespaces on one switch.

A :class:`Network` makes one namespace per host, each with its own ``eth0`` and address in a
/24 of 198.18.0.0/15 (the benchmarking range, never routed), all plugged into a bridge that
lives in a namespace of its own (the switch). Every link is the host's port on that switch, so
the tests act on the network from outside the hosts:

- :meth:`Network.partition` takes the host's switch port down: its packets vanish, and a
  sender sees no error, only silence (as behind a failed switch), until :meth:`Network.heal`;
- :meth:`Network.cap` shapes the port with a token bucket (tbf): a bandwidth cap;
- :meth:`Network.delay` and :meth:`Network.loss` act on what a host receives, inside it
  (iptables: a user-space holder of queued packets, :mod:`kvbridge.deploy.linkdelay`, and a
  random drop), as the kernel here has no netem.

A process started again in the same namespace has the same address: that is a restart.

Processes get into a host three ways: :meth:`Network.popen` (``ip netns exec``),
:func:`enter` (a process moves itself, before it opens any socket) and :func:`inside` (this
thread for a block: sockets and threads made in it stay in the namespace). What these machines
can emulate: partitions, bandwidth caps (tbf), loss (iptables) and delay through
:mod:`.linkdelay` (the kernel has no netem: no delay queue of its own).

Root and ``ip`` (iproute2) are needed; :func:`unavailable` says why where they are not.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvbridge.integrations import namespace

__all__ = ["Host", "Network", "NetnsError", "enter", "inside", "unavailable"]

# Jumbo frames, as data-center links between serving hosts have: also 6x fewer packets for the
# user-space delay holder to give back than at 1500.
MTU = 9000
_serial = itertools.count()


class NetnsError(RuntimeError):
    """A namespace, link or shaping command failed (the command and its message)."""


def _run(tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise NetnsError(f"{tool} {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run("ip", *args, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None where they can): tried, not guessed."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"kvbprobe{os.getpid()}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def enter(netns: str) -> None:
    """Move the calling thread (in a new process: the process) into ``netns`` for good."""
    try:
        namespace.enter(netns)
    except OSError as e:
        raise NetnsError(f"entering network namespace {netns}: {e.strerror or e}") from None


@contextlib.contextmanager
def inside(netns: str) -> Iterator[None]:
    """The calling thread in ``netns`` for the block, then back: sockets opened and threads
    started in the block stay in ``netns`` (a thread inherits its creator's namespace)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter(netns)
        try:
            yield
        finally:
            try:
                namespace.setns(home)
            except OSError as e:  # pragma: no cover - the kernel refused
                raise NetnsError(f"setns back: {e.strerror or e}") from None
    finally:
        os.close(home)


@dataclass(frozen=True)
class Host:
    name: str  # the test's name for it ("prefill")
    netns: str  # its namespace
    address: str  # its eth0 address
    port: str  # its port on the switch (an interface in the switch's namespace)


class Network:
    """Hosts ``names`` on one switch, built now; :meth:`close` (or the ``with`` block's end)
    kills what :meth:`popen` started and deletes every namespace, with its links, qdiscs and
    bridge. Names of namespaces and ports carry this process's pid, so that runs at once on
    one machine never meet.

    Each network has a /24 of 198.18.0.0/15 of its own (two at once on a machine never route
    into each other). ``join``: the caller's own namespace is plugged into the switch too, at
    :attr:`here` (the subnet's .1), so that a test reaches every host's servers directly; that
    link goes with the switch."""

    def __init__(self, names: Sequence[str], *, join: bool = False) -> None:
        if not 1 <= len(names) <= 200 or len(set(names)) != len(names):
            raise ValueError(f"expected 1 to 200 distinct host names, got {list(names)}")
        serial = next(_serial)
        self.prefix = f"kvb{os.getpid()}n{serial}"
        self.subnet = f"198.18.{(os.getpid() + serial) % 256}"
        self.here = f"{self.subnet}.1" if join else None
        self.switch = f"{self.prefix}sw"
        self.hosts: dict[str, Host] = {}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._holders: dict[str, subprocess.Popen[bytes]] = {}
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "mtu", str(MTU), "up")
            for i, name in enumerate(names):
                self._add(name, f"{self.subnet}.{i + 2}", f"{self.prefix}h{i}")
            if self.here is not None:
                here, port = f"{self.prefix}j", f"{self.prefix}p"
                _ip("link", "add", here, "type", "veth", "peer", "name", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0", "mtu", str(MTU), "up")
                _ip("addr", "add", f"{self.here}/24", "dev", here)
                _ip("link", "set", here, "mtu", str(MTU), "up")
        except BaseException:
            self.close()
            raise

    def _add(self, name: str, address: str, netns: str) -> None:
        port = netns  # made in this namespace first, so unique here too
        if len(port) > 15:  # the kernel's limit on an interface name
            raise NetnsError(f"interface name {port!r} is longer than 15 characters")
        _ip("netns", "add", netns)
        self.hosts[name] = Host(name, netns, address, port)
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "mtu", str(MTU), "up")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "mtu", str(MTU), "up")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- links -----------------------------------------------------------------------------

    def partition(self, name: str) -> None:
        """Cut ``name`` off the switch: its port goes down, every packet to or from it is lost
        without a word to either end."""
        _ip("-n", self.switch, "link", "set", self[name].port, "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self[name].port, "up")

    def traffic(self, name: str) -> int:
        """Bytes that crossed ``name``'s switch port so far, both ways: what went over the
        network to and from that host (loopback and shared memory never count)."""
        out = _ip("-n", self.switch, "-s", "-j", "link", "show", "dev", self[name].port).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])

    def cap(self, name: str, mbit: float | None) -> None:
        """At most ``mbit`` megabits a second toward ``name`` (a token bucket on its switch
        port); None removes the cap."""
        port = self[name].port
        if mbit is None:
            _run("tc", "-n", self.switch, "qdisc", "del", "dev", port, "root", check=False)
            return
        _run(
            "tc",
            "-n",
            self.switch,
            "qdisc",
            "replace",
            "dev",
            port,
            "root",
            "tbf",
            "rate",
            f"{mbit}mbit",
            "burst",
            "256kb",
            "latency",
            "100ms",
        )

    def delay(self, name: str, ms: float) -> None:
        """Hold every packet ``name`` receives ``ms`` milliseconds (0: no more delay): an
        iptables NFQUEUE rule on the host and a holder process there
        (:mod:`kvbridge.deploy.linkdelay`). Delay both ends for a round trip of twice ``ms``."""
        holder = self._holders.pop(name, None)
        if holder is not None:
            self._iptables(name, "-D", *_QUEUED)
            holder.kill()
            holder.wait(10)
        if ms <= 0:
            return
        argv = [sys.executable, "-m", "kvbridge.deploy.linkdelay", "0", f"{ms:g}"]
        holder = self.popen(name, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = holder.stdout.readline() if holder.stdout is not None else b""
        if line.strip() != b"ready":
            err = holder.stderr.read().decode() if holder.stderr is not None else ""
            holder.kill()
            raise NetnsError(f"the delay holder on {name} did not start: {err.strip()[-500:]}")
        self._holders[name] = holder
        self._iptables(name, "-A", *_QUEUED)

    def loss(self, name: str, percent: float) -> None:
        """Drop ``percent`` % of the packets ``name`` receives, at random (0: none)."""
        self._iptables(name, "-F", "KVB-LOSS", check=False)
        if percent <= 0:
            return
        self._iptables(name, "-N", "KVB-LOSS", check=False)  # exists after the first time
        if not self._iptables(name, "-C", "INPUT", "-j", "KVB-LOSS", check=False):
            self._iptables(name, "-I", "INPUT", "1", "-j", "KVB-LOSS")
        p = f"{percent / 100:.6f}"
        rule = ["-i", "eth0", "-m", "statistic", "--mode", "random", "--probability", p, "-j"]
        self._iptables(name, "-A", "KVB-LOSS", *rule, "DROP")

    def _iptables(self, name: str, *args: str, check: bool = True) -> bool:
        if shutil.which("iptables") is None:
            raise NetnsError("no `iptables` command: delay and loss need it (apt iptables)")
        return (
            _ip("netns", "exec", self[name].netns, "iptables", *args, check=check).returncode == 0
        )

    # ---- processes -------------------------------------------------------------------------

    def popen(self, name: str, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """``argv`` started on host ``name`` (killed at :meth:`close` if still running)."""
        proc: subprocess.Popen[bytes] = subprocess.Popen(
            ["ip", "netns", "exec", self[name].netns, *argv],
            **kwargs,  # type: ignore[call-overload]
        )
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for host in self.hosts.values():
            _ip("netns", "del", host.netns, check=False)
        _ip("netns", "del", self.switch, check=False)
        self.hosts = {}


# Every packet a host receives on its link goes to queue 0 (passes, undelayed, if no holder).
_QUEUED = ("INPUT", "-i", "eth0", "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass")
