"""Layer-wise sends through the engine-facing API: a prefill forward hands each layer over as it
computes it; the request completes with the last layer of the last token, and a layer that never
comes is a failure that names it, never a hang."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from bridge_ranks import until
from kvbridge import CacheSpec, DType, ParallelLayout, Placement, PlacementError, build_memory
from kvbridge.bootstrap import BootstrapServer
from kvbridge.config import Settings
from kvbridge.errors import FailureKind
from kvbridge.memory.pools import HostPool
from kvbridge.model.spec import attention_layer, mamba2_layer
from kvbridge.runtime import Bridge
from kvbridge.runtime.status import KVPoll
from kvbridge.wire.protocol import Role

SPEC = CacheSpec(
    "hyb",
    (
        attention_layer(2, 8, DType.BFLOAT16),
        mamba2_layer(4, 4, 2, 4, 4, conv_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32),
        attention_layer(2, 8, DType.BFLOAT16),
        attention_layer(2, 8, DType.BFLOAT16),
    ),
)
SETTINGS = Settings(
    bootstrap_timeout=10,
    waiting_timeout=10,
    transfer_timeout=3,
    abort_timeout=2,
    heartbeat_interval=0.2,
    heartbeat_misses=5,
)


@pytest.fixture
def pair() -> Iterator[tuple[Bridge, Bridge, HostPool, HostPool]]:
    par = ParallelLayout.even(SPEC.num_layers, 1)
    mem = build_memory(SPEC, par, page_size=4, num_pages=16)
    pools = [HostPool(mem.regions, shared=False) for _ in range(2)]
    with BootstrapServer() as server:
        p = Bridge(
            role=Role.PREFILL,
            spec=SPEC,
            parallel=par,
            rank=0,
            memory=mem,
            regions=pools[0],
            transport="inproc",
            bootstrap=server.address,
            engine_id="p",
            settings=SETTINGS,
        ).start()
        d = Bridge(
            role=Role.DECODE,
            spec=SPEC,
            parallel=par,
            rank=0,
            memory=mem,
            regions=pools[1],
            transport="inproc",
            bootstrap=server.address,
            engine_id="d",
            settings=SETTINGS,
        ).start()
        try:
            for r in mem.regions:  # a different byte per region, to see where bytes land
                pools[0].view(r.name)[:] = np.arange(r.nbytes) % 251
                pools[1].view(r.name)[:] = 0
            yield p, d, pools[0], pools[1]
        finally:
            d.close()
            p.close()
            for pool in pools:
                pool.close()


PLACE = Placement.simple(12, np.arange(3), state_slot=1, aux_slot=1)


def test_layers_sent_as_computed_complete_with_the_last(
    pair: tuple[Bridge, Bridge, HostPool, HostPool],
) -> None:
    p, d, src, dst = pair
    r = d.receiver(1)
    r.init(PLACE)
    s = p.sender(1, PLACE)
    s.send(8, layers=range(2, 4))  # any order within a chunk
    s.send(8, layers=range(0, 2))
    for li in (3, 0, 1):
        s.send(12, layers=range(li, li + 1))
    assert r.wait(1.0) is KVPoll.TRANSFERRING  # layer 2 of the last tokens is not there yet
    assert "kv of layers 2" in r.completion.missing()[0]  # type: ignore[union-attr]
    s.send(12)  # the rest: layer 2
    assert r.wait(10) is KVPoll.SUCCESS, r.failure
    assert s.wait(10) is KVPoll.SUCCESS
    # same layout and placement on both sides: layer 3's K pages hold the same bytes
    k = p.side.memory.buffers[(3, "k")]
    span = slice(k.offset, k.offset + 3 * k.stride("page"))
    assert np.array_equal(src.view(k.region)[span], dst.view(k.region)[span])


def test_layer_groups_whose_writes_come_out_of_order_are_all_written(
    pair: tuple[Bridge, Bridge, HostPool, HostPool],
) -> None:
    """The jobs of one request's layer groups reach the prefill's worker in any order when
    two threads queue them (the engine's at ``send()``, the one that took the decode's ask).
    A job for a later group writes from the first group not yet written: the earlier group
    is never counted written unsent (it was: a hang, the decode waiting for layers 0-1)."""
    p, d, src, dst = pair
    r = d.receiver(1)
    r.init(PLACE)
    s = p.sender(1, PLACE)
    assert until(lambda: s.poll() is KVPoll.WAITING_FOR_INPUT)  # the decode asked
    worker = p._prefill.worker  # type: ignore[union-attr]
    with worker._busy:  # neither the worker nor the engine's send() writes meanwhile
        s.send(12, layers=range(0, 2))
        s.send(12, layers=range(2, 4))
        writer = worker.writer
        writer.transfer(s, 0, 1)  # the second group's job first, as a race can queue it
        writer.transfer(s, 0, 0)
    assert r.wait(10) is KVPoll.SUCCESS, r.failure
    assert s.wait(10) is KVPoll.SUCCESS, s.failure
    k = p.side.memory.buffers[(0, "k")]  # layer 0, of the group whose job came second
    span = slice(k.offset, k.offset + 3 * k.stride("page"))
    assert np.array_equal(src.view(k.region)[span], dst.view(k.region)[span])


def test_a_job_taken_before_an_earlier_chunks_writes_both(
    pair: tuple[Bridge, Bridge, HostPool, HostPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two chunks of other tokens (a layer group's chunk does not continue the one before):
    the job of the second reaches the worker first. It writes the first (writes go in chunk
    order), then its own; the first's job finds both written. It used to stop after the
    first, and the second was never written: a hang, the decode waiting for those tokens
    (found by the demo's layer-wise cases under load)."""
    p, d, src, dst = pair
    r = d.receiver(1)
    r.init(PLACE)
    s = p.sender(1, PLACE)
    assert until(lambda: s.poll() is KVPoll.WAITING_FOR_INPUT)  # the decode asked
    role = p._prefill  # type: ignore[union-attr]
    monkeypatch.setattr(role, "pump", lambda *_, **__: None)  # the jobs only as queued below
    s.send(8)
    s.send(12)
    assert "chunks [0,8)L0-4 [8,12)L0-4; decode rank 0 placed, queued 0, written 0" in (
        p.describe()
    )
    assert "prefill rank 0 owes kv (0/12 tokens), state, aux" in d.describe()
    writer = role.worker.writer
    writer.transfer(s, 0, 1)  # the second chunk's job first, as two threads can queue them
    assert r.wait(10) is KVPoll.SUCCESS, r.failure  # both written, without the first's job
    writer.transfer(s, 0, 0)  # which finds nothing left to write
    assert s.wait(10) is KVPoll.SUCCESS, s.failure
    for layer in (0, 2, 3):  # the attention layers' keys, in every page of the request
        k = p.side.memory.buffers[(layer, "k")]
        span = slice(k.offset, k.offset + 3 * k.stride("page"))
        assert np.array_equal(src.view(k.region)[span], dst.view(k.region)[span]), layer


def test_misuse_of_layers_is_refused_saying_what_was_expected(
    pair: tuple[Bridge, Bridge, HostPool, HostPool],
) -> None:
    p, _, _, _ = pair
    s = p.sender(2, PLACE)
    s.send(4, layers=range(0, 2))
    assert s.unsent() == "the engine has not sent layers 2-3 of tokens [0, 4)"
    with pytest.raises(PlacementError, match=r"tokens \[0, 4\) still miss layers 2-3"):
        s.send(8)
    with pytest.raises(PlacementError, match=r"not sent yet \(2-3\)"):
        s.send(4, layers=range(1, 3))  # layer 1 again
    with pytest.raises(PlacementError, match="expected a non-empty range"):
        s.send(4, layers=range(2, 6))  # past this rank's layers
    s.send(4)
    with pytest.raises(PlacementError, match="expected a non-empty range"):
        s.send(8, layers=range(7, 9))  # a refused first group leaves the next chunk unopened
    s.send(8, layers=range(3, 4))
    with pytest.raises(PlacementError, match=r"tokens \[4, 8\) still miss layers 0-2"):
        s.send(12)


@pytest.mark.slow  # waits out a deadline
def test_a_layer_never_sent_fails_at_the_deadline_naming_it(
    pair: tuple[Bridge, Bridge, HostPool, HostPool],
) -> None:
    p, d, _, _ = pair
    r = d.receiver(3)
    r.init(PLACE)
    s = p.sender(3, PLACE)
    s.send(12, layers=range(0, 1))
    s.send(12, layers=range(2, 4))  # layer 1 (the Mamba2 state) never comes
    assert r.wait(SETTINGS.transfer_timeout + 5) is KVPoll.FAILED
    assert s.wait(5) is KVPoll.FAILED
    # Both deadlines pass together; whichever side's comes first names what is missing:
    # the decode side the state it still waits for, the prefill side the layer never sent.
    assert r.failure is not None and r.failure.kind is FailureKind.DEADLINE
    assert "prefill rank 0: state" in str(
        r.failure
    ) or "the engine has not sent layers 1 of tokens [0, 12)" in str(r.failure), r.failure
