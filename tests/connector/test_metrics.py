"""The `/metrics` export's pure parts: per-step payloads from running totals
and observed values, vLLM's aggregate/reset of them, the Prometheus series
they feed, and what the scheduler side hands them (its control-plane server's
refusals included)."""

from __future__ import annotations

import functools
import socket
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.connector import RapidKVConnector
from rapidkv.connector.metrics import (
    BYTES_BUCKETS,
    SECONDS_BUCKETS,
    STATS_INTERVAL_S,
    RapidKVPromMetrics,
    StatsCadence,
    StatsDelta,
    buckets_for,
    series_name,
    stats_due,
)
from rapidkv.connector.observations import Observations
from rapidkv.connector.scheduler_side import SchedulerSide
from rapidkv.connector.shared_state import COUNTED_FROM_START

pytestmark = pytest.mark.unit

LABELS = ["model_name", "engine"]
PER_ENGINE = {0: ["m", "0"], 1: ["m", "1"]}


def prom(registry: CollectorRegistry) -> RapidKVPromMetrics:
    """Our prom metrics on a private registry, built as vLLM builds them."""
    types = {
        Counter: functools.partial(Counter, registry=registry),
        Gauge: functools.partial(Gauge, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = RapidKVConnector.build_prom_metrics(config, types, LABELS, PER_ENGINE)
    assert isinstance(metrics, RapidKVPromMetrics)
    return metrics


def value(registry: CollectorRegistry, sample: str, engine: str = "0") -> float | None:
    return registry.get_sample_value(sample, {"model_name": "m", "engine": engine})


def test_increments_cover_each_growth_once_and_gauges_go_when_they_change() -> None:
    d = StatsDelta()
    assert d.take({"a": 2.0, "z": 0.0}, {"g": 1.0}) == {
        "counters": {"a": 2.0, "z": 0.0},  # z: its series exists before it counts
        "gauges": {"g": 1.0},
        "histograms": {},
    }
    nothing = {"counters": {}, "gauges": {}, "histograms": {}}
    assert d.take({"a": 2.0, "z": 0.0}, {"g": 1.0}) == nothing
    assert d.take({"a": 5.0, "b": 1.0}, {"g": 0.0}, {"t_seconds": [0.5], "u": []}) == {
        "counters": {"a": 3.0, "b": 1.0},
        "gauges": {"g": 0.0},
        "histograms": {"t_seconds": [0.5]},  # a name without values is left out
    }
    # a total that went down (never, for a counter) is resynced, not exported negative
    assert d.take({"a": 1.0, "b": 1.0}, {"g": 0.0}) == nothing
    assert d.take({"a": 4.0, "b": 1.0}, {"g": 0.0})["counters"] == {"a": 3.0}


def test_a_payload_is_due_at_its_time_or_at_once_when_no_request_holds_a_block() -> None:
    assert not stats_due(now=5.0, due_at=5.0 + STATS_INTERVAL_S / 2, holds_blocks=True)
    assert stats_due(now=5.0, due_at=5.0, holds_blocks=True)
    assert stats_due(now=5.0, due_at=5.0 + STATS_INTERVAL_S, holds_blocks=False)  # going idle


def test_a_busy_connector_ships_one_payload_an_interval_and_the_idle_one_at_once() -> None:
    """`get_kv_connector_stats` over busy steps (a request holds blocks, the
    levels move at each): one payload per `STATS_INTERVAL_S`, holding every
    counter's growth since the previous one, and at once at the step that
    leaves no block held."""
    levels = {"free_blocks": 10.0}
    totals = {"transfers_ok": 0.0}
    observations = Observations()
    sched = SimpleNamespace(
        gauges=lambda: dict(levels),
        counter_totals=lambda: dict(totals),
        take_observations=observations.take,
        holds_blocks=lambda: levels["free_blocks"] < 63.0,
    )
    clock = [100.0]
    c = object.__new__(RapidKVConnector)
    c.sched, c._stats_delta = sched, StatsDelta()
    c._stats_cadence = StatsCadence(clock=lambda: clock[0])
    shipped = {}
    for step in range(150):  # 1.5 s of 10 ms steps
        clock[0] += 0.01
        levels["free_blocks"] = 10.0 + step % 7
        totals["transfers_ok"] += 1 if step in (17, 30) else 0
        if step in (17, 30):
            observations.observe("transfer_seconds", step / 1000)
        stats = c.get_kv_connector_stats()
        if stats is not None:
            shipped[step] = stats.data
    assert list(shipped) == [0, 100]  # the first step, then one interval later
    assert shipped[100]["counters"] == {"transfers_ok": 2.0}  # both, once
    assert shipped[100]["histograms"] == {"transfer_seconds": [0.017, 0.030]}
    clock[0] += 0.01
    levels["free_blocks"] = 63.0  # the last request let go of its blocks
    idle = c.get_kv_connector_stats()
    assert idle is not None and idle.data["gauges"] == {"free_blocks": 63.0}


totals_seq = st.lists(
    st.dictionaries(st.sampled_from("abc"), st.integers(0, 50), max_size=3), max_size=12
)


@given(totals_seq, st.integers(1, 5))
def test_summed_increments_equal_the_totals_however_vllm_groups_them(
    increments: list[dict[str, int]], interval: int
) -> None:
    """Running totals grow step by step; the steps' payloads, aggregated per
    logging interval (then reset) by vLLM's own KVConnectorLogging, and fed one
    by one to the prom metrics as PrometheusStatLogger does, each add up to the
    totals: nothing counted twice, nothing lost."""
    registry = CollectorRegistry()
    metrics = prom(registry)
    logging_ = KVConnectorLogging(
        KVTransferConfig(
            kv_connector="RapidKVConnector",
            kv_connector_module_path="rapidkv.connector",
            kv_role="kv_both",
        )
    )
    d, totals = StatsDelta(), dict.fromkeys("abc", 0.0)
    logged: dict[str, float] = {}

    def flush() -> None:
        acc = logging_.transfer_stats_accumulator
        if acc is not None:
            for k, v in acc.data["counters"].items():
                logged[k] = logged.get(k, 0) + v
        logging_.log(lambda *a: None)  # logs reduce() and resets
        assert logging_.transfer_stats_accumulator is None

    for i, inc in enumerate(increments):
        for k, n in inc.items():
            totals[k] += n
        payload = d.take(totals, {"level": float(i)})
        metrics.observe(payload, 0)
        logging_.observe(payload)
        if i % interval == interval - 1:
            assert logging_.transfer_stats_accumulator.reduce()["level"] == i  # latest
            flush()
    flush()
    for k, total in totals.items():
        assert logged.get(k, 0) == total
        assert (value(registry, f"rapidkv_{k}_total") or 0) == total
    if increments:
        assert value(registry, "rapidkv_level") == len(increments) - 1


def test_aggregating_never_changes_the_payloads_it_was_built_from() -> None:
    """vLLM hands the same payload dict to its logging and prom loggers."""
    first = {"counters": {"a": 1.0}, "gauges": {"g": 1.0}, "histograms": {"t_seconds": [1.0]}}
    second = {"counters": {"a": 2.0, "b": 1.0}, "gauges": {"g": 0.0}, "histograms": {}}
    third = {"counters": {}, "gauges": {}, "histograms": {"t_seconds": [2.0, 6.0]}}
    acc = RapidKVConnector.build_kv_connector_stats(first)
    for later in (second, third):
        acc.aggregate(RapidKVConnector.build_kv_connector_stats(later))
    assert acc.data == {
        "counters": {"a": 3.0, "b": 1.0},
        "gauges": {"g": 0.0},
        "histograms": {"t_seconds": [1.0, 2.0, 6.0]},
    }
    assert first == {
        "counters": {"a": 1.0},
        "gauges": {"g": 1.0},
        "histograms": {"t_seconds": [1.0]},
    }
    assert acc.reduce() == {"a": 3, "b": 1, "g": 0, "t_seconds_count": 3, "t_seconds_mean": 3}
    assert RapidKVConnector.build_kv_connector_stats(None).is_empty()
    assert not RapidKVConnector.build_kv_connector_stats(third).is_empty()
    assert RapidKVConnector.build_kv_connector_stats({}).to_dict() == {
        "counters": {},
        "gauges": {},
        "histograms": {},
    }


def test_series_per_engine_and_a_clashing_name_is_skipped_not_raised() -> None:
    registry = CollectorRegistry()
    metrics = prom(registry)
    metrics.observe({"counters": {"transfers_ok": 2.0}, "gauges": {"parked_now": 3.0}}, 0)
    metrics.observe({"counters": {"transfers_ok": 1.0}, "gauges": {}}, 1)
    metrics.observe({"counters": {"transfers_ok": 1.0}, "gauges": {"parked_now": 0.0}}, 0)
    assert value(registry, "rapidkv_transfers_ok_total") == 3.0
    assert value(registry, "rapidkv_transfers_ok_total", engine="1") == 1.0
    assert value(registry, "rapidkv_parked_now") == 0.0
    # a gauge whose series name a counter already holds: logged, skipped, never raised
    metrics.observe({"counters": {}, "gauges": {"transfers_ok_total": 1.0, "x y": 2.0}}, 0)
    assert value(registry, "rapidkv_transfers_ok_total") == 3.0
    assert value(registry, "rapidkv_x_y") == 2.0
    assert series_name("aborts_client-abort") == "rapidkv_aborts_client_abort"


def test_a_new_prom_metrics_replaces_the_previous_ones_series_in_the_default_registry() -> None:
    """vLLM builds a new PrometheusStatLogger (hence our prom metrics) per engine
    client; the second must not die of duplicated series."""
    from prometheus_client import REGISTRY

    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    config = SimpleNamespace(kv_transfer_config=None)
    for n in (1.0, 2.0):
        m = RapidKVPromMetrics(config, types, LABELS, PER_ENGINE)
        m.observe(
            {
                "counters": {"unit_test_counter": n},
                "gauges": {"unit_test_gauge": n},
                "histograms": {"unit_test_seconds": [n]},
            },
            0,
        )
        labels = {"model_name": "m", "engine": "0"}
        assert REGISTRY.get_sample_value("rapidkv_unit_test_counter_total", labels) == n
        assert REGISTRY.get_sample_value("rapidkv_unit_test_gauge", labels) == n
        assert REGISTRY.get_sample_value("rapidkv_unit_test_seconds_sum", labels) == n
    RapidKVPromMetrics(config, types, LABELS, PER_ENGINE)  # unregisters them
    assert REGISTRY.get_sample_value("rapidkv_unit_test_gauge", labels) is None
    assert REGISTRY.get_sample_value("rapidkv_unit_test_seconds_sum", labels) is None


def test_scheduler_side_exports_its_counters_gauges_and_the_servers_refusals() -> None:
    sched = SchedulerSide(ConnectorConfig(), "inst", 16, 1, "fp")
    try:
        sched.counters["transfers_ok"] += 2
        host, port = sched.server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            # not a rapidkv-rpc client: "GET " reads as a frame length of ~1.2 GB
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            s.settimeout(5)
            while s.recv(4096):
                pass  # until the server closes it
        totals, gauges = sched.counter_totals(), sched.gauges()
        assert totals["transfers_ok"] == 2
        assert totals["rpc_frame_errors"] == totals["rpc_oversized_frames"] == 1
        for name in ("rpc_connections_refused", "rpc_hello_timeouts", "rpc_auth_failures"):
            assert totals[name] == 0
        # what the dashboard and the alerts read is there before its first increment
        assert {name: totals[name] for name in COUNTED_FROM_START} == {
            **dict.fromkeys(COUNTED_FROM_START, 0.0),
            "transfers_ok": 2.0,
        }
        assert "transfer_kv_retries_busy" not in totals  # the others at their first
        assert gauges == {
            "parked_now": 0.0,
            "transfers_live": 0.0,
            "tombstones": 0.0,
            "waiting_for_kv": 0.0,
            "held_requests": 0.0,
            "held_blocks": 0.0,
            "migrations_live": 0.0,
            "migration_sources": 0.0,
            "peers_decode": 0.0,
            "peers_prefill_ready": 0.0,
            "peers_prefill_connecting": 0.0,
            "peers_prefill_failed": 0.0,
        }
        assert sched.stats() == {**totals, **gauges}  # no histogram value yet
        assert not set(totals) & set(gauges)
        sched.shared.observations.observe("transfer_seconds", 0.25)
        assert sched.stats() == {
            **totals,
            **gauges,
            "transfer_seconds_count": 1.0,
            "transfer_seconds_sum": 0.25,
        }
        assert sched.take_observations() == {"transfer_seconds": [0.25]}
        assert sched.take_observations() == {}
    finally:
        sched.close()


def test_histograms_go_to_prometheus_with_buckets_by_their_unit() -> None:
    """Values in the payloads are observed into a histogram per name and
    engine: seconds and bytes get their own buckets, and a histogram's
    count, sum and buckets are what the payloads carried."""
    registry = CollectorRegistry()
    metrics = prom(registry)
    metrics.observe({"histograms": {"transfer_seconds": [0.0007, 0.2]}}, 0)
    metrics.observe({"histograms": {"transfer_seconds": [40.0], "transfer_bytes": [3e6]}}, 0)
    metrics.observe({"histograms": {"transfer_seconds": [0.003]}}, 1)
    assert value(registry, "rapidkv_transfer_seconds_count") == 3
    assert value(registry, "rapidkv_transfer_seconds_sum") == pytest.approx(40.2007)
    assert value(registry, "rapidkv_transfer_seconds_count", engine="1") == 1
    labels = {"model_name": "m", "engine": "0"}
    bucket = "rapidkv_transfer_seconds_bucket"
    assert registry.get_sample_value(bucket, {**labels, "le": "0.001"}) == 1
    assert registry.get_sample_value(bucket, {**labels, "le": "30.0"}) == 2
    assert registry.get_sample_value(bucket, {**labels, "le": "+Inf"}) == 3
    assert (
        registry.get_sample_value("rapidkv_transfer_bytes_bucket", {**labels, "le": "1.048576e+06"})
        == 0
    )
    assert (
        registry.get_sample_value("rapidkv_transfer_bytes_bucket", {**labels, "le": "4.194304e+06"})
        == 1
    )
    assert buckets_for("kv_wait_seconds") == SECONDS_BUCKETS
    assert buckets_for("transfer_bytes") == BYTES_BUCKETS
    assert buckets_for("other") == Histogram.DEFAULT_BUCKETS
    # a histogram whose name a counter already holds: skipped, never raised
    metrics.observe({"counters": {"clash_seconds": 1.0}}, 0)
    metrics.observe({"histograms": {"clash_seconds_total": [1.0]}}, 0)
    assert value(registry, "rapidkv_clash_seconds_total") == 1.0


def test_observations_are_taken_once_counted_always_and_capped_between_payloads() -> None:
    o = Observations(max_pending=2)
    for v in (1.0, 2.0, 4.0):
        o.observe("x_seconds", v)
    assert o.take() == {"x_seconds": [1.0, 2.0]}  # the third did not fit
    assert o.dropped == 1
    assert o.take() == {}
    o.observe("x_seconds", 8.0)
    assert o.take() == {"x_seconds": [8.0]}
    assert o.totals() == {"x_seconds_count": 4.0, "x_seconds_sum": 15.0}
