"""Real SGLang servers for the SGLang backend's tests: SGLang's CPU build in the venv
scripts/sglang_env.sh builds (the tests skip, saying why, where there is none), a tiny local
model, a prefill/decode pair behind SGLang's mini load balancer, greedy ids compared with an
undisturbed server's."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import random
import re
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbridge.integrations.sglang import launch
from kvbridge.integrations.sglang.launch import Server
from kvbridge.integrations.vllm.launch import post
from sglang_hybrid_models import reference_ids

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def sglang_python() -> Path:
    """The SGLang venv's python (:func:`kvbridge.integrations.sglang.launch.sglang_python`);
    skips, with scripts/sglang_env.sh's reason, where SGLang cannot be installed here."""
    try:
        return launch.sglang_python(ROOT)
    except launch.SGLangUnavailable as e:
        pytest.skip(str(e))


# kvbridge's deadlines for servers that share two cores with other servers and, under
# pytest-xdist, with other workers' tests: a peer silent 20 s is dead (the default 3 s is a
# scheduling hiccup under that load), a transfer may take 2 minutes. The fault tests kill
# processes, which their peers on this host know two heartbeats later (the process is gone),
# not by these windows.
TOLERANT = {
    "KVBRIDGE_HEARTBEAT_MISSES": "40",
    "KVBRIDGE_TRANSFER_TIMEOUT": "120",
    "KVBRIDGE_STALL_DUMP": "20",  # a rank frozen 20 s writes every thread's stack to its log
}


# SGLang compiles a few helpers with torch.compile at a first request (a GDN model's first
# request 3.5 -> 1.0 s without): eager, they give the same ids.
EAGER = {"TORCH_COMPILE_DISABLE": "1"}


def serve(
    *args: Any, env: dict[str, str] | None = None, fork: bool = True, **kwargs: Any
) -> Server:
    """:func:`kvbridge.integrations.sglang.launch.serve` with the deadlines above, SGLang's
    processes forked (half the CPU to start: kvbridge.integrations.forked) unless ``fork`` is
    False: test_sglang_backend.py's decode spawns them, as users start SGLang."""
    return launch.serve(*args, env={**TOLERANT, **EAGER, **(env or {})}, fork=fork, **kwargs)


def serve_router(python: Path, workdir: Path, prefill: Server, decode: Server) -> Server:
    """SGLang's mini load balancer forked from the servers' fork server (its module imports
    SGLang: 9 s of CPU a router started afresh)."""
    return launch.router(python, workdir, prefill, decode, env=EAGER, fork=True)


def realtime_tokens(server: Server) -> dict[str, float]:
    """SGLang's ``realtime_tokens_total`` by mode (prefill_compute: prompt tokens the server
    computed itself; prefill_cache: prompt tokens its radix cache held; decode: tokens it
    generated), from its /metrics (``--enable-metrics``). A series appears once it is non-zero."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    pattern = r'^sglang:realtime_tokens_total\{[^}]*mode="(\w+)"[^}]*\} (\S+)$'
    out: dict[str, float] = {}
    for mode, value in re.findall(pattern, text, re.M):
        out[mode] = out.get(mode, 0.0) + float(value)
    return out


@dataclass
class Turns:
    """A TP 2 prefill (pages of 16, computing in chunks) feeding a TP 1 decode (pages of 32, its
    own radix cache on) through kvbridge behind SGLang's router, and transformers' greedy ids
    for the prompts the module sends (``reference``), a follow-up turn's included."""

    model: Path
    reference: dict[tuple[int, ...], list[int]]  # prompt -> transformers' greedy ids
    prefill: Server
    decode: Server
    router: Server
    metrics: int  # the decode's kvbridge Prometheus port
    follow_up: list[int]  # the repeated prompt, transformers' answer to it, the next turn


@contextlib.contextmanager
def tp2_to_tp1(
    tmp: Path,
    model: Path,
    chunk: int,
    prompts: Sequence[list[int]],
    repeated: list[int],
    next_turn: list[int],
    max_new: int,
) -> Iterator[Turns]:
    """:class:`Turns` of ``model``, its servers' logs under ``tmp``."""
    py = sglang_python()
    metrics = launch.free_port()
    # Both start at once (some 25 s of CPU each): the prefill's ranks on both cores, the
    # decode on core 1.
    prefill = serve(
        py,
        tmp,
        "prefill-tp2",
        model,
        mode="prefill",
        tp=2,
        page_size=16,
        core="0,1",
        args=("--chunked-prefill-size", str(chunk), "--enable-metrics"),
    )
    decode = serve(
        py,
        tmp,
        "decode-tp1",
        model,
        mode="decode",
        page_size=32,
        core="1",
        args=("--enable-metrics", "--disaggregation-decode-enable-radix-cache"),
        env={"KVBRIDGE_METRICS_PORT": str(metrics)},
    )
    fixed = [*prompts, repeated]
    with launch.killed_after(prefill, decode):
        router = serve_router(py, tmp, prefill, decode)
        with launch.killed_after(router):
            # transformers' ids while the servers start (a subprocess of the SGLang venv).
            oracle = reference_ids(py, model, fixed, max_new)
            follow_up = repeated + oracle[-1] + next_turn
            oracle += reference_ids(py, model, [follow_up], max_new)
            wait_healthy([prefill, decode, router])
            yield Turns(
                model,
                {tuple(p): ids for p, ids in zip([*fixed, follow_up], oracle, strict=True)},
                prefill,
                decode,
                router,
                metrics,
                follow_up,
            )


def answers(
    url: str, prompts: Sequence[list[int]], max_new: int, timeout: float = 300
) -> list[tuple[int, dict[str, Any]]]:
    """Every prompt at once (concurrent requests), greedy: each (status, answer)."""
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: launch.generate(url, p, max_new, timeout), prompts))


def kvbridge_bytes(metrics_port: int, direction: str = "received") -> float:
    """kvbridge's bytes ``received`` (a decode server) or ``sent`` (a prefill) so far, from the
    server's kvbridge Prometheus port (``KVBRIDGE_METRICS_PORT``)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    name = f"kvbridge_bytes_{direction}_total"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def crossed_answer(
    prefill: Server, decode: Server, a: list[int], b: list[int], max_new: int
) -> tuple[int, dict[str, Any]]:
    """One request under one room whose prefill leg carries prompt ``a`` and whose decode leg
    carries ``b`` (of ``a``'s length): the decode's (status, answer). A decode that computes no
    prompt token continues what it was sent, ``a``'s KV."""
    if prefill.bootstrap is None:
        raise ValueError(f"{prefill.name} is not a prefill server (no bootstrap port)")
    host, port = prefill.bootstrap.rsplit(":", 1)
    room = random.getrandbits(63)

    def leg(server: Server, prompt: list[int]) -> tuple[int, dict[str, Any]]:
        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True},
            "bootstrap_host": host,
            "bootstrap_port": int(port),
            "bootstrap_room": room,
        }
        return post(f"{server.url}/generate", body, 300)

    with cf.ThreadPoolExecutor(2) as ex:
        legs = [ex.submit(leg, prefill, a), ex.submit(leg, decode, b)]
        return [f.result() for f in legs][1]


def legs_of_other_prompts_fail_at_once(
    prefill: Server, decode: Server, crossed: tuple[list[int], list[int]], max_new: int
) -> None:
    """One request whose prefill leg carries prompt A and whose decode leg carries prompt B,
    of A's length, under one room (a proxy that sent the legs different prompts; SGLang keys a
    transfer by its room alone): A's KV never lands as B's. The prefill's request and the
    decode's ask have other fingerprints: both fail at once, the decode's answer saying why,
    rather than its deadline passing."""
    t0 = time.monotonic()
    status, answer = crossed_answer(prefill, decode, *crossed, max_new)
    took = time.monotonic() - t0
    assert status != 200 and "fingerprints differ" in str(answer), answer
    assert took < 60, f"the request took {took:.0f} s to fail: {answer}"


def wait_healthy(servers: Sequence[Server], timeout: float = 420) -> None:
    # A pair took 200 s to turn healthy on 2 cores shared with other test runs (load 30).
    try:
        launch.wait_healthy(servers, timeout)
    except RuntimeError as e:
        raise AssertionError(str(e)) from None


# Token-id prompts (the tiny model's vocabulary is 512; 0-3 are its special tokens), no two
# sharing a prefix: shorter than a page of 16, one page exactly, one more than two pages, and
# longer ones with a partial last page.
PROMPTS = [
    [5, 17, 42],
    list(range(10, 26)),
    [(11 * i) % 500 + 7 for i in range(33)],
    [(13 * i) % 490 + 9 for i in range(77)],
    [(7 * i) % 500 + 4 for i in range(150)],
    [(17 * i + 3) % 505 + 5 for i in range(300)],
]
