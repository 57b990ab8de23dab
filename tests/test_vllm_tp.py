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
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_servers import (
    PROMPTS,
    Server,
    complete,
    generated,
    kvbridge_lines,
    make_model,
    require_vllm,
    serve,
    start,
    wait_healthy,
)

require_vllm()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[Server]]]:
    tmp = tmp_path_factory.mktemp("vllm-tp")
    model = make_model(tmp / "tiny-llama")
    # OpenMP threads that wait passively: the prefill's two workers otherwise spin on both
    # cores and starve the decode engine (its heartbeats were seen silent 10 s).
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    pre = serve(tmp, model, "prefill-tp2", 64, "kv_producer", args=["-tp", "2"],
                env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", **passive})
    dec = serve(tmp, model, "decode-tp1", 32, "kv_consumer",
                env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", **passive})
    assert pre.bootstrap is not None
    proxy = start(tmp, "proxy-at-once", ["proxy", "--prefill", pre.url, "--decode", dec.url,
                                         "--prefill-bootstrap", pre.bootstrap])
    every = [pre, dec, proxy]
    try:
        wait_healthy(every)
        yield model, every
    finally:
        for s in every:
            s.kill()


def test_prefill_tp2_to_decode_tp1_streamed_is_token_exact(
        servers: tuple[Path, list[Server]]) -> None:
    model, (pre, dec, proxy) = servers
    prompts = [[(p + 3) % 500 + 4 for p in prompt] for prompt in PROMPTS]
    want = [complete(dec.url, model, p) for p in prompts]  # undisturbed, TP 1
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(proxy.url, model, p), prompts))
    for prompt, (status, answer), (_, ref) in zip(prompts, got, want, strict=True):
        assert status == 200, f"{answer}\n{kvbridge_lines(pre, dec)}"
        assert generated(answer)[0] == generated(ref)[0], len(prompt)
        assert generated(answer)[1] == pytest.approx(generated(ref)[1], abs=1e-4), len(prompt)
    log = pre.log.read_text(errors="replace")
    assert "prefill rank 0:" in log and "prefill rank 1:" in log  # two ranks registered
