"""Settings: every deadline and knob, from one typed table of ``KVBRIDGE_*`` variables.

Constructor arguments win over the environment, which wins over the defaults::

    Settings.from_env(transfer_timeout=5.0)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.staging.cost import StagingMode


class SettingsError(KVBridgeError, ValueError):
    """A setting (argument or environment variable) has a value it cannot take."""


@dataclass(frozen=True)
class Settings:
    bootstrap_timeout: float = 30.0  # reach the bootstrap service and every prefill rank
    waiting_timeout: float = 60.0  # a request waits this long for the other side's input
    transfer_timeout: float = 60.0  # from the first byte owed to the last
    abort_timeout: float = 5.0  # a decode abort waits this long for the senders' drain
    heartbeat_interval: float = 0.5
    heartbeat_misses: int = 6  # a peer silent for interval x misses is dead
    token: str = ""  # shared secret for every channel: bootstrap, control, tcp data
    host: str = "127.0.0.1"  # where control endpoints bind: loopback unless told otherwise
    integrity: bool = False  # checksum every part and verify it on the decode side
    faults: str = ""  # test-only fault injection, see kvbridge.faults
    max_parked: int = 4096  # request metadata held for rooms this rank has no sender for yet
    max_connections: int = 256  # inbound data connections a tcp agent accepts at once
    # Staged transfer (kvbridge.staging): the path, and each rank's staging region, a ring of
    # staging_slots slots of staging_slot_bytes (a segment is at most one slot).
    staging: StagingMode = StagingMode.AUTO
    staging_slots: int = 8
    staging_slot_bytes: int = 16 << 20

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
        for f in ("heartbeat_misses", "max_parked", "max_connections"):
            if getattr(self, f) < 1:
                raise SettingsError(f"{f} must be >= 1, got {getattr(self, f)}")

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
                    values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
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
        return replace(cls(**values), **overrides)


# ---- what a server listens on (bootstrap, proxy) ---------------------------------------------


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
    """``token`` if clients can send it as ``Authorization: Bearer TOKEN`` (printable ASCII, no
    spaces), else SettingsError; None means no token."""
    if token is not None and (
        not isinstance(token, str) or not token or any(not "!" <= c <= "~" for c in token)
    ):
        raise SettingsError(
            f"a token must be non-empty printable ASCII without spaces, got {token!r}"
        )
    return token


MAX_STAGING_SLOTS = 4096
MIN_SLOT_BYTES = 4096  # a page: smaller segments cost more in notices than they save
MAX_SLOT_BYTES = 1 << 30
ENV_PREFIX = "KVBRIDGE_"
ENV_VARS = tuple(ENV_PREFIX + f.name.upper() for f in fields(Settings))
