"""kvbridge between vLLM servers of different tensor parallelism: a prefill at TP 2 (each rank
holding one of the tiny model's two KV heads) and a decode at TP 1, both legs at once with every
layer streamed, against the decode server run undisturbed; the decode's blocks (32 tokens) are
smaller than the prefill's (64). vLLM's NixlConnector needs the decode TP to be a multiple of
the prefill's, and equal block sizes.

On this 2-core host the prefill's two workers take a core each, the decode runs unbound, and
OpenMP threads wait passively: bound to a core a prefill worker spins on, the decode engine
starved the prefill (a 4-token prompt took 63 s), and with spinning waits the decode's
heartbeats fell silent for 10 s. One leg after the other runs the same planner and transport
path (and has its own test at TP 1); both legs at once adds streaming.

The decode's connector is vLLM's MultiConnector holding kvbridge (vLLM's OffloadingConnector,
the other half of the composition the issue asks for, refuses vLLM's CPU build at start-up:
"CPU Offloading is currently only supported on CUDA-alike and XPU GPUs").

The same deployment (one KV cache group: vLLM reports a failed load's blocks per block only
then) serves the prefix-cache tests: a decode that holds a prompt's first blocks loads only the
tokens past them, and a failed load reports only its own blocks, never the shared ones. The
references run on the decode server undisturbed, under a ``cache_salt`` of their own, so that
they share no cached block with what kvbridge loaded.

Across hosts, where network namespaces can be made (kvbridge.deploy.netns; on loopback
otherwise, saying so): the prefill server, the decode server and the proxy each on a host of
its own with its own address (``--host``, ``KVBRIDGE_HOST``, the bootstrap service on the
prefill's address), the test reaching them over the same switch. This is the README's vLLM
deployment across hosts.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import secrets
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.deploy.netns import Network, unavailable
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


MULTI = json.dumps(
    {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "KVBridgeConnector", "kv_role": "kv_consumer"}]
        },
    }
)


@pytest.fixture(scope="module")
def network() -> Iterator[Network | None]:
    """Three hosts on a switch this process joins; None (loopback) where there can be none."""
    reason = unavailable()
    if reason:
        warnings.warn(f"vLLM TP servers on loopback, not across hosts: {reason}", stacklevel=1)
        yield None
        return
    with Network(["prefill", "decode", "proxy"], join=True) as net:
        yield net


@pytest.fixture(scope="module")
def servers(
    vllm_models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    network: Network | None,
) -> Iterator[tuple[Path, list[Server]]]:
    host = (lambda name: network[name]) if network else (lambda name: None)
    tmp = tmp_path_factory.mktemp("vllm-tp")
    model = vllm_models["tiny-llama"]
    # OpenMP threads that wait passively: the prefill's two workers otherwise spin on both
    # cores and starve the decode engine (its heartbeats were seen silent 10 s).
    # In full-suite runs (twice) the decode process froze for about 30 s at the start of a
    # request (its engine step, and its heartbeats, with it: vLLM's and kvbridge's threads
    # starved on this 2-core host after ten minutes of tests): with the suite's 10 s heartbeat
    # window and 30 s waiting deadline, the prefill declared it dead. Since then freezes of
    # 15-25 s, and on 2026-11-27 one of 40.8 s (the engine core's every thread, kvbridge's
    # included, in eager mode: no compilation; the cause is not known) against a 40 s window.
    # This module has no fault test: its deployment tolerates a freeze of two minutes.
    passive = {
        "OMP_WAIT_POLICY": "PASSIVE",
        "KVBRIDGE_HEARTBEAT_MISSES": "240",
        "KVBRIDGE_WAITING_TIMEOUT": "180",
        "KVBRIDGE_TRANSFER_TIMEOUT": "180",
    }
    pre = serve(
        tmp,
        model,
        "prefill-tp2",
        64,
        "kv_producer",
        args=["-tp", "2"],
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", **passive},
        host=host("prefill"),
    )
    # The decode's connector is vLLM's MultiConnector holding kvbridge, named (registered by
    # kvbridge's vLLM plugin) rather than loaded by module path: kvbridge composes with vLLM's
    # other connectors (its statistics are rebuilt by name in vLLM's front-end).
    dec = serve(
        tmp,
        model,
        "decode-tp1",
        32,
        None,
        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", **passive},
        args=["--kv-transfer-config", MULTI],
        host=host("decode"),
    )
    assert pre.bootstrap is not None
    proxy = start(
        tmp,
        "proxy-at-once",
        ["proxy", "--prefill", pre.url, "--decode", dec.url, "--prefill-bootstrap", pre.bootstrap],
        host=host("proxy"),
    )
    every = [pre, dec, proxy]
    try:
        wait_healthy(every)
        yield model, every
    finally:
        for s in every:
            s.kill()


def test_prefill_tp2_to_decode_tp1_streamed_is_token_exact(
    servers: tuple[Path, list[Server]], network: Network | None
) -> None:
    """Across hosts, where there are: every byte kvbridge loaded crossed the decode host's
    link (the decode server logs each load's bytes)."""
    model, (pre, dec, proxy) = servers
    prompts = [[(p + 3) % 500 + 4 for p in prompt] for prompt in PROMPTS]
    want = [complete(dec.url, model, p) for p in prompts]  # undisturbed, TP 1
    before = network.traffic("decode") if network else 0
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(proxy.url, model, p), prompts))
    for prompt, (status, answer), (_, ref) in zip(prompts, got, want, strict=True):
        assert status == 200, f"{answer}\n{kvbridge_lines(pre, dec)}"
        assert generated(answer)[0] == generated(ref)[0], len(prompt)
        assert generated(answer)[1] == pytest.approx(generated(ref)[1], abs=1e-4), len(prompt)
    log = pre.log.read_text(errors="replace")
    assert "prefill rank 0:" in log and "prefill rank 1:" in log  # two ranks registered
    if network:
        moved = sum(b for *_, b in loads(dec))
        assert moved > 0 and network.traffic("decode") - before >= moved, moved


LOADED = re.compile(r"loaded tokens \[(\d+), (\d+)\) of room (\d+): (\d+) bytes")


def loads(dec: Server) -> list[tuple[int, int, int, int]]:
    """(start, stop, room, bytes) of every load the decode server completed."""
    return [
        tuple(map(int, m.groups()))
        for m in LOADED.finditer(  # type: ignore[misc]
            dec.log.read_text(errors="replace")
        )
    ]


def reference(dec: Server, model: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The decode server's own answer, computed from scratch (a cache salt of its own)."""
    status, answer = complete(dec.url, model, prompt, cache_salt=secrets.token_hex(8))
    assert status == 200, answer
    return generated(answer)


def same(answer: dict[str, Any], want: tuple[list[int], list[float]]) -> None:
    assert generated(answer)[0] == want[0]
    assert generated(answer)[1] == pytest.approx(want[1], abs=1e-4)


def test_a_decode_prefix_hit_loads_only_the_tokens_past_it_token_exact(
    servers: tuple[Path, list[Server]],
) -> None:
    """A second prompt sharing 140 tokens with a first: the decode holds the first 4 blocks
    (128 tokens) and kvbridge moves only tokens [128, 166); the prefill, holding 2 blocks of
    64, computes only the rest but sends every token the decode asks for."""
    model, (pre, dec, proxy) = servers
    first = [(11 * i) % 480 + 7 for i in range(151)]
    second = first[:140] + [(5 * i) % 300 + 100 for i in range(26)]
    want = [reference(dec, model, p) for p in (first, second)]
    for prompt, ref in zip((first, second), want, strict=True):
        status, answer = complete(proxy.url, model, prompt)
        assert status == 200, f"{answer}\n{kvbridge_lines(pre, dec)}"
        same(answer, ref)
    whole = [ld for ld in loads(dec) if ld[1] == 151]
    part = [ld for ld in loads(dec) if ld[1] == 166]
    assert len(whole) == 1 and whole[0][0] == 0, loads(dec)
    assert len(part) == 1 and part[0][0] == 128, loads(dec)
    # 38 of 166 tokens: the bytes (and the aux slot) of those alone, not the prompt's.
    assert part[0][3] < whole[0][3] * 38 / 151 + 1024, (part, whole)


def wait_logged(server: Server, needles: list[str], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = server.log.read_text(errors="replace")
        if all(n in text for n in needles):
            return
        time.sleep(0.1)
    raise AssertionError(f"not logged within {timeout} s: {needles}\n{kvbridge_lines(server)}")


def test_a_failed_load_leaves_the_requests_sharing_its_prefix_token_exact(
    servers: tuple[Path, list[Server]],
) -> None:
    """Three requests share a 130-token prefix the decode holds (4 blocks), each waiting for
    its KV (the decode legs sent first, as the at-once proxy does). One fails: its prefill leg
    holds a token more than its decode leg. vLLM is told only that request's own blocks: had
    it been told the shared ones, it would fail every request holding them. The other two
    then load, token-exact."""
    model, (pre, dec, proxy) = servers
    prefix = [(17 * i) % 470 + 11 for i in range(130)]
    tails = [[(t * 31 + 7 * i) % 400 + 50 for i in range(30)] for t in range(3)]
    prompts = [prefix + tail for tail in tails]
    want = [reference(dec, model, p) for p in prompts[:2]]
    status, answer = complete(proxy.url, model, prefix + [3, 5, 9])  # the decode caches it
    assert status == 200, answer
    rooms = [secrets.randbits(62) for _ in prompts]
    with cf.ThreadPoolExecutor(3) as pool:
        legs = [
            pool.submit(
                complete,
                dec.url,
                model,
                p,
                kv_transfer_params={
                    "do_remote_prefill": True,
                    "kvbridge": {"bootstrap": pre.bootstrap, "room": room},
                },
            )
            for p, room in zip(prompts, rooms, strict=True)
        ]
        wait_logged(dec, [f"receiving room {room} " for room in rooms])
        loaded = [f"of room {room}:" for room in rooms[:2]]
        assert not any(n in dec.log.read_text(errors="replace") for n in loaded)

        def prefill_leg(prompt: list[int], room: int) -> tuple[int, dict[str, Any]]:
            return post(
                f"{pre.url}/v1/completions",
                {
                    "model": str(model),
                    "prompt": prompt,
                    "max_tokens": 1,
                    "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": True, "kvbridge": {"room": room}},
                },
            )

        status, answer = prefill_leg(prompts[2] + [1], rooms[2])  # a token more: refused
        assert status == 200, answer
        status, failed = legs[2].result(timeout=120)
        assert status == 500, failed  # vLLM's kv_load_failure_policy "fail"
        for prompt, room in zip(prompts[:2], rooms[:2], strict=True):
            status, answer = prefill_leg(prompt, room)
            assert status == 200, answer
        for leg, ref in zip(legs[:2], want, strict=True):
            status, answer = leg.result(timeout=120)
            assert status == 200, f"{answer}\n{kvbridge_lines(pre, dec)}"
            same(answer, ref)
    starts = {room: a for a, _, room, _ in loads(dec)}
    assert starts.get(rooms[0]) == starts.get(rooms[1]) == 128, loads(dec)


def test_both_servers_metrics_and_logs_show_kvbridges_transfers(
    servers: tuple[Path, list[Server]],
) -> None:
    """vLLM's /metrics on each server carries kvbridge's counters (through vLLM's connector
    stats), and one request's trace id is in both servers' logs."""
    model, (pre, dec, proxy) = servers
    prompt = [(19 * i) % 460 + 13 for i in range(90)]
    status, answer = complete(proxy.url, model, prompt)
    assert status == 200, answer
    want = {pre.url: "kvbridge_bytes_sent_total", dec.url: "kvbridge_bytes_received_total"}
    end = time.monotonic() + 60
    while want and time.monotonic() < end:  # vLLM ships stats on its next steps
        for url, name in list(want.items()):
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
                text = r.read().decode()
            counts = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(name + "{")
            ]
            if sum(counts) > 0:
                del want[url]
        if want:
            complete(proxy.url, model, prompt[:40])  # steps that carry the stats on
            time.sleep(0.5)
    assert not want, f"no {list(want.values())} in /metrics"
    (room,) = {r for a, b, r, _ in loads(dec) if b == 90}
    tag = f'"trace": "{room:016x}"'
    for server in (pre, dec):
        assert tag in server.log.read_text(errors="replace"), server.name


def test_a_streamed_answer_through_both_legs_at_once_is_relayed_token_by_token(
    servers: tuple[Path, list[Server]],
) -> None:
    """The at-once proxy relays the decode server's stream from its first token (not after the
    prefill server's own answer), and the streamed text is the undisturbed one."""
    model, (pre, dec, proxy) = servers
    prompt = [(23 * i) % 450 + 17 for i in range(120)]
    ref = reference(dec, model, prompt)
    body = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        f"{proxy.url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    events, done = [], False
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers.get_content_type() == "text/event-stream", r.headers
        for raw in r:
            line = raw.decode().strip()
            done = done or line == "data: [DONE]"
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert not [e for e in events if "error" in e], events
    tokens = [t for e in events for c in e.get("choices", []) for t in (c.get("token_ids") or [])]
    assert tokens == ref[0], (tokens, ref[0])
    # A stream, not one answer: completion chunks, then [DONE]. How many tokens a chunk holds
    # is the decode server's: a loaded one merges what its API server has not taken yet (CI
    # once saw all 12 in one chunk), so the count of chunks proves nothing either way.
    assert done and events and all(e.get("object") == "text_completion" for e in events), events
