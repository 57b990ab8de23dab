"""CUDA device memory, on a GPU: the byte grid over every transport that moves it (tcp's
through pinned bounce buffers), the refusals, and the ordering hook. Skipped, saying why,
where CUDA is not usable (CI, this project's CPU hosts); ``scripts/gpu_check.sh`` runs it on
a GPU machine."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbridge.errors import DeviceError, DeviceNotSupported
from kvbridge.memory.device import DevicePool, cuda_unavailable, tensor_of, wait_event, wrap_tensor
from kvbridge.memory.location import cuda
from kvbridge.planner.layout import Region
from kvbridge.planner.runs import Runs
from kvbridge.transports import create

WHY = cuda_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"needs CUDA: {WHY}")


@pytest.mark.parametrize("transport", ["cudaipc", "tcp", "nixl", "mooncake"])
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


def test_tcp_moves_device_and_host_regions_in_one_batch() -> None:
    """KV pages on the device and aux slots in host memory (as SGLang keeps them), posted in
    one batch over tcp: 4 KiB pieces shuffled, a strided run and a run longer than the
    bounce buffer, device pieces through the pinned buffers; bytes exact, the rest kept."""
    import torch

    from kvbridge.memory.pools import HostPool
    from kvbridge.transports.base import TransportOptions, XferState

    kv, aux, piece = 8 << 20, 1 << 16, 4096
    opts = TransportOptions(device=cuda(0))
    pools = []
    agents = [create("tcp", name, opts) for name in ("p", "d")]
    try:
        for i, t in enumerate(agents):
            dev = DevicePool([Region(f"kv{i}", kv)], cuda(0))
            host = HostPool([Region(f"aux{i}", aux)], shared=False)
            pools += [dev, host]
            if i == 0:
                dev.view("kv0").copy_(torch.randint(0, 256, (kv,), dtype=torch.uint8))
                host.view("aux0")[:] = np.random.default_rng(1).integers(0, 256, aux, np.uint8)
            else:
                dev.view("kv1").fill_(0xA5)
                host.view("aux1")[:] = 0xA5
            t.register([*dev.regions(), *host.regions()])
        agents[0].add_peer("d", agents[1].register([]))
        k = kv // 2 // piece
        src = np.arange(k, dtype=np.int64) * piece
        dst = np.random.default_rng(2).permutation(src)
        rows = [  # (src region, src offset, dst region, dst offset, bytes, count, strides)
            *((0, int(s), 0, int(d), piece, 1, 0) for s, d in zip(src, dst, strict=True)),
            (0, kv // 2, 0, kv // 2, 3 << 20, 1, 0),  # longer than a bounce buffer
            (0, kv - (1 << 20), 0, kv - (1 << 20), 512, 256, 2048),  # strided
            (1, 0, 1, 4096, 1000, 1, 0),  # host to host, in the same batch
            (1, 8192, 0, kv - 4096, 2048, 1, 0),  # host to device
        ]
        cols = [np.array(c, dtype=np.int64) for c in zip(*rows, strict=True)]
        runs = Runs(*cols[:6], cols[6], cols[6])
        h = agents[0].post("d", ("kv0", "aux0"), ("kv1", "aux1"), runs)
        assert agents[0].wait(h, 60) is XferState.DONE, h.error
        s_kv, d_kv = pools[0].view("kv0").cpu().numpy(), pools[2].view("kv1").cpu().numpy()
        s_aux, d_aux = pools[1].view("aux0"), pools[3].view("aux1")
        want = [np.full(kv, 0xA5, np.uint8), np.full(aux, 0xA5, np.uint8)]
        sent = [s_kv, s_aux]
        for sr, so, dr, do, n, c, st in rows:
            for j in range(c):
                a, b = so + j * st, do + j * st
                want[dr][b : b + n] = sent[sr][a : a + n]
        want_kv, want_aux = want
        assert np.array_equal(d_kv, want_kv) and np.array_equal(d_aux, want_aux)
    finally:
        for t in agents:
            t.close()
        for p in pools:
            p.close()


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


@pytest.mark.parametrize(
    ("model", "topology", "transport"),
    [
        ("llama", "tp2-tp3", "cudaipc"),  # GQA heads replicated on the decode side
        ("qwen3", "nhd-hnd", "tcp"),  # one head a block to another layout, via pinned memory
        ("qwen3-next", "tp4-tp1", "nixl"),  # gated delta net state beside full attention
        ("deepseek-v3", "tp1-dcp2", "mooncake"),  # MLA latent, decode context parallel
    ],
)
def test_the_demo_runs_token_exact_on_the_gpu(model: str, topology: str, transport: str) -> None:
    """Every process runs its model and keeps its pools on the GPU; the prefill's sends wait
    for the event behind its copies (Sender.send(wait_event=...)); kvbridge moves device
    memory; the decode generates from the received pages on the GPU."""
    from kvbridge.demo.run import Runner
    from kvbridge.transports import unavailable

    why = unavailable(transport)
    if why is not None:
        pytest.skip(why)
    r = Runner(device="cuda:0").run(model, topology, transport, new_tokens=8)
    assert r.ok, r.problem
    assert r.bytes_moved > 0


def test_the_device_copier_gathers_and_scatters_a_staged_request() -> None:
    """A device rank's staging copies (kvbridge.memory.copier.TorchCopier: kernels on a
    stream of its own, synchronized before each call returns) over 1,000 scattered 64-byte
    runs from two source regions, one on the GPU and one left in host memory (SGLang's aux
    slots are), cut into segments, each gathered into a device slot and scattered out of
    it: the bytes numpy's copier lands, read back after each call."""
    import torch

    from kvbridge.memory.copier import HostCopier, TorchCopier
    from kvbridge.staging.layout import gather, scatter, segments

    rng = np.random.default_rng(7)
    unit, units, n = 64, 4096, 1000
    free = rng.permutation(2 * units)[:n]
    runs = Runs(
        rng.integers(0, 2, n),
        rng.integers(0, units, n) * unit,
        free // units,
        free % units * unit,
        np.full(n, unit),
        np.ones(n, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
    )

    def memory() -> dict[str, np.ndarray]:
        mem = {n: np.random.default_rng(1).integers(0, 256, units * unit, np.uint8) for n in "ab"}
        mem |= {n: np.full(units * unit, 0xA5, np.uint8) for n in "cd"}
        return mem | {"slot": np.zeros(8192 + 5, np.uint8)}

    want, got = memory(), memory()
    tensors = {
        n: torch.from_numpy(v) if n == "a" else torch.from_numpy(v).cuda() for n, v in got.items()
    }
    for copier in (HostCopier(want), TorchCopier(tensors, torch, cuda(0))):
        for seg in segments(runs, 8192 + 5):
            copier.copy(gather(seg, 0), ("a", "b"), ("slot",))
            copier.copy(scatter(seg, 0), ("slot",), ("c", "d"))
    for n in "cd":
        assert np.array_equal(want[n], tensors[n].cpu().numpy()), n


@pytest.mark.parametrize("transport", ["nixl", "tcp"])
def test_the_demo_stages_device_memory_on_the_gpu(transport: str) -> None:
    """Staging forced on both sides (KVBRIDGE_STAGING=always) with every pool on the GPU:
    each segment of a TP 4 -> 1 request (one head a block, a descriptor each written
    directly) is gathered by kernels into a device staging slot, written as one piece,
    and scattered on the decode's device before the chunk counts; token-exact."""
    from kvbridge.demo.run import Runner
    from kvbridge.staging import StagingMode
    from kvbridge.transports import unavailable

    why = unavailable(transport)
    if why is not None:
        pytest.skip(why)
    staged = {"staging": StagingMode.ALWAYS}
    r = Runner(device="cuda:0").run(
        "qwen3", "tp4-tp1", transport, new_tokens=8, prefill_settings=staged, decode_settings=staged
    )
    assert r.ok, r.problem
    assert r.bytes_moved > 0


@pytest.mark.parametrize("transport", ["cudaipc", "tcp", "nixl"])
def test_the_vllm_connectors_workers_move_vllms_cuda_kv_in_place(transport: str) -> None:
    """The connector's worker halves (no vLLM needed) over CUDA tensors laid out as vLLM's
    attention backends allocate them ([blocks, heads, tokens, K|V], NHD strides): the prefill
    pushes a request from blocks (1, 4, 6) into the decode's (0, 2, 5); each send waits for
    the event the worker records behind the forward's writes."""
    import torch

    from kvbridge.integrations.vllm.describe import WorkerPlace
    from kvbridge.integrations.vllm.launch import free_port
    from kvbridge.integrations.vllm.params import ConnectorOptions, RemotePrefill
    from kvbridge.integrations.vllm.scheduler import RecvJob, SendJob, StepMeta
    from kvbridge.integrations.vllm.worker import WorkerSide
    from kvbridge.transports import unavailable

    why = unavailable(transport)
    if why is not None:
        pytest.skip(why)
    blocks, heads, rows, dim, layers, tokens = 8, 2, 16, 32, 2, 40
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]

    def kv(fill: float | None) -> dict[str, torch.Tensor]:
        def one() -> torch.Tensor:
            t = torch.empty(blocks, rows, heads, 2 * dim, device="cuda:0")  # NHD in memory
            t.normal_() if fill is None else t.fill_(fill)
            return t.permute(0, 2, 1, 3)  # [B, H, N, 2D], as vLLM hands it over

        return {n: one() for n in names}

    address = f"127.0.0.1:{free_port()}"
    opts = ConnectorOptions(bootstrap=address, transport=transport, aux_slots=4)
    sides = []
    try:
        for producer, name in ((True, "prefill"), (False, "decode")):
            place = WorkerPlace("m", heads, layers, 1, 0, ((0, layers),), 0, name, False)
            sides.append(WorkerSide(opts, place, producer))
        prefill, decode = sides
        src, dst = kv(None), kv(7.0)
        prefill.register(src)
        decode.register(dst)
        prefill.start(StepMeta(sends=[SendJob("r", 7, tokens, ((1, 4, 6),))]))
        decode.start(
            StepMeta(recvs=[RecvJob("r", RemotePrefill(address, 7, tokens), ((0, 2, 5),))])
        )
        end = time.monotonic() + 30
        received: set[str] = set()
        failed: set[str] = set()
        while not (received or failed) and time.monotonic() < end:
            prefill.results(set())
            _, received, failed = decode.results(set())
            time.sleep(0.01)
        assert received == {"r"} and not failed, (received, failed)
        torch.cuda.synchronize()
        for n in names:
            for t in range(tokens):
                (sb, db), row = ((1, 0), (4, 2), (6, 5))[t // rows], t % rows
                assert torch.equal(dst[n][db, :, row], src[n][sb, :, row]), (n, t)
            assert bool((dst[n][5, :, tokens % rows :] == 0).all())  # the rest of the last block
            assert bool((dst[n][[1, 3, 4, 6, 7]] == 7.0).all())  # blocks of no request
    finally:
        for side in sides:
            side.close()
