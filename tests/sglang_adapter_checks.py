"""The SGLang backend's sender and receiver driven as SGLang's schedulers drive them, without
servers: two KVBridgeKVManagers built on numpy pools (SGLang's KVArgs stood in by kvbridge's own
PoolArgs), real Bridges over tcp, a real bootstrap service. Run by the SGLang venv's python
(the classes import SGLang's base classes); tests/test_sglang_adapter.py reads its JSON line.
Each check is a sequence an attacker of the adapter found ending wrong (2026-11-30)."""

from __future__ import annotations

import json
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from kvbridge.bootstrap import BootstrapServer
from kvbridge.config import Settings
from kvbridge.integrations.sglang.backend import KVBridgeKVManager
from kvbridge.integrations.sglang.pools import AuxPacker, PoolArgs, describe
from kvbridge.integrations.sglang.receiver import KVBridgeKVReceiver, note_request
from kvbridge.integrations.sglang.sender import KVBridgeKVSender, note_prompt
from kvbridge.memory.pools import HostPool, wrap_address
from kvbridge.planner.layout import AUX
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.runtime import Bridge
from kvbridge.runtime.status import KVPoll
from kvbridge.wire.protocol import Role

LAYERS, HEADS, HEAD_DIM, SLOTS, PAGE = 2, 2, 4, 256, 4
AUX_ITEMS = (32, 8)  # the last item holds the room, as SGLang's metadata buffers do
SETTINGS = Settings(
    bootstrap_timeout=4,
    waiting_timeout=3,
    transfer_timeout=4,
    abort_timeout=2,
    heartbeat_interval=0.2,
    heartbeat_misses=5,
)
TOKENS = list(range(1, 19))
CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def manager(prefill: bool, bootstrap: str, name: str) -> KVBridgeKVManager:
    """A scheduler's KV manager, as KVBridgeKVManager.__init__ makes it from SGLang's KVArgs."""
    kv = [np.zeros((SLOTS + PAGE, HEADS, HEAD_DIM), np.float32) for _ in range(2 * LAYERS)]
    aux = [np.zeros((8, n), np.uint8) for n in AUX_ITEMS]
    args = PoolArgs(
        kv_ptrs=tuple(b.ctypes.data for b in kv),
        kv_lens=tuple(b.nbytes for b in kv),
        kv_item_lens=tuple(b[0].nbytes * PAGE for b in kv),
        page_size=PAGE,
        kv_heads=HEADS,
        total_kv_heads=HEADS,
        aux_ptrs=tuple(a.ctypes.data for a in aux),
        aux_lens=tuple(a.nbytes for a in aux),
        aux_item_lens=AUX_ITEMS,
        dtype="auto/float32",
        mla=False,
        tp=1,
        tp_rank=0,
    )
    m = object.__new__(KVBridgeKVManager)
    m._arrays = (kv, aux)  # type: ignore[attr-defined]  # kept alive with the manager
    m.kv_args = types.SimpleNamespace(aux_data_ptrs=args.aux_ptrs, aux_item_lens=AUX_ITEMS)
    m.settings, m.pools, m.page_size, m.whole = SETTINGS, args, PAGE, False
    d = describe(args)
    m.aux = HostPool([d.memory.region(AUX)], shared=False)
    aux_at = int(m.aux.regions()[0].view().ctypes.data)
    m.aux_packer = AuxPacker(aux_at, args.aux_ptrs, AUX_ITEMS)
    m.bridge = Bridge(
        role=Role.PREFILL if prefill else Role.DECODE,
        spec=d.spec,
        parallel=ParallelLayout(1, ((0, d.spec.num_layers),)),
        rank=0,
        memory=d.memory,
        regions=[wrap_address(n, p, b) for n, p, b in d.regions] + list(m.aux.regions()),
        transport="tcp",
        bootstrap=bootstrap if prefill else None,
        engine_id=name,
        settings=SETTINGS,
    ).start()
    m._receivers, m._tracked, m._lock, m.prefill_info_table = {}, 0, threading.Lock(), {}
    return m


@contextmanager
def servers() -> Iterator[tuple[str, KVBridgeKVManager, KVBridgeKVManager]]:
    with BootstrapServer() as server:
        p = manager(True, server.address, "sglang-prefill-x:1")
        d = manager(False, server.address, "sglang-decode-x:2")
        try:
            yield server.address, p, d
        finally:
            d.bridge.close()
            p.bridge.close()


def receiver(d: KVBridgeKVManager, address: str, room: int) -> KVBridgeKVReceiver:
    r = KVBridgeKVReceiver(d, address, room)
    note_request(r, TOKENS)  # the plugin's hook, as SGLang makes it
    return r


def sender(p: KVBridgeKVManager, address: str, room: int) -> KVBridgeKVSender:
    s = KVBridgeKVSender(p, address, room)
    note_prompt(s, TOKENS)
    return s


def until(cond: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


@check
def an_abort_before_init_leaves_nothing_behind() -> None:
    """SGLang inits a request still pending on its bootstrap address even if the client aborted
    it meanwhile: the receiver came back to life, held the room to its deadline and was tracked
    for ever (SGLang's clear() waits for released)."""
    with servers() as (address, _, d):
        r = receiver(d, address, 5)
        r.abort()
        r.init(0)
        assert r.poll() == KVPoll.FAILED and r.released and d.bridge.active_rooms() == 0
        again = receiver(d, address, 5)
        again.init(0)  # the room is free: no "already has a receiver"
        assert again.poll() != KVPoll.FAILED, again._failure


@check
def a_sender_holding_an_ask_ends_when_the_decode_aborts_or_at_its_deadline() -> None:
    """SGLang keeps a request WaitingForInput while its metadata buffers are full: the sender
    looked at the decode's ask once and then never again (a decode abort, or no init for ever,
    left it waiting with no end). Before init SGLang's bootstrap step takes no state but
    Bootstrapping, WaitingForInput and Failed (any other raises in its scheduler)."""
    with servers() as (address, p, d):
        for room, abort in ((1, True), (2, False)):
            r = receiver(d, address, room)
            r.init(0)
            s = sender(p, address, room)
            seen: list[int] = []

            def polled(s: KVBridgeKVSender = s, seen: list[int] = seen) -> int:
                seen.append(s.poll())
                return seen[-1]

            r.send_metadata([10, 11, 12, 13, 14], aux_index=3)
            assert until(lambda: polled() == KVPoll.WAITING_FOR_INPUT, 5)
            if abort:
                r.abort()
                assert until(lambda: polled() == KVPoll.FAILED, 3), "after the abort"
            else:
                assert until(lambda: polled() == KVPoll.FAILED, SETTINGS.waiting_timeout + 3)
                assert "KVBRIDGE_WAITING_TIMEOUT" in str(s._failure), s._failure
            bootstrap = {KVPoll.BOOTSTRAPPING, KVPoll.WAITING_FOR_INPUT, KVPoll.FAILED}
            assert set(seen) <= {int(k) for k in bootstrap}, sorted(set(seen))
            assert seen[seen.index(KVPoll.FAILED) :] == [KVPoll.FAILED] * (
                len(seen) - seen.index(KVPoll.FAILED)
            ), "FAILED, then something else"


@check
def bad_state_indices_and_rooms_fail_typed_and_at_once() -> None:
    with servers() as (address, p, d):
        r = receiver(d, address, 1)
        r.init(0)
        s = sender(p, address, 1)
        r.send_metadata([10, 11, 12, 13, 14], aux_index=3)
        assert until(lambda: s.poll() == KVPoll.WAITING_FOR_INPUT, 5)
        s.init(5, 3)
        s.send([20, 21, 22, 23, 24], state_indices=7)  # not a list: was a TypeError raised
        # (no state pools here: ignored, or a typed failure, held until its writes ended)
        assert until(lambda: s.poll() in (KVPoll.FAILED, KVPoll.SUCCESS), 5), s.poll()
        for room in (-3, 1 << 63):
            bad = receiver(d, address, room)
            bad.init(0)
            assert bad.poll() == KVPoll.FAILED and "[0, 2**63)" in str(bad._failure)


@check
def released_receivers_sglang_never_cleared_are_forgotten() -> None:
    """SGLang clears a receiver when it sees it released; one released later (its deferred
    release given up, or a success seen before the release) stayed tracked for ever."""
    with servers() as (address, _, d):
        for room in range(300):  # each ends (aborted) and is never cleared
            r = receiver(d, address, 1000 + room)
            r.init(0)
            r.abort()
        assert until(lambda: all(r.released for rs in d._receivers.values() for r in rs), 10)
        for room in range(212):  # live ones, to the 512th tracked: the released ones go then
            receiver(d, address, 5000 + room).init(0)
        assert sum(len(rs) for rs in d._receivers.values()) == 212


def main() -> None:
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
