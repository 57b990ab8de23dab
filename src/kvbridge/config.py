"""Settings: every deadline and knob, from one typed table of ``KVBRIDGE_*`` variables.

Constructor arguments win over the environment, which wins over the defaults::

    Settings.from_env(transfer_timeout=5.0)

Each field says what it means (:func:`documented`), and so does each variable kvbridge reads
outside this table (:data:`OTHER_VARIABLES`): :mod:`kvbridge.cli.configref` renders both, with
the vLLM connector's options, as docs/configuration.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from kvbridge.errors import KVBridgeError
from kvbridge.staging.cost import StagingMode

T = TypeVar("T")
DOC = "doc"  # the metadata key of what a documented field means

MAX_STAGING_SLOTS = 4096
MIN_SLOT_BYTES = 4096  # a page: smaller segments cost more in notices than they save
MAX_SLOT_BYTES = 1 << 30
TRUE_WORDS = ("1", "true", "yes", "on")  # a bool variable is true for these (any case)


class SettingsError(KVBridgeError, ValueError):
    """A setting (argument or environment variable) has a value it cannot take."""


def documented(default: T, doc: str) -> T:
    """A dataclass field's ``default``, with ``doc``: what the field means to a user. The
    configuration reference is rendered from these, so the meaning lives next to the default
    and cannot drift from it."""
    return field(default=default, metadata={DOC: doc})


@dataclass(frozen=True)
class Settings:
    bootstrap_timeout: float = documented(
        30.0,
        "Seconds to reach the bootstrap service and every prefill rank. In the vLLM "
        "connector's both-legs-at-once mode it counts from the decode request's arrival, so "
        "it includes the time the prompt queues at the prefill server.",
    )
    waiting_timeout: float = documented(
        120.0,
        "Seconds a request waits for the other side's input: a prefill rank holds a computed "
        "request's pages this long for a decode rank that never asks (a dead one that had "
        "asked fails it within the heartbeat window). A cold decode engine on a shared host "
        "took 61 s to ask for its first requests (docs/vllm-connector.md). In the vLLM "
        "connector's both-legs-at-once mode it counts from the decode request's arrival, like "
        "bootstrap_timeout.",
    )
    transfer_timeout: float = documented(60.0, "Seconds from the first byte owed to the last.")
    abort_timeout: float = documented(
        5.0, "Seconds a decode abort waits for the senders to drain their writes."
    )
    heartbeat_interval: float = documented(0.5, "Seconds between heartbeats to each peer.")
    heartbeat_misses: int = documented(
        6,
        "A peer silent for heartbeat_interval x heartbeat_misses seconds is dead, and its "
        "requests fail.",
    )
    token: str = documented(
        "",
        "Shared secret for every channel: bootstrap, control, tcp data. Empty: none (a rank "
        "that binds off loopback without one logs a warning).",
    )
    host: str = documented(
        "127.0.0.1",
        "Where a rank's endpoints bind (its control channel and its tcp or Mooncake data "
        "endpoint) and its metrics are served: loopback unless told otherwise. Across hosts, "
        "this host's address on the network the other side reaches (docs/deployment.md).",
    )
    advertise: str = documented(
        "",
        "The address peers reach this rank's endpoints at, where it is not host (behind NAT, "
        "or host 0.0.0.0, which names no address a peer can reach: a rank bound there "
        "without advertise is refused at start-up). Empty: host.",
    )
    integrity: bool = documented(False, "Checksum every part and verify it on the decode side.")
    faults: str = documented(
        "",
        "Test-only fault injection: comma-separated name[=value], e.g. shift_bytes=8 "
        "(kvbridge.runtime.faults lists every name); or @PATH, the faults a file holds, "
        "read again at each request where it changed. Empty: none; every hook is a no-op.",
    )
    stall_dump: float = documented(
        0.0,
        "Seconds this process's ranks may miss their control ticks before every thread's "
        "Python stack is written to stderr, and again every as many seconds while the stall "
        "lasts (kvbridge.runtime.watchdog): the diagnosis of a rank its peers saw freeze. "
        "0: off.",
    )
    max_parked: int = documented(
        4096, "Request metadata held for rooms this rank has no sender for yet."
    )
    max_connections: int = documented(256, "Inbound data connections a tcp agent accepts at once.")
    metrics_port: int = documented(
        0,
        "Serve this process's kvbridge metrics (Prometheus text, names starting kvbridge_) "
        "at http://host:metrics_port/metrics. 0: not served (an engine may serve "
        "kvbridge.runtime.metrics.REGISTRY itself; the vLLM connector reports through "
        "vLLM's /metrics).",
    )
    # Staged transfer (kvbridge.staging): the path, and each rank's staging region, a ring of
    # staging_slots slots of staging_slot_bytes (a segment is at most one slot).
    staging: StagingMode = documented(
        StagingMode.AUTO,
        "How a sender chooses its path (docs/design.md, Staged transfer): auto, staged where "
        "the transport's cost model says it is faster; always, staged wherever both ranks "
        "have a staging region (tests, benchmarks; on CUDA pools the only way to stage: the "
        "region is then GPU memory); never, direct, and no staging region is allocated.",
    )
    staging_slots: int = documented(
        8,
        f"Slots in each rank's staging ring, in [1, {MAX_STAGING_SLOTS}]; allocated only "
        "where staging can be chosen.",
    )
    staging_slot_bytes: int = documented(
        16 << 20,
        f"Bytes of one staging slot, in [{MIN_SLOT_BYTES}, {MAX_SLOT_BYTES}]; a segment is at "
        "most one slot, so larger slots mean fewer, larger writes (docs/benchmarks.md).",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.staging, StagingMode):
            modes = ", ".join(m.value for m in StagingMode)
            raise SettingsError(f"staging must be a StagingMode ({modes}), got {self.staging!r}")
        if not 1 <= self.staging_slots <= MAX_STAGING_SLOTS:
            raise SettingsError(
                f"staging_slots must be in [1, {MAX_STAGING_SLOTS}], got {self.staging_slots}"
            )
        if not MIN_SLOT_BYTES <= self.staging_slot_bytes <= MAX_SLOT_BYTES:
            raise SettingsError(
                f"staging_slot_bytes must be in [{MIN_SLOT_BYTES}, "
                f"{MAX_SLOT_BYTES}], got {self.staging_slot_bytes}"
            )
        for f in (
            "bootstrap_timeout",
            "waiting_timeout",
            "transfer_timeout",
            "abort_timeout",
            "heartbeat_interval",
        ):
            if not getattr(self, f) > 0:
                raise SettingsError(f"{f} must be > 0 seconds, got {getattr(self, f)}")
        check_host(self.host)
        if self.advertise:
            check_host(self.advertise)
        elif self.host in WILDCARDS:
            raise SettingsError(
                f"host {self.host} binds every interface and names none a peer can reach: "
                f"set {ENV_PREFIX}ADVERTISE to this host's address on the peers' network"
            )
        if not self.stall_dump >= 0:
            raise SettingsError(f"stall_dump must be >= 0 seconds, got {self.stall_dump}")
        if not 0 <= self.metrics_port < 65536:
            raise SettingsError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        for f in ("heartbeat_misses", "max_parked", "max_connections"):
            if getattr(self, f) < 1:
                raise SettingsError(f"{f} must be >= 1, got {getattr(self, f)}")

    def hint(self, name: str) -> str:
        """What a deadline failure tells the operator: the setting behind it, and when to
        raise it."""
        return (
            f"{ENV_PREFIX}{name.upper()} is {getattr(self, name):g} s: raise it where the "
            f"engines are slow to start or to compute, not dead (a dead peer fails its "
            f"requests within the heartbeat window whatever it is)"
        )

    @property
    def dead_after(self) -> float:
        return self.heartbeat_interval * self.heartbeat_misses

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = ENV_PREFIX + f.name.upper()
            if name not in env:
                continue
            raw = env[name]
            try:
                if f.type == "bool":
                    values[f.name] = raw.strip().lower() in TRUE_WORDS
                elif f.type == "int":
                    values[f.name] = int(raw)
                elif f.type == "float":
                    values[f.name] = float(raw)
                elif f.type == "StagingMode":
                    values[f.name] = StagingMode(raw.strip().lower())
                else:
                    values[f.name] = raw
            except ValueError:
                want = (
                    f"a {f.type}"
                    if f.type != "StagingMode"
                    else " or ".join(m.value for m in StagingMode)
                )
                raise SettingsError(f"{name}={raw!r}: expected {want}") from None
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise SettingsError(
                f"unknown settings {sorted(unknown)}; known: {[f.name for f in fields(cls)]}"
            )
        try:
            settings = cls(**values)
        except SettingsError as e:  # a value each variable reads well, refused together
            given = ", ".join(
                f"{ENV_PREFIX}{k.upper()}={env[ENV_PREFIX + k.upper()]!r}" for k in values
            )
            raise SettingsError(f"{e} (from {given})") from None
        return replace(settings, **overrides)


# ---- what a server listens on (bootstrap, proxy) ---------------------------------------------

WILDCARDS = frozenset({"0.0.0.0", "::", "[::]"})  # every interface: no address to reach


def check_host(host: str) -> str:
    """``host`` if a server can be told to listen on it, else SettingsError. "" is refused:
    it means every interface, which a user should say (0.0.0.0), not get by accident."""
    if (
        not isinstance(host, str)
        or not host
        or host != host.strip()
        or any(not c.isprintable() or c.isspace() for c in host)
    ):
        raise SettingsError(
            f"expected a host name or IP address to listen on (0.0.0.0 for "
            f"every interface), got {host!r}"
        )
    return host


def check_port(port: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise SettingsError(f"port must be in [0, 65535] (0: a free one), got {port!r}")
    return port


def check_token(token: str | None) -> str | None:
    """``token`` if it can be given on a command line and in a variable (printable ASCII, no
    spaces), else SettingsError; None means no token."""
    if token is not None and (
        not isinstance(token, str) or not token or any(not "!" <= c <= "~" for c in token)
    ):
        raise SettingsError(
            f"a token must be non-empty printable ASCII without spaces, got {token!r}"
        )
    return token


ENV_PREFIX = "KVBRIDGE_"
ENV_VARS = tuple(ENV_PREFIX + f.name.upper() for f in fields(Settings))


# ---- variables read outside Settings ------------------------------------------------------


@dataclass(frozen=True)
class Variable:
    """A ``KVBRIDGE_*`` variable read by one part of kvbridge (or its scripts) rather than
    through :class:`Settings`: a log level, or where a script builds its environment."""

    name: str
    read_by: str
    default: str  # what holds while it is unset
    doc: str

    def __post_init__(self) -> None:
        if not self.name.startswith(ENV_PREFIX) or self.name in ENV_VARS:
            raise SettingsError(f"{self.name} is no {ENV_PREFIX}* variable outside Settings")


OTHER_VARIABLES = (
    Variable(
        "KVBRIDGE_LOG",
        "the vLLM connector",
        "unset: vLLM's loggers only",
        "Level of kvbridge's log on stderr (debug, info, warning...), in vLLM's scheduler "
        "process and in each worker's.",
    ),
    Variable(
        "KVBRIDGE_RANK_LOG",
        "kvbridge chaos",
        "unset: dropped (faults are the point there)",
        "Level of the log of each rank process the chaos soak starts (debug, info...).",
    ),
    Variable(
        "KVBRIDGE_VLLM_VENV",
        "scripts/vllm_env.sh, the vLLM tests",
        "~/.cache/kvbridge/vllm-venv",
        "Where scripts/vllm_env.sh builds (or reuses) the venv with vLLM's CPU build and "
        "kvbridge, and where the vLLM tests look for it.",
    ),
    Variable(
        "KVBRIDGE_VLLM_PYTHON",
        "scripts/vllm_env.sh",
        "python3",
        "The Python interpreter that vLLM's venv is built with.",
    ),
    Variable(
        "KVBRIDGE_VLLM_PY",
        "the vLLM tests",
        "unset: KVBRIDGE_VLLM_VENV's python",
        "The python of a vLLM environment for the vLLM tests; scripts/test.sh sets it to the "
        "one scripts/vllm_env.sh printed.",
    ),
    Variable(
        "KVBRIDGE_SGLANG_VENV",
        "scripts/sglang_env.sh",
        "~/.cache/kvbridge/sglang-venv",
        "Where scripts/sglang_env.sh builds (or reuses) the venv with SGLang 0.5.23 for CPU, "
        "sglang-router and kvbridge.",
    ),
    Variable(
        "KVBRIDGE_SGLANG_PY",
        "the SGLang tests",
        "unset: what scripts/sglang_env.sh builds or reuses",
        "The python of an SGLang environment for the SGLang backend's tests; scripts/test.sh "
        "sets it to the one scripts/sglang_env.sh printed.",
    ),
    Variable(
        "KVBRIDGE_SGLANG_TRANSPORT",
        "the SGLang backend",
        "tcp",
        "The transport kvbridge's SGLang backend moves KV with (tcp, shm, nixl, mooncake; "
        "inproc is for tests in one process), in each SGLang server's scheduler processes; "
        "prefill and decode servers must use the same. A GPU server's KV moves over tcp (through "
        "pinned host memory), nixl or mooncake (its aux slots are host memory, which cudaipc "
        "refuses).",
    ),
    Variable(
        "KVBRIDGE_SGLANG_PYTHON",
        "scripts/sglang_env.sh",
        "python3",
        "The Python interpreter (3.11 or newer) that SGLang's venv is built with.",
    ),
)
