"""Attention data parallelism: which prefill DP group holds a request.

An engine serving with attention DP runs several attention groups, each with its own TP (and
PP, CP) and its own requests. In kvbridge each group is an engine of its own, named
:func:`group_engine_id` (``prefill.dp1``), registered with the deployment's one bootstrap
service. A request lives in one prefill group and one decode group: a decode rank links to the
prefill group that holds the room and to no other, so routes, completion, fencing and aux are
all per (prefill group, decode group) pairing, and DP sizes may differ between the sides.

A decode rank never guesses the prefill group. The first rank of each prefill group announces
the rooms it schedules (:class:`RoomAnnouncer`); a decode rank that is not told the group asks
the bootstrap service (:class:`RoomResolver`), which answers as soon as the room is announced,
or at once where the prefill side is a single engine without DP. Both batch their calls on a
thread of their own: neither ever blocks the engine's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvbridge.bootstrap import BootstrapClient
from kvbridge.bootstrap.rooms import MAX_ROOMS_PER_CALL
from kvbridge.errors import BootstrapError, KVBridgeError
from kvbridge.planner.parallel import MAX_DP

log = logging.getLogger("kvbridge.bootstrap.groups")

_LOOKUP_WAIT = 1.0  # seconds the server may hold one lookup
_LOOKUP_SLACK = 0.5  # seconds more for its answer: an unreachable service is reported soon
_RETRY = 0.2  # seconds between attempts while the bootstrap service is unreachable
# Seconds a batcher's thread waits with nothing queued before it ends (the next room starts
# another): a decode rank has one resolver per bootstrap address its requests ever named, and
# a client names the address.
IDLE_EXIT = 30.0


def group_engine_id(engine_id: str, dp: int, dp_rank: int) -> str:
    """The engine id of DP group ``dp_rank`` of a deployment named ``engine_id``."""
    if isinstance(dp, bool) or not isinstance(dp, int) or not 1 <= dp <= MAX_DP:
        raise KVBridgeError(
            f"dp (attention DP groups) must be an integer in [1, {MAX_DP}], got {dp!r}"
        )
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp:
        raise KVBridgeError(f"dp_rank must be in [0, {dp}) for {dp} DP groups, got {dp_rank!r}")
    return engine_id if dp == 1 else f"{engine_id}.dp{dp_rank}"


class _Batcher:
    """A thread that takes the rooms queued so far, up to a call's worth, and hands them to
    ``work``; it sleeps while nothing is queued."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pending: dict[int, None] = {}  # insertion-ordered set
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None  # the running one (None: none runs)

    def start(self) -> None:
        with self._cond:
            self._spawn()

    def _spawn(self) -> None:
        """A thread, where none runs (under the condition's lock)."""
        if self._thread is None and not self._stop:
            self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
            self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(2 * _LOOKUP_WAIT + 1)

    def add(self, room: int) -> None:
        with self._cond:
            self._pending[room] = None
            self._cond.notify_all()
            self._spawn()

    def discard(self, room: int) -> None:
        with self._cond:
            self._pending.pop(room, None)

    def _take(self) -> list[int] | None:
        """The next rooms to work on; None when the thread is to end (it says so under the
        lock, so that a room added after starts another)."""
        with self._cond:
            idle_until = time.monotonic() + IDLE_EXIT
            while not self._pending and not self._stop:
                left = idle_until - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._stop or not self._pending:
                self._thread = None
                return None
            return list(self._pending)[:MAX_ROOMS_PER_CALL]

    def _run(self) -> None:
        while (rooms := self._take()) is not None:
            try:
                self.work(rooms)
            except Exception:  # a bug here must not end the thread: rooms fail by deadline
                log.exception("%s", self._name)
                time.sleep(_RETRY)

    def work(self, rooms: list[int]) -> None:
        raise NotImplementedError


class RoomAnnouncer(_Batcher):
    """Tells the bootstrap service which rooms prefill engine ``engine`` holds (``held``: the
    rooms it holds now, announced again by :meth:`again`). A room that cannot be announced
    (another engine holds it, or the service refused) is reported to ``refused(room, reason)``;
    one taken once is not for a service that failed to take it again (the next try will)."""

    def __init__(
        self,
        client: BootstrapClient,
        engine: str,
        refused: Callable[[int, str], None],
        held: Callable[[], list[int]],
    ) -> None:
        super().__init__(f"kvbridge-announce-{engine}")
        self.client, self.engine, self.refused, self.held = client, engine, refused, held
        self._taken: set[int] = set()  # rooms the service took once

    def again(self) -> None:
        """Announce every room ``held`` now once more: a service restarted since knows none."""
        rooms = self.held()
        with self._cond:
            self._taken &= set(rooms)
        for room in rooms:
            self.add(room)

    def work(self, rooms: list[int]) -> None:
        why = ""
        try:
            conflicts = self.client.announce_rooms(self.engine, rooms)
        except BootstrapError as e:
            with self._cond:
                conflicts = {r: "" for r in rooms if r not in self._taken}
            why = f"could not announce it to the bootstrap service: {e}"
        with self._cond:
            self._taken.update(r for r in rooms if r not in conflicts)
        for r in rooms:
            self.discard(r)
        for room, holder in conflicts.items():
            self.refused(
                room,
                f"room {room} is held by prefill engine {holder!r} already"
                if holder
                else f"room {room}: {why}",
            )


class RoomResolver(_Batcher):
    """Asks the bootstrap service at ``client.address`` which prefill engine holds each room
    queued with :meth:`resolve`; ``resolved(room, engine)`` is called on this thread."""

    def __init__(self, client: BootstrapClient, resolved: Callable[[int, str], None]) -> None:
        super().__init__(f"kvbridge-resolve-{client.address}")
        self.client, self.resolved = client, resolved
        self.single: str | None = None  # the one engine there is, once the service said so
        self.last_error = ""

    def resolve(self, room: int) -> str | None:
        """The engine holding ``room`` if it is known now; else None, and the answer comes to
        ``resolved`` later."""
        single = self.single
        if single is not None:
            return single
        self.add(room)
        return None

    def work(self, rooms: list[int]) -> None:
        try:
            found, single = self.client.find_rooms(
                rooms, _LOOKUP_WAIT, deadline=time.monotonic() + _LOOKUP_WAIT + _LOOKUP_SLACK
            )
        except BootstrapError as e:
            self.last_error = str(e)
            time.sleep(_RETRY)
            return
        self.last_error = ""
        if single is not None:
            self.single = single
            found = {r: single for r in rooms}
        for room, engine in found.items():
            self.discard(room)
            self.resolved(room, engine)
