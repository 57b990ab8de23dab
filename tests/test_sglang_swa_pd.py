"""SGLang's hybrid sliding-window pool through kvbridge inside real SGLang 0.5.23 servers (CPU).

The model is a tiny random Mellum (tests/sglang_hybrid_models.py, ``SWA_ARCH``: sliding, full,
sliding, full attention, a window of 40 in its config), for which SGLang keeps the sliding
layers' KV in a window sub-pool of its own (``SWAKVPool``) beside the full-attention pool, and
hands a transfer backend, per request, a list of the window's pages (its ``swa`` state). Its
scheduler's window is the config's less one (39): a list starts at the page of token
``max(prefix, length - 39)``, floored to the server's page size, and ends at the request's last
page.

One deployment for the module: a TP 2 prefill with pages of 16 feeding a TP 1 decode with pages
of 32 through ``--disaggregation-transfer-backend kvbridge`` behind SGLang's router. The
prefill computes in chunks of 32 tokens (``--chunked-prefill-size 32``), so a prompt longer than
32 is chunked; the decode keeps a
radix cache of its own (``--disaggregation-decode-enable-radix-cache``). The two servers' window
lists differ in length (seed 004's situation: here pages of 16 against pages of 32), and for
some prompts in what they cover: a 65-token prompt's prefill list starts at token 16 (four
pages of 16), its decode list at token 0 (three pages of 32). kvbridge plans by tokens, the
last 39 of the request, each list anchored at its last page.

The oracle: transformers' own greedy ids for the checkpoint (independent of SGLang, so they
check the test-only patch of SGLang's CPU attention the servers run with too,
tests/sglang_standins/sgl_kernel/_sglang_patches.py: on ``torch_native`` SGLang writes a
sliding layer's KV at window-pool slots but reads it through full-pool slots). A request whose
prefill leg and decode leg carry different prompts of one length fails at once on both servers
(their fingerprints differ), never continuing one prompt's KV as the other's.

The tests skip, saying why, where SGLang cannot be installed (scripts/sglang_env.sh).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.integrations.sglang import launch
from sglang_hybrid_models import SWA_ARCH, SWA_WINDOW
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
    """``n`` token ids; ``k`` picks the first one (10 + 7k), so no two prompts share a prefix."""
    return [(5 + 7 * k + (11 + 2 * k) * i) % 500 + 5 for i in range(n)]


# Shorter than a page, a page, just past it; SGLang's window, the config's window, one past;
# around three prefill pages; two decode pages and one past; several chunks and windows.
W = SWA_WINDOW  # 40: SGLang keeps 39
LENGTHS = (3, 16, 17, W - 1, W, W + 1, 47, 48, 49, 64, 65, 150)
PROMPTS = [_prompt(n, k) for k, n in enumerate(LENGTHS)]
# For the prefix hits: a prompt sent twice, then its next turn (the prompt, the 12 ids it is
# answered with, 40 more tokens: built in the fixture).
REPEATED = _prompt(150, len(LENGTHS))
NEXT_TURN = _prompt(40, len(LENGTHS) + 1)
# Two prompts of one length (77 tokens: three chunks, and a window that starts past two
# prefill pages), one on each leg of a request.
CROSSED = (_prompt(77, len(LENGTHS) + 2), _prompt(77, len(LENGTHS) + 3))


@pytest.fixture(scope="module")
def swa(
    tmp_path_factory: pytest.TempPathFactory, sglang_models: dict[str, Path]
) -> Iterator[Turns]:
    tmp = tmp_path_factory.mktemp("sglang-swa")
    model = sglang_models[SWA_ARCH]
    fixed = PROMPTS
    with tp2_to_tp1(tmp, model, CHUNK, fixed, REPEATED, NEXT_TURN, MAX_NEW) as turns:
        yield turns


def received(d: Turns) -> float:
    """kvbridge's bytes received so far on the decode server."""
    return kvbridge_bytes(d.metrics)


def test_window_pool_crosses_tp_and_page_sizes_token_exact(swa: Turns) -> None:
    """Concurrent prompts of 3 to 150 tokens on both sides of the window (39 and 40 tokens)
    and of the page boundaries (16, 32, 48, 64), chunked where longer than 32: a TP 2 prefill
    with pages of 16 -> a TP 1 decode with pages of 32, through SGLang's router, exactly
    transformers' ids; the decode computed no prompt token (every prompt's KV and window
    came by kvbridge)."""
    before = realtime_tokens(swa.decode)
    got = answers(swa.router.url, PROMPTS, MAX_NEW)
    for p, (status, answer) in zip(PROMPTS, got, strict=True):
        assert status == 200, f"{len(p)} tokens: {answer}\n(logs: {swa.decode.log})"
        assert launch.output_ids(answer) == swa.reference[tuple(p)], f"{len(p)} tokens"
    after = realtime_tokens(swa.decode)
    assert after.get("decode", 0) > before.get("decode", 0), (before, after)
    assert after.get("prefill_compute", 0) == before.get("prefill_compute", 0), (before, after)


def test_prefix_hits_on_both_servers_token_exact(swa: Turns) -> None:
    """A 150-token prompt, the same again, then its next turn (the prompt, its 12-token answer
    and 40 more tokens: 202): exact each time. The second and third find its first 144 tokens
    (nine pages of 16) in the prefill's radix cache, SGLang computing only the rest (in
    chunks). The next turn also finds a prefix in the decode's radix cache, which holds the
    first turn with its answer: SGLang's decode takes full-attention KV from it, up to the
    page of token 202 - 1 - 39, and has the window after it sent afresh; kvbridge moves only
    the tokens past that prefix, fewer bytes for the 202 tokens than for the 150 of the first
    turn. (A repeated prompt finds no prefix there: the decode's cached window of it ends
    where its answer did, not where the prefix would.)"""
    bytes_seen, cached = [received(swa)], [realtime_tokens(swa.prefill).get("prefill_cache", 0)]
    for p in (REPEATED, REPEATED, swa.follow_up):
        status, answer = launch.generate(swa.router.url, p, MAX_NEW)
        assert status == 200, f"{len(p)} tokens: {answer}\n(logs: {swa.decode.log})"
        assert launch.output_ids(answer) == swa.reference[tuple(p)], f"{len(p)} tokens"
        bytes_seen.append(received(swa))
        cached.append(realtime_tokens(swa.prefill).get("prefill_cache", 0))
    first, again, follow_up = (b - a for a, b in zip(bytes_seen, bytes_seen[1:], strict=False))
    hits = [b - a for a, b in zip(cached, cached[1:], strict=False)]
    assert hits[1] >= 144 and hits[2] >= 144, hits  # the prefill's prefix hits
    assert 0 < follow_up < first, (first, again, follow_up)  # the decode's prefix hit


def test_legs_of_other_prompts_under_one_room_fail_at_once(swa: Turns) -> None:
    legs_of_other_prompts_fail_at_once(swa.prefill, swa.decode, CROSSED, MAX_NEW)
