"""In-process transport: agents of one process write into each other's regions directly.

For tests and single-process demos. A process-global table maps agent ids to live agents;
``post`` copies synchronously with :func:`kvbridge.memory.copy.execute`, so the handle it returns is
already terminal.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

from kvbridge.errors import TransportError
from kvbridge.memory.copy import execute
from kvbridge.memory.pools import RegionMemory
from kvbridge.planner.runs import Runs
from kvbridge.transports._common import (
    DEVICE_TRANSPORTS,
    METADATA_VERSION,
    AgentMetadata,
    LocalRegions,
    checked_sources,
    decode_metadata,
    encode_metadata,
    refuse_device,
)
from kvbridge.transports.base import FenceKey, Transport, XferHandle

_AGENTS: dict[str, InprocTransport] = {}
_AGENTS_LOCK = threading.Lock()


class InprocTransport(Transport):
    name: ClassVar[str] = "inproc"

    def __init__(self, agent: str) -> None:
        super().__init__(agent)
        with _AGENTS_LOCK:
            if agent in _AGENTS:
                raise TransportError(f"an inproc agent {agent!r} already exists in this process")
            _AGENTS[agent] = self
        self._local = LocalRegions()
        self._peers: dict[str, AgentMetadata] = {}
        self._closed = False

    def register(self, regions: Sequence[RegionMemory]) -> bytes:
        self._check_open()
        refuse_device(self.name, regions, DEVICE_TRANSPORTS)
        self._local.add(regions)
        return encode_metadata(
            AgentMetadata(METADATA_VERSION, self.name, self.agent, self._local.infos())
        )

    def add_peer(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        self._peers[peer] = decode_metadata(metadata, self.name, peer)

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def post(
        self,
        peer: str,
        src_regions: Sequence[str],
        dst_regions: Sequence[str],
        runs: Runs,
        *,
        key: FenceKey | None = None,
    ) -> XferHandle:
        self._check_open()
        meta = self._peers.get(peer)
        if meta is None:
            raise TransportError(f"unknown peer {peer!r}; add_peer it first")
        src = checked_sources(self._local, meta, peer, src_regions, dst_regions, runs)
        with _AGENTS_LOCK:
            target = _AGENTS.get(peer)
        handle = XferHandle(self, peer, runs.total_bytes, 1)
        if target is None:
            handle.part_done(f"inproc peer {peer!r} is closed")
            return handle
        try:
            dst = target._local.views(dst_regions, "destination")
            # The peer may have re-registered since its metadata: execute checks live sizes.
            execute(runs, src, dst, src_names=src_regions, dst_names=dst_regions)
        except TransportError as e:
            handle.part_done(str(e))
        else:
            handle.part_done()
        return handle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _AGENTS_LOCK:
            if _AGENTS.get(self.agent) is self:
                del _AGENTS[self.agent]
        self._peers.clear()
        self._local.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"inproc agent {self.agent!r} is closed")
