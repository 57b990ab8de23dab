"""Real SGLang servers for the SGLang backend's tests: SGLang's CPU build in the venv
scripts/sglang_env.sh builds (the tests skip, saying why, where there is none), a tiny local
model, a prefill/decode pair behind SGLang's mini load balancer, greedy ids compared with an
undisturbed server's."""

from __future__ import annotations

import functools
import re
import subprocess
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvbridge.integrations.sglang import launch
from kvbridge.integrations.sglang.launch import Server

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
# pytest-xdist, with another worker's tests: a peer silent 20 s is dead (the default 3 s is a
# scheduling hiccup under that load), a transfer may take 2 minutes. The fault tests kill
# processes, which their peers on this host know two heartbeats later (the process is gone),
# not by these windows.
TOLERANT = {"KVBRIDGE_HEARTBEAT_MISSES": "40", "KVBRIDGE_TRANSFER_TIMEOUT": "120"}


def serve(*args: Any, env: dict[str, str] | None = None, **kwargs: Any) -> Server:
    """:func:`kvbridge.integrations.sglang.launch.serve` with the deadlines above."""
    return launch.serve(*args, env={**TOLERANT, **(env or {})}, **kwargs)


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
