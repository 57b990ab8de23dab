"""The bodies of the demo's processes: prefill ranks, decode ranks and the undisturbed reference.

Each rank is one process with its own :class:`~kvbridge.engine.Bridge`, exactly as an engine
embeds it. Every prefill rank runs the whole model on the prompt, chunk by chunk (standing in
for its TP/PP shard of the computation), writes its shard of each chunk's cache into its paged
pools as the chunk is computed, then hands the chunks to its sender one by one (so that the send
window times the transfer, not the model). Each decode rank receives into its pools; decode
rank 0 gathers the other decode ranks' pools, rebuilds the HF cache and generates; the others
only hold pools.

This module imports torch at import time: it runs only in worker processes (the parent reaches
it through :func:`kvbridge.demo.run.entry`). Every computation runs on one thread, so that the
reference and the workers do the same float operations in the same order.
"""

from __future__ import annotations

import inspect
import queue
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kvbridge.config import Settings
from kvbridge.demo import cache_io
from kvbridge.demo.deployment import ROOM, Job, build_side, chunks, placement
from kvbridge.demo.models import (
    CacheMap,
    ModelCase,
    build_model,
    cache_map,
    hf_config,
    preload,
    weights_digest,
)
from kvbridge.engine import Bridge
from kvbridge.errors import SpecError
from kvbridge.memory import HostPool
from kvbridge.placement import Placement
from kvbridge.plan import Side
from kvbridge.protocol import Role
from kvbridge.reference import fill

CANARY = 0xA5

preload()  # this module is imported once by the fork server: every rank forks warm


# ---- the model, as every process runs it ------------------------------------------------------


def _setup(case: ModelCase, seed: int, digest: str | None) -> tuple[Any, CacheMap]:
    torch.set_num_threads(1)
    model = build_model(case, seed)
    got = weights_digest(model)
    if digest is not None and got != digest:
        raise RuntimeError(f"this process built weights {got}, the reference {digest}")
    return model, cache_map(case, model.config)


def prefill_steps(model: Any, prompt: tuple[int, ...], chunk: int
                  ) -> Iterator[tuple[int, int, int, Any]]:
    """Chunked prefill: yields ``(start, stop, argmax of the last logits, cache)``."""
    from transformers.cache_utils import DynamicCache

    ids = torch.tensor([prompt])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for s, e in chunks(len(prompt), chunk):
            logits = model(ids[:, s:e], **{_cache_arg(model): cache},
                           position_ids=torch.arange(s, e)[None], use_cache=True).logits
            yield s, e, int(logits[0, -1].argmax()), cache


def _cache_arg(model: Any) -> str:
    """The keyword a model's forward takes its cache by (Mamba1: ``cache_params``)."""
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params else "cache_params"


def decode_steps(model: Any, cache: Any, first: int, tokens: int, new_tokens: int,
                 on_first: Any = None) -> list[int]:
    """Greedy generation from the cache of ``tokens`` tokens; ``first`` was sampled by prefill.
    Positions are always passed (some models, Bamba, ignore the cache's offset)."""
    out = [first]
    with torch.no_grad():
        for i in range(new_tokens - 1):
            logits = model(torch.tensor([[out[-1]]]), **{_cache_arg(model): cache},
                           position_ids=torch.tensor([[tokens + i]]), use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            if i == 0 and on_first is not None:
                on_first()
    return out


# ---- process bodies -------------------------------------------------------------------------


def reference_main(case: ModelCase, seed: int, prompt: tuple[int, ...], new_tokens: int,
                   chunk: int, out: Any) -> None:
    """The same model, undisturbed, in one process: the oracle of tokens and cache tensors."""
    try:
        model, cmap = _setup(case, seed, None)
        *_, (_, _, first, cache) = prefill_steps(model, prompt, chunk)
        cache_io.check_cache(cmap, cache, len(prompt))
        snap = cache_io.snapshot(cmap, cache)
        tokens = decode_steps(model, cache, first, len(prompt), new_tokens)
        out.put(("reference", {"spec": cmap.spec, "digest": weights_digest(model),
                               "snapshot": snap, "tokens": tokens}))
    except SpecError as e:  # a model the demo cannot run: said in one line, not a traceback
        out.put(("refused", str(e)))
    except BaseException:
        out.put(("error", "reference", 0, traceback.format_exc()))


def prefill_main(job: Job, rank: int, bootstrap: str, out: Any, go: Any, stop: Any) -> None:
    pool = None
    try:
        model, cmap = _setup(job.model, job.seed, job.digest)
        spec, n = cmap.spec, len(job.prompt)
        side = build_side(spec, job.prefill, n)
        pool = HostPool(side.memory.regions_of(side.parallel.layers_of(rank)), shared=False)
        views = {r.name: pool.view(r.name) for r in pool.regions()}
        garbage = np.random.default_rng(100 + rank)
        for v in views.values():  # bytes never written must never reach the decode side
            v[:] = garbage.integers(0, 256, len(v), dtype=np.uint8)
        where = placement(spec, job.prefill, n, decode=False)
        settings = Settings.from_env(**job.prefill_settings)
        with Bridge(role=Role.PREFILL, spec=spec, parallel=side.parallel, rank=rank,
                    memory=side.memory, regions=pool, transport=job.transport,
                    bootstrap=bootstrap, engine_id="prefill", settings=settings) as bridge:
            out.put(("ready", "prefill", rank))
            go.wait(job.timeout)
            sender = bridge.sender(ROOM, where)
            for s, e, first, cache in prefill_steps(model, job.prompt, job.chunk):
                last = e == n
                aux = cache_io.pack_aux(first, n, spec.aux_bytes) if last else \
                    np.zeros(spec.aux_bytes, dtype=np.uint8)
                fill(side, where, cache_io.hf_to_logical(cmap, cache, n, e, aux), {rank: views},
                     decode=False, token_range=range(s, e), with_tail=last, ranks=[rank])
            # Then hand the chunks over one by one, as they were computed: the send window
            # (and so GB/s) measures the transfer, not the model.
            first_send = time.monotonic()
            for _, e in chunks(n, job.chunk):
                sender.send(e)
            state = sender.wait(job.timeout)
            out.put(("result", "prefill", rank, {
                "state": state.name, "failure": str(sender.failure or ""),
                "send_seconds": time.monotonic() - first_send}))
            stop.wait(job.timeout)  # stay up (heart-beating, answering aborts) until told
    except BaseException:
        out.put(("error", "prefill", rank, traceback.format_exc()))
    finally:
        if pool is not None:
            pool.close()


def decode_main(job: Job, rank: int, bootstrap: str, out: Any, go: Any, stop: Any,
                gather: Any) -> None:
    pool = None
    try:
        torch.set_num_threads(1)
        if rank == 0:  # decode rank 0 runs the model for the whole decode side
            model, cmap = _setup(job.model, job.seed, job.digest)
        else:
            cmap = cache_map(job.model, hf_config(job.model))
        spec, n = cmap.spec, len(job.prompt)
        side = build_side(spec, job.decode, n)
        pool = HostPool(side.memory.regions_of(side.parallel.layers_of(rank)),
                        shared=job.transport == "shm")
        views = {r.name: pool.view(r.name) for r in pool.regions()}
        for v in views.values():
            v[:] = CANARY
        where = placement(spec, job.decode, n, decode=True)
        settings = Settings.from_env(**job.decode_settings)
        with Bridge(role=Role.DECODE, spec=spec, parallel=side.parallel, rank=rank,
                    memory=side.memory, regions=pool, transport=job.transport,
                    bootstrap=bootstrap, engine_id="decode", settings=settings) as bridge:
            out.put(("ready", "decode", rank))
            go.wait(job.timeout)
            receiver = bridge.receiver(ROOM)
            receiver.init(where)
            state = receiver.wait(job.timeout)
            result: dict[str, Any] = {"state": state.name,
                                      "failure": str(receiver.failure or "")}
            if rank != 0:
                gather.put((rank, state.name, {k: v.copy() for k, v in views.items()}))
                out.put(("result", "decode", rank, result))
            else:
                result.update(_generate(job, side, where, views, gather, model, cmap, state.name))
                out.put(("result", "decode", 0, result))
            stop.wait(job.timeout)
    except BaseException:
        out.put(("error", "decode", rank, traceback.format_exc()))
    finally:
        if pool is not None:
            pool.close()


def _generate(job: Job, side: Side, where: Placement, views: dict[str, np.ndarray],
              gather: Any, model: Any, cmap: CacheMap, state: str) -> dict[str, Any]:
    """Decode rank 0: gather every decode rank's pools, rebuild the HF cache, generate."""
    pools = {0: views}
    states = {0: state}
    end = time.monotonic() + job.timeout
    for _ in range(side.parallel.world - 1):
        try:
            r, st, regions = gather.get(timeout=max(0.1, end - time.monotonic()))
        except queue.Empty:
            return {"problem": "the other decode ranks did not hand over their pools in time"}
        pools[r], states[r] = regions, st
    bad = {r: s for r, s in states.items() if s != "SUCCESS"}
    if bad:
        return {"problem": f"decode ranks did not succeed: {bad}"}
    try:
        got = cache_io.read_received(side, where, pools)
    except ValueError as e:
        return {"problem": f"decode rank 0: {e}"}
    cache = cache_io.logical_to_hf(cmap, model.config, got)
    snap = cache_io.snapshot(cmap, cache)
    stamp: list[float] = []
    tokens = decode_steps(model, cache, got.first_token, got.tokens, job.new_tokens,
                          on_first=lambda: stamp.append(time.monotonic()))
    return {"tokens": tokens, "snapshot": snap, "problems": list(got.problems),
            "first_decoded": stamp[0] if stamp else None}
