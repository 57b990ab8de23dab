"""Real vLLM servers for the connector's tests: vLLM's CPU build in the venv
scripts/vllm_env.sh builds (the tests skip, saying why, where there is none), a tiny local
model, servers with kvbridge's connector, completions compared with an undisturbed instance."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fault_switch import FaultSwitch
from kvbridge.deploy.netns import Host
from kvbridge.integrations.vllm import launch
from kvbridge.integrations.vllm.launch import Server, free_port, kvbridge_config, post

ROOT = Path(__file__).resolve().parents[1]


def _vllm_python() -> Path:
    explicit = os.environ.get("KVBRIDGE_VLLM_PY")
    if explicit:
        return Path(explicit)
    venv = Path(os.environ.get("KVBRIDGE_VLLM_VENV", Path.home() / ".cache/kvbridge/vllm-venv"))
    return venv / "bin/python"


VPY = _vllm_python()
# One VLLM_CACHE_ROOT for every server: vLLM inspects a model's architecture in a subprocess
# (~8 s of an engine's start) unless this cache holds the answer (written atomically, keyed by
# the model module's hash); the servers run eager, so nothing else is cached there.
CACHE = VPY.parents[2] / "vllm-cache"


@functools.cache
def _vllm_imports() -> bool:
    return (
        VPY.exists()
        and subprocess.run(
            [str(VPY), "-c", "import vllm, kvbridge"], capture_output=True, timeout=300
        ).returncode
        == 0
    )


def require_vllm() -> None:
    """Skip, saying why, where vLLM's environment is missing. Called by the fixtures that start
    servers (conftest.py's ``vllm_models``), not at import: collecting the vLLM modules, as the
    fast tier does before leaving them out, costs no vLLM import."""
    if not _vllm_imports():
        pytest.skip(
            f"no vLLM environment at {VPY} (scripts/test.sh builds it with "
            f"scripts/vllm_env.sh; see its output for why it could not)"
        )


def start(
    tmp: Path,
    name: str,
    args: list[str],
    env: dict[str, str] | None = None,
    host: Host | None = None,
    fork: bool = True,
) -> Server:
    # vLLM binds its CPU worker's OpenMP threads to cores, and kvbridge's threads must not
    # starve behind them (kvbridge.integrations.affinity.any_core). Each engine gets a
    # core of its own, as engines sharing a host must: two engines whose OpenMP threads
    # share cores spin at each other's barriers (seen: a decode engine's first step held
    # 30 s while the prefill engine busy-waited on its transfers). Deadlines fit a shared
    # 2-core host running three engines beside other pytest-xdist workers' tests (a decode
    # rank was seen paused 6-19 s at a time there): a peer silent 20 s is dead, a transfer may
    # take 2 minutes; the bootstrap deadline stays 30 s (the killed-prefill test waits it out).
    e = {
        "VLLM_CACHE_ROOT": str(CACHE),
        "KVBRIDGE_BOOTSTRAP_TIMEOUT": "30",
        "KVBRIDGE_WAITING_TIMEOUT": "120",
        "KVBRIDGE_TRANSFER_TIMEOUT": "120",
        "KVBRIDGE_HEARTBEAT_MISSES": "40",
        "KVBRIDGE_LOG": "debug",
        # A rank that misses its ticks 20 s writes every thread's stack into the server's log
        # (a decode rank was seen frozen for 120 s under the suite's load, cause unknown).
        "KVBRIDGE_STALL_DUMP": "20",
        # The servers run eager, but vLLM still compiles a few helpers with torch.compile at a
        # first request (at TP 2 the vocabulary mask: 20-40 s of both ranks' CPU, Inductor
        # building C++ kernels); eager they give the same ids.
        "TORCH_COMPILE_DISABLE": "1",
        **(env or {}),
    }
    # vLLM's engine core and workers forked (kvbridge.integrations.forked: 6-7 s of CPU less
    # each) unless ``fork`` is False: test_vllm_connector.py's decode spawns them, as vLLM's
    # CPU platform does for its users.
    if host is None:
        return launch.start(VPY, tmp, name, args, e, fork=fork)
    return launch.start(VPY, tmp, name, args, e, host=host.address, netns=host.netns, fork=fork)


def wait_healthy(servers: list[Server]) -> None:
    try:
        launch.wait_healthy(servers)
    except RuntimeError as e:
        raise AssertionError(str(e)) from None


def kvbridge_lines(*servers: Server) -> str:
    """What kvbridge logged in each server, for a failure's message."""
    return "\n".join(
        f"{s.name}: {line}"
        for s in servers
        for line in s.log.read_text(errors="replace").splitlines()
        if " kvbridge." in line
    )


# The tiny models the vLLM modules serve (vllm_model.py): directory name -> architecture.
MODELS = {
    "tiny-llama-swa": "llama_swa",  # test_vllm_connector.py
    "tiny-llama": "llama",  # test_vllm_tp.py
    "tiny-nemotron-h": "nemotron_h",  # test_vllm_hybrid.py
    "tiny-qwen3-next": "qwen3_next",  # test_vllm_gdn.py
}


def make_models(root: Path, models: dict[str, str] = MODELS) -> dict[str, Path]:
    """Build ``models`` (name -> arch) under ``root`` in one process of vLLM's venv: torch and
    transformers are imported once for all of them, not once a model (~3 s each)."""
    paths = {name: root / name for name in models}
    build = ", ".join(f"({str(paths[n])!r}, {a!r})" for n, a in models.items())
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); "
        f"from vllm_model import make_tiny_model; "
        f"[make_tiny_model(path, arch) for path, arch in [{build}]]"
    )
    subprocess.run([str(VPY), "-c", code], check=True, capture_output=True, timeout=300)
    return paths


def serve(
    tmp: Path,
    model: Path,
    name: str,
    block: int,
    role: str | None,
    env: dict[str, str] | None = None,
    args: Sequence[str] = (),
    host: Host | None = None,
    fork: bool = True,
) -> Server:
    """A vLLM server (on ``host``, where given); a producer serves kvbridge's bootstrap service
    on a port of its own; ``fork``: as :func:`start`."""
    argv = [
        str(model),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--block-size",
        str(block),
        *args,
    ]
    port = free_port() if role == "kv_producer" else None
    address = host.address if host else "127.0.0.1"
    if role is not None:
        argv += ["--kv-transfer-config", kvbridge_config(role, port, address)]
    core = "1" if role == "kv_consumer" else "0"
    env = {"VLLM_CPU_OMP_THREADS_BIND": core, **(env or {})}
    server = start(tmp, name, argv, env, host, fork)
    server.bootstrap = f"{address}:{port}" if port else None
    return server


@dataclass
class Served:
    """A prefill and a decode of one model, the proxies in front of them, and the prefill's
    fault switch (its kvbridge shifts destination bytes inside ``faults.on(...)``)."""

    prefill: Server
    decode: Server
    proxy: Server  # one leg after the other
    at_once: Server  # both legs at once: the prefill streams
    faults: FaultSwitch


@contextlib.contextmanager
def served(tmp: Path, model: Path, args: Sequence[str]) -> Iterator[Served]:
    """vLLM servers of ``model`` with ``args`` (blocks of 32) and their proxies, healthy."""
    switch = FaultSwitch(tmp / "prefill.faults")
    pre = serve(tmp, model, "prefill", 32, "kv_producer", args=args, env=switch.env)
    dec = serve(tmp, model, "decode", 32, "kv_consumer", args=args)
    assert pre.bootstrap is not None
    legs = ["proxy", "--prefill", pre.url, "--decode", dec.url]
    proxy = start(tmp, "proxy", legs)
    at_once = start(tmp, "proxy-at-once", [*legs, "--prefill-bootstrap", pre.bootstrap])
    every = [pre, dec, proxy, at_once]
    try:
        wait_healthy(every)
        yield Served(pre, dec, proxy, at_once, switch)
    finally:
        for s in every:
            s.kill()


# Lengths: shorter than a block, one block exactly, several blocks with a partial last one.
PROMPTS = [
    [5, 17, 42, 99],
    list(range(10, 42)),
    [(7 * i) % 500 + 4 for i in range(150)],
    [(13 * i) % 490 + 9 for i in range(77)],
]


def complete(
    url: str, model: Path | str, prompt: list[int], **kw: Any
) -> tuple[int, dict[str, Any]]:
    body = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
        **kw,
    }
    return post(f"{url}/v1/completions", body)


def generated(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    choice = answer["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]
