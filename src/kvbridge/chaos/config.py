"""What a chaos soak (:mod:`.soak`) is asked to do: the fault kinds, the model and the
deployment's shapes, the number of requests and their deadlines, each checked when given.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kvbridge.config import SettingsError
from kvbridge.model.spec import CacheSpec, DType, attention_layer, mamba2_layer


class Fault(enum.Enum):
    NONE = "none"
    KILL_PREFILL = "kill -9 prefill"
    KILL_DECODE = "kill -9 decode"
    STALL = "SIGSTOP/SIGCONT"
    STALL_MID_WRITE = "SIGSTOP right after a post"
    STALL_BEFORE_WRITE = "SIGSTOP right before a post"
    DROP_NOTICE = "dropped notice"
    DUP_NOTICES = "duplicated notices"
    REORDER_NOTICES = "reordered notices"
    FORGED = "forged messages"
    SLOW_PEER = "slow peer"
    BOOTSTRAP_RESTART = "bootstrap service killed and restarted"
    # Between hosts only (``hosts``): on a host's link, for one round.
    PARTITION = "partition of a host"
    LOSS = "1% packet loss"
    DELAY = "5 ms delay"


NETWORK_FAULTS = (Fault.PARTITION, Fault.LOSS, Fault.DELAY)
TRANSPORTS = ("shm", "tcp", "mooncake")


TOKEN = "chaos-token"
# ChaosConfig's integers: past these a soak would take days (requests) or its pools, sized for
# 4 x round requests of ``tokens`` each, would not fit a host (round, tokens).
BOUNDS = {
    "requests": (1, 1_000_000),
    "round": (1, 1024),
    "tokens": (1, 4096),
    "seed": (0, 2**64 - 1),
}
# A hybrid: attention (per token), Mamba2 (state), aux; KV heads split unevenly across sides.
SPEC = CacheSpec(
    "chaos",
    (
        attention_layer(4, 16, DType.BFLOAT16),
        mamba2_layer(8, 4, 2, 4, 4, conv_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32),
        attention_layer(4, 16, DType.BFLOAT16),
    ),
)


@dataclass(frozen=True)
class ChaosConfig:
    requests: int = 300
    round: int = 10
    seed: int = 0
    transport: str = "shm"
    prefill: str = "tp=2,page=4"
    decode: str = "tp=4,page=8"
    tokens: int = 40
    faults: tuple[Fault, ...] = ()  # (): every kind that applies
    heartbeat_interval: float = 0.1
    heartbeat_misses: int = 5
    deadline: float = 4.0  # waiting and transfer deadlines
    abort_timeout: float = 1.0
    # The negative control: decode ranks reuse a failed request's slot without waiting for
    # ``released``. A stalled writer then lands bytes in reused slots, which the soak reports.
    eager_reuse: bool = False
    # The bootstrap service, the prefill ranks and the decode ranks each on a host of their
    # own (network namespaces: kvbridge.deploy.netns), the link's faults among the kinds.
    hosts: bool = False

    def __post_init__(self) -> None:
        for name, (lo, hi) in BOUNDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise SettingsError(f"{name} must be in [{lo}, {hi}], got {value!r}")
        if self.transport not in TRANSPORTS:
            raise SettingsError(
                f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        if self.hosts and self.transport == "shm":
            raise SettingsError(
                "shm moves memory within one host: between hosts use tcp or mooncake"
            )
        if not all(isinstance(f, Fault) for f in self.faults):
            raise SettingsError(f"faults must be Faults, got {self.faults!r}")
        applicable = tuple(f for f in Fault if self.hosts or f not in NETWORK_FAULTS)
        if not self.faults:
            object.__setattr__(self, "faults", applicable)
        elif not set(self.faults) <= set(applicable):
            wrong = ", ".join(f.name.lower() for f in self.faults if f not in applicable)
            raise SettingsError(f"faults {wrong} act on links between hosts: they need hosts")

    @property
    def settings(self) -> dict[str, Any]:
        return {
            "bootstrap_timeout": self.deadline,
            "waiting_timeout": self.deadline,
            "transfer_timeout": self.deadline,
            "abort_timeout": self.abort_timeout,
            "heartbeat_interval": self.heartbeat_interval,
            "heartbeat_misses": self.heartbeat_misses,
            "token": TOKEN,
            "integrity": True,
        }

    @property
    def bound(self) -> float:
        """The longest a request may take to end where its rank was never paused: every
        state's deadline, and the time to declare a peer dead, with a second of slack for
        this shared host."""
        return 3 * self.deadline + self.heartbeat_interval * self.heartbeat_misses + 1.0

    def bound_for(self, paused: float) -> float:
        """The longest for a request whose rank saw itself paused ``paused`` seconds in all:
        the pauses move its deadlines back, each state's at most as far again as its own
        timeout (kvbridge.runtime.status.RequestStatus.extend)."""
        return self.bound + min(paused, 3 * self.deadline)

    @property
    def longest_bound(self) -> float:
        return self.bound_for(float("inf"))
