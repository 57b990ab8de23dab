"""Every place kvbridge parses bytes or values from outside, as fuzz targets.

A target takes one input (bytes) and feeds it to one decoder the way the code that receives
it does; the decoder must answer with a result or a :class:`~kvbridge.errors.KVBridgeError`
naming what is wrong. Anything else (a ``KeyError``, an ``OverflowError``, a ``TypeError``)
is a bug: in a rank it would reach a handler untyped, be logged as a crash and answer no one.
The tests drive the targets with hypothesis (``tests/test_fuzz.py``); ``benchmarks/fuzz.py``
runs each for longer, coverage-guided with atheris where it installs, and reports how many
inputs each took.

The JSON targets take a decoded JSON value (what the engine or the proxy hands over): an input
that parses as JSON is that value; any other input steers a mutation of one of the target's
valid values (which field to replace, and with what), so that byte-level fuzzers reach the
decoder with structured values rather than with parse errors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.bootstrap.checks import Fail, prefill_side
from kvbridge.errors import KVBridgeError, ProtocolError
from kvbridge.integrations.sglang.pools import PrefillPages, decode_placement
from kvbridge.integrations.sglang.states import StateArgs, StateIndices
from kvbridge.integrations.vllm.params import ConnectorOptions, PushRoom, RemotePrefill
from kvbridge.integrations.vllm.proxy import prefill_answer
from kvbridge.model.spec import CacheSpec, DType, attention_layer, mamba2_layer
from kvbridge.planner.layout import build_memory
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.plan import Side
from kvbridge.transports import tcp_wire as wire
from kvbridge.wire.protocol import (
    Abort,
    ChunkDone,
    Heartbeat,
    Hello,
    RequestMeta,
    Role,
    decode,
    encode,
    info_to_json,
    rank_info,
)

TOKEN = "fuzz-token"
NONCE = bytes(range(32))


class NotApplicable(Exception):
    """The input is not of the kind this target's decoder receives (not JSON): not counted."""


@dataclass(frozen=True)
class Target:
    name: str
    what: str  # the decoder, and where its input comes from
    run: Callable[[Any], object]  # bytes, or a JSON value where ``json``
    seeds: tuple[bytes, ...]
    json: bool = False


class _Stream:
    """Choices read off fuzzer bytes (zeros once they run out)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def byte(self) -> int:
        self.at += 1
        return self.data[self.at - 1] if self.at <= len(self.data) else 0

    def value(self, depth: int = 0) -> Any:
        kind = self.byte() % (9 if depth < 3 else 7)
        n = self.byte()
        if kind == 0:
            return None
        if kind == 1:
            return bool(n & 1)
        if kind == 2:
            return n - 128
        if kind == 3:  # a wide integer, either sign
            return int.from_bytes(bytes(self.byte() for _ in range(n % 10)), "big") * (
                -1 if n & 1 else 1
            )
        if kind == 4:
            return [float("inf"), float("-inf"), float("nan"), 0.5, -1.0, 1e300][n % 6]
        if kind == 5:
            return "".join(chr(self.byte() or 0x2603) for _ in range(n % 12))
        if kind == 6:
            return ["127.0.0.1:8998", "", "tcp", "-1", "1e9", "true", ":", "a:0"][n % 8]
        if kind == 7:
            return [self.value(depth + 1) for _ in range(n % 5)]
        keys = [str(self.value(3)) if n & 1 else "room" for _ in range(n % 4)]  # JSON's: strings
        return {k: self.value(depth + 1) for k in keys}

    def mutate(self, value: Any) -> Any:
        """``value`` with the fields the bytes pick replaced by values they make."""
        if self.byte() % 4 == 0:
            return self.value()
        if isinstance(value, dict):
            out = {k: self.mutate(v) for k, v in value.items() if self.byte() % 8}
            if self.byte() % 4 == 0:
                out[str(self.value(3))] = self.value()
            return out
        if isinstance(value, list):
            return [self.mutate(v) for v in value] + [self.value() for _ in range(self.byte() % 2)]
        return value


def _json_input(target: Target, data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        stream = _Stream(data)
        return stream.mutate(json.loads(target.seeds[stream.byte() % len(target.seeds)]))


def _side() -> Side:
    spec = CacheSpec(
        "fuzz",
        (
            attention_layer(2, 8, DType.BFLOAT16),
            mamba2_layer(4, 4, 1, 4, 4, conv_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32),
        ),
    )
    par = ParallelLayout.even(2, 2)
    return Side(spec, par, build_memory(spec, par, page_size=4, num_pages=8))


_INFO = rank_info("p", Role.PREFILL, 1, "tcp://127.0.0.1:5555", _side(), "tcp", b"meta")


def _control(data: bytes) -> object:
    return decode(data)


def _registration(data: bytes) -> object:
    """What the bootstrap service does with a prefill rank's registration body before it
    stores it (a refusal is its answer: 400 and the reason)."""
    try:
        return prefill_side(data)
    except Fail as e:
        raise ProtocolError(f"{e.status}: {e.message}") from None


def _tcp_handshake(data: bytes) -> object:
    """The listener reads a fixed part, then as many bytes as it says, then checks them."""
    if len(data) < wire.ANSWER.size:
        return wire.decode_challenge(data.ljust(wire.CHALLENGE.size, b"\0")[: wire.CHALLENGE.size])
    n = wire.answer_length(data[: wire.ANSWER.size])
    return wire.check_answer(TOKEN, NONCE, data[:n].ljust(n, b"\0"))


def _tcp_batch(data: bytes) -> object:
    """A batch's prefix and header as the receiver reads them; a reply as the sender does."""
    if data[:4] == wire.REPLY_MAGIC:
        return wire.decode_reply(data.ljust(wire.REPLY.size, b"\0")[: wire.REPLY.size])
    _, _, header_len = wire.decode_prefix(data.ljust(wire.PREFIX.size, b"\0")[: wire.PREFIX.size])
    return wire.decode_header(data[wire.PREFIX.size : wire.PREFIX.size + header_len])


def _vllm_params(params: Any) -> object:
    """kv_transfer_params as vLLM hands them to the connector, and its extra config."""
    if not isinstance(params, dict):
        raise NotApplicable  # vLLM hands the connector a dict
    if "do_remote_prefill" in params:
        return RemotePrefill.from_params(params, prompt=params.get("prompt_len"))
    if "kvbridge" in params:
        return PushRoom.from_params(params)
    return ConnectorOptions.parse(params)


def _proxy(answer: Any) -> object:
    """The proxy reading a prefill server's answer."""
    return prefill_answer(json.dumps(answer).encode(), "http://prefill")


_STATES = (
    StateArgs("mamba", (4096,), (512,), (64,), (0,)),
    StateArgs("swa", (8192,), (512,), (64,)),
)


def _sglang(value: Any) -> object:
    """What SGLang hands kvbridge's backend: a decode request's pages and state indices, and
    a prefill's sends (each a page list, a token count, the last with state indices)."""
    if not isinstance(value, dict):
        raise NotApplicable
    tokens, start, page = (value.get(k, d) for k, d in (("tokens", 8), ("start", 0), ("page", 4)))
    sends = value.get("sends") or []
    # SGLang hands integers (and lists or tensors of them): other types are not its input.
    if not all(type(x) is int for x in (tokens, start, page)) or not isinstance(sends, list):
        raise NotApplicable
    states = StateIndices.parse(_STATES, value.get("states"))
    if value.get("role") == "prefill":
        pp = PrefillPages(tokens, start, page, 0)
        for i, send in enumerate(sends):
            given = send.get("tokens") if isinstance(send, dict) else "?"
            if given is not None and type(given) is not int:
                raise NotApplicable
            last = i == len(sends) - 1  # SGLang gives the state indices with its last send
            pp.add(send.get("pages", []), given, states if last else StateIndices())
        return pp.placement()
    return decode_placement(tokens, start, page, value.get("pages") or [], 0, states)


TARGETS = (
    Target(
        "control",
        "protocol.decode: a control message off the ZeroMQ socket",
        _control,
        tuple(
            encode(m)
            for m in (
                Heartbeat(sender="d"),
                Abort(sender="d", session=1, room=5, decode_rank=0),
                Hello(sender="d", session=1, info=_INFO),
                RequestMeta(
                    sender="d",
                    session=1,
                    room=5,
                    decode_rank=0,
                    tokens=9,
                    pages={"kv": [3, 1, 2]},
                    slots={"aux": 1, "state": 0},
                ),
                ChunkDone(
                    sender="p", session=1, room=5, prefill_rank=0, start=0, stop=9, parts=["kv"]
                ),
            )
        ),
    ),
    Target(
        "registration",
        "a rank's registration body, as the bootstrap service decodes and validates it",
        _registration,
        (info_to_json(_INFO),),
    ),
    Target(
        "tcp_handshake",
        "the tcp data port's challenge and answer",
        _tcp_handshake,
        (wire.encode_answer(TOKEN, NONCE, "p/prefill/0"), wire.challenge()[1]),
    ),
    Target(
        "tcp_batch",
        "a tcp batch's prefix and header, and the receiver's reply",
        _tcp_batch,
        (
            wire.encode_batch(
                7,
                wire.BatchHeader("p", "d", ("L0.k",), 64, (1, 5)),
                np.zeros((5, 1), dtype=np.int64),
            ),
            wire.encode_reply(7, "refused: no such room"),
        ),
    ),
    Target(
        "vllm_params",
        "the vLLM connector's kv_transfer_params and kv_connector_extra_config",
        _vllm_params,
        (
            json.dumps(RemotePrefill("127.0.0.1:8998", 5, 9).to_params()).encode(),
            json.dumps(PushRoom(5).to_params()).encode(),
            b'{"bootstrap": "127.0.0.1:8998", "transport": "tcp", "aux_slots": 4}',
        ),
        json=True,
    ),
    Target(
        "vllm_proxy",
        "the vLLM proxy reading a prefill server's answer",
        _proxy,
        (
            b'{"choices": [], "kv_transfer_params": '
            + json.dumps(RemotePrefill("127.0.0.1:8998", 5, 9).to_params()).encode()
            + b"}",
        ),
        json=True,
    ),
    Target(
        "sglang",
        "the SGLang backend's page lists and state indices, as SGLang hands them over",
        _sglang,
        (
            b'{"tokens": 9, "start": 4, "page": 4, "pages": [7, 2], "states": [[3], [2]]}',
            b'{"role": "prefill", "tokens": 9, "page": 4, "states": [[3], [1, 2]], '
            b'"sends": [{"pages": [1, 2], "tokens": 8}, {"pages": [5], "tokens": 1}]}',
        ),
        json=True,
    ),
)


def run(target: Target, data: bytes) -> bool:
    """Feeds ``data`` to ``target``: True if it was of the target's kind (counted), False if
    not; any exception but a KVBridgeError propagates (a bug)."""
    try:
        target.run(_json_input(target, data) if target.json else data)
    except NotApplicable:
        return False
    except KVBridgeError:
        pass
    return True
