"""kvbridge as SGLang's transfer backend: the manager, sender (:mod:`.sender`), receiver
(:mod:`.receiver`) and bootstrap server that ``--disaggregation-transfer-backend kvbridge``
selects (:mod:`.plugin` registers them).

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

import logging
import os
import threading
from typing import Any

from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    KVArgs,
)

from kvbridge.bootstrap import BootstrapServer
from kvbridge.config import Settings
from kvbridge.integrations.affinity import any_core
from kvbridge.integrations.sglang import internals
from kvbridge.integrations.sglang.pools import AuxPacker, describe
from kvbridge.integrations.sglang.receiver import KVBridgeKVReceiver
from kvbridge.integrations.sglang.sender import KVBridgeKVSender
from kvbridge.integrations.sglang.states import SWA
from kvbridge.memory.pools import HostPool, wrap_address
from kvbridge.planner.layout import AUX
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.runtime import Bridge
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
        # Decode: the receivers by room, for SGLang's deferred release of failed requests
        # (SGLang asks by room alone: where two requests were given one room, a release of
        # one must not drop the other's).
        self._receivers: dict[int, list[KVBridgeKVReceiver]] = {}
        self._tracked = 0  # receivers tracked so far
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
        """Hold ``receiver`` until released. Released ones SGLang's ``clear`` missed (one that
        succeeded as it looked, one released after SGLang gave up waiting) go every 256 rooms
        (a released one changes no answer of :meth:`is_abort_release_safe`)."""
        with self._lock:
            self._receivers.setdefault(room, []).append(receiver)
            self._tracked += 1
            if self._tracked % 256 == 0:
                kept = {k: [r for r in rs if not r.released] for k, rs in self._receivers.items()}
                self._receivers = {k: rs for k, rs in kept.items() if rs}

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        """Whether no prefill write of failed request ``room`` can still land."""
        with self._lock:
            held = list(self._receivers.get(room, ()))
        return all(r.released for r in held)

    def clear_deferred_abort_state(self, room: int) -> None:
        """Forget the room's receivers that are released (one still held stays tracked)."""
        with self._lock:
            held = [r for r in self._receivers.pop(room, ()) if not r.released]
            if held:
                self._receivers[room] = held

    def register_buffer_to_engine(self) -> None:
        """kvbridge registered the pools when its bridge started."""

    def deregister_buffer_to_engine(self) -> None:
        """Nothing to do: the pools stay registered for the bridge's life."""


class _OneGroup:
    """What SGLang's decode queue reads of a prefill server's parallel info."""

    dp_size = 1
    follow_bootstrap_room = True


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
