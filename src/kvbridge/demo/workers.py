"""The bodies of the demo's processes: prefill ranks, decode ranks and the undisturbed reference.

Each rank is one process with its own :class:`~kvbridge.runtime.Bridge`, exactly as an engine
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

import queue
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kvbridge.config import Settings
from kvbridge.demo import cache_io, diagnosis, hfcache
from kvbridge.demo.cachemap import CacheMap, cache_map
from kvbridge.demo.deployment import IDLE, ROOM, Job, build_side, placement
from kvbridge.demo.forward import _cache_arg as _cache_arg
from kvbridge.demo.forward import decode_steps as decode_steps
from kvbridge.demo.forward import prefill_steps as prefill_steps
from kvbridge.demo.models import ModelCase, build_model, hf_config, preload, weights_digest
from kvbridge.demo.pools import RankPools
from kvbridge.errors import SpecError
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Side
from kvbridge.planner.reference import fill
from kvbridge.runtime import Bridge
from kvbridge.wire.protocol import Role

CANARY = 0xA5

preload()  # this module is imported once by the fork server: every rank forks warm


# ---- the model, as every process runs it ------------------------------------------------------


def _setup(case: ModelCase, seed: int, digest: str | None, device: str) -> tuple[Any, CacheMap]:
    torch.set_num_threads(1)
    model = build_model(case, seed)
    got = weights_digest(model)
    if digest is not None and got != digest:
        raise RuntimeError(f"this process built weights {got}, the reference {digest}")
    return model.to(device), cache_map(case, model.config)


# ---- process bodies -------------------------------------------------------------------------


def reference_main(
    case: ModelCase,
    seed: int,
    prompt: tuple[int, ...],
    new_tokens: int,
    chunk: int,
    out: Any,
    device: str = "cpu",
) -> None:
    """The same model, undisturbed, in one process (on the device the case runs on): the
    oracle of tokens and cache tensors."""
    try:
        model, cmap = _setup(case, seed, None, device)
        *_, (_, _, first, cache) = prefill_steps(model, prompt, chunk)
        cache_io.check_filled(cmap, cache)
        cache_io.check_cache(cmap, cache, len(prompt))
        snap = cache_io.snapshot(cmap, cache)
        tokens = decode_steps(model, cache, first, len(prompt), new_tokens)
        out.put(
            (
                "reference",
                {
                    "spec": cmap.spec,
                    "digest": weights_digest(model),
                    "snapshot": snap,
                    "tokens": tokens,
                },
            )
        )
    except SpecError as e:  # a model the demo cannot run: said in one line, not a traceback
        out.put(("refused", str(e)))
    except BaseException:
        out.put(("error", "reference", 0, traceback.format_exc()))


def prefill_main(
    job: Job, index: int, bootstrap: str, out: Any, go: Any, stop: Any, inboxes: list[Any]
) -> None:
    """Prefill process ``index`` (DP group ``index // world``, engine rank ``index % world``).
    Only the group holding the request (``job.prefill_group``) computes and sends it; the
    others run as idle engines of the deployment."""
    pool = None
    try:
        model, cmap = _setup(job.model, job.seed, job.digest, job.device)
        spec, n = cmap.spec, len(job.prompt)
        side = build_side(spec, job.prefill, n)
        group, rank = divmod(index, side.parallel.world)
        pool = RankPools(side.memory.regions_of(side.parallel.layers_of(rank)), job.device)
        # Bytes never written must never reach the decode side.
        pool.fill(rng=np.random.default_rng(100 + index))
        where = placement(spec, job.prefill, n, decode=False)
        settings = Settings.from_env(**job.prefill_settings)
        with Bridge(
            role=Role.PREFILL,
            spec=spec,
            parallel=side.parallel,
            rank=rank,
            memory=side.memory,
            regions=pool.registered(),
            transport=job.transport,
            bootstrap=bootstrap,
            engine_id="prefill",
            settings=settings,
            dp=job.prefill.dp,
            dp_rank=group,
        ) as bridge:
            diagnosis.watch(bridge)
            out.put(("ready", "prefill", index))
            go.wait(job.timeout)
            if group != job.prefill_group:
                out.put(("result", "prefill", index, {"state": IDLE}))
                stop.wait(job.timeout)
                return
            sender = bridge.sender(ROOM, where)
            relay = _Relay(side, index, inboxes) if side.parallel.tokens.shards > 1 else None
            stream = _LayerStream(model, cmap, side, rank, pool, where, sender)
            try:
                for s, e, first, _ in _my_pieces(model, job, relay, stream.begin):
                    stream.end(s, e, first)
                stream.finish()
            finally:
                stream.close()
            first_send = stream.first_send or time.monotonic()
            state = sender.wait(job.timeout)
            out.put(
                (
                    "result",
                    "prefill",
                    index,
                    {
                        "state": state.name,
                        "failure": str(sender.failure or ""),
                        "send_seconds": time.monotonic() - first_send,
                        "sends": stream.sends,
                    },
                )
            )
            stop.wait(job.timeout)  # stay up (heart-beating, answering aborts) until told
    except BaseException:
        out.put(("error", "prefill", index, traceback.format_exc()))
    finally:
        if pool is not None:
            pool.close()


class _LayerStream:
    """Layer-wise sends, as a serving engine streams its prefill: a forward hook on every
    decoder layer writes the layer's shard of the chunk (its KV, and on the last chunk its
    state) into the pools and hands those layers to the sender at once, so the transfer of
    layer i overlaps the compute of layer i + 1. The last chunk's last layer waits for the
    logits: the aux slot (the sampled token) travels with it. Tokens this rank does not hold
    (context parallel) are handed over without bytes, in order."""

    def __init__(
        self,
        model: Any,
        cmap: CacheMap,
        side: Side,
        rank: int,
        pool: RankPools,
        where: Placement,
        sender: Any,
    ) -> None:
        self.cmap, self.side, self.rank, self.pool = cmap, side, rank, pool
        self.views = pool.views
        self.where, self.sender, self.n = where, sender, where.tokens
        self.mine = side.parallel.layers_of(rank)
        self.hooks = hfcache.LayerHooks(
            model, [hf.hf_index for hf in cmap.layers], self.mine, self.after
        )
        # this rank's last decoder layer (-1: none hooked, every layer sent after the forward)
        self.final = max(self.hooks.by_decoder, default=-1)
        self.chunk, self.sent = (0, 0), 0
        self.first_send: float | None = None
        self.sends = 0  # calls to sender.send: one per layer group and chunk

    def begin(self, start: int, stop: int, cache: Any) -> None:
        if start > self.sent:  # tokens another CP group holds: nothing of them here
            self._send(start)
        self.chunk, self.hooks.cache, self.sent = (start, stop), cache, stop

    def after(self, decoder_layer: int, layers: list[int]) -> None:
        s, e = self.chunk
        aux = np.zeros(self.cmap.spec.aux_bytes, dtype=np.uint8)
        fill(
            self.side,
            self.where,
            cache_io.hf_to_logical(self.cmap, self.hooks.cache, self.n, e, aux, layers),
            {self.rank: self.views},
            decode=False,
            token_range=range(s, e),
            with_tail=e == self.n,
            ranks=[self.rank],
            layers=layers,
            with_aux=False,
        )
        if e == self.n and decoder_layer == self.final:
            return  # with the aux slot, once the logits say which token came first
        self._send(e, range(layers[0], layers[-1] + 1))

    def end(self, start: int, stop: int, first: int) -> None:
        if not self.hooks.layerwise:  # the forward is done: every layer of the chunk now
            self.after(self.final, list(self.mine))
        if stop == self.n:
            aux = cache_io.pack_aux(first, self.n, self.cmap.spec.aux_bytes)
            fill(
                self.side,
                self.where,
                cache_io.hf_to_logical(self.cmap, self.hooks.cache, self.n, stop, aux, []),
                {self.rank: self.views},
                decode=False,
                token_range=range(0),
                layers=[],
                ranks=[self.rank],
            )
            self._send(stop)  # the layers still held back: the last one, with aux

    def finish(self) -> None:
        if self.sent < self.n:  # the last tokens are another CP group's
            self._send(self.n)

    def close(self) -> None:
        self.hooks.remove()

    def _send(self, stop: int, layers: range | None = None) -> None:
        if self.first_send is None:
            self.first_send = time.monotonic()
        mine = self.side.parallel.layers_of(self.rank) if layers is None else layers
        regions = [r.name for r in self.side.memory.regions_of(mine)]
        self.sender.send(stop, layers=layers, wait_event=self.pool.upload(regions))
        self.sends += 1


class _Relay:
    """Context-parallel prefill, as "partial query, full KV" computes it: each token shard's
    rank computes its own pieces of the prompt, attending over the KV (and, for recurrent
    layers, starting from the state) of every earlier token, which the rank that computed them
    hands over. The pieces are computed in order, one rank after the other: the values are
    CP's, the overlap is not (a real engine runs the ranks in lock-step, layer by layer)."""

    def __init__(self, side: Side, index: int, inboxes: list[Any]) -> None:
        self.par = side.parallel
        self.group_base = index - index % self.par.world
        stage, cp_rank, tp_rank = self.par.coords(index % self.par.world)
        self.stage, self.tp_base = stage, tp_rank - tp_rank % self.par.dcp
        self.shard = self.par.shard(cp_rank, tp_rank)
        self.inboxes = inboxes
        self.index = index

    def peer(self, shard: int) -> Any:
        """The inbox of the rank of ``shard`` that shares this rank's TP group and stage."""
        cp_rank, j = divmod(shard, self.par.dcp)
        return self.inboxes[
            self.group_base + self.par.engine_rank(self.stage, self.tp_base + j, cp_rank)
        ]


def _my_pieces(
    model: Any, job: Job, relay: _Relay | None, before: Any
) -> Iterator[tuple[int, int, int, Any]]:
    """The chunks this rank computes: every chunk without context parallelism; with it, the
    chunks of this rank's pieces, each continuing from the cache of the tokens before it.
    ``before(start, stop, cache)`` is called before each chunk's forward."""
    if relay is None:
        yield from prefill_steps(model, job.prompt, job.chunk, before=before)
        return
    n = len(job.prompt)
    cmap = cache_map(job.model, model.config)
    pieces = relay.par.tokens.pieces(n)
    cache = hfcache.new_cache(model.config, job.device)
    for i, (s, e, shard) in enumerate(pieces):
        if shard != relay.shard:
            continue
        if i > 0 and pieces[i - 1][2] != relay.shard:  # the tokens before came from another
            got = relay.inboxes[relay.index].get(timeout=job.timeout)
            cache = (
                hfcache.new_cache(model.config, job.device)
                if job.forget_handover
                else cache_io.logical_to_hf(cmap, model.config, got, job.device)
            )
        yield from prefill_steps(model, job.prompt, job.chunk, cache, s, e, before)
        if i + 1 < len(pieces) and pieces[i + 1][2] != relay.shard:
            relay.peer(pieces[i + 1][2]).put(cache_io.received(cmap, cache, e))


def decode_main(
    job: Job, index: int, bootstrap: str, out: Any, go: Any, stop: Any, gather: Any
) -> None:
    """Decode process ``index`` (DP group ``index // world``, engine rank ``index % world``).
    Only the group the request lives in (``job.decode_group``) receives it; it is not told
    which prefill group holds it: the bootstrap service is."""
    pool = None
    try:
        torch.set_num_threads(1)
        cmap = cache_map(job.model, hf_config(job.model))
        spec, n = cmap.spec, len(job.prompt)
        side = build_side(spec, job.decode, n)
        group, rank = divmod(index, side.parallel.world)
        head = rank == 0 and group == job.decode_group  # runs the model for the decode side
        if head:
            model, cmap = _setup(job.model, job.seed, job.digest, job.device)
        pool = RankPools(
            side.memory.regions_of(side.parallel.layers_of(rank)),
            job.device,
            shared=job.transport == "shm",
        )
        views = pool.views
        pool.fill(CANARY)
        where = placement(spec, job.decode, n, decode=True)
        settings = Settings.from_env(**job.decode_settings)
        with Bridge(
            role=Role.DECODE,
            spec=spec,
            parallel=side.parallel,
            rank=rank,
            memory=side.memory,
            regions=pool.registered(),
            transport=job.transport,
            bootstrap=bootstrap,
            engine_id="decode",
            settings=settings,
            dp=job.decode.dp,
            dp_rank=group,
        ) as bridge:
            diagnosis.watch(bridge)
            out.put(("ready", "decode", index))
            go.wait(job.timeout)
            if group != job.decode_group:
                out.put(("result", "decode", index, {"state": IDLE}))
                stop.wait(job.timeout)
                return
            receiver = bridge.receiver(ROOM)
            receiver.init(where)
            state = receiver.wait(job.timeout)
            pool.download()
            result: dict[str, Any] = {"state": state.name, "failure": str(receiver.failure or "")}
            if not head:
                gather.put((rank, state.name, {k: v.copy() for k, v in views.items()}))
                out.put(("result", "decode", index, result))
            else:
                result.update(_generate(job, side, where, views, gather, model, cmap, state.name))
                out.put(("result", "decode", index, result))
            stop.wait(job.timeout)
    except BaseException:
        out.put(("error", "decode", index, traceback.format_exc()))
    finally:
        if pool is not None:
            pool.close()


def _generate(
    job: Job,
    side: Side,
    where: Placement,
    views: dict[str, np.ndarray],
    gather: Any,
    model: Any,
    cmap: CacheMap,
    state: str,
) -> dict[str, Any]:
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
    cache = cache_io.logical_to_hf(cmap, model.config, got, job.device)
    snap = cache_io.snapshot(cmap, cache)
    stamp: list[float] = []
    tokens = decode_steps(
        model,
        cache,
        got.first_token,
        got.tokens,
        job.new_tokens,
        on_first=lambda: stamp.append(time.monotonic()),
    )
    return {
        "tokens": tokens,
        "snapshot": snap,
        "problems": list(got.problems),
        "first_decoded": stamp[0] if stamp else None,
    }
