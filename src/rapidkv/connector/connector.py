"""`RapidKVConnector`: rapidkv as a vLLM KV connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "RapidKVConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"control_port": 9100,
                                      "secret_file": "/etc/rapidkv/secret"}}'

(an installed rapidkv registers the name with vLLM: `plugin.py`; code run from a
checkout on `PYTHONPATH` adds `"kv_connector_module_path": "rapidkv.connector"`).

One instance can act as P, D or both: the role of each request comes from its
`kv_transfer_params["rapidkv"]["role"]` (set by the router).

Which side calls what (docs/vllm-connector-contract.md has the details):

| side | method | when |
|---|---|---|
| scheduler | `on_new_request` | the engine admits a request (between steps) |
| scheduler | `get_num_new_matched_tokens` | D: may a waiting request load KV? (no side effects) |
| scheduler | `update_state_after_alloc` | D: blocks allocated -> TransferKV to P |
| scheduler | `build_connector_meta` | every step: our step id, tasks, releases |
| scheduler | `update_connector_output` | every step: settled transfers from the workers |
| scheduler | `request_finished` | once per request: P holds its blocks (delayed free) |
| scheduler | `has_pending_block_frees` | blocks short: held P blocks will free soon |
| worker | `register_kv_caches` | once: layout, kvt, transport |
| worker | `bind_connector_metadata` | every step: begin the kvt step |
| worker | `wait_for_layer_load` | before each layer: a split prefill's head in place |
| worker | `save_kv_layer` | after each layer's KV is written: kvt `layer_done` |
| worker | `wait_for_save` | after the forward: kvt `freeze_step` |
| worker | `get_transfer_results` | every step: finished sending / receiving |
| scheduler | `get_kv_connector_stats` | every step: counters and gauges for `/metrics` |
| API server | `build_prom_metrics`, `build_kv_connector_stats` | `/metrics` series (metrics.py) |
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from rapidkv.connector.amx import request_tile_permission
from rapidkv.connector.config import ConnectorConfig, kv_roles, warn_if_inline_secret
from rapidkv.connector.metadata import RankInfo, StepMeta
from rapidkv.connector.metrics import (
    RapidKVPromMetrics,
    RapidKVStats,
    StatsCadence,
    StatsDelta,
)
from rapidkv.connector.rank_links import ModelHeads
from rapidkv.connector.scheduler_side import SchedulerSide, model_fingerprint
from rapidkv.connector.worker_side import WorkerSide

log = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """rapidkv's loggers print through vLLM's handlers (vLLM configures only its own)."""
    ours, theirs = logging.getLogger("rapidkv"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


_log_like_vllm()


def start_worker_side(
    config: ConnectorConfig,
    instance_id: str,
    rank: int,
    block_size: int,
    heads: ModelHeads | None = None,
) -> WorkerSide:
    """The worker role, in a vLLM worker process, before its first forward.

    AMX tile permission is asked for first, before any thread or transport of
    ours exists (`rapidkv.connector.amx`): vLLM's bf16 attention uses AMX
    without asking, and would kill this worker at a forward of a few tokens.
    """
    request_tile_permission()
    return WorkerSide(config, instance_id, rank, block_size, heads)


class RapidKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        self.instance_id = str(ktc.engine_id)
        block_size = vllm_config.cache_config.block_size
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._stats_delta = StatsDelta()
        self._stats_cadence = StatsCadence()
        if role == KVConnectorRole.SCHEDULER:
            warn_if_inline_secret(self.config)
            if ktc.is_kv_consumer and ktc.kv_load_failure_policy != "recompute":
                log.warning(
                    "rapidkv: kv_load_failure_policy is %r; with 'recompute' a failed "
                    "transfer is prefilled locally instead of failing the request",
                    ktc.kv_load_failure_policy,
                )
            self.sched = SchedulerSide(
                self.config,
                self.instance_id,
                block_size,
                vllm_config.parallel_config.tensor_parallel_size,
                model_fingerprint(vllm_config.model_config),
                roles=kv_roles(ktc.kv_role),
                max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
                kv_events=kv_events_publisher(vllm_config),
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            model = vllm_config.model_config
            heads = ModelHeads(
                total=model.get_total_num_kv_heads(),
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                head_size=model.get_head_size(),
            )
            self.worker = start_worker_side(
                self.config, self.instance_id, get_tensor_model_parallel_rank(), block_size, heads
            )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Our per-layer hooks (P's layer-by-layer sends, a split prefill's wait
        for each layer on D) must run between layers: no full CUDA graphs."""
        return True

    # -- worker side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches, self._kv_cache_config.num_blocks)

    def get_handshake_metadata(self) -> RankInfo | None:
        return self.worker.info if self.worker is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self.worker is not None and isinstance(connector_metadata, StepMeta)
        self.worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self.worker is not None and isinstance(kv_connector_metadata, StepMeta)
        self.worker.preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # KV is pushed by P; nothing to pull

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_layer(layer_name)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        assert self.worker is not None
        self.worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.step_done()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        sending, recving, failed = self.worker.finished(finished_req_ids)
        return KVConnectorTransferResults(sending, recving, failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.worker_meta() if self.worker is not None else None

    # -- scheduler side ---------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.sched is not None:
            self.sched.kv_cache_manager = kv_cache_manager

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        assert self.sched is not None
        self.sched.set_ranks({int(rank): info for rank, info in metadata.items()})

    def on_new_request(self, request: Any) -> None:
        assert self.sched is not None
        self.sched.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.sched is not None
        return self.sched.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        assert self.sched is not None
        self.sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.sched is not None
        return self.sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.sched is not None
        self.sched.update_output(
            connector_output.kv_connector_worker_meta,
            connector_output.finished_recving,
            connector_output.finished_sending,
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        assert self.sched is not None
        return self.sched.request_finished(request, block_ids)

    def get_kv_connector_stats(self) -> RapidKVStats | None:
        """Scheduler role, every step after `update_connector_output`, when
        `stats_due` (at most every `STATS_INTERVAL_S` while a request holds
        blocks, at once when none does): what the counters grew, the gauges
        that changed and the histograms' values observed since the previous
        payload (`metrics.py`; the workers' counters reach the scheduler side
        in their metadata, so the worker role reports nothing here)."""
        if self.sched is None:
            return None
        if not self._stats_cadence.take(self.sched.holds_blocks()):
            return None
        return RapidKVStats(
            self._stats_delta.take(
                self.sched.counter_totals(), self.sched.gauges(), self.sched.take_observations()
            )
        )

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> RapidKVStats:
        return RapidKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> RapidKVPromMetrics:
        return RapidKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def has_pending_block_frees(self) -> bool:
        return self.sched is not None and self.sched.pending_block_frees()

    def shutdown(self) -> None:
        if self.sched is not None:
            self.sched.close()
        if self.worker is not None:
            self.worker.close()


def kv_events_publisher(vllm_config: Any) -> dict[str, str] | None:
    """Where this engine publishes its KV cache events (``--kv-events-config``
    with the ZMQ publisher), as `SchedulerSide.identity` reports it; None when
    it publishes none. vLLM offsets both ports by the data-parallel rank."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    if cfg is None or not cfg.enable_kv_cache_events or cfg.publisher != "zmq":
        return None
    out = {"endpoint": cfg.endpoint, "topic": cfg.topic or ""}
    if cfg.replay_endpoint:
        out["replay_endpoint"] = cfg.replay_endpoint
    rank = vllm_config.parallel_config.data_parallel_rank
    if rank:
        from vllm.distributed.kv_events import ZmqEventPublisher

        out = {
            k: ZmqEventPublisher.offset_endpoint_port(v, rank) if k != "topic" else v
            for k, v in out.items()
        }
    return out
