"""What a prefill rank keeps of the rooms it has no sender for.

A decode rank's metadata may come before the engine made the room's sender: it is parked (at
most ``max_parked`` in all, each for ``waiting_timeout``) and bound once the sender exists. A
room that ended here is remembered (the newest :data:`ENDED_MAX`, each for
``waiting_timeout``), with its failure (None: success), so that late metadata is answered at
once instead of parked, and a room aborted before the engine got to it fails as soon as it
does.

Not thread-safe: the role calls every method under its own lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from kvbridge.errors import TransferFailed
from kvbridge.wire.protocol import RequestMeta

ENDED_MAX = 1 << 16  # ended rooms remembered, to answer late metadata at once


@dataclass(frozen=True)
class Asked:
    """A decode engine's ask for a room this rank has no sender for yet: the request's
    length and the first token it needs (its prefix-cache hit ends there); or why the room
    already ended (it was aborted first)."""

    tokens: int = 0
    start: int = 0
    failure: TransferFailed | None = None
    fingerprint: bytes = b""  # the decode engine's digest of the request's tokens, if given


@dataclass(frozen=True)
class Ended:
    """A room that ended here: when, its failure (None: success), and the fingerprint of the
    request that held it (empty: none given), which late metadata for other tokens differs
    from."""

    at: float
    failure: TransferFailed | None
    fingerprint: bytes = b""

    def other_tokens(self, fingerprint: bytes) -> bool:
        return bool(self.fingerprint and fingerprint and fingerprint != self.fingerprint)


class Parked:
    """Metadata parked before its sender, and rooms that ended."""

    def __init__(self) -> None:
        self._early: dict[int, list[RequestMeta]] = {}
        self._early_at: dict[int, float] = {}
        # Rooms that ended here (None: success), so that late metadata is answered at once
        # instead of parked; and failures that came before the engine made a sender.
        self._ended: OrderedDict[int, Ended] = OrderedDict()

    def rooms(self) -> int:
        """How many rooms have metadata parked."""
        return len(self._early)

    def park(self, msg: RequestMeta, limit: int) -> bool:
        """Park ``msg`` unless ``limit`` metadata are parked already."""
        if sum(len(v) for v in self._early.values()) >= limit:
            return False
        self._early.setdefault(msg.room, []).append(msg)
        self._early_at.setdefault(msg.room, time.monotonic())
        return True

    def claim(self, room: int) -> tuple[list[RequestMeta], TransferFailed | None]:
        """The engine made the room's sender: its parked metadata, and its failure if it was
        aborted before; the room is forgotten here."""
        early = self._early.pop(room, [])
        self._early_at.pop(room, None)
        ended = self._ended.pop(room, None)
        return early, None if ended is None else ended.failure

    def asked(self, room: int) -> Asked | None:
        """What a decode engine asked of ``room`` (None: nothing yet)."""
        early = self._early.get(room)
        ended = self._ended.get(room) if early is None else None
        if early:
            return Asked(early[0].tokens, early[0].start, fingerprint=early[0].fingerprint)
        if ended is not None and ended.failure is not None:
            return Asked(failure=ended.failure)
        return None

    def ended(self, room: int) -> Ended | None:
        """How the room ended here; None if it did not."""
        return self._ended.get(room)

    def abort(self, room: int, failure: TransferFailed) -> None:
        """A decode rank aborted a room that has no sender here: its parked metadata go, and
        the failure is remembered (unless the room had ended already)."""
        dropped = self._early.pop(room, None)
        self._early_at.pop(room, None)
        if dropped is not None or room not in self._ended:
            self.remember(room, failure)

    def remember(self, room: int, failure: TransferFailed | None, fingerprint: bytes = b"") -> None:
        """Record an ended room; the oldest are forgotten."""
        self._ended[room] = Ended(time.monotonic(), failure, fingerprint)
        self._ended.move_to_end(room)
        while len(self._ended) > ENDED_MAX:
            self._ended.popitem(last=False)

    def expire(self, now: float, timeout: float) -> None:
        """Forget what is older than ``timeout``."""
        for room in [r for r, t in self._early_at.items() if now - t > timeout]:
            del self._early[room], self._early_at[room]
        while self._ended and now - next(iter(self._ended.values())).at > timeout:
            self._ended.popitem(last=False)

    def postpone(self, seconds: float) -> None:
        """This rank was paused ``seconds``: parked metadata waits as long again."""
        for room in self._early_at:
            self._early_at[room] += seconds
