"""MLA through kvbridge inside real SGLang 0.5.23 servers (CPU): SGLang's ``MLATokenToKVPool``.

The model is a tiny random DeepSeek-V2 (tests/sglang_hybrid_models.py, ``MLA_ARCH``: three MLA
layers, a latent of 64 + 16 rope dims a token and layer, float32: 960 bytes a token). SGLang
keeps one latent row a token and layer, replicated on every TP rank, and hands a transfer
backend no state beside it (``state_types`` empty, ``is_mla_backend``, no KV head counts).

One deployment for the module: a TP 2 prefill with pages of 16, computing in chunks of 32,
feeding a TP 1 decode with pages of 32 (its own radix cache on) through
``--disaggregation-transfer-backend kvbridge`` behind SGLang's router. Both prefill ranks hold
every token's latent: the decode must be sent it once, by one of them, and the other must
still end the request (the planner derives which rank sends; it is never guessed).

SGLang's CPU attention cannot serve MLA as it comes: ``torch_native`` has no entry in SGLang's
DeepSeek dispatch, which falls back to Triton's, whose plain (non-absorbed) MHA for a fresh
prefill reads the latent cache as MHA keys and dies ("Expected size ... [8, 48] but got: [8,
80]"). The test-only stand-ins (tests/sglang_standins/sgl_kernel/_sglang_patches.py) register
``torch_native`` for absorbed MLA, whose attention over the latent ``torch_native`` computes as
it is. The oracle is transformers' own greedy ids for the checkpoint (independent of SGLang,
of that patch and of kvbridge); a single server so patched gives them too.

The tests skip, saying why, where SGLang cannot be installed (scripts/sglang_env.sh).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.integrations.sglang import launch
from sglang_hybrid_models import MLA_ARCH
from sglang_servers import (
    Turns,
    answers,
    kvbridge_bytes,
    legs_of_other_prompts_fail_at_once,
    realtime_tokens,
    tp2_to_tp1,
)

pytestmark = pytest.mark.slow  # real SGLang servers: two, about a minute to start

MAX_NEW = 12
CHUNK = 32  # the prefill's chunks (its pages of 16, the decode's of 32: tp2_to_tp1)


def _prompt(n: int, k: int) -> list[int]:
    """``n`` token ids; ``k`` picks the first one, so no two prompts share a prefix."""
    return [(9 + 5 * k + (13 + 2 * k) * i) % 500 + 5 for i in range(n)]


# Shorter than a page; a prefill page and one past; a chunk (two prefill pages, one decode
# page) and around it; two chunks and one past; many chunks with a partial last page.
LENGTHS = (3, 16, 17, 31, 32, 33, 64, 65, 150)
PROMPTS = [_prompt(n, k) for k, n in enumerate(LENGTHS)]
REPEATED = _prompt(150, len(LENGTHS))  # sent alone, then again (the prefix hits)
NEXT_TURN = _prompt(40, len(LENGTHS) + 1)  # REPEATED, its answer, these (the decode's hit)
CROSSED = (_prompt(77, len(LENGTHS) + 2), _prompt(77, len(LENGTHS) + 3))  # a leg each


@pytest.fixture(scope="module")
def mla(
    tmp_path_factory: pytest.TempPathFactory, sglang_models: dict[str, Path]
) -> Iterator[Turns]:
    tmp = tmp_path_factory.mktemp("sglang-mla")
    model = sglang_models[MLA_ARCH]
    fixed = PROMPTS
    with tp2_to_tp1(tmp, model, CHUNK, fixed, REPEATED, NEXT_TURN, MAX_NEW) as turns:
        yield turns


def token_bytes(d: Turns) -> int:
    """One token's latent over every layer, from the checkpoint's config (float32)."""
    config = json.loads((d.model / "config.json").read_text())
    return config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4


def _served(d: Turns, prompt: list[int]) -> None:
    status, answer = launch.generate(d.router.url, prompt, MAX_NEW, 300)
    assert status == 200, f"{len(prompt)} tokens: {answer}\n(logs: {d.decode.log})"
    assert launch.output_ids(answer) == d.reference[tuple(prompt)], f"{len(prompt)} tokens"


def test_latent_crosses_tp_and_page_sizes_token_exact_and_once(mla: Turns) -> None:
    """Concurrent prompts of 3 to 150 tokens on both sides of the page (16, 32) and chunk
    boundaries: a TP 2 prefill with pages of 16 -> a TP 1 decode with pages of 32, through
    SGLang's router, exactly transformers' ids, the decode computing no prompt token. Then
    one 150-token prompt alone. From the decode's byte counter over the two: each token's
    latent arrived once (960 bytes over three layers), not once from each prefill rank that
    holds it, and each request's metadata (the same for every request) beside it."""
    tokens_before, bytes_before = realtime_tokens(mla.decode), kvbridge_bytes(mla.metrics)
    got = answers(mla.router.url, PROMPTS, MAX_NEW)
    for p, (status, answer) in zip(PROMPTS, got, strict=True):
        assert status == 200, f"{len(p)} tokens: {answer}\n(logs: {mla.decode.log})"
        assert launch.output_ids(answer) == mla.reference[tuple(p)], f"{len(p)} tokens"
    tokens_after, batch = realtime_tokens(mla.decode), kvbridge_bytes(mla.metrics) - bytes_before
    assert tokens_after.get("decode", 0) > tokens_before.get("decode", 0)
    assert tokens_after.get("prefill_compute", 0) == tokens_before.get("prefill_compute", 0)

    before = kvbridge_bytes(mla.metrics)
    _served(mla, REPEATED)
    alone = kvbridge_bytes(mla.metrics) - before
    # batch = sum(LENGTHS) x token + n x aux; alone = 150 x token + aux.
    n = len(PROMPTS)
    per_token = (batch - n * alone) / (sum(LENGTHS) - n * len(REPEATED))
    assert per_token == token_bytes(mla), (batch, alone)
    assert alone > len(REPEATED) * token_bytes(mla), alone  # and its metadata


def test_prefix_hits_on_both_servers_token_exact(mla: Turns) -> None:
    """The 150-token prompt, the same again, then its next turn (the prompt, its 12-token
    answer and 40 more tokens: 202): exact each time. The prefill's radix cache holds the
    prompt's first 144 tokens (nine pages of 16) the second and third time. The decode's
    radix cache holds the first turn with its answer, in pages of 32: the same prompt again
    finds its first 128 tokens there (SGLang matches all but the last token, whole pages), the
    next turn its first 160; kvbridge moves the latent past that prefix only, 22 and 42
    tokens, with the same metadata each time."""
    _served(mla, REPEATED)
    bytes_seen = [kvbridge_bytes(mla.metrics)]
    cached = [realtime_tokens(mla.prefill).get("prefill_cache", 0)]
    for p in (REPEATED, mla.follow_up):
        _served(mla, p)
        bytes_seen.append(kvbridge_bytes(mla.metrics))
        cached.append(realtime_tokens(mla.prefill).get("prefill_cache", 0))
    again, follow_up = (b - a for a, b in zip(bytes_seen, bytes_seen[1:], strict=False))
    assert all(b - a >= 144 for a, b in zip(cached, cached[1:], strict=False)), cached
    moved = (len(REPEATED) - 128, len(mla.follow_up) - 160)
    assert follow_up - again == (moved[1] - moved[0]) * token_bytes(mla), (again, follow_up)
    assert again > moved[0] * token_bytes(mla), again  # and its metadata


def test_legs_of_other_prompts_under_one_room_fail_at_once(mla: Turns) -> None:
    legs_of_other_prompts_fail_at_once(mla.prefill, mla.decode, CROSSED, MAX_NEW)
