"""The token never travels: a tokened deployment started as a user starts one (``KVBRIDGE_TOKEN``
set, ``kvbridge demo`` over ``tcp``: the bootstrap service's HTTP, the control channel, the data
port), on a host of its own, every packet on that host's loopback captured with a raw packet
socket while it runs, and the token's bytes (raw, base64, hex) found in none. The capture is
shown to see what it must: the bootstrap requests' signatures are in it, and a request that
sends the token itself (as the client once did) is found.

Needs a raw packet socket and network namespaces (Linux, root): skipped, saying why, where
either cannot be had.
"""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from kvbridge.bootstrap import BootstrapServer
from kvbridge.deploy.netns import inside
from wire import capture, private_host

pytestmark = pytest.mark.slow  # a demo run, ~10 s


def forms(token: str) -> list[bytes]:
    raw = token.encode()
    return [raw, base64.b64encode(raw), raw.hex().encode()]


def test_a_tokened_deployment_never_puts_the_token_on_the_wire() -> None:
    token = "kvb-" + secrets.token_hex(12)
    env = {**os.environ, "KVBRIDGE_TOKEN": token}
    command = [sys.executable, "-m", "kvbridge", "demo", "--model", "llama"]
    command += ["--topology", "tp2-tp1", "--transport", "tcp"]
    with private_host() as net, capture(namespace=net["host"].netns) as frames:
        demo = net.popen("host", command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = (b.decode(errors="replace") for b in demo.communicate(timeout=300))
    assert demo.returncode == 0, out[-2000:] + err[-2000:]
    wire = b"".join(frames)
    assert wire.count(b"Authorization: KVB1 ts=") >= 3, "the capture saw no bootstrap request"
    for form in forms(token):
        assert form not in wire, f"the token ({form!r}) travelled"


def test_the_capture_finds_a_token_that_is_sent() -> None:
    """The control: a request carrying the token itself, as the bootstrap client once did."""
    token = "kvb-" + secrets.token_hex(12)
    with (
        private_host() as net,
        inside(net["host"].netns),  # the service, the request and the capture: on that host
        BootstrapServer(token=token) as server,
        capture() as frames,
    ):
        req = urllib.request.Request(f"http://{server.address}/v1/prefill")
        req.add_header("Authorization", f"Bearer {token}")
        with pytest.raises(urllib.error.HTTPError):  # refused: the token is no proof
            urllib.request.urlopen(req, timeout=5)
    assert token.encode() in b"".join(frames)
