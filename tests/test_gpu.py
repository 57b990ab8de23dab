"""CUDA device memory, on a GPU: the byte grid over every transport that moves it, the
refusals, and the ordering hook. Skipped, saying why, where CUDA is not usable (CI, this
project's CPU hosts); ``scripts/gpu_check.sh`` runs it on a GPU machine."""

from __future__ import annotations

import time

import pytest

from kvbridge.device import DevicePool, cuda_unavailable, tensor_of, wait_event, wrap_tensor
from kvbridge.errors import DeviceError, DeviceNotSupported
from kvbridge.layout import Region
from kvbridge.location import cuda
from kvbridge.transports import create

WHY = cuda_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"needs CUDA: {WHY}")


@pytest.mark.parametrize("transport", ["cudaipc", "nixl", "mooncake"])
def test_device_pools_match_the_reference_over(transport: str) -> None:
    from kvbridge.bench.device import byte_grid

    rows = byte_grid([transport], cuda(0))
    if rows and rows[0].detail.startswith("SKIP"):
        pytest.skip(rows[0].detail)
    bad = [f"{r.case}: {r.detail}" for r in rows if not r.ok]
    assert not bad, bad


@pytest.mark.parametrize("transport", ["shm", "tcp", "inproc"])
def test_host_transports_refuse_device_memory_at_registration(transport: str) -> None:
    with DevicePool([Region("k", 4096)], cuda(0)) as pool:
        t = create(transport, "a")
        try:
            with pytest.raises(DeviceNotSupported, match="cudaipc"):
                t.register(pool.regions())
        finally:
            t.close()


def test_an_engine_tensor_is_wrapped_in_place() -> None:
    import torch

    x = torch.arange(1024, dtype=torch.int32, device="cuda:0")
    r = wrap_tensor("x", x)
    assert (r.address, r.nbytes, r.location) == (x.data_ptr(), 4096, cuda(0))
    with pytest.raises(DeviceError):
        r.view()  # no host view of device memory
    assert torch.equal(tensor_of(r).view(torch.int32), x)


def test_a_sender_waits_for_the_engines_event() -> None:
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # a long "forward" on the engine's stream
        event = torch.cuda.Event()
        event.record(stream)
    assert not wait_event(event, time.monotonic() + 0.001)  # deadline first: not yet
    assert wait_event(event, time.monotonic() + 60)
    assert event.query()
