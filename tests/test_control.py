"""The control channel refuses what it must and keeps serving."""

from __future__ import annotations

import threading
import time

from kvbridge.control import ControlChannel
from kvbridge.protocol import Abort, Heartbeat, Message, encode


def channel(name: str, token: str, got: list[Message]) -> ControlChannel:
    return ControlChannel(name, host="127.0.0.1", token=token, on_message=got.append,
                          on_tick=lambda now: None)


def wait_until(cond: object, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_wrong_token_malformed_and_unknown_messages_are_refused() -> None:
    got: list[Message] = []
    rx = channel("rx", "secret", got)
    tx = channel("tx", "", [])
    rx.start()
    tx.start()
    try:
        tx.send("rx", rx.endpoint, Heartbeat(sender="tx", token="wrong"))
        tx.send_raw("rx", rx.endpoint, b"\x00\x01garbage")
        tx.send_raw("rx", rx.endpoint, encode(Heartbeat(sender="tx", token="secret")).replace(
            b"heartbeat", b"heartbeaT"))
        tx.send("rx", rx.endpoint, Abort(sender="tx", token="secret", room=5, decode_rank=0))
        assert wait_until(lambda: len(got) == 1)
        assert isinstance(got[0], Abort) and got[0].room == 5
        assert wait_until(lambda: rx.refused == 3)
        assert rx.handler_errors == 0
    finally:
        tx.close()
        rx.close()


def test_a_handler_that_raises_does_not_stop_the_channel() -> None:
    calls: list[Message] = []
    lock = threading.Lock()

    def handler(msg: Message) -> None:
        with lock:
            calls.append(msg)
        if len(calls) == 1:
            raise RuntimeError("bug in a handler")

    rx = ControlChannel("rx", host="127.0.0.1", token="", on_message=handler,
                        on_tick=lambda now: None)
    tx = channel("tx", "", [])
    rx.start()
    tx.start()
    try:
        for room in (1, 2):
            tx.send("rx", rx.endpoint, Abort(sender="tx", room=room, decode_rank=0))
        assert wait_until(lambda: len(calls) == 2)
        assert wait_until(lambda: rx.handler_errors == 1)
    finally:
        tx.close()
        rx.close()
