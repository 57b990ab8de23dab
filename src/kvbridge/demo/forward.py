"""The model's forward as every demo process runs it, and the parent's proof that it runs.

:func:`prefill_steps` and :func:`decode_steps` are the chunked prefill and the greedy decode of
the reference, the prefill ranks and the decode rank that generates (:mod:`.workers`), and of
:mod:`.sweep`. :func:`prove` is what ``kvbridge demo --model CONFIG`` does with a user's config
before any process starts (issue 33: a config transformers runs is either run exactly or
refused in one line, never a worker's traceback): the cache described from the config, the
scaled model built as every process builds it (float32, eager attention, the demo's seed), and
a few tokens run through it as the reference runs the prompt (a chunked prefill into the
model's own cache kind, :func:`kvbridge.demo.hfcache.new_cache`, that crosses a sliding
window of the demo's size, the cache checked against its description, two decode steps).
Where any of that fails it is a :class:`~kvbridge.errors.SpecError` naming the error. At the
demo's size it costs about a second a model (what the reference pays for two of its chunks:
14 s for bamba-9b's 32 layers of 128-head Mamba2 through transformers' reference kernels, 0.1 s
for the issue's 4-layer Zamba2), besides importing torch.

torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from kvbridge.demo import hfcache
from kvbridge.demo.deployment import chunks
from kvbridge.demo.models import ModelCase, build_model, one_line, weights_digest
from kvbridge.errors import SpecError
from kvbridge.model.spec import CacheSpec


def prefill_steps(
    model: Any,
    prompt: tuple[int, ...],
    chunk: int,
    cache: Any = None,
    start: int = 0,
    stop: int | None = None,
    before: Any = None,
) -> Iterator[tuple[int, int, int, Any]]:
    """Chunked prefill of tokens ``[start, stop)`` (all by default) into ``cache`` (a new one
    by default, which ``start`` 0 needs): yields ``(start, stop, argmax of the last logits,
    cache)`` per chunk; ``before(start, stop, cache)`` is called before each chunk's forward."""
    import torch

    ids = _ids(model, prompt)
    cache = hfcache.new_cache(model.config, str(model.device)) if cache is None else cache
    stop = len(prompt) if stop is None else stop
    with torch.no_grad():
        for s, e in chunks(len(prompt), chunk):
            if not start <= s < stop:
                continue
            if before is not None:
                before(s, e, cache)
            given = 0 if _whole(model) else s  # the first position the forward is given
            logits = _forward(model, ids[:, given:e], cache, given)
            yield s, e, _sampled(model, logits), cache


def _forward(model: Any, ids: Any, cache: Any, given: int) -> Any:
    """The logits of one forward of ``ids`` (from position ``given``) on ``cache``."""
    import torch

    if isinstance(cache, hfcache.Mems):  # XLNet returns its new memory; it derives positions
        out = model(ids, mems=tuple(cache) or None, use_mems=True)
        cache[:] = out.mems
        return out.logits
    positions = torch.arange(given, given + ids.shape[-1], device=model.device)[None]
    with hfcache.attached(model, cache):
        return model(
            ids, **{_cache_arg(model): cache}, position_ids=positions, use_cache=True
        ).logits


# CPM-Ant's and XLM's forwards take the whole sequence at every step (CPM-Ant prepends its
# prompt positions), then keep only the positions past what the cache holds; of the tokens
# before those, embedded and dropped, only that they are no padding counts (CPM-Ant's 0,
# XLM's ``pad_index``): the decode, which has the cache and not the prompt, gives fillers.
def _whole(model: Any) -> bool:
    return model.config.model_type in ("cpmant", "xlm")


def filler(model: Any) -> int:
    """A token that stands for one the cache holds, in a whole-sequence step."""
    return 3 if getattr(model.config, "pad_index", None) == 1 else 1


# MusicGen's decoder reads a token of each audio codebook a step (input ids ``[codebooks,
# tokens]``, logits ``[codebooks, tokens, vocab]``; its cache is one stream's, of the codebooks'
# summed embeddings). The demo's token is then a frame: its codebooks' ids are the digits of
# one integer in base ``vocab_size``, so that the prompt, the aux slot that carries the first
# sampled token and the comparison of the generated tokens hold one integer a step as for every
# other model. (A prompt's bytes, under the scaled vocabulary of 256, are frames of the first
# codebook alone.)
_FRAMED = frozenset({"musicgen_decoder", "musicgen_melody_decoder"})


def _codebooks(model: Any) -> int:
    return int(model.config.num_codebooks) if model.config.model_type in _FRAMED else 1


def _ids(model: Any, tokens: Sequence[int]) -> Any:
    """The model's input ids of ``tokens`` (a batch of one)."""
    import torch

    if (books := _codebooks(model)) == 1:
        return torch.tensor([tokens], device=model.device)
    vocab = model.config.vocab_size
    rows = [[t // vocab**k % vocab for t in tokens] for k in range(books)]
    return torch.tensor(rows, device=model.device)


def _sampled(model: Any, logits: Any) -> int:
    """The greedy token of the last position's ``logits``: a frame's, digit by digit."""
    if (books := _codebooks(model)) == 1:
        return int(logits[0, -1].argmax())
    vocab = model.config.vocab_size
    return sum(int(logits[k, -1].argmax()) * vocab**k for k in range(books))


def _cache_arg(model: Any) -> str:
    """The keyword a model's forward takes its cache by (Mamba1: ``cache_params``; RWKV:
    ``state``; XLM: ``cache``; XLNet: ``mems``)."""
    params = inspect.signature(model.forward).parameters
    for name in ("past_key_values", "cache_params", "state", "cache", "mems"):
        if name in params:
            return name
    if not any(word in p for p in params for word in ("past", "cache", "mem")):
        # (OpenAI GPT: every step runs the whole sequence again)
        raise SpecError(
            f"{type(model).__name__} keeps no cache (its forward takes none): a decode of it "
            f"has nothing a prefill can hand it"
        )
    raise SpecError(f"{type(model).__name__}'s forward takes no cache this demo knows")


def decode_steps(
    model: Any, cache: Any, first: int, tokens: int, new_tokens: int, on_first: Any = None
) -> list[int]:
    """Greedy generation from the cache of ``tokens`` tokens; ``first`` was sampled by prefill.
    Positions are always passed (some models, Bamba, ignore the cache's offset)."""
    import torch

    out = [first]
    with torch.no_grad():
        for i in range(new_tokens - 1):
            seen = (filler(model),) * (tokens + i) if _whole(model) else ()
            logits = _forward(model, _ids(model, (*seen, out[-1])), cache, tokens + i - len(seen))
            out.append(_sampled(model, logits))
            if i == 0 and on_first is not None:
                on_first()
    return out


# ---- the proof, before any process starts -------------------------------------------------

# 24 byte tokens in chunks of 16: two forwards, the second continuing the cache of the first
# and crossing the demo's sliding window (16); then two decode steps.
T = TypeVar("T")
PROOF_PROMPT = tuple(b"kvbridge proves it runs.")
PROOF_CHUNK = 16
_PROVEN: dict[str, CacheSpec] = {}


def describe(case: ModelCase) -> CacheSpec:
    """The CacheSpec of the cache HF builds for ``case``, from its config alone (no model
    built); SpecError, in one line, where the demo cannot describe it."""
    from kvbridge.demo.cachemap import cache_map

    return cache_map(case).spec


def prove(case: ModelCase, seed: int | None = None) -> CacheSpec:
    """SpecError, in one line, unless the demo's processes can run ``case``: its cache
    described, and (at the demo's size: a full-size model is only described, as building it
    twice would cost what the user gave the memory for) the model built and run on a few tokens
    as the reference runs the prompt (see the module docstring). Returns the CacheSpec; each
    case is proven once a process."""
    from kvbridge.demo.run import SEED

    seed = SEED if seed is None else seed
    key = repr((case, seed))
    if key not in _PROVEN:
        spec = describe(case)
        if not case.full_size:
            spec = _run(case, seed)
        _PROVEN[key] = spec
    return _PROVEN[key]


def proven(
    case: ModelCase,
    tied: Callable[[], ModelCase],
    run: Callable[[ModelCase], T] = prove,  # type: ignore[assignment]
) -> tuple[ModelCase, T]:
    """``case`` and what ``run`` (:func:`prove`, or the sweep's whole path) gives of it; where
    that is a refusal, the config scaled with its attention width tied to its hidden size as
    the config has them (``tied()``: :func:`kvbridge.demo.scaling.scaled`'s ``tie_width``)
    and what ``run`` gives of that, if it gives; else the first refusal."""
    try:
        return case, run(case)
    except SpecError as first:
        other = tied()
        if other.config == case.config:
            raise
        try:
            return other, run(other)
        except SpecError:
            raise first from None


def _run(case: ModelCase, seed: int) -> CacheSpec:
    import torch
    from transformers.utils import logging

    from kvbridge.demo import cache_io
    from kvbridge.demo.cachemap import cache_map

    n = len(PROOF_PROMPT)
    chunk = PROOF_CHUNK if case.chunked else n
    threads, verbosity = torch.get_num_threads(), logging.get_verbosity()
    torch.set_num_threads(1)  # as every demo process runs
    logging.set_verbosity_error()  # not "falling back to the PyTorch kernel", as in the workers
    try:
        model = build_model(case, seed)  # SpecError where transformers does not build it
        cmap = cache_map(case, model.config)
        weights_digest(model)  # what every process checks its weights by
        try:
            *_, (_, _, first, cache) = prefill_steps(model, PROOF_PROMPT, chunk)
            cache_io.check_filled(cmap, cache)
            cache_io.check_cache(cmap, cache, n)
            decode_steps(model, cache, first, n, 3)
        except SpecError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever transformers' forward raises
            raise SpecError(
                f"{case.name}: transformers' own forward fails on the demo's scaled config "
                f"({n} tokens in chunks of {chunk}, float32, eager attention): "
                f"{type(e).__name__}: {one_line(e)}"
            ) from None
    except SpecError:
        raise
    except Exception as e:  # noqa: BLE001 - the demo's own steps, on a model it built
        raise SpecError(
            f"{case.name}: the demo cannot run transformers' model of the scaled config: "
            f"{type(e).__name__}: {one_line(e)}"
        ) from None
    finally:
        torch.set_num_threads(threads)
        logging.set_verbosity(verbosity)
    return cmap.spec
