"""A running server's kvbridge faults, switched for a block of requests (``KVBRIDGE_FAULTS=@PATH``,
kvbridge.runtime.faults: each rank reads the file again at the start of a request): one server
serves the undisturbed requests and, inside the block, the faulty ones, where a server of its
own for them costs some 25 s of CPU to start."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


class FaultSwitch:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    @property
    def env(self) -> dict[str, str]:
        """The server's environment for it."""
        return {"KVBRIDGE_FAULTS": f"@{self.path}"}

    @contextlib.contextmanager
    def on(self, faults: str) -> Iterator[None]:
        """``faults`` for the requests started inside the block (none again after it, also
        when the block fails, so that one failed test leaves no fault to the next)."""
        self.path.write_text(faults)
        try:
            yield
        finally:
            self.path.write_text("")
