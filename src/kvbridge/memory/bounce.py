"""A thread's bounce buffer: how a transport that copies with the CPU (tcp) moves device memory.

A socket reads and writes host memory only. Device bytes therefore go through pinned host
memory, in pieces of at most the buffer's size, so that a transfer of any size needs a fixed
buffer: a sender's runs are gathered on the GPU into a device staging buffer (one
gather kernel per region for many runs: :func:`~kvbridge.memory.gather.copy_flat`) and copied
device-to-host into the pinned buffer, which then goes on the wire; a receiver's bytes come off
the wire into the pinned buffer, are copied host-to-device into the staging buffer and
scattered into the pages. Every copy runs on a CUDA stream of kvbridge's own (never the
engine's) and is synchronized before the host buffer is sent or reused, so a receiver that
acknowledges a batch after its last piece acknowledges bytes that have landed in device memory,
and a fence that returns after a piece returns after its device writes.

The engine's own writes are ordered before ours by the sender, which waits for the engine's
CUDA event before it posts (:meth:`kvbridge.runtime.prefill.sender.Sender.send`).

For host memory a bounce buffer is plain (pageable) host memory, and nothing else.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbridge.errors import DeviceError
from kvbridge.memory.device import require_cuda
from kvbridge.memory.gather import copy_flat
from kvbridge.memory.location import HOST, Location


class Bounce:
    """``nbytes`` of host memory (``host``, a uint8 array), pinned when ``location`` is a
    device; then also as many bytes on the device and a CUDA stream there. One per thread."""

    def __init__(self, nbytes: int, location: Location = HOST) -> None:
        self.location = location
        self._torch: Any = None
        if not location.is_device:
            self.host = np.empty(nbytes, dtype=np.uint8)
            return
        torch = self._torch = require_cuda(location)
        with torch.cuda.device(location.device):
            # Pinned: a device copy into pageable memory is staged by the driver and
            # synchronous; into pinned memory it runs at the link's speed, on our stream.
            self._pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=str(location))
            self._stream = torch.cuda.Stream()
        self.host = self._pinned.numpy()

    @property
    def nbytes(self) -> int:
        return int(self.host.nbytes)

    def to_host(self, tensor: Any, offsets: np.ndarray, sizes: np.ndarray) -> None:
        """Gather flat runs (``sizes[i]`` bytes at ``offsets[i]``) of device tensor ``tensor``
        into ``host``, packed in order; returns once they are there."""
        torch, n = self._device_side(tensor), int(sizes.sum())
        with torch.cuda.device(self.location.device), torch.cuda.stream(self._stream):
            if len(sizes) == 1:  # one run: straight from the pages, no staging
                src = tensor[int(offsets[0]) : int(offsets[0]) + n]
            else:
                copy_flat(torch, self._staging, tensor, _packed(sizes), offsets, sizes)
                src = self._staging[:n]
            self._pinned[:n].copy_(src, non_blocking=True)
        self._stream.synchronize()

    def from_host(self, tensor: Any, offsets: np.ndarray, sizes: np.ndarray) -> None:
        """Scatter ``host``'s first bytes, packed in order, into flat runs of device tensor
        ``tensor``; returns once they have landed."""
        torch, n = self._device_side(tensor), int(sizes.sum())
        with torch.cuda.device(self.location.device), torch.cuda.stream(self._stream):
            if len(sizes) == 1:
                tensor[int(offsets[0]) : int(offsets[0]) + n].copy_(
                    self._pinned[:n], non_blocking=True
                )
            else:
                self._staging[:n].copy_(self._pinned[:n], non_blocking=True)
                copy_flat(torch, tensor, self._staging, offsets, _packed(sizes), sizes)
        self._stream.synchronize()

    def _device_side(self, tensor: Any) -> Any:
        if self._torch is None:
            raise DeviceError(
                "this bounce buffer was made for host memory; device runs need one made "
                "for their device"
            )
        if tensor.get_device() != self.location.device:
            raise DeviceError(
                f"bounce buffer on {self.location}, runs on cuda:{tensor.get_device()}"
            )
        return self._torch


def _packed(sizes: np.ndarray) -> np.ndarray:
    """Where each run starts when the runs are packed back to back."""
    out: np.ndarray = np.cumsum(sizes) - sizes
    return out
