"""A real Prometheus over the shared P/D pair and a router in front of it:
the shipped rules (deploy/prometheus/rapidkv-rules.yml) pass `promtool check
rules` and evaluate without error, Prometheus scrapes P, D and the router
through a load, the router's upstreams arrive under their own label (the
scrape target keeps `instance`), and every query of every panel of the
shipped dashboard (deploy/grafana/rapidkv-pd.json) returns data. Skips,
saying why, where Prometheus is not installed (scripts/setup installs it)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from pd_harness import MAX_TOKENS, Pair, assert_back_to_baseline

from rapidkv.harness import random_prompts
from rapidkv.harness.client import stream_many
from rapidkv.harness.prometheus import PrometheusServer, PrometheusUnavailable, check_rules
from rapidkv.harness.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "rapidkv-pd.json"
RULES = ROOT / "deploy" / "prometheus" / "rapidkv-rules.yml"
# Grafana's variables in the dashboard's queries, as Grafana would fill them
# in for a range that covers this test (every sample Prometheus has)
GRAFANA_VARIABLES = {"$__rate_interval": "1m"}
WAVES, PER_WAVE = 3, 2  # the load: waves of streamed requests, a scrape apart
SCRAPE_S = 1.0


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, query with Grafana's variables filled in) of every
    target of every panel."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], target["refId"], expr))
    return out


def has_data(result: list[dict[str, Any]]) -> bool:
    """Some series with a number (a quantile of nothing observed is NaN)."""
    return any(math.isfinite(float(r["value"][1])) for r in result)


def test_prometheus_scrapes_the_fleet_and_every_dashboard_query_returns_data(
    pd_pair: Pair, tmp_path: Path
) -> None:
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    try:
        assert "SUCCESS" in check_rules(RULES)
    except PrometheusUnavailable as e:
        pytest.skip(f"prometheus cannot run here: {e}")
    t0 = time.monotonic()
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        split_prefill=False,  # every request waits for its KV on D: kv_wait_seconds
        port=0,
    )
    prompts = random_prompts(pd_pair.model, [300] * (1 + WAVES * PER_WAVE), seed=4040)
    with start_router(config) as router:
        # one request first: the connector's histograms exist from the first scrape
        stream_many(router.url, prompts[:1], MAX_TOKENS)
        hostport = {w: url.split("//", 1)[1] for w, url in (
            ("prefill", pd_pair.p.base_url), ("decode", pd_pair.d.base_url), ("router", router.url)
        )}  # fmt: skip
        prom = PrometheusServer(
            {job: [addr] for job, addr in hostport.items()},
            rule_files=[RULES],
            scrape_interval_s=SCRAPE_S,
            log_dir=tmp_path,
        )
        try:
            prom.start()
        except PrometheusUnavailable as e:
            pytest.skip(f"prometheus cannot run here: {e}")
        try:
            want_up = {f"{job}/{addr}": "up" for job, addr in hostport.items()}
            wait_until(lambda: prom.targets_up() == want_up, 15, what="every target scraped")
            for k in range(WAVES):
                wave = prompts[1 + k * PER_WAVE : 1 + (k + 1) * PER_WAVE]
                outs = stream_many(router.url, wave, MAX_TOKENS, concurrency=PER_WAVE)
                assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
                time.sleep(SCRAPE_S * 1.5)
            served = 1 + WAVES * PER_WAVE
            ok = 'sum(rapidkv_router_placed_requests_total{placement="pd",outcome="ok"})'

            def value(expr: str) -> float:
                return float(prom.query(expr)[0]["value"][1])

            def caught_up() -> bool:
                return (
                    value(ok) == served
                    # P's transfers as its control plane counts them (the last
                    # may settle on P after D's answer)
                    and value("sum(rapidkv_transfers_ok_total)")
                    == pd_pair.stats("p")["transfers_ok"]
                    # both instances idle, as their last engine step left them
                    and len(prom.query("rapidkv_usable_blocks - rapidkv_free_blocks == 0")) == 2
                    and len(
                        prom.query("vllm:num_requests_running + vllm:num_requests_waiting == 0")
                    )
                    == 2
                )

            wait_until(caught_up, 15, what="Prometheus to scrape the load's end")

            # the router's upstreams under `upstream`; `instance` is the router's own
            up = prom.query("rapidkv_router_instance_up")
            assert {(r["metric"]["upstream"], r["metric"]["instance"]) for r in up} == {
                (pd_pair.p.base_url, hostport["router"]),
                (pd_pair.d.base_url, hostport["router"]),
            }
            assert prom.query('{exported_instance!=""}') == []

            queries = panel_queries()
            assert len(queries) >= 30
            empty = [
                f"{title} [{ref}]: {expr}"
                for title, ref, expr in queries
                if not has_data(prom.query(expr))
            ]
            assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

            # every rule evaluated (never: year 1) without error; every recorded series has data
            def evaluated() -> list[dict[str, Any]]:
                rules = prom.rules()
                done = all(not r["lastEvaluation"].startswith("0001") for r in rules)
                return rules if done else []

            rules = wait_until(evaluated, 10, what="every rule evaluated")
            assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
            recorded = [r["name"] for r in rules if r["type"] == "recording"]
            assert len(recorded) >= 8
            wait_until(
                lambda: all(has_data(prom.query(name)) for name in recorded),
                10,
                what="every recording rule's series",
            )
        finally:
            prom.stop()
    assert_back_to_baseline(pd_pair)
    print(f"prometheus part: {time.monotonic() - t0:.1f} s")
