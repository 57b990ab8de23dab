"""The bootstrap service's client: the stdlib only, every call bounded by a deadline.

A deployment may run more than one service (``"host1:port1,host2:port2"``): a prefill rank's
registration, room announcements and deregistration go to every one of them at once (a
service that is down costs the call its deadline, not the others' answers), and a lookup asks
them in turn, from the one that answered last, until one answers: so any one of them alive is
enough for a decode engine to link."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import msgspec

from kvbridge.bootstrap.auth import sign
from kvbridge.errors import BootstrapError, IncompatibleError, ProtocolError
from kvbridge.wire.protocol import RankInfo, check_protocol

_GRACE = 0.5  # seconds the other services get once one accepted a registration


class _RoomAnswer(msgspec.Struct):
    rooms: dict[int, str]
    single: str | None


class _RankList(msgspec.Struct):
    world: int
    ranks: list[RankInfo]


# Built once at import: a first typed decode of a Struct in two threads at once can crash
# (kvbridge.transports._common says why).
_ROOM_ANSWER = msgspec.json.Decoder(_RoomAnswer)
_RANK_LIST = msgspec.json.Decoder(_RankList)


def _message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, str):
        return error
    return raw[:300].decode("utf-8", "replace") or "(empty body)"


class BootstrapClient:
    """Stdlib client of the bootstrap service. Every call ends by its deadline (by default
    ``timeout`` seconds from the call); refused or reset connections are retried until then."""

    def __init__(self, address: str, token: str | None = None, timeout: float = 10.0) -> None:
        self._addresses = [a.strip() for a in address.split(",")]
        for a in self._addresses:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit():
                raise BootstrapError(
                    f"bootstrap address must be 'host:port' (or several, comma-separated), got "
                    f"{address!r}"
                )
        if len(set(self._addresses)) != len(self._addresses):
            raise BootstrapError(f"bootstrap addresses repeated: {address!r}")
        if not timeout > 0:
            raise BootstrapError(f"bootstrap timeout must be > 0 s, got {timeout}")
        self.address, self.timeout = ",".join(self._addresses), timeout
        self._token = token
        self._good = 0  # the address that answered last: asked first
        # One client an address, for the calls that go to every service at once.
        self._each = (
            [BootstrapClient(a, token, timeout) for a in self._addresses]
            if len(self._addresses) > 1
            else []
        )
        # No proxies: the service is on the cluster network; an http_proxy must not reroute it.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _send(
        self,
        method: str,
        path: str,
        query: dict[str, str],
        body: bytes | None,
        deadline: float,
        every: bool = False,
    ) -> tuple[int, bytes]:
        """``(status, body)`` of the first HTTP answer; BootstrapError if none by the deadline.
        ``every``: sent to every service (the best answer: a 200 if any gave one)."""
        if every and len(self._addresses) > 1:
            return self._to_every(method, path, query, body, deadline)
        target = path + ("?" + urllib.parse.urlencode(query) if query else "")
        start, delay, attempts = time.monotonic(), 0.02, 0
        last: BaseException | None = None
        i, n = self._good, len(self._addresses)
        while attempts == 0 or time.monotonic() < deadline:
            attempts += 1
            try:
                got = self._once(self._addresses[i], method, target, body, deadline)
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
                last = e
                i = (i + 1) % n  # the next service, at once; a pause after a whole round
                if i != self._good:
                    continue
            else:
                self._good = i
                return got
            time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(delay * 2, 0.2)
        raise BootstrapError(
            f"bootstrap at {self.address} could not be reached: {method} {path} "
            f"failed {attempts} times in {time.monotonic() - start:.1f} s; "
            f"last error: {last}"
        )

    def _once(
        self, address: str, method: str, target: str, body: bytes | None, deadline: float
    ) -> tuple[int, bytes]:
        """One HTTP exchange with the service at ``address``."""
        headers = {"Content-Type": "application/json"}
        timeout = min(self.timeout, max(deadline - time.monotonic(), 0.05))
        if self._token is not None:  # a fresh proof each try: the service takes each once
            headers["Authorization"] = sign(self._token, method, target, body or b"")
        req = urllib.request.Request(
            f"http://{address}{target}", data=body, headers=headers, method=method
        )
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                return int(resp.status), bytes(resp.read())
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
            e.close()
            if status == 401:
                given = "no token was given" if self._token is None else "a token was given"
                raise BootstrapError(
                    f"bootstrap at {address} refused the token ({given}): {_message(raw)}"
                ) from None
            return status, raw

    def _to_every(
        self, method: str, path: str, query: dict[str, str], body: bytes | None, deadline: float
    ) -> tuple[int, bytes]:
        """One call to every service at once; a 200 if any gave one, else the first answer,
        else BootstrapError naming what each met. Once one answered 200 the others have
        :data:`_GRACE` seconds more: a service that is down does not hold a rank's start for
        the whole deadline (its thread ends by the deadline, in the background)."""
        answers: dict[str, tuple[int, bytes] | BaseException] = {}
        ok = threading.Event()

        def one(single: BootstrapClient) -> None:
            try:
                answers[single.address] = got = single._send(method, path, query, body, deadline)
                if got[0] == 200:
                    ok.set()
            except BootstrapError as e:
                answers[single.address] = e

        threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in self._each]
        for t in threads:
            t.start()
        end = deadline + 1.0
        if ok.wait(max(0.0, end - time.monotonic())):
            end = min(end, time.monotonic() + _GRACE)
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        got = [answers.get(a) for a in self._addresses]
        for want_ok in (True, False):
            for g in got:
                if isinstance(g, tuple) and (g[0] == 200 or not want_ok):
                    return g
        raise BootstrapError("; ".join(str(g) for g in got if g is not None) or "no answer")

    def _call(
        self,
        method: str,
        path: str,
        what: str,
        *,
        query: dict[str, str] | None = None,
        body: bytes | None = None,
        deadline: float | None = None,
        pairing: bool = False,
        every: bool = False,
    ) -> bytes:
        """The body of a 200 answer; any other answer raises BootstrapError saying ``what`` was
        refused, but a refused pairing (409) raises IncompatibleError with the server's words."""
        end = time.monotonic() + self.timeout if deadline is None else deadline
        status, raw = self._send(method, path, query or {}, body, end, every)
        if status == 409 and pairing:
            raise IncompatibleError(_message(raw))
        if status != 200:
            raise BootstrapError(
                f"bootstrap at {self.address} refused {what} ({status}): {_message(raw)}"
            )
        return raw

    def register_prefill(self, info: RankInfo, *, deadline: float | None = None) -> None:
        self._call(
            "POST",
            "/v1/prefill",
            f"prefill rank {info.agent}",
            body=msgspec.json.encode(info),
            deadline=deadline,
            every=True,
        )

    def prefill_ranks(
        self,
        engine: str | None = None,
        *,
        wait_for_world: bool = True,
        deadline: float | None = None,
    ) -> list[RankInfo]:
        """The ranks of a prefill engine, sorted by engine rank. With ``wait_for_world``, polls
        until all of them have registered (a decode engine may start before its prefill)."""
        start = time.monotonic()
        end = start + self.timeout if deadline is None else deadline
        query = {} if engine is None else {"engine": engine}
        delay, state, attempts = 0.02, "no answer yet", 0
        while attempts == 0 or time.monotonic() < end:
            attempts += 1
            status, raw = self._send("GET", "/v1/prefill", query, None, end)
            if status == 200:
                try:
                    got = _RANK_LIST.decode(raw)
                except (msgspec.ValidationError, msgspec.DecodeError) as e:
                    raise BootstrapError(
                        f"bootstrap at {self.address} sent a malformed rank list: {e}"
                    ) from None
                if not wait_for_world or len(got.ranks) >= got.world:
                    try:
                        return [check_protocol(info) for info in got.ranks]
                    except ProtocolError as e:
                        raise BootstrapError(f"bootstrap at {self.address}: {e}") from None
                state = f"{len(got.ranks)} of {got.world} prefill ranks registered"
            elif status == 404:
                if not wait_for_world:
                    raise BootstrapError(f"bootstrap at {self.address}: {_message(raw)}")
                state = _message(raw)
            else:
                raise BootstrapError(
                    f"bootstrap at {self.address} refused the lookup ({status}): {_message(raw)}"
                )
            time.sleep(max(0.0, min(delay, end - time.monotonic())))
            delay = min(delay * 2, 0.2)
        name = f"prefill engine {engine!r}" if engine is not None else "prefill engine"
        raise BootstrapError(
            f"{name}: {state} after {time.monotonic() - start:.1f} s (bootstrap at {self.address})"
        )

    def register_decode(
        self, info: RankInfo, engine: str | None = None, *, deadline: float | None = None
    ) -> None:
        """Check a decode rank against a prefill engine; IncompatibleError says what differs."""
        self._call(
            "POST",
            "/v1/decode",
            f"decode rank {info.agent}",
            query={} if engine is None else {"engine": engine},
            body=msgspec.json.encode(info),
            deadline=deadline,
            pairing=True,
        )

    def deregister_prefill(self, engine: str, rank: int, *, deadline: float | None = None) -> None:
        self._call(
            "DELETE",
            "/v1/prefill",
            f"to deregister {engine} rank {rank}",
            query={"engine": engine, "rank": str(rank)},
            deadline=deadline,
            every=True,
        )

    def announce_rooms(
        self, engine: str, rooms: list[int], *, deadline: float | None = None
    ) -> dict[int, str]:
        """Say that prefill engine ``engine`` holds ``rooms``; returns the rooms another engine
        holds already (refused), with that engine."""
        raw = self._call(
            "POST",
            "/v1/rooms",
            f"rooms of {engine}",
            query={"engine": engine},
            body=msgspec.json.encode({"rooms": rooms}),
            deadline=deadline,
            every=True,
        )
        try:
            got = msgspec.json.decode(raw, type=dict[str, dict[int, str]])
            return got["conflicts"]
        except (msgspec.ValidationError, msgspec.DecodeError, KeyError) as e:
            raise BootstrapError(
                f"bootstrap at {self.address} answered a room announcement with {raw[:200]!r}: {e}"
            ) from None

    def find_rooms(
        self, rooms: list[int], wait: float, *, deadline: float | None = None
    ) -> tuple[dict[int, str], str | None]:
        """The prefill engine of each announced room among ``rooms``, and the name of the only
        prefill engine if there is one and it is not data parallel; the server waits up to
        ``wait`` seconds for either."""
        end = time.monotonic() + wait + self.timeout if deadline is None else deadline
        raw = self._call(
            "GET",
            "/v1/rooms",
            "a room lookup",
            deadline=end,
            query={"rooms": ",".join(map(str, rooms)), "wait": f"{wait:.3f}"},
        )
        try:
            got = _ROOM_ANSWER.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise BootstrapError(
                f"bootstrap at {self.address} answered a room lookup with {raw[:200]!r}: {e}"
            ) from None
        return got.rooms, got.single

    def health(self, *, deadline: float | None = None) -> dict[str, Any]:
        raw = self._call("GET", "/health", "a health check", deadline=deadline)
        try:
            return msgspec.json.decode(raw, type=dict[str, Any])
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise BootstrapError(
                f"bootstrap at {self.address} answered health with {raw[:200]!r}: {e}"
            ) from None
