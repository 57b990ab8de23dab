"""The bootstrap service (see :mod:`kvbridge.bootstrap`): aiohttp on its own thread."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

from kvbridge.bootstrap.auth import AuthRefused, Verifier
from kvbridge.bootstrap.checks import (
    ROOMS,
    Fail,
    check_rooms,
    decode_info,
    pair,
    prefill_side,
    rank_difference,
    world,
)
from kvbridge.bootstrap.rooms import ROOM_CAPACITY, ROOM_TTL, RoomTable
from kvbridge.config import check_host, check_port, check_token
from kvbridge.errors import BootstrapError
from kvbridge.planner.plan import Side
from kvbridge.wire.protocol import RankInfo, Role

log = logging.getLogger("kvbridge.bootstrap")

# The largest shipped preset's RankInfo (falcon-h1-7b, 88 hybrid layers, 177 regions, all on
# one rank, with its transport metadata) is 75 KB of JSON; a 100-layer hybrid model's is well
# under 1 MiB. 8 MiB leaves ample margin; BootstrapServer(max_body=...) overrides it.
MAX_BODY = 8 * 1024 * 1024
_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0
_CHECK_THREADS = 2  # registrations validated at once; more wait for a thread, off the loop
_READ_CHUNK = 1 << 16
_BODY = "kvbridge.body"  # a request's body, once read to check its proof of the token
_INTEGER = re.compile(r"-?[0-9]+")
_RETRIES = 8  # re-checks of a registration whose engine changed while it was validated
_MAX_ROOM_WAIT = 10.0  # seconds a room lookup may wait for news

_T = TypeVar("_T")


def _json(obj: object, status: int = 200) -> web.Response:
    # msgspec, not json: the bodies carry RankInfo structs (and their base64'd bytes).
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only ("" and 0.0.0.0 are every
    interface; a name other than localhost is taken as reachable)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, port: int, has_token: bool) -> str | None:
    """What a server on ``host:port`` exposes when it has no token, or None when it is safe."""
    if has_token or is_loopback(host):
        return None
    where = f"{host or '0.0.0.0'}:{port}"
    return (
        f"bootstrap server on {where} has no token: anyone who can reach {where} can list "
        f"every rank's endpoints and memory table and re-register or delete ranks; set a "
        f"token (token=..., or --token) or bind a loopback address"
    )


@dataclass
class _Engine:
    """One prefill engine: the side its first rank described, and its ranks so far."""

    side: Side
    world: int
    dp: int  # the DP groups of its deployment (1: not data parallel)
    ranks: dict[int, RankInfo] = field(default_factory=dict)


def _others(engine: _Engine, info: RankInfo) -> list[RankInfo]:
    """The engine's ranks other than ``info``'s, by engine rank."""
    return sorted(
        (r for r in engine.ranks.values() if r.engine_rank != info.engine_rank),
        key=lambda r: r.engine_rank,
    )


class BootstrapServer:
    """The rendezvous service, on its own thread. ``start()`` returns once it listens."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        *,
        max_body: int = MAX_BODY,
        room_ttl: float = ROOM_TTL,
        room_capacity: int = ROOM_CAPACITY,
    ) -> None:
        if max_body < 1:
            raise BootstrapError(f"bootstrap max_body must be >= 1 byte, got {max_body}")
        self.host, self.port = check_host(host), check_port(port)
        check_token(token)
        self._verifier = Verifier(token) if token is not None else None
        self._max_body = max_body
        self._executor: ThreadPoolExecutor | None = None
        # Only touched on the server's event-loop thread, so no lock is needed.
        self._prefill: dict[str, _Engine] = {}
        self._decode: dict[str, dict[int, tuple[RankInfo, str]]] = {}
        self._rooms = RoomTable(room_ttl, room_capacity)
        # Set (and dropped) when rooms or engines change: lookups waiting for news wake.
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._start_error: BaseException | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> BootstrapServer:
        if self._thread is not None:
            raise BootstrapError(f"bootstrap server {self.address} is already started")
        ready = threading.Event()
        self._executor = ThreadPoolExecutor(
            _CHECK_THREADS, thread_name_prefix="kvbridge-bootstrap-check"
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run,
            args=(self._loop, ready),
            daemon=True,
            name=f"kvbridge-bootstrap-{self.port}",
        )
        self._thread.start()
        if not ready.wait(_START_TIMEOUT):
            self.stop()
            raise BootstrapError(
                f"bootstrap server did not start listening on {self.address} "
                f"within {_START_TIMEOUT} s"
            )
        if self._start_error is not None:
            self._thread.join(_STOP_TIMEOUT)
            self._thread = None
            self._stop_executor()
            raise BootstrapError(
                f"bootstrap server cannot listen on {self.address}: {self._start_error}"
            ) from self._start_error
        exposed = exposure_warning(self.host, self.port, self._verifier is not None)
        if exposed is not None:
            log.warning("%s", exposed)
        return self

    def _run(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        # A short shutdown timeout: stop() must be bounded even with clients connected.
        runner = web.AppRunner(self._app(), access_log=None, shutdown_timeout=0.5)
        try:
            loop.run_until_complete(self._listen(runner))
        except BaseException as e:  # reported to start(), which raises it in the caller
            self._start_error = e
        ready.set()
        try:
            if self._start_error is None:
                loop.run_forever()
        finally:
            with contextlib.suppress(Exception):  # a slow close must not outlive stop()
                loop.run_until_complete(asyncio.wait_for(runner.cleanup(), _STOP_TIMEOUT))
            loop.close()

    async def _listen(self, runner: web.AppRunner) -> None:
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port).start()
        self.port = int(runner.addresses[0][1])  # the real port when 0 was asked
        log.info("bootstrap listening on %s", self.address)

    def stop(self) -> None:
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop may have closed on its own
            loop.call_soon_threadsafe(loop.stop)
        thread.join(_STOP_TIMEOUT + 1.0)
        if thread.is_alive():
            log.warning(
                "bootstrap server %s did not stop within %.1f s", self.address, _STOP_TIMEOUT + 1.0
            )
        self._thread = None
        self._stop_executor()

    def _stop_executor(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            # Queued checks are dropped; one running ends on its own (its answer is not sent).
            executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- HTTP ----------------------------------------------------------------------------

    def _app(self) -> web.Application:
        @web.middleware
        async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
            try:
                if self._verifier is not None and request.path != "/health":
                    # The proof covers the body: read it (bounded) before any handler runs.
                    body = request[_BODY] = await self._read_body(request)
                    try:
                        self._verifier.check(
                            request.headers.get("Authorization", ""),
                            request.method,
                            request.raw_path,
                            body,
                        )
                    except AuthRefused as e:
                        return _json({"error": str(e)}, 401)
                return await handler(request)
            except Fail as e:
                return _json({"error": e.message}, e.status)
            except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method
                return _json({"error": f"{request.method} {request.path}: {e.reason}"}, e.status)
            except Exception as e:  # a bug answers 500; it must not take the service down
                log.exception("bootstrap: %s %s failed", request.method, request.path)
                return _json({"error": f"internal error: {type(e).__name__}: {e}"}, 500)

        # client_max_size makes aiohttp itself refuse bodies it would otherwise buffer whole.
        app = web.Application(middlewares=[guard], client_max_size=self._max_body)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/prefill", self._register_prefill)
        app.router.add_get("/v1/prefill", self._lookup_prefill)
        app.router.add_delete("/v1/prefill", self._deregister_prefill)
        app.router.add_post("/v1/decode", self._register_decode)
        app.router.add_post("/v1/rooms", self._announce_rooms)
        app.router.add_get("/v1/rooms", self._find_rooms)
        return app

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body; 413, reading no further, once it is past ``max_body``."""
        if _BODY in request:  # read once already, to check its proof
            return bytes(request[_BODY])
        size = request.content_length
        if size is not None and size > self._max_body:
            raise self._too_large(f"request body of {size} bytes")
        body = bytearray()
        while True:  # ends: each chunk adds >= 1 byte, and the body is refused past the bound
            chunk = await request.content.read(min(_READ_CHUNK, self._max_body + 1 - len(body)))
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > self._max_body:
                raise self._too_large("request body")

    def _too_large(self, what: str) -> Fail:
        return Fail(
            413,
            f"{what} exceeds the limit of {self._max_body} bytes (a rank's "
            f"registration needs well under 1 MiB; the server's max_body sets the "
            f"limit)",
        )

    async def _off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on the server's check threads: the loop serves others meanwhile."""
        executor = self._executor
        try:
            if executor is None:
                raise RuntimeError("stopped")
            future = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        except RuntimeError:  # stop() shut the pool down
            raise Fail(503, "the bootstrap server is stopping") from None
        return await future

    def _pick_engine(self, request: web.Request) -> tuple[str, _Engine]:
        name = request.query.get("engine")
        if name is None:
            if not self._prefill:
                raise Fail(404, "no prefill engine registered")
            if len(self._prefill) > 1:
                raise Fail(
                    400,
                    f"{len(self._prefill)} prefill engines are registered "
                    f"({', '.join(sorted(self._prefill))}); name one with ?engine=",
                )
            name = next(iter(self._prefill))
        engine = self._prefill.get(name)
        if engine is None:
            raise Fail(
                404,
                f"prefill engine {name!r} is not registered (registered: "
                f"{sorted(self._prefill) or 'none'})",
            )
        return name, engine

    async def _health(self, request: web.Request) -> web.Response:
        decode = {}
        for name, ranks in self._decode.items():
            any_info, paired_with = next(iter(ranks.values()))
            decode[name] = {
                "registered": len(ranks),
                "world": world(any_info),
                "prefill_engine": paired_with,
            }
        return _json(
            {
                "status": "ok",
                "prefill_engines": {
                    n: {"registered": len(e.ranks), "world": e.world}
                    for n, e in self._prefill.items()
                },
                "decode_engines": decode,
                "rooms": len(self._rooms),
            }
        )

    async def _register_prefill(self, request: web.Request) -> web.Response:
        info, side = await self._off_loop(prefill_side, await self._read_body(request))
        for _ in range(_RETRIES):
            engine = self._prefill.get(info.engine_id)
            others = [] if engine is None else _others(engine, info)
            if engine is None or not others:
                # A first rank, or the only rank restarting: its description becomes the engine's
                # (the only rank keeping its record, every REFRESH, keeps the engine as it is).
                if engine is None or engine.ranks.get(info.engine_rank) != info:
                    engine = self._prefill[info.engine_id] = _Engine(side, world(info), info.dp)
                return self._add_prefill(engine, info)
            diff = await self._off_loop(rank_difference, others[0], info, engine.side, side)
            # Every rank of one _Engine matches its description: while the engine is the same
            # object and has another rank, the comparison still holds; else look again.
            if self._prefill.get(info.engine_id) is not engine or not _others(engine, info):
                continue
            if diff is not None:
                raise Fail(
                    409,
                    f"prefill engine {info.engine_id!r}: rank {info.engine_rank} "
                    f"does not match rank {others[0].engine_rank} already "
                    f"registered: {diff}",
                )
            return self._add_prefill(engine, info)
        raise Fail(
            503,
            f"prefill engine {info.engine_id!r} kept changing while rank "
            f"{info.engine_rank} was checked against it; register again",
        )

    def _add_prefill(self, engine: _Engine, info: RankInfo) -> web.Response:
        again = engine.ranks.get(info.engine_rank) == info  # a rank keeping its record
        engine.ranks[info.engine_rank] = info  # a restarted rank replaces its old record
        log.log(
            logging.DEBUG if again else logging.INFO,
            "bootstrap: %s registered (%d of %d)",
            info.agent,
            len(engine.ranks),
            engine.world,
        )
        self._notify()
        return _json({"ok": True})

    async def _lookup_prefill(self, request: web.Request) -> web.Response:
        _, engine = self._pick_engine(request)
        return _json(
            {"world": engine.world, "ranks": [engine.ranks[r] for r in sorted(engine.ranks)]}
        )

    async def _deregister_prefill(self, request: web.Request) -> web.Response:
        name, rank = request.query.get("engine"), request.query.get("rank", "")
        if name is None or not _INTEGER.fullmatch(rank):  # (not isdigit: "²" is a digit)
            raise Fail(
                400,
                f"expected ?engine=ID&rank=R with an integer R, got engine={name!r} rank={rank!r}",
            )
        engine = self._prefill.get(name)
        removed = engine is not None and engine.ranks.pop(int(rank), None) is not None
        if engine is not None and not engine.ranks:
            # An engine whose every rank left is forgotten: it may come back with a new layout.
            del self._prefill[name]
            self._rooms.forget_engine(name)
        return _json({"ok": True, "removed": removed})

    # ---- rooms: which prefill engine (DP group) holds a request ---------------------------

    def _notify(self) -> None:
        """Wake every room lookup waiting for news."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _announce_rooms(self, request: web.Request) -> web.Response:
        name = request.query.get("engine", "")
        if name not in self._prefill:
            raise Fail(
                404,
                f"prefill engine {name!r} is not registered; only a registered "
                f"engine announces rooms",
            )
        try:
            body = ROOMS.decode(await self._read_body(request))
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise Fail(400, f'expected {{"rooms": [room, ...]}}: {e}') from None
        check_rooms(body.rooms)
        try:
            conflicts = self._rooms.announce(name, body.rooms, time.monotonic())
        except BootstrapError as e:
            raise Fail(503, str(e)) from None
        self._notify()
        return _json({"conflicts": {str(r): e for r, e in conflicts.items()}})

    async def _find_rooms(self, request: web.Request) -> web.Response:
        """``?rooms=1,2,3&wait=S``: the engine of each known room, and the name of the only
        prefill engine when there is exactly one and it is not data parallel (its every room
        is its own). Waits up to ``wait`` seconds (at most 10) for either."""
        raw, wait = request.query.get("rooms", ""), request.query.get("wait", "0")
        try:
            rooms = [int(r) for r in raw.split(",")]
            seconds = float(wait)
        except ValueError:
            raise Fail(
                400,
                f"expected ?rooms=R1,R2,... (integers) and wait=seconds, got "
                f"rooms={raw[:80]!r} wait={wait[:20]!r}",
            ) from None
        check_rooms(rooms)
        if not 0 <= seconds <= _MAX_ROOM_WAIT:
            raise Fail(400, f"wait must be in [0, {_MAX_ROOM_WAIT:g}] seconds, got {seconds:g}")
        end = time.monotonic() + seconds
        while True:
            found = self._rooms.find(rooms, time.monotonic())
            single = None
            if len(self._prefill) == 1:
                name, engine = next(iter(self._prefill.items()))
                single = name if engine.dp == 1 else None
            left = end - time.monotonic()
            if found or single is not None or left <= 0:
                return _json({"rooms": {str(r): e for r, e in found.items()}, "single": single})
            if self._changed is None:
                self._changed = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def _register_decode(self, request: web.Request) -> web.Response:
        info = await self._off_loop(
            decode_info, await self._read_body(request), Role.DECODE, request.path
        )
        for _ in range(_RETRIES):
            name, engine = self._pick_engine(request)
            await self._off_loop(pair, info, engine.side, name)
            if self._prefill.get(name) is engine:  # else it changed while paired: look again
                self._decode.setdefault(info.engine_id, {})[info.engine_rank] = (info, name)
                log.info("bootstrap: %s paired with prefill engine %s", info.agent, name)
                return _json({"ok": True})
        raise Fail(
            503,
            f"prefill engine {name!r} kept changing while decode rank {info.agent} "
            f"was paired with it; register again",
        )


def serve_forever(
    host: str = "127.0.0.1",
    port: int = 8998,
    token: str | None = None,
    *,
    on_listening: Callable[[str], None] | None = None,
    max_body: int = MAX_BODY,
) -> None:
    """Run the service until SIGTERM or SIGINT; ``on_listening("host:port")`` once it listens.
    A non-loopback ``host`` without a token logs a warning saying what it exposes."""
    done = threading.Event()
    previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with BootstrapServer(host, port, token, max_body=max_body) as server:
            if on_listening is not None:
                on_listening(server.address)
            done.wait()  # a server runs until told to stop; the signal handlers set this
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
