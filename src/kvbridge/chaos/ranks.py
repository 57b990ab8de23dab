"""A rank of the chaos soak: one Bridge and its pools, in a process of its own.

Requests live in slots: slot ``i`` is pages ``[i * n, (i + 1) * n)`` and state/aux slot ``i``
on each side. A prefill rank fills a slot with the reference shard of the room it sends from
it. A decode rank behaves as a serving engine must: it hands a slot to a receiver, and takes it
back only once the receiver says ``released``, filling it then with fresh bytes (REUSED) as the
next user would. A byte that lands in a slot after that, before the slot's next request, is a
write after release; :meth:`ChaosRank.begin_receive` counts them.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.config import Settings
from kvbridge.deploy.cluster import Job, build_side
from kvbridge.errors import ClosedError
from kvbridge.memory.pools import HostPool
from kvbridge.planner.placement import Placement
from kvbridge.planner.reference import fill, logical_cache
from kvbridge.runtime import Bridge, Receiver, Sender
from kvbridge.runtime.status import KVPoll
from kvbridge.wire.protocol import Role

REUSED = 0x5A


@dataclass(frozen=True)
class Ended:
    """One request as this rank ended it."""

    room: int
    state: str  # KVPoll name
    kind: str  # FailureKind value, "" on success
    reason: str
    seconds: float  # from begin to the end
    bytes_ok: bool | None  # decode SUCCESS: the slot holds exactly the reference bytes
    paused: float = 0.0  # how long the rank saw itself paused while it was open


class ChaosRank:
    def __init__(
        self, job: Job, role: str, rank: int, bootstrap: str, settings: dict[str, Any], slots: int
    ) -> None:
        self.job, self.rank = job, rank
        self.decode = role == "decode"
        opts = job.decode if self.decode else job.prefill
        self.side = build_side(job, opts)
        self.pool = HostPool(
            self.side.memory.regions_of(self.side.parallel.layers_of(rank)),
            shared=self.decode and job.transport == "shm",
        )
        self.views = {r.name: self.pool.view(r.name) for r in self.pool.regions()}
        need = -(-job.tokens // opts.page)
        self.slots = [
            Placement(
                job.tokens,
                {
                    "kv": np.arange(i * need, (i + 1) * need),
                    "swa": np.arange(i * need, (i + 1) * need),
                },
                {"state": i, "aux": i},
            )
            for i in range(slots)
        ]
        self._masks: dict[int, dict[str, np.ndarray]] = {}
        for v in self.views.values():
            v[:] = REUSED
        self.bridge = Bridge(
            role=Role.DECODE if self.decode else Role.PREFILL,
            spec=job.spec,
            parallel=self.side.parallel,
            rank=rank,
            memory=self.side.memory,
            regions=self.pool,
            transport=job.transport,
            transport_options=job.transport_options,
            bootstrap=bootstrap,
            engine_id=role,
            settings=Settings.from_env(**settings),
        ).start()
        self._ends: dict[int, tuple[Sender | Receiver, int, float]] = {}
        self._done: dict[int, Ended] = {}  # ended, slot not yet given back
        self._timers: list[threading.Timer] = []
        self.threads_at_start = threading.active_count()

    def identity(self) -> dict[str, Any]:
        sessions = self.bridge.sessions()
        return {
            "agent": self.bridge.agent,
            "control": self.bridge.info.control,
            "sessions": sessions,
        }

    def faults(self, text: str) -> None:
        """Change this rank's injected faults (counters restart)."""
        self.bridge.faults.reset(text)

    # ---- prefill -------------------------------------------------------------------------

    def begin_send(self, room: int, slot: int, delay: float = 0.0) -> None:
        place = self.slots[slot]
        fill(
            self.side,
            place,
            logical_cache(self.job.spec, self.job.tokens, room),
            {self.rank: self.views},
            decode=False,
            ranks=[self.rank],
        )
        s = self.bridge.sender(room, place)
        self._ends[room] = (s, slot, time.monotonic())
        if delay:  # a slow engine: the chunk comes late
            timer = threading.Timer(delay, self._late_send, args=(s,))
            self._timers.append(timer)
            timer.start()
        else:
            s.send(self.job.tokens)

    def _late_send(self, s: Sender) -> None:
        with contextlib.suppress(ClosedError):  # the rank closed before the engine was done
            s.send(self.job.tokens)

    # ---- decode --------------------------------------------------------------------------

    def begin_receive(self, room: int, slot: int) -> int:
        """Start receiving ``room`` into ``slot``. Returns the bytes of the slot that are no
        longer what the engine wrote when it took the slot back (landed after release)."""
        landed = self.landed(slot)
        r = self.bridge.receiver(room)
        self._ends[room] = (r, slot, time.monotonic())
        r.init(self.slots[slot])
        return landed

    def landed(self, slot: int | None = None) -> int:
        """Bytes of a free ``slot`` (of every slot: None) that are no longer what the engine
        wrote when it took the slot back."""
        slots = range(len(self.slots)) if slot is None else (slot,)
        return sum(
            int((self.views[n][m] != REUSED).sum()) for s in slots for n, m in self._mask(s).items()
        )

    def reuse(self, eager: bool = False) -> list[int]:
        """Take back the slots of ended requests whose pages are released; returns them.
        ``eager`` takes them back as soon as the request ended, as an engine that trusted a
        failure to mean "no more writes" would (the soak's negative control)."""
        freed = []
        for room in list(self._done):
            end, slot, _ = self._ends[room]
            if isinstance(end, Receiver) and not end.released and not eager:
                continue  # still quarantined: a writer may yet write
            if isinstance(end, Receiver):
                for n, m in self._mask(slot).items():
                    self.views[n][m] = REUSED
            freed.append(slot)
            del self._done[room], self._ends[room]
        return freed

    def held(self) -> dict[int, str]:
        """Rooms ended here whose slot is not back yet, with their release state."""
        out = {}
        for room in self._done:
            end = self._ends[room][0]
            out[room] = end.release.name if isinstance(end, Receiver) else "SENDER"
        return out

    def _mask(self, slot: int) -> dict[str, np.ndarray]:
        """Which bytes of each region a request in ``slot`` covers (written twice with two
        backgrounds: a byte is the request's where both agree)."""
        if slot not in self._masks:
            cache = logical_cache(self.job.spec, self.job.tokens, 0)
            a = {n: np.zeros(len(v), dtype=np.uint8) for n, v in self.views.items()}
            b = {n: np.full(len(v), 0xFF, dtype=np.uint8) for n, v in self.views.items()}
            for pools in (a, b):
                fill(
                    self.side,
                    self.slots[slot],
                    cache,
                    {self.rank: pools},
                    decode=True,
                    ranks=[self.rank],
                )
            self._masks[slot] = {n: a[n] == b[n] for n in a if (a[n] == b[n]).any()}
        return self._masks[slot]

    def _verify(self, room: int, slot: int) -> bool:
        mask = self._mask(slot)
        want = {n: self.views[n].copy() for n in mask}
        fill(
            self.side,
            self.slots[slot],
            logical_cache(self.job.spec, self.job.tokens, room),
            {self.rank: want},
            decode=True,
            ranks=[self.rank],
        )
        return all(np.array_equal(self.views[n][m], want[n][m]) for n, m in mask.items())

    # ---- both ----------------------------------------------------------------------------

    def collect(self) -> list[Ended]:
        """Requests that ended since the last call."""
        out = []
        for room, (end, slot, t0) in self._ends.items():
            if room in self._done or not end.poll().terminal:
                continue
            f = end.failure
            ok = None
            if self.decode and end.poll() is KVPoll.SUCCESS:
                ok = self._verify(room, slot)
            ended_at = end.status.ended_at or time.monotonic()
            e = self._done[room] = Ended(
                room,
                end.poll().name,
                getattr(getattr(f, "kind", None), "value", ""),
                getattr(f, "detail", ""),
                ended_at - t0,
                ok,
                end.status.paused,
            )
            out.append(e)
        return out

    def open(self, rooms: list[int]) -> dict[int, str]:
        """Where each of ``rooms`` still open here stands, in words (a hung request's
        evidence): its state, its age, its deadline and this rank's pauses."""
        now = time.monotonic()
        out = {}
        for room in rooms:
            if room not in self._ends or room in self._done:
                continue
            st = self._ends[room][0].status
            out[room] = (
                f"{st.state.name} {now - self._ends[room][2]:.1f} s in, deadline in "
                f"{st.deadline - now:.1f} s, paused {st.paused:.1f} s"
            )
        return out

    def stacks(self) -> str:
        """Where each of this rank's kvbridge threads is now (a hung request's evidence: a
        control thread held up, a lock waited on), innermost calls last."""
        frames = sys._current_frames()
        out = []
        for t in threading.enumerate():
            frame = frames.get(t.ident or -1)
            if frame is not None and t.name.startswith("kvbridge"):
                where = "".join(traceback.format_stack(frame, limit=6))
                out.append(f"--- {t.name}\n{where}")
        return "\n".join(out)

    def open_rooms(self) -> int:
        return sum(1 for e, _, _ in self._ends.values() if not e.poll().terminal)

    def stats(self) -> dict[str, int]:
        return {
            "active_rooms": self.bridge.active_rooms(),
            "threads": threading.active_count() - self.threads_at_start,
            "refused": self.bridge.channel.refused,
            "handler_errors": self.bridge.channel.handler_errors,
        }

    def close(self) -> None:
        for t in self._timers:
            t.cancel()
        self.bridge.close()
        self.pool.close()
