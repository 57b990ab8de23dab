"""Staged transfer, piece by piece: the choice of path, the staging ring, and the decode rank's
scatter, which never writes into the pages of a request that ended (the bytes themselves are
checked over the whole layout grid in ``test_plan_bytes.py``)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from bridges import SPEC, bridge
from kvbridge import ParallelLayout, build_memory
from kvbridge.bench.rounds import placement
from kvbridge.bench.transfer import CASES, _job
from kvbridge.bootstrap import BootstrapServer
from kvbridge.config import Settings, SettingsError
from kvbridge.deploy.cluster import build_side
from kvbridge.errors import FailureKind
from kvbridge.memory.copier import HostCopier
from kvbridge.memory.copy import execute
from kvbridge.memory.pools import HostPool
from kvbridge.model.hf import load_spec
from kvbridge.planner.layout import Region
from kvbridge.planner.plan import Pairing
from kvbridge.planner.reference import allocate
from kvbridge.planner.runs import Runs
from kvbridge.runtime import Receiver
from kvbridge.runtime.decode.landing import StagingArea
from kvbridge.runtime.metrics import Metrics
from kvbridge.runtime.staging_pool import REGION, StagingPool
from kvbridge.runtime.staging_pool import allocate as allocate_pool
from kvbridge.runtime.status import KVPoll
from kvbridge.staging import Path, StagingMode, choose, gather, scatter, segments
from kvbridge.staging.ring import SlotRing
from kvbridge.transports import transport_class
from kvbridge.wire.protocol import Role, StageAsk, Staged, StageGrant

# ---- the choice of path -------------------------------------------------------------------


def issue_pair_runs(case: int) -> Runs:
    """Prefill rank 0's runs to the decode rank, Qwen3-32B, 4,096 tokens: the issue's cases."""
    job = _job(load_spec("qwen3-32b"), CASES[case], "shm", 4096, 64)
    plan = Pairing(build_side(job, job.prefill), build_side(job, job.decode)).plan(
        placement(job, job.prefill, False, 0),
        placement(job, job.decode, False, 1),
        prefill_rank=0,
    )
    return plan.pairs[0].runs


CONTIGUOUS, NHD, HND = 0, 1, 2
SEGMENT = Settings().staging_slot_bytes


@pytest.mark.parametrize(
    ("transport", "case", "path"),
    [
        *((t, c, Path.DIRECT) for t in ("inproc", "shm", "tcp") for c in (CONTIGUOUS, NHD, HND)),
        ("nixl", CONTIGUOUS, Path.DIRECT),
        ("nixl", NHD, Path.STAGED),
        ("nixl", HND, Path.DIRECT),
        ("mooncake", CONTIGUOUS, Path.DIRECT),
        ("mooncake", NHD, Path.STAGED),
    ],
)
def test_auto_stages_only_where_the_transport_pays_per_descriptor(
    transport: str, case: int, path: Path
) -> None:
    cost = transport_class(transport).cost
    assert choose(issue_pair_runs(case), cost, StagingMode.AUTO, SEGMENT) is path


def test_the_setting_forces_either_path_and_nothing_is_staged_without_bytes() -> None:
    runs = issue_pair_runs(NHD)
    cost = transport_class("nixl").cost
    assert choose(runs, cost, StagingMode.NEVER, SEGMENT) is Path.DIRECT
    assert (
        choose(
            issue_pair_runs(CONTIGUOUS), transport_class("shm").cost, StagingMode.ALWAYS, SEGMENT
        )
        is Path.STAGED
    )
    assert choose(Runs.empty(), cost, StagingMode.ALWAYS, SEGMENT) is Path.DIRECT


def test_ranks_of_transports_at_copy_speed_hold_no_staging_memory_unless_forced() -> None:
    for name in ("inproc", "shm", "tcp"):
        assert not transport_class(name).cost.may_stage
        assert allocate_pool(Settings(), transport_class(name).cost, shared=False) is None
    for name in ("nixl", "mooncake"):
        assert transport_class(name).cost.may_stage
    forced = allocate_pool(
        Settings(staging=StagingMode.ALWAYS, staging_slots=2, staging_slot_bytes=4096),
        transport_class("shm").cost,
        shared=False,
    )
    assert forced is not None and forced.region.nbytes == 2 * 4096
    forced.close()
    assert (
        allocate_pool(
            Settings(staging=StagingMode.NEVER), transport_class("nixl").cost, shared=False
        )
        is None
    )


def test_the_staging_setting_is_an_enum_from_the_environment() -> None:
    assert Settings.from_env({"KVBRIDGE_STAGING": "Always"}).staging is StagingMode.ALWAYS
    with pytest.raises(SettingsError, match="auto or always or never"):
        Settings.from_env({"KVBRIDGE_STAGING": "sometimes"})
    with pytest.raises(SettingsError, match="StagingMode"):
        Settings(staging="always")  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="staging_slot_bytes"):
        Settings(staging_slot_bytes=100)


def test_segments_are_full_but_the_last_and_gather_then_scatter_is_the_direct_copy() -> None:
    runs = issue_pair_runs(NHD)
    segs = segments(runs, 3 << 20)
    assert [s.total_bytes for s in segs[:-1]] == [3 << 20] * (len(segs) - 1)
    assert sum(s.total_bytes for s in segs) == runs.total_bytes
    assert segments(runs, 3 << 20)[5].src_offset.tolist() == segs[5].src_offset.tolist()
    # A small case end to end against the direct copy.
    one = np.ones(3, dtype=np.int64)
    r = Runs(
        0 * one,
        np.array([0, 700, 1500]),
        0 * one,
        np.array([10, 400, 3000]),
        np.array([30, 7, 100]),
        np.array([5, 1, 2]),
        np.array([40, 0, 150]),
        np.array([50, 0, 120]),
    )
    src = np.arange(2000, dtype=np.int64).astype(np.uint8)
    want, got = np.zeros(4000, np.uint8), np.zeros(4000, np.uint8)
    execute(r, [src], [want])
    for seg in segments(r, 13):
        slot = np.zeros(13, np.uint8)
        execute(gather(seg, 0), [src], [slot])
        execute(scatter(seg, 0), [slot], [got])
    assert np.array_equal(got, want)


# ---- the ring -----------------------------------------------------------------------------


def test_the_ring_grants_in_the_order_asked_and_never_more_slots_than_it_has() -> None:
    ring = SlotRing(2)
    a, b = ring.ask("a"), ring.ask("b")
    assert a is not None and b is not None and {a.slot, b.slot} == {0, 1}
    assert ring.ask("c") is None and ring.ask("d") is None  # they wait, nothing fails
    assert ring.take() is None  # nothing jumps the queue either
    grants = ring.free([a.slot])
    assert [(g.key, g.slot) for g in grants] == [("c", a.slot)]
    assert ring.held() == 2 and ring.waiting() == 1
    ring.drop_waiting(lambda k: k == "d")  # its request ended before it was served
    assert ring.free([b.slot, 99]) == [] and ring.held() == 1  # an unknown slot is ignored
    grants = ring.release(lambda k: k == "c")
    assert grants == [] and ring.held() == 0 and ring.take() is not None


# ---- the decode rank's scatter ------------------------------------------------------------


class _Fakes:
    """One decode rank's StagingArea over a real pairing and pools, its role and transport
    stood in for (the area only sends grants and fails requests through them)."""

    def __init__(self, slots: int = 1) -> None:
        job = _job(load_spec("qwen3-32b"), CASES[NHD], "shm", 64, 16)
        self.prefill, self.decode = build_side(job, job.prefill), build_side(job, job.decode)
        self.pairing = Pairing(self.prefill, self.decode)
        self.src_place = placement(job, job.prefill, False, 0)
        self.dst_place = placement(job, job.decode, False, 1)
        self.src = allocate(self.prefill, seed=3)[0]
        self.dst = allocate(self.decode, fill_byte=0xA5)[0]
        self.sent: list[Any] = []
        self.failed: list[str] = []
        self.pool = StagingPool(HostPool([Region(REGION, slots * 4096)], shared=False), slots, 4096)
        b = SimpleNamespace(
            agent="decode/decode/0",
            settings=Settings(),
            views=self.dst,
            copier=HostCopier({**self.dst, REGION: self.pool.pool.view(REGION)}),
            send=lambda agent, msg: self.sent.append(msg),
            metrics=Metrics(Role.DECODE, 0, "decode", "shm"),
        )
        self.role = SimpleNamespace(rank=0, fail=self._fail, maybe_release=lambda r: None)
        self.area = StagingArea(self.role, b, self.pool)  # type: ignore[arg-type]

    def _fail(self, r: Any, kind: FailureKind, reason: str) -> None:
        if r.status.fail(kind, reason):
            self.failed.append(reason)
            self.area.ended(r)

    def receiver(self, room: int) -> Receiver:
        """A real receiver, linked and placed, its role stood in for."""
        r = Receiver(self.role, room, "127.0.0.1:1", time.monotonic() + 60)  # type: ignore[arg-type]
        r.link = SimpleNamespace(session=1, pairing=self.pairing)  # type: ignore[assignment]
        r.placement = self.dst_place
        return r

    def ask(self, r: Any, ask: int) -> None:
        self.area.ask(
            r,
            1,
            0,
            StageAsk(sender="prefill/prefill/0", session=1, room=r.room, prefill_rank=0, ask=ask),
        )

    def land(self, r: Any, grant: StageGrant) -> Staged:
        """What the prefill rank does: gather segment 0 into the granted slot; its notice."""
        plan = self.pairing.plan(
            self.src_place, self.dst_place, 0, 16, prefill_rank=0, decode_rank=0
        )
        names, _, runs = plan.pairs[0].runs.restricted(plan.src_regions, plan.dst_regions)
        seg = segments(runs, 4096)[0]
        execute(
            gather(seg, grant.slot * 4096),
            [self.src[n] for n in names],
            [self.pool.pool.view(REGION)],
        )
        p = self.src_place
        return Staged(
            sender="prefill/prefill/0",
            session=1,
            room=r.room,
            prefill_rank=0,
            ask=grant.ask,
            slot=grant.slot,
            start=0,
            stop=16,
            last=False,
            segment=0,
            segment_bytes=4096,
            nbytes=seg.total_bytes,
            tokens=p.tokens,
            pages={g: ids.tolist() for g, ids in p.pages.items()},
            slots=dict(p.slots),
        )

    def untouched(self) -> bool:
        return all(bool((v == 0xA5).all()) for v in self.dst.values())


def test_a_segment_of_a_request_that_ended_is_never_scattered_and_its_slot_waits_release() -> None:
    f = _Fakes(slots=1)
    r, other = f.receiver(7), f.receiver(8)
    f.ask(r, 0)
    (grant,) = f.sent
    assert isinstance(grant, StageGrant) and grant.slot == 0 and not grant.refused
    f.ask(other, 1)  # the only slot is taken: it waits
    notice = f.land(r, grant)
    f.role.fail(r, FailureKind.ABORTED, "aborted by the decode engine")
    f.area._scatter(r, 0, notice)  # the writer's notice arrives after the abort
    assert f.area.refused == 1 and f.area.scatters == 0
    assert f.untouched(), "bytes were scattered into the pages of an aborted request"
    # The slot may still be written (the writer is not known to have drained): held, and the
    # other request keeps waiting, until the aborted one is released.
    assert f.pool.slots == 1 and f.area.ring.holder(0) is not None and len(f.sent) == 1
    f.area.released(r)
    assert [(g.room, g.slot) for g in f.sent[1:]] == [(8, 0)]


def test_a_live_request_is_scattered_into_its_own_pages_and_its_slot_goes_to_the_next_ask() -> None:
    f = _Fakes(slots=1)
    r, other, gone = f.receiver(7), f.receiver(8), f.receiver(9)
    f.ask(r, 0)
    f.ask(gone, 1)
    f.ask(other, 2)
    f.role.fail(gone, FailureKind.DEADLINE, "deadline")  # its waiting ask is dropped
    f.area._scatter(r, 0, f.land(r, f.sent[0]))
    assert f.area.scatters == 1 and f.failed == ["deadline"] and not f.untouched()
    plan = f.pairing.plan(f.src_place, f.dst_place, 0, 16, prefill_rank=0, decode_rank=0)
    names, dnames, runs = plan.pairs[0].runs.restricted(plan.src_regions, plan.dst_regions)
    seg = segments(runs, 4096)[0]
    want = {n: np.full_like(v, 0xA5) for n, v in f.dst.items()}
    execute(seg, [f.src[n] for n in names], [want[n] for n in dnames])
    assert all(np.array_equal(f.dst[n], want[n]) for n in f.dst)
    assert [(g.room, g.slot) for g in f.sent[1:]] == [(8, 0)]


def test_a_notice_naming_a_slot_not_granted_to_it_fails_the_request_without_a_write() -> None:
    f = _Fakes(slots=2)
    r, other = f.receiver(7), f.receiver(8)
    f.ask(r, 0)
    f.ask(other, 1)
    notice = f.land(r, f.sent[1])  # the other request's slot
    f.area._scatter(r, 0, notice)
    assert f.failed and "not granted" in f.failed[0] and f.untouched()


def test_an_ask_for_a_request_that_is_not_live_is_refused() -> None:
    f = _Fakes()
    r = f.receiver(7)
    f.role.fail(r, FailureKind.ABORTED, "aborted")
    f.ask(r, 0)
    f.area.ask(
        None, 1, 0, StageAsk(sender="prefill/prefill/0", session=1, room=99, prefill_rank=0, ask=1)
    )
    assert [bool(g.refused) for g in f.sent] == [True, True]
    assert f.area.ring.held() == 0


@pytest.mark.slow  # a real Bridge, and a bootstrap deadline waited out
def test_a_request_that_ends_before_it_is_linked_is_released_where_the_rank_stages() -> None:
    """A decode rank with a staging region (KVBRIDGE_STAGING=always here; auto gives one on
    nixl, mooncake and cudaipc): a request that ends before any prefill engine is found for it
    (the engine's abort; its bootstrap deadline) asked for no slot. Its end once raised into
    the engine's call (the staging area asked for its link), left it never released, and made
    the Bridge's close raise with its threads still running."""
    mem = build_memory(SPEC, ParallelLayout.even(2, 1), page_size=4, num_pages=16)
    pool = HostPool(mem.regions, shared=True)
    settings = Settings(staging=StagingMode.ALWAYS, bootstrap_timeout=0.5, abort_timeout=2)
    with BootstrapServer() as server:
        d = bridge(
            Role.DECODE, "d", mem, pool, server.address, transport="shm", settings=settings
        ).start()
        try:
            aborted, expired = d.receiver(7), d.receiver(8)
            assert aborted.link is None  # no prefill engine announced these rooms
            aborted.abort("the engine's")
            assert expired.wait(5) is KVPoll.FAILED
            assert "bootstrap deadline" in str(expired.failure)
            assert aborted.wait_released(5) and expired.wait_released(5)
            open_ = d.receiver(9)
            assert d.active_rooms() == 1  # room 9's, waiting
        finally:
            d.close()  # fails room 9 on its way
            pool.close()
    assert open_.status.state is KVPoll.FAILED and open_.released
    assert not d.channel._thread.is_alive()
