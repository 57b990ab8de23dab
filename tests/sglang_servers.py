"""Real SGLang servers for the SGLang backend's tests: SGLang's CPU build in the venv
scripts/sglang_env.sh builds (the tests skip, saying why, where there is none), a tiny local
model, a prefill/decode pair behind SGLang's mini load balancer, greedy ids compared with an
undisturbed server's."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvbridge.integrations.sglang import launch
from kvbridge.integrations.sglang.launch import Server

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def sglang_python() -> Path:
    """The SGLang venv's python: ``KVBRIDGE_SGLANG_PY``, else what scripts/sglang_env.sh builds
    or reuses (its last stdout line). Skips, with the script's reason, where SGLang cannot be
    installed on this machine (its exit status 2)."""
    explicit = os.environ.get("KVBRIDGE_SGLANG_PY")
    if explicit:
        return Path(explicit)
    # A fresh build is minutes (3.6 GB); reuse is seconds.
    done = subprocess.run(
        ["bash", str(ROOT / "scripts/sglang_env.sh")],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode == 2:
        reason = [line for line in done.stderr.splitlines() if "SKIP:" in line]
        pytest.skip(reason[-1] if reason else f"sglang_env.sh exited 2: {done.stderr[-500:]}")
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(
            f"scripts/sglang_env.sh exited {done.returncode}:\n{done.stderr[-2000:]}"
        )
    return Path(done.stdout.strip().splitlines()[-1])


def make_model(root: Path, name: str = "tiny-qwen3", arch: str = "qwen3") -> Path:
    """A tiny random model (tests/vllm_model.py) under ``root``, saved by the SGLang venv's
    transformers (a model saved by another version may carry config fields SGLang's cannot
    read). Qwen3 by default: float32 greedy ids are the same across SGLang launches on CPU."""
    path = root / name
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); "
        f"from vllm_model import make_tiny_model; make_tiny_model({str(path)!r}, {arch!r})"
    )
    subprocess.run([str(sglang_python()), "-c", code], check=True, capture_output=True, timeout=300)
    return path


def wait_healthy(servers: Sequence[Server], timeout: float = 420) -> None:
    # A pair took 200 s to turn healthy on 2 cores shared with other test runs (load 30).
    try:
        launch.wait_healthy(servers, timeout)
    except RuntimeError as e:
        raise AssertionError(str(e)) from None


@contextlib.contextmanager
def killed_after(*servers: Server) -> Iterator[None]:
    try:
        yield
    finally:
        for s in servers:
            s.kill()


@contextlib.contextmanager
def pd_pair(
    tmp: Path,
    model: Path,
    backend: str,
    page_size: int = 1,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
) -> Iterator[tuple[Server, Server, Server]]:
    """(prefill, decode, router), healthy: the prefill on core 0, the decode on core 1 (two
    servers sharing cores spin at each other's OpenMP barriers), the router unpinned."""
    py = sglang_python()
    pre = launch.serve(
        py,
        tmp,
        "prefill",
        model,
        mode="prefill",
        backend=backend,
        page_size=page_size,
        core="0",
        args=prefill_args,
    )
    dec = launch.serve(
        py,
        tmp,
        "decode",
        model,
        mode="decode",
        backend=backend,
        page_size=page_size,
        core="1",
        args=decode_args,
    )
    with killed_after(pre, dec):
        rt = launch.router(py, tmp, pre, dec)
        with killed_after(rt):
            # The router's /health answers at once: the pair's is what says the route is ready.
            wait_healthy([pre, dec, rt])
            yield pre, dec, rt


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
