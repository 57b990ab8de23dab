"""Proof of the shared token for the bootstrap service's HTTP routes: the token never travels.

A tokened client signs each request: ``Authorization: KVB1 ts=<ms>,nonce=<32 hex>,mac=<64 hex>``,
where ``mac`` is HMAC-SHA256 under the token of the scheme, the method, the target as sent (path
and query), the time, the nonce and the SHA-256 of the body. The service recomputes it, refuses a
time outside its window (the hosts' clocks must agree within :data:`WINDOW` seconds) and a nonce
it has seen inside that window: a request read off the wire can neither be altered nor sent
again. The same token proves itself to the control channel and the ``tcp`` data port over a
fresh challenge (:mod:`kvbridge.transports.tcp_wire`); HTTP gets a timestamp instead, so that a
call stays one round trip.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable

SCHEME = "KVB1"
WINDOW = 300.0  # seconds either side of the service's clock
MAX_SEEN = 1 << 20  # nonces held for replay checks: far above any deployment's request rate
_HEADER = re.compile(r"KVB1 ts=(\d{1,15}),nonce=([0-9a-f]{32}),mac=([0-9a-f]{64})")


class AuthRefused(Exception):
    """Why a request's proof of the token was refused (the reason goes back to the client)."""


def _mac(token: str, method: str, target: str, ts: str, nonce: str, body: bytes) -> str:
    head = f"{SCHEME}\n{method.upper()}\n{target}\n{ts}\n{nonce}\n".encode()
    return hmac.new(token.encode(), head + hashlib.sha256(body).digest(), "sha256").hexdigest()


def sign(token: str, method: str, target: str, body: bytes, now: float | None = None) -> str:
    """The ``Authorization`` value of one request (``target``: path and query, as sent)."""
    ts = str(int((time.time() if now is None else now) * 1000))
    nonce = secrets.token_hex(16)
    return f"{SCHEME} ts={ts},nonce={nonce},mac={_mac(token, method, target, ts, nonce, body)}"


class Verifier:
    """The service's side: checks each request's proof, once. Thread-safe."""

    def __init__(
        self, token: str, window: float = WINDOW, clock: Callable[[], float] = time.time
    ) -> None:
        self._token, self._window, self._clock = token, window, clock
        self._seen: set[str] = set()
        self._expiry: deque[tuple[float, str]] = deque()
        self._lock = threading.Lock()

    def check(self, header: str, method: str, target: str, body: bytes) -> None:
        """Returns if ``header`` proves the token for this request; AuthRefused saying why."""
        if not header:
            raise AuthRefused(f"no proof of the bootstrap token (expected '{SCHEME} ...')")
        m = _HEADER.fullmatch(header)
        if m is None:
            scheme = header.split(" ", 1)[0][:16]
            raise AuthRefused(
                f"a proof of the bootstrap token in {scheme!r} form; expected '{SCHEME} "
                f"ts=..,nonce=..,mac=..' (the token itself is never accepted)"
            )
        ts, nonce, mac = m.groups()
        now = self._clock()
        skew = int(ts) / 1000 - now
        if abs(skew) > self._window:
            raise AuthRefused(
                f"a proof of the bootstrap token signed {skew:+.0f} s from this service's "
                f"clock; the window is {self._window:.0f} s (are the hosts' clocks synced?)"
            )
        if not hmac.compare_digest(mac, _mac(self._token, method, target, ts, nonce, body)):
            raise AuthRefused("wrong proof of the bootstrap token (another token, or altered)")
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(self._expiry.popleft()[1])
            if nonce in self._seen:
                raise AuthRefused("a replayed request (its nonce was already used)")
            if len(self._seen) >= MAX_SEEN:
                raise AuthRefused(f"more than {MAX_SEEN} requests in {self._window:.0f} s")
            self._seen.add(nonce)
            # Held until its time leaves the window: the clock check refuses it after that.
            self._expiry.append((int(ts) / 1000 + self._window, nonce))
