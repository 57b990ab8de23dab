"""A prefill rank's record in the bootstrap service, kept there.

The service holds its table in memory only: restarted (or replaced at the same address), it
knows no prefill rank, and every decode engine that links afterwards would wait for ranks that
never register again. So a prefill rank registers at start (a failure there fails the start,
saying why) and then again every :data:`REFRESH` seconds, which the service takes as the same
record, and after each its owner's ``registered`` runs (a DP group's first rank announces its
live rooms again: a restarted service knew none of them); a service that is down is logged once
when it goes and once when it is back. Links already made do not need the service: their
requests go on while it is away.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvbridge.bootstrap import BootstrapClient
from kvbridge.errors import BootstrapError, IncompatibleError
from kvbridge.wire.protocol import RankInfo

log = logging.getLogger("kvbridge.sender")

REFRESH = 2.0  # seconds between registrations; a restarted service knows the rank after this


class Registration:
    """Registers ``info`` with the service at ``client.address`` now and keeps it registered."""

    def __init__(
        self, client: BootstrapClient, info: RankInfo, registered: Callable[[], None]
    ) -> None:
        self.client, self.info, self.registered = client, info, registered
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._keep, daemon=True, name=f"kvbridge-register-{info.agent}"
        )

    def start(self) -> None:
        self.client.register_prefill(self.info)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(REFRESH + self.client.timeout)

    def _keep(self) -> None:
        away = ""
        while not self._stop.wait(REFRESH):
            try:
                self.client.register_prefill(self.info, deadline=time.monotonic() + REFRESH)
            except (BootstrapError, IncompatibleError) as e:
                if not away:
                    log.warning(
                        "%s: the bootstrap service at %s cannot register this rank (%s); "
                        "links already made go on, new decode engines cannot link until it "
                        "is back",
                        self.info.agent,
                        self.client.address,
                        e,
                    )
                away = str(e)
            else:
                self.registered()
                if away:
                    log.info(
                        "%s: registered again with the bootstrap service at %s",
                        self.info.agent,
                        self.client.address,
                    )
                away = ""
