"""Runs between one rank's own regions, wherever they live: the staged path's gathers (into a
staging slot, before the transport writes it) and scatters (out of one, before the chunk is
reported), :mod:`kvbridge.runtime.prefill.staged` and :mod:`kvbridge.runtime.decode.landing`.

A rank whose memory is host memory copies with numpy (:func:`kvbridge.memory.copy.execute`).
A rank whose pools are on a CUDA device (its staging region with them) copies with torch, many
runs in a few kernels (:func:`kvbridge.memory.gather.copy_runs`), on a stream of its own, and
returns only once they are done: a gathered slot is posted, and a scattered one reported, only
when its bytes are there. A host region among device ones (SGLang's aux slots) is copied run by
run across. Every run is bounds-checked before the first byte moves, as for host memory.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvbridge.memory.copy import check, execute
from kvbridge.memory.device import bind_thread, require_cuda, tensor_of
from kvbridge.memory.gather import copy_runs
from kvbridge.memory.location import Location
from kvbridge.memory.pools import RegionMemory
from kvbridge.planner.runs import Runs


class Copier:
    """Copies runs between named regions of one rank (``src``/``dst``: the names the runs'
    region numbers index)."""

    def copy(self, runs: Runs, src: Sequence[str], dst: Sequence[str]) -> None:
        raise NotImplementedError


class HostCopier(Copier):
    """Host regions, through their numpy views."""

    def __init__(self, views: Mapping[str, np.ndarray]) -> None:
        self._views = views

    def copy(self, runs: Runs, src: Sequence[str], dst: Sequence[str]) -> None:
        execute(
            runs,
            [self._views[n] for n in src],
            [self._views[n] for n in dst],
            src_names=src,
            dst_names=dst,
        )


class TorchCopier(Copier):
    """Regions as uint8 torch tensors (a device's, or host ones as CPU tensors over their
    memory); ``location``: the device whose stream copies (host: torch's CPU copies, which the
    tests use to check this class against :class:`HostCopier`)."""

    def __init__(self, tensors: Mapping[str, Any], torch: Any, location: Location) -> None:
        self._tensors, self._torch, self._location = tensors, torch, location
        self._stream = torch.cuda.Stream(device=location.device) if location.is_device else None
        self._bound = threading.local()  # the threads whose device is set

    def copy(self, runs: Runs, src: Sequence[str], dst: Sequence[str]) -> None:
        if not len(runs):
            return
        s, d = [self._tensors[n] for n in src], [self._tensors[n] for n in dst]
        check(
            runs,
            [int(t.numel()) for t in s],
            [int(t.numel()) for t in d],
            src_names=src,
            dst_names=dst,
        )
        flat = runs.flat()
        where = {dev: k for k, dev in enumerate({str(t.device) for t in (*s, *d)})}
        s_at = np.array([where[str(t.device)] for t in s], dtype=np.int64)
        d_at = np.array([where[str(t.device)] for t in d], dtype=np.int64)
        across = s_at[flat.src_region] != d_at[flat.dst_region]
        if self._stream is None:
            self._copy(flat, s, d, across)
            return
        torch = self._torch
        if not getattr(self._bound, "done", False):  # once a thread: it synchronizes the device
            bind_thread(self._location)  # (the thread may never have used the device)
            self._bound.done = True
        with torch.cuda.device(self._location.device), torch.cuda.stream(self._stream):
            self._copy(flat, s, d, across)
        self._stream.synchronize()  # this stream's copies only: never the engine's work

    def _copy(self, flat: Runs, s: list[Any], d: list[Any], across: np.ndarray) -> None:
        if not across.all():
            copy_runs(self._torch, d, s, flat.select(~across))
        for i in np.flatnonzero(across).tolist():
            a, b, n = (int(x[i]) for x in (flat.src_offset, flat.dst_offset, flat.nbytes))
            src_t, dst_t = s[int(flat.src_region[i])], d[int(flat.dst_region[i])]
            dst_t[b : b + n].copy_(src_t[a : a + n])


def copier_for(
    regions: Sequence[RegionMemory], views: Mapping[str, np.ndarray], location: Location
) -> Copier:
    """The copier of a rank whose memory is at ``location`` (``views``: its host regions')."""
    if not location.is_device:
        return HostCopier(views)
    torch = require_cuda(location)
    tensors = {
        r.name: tensor_of(r) if r.on_device else torch.from_numpy(views[r.name]) for r in regions
    }
    return TorchCopier(tensors, torch, location)
