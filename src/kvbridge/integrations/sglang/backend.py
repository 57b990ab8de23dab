"""kvbridge as SGLang's transfer backend: the manager, sender, receiver and bootstrap server
that ``--disaggregation-transfer-backend kvbridge`` selects (:mod:`.plugin` registers them).

It translates SGLang's vocabulary and nothing more: its pools (``KVArgs``) into a spec and
memory (:mod:`.pools`), its page indices into a :class:`~kvbridge.planner.placement.Placement`, its
calls into a :class:`~kvbridge.runtime.Bridge`'s senders and receivers, and kvbridge's states
into the ``KVPoll`` values SGLang polls (kvbridge's are SGLang's, value for value). Which bytes
go where is the planner's business; when a request is done is the decode side's completion
rule, derived from the planner; every request ends within kvbridge's deadlines.

SGLang's protocol, as its schedulers drive it:

- decode: a receiver per request; ``init`` (bootstrap: kvbridge links to the prefill engine and
  says WaitingForInput once linked); ``send_metadata`` with the pages it allocated past its
  prefix-cache hit (kvbridge's placement ``start``); poll until Success or Failed.
- prefill: a sender per request; it waits (Bootstrapping) until the decode side has asked for
  the room, which tells it the request's length and the decode's prefix hit
  (``pop_decode_prefix_len``); ``init`` with the pages and the aux slot; ``send`` once per
  chunk with that chunk's pages; poll until Success or Failed.
- aux: SGLang keeps several metadata buffers a request slot (the first output token, its
  logprobs, the room for a check...). The prefill packs them into kvbridge's one aux slot
  before the last chunk goes; the decode unpacks them when its request succeeds, before SGLang
  reads them. Dense models get their aux like every other (a seed bug of SGLang's backends).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVTransferMetric,
)

from kvbridge.bootstrap import BootstrapServer
from kvbridge.config import Settings
from kvbridge.errors import FailureKind, KVBridgeError, PlacementError, TransferFailed
from kvbridge.integrations.affinity import any_core
from kvbridge.integrations.sglang import internals
from kvbridge.integrations.sglang.pools import (
    NO_STATE,
    AuxPacker,
    PrefillPages,
    decode_placement,
    describe,
)
from kvbridge.integrations.sglang.states import SWA, StateIndices
from kvbridge.memory.pools import HostPool, wrap_address
from kvbridge.planner.layout import AUX
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.runtime import Bridge, Receiver, Sender
from kvbridge.runtime.prefill.role import Asked
from kvbridge.runtime.status import KVPoll
from kvbridge.wire.protocol import Role

log = logging.getLogger("kvbridge.sglang")

TRANSPORT_VAR = "KVBRIDGE_SGLANG_TRANSPORT"


def engine_name(place: internals.Place, prefill: bool) -> str:
    """A server's engine name, unique among the servers its peers link to (its agents are named
    after it): its HTTP address. A decode rank finds a prefill server's engine from the
    bootstrap service, which holds that one engine."""
    return f"sglang-{'prefill' if prefill else 'decode'}-{place.host}:{place.port}"


class KVBridgeKVManager(BaseKVManager):  # type: ignore[misc]
    """One per scheduler process (a TP rank): its pools described, its bridge started."""

    supports_host_destination = False
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
        **_: Any,
    ) -> None:
        internals.check_version()
        self.kv_args = args
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.prefill = str(getattr(disaggregation_mode, "value", disaggregation_mode)) == "prefill"
        place = internals.place(server_args)
        if place.pp > 1 or place.dp > 1:
            raise internals.UnsupportedSGLang(
                f"kvbridge's SGLang backend serves attention TP only so far; this server runs "
                f"PP {place.pp}, attention DP {place.dp}"
            )
        deferred, hold = internals.deferred_release()
        self.enable_deferred_decode_kv_release = deferred
        self.settings = Settings.from_env()
        if not self.prefill and (not deferred or hold < self.settings.abort_timeout):
            log.warning(
                "SGLang releases a failed request's pages %s; kvbridge may need up to "
                "KVBRIDGE_ABORT_TIMEOUT=%.0f s to prove no write can land: set "
                "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1 and its _TIMEOUT to at "
                "least that",
                f"after {hold:.0f} s" if deferred else "at once",
                self.settings.abort_timeout,
            )
        self.pools = internals.pool_args(args, place, self.is_mla_backend, server_args)
        d = describe(self.pools)
        # A window's pages are named with SGLang's last send only: such a request goes whole.
        self.whole = any(st.kind == SWA for st in self.pools.states)
        self.aux = HostPool([d.memory.region(AUX)], shared=False)
        self.aux_packer = AuxPacker(
            int(self.aux.regions()[0].view().ctypes.data),
            tuple(args.aux_data_ptrs),
            tuple(args.aux_item_lens),
        )
        self.page_size = int(args.page_size)
        # The pools where SGLang keeps them (its GPU); the aux slots are host memory (nixl and
        # mooncake move both; cudaipc refuses the host region at start-up, saying so).
        regions = [
            wrap_address(n, p, b, location=self.pools.location) for n, p, b in d.regions
        ] + list(self.aux.regions())
        transport = os.environ.get(TRANSPORT_VAR, "tcp")
        with any_core():  # its threads must not share the engine's pinned core
            self.bridge = Bridge(
                role=Role.PREFILL if self.prefill else Role.DECODE,
                spec=d.spec,
                parallel=ParallelLayout(place.tp, ((0, d.spec.num_layers),)),
                rank=place.tp_rank,
                memory=d.memory,
                regions=regions,
                transport=transport,
                bootstrap=internals.bootstrap_address() if self.prefill else None,
                engine_id=engine_name(place, self.prefill),
                settings=self.settings,
            ).start()
        # Decode: the receivers by room, for SGLang's deferred release of failed requests.
        self._receivers: dict[int, KVBridgeKVReceiver] = {}
        self._lock = threading.Lock()
        # SGLang's decode queue reads these (prefill_info_table: one DP group, always).
        self.prefill_info_table: dict[str, Any] = {}
        log.info(
            "kvbridge %s rank %d/%d: %d layers, %d pages of %d tokens, %d aux slots, %s",
            "prefill" if self.prefill else "decode",
            place.tp_rank,
            place.tp,
            d.spec.num_layers,
            d.num_pages,
            self.page_size,
            d.aux_slots,
            transport,
        )

    def register_to_bootstrap(self) -> None:
        """The bridge registered when it started."""

    # ---- SGLang's decode queue asks these ------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One DP group a prefill server (kvbridge's link checks the rest, with deadlines)."""
        if bootstrap_addr not in self.prefill_info_table:
            self.prefill_info_table[bootstrap_addr] = _OneGroup()
        return True

    def track(self, room: int, receiver: KVBridgeKVReceiver) -> None:
        with self._lock:
            self._receivers[room] = receiver

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        """Whether no prefill write of failed request ``room`` can still land."""
        with self._lock:
            r = self._receivers.get(room)
        return r is None or r.released

    def clear_deferred_abort_state(self, room: int) -> None:
        with self._lock:
            self._receivers.pop(room, None)

    def register_buffer_to_engine(self) -> None:
        """kvbridge registered the pools when its bridge started."""

    def deregister_buffer_to_engine(self) -> None:
        """Nothing to do: the pools stay registered for the bridge's life."""


class _OneGroup:
    """What SGLang's decode queue reads of a prefill server's parallel info."""

    dp_size = 1
    follow_bootstrap_room = True


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
                self._sender = self.kv_mgr.bridge.sender(self.room, placement)
        if self._sender is not None:
            self._sender.abort(reason)
        return failure

    def poll(self) -> int:
        if self._sender is not None and self._failure is None:
            return int(self._sender.poll())
        if self._failure is not None:
            return int(KVPoll.FAILED)
        if self._asked is None:
            self._asked = self.kv_mgr.bridge.asked(self.room)
        if self._asked is None:
            if time.monotonic() > self._deadline:
                self._fail(
                    FailureKind.DEADLINE,
                    f"no decode rank asked for this request within KVBRIDGE_WAITING_TIMEOUT="
                    f"{self.kv_mgr.settings.waiting_timeout:.0f} s",
                )
                return int(KVPoll.FAILED)
            return int(KVPoll.BOOTSTRAPPING)
        if self._asked.failure is not None:
            self._fail(self._asked.failure.kind, self._asked.failure.detail)
            return int(KVPoll.FAILED)
        return int(KVPoll.WAITING_FOR_INPUT)

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
            self._sender = self.kv_mgr.bridge.sender(self.room, pages.placement())
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
                if state_indices is not None and len(state_indices)
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
        self.tokens: int | None = None  # set by the plugin's hook as SGLang makes us
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
                    np.asarray(kv_indices).reshape(-1).tolist(),
                    self._aux,
                    StateIndices.parse(self.kv_mgr.pools.states, state_indices),
                )
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


class KVBridgeKVBootstrapServer(BaseKVBootstrapServer):  # type: ignore[misc]
    """kvbridge's bootstrap service, in the prefill server's main process, on
    ``--disaggregation-bootstrap-port``."""

    def __init__(self, host: str, port: int, **_: Any) -> None:
        token = Settings.from_env().token or None
        self.server = BootstrapServer(host, int(port), token).start()
        log.info("kvbridge bootstrap service on %s:%d", host, port)

    def close(self) -> None:
        self.server.stop()


CLASSES: dict[str, type] = {
    "manager": KVBridgeKVManager,
    "sender": KVBridgeKVSender,
    "receiver": KVBridgeKVReceiver,
    "bootstrap_server": KVBridgeKVBootstrapServer,
}


def elsewhere(server: str) -> str:
    """Why a request failed on this rank when its own transfer did not: SGLang fails a request
    on every TP rank once one rank's poll says FAILED. This rank stops its own transfer (SGLang
    frees the pages next) and says where the reason is."""
    return (
        f"another TP rank of this {server} server failed the request (its reason is in this "
        f"server's log); this rank's own transfer stopped with it"
    )


def note_length(receiver: Any, tokens: int) -> None:
    if isinstance(receiver, KVBridgeKVReceiver):
        receiver.tokens = tokens
