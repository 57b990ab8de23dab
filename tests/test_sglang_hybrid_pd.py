"""The seeds' own model classes through kvbridge inside real SGLang 0.5.23 servers (CPU): a
gated-delta-net hybrid of the Qwen3-Next class and a Mamba2 hybrid of the Nemotron-H class
(tests/sglang_hybrid_models.py: tiny, random, float32), each served disaggregated with
``--disaggregation-transfer-backend kvbridge`` across TP sizes that differ: the GDN hybrid's
prefill at TP 1 feeding a decode at TP 2 (each decode rank takes its half of the heads' state),
the Mamba2 hybrid's prefill at TP 2 feeding a decode at TP 1 (the decode gathers both halves,
its conv state sharded per segment). The Mamba state (conv and temporal of every
linear-attention layer) crosses TP sizes that differ: seed 001's deployment. One direction a
model: each server costs some 25 s of CPU to start on this 2-core host, and the planner's
byte grid runs both directions of both models on SGLang's real pools
(test_sglang_real_pools.py).

The oracle is transformers' own greedy decoding of the same checkpoint (float32, its pure-torch
GDN and Mamba2 functions: independent of SGLang, of its stand-in kernels and of kvbridge); the
decode server must compute no prompt token itself (SGLang's ``prefill_compute`` counter), so
every token it generates continues the KV and state kvbridge moved. The negative control: the
prefill's kvbridge switched to land every byte 4 bytes off changes the outputs.

SGLang's CPU path has no kernels for these models: the SGLang venv's test-only stand-ins
compute them (tests/sglang_standins/, checked kernel by kernel in test_sglang_standins.py).
The Qwen3-Next servers keep their conv state in float32 (SGLang's default bf16 rounds the conv
window between steps where transformers does not: two late tokens flip on this model); the
Nemotron-H servers keep SGLang's bf16 conv state beside float32 SSM state, so a state of each
width is moved. The tests skip, saying why, where SGLang cannot be installed.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fault_switch import FaultSwitch
from kvbridge.integrations.sglang import launch
from kvbridge.integrations.sglang.launch import Server
from sglang_hybrid_models import ARCHS, HYBRID_ARGS, reference_ids
from sglang_servers import PROMPTS, realtime_tokens, serve, sglang_python, wait_healthy

pytestmark = pytest.mark.slow  # real SGLang servers: two or three a model, a minute to start

MAX_NEW = 12
ENV = {"qwen3_next": {"SGLANG_MAMBA_CONV_DTYPE": "float32"}, "nemotron_h": {}}
# The TP sizes of each model's prefill and decode.
PAIR = {"qwen3_next": (1, 2), "nemotron_h": (2, 1)}
# The fault controls run on one model, the one whose state has two widths (bf16 conv, float32
# SSM). Their tests come last in this module, so that pytest starts each model's servers once.
CONTROLLED = "nemotron_h"


@dataclass
class Hybrid:
    arch: str
    reference: list[list[int]]  # transformers' greedy ids of each prompt
    prefill: Server
    decode: Server
    faults: FaultSwitch  # the prefill's kvbridge faults
    # CONTROLLED only: a TP 1 prefill whose process exits right after its first write is posted.
    dying: Server | None


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    sglang_models: dict[str, Path],
) -> Iterator[Hybrid]:
    arch = str(request.param)
    py = sglang_python()
    tmp = tmp_path_factory.mktemp(f"sglang-pd-{arch}")
    model = sglang_models[arch]
    env = ENV[arch]

    def server(
        name: str, mode: launch.Mode, tp: int, faults: dict[str, str], chunk: int = 64
    ) -> Server:
        # The prefill in chunks of 64: SGLang sends each chunk, the state indices with the last.
        extra = (
            ("--enable-metrics",) if mode == "decode" else ("--chunked-prefill-size", str(chunk))
        )
        # A TP rank a core; a TP 1 prefill on core 0, a TP 1 decode on core 1.
        core = "0,1" if tp == 2 else "0" if mode == "prefill" else "1"
        return serve(
            py,
            tmp,
            name,
            model,
            mode=mode,
            tp=tp,
            page_size=16,
            core=core,
            args=[*HYBRID_ARGS, *extra],
            env={**env, **faults},
        )

    p, d = PAIR[arch]
    switch = FaultSwitch(tmp / "prefill.faults")
    servers = [
        server(f"prefill-tp{p}", "prefill", p, switch.env),
        server(f"decode-tp{d}", "decode", d, {}),
    ]
    if arch == CONTROLLED:
        # Unchunked: its one send carries the KV and the Mamba state together.
        servers.append(
            server("dying-tp1", "prefill", 1, {"KVBRIDGE_FAULTS": "exit_after_post=1"}, chunk=4096)
        )
    with launch.killed_after(*servers):
        wait_healthy(servers)
        yield Hybrid(
            arch,
            reference_ids(py, model, PROMPTS, MAX_NEW),
            servers[0],
            servers[1],
            switch,
            servers[2] if arch == CONTROLLED else None,
        )


def ids_through(prefill: Server, decode: Server) -> list[tuple[int, dict[str, Any]]]:
    """Every prompt at once, both legs of each as SGLang's router sends them."""
    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
        return list(ex.map(lambda p: launch.generate_pd(prefill, decode, p, MAX_NEW, 300), PROMPTS))


def test_hybrid_state_crosses_tp_sizes_token_exact(hybrid: Hybrid) -> None:
    """Concurrent prompts of 3 to 300 tokens (pages of 16, the Mamba state of each request in a
    slot of its own): exactly transformers' greedy ids, the decode computing no prompt token."""
    before = realtime_tokens(hybrid.decode)
    got = ids_through(hybrid.prefill, hybrid.decode)
    for i, (status, answer) in enumerate(got):
        where = f"{hybrid.arch} prompt {i}"
        assert status == 200, f"{where}: {answer}\n(logs: {hybrid.decode.log})"
        assert launch.output_ids(answer) == hybrid.reference[i], where
    after = realtime_tokens(hybrid.decode)
    # Its counters move (it generated), but not for prompt tokens: every prompt came by kvbridge.
    assert after.get("decode", 0) > before.get("decode", 0), (before, after)
    assert after.get("prefill_compute", 0) == before.get("prefill_compute", 0), (before, after)


@pytest.mark.parametrize("hybrid", [CONTROLLED], indirect=True)
def test_shifted_bytes_change_the_outputs(hybrid: Hybrid) -> None:
    """The negative control: the prefill's kvbridge landing every byte (KV and state) 4 bytes
    off gives other tokens, or an error naming the room where the metadata lands off."""
    with hybrid.faults.on("shift_bytes=4"):
        got = ids_through(hybrid.prefill, hybrid.decode)
    changed = [
        i
        for i, (status, answer) in enumerate(got)
        if (status == 200 and launch.output_ids(answer) != hybrid.reference[i])
        or (status != 200 and "integrity" in str(answer))
    ]
    assert len(changed) >= len(PROMPTS) - 1, got


def held(server: Server) -> dict[str, int]:
    """What a server holds of requests: running, queued, KV slots in use."""
    loads = launch.loads(server)
    queues = {k: v for k, v in loads["disaggregation"].items() if k.endswith("_reqs")}
    return {"running": loads["num_running_reqs"], "tokens": loads["num_used_tokens"], **queues}


@pytest.mark.parametrize("hybrid", [CONTROLLED], indirect=True)
def test_a_prefill_killed_with_the_state_in_flight_ends_the_request(hybrid: Hybrid) -> None:
    """A prefill server that exits right after posting the write of a request's KV and Mamba
    state: the decode server ends that request with kvbridge's reason two heartbeats after
    (its process is gone: not the 20 s heartbeat window these servers have), holds nothing of
    it afterwards (no request running or queued, as many KV slots in use as before: SGLang
    frees a request's Mamba slot with its KV, and reports no count of its own for it), and
    serves the next requests exactly."""
    prefill, decode = hybrid.prefill, hybrid.decode  # a TP 1 decode: its one rank names the reason
    assert hybrid.dying is not None
    before = held(decode)
    t0 = time.monotonic()
    status, answer = launch.generate_pd(hybrid.dying, decode, PROMPTS[4], MAX_NEW, 120)
    took = time.monotonic() - t0
    assert status != 200 and "peer_dead" in str(answer) and "exited" in str(answer), answer
    assert took < 60, f"the failed request took {took:.0f} s"
    end = time.monotonic() + 60
    while (after := held(decode)) != before and time.monotonic() < end:
        time.sleep(1)
    assert after == before, (before, after)
    got = [launch.generate_pd(prefill, decode, p, MAX_NEW, 300) for p in PROMPTS[:3]]
    assert [launch.output_ids(a) for _, a in got] == hybrid.reference[:3]
