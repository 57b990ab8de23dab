"""Heartbeat silence, judged on this rank's own clock (pure: times are given); a process
proven gone; a decode link that meets another process than the one registered."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvbridge.wire.liveness import ProcessId, Silence, start_time

TICK = 0.05


def ticks(s: Silence, start: float, stop: float) -> list[str]:
    """Tick regularly from ``start`` to ``stop``; the peers dead at the last tick."""
    t = start
    while t < stop:
        s.tick(t)
        t += TICK
    assert s.tick(stop) == 0.0
    return s.dead(stop)


def test_a_peer_silent_past_the_limit_is_dead_and_one_heard_is_not() -> None:
    s = Silence(dead_after=1.0, last_tick=0.0)
    s.add("quiet", 0.0)
    s.add("talker", 0.0)
    assert ticks(s, 0.0, 0.9) == []
    s.heard("talker", 0.9)
    assert ticks(s, 0.9, 1.2) == ["quiet"]
    assert ticks(s, 1.2, 2.0) == ["quiet", "talker"]


def test_a_pause_of_this_rank_is_not_charged_to_its_peers() -> None:
    s = Silence(dead_after=1.0, last_tick=0.0)
    s.add("peer", 0.0)
    ticks(s, 0.0, 0.5)
    # This rank stopped for 5 s: at its first tick after, its peers are not yet dead ...
    assert s.tick(5.5) == 5.0
    assert s.dead(5.5) == []
    # ... but one still silent a full limit later is.
    assert ticks(s, 5.5, 6.4) == []
    assert ticks(s, 6.4, 6.6) == ["peer"]


def test_a_late_tick_within_half_the_limit_is_not_a_pause() -> None:
    s = Silence(dead_after=1.0, last_tick=0.0)
    s.add("peer", 0.0)
    ticks(s, 0.0, 0.7)
    assert s.tick(1.1) == 0.0
    assert s.dead(1.1) == ["peer"]


def test_a_removed_peer_is_not_revived_by_its_late_heartbeats() -> None:
    s = Silence(dead_after=1.0, last_tick=0.0)
    s.add("peer", 0.0)
    s.remove("peer")
    s.heard("peer", 0.5)
    s.heard("stranger", 0.5)
    assert ticks(s, 0.0, 3.0) == []
    s.add("peer", 3.0)
    assert ticks(s, 3.0, 4.1) == ["peer"]


def test_a_process_is_proven_gone_only_in_its_own_pid_namespace() -> None:
    """A pid that names no process proves its process gone only to a peer in the same pid
    namespace: containers of one host share the boot id, not their pids."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid is free
    me = ProcessId.current()
    dead = ProcessId(me.host, child.pid, me.started, me.pid_ns)
    assert me.pid_ns.startswith("pid:[")
    assert dead.proven_gone()
    assert not me.proven_gone()
    assert not ProcessId(me.host, child.pid, me.started, "pid:[1]").proven_gone()
    assert not ProcessId(me.host, child.pid, me.started, "").proven_gone()
    assert not ProcessId("another host", child.pid, me.started, me.pid_ns).proven_gone()


def test_a_killed_child_not_yet_reaped_is_gone_and_a_stopped_one_is_not() -> None:
    """A zombie's memory no longer exists: gone. A stopped process may resume writing: not."""
    import signal

    me = ProcessId.current()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid = child.pid
        started = start_time(pid)
        assert started is not None and started > 0
        proc = ProcessId(me.host, pid, started, me.pid_ns)
        os.kill(pid, signal.SIGSTOP)
        assert not proc.proven_gone()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not proc.proven_gone() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.proven_gone()  # a zombie: killed, not reaped yet
        assert child.poll() is not None
    finally:
        child.kill()
        child.wait()


def test_a_decode_link_fails_when_a_prefill_answers_from_another_process_than_registered() -> None:
    """The decode judges a prefill rank's death by the process the bootstrap service named:
    an answer from another process (the rank restarted after the look-up) fails the link,
    saying so; an answer from the registered process completes it."""
    import types

    import msgspec

    from kvbridge.errors import FailureKind
    from kvbridge.model.spec import CacheSpec, DType, attention_layer
    from kvbridge.planner.layout import build_memory
    from kvbridge.planner.parallel import ParallelLayout
    from kvbridge.planner.plan import Side
    from kvbridge.runtime.decode.link import LinkState, PrefillLink
    from kvbridge.wire.protocol import HelloReply, Role, rank_info

    spec = CacheSpec("m", tuple(attention_layer(2, 8, DType.BFLOAT16) for _ in range(2)))
    par = ParallelLayout.even(spec.num_layers, 1, 1)
    side = Side(spec, par, build_memory(spec, par, page_size=4, num_pages=8))
    info = rank_info("p", Role.PREFILL, 0, "tcp://127.0.0.1:1", side, "tcp", b"m")
    restarted = msgspec.structs.replace(info, pid=info.pid + 1)

    class Owner:
        def __init__(self) -> None:
            self.ready: list[PrefillLink] = []
            self.failed: list[tuple[FailureKind, str]] = []

        def link_ready(self, link: PrefillLink) -> None:
            self.ready.append(link)

        def link_failed(self, link: PrefillLink, kind: FailureKind, reason: str) -> None:
            self.failed.append((kind, reason))

    for answer, fails in ((restarted, True), (info, False)):
        owner = Owner()
        link = PrefillLink(types.SimpleNamespace(agent="d"), owner, "127.0.0.1:1", "p")  # type: ignore[arg-type]
        link.infos = {0: info}
        link.on_reply(0, HelloReply(sender=info.agent, session=link.session, info=answer))
        if fails:
            assert owner.failed and owner.failed[0][0] is FailureKind.BOOTSTRAP
            assert "restarted after the look-up" in owner.failed[0][1]
            assert not owner.ready
        else:
            assert not owner.failed and owner.ready == [link]
            assert link.state is LinkState.READY
