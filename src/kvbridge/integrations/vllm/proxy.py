"""``kvbridge proxy``: one OpenAI-compatible endpoint in front of vLLM prefill and decode servers.

For each completion request it asks a prefill server for one token with
``kv_transfer_params={"do_remote_decode": true}``, then sends the original request to a decode
server with the ``kv_transfer_params`` the prefill server answered (where its KV waits), and
relays the decode server's answer (streamed or not) to the client. Servers are taken round
robin. Every upstream call has a deadline: a client gets an answer or an error, never a hang.

Told each prefill server's bootstrap address, it sends both legs at once instead: it picks the
room, the decode server allocates blocks and asks for it while the prefill server computes,
and the prefill ranks send each layer as their forward computes it (no round trip between the
legs, and the transfer hides behind the forward). A prefill leg that fails cancels the decode
leg (vLLM aborts a request whose client left, and kvbridge's receive with it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import secrets
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kvbridge.config import SettingsError, check_host, check_port
from kvbridge.integrations.vllm.params import ParamsError, PushRoom, check_address

log = logging.getLogger("kvbridge.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_TIMEOUT = 86400.0  # a day: longer is a typo, and would hold a client's socket as long
# vLLM's HTTP server closes a connection idle for 5 s (uvicorn's keep-alive, vLLM's default);
# aiohttp keeps one for 15. A request sent on a connection the server is closing that moment
# fails, "Server disconnected" (the suite saw it: a 502 after a leg idle exactly 5 s). The
# proxy drops idle connections well before any server's default closes them.
UPSTREAM_KEEPALIVE = 2.0


def check_url(url: str) -> str:
    """``url`` without a trailing slash if it names an HTTP server (``http://host:port``, an
    optional path), else SettingsError: refused now, not as a 502 on every request."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port raises on a bad one
    except (ValueError, TypeError) as e:
        raise SettingsError(
            f"expected a server URL like http://host:8100, got {url!r}: {e}"
        ) from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.query
        or parts.fragment
        or any(c.isspace() or not c.isprintable() for c in url)
    ):
        raise SettingsError(f"expected a server URL like http://host:8100, got {url!r}")
    return url.rstrip("/")


def check_timeout(timeout: float) -> float:
    if not (
        isinstance(timeout, (int, float)) and math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT
    ):
        raise SettingsError(f"timeout must be in (0, {MAX_TIMEOUT:.0f}] seconds, got {timeout}")
    return float(timeout)


def check_bootstrap(address: str) -> str:
    """``host:port`` of a prefill server's kvbridge bootstrap service."""
    try:
        return check_address(address, "a bootstrap address")
    except ParamsError as e:
        raise SettingsError(str(e)) from None


class Proxy:
    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        timeout: float = 300.0,
        bootstrap: Sequence[str] = (),
    ) -> None:
        if not prefill or not decode:
            raise SettingsError("the proxy needs at least one prefill and one decode server")
        if bootstrap and len(bootstrap) != len(prefill):
            raise SettingsError(
                f"one bootstrap address per prefill server, in order: got "
                f"{len(bootstrap)} for {len(prefill)} prefill servers"
            )
        # (url, its bootstrap service or None: legs one after the other)
        addresses: list[str | None] = [check_bootstrap(a) for a in bootstrap]
        self._prefill = itertools.cycle(
            list(
                zip(
                    [check_url(u) for u in prefill], addresses or [None] * len(prefill), strict=True
                )
            )
        )
        self._decode = itertools.cycle([check_url(u) for u in decode])
        self._timeout = aiohttp.ClientTimeout(total=check_timeout(timeout))
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()
        for route in ROUTES:
            app.router.add_post(route, self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_KEEPALIVE)
        self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        async with self._session.get(f"{next(self._decode)}/v1/models") as r:
            return web.Response(
                status=r.status, body=await r.read(), content_type="application/json"
            )

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        try:
            body: dict[str, Any] = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        (prefill, bootstrap), decode = next(self._prefill), next(self._decode)
        try:
            if bootstrap is None:
                return await self._one_then_other(request, body, prefill, decode)
            return await self._both_at_once(request, body, prefill, bootstrap, decode)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"upstream failed: {type(e).__name__}: {e}")

    async def _one_then_other(
        self, request: web.Request, body: dict[str, Any], prefill: str, decode: str
    ) -> web.StreamResponse:
        assert self._session is not None
        t0 = time.monotonic()
        async with self._session.post(
            prefill + request.path, json=_prefill_leg(body, {"do_remote_decode": True})
        ) as r:
            answer = await r.read()
            if r.status != 200:
                return web.Response(status=r.status, body=answer, content_type="application/json")
        try:
            params = prefill_answer(answer, prefill)
        except ParamsError as e:
            return _error(502, str(e))
        log.info(
            "prefill %s answered in %.2f s: %s",
            prefill,
            time.monotonic() - t0,
            params.get("kvbridge"),
        )
        async with self._session.post(
            decode + request.path, json=dict(body, kv_transfer_params=params)
        ) as r:
            return await _relay(request, r)

    async def _both_at_once(
        self, request: web.Request, body: dict[str, Any], prefill: str, bootstrap: str, decode: str
    ) -> web.StreamResponse:
        assert self._session is not None
        session = self._session
        room = secrets.randbits(63)
        # No "tokens": the decode server takes its prompt's length.
        waiting = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvbridge": {"bootstrap": bootstrap, "room": room},
        }
        second = asyncio.ensure_future(
            session.post(decode + request.path, json=dict(body, kv_transfer_params=waiting))
        )
        t0 = time.monotonic()

        async def prefill_leg() -> tuple[int, bytes]:
            async with session.post(
                prefill + request.path, json=_prefill_leg(body, PushRoom(room).to_params())
            ) as r:
                return r.status, await r.read()

        async def first_bytes() -> tuple[aiohttp.ClientResponse, bytes]:
            r2 = await second
            return r2, await r2.content.readany()

        first = asyncio.ensure_future(prefill_leg())
        peek = asyncio.ensure_future(first_bytes())
        peek.add_done_callback(_quiet)
        try:
            await asyncio.wait({first, peek}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                # The decode leg answered first. With its first bytes of a 200 its KV arrived
                # (the prefill took the room): relay now, a streamed answer from its first
                # token; the prefill leg ends on its own. Anything else (an error, a leg that
                # failed) ends the request: the prefill leg is cancelled, so that the prefill
                # server drops the request rather than hold its KV for a receive that never
                # comes, and the decode's answer (or the failure) is the client's.
                first.add_done_callback(_quiet)
                if peek.exception() is not None:
                    first.cancel()
                    raise peek.exception()  # type: ignore[misc]
                r2, head = peek.result()
                if r2.status != 200 or not head:
                    first.cancel()
                async with r2:
                    return await _relay(request, r2, head)
            status, answer = await first
            log.info(
                "prefill %s answered in %.2f s (room %d, decode leg sent with it)",
                prefill,
                time.monotonic() - t0,
                room,
            )
            if status != 200:
                peek.cancel()
                await _drop(second)  # the decode server aborts the request and its receive
                return web.Response(status=status, body=answer, content_type="application/json")
            try:
                params, why = prefill_answer(answer, prefill), ""
            except ParamsError as e:
                params, why = {}, str(e)
            ours = params.get("kvbridge")
            if not isinstance(ours, dict) or ours.get("room") != room:
                # Not held under our room (not a kvbridge producer, or it refused the room):
                # the waiting decode leg would only reach its deadline.
                peek.cancel()
                await _drop(second)
                if why:
                    return _error(502, why)
                log.warning(
                    "prefill %s did not take room %d; decode leg sent again with its answer",
                    prefill,
                    room,
                )
                async with session.post(
                    decode + request.path, json=dict(body, kv_transfer_params=params)
                ) as r3:
                    return await _relay(request, r3)
            r2, head = await peek
        except BaseException:
            # The client left, or a leg failed: nothing of this request may go on running.
            first.cancel()
            peek.cancel()
            await _drop(second)
            raise
        async with r2:
            return await _relay(request, r2, head)


def _quiet(task: asyncio.Future[Any]) -> None:
    """A leg nobody may wait for any more: its outcome is retrieved, and logged."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("a leg ended with %r after the request was answered", task.exception())


async def _drop(leg: asyncio.Future[aiohttp.ClientResponse]) -> None:
    """End a decode leg that must not be relayed: cancelled if it has no answer yet, its answer
    closed if it has (a streamed answer has headers at once); either way the decode server sees
    its client leave and aborts the request."""
    if not leg.done():
        leg.cancel()
        return
    if not leg.cancelled() and leg.exception() is None:
        leg.result().close()


def _prefill_leg(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill server gets it: one token, not streamed."""
    first = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
    first.pop("stream_options", None)
    if "max_completion_tokens" in first:
        first["max_completion_tokens"] = 1
    return first


async def _relay(
    request: web.Request, r: aiohttp.ClientResponse, head: bytes = b""
) -> web.StreamResponse:
    """The decode server's answer, streamed or not, to the client (``head``: its first bytes,
    read already)."""
    out = web.StreamResponse(
        status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "application/json")}
    )
    await out.prepare(request)
    if head:
        await out.write(head)
    async for chunk in r.content.iter_any():
        await out.write(chunk)
    await out.write_eof()
    return out


def prefill_answer(answer: bytes, prefill: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill server's 200 answer, or ParamsError saying what
    came instead."""
    try:
        body = json.loads(answer)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ParamsError(
            f"prefill server {prefill} answered 200 with a body that is not JSON: {answer[:200]!r}"
        ) from None
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if not isinstance(params, dict) or not params:
        raise ParamsError(
            f"prefill server {prefill} answered without kv_transfer_params ({params!r}): is "
            f"its connector a kv_producer?"
        )
    return params


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def serve(
    prefill: Sequence[str],
    decode: Sequence[str],
    host: str,
    port: int,
    timeout: float,
    bootstrap: Sequence[str] = (),
) -> None:
    app = Proxy(prefill, decode, timeout=timeout, bootstrap=bootstrap).app()
    try:
        web.run_app(
            app, host=check_host(host), port=check_port(port), print=lambda *a: log.info(*a)
        )
    except OSError as e:  # binding: the address is taken or not this host's
        raise SettingsError(f"the proxy cannot listen on {host}:{port}: {e}") from e
