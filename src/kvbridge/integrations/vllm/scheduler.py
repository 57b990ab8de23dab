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

from kvbridge.integrations.vllm.params import ConnectorOptions, ParamsError, RemotePrefill

log = logging.getLogger("kvbridge.vllm")


@dataclass(frozen=True)
class SendJob:
    req_id: str
    room: int
    tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class RecvJob:
    req_id: str
    remote: RemotePrefill
    block_ids: tuple[int, ...]


@dataclass
class StepMeta:
    """What the workers learn this step (vLLM pickles it to them)."""

    sends: list[SendJob] = field(default_factory=list)
    recvs: list[RecvJob] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # receives the decode engine gave up


class SchedulerSide:
    def __init__(self, options: ConnectorOptions, producer: bool) -> None:
        self.options = options
        self.producer = producer
        self._next = StepMeta()
        self._receiving: set[str] = set()  # handed to the workers, not reported finished yet

    # ---- decode: the prompt's KV is external, loaded asynchronously ---------------------

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        remote = self._remote(request)
        if remote is None:
            return 0, False
        count = remote.tokens - num_computed
        log.debug("request %s: %d tokens to load from room %d", request.request_id, count,
                  remote.room)
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, block_ids: list[int], num_external: int) -> None:
        params = request.kv_transfer_params
        remote = self._remote(request)
        if remote is None or num_external <= 0:
            return
        params["do_remote_prefill"] = False  # once: vLLM may call this twice per request
        self._next.recvs.append(RecvJob(request.request_id, remote, tuple(block_ids)))
        self._receiving.add(request.request_id)
        log.debug("request %s: %d blocks allocated for room %d", request.request_id,
                  len(block_ids), remote.room)

    def _remote(self, request: Any) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if self.producer or not params or not params.get("do_remote_prefill"):
            return None
        try:
            remote = RemotePrefill.from_params(params)
        except ParamsError as e:
            log.error("request %s: %s; computing its prompt here", request.request_id, e)
            return None
        prompt = len(request.prompt_token_ids or ())
        if remote.tokens != prompt:
            log.error("request %s: the prefill instance holds %d tokens, the prompt has %d; "
                      "computing its prompt here", request.request_id, remote.tokens, prompt)
            return None
        return remote

    # ---- prefill: hold the blocks, push them, answer with where they are ----------------

    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if req_id in self._receiving:
            # The decode engine gave up on a request still receiving: its blocks stay held
            # until the workers say no byte of it can land (they report it finished).
            self._next.aborts.append(req_id)
            return True, None
        params = request.kv_transfer_params
        if not self.producer or not params or not params.get("do_remote_decode"):
            return False, None
        if not block_ids or request.status.name not in ("FINISHED_LENGTH_CAPPED",
                                                        "FINISHED_STOPPED"):
            return False, None  # aborted or errored: nothing to hand over
        room = secrets.randbits(63)
        tokens = int(request.num_computed_tokens)
        self._next.sends.append(SendJob(req_id, room, tokens, tuple(block_ids)))
        return True, RemotePrefill(self.options.bootstrap, room, tokens).to_params()

    # ---- every step ----------------------------------------------------------------------

    def build_meta(self) -> StepMeta:
        meta, self._next = self._next, StepMeta()
        return meta

    def workers_reported(self, finished_recving: set[str] | None) -> None:
        self._receiving -= set(finished_recving or ())
