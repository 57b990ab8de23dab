"""Start real SGLang servers (and SGLang's mini load balancer) on loopback, for the SGLang
backend's tests and benchmark: each in its own process group with its own log, health-checked,
killed as a group. A process of its own per server, started with a given python (SGLang's own
venv): nothing of SGLang is imported here.

Why the flags are what they are on a CPU host: docs/sglang-backend.md, "SGLang's CPU path"
(each flag with what SGLang 0.5.23 does without it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from kvbridge.integrations import forkserver
from kvbridge.integrations.vllm.launch import Server, free_port, post, wait_healthy

__all__ = [
    "SGLangUnavailable",
    "Server",
    "free_port",
    "generate",
    "generate_pd",
    "killed_after",
    "loads",
    "logprobs",
    "output_ids",
    "router",
    "serve",
    "sglang_python",
    "wait_healthy",
]

Mode = Literal["prefill", "decode"]

# Without SGLANG_USE_CPU_ENGINE SGLang does not take its CPU path (and fails importing vllm);
# without SGLANG_HOST_IP it advertises eth0's address to its peers.
_BASE_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_HOST_IP": "127.0.0.1"}

# What a fork server of SGLang's python imports once for every server forked from it: the
# launcher, the processes it starts (HTTP server, scheduler, detokenizer), the model classes
# (the registry imports them all), the router and kvbridge's backend.
PRELOAD = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.models.registry",
    "sglang_router.launch_router",
    "kvbridge.integrations.sglang.backend",
)

# SGLang's CPU path: torch_native attention, float32 (deterministic greedy ids to compare), a
# bounded KV pool (unbounded, it sizes one from the host's free memory: 15 GB on 24 GB), and no
# warm-up request: /health turns 200 once the scheduler is up, not after a first generation
# (which a PD server can only fake), and the first real request pays what warm-up would.
CPU_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--dtype",
    "float32",
    "--max-total-tokens",
    "4096",
    "--skip-server-warmup",
    # An idle scheduler otherwise spins on its core: several servers share two cores here.
    "--sleep-on-idle",
)


class SGLangUnavailable(RuntimeError):
    """scripts/sglang_env.sh says SGLang cannot be installed on this machine (its reason)."""


def sglang_python(checkout: Path) -> Path:
    """The python of an SGLang environment: ``KVBRIDGE_SGLANG_PY``, else what ``checkout``'s
    scripts/sglang_env.sh builds or reuses (its last stdout line; a fresh build is minutes).
    SGLangUnavailable, with the script's reason, where it exits 2."""
    explicit = os.environ.get("KVBRIDGE_SGLANG_PY")
    if explicit:
        return Path(explicit)
    done = subprocess.run(
        ["bash", str(checkout / "scripts/sglang_env.sh")],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode == 2:
        reason = [line for line in done.stderr.splitlines() if "SKIP:" in line]
        raise SGLangUnavailable(reason[-1] if reason else done.stderr[-500:])
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(
            f"scripts/sglang_env.sh exited {done.returncode}:\n{done.stderr[-2000:]}"
        )
    return Path(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def killed_after(*servers: Server) -> Iterator[None]:
    """Kill ``servers`` (their process groups) when the block ends, however it ends."""
    try:
        yield
    finally:
        failed: list[Exception] = []
        for s in servers:
            try:
                s.kill()
            except Exception as e:  # the others are killed all the same
                failed.append(e)
        if failed:
            raise failed[0]


def _launch(
    cmd: list[str],
    workdir: Path,
    name: str,
    port: int,
    env: dict[str, str],
    core: str | None,
    python: Path | None = None,
) -> Server:
    """Start ``cmd`` (with ``python``: ``python -m MODULE ARGS`` forked from a fork server of
    that python, :mod:`kvbridge.integrations.forkserver`, ``cmd`` being ``MODULE ARGS``)."""
    log = workdir / f"{name}.log"
    if python is not None:
        cpus = _cores(core) if core is not None else None
        child = forkserver.start(python, cmd, {**os.environ, **env}, log, PRELOAD, cpus)
        return Server(name, port, child, log)
    # On a CPU without AMX SGLang binds no threads itself, and torch's threads follow taskset:
    # a core a server keeps two servers from spinning at each other's OpenMP barriers.
    argv = ["taskset", "-c", core, *cmd] if core is not None else cmd
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    return Server(name, port, proc, log)


def _metrics_dir(workdir: Path, name: str) -> str:
    """An empty directory for a forked server's prometheus_client files (a killed server's
    files would count too)."""
    metrics = workdir / f"{name}.metrics"
    shutil.rmtree(metrics, ignore_errors=True)
    metrics.mkdir()
    return str(metrics)


def _cores(core: str) -> list[int]:
    """The cores of a taskset list ("0", "0,1", "0-1")."""
    cores: list[int] = []
    for part in core.split(","):
        low, _, high = part.partition("-")
        cores += range(int(low), int(high or low) + 1)
    return cores


def _omp_bind(core: str | None, tp: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for ``tp`` ranks: one core list a rank, '|'-separated.
    Without it SGLang refuses more ranks than NUMA nodes; on a CPU without AMX it only passes
    that check (nothing is bound), so the split matters little."""
    cores = _cores(core) if core is not None else list(range(tp))
    return "|".join(str(cores[i % len(cores)]) for i in range(tp))


def serve(
    python: Path,
    workdir: Path,
    name: str,
    model: Path,
    *,
    mode: Mode | None = None,
    backend: str = "kvbridge",
    tp: int = 1,
    page_size: int = 1,
    core: str | None = None,
    bootstrap_port: int | None = None,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    fork: bool = False,
) -> Server:
    """``python -m sglang.launch_server`` of ``model`` on CPU, on a free loopback port, logging
    to ``workdir/NAME.log``; with ``mode``, one side of a prefill/decode pair over ``backend``
    (``--disaggregation-transfer-backend``). A prefill server's bootstrap service listens on
    ``bootstrap_port`` (a free one if None), as ``server.bootstrap``. ``core``: a taskset core
    list ("0", "0,1", "0-1") the whole server runs on. ``fork``: SGLang's processes forked,
    not spawned, from a fork server that imported SGLang once (:mod:`kvbridge.integrations.
    forked`, :mod:`kvbridge.integrations.forkserver`: each server's own import was 16 s of
    CPU here)."""
    port = free_port()
    cmd = [
        "sglang.launch_server",
        "--model-path",
        str(model),
        *CPU_ARGS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # Its torch.distributed store's port, ours: left to SGLang, each server picks one that
        # is free when it starts and binds it later, and two servers started together can pick
        # the same one (seen: EADDRINUSE in a scheduler).
        "--nccl-port",
        str(free_port()),
        "--page-size",
        str(page_size),
        "--tp-size",
        str(tp),
    ]
    e = dict(_BASE_ENV)
    if tp > 1:
        e["SGLANG_CPU_OMP_THREADS_BIND"] = _omp_bind(core, tp)
    if fork:  # before SGLang imports prometheus_client: kvbridge.integrations.forked
        e["PROMETHEUS_MULTIPROC_DIR"] = _metrics_dir(workdir, name)
    if backend == "mooncake":
        # Mooncake's engine otherwise looks for RDMA devices.
        e |= {"MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1"}
    if mode == "prefill":
        bootstrap_port = bootstrap_port or free_port()
        cmd += [
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bootstrap_port),
            "--disaggregation-transfer-backend",
            backend,
            # The overlap scheduler sends a reused (radix-cached) prefix early and records a
            # torch.cuda.Event for it: the prefill server dies on CPU at the first prefix hit.
            "--disable-overlap-schedule",
        ]
        if backend == "mooncake":
            # Mooncake's sender claims host tensor indices, which sends prefill down a path of
            # pinned memory and torch.cuda.Event (prefill.py, send_kv_chunk) that dies on CPU.
            # "Every context-parallel rank sends" bypasses that path; with CP 1 it changes
            # nothing else (each rank's share of the pages is all of them).
            e["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] = "1"
    elif mode == "decode":
        cmd += [
            "--disaggregation-mode",
            "decode",
            "--disaggregation-transfer-backend",
            backend,
            # The default backup of retracted requests' KV calls cudaHostRegister.
            "--disaggregation-decode-retraction-backup",
            "cpu_tensor",
        ]
    e |= env or {}
    if fork:
        server = _launch([*cmd, *args], workdir, name, port, e, core, python)
    else:
        server = _launch([str(python), "-m", *cmd, *args], workdir, name, port, e, core)
    if mode == "prefill":
        server.bootstrap = f"127.0.0.1:{bootstrap_port}"
    return server


def router(
    python: Path,
    workdir: Path,
    prefill: Server,
    decode: Server,
    core: str | None = None,
    env: dict[str, str] | None = None,
    fork: bool = False,
) -> Server:
    """sglang-router's mini load balancer in front of one prefill/decode pair: it sends each
    request to both with the prefill's bootstrap address and room, and answers with the
    decode's reply. Its /health answers 200 as soon as it listens, whatever the servers.
    ``fork``: forked from the fork server that imported SGLang for :func:`serve` (the router's
    module imports SGLang: 9 s of CPU), the one of servers given the same ``env``."""
    if prefill.bootstrap is None:
        raise ValueError(f"{prefill.name} is not a prefill server (no bootstrap port)")
    port = free_port()
    cmd = [
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--mini-lb",
        "--prefill",
        prefill.url,
        prefill.bootstrap.rsplit(":", 1)[1],
        "--decode",
        decode.url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if fork:  # (a metrics directory as the servers', whose fork server it shares)
        e = {**_BASE_ENV, "PROMETHEUS_MULTIPROC_DIR": _metrics_dir(workdir, "router")}
        return _launch(cmd, workdir, "router", port, {**e, **(env or {})}, core, python)
    return _launch([str(python), "-m", *cmd], workdir, "router", port, env or {}, core)


def generate(
    url: str, input_ids: Sequence[int], max_new_tokens: int = 12, timeout: float = 120
) -> tuple[int, dict[str, Any]]:
    """POST /generate, greedy, with the generated tokens' logprobs; (status, JSON answer).
    ``ignore_eos``: every answer is ``max_new_tokens`` long, whatever the random model draws."""
    body = {
        "input_ids": list(input_ids),
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": max_new_tokens,
            "ignore_eos": True,
        },
        "return_logprob": True,
    }
    return post(f"{url}/generate", body, timeout)


def generate_pd(
    prefill: Server,
    decode: Server,
    input_ids: Sequence[int],
    max_new_tokens: int = 12,
    timeout: float = 120,
    room: int | None = None,
    answer: Mode = "decode",
) -> tuple[int, dict[str, Any]]:
    """One request to a prefill/decode pair, both legs at once, as SGLang's router sends it (the
    prefill's bootstrap address and a room, random unless given, in both): the decode's
    (status, answer), or the prefill's with ``answer="prefill"``. For the tests' extra pairs,
    which need no router process of their own."""
    if prefill.bootstrap is None:
        raise ValueError(f"{prefill.name} is not a prefill server (no bootstrap port)")
    host, port = prefill.bootstrap.rsplit(":", 1)
    body = {
        "input_ids": list(input_ids),
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "return_logprob": True,
        "bootstrap_host": host,
        "bootstrap_port": int(port),
        "bootstrap_room": random.getrandbits(63) if room is None else room,
    }
    # The decode's answer is the request's; the other leg is not waited for (a prefill leg
    # whose decode failed may wait out its own deadline).
    ex = ThreadPoolExecutor(2)
    legs = {
        m: ex.submit(post, f"{s.url}/generate", body, timeout)
        for m, s in (("prefill", prefill), ("decode", decode))
    }
    try:
        return legs[answer].result()
    finally:
        ex.shutdown(wait=False)


def loads(server: Server) -> dict[str, Any]:
    """The server's load (``GET /v1/loads``, its first data-parallel rank): queue lengths (the
    ``disaggregation`` section's ``prefill_inflight_queue_reqs``: requests whose KV is held for
    a transfer) and ``num_used_tokens`` (KV slots in use, the radix cache's evictable ones
    not counted)."""
    with urllib.request.urlopen(f"{server.url}/v1/loads", timeout=30) as r:
        return dict(json.loads(r.read())["loads"][0])


def output_ids(answer: dict[str, Any]) -> list[int]:
    """The generated token ids of a /generate answer."""
    return [int(i) for i in answer["output_ids"]]


def logprobs(answer: dict[str, Any]) -> list[float]:
    """The generated tokens' logprobs: ``meta_info.output_token_logprobs`` holds one
    ``[logprob, token_id, text]`` a token (text None unless asked for)."""
    return [float(lp) for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
