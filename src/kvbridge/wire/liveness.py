"""Whether a peer is alive: heartbeat silence (:class:`Silence`), enough to fail its requests,
and whether its process still exists (:class:`ProcessId`), the proof that a one-sided writer is
gone.

A decode rank cannot stop a peer that writes into its memory directly (shm, NIXL, Mooncake).
Heartbeat silence does not prove the writer stopped: a process under SIGSTOP is silent and
resumes writing on SIGCONT. What does prove it, on the same host and in the same pid
namespace, is that the process is no longer there: its pid is free, or now belongs to another
process (another start time). Containers of one host share its boot id but not their pids: a
peer in another pid namespace, like a peer on another host, can only be proven gone by its
acknowledgement or by the transport.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path


@cache
def host_id() -> str:
    """Identifies this host's processes and memory: the kernel's boot id (shared by the
    containers of one host), else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


UNKNOWN = -1  # start_time(): this process may not look at that one


def start_time(pid: int) -> int | None:
    """The start time, in clock ticks since boot (field 22 of /proc/PID/stat), of the live
    process ``pid``; None only if there certainly is none: no such pid, or a zombie (killed,
    not yet reaped) none of whose threads still runs (its memory, and so any write it was
    making, no longer exists); :data:`UNKNOWN` where this process may not look (/proc mounted
    with hidepid, another user's process), which is never proof of anything."""
    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:
        return None if _no_such_pid(pid) else UNKNOWN
    except (OSError, ValueError):
        return UNKNOWN
    try:
        state, started = fields[0], int(fields[19])
    except (IndexError, ValueError):
        return UNKNOWN
    # A zombie leader whose other threads still run (its main thread exited alone) is alive.
    return None if state in ("Z", "X") and _threads(pid) <= 1 else started


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP: state T in /proc): it
    runs no instruction until someone continues it. A tracer's brief stops (state t: strace,
    a sampling profiler) are not. False where it cannot be read."""
    try:
        return _stat_fields(pid)[:1] == ["T"]
    except (OSError, ValueError):
        return False


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat from the third (the state) on. The command name (the
    second) may hold spaces and parentheses: split after its last ')'."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2 :].split()


def _no_such_pid(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, and is not ours to signal
        pass
    return False


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 2  # unknown: counted alive


@cache
def pid_namespace() -> str:
    """This process's pid namespace (``pid:[4026531836]``), or "" where it cannot be read or
    the /proc mounted here is another namespace's (``unshare --pid`` without a /proc of its
    own): pids read there would name other processes."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return ""
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcessId:
    """A process, unambiguously: host, pid namespace, pid and start time (pids are reused)."""

    host: str
    pid: int
    started: int
    pid_ns: str = ""

    @classmethod
    def current(cls) -> ProcessId:
        pid = os.getpid()
        return cls(host_id(), pid, max(start_time(pid) or 0, 0), pid_namespace())

    def proven_gone(self) -> bool:
        """True only when this process certainly no longer exists: it ran on this host, in
        this pid namespace, and its pid is free or belongs to a process started at another
        time."""
        if self.host != host_id() or self.pid <= 0 or self.started <= 0:
            return False
        if not self.pid_ns or self.pid_ns != pid_namespace():
            return False
        started = start_time(self.pid)
        return started is None or started not in (UNKNOWN, self.started)


@dataclass
class Silence:
    """When each peer was last heard from, and who has been silent past ``dead_after``.

    Judged from this rank's own ticks, so a pause of this rank is not charged to its peers:
    a tick that comes more than ``dead_after / 2`` after the previous one means this rank
    itself was stopped (SIGSTOP, a frozen VM, a long collection); its peers' heartbeats of
    that while may still sit unread in the socket. Their silence is then measured afresh
    from that tick. Not thread-safe: the engine holds its peers' lock around every call.
    """

    dead_after: float
    last_tick: float
    _seen: dict[str, float] = field(default_factory=dict)

    def add(self, agent: str, now: float) -> None:
        self._seen[agent] = now

    def remove(self, agent: str) -> None:
        self._seen.pop(agent, None)

    def heard(self, agent: str, now: float) -> None:
        # Only live peers are refreshed: a dead one's queued heartbeats do not revive it.
        if agent in self._seen:
            self._seen[agent] = now

    def tick(self, now: float) -> float:
        """Note a tick; returns how long this rank was paused before it (0 if it was not)."""
        paused, self.last_tick = now - self.last_tick, now
        if paused <= self.dead_after / 2:
            return 0.0
        for agent in self._seen:
            self._seen[agent] = now
        return paused

    def dead(self, now: float) -> list[str]:
        return self.quiet(now, self.dead_after)

    def quiet(self, now: float, after: float) -> list[str]:
        """Peers silent for more than ``after`` seconds."""
        return [a for a, seen in self._seen.items() if now - seen > after]
