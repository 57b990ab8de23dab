"""``kvbridge proxy``'s connections to its upstream servers: reused while fresh, dropped once
idle past ``UPSTREAM_KEEPALIVE`` (below vLLM's 5 s, so that no request goes out on a connection
the server is closing). A real proxy app in front of a real HTTP server that counts the
connections it was asked on, both on loopback in this process."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from kvbridge.integrations.vllm import proxy


async def _connections_seen(gaps: list[float]) -> tuple[list[int], int]:
    """The proxy's answers to one request after each gap (seconds idle), and how many
    connections the upstream server saw them on."""
    peers: set[tuple[str, int]] = set()

    async def models(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername")[:2])  # type: ignore[union-attr]
        return web.json_response({"data": []})

    upstream = web.Application()
    upstream.router.add_get("/v1/models", models)
    up = web.AppRunner(upstream, keepalive_timeout=60)
    await up.setup()
    await web.TCPSite(up, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{up.addresses[0][1]}"
    front = web.AppRunner(proxy.Proxy([url], [url]).app())
    await front.setup()
    await web.TCPSite(front, "127.0.0.1", 0).start()
    statuses = []
    try:
        async with aiohttp.ClientSession() as client:
            for gap in gaps:
                await asyncio.sleep(gap)
                async with client.get(f"http://127.0.0.1:{front.addresses[0][1]}/v1/models") as r:
                    statuses.append(r.status)
    finally:
        await front.cleanup()
        await up.cleanup()
    return statuses, len(peers)


@pytest.mark.slow  # waits out the keep-alive twice
def test_the_proxy_reuses_a_fresh_upstream_connection_and_drops_an_idle_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(proxy, "UPSTREAM_KEEPALIVE", 1.0)
    statuses, connections = asyncio.run(_connections_seen([0, 0, 0]))
    assert statuses == [200] * 3 and connections == 1  # kept while fresh
    statuses, connections = asyncio.run(_connections_seen([0, 2.2, 2.2]))
    assert statuses == [200] * 3 and connections == 3  # never reused once idle past it
