"""Device memory on a host without CUDA: where memory lives is described and validated, device
memory is never read as host memory (host transports refuse it at registration, naming the
transports that take it), and the GPU commands refuse in one line with exit status 2."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge.errors import (
    DeviceError,
    DeviceNotSupported,
    LayoutError,
    TransportError,
    TransportUnavailable,
)
from kvbridge.memory.device import cuda_unavailable, wait_event
from kvbridge.memory.location import HOST, Location, MemoryKind, cuda
from kvbridge.memory.pools import RegionMemory, wrap_address
from kvbridge.transports import DEVICE_ONLY, HOST_NAMES, create
from kvbridge.transports._common import LocalRegions

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = cuda_unavailable()
needs_no_cuda = pytest.mark.skipif(NO_CUDA is None, reason="CUDA is usable here")
FAKE_DEVICE_POINTER = 0x7F00_0000_0000  # described, never dereferenced


def test_locations_validate_themselves() -> None:
    assert HOST.kind is MemoryKind.HOST and not HOST.is_device and str(HOST) == "host"
    assert cuda(3) == Location(MemoryKind.CUDA, 3) and str(cuda(3)) == "cuda:3"
    assert Location.parse("cuda") == cuda(0) and Location.parse("CUDA:2") == cuda(2)
    assert Location.parse("cpu") is HOST and Location.from_index(-1) is HOST
    assert Location.from_index(1) == cuda(1)
    for bad in ("tpu", "cuda:", "cuda:-1", "cuda:x"):
        with pytest.raises(LayoutError):
            Location.parse(bad)
    with pytest.raises(LayoutError):
        Location(MemoryKind.HOST, 0)
    with pytest.raises(LayoutError):
        Location(MemoryKind.CUDA, -1)


def test_device_memory_has_no_host_view_and_no_segment() -> None:
    r = wrap_address("k", FAKE_DEVICE_POINTER, 4096, location=cuda(0))
    assert r.on_device and r.location == cuda(0)
    with pytest.raises(DeviceError, match="no host view"):
        r.view()
    with pytest.raises(LayoutError, match="shared-memory segment"):
        RegionMemory("k", FAKE_DEVICE_POINTER, 4096, segment="kvb_x", location=cuda(0))


def test_peers_learn_each_regions_device() -> None:
    local = LocalRegions()
    local.add([wrap_address("k", FAKE_DEVICE_POINTER, 4096, location=cuda(1))])
    (info,) = local.addressed_infos()
    assert (info.device, info.address) == (1, FAKE_DEVICE_POINTER)
    with pytest.raises(TransportError, match="not registered"):
        local.views(["k", "v"])
    if cuda_unavailable() is not None:  # its bytes are a CUDA tensor, never a host view
        with pytest.raises(DeviceError, match="CUDA"):
            local.views(["k"])


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp"])
def test_host_transports_refuse_device_memory_at_registration(transport: str) -> None:
    t = create(transport, "a")
    try:
        device = wrap_address("k", FAKE_DEVICE_POINTER, 4096, location=cuda(0))
        with pytest.raises(DeviceNotSupported, match=rf"{transport}.*cudaipc"):
            t.register([device])
    finally:
        t.close()


def test_the_gpu_transport_is_listed_apart_from_host_ones() -> None:
    assert DEVICE_ONLY == ("cudaipc",) and "cudaipc" not in HOST_NAMES


@needs_no_cuda
def test_cudaipc_is_unavailable_without_cuda_saying_why() -> None:
    with pytest.raises(TransportUnavailable, match="needs CUDA"):
        create("cudaipc", "a")


class _CountingEvent:
    """Completes after ``n`` queries, as a CUDA event does once its stream got there."""

    def __init__(self, n: int) -> None:
        self.left = n

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_waiting_for_an_engine_event_is_bounded_by_the_deadline() -> None:
    assert wait_event(None, 0.0)  # host memory: nothing to wait for
    assert wait_event(_CountingEvent(3), time.monotonic() + 10)
    t0 = time.monotonic()
    assert not wait_event(_CountingEvent(10**9), t0 + 0.05)
    assert time.monotonic() - t0 < 1.0


@needs_no_cuda
@pytest.mark.slow  # a command in a process of its own, importing torch: seconds each
@pytest.mark.parametrize("command", [["demo"], ["bench"]])
def test_gpu_commands_refuse_in_one_line_without_cuda(command: list[str]) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "kvbridge", *command, "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device" in lines[0] and NO_CUDA in lines[0], p.stderr


@needs_no_cuda
@pytest.mark.slow  # the script, then python importing torch
def test_gpu_check_script_skips_in_one_line_without_cuda() -> None:
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert p.stdout.splitlines() == [f"gpu_check.sh: SKIP: {NO_CUDA}"], p.stdout + p.stderr
