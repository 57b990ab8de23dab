"""Small models and settings for the multi-process runtime tests."""

from __future__ import annotations

from kvbridge.deploy.cluster import Job
from kvbridge.model.spec import (
    CacheSpec,
    DType,
    attention_layer,
    gdn_layer,
    mamba2_layer,
    mla_layer,
)
from kvbridge.planner.sidespec import SideOptions

BF16, F32 = DType.BFLOAT16, DType.FLOAT32
DENSE8 = CacheSpec("dense8", tuple(attention_layer(8, 8, BF16) for _ in range(4)))
DENSE6 = CacheSpec("dense6", tuple(attention_layer(6, 8, BF16) for _ in range(4)))
MLA = CacheSpec("mla", tuple(mla_layer(16, 4, BF16) for _ in range(4)))
MAMBA2 = CacheSpec(
    "mamba2",
    (
        attention_layer(2, 8, BF16),
        mamba2_layer(8, 4, 2, 4, 4, conv_dtype=BF16, ssm_dtype=F32),
        mamba2_layer(8, 4, 2, 4, 4, conv_dtype=BF16, ssm_dtype=F32),
    ),
)
GDN = CacheSpec(
    "gdn",
    (
        gdn_layer(2, 4, 4, 4, 4, conv_dtype=BF16, state_dtype=F32),
        gdn_layer(2, 4, 4, 4, 4, conv_dtype=BF16, state_dtype=F32),
        attention_layer(2, 8, BF16),
    ),
)
SWA = CacheSpec(
    "swa",
    (
        attention_layer(4, 8, BF16, window=16),
        attention_layer(4, 8, BF16),
        attention_layer(4, 8, BF16, window=16),
    ),
)

FAST = {
    "bootstrap_timeout": 15.0,
    "waiting_timeout": 15.0,
    "transfer_timeout": 15.0,
    "abort_timeout": 3.0,
    "heartbeat_interval": 0.2,
    "heartbeat_misses": 5,
}


def job(spec: CacheSpec, prefill: str, decode: str, transport: str, **kw: object) -> Job:
    settings = {**FAST, **kw.pop("settings", {})}  # type: ignore[dict-item]
    return Job(
        spec,
        SideOptions.parse(prefill),
        SideOptions.parse(decode),
        transport=transport,
        prefill_settings={**settings, **kw.pop("prefill_settings", {})},  # type: ignore[dict-item]
        decode_settings={**settings, **kw.pop("decode_settings", {})},  # type: ignore[dict-item]
        **kw,
    )  # type: ignore[arg-type]
