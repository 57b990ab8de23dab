"""What travels between the two vLLM instances inside ``kv_transfer_params``, and the
connector's own options (``kv_connector_extra_config``). Plain data, no vLLM import.

The flow is vLLM's disaggregated one:

1. the proxy sends the prompt to the prefill instance with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``;
2. the prefill instance computes the prompt's KV, holds its blocks, and answers with
   :class:`RemotePrefill` as ``kv_transfer_params`` (where its bootstrap service is, which
   room, how many tokens);
3. the proxy sends the request to the decode instance with those params; the decode instance
   allocates blocks, asks for the room, and the prefill ranks push the KV into them.

Or both legs at once (``kvbridge proxy --prefill-bootstrap``): the proxy picks the room and
sends the prefill request ``{"do_remote_decode": true, "kvbridge": {"room": R}}`` (a
:class:`PushRoom`) and the decode request :class:`RemotePrefill` without ``tokens`` (the
prompt's length) together; the decode instance's blocks are ready before the prefill's forward
ends, so the prefill ranks send each layer as the forward computes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvbridge.config import documented
from kvbridge.errors import KVBridgeError
from kvbridge.integrations.vllm.memory import VllmLayout

KEY = "kvbridge"  # the sub-dictionary of kv_transfer_params kvbridge owns


class ParamsError(KVBridgeError):
    """kv_transfer_params or the connector's extra config are not what kvbridge expects."""


@dataclass(frozen=True)
class RemotePrefill:
    """What a decode instance needs to receive one request's KV from a prefill instance."""

    bootstrap: str  # host:port of the prefill instance's bootstrap service
    room: int
    tokens: int  # prompt tokens whose KV the prefill instance holds

    def __post_init__(self) -> None:
        check_address(self.bootstrap, "bootstrap")
        if not 0 <= self.room < 2**63 or self.tokens < 1:
            raise ParamsError(
                f"room must be in [0, 2^63) and tokens >= 1, got room "
                f"{self.room}, tokens {self.tokens}"
            )

    def to_params(self) -> dict[str, Any]:
        """The prefill instance's answer, as vLLM's proxies forward it to the decode one."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            KEY: {"bootstrap": self.bootstrap, "room": self.room, "tokens": self.tokens},
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any], prompt: int | None = None) -> RemotePrefill:
        """The decode request's params; ``tokens`` may be left out where the proxy sent both
        legs at once (it may not know the prompt's length): ``prompt`` is then used."""
        ours = _ours(params, "do_remote_prefill", "the prefill instance's answer")
        try:
            tokens = ours["tokens"] if "tokens" in ours or prompt is None else prompt
            return cls(str(ours["bootstrap"]), int(ours["room"]), int(tokens))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ParamsError(
                f"kv_transfer_params[{KEY!r}] needs bootstrap, room and tokens; "
                f"got {dict(ours)}: {e}"
            ) from None


@dataclass(frozen=True)
class PushRoom:
    """A prefill request whose decode request was sent at the same time: the room the proxy
    chose, under which the decode instance is already waiting."""

    room: int

    def __post_init__(self) -> None:
        if not 0 <= self.room < 2**63:
            raise ParamsError(f"room must be in [0, 2^63), got {self.room}")

    def to_params(self) -> dict[str, Any]:
        return {"do_remote_decode": True, KEY: {"room": self.room}}

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PushRoom | None:
        """None for a plain prefill request (the prefill instance picks the room)."""
        if KEY not in params:
            return None
        ours = _ours(params, "do_remote_decode", "the room the proxy chose")
        try:
            return cls(int(ours["room"]))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ParamsError(
                f"kv_transfer_params[{KEY!r}] of a prefill request needs room; "
                f"got {dict(ours)}: {e}"
            ) from None


def check_address(address: str, what: str) -> str:
    """``host:port`` (a port in [1, 65535]; a host name or address, not a URL)."""
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if (
        not host
        or "/" in host
        or any(c.isspace() or not c.isprintable() for c in host)
        or not port.isdigit()
        or not 0 < int(port) < 65536
    ):
        raise ParamsError(f"{what} must be host:port (a port in [1, 65535]), got {address!r}")
    return address


def _ours(params: Mapping[str, Any], flag: str, what: str) -> Mapping[str, Any]:
    ours = params.get(KEY)
    if not isinstance(ours, Mapping):
        raise ParamsError(
            f"kv_transfer_params with {flag} need a {KEY!r} entry ({what}), got "
            f"{KEY!r}: {ours!r} among keys {sorted(params)}"
        )
    return ours


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config``: every key optional, named as the field; each field says
    what it means (docs/configuration.md is rendered from them)."""

    bootstrap: str = documented(
        "127.0.0.1:8998",
        "host:port of the prefill instance's bootstrap service (the producer serves it there).",
    )
    serve_bootstrap: bool = documented(
        True,
        "The producer's first worker serves the bootstrap service; false when it runs on its "
        "own (kvbridge bootstrap).",
    )
    transport: str = documented(
        "tcp",
        "The transport that moves the bytes: tcp, nixl or mooncake; for KV on GPUs tcp "
        "(through pinned host memory), nixl, mooncake or cudaipc (one host). tcp by default: "
        "vLLM's CPU KV cache is private memory, and shm needs shared memory on the decode side.",
    )
    layout: VllmLayout | None = documented(
        None,
        "The KV tensors' layout. Unset: cpu on vLLM's CPU backend (per block and head, K "
        "transposed as [head_size, block_size], then V as [block_size, head_size]); on CUDA "
        "read from the tensors' strides (LBNHC is nhd, LBHNC is hnd).",
    )
    aux_slots: int = documented(1024, "Requests one decode worker may receive at once.")

    def __post_init__(self) -> None:
        check_address(self.bootstrap, "kv_connector_extra_config bootstrap")
        if self.aux_slots < 1:
            raise ParamsError(f"aux_slots must be >= 1, got {self.aux_slots}")

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        extra = dict(extra or {})
        known = [f.name for f in fields(cls)]
        unknown = set(extra) - set(known)
        if unknown:
            raise ParamsError(
                f"unknown kv_connector_extra_config keys {sorted(map(repr, unknown))}; "
                f"known: {', '.join(known)}"
            )
        layout = extra.get("layout")
        try:
            return cls(
                bootstrap=str(extra.get("bootstrap", cls.bootstrap)),
                serve_bootstrap=_bool(extra.get("serve_bootstrap", True)),
                transport=str(extra.get("transport", cls.transport)),
                layout=VllmLayout(layout) if layout is not None else None,
                aux_slots=int(extra.get("aux_slots", cls.aux_slots)),
            )
        except (ValueError, TypeError, OverflowError) as e:
            raise ParamsError(f"kv_connector_extra_config: {e}") from None


# A bool option is a JSON bool, or one of these words (any case).
TRUE_WORDS = ("1", "true", "yes")
FALSE_WORDS = ("0", "false", "no")


def _bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in TRUE_WORDS:
        return True
    if str(v).lower() in FALSE_WORDS:
        return False
    raise ValueError(f"expected a boolean, got {v!r}")
