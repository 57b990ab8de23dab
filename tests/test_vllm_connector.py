"""kvbridge inside vLLM: real ``vllm serve`` processes (vLLM's CPU build, in the venv
scripts/vllm_env.sh builds) with kvbridge's connector, behind ``kvbridge proxy``, compared with
an undisturbed vLLM instance on the same prompts: same tokens, same logprobs.

The model is a tiny Llama whose first layer attends a sliding window of 48 tokens
(``layer_types``): vLLM keeps that layer in a KV cache group of its own, and the two longer
prompts (77 and 150 tokens) reach beyond the window, where only its last 48 tokens travel.

Servers: a prefill (kv_producer, block 32; requests without kv_transfer_params run on it
undisturbed, the reference), a decode (kv_consumer, block 64: NixlConnector refuses a decode
block size other than prefill's). The negative controls switch the prefill's kvbridge to
shift every destination byte (``KVBRIDGE_FAULTS=@PATH``: the decode output must differ), and
the last fault test kills the prefill with a request's KV in flight.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fault_switch import FaultSwitch
from vllm_servers import (
    PROMPTS,
    Server,
    complete,
    generated,
    kvbridge_lines,
    post,
    serve,
    start,
    wait_healthy,
)

# Real vLLM servers, started for this module (about a minute on a 2-core host).
pytestmark = pytest.mark.slow


@dataclass
class Deployment:
    model: Path
    prefill: Server  # also the reference: requests without kv_transfer_params run undisturbed
    decode: Server
    proxy: Server  # the prefill leg, then the decode leg with the prefill's answer
    at_once: Server  # both legs at once (--prefill-bootstrap): the prefill streams each layer
    faults: FaultSwitch  # the prefill's kvbridge shifts destination bytes inside faults.on()


@pytest.fixture(scope="module")
def model(vllm_models: dict[str, Path]) -> Path:
    return vllm_models["tiny-llama-swa"]


@pytest.fixture(scope="module")
def deployment(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("vllm")
    # Block 64 on decode, 32 on prefill: NixlConnector refuses a decode block size other
    # than prefill's.
    switch = FaultSwitch(tmp / "prefill.faults")
    # The decode spawned, as vLLM's CPU platform starts its processes for users: a spawned
    # worker loads kvbridge's plugin itself (the suite's other vLLM servers fork theirs, which
    # inherit it loaded: tests/vllm_servers.py).
    pre = serve(tmp, model, "prefill", 32, "kv_producer", env=switch.env)
    dec = serve(tmp, model, "decode", 64, "kv_consumer", fork=False)
    prx = start(tmp, "proxy", ["proxy", "--prefill", pre.url, "--decode", dec.url])
    assert pre.bootstrap is not None
    now = start(
        tmp,
        "proxy-at-once",
        ["proxy", "--prefill", pre.url, "--decode", dec.url, "--prefill-bootstrap", pre.bootstrap],
    )
    try:
        wait_healthy([pre, dec, prx, now])
        yield Deployment(model, pre, dec, prx, now, switch)
    finally:
        for s in (pre, dec, prx, now):
            s.kill()


def prefill_leg(d: Deployment, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of a request, as the proxy sends it (one token, ``params`` as its
    kv_transfer_params): the prefill's answer."""
    status, first = post(
        f"{d.prefill.url}/v1/completions",
        {
            "model": str(d.model),
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": params,
        },
    )
    assert status == 200, first
    return first


def test_disaggregated_serving_is_token_exact_and_logprob_exact(deployment: Deployment) -> None:
    d = deployment
    want = [complete(d.prefill.url, d.model, p) for p in PROMPTS]  # undisturbed, one instance
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent requests
        disagg = list(pool.map(lambda p: complete(d.proxy.url, d.model, p), PROMPTS))
    for prompt, (status, got), (_, ref) in zip(PROMPTS, disagg, want, strict=True):
        assert status == 200, f"{got}\n{kvbridge_lines(d.prefill, d.decode)}"
        tokens, logprobs = generated(got)
        want_tokens, want_logprobs = generated(ref)
        assert tokens == want_tokens, (len(prompt), tokens, want_tokens)
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4), len(prompt)
    # The sliding-window layer was a KV cache group of its own on both sides.
    for server in (d.prefill, d.decode):
        assert "2 tensors in 2 groups" in server.log.read_text(errors="replace"), server.name


def test_both_legs_at_once_stream_every_layer_token_exact(deployment: Deployment) -> None:
    """The proxy sends the prefill and decode legs together: the decode blocks wait before the
    prefill's forward ends, and each layer goes as vLLM's forward computes it (save_kv_layer)."""
    d = deployment
    # Fresh prompts: the decode instance caches what it loaded before.
    prompts = [[(p + 5) % 500 + 4 for p in prompt] for prompt in PROMPTS]
    want = [complete(d.prefill.url, d.model, p) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        disagg = list(pool.map(lambda p: complete(d.at_once.url, d.model, p), prompts))
    for prompt, (status, got), (_, ref) in zip(prompts, disagg, want, strict=True):
        assert status == 200, f"{got}\n{kvbridge_lines(d.prefill, d.decode)}"
        assert generated(got)[0] == generated(ref)[0], len(prompt)
        assert generated(got)[1] == pytest.approx(generated(ref)[1], abs=1e-4), len(prompt)
    # Each went layer by layer (the whole prompt in one step, one token asked): none was
    # pushed whole after its forward.
    streamed = d.prefill.log.read_text(errors="replace").count("layer by layer")
    assert streamed >= len(prompts), kvbridge_lines(d.prefill)


def test_the_kv_really_travels_a_shifted_transfer_changes_the_output(
    deployment: Deployment,
) -> None:
    d = deployment
    # Fresh prompts: the decode instance caches what it loaded, and must not hit it here.
    prompts = [[(p + 3) % 500 + 4 for p in prompt] for prompt in PROMPTS[1:]]
    want = [generated(complete(d.prefill.url, d.model, p)[1]) for p in prompts]
    changed = 0
    with d.faults.on("shift_bytes=4"):
        for prompt, ref in zip(prompts, want, strict=True):
            first = prefill_leg(d, prompt, {"do_remote_decode": True})
            status, got = complete(
                d.decode.url, d.model, prompt, kv_transfer_params=first["kv_transfer_params"]
            )
            assert status == 200, f"{got}\n{kvbridge_lines(d.prefill, d.decode)}"
            changed += generated(got) != ref
    assert changed >= 2, "the decode output did not depend on the bytes kvbridge moved"


def test_the_kv_really_streams_a_shifted_layer_wise_transfer_changes_the_output(
    deployment: Deployment,
) -> None:
    """Both legs at once, as `kvbridge proxy --prefill-bootstrap` sends them, to the prefill
    whose kvbridge shifts every destination byte."""
    d = deployment
    prompts = [[(p + 7) % 500 + 4 for p in prompt] for prompt in PROMPTS[1:]]
    want = [generated(complete(d.prefill.url, d.model, p)[1]) for p in prompts]
    streamed = d.prefill.log.read_text(errors="replace").count("layer by layer")
    changed = 0
    with d.faults.on("shift_bytes=4"):
        for i, (prompt, ref) in enumerate(zip(prompts, want, strict=True)):
            room = 1000 + i
            waiting = {
                "do_remote_prefill": True,
                "kvbridge": {"bootstrap": d.prefill.bootstrap, "room": room},
            }
            with cf.ThreadPoolExecutor(2) as pool:
                second = pool.submit(
                    complete, d.decode.url, d.model, prompt, kv_transfer_params=waiting
                )
                prefill_leg(d, prompt, {"do_remote_decode": True, "kvbridge": {"room": room}})
                status, got = second.result()
            assert status == 200, f"{got}\n{kvbridge_lines(d.prefill, d.decode)}"
            changed += generated(got) != ref
    assert changed >= 2, "the decode output did not depend on the bytes kvbridge streamed"
    now = d.prefill.log.read_text(errors="replace").count("layer by layer")
    assert now - streamed >= len(prompts)


def test_the_proxy_refuses_what_is_not_a_completion_request(deployment: Deployment) -> None:
    status, got = post(f"{deployment.proxy.url}/v1/completions", ["not", "an", "object"])
    assert status == 400 and "JSON object" in got["error"]["message"]


def test_a_prefill_killed_with_the_kv_in_flight_ends_the_request_and_decode_serves_on(
    deployment: Deployment,
) -> None:
    """Last: it kills the module's prefill."""
    d = deployment
    prompt = [(p + 11) % 500 + 4 for p in PROMPTS[2]]
    want = generated(complete(d.prefill.url, d.model, PROMPTS[0])[1])[0]
    first = prefill_leg(d, prompt, {"do_remote_decode": True})
    assert first.get("kv_transfer_params"), first
    d.prefill.kill()  # its blocks and its bootstrap service are gone
    t0 = time.monotonic()
    status, answer = complete(
        d.decode.url, d.model, prompt, kv_transfer_params=first["kv_transfer_params"]
    )
    took = time.monotonic() - t0
    # vLLM's default kv_load_failure_policy is "fail": the client gets an error, not a hang,
    # within kvbridge's bootstrap deadline (30 s here).
    assert status == 500, answer
    assert took < 60, took
    assert "KV load failed" in d.decode.log.read_text(errors="replace")
    # The decode server serves the next request (computed on it: the prefill is gone), exactly.
    status, got = complete(d.decode.url, d.model, PROMPTS[0])
    assert status == 200, got
    assert generated(got)[0] == want


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
