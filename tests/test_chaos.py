"""The chaos soak (``kvbridge chaos``) over a real multi-process deployment: every fault kind
drawn, every request ends within its bound, no false success, no byte after release, nothing
left; and the soak itself catches an engine that reuses pages too early. Across hosts (network
namespaces), partitions, loss, delay and the bootstrap service's restart among the faults."""

from __future__ import annotations

import pytest

from kvbridge.chaos.config import NETWORK_FAULTS
from kvbridge.chaos.soak import ChaosConfig, Fault, run_chaos
from kvbridge.config import SettingsError
from kvbridge.deploy.netns import unavailable
from kvbridge.transports import unavailable as transport_unavailable

pytestmark = pytest.mark.slow  # soaks of 50 and 60 requests: half a minute in all


@pytest.mark.parametrize(("transport", "requests"), [("shm", 60), ("tcp", 50)])
def test_a_soak_with_every_fault_ends_every_request_and_breaks_no_promise(
    transport: str, requests: int
) -> None:
    rep = run_chaos(ChaosConfig(requests=requests, round=10, seed=7, transport=transport))
    assert rep.ok, "\n".join(rep.violations[:10])
    assert rep.hung == rep.bad_bytes == rep.false_success == rep.landed_after_release == 0
    assert rep.rooms_left == rep.threads_left == rep.segments_left == 0
    # The soak did soak: faults of several kinds, and requests both succeeded and failed.
    assert len([f for f in rep.injected if f is not Fault.NONE]) >= 5, rep.injected
    states = {(side, state) for side, state, _ in rep.outcomes}
    assert {
        ("decode", "SUCCESS"),
        ("decode", "FAILED"),
        ("prefill", "SUCCESS"),
        ("prefill", "FAILED"),
    } <= states, rep.outcomes
    assert rep.longest <= ChaosConfig(transport=transport).longest_bound


def test_the_soak_catches_an_engine_that_reuses_pages_before_release() -> None:
    # A stalled shm writer cannot be fenced: an engine that reuses the pages of a failed
    # request at once, instead of waiting for ``released``, gets bytes written into them. The
    # writer stops right before a post, so its write starts only after it resumes.
    rep = run_chaos(
        ChaosConfig(
            requests=30,
            round=10,
            seed=1,
            transport="shm",
            faults=(Fault.STALL_BEFORE_WRITE,),
            eager_reuse=True,
        )
    )
    assert rep.landed_after_release > 0, rep.rows()
    assert any("landed after release" in v for v in rep.violations), rep.violations


def test_the_links_faults_need_hosts_and_shm_stays_on_one() -> None:
    assert set(ChaosConfig().faults) == set(Fault) - set(NETWORK_FAULTS)
    assert set(ChaosConfig(transport="tcp", hosts=True).faults) == set(Fault)
    with pytest.raises(SettingsError, match="partition act on links between hosts"):
        ChaosConfig(faults=(Fault.PARTITION,))
    with pytest.raises(SettingsError, match="within one host"):
        ChaosConfig(transport="shm", hosts=True)


@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
def test_a_soak_across_hosts_survives_partitions_loss_delay_and_the_bootstrap_restarted(
    transport: str,
) -> None:
    """Prefill, decode and bootstrap on hosts of their own: a partition of a host's link for
    up to twice the heartbeat window, 1% loss, 5 ms delay, the bootstrap service down and back
    at its address, each in a round of its own; every promise kept."""
    why = unavailable() or transport_unavailable(transport)
    if why:
        pytest.skip(why)
    kinds = (*NETWORK_FAULTS, Fault.BOOTSTRAP_RESTART)
    rep = run_chaos(
        ChaosConfig(requests=40, round=10, seed=3, transport=transport, hosts=True, faults=kinds)
    )
    assert rep.ok, "\n".join(rep.violations[:10])
    assert set(rep.injected) == set(kinds), rep.injected
    assert ("decode", "SUCCESS", "") in rep.outcomes, rep.outcomes


def test_a_rank_shows_where_its_threads_are_for_a_request_that_never_ended() -> None:
    """The evidence a hung request's violation carries: every kvbridge thread's stack."""
    from kvbridge.chaos.deployment import Deployment

    dep = Deployment(ChaosConfig(requests=1, transport="shm"))
    try:
        stacks = dep.ranks[("decode", 0)].call("stacks")
    finally:
        dep.close()
    assert "--- kvbridge-control-decode" in stacks, stacks
    assert "in _run" in stacks, stacks  # the control loop, where it waits between ticks
