"""The room table: which prefill engine (attention DP group) holds each request.

A prefill deployment with attention data parallelism is several kvbridge engines, one per DP
group, behind one bootstrap service; each request lives in one of them. The prefill side
announces a room when it schedules the request, and a decode rank asks where a room is instead
of guessing (a room-modulo-DP guess sends a request to a group that never heard of it).

The table is bounded: at most ``capacity`` rooms, each forgotten ``ttl`` seconds after it was
announced (a decode rank asks within its bootstrap deadline, seconds after the prefill side
scheduled the request). A room another engine holds is a conflict, refused, never moved.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvbridge.errors import BootstrapError

ROOM_TTL = 300.0
ROOM_CAPACITY = 1 << 18
MAX_ROOMS_PER_CALL = 256  # rooms one announcement or lookup names


class RoomTable:
    """Room -> engine, in announcement order. Not thread-safe: the server's event loop owns it."""

    def __init__(self, ttl: float = ROOM_TTL, capacity: int = ROOM_CAPACITY) -> None:
        if not ttl > 0 or capacity < 1:
            raise BootstrapError(
                f"room table needs ttl > 0 s and capacity >= 1, got ttl={ttl}, capacity={capacity}"
            )
        self.ttl, self.capacity = ttl, capacity
        self._rooms: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rooms)

    def announce(self, engine: str, rooms: Iterable[int], now: float) -> dict[int, str]:
        """Record ``rooms`` as ``engine``'s. Returns ``{room: engine holding it}`` for rooms
        another engine holds (those are not recorded). Raises BootstrapError, recording none,
        if the new rooms do not fit."""
        self.expire(now)
        conflicts, new = {}, []
        for room in dict.fromkeys(rooms):
            held = self._rooms.get(room)
            if held is not None and held[0] != engine:
                conflicts[room] = held[0]
            elif held is None:
                new.append(room)
        if len(self._rooms) + len(new) > self.capacity:
            raise BootstrapError(
                f"the room table holds {len(self._rooms)} rooms of at most "
                f"{self.capacity} (each kept {self.ttl:.0f} s); {len(new)} "
                f"more do not fit"
            )
        for room in new:
            self._rooms[room] = (engine, now)
        return conflicts

    def find(self, rooms: Iterable[int], now: float) -> dict[int, str]:
        """The engine of each known room among ``rooms``."""
        self.expire(now)
        return {room: self._rooms[room][0] for room in rooms if room in self._rooms}

    def forget_engine(self, engine: str) -> None:
        """An engine that left: its rooms are no longer its (it may come back as another)."""
        for room in [r for r, (e, _) in self._rooms.items() if e == engine]:
            del self._rooms[room]

    def expire(self, now: float) -> None:
        while self._rooms:
            room, (_, at) = next(iter(self._rooms.items()))
            if now - at <= self.ttl:
                return
            del self._rooms[room]
