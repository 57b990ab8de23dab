"""Per-request status on each side, and the decode side's completion rule.

:class:`RequestStatus` moves forward only (Bootstrapping -> WaitingForInput -> Transferring ->
Success | Failed); the first terminal state wins; every non-terminal state has a deadline.

:class:`Completion` is the rule of the second design idea, expected senders are derived, never
guessed (docs/design.md): a decode rank's request is complete when every expected sender
(derived by the planner) has reported every part it owes: KV chunks covering all tokens, the
state where the model has state, aux always. Notices are keyed by sender engine rank and token
range, so duplicates and reordering change nothing and two senders never collide.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from kvbridge.errors import FailureKind, ProtocolError, TransferFailed
from kvbridge.planner.transferplan import PartKind
from kvbridge.runtime.timeline import Phase, Timeline

_R = TypeVar("_R")


class KVPoll(enum.IntEnum):
    """What polling a sender or receiver says. Values match SGLang's KVPoll."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def terminal(self) -> bool:
        return self in (KVPoll.FAILED, KVPoll.SUCCESS)


_ORDER = {KVPoll.BOOTSTRAPPING: 0, KVPoll.WAITING_FOR_INPUT: 1, KVPoll.TRANSFERRING: 2}


def each(requests: Iterable[_R], fn: Callable[[_R], object]) -> None:
    """``fn`` on every one of ``requests``, even where it raises for some: one request's bug
    must not keep the others past their deadlines (a tick that raised at one request would
    leave every later one open, tick after tick). The first error is raised at the end, for
    the control channel to log and count."""
    first: Exception | None = None
    for r in requests:
        try:
            fn(r)
        except Exception as e:
            first = first or e
    if first is not None:
        raise first


class RequestStatus:
    """Thread-safe state of one request on one rank."""

    def __init__(
        self,
        room: int,
        deadline: float,
        on_end: Callable[[RequestStatus], None] | None = None,
    ) -> None:
        """``on_end``: called once when the request ends either way (the runtime counts and
        logs outcomes there), before anyone waiting learns it ended, under this status's lock:
        it must not call back into the status."""
        self.room = room
        self._state = KVPoll.BOOTSTRAPPING
        self._deadline = deadline
        self._failure: TransferFailed | None = None
        self._on_end = on_end
        self.created_at = time.monotonic()
        # This rank's own pauses (:meth:`extend`): the furthest they can move the state's
        # deadline (as far again as its timeout), what of them moved it, and all of them.
        self._latest = deadline + max(0.0, deadline - self.created_at)
        self._moved = 0.0
        self.paused = 0.0
        self.transferring_at: float | None = None  # time.monotonic() it began transferring
        self.ended_at: float | None = None  # time.monotonic() of Success or Failed
        self.timeline = Timeline(self.created_at)  # its phases' moments, for the budget
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    @property
    def state(self) -> KVPoll:
        return self._state

    @property
    def failure(self) -> TransferFailed | None:
        return self._failure

    @property
    def deadline(self) -> float:
        return self._deadline

    @property
    def latest(self) -> float:
        """The furthest this state's deadline can move (:meth:`extend`): past it the request
        is over whatever this rank's pauses were, which the engine's own polling enforces
        where the control thread that ticks deadlines is held up. Set with the state (no
        lock: an engine reads it at every poll)."""
        return self._latest

    def advance(self, state: KVPoll, deadline: float) -> bool:
        """Move forward to a non-terminal ``state`` with a new deadline. Returns False (and
        changes nothing) if the request is already there, past it, or ended."""
        with self._lock:
            if self._state.terminal or _ORDER[state] <= _ORDER[self._state]:
                return False
            self._state, self._deadline = state, deadline
            self._latest, self._moved = deadline + max(0.0, deadline - time.monotonic()), 0.0
            if state is KVPoll.TRANSFERRING:
                self.transferring_at = time.monotonic()
            self._changed.notify_all()
            return True

    def succeed(self) -> bool:
        return self._end(KVPoll.SUCCESS, None)

    def fail(self, kind: FailureKind, reason: str) -> bool:
        """End in Failed unless already ended. Returns whether this call ended it."""
        return self._end(KVPoll.FAILED, TransferFailed(kind, reason))

    def _end(self, state: KVPoll, failure: TransferFailed | None) -> bool:
        with self._lock:
            if self._state.terminal:
                return False
            self._state, self._failure = state, failure
            self.ended_at = time.monotonic()
            self.timeline.mark(Phase.ENDED, self.ended_at)
            if self._on_end is not None:
                self._on_end(self)
            self._changed.notify_all()
        return True

    def extend(self, seconds: float) -> None:
        """This rank was paused ``seconds``: its own stall is not the other side's delay, so
        the deadline moves back as much, but in each state at most as far again as that
        state's own timeout. A rank starved without end (every tick late) still ends its
        requests, within twice their deadlines."""
        with self._lock:
            if self._state.terminal:
                return
            self.paused += seconds
            step = min(seconds, self._latest - self._deadline)
            self._deadline += step
            self._moved += step

    def paused_note(self) -> str:
        """What this rank's pauses did to the deadline, for a deadline failure's reason."""
        with self._lock:
            if not self.paused:
                return ""
            return (
                f"; this rank was paused {self.paused:.1f} s in all, which moved the "
                f"deadline back {self._moved:.1f} s (at most the state's own timeout)"
            )

    def check_deadline(self, now: float, detail: str = "") -> bool:
        """Fail with DEADLINE if the current state's deadline has passed (``detail``: what
        the request still waited for, in words)."""
        with self._lock:
            if self._state.terminal or now < self._deadline:
                return False
        return self.fail(
            FailureKind.DEADLINE,
            f"room {self.room}: still {self._state.name} when its deadline passed"
            + (f"; {detail}" if detail else "")
            + self.paused_note(),
        )

    def wait(
        self, timeout: float, until: Iterable[KVPoll] = (KVPoll.SUCCESS, KVPoll.FAILED)
    ) -> KVPoll:
        targets = set(until)
        end = time.monotonic() + timeout
        with self._lock:
            while self._state not in targets:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self._state


class Completion:
    """What one decode rank still waits for, for one request.

    A sender owes KV of every token for each of its layers with per-token components, the
    state of each of its stateful layers where it owes state, and aux where it owes aux. A
    notice covers a token range for some of its layers (``layers``; all of them by default):
    a prefill rank that sends layer by layer, as its forward computes them, reports each layer
    group, in any order. ``layers`` maps each sender to (KV layers, state layers); without it
    every sender is one group of layers, covered by every notice. Only tokens ``[start,
    tokens)`` are owed; a notice may cover earlier ones (a chunk that carried no bytes here).
    """

    def __init__(
        self,
        tokens: int,
        expected: Mapping[int, frozenset[PartKind]],
        layers: Mapping[int, tuple[frozenset[int], frozenset[int]]] | None = None,
        *,
        start: int = 0,
    ) -> None:
        if not expected:
            raise ValueError("a request must expect at least one sender (aux is always owed)")
        if not 0 <= start < tokens:
            raise ValueError(f"start {start} must be in [0, {tokens})")
        self.tokens = tokens
        self.start = start  # tokens before it are held already (a prefix hit): not owed
        self.expected = dict(expected)
        whole = (frozenset({0}), frozenset({0}))
        self._layers = {s: (layers[s] if layers is not None else whole) for s in expected}
        self._kv: dict[int, dict[int, list[tuple[int, int]]]] = {
            s: {li: [] for li in self._layers[s][0]}
            for s, k in expected.items()
            if PartKind.KV in k
        }
        self._state: dict[int, set[int]] = {
            s: set(self._layers[s][1]) for s, k in expected.items() if PartKind.STATE in k
        }
        self._aux = {s for s, k in expected.items() if PartKind.AUX in k}

    def record(
        self,
        sender: int,
        start: int,
        stop: int,
        parts: Iterable[PartKind],
        layers: range | None = None,
    ) -> None:
        """Record one notice. Raises ProtocolError for a sender, part or layer that is not
        owed."""
        owed = self.expected.get(sender)
        if owed is None:
            raise ProtocolError(
                f"prefill rank {sender} is not an expected sender; expected {sorted(self.expected)}"
            )
        kv_layers, state_layers = self._layers[sender]
        known = kv_layers | state_layers
        if layers is not None and (
            not len(layers)
            or layers.start < min(known)
            or layers.stop > max(known) + 1
            or layers.step != 1
            or not set(layers) <= known
        ):
            raise ProtocolError(
                f"prefill rank {sender} reported layers [{layers.start}, "
                f"{layers.stop}); its layers are "
                f"{ranges_text(kv_layers | state_layers)}"
            )
        for part in parts:
            if part not in owed:
                raise ProtocolError(
                    f"prefill rank {sender} reported {part.value}, which it "
                    f"does not owe (owes {sorted(p.value for p in owed)})"
                )
            if part is PartKind.KV:
                if not 0 <= start < stop <= self.tokens:
                    raise ProtocolError(
                        f"prefill rank {sender} reported tokens [{start}, {stop})"
                        f" outside the request's {self.tokens}"
                    )
                for li in kv_layers if layers is None else kv_layers & set(layers):
                    self._kv[sender][li] = _merge(self._kv[sender][li], (start, stop))
            elif part is PartKind.STATE:
                self._state[sender] -= state_layers if layers is None else set(layers)
            else:
                self._aux.discard(sender)

    @property
    def done(self) -> bool:
        return not self.missing()

    def missing(self) -> dict[int, str]:
        """Per sender still owing something: what, in words (for failure reasons)."""
        out = {}
        owed = self.tokens - self.start
        for s in self.expected:
            what = []
            short = {
                li: got
                for li, ivs in self._kv.get(s, {}).items()
                if (got := self._covered(ivs)) < owed
            }
            if short:
                have = min(short.values())
                what.append(
                    f"kv ({have}/{owed} tokens)"
                    if len(short) == len(self._kv[s]) and len(set(short.values())) == 1
                    else f"kv of layers {ranges_text(short)} (as few as {have}/{owed} tokens)"
                )
            if self._state.get(s):
                what.append(
                    "state"
                    if self._state[s] == set(self._layers[s][1])
                    else f"state of layers {ranges_text(self._state[s])}"
                )
            if s in self._aux:
                what.append("aux")
            if what:
                out[s] = ", ".join(what)
        return out

    def _covered(self, ranges: list[tuple[int, int]]) -> int:
        """How many owed tokens ``[start, tokens)`` the merged ranges cover."""
        return sum(max(0, min(b, self.tokens) - max(a, self.start)) for a, b in ranges)


def ranges_text(values: Iterable[int]) -> str:
    """``0-3,7``: sorted integers as runs."""
    v = sorted(values)
    out, i = [], 0
    while i < len(v):
        j = i
        while j + 1 < len(v) and v[j + 1] == v[j] + 1:
            j += 1
        out.append(str(v[i]) if i == j else f"{v[i]}-{v[j]}")
        i = j + 1
    return ",".join(out)


def _merge(ranges: list[tuple[int, int]], new: tuple[int, int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted([*ranges, new]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
