"""What both ends of one SGLang request share: its tokens' fingerprint, and where the reason
of a failure that came from another TP rank is."""

from __future__ import annotations

import contextlib
import hashlib
import struct
from collections.abc import Sequence

import numpy as np

FINGERPRINT_BYTES = 16


def fingerprint(token_ids: Sequence[int]) -> bytes:
    """A digest of the tokens whose KV a request moves, the same on the prefill and decode
    servers. SGLang keys a transfer by its bootstrap room alone: two requests given one room
    would otherwise be told apart only by their length, and not at all where it is equal."""
    if not isinstance(token_ids, np.ndarray):
        # SGLang's lists of ints: packed straight, 2.5x as fast as numpy converts them (ids
        # that are not plain ints are read as numpy reads them, below).
        with contextlib.suppress(struct.error, TypeError):
            return _digest(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return _digest(np.asarray(token_ids, dtype="<i8").tobytes())


def _digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=FINGERPRINT_BYTES).digest()


def elsewhere(server: str) -> str:
    """Why a request failed on this rank when its own transfer did not: SGLang fails a request
    on every TP rank once one rank's poll says FAILED. This rank stops its own transfer (SGLang
    frees the pages next) and says where the reason is."""
    return (
        f"another TP rank of this {server} server failed the request (its reason is in this "
        f"server's log); this rank's own transfer stopped with it"
    )
