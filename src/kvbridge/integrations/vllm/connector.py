"""kvbridge as a vLLM KV connector (vLLM >= 0.32, the V1 connector API).

Installed next to vLLM, kvbridge registers it by name (:mod:`.plugin`)::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
        "kv_role": "kv_producer",          # kv_consumer on the decode instance
        "kv_connector_extra_config": {"bootstrap": "127.0.0.1:8998"}}'

(``"kv_connector_module_path": "kvbridge.integrations.vllm.connector"`` loads it without the
registration.)

vLLM makes one instance in its scheduler (role SCHEDULER, :mod:`.scheduler`) and one per
worker rank (role WORKER, :mod:`.worker`); this class only routes vLLM's calls to them.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbridge.integrations.vllm import stats
from kvbridge.integrations.vllm.describe import KVGroup, StatePart, WorkerPlace, dtype_of
from kvbridge.integrations.vllm.params import ConnectorOptions
from kvbridge.integrations.vllm.scheduler import SchedulerSide, StepMeta, blocks_of
from kvbridge.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch


class KVBridgeMetadata(KVConnectorMetadata, StepMeta):  # type: ignore[misc]
    """One step's :class:`StepMeta`, as vLLM hands connector metadata to its workers."""


class KVBridgeStats(KVConnectorStats):  # type: ignore[misc]
    """kvbridge's metrics of one interval (:mod:`.stats`), as vLLM ships them."""

    def reset(self) -> None:
        self.data = stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return KVBridgeStats(data=stats.aggregate(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return stats.reduce(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


class KVBridgePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """kvbridge's metrics in vLLM's /metrics, per engine (names start with kvbridge_)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = {}
        for m in stats.METRICS:
            if m.histogram:
                metric = self._histogram_cls(
                    name=m.name,
                    documentation=m.doc,
                    buckets=list(stats.BUCKETS),
                    labelnames=[*labelnames, *m.labels],
                )
            else:
                metric = self._counter_cls(
                    name=m.name, documentation=m.doc, labelnames=[*labelnames, *m.labels]
                )
            self._metrics[m.key] = metric

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]

        def record(m: stats.Metric, labels: tuple[str, ...], value: float) -> None:
            child = self._metrics[m.key].labels(*engine, *labels)
            if m.histogram:
                child.observe(value)
            else:
                child.inc(value)

        stats.observe(transfer_stats_data, record)


def _log_to_stderr() -> None:
    """kvbridge's log at ``KVBRIDGE_LOG``'s level, in the scheduler's process and in each
    worker's (vLLM configures its own loggers only)."""
    level = os.environ.get("KVBRIDGE_LOG")
    root = logging.getLogger("kvbridge")
    if level and not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(level.upper())


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """SupportsHMA: vLLM keeps its hybrid allocator on (attention and Mamba layers in KV cache
    groups of their own) and hands over block ids per group."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_to_stderr()
        ktc = vllm_config.kv_transfer_config
        options = ConnectorOptions.parse(ktc.kv_connector_extra_config)
        producer = bool(ktc.is_kv_producer)
        if bool(ktc.is_kv_consumer) == producer:
            raise ValueError(
                f"kvbridge's vLLM connector is either kv_producer (prefill) or "
                f"kv_consumer (decode), got kv_role={ktc.kv_role!r}"
            )
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            mamba = bool(getattr(kv_cache_config, "has_mamba_layers", False))
            self._sched = SchedulerSide(
                options,
                producer,
                stream=vllm_config.max_concurrent_batches == 1,
                backoff=1 if mamba else 0,
            )
        else:
            self._worker = WorkerSide(
                options, _place(vllm_config, ktc.engine_id, kv_cache_config), producer
            )

    # ---- scheduler side ------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        assert self._sched is not None
        self._sched.arrived(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        step = self._sched.build_meta(scheduler_output)
        return KVBridgeMetadata(**vars(step))

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.workers_reported(connector_output.finished_recving)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.finished(request, blocks_of((block_ids,)))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.finished(request, blocks_of(block_ids))

    # ---- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward: the requests it streams get their senders."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVBridgeMetadata):
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request runs only once its KV is all there."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Layer ``layer_name`` of this step's tokens is in the cache: the requests this step
        streams send it now, while the forward computes the next layers."""
        assert self._worker is not None
        self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        """Pushes run in kvbridge's threads; vLLM frees the blocks when they ended."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sent, received, failed = self._worker.results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this worker's kvbridge moved since vLLM last asked (None: nothing)."""
        if self._worker is None:
            return None
        data = self._worker.stats()
        return None if stats.is_empty(data) else KVBridgeStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVBridgeStats(data=data if data is not None else stats.empty())

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


def _place(vllm_config: Any, engine_id: str, kv_cache_config: Any) -> WorkerPlace:
    """Where this worker sits, read from vLLM."""
    import torch
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    from vllm.distributed.utils import get_pp_indices
    from vllm.v1.kv_cache_interface import MambaSpec

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    layers = (
        mc.get_total_num_hidden_layers()
        if hasattr(mc, "get_total_num_hidden_layers")
        else mc.hf_config.num_hidden_layers
    )
    pp = pc.pipeline_parallel_size
    ranges = tuple(get_pp_indices(layers, r, pp) for r in range(pp))
    groups = tuple(
        KVGroup(
            tuple(g.layer_names),
            isinstance(g.kv_cache_spec, MambaSpec),
            _states(g.kv_cache_spec),
            getattr(g.kv_cache_spec, "sliding_window", None),
            getattr(g.kv_cache_spec, "num_speculative_blocks", 0) or 0,
            getattr(g.kv_cache_spec, "attention_chunk_size", None),
        )
        for g in (kv_cache_config.kv_cache_groups if kv_cache_config else ())
    )
    hybrid = any(g.state for g in groups)
    return WorkerPlace(
        model=str(mc.model).rstrip("/").rsplit("/", 1)[-1],
        total_kv_heads=mc.get_total_num_kv_heads(),
        num_layers=layers,
        tp=pc.tensor_parallel_size,
        tp_rank=get_tp_group().rank_in_group,
        pp_ranges=ranges,
        pp_rank=get_pp_group().rank_in_group,
        engine_id=engine_id or "vllm",
        cpu=not torch.cuda.is_available(),
        groups=groups,
        hf_config=mc.hf_text_config.to_dict() if hybrid else None,
    )


def _states(spec: Any) -> tuple[StatePart, ...]:
    """One request's states of one layer of a MambaSpec, as vLLM allocates them (none for
    attention)."""
    import math

    shapes, dtypes = getattr(spec, "shapes", ()), getattr(spec, "dtypes", ())
    return tuple(StatePart(math.prod(s), dtype_of(d)) for s, d in zip(shapes, dtypes, strict=True))
