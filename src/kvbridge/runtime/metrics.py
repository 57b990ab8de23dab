"""What a rank moved and how its requests ended, counted where it happens, for operators.

Each :class:`~kvbridge.runtime.engine.Bridge` counts into its own :class:`Metrics`: bytes sent
and received (direct or staged), descriptors posted, staged segments, requests by outcome and
failure kind, and histograms (transfer time: from the first byte owed to the end; request
time: from the request's creation to its end; each phase's time, labelled by phase:
:mod:`kvbridge.runtime.timeline`). They reach operators two ways:

* :data:`REGISTRY`, a Prometheus registry over every live bridge of this process (labels:
  ``role``, ``rank``, ``engine``, ``transport``); an engine serving Prometheus registers it (or
  ``KVBRIDGE_METRICS_PORT`` serves it: :func:`serve`);
* :meth:`Metrics.drain`: what changed since the last drain, as plain data, for an engine that
  ships statistics from its workers itself (vLLM's connector stats:
  :mod:`kvbridge.integrations.vllm.stats`).

Every metric's name starts with ``kvbridge_`` (:data:`NAMES`).

Traces: each request's events are logged as JSON lines at DEBUG on the ``kvbridge.trace``
logger, keyed by ``trace``, the request's room in hex: the prefill's lines and the decode's
lines of one request carry the same one (:func:`trace`).
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from kvbridge.runtime.status import KVPoll, RequestStatus
from kvbridge.staging.cost import Path
from kvbridge.wire.protocol import Role

# Seconds: a chunk of a small model on loopback (ms) to a long prompt across hosts (s).
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_KEEP = 4096  # observations kept between drains (a drain every engine step empties them)

NAMES = {
    "bytes_sent": "kvbridge_bytes_sent",  # counter, by path
    "bytes_received": "kvbridge_bytes_received",  # counter, by path
    "descriptors": "kvbridge_descriptors_posted",  # counter
    "segments": "kvbridge_staged_segments",  # counter
    "requests": "kvbridge_requests",  # counter, by outcome and failure kind
    "transfer_seconds": "kvbridge_transfer_seconds",  # histogram
    "request_seconds": "kvbridge_request_seconds",  # histogram
    "phase_seconds": "kvbridge_phase_seconds",  # histogram, by phase
}

trace_log = logging.getLogger("kvbridge.trace")
log = logging.getLogger("kvbridge.metrics")


def trace(room: int, event: str, **fields: Any) -> None:
    """One JSON line at DEBUG for a request's ``event``; ``trace`` ties both sides' lines."""
    if trace_log.isEnabledFor(logging.DEBUG):
        trace_log.debug(json.dumps({"trace": f"{room:016x}", "event": event, **fields}))


def ended(status: RequestStatus, role: str, rank: int) -> None:
    """The trace line of a request's end on one rank."""
    failure = status.failure
    end = status.ended_at or status.created_at
    trace(
        status.room,
        "end",
        role=role,
        rank=rank,
        outcome=status.state.name.lower(),
        kind=failure.kind.value if failure else "",
        reason=failure.detail if failure else "",
        seconds=round(end - status.created_at, 6),
        phases={k: round(v, 6) for k, v in status.timeline.durations().items()},
    )


@dataclass
class _Histogram:
    counts: list[int]
    total: float = 0.0
    recent: list[float] | None = None

    @classmethod
    def empty(cls) -> _Histogram:
        return cls([0] * (len(BUCKETS) + 1), 0.0, [])

    def observe(self, v: float) -> None:
        i = next((k for k, b in enumerate(BUCKETS) if v <= b), len(BUCKETS))
        self.counts[i] += 1
        self.total += v
        if self.recent is not None and len(self.recent) < _KEEP:
            self.recent.append(v)


class Metrics:
    """One rank's counts. Thread-safe: the worker, control and landing threads all count."""

    def __init__(self, role: Role, rank: int, engine: str, transport: str) -> None:
        self.labels = {
            "role": role.value,
            "rank": str(rank),
            "engine": engine,
            "transport": transport,
        }
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], int] = defaultdict(int)
        self._drained: dict[tuple[str, str], int] = defaultdict(int)
        self._hists = {
            "transfer_seconds": _Histogram.empty(),
            "request_seconds": _Histogram.empty(),
        }
        self._phases: dict[str, _Histogram] = {}  # phase -> its seconds
        with _LIVE_LOCK:
            _LIVE.add(self)

    def close(self) -> None:
        """The rank closed: its series leave the registry."""
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def _add(self, name: str, label: str, n: int) -> None:
        with self._lock:
            self._counters[(name, label)] += n

    def sent(self, nbytes: int, path: Path, descriptors: int) -> None:
        """A prefill rank's write (or staged chunk) ended DONE and was reported."""
        with self._lock:
            self._counters[("bytes_sent", path.value)] += nbytes
            self._counters[("descriptors", "")] += descriptors

    def received(self, nbytes: int, path: Path) -> None:
        """A decode rank counted a chunk notice (the bytes as its sender counted them)."""
        self._add("bytes_received", path.value, nbytes)

    def scattered(self) -> None:
        self._add("segments", "", 1)

    def ended(self, status: RequestStatus) -> None:
        """A request ended (``RequestStatus``'s ``on_end``): its outcome and times."""
        end = status.ended_at or status.created_at
        failure = status.failure
        outcome = "success" if status.state is KVPoll.SUCCESS else "failed"
        kind = failure.kind.value if failure is not None else ""
        with self._lock:
            self._counters[("requests", f"{outcome}|{kind}")] += 1
            self._hists["request_seconds"].observe(end - status.created_at)
            if status.transferring_at is not None:
                self._hists["transfer_seconds"].observe(end - status.transferring_at)
            for phase, seconds in status.timeline.durations().items():
                self._phases.setdefault(phase, _Histogram.empty()).observe(seconds)

    def drain(self) -> dict[str, Any]:
        """What changed since the last drain: ``counters`` (``name|label`` -> increment) and
        ``observations`` (histogram name -> seconds observed); empty dicts when nothing did."""
        with self._lock:
            counters = {
                f"{n}|{label}": v - self._drained[(n, label)]
                for (n, label), v in self._counters.items()
                if v != self._drained[(n, label)]
            }
            self._drained = defaultdict(int, self._counters)
            observations = {}
            for name, h in [*self._hists.items(), *self._phase_items()]:
                if h.recent:
                    observations[name] = h.recent
                    h.recent = []
        return {"counters": counters, "observations": observations}

    def _phase_items(self) -> list[tuple[str, _Histogram]]:
        """The phase histograms, named ``phase_seconds|PHASE`` (as counters name labels)."""
        return [(f"phase_seconds|{p}", h) for p, h in self._phases.items()]

    def snapshot(self) -> tuple[dict[tuple[str, str], int], dict[str, tuple[list[int], float]]]:
        """Cumulative counters and histograms (bucket counts, sum; phases as
        ``phase_seconds|PHASE``), for Prometheus."""
        with self._lock:
            return dict(self._counters), {
                k: (list(h.counts), h.total)
                for k, h in [*self._hists.items(), *self._phase_items()]
            }


_COUNTERS: tuple[tuple[str, list[str]], ...] = (
    ("bytes_sent", ["path"]),
    ("bytes_received", ["path"]),
    ("descriptors", []),
    ("segments", []),
    ("requests", ["outcome", "kind"]),
)


def families(ranks: list[Metrics]) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
    """The metrics of ``ranks``, one family per name, a sample set per rank."""
    keys = ["role", "rank", "engine", "transport"]
    snaps = [(list(m.labels.values()), *m.snapshot()) for m in ranks]
    for name, extra in _COUNTERS:
        fam = CounterMetricFamily(NAMES[name], _HELP[name], labels=keys + extra)
        for values, counters, _ in snaps:
            for (n, label), v in counters.items():
                if n == name:
                    fam.add_metric(values + (label.split("|") if extra else []), v)
        yield fam
    bounds = [*map(str, BUCKETS), "+Inf"]

    def buckets(counts: list[int]) -> list[tuple[str, int]]:
        return list(zip(bounds, [sum(counts[: i + 1]) for i in range(len(counts))], strict=True))

    for name in ("transfer_seconds", "request_seconds"):
        hist = HistogramMetricFamily(NAMES[name], _HELP[name], labels=keys)
        for values, _, hists in snaps:
            counts, total = hists[name]
            hist.add_metric(values, buckets(counts), total)
        yield hist
    hist = HistogramMetricFamily(
        NAMES["phase_seconds"], _HELP["phase_seconds"], labels=keys + ["phase"]
    )
    for values, _, hists in snaps:
        for key, (counts, total) in hists.items():
            name, _, phase = key.partition("|")
            if name == "phase_seconds":
                hist.add_metric([*values, phase], buckets(counts), total)
    yield hist


_HELP = {
    "bytes_sent": "Bytes a prefill rank wrote to decode ranks, by path (direct or staged).",
    "bytes_received": "Bytes decode ranks were sent, as their senders' notices count them.",
    "descriptors": "Write descriptors (runs, or staged segments) a prefill rank posted.",
    "segments": "Staged segments a decode rank scattered into its pages.",
    "requests": "Requests that ended, by outcome and failure kind.",
    "transfer_seconds": "From the first byte owed to the request's end.",
    "request_seconds": "From the request's creation on this rank to its end.",
    "phase_seconds": "Each phase of a request on this rank, from the moment before it "
    "(kvbridge.runtime.timeline.Phase: ask, first_write, told, ready, post, writes, notice, end).",
}

_LIVE: weakref.WeakSet[Metrics] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


class _Bridges(Collector):
    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        with _LIVE_LOCK:
            ranks = list(_LIVE)
        yield from families(ranks)


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(_Bridges())

_served: dict[int, object] = {}
_serve_lock = threading.Lock()


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Serve :data:`REGISTRY` at ``http://host:port/metrics``, once per process. A port
    another process holds (ranks sharing a host and one setting) is logged, not fatal: the
    rank serves requests without it."""
    from prometheus_client import start_http_server

    with _serve_lock:
        if port in _served:
            return
        try:
            _served[port] = start_http_server(port, addr=host, registry=REGISTRY)
        except OSError as e:
            log.warning("kvbridge metrics not served on %s:%d: %s", host, port, e)
            _served[port] = None
