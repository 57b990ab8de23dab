"""The prefill worker's jobs, one dataclass each, taken in order by its one thread.

One synchronous worker means that when it takes a :class:`Notify` or an :class:`Ack`, no write
of any request is in flight: draining is free, and an acknowledgement is the truth.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.runtime.prefill.sender import Sender
from kvbridge.wire.protocol import Abort


@dataclass(frozen=True, eq=False)
class WriteChunk:
    """Write chunk ``index`` of a request to decode rank ``decode_rank``, then report it."""

    sender: Sender
    decode_rank: int
    index: int


@dataclass(frozen=True, eq=False)
class Notify:
    """Tell every decode rank of a failed request why (nothing of it is in flight now)."""

    sender: Sender


@dataclass(frozen=True, eq=False)
class Ack:
    """Acknowledge an abort at ``endpoint`` (nothing of the room is in flight now)."""

    abort: Abort
    endpoint: str


@dataclass(frozen=True)
class Land:
    """Land the writes another thread posted (``post_now``; the worker does before every job)."""


@dataclass(frozen=True)
class Stop:
    """The rank is closing: the worker ends."""


Job = WriteChunk | Notify | Ack | Land | Stop
