"""The chaos soak's deployment: real rank processes (restartable), their bootstrap server
(restartable at its address), the hosts they run on (with ``hosts``: a network namespace each,
on one switch), the pairing they form, and which request slots the driver may hand out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from kvbridge.bootstrap import BootstrapServer
from kvbridge.chaos.config import NETWORK_FAULTS, SPEC, TOKEN, ChaosConfig, Fault
from kvbridge.chaos.process import RankProcess
from kvbridge.chaos.ranks import ChaosRank
from kvbridge.config import SettingsError
from kvbridge.deploy.cluster import Job, build_side
from kvbridge.deploy.netns import Network, inside
from kvbridge.planner.plan import Pairing
from kvbridge.planner.sidespec import SideOptions


class Deployment:
    """The ranks, restartable, and what the driver knows of their slots."""

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.net = Network(["bootstrap", "prefill", "decode"]) if cfg.hosts else None
        self.server = self._serve(0)
        self.job = Job(
            SPEC,
            SideOptions.parse(cfg.prefill),
            SideOptions.parse(cfg.decode),
            transport=cfg.transport,
            tokens=cfg.tokens,
            requests=self.slots,
        )
        self.pw = self.job.prefill.parallel(SPEC.num_layers).world
        self.dw = self.job.decode.parallel(SPEC.num_layers).world
        self.pairing = Pairing(
            build_side(self.job, self.job.prefill), build_side(self.job, self.job.decode)
        )
        self.ranks: dict[tuple[str, int], RankProcess] = {}
        self.pids: set[int] = set()  # every rank process it started, restarts included
        for role, n in (("prefill", self.pw), ("decode", self.dw)):
            for r in range(n):
                self.spawn(role, r)
        for p in self.ranks.values():
            p.started()
        self.free: set[int] = set(range(self.slots))
        self.taken: dict[int, set[int]] = {}  # slot -> decode ranks that still hold it

    @property
    def slots(self) -> int:
        return 4 * self.cfg.round

    def on(self, host: str) -> contextlib.AbstractContextManager[None]:
        """This thread on ``host`` for a block (sockets made in it are that host's)."""
        return inside(self.net[host].netns) if self.net else contextlib.nullcontext()

    def _serve(self, port: int) -> BootstrapServer:
        host = self.net["bootstrap"].address if self.net else "127.0.0.1"
        server = BootstrapServer(host=host, port=port, token=TOKEN)
        with self.on("bootstrap"):
            server.start()  # its sockets and threads stay on its host
        return server

    def restart_bootstrap(self, down: float) -> None:
        """The bootstrap service gone for ``down`` seconds, then back at the same address:
        the ranks must find it again by themselves."""
        port = self.server.port
        self.server.stop()
        time.sleep(down)
        self.server = self._serve(port)

    def spawn(self, role: str, rank: int) -> RankProcess:
        settings = dict(self.cfg.settings)
        if self.net:
            settings["host"] = self.net[role].address
        p = self.ranks[(role, rank)] = RankProcess(
            f"{role}{rank}",
            ChaosRank,
            self.job,
            role,
            rank,
            self.server.address,
            settings,
            self.slots,
            netns=self.net[role].netns if self.net else None,
        )
        self.pids.add(p.pid)
        return p

    def restart(self, role: str, rank: int) -> None:
        self.spawn(role, rank).started()
        if role == "decode":  # a new process: its pool is fresh, nothing of it is held
            for holders in self.taken.values():
                holders.discard(rank)
            self._settle()

    def decode(self) -> list[tuple[int, RankProcess]]:
        return [(r, self.ranks[("decode", r)]) for r in range(self.dw)]

    def prefill(self) -> list[tuple[int, RankProcess]]:
        return [(r, self.ranks[("prefill", r)]) for r in range(self.pw)]

    def take(self, n: int) -> list[int]:
        got = sorted(self.free)[:n]
        for s in got:
            self.free.discard(s)
            self.taken[s] = set(range(self.dw))
        return got

    def give_back(self) -> None:
        for r, p in self.decode():
            for slot in p.call("reuse", self.cfg.eager_reuse):
                self.taken.get(slot, set()).discard(r)
        self._settle()

    def _settle(self) -> None:
        for slot in [s for s, holders in self.taken.items() if not holders]:
            del self.taken[slot]
            self.free.add(slot)

    @contextlib.contextmanager
    def link_fault(self, host: str, fault: Fault) -> Iterator[None]:
        """``host``'s link for the block: cut off (PARTITION), 1% of what it receives lost
        (LOSS) or held 5 ms (DELAY); as it was after."""
        net = self.net
        if net is None or fault not in NETWORK_FAULTS:
            raise SettingsError(f"{fault.value} is a fault of a link between hosts")
        if fault is Fault.PARTITION:
            net.partition(host)
            try:
                yield
            finally:
                net.heal(host)
            return
        act, amount = (net.loss, 1.0) if fault is Fault.LOSS else (net.delay, 5.0)
        act(host, amount)
        try:
            yield
        finally:
            act(host, 0)

    def close(self) -> None:
        try:
            for p in self.ranks.values():
                p.close()
            self.server.stop()
        finally:
            if self.net:
                self.net.close()
