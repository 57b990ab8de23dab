"""kvbridge's KV receiver for SGLang's decode scheduler: one request on one decode rank (see
:mod:`.backend` for the protocol SGLang drives)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVReceiver

from kvbridge.errors import FailureKind, KVBridgeError, PlacementError, TransferFailed
from kvbridge.integrations.affinity import any_core
from kvbridge.integrations.sglang import internals
from kvbridge.integrations.sglang.pools import decode_placement
from kvbridge.integrations.sglang.request import elsewhere, fingerprint
from kvbridge.integrations.sglang.states import StateIndices
from kvbridge.runtime import Receiver
from kvbridge.runtime.status import KVPoll

if TYPE_CHECKING:
    from kvbridge.integrations.sglang.backend import KVBridgeKVManager

log = logging.getLogger("kvbridge.sglang")


class KVBridgeKVReceiver(BaseKVReceiver):  # type: ignore[misc]
    """One request on one decode rank."""

    require_staging = False

    def __init__(
        self,
        mgr: KVBridgeKVManager,
        bootstrap_addr: str,
        bootstrap_room: int | None = None,
        **_: Any,
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.room = int(bootstrap_room or 0)
        # Set by the plugin's hook as SGLang makes us: the tokens whose KV comes, their digest.
        self.tokens: int | None = None
        self.fingerprint = b""
        self.conclude_state: int | None = None
        self.abort_notified = False
        self.bootstrap_infos: list[Any] = []
        self._receiver: Receiver | None = None
        self._failure: KVBridgeError | None = None
        self._aux: int | None = None
        self._unpacked = False

    def _fail(self, kind: FailureKind, reason: str) -> KVBridgeError:
        """Fail the request (the first reason stays); returns the failure."""
        failure = self._failure or TransferFailed(kind, f"room {self.room}: {reason}")
        if self._failure is None:
            self._failure = failure
            log.warning("%s", failure)
        if self._receiver is not None:
            self._receiver.abort(reason)
        return failure

    def init(self, prefill_dp_rank: int = 0) -> None:
        if self._failure is not None:  # aborted first (SGLang inits a pending request anyway)
            return
        if prefill_dp_rank:
            self._fail(
                FailureKind.BAD_INPUT,
                f"prefill DP rank {prefill_dp_rank}: kvbridge's SGLang backend serves one",
            )
            return
        try:
            with any_core():  # a new link starts a thread
                self._receiver = self.kv_mgr.bridge.receiver(
                    self.room, bootstrap=self.bootstrap_addr
                )
        except KVBridgeError as e:
            self._fail(FailureKind.BAD_INPUT, str(e))
            return
        self.kv_mgr.track(self.room, self)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Sequence[Any] | None = None,
        decode_prefix_len: int | None = None,
        **_: Any,
    ) -> None:
        r = self._receiver
        if r is None or self._failure is not None:
            return
        try:
            if self.tokens is None:
                raise PlacementError(
                    "the request's length was never noted (the plugin's hook on SGLang's "
                    "decode queue did not run)"
                )
            self._aux = int(aux_index or 0)
            r.init(
                decode_placement(
                    self.tokens,
                    int(decode_prefix_len or 0),
                    self.kv_mgr.page_size,
                    np.asarray(kv_indices).reshape(-1),  # checked as ids, never a list
                    self._aux,
                    StateIndices.parse(self.kv_mgr.pools.states, state_indices),
                ),
                self.fingerprint,
            )
        except KVBridgeError as e:
            self._fail(FailureKind.BAD_INPUT, str(e))

    def poll(self) -> int:
        if self._failure is not None:
            return int(KVPoll.FAILED)
        if self._receiver is None:
            return int(KVPoll.BOOTSTRAPPING)
        state = self._receiver.poll()
        if state is KVPoll.SUCCESS and not self._unpacked and self._aux is not None:
            self.kv_mgr.aux_packer.unpack(self._aux)  # before SGLang reads its metadata
            self._unpacked = True
            args = self.kv_mgr.kv_args
            named = internals.aux_room(args.aux_data_ptrs, args.aux_item_lens, self._aux)
            if named != self.room:  # SGLang's decode would wait for it forever (room 0)
                self._fail(
                    FailureKind.INTEGRITY,
                    f"the metadata that arrived names room {named}, not this request's",
                )
                return int(KVPoll.FAILED)
        return int(state)

    @property
    def released(self) -> bool:
        return self._receiver is None or self._receiver.released

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        """kvbridge told every prefill rank when the request failed; SGLang holds the pages
        until :attr:`released` (the manager's ``is_abort_release_safe``)."""
        self.abort_notified = True

    def failure_exception(self) -> None:
        own = self._receiver.failure if self._receiver is not None else None
        raise self._failure or own or self._fail(FailureKind.SENDER_ERROR, elsewhere("decode"))

    def abort(self) -> None:
        self._fail(FailureKind.ABORTED, "aborted by SGLang's decode scheduler")

    def clear(self) -> None:
        if self.released:
            self.kv_mgr.clear_deferred_abort_state(self.room)


def note_request(receiver: Any, token_ids: Sequence[int]) -> None:
    """The tokens whose KV ``receiver``'s request gets (the plugin's hook, as SGLang makes it)."""
    if isinstance(receiver, KVBridgeKVReceiver):
        receiver.tokens = len(token_ids)
        receiver.fingerprint = fingerprint(token_ids)
