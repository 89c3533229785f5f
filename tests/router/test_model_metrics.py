"""The adaptive router's learned costs on /metrics (`ModelsCollector`): in
seconds, per upstream instance (label `upstream`)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rapidkv.router.model_metrics import ModelsCollector
from rapidkv.router.placement import FleetState, Models

pytestmark = pytest.mark.unit

URLS = ["http://a:1", "http://b:2"]


def scrape(models: Models, urls: list[str]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(ModelsCollector(models, lambda: urls))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_instance_exports_its_lines_and_only_observed_pairs_a_transfer() -> None:
    models = Models(2)
    models.observe_step(1, 4, 9.0)
    models.observe_transfer(0, 1, 500, 30.0)
    got = scrape(models, URLS)
    for i, url in enumerate(URLS):
        for name, cost in (("prefill", models.prefill[i]), ("step", models.step[i])):
            key = f"rapidkv_router_model_{name}_seconds"
            assert got[(key, (("term", "intercept"), ("upstream", url)))] == cost.intercept / 1000
            assert got[(key, (("term", "slope"), ("upstream", url)))] == cost.slope / 1000
    # what instance 1 taught its step model shows, instance 0 still has the prior's
    assert (
        got[("rapidkv_router_model_step_seconds", (("term", "slope"), ("upstream", URLS[1])))]
        != (got[("rapidkv_router_model_step_seconds", (("term", "slope"), ("upstream", URLS[0])))])
    )
    transfers = {k: v for k, v in got.items() if k[0] == "rapidkv_router_model_transfer_seconds"}
    pair = (("decode", URLS[1]), ("prefill", URLS[0]))
    assert transfers == {
        ("rapidkv_router_model_transfer_seconds", (*pair, ("term", "intercept"))): models.transfer[
            (0, 1)
        ].intercept
        / 1000,
        ("rapidkv_router_model_transfer_seconds", (*pair, ("term", "slope"))): models.transfer[
            (0, 1)
        ].slope
        / 1000,
    }


def test_a_scrape_reads_the_models_as_they_are_now() -> None:
    models = Models(1)
    before = scrape(models, URLS[:1])
    models.observe_prefill(0, 800, 400.0)
    after = scrape(models, URLS[:1])
    key = ("rapidkv_router_model_prefill_seconds", (("term", "slope"), ("upstream", URLS[0])))
    assert after[key] > before[key]


def test_an_instance_the_models_do_not_have_yet_is_left_out() -> None:
    got = scrape(Models(1), URLS)  # a member appended before the models grew
    assert {dict(k[1])["upstream"] for k in got} == {URLS[0]}


def test_the_capacity_the_router_learned_is_exported_per_instance() -> None:
    fleet = FleetState(2)
    fleet.set_max_num_seqs(1, 8)
    registry = CollectorRegistry()
    registry.register(ModelsCollector(Models(2), lambda: URLS, fleet))
    seqs = "rapidkv_router_instance_max_num_seqs"
    assert registry.get_sample_value(seqs, {"upstream": URLS[1]}) == 8.0
    assert registry.get_sample_value(seqs, {"upstream": URLS[0]}) is None  # not known


def test_the_roles_and_the_fleets_shape_are_exported() -> None:
    from rapidkv.router.placement import Specializer

    models, fleet, shape = Models(2), FleetState(2), Specializer()
    registry = CollectorRegistry()
    registry.register(ModelsCollector(models, lambda: URLS, fleet, shape))

    def got() -> dict:
        text = generate_latest(registry).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    before = got()
    assert before[("rapidkv_router_fleet_specialized", ())] == 0
    assert before[("rapidkv_router_fleet_shape_switches_total", ())] == 0
    for reason in ("decodes", "hits", "ttft"):
        assert before[("rapidkv_router_fleet_held", (("reason", reason),))] == 0
    assert before[("rapidkv_router_instance_role", (("role", "any"), ("upstream", URLS[1])))] == 1
    for k in range(160):  # 8 req/s of 500-token prompts, 16-token answers
        shape.arrived(k / 8, 500, 16)
    assert shape.apply(fleet, ["any", "any"], models, 9.0)
    after = got()
    assert after[("rapidkv_router_fleet_specialized", ())] == 1
    assert after[("rapidkv_router_fleet_pressure", ())] == shape.last_pressure >= 1.0
    assert after[("rapidkv_router_fleet_shape_switches_total", ())] == 1
    roles = {k[1]: v for k, v in after.items() if k[0] == "rapidkv_router_instance_role"}
    assert roles == {
        (("role", "prefill"), ("upstream", URLS[0])): 1,
        (("role", "decode"), ("upstream", URLS[1])): 1,
    }
    for k in range(400):  # then 20 req/s of 64-token answers: one decoder could not hold them
        shape.arrived(20 + k / 20, 500, 64)
    assert not shape.apply(fleet, ["any", "any"], models, 9.0)
    held = {k[1]: v for k, v in got().items() if k[0] == "rapidkv_router_fleet_held"}
    assert held == {(("reason", "decodes"),): 1, (("reason", "hits"),): 0, (("reason", "ttft"),): 0}
