"""The bridge: one per rank, what an inference engine embeds.

A :class:`Bridge` owns the rank's transport, its control channel and its worker thread, and
hands out senders (prefill) and receivers (decode) in the vocabulary engines know::

    bridge = Bridge(role=Role.PREFILL, spec=spec, parallel=par, rank=r, memory=side_memory,
                    regions=pool.regions(), transport="shm", bootstrap="127.0.0.1:8998")
    bridge.start()
    sender = bridge.sender(room, placement)       # prefill
    sender.send(stop)                             # as chunked prefill produces tokens
    receiver = bridge.receiver(room)              # decode
    receiver.init(placement); receiver.poll()     # -> KVPoll

The role-specific logic lives in the prefill half (:mod:`kvbridge.runtime.prefill`) and the
decode half (:mod:`kvbridge.runtime.decode`); this module holds what both share: identity,
peers, heartbeats, the tick and closing. It offers the halves a
:class:`~kvbridge.runtime.contracts.Rank` and they offer it a
:class:`~kvbridge.runtime.contracts.RoleLogic`.

A peer declared dead stays dead: its heartbeats no longer count (messages queued while it was
stalled do not revive it), and the role logic fences its link. Only a new hello, in a new
session, makes it a peer again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvbridge.bootstrap.groups import group_engine_id
from kvbridge.config import Settings
from kvbridge.errors import ClosedError, DeviceError, KVBridgeError, LayoutError, ProtocolError
from kvbridge.memory import heap
from kvbridge.memory.copier import copier_for
from kvbridge.memory.device import location_of
from kvbridge.memory.location import Location
from kvbridge.memory.pools import Pool, RegionMemory
from kvbridge.model.spec import CacheSpec
from kvbridge.planner.layout import SideMemory
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Side
from kvbridge.runtime import staging_pool, watchdog
from kvbridge.runtime.contracts import RoleLogic
from kvbridge.runtime.control import ControlChannel
from kvbridge.runtime.decode.receiver import Receiver
from kvbridge.runtime.decode.role import DecodeRole
from kvbridge.runtime.faults import Faults
from kvbridge.runtime.metrics import Metrics, serve
from kvbridge.runtime.prefill.role import Asked, PrefillRole
from kvbridge.runtime.prefill.sender import Sender
from kvbridge.transports import create as create_transport
from kvbridge.transports import transport_class
from kvbridge.transports.base import TransportOptions
from kvbridge.wire.liveness import ProcessId, Silence
from kvbridge.wire.protocol import (
    ChunkDone,
    Heartbeat,
    Message,
    Role,
    agent_name,
    decode,
    rank_info,
)

log = logging.getLogger("kvbridge.engine")
EXITED = "exited (its process on this host is gone)"


class Bridge:
    def __init__(
        self,
        *,
        role: Role,
        spec: CacheSpec,
        parallel: ParallelLayout,
        rank: int,
        memory: SideMemory,
        regions: Sequence[RegionMemory] | Pool,
        transport: str = "shm",
        bootstrap: str | None = None,
        engine_id: str = "engine",
        settings: Settings | None = None,
        transport_options: dict[str, Any] | None = None,
        dp: int = 1,
        dp_rank: int = 0,
    ) -> None:
        self.role = role
        self.side = Side(spec, parallel, memory)
        parallel.split_rank(rank)
        self.rank = rank
        # With attention DP, each group is an engine of its own (kvbridge.bootstrap.groups).
        self.engine_id = group_engine_id(engine_id, dp, dp_rank)
        self.dp, self.dp_rank = dp, dp_rank
        self.bootstrap = bootstrap
        self.settings = settings or Settings.from_env()
        self.faults = Faults.from_setting(self.settings.faults)
        self.metrics = Metrics(role, rank, self.engine_id, transport)
        if self.settings.metrics_port:
            serve(self.settings.metrics_port, self.settings.host)
        self.agent = agent_name(self.engine_id, role, rank)
        regs = tuple(regions.regions() if isinstance(regions, Pool) else regions)
        staging_pool.check_names(list(regs))
        _check_regions(self.side, rank, regs)
        cls = transport_class(transport)
        self.device = _device_of(regs, self.settings)
        # A decode rank's staging region is written by its peers: shared memory, for shm; a
        # rank's on a device where its pools are (the device gathers and scatters).
        self.staging = staging_pool.allocate(
            self.settings, cls.cost, shared=role is Role.DECODE, location=self.device
        )
        if self.staging is not None:
            regs = (*regs, self.staging.region)
        # Host views, for what the CPU reads here (checksums); device memory has none.
        self.views = {r.name: r.view() for r in regs if not r.on_device}
        self.copier = copier_for(regs, self.views, self.device)
        _warn_exposure(self.settings)
        runtime = TransportOptions(
            io_timeout=self.settings.transfer_timeout,
            token=self.settings.token,
            max_connections=self.settings.max_connections,
            admission=role is Role.DECODE,
            allow_private=role is Role.PREFILL,
            host=self.settings.host,
            advertise=self.settings.advertise,
            device=self.device,
            quick_notices=not self.settings.integrity,
        )
        self.transport = create_transport(
            transport, self.agent, runtime, **(transport_options or {})
        )
        meta = self.transport.register(regs)
        # The channel is bound before the rank's own description exists (it names the
        # endpoint); the largest message it can need is bounded from that description below.
        self.channel = ControlChannel(
            self.agent,
            host=self.settings.host,
            advertise=self.settings.advertise,
            token=self.settings.token,
            on_message=self._on_message,
            on_tick=self._on_tick,
            outgoing=self.faults.outgoing,
        )
        self.info = rank_info(
            self.engine_id,
            role,
            rank,
            self.channel.endpoint,
            self.side,
            transport,
            meta,
            (self.staging.slots, self.staging.slot_bytes) if self.staging is not None else (0, 0),
            (dp, dp_rank),
        )
        self.channel.limit(message_bound(self.side, len(msgspec.msgpack.encode(self.info))))
        self._endpoints: dict[str, str] = {}
        self._known: dict[str, str] = {}  # every agent ever added, dead ones too
        self._processes: dict[str, ProcessId] = {}  # live peers' processes, where known
        self._silence = Silence(self.settings.dead_after, time.monotonic())
        self._peers_lock = threading.Lock()
        self._next_beat = 0.0
        self._closed = False
        self._prefill: PrefillRole | None = None
        self._decode: DecodeRole | None = None
        self._role: RoleLogic
        if role is Role.PREFILL:
            self._role = self._prefill = PrefillRole(self)
        else:
            self._role = self._decode = DecodeRole(self)
            self.transport.on_notice(self._on_notice)

    # ---- life ----------------------------------------------------------------------------

    def start(self) -> Bridge:
        heap.raise_thresholds()  # each large request's plan is fresh memory otherwise
        self.channel.start()
        self._role.start()
        return self

    def close(self) -> None:
        """Fail every open request (``closed``), drain, release what can be released, then
        stop. Later calls raise :class:`~kvbridge.errors.ClosedError`."""
        if self._closed:
            return
        self._closed = True
        self.faults.release()
        self.metrics.close()
        self._role.close()
        self.channel.close()
        watchdog.stop(self)
        self.transport.close()
        self._role.closed()
        if self.staging is not None:
            self.staging.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.agent}: the bridge is closed")

    def __enter__(self) -> Bridge:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine API ----------------------------------------------------------------------

    def sender(self, room: int, placement: Placement, fingerprint: bytes = b"") -> Sender:
        """A prefill rank's sender for request ``room`` (see
        :class:`kvbridge.runtime.prefill.sender.Sender`). ``fingerprint``: the engine's digest
        of the request's tokens (at most 64 bytes); a decode rank asking with another one
        (the engines gave two requests one room) is refused at once, never sent to."""
        self.check_open()
        if self._prefill is None:
            raise KVBridgeError("sender() is for prefill bridges; this one is decode")
        return self._prefill.sender(_room(room), placement, fingerprint)

    def receiver(
        self, room: int, bootstrap: str | None = None, engine: str | None = None
    ) -> Receiver:
        """A decode rank's receiver for request ``room`` from the prefill deployment at
        ``bootstrap`` (default: the bridge's): from prefill engine ``engine`` (a DP group's,
        :func:`kvbridge.bootstrap.groups.group_engine_id`) where the decode engine knows it, else
        from the one the bootstrap service says holds the room. See
        :class:`kvbridge.runtime.decode.receiver.Receiver`."""
        self.check_open()
        if self._decode is None:
            raise KVBridgeError("receiver() is for decode bridges; this one is prefill")
        return self._decode.receiver(_room(room), bootstrap or self.bootstrap, engine)

    def asked(self, room: int) -> Asked | None:
        """On a prefill rank with no sender for ``room`` yet: what a decode engine asked of it
        (the request's length, the first token it needs), or why it already ended; None
        while no decode rank has asked (see
        :meth:`kvbridge.runtime.prefill.role.PrefillRole.asked`). An engine polls it: what
        arrived is taken first, on its thread (:meth:`progress`)."""
        if self._prefill is None:
            raise KVBridgeError("asked() is for prefill bridges; this one is decode")
        self.progress()
        return self._prefill.asked(room)

    def progress(self) -> bool:
        """Take what arrived for this rank on the calling thread, an engine's that polls a
        request: its peers' messages (:meth:`ControlChannel.progress`) and the writes its
        transport lands there (:meth:`Transport.progress`). kvbridge's own threads would
        otherwise take them once they get the interpreter the engine's thread holds. Never
        waits. True when it took something."""
        if self._closed:
            return False
        took = self.channel.progress()
        return self.transport.progress() > 0 or took

    def holds(self, room: int) -> bool:
        """On a prefill rank: whether it has a sender for ``room`` now (one of the engine's
        requests holds the room)."""
        if self._prefill is None:
            raise KVBridgeError("holds() is for prefill bridges; this one is decode")
        return self._prefill.holds(room)

    def ended_with(self, room: int) -> bytes | None:
        """On a prefill rank: the fingerprint of the request whose ``room`` ended here lately
        (empty: it gave none), None where none did."""
        if self._prefill is None:
            raise KVBridgeError("ended_with() is for prefill bridges; this one is decode")
        return self._prefill.ended_with(room)

    def active_rooms(self) -> int:
        """Requests this rank still holds state for (0 once everything ended and drained)."""
        return self._role.active_rooms()

    def sessions(self) -> list[int]:
        """The sessions of a decode rank's links to prefill engines (none on prefill)."""
        return self._decode.sessions() if self._decode is not None else []

    def describe(self) -> str:
        """This rank's requests and their state, a line each (for a diagnosis: what a request
        that never ends waits for; the demo writes it on SIGUSR2)."""
        lines = [f"{self.agent} ({self.role.value} rank {self.rank})"]
        if self._prefill is not None:
            lines.append(self._prefill.worker.describe())
            lines += [s.describe() for s in list(self._prefill.requests.values())]
        if self._decode is not None:
            lines += [r.describe() for r in self._decode.receivers()]
        return "\n".join(lines)

    def staged_segments(self) -> tuple[int, int]:
        """A decode rank's staged segments so far: scattered, and refused (their request
        had ended). (0, 0) where this rank stages nothing."""
        area = self._decode.staging if self._decode is not None else None
        return (area.scatters, area.refused) if area is not None else (0, 0)

    # ---- peers ---------------------------------------------------------------------------

    def add_peer(self, agent: str, endpoint: str, process: ProcessId | None = None) -> None:
        """``agent`` a peer at ``endpoint``; its ``process`` (where known) lets a peer on
        this host that exited be declared dead without waiting out the heartbeat window."""
        with self._peers_lock:
            self._endpoints[agent] = endpoint
            self._known[agent] = endpoint
            self._silence.add(agent, time.monotonic())
            if process is not None:
                self._processes[agent] = process
            else:
                self._processes.pop(agent, None)

    def known_endpoint(self, agent: str) -> str | None:
        """The control endpoint ``agent`` had when it was last a peer, dead or alive."""
        with self._peers_lock:
            return self._known.get(agent)

    def live_peers(self) -> set[str]:
        """Agents this rank talks to and has not declared dead."""
        with self._peers_lock:
            return set(self._endpoints)

    def drop_peer(self, agent: str) -> None:
        with self._peers_lock:
            self._drop_locked(agent)

    def _drop_locked(self, agent: str) -> None:
        self._endpoints.pop(agent, None)
        self._silence.remove(agent)
        self._processes.pop(agent, None)

    def send(self, agent: str, msg: Message, *, faults: bool = True) -> None:
        endpoint = self._endpoints.get(agent)
        if endpoint is None:
            log.warning(
                "%s: no endpoint for %s; %s not sent", self.agent, agent, type(msg).__name__
            )
            return
        self.channel.send(agent, endpoint, msg, faults=faults)

    def send_raw(self, agent: str, endpoint: str, raw: bytes) -> None:
        """Raw bytes to ``agent`` (the fault seam's malformed messages)."""
        self.channel.send_raw(agent, endpoint, raw)

    def send_to(self, agent: str, endpoint: str, msg: Message) -> None:
        """Send to ``agent`` even if it was declared dead (an abort it must answer, a fence
        it must learn of, if it was only stalled)."""
        self.channel.send(agent, endpoint, msg, faults=False)

    def _on_message(self, msg: Message) -> None:
        with self._peers_lock:
            self._silence.heard(msg.sender, time.monotonic())
        if not isinstance(msg, Heartbeat):
            self._role.on_message(msg)

    def _on_notice(self, peer: str, raw: bytes) -> None:
        """A chunk notice a write carried (Transport.post_noticed), on the transport's thread
        that landed the write: taken as if the control channel had brought it, from the
        agent the transport authenticated, which it must name as its sender. ProtocolError
        (the transport refuses the write's acknowledgement) for anything else."""
        msg = decode(raw)
        if not isinstance(msg, ChunkDone) or msg.sender != peer:
            raise ProtocolError(
                f"a {type(msg).__name__} from {msg.sender!r} carried by a write from {peer!r}: "
                f"only an agent's own chunk notices ride with its writes"
            )
        self._on_message(msg)

    def _on_tick(self, now: float) -> None:
        self.faults.ticking()
        if not self._closed:  # (a control thread outliving close must not re-arm it)
            watchdog.tick(self, self.settings.stall_dump)
        with self._peers_lock:
            paused = self._silence.tick(now)
        if paused:
            self._role.on_paused(paused)
            log.warning(
                "%s: this rank was paused for %.1f s; its peers' silence is measured afresh "
                "and its requests' deadlines move back as much%s",
                self.agent,
                paused,
                f" (threads: {watchdog.threads()})" if self.settings.stall_dump else "",
            )
        if now >= self._next_beat:
            self._next_beat = now + self.settings.heartbeat_interval
            with self._peers_lock:
                peers = list(self._endpoints)
                # A peer quiet for two beats whose process on this host is gone is dead now:
                # its exit is proof, where silence alone must wait out the whole window.
                quiet = self._silence.quiet(now, 2 * self.settings.heartbeat_interval)
                suspects = [(a, p) for a in quiet if (p := self._processes.get(a)) is not None]
            gone = [(a, p) for a, p in suspects if p.proven_gone()]  # /proc, off the lock
            for agent in peers:
                self.send(agent, Heartbeat(sender=self.agent))
            why = f"stopped heart-beating ({self.settings.dead_after:.1f} s)"
            with self._peers_lock:  # decided and dropped at once: a new hello may have come
                ended = {a: why for a in self._silence.dead(now)}
                quiet = self._silence.quiet(now, 2 * self.settings.heartbeat_interval)
                for agent, process in gone:
                    if agent in quiet and self._processes.get(agent) is process:
                        ended.setdefault(agent, EXITED)
                for agent in ended:
                    self._drop_locked(agent)
            for agent, reason in ended.items():
                log.warning("%s: peer %s %s: dead", self.agent, agent, reason)
                self._role.on_peer_dead(agent, reason)
        self._role.on_tick(now)


def message_bound(side: Side, info_bytes: int) -> int:
    """The largest control message this rank can need to accept: a peer's description (a
    hello, about the size of this rank's own) and a request's placement (at most one page id,
    9 bytes of msgpack, per token and page group, for a request as long as this side's largest
    pool holds), with ample margin. Anything larger is not a kvbridge message."""
    tokens, groups = 1, set()
    for buf in side.memory.buffers.values():
        if buf.dim("page") is not None:
            tokens = max(tokens, buf.size("page") * buf.size("token"))
            groups.add(buf.group)
    return 4 * info_bytes + 16 * tokens * max(1, len(groups)) + (1 << 20)


def _warn_exposure(settings: Settings) -> None:
    if not settings.token and not _loopback(settings.host):
        log.warning(
            "kvbridge binds its control endpoints on %s without a token: anyone who "
            "can reach that address can send this rank control messages, and the "
            "tcp data port accepts writes from any peer that knows the protocol; set "
            "KVBRIDGE_TOKEN",
            settings.host,
        )


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _device_of(regions: Sequence[RegionMemory], settings: Settings) -> Location:
    """Where the rank's memory is; device memory with a setting that reads it with the CPU
    (integrity checksums) is refused now rather than in a worker."""
    where = location_of(regions)
    if where.is_device and settings.integrity:
        raise DeviceError(
            f"KVBRIDGE_INTEGRITY checksums read the pools with the CPU; this rank's are on "
            f"{where}: turn integrity off for device memory"
        )
    return where


def _check_regions(side: Side, rank: int, regions: Sequence[RegionMemory]) -> None:
    have = {r.name: r for r in regions}
    for want in side.memory.regions_of(side.parallel.layers_of(rank)):
        got = have.get(want.name)
        if got is None:
            raise LayoutError(
                f"rank {rank} must register region {want.name!r} "
                f"({want.nbytes} bytes); registered: {sorted(have)[:8]}"
            )
        if got.nbytes < want.nbytes:
            raise LayoutError(
                f"region {want.name!r} has {got.nbytes} bytes; the memory layout "
                f"needs {want.nbytes}"
            )


def _room(room: int) -> int:
    """A request's room, as the wire and the bootstrap service take it, or KVBridgeError (at
    once: a room out of range would wait out both sides' deadlines)."""
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 1 << 63:
        raise KVBridgeError(f"a room is an integer in [0, 2**63), got {room!r}")
    return room
