"""A staging region's slots, handed out in the order they were asked for.

Fixed-size slots rather than a byte allocator: every segment fits a slot, a freed slot fits
any ask, so nothing fragments and the ask at the head of the queue is always the next served.

Back-pressure without failure or deadlock: an ask that finds no free slot waits in the queue
(it never fails for want of space); a slot is freed when the bytes in it are used (or their
request is released), which never waits on another ask, so every slot in use is freed in
finite time and every ask is served in turn.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class Grant:
    """Slot ``slot`` given to the ask ``key``."""

    key: Hashable
    slot: int


class SlotRing:
    """``slots`` slots; thread-safe."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a staging ring needs at least one slot, got {slots}")
        self.slots = slots
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(slots))
        self._held: dict[int, Hashable] = {}
        self._waiting: deque[Hashable] = deque()

    def ask(self, key: Hashable) -> Grant | None:
        """A slot for ``key`` now, or None: the ask waits its turn (see :meth:`free`)."""
        with self._lock:
            if self._free and not self._waiting:
                slot = self._free.popleft()
                self._held[slot] = key
                return Grant(key, slot)
            self._waiting.append(key)
            return None

    def take(self) -> int | None:
        """A free slot for this rank's own use (no queue: the caller decides how to wait)."""
        with self._lock:
            if self._waiting or not self._free:
                return None
            slot = self._free.popleft()
            self._held[slot] = None
            return slot

    def holder(self, slot: int) -> Hashable | None:
        with self._lock:
            return self._held.get(slot)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def free(
        self, slots: list[int], live: Callable[[Hashable], bool] = lambda k: True
    ) -> list[Grant]:
        """Free ``slots`` and serve waiting asks in order (an ask whose ``live`` is False is
        dropped); returns the grants made, for the caller to deliver."""
        with self._lock:
            for slot in slots:
                if self._held.pop(slot, _NONE) is not _NONE:
                    self._free.append(slot)
            grants = []
            while self._free and self._waiting:
                key = self._waiting.popleft()
                if not live(key):
                    continue
                slot = self._free.popleft()
                self._held[slot] = key
                grants.append(Grant(key, slot))
            return grants

    def release(
        self, owns: Callable[[Hashable], bool], live: Callable[[Hashable], bool] = lambda k: True
    ) -> list[Grant]:
        """Drop every waiting ask and free every slot whose key ``owns`` says is the caller's
        (a request that ended); returns the grants this made to other asks."""
        with self._lock:
            self._waiting = deque(k for k in self._waiting if not owns(k))
            mine = [s for s, k in self._held.items() if k is not None and owns(k)]
        return self.free(mine, live)

    def drop_waiting(self, owns: Callable[[Hashable], bool]) -> None:
        """Forget waiting asks ``owns`` says are the caller's; slots they hold stay held."""
        with self._lock:
            self._waiting = deque(k for k in self._waiting if not owns(k))


_NONE = object()
