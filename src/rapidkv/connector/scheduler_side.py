"""The scheduler side of the connector (EngineCore process): the roles an
instance plays, composed behind the hooks `connector.py` calls, plus this
instance's control-plane server (its own thread).

- P's role (`producer_side.ProducerSide`): requests whose KV is sent from here
  (`kv_transfer_params.rapidkv.role == "prefill"`).
- D's role (`consumer_side.ConsumerSide`): requests whose KV is loaded from
  another instance (`role == "decode"`).
- The control plane (`control_handlers.ControlHandlers`): the server's
  handlers, and the destinations that handshook with us.
- Migration sources (`sources.Sources`): every running request of ours (any
  role, `local` included: a request computed and decoded here alone), which a
  migration destination may ask the KV of by its `xfer_id`; P's role serves
  such a migration TransferKV.

They share one `SharedState` (shared_state.py): the lock, the counters, the
metadata pending for the next step, the engine step in flight, the timeline.
Each request has at most one role here, fixed at admission (`on_new_request`),
and is a migration source besides until vLLM finished it. An instance may
serve both roles at once; every role exists on every instance.

Locking: what the roles hold is shared between the engine thread, the RPC
server's loop thread and the RPC client's threads, and touched under the
shared lock (the roles' docstrings name the exceptions); the engine thread
never waits on the network.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

import httpx

from rapidkv.connector.bypass import BypassSender
from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.consumer_side import ConsumerSide
from rapidkv.connector.control_handlers import ControlHandlers
from rapidkv.connector.metadata import RankInfo, StepMeta, WorkerMeta
from rapidkv.connector.producer_side import ProducerSide
from rapidkv.connector.shared_state import SharedState
from rapidkv.connector.shutdown_signal import chain_shutdown_signals
from rapidkv.connector.sources import ROLES, Sources
from rapidkv.control.address import format_address, parse_address
from rapidkv.control.messages import (
    KVSpec,
    RankEndpoint,
    Timeline,
)
from rapidkv.control.server import RpcServer
from rapidkv.membership.record import InstanceRecord, encode_record, record_key
from rapidkv.membership.registrar import Registrar

log = logging.getLogger(__name__)


def rapidkv_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """Our part of a request's `kv_transfer_params`, if any."""
    if not params:
        return None
    ours = params.get("rapidkv")
    return ours if isinstance(ours, dict) and ours.get("xfer_id") else None


def is_discovery(params: dict[str, Any] | None) -> bool:
    """A router's probe for this instance's control address
    (`kv_transfer_params = {"rapidkv": {"discover": true}}`)."""
    ours = params.get("rapidkv") if params else None
    return isinstance(ours, dict) and ours.get("discover") is True


class SchedulerSide:
    """The scheduler role of `RapidKVConnector`: one per instance, for the
    life of its EngineCore."""

    def __init__(
        self,
        config: ConnectorConfig,
        instance_id: str,
        block_size: int,
        tp_size: int,
        fingerprint: str,
        roles: tuple[str, ...] = ("prefill", "decode"),
        max_num_seqs: int | None = None,
        kv_events: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.kv_events = kv_events  # vLLM's KV-event publisher, for a router's prefix index
        self.instance_id = instance_id
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs  # vLLM's; a router's placement waits beyond it
        self.tp_size = tp_size
        self.fingerprint = fingerprint
        self.shared = SharedState(config, instance_id, block_size, tp_size)
        self.incarnation = self.shared.incarnation
        self.counters = self.shared.counters
        self._lock = self.shared.lock
        self.sources = Sources(self.shared)
        self.producer = ProducerSide(self.shared, self.sources)
        self.consumer = ConsumerSide(self.shared)
        self.control = ControlHandlers(self.shared, self.producer, self.stats, self.timeline)
        self.server = RpcServer(
            self.control.handle,
            config.control_host,
            config.control_port,
            secret=config.shared_secret(),
        )
        self.server.start()
        # what peers and routers are told (the bound host unless another is advertised)
        port = parse_address(self.server.address)[1]
        self.shared.control_address = format_address(config.control_advertised_host, port)
        log.info(
            "rapidkv %s: control plane on %s, advertised as %s",
            instance_id,
            self.server.address,
            self.shared.control_address,
        )
        self.registrar = self._register(roles) if config.etcd_endpoints else None
        self._shut_down = False  # `closing` acted on (engine thread)
        self._leaving: threading.Thread | None = None  # revokes our etcd record
        # vLLM's EngineCore: its SIGTERM starts a shutdown that waits for held blocks
        chain_shutdown_signals(self._shutdown_requested)

    def _shutdown_requested(self) -> None:
        """A shutdown signal reached the engine (in a signal handler: a flag only)."""
        self.shared.closing = True

    @property
    def spec(self) -> KVSpec | None:
        """This instance's KV spec, once `set_ranks` ran."""
        return self.shared.spec

    @property
    def endpoints(self) -> list[RankEndpoint]:
        """This instance's ranks as a peer reaches them, once `set_ranks` ran."""
        return self.shared.endpoints

    @property
    def kv_cache_manager(self) -> Any:
        """vLLM's KV cache manager (bound by `bind_kv_cache_manager`)."""
        return self.shared.kv_cache_manager

    @kv_cache_manager.setter
    def kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.shared.kv_cache_manager = kv_cache_manager

    # -- start-up ---------------------------------------------------------------

    def set_ranks(self, infos: dict[int, RankInfo]) -> None:
        """The workers' handshake metadata, once: this instance's KV spec, its
        ranks' endpoints and their bypass channels."""
        first = infos[min(infos)]
        self.shared.spec = KVSpec(
            block_size=self.block_size,
            kernel_blocks_per_block=first.kernel_blocks_per_block,
            dtype=first.dtype,
            num_layers=len(first.block_bytes),
            layer_block_bytes=first.block_bytes,
            layer_runs_per_block=first.runs_per_block,
            tp_size=self.tp_size,
            model_fingerprint=self.fingerprint,
        )
        self.shared.endpoints = [
            RankEndpoint(
                rank=r,
                transport=i.transport,
                transport_metadata=i.transport_metadata,
                layout=i.layout,
                num_blocks=i.num_blocks,
            )
            for r, i in sorted(infos.items())
        ]
        self.shared.bypass = BypassSender({r: i.bypass_address for r, i in infos.items()})

    # -- request lifecycle (engine thread) ---------------------------------------

    def on_new_request(self, request: Any) -> None:
        """The engine admitted `request`: the role its params name takes it,
        and it is a migration source (`prefill`, `decode` or `local`)."""
        ours = rapidkv_params(request.kv_transfer_params)
        if ours is None:
            return
        xfer_id = str(ours["xfer_id"])
        role = ours.get("role")
        with self._lock:
            if role == "prefill":
                self.producer.admit(request, xfer_id)
            elif role == "decode":
                self.consumer.admit(request, xfer_id, ours)
            if role in ROLES:
                self.sources.admit(request, xfer_id, role)

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """D: tokens to load from P (`ConsumerSide.matched_tokens`)."""
        return self.consumer.matched_tokens(request, num_computed)

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        """D: blocks allocated; the TransferKV goes to P (`ConsumerSide.after_alloc`)."""
        self.consumer.after_alloc(request, blocks, num_external)

    def build_meta(self, so: Any) -> StepMeta:
        """The next step's metadata for the workers (vLLM's scheduler output
        `so`): P's tasks, then all that was pending for the workers, and the
        bypass messages sent so far. The step is in flight until its output."""
        self.shared.step_id += 1
        meta = StepMeta(self.shared.step_id)
        now = time.monotonic()
        with self._lock:
            if self.shared.closing and not self._shut_down:
                self._begin_shutdown()
            self.sources.on_step(meta.step_id, so.num_scheduled_tokens, so.preempted_req_ids)
            self.producer.plan_step(meta, so, now)
            self.control.forget_idle(now)
            pending = self.shared.take_pending()
            bypass_seq = self.shared.bypass.sent if self.shared.bypass is not None else 0
            self.shared.begin_step(now, so.total_num_scheduled_tokens, so.num_scheduled_tokens)
        pending.fill(meta)
        meta.bypass_seq = bypass_seq
        return meta

    def _begin_shutdown(self) -> None:
        """The engine is shutting down: this instance leaves the fleet (its
        etcd record is revoked, on a thread of its own: no router sends it
        more) and nothing of P's waits for a TransferKV any more
        (`ProducerSide.shut_down`; the releases go with the step being built).
        Engine thread, under the lock."""
        self._shut_down = True
        if self.registrar is not None:
            self._leaving = threading.Thread(
                target=self.registrar.stop, name="rapidkv-leave", daemon=True
            )
            self._leaving.start()
        answered, released = self.producer.shut_down()
        log.info(
            "rapidkv %s: vLLM is shutting down: %d parked TransferKVs answered GONE, "
            "%d finished requests no TransferKV came for released",
            self.instance_id,
            answered,
            released,
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM finished `request`: whether its blocks are held (a P request's,
        and any request's a migration from it is not over, until nothing can be
        sent from them) and what its response's `kv_transfer_params` carry."""
        req_id = request.request_id
        if is_discovery(request.kv_transfer_params):
            # a router asks where our control plane listens (the answer goes out
            # in the response's kv_transfer_params)
            return False, self.identity()
        ours = rapidkv_params(request.kv_transfer_params)
        with self._lock:
            self.sources.finished(req_id)
            self.consumer.request_finished(req_id)
            if not self.producer.request_finished(request, block_ids):
                return False, None
        if ours is None or ours.get("role") != "prefill":
            return True, None  # held for a migration only
        # who computed it: a router that knew another control address re-learns it
        return True, self.identity()

    def identity(self) -> dict[str, Any]:
        """What a router learns from our answers (`kv_transfer_params`): where
        our control plane listens, who we are, our block size, how many
        requests our engine runs at once and, when vLLM publishes its KV
        events over ZMQ, where (``kv_events``: ``endpoint``, ``replay_endpoint``
        when set, ``topic``; a wildcard host is the router's to replace with
        this instance's)."""
        ours: dict[str, Any] = {
            "control": self.shared.control_address,
            "instance_id": self.instance_id,
            "incarnation": self.incarnation,
            "block_size": self.block_size,
        }
        if self.max_num_seqs is not None:
            ours["max_num_seqs"] = self.max_num_seqs
        if self.kv_events is not None:
            ours["kv_events"] = dict(self.kv_events)
        return {"rapidkv": ours}

    def update_output(
        self,
        meta: WorkerMeta | None,
        finished_recving: set[str] | None,
        finished_sending: set[str] | None = None,
    ) -> None:
        """The step in flight returned with the workers' output, applied in this
        order: blocks vLLM freed, the step's end, the ranks' acks, D's received
        KV, the workers' counters and the destinations whose writes failed,
        then the transfers settled on a rank."""
        with self._lock:
            self.producer.blocks_freed(finished_sending or ())
            ended = self.shared.end_step(meta.timings if meta is not None else ())
            if ended is not None:
                self.producer.step_ended(*ended)
            self.producer.take_acks(meta.acks if meta is not None else ())
            self.consumer.kv_received(finished_recving or set())
            if meta is not None:
                self.counters.update(meta.counters)
                self.control.writes_failed(meta.broken_peers)
            self.producer.take_settled(meta.settled if meta is not None else ())

    def pending_block_frees(self) -> bool:
        """Finished P requests hold blocks that will be freed without preempting
        anyone (`ProducerSide.pending_block_frees`)."""
        return self.producer.pending_block_frees()

    # -- observability ------------------------------------------------------------

    def timeline(self, xfer_ids: list[str]) -> Timeline:
        """Events of these transfers (P's, and on a D `d_admitted`,
        `d_transfer_kv_sent`, `d_kv_received`) and the recent steps."""
        with self._lock:
            return self.shared.timeline.snapshot(xfer_ids)

    def counter_totals(self) -> dict[str, float]:
        """Every counter's running total: this side's (the workers' increments
        included), `observations_dropped` (histogram values left out of a
        payload, `observations.py`) and the control-plane server's, prefixed
        `rpc_`. Totals never decrease; a counter appears once first incremented
        (the server's are always there)."""
        with self._lock:
            out = {k: float(v) for k, v in self.counters.items()}
            dropped = self.shared.observations.dropped
        if dropped:
            out["observations_dropped"] = float(dropped)
        out.update({f"rpc_{k}": float(v) for k, v in self.server.counters().items()})
        return out

    def take_observations(self) -> dict[str, list[float]]:
        """The histograms' values observed since the previous call
        (`observations.py`), per name."""
        with self._lock:
            return self.shared.observations.take()

    def gauges(self) -> dict[str, float]:
        """Current levels: parked TransferKVs, live transfers, tombstones, D
        requests waiting for KV, blocks of finished P requests held for their
        transfer, peers (D instances that handshook with us; P instances we
        handshook with, by state), vLLM's free blocks and the blocks it can
        hand out at all, the null block excepted (once bound; equal when no
        request holds a block)."""
        with self._lock:
            out = {
                **self.producer.gauges(),
                **self.control.gauges(),
                **self.consumer.gauges(),
                **self.sources.gauges(),
            }
        pool = self._pool_levels()
        if pool is not None:
            out["free_blocks"], out["usable_blocks"] = (float(n) for n in pool)
            out["block_size"] = float(self.block_size)  # what a router sizes requests by
        return out

    def holds_blocks(self) -> bool:
        """Whether some request holds a block of vLLM's pool (True until the
        pool is bound)."""
        pool = self._pool_levels()
        return pool is None or pool[0] < pool[1]

    def _pool_levels(self) -> tuple[int, int] | None:
        """vLLM's free blocks and the blocks it can hand out at all (its pool
        less the null block); None until the pool is bound."""
        manager = self.shared.kv_cache_manager
        if manager is None:
            return None
        pool = manager.block_pool
        return pool.get_num_free_blocks(), pool.num_gpu_blocks - 1

    def stats(self) -> dict[str, float]:
        """What `StatsRequest` answers: `counter_totals()`, `gauges()` and each
        histogram's ``<name>_count`` and ``<name>_sum`` since the start (no
        name is in two of them)."""
        with self._lock:
            histograms = self.shared.observations.totals()
        return {**self.counter_totals(), **self.gauges(), **histograms}

    def _register(self, roles: tuple[str, ...]) -> Registrar:
        """Keep this instance's record in etcd while it runs (`membership`),
        from when its HTTP server answers `/health`."""
        assert self.config.advertise_url is not None  # ConnectorConfig checks it
        url = self.config.advertise_url.rstrip("/")
        record = InstanceRecord(
            url=url,
            control=self.shared.control_address,
            roles=roles,
            block_size=self.block_size,
            instance_id=self.instance_id,
            incarnation=self.incarnation,
            max_num_seqs=self.max_num_seqs,
        )

        def ready() -> bool:
            return httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200

        registrar = Registrar(
            self.config.etcd_endpoints,
            record_key(self.config.etcd_prefix, self.instance_id),
            encode_record(record),
            self.config.etcd_ttl_s,
            ready=ready,
        )
        registrar.start()
        log.info(
            "rapidkv %s: registers %s in etcd %s under %s once it answers /health",
            self.instance_id,
            url,
            ",".join(self.config.etcd_endpoints),
            self.config.etcd_prefix,
        )
        return registrar

    def close(self) -> None:
        """Leave the fleet (etcd), answer what is parked (GONE: the engine
        stopped), stop the control-plane server, then the client and the
        bypass channel."""
        if self._leaving is not None:
            self._leaving.join()
        elif self.registrar is not None:
            self.registrar.stop()
        self.shared.closing = True
        with self._lock:
            if not self._shut_down:
                self._shut_down = True
                self.producer.shut_down()
        self.server.stop()
        self.consumer.close()
        if self.shared.bypass is not None:
            self.shared.bypass.close()
        log.info("rapidkv %s: connector closed", self.instance_id)


def model_fingerprint(model_config: Any) -> str:
    """Hash of what shapes the KV and the tokens: layers, KV heads, head size,
    dtype, vocabulary size."""
    hf = model_config.hf_config
    parts = [
        getattr(hf, "num_hidden_layers", None),
        getattr(hf, "num_key_value_heads", None),
        model_config.get_head_size(),
        str(model_config.dtype),
        getattr(hf, "vocab_size", None),
    ]
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()
