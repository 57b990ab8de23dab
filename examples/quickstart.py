"""kvbridge in one file: a TP2 prefill engine hands a request's KV cache to a TP1 decode engine.

Every rank is a Bridge; here all three live in one process for brevity (in a deployment each
is embedded in its own engine process). Run: python examples/quickstart.py
"""

import numpy as np

from kvbridge import (
    Bridge,
    HostPool,
    KVLayout,
    KVPoll,
    ParallelLayout,
    Placement,
    Role,
    build_memory,
)
from kvbridge.bootstrap import BootstrapServer
from kvbridge.model.hf import load_spec
from kvbridge.planner.reference import fill, logical_cache

spec = load_spec("qwen3-0.6b")  # 28 layers, 8 KV heads of 128, bf16
tokens = 300
prefill_par, decode_par = (
    ParallelLayout.even(spec.num_layers, tp=2),
    ParallelLayout.even(spec.num_layers, tp=1),
)
# How each side lays out its pools: page size and NHD/HND may differ between the sides.
prefill_mem = build_memory(spec, prefill_par, page_size=64, num_pages=16)
decode_mem = build_memory(spec, decode_par, page_size=16, num_pages=64, kv_layout=KVLayout.HND)

with BootstrapServer() as server:  # the rendezvous service, on a real port
    prefill_pools = [HostPool(prefill_mem.regions, shared=False) for _ in range(2)]
    decode_pool = HostPool(decode_mem.regions, shared=True)  # shm needs shared destinations
    prefill = [
        Bridge(
            role=Role.PREFILL,
            spec=spec,
            parallel=prefill_par,
            rank=r,
            memory=prefill_mem,
            regions=prefill_pools[r],
            transport="shm",
            bootstrap=server.address,
            engine_id="prefill",
        ).start()
        for r in range(2)
    ]
    decode = Bridge(
        role=Role.DECODE,
        spec=spec,
        parallel=decode_par,
        rank=0,
        memory=decode_mem,
        regions=decode_pool,
        transport="shm",
        bootstrap=server.address,
        engine_id="decode",
    ).start()

    # The prefill engine computed the request's KV into its pages (here: reference data).
    src = Placement.simple(tokens, page_ids=[3, 0, 7, 1, 5], aux_slot=0)
    cache = logical_cache(spec, tokens, seed=0)
    fill(
        prefill[0].side,
        src,
        cache,
        {
            r: {x.name: prefill_pools[r].view(x.name) for x in prefill_pools[r].regions()}
            for r in range(2)
        },
        decode=False,
    )

    # Decode: a receiver per request, given the pages it allocated.
    receiver = decode.receiver(room=42)
    dst = Placement.simple(tokens, page_ids=np.arange(40, 59), aux_slot=3)
    receiver.init(dst)

    # Prefill: a sender per request on every rank; chunks go as chunked prefill makes them.
    senders = [b.sender(room=42, placement=src) for b in prefill]
    for stop in (128, 256, 300):
        for s in senders:
            s.send(stop)

    assert receiver.wait(timeout=30) is KVPoll.SUCCESS, receiver.failure
    assert all(s.wait(timeout=30) is KVPoll.SUCCESS for s in senders)

    # Bytes are the oracle: the decode pools (zero before) equal the reference re-shard.
    names = [x.name for x in decode_pool.regions()]
    want = {0: {n: np.zeros(decode_pool.view(n).nbytes, dtype=np.uint8) for n in names}}
    fill(decode.side, dst, cache, want, decode=True)
    ok = all(np.array_equal(decode_pool.view(n), want[0][n]) for n in names)
    print(
        f"moved {tokens} tokens of {spec.model} from prefill TP2 (page 64, NHD) to decode "
        f"TP1 (page 16, HND): {'bytes equal' if ok else 'MISMATCH'}"
    )
    assert ok

    for b in [*prefill, decode]:
        b.close()
    for p in [*prefill_pools, decode_pool]:
        p.close()
