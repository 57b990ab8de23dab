"""The completion rule under random interleavings of notices, failures and deadlines."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbridge.errors import FailureKind
from kvbridge.plan import PartKind
from kvbridge.status import Completion, KVPoll, RequestStatus

TOKENS = 20
SENDERS = {0: frozenset({PartKind.KV, PartKind.AUX}), 1: frozenset({PartKind.KV}),
           2: frozenset({PartKind.KV, PartKind.STATE})}
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
        parts = [PartKind.KV] + ([k for k in SENDERS[sender] if k is not PartKind.KV]
                                 if last else [])
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
