"""A decode rank's link to one prefill engine.

A :class:`PrefillLink` connects this decode rank to one prefill engine: it looks the prefill
ranks up in the bootstrap service, has the service check that the two sides fit (refused with
what differs, before any request), builds the :class:`~kvbridge.planner.plan.Pairing`, and says
hello to every prefill rank in a new session (a random number every link message carries). From the
pairing it knows which prefill ranks owe this rank what. Its owner (the decode role,
:mod:`.role`) learns the outcome through ``link_ready`` / ``link_failed``.
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from typing import Protocol

from kvbridge.bootstrap import BootstrapClient
from kvbridge.errors import FailureKind, IncompatibleError, KVBridgeError
from kvbridge.planner.plan import Pairing
from kvbridge.runtime.contracts import Rank
from kvbridge.wire.protocol import Hello, HelloReply, RankInfo, process_of, side_from_info

log = logging.getLogger("kvbridge.receiver")


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"  # and fenced: its session's messages no longer count


class LinkOwner(Protocol):
    """What a link tells its owner."""

    def link_ready(self, link: PrefillLink) -> None: ...
    def link_failed(self, link: PrefillLink, kind: FailureKind, reason: str) -> None: ...


class PrefillLink:
    """This decode rank's link to prefill engine ``engine`` (a DP group, where the prefill
    side is data parallel) registered at the bootstrap service ``address``."""

    def __init__(self, rank: Rank, owner: LinkOwner, address: str, engine: str) -> None:
        self.b = rank
        self.role = owner
        self.address = address
        self.engine = engine
        self.session = secrets.randbits(63)
        self.state = LinkState.CONNECTING
        self.failure: tuple[FailureKind, str] | None = None
        self.infos: dict[int, RankInfo] = {}
        self.ranks: dict[str, int] = {}  # agent -> prefill engine rank
        self.pairing: Pairing | None = None
        self._replies: set[int] = set()
        self._started = time.monotonic()
        self._thread = threading.Thread(
            target=self._connect, daemon=True, name=f"kvbridge-link-{address}-{engine}"
        )

    def start(self) -> None:
        self._thread.start()

    @property
    def agents(self) -> list[str]:
        return list(self.ranks)

    def _connect(self) -> None:
        b = self.b
        settings = b.settings
        self._started = time.monotonic()
        log.info("%s: linking to prefill engine %s at %s", b.agent, self.engine, self.address)
        try:
            client = BootstrapClient(
                self.address, settings.token or None, timeout=settings.bootstrap_timeout
            )
            deadline = time.monotonic() + settings.bootstrap_timeout
            infos = client.prefill_ranks(self.engine, wait_for_world=True, deadline=deadline)
            client.register_decode(b.info, engine=self.engine)
            log.info(
                "%s: paired with prefill engine %s (%d ranks) in %.1f s",
                b.agent,
                infos[0].engine_id,
                len(infos),
                time.monotonic() - self._started,
            )
            self.pairing = Pairing(side_from_info(infos[0]), b.side)
        except IncompatibleError as e:
            self.role.link_failed(self, FailureKind.INCOMPATIBLE, str(e))
            return
        except (KVBridgeError, OSError) as e:
            self.role.link_failed(self, FailureKind.BOOTSTRAP, f"{self.address}: {e}")
            return
        self.infos = {i.engine_rank: i for i in infos}
        self.ranks = {i.agent: i.engine_rank for i in infos}
        for info in infos:
            b.add_peer(info.agent, info.control, process_of(info))
            b.send(info.agent, Hello(sender=b.agent, session=self.session, info=b.info))

    def fail(self, kind: FailureKind, reason: str) -> bool:
        """Fail (and fence) the link; False where it had failed already."""
        if self.state is LinkState.FAILED:
            return False
        self.state, self.failure = LinkState.FAILED, (kind, reason)
        return True

    def on_reply(self, rank: int, msg: HelloReply) -> None:
        if msg.refused:
            self.role.link_failed(
                self, FailureKind.INCOMPATIBLE, f"prefill rank {rank} refused: {msg.refused}"
            )
            return
        registered = process_of(self.infos[rank])
        if msg.info is not None and process_of(msg.info) != registered:
            # Its liveness would be judged by a process that is not the one answering.
            self.role.link_failed(
                self,
                FailureKind.BOOTSTRAP,
                f"prefill rank {rank} answered from process {msg.info.pid}, not the "
                f"{registered.pid} registered: it restarted after the look-up",
            )
            return
        self._replies.add(rank)
        if self.state is LinkState.CONNECTING and len(self._replies) == len(self.infos):
            log.info(
                "%s: link to %s at %s ready in %.1f s",
                self.b.agent,
                self.engine,
                self.address,
                time.monotonic() - self._started,
            )
            self.state = LinkState.READY
            self.role.link_ready(self)
