"""Versioned, named, validated wire messages: control channel and bootstrap records.

Every message is a msgspec Struct with a ``type`` tag, the protocol version ``v`` and the
sending agent. :func:`decode` turns bytes into exactly one of :data:`Message` or raises
:class:`~kvbridge.errors.ProtocolError` (malformed, unknown type, wrong version); it never
returns a half-parsed message. Fields are named, never positional. The shared token never
travels: the control channel authenticates each message with an HMAC of its bytes.

Messages between a decode rank and a prefill rank carry the ``session`` of their link: a random
number the decode rank chose for its hello. A link declared dead is fenced: nothing of its
session counts any more (but the acknowledgement that a writer drained), and a peer that
comes back must say hello again, in a new session.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

from kvbridge.errors import FailureKind, LayoutError, ProtocolError, SpecError
from kvbridge.model.spec import CacheSpec
from kvbridge.planner.layout import BufferLayout, Dim, Region, SideMemory
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Side
from kvbridge.planner.tokenmap import TokenSplit
from kvbridge.wire.liveness import ProcessId

PROTOCOL_VERSION = 6


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


# ---- descriptions of a side, as they travel -------------------------------------------------


class DimWire(msgspec.Struct, frozen=True, array_like=True):
    name: str
    size: int
    stride: int


class BufferWire(msgspec.Struct, frozen=True):
    layer: int  # -1 for aux
    component: str
    region: str
    offset: int
    dims: list[DimWire]
    group: str
    itemsize: int = 0


class MemoryWire(msgspec.Struct, frozen=True):
    regions: list[tuple[str, int]]
    buffers: list[BufferWire]
    aux: BufferWire


class RankInfo(msgspec.Struct, frozen=True):
    """What a rank tells the bootstrap service and its peers about itself."""

    engine_id: str
    role: Role
    engine_rank: int
    control: str  # its control endpoint, e.g. tcp://127.0.0.1:41234
    spec: dict[str, Any]
    fingerprint: str
    tp: int
    layer_ranges: list[tuple[int, int]]
    memory: MemoryWire
    transport: str
    transport_meta: bytes
    # The rank's process, so that a peer on the same host can prove it gone
    # (kvbridge.wire.liveness).
    host_id: str = ""
    pid: int = 0
    started: int = 0
    # Its staging region (kvbridge.runtime.staging_pool), if it has one: slots of slot_bytes each.
    staging_slots: int = 0
    staging_slot_bytes: int = 0
    # Attention data parallelism: this engine is DP group dp_rank of dp (kvbridge.bootstrap.groups).
    dp: int = 1
    dp_rank: int = 0
    # Context parallelism (kvbridge.planner.parallel): CP groups, DCP ranks, the token map.
    cp: int = 1
    dcp: int = 1
    split: TokenSplit = TokenSplit.INTERLEAVED
    interleave: int = 1
    # The protocol version the rank speaks (0: a release from before ranks said so), checked
    # wherever a rank's description is read: the bootstrap service refuses a registration of
    # another version, and a decode rank a prefill rank of another version, naming both.
    protocol: int = 0
    # The rank's pid namespace: its pid proves it gone only to a peer in the same one
    # (containers of one host share its boot id, not their pids).
    pid_ns: str = ""

    @property
    def agent(self) -> str:
        return agent_name(self.engine_id, self.role, self.engine_rank)

    def parallel(self) -> ParallelLayout:
        """The side's parallel layout (LayoutError if it is not a valid one)."""
        return ParallelLayout(
            self.tp,
            tuple((int(a), int(b)) for a, b in self.layer_ranges),
            self.cp,
            self.dcp,
            self.split,
            self.interleave,
        )


def agent_name(engine_id: str, role: Role, rank: int) -> str:
    return f"{engine_id}/{role.value}/{rank}"


def _buffer_wire(layer: int, comp: str, b: BufferLayout) -> BufferWire:
    return BufferWire(
        layer,
        comp,
        b.region,
        b.offset,
        [DimWire(d.name, d.size, d.stride) for d in b.dims],
        b.group,
        b.itemsize,
    )


def _buffer(b: BufferWire) -> BufferLayout:
    return BufferLayout(
        b.region,
        b.offset,
        tuple(Dim(d.name, d.size, d.stride) for d in b.dims),
        b.group,
        b.itemsize,
    )


def memory_to_wire(m: SideMemory) -> MemoryWire:
    return MemoryWire(
        [(r.name, r.nbytes) for r in m.regions],
        [_buffer_wire(li, c, b) for (li, c), b in m.buffers.items()],
        _buffer_wire(-1, "aux", m.aux),
    )


def side_from_info(info: RankInfo) -> Side:
    """Rebuild and validate the side a rank described (LayoutError/SpecError if it is bad)."""
    try:
        spec = CacheSpec.from_dict(info.spec)
        if spec.fingerprint != info.fingerprint:
            raise ProtocolError(
                f"rank {info.agent}: spec fingerprint {info.fingerprint} does not "
                f"match its spec ({spec.fingerprint})"
            )
        memory = SideMemory(
            tuple(Region(n, b) for n, b in info.memory.regions),
            {(b.layer, b.component): _buffer(b) for b in info.memory.buffers},
            _buffer(info.memory.aux),
        )
        return Side(spec, info.parallel(), memory)
    except (SpecError, LayoutError):
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise ProtocolError(f"rank {info.agent}: malformed side description: {e}") from e


def rank_info(
    engine_id: str,
    role: Role,
    rank: int,
    control: str,
    side: Side,
    transport: str,
    transport_meta: bytes,
    staging: tuple[int, int] = (0, 0),
    dp: tuple[int, int] = (1, 0),
) -> RankInfo:
    """``staging``: the rank's staging slots and slot bytes ((0, 0): none); ``dp``: its
    engine's DP group count and index."""
    me = ProcessId.current()
    par = side.parallel
    return RankInfo(
        engine_id,
        role,
        rank,
        control,
        side.spec.to_dict(),
        side.spec.fingerprint,
        par.tp,
        list(par.layer_ranges),
        memory_to_wire(side.memory),
        transport,
        transport_meta,
        me.host,
        me.pid,
        me.started,
        *staging,
        *dp,
        cp=par.cp,
        dcp=par.dcp,
        split=par.split,
        interleave=par.interleave,
        protocol=PROTOCOL_VERSION,
        pid_ns=me.pid_ns,
    )


def process_of(info: RankInfo) -> ProcessId:
    return ProcessId(info.host_id, info.pid, info.started, info.pid_ns)


# ---- control-channel messages ---------------------------------------------------------------


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = PROTOCOL_VERSION
    sender: str  # agent name; the channel checks it is the connection's own identity


class _LinkMsg(_Msg, frozen=True):
    session: int  # the link's session, chosen by the decode rank in its hello


class Hello(_LinkMsg, tag="hello", frozen=True):
    """A decode rank introduces itself to a prefill rank (its memory, its transport) and
    opens a session; a new hello ends every request of the previous one."""

    info: RankInfo


class HelloReply(_LinkMsg, tag="hello_reply", frozen=True):
    info: RankInfo | None = None  # the prefill rank's own description, when accepted
    refused: str = ""  # why the hello was refused; empty when accepted


FINGERPRINT_MAX = 64  # bytes of a request's fingerprint (a digest of its tokens)


def fingerprint_of(room: int, fingerprint: bytes) -> bytes:
    """An engine's fingerprint of request ``room``, checked: at most FINGERPRINT_MAX bytes."""
    if len(fingerprint) > FINGERPRINT_MAX:
        raise ProtocolError(
            f"room {room}: a fingerprint is at most {FINGERPRINT_MAX} bytes, got {len(fingerprint)}"
        )
    return bytes(fingerprint)


class RequestMeta(_LinkMsg, tag="request", frozen=True):
    """A decode rank's placement of a request, sent to every prefill rank of its engine.
    ``start``: the first token it needs (it holds the ones before: a prefix-cache hit).
    ``fingerprint``: the decode engine's digest of the request's tokens (empty: none given);
    a prefill sender with another one is another request given the same room."""

    room: int
    decode_rank: int
    tokens: int
    pages: dict[str, list[int]]
    slots: dict[str, int]
    start: int = 0
    fingerprint: Annotated[bytes, msgspec.Meta(max_length=FINGERPRINT_MAX)] = b""

    def placement(self) -> Placement:
        return _placement(self.tokens, self.pages, self.slots, self.start)


class ChunkDone(_LinkMsg, tag="chunk_done", frozen=True):
    """Every write of a chunk from one prefill rank to one decode rank has completed."""

    room: int
    prefill_rank: int
    start: int
    stop: int
    parts: list[str]  # PartKind values carried: "kv", "state", "aux"
    checksums: dict[str, int] = {}  # region name -> crc32 (integrity mode)
    # Staged in this many segments (0: written directly); the chunk counts only once the
    # decode rank scattered every one of them.
    staged: int = 0
    # The layers [start, stop) this notice covers (a layer-wise send); None: all of the
    # prefill rank's layers.
    layers: tuple[int, int] | None = None
    nbytes: int = 0  # bytes the chunk wrote (a count for people, never a proof)

    def layer_range(self) -> range | None:
        return None if self.layers is None else range(*self.layers)


class StageAsk(_LinkMsg, tag="stage_ask", frozen=True):
    """A prefill rank asks the decode rank for a slot of its staging region, for one segment
    of this request. ``ask`` numbers the asks of a (room, prefill rank) pair."""

    room: int
    prefill_rank: int
    ask: int


class StageGrant(_LinkMsg, tag="stage_grant", frozen=True):
    """Slot ``slot`` of the decode rank's staging region is the ask's until its bytes are
    scattered or the request is released; or the ask was refused (the request is not live)."""

    room: int
    decode_rank: int
    ask: int
    slot: int = -1
    refused: str = ""


class Staged(_LinkMsg, tag="staged", frozen=True):
    """Segment ``segment`` (of ``segment_bytes``-byte segments) of this pair's chunk
    ``[start, stop)`` has landed in granted slot ``slot``: scatter it. The first segment of a
    chunk carries the prefill rank's placement, from which the decode rank plans the chunk
    (and so the scatter) itself."""

    room: int
    prefill_rank: int
    ask: int
    slot: int
    start: int
    stop: int
    last: bool
    segment: int
    segment_bytes: int
    nbytes: int
    tokens: int = 0
    pages: dict[str, list[int]] = {}
    slots: dict[str, int] = {}
    # The layers [start, stop) of the chunk (None: all of the prefill rank's), and whether
    # the aux slot travels with it (the send completing the last chunk).
    layers: tuple[int, int] | None = None
    aux: bool = True
    placement_start: int = 0  # the prefill placement's own start

    def placement(self) -> Placement:
        return _placement(self.tokens, self.pages, self.slots, self.placement_start)

    def layer_range(self) -> range | None:
        return None if self.layers is None else range(*self.layers)


def _placement(
    tokens: int, pages: dict[str, list[int]], slots: dict[str, int], start: int
) -> Placement:
    import numpy as np

    return Placement(
        tokens, {g: np.asarray(p, dtype=np.int64) for g, p in pages.items()}, slots, start
    )


class Delivered(_LinkMsg, tag="delivered", frozen=True):
    """The decode rank has every byte of the request: its senders may report success."""

    room: int
    decode_rank: int


class Failure(_LinkMsg, tag="failure", frozen=True):
    """The request failed on the sending rank. A prefill rank sends it only once nothing of
    the room is in flight from it, and never writes the room afterwards."""

    room: int
    rank: int
    kind: FailureKind
    reason: str


class Abort(_LinkMsg, tag="abort", frozen=True):
    """Stop writing this request; acknowledge once nothing of it is in flight. Repeated until
    acknowledged, also to a peer declared dead (it may only be stalled)."""

    room: int
    decode_rank: int


class AbortAck(_LinkMsg, tag="abort_ack", frozen=True):
    room: int
    prefill_rank: int


class Fenced(_LinkMsg, tag="fenced", frozen=True):
    """The decode rank declared this session dead: none of its requests can succeed."""

    reason: str


class Heartbeat(_Msg, tag="heartbeat", frozen=True):
    pass


Message = (
    Hello
    | HelloReply
    | RequestMeta
    | ChunkDone
    | StageAsk
    | StageGrant
    | Staged
    | Delivered
    | Failure
    | Abort
    | AbortAck
    | Fenced
    | Heartbeat
)
LinkMessage = (
    Hello
    | HelloReply
    | RequestMeta
    | ChunkDone
    | StageAsk
    | StageGrant
    | Staged
    | Delivered
    | Failure
    | Abort
    | AbortAck
    | Fenced
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
# Built once at import: a first typed decode of a Struct in two threads at once can crash
# (kvbridge.transports._common says why).
_RANK_INFO = msgspec.json.Decoder(RankInfo)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(raw: bytes) -> Message:
    try:
        msg: Message = _decoder.decode(raw)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid message: {e}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec lets bad UTF-8 through
        raise ProtocolError(f"undecodable message ({len(raw)} bytes): {e}") from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {msg.v} from {msg.sender!r}; this side speaks {PROTOCOL_VERSION}"
        )
    return msg


def info_to_json(info: RankInfo) -> bytes:
    return msgspec.json.encode(info)


def info_from_json(raw: bytes) -> RankInfo:
    try:
        info: RankInfo = _RANK_INFO.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"invalid rank registration: {e}") from None
    return check_protocol(info)


def check_protocol(info: RankInfo) -> RankInfo:
    """``info`` if its rank speaks this side's protocol version, else ProtocolError naming
    both."""
    if info.protocol != PROTOCOL_VERSION:
        spoken = info.protocol or "unknown (a release from before protocol version 6)"
        raise ProtocolError(
            f"{info.agent} speaks protocol version {spoken}; this side speaks {PROTOCOL_VERSION}"
        )
    return info
