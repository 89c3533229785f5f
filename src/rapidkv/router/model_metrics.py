"""The adaptive router's learned costs as Prometheus gauges, read at each scrape.

Every cost of `placement.Models` is a line ``ms = intercept + slope * x``; each
is exported in seconds, as two samples, ``term="intercept"`` (s) and
``term="slope"`` (s per unit of its x):

- ``rapidkv_router_model_prefill_seconds{upstream}``: x = prompt tokens computed;
- ``rapidkv_router_model_step_seconds{upstream}``: x = requests decoding;
- ``rapidkv_router_model_transfer_seconds{prefill, decode}``: x = prompt tokens,
  for each ordered pair the router has observed (a pair never observed uses
  the prior, which is not exported).

and, from the fleet's state, ``rapidkv_router_instance_max_num_seqs{upstream}``
for each instance whose engine's ``max_num_seqs`` the router has learned
(discovery or etcd): the capacity the policy waits beyond, and
``rapidkv_router_instance_role{upstream, role}`` (1 for the role each
instance plays now: ``any``, ``prefill`` or ``decode``). With a
`placement.Specializer`: ``rapidkv_router_fleet_specialized`` (1 while the
instances configured ``both`` are pinned half to prefill, half to decode),
``rapidkv_router_fleet_pressure`` (the pressure that decided it, at the last
request), ``rapidkv_router_fleet_held{reason}`` (1 for what kept the fleet
unpinned at the last request though the pressure called for pinning, 0 for
the other reasons of `shape.HELD_BY`) and
``rapidkv_router_fleet_shape_switches_total``.

``upstream``, ``prefill`` and ``decode`` are instance URLs (``upstream``, not
``instance``, which Prometheus keeps for the scrape target). The collector holds
no state of its own: a scrape reads the models as they are at that moment
(the router's one event loop is the only writer; a scrape from the same loop
sees a consistent model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rapidkv.router.placement import FleetState, Models, Specializer
from rapidkv.router.placement.model import LinearCost
from rapidkv.router.placement.shape import HELD_BY


class ModelsCollector(Collector):
    """Exports `models` (and `fleet`'s capacities); `urls()` gives the URL of
    each instance index."""

    def __init__(
        self,
        models: Models,
        urls: Callable[[], Sequence[str]],
        fleet: FleetState | None = None,
        shape: Specializer | None = None,
    ) -> None:
        self.models = models
        self.urls = urls
        self.fleet = fleet
        self.shape = shape

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        urls = list(self.urls())
        n = min(len(urls), self.models.n)
        prefill = GaugeMetricFamily(
            "rapidkv_router_model_prefill_seconds",
            "Learned prefill cost beyond a decode step: intercept (s), slope (s per token)",
            labels=["upstream", "term"],
        )
        step = GaugeMetricFamily(
            "rapidkv_router_model_step_seconds",
            "Learned decode step: intercept (s), slope (s per decoding request)",
            labels=["upstream", "term"],
        )
        transfer = GaugeMetricFamily(
            "rapidkv_router_model_transfer_seconds",
            "Learned KV transfer after P's answer, per observed pair: intercept (s), slope "
            "(s per token)",
            labels=["prefill", "decode", "term"],
        )
        for i in range(n):
            _add(prefill, [urls[i]], self.models.prefill[i])
            _add(step, [urls[i]], self.models.step[i])
        for (i, j), cost in sorted(self.models.transfer.items()):
            if i < n and j < n:
                _add(transfer, [urls[i], urls[j]], cost)
        yield from (prefill, step, transfer)
        if self.fleet is not None:
            seqs = GaugeMetricFamily(
                "rapidkv_router_instance_max_num_seqs",
                "The instance engine's max_num_seqs, as the router learned it",
                labels=["upstream"],
            )
            roles = GaugeMetricFamily(
                "rapidkv_router_instance_role",
                "1 for the role the instance plays now (any, prefill, decode)",
                labels=["upstream", "role"],
            )
            for i, load in enumerate(self.fleet.view()[:n]):
                if load.max_num_seqs is not None:
                    seqs.add_metric([urls[i]], load.max_num_seqs)
                roles.add_metric([urls[i], load.role], 1)
            yield seqs
            yield roles
        if self.shape is not None:
            yield GaugeMetricFamily(
                "rapidkv_router_fleet_specialized",
                "1 while the instances configured both are pinned, half to prefill, half to decode",
                value=int(self.shape.specialized),
            )
            yield GaugeMetricFamily(
                "rapidkv_router_fleet_pressure",
                "Prompts landing beside a decode at the tail, in TPOT slack (>= 1: specialise)",
                value=self.shape.last_pressure,
            )
            held = GaugeMetricFamily(
                "rapidkv_router_fleet_held",
                "1 for what kept the fleet unpinned at the last request though its pressure "
                "called for pinning (decodes, hits, ttft)",
                labels=["reason"],
            )
            for reason in HELD_BY:
                held.add_metric([reason], int(self.shape.held_by == reason))
            yield held
            yield CounterMetricFamily(
                "rapidkv_router_fleet_shape_switches",
                "Times the fleet specialised or went back",
                value=self.shape.switches,
            )

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # unchecked: the series depend on the fleet


def _add(family: GaugeMetricFamily, labels: list[str], cost: LinearCost) -> None:
    """`cost` (ms) as its two terms, in seconds."""
    family.add_metric([*labels, "intercept"], cost.intercept / 1000)
    family.add_metric([*labels, "slope"], cost.slope / 1000)
