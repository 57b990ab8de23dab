"""The connector's scheduler half: which requests send, which receive, and what vLLM is told.

It lives in vLLM's engine-core process and talks to the workers only through the metadata it
builds each step (:class:`StepMeta`) and the completions the workers report. It imports
nothing of vLLM: requests are duck-typed (``request_id``, ``prompt_token_ids``,
``kv_transfer_params``, ``num_computed_tokens``, ``status``).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvbridge.integrations.vllm.params import (
    ConnectorOptions,
    ParamsError,
    PushRoom,
    RemotePrefill,
)

log = logging.getLogger("kvbridge.vllm")


Blocks = tuple[tuple[int, ...], ...]  # a request's block ids, per KV cache group


def blocks_of(block_ids: Any) -> Blocks:
    """vLLM's block ids, one list per KV cache group, as a tuple of tuples."""
    return tuple(tuple(int(b) for b in group) for group in block_ids)


@dataclass(frozen=True)
class SendJob:
    req_id: str
    room: int
    tokens: int
    block_ids: Blocks


@dataclass(frozen=True)
class RecvJob:
    """A load: tokens ``[start, remote.tokens)`` into the request's blocks. The blocks before
    ``start`` are the decode's own prefix-cache hit, shared with other requests: never
    written, never reported failed."""

    req_id: str
    remote: RemotePrefill
    block_ids: Blocks
    start: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.remote.tokens:
            raise ValueError(f"a load starts in [0, {self.remote.tokens}), got {self.start}")


@dataclass
class StepMeta:
    """What the workers learn this step (vLLM pickles it to them)."""

    sends: list[SendJob] = field(default_factory=list)  # computed: push them now
    # Computed during this step's forward: hand each layer over as it is computed.
    streams: list[SendJob] = field(default_factory=list)
    recvs: list[RecvJob] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # receives the decode engine gave up
    stream_aborts: list[str] = field(default_factory=list)  # streams whose request failed


class SchedulerSide:
    def __init__(
        self, options: ConnectorOptions, producer: bool, *, stream: bool = True, backoff: int = 0
    ) -> None:
        """``stream``: whether requests may be streamed layer by layer; not where vLLM keeps
        more than one batch in flight (pipeline parallel, async scheduling), since a later
        batch may then preempt a request, and reuse its blocks, while its layers are sent.
        ``backoff``: trailing prompt tokens the prefill does not compute (1 for models with
        Mamba layers: the decode instance recomputes the last prompt token, which would
        advance a transferred state twice; it needs the state before that token)."""
        self.options = options
        self.producer = producer
        self.stream = stream
        self.backoff = backoff
        self._next = StepMeta()
        self._receiving: set[str] = set()  # handed to the workers, not reported finished yet
        self._push: dict[str, int] = {}  # prefill requests whose decode leg waits: their room
        self._streaming: dict[str, SendJob] = {}  # streamed, the request not finished yet

    # ---- decode: the prompt's KV is external, loaded asynchronously ---------------------

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        remote = self._remote(request)
        if remote is None:
            return 0, False
        count = remote.tokens - num_computed
        log.debug(
            "request %s: %d tokens to load from room %d", request.request_id, count, remote.room
        )
        return (count, True) if count > 0 else (0, False)

    def arrived(self, request: Any) -> None:
        """A new request: a prefill request of a model with a backoff drops its last prompt
        tokens (the decode instance computes them), and asks one token."""
        params = request.kv_transfer_params
        if (
            not (self.producer and self.backoff and params and params.get("do_remote_decode"))
            or params.get("_kvbridge_backoff")
            or request.prompt_token_ids is None
            or len(request.prompt_token_ids) <= self.backoff
        ):
            return
        del request.prompt_token_ids[-self.backoff :]
        del request._all_token_ids[-self.backoff :]
        request.num_prompt_tokens -= self.backoff
        request.max_tokens = 1
        params["_kvbridge_backoff"] = self.backoff

    def after_alloc(self, request: Any, block_ids: Blocks, num_external: int) -> None:
        params = request.kv_transfer_params
        if self.producer:
            self._note_push(request)
            return
        remote = self._remote(request)
        if remote is None or num_external <= 0:
            return
        params["do_remote_prefill"] = False  # once: vLLM may call this twice per request
        # vLLM asks for the tokens past its local prefix-cache hit (matched_tokens): the load
        # is the prompt's last num_external tokens.
        start = max(0, remote.tokens - num_external)
        self._next.recvs.append(RecvJob(request.request_id, remote, blocks_of(block_ids), start))
        self._receiving.add(request.request_id)
        log.debug(
            "request %s: blocks allocated for room %d, loading tokens [%d, %d)",
            request.request_id,
            remote.room,
            start,
            remote.tokens,
        )

    def _remote(self, request: Any) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if self.producer or not params or not params.get("do_remote_prefill"):
            return None
        prompt = len(request.prompt_token_ids or ()) - self.backoff
        try:
            remote = RemotePrefill.from_params(params, prompt)
        except ParamsError as e:
            log.error("request %s: %s; computing its prompt here", request.request_id, e)
            return None
        if remote.tokens != prompt:
            log.error(
                "request %s: the prefill instance holds %d tokens, expected %d (the "
                "prompt's less %d this instance computes); computing its prompt here",
                request.request_id,
                remote.tokens,
                prompt,
                self.backoff,
            )
            return None
        return remote

    # ---- prefill: hold the blocks, push them, answer with where they are ----------------

    def _stops_short(self, params: Any) -> bool:
        """Whether a prefill request computes what the decode instance expects: all but the
        backoff's tokens (a prompt too short to drop them from is computed by the decode
        instance itself, which refuses a prefill answer holding them)."""
        return not self.backoff or bool(params.get("_kvbridge_backoff"))

    def _note_push(self, request: Any) -> None:
        """A prefill request whose decode leg was sent with it: remember the room the proxy
        chose (vLLM calls this at every allocation; the first one counts)."""
        params = request.kv_transfer_params
        if (
            not params
            or not params.get("do_remote_decode")
            or not self._stops_short(params)
            or request.request_id in self._push
            or request.request_id in self._streaming
        ):
            return
        try:
            push = PushRoom.from_params(params)
        except ParamsError as e:
            log.error("request %s: %s; its KV is not handed over", request.request_id, e)
            params["do_remote_decode"] = False
            return
        if push is not None:
            self._push[request.request_id] = push.room

    def finished(self, request: Any, block_ids: Blocks) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: per KV cache group."""
        req_id = request.request_id
        if req_id in self._receiving:
            # The decode engine gave up on a request still receiving: its blocks stay held
            # until the workers say no byte of it can land (they report it finished).
            self._next.aborts.append(req_id)
            return True, None
        computed = request.status.name in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
        streamed = self._streaming.pop(req_id, None)
        if streamed is not None:
            # Its senders exist and may be writing: the blocks stay held until they ended.
            if not computed:
                self._next.stream_aborts.append(req_id)
                return True, None
            return True, RemotePrefill(
                self.options.bootstrap, streamed.room, streamed.tokens
            ).to_params()
        room = self._push.pop(req_id, None)
        params = request.kv_transfer_params
        if (
            not self.producer
            or not params
            or not params.get("do_remote_decode")
            or not self._stops_short(params)
        ):
            return False, None
        if not any(block_ids) or not computed:
            return False, None  # aborted or errored: nothing to hand over
        room = secrets.randbits(63) if room is None else room
        tokens = int(request.num_computed_tokens)
        if tokens < 1:
            return False, None
        self._next.sends.append(SendJob(req_id, room, tokens, blocks_of(block_ids)))
        return True, RemotePrefill(self.options.bootstrap, room, tokens).to_params()

    # ---- every step ----------------------------------------------------------------------

    def build_meta(self, scheduled: Any = None) -> StepMeta:
        """This step's metadata; ``scheduled`` is vLLM's SchedulerOutput (duck-typed:
        ``scheduled_new_reqs``, ``num_scheduled_tokens``)."""
        if scheduled is not None and self._push and self.stream:
            self._stream(scheduled)
        meta, self._next = self._next, StepMeta()
        return meta

    def _stream(self, scheduled: Any) -> None:
        """Push requests whose whole prompt this step computes, and which end with it (one
        token, as the proxy asks), are streamed: their layers go as the forward computes
        them, into decode blocks already waiting. Any other (a prompt prefilled in chunks)
        is pushed once computed, from :meth:`finished`: a request that runs on could be
        preempted and its blocks reused while a layer-wise write still reads them."""
        for new in scheduled.scheduled_new_reqs:
            room = self._push.get(new.req_id)
            if room is None:
                continue
            if not new.prompt_token_ids:  # prompt embeddings: pushed once computed
                continue
            prompt = len(new.prompt_token_ids)
            done = new.num_computed_tokens + scheduled.num_scheduled_tokens.get(new.req_id, 0)
            sampling = new.sampling_params
            if (
                done < prompt
                or sampling is None
                or sampling.max_tokens != 1
                or getattr(sampling, "n", 1) != 1
            ):
                continue
            job = SendJob(new.req_id, room, prompt, blocks_of(new.block_ids))
            del self._push[new.req_id]
            self._streaming[new.req_id] = job
            self._next.streams.append(job)

    def workers_reported(self, finished_recving: set[str] | None) -> None:
        self._receiving -= set(finished_recving or ())
