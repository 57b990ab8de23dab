"""Threads that decode outside input for the first time at once do not crash the process.

msgspec builds a Struct type's decoding info on the type's first typed decode, and a second
thread decoding the same type meanwhile can read it half built: a segfault (msgspec 0.22; seen
as examples/quickstart.py dying with SIGSEGV under load, its two prefill ranks taking their
first hello together). kvbridge builds its decoders at import. Each child process here starts
from a parent that has decoded nothing, and has eight threads decode at once, the interpreter
switching threads as often as it can; before the decoders were built at import, about one
child in three died."""

from __future__ import annotations

import os
import signal
import sys
import threading

import msgspec
import pytest

from kvbridge.bootstrap.checks import ROOMS
from kvbridge.transports._common import (
    METADATA_VERSION,
    AgentMetadata,
    RegionInfo,
    decode_metadata,
    encode_metadata,
)
from kvbridge.transports.tcp_wire import BatchHeader, decode_header

CHILDREN = 24
THREADS = 8


def _decode_at_once() -> None:
    meta = encode_metadata(
        AgentMetadata(METADATA_VERSION, "shm", "a", (RegionInfo("k", 10, "seg"),), host_id="h")
    )
    header = msgspec.json.encode(BatchHeader("a", "b", ("k",), 10, (1, 2)))
    barrier = threading.Barrier(THREADS)

    def decode() -> None:
        barrier.wait()
        decode_metadata(meta, "shm", "a")
        decode_header(header)
        ROOMS.decode(b'{"rooms": [1, 2]}')

    threads = [threading.Thread(target=decode) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_first_decodes_in_many_threads_at_once_do_not_crash() -> None:
    died = []
    for _ in range(CHILDREN):
        pid = os.fork()
        if pid == 0:  # the child: decode, then leave without running the parent's teardown
            code = 1
            try:
                sys.setswitchinterval(1e-6)
                _decode_at_once()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) or os.WEXITSTATUS(status):
            died.append(
                signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else status
            )
    assert not died, f"{len(died)} of {CHILDREN} children died: {died}"
