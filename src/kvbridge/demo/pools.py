"""A demo rank's pools, on the host or on a CUDA device (``kvbridge demo --device cuda``).

The demo writes a rank's shard of the cache into its pages, and reads the received pages
back, with numpy (:func:`kvbridge.planner.reference.fill`, :mod:`.cache_io`): the reference re-shard
is the oracle of the whole project, and it is host code. On the host the pools kvbridge
registers are those numpy views. On a device they are a :class:`~kvbridge.memory.device.DevicePool`
that the transports move device to device, with the numpy views as the engine's side of it:
the prefill uploads the bytes of the layers it is about to send and hands the sender the CUDA
event recorded behind the copies (``Sender.send(wait_event=...)``: nothing is read before the
bytes landed, as with an engine's forward); the decode downloads its pages once the request
succeeded. Every byte kvbridge moves is device memory: the page scatter and gather are the
demo's, not kvbridge's.

This module imports torch: it runs in worker processes only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from kvbridge.memory.device import DevicePool
from kvbridge.memory.location import Location
from kvbridge.memory.pools import HostPool
from kvbridge.planner.layout import Region


class RankPools:
    """The regions of one rank: ``views`` (numpy, what the demo writes and reads) and
    :meth:`registered` (what its :class:`~kvbridge.runtime.Bridge` is given)."""

    def __init__(self, regions: Sequence[Region], device: str, *, shared: bool = False) -> None:
        self.location = Location.parse(device)
        self.host = HostPool(regions, shared=shared and not self.location.is_device)
        self.views: dict[str, np.ndarray] = {r.name: self.host.view(r.name) for r in regions}
        self.dev: DevicePool | None = None
        if self.location.is_device:
            torch.cuda.set_device(self.location.device)  # the copies and events below run here
            self.dev = DevicePool(regions, self.location)

    def registered(self) -> HostPool | tuple[Any, ...]:
        return self.host if self.dev is None else self.dev.regions()

    def fill(self, byte: int | None = None, rng: np.random.Generator | None = None) -> None:
        """Every byte ``byte``, or drawn from ``rng``, on the host and on the device alike."""
        for v in self.views.values():
            v[:] = byte if rng is None else rng.integers(0, 256, len(v), dtype=np.uint8)
        self.upload()
        if self.dev is not None:
            torch.cuda.synchronize(self.location.device)

    def upload(self, names: Iterable[str] | None = None) -> Any:
        """Copy regions ``names`` (all by default) to the device; the CUDA event recorded
        behind the copies (None on the host, where the views are the registered memory)."""
        if self.dev is None:
            return None
        for name in self.views if names is None else names:
            self.dev.view(name).copy_(torch.from_numpy(self.views[name]))
        event = torch.cuda.Event()
        event.record()
        return event

    def download(self) -> None:
        """The device's bytes into the views (nothing to do on the host)."""
        if self.dev is not None:
            for name, v in self.views.items():
                v[:] = self.dev.view(name).cpu().numpy()

    def close(self) -> None:
        if self.dev is not None:
            self.dev.close()
        self.host.close()
