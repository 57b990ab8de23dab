"""kvbridge's KV sender for SGLang's prefill scheduler: one request on one prefill rank (see
:mod:`.backend` for the protocol SGLang drives).

SGLang keys a transfer by its bootstrap room alone. Where the two servers' requests under one
room are not the same tokens (a router gave two requests one room, or a proxy sent the two
legs of one request different prompts), the decode's ask carries its tokens' fingerprint
(:func:`.request.fingerprint`): a prefill request with another one fails at once, and so does
the ask (the decode side learns why at once), never a KV crossing into another request's
pages or a request waiting out its deadline; a request that finds its room held (now, or
lately with other tokens) by another request of this server fails at once too.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sglang.srt.disaggregation.base.conn import BaseKVSender, KVTransferMetric

from kvbridge.errors import FailureKind, KVBridgeError, TransferFailed
from kvbridge.integrations.sglang.pools import NO_STATE, PrefillPages
from kvbridge.integrations.sglang.request import elsewhere, fingerprint
from kvbridge.integrations.sglang.states import StateIndices
from kvbridge.runtime import Sender
from kvbridge.runtime.prefill.role import Asked
from kvbridge.runtime.prefill.sender import MISMATCH
from kvbridge.runtime.status import KVPoll

if TYPE_CHECKING:
    from kvbridge.integrations.sglang.backend import KVBridgeKVManager

log = logging.getLogger("kvbridge.sglang")


class KVBridgeKVSender(BaseKVSender):  # type: ignore[misc]
    """One request on one prefill rank."""

    supports_host_tensor_indices = False  # True takes SGLang's CUDA-only index path

    def __init__(
        self,
        mgr: KVBridgeKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self.kv_mgr = mgr
        self.room = int(bootstrap_room)
        self.conclude_state: int | None = None
        self._asked: Asked | None = None
        self._sender: Sender | None = None
        self._failure: KVBridgeError | None = None
        self._deadline = time.monotonic() + mgr.settings.waiting_timeout
        self._pages: PrefillPages | None = None
        self.fingerprint = b""  # of its prompt, set by the plugin's hook as SGLang makes us

    def _fail(self, kind: FailureKind, reason: str) -> KVBridgeError:
        """Fail the request (the first reason stays); returns the failure."""
        failure = self._failure or TransferFailed(kind, f"room {self.room}: {reason}")
        if self._failure is None:
            self._failure = failure
            log.warning("%s", failure)
        asked = self._asked
        if self._sender is None and asked is not None and asked.failure is None:
            # The decode side asked and waits: a sender that ends at once tells it why now,
            # rather than at its deadline. (Where the room already has a sender, that one is
            # another request's: it is left alone.)
            page = self.kv_mgr.page_size
            with contextlib.suppress(KVBridgeError):
                placement = PrefillPages(asked.tokens, asked.start, page, 0).placement()
                self._sender = self.kv_mgr.bridge.sender(self.room, placement, self.fingerprint)
        if self._sender is not None:
            self._sender.abort(reason)
        return failure

    def poll(self) -> int:
        state = self._state()
        s = self._sender
        if state is KVPoll.FAILED and self._pages is not None and s is not None and not s.released:
            # SGLang frees a failed request's pages: not while a write of it may read them.
            # (Before init nothing was written, and SGLang's bootstrap step takes no other
            # state than Bootstrapping, WaitingForInput or Failed.)
            return int(KVPoll.TRANSFERRING)
        return int(state)

    def _state(self) -> KVPoll:
        if self._sender is not None and self._failure is None:
            return self._sender.poll()
        if self._failure is not None:
            return KVPoll.FAILED
        if self._asked is None:
            why = self._not_ours()
            if why is not None:
                self._fail(FailureKind.BAD_INPUT, why)
                return KVPoll.FAILED
        if self._asked is not None:
            # Asked, not yet taken (SGLang holds it while its metadata buffers are full): the
            # decode side may abort meanwhile, and the wait has its deadline too.
            self._asked = self.kv_mgr.bridge.asked(self.room) or self._asked
            if self._asked.failure is not None:
                self._fail(self._asked.failure.kind, self._asked.failure.detail)
                return KVPoll.FAILED
        if time.monotonic() > self._deadline:
            waited = (
                "no decode rank asked for this request"
                if self._asked is None
                else "the decode side asked, and this prefill did not take the request"
            )
            timeout = self.kv_mgr.settings.waiting_timeout
            self._fail(
                FailureKind.DEADLINE, f"{waited} within KVBRIDGE_WAITING_TIMEOUT={timeout:.0f} s"
            )
            return KVPoll.FAILED
        return KVPoll.BOOTSTRAPPING if self._asked is None else KVPoll.WAITING_FOR_INPUT

    def _not_ours(self) -> str | None:
        """Take the decode side's ask for the room; why the room is not this request's
        (its failure then fails the ask too: the decode side learns at once), None where it
        is or while no ask came."""
        bridge = self.kv_mgr.bridge
        if bridge.holds(self.room):  # a sender of this server's that is not ours
            return f"another request on this prefill server holds the room: {MISMATCH}"
        held = bridge.ended_with(self.room)
        if held and self.fingerprint and held != self.fingerprint:
            return f"another request on this prefill server held the room: {MISMATCH}"
        self._asked = asked = bridge.asked(self.room)
        theirs = asked.fingerprint if asked is not None else b""
        if theirs and self.fingerprint and theirs != self.fingerprint:
            return f"the decode side asked for other tokens (their fingerprints differ): {MISMATCH}"
        return None

    def pop_decode_prefix_len(self) -> int:
        return self._asked.start if self._asked is not None else 0

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        asked = self._asked
        if asked is None or asked.failure is not None:
            self._fail(FailureKind.BAD_INPUT, "init before the decode side asked for the request")
            return
        pages = PrefillPages(asked.tokens, asked.start, self.kv_mgr.page_size, int(aux_index or 0))
        if pages.pages_to_send() != num_kv_indices:
            self._fail(
                FailureKind.BAD_INPUT,
                f"the decode side asked for tokens [{asked.start}, {asked.tokens}) "
                f"({pages.pages_to_send()} pages of {pages.page_size}); this prefill sends "
                f"{num_kv_indices}: the two servers do not agree on the prompt",
            )
            return
        self._pages = pages
        try:
            self._sender = self.kv_mgr.bridge.sender(self.room, pages.placement(), self.fingerprint)
        except KVBridgeError as e:
            self._fail(FailureKind.BAD_INPUT, str(e))

    def send(
        self,
        kv_indices: Any,
        state_indices: Sequence[Any] | None = None,
        num_kv_tokens: int | None = None,
        wait_event: Any = None,
        **_: Any,
    ) -> None:
        """The pages of the next ``num_kv_tokens`` tokens (the prefill computed them).
        ``wait_event``: the CUDA event SGLang recorded behind a forward that may still be
        writing them (its early send of a cached prefix): nothing is read before it."""
        s, pages = self._sender, self._pages
        if s is None or pages is None or self._failure is not None:
            return
        try:
            # SGLang gives the state indices with its last send only (None before).
            states = (
                StateIndices.parse(self.kv_mgr.pools.states, state_indices)
                if state_indices is not None
                and (not hasattr(state_indices, "__len__") or len(state_indices))
                else NO_STATE
            )
            stop = pages.add(kv_indices, num_kv_tokens, states)
            if stop == pages.tokens:
                self.kv_mgr.aux_packer.pack(pages.aux)  # SGLang filled it before this send
            elif self.kv_mgr.whole:
                return
            s.send(stop, placement=pages.placement(), wait_event=wait_event)
        except KVBridgeError as e:
            self._fail(FailureKind.BAD_INPUT, f"send refused: {e}")

    def get_transfer_metric(self) -> KVTransferMetric:
        s = self._sender
        if s is None:
            return KVTransferMetric()
        st = s.status
        latency = (
            st.ended_at - st.transferring_at
            if st.ended_at is not None and st.transferring_at is not None
            else None
        )
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=s.sent_bytes)

    def failure_exception(self) -> None:
        own = self._sender.failure if self._sender is not None else None
        raise self._failure or own or self._fail(FailureKind.SENDER_ERROR, elsewhere("prefill"))

    def abort(self) -> None:
        self._fail(FailureKind.ABORTED, "aborted by SGLang's prefill scheduler")


def note_prompt(sender: Any, token_ids: Sequence[int]) -> None:
    """The prompt of the request ``sender`` serves (the plugin's hook, as SGLang makes it)."""
    if isinstance(sender, KVBridgeKVSender):
        sender.fingerprint = fingerprint(token_ids)
