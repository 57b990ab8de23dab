"""The bootstrap service's checks of what ranks send it: pure functions of the request, run on
the server's check threads (they read no server state); each refusal is a :class:`Fail`, the
status and the reason the client gets."""

from __future__ import annotations

import dataclasses

import msgspec

from kvbridge.bootstrap.rooms import MAX_ROOMS_PER_CALL
from kvbridge.errors import IncompatibleError, LayoutError, ProtocolError, SpecError
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.plan import Pairing, Side
from kvbridge.wire.protocol import RankInfo, Role, info_from_json, side_from_info


class Fail(Exception):
    """Raised by a handler to answer ``status`` with ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def world(info: RankInfo) -> int:
    return info.tp * info.cp * len(info.layer_ranges)


def memory_difference(a: RankInfo, b: RankInfo) -> str | None:
    ra, rb = dict(a.memory.regions), dict(b.memory.regions)
    for name in sorted(ra.keys() | rb.keys()):
        if ra.get(name) != rb.get(name):
            return f"region {name!r} of {ra.get(name)} vs {rb.get(name)} bytes"
    # Compared by key, not by list order: the order is a dict's, not part of the description.
    ba = {(x.layer, x.component): x for x in [*a.memory.buffers, a.memory.aux]}
    bb = {(x.layer, x.component): x for x in [*b.memory.buffers, b.memory.aux]}
    for key in sorted(ba.keys() | bb.keys()):
        if ba.get(key) != bb.get(key):
            return f"buffer layer {key[0]} {key[1]!r}: {ba.get(key)} vs {bb.get(key)}"
    return None


def rank_difference(known: RankInfo, new: RankInfo, known_side: Side, new_side: Side) -> str | None:
    """What makes ``new`` a different side than ``known`` (two ranks of one engine), or None."""
    if known.fingerprint != new.fingerprint:
        what = known_side.spec.describe_difference(new_side.spec)
        return f"spec fingerprint {known.fingerprint} vs {new.fingerprint} ({what})"
    for f in dataclasses.fields(ParallelLayout):
        a, b = getattr(known_side.parallel, f.name), getattr(new_side.parallel, f.name)
        if a != b:
            return f"{f.name} {getattr(a, 'value', a)} vs {getattr(b, 'value', b)}"
    mem = memory_difference(known, new)
    return None if mem is None else f"memory description: {mem}"


def decode_info(raw: bytes, role: Role, path: str) -> RankInfo:
    try:
        info = info_from_json(raw)
    except ProtocolError as e:
        raise Fail(400, str(e)) from None
    if info.role is not role:
        raise Fail(
            400,
            f"{path} expects a {role.value} rank; {info.agent} says it is a {info.role.value} rank",
        )
    return info


def check_rank(info: RankInfo) -> None:
    """After the side is known valid, so that ``world`` means something."""
    if not 0 <= info.engine_rank < world(info):
        raise Fail(
            400,
            f"{info.agent}: engine_rank {info.engine_rank} is out of range "
            f"[0, {world(info)}) for tp {info.tp} x cp {info.cp} x pp "
            f"{len(info.layer_ranges)}",
        )


def prefill_side(raw: bytes) -> tuple[RankInfo, Side]:
    info = decode_info(raw, Role.PREFILL, "/v1/prefill")
    try:
        side = side_from_info(info)
    except (ProtocolError, SpecError, LayoutError) as e:
        raise Fail(400, str(e)) from None
    check_rank(info)
    return info, side


class Rooms(msgspec.Struct):
    rooms: list[int]


# Built once at import: a first typed decode of a Struct in two threads at once can crash
# (kvbridge.transports._common says why).
ROOMS = msgspec.json.Decoder(Rooms)


def check_rooms(rooms: list[int]) -> None:
    if not 1 <= len(rooms) <= MAX_ROOMS_PER_CALL:
        raise Fail(400, f"name 1 to {MAX_ROOMS_PER_CALL} rooms a call, got {len(rooms)}")
    bad = [r for r in rooms if not 0 <= r < 1 << 63]
    if bad:
        raise Fail(400, f"a room is an integer in [0, 2**63), got {bad[0]}")


def pair(info: RankInfo, prefill: Side, name: str) -> None:
    try:
        side = side_from_info(info)
        check_rank(info)
        # Pairing is the planner's own check: what it refuses, no transfer could serve.
        Pairing(prefill, side)
    except (IncompatibleError, LayoutError) as e:
        raise Fail(
            409, f"decode rank {info.agent} cannot pair with prefill engine {name!r}: {e}"
        ) from None
    except (ProtocolError, SpecError) as e:
        raise Fail(400, str(e)) from None
