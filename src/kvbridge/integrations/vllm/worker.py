"""The connector's worker half: one kvbridge :class:`~kvbridge.runtime.Bridge` per vLLM worker
rank, over the engine's own KV tensors (wrapped in place, never copied).

It translates vLLM's vocabulary and nothing more: layers and tensors into a
:class:`~kvbridge.model.spec.CacheSpec` and a :class:`~kvbridge.planner.layout.SideMemory`; block
ids into a :class:`~kvbridge.planner.placement.Placement`; kvbridge's states into vLLM's
finished/failed sets. Which bytes go where is the planner's business.

A failed receive is reported to vLLM only once its blocks are ``released`` (no byte of it can
land any more): vLLM then recomputes or fails the request (its ``kv_load_failure_policy``)
and may reuse the blocks. Until then the request waits, quarantined, in vLLM's
WAITING_FOR_REMOTE_KVS state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvbridge.bootstrap import BootstrapServer
from kvbridge.config import Settings
from kvbridge.errors import KVBridgeError, LayoutError, PlacementError
from kvbridge.integrations.affinity import any_core
from kvbridge.integrations.vllm.describe import WorkerPlace, describe
from kvbridge.integrations.vllm.params import ConnectorOptions
from kvbridge.integrations.vllm.scheduler import Blocks, RecvJob, SendJob, StepMeta
from kvbridge.memory.device import DevicePool, tensors_location
from kvbridge.memory.location import HOST
from kvbridge.memory.pools import HostPool, wrap_address
from kvbridge.planner.layout import AUX
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.placement import Placement
from kvbridge.runtime import Bridge, Receiver, Sender
from kvbridge.runtime.status import KVPoll
from kvbridge.wire.protocol import Role

log = logging.getLogger("kvbridge.vllm")
_SLOW = 0.5  # seconds of kvbridge work in an engine step worth a warning


def tail_blocks(
    tokens: int, block_size: int, pages: Sequence[Sequence[Any]], block_ids: Blocks, start: int = 0
) -> list[tuple[Any, int]]:
    """(tensor, block id) of the last block of a ``tokens``-token load where it is partly
    filled, for each attention tensor of each group (``pages``: per group, none for a state
    group); a sliding-window group's table keeps null blocks before its window, never in
    its last. Nothing where the load starts inside that block: its rows before ``start`` are
    held tokens (a prefix hit), never cleared."""
    last, partial = divmod(tokens, block_size)
    if not partial or start > last * block_size:
        return []
    return [
        (t, ids[last])
        for tensors, ids in zip(pages, block_ids, strict=True)
        if last < len(ids)
        for t in tensors
    ]


def own_blocks(rj: RecvJob, block_size: int) -> list[int]:
    """The blocks a failed load reports to vLLM: those it was to write, from the one holding
    its first token; never the prefix-cache hit's before them, which other requests share
    (vLLM would fail or recompute every request holding a block reported). Only for a single
    KV cache group: vLLM takes block-level failures from no other model."""
    if len(rj.block_ids) != 1:
        return []
    return list(rj.block_ids[0][rj.start // block_size :])


def _send_rest(s: Sender, written: Any) -> None:
    """Hand over every token and layer of a computed request not handed over yet
    (``written``: the CUDA event behind the forward's writes, None for host KV)."""
    try:
        if s.unsent():
            s.send(s.tokens, wait_event=written)
    except KVBridgeError as e:
        s.abort(f"not handed over: {e}")


class WorkerSide:
    def __init__(self, options: ConnectorOptions, place: WorkerPlace, producer: bool) -> None:
        self.options = options
        self.place = place
        self.producer = producer
        self.bridge: Bridge | None = None
        self.bootstrap: BootstrapServer | None = None
        self._aux: HostPool | DevicePool | None = None
        self._location = HOST  # where vLLM keeps the KV: the host, or a CUDA device
        self._free_aux: list[int] = []
        self._sending: dict[str, Sender] = {}
        self._recving: dict[str, tuple[Receiver, int, RecvJob]] = {}
        self._load_errors: set[int] = set()
        self._groups: tuple[tuple[str, bool], ...] = ()  # per vLLM group: table, is a state
        self._layers: Mapping[str, int] = {}  # vLLM layer name -> spec layer
        self._pages: tuple[tuple[Any, ...], ...] = ()  # per vLLM group: its attention tensors
        self._block_size = 0
        self._refused: set[str] = set()  # receives that could not start
        self._unsent: set[str] = set()  # sends that could not start
        self._step: list[Sender] = []  # the senders this step's forward streams
        # Streamed requests vLLM has not finished yet: reported only once it has (vLLM frees
        # a request's blocks when told its send ended, even while the request runs).
        self._running: set[str] = set()

    # ---- memory ------------------------------------------------------------------------

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        """Describe the engine's KV tensors and start this rank's bridge over them."""
        place, opts = self.place, self.options
        d = describe(kv_caches, place, opts.layout, opts.aux_slots)
        self._groups, self._layers = d.groups, d.layers
        self._pages, self._block_size = d.pages, d.block_size
        # On a GPU the aux slots are device memory too: cudaipc moves nothing else.
        self._location = where = tensors_location(kv_caches.values())
        aux = [d.memory.region(AUX)]
        self._aux = DevicePool(aux, where) if where.is_device else HostPool(aux, shared=False)
        regions = [
            wrap_address(name, ptr, nbytes, location=where) for name, ptr, nbytes in d.regions
        ] + list(self._aux.regions())
        self._free_aux = list(range(opts.aux_slots))
        rank = place.pp_rank * place.tp + place.tp_rank
        with any_core():
            if self.producer and opts.serve_bootstrap and rank == 0:
                host, _, port = opts.bootstrap.rpartition(":")
                token = Settings.from_env().token or None
                self.bootstrap = BootstrapServer(host, int(port), token).start()
            self.bridge = Bridge(
                role=Role.PREFILL if self.producer else Role.DECODE,
                spec=d.spec,
                parallel=ParallelLayout(place.tp, d.pp_ranges),
                rank=rank,
                memory=d.memory,
                regions=regions,
                transport=opts.transport,
                bootstrap=opts.bootstrap,
                engine_id=place.engine_id,
            ).start()
        log.info(
            "kvbridge %s rank %d: %d tensors in %d groups, %d blocks of %d, %s layout, %s",
            "prefill" if self.producer else "decode",
            rank,
            len(kv_caches),
            len(d.groups),
            d.num_blocks,
            d.block_size,
            d.layout.value,
            opts.transport,
        )

    def placement(self, tokens: int, block_ids: Blocks, aux: int, start: int = 0) -> Placement:
        """A request's blocks, per vLLM group: pages of attention groups, the last block of a
        Mamba group (the request's state); ``start``: the first token to load (the blocks
        before it are a prefix-cache hit)."""
        given = list(zip(self._groups, block_ids, strict=False))
        if len(block_ids) != len(self._groups) or any(
            state and not ids for (_, state), ids in given
        ):
            raise PlacementError(
                f"block ids for {len(block_ids)} KV cache groups "
                f"({[len(ids) for ids in block_ids]} blocks), expected "
                f"{len(self._groups)} with a block in each state group"
            )
        pages = {g: np.array(ids, dtype=np.int64) for (g, state), ids in given if not state}
        slots = {g: ids[-1] for (g, state), ids in given if state}
        return Placement(tokens, pages, {**slots, "aux": aux}, start)

    # ---- every step ----------------------------------------------------------------------

    def start(self, meta: StepMeta) -> None:
        """Start what the scheduler handed over this step: pushes and receives."""
        b = self.bridge
        if b is None:
            raise LayoutError("the connector's KV caches were never registered")
        if meta.sends or meta.recvs or meta.aborts or meta.stream_aborts or self._step:
            t0 = time.monotonic()
            with any_core():  # a new link starts a thread
                self._start(b, meta)
            if time.monotonic() - t0 > _SLOW:  # the engine's step waits for this
                log.warning(
                    "starting %d sends and %d receives took %.1f s",
                    len(meta.sends),
                    len(meta.recvs),
                    time.monotonic() - t0,
                )

    def begin_step(self, meta: StepMeta) -> None:
        """Before the forward: a sender for each request it streams (its layers are handed
        over by :meth:`layer_saved`)."""
        if self.bridge is None or not meta.streams:
            return
        with any_core():  # a new link starts a thread
            for job in meta.streams:
                self._running.add(job.req_id)
                s = self._sender(self.bridge, job)
                if s is not None:
                    self._step.append(s)
                    log.debug("request %s: streaming room %d layer by layer", job.req_id, job.room)

    def layer_saved(self, layer_name: str) -> None:
        """Layer ``layer_name`` of this step's tokens is in the cache."""
        if not self._step:
            return
        li = self._layers.get(layer_name)
        if li is None:
            return
        layers, written = range(li, li + 1), self._written()
        for s in self._step:
            try:
                s.send(s.tokens, layers=layers, wait_event=written)
            except KVBridgeError as e:  # a layer vLLM saved twice, or one not this rank's
                s.abort(f"layer-wise send of {layer_name}: {e}")

    def _written(self) -> Any:
        """A CUDA event recorded now on the engine's current stream, behind every write of
        the forward queued so far (None for host KV): a send reads nothing before it."""
        if not self._location.is_device:
            return None
        import torch

        event = torch.cuda.Event()
        event.record()
        return event

    def _sender(self, b: Bridge, job: SendJob) -> Sender | None:
        # A request kvbridge refuses (bad block ids, a closed bridge...) fails alone: vLLM
        # frees or recomputes it; the engine goes on.
        try:
            s = b.sender(job.room, self.placement(job.tokens, job.block_ids, 0))
        except KVBridgeError as e:
            log.error("request %s: KV not handed over: %s", job.req_id, e)
            self._unsent.add(job.req_id)
            return None
        self._sending[job.req_id] = s
        log.debug("request %s: sending room %d, %d tokens", job.req_id, job.room, job.tokens)
        return s

    def _start(self, b: Bridge, meta: StepMeta) -> None:
        # The forward has ended: what a stream's layer hooks did not hand over goes now (a
        # layer vLLM computed without calling save_kv_layer).
        written = self._written()
        for s in self._step:
            _send_rest(s, written)
        self._step = []
        for req_id in meta.stream_aborts:
            if req_id in self._sending:
                self._sending[req_id].abort("the prefill engine failed the request")
        for job in meta.sends:
            sender = self._sender(b, job)
            if sender is not None:
                _send_rest(sender, written)
        for rj in meta.recvs:
            if not self._free_aux:
                self._refuse(
                    rj,
                    f"all {self.options.aux_slots} aux slots are receiving; "
                    f"raise aux_slots in kv_connector_extra_config",
                )
                continue
            slot = self._free_aux.pop()
            r: Receiver | None = None
            try:
                p = self.placement(rj.remote.tokens, rj.block_ids, slot, rj.start)
                self._clear_tail(rj)
                r = b.receiver(rj.remote.room, rj.remote.bootstrap)
                r.init(p)
            except KVBridgeError as e:
                # A refused placement was never sent: no prefill rank writes into it.
                if r is not None:
                    r.abort(f"refused: {e}")
                self._free_aux.append(slot)
                self._refuse(rj, str(e))
                continue
            self._recving[rj.req_id] = (r, slot, rj)
            log.debug(
                "request %s: receiving room %d from %s, tokens [%d, %d)",
                rj.req_id,
                rj.remote.room,
                rj.remote.bootstrap,
                rj.start,
                rj.remote.tokens,
            )
        for req_id in meta.aborts:
            got = self._recving.get(req_id)
            if got is not None and not got[0].poll().terminal:
                got[0].abort("the decode engine finished the request while it was receiving")

    def _clear_tail(self, rj: RecvJob) -> None:
        """Zero the last, partly loaded attention block of each group, before any byte lands.

        vLLM zeroes a request's new full-attention blocks, but not those a connector loads:
        the rows after the prompt's in the last one keep what the block held before, and
        vLLM's CPU attention weights masked positions by 0: 0 x NaN is NaN. Stale bytes are
        NaNs often enough where attention and state blocks share memory (a bf16 view of a
        float32 state: seen as a hybrid decode generating NaN logprobs)."""
        cleared = [
            t[b].zero_()
            for t, b in tail_blocks(
                rj.remote.tokens, self._block_size, self._pages, rj.block_ids, rj.start
            )
        ]
        if any(t.is_cuda for t in cleared):
            # Queued on the stream: done before the placement goes out and a peer writes.
            import torch

            torch.cuda.synchronize()

    def _refuse(self, rj: RecvJob, why: str) -> None:
        log.error("request %s: KV load failed: %s", rj.req_id, why)
        self._refused.add(rj.req_id)
        self._failed_blocks(rj)

    def results(self, finished: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call;
        ``finished``: the requests vLLM finished since the last step."""
        self._running -= finished
        # (a failed request's blocks are vLLM's again only once no write of it reads them)
        sent = {rid for rid, s in self._sending.items() if s.poll().terminal and s.released}
        sent |= self._unsent
        sent -= self._running
        self._unsent -= sent
        for rid in sent & set(self._sending):
            s = self._sending.pop(rid)
            if s.poll() is KVPoll.FAILED:
                log.warning("request %s: KV not handed over: %s", rid, s.failure)
        received, failed = set(self._refused), set(self._refused)
        self._refused.clear()
        for rid, (r, slot, rj) in list(self._recving.items()):
            state = r.poll()
            if state is KVPoll.SUCCESS:
                received.add(rid)
                log.debug(
                    "request %s: loaded tokens [%d, %d) of room %d: %d bytes",
                    rid,
                    rj.start,
                    rj.remote.tokens,
                    rj.remote.room,
                    r.received_bytes,
                )
            elif state is KVPoll.FAILED and r.released:
                log.warning("request %s: KV load failed: %s", rid, r.failure)
                received.add(rid)
                failed.add(rid)
                self._failed_blocks(rj)
            else:
                continue
            del self._recving[rid]
            self._free_aux.append(slot)
        return sent, received, failed

    def _failed_blocks(self, rj: RecvJob) -> None:
        # vLLM takes failed block ids with one KV cache group only (a hybrid model's
        # requests fail whole, from failed_recving).
        self._load_errors.update(own_blocks(rj, self._block_size))

    def stats(self) -> dict[str, Any]:
        """kvbridge's metrics since the last call (vLLM's connector stats, each step). vLLM
        sums its workers': bytes add up across ranks, but every rank sees each request end,
        so requests and their times come from rank 0 alone."""
        if self.bridge is None:
            return {"counters": {}, "observations": {}}
        data = self.bridge.metrics.drain()
        if self.bridge.rank != 0:
            data["counters"] = {
                k: v for k, v in data["counters"].items() if not k.startswith("requests|")
            }
            data["observations"] = {}
        return data

    def load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        if self.bridge is not None:
            self.bridge.close()
        if self.bootstrap is not None:
            self.bootstrap.stop()
        if self._aux is not None:
            self._aux.close()
