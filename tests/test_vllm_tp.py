"""kvbridge between vLLM servers of different tensor parallelism: a prefill at TP 2 (each rank
holding one of the tiny model's two KV heads) and a decode at TP 1, through both proxies (one
leg after the other, and both at once with every layer streamed), against the decode server
run undisturbed. vLLM's NixlConnector needs the decode TP to be a multiple of the prefill's.

On this 2-core host the prefill's two workers take a core each and the decode runs unbound:
bound to a core a prefill worker spins on, the decode engine starved the prefill (a 4-token
prompt took 63 s).
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
    pre = serve(tmp, model, "prefill-tp2", 32, "kv_producer", args=["-tp", "2"],
                env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    dec = serve(tmp, model, "decode-tp1", 64, "kv_consumer",
                env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert pre.bootstrap is not None
    legs = ["proxy", "--prefill", pre.url, "--decode", dec.url]
    proxies = [start(tmp, "proxy", legs),
               start(tmp, "proxy-at-once", [*legs, "--prefill-bootstrap", pre.bootstrap])]
    every = [pre, dec, *proxies]
    try:
        wait_healthy(every)
        yield model, every
    finally:
        for s in every:
            s.kill()


@pytest.mark.parametrize("way", ["one leg after the other", "both legs at once"])
def test_prefill_tp2_to_decode_tp1_is_token_exact(servers: tuple[Path, list[Server]],
                                                  way: str) -> None:
    model, (pre, dec, *proxies) = servers
    proxy = proxies[way == "both legs at once"]
    shift = 3 if way == "both legs at once" else 1  # fresh prompts: the decode caches loads
    prompts = [[(p + shift) % 500 + 4 for p in prompt] for prompt in PROMPTS]
    want = [complete(dec.url, model, p) for p in prompts]  # undisturbed, TP 1
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(proxy.url, model, p), prompts))
    for prompt, (status, answer), (_, ref) in zip(prompts, got, want, strict=True):
        assert status == 200, f"{answer}\n{kvbridge_lines(pre, dec)}"
        assert generated(answer)[0] == generated(ref)[0], len(prompt)
        assert generated(answer)[1] == pytest.approx(generated(ref)[1], abs=1e-4), len(prompt)
    log = pre.log.read_text(errors="replace")
    assert "prefill rank 0:" in log and "prefill rank 1:" in log  # two ranks registered
