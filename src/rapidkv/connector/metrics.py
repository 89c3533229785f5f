"""The connector's counters, gauges and histograms on each vLLM instance's own
`/metrics` (every series: docs/metrics.md).

How they get there (vLLM 0.32's KV-connector stats hooks, as NixlConnector uses
them; docs/vllm-connector-contract.md §7):

1. EngineCore, every `update_from_output`, after `update_connector_output`:
   the scheduler role's `get_kv_connector_stats()` returns a `RapidKVStats`
   (`StatsDelta.take` over `SchedulerSide.counter_totals()` / `gauges()` /
   `take_observations()`) when `stats_due`, or None.
2. `make_stats` ships `stats.to_dict()` (plain dicts of floats, serialized)
   to the API server in `SchedulerStats.kv_connector_stats`.
3. The API server's `PrometheusStatLogger` passes each such payload once to
   `RapidKVPromMetrics.observe(payload, engine_idx)`; its `LoggingStatLogger`
   rebuilds it with `build_kv_connector_stats`, `aggregate`s the payloads of a
   logging interval, logs `reduce()` and starts over.

Payload: ``{"counters": {name: increment}, "gauges": {name: level},
"histograms": {name: [value, ...]}}``.
Invariants:

- a counter's increment covers what it grew since the previous payload of this
  engine, so the increments summed over every payload are its total: nothing
  is counted twice, whoever aggregates or resets them (vLLM aggregates across
  an interval, then resets);
- a counter seen for the first time is in the payload, at 0 if it is 0;
- a gauge is in a payload when its level differs from the previous payload's;
  aggregating keeps the later level;
- a histogram's values are those observed since the previous payload
  (`observations.py`), each in one payload only; aggregating concatenates;
- a payload is taken at most every `STATS_INTERVAL_S` while a request holds
  blocks, and at once at a step that leaves none held (the instance is going
  idle), so an idle instance's `/metrics` equals its `StatsRequest`: taking
  and shipping one at every step (`free_blocks` moves as decodes grow) cost
  local decodes 12-30 % of their TPOT (measured against plain vLLM replicas;
  the engine core, vLLM's loggers and the API server share the instance's
  core);
- a payload with neither is empty.

Series (every name the payloads carry, with no list kept here: a counter
added later shows up as it is): a counter `x` is the Prometheus counter
`rapidkv_x` (exposed as `rapidkv_x_total`), a gauge `y` the gauge `rapidkv_y`,
a histogram `z_seconds` or `z_bytes` the histogram `rapidkv_z_seconds` (its
buckets by the unit: `buckets_for`; exposed as `_bucket`, `_sum`, `_count`);
labels `model_name` and `engine`, as vLLM's own series. A series appears at the
first engine step after its counter came to exist (the control server's and
`shared_state.COUNTED_FROM_START` from the start, at 0; the others, and a
histogram, at their first increment or value). Like every vLLM series
fed from engine stats, it moves only while the engine steps: an idle
instance's `/metrics` holds what its last step saw (`StatsRequest` answers the
live values).

Processes: the series live in the API server (vLLM's `PrometheusStatLogger`
builds `RapidKVPromMetrics` with its own metric classes); nothing is exported
from the engine core or the workers. With several API servers vLLM runs
prometheus_client's multiprocess mode: each payload reaches one of them, so
counters and histograms add up across them and gauges take the most recent
level (``multiprocess_mode="mostrecent"``, as vLLM's own gauges).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

log = logging.getLogger(__name__)

PREFIX = "rapidkv_"
STATS_INTERVAL_S = 1.0  # while busy, /metrics moves at most this often
COUNTERS = "counters"
GAUGES = "gauges"
HISTOGRAMS = "histograms"
# a transfer's duration (or D's wait for it): GPU memory over RDMA or NVLink
# takes well under a millisecond to a few; CPU memory over TCP tens of ms to seconds
SECONDS_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# a transfer's size: 64 KiB (a few blocks of a small model) to 16 GiB, by 4x
BYTES_BUCKETS = tuple(float(4**k * 65536) for k in range(10))

Payload = dict[str, dict[str, Any]]


def empty_payload() -> Payload:
    return {COUNTERS: {}, GAUGES: {}, HISTOGRAMS: {}}


def buckets_for(name: str) -> tuple[float, ...]:
    """A histogram's buckets by its unit suffix: `SECONDS_BUCKETS` for
    ``_seconds``, `BYTES_BUCKETS` for ``_bytes``, prometheus_client's
    defaults otherwise."""
    if name.endswith("_seconds"):
        return SECONDS_BUCKETS
    if name.endswith("_bytes"):
        return BYTES_BUCKETS
    return Histogram.DEFAULT_BUCKETS


class StatsDelta:
    """Turns running totals and current levels into payloads (pure).

    Invariant: after `take`, `_sent` holds every counter total and `_levels`
    every gauge level that the payloads taken so far account for.
    """

    def __init__(self) -> None:
        self._sent: dict[str, float] = {}
        self._levels: dict[str, float] = {}

    def take(
        self,
        totals: Mapping[str, float],
        levels: Mapping[str, float],
        observed: Mapping[str, list[float]] | None = None,
    ) -> Payload:
        """What changed since the previous call: each counter's growth (a
        counter seen for the first time is in it even at 0, so that its series
        exists before its first increment; a total that went down, which a
        counter never does, is resynced without an increment), each gauge
        whose level changed (all of them the first time), and `observed`, the
        histograms' new values (taken as they are: they are new each time)."""
        out = empty_payload()
        out[HISTOGRAMS] = {name: list(v) for name, v in (observed or {}).items() if v}
        for name, total in totals.items():
            sent = self._sent.get(name)
            grown = total - (sent or 0.0)
            if grown > 0 or (sent is None and grown == 0):
                out[COUNTERS][name] = grown
            if grown != 0 or sent is None:
                self._sent[name] = total
        for name, level in levels.items():
            if self._levels.get(name) != level:
                out[GAUGES][name] = level
                self._levels[name] = level
        return out


def stats_due(now: float, due_at: float, holds_blocks: bool) -> bool:
    """Whether this step takes a payload: at `due_at` or later (the last one
    + `STATS_INTERVAL_S`), or whenever no request holds a block (idle, or
    about to be)."""
    return now >= due_at or not holds_blocks


class StatsCadence:
    """`stats_due` over a clock (injected: monotonic seconds): `take` says
    whether this step ships a payload and, when it does, sets the next due
    time `interval_s` later. The first step is always due."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, interval_s: float = STATS_INTERVAL_S
    ) -> None:
        self._clock = clock
        self._interval_s = interval_s
        self._due_at = -float("inf")

    def take(self, holds_blocks: bool) -> bool:
        now = self._clock()
        if not stats_due(now, self._due_at, holds_blocks):
            return False
        self._due_at = now + self._interval_s
        return True


@dataclass
class RapidKVStats(KVConnectorStats):
    """One or more payloads (module docstring). `data` stays a plain dict of
    dicts of floats: vLLM serializes it from EngineCore to the API server."""

    def __post_init__(self) -> None:
        data = self.data or {}
        # copies: aggregating must never change a payload vLLM also hands others
        self.data = {
            COUNTERS: dict(data.get(COUNTERS, {})),
            GAUGES: dict(data.get(GAUGES, {})),
            HISTOGRAMS: {k: list(v) for k, v in data.get(HISTOGRAMS, {}).items()},
        }

    def reset(self) -> None:
        self.data = empty_payload()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Fold in `other`, the later stats: increments add up, its levels
        win, histogram values are appended."""
        counters = self.data[COUNTERS]
        for name, n in other.data.get(COUNTERS, {}).items():
            counters[name] = counters.get(name, 0.0) + n
        self.data[GAUGES].update(other.data.get(GAUGES, {}))
        histograms = self.data[HISTOGRAMS]
        for name, values in other.data.get(HISTOGRAMS, {}).items():
            histograms[name] = [*histograms.get(name, ()), *values]
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's "KV Transfer metrics" log line: the interval's increments,
        the latest levels, and each histogram's values' ``<name>_count`` and
        ``<name>_mean``."""
        flat = {**self.data[COUNTERS], **self.data[GAUGES]}
        for name, values in self.data[HISTOGRAMS].items():
            if values:
                flat[f"{name}_count"] = len(values)
                flat[f"{name}_mean"] = sum(values) / len(values)
        out: dict[str, int | float] = {}
        for name, v in sorted(flat.items()):
            out[name] = int(v) if float(v).is_integer() else round(v, 6)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[kind] for kind in (COUNTERS, GAUGES, HISTOGRAMS))


def series_name(name: str) -> str:
    """`rapidkv_<name>`, any character Prometheus does not allow made `_`."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", name)


# collectors this process registered in prometheus_client's default registry:
# a later RapidKVPromMetrics (vLLM builds a new logger per engine client)
# unregisters them first, as vLLM's PrometheusStatLogger does with its own
_registered: list[Any] = []


class RapidKVPromMetrics(KVConnectorPromMetrics):
    """Prometheus series for every name in the payloads, created when first
    seen (with vLLM's metric classes and labels). `observe` never raises: a
    name that cannot become a series (it clashes with another) is logged once
    and skipped; vLLM's output handler, which calls it, must not fail."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        while _registered:
            collector = _registered.pop()
            if collector in REGISTRY._collector_to_names:
                REGISTRY.unregister(collector)
        self._series: dict[tuple[str, str], Any] = {}  # (kind, name) -> metric
        self._children: dict[tuple[str, str, int], Any] = {}  # + engine -> labelled child
        self._skipped: set[tuple[str, str]] = set()

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for kind in (COUNTERS, GAUGES, HISTOGRAMS):
            for name, value in (transfer_stats_data.get(kind) or {}).items():
                child = self._child(kind, name, engine_idx)
                if child is None:
                    continue
                if kind == COUNTERS:
                    child.inc(value)
                elif kind == GAUGES:
                    child.set(value)
                else:
                    for v in value:
                        child.observe(v)

    def _child(self, kind: str, name: str, engine_idx: int) -> Any:
        key = (kind, name, engine_idx)
        child = self._children.get(key)
        if child is not None or (kind, name) in self._skipped:
            return child
        try:
            metric = self._series.get((kind, name))
            if metric is None:
                metric = self._series[(kind, name)] = self._create(kind, name)
            child = self._children[key] = metric.labels(*self.per_engine_labelvalues[engine_idx])
        except Exception as e:
            self._skipped.add((kind, name))
            log.warning("rapidkv: %s %r not exported to /metrics: %s", kind[:-1], name, e)
            return None
        return child

    def _create(self, kind: str, name: str) -> Any:
        doc = f"rapidkv connector {kind[:-1]} {name} (docs/metrics.md)"
        if kind == COUNTERS:
            metric = self._counter_cls(
                name=series_name(name), documentation=doc, labelnames=self._labelnames
            )
        elif kind == HISTOGRAMS:
            metric = self._histogram_cls(
                name=series_name(name),
                documentation=doc,
                labelnames=self._labelnames,
                buckets=buckets_for(name),
            )
        else:
            metric = self._gauge_cls(
                name=series_name(name),
                documentation=doc,
                labelnames=self._labelnames,
                multiprocess_mode="mostrecent",
            )
        if isinstance(metric, Counter | Gauge | Histogram):
            _registered.append(metric)
        return metric
