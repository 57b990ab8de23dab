"""Ranks for the fencing and security tests: one Bridge per process, driven by commands.

Each rank is a spawned process (:class:`~kvbridge.chaos.process.RankProcess`) holding one
prefill or decode Bridge with its pools (prefill: the reference shards of every request;
decode: canary bytes). The test drives the
life of requests step by step (create, send, wait, reuse pages, look at bytes), so that it can
stall, kill or impersonate peers between any two steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.bootstrap import BootstrapServer
from kvbridge.chaos.process import RankProcess
from kvbridge.deploy.cluster import Job, bootstrap_service, build_side, placements
from kvbridge.model.spec import CacheSpec, DType, attention_layer
from kvbridge.planner.sidespec import SideOptions

CANARY = 0xA5
REUSED = 0x5A  # what the decode engine writes into pages it was told it may reuse


class Commands:
    def __init__(
        self, job: Job, role: str, rank: int, bootstrap: str, settings: dict[str, Any]
    ) -> None:
        from kvbridge.config import Settings
        from kvbridge.memory.pools import HostPool
        from kvbridge.planner.reference import fill, logical_cache
        from kvbridge.runtime import Bridge
        from kvbridge.wire.protocol import Role

        self.job, self.role, self.rank = job, role, rank
        decode = role == "decode"
        self.side = build_side(job, job.decode if decode else job.prefill)
        self.pool = HostPool(
            self.side.memory.regions_of(self.side.parallel.layers_of(rank)),
            shared=decode and job.transport == "shm",
        )
        # The bytes the test reads and writes; the Bridge's own memory may be elsewhere.
        self.views = {r.name: self.pool.view(r.name) for r in self.pool.regions()}
        self.places = placements(job, job.decode if decode else job.prefill, int(decode))
        for v in self.views.values():
            v[:] = CANARY
        if not decode:
            for i, p in enumerate(self.places):
                fill(
                    self.side,
                    p,
                    logical_cache(job.spec, job.tokens, job.seed + i),
                    {rank: self.views},
                    decode=False,
                    ranks=[rank],
                )
        self.bridge = Bridge(
            role=Role.DECODE if decode else Role.PREFILL,
            spec=job.spec,
            parallel=self.side.parallel,
            rank=rank,
            memory=self.side.memory,
            regions=self._registered(),
            transport=job.transport,
            transport_options=job.transport_options,
            bootstrap=bootstrap,
            engine_id=role,
            settings=Settings.from_env(**settings),
        ).start()
        self.ends: dict[int, Any] = {}

    def _registered(self) -> Any:
        """The memory the Bridge moves: here the pool the test's views look at."""
        return self.pool

    def _pull(self) -> None:
        """Make the test's views show the Bridge's bytes (a no-op: they are the same)."""

    def _store(self, name: str, mask: np.ndarray, value: int) -> None:
        """Write ``value`` at ``mask`` of region ``name``, as the engine reusing pages would."""
        self.views[name][mask] = value

    # ---- prefill ---------------------------------------------------------------------------

    def send(self, rooms: list[int]) -> None:
        """A sender per room (room i lives in placement i), every token sent in one chunk."""
        for room in rooms:
            s = self.ends[room] = self.bridge.sender(room, self.places[room - 1000])
            s.send(self.job.tokens)

    def asked(self, rooms: list[int]) -> int:
        """How many of ``rooms`` a decode rank's metadata reached here before their senders."""
        return sum(self.bridge.asked(room) is not None for room in rooms)

    # ---- decode ----------------------------------------------------------------------------

    def receive(self, rooms: list[int]) -> None:
        for room in rooms:
            r = self.ends[room] = self.bridge.receiver(room)
            r.init(self.places[room - 1000])

    def abort(self, rooms: list[int]) -> None:
        for room in rooms:
            self.ends[room].abort("aborted by the test")

    def staged(self) -> tuple[int, int]:
        """Staged segments this decode rank scattered, and refused (their request ended)."""
        return self.bridge.staged_segments()

    def released(self, rooms: list[int]) -> dict[int, str]:
        return {room: self.ends[room].release.name for room in rooms}

    def reuse(self, rooms: list[int]) -> int:
        """The engine reuses the pages of every released request: fresh bytes in all of them.
        Returns how many bytes it wrote."""
        n = 0
        for room in rooms:
            r = self.ends[room]
            if not r.released:
                continue
            for name, mask in self._request_bytes(room).items():
                self._store(name, mask, REUSED)
                n += int(mask.sum())
        return n

    def landed_after_reuse(self, rooms: list[int]) -> int:
        """Bytes of reused pages that are no longer what the engine wrote there."""
        bad = 0
        self._pull()
        for room in rooms:
            if self.ends[room].released:
                for name, mask in self._request_bytes(room).items():
                    bad += int((self.views[name][mask] != REUSED).sum())
        return bad

    def _request_bytes(self, room: int) -> dict[str, np.ndarray]:
        """A mask per region of the destination bytes of request ``room``."""
        from kvbridge.planner.reference import fill, logical_cache

        i = room - 1000
        probe = {n: np.zeros(len(v), dtype=np.uint8) for n, v in self.views.items()}
        fill(
            self.side,
            self.places[i],
            logical_cache(self.job.spec, self.job.tokens, 0),
            {self.rank: probe},
            decode=True,
            ranks=[self.rank],
        )
        # fill() writes the request's bytes; bytes equal to 0 there stay unmarked, so mark
        # by writing twice with two different caches.
        probe2 = {n: np.full(len(v), 0xFF, dtype=np.uint8) for n, v in self.views.items()}
        fill(
            self.side,
            self.places[i],
            logical_cache(self.job.spec, self.job.tokens, 0),
            {self.rank: probe2},
            decode=True,
            ranks=[self.rank],
        )
        return {n: (probe[n] == probe2[n]) for n in probe}

    def verify(self, rooms: list[int]) -> bool:
        from kvbridge.planner.reference import fill, logical_cache

        self._pull()
        want = {self.rank: {n: v.copy() for n, v in self.views.items()}}
        for room in rooms:
            i = room - 1000
            fill(
                self.side,
                self.places[i],
                logical_cache(self.job.spec, self.job.tokens, self.job.seed + i),
                want,
                decode=True,
                ranks=[self.rank],
            )
        return all(np.array_equal(v, want[self.rank][n]) for n, v in self.views.items())

    # ---- both ------------------------------------------------------------------------------

    def wait(self, rooms: list[int], timeout: float) -> dict[int, tuple[str, str]]:
        """Each room's state once it ended (or when ``timeout`` passed) and its failure."""
        end = time.monotonic() + timeout
        for room in rooms:
            self.ends[room].wait(max(0.0, end - time.monotonic()))
        return {
            room: (self.ends[room].poll().name, str(self.ends[room].failure or ""))
            for room in rooms
        }

    def identity(self) -> dict[str, Any]:
        """What an attacker on this host could learn: agent, endpoints, link sessions."""
        import msgspec

        sessions = self.bridge.sessions()
        return {
            "agent": self.bridge.agent,
            "control": self.bridge.info.control,
            "transport_meta": msgspec.json.decode(self.bridge.info.transport_meta),
            "info": msgspec.json.encode(self.bridge.info),
            "sessions": sessions,
        }

    def refused(self) -> int:
        """Messages and batches this rank refused (control channel, role, transport)."""
        role = self.bridge._decode or self.bridge._prefill
        return (
            self.bridge.channel.refused
            + getattr(role, "refused", 0)
            + getattr(self.bridge.transport, "refused", 0)
        )

    def active(self) -> int:
        return self.bridge.active_rooms()

    def maps(self, needle: str) -> int:
        """Lines of this process's memory map that name ``needle``."""
        return sum(needle in line for line in Path("/proc/self/maps").read_text().splitlines())

    def segments(self) -> list[str]:
        return [self.pool.segment] if self.pool.segment else []

    def close(self) -> None:
        self.bridge.close()
        self.pool.close()


class DeviceCommands(Commands):
    """A rank whose Bridge moves CUDA device memory (device 0): the host pool is the test's
    copy of it, uploaded once filled and downloaded before each look at the bytes."""

    def _registered(self) -> Any:
        import torch

        from kvbridge.memory.device import DevicePool
        from kvbridge.memory.location import cuda
        from kvbridge.planner.layout import Region

        self.device = DevicePool([Region(r.name, r.nbytes) for r in self.pool.regions()], cuda(0))
        for name, view in self.views.items():
            self.device.view(name).copy_(torch.from_numpy(view))
        torch.cuda.synchronize()
        return self.device.regions()

    def _pull(self) -> None:
        for name, view in self.views.items():
            view[:] = self.device.view(name).cpu().numpy()

    def _store(self, name: str, mask: np.ndarray, value: int) -> None:
        import torch

        super()._store(name, mask, value)
        dev = self.device.view(name)
        dev[torch.from_numpy(mask).to(dev.device)] = value
        torch.cuda.synchronize()

    def device_intact(self) -> bool:
        """The device still answers, and holds the bytes last uploaded or stored (what a
        prefill rank's pools must keep whatever its peers did)."""
        return all(
            np.array_equal(self.device.view(name).cpu().numpy(), view)
            for name, view in self.views.items()
        )

    def close(self) -> None:
        super().close()
        self.device.close()


class NewerCommands(Commands):
    """A rank of a newer kvbridge release: it speaks the next protocol version."""

    def __init__(self, *args: Any) -> None:
        import kvbridge.wire.protocol

        kvbridge.wire.protocol.PROTOCOL_VERSION += 1
        super().__init__(*args)


def rank_process(
    job: Job,
    role: str,
    rank: int,
    bootstrap: str,
    settings: dict[str, Any],
    factory: type[Commands] = Commands,
) -> RankProcess:
    """A rank of ``job``, on its side's host where the job has hosts."""
    host = job.hosts[1 + (role == "decode")] if job.hosts else None
    if host is not None:
        settings = {"host": host.address, **settings}
    return RankProcess(
        f"{role}{rank}",
        factory,
        job,
        role,
        rank,
        bootstrap,
        settings,
        netns=host.netns if host else None,
    )


# 8 layers x 8 KV heads x 128 x bf16: 32 KiB a token; 2048 tokens = 64 MiB, so that a stall
# right after posting lands in the middle of the copy.
BIG = CacheSpec("big", tuple(attention_layer(8, 128, DType.BFLOAT16) for _ in range(8)))
SMALL = CacheSpec("small", tuple(attention_layer(2, 8, DType.BFLOAT16) for _ in range(2)))
# Deadlines short enough for tests that wait them out. The heartbeat window (2 s) is the
# shortest silence a loaded CI host is not expected to impose on a live rank: at 0.5 s, one
# room of 30 failed once while the other worker started an SGLang server.
QUICK = {
    "bootstrap_timeout": 10.0,
    "waiting_timeout": 10.0,
    "transfer_timeout": 20.0,
    "abort_timeout": 1.0,
    "heartbeat_interval": 0.2,
    "heartbeat_misses": 10,
}


def until(cond: Callable[[], Any], timeout: float = 10.0, step: float = 0.05) -> Any:
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got or time.monotonic() > end:
            return got
        time.sleep(step)


@contextmanager
def deployment(
    job: Job,
    settings: dict[str, Any] | None = None,
    prefill_settings: dict[int, dict[str, Any]] | None = None,
    factory: type[Commands] = Commands,
) -> Iterator[tuple[list[RankProcess], list[RankProcess], BootstrapServer]]:
    settings = {**QUICK, **(settings or {})}
    token = settings.get("token") or None
    with bootstrap_service(job, token) as server:
        pw = job.prefill.parallel(job.spec.num_layers).world
        dw = job.decode.parallel(job.spec.num_layers).world
        prefill = [
            rank_process(
                job,
                "prefill",
                r,
                server.address,
                {**settings, **(prefill_settings or {}).get(r, {})},
                factory,
            )
            for r in range(pw)
        ]
        decode = [
            rank_process(job, "decode", r, server.address, settings, factory) for r in range(dw)
        ]
        try:
            for rank in [*prefill, *decode]:
                # The harness's wait for a rank to come up, not a deadline of kvbridge's: a
                # prefill rank of a 64 MiB job fills its pools first (10 s alone here; over 60 s
                # once, beside two engine servers starting on the other worker).
                rank.started(timeout=180.0)
            yield prefill, decode, server
        finally:
            for rank in [*decode, *prefill]:
                rank.close()


def job_of(
    spec: CacheSpec, prefill: str, decode: str, transport: str, tokens: int, requests: int = 1
) -> Job:
    return Job(
        spec,
        SideOptions.parse(prefill),
        SideOptions.parse(decode),
        transport=transport,
        tokens=tokens,
        requests=requests,
    )
