"""A rogue process on the host cannot make a request succeed without its bytes, fail real
requests, or speak for a peer: control messages count only when signed with the token and sent
on the sending agent's own connection, in the link's session.

The rogue is this test process, with a ZeroMQ socket of its own; the deployment is real ranks
in their own processes. The rogue is given everything an attacker on the host could learn (the
endpoints, the agents' names, even the link's session) and, in the second test, the token.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq

from bridge_ranks import SMALL, deployment, job_of, until
from kvbridge.runtime.control import Seal, connection_identity
from kvbridge.transports import tcp_wire as wire
from kvbridge.wire.protocol import ChunkDone, Hello, Message, RankInfo, RequestMeta, encode
from transport_agents import raw_connect, read_reply

TOKEN = "s3cret"

# Two real deployments, 4-6 s each. The fast tier keeps the token checks of
# test_tcp_fencing.py and test_bootstrap.py.
pytestmark = pytest.mark.slow


class Rogue:
    """Connects to a rank's control endpoint under an identity of its choosing."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket[bytes]] = []

    def send(self, endpoint: str, identity: str, msg: Message, key: str = "") -> None:
        """Send ``msg`` on a new connection named as a channel names its own with ``key``
        (the rogue's guess of the token): agent ``identity`` ("rogue" gets a unique suffix, so
        that ZeroMQ delivers it: a ROUTER drops a connection reusing a connected identity,
        which is also what becomes of the rogue's connections under a real peer's name)."""
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if identity == "rogue":
            identity = f"rogue-{len(self.socks)}"
        s.setsockopt(zmq.IDENTITY, connection_identity(identity, key.encode(), endpoint))
        s.connect(endpoint)
        payload = encode(msg)
        s.send_multipart([payload, Seal(key.encode(), endpoint)(payload) if key else b""])
        self.socks.append(s)

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()


def forge_completion(
    prefill: list[dict], decode: dict, rooms: list[int], tokens: int
) -> list[ChunkDone]:
    session = decode["sessions"][0]
    return [
        ChunkDone(
            sender=p["agent"],
            session=session,
            room=room,
            prefill_rank=rank,
            start=0,
            stop=tokens,
            parts=["kv", "aux"],
        )
        for room in rooms
        for rank, p in enumerate(prefill)
    ]


@pytest.mark.parametrize("knows_token", [False, True])
def test_forged_messages_are_refused_and_real_requests_beside_them_succeed(
    knows_token: bool,
) -> None:
    job = job_of(SMALL, "tp=2,page=4", "tp=1,page=4", "shm", tokens=40, requests=2)
    rooms = [1000, 1001]
    key = TOKEN if knows_token else ""
    rogue = Rogue()
    with deployment(job, settings={"token": TOKEN}) as (prefill, decode, _):
        (d,) = decode
        d.call("receive", rooms)
        assert until(lambda: d.call("identity")["sessions"], 10)
        who = {r.name: r.call("identity") for r in [*prefill, *decode]}
        p_ids = [who["prefill0"], who["prefill1"]]
        d_id = who["decode0"]
        time.sleep(0.5)  # the link is up: the real prefill ranks hold their identities
        # 1. Completion of both rooms, naming the real prefill ranks, on the rogue's own
        #    connection, and on a connection under a prefill rank's own name.
        for msg in forge_completion(p_ids, d_id, rooms, job.tokens):
            rogue.send(d_id["control"], "rogue", msg, key)
            rogue.send(d_id["control"], msg.sender, msg, key)
        # 2. Metadata sending room 1000's bytes elsewhere, and a hello with another spec.
        other = msgspec.json.decode(d_id["info"], type=RankInfo)
        fake_meta = RequestMeta(
            sender=d_id["agent"],
            session=d_id["sessions"][0],
            room=1000,
            decode_rank=0,
            tokens=job.tokens,
            pages={"kv": list(range(10))},
            slots={"aux": 1},
        )
        bad_spec = msgspec.structs.replace(other, fingerprint="0" * 16)
        for p in p_ids:
            rogue.send(p["control"], "rogue", fake_meta, key)
            rogue.send(
                p["control"], "rogue", Hello(sender=d_id["agent"], session=7, info=bad_spec), key
            )
        time.sleep(1.0)
        states = d.call("wait", rooms, 0.0)
        assert {s for s, _ in states.values()} == {"TRANSFERRING"}, states  # nothing counted
        assert until(lambda: d.call("refused") >= 2 * len(rooms), 5)
        assert all(until(lambda p=p: p.call("refused") >= 2, 5) for p in prefill)
        # 3. The real requests go through, every byte where it belongs.
        for p in prefill:
            p.call("send", rooms)
        for rank in [*decode, *prefill]:
            got = rank.call("wait", rooms, 15.0)
            assert {s for s, _ in got.values()} == {"SUCCESS"}, (rank.name, got)
        assert d.call("verify", rooms)
    rogue.close()


def test_a_write_cannot_carry_a_notice_in_another_agents_name() -> None:
    """Over tcp a prefill rank's chunk notice rides in its write (Transport.post_noticed).
    A rogue that knows the token authenticates on the decode rank's data port under its own
    name and writes one byte of an admitted request with a notice naming each real prefill
    rank: the write is acknowledged DISCARDED, the notice refused and counted, nothing
    completes; then the real requests go through, every byte where it belongs."""
    job = job_of(SMALL, "tp=2,page=4", "tp=1,page=4", "tcp", tokens=40, requests=1)
    rooms = [1000]
    with deployment(job, settings={"token": TOKEN}) as (prefill, decode, _):
        (d,) = decode
        d.call("receive", rooms)
        # Its metadata went out: the request is admitted on the data port.
        assert until(lambda: d.call("wait", rooms, 0.0)[1000][0] == "TRANSFERRING", 10)
        d_id = d.call("identity")
        p_ids = [p.call("identity") for p in prefill]
        meta = d_id["transport_meta"]
        region = meta["regions"][0]
        before = d.call("refused")
        for forged in forge_completion(p_ids, d_id, rooms, job.tokens):
            header = wire.BatchHeader(
                "rogue",
                d_id["agent"],
                (region["name"],),
                1,
                (forged.session, forged.room),
                encode(forged),
            )
            runs = np.array([[0], [region["nbytes"] - 1], [1], [1], [0]], dtype=np.int64)
            with raw_connect((meta["host"], meta["port"]), "rogue", TOKEN) as s:  # type: ignore[attr-defined]
                s.sendall(wire.encode_batch(1, header, runs) + b"\x00")
                _, status, why = read_reply(s, 10.0)
            assert status is wire.Status.DISCARDED and "its notice was refused" in why, why
        assert d.call("refused") == before + len(prefill)
        assert d.call("wait", rooms, 0.5)[1000][0] == "TRANSFERRING"  # nothing counted
        for p in prefill:
            p.call("send", rooms)
        for rank in [*decode, *prefill]:
            assert rank.call("wait", rooms, 15.0)[1000][0] == "SUCCESS", rank.name
        assert d.call("verify", rooms)
