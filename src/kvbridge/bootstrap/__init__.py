"""The bootstrap service: prefill ranks register here, decode ranks look them up.

A small HTTP/JSON service (aiohttp on its own thread and event loop) and its stdlib client.
Compatibility is checked here, once, when ranks arrive, never later inside a worker thread:

* all ranks of one prefill engine must describe the same side (spec fingerprint, TP, PP layer
  ranges, memory description), else the newcomer is refused with 409 saying what differs;
* a decode rank registers against a prefill engine and is refused with 409 and the planner's
  own message when :class:`~kvbridge.planner.plan.Pairing` cannot pair the two sides.

Routes (errors are ``{"error": "..."}``; with a token, every route but ``/health`` needs a proof
of it, ``Authorization: KVB1 ...`` (:mod:`.auth`: a MAC of the request under the token, good once;
the token itself never travels); ``/health`` gives counts, never an endpoint)::

    GET    /health                       200 {"status", "prefill_engines", "decode_engines",
                                              "rooms"}
    POST   /v1/prefill                   body: RankInfo JSON
    GET    /v1/prefill?engine=ID         200 {"world": n, "ranks": [RankInfo, ...]}
    DELETE /v1/prefill?engine=ID&rank=R  200 {"ok": true, "removed": bool}
    POST   /v1/decode?engine=ID          body: a decode rank's RankInfo; 200 {"ok": true}
    POST   /v1/rooms?engine=ID           body: {"rooms": [room, ...]}; 200 {"conflicts":
                                         {room: engine holding it}} (:mod:`.rooms`)
    GET    /v1/rooms?rooms=R1,R2&wait=S  200 {"rooms": {room: engine}, "single": engine|null}

A prefill deployment with attention data parallelism registers one engine per DP group and
announces each request's room as it schedules it; a decode rank looks the room up
(:mod:`kvbridge.bootstrap.groups`). Where a single engine without DP is registered, every room is
its own and the lookup says so at once (``single``).

Every client call is bounded by a deadline; refused connections are retried until it.

The event loop only moves bytes and state. A registration body is bounded (``max_body``, 413
past it, read no further), and everything that costs time in proportion to it (decoding the
RankInfo, rebuilding and comparing sides, :class:`~kvbridge.planner.plan.Pairing`) runs on a small
thread pool of the server's, so that a huge or slow registration never delays ``/health``.
State is read and changed on the loop thread only.

Without a token the service trusts everyone who can reach it: bind a loopback address, or set
a token; a non-loopback bind without one logs a warning saying what is exposed.
"""

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.bootstrap.server import (
    MAX_BODY,
    BootstrapServer,
    exposure_warning,
    is_loopback,
    serve_forever,
)

__all__ = [
    "MAX_BODY",
    "BootstrapClient",
    "BootstrapServer",
    "exposure_warning",
    "is_loopback",
    "serve_forever",
]
