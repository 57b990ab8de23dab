"""The vLLM connector's scheduler half and its parameters, without vLLM: what it hands the
workers and what it tells vLLM, for requests as vLLM's scheduler shows them (duck-typed)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvbridge.integrations.vllm.memory import VllmLayout
from kvbridge.integrations.vllm.params import (
    ConnectorOptions,
    ParamsError,
    PushRoom,
    RemotePrefill,
)
from kvbridge.integrations.vllm.scheduler import RecvJob, SchedulerSide
from kvbridge.integrations.vllm.worker import own_blocks


class Status(enum.Enum):  # the names of vLLM's RequestStatus that matter here
    FINISHED_STOPPED = 1
    FINISHED_LENGTH_CAPPED = 2
    FINISHED_ABORTED = 3


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int = 0
    status: Status = Status.FINISHED_LENGTH_CAPPED
    extra: dict[str, Any] = field(default_factory=dict)


OPTIONS = ConnectorOptions(bootstrap="10.0.0.5:9000")


def test_prefill_holds_the_blocks_and_answers_where_they_wait() -> None:
    side = SchedulerSide(OPTIONS, producer=True)
    req = Request("a", list(range(70)), {"do_remote_decode": True}, num_computed_tokens=70)
    delay, params = side.finished(req, ([4, 9, 2],))
    assert delay and params is not None
    remote = RemotePrefill.from_params(params)
    assert (remote.bootstrap, remote.tokens) == ("10.0.0.5:9000", 70)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    (job,) = side.build_meta().sends
    assert (job.req_id, job.room, job.tokens, job.block_ids) == ("a", remote.room, 70, ((4, 9, 2),))
    assert side.build_meta().sends == []  # handed over once


@pytest.mark.parametrize(
    "req",
    [
        Request("aborted", [1, 2], {"do_remote_decode": True}, 2, Status.FINISHED_ABORTED),
        Request("plain", [1, 2], None, 2),
        Request("no-blocks", [1, 2], {"do_remote_decode": True}, 2),
    ],
)
def test_prefill_hands_over_nothing_it_should_not(req: Request) -> None:
    side = SchedulerSide(OPTIONS, producer=True)
    blocks = [] if req.request_id == "no-blocks" else [1]
    assert side.finished(req, (blocks,)) == (False, None)
    assert side.build_meta().sends == []


def remote_request(tokens: int = 70, prompt: int = 70) -> Request:
    params = RemotePrefill("10.0.0.5:9000", 77, tokens).to_params()
    return Request("d", list(range(prompt)), params)


def test_decode_loads_the_prompt_asynchronously_into_its_blocks_once() -> None:
    side = SchedulerSide(OPTIONS, producer=False)
    req = remote_request()
    assert side.matched_tokens(req, 0) == (70, True)
    assert side.matched_tokens(req, 64) == (6, True)  # a local prefix hit
    side.after_alloc(req, ([3, 1],), 70)
    side.after_alloc(req, ([3, 1],), 70)  # vLLM may call it twice: one receive
    (job,) = side.build_meta().recvs
    assert (job.req_id, job.remote.room, job.remote.tokens, job.block_ids) == (
        "d",
        77,
        70,
        ((3, 1),),
    )
    assert side.matched_tokens(req, 0) == (0, False)  # loaded: not external any more


def test_a_decode_prefix_hit_loads_only_the_tokens_past_it_and_owns_only_their_blocks() -> None:
    """vLLM asks for the tokens past its local hit (block-aligned: 2 blocks of 32 here); the
    load starts there, and a failed load reports only the blocks from it on: the hit's blocks
    are shared with other requests, which vLLM would fail or recompute."""
    side = SchedulerSide(OPTIONS, producer=False)
    req = remote_request()
    assert side.matched_tokens(req, 64) == (6, True)
    side.after_alloc(req, ([8, 5, 3],), 6)
    (job,) = side.build_meta().recvs
    assert (job.start, job.remote.tokens, job.block_ids) == (64, 70, ((8, 5, 3),))
    assert own_blocks(job, 32) == [3]
    assert own_blocks(RecvJob("x", job.remote, ((8, 5, 3),), 40), 32) == [5, 3]
    assert own_blocks(RecvJob("x", job.remote, ((8, 5, 3),)), 32) == [8, 5, 3]
    # A hybrid model (several KV cache groups): vLLM takes its failures per request only.
    assert own_blocks(RecvJob("x", job.remote, ((8, 5, 3), (4,)), 64), 32) == []
    with pytest.raises(ValueError, match=r"starts in \[0, 70\)"):
        RecvJob("x", job.remote, ((8, 5, 3),), 70)


def test_decode_finished_while_receiving_holds_the_blocks_until_the_workers_report() -> None:
    side = SchedulerSide(OPTIONS, producer=False)
    req = remote_request()
    side.after_alloc(req, ([3, 1],), 70)
    side.build_meta()
    assert side.finished(req, ([3, 1],)) == (True, None)
    assert side.build_meta().aborts == ["d"]
    side.workers_reported({"d"})
    assert side.finished(req, ([3, 1],)) == (False, None)


@pytest.mark.parametrize(
    "req",
    [
        remote_request(tokens=69),
        Request("d", [1] * 70, {"do_remote_prefill": True, "kvbridge": {"room": 1}}),
    ],
)
def test_decode_computes_locally_what_it_cannot_load(
    req: Request, caplog: pytest.LogCaptureFixture
) -> None:
    side = SchedulerSide(OPTIONS, producer=False)
    assert side.matched_tokens(req, 0) == (0, False)
    assert "computing its prompt here" in caplog.text


def test_options_and_params_refuse_bad_values_saying_what_was_expected() -> None:
    assert ConnectorOptions.parse(
        {"layout": "cpu", "serve_bootstrap": "false"}
    ) == ConnectorOptions(layout=VllmLayout.CPU, serve_bootstrap=False)
    for extra, match in [
        ({"bootstrap": "nohost"}, "host:port"),
        ({"colour": 1}, "unknown kv_connector_extra_config keys"),
        ({"serve_bootstrap": "maybe"}, "boolean"),
        ({"layout": "xyz"}, "kv_connector_extra_config"),
        ({"aux_slots": 0}, "aux_slots must be >= 1"),
    ]:
        with pytest.raises(ParamsError, match=match):
            ConnectorOptions.parse(extra)
    with pytest.raises(ParamsError, match="room must be"):
        RemotePrefill("h:1", -1, 5)
    with pytest.raises(ParamsError, match="need a 'kvbridge' entry"):
        RemotePrefill.from_params({"do_remote_prefill": True})


# ---- both legs at once (kvbridge proxy --prefill-bootstrap): the proxy picks the room -----


@dataclass
class Sampling:
    max_tokens: int


@dataclass
class NewReq:  # vLLM's NewRequestData, the fields the scheduler half reads
    req_id: str
    prompt_token_ids: list[int] | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    sampling_params: Sampling


@dataclass
class Scheduled:  # vLLM's SchedulerOutput, likewise
    scheduled_new_reqs: list[NewReq]
    num_scheduled_tokens: dict[str, int]


def push_request(room: int = 5, prompt: int = 70) -> Request:
    return Request("p", list(range(prompt)), PushRoom(room).to_params(), num_computed_tokens=prompt)


def step(req: Request, computed: int, scheduled: int, max_tokens: int = 1) -> Scheduled:
    new = NewReq(req.request_id, req.prompt_token_ids, ([4, 9, 2],), computed, Sampling(max_tokens))
    return Scheduled([new], {req.request_id: scheduled})


def test_a_push_request_computed_whole_in_one_step_is_streamed_under_the_proxys_room() -> None:
    side = SchedulerSide(OPTIONS, producer=True)
    req = push_request()
    side.after_alloc(req, ([4, 9, 2],), 0)
    meta = side.build_meta(step(req, computed=6, scheduled=64))  # a local prefix hit of 6
    (job,) = meta.streams
    assert (job.req_id, job.room, job.tokens, job.block_ids) == ("p", 5, 70, ((4, 9, 2),))
    assert meta.sends == []
    assert side.build_meta(step(req, 70, 0)).streams == []  # once
    delay, params = side.finished(req, ([4, 9, 2],))
    assert delay and params is not None and RemotePrefill.from_params(params).room == 5
    assert side.build_meta().sends == []  # streamed already: not pushed again


@pytest.mark.parametrize(
    ("scheduled", "max_tokens", "stream", "embeds"),
    [(32, 1, True, False), (70, 2, True, False), (70, 1, False, False), (70, 1, True, True)],
)
def test_a_push_request_not_ending_with_its_step_is_pushed_once_computed(
    scheduled: int, max_tokens: int, stream: bool, embeds: bool
) -> None:
    """Prefilled in chunks, running on, or in an engine with more than one batch in flight
    (each could be preempted and its blocks reused while a layer-wise write reads them), or
    given as embeddings: pushed from request_finished, under the proxy's room."""
    side = SchedulerSide(OPTIONS, producer=True, stream=stream)
    req = push_request()
    side.after_alloc(req, ([4, 9, 2],), 0)
    scheduled_out = step(req, 0, scheduled, max_tokens)
    if embeds:
        scheduled_out.scheduled_new_reqs[0].prompt_token_ids = None
    assert side.build_meta(scheduled_out).streams == []
    assert side.finished(req, ([4, 9, 2],))[0]
    (job,) = side.build_meta().sends
    assert (job.room, job.tokens) == (5, 70)


def test_a_streamed_request_that_fails_keeps_its_blocks_and_aborts_its_senders() -> None:
    side = SchedulerSide(OPTIONS, producer=True)
    req = push_request()
    side.after_alloc(req, ([4, 9, 2],), 0)
    side.build_meta(step(req, 0, 70))
    req.status = Status.FINISHED_ABORTED
    assert side.finished(req, ([4, 9, 2],)) == (True, None)  # held until the workers report
    meta = side.build_meta()
    assert meta.stream_aborts == ["p"] and meta.sends == []


def test_a_push_request_with_a_bad_room_is_refused_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    side = SchedulerSide(OPTIONS, producer=True)
    req = Request("p", [1] * 70, {"do_remote_decode": True, "kvbridge": {"room": -3}}, 70)
    side.after_alloc(req, ([4, 9, 2],), 0)
    assert side.build_meta(step(req, 0, 70)).streams == []
    assert "room must be in [0, 2^63)" in caplog.text
    assert side.finished(req, ([4, 9, 2],)) == (False, None)


def test_a_decode_request_sent_with_its_prefill_loads_the_whole_prompt() -> None:
    side = SchedulerSide(OPTIONS, producer=False)
    req = Request(
        "d",
        list(range(70)),
        {"do_remote_prefill": True, "kvbridge": {"bootstrap": "10.0.0.5:9000", "room": 5}},
    )
    assert side.matched_tokens(req, 0) == (70, True)
    side.after_alloc(req, ([3, 1],), 70)
    (job,) = side.build_meta().recvs
    assert (job.remote.room, job.remote.tokens, job.remote.bootstrap) == (5, 70, "10.0.0.5:9000")


# ---- models with Mamba layers: the prefill stops one token short, the decode computes it --


@dataclass
class FullRequest(Request):  # the fields of vLLM's Request the backoff changes
    num_prompt_tokens: int = 0
    max_tokens: int = 16
    _all_token_ids: list[int] = field(default_factory=list)


def test_a_mamba_prefill_drops_the_last_prompt_token_once_and_asks_one_token() -> None:
    side = SchedulerSide(OPTIONS, producer=True, backoff=1)
    req = FullRequest(
        "p",
        list(range(70)),
        {"do_remote_decode": True},
        num_prompt_tokens=70,
        _all_token_ids=list(range(70)),
    )
    side.arrived(req)
    side.arrived(req)  # once, whatever vLLM does
    assert (
        len(req.prompt_token_ids),
        len(req._all_token_ids),
        req.num_prompt_tokens,
        req.max_tokens,
    ) == (69, 69, 69, 1)
    plain = FullRequest("q", list(range(70)), None, num_prompt_tokens=70)
    side.arrived(plain)  # not handed over: computed whole
    assert len(plain.prompt_token_ids) == 70
    short = FullRequest("r", [5], {"do_remote_decode": True}, num_prompt_tokens=1)
    side.arrived(short)  # nothing would be left to compute
    assert short.prompt_token_ids == [5]


def test_a_mamba_decode_loads_all_but_the_last_token_and_refuses_a_whole_prompt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    side = SchedulerSide(OPTIONS, producer=False, backoff=1)
    assert side.matched_tokens(remote_request(tokens=69, prompt=70), 0) == (69, True)
    at_once = Request(
        "d",
        list(range(70)),
        {"do_remote_prefill": True, "kvbridge": {"bootstrap": "10.0.0.5:9000", "room": 5}},
    )
    assert side.matched_tokens(at_once, 0) == (69, True)
    # A prefill that computed the whole prompt holds a state one token too far.
    assert side.matched_tokens(remote_request(tokens=70, prompt=70), 0) == (0, False)
    assert "expected 69" in caplog.text


def test_a_mamba_prompt_too_short_to_stop_short_is_not_handed_over() -> None:
    """One token: nothing is left for the decode instance to compute after dropping it, so the
    prefill computes it whole, and the decode instance (expecting 0 tokens) computes it too:
    the prefill must not hold its blocks for a transfer nobody asks for."""
    side = SchedulerSide(OPTIONS, producer=True, backoff=1)
    req = FullRequest(
        "p",
        [5],
        PushRoom(5).to_params(),
        num_computed_tokens=1,
        num_prompt_tokens=1,
        _all_token_ids=[5],
    )
    side.arrived(req)
    side.after_alloc(req, ([4],), 0)
    assert side.build_meta(step(req, 0, 1)).streams == []
    assert side.finished(req, ([4],)) == (False, None)
    assert side.build_meta().sends == []
