"""The bootstrap service, over real HTTP on real ephemeral ports: ranks register and are found,
lookups wait for late ranks and end by their deadline, incompatible sides are refused at
registration with what differs, and bad requests never take the service down."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import TracebackType

import msgspec
import pytest

from kvbridge import (
    BootstrapError,
    CacheSpec,
    IncompatibleError,
    ParallelLayout,
    Side,
    bootstrap,
    build_memory,
)
from kvbridge.bootstrap import MAX_BODY, BootstrapClient, BootstrapServer, exposure_warning
from kvbridge.bootstrap.auth import AuthRefused, Verifier, sign
from kvbridge.model.hf import load_spec
from kvbridge.model.spec import DType, attention_layer
from kvbridge.wire import protocol
from kvbridge.wire.protocol import RankInfo, Role, rank_info

pytestmark = pytest.mark.timeout(30)


def spec(heads: int = 8, head_dim: int = 16, model: str = "m", layers: int = 4) -> CacheSpec:
    return CacheSpec(
        model, tuple(attention_layer(heads, head_dim, DType.BFLOAT16) for _ in range(layers))
    )


def side(s: CacheSpec, tp: int = 1, pp: int = 1) -> Side:
    par = ParallelLayout.even(s.num_layers, tp, pp)
    return Side(s, par, build_memory(s, par, page_size=4, num_pages=16))


def info(sd: Side, rank: int = 0, engine: str = "p", role: Role = Role.PREFILL) -> RankInfo:
    return rank_info(engine, role, rank, "tcp://127.0.0.1:1", sd, "tcp", b"meta")


PREFILL = side(spec(), tp=2, pp=2)  # TP2 x PP2: engine ranks 0..3


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    with BootstrapServer() as s:
        yield s


@pytest.fixture
def client(server: BootstrapServer) -> BootstrapClient:
    return BootstrapClient(server.address, timeout=5.0)


def raw(
    server: BootstrapServer,
    method: str,
    path: str,
    body: bytes | None = None,
    token: str | None = None,
    auth: str | None = None,
) -> tuple[int, dict[str, object]]:
    """One request without the client, to see statuses and bodies as they are: signed with
    ``token`` (as the client signs), or with ``auth`` as its Authorization header."""
    req = urllib.request.Request(f"http://{server.address}{path}", data=body, method=method)
    if token is not None:
        auth = sign(token, method, path, body or b"")
    if auth is not None:
        req.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def register_all(client: BootstrapClient, sd: Side = PREFILL, engine: str = "p") -> None:
    for r in range(sd.parallel.world):
        client.register_prefill(info(sd, r, engine))


def test_all_ranks_of_a_tp2_pp2_engine_register_and_are_found(client: BootstrapClient) -> None:
    for r in (3, 1, 0, 2):  # out of order: the lookup sorts them
        client.register_prefill(info(PREFILL, r))
    ranks = client.prefill_ranks("p", deadline=time.monotonic() + 2)
    assert [r.engine_rank for r in ranks] == [0, 1, 2, 3]
    assert ranks[2] == info(PREFILL, 2)  # the record survives the round trip exactly
    assert client.prefill_ranks(deadline=time.monotonic() + 2) == ranks  # the only engine


def test_a_restarted_rank_replaces_its_record(client: BootstrapClient) -> None:
    register_all(client)
    moved = msgspec.structs.replace(info(PREFILL, 1), control="tcp://127.0.0.1:2")
    client.register_prefill(moved)
    ranks = client.prefill_ranks("p")
    assert len(ranks) == 4 and ranks[1].control == "tcp://127.0.0.1:2"


@pytest.mark.parametrize("world", [1, 2])
def test_a_rank_keeping_its_record_is_logged_once(
    client: BootstrapClient, caplog: pytest.LogCaptureFixture, world: int
) -> None:
    """Ranks register again every few seconds: the operator's log says so once (a one-rank
    engine was logged at every refresh), and again only for a record that changed."""
    sd = side(spec(), tp=world)
    caplog.set_level(logging.INFO, logger="kvbridge.bootstrap")
    for _ in range(3):
        for r in range(world):
            client.register_prefill(info(sd, r))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len([m for m in said if " registered (" in m]) == world, said
    client.register_prefill(msgspec.structs.replace(info(sd, 0), control="tcp://127.0.0.1:2"))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len([m for m in said if " registered (" in m]) == world + 1, said
    assert client.prefill_ranks("p")[0].control == "tcp://127.0.0.1:2"


def test_lookup_waits_for_a_rank_registered_later(client: BootstrapClient) -> None:
    for r in (0, 1, 2):
        client.register_prefill(info(PREFILL, r))
    late = threading.Timer(0.3, client.register_prefill, args=(info(PREFILL, 3),))
    late.start()
    t0 = time.monotonic()
    ranks = client.prefill_ranks("p", deadline=t0 + 5)
    late.join()
    assert [r.engine_rank for r in ranks] == [0, 1, 2, 3]
    assert 0.25 < time.monotonic() - t0 < 2.0


def test_lookup_waits_for_an_engine_not_yet_registered(client: BootstrapClient) -> None:
    late = threading.Timer(0.2, register_all, args=(client,))
    late.start()
    ranks = client.prefill_ranks(deadline=time.monotonic() + 5)
    late.join()
    assert len(ranks) == 4


def test_lookup_ends_at_its_deadline_with_the_counts(client: BootstrapClient) -> None:
    for r in (0, 1, 3):
        client.register_prefill(info(PREFILL, r))
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match=r"3 of 4 prefill ranks registered after 0\.[45] s"):
        client.prefill_ranks("p", deadline=t0 + 0.5)
    assert time.monotonic() - t0 < 1.0
    assert len(client.prefill_ranks("p", wait_for_world=False)) == 3
    with pytest.raises(BootstrapError, match=r"no prefill engine|'q' is not registered"):
        client.prefill_ranks("q", deadline=time.monotonic() + 0.2)


def test_a_server_that_is_down_fails_by_the_deadline() -> None:
    with BootstrapServer() as s:
        address = s.address
    # The port was just released: connections are refused until the deadline, then it says so.
    c = BootstrapClient(address, timeout=5.0)
    t0 = time.monotonic()
    with pytest.raises(
        BootstrapError,
        match=rf"bootstrap at {address} could not be reached.*"
        r"last error: .*refused",
    ):
        c.prefill_ranks("p", deadline=t0 + 0.6)
    assert 0.5 < time.monotonic() - t0 < 1.5
    with pytest.raises(BootstrapError, match=address):
        c.register_prefill(info(PREFILL), deadline=time.monotonic() + 0.2)


@pytest.mark.parametrize(
    ("decode", "words"),
    [
        (info(side(spec(head_dim=32)), role=Role.DECODE), ["layer 0", "heads=8x16", "heads=8x32"]),
        (info(side(spec(model="other")), role=Role.DECODE), ["model", "'m'", "'other'"]),
        # 8 heads cannot be split over TP 3: the decode rank says so, Side refuses to be built.
        (
            msgspec.structs.replace(info(side(spec()), role=Role.DECODE), tp=3),
            ["8 units, not divisible by TP 3"],
        ),
    ],
    ids=["head_dim", "model", "heads_vs_tp"],
)
def test_incompatible_decode_is_refused_with_what_differs(
    client: BootstrapClient, decode: RankInfo, words: list[str]
) -> None:
    register_all(client)
    with pytest.raises(IncompatibleError) as e:
        client.register_decode(decode, "p")
    assert "cannot pair with prefill engine 'p'" in str(e.value)
    for w in words:
        assert w in str(e.value)
    assert client.health()["decode_engines"] == {}


def test_compatible_decode_is_accepted(client: BootstrapClient) -> None:
    register_all(client)
    for tp in (1, 4, 16):  # fewer, more, and more ranks than KV heads (replicas)
        d = side(spec(), tp=tp)
        client.register_decode(info(d, tp - 1, engine=f"d{tp}", role=Role.DECODE))
    assert client.health()["decode_engines"]["d16"] == {
        "registered": 1,
        "world": 16,
        "prefill_engine": "p",
    }


def test_decode_without_a_prefill_engine(client: BootstrapClient) -> None:
    with pytest.raises(BootstrapError, match=r"\(404\): no prefill engine registered"):
        client.register_decode(info(side(spec()), role=Role.DECODE))


@pytest.mark.parametrize(
    ("other", "words"),
    [
        (side(spec(head_dim=32), tp=2, pp=2), ["spec fingerprint", "heads=8x32"]),
        (side(spec(), tp=4, pp=1), ["tp 2 vs 4"]),
        (side(spec(), tp=2, pp=4), ["layer_ranges"]),
    ],
    ids=["fingerprint", "tp", "pp"],
)
def test_conflicting_prefill_ranks_are_refused(
    server: BootstrapServer, client: BootstrapClient, other: Side, words: list[str]
) -> None:
    client.register_prefill(info(PREFILL, 0))
    status, body = raw(server, "POST", "/v1/prefill", msgspec.json.encode(info(other, 1)))
    assert status == 409
    assert "rank 1 does not match rank 0 already registered" in str(body["error"])
    for w in words:
        assert w in str(body["error"])
    with pytest.raises(BootstrapError, match=r"\(409\)"):
        client.register_prefill(info(other, 2))
    assert client.health()["prefill_engines"] == {"p": {"registered": 1, "world": 4}}


def test_other_memory_is_refused(server: BootstrapServer, client: BootstrapClient) -> None:
    client.register_prefill(info(PREFILL, 0))
    s = PREFILL.spec
    bigger = Side(s, PREFILL.parallel, build_memory(s, PREFILL.parallel, page_size=4, num_pages=32))
    status, body = raw(server, "POST", "/v1/prefill", msgspec.json.encode(info(bigger, 1)))
    assert status == 409 and "memory description: region 'L0.k'" in str(body["error"])


def test_bad_registrations_are_400_and_the_server_keeps_serving(
    server: BootstrapServer, client: BootstrapClient
) -> None:
    for body, words in [
        (b"{not json", "invalid rank registration"),
        (b"", "invalid rank registration"),
        (b'{"engine_id": "p"}', "missing required field"),
        (msgspec.json.encode(info(PREFILL, 4)), "engine_rank 4 is out of range [0, 4)"),
        (msgspec.json.encode(info(PREFILL, 0, role=Role.DECODE)), "expects a prefill rank"),
        (
            msgspec.json.encode(msgspec.structs.replace(info(PREFILL), fingerprint="x")),
            "does not match its spec",
        ),
    ]:
        status, answer = raw(server, "POST", "/v1/prefill", body)
        assert status == 400 and words in str(answer["error"]), answer
    for rank in ("x", "--5", "-", "%C2%B2"):  # the last one "²", a digit to str.isdigit
        assert raw(server, "DELETE", f"/v1/prefill?engine=p&rank={rank}")[0] == 400, rank
    assert raw(server, "GET", "/nowhere")[0] == 404
    register_all(client)  # still serving
    assert len(client.prefill_ranks("p")) == 4


def test_a_body_over_the_limit_is_413() -> None:
    with BootstrapServer(max_body=1024) as s:
        status, body = raw(s, "POST", "/v1/prefill", msgspec.json.encode(info(PREFILL)))
        assert status == 413 and "exceeds the limit of 1024 bytes" in str(body["error"])
        assert raw(s, "GET", "/health")[0] == 200


def test_several_engines_must_be_named(client: BootstrapClient) -> None:
    register_all(client, engine="a")
    register_all(client, engine="b")
    with pytest.raises(BootstrapError, match=r"2 prefill engines are registered \(a, b\)"):
        client.prefill_ranks()
    assert {r.engine_id for r in client.prefill_ranks("b")} == {"b"}


def test_deregistration(client: BootstrapClient) -> None:
    register_all(client)
    client.deregister_prefill("p", 3)
    client.deregister_prefill("p", 3)  # idempotent: a clean shutdown may be retried
    assert client.health()["prefill_engines"] == {"p": {"registered": 3, "world": 4}}
    for r in (0, 1, 2):
        client.deregister_prefill("p", r)
    assert client.health()["prefill_engines"] == {}
    # Forgotten entirely: the engine may come back with another layout.
    register_all(client, side(spec(), tp=4))
    assert client.health()["prefill_engines"] == {"p": {"registered": 4, "world": 4}}


NO_PROOF = {"error": "no proof of the bootstrap token (expected 'KVB1 ...')"}
WRONG = {"error": "wrong proof of the bootstrap token (another token, or altered)"}


def test_token() -> None:
    with BootstrapServer(token="s3cret") as s:
        assert raw(s, "GET", "/health")[0] == 200  # health stays open for probes
        assert raw(s, "GET", "/v1/prefill") == (401, NO_PROOF)
        for token in ("wrong", "s3cret-and-more"):
            assert raw(s, "GET", "/v1/prefill", token=token) == (401, WRONG)
        # The token itself is no proof: a client that sends it is refused.
        status, body = raw(s, "GET", "/v1/prefill", auth="Bearer s3cret")
        assert status == 401 and "in 'Bearer' form" in str(body["error"]), body
        assert raw(s, "GET", "/v1/prefill", token="s3cret")[0] == 404  # past the guard
        with pytest.raises(BootstrapError, match=r"refused the token \(no token was given\)"):
            BootstrapClient(s.address).register_prefill(info(PREFILL))
        with pytest.raises(BootstrapError, match=r"refused the token \(a token was given\)"):
            BootstrapClient(s.address, token="wrong").prefill_ranks()
        good = BootstrapClient(s.address, token="s3cret")
        register_all(good)
        assert len(good.prefill_ranks()) == 4


def test_a_proof_is_good_for_its_own_request_once() -> None:
    """A request read off the wire can be neither sent again nor altered: its method, target,
    body and time are under the MAC, and the service takes each nonce once."""
    with BootstrapServer(token="s3cret") as s:
        body = msgspec.json.encode(info(PREFILL, 0))
        proof = sign("s3cret", "POST", "/v1/prefill", body)
        assert raw(s, "POST", "/v1/prefill", body, auth=proof)[0] == 200
        status, answer = raw(s, "POST", "/v1/prefill", body, auth=proof)
        assert (status, answer) == (
            401,
            {"error": "a replayed request (its nonce was already used)"},
        )
        other = msgspec.json.encode(info(PREFILL, 1))
        for method, path, sent in (
            ("POST", "/v1/prefill", other),  # another body under the proof of the first
            ("DELETE", "/v1/prefill?engine=p&rank=0", None),  # another method and target
        ):
            signed = sign("s3cret", "POST", "/v1/prefill", body)
            assert raw(s, method, path, sent, auth=signed) == (401, WRONG), (method, path)
        query = sign("s3cret", "GET", "/v1/prefill?engine=p", b"")
        assert raw(s, "GET", "/v1/prefill?engine=q", auth=query) == (401, WRONG)
        stale = sign("s3cret", "GET", "/v1/prefill?engine=p", b"", now=time.time() - 1000)
        status, answer = raw(s, "GET", "/v1/prefill?engine=p", auth=stale)
        assert status == 401 and "signed -1000 s from this service's clock" in str(answer["error"])
        # Only the first registration happened.
        assert raw(s, "GET", "/health")[1]["prefill_engines"] == {
            "p": {"registered": 1, "world": 4}
        }


def test_the_replay_window_forgets_only_what_its_clock_refuses() -> None:
    now = [1000.0]
    v = Verifier("t", window=10.0, clock=lambda: now[0])
    first = sign("t", "GET", "/x", b"", now=now[0])
    v.check(first, "GET", "/x", b"")
    now[0] += 9.0
    with pytest.raises(AuthRefused, match="replayed"):  # still inside the window: remembered
        v.check(first, "GET", "/x", b"")
    now[0] += 2.0  # past it: forgotten, and refused by the clock instead
    with pytest.raises(AuthRefused, match="signed -11 s"):
        v.check(first, "GET", "/x", b"")
    v.check(sign("t", "GET", "/x", b"", now=now[0]), "GET", "/x", b"")
    assert len(v._seen) == 1  # the first's nonce was let go: memory stays bounded by the window
    for bad in ("KVB1 ts=1,nonce=zz,mac=00", "KVB1 " + "a" * 5000, "Basic dDp0"):
        with pytest.raises(AuthRefused, match="form; expected 'KVB1"):
            v.check(bad, "GET", "/x", b"")


def test_health(client: BootstrapClient) -> None:
    assert client.health() == {
        "status": "ok",
        "prefill_engines": {},
        "decode_engines": {},
        "rooms": 0,
    }
    client.register_prefill(info(PREFILL, 2))
    assert client.health()["prefill_engines"] == {"p": {"registered": 1, "world": 4}}


def test_bad_client_arguments() -> None:
    with pytest.raises(BootstrapError, match=r"'host:port'.*got 'localhost'"):
        BootstrapClient("localhost")
    with pytest.raises(BootstrapError, match=r"timeout must be > 0"):
        BootstrapClient("localhost:1", timeout=0)


@pytest.mark.parametrize("bad", ["127.0.0.1:1,127.0.0.1:1", "127.0.0.1:1,nohost", "a:1,,b:2"])
def test_a_bad_list_of_services_is_refused_saying_so(bad: str) -> None:
    with pytest.raises(BootstrapError, match="host:port|repeated"):
        BootstrapClient(bad)


def test_a_port_in_use_is_a_clear_error(server: BootstrapServer) -> None:
    with pytest.raises(BootstrapError, match=rf"cannot listen on 127.0.0.1:{server.port}"):
        BootstrapServer(port=server.port).start()


@pytest.mark.slow  # starts processes: the fast tier's are in-process
def test_the_bootstrap_command_serves_health() -> None:
    cmd = [sys.executable, "-m", "kvbridge.cli", "bootstrap", "--port", "0"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        try:
            line = proc.stdout.readline()  # printed once it listens
            assert line.startswith("kvbridge bootstrap listening on http://127.0.0.1:"), line
            address = line.split("http://")[1].split()[0]
            assert BootstrapClient(address, timeout=5.0).health()["status"] == "ok"
        finally:
            proc.terminate()  # SIGTERM: a clean stop, exit status 0
            code = proc.wait(timeout=10)
        assert code == 0, proc.stderr.read()


# ---- bounded bodies, a responsive loop, the token, the exposure warning -----------------------


class HealthProbe:
    """Polls ``/health`` every 10 ms from a thread of its own and keeps each answer's latency
    (a new connection each time: what a load balancer's probe does)."""

    def __init__(self, server: BootstrapServer) -> None:
        self._host, self._port = server.host, server.port
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="health-probe")

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            conn = http.client.HTTPConnection(self._host, self._port, timeout=5)
            try:
                conn.request("GET", "/health")
                resp = conn.getresponse()
                body = resp.read()
                if resp.status != 200 or json.loads(body)["status"] != "ok":
                    self.errors.append(f"{resp.status}: {body[:200]!r}")
            except (OSError, http.client.HTTPException) as e:
                self.errors.append(repr(e))
            finally:
                conn.close()
            self.latencies.append(time.monotonic() - t0)
            self._stop.wait(0.01)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(10)

    def check(self, at_least: int, below: float | None = None) -> None:
        """Every poll answered; ``below``: none took that long (a bound only where the loop
        being blocked would cost far more: wall-clock bounds are otherwise the host's load)."""
        assert not self.errors, self.errors[:5]
        assert len(self.latencies) >= at_least, f"only {len(self.latencies)} health polls"
        worst, median = max(self.latencies), sorted(self.latencies)[len(self.latencies) // 2]
        assert below is None or worst < below, (
            f"/health took up to {worst * 1e3:.0f} ms (median {median * 1e3:.1f} ms, "
            f"{len(self.latencies)} polls)"
        )


def big_info(
    rank: int = 0, engine: str = "big", meta_bytes: int = 5 << 20, pp: int = 2
) -> RankInfo:
    """A real RankInfo of the largest preset (falcon-h1-7b, 88 hybrid layers), its transport
    metadata padded so that the body is near, but under, MAX_BODY."""
    s = load_spec("falcon-h1-7b")
    par = ParallelLayout.even(s.num_layers, 1, pp)
    sd = Side(s, par, build_memory(s, par, page_size=16, num_pages=1 << 16))
    return rank_info(engine, Role.PREFILL, rank, "tcp://127.0.0.1:1", sd, "tcp", b"\0" * meta_bytes)


def test_real_rank_infos_are_far_under_the_body_limit() -> None:
    """MAX_BODY is derived from what a rank needs: the largest preset, all 88 layers on one
    rank, is under 1% of it; the limit still refuses what no rank sends."""
    whole = big_info(meta_bytes=16 << 10, pp=1)
    assert len(msgspec.json.encode(whole)) < MAX_BODY // 64
    assert MAX_BODY <= 8 << 20


def test_a_16_mib_body_is_413_while_health_answers() -> None:
    """Refused at the bound, Content-Length or chunked, while /health answers every poll."""
    oversize = msgspec.json.encode(big_info(meta_bytes=12 << 20))  # a real, decodable info
    assert len(oversize) >= 16 << 20
    with BootstrapServer() as s, HealthProbe(s) as probe:
        time.sleep(0.05)
        for _ in range(3):
            status, body = raw(s, "POST", "/v1/prefill", oversize)
            assert status == 413
            assert f"exceeds the limit of {MAX_BODY} bytes" in str(body["error"])
            # Chunked (no Content-Length): read to just past the bound, then refused.
            conn = http.client.HTTPConnection(s.host, s.port, timeout=10)
            try:
                conn.request(
                    "POST",
                    "/v1/prefill",
                    body=iter(
                        [oversize[i : i + (1 << 20)] for i in range(0, len(oversize), 1 << 20)]
                    ),
                )
                resp = conn.getresponse()
                assert resp.status == 413
                assert "request body exceeds the limit" in json.loads(resp.read())["error"]
            finally:
                conn.close()
        time.sleep(0.05)
        assert raw(s, "GET", "/health")[1]["prefill_engines"] == {}
    probe.check(at_least=5)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_oversize_body_is_refused_before_it_is_read_whole(framing: str) -> None:
    """The client sends the headers and only just past the limit, and never the rest: the 413
    comes anyway (the server read no further than its bound)."""
    with (
        BootstrapServer(max_body=1024) as s,
        socket.create_connection((s.host, s.port), timeout=5) as sock,
    ):
        head = "POST /v1/prefill HTTP/1.1\r\nHost: x\r\n"
        if framing == "content-length":
            sock.sendall(f"{head}Content-Length: {16 << 20}\r\n\r\n".encode())
        else:
            sock.sendall(
                f"{head}Transfer-Encoding: chunked\r\n\r\n".encode()
                + b"%x\r\n" % 1025
                + b"{" * 1025
                + b"\r\n"
            )
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"exceeds the limit of 1024 bytes" in answer


@pytest.mark.slow  # validations that take 1 s each
def test_slow_validation_runs_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rebuilding a side that takes 1 s (three registrations at once, more than the check
    threads) never delays /health; the checks run on the server's threads, not the loop."""
    real = protocol.side_from_info
    where: list[str] = []

    def slow(i: RankInfo) -> Side:
        where.append(threading.current_thread().name)
        time.sleep(1.0)
        return real(i)

    monkeypatch.setattr(bootstrap.checks, "side_from_info", slow)
    with BootstrapServer() as s, HealthProbe(s) as probe:
        c = BootstrapClient(s.address, timeout=20.0)
        t0 = time.monotonic()
        ranks = [
            threading.Thread(target=c.register_prefill, args=(info(PREFILL, r),)) for r in range(3)
        ]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join(20)
        elapsed = time.monotonic() - t0
        assert c.health()["prefill_engines"] == {"p": {"registered": 3, "world": 4}}
        c.register_decode(info(side(spec()), role=Role.DECODE))  # pairing rebuilds a side too
    probe.check(at_least=50, below=0.5)  # a check on the loop would hold it 1 s
    assert elapsed >= 2.0  # two check threads for three 1 s checks
    assert len(where) == 4 and all(n.startswith("kvbridge-bootstrap-check") for n in where), where
    # stop() shut the check threads down.
    end = time.monotonic() + 5
    while any(t.name.startswith("kvbridge-bootstrap-check") for t in threading.enumerate()):
        assert time.monotonic() < end, "the check threads outlived stop()"
        time.sleep(0.02)


def test_registrations_of_the_largest_preset_near_the_limit(
    client: BootstrapClient, server: BootstrapServer
) -> None:
    """Real 7 MB RankInfos (decoded, rebuilt and compared) are accepted while /health answers
    every poll (that checks run off the loop: test_slow_validation_runs_off_the_loop)."""
    infos = [big_info(r) for r in range(2)]
    assert all(6 << 20 < len(msgspec.json.encode(i)) < MAX_BODY for i in infos)
    with HealthProbe(server) as probe:
        for _ in range(3):
            for i in infos:
                client.register_prefill(i)
        assert client.prefill_ranks("big") == infos
    probe.check(at_least=5)


def test_a_token_guards_every_route_but_health() -> None:
    routes = [
        ("GET", "/v1/prefill", None),
        ("GET", "/v1/prefill?engine=p", None),
        ("POST", "/v1/prefill", msgspec.json.encode(info(PREFILL, 1))),
        ("DELETE", "/v1/prefill?engine=p&rank=0", None),
        ("POST", "/v1/decode?engine=p", msgspec.json.encode(info(side(spec()), role=Role.DECODE))),
        ("POST", "/v1/rooms?engine=p", b'{"rooms": [1]}'),
        ("GET", "/v1/rooms?rooms=1", None),
        ("GET", "/nowhere", None),
        ("PUT", "/v1/prefill", b"{}"),
    ]
    with BootstrapServer(token="s3cret") as s:
        BootstrapClient(s.address, token="s3cret").register_prefill(info(PREFILL, 0))
        for method, path, body in routes:
            assert raw(s, method, path, body) == (401, NO_PROOF), (method, path)
            for token in ("wrong", "s3cret2", "S3CRET", "s3cre"):
                assert raw(s, method, path, body, token=token) == (401, WRONG), (path, token)
        # Nothing the refused requests asked for happened.
        health = raw(s, "GET", "/health")
        assert health == (
            200,
            {
                "status": "ok",
                "decode_engines": {},
                "rooms": 0,
                "prefill_engines": {"p": {"registered": 1, "world": 4}},
            },
        )
        # /health tells counts, never an endpoint, a memory table or transport metadata.
        text = json.dumps(health[1])
        for secret in ("tcp://", "127.0.0.1", "bWV0YQ", "regions", "L0.k"):
            assert secret not in text
        assert raw(s, "GET", "/v1/prefill?engine=p", token="s3cret")[0] == 200


def test_a_non_loopback_bind_without_a_token_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvbridge.bootstrap")
    with BootstrapServer("0.0.0.0") as s:
        pass
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert (
        f"0.0.0.0:{s.port} has no token: anyone who can reach 0.0.0.0:{s.port} can list "
        f"every rank's endpoints and memory table and re-register or delete ranks" in warned[0]
    )
    caplog.clear()
    for quiet in (
        BootstrapServer("0.0.0.0", token="t"),
        BootstrapServer("127.0.0.1"),
        BootstrapServer("localhost"),
    ):
        with quiet:
            pass
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    for host, exposed in [
        ("", True),
        ("::", True),
        ("10.1.2.3", True),
        ("node-7", True),
        ("127.0.0.5", False),
        ("::1", False),
        ("[::1]", False),
    ]:
        assert (exposure_warning(host, 1, False) is not None) == exposed, host
        assert exposure_warning(host, 1, True) is None


@pytest.mark.slow  # starts processes: the fast tier's are in-process
def test_the_bootstrap_command_warns_when_exposed() -> None:
    cmd = [sys.executable, "-m", "kvbridge.cli", "bootstrap", "--host", "0.0.0.0", "--port", "0"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        try:
            line = proc.stdout.readline()
            assert line.startswith("kvbridge bootstrap listening on http://0.0.0.0:"), line
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        err = proc.stderr.read()
    port = line.split("http://0.0.0.0:")[1].split()[0]
    assert f"0.0.0.0:{port} has no token: anyone who can reach" in err, err
