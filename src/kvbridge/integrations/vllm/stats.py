"""kvbridge's metrics in vLLM's connector-stats interface, without importing vLLM.

vLLM asks each worker's connector for what it observed each step (``get_kv_connector_stats``),
sums the workers' (``aggregate``), ships the sum to its front-end process, and there hands it
to the connector's Prometheus metrics (``build_prom_metrics``), served at vLLM's ``/metrics``,
and to its periodic log line (``reduce``). The payload is :meth:`Metrics.drain
<kvbridge.runtime.metrics.Metrics.drain>`'s plain data: ``counters`` (``name|label`` ->
increment) and ``observations`` (histogram -> seconds). :mod:`.connector` wraps these functions
in vLLM's classes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.runtime.metrics import BUCKETS, NAMES

Stats = dict[str, Any]


def empty() -> Stats:
    return {"counters": {}, "observations": {}}


def is_empty(data: Mapping[str, Any]) -> bool:
    return not data.get("counters") and not any(data.get("observations", {}).values())


def aggregate(a: Mapping[str, Any], b: Mapping[str, Any]) -> Stats:
    """Two workers' (or two steps') stats as one."""
    counters = dict(a.get("counters", {}))
    for k, v in b.get("counters", {}).items():
        counters[k] = counters.get(k, 0) + v
    observations = {k: list(v) for k, v in a.get("observations", {}).items()}
    for k, v in b.get("observations", {}).items():
        observations.setdefault(k, []).extend(v)
    return {"counters": counters, "observations": observations}


def reduce(data: Mapping[str, Any]) -> dict[str, int | float]:
    """One interval's summary, for vLLM's log line: totals, and mean seconds."""
    out: dict[str, int | float] = {}
    for key, v in sorted(data.get("counters", {}).items()):
        name, _, label = key.partition("|")
        out[f"{name}[{label}]" if label else name] = v
    for name, values in sorted(data.get("observations", {}).items()):
        if values:
            out[f"{name}_mean"] = round(sum(values) / len(values), 6)
    return out


@dataclass(frozen=True)
class Metric:
    """One kvbridge metric as vLLM's front-end registers it: a counter fed by the counters
    whose name is ``key``, split by ``labels``; or a histogram fed by observations."""

    key: str
    labels: tuple[str, ...] = ()
    histogram: bool = False
    doc: str = ""

    @property
    def name(self) -> str:
        return NAMES[self.key]


METRICS = (
    Metric("bytes_sent", ("path",), doc="Bytes the prefill ranks wrote, by path."),
    Metric("bytes_received", ("path",), doc="Bytes the decode ranks were sent, by path."),
    Metric("descriptors", doc="Write descriptors (runs, or staged segments) posted."),
    Metric("segments", doc="Staged segments scattered into decode pages."),
    Metric("requests", ("outcome", "kind"), doc="Transfers ended, by outcome and kind."),
    Metric("transfer_seconds", histogram=True, doc="From the first byte owed to the end."),
    Metric("request_seconds", histogram=True, doc="From a request's creation to its end."),
    Metric("phase_seconds", ("phase",), histogram=True, doc="Each phase of a request."),
)


def observe(
    data: Mapping[str, Any], record: Callable[[Metric, tuple[str, ...], float], None]
) -> None:
    """Feed one payload to vLLM's metrics: ``record(metric, label values, value)`` once per
    counter increment (the value to add) and per histogram observation."""
    by_key = {m.key: m for m in METRICS}
    for key, v in data.get("counters", {}).items():
        name, _, label = key.partition("|")
        m = by_key.get(name)
        if m is not None and not m.histogram:
            values = tuple(label.split("|")) if m.labels else ()
            record(m, values + ("",) * (len(m.labels) - len(values)), float(v))
    for key, seconds in data.get("observations", {}).items():
        name, _, label = key.partition("|")  # phase_seconds|PHASE
        m = by_key.get(name)
        if m is not None and m.histogram:
            values = (label,) if m.labels else ()
            for s in seconds:
                record(m, values, float(s))


__all__ = ["BUCKETS", "METRICS", "Metric", "aggregate", "empty", "is_empty", "observe", "reduce"]
