"""The completion rule under random interleavings of notices, failures and deadlines."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbridge.errors import FailureKind
from kvbridge.planner.transferplan import PartKind
from kvbridge.runtime.status import Completion, KVPoll, RequestStatus
from tiers import examples

TOKENS = 20
SENDERS = {
    0: frozenset({PartKind.KV, PartKind.AUX}),
    1: frozenset({PartKind.KV}),
    2: frozenset({PartKind.KV, PartKind.STATE}),
}
CHUNKS = [(0, 5), (5, 12), (12, 20)]


class CompletionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.completion = Completion(TOKENS, SENDERS)
        self.status = RequestStatus(7, deadline=100.0)
        self.status.advance(KVPoll.TRANSFERRING, 100.0)
        self.delivered: set[tuple[int, int]] = set()  # (sender, chunk index)
        self.tails: set[tuple[int, PartKind]] = set()
        self.failed = False

    @rule(sender=st.sampled_from(sorted(SENDERS)), chunk=st.integers(0, len(CHUNKS) - 1))
    def notice(self, sender: int, chunk: int) -> None:
        start, stop = CHUNKS[chunk]
        last = chunk == len(CHUNKS) - 1
        parts = [PartKind.KV] + (
            [k for k in SENDERS[sender] if k is not PartKind.KV] if last else []
        )
        self.completion.record(sender, start, stop, parts)  # duplicates are fine
        self.delivered.add((sender, chunk))
        if last:
            self.tails |= {(sender, k) for k in parts if k is not PartKind.KV}
        if self.completion.done:
            self.status.succeed()

    @rule(kind=st.sampled_from(list(FailureKind)))
    def failure(self, kind: FailureKind) -> None:
        if self.status.fail(kind, "boom"):
            self.failed = True

    @rule(now=st.floats(0, 200))
    def tick(self, now: float) -> None:
        if self.status.check_deadline(now):
            self.failed = True

    @precondition(lambda self: not self.status.state.terminal)
    @rule()
    def stays_open_until_everything_arrived(self) -> None:
        everything = all((s, c) in self.delivered for s in SENDERS for c in range(len(CHUNKS)))
        assert self.completion.done == everything

    @invariant()
    def done_iff_every_part_of_every_sender(self) -> None:
        everything = all((s, c) in self.delivered for s in SENDERS for c in range(len(CHUNKS)))
        assert self.completion.done == everything
        if self.completion.done:
            assert self.completion.missing() == {}
        else:
            assert self.completion.missing()

    @invariant()
    def terminal_states_are_sticky_and_explained(self) -> None:
        if self.failed:
            assert self.status.state is KVPoll.FAILED
            assert self.status.failure is not None and self.status.failure.kind in FailureKind
        if self.status.state is KVPoll.SUCCESS:
            assert not self.failed and self.completion.done


TestCompletion = CompletionMachine.TestCase
# (Hypothesis's default size in the full suite, a tenth in the fast tier)
TestCompletion.settings = settings(max_examples=examples(100))


def test_a_notice_from_an_unexpected_sender_or_part_is_refused() -> None:
    import pytest

    from kvbridge.errors import ProtocolError

    c = Completion(TOKENS, SENDERS)
    with pytest.raises(ProtocolError, match="not an expected sender"):
        c.record(5, 0, 5, [PartKind.KV])
    with pytest.raises(ProtocolError, match="does not owe"):
        c.record(1, 0, 5, [PartKind.STATE])
    with pytest.raises(ProtocolError, match="outside the request"):
        c.record(0, 15, 25, [PartKind.KV])
    assert not c.done


# ---- layer by layer ---------------------------------------------------------------------------

LAYERS = {
    0: (frozenset(range(0, 4)), frozenset()),  # a KV stage, layers 0-3
    1: (frozenset({4, 6}), frozenset({5, 7})),
}  # a hybrid stage: attention and state
OWES = {0: frozenset({PartKind.KV}), 1: frozenset({PartKind.KV, PartKind.STATE, PartKind.AUX})}


@st.composite
def pieces(draw: st.DrawFn) -> list[tuple[int, int, range]]:
    """Every (sender, chunk, layer group) a layer-wise prefill sends, in a random order."""
    out = []
    for sender, (kv, state) in LAYERS.items():
        layers = sorted(kv | state)
        for chunk in range(len(CHUNKS)):
            cut = draw(st.integers(1, len(layers)))
            out += [
                (sender, chunk, range(layers[0], layers[cut - 1] + 1)),
                (sender, chunk, range(layers[cut - 1] + 1, layers[-1] + 1)),
            ]
    return draw(st.permutations([p for p in out if len(p[2])]))


@given(pieces())
def test_layer_wise_notices_complete_exactly_when_every_layer_of_every_token_arrived(
    order: list[tuple[int, int, range]],
) -> None:
    c = Completion(TOKENS, OWES, LAYERS)
    final = len(CHUNKS) - 1
    completing = max(i for i, (s, ch, _) in enumerate(order) if s == 1 and ch == final)
    # what must arrive, one item at a time: KV of each (sender, chunk, KV layer), the state of
    # each stateful layer (with the last chunk), and the aux slot
    owed = (
        {
            ("kv", s, ch, li)
            for s, (kv, _) in LAYERS.items()
            for ch in range(len(CHUNKS))
            for li in kv
        }
        | {("state", 1, final, li) for li in LAYERS[1][1]}
        | {("aux",)}
    )
    for i, (sender, chunk, layers) in enumerate(order):
        start, stop = CHUNKS[chunk]
        parts = [PartKind.KV] + ([PartKind.STATE] if chunk == final and sender == 1 else [])
        if i == completing:
            parts.append(PartKind.AUX)  # with the send that completes the last chunk
        c.record(sender, start, stop, parts, layers)
        owed -= (
            {("kv", sender, chunk, li) for li in layers}
            | {("state", sender, chunk, li) for li in layers}
            | ({("aux",)} if i == completing else set())
        )
        assert c.done == (not owed), (owed, c.missing())
    assert c.done, c.missing()


def test_a_missing_layer_is_named() -> None:
    import pytest

    from kvbridge.errors import ProtocolError

    c = Completion(TOKENS, OWES, LAYERS)
    for start, stop in CHUNKS:
        c.record(0, start, stop, [PartKind.KV], range(0, 3))  # layer 3 never comes
    c.record(1, 0, TOKENS, [PartKind.KV, PartKind.STATE, PartKind.AUX], range(4, 6))
    assert c.missing() == {
        0: "kv of layers 3 (as few as 0/20 tokens)",
        1: "kv of layers 6 (as few as 0/20 tokens), state of layers 7",
    }
    with pytest.raises(ProtocolError, match=r"reported layers \[3, 5\); its layers are 0-3"):
        c.record(0, 0, 5, [PartKind.KV], range(3, 5))
    with pytest.raises(ProtocolError, match="its layers are"):
        c.record(0, 0, 5, [PartKind.KV], range(0, 10**12))


@given(
    timeout=st.floats(0.5, 100.0),
    pauses=st.lists(st.floats(0.0, 50.0), max_size=40),
    advance_at=st.integers(0, 40),
)
def test_a_ranks_pauses_move_a_deadline_back_at_most_as_far_again_as_its_timeout(
    timeout: float, pauses: list[float], advance_at: int
) -> None:
    """A rank starved without end (every tick late) still ends its requests: in each state
    its pauses move the deadline back by what they lasted, up to that state's own timeout."""
    s = RequestStatus(7, deadline=time.monotonic() + timeout)
    set_at = s.deadline
    moved = 0.0
    for i, p in enumerate(pauses):
        if i == advance_at:  # a new state: a new deadline, its own allowance
            assert s.advance(KVPoll.TRANSFERRING, time.monotonic() + timeout)
            set_at, moved = s.deadline, 0.0
        s.extend(p)
        moved = min(moved + p, timeout)
        assert abs(s.deadline - (set_at + moved)) < 0.05
    assert abs(s.paused - sum(pauses)) < 1e-6
    if sum(pauses) and s.check_deadline(s.deadline + 1.0):
        assert s.failure is not None and "this rank was paused" in s.failure.detail
