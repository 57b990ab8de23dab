"""The TCP transport's wire format, and how a batch's bytes are laid out on the stream.

A connection starts with a challenge-response, so that only agents that know the token can
have a batch read at all (the token itself never travels)::

    listener   CHALLENGE: magic b"KVBC", version, a fresh 32-byte nonce
    connector  ANSWER: magic b"KVBA", version, HMAC-SHA256(token, b"kvbridge-tcp/1" + nonce +
               agent id), the agent id's length; then the agent id (UTF-8)
    listener   WELCOME: magic b"KVBW", version  (a wrong answer gets no byte: the connection
               is closed)

Then batches, each::

    prefix   PREFIX: magic b"KVBT", version, flags (0), seq, n_runs, header_len
    header   JSON BatchHeader: sender, receiver, dst_regions, nbytes (payload length), key,
             notice (the sender's runtime's message for the receiver's, once the batch is in)
    runs     5 x n_runs little-endian int64: dst_region, dst_offset, nbytes, count, dst_stride
    payload  the bytes of run 0 (block 0, 1, ...), run 1, ...: nbytes * count each

and the receiver answers each batch, in order, with ``REPLY`` (magic b"KVBR", version,
status, seq, message length) and a UTF-8 message (the reason of a refusal). A batch
``REFUSED`` ends the connection; one ``DISCARDED`` (its request was not admitted, or was
fenced) had its payload read and dropped, and the connection goes on. A batch's ``notice`` is
handed to the receiver's notice handler after its last byte landed and before the ``OK``
reply: never for a batch refused, discarded or fenced. A notice the handler does not take
makes the reply ``DISCARDED`` with its reason (the bytes landed; the sender must not count on
the notice).

Both sides walk the runs in header order with :func:`pieces`, each over its own memory:
large contiguous blocks go straight between region memory and the socket; small blocks
(strided pieces, small flat runs) travel through a bounded, cache-sized bounce buffer and are
gathered or scattered by one vectorised numpy copy, because one syscall per 512-byte block
would cost more than the bytes. Runs in device memory all travel through the bounce buffer
(:class:`~kvbridge.memory.bounce.Bounce`: gathered or scattered on the GPU, copied to or from
pinned memory), each side cutting its own runs into pieces of its own buffer's size: the wire
carries the same bytes in the same order either way. The sender orders runs so that small
flat runs of one size and region pair are adjacent (see :func:`stream_order`), which lets
them be moved as groups.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from kvbridge.errors import ProtocolError
from kvbridge.memory.bounce import Bounce
from kvbridge.memory.copy import FLATTEN_BELOW, progressions, rows, strided
from kvbridge.memory.location import Location
from kvbridge.planner.runs import each_block

WIRE_VERSION = 3
BATCH_MAGIC = b"KVBT"
REPLY_MAGIC = b"KVBR"
CHALLENGE_MAGIC, ANSWER_MAGIC, WELCOME_MAGIC = b"KVBC", b"KVBA", b"KVBW"
CHALLENGE = struct.Struct("<4sH32s")  # magic, version, nonce
ANSWER = struct.Struct("<4sH32sH")  # magic, version, mac, agent id length; then the agent id
WELCOME = struct.Struct("<4sH")  # magic, version
AUTH_LABEL = b"kvbridge-tcp/1"
MAX_AGENT = 1024
PREFIX = struct.Struct("<4sHHQQI")  # magic, version, flags, seq, n_runs, header_len
REPLY = struct.Struct("<4sHHQI")  # magic, version, status, seq, message_len
MAX_RUNS = 1 << 20  # per batch: bounds what a header can make the receiver allocate
MAX_HEADER = 1 << 20
MAX_MESSAGE = 4096
MAX_NOTICE = 64 << 10  # a chunk notice with a checksum per layer and part fits many times
RUN_FIELDS = 5
# Contiguous blocks from this size are sent and received in place; smaller ones are packed.
DIRECT_MIN = 64 << 10
BOUNCE_BYTES = 1 << 20
PROGRESSIONS_FROM = 256 << 10  # bytes of flat runs worth looking for progressions in
# Device pieces: each costs a few kernel launches, a copy and a stream synchronization from
# Python (~0.1-0.5 ms), so they are larger; a thread's buffer is this much pinned memory.
DEVICE_BOUNCE_BYTES = 4 << 20


def bounce_for(location: Location) -> Bounce:
    """A thread's bounce buffer for memory at ``location``."""
    return Bounce(DEVICE_BOUNCE_BYTES if location.is_device else BOUNCE_BYTES, location)


class Status(enum.IntEnum):
    OK = 0
    REFUSED = 1  # the batch broke the contract: the receiver ends the connection
    DISCARDED = 2  # its request may not write (not admitted, fenced): payload dropped


_Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class BatchHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    sender: Annotated[str, msgspec.Meta(max_length=MAX_AGENT)]
    receiver: Annotated[str, msgspec.Meta(max_length=MAX_AGENT)]
    dst_regions: tuple[Annotated[str, msgspec.Meta(max_length=1024)], ...]
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
    key: tuple[_Int64, _Int64] | None = None  # (session, room) of the post, if it gave one
    notice: Annotated[bytes, msgspec.Meta(max_length=MAX_NOTICE)] | None = None


# ---- the handshake --------------------------------------------------------------------------


def challenge() -> tuple[bytes, bytes]:
    """A fresh nonce and the CHALLENGE that carries it."""
    nonce = secrets.token_bytes(32)
    return nonce, CHALLENGE.pack(CHALLENGE_MAGIC, WIRE_VERSION, nonce)


def decode_challenge(buf: bytes | bytearray) -> bytes:
    magic, version, nonce = CHALLENGE.unpack(buf)
    if magic != CHALLENGE_MAGIC or version != WIRE_VERSION:
        raise ProtocolError(
            f"not a kvbridge tcp challenge (magic {magic!r}, version "
            f"{version}; this kvbridge speaks version {WIRE_VERSION})"
        )
    return bytes(nonce)


def proof(token: str, nonce: bytes, agent: bytes) -> bytes:
    """What proves knowledge of the token for this nonce and agent id (the id is last, the
    nonce of fixed size: the message is unambiguous)."""
    return hmac.new(token.encode(), AUTH_LABEL + nonce + agent, hashlib.sha256).digest()


def encode_answer(token: str, nonce: bytes, agent: str) -> bytes:
    name = agent.encode()
    if len(name) > MAX_AGENT:
        raise ProtocolError(f"agent id of {len(name)} bytes; the limit is {MAX_AGENT}")
    return ANSWER.pack(ANSWER_MAGIC, WIRE_VERSION, proof(token, nonce, name), len(name)) + name


def answer_length(head: bytes | bytearray) -> int:
    """The whole answer's length from its fixed part, or ProtocolError."""
    magic, version, _, n = ANSWER.unpack(head)
    if magic != ANSWER_MAGIC or version != WIRE_VERSION or not 0 < n <= MAX_AGENT:
        raise ProtocolError("not a kvbridge tcp answer")
    return ANSWER.size + int(n)


def check_answer(token: str, nonce: bytes, answer: bytes | bytearray) -> str:
    """The agent id a complete answer proves, or ProtocolError."""
    mac = ANSWER.unpack_from(answer)[2]
    name = bytes(answer[ANSWER.size :])
    if not hmac.compare_digest(mac, proof(token, nonce, name)):
        raise ProtocolError("wrong token")
    try:
        return name.decode()
    except UnicodeDecodeError as e:
        raise ProtocolError("agent id is not UTF-8") from e


WELCOME_BYTES = WELCOME.pack(WELCOME_MAGIC, WIRE_VERSION)


# Built once at import: a first typed decode of a Struct in two threads at once can crash
# (kvbridge.transports._common says why).
_HEADER = msgspec.json.Decoder(BatchHeader)


def encode_batch(seq: int, header: BatchHeader, dst: np.ndarray) -> bytes:
    """Prefix, header and the run arrays (``dst``: RUN_FIELDS x n int64) as one buffer."""
    body = msgspec.json.encode(header)
    n = dst.shape[1]
    return (
        PREFIX.pack(BATCH_MAGIC, WIRE_VERSION, 0, seq, n, len(body))
        + body
        + np.ascontiguousarray(dst, dtype="<i8").tobytes()
    )


def decode_prefix(buf: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """``(seq, n_runs, header_len)`` of a batch prefix, or ProtocolError."""
    magic, version, flags, seq, n, hlen = PREFIX.unpack(buf)
    if magic != BATCH_MAGIC:
        raise ProtocolError(f"not a kvbridge batch (magic {magic!r})")
    if version != WIRE_VERSION or flags != 0:
        raise ProtocolError(
            f"batch of wire version {version} flags {flags}; this kvbridge "
            f"speaks version {WIRE_VERSION}"
        )
    if not 0 < n <= MAX_RUNS or not 0 < hlen <= MAX_HEADER:
        raise ProtocolError(
            f"batch declares {n} runs and a {hlen}-byte header; limits are "
            f"1..{MAX_RUNS} and 1..{MAX_HEADER}"
        )
    return seq, n, hlen


def decode_header(buf: bytes | bytearray | memoryview) -> BatchHeader:
    try:
        return _HEADER.decode(buf)
    except (msgspec.MsgspecError, UnicodeDecodeError) as e:  # msgspec lets bad UTF-8 through
        raise ProtocolError(f"malformed batch header: {e}") from e


def encode_reply(seq: int, error: str | None = None, status: Status | None = None) -> bytes:
    msg = b"" if error is None else error.encode("utf-8", "replace")[:MAX_MESSAGE]
    if status is None:
        status = Status.OK if error is None else Status.REFUSED
    return REPLY.pack(REPLY_MAGIC, WIRE_VERSION, status, seq, len(msg)) + msg


def decode_reply(buf: bytes | bytearray | memoryview) -> tuple[int, Status, int]:
    """``(seq, status, message_len)`` of a reply, or ProtocolError."""
    magic, version, status, seq, mlen = REPLY.unpack(buf)
    if magic != REPLY_MAGIC or version != WIRE_VERSION:
        raise ProtocolError(f"not a kvbridge reply (magic {magic!r}, version {version})")
    if status not in tuple(Status) or mlen > MAX_MESSAGE:
        raise ProtocolError(f"reply with status {status} and a {mlen}-byte message")
    return seq, Status(status), mlen


# ---- sockets --------------------------------------------------------------------------------


def tune(sock: socket.socket, sockbuf: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # header and ack are small
    if sockbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sockbuf)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockbuf)


def stream_order(
    src_region: np.ndarray, dst_region: np.ndarray, nbytes: np.ndarray, count: np.ndarray
) -> np.ndarray:
    """The order a sender puts a batch's runs in: small flat runs of one (source region,
    destination region, size) adjacent, in the plan's order (a layer's tokens in turn), so
    both sides move them as groups. Two sort passes: the regions and the kind of run packed
    in one key (a request of scattered pages has a run a page, layer and K or V, and each pass
    over them costs about what planning them does)."""
    small = (count == 1) & (nbytes < DIRECT_MIN)
    # Region indices index a batch's tables of names: far under 2**31, so the key fits int64.
    bits = max(int(src_region.max(initial=0)), int(dst_region.max(initial=0)), 1).bit_length()
    regions = (small.astype(np.int64) << (2 * bits)) | (src_region << bits) | dst_region
    order: np.ndarray = np.lexsort((nbytes, regions))
    return order


# ---- pieces: one side's walk over the stream ------------------------------------------------


@dataclass(frozen=True)
class Direct:
    """Contiguous region bytes that go to or come from the socket in place."""

    buf: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes)


@dataclass(frozen=True)
class Blocks:
    """``count`` blocks of ``size`` at ``offset + i * stride``, packed through the bounce."""

    view: np.ndarray
    offset: int
    size: int
    count: int
    stride: int

    @property
    def nbytes(self) -> int:
        return self.size * self.count

    def gather(self, bounce: Bounce) -> None:
        np.copyto(
            bounce.host[: self.nbytes].reshape(self.count, self.size),
            strided(self.view, self.offset, self.size, self.count, self.stride),
        )

    def scatter(self, bounce: Bounce) -> None:
        np.copyto(
            strided(self.view, self.offset, self.size, self.count, self.stride),
            bounce.host[: self.nbytes].reshape(self.count, self.size),
        )


@dataclass(frozen=True)
class Group:
    """Flat runs of one size at arbitrary offsets of one region, packed through the bounce."""

    view: np.ndarray
    offsets: np.ndarray
    size: int

    @property
    def nbytes(self) -> int:
        return self.size * len(self.offsets)

    def gather(self, bounce: Bounce) -> None:
        out = bounce.host[: self.nbytes].reshape(-1, self.size)
        out[...] = rows(self.view, self.size)[self.offsets]

    def scatter(self, bounce: Bounce) -> None:
        rows(self.view, self.size)[self.offsets] = bounce.host[: self.nbytes].reshape(-1, self.size)


@dataclass(frozen=True)
class Staged:
    """Flat runs of device memory (``sizes[i]`` bytes at ``offsets[i]`` of uint8 tensor
    ``tensor``), at most a bounce buffer's bytes, through the bounce's pinned memory."""

    tensor: Any
    offsets: np.ndarray
    sizes: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    def gather(self, bounce: Bounce) -> None:
        bounce.to_host(self.tensor, self.offsets, self.sizes)

    def scatter(self, bounce: Bounce) -> None:
        bounce.from_host(self.tensor, self.offsets, self.sizes)


Piece = Direct | Blocks | Group | Staged


def pieces(
    region: np.ndarray,
    offset: np.ndarray,
    nbytes: np.ndarray,
    count: np.ndarray,
    stride: np.ndarray,
    views: list[Any],
    bounce: int = BOUNCE_BYTES,
    staged: int | None = None,
) -> Iterator[Piece]:
    """One side's pieces of the stream, in stream order, over ``views``: a uint8 array of each
    host region, a uint8 device tensor of each device region (in pieces of at most ``staged``
    bytes, ``bounce`` if not given). Runs must be checked already."""
    n = len(region)
    if n == 0:
        return
    host = np.array([isinstance(v, np.ndarray) for v in views], dtype=bool)
    if not host[region].all():
        yield from _mixed(region, offset, nbytes, count, stride, views, host, bounce, staged)
        return
    region, offset, nbytes, count, stride = _flattened(region, offset, nbytes, count, stride)
    n = len(region)
    small = (count == 1) & (nbytes < DIRECT_MIN)
    brk = np.ones(n, dtype=bool)
    brk[1:] = ~small[1:] | ~small[:-1] | (region[1:] != region[:-1]) | (nbytes[1:] != nbytes[:-1])
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], n)
    reg, off, nb, cnt, st = (a.tolist() for a in (region, offset, nbytes, count, stride))
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        view, size = views[reg[a]], nb[a]
        if small[a]:
            yield from _small_runs(view, offset[a:b], size, bounce)
        elif cnt[a] == 1:
            yield Direct(view[off[a] : off[a] + size])
        elif size >= DIRECT_MIN:
            for j in range(cnt[a]):  # blocks of 64 KiB and more: the loop costs nothing
                o = off[a] + j * st[a]
                yield Direct(view[o : o + size])
        else:
            per = max(1, bounce // size)
            for j in range(0, cnt[a], per):
                yield Blocks(view, off[a] + j * st[a], size, min(per, cnt[a] - j), st[a])


def _flattened(*runs: np.ndarray) -> tuple[np.ndarray, ...]:
    """The runs with each short strided run of small blocks (fewer than a progression's worth:
    a key and a value of one page, say) as that many flat runs, in the same stream order: on
    scattered pages every such run would be a strided copy of its own, a Python call each,
    where flat runs of one size in one region gather in one fancy-indexed copy."""
    region, offset, nbytes, count, stride = runs
    short = (count > 1) & (count < FLATTEN_BELOW) & (nbytes < DIRECT_MIN)
    # Never past MAX_RUNS flat runs: a header of MAX_RUNS short runs would make 15 times that
    # (2 GiB of lists from a 40 MiB header, seen), before a byte of payload came.
    if not short.any() or int(np.where(short, count, 1).sum()) > MAX_RUNS:
        return runs
    idx, (offset,) = each_block(
        np.arange(len(region)), np.where(short, count, 1), [offset], [np.where(short, stride, 0)]
    )
    flat = short[idx]
    return (
        region[idx],
        offset,
        nbytes[idx],
        np.where(flat, 1, count[idx]),
        np.where(flat, 0, stride[idx]),
    )


def _small_runs(view: np.ndarray, offsets: np.ndarray, size: int, bounce: int) -> Iterator[Piece]:
    """Flat runs of one size in one region: constant-step stretches as Blocks (a strided copy
    through the bounce), the rest as Groups (fancy-indexed), each at most ``bounce`` bytes."""
    per = max(1, bounce // size)
    pos = 0
    # A strided copy streams faster than a fancy-indexed one, but finding the progressions
    # costs tens of microseconds: more than it saves on a small stretch (a small request).
    found = progressions(offsets) if len(offsets) * size >= PROGRESSIONS_FROM else []
    for a, b in [*found, (len(offsets), len(offsets))]:
        for k in range(pos, a, per):
            yield Group(view, offsets[k : min(k + per, a)], size)
        if b > a:
            step = int(offsets[a + 1] - offsets[a])
            for k in range(a, b, per):
                yield Blocks(view, int(offsets[k]), size, min(per, b - k), step)
        pos = b


def _mixed(
    region: np.ndarray,
    offset: np.ndarray,
    nbytes: np.ndarray,
    count: np.ndarray,
    stride: np.ndarray,
    views: list[Any],
    host: np.ndarray,
    bounce: int,
    staged: int | None,
) -> Iterator[Piece]:
    """:func:`pieces` where some regions are device memory: each stretch of runs in host
    regions as host pieces, each stretch in one device region as :class:`Staged` pieces."""
    on_host = host[region]
    brk = np.ones(len(region), dtype=bool)
    brk[1:] = (on_host[1:] != on_host[:-1]) | (~on_host[1:] & (region[1:] != region[:-1]))
    starts = np.flatnonzero(brk).tolist()
    for a, b in zip(starts, [*starts[1:], len(region)], strict=True):
        part = (region[a:b], offset[a:b], nbytes[a:b], count[a:b], stride[a:b])
        if on_host[a]:
            yield from pieces(*part, views, bounce)
        else:
            for offsets, sizes in staged_runs(*part[1:], staged or bounce):
                yield Staged(views[int(region[a])], offsets, sizes)


def staged_runs(
    offset: np.ndarray, nbytes: np.ndarray, count: np.ndarray, stride: np.ndarray, bounce: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Runs of one region as flat runs, cut into pieces of at most ``bounce`` bytes in stream
    order (a run that crosses a piece's end is split there): (offsets, sizes) of each piece."""
    if bounce < 1:
        raise ValueError(f"bounce must be >= 1 byte, got {bounce}")
    idx, (off,) = each_block(np.arange(len(offset)), count, [offset], [stride])  # flattened
    size = nbytes[idx]
    # Cut every run at each multiple of ``bounce`` of the stream position it covers.
    start = np.cumsum(size) - size
    first, last = start // bounce, (start + size - 1) // bounce
    parts = last - first + 1
    j = np.arange(int(parts.sum()), dtype=np.int64) - np.repeat(np.cumsum(parts) - parts, parts)
    s0, sz, o0 = (np.repeat(a, parts) for a in (start, size, off))
    lo = np.maximum(s0, (np.repeat(first, parts) + j) * bounce)
    hi = np.minimum(s0 + sz, (np.repeat(first, parts) + j + 1) * bounce)
    piece = lo // bounce
    edges = np.flatnonzero(np.diff(piece)) + 1
    for sel in np.split(np.arange(len(lo)), edges):
        yield o0[sel] + (lo[sel] - s0[sel]), hi[sel] - lo[sel]
