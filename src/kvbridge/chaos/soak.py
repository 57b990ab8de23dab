"""The chaos soak: requests over a real multi-process deployment, faults drawn at random.

Each round (of a :class:`~.config.ChaosConfig`) starts ``round`` requests on every rank of the
deployment (:mod:`.deployment`), injects one fault dealt from a deck of every kind shuffled by
the seeded generator (each kind once in every so many rounds as there are kinds), waits for
every request to end, repairs the deployment (resumes a stalled rank, restarts a killed one)
and takes back every released slot. It checks, and counts as a violation:

* a request that did not end (success or failure with a reason) within its deadline bound
  (its deadlines, moved back by its rank's own pauses within their limit);
* a decode success whose bytes differ from the reference (integrity mode is on as well);
* a prefill success for a request a decode rank it owes did not receive (a false success);
* a byte that landed in a slot after the decode engine was told it could reuse it;
* rooms still held, threads left over, shared-memory segments left when the run ends;
* the ranks' resident memory, threads, file descriptors or shared-memory segments still
  rising at the end of the run (sampled about a hundred times as it runs: :mod:`.resources`).
"""

from __future__ import annotations

import contextlib
import glob
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvbridge.chaos.config import BOUNDS, NETWORK_FAULTS, TOKEN, ChaosConfig, Fault
from kvbridge.chaos.deployment import Deployment
from kvbridge.chaos.process import RankError, RankProcess
from kvbridge.chaos.ranks import Ended
from kvbridge.chaos.resources import MIN_SAMPLES, Sample, growth, rising, sample
from kvbridge.memory.pools import SEGMENT_PREFIX
from kvbridge.runtime.control import Seal, connection_identity

__all__ = ["BOUNDS", "ChaosConfig", "Fault", "Report", "run_chaos"]  # the first three re-exported

# Faults a prefill rank injects in itself (kvbridge.runtime.faults), for one round.
_RANK_FAULTS = {
    Fault.DROP_NOTICE: "drop_notice=1",
    Fault.DUP_NOTICES: "dup_notices",
    Fault.REORDER_NOTICES: "reorder_notices",
    Fault.STALL_MID_WRITE: "stop_after_post=1",
    Fault.STALL_BEFORE_WRITE: "stop_before_post=1",
}


@dataclass
class Report:
    config: ChaosConfig
    injected: Counter[Fault] = field(default_factory=Counter)
    outcomes: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # side, state, kind
    longest: float = 0.0
    hung: int = 0
    bad_bytes: int = 0
    false_success: int = 0
    landed_after_release: int = 0
    rooms_left: int = 0
    threads_left: int = 0
    segments_left: int = 0
    seconds: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def rows(self) -> list[tuple[str, str]]:
        c = self.config
        rows = [
            (
                "requests",
                f"{c.requests} ({c.transport}, prefill {c.prefill}, decode "
                f"{c.decode}, seed {c.seed})",
            )
        ]
        rows += [
            (f"fault: {f.value}", str(n))
            for f, n in sorted(self.injected.items(), key=lambda x: x[0].value)
        ]
        rows += [
            (f"{side} ranks {state}" + (f" ({kind})" if kind else ""), str(n))
            for (side, state, kind), n in sorted(self.outcomes.items())
        ]
        rows += [
            (
                "longest time to end",
                f"{self.longest:.2f} s (bound {c.bound:.1f} s, up to "
                f"{c.longest_bound - c.bound:.1f} s more where its rank was paused)",
            ),
            ("requests that never ended", str(self.hung)),
            ("successes with wrong bytes", str(self.bad_bytes)),
            ("prefill successes the decode side lacks", str(self.false_success)),
            ("bytes landed after release", str(self.landed_after_release)),
            ("rooms left", str(self.rooms_left)),
            ("threads left", str(self.threads_left)),
            ("shm segments left", str(self.segments_left)),
            *self._resource_rows(),
            ("seconds", f"{self.seconds:.1f}"),
        ]
        return rows

    def _resource_rows(self) -> list[tuple[str, str]]:
        if len(self.samples) < MIN_SAMPLES:
            return [("ranks' resources", f"{len(self.samples)} samples: too few to judge")]
        g = growth(self.samples)
        (rss0, rss1) = g["rss"]
        rows = [
            (
                "ranks' resident memory, 2nd -> last fifth",
                f"{rss0 / 2**20:,.1f} -> {rss1 / 2**20:,.1f} MiB",
            )
        ]
        rows += [
            (f"ranks' {what}, 2nd -> last fifth", f"{g[name][0]:,.0f} -> {g[name][1]:,.0f}")
            for name, what in (
                ("threads", "threads"),
                ("fds", "file descriptors"),
                ("segments", "shm segments"),
            )
        ]
        return rows + [("resource samples", str(len(self.samples)))]


def run_chaos(cfg: ChaosConfig, progress: Any = None) -> Report:
    rep = Report(cfg)
    rng = random.Random(cfg.seed)
    t_start = time.monotonic()
    dep = Deployment(cfg)
    try:
        room = 1000
        done = 0
        # One fault a round, dealt from a shuffled deck of every kind: each kind comes up
        # once in every len(faults) rounds (independent draws left kinds out of short soaks).
        deck: list[Fault] = []
        rounds, every = 0, max(1, -(-cfg.requests // cfg.round) // 100)
        while done < cfg.requests:
            n = min(cfg.round, cfg.requests - done)
            while len(dep.free) < n:  # slots quarantined behind a stalled writer
                dep.give_back()
                time.sleep(0.05)
                if time.monotonic() - t_start > cfg.requests * cfg.bound:
                    raise RuntimeError("slots never came back")
            rooms = list(range(room, room + n))
            room += n
            deck = deck or rng.sample(cfg.faults, len(cfg.faults))
            _round(dep, rep, rng, deck.pop(), rooms, dep.take(n))
            done += n
            rounds += 1
            if rounds % every == 0:
                live = [p.pid for p in dep.ranks.values()]
                rep.samples.append(sample(done, live, dep.pids))
            if progress is not None:
                progress(done, rep)
        _final(dep, rep)
        rep.violations += rising(rep.samples, len(dep.ranks))
    finally:
        dep.close()

    # The resource tracker unlinks what killed ranks left, within 0.5 s; the soak's own ranks'
    # segments only (another run on this machine has its own).
    def left() -> int:
        return sum(len(glob.glob(f"/dev/shm/{SEGMENT_PREFIX}{pid}_*")) for pid in dep.pids)

    end = time.monotonic() + 0.5
    while (n := left()) and time.monotonic() < end:
        time.sleep(0.02)
    rep.segments_left = n
    if rep.segments_left:
        rep.violations.append(f"{rep.segments_left} shared-memory segments left")
    rep.seconds = time.monotonic() - t_start
    return rep


def _round(
    dep: Deployment,
    rep: Report,
    rng: random.Random,
    fault: Fault,
    rooms: list[int],
    slots: list[int],
) -> None:
    cfg = dep.cfg
    rep.injected[fault] += 1
    victim_p = rng.randrange(dep.pw)
    victim_d = rng.randrange(dep.dw)
    if fault in _RANK_FAULTS:
        dep.ranks[("prefill", victim_p)].call("faults", _RANK_FAULTS[fault])
    # A forger learns the real identities first (a rank answers its commands in order).
    idents = _identities(dep) if fault is Fault.FORGED else None
    for _, p in dep.decode():
        for rm, slot in zip(rooms, slots, strict=True):
            p.start("begin_receive", rm, slot)
    started: set[tuple[str, int]] = set()  # ranks whose begin_* replies are collected

    def decode_started() -> None:
        for r, p in dep.decode():
            if ("decode", r) not in started:
                started.add(("decode", r))
                _started(p, rep, len(rooms))

    if idents is not None:
        # Forged completions reach the receivers before any real byte is sent: accepting
        # one would be a success without bytes.
        decode_started()
        with dep.on("prefill"):  # a process on the prefill ranks' host
            _forge(dep, rooms, idents)
    for r, p in dep.prefill():
        slow = fault is Fault.SLOW_PEER and r == victim_p
        for rm, slot in zip(rooms, slots, strict=True):
            p.start("begin_send", rm, slot, rng.uniform(0, 1.5 * cfg.deadline) if slow else 0.0)
    time.sleep(rng.uniform(0, 0.05))
    killed: list[tuple[str, int]] = []
    ended: dict[tuple[str, int], dict[int, Ended]] = {k: {} for k in dep.ranks}
    if fault is Fault.KILL_PREFILL:
        dep.ranks[("prefill", victim_p)].signal(signal.SIGKILL)
        killed.append(("prefill", victim_p))
    elif fault is Fault.KILL_DECODE:
        dep.ranks[("decode", victim_d)].signal(signal.SIGKILL)
        killed.append(("decode", victim_d))
    elif fault in (Fault.STALL, Fault.STALL_MID_WRITE, Fault.STALL_BEFORE_WRITE):
        stalled = dep.ranks[("prefill", victim_p)]
        if fault is Fault.STALL:
            stalled.signal(signal.SIGSTOP)
        else:  # it stops itself at its first post; give it a bounded while to get there
            end = time.monotonic() + cfg.deadline
            while not stalled.stopped() and time.monotonic() < end:
                time.sleep(0.01)
        # Long enough for the decode side to declare it dead and fail its requests (and
        # until every decode request ended: a loaded machine may take longer); then the
        # engine reuses what it was told it could, while the writer still sleeps.
        time.sleep(rng.uniform(1.0, 3.0) * cfg.heartbeat_interval * cfg.heartbeat_misses)
        decode_started()
        _wait(
            dep, rep, rooms, {k: v for k, v in ended.items() if k[0] == "decode"}, report=False
        )  # what never ends is reported once, by the round's own wait
        dep.give_back()
        stalled.signal(signal.SIGCONT)
    elif fault is Fault.BOOTSTRAP_RESTART:
        dep.restart_bootstrap(rng.uniform(0, cfg.deadline / 2))
    with _on_the_link(dep, rng, fault):
        for key, p in dep.ranks.items():
            if key not in killed and key not in started:
                _started(p, rep, len(rooms))
        for key in killed:
            del ended[key]
        _wait(dep, rep, rooms, ended)
    _judge(dep, rep, rooms, ended)
    if fault in _RANK_FAULTS:
        dep.ranks[("prefill", victim_p)].call("faults", "")
    for role, r in killed:
        dep.restart(role, r)
    dep.give_back()


@contextlib.contextmanager
def _on_the_link(dep: Deployment, rng: random.Random, fault: Fault) -> Iterator[None]:
    """A network fault on the link of a host drawn at random, for the rest of the round: a
    partition for up to twice the heartbeat window, then healed (a longer one is a dead peer
    to the other side, a shorter one TCP's to retransmit through); loss or delay throughout."""
    if fault not in NETWORK_FAULTS:
        yield
        return
    host = rng.choice(("prefill", "decode", "bootstrap"))
    if fault is Fault.PARTITION:  # cut and healed before the round waits for its requests
        window = dep.cfg.heartbeat_interval * dep.cfg.heartbeat_misses
        with dep.link_fault(host, fault):
            time.sleep(rng.uniform(0.2, 2.0) * window)  # the fault's length, not a wait
        yield
        return
    with dep.link_fault(host, fault):
        yield


def _wait(
    dep: Deployment,
    rep: Report,
    rooms: list[int],
    ended: dict[tuple[str, int], dict[int, Ended]],
    report: bool = True,
) -> None:
    """Collect every live rank's ended requests into ``ended`` until all ended or the bound
    (the longest, where pauses of the ranks moved deadlines back)."""
    end = time.monotonic() + dep.cfg.longest_bound
    while time.monotonic() < end:
        for key, got in ended.items():
            for e in dep.ranks[key].call("collect"):
                if e.room in rooms:  # not one an earlier round reported as never ended
                    got[e.room] = e
        if all(len(got) == len(rooms) for got in ended.values()):
            break
        time.sleep(0.05)
    for key, got in ended.items() if report else ():
        missing = [r for r in rooms if r not in got]
        if missing:
            rep.hung += len(missing)
            where = dep.ranks[key].call("open", missing)
            rep.violations.append(
                f"{key[0]}{key[1]}: rooms {missing} never ended: "
                + "; ".join(f"{r}: {w}" for r, w in where.items())
                + f"\nits threads now:\n{dep.ranks[key].call('stacks')}"
            )


def _judge(
    dep: Deployment, rep: Report, rooms: list[int], ended: dict[tuple[str, int], dict[int, Ended]]
) -> None:
    for (role, rank), got in ended.items():
        for e in got.values():
            rep.outcomes[(role, e.state, e.kind)] += 1
            rep.longest = max(rep.longest, e.seconds)
            if e.seconds > dep.cfg.bound_for(e.paused):
                rep.violations.append(
                    f"{role}{rank} room {e.room} took {e.seconds:.1f} s "
                    f"(its rank paused {e.paused:.1f} s)"
                )
            if e.bytes_ok is False:
                rep.bad_bytes += 1
                rep.violations.append(f"decode{rank} room {e.room}: success with wrong bytes")
    for (role, p), got in ended.items():
        if role != "prefill":
            continue
        for e in got.values():
            if e.state != "SUCCESS":
                continue
            for d in dep.pairing.receivers_of(p):
                dec = ended.get(("decode", d), {}).get(e.room)
                if dec is not None and dec.state != "SUCCESS":
                    rep.false_success += 1
                    rep.violations.append(
                        f"prefill{p} room {e.room}: SUCCESS while decode{d} "
                        f"{dec.state}: {dec.reason}"
                    )


def _started(p: RankProcess, rep: Report, commands: int) -> None:
    """Collect the replies to a rank's ``begin_*`` commands (bytes landed after release)."""
    try:
        for _ in range(commands):
            rep.landed_after_release += int(p.result() or 0)
    except (TimeoutError, RankError) as e:
        rep.violations.append(f"{p.name} did not start the round: {e}")


def _identities(dep: Deployment) -> dict[tuple[str, int], dict[str, Any]]:
    return {key: p.call("identity") for key, p in dep.ranks.items()}


def _forge(
    dep: Deployment, rooms: list[int], idents: dict[tuple[str, int], dict[str, Any]]
) -> None:
    """What a process on the host with the token could try: every room complete, sent on its
    own connection in the name of the real prefill ranks, in the link's real session."""
    import zmq

    from kvbridge.wire.protocol import ChunkDone, encode

    agents = [idents[("prefill", r)]["agent"] for r in range(dep.pw)]
    ctx = zmq.Context()
    try:
        for d in range(dep.dw):
            ident = idents[("decode", d)]
            for i, session in enumerate(ident["sessions"]):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                rogue = connection_identity(f"rogue-{d}-{i}", TOKEN.encode(), ident["control"])
                sock.setsockopt(zmq.IDENTITY, rogue)  # the token's holder, under its own name
                sock.connect(ident["control"])
                seal = Seal(TOKEN.encode(), ident["control"])  # the deployment's token
                for room in rooms:
                    for rank, agent in enumerate(agents):
                        payload = encode(
                            ChunkDone(
                                sender=agent,
                                session=session,
                                room=room,
                                prefill_rank=rank,
                                start=0,
                                stop=dep.cfg.tokens,
                                parts=["kv", "state", "aux"],
                            )
                        )
                        sock.send_multipart([payload, seal(payload)])
                sock.close(1000)
    finally:
        ctx.term()


def _final(dep: Deployment, rep: Report) -> None:
    """Everything given back, nothing held, nothing left running."""
    end = time.monotonic() + dep.cfg.bound
    while dep.taken and time.monotonic() < end:
        dep.give_back()
        time.sleep(0.05)
    if dep.taken:
        rep.violations.append(f"slots {sorted(dep.taken)} never released")
    else:  # what the last round's writers left in slots already given back
        rep.landed_after_release += sum(p.call("landed") for _, p in dep.decode())
    end = time.monotonic() + 2.0
    while True:
        stats = {k: p.call("stats") for k, p in dep.ranks.items()}
        rooms = sum(s["active_rooms"] for s in stats.values())
        if rooms == 0 or time.monotonic() > end:
            break
        time.sleep(0.05)
    rep.rooms_left = rooms
    # Threads a rank started and kept: transports' per-peer threads are expected (a bounded
    # few per peer); what grows with requests or faults is a leak.
    rep.threads_left = max(0, max(s["threads"] for s in stats.values()) - 4 * (dep.pw + dep.dw))
    if rooms:
        rep.violations.append(f"{rooms} rooms still held: {stats}")
    if rep.threads_left:
        rep.violations.append(f"threads left over: {stats}")
    # A handler that raised is a bug: its channel goes on, but what it was handling is lost.
    if errors := {k: s["handler_errors"] for k, s in stats.items() if s["handler_errors"]}:
        rep.violations.append(f"handlers raised (rank: how often): {errors}")
    if rep.landed_after_release:
        rep.violations.append(f"{rep.landed_after_release} bytes landed after release")
