"""``kvbridge proxy``: one OpenAI-compatible endpoint in front of vLLM prefill and decode servers.

For each completion request it asks a prefill server for one token with
``kv_transfer_params={"do_remote_decode": true}``, then sends the original request to a decode
server with the ``kv_transfer_params`` the prefill server answered (where its KV waits), and
relays the decode server's answer (streamed or not) to the client. Servers are taken round
robin. Every upstream call has a deadline: a client gets an answer or an error, never a hang.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kvbridge.config import SettingsError, check_host, check_port

log = logging.getLogger("kvbridge.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_TIMEOUT = 86400.0  # a day: longer is a typo, and would hold a client's socket as long


def check_url(url: str) -> str:
    """``url`` without a trailing slash if it names an HTTP server (``http://host:port``, an
    optional path), else SettingsError: refused now, not as a 502 on every request."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port raises on a bad one
    except (ValueError, TypeError) as e:
        raise SettingsError(f"expected a server URL like http://host:8100, got {url!r}: "
                            f"{e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or \
            parts.fragment or any(c.isspace() or not c.isprintable() for c in url):
        raise SettingsError(f"expected a server URL like http://host:8100, got {url!r}")
    return url.rstrip("/")


def check_timeout(timeout: float) -> float:
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout)
            and 0 < timeout <= MAX_TIMEOUT):
        raise SettingsError(f"timeout must be in (0, {MAX_TIMEOUT:.0f}] seconds, got {timeout}")
    return float(timeout)


class Proxy:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *,
                 timeout: float = 300.0) -> None:
        if not prefill or not decode:
            raise SettingsError("the proxy needs at least one prefill and one decode server")
        self._prefill = itertools.cycle([check_url(u) for u in prefill])
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
        self._session = aiohttp.ClientSession(timeout=self._timeout)

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        async with self._session.get(f"{next(self._decode)}/v1/models") as r:
            return web.Response(status=r.status, body=await r.read(),
                                content_type="application/json")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        try:
            body: dict[str, Any] = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        first = dict(body, max_tokens=1, stream=False,
                     kv_transfer_params={"do_remote_decode": True})
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        prefill, decode = next(self._prefill), next(self._decode)
        t0 = time.monotonic()
        try:
            async with self._session.post(prefill + request.path, json=first) as r:
                answer = await r.read()
                if r.status != 200:
                    return web.Response(status=r.status, body=answer,
                                        content_type="application/json")
            params = json.loads(answer).get("kv_transfer_params")
            log.info("prefill %s answered in %.2f s: %s", prefill, time.monotonic() - t0,
                     (params or {}).get("kvbridge"))
            if not params:
                return _error(502, f"prefill server {prefill} answered without "
                                   f"kv_transfer_params: is its connector a kv_producer?")
            async with self._session.post(decode + request.path,
                                          json=dict(body, kv_transfer_params=params)) as r:
                out = web.StreamResponse(status=r.status, headers={
                    "Content-Type": r.headers.get("Content-Type", "application/json")})
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"upstream failed: {type(e).__name__}: {e}")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def serve(prefill: Sequence[str], decode: Sequence[str], host: str, port: int,
          timeout: float) -> None:
    app = Proxy(prefill, decode, timeout=timeout).app()
    try:
        web.run_app(app, host=check_host(host), port=check_port(port),
                    print=lambda *a: log.info(*a))
    except OSError as e:  # binding: the address is taken or not this host's
        raise SettingsError(f"the proxy cannot listen on {host}:{port}: {e}") from e
