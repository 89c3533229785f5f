"""The shipped Grafana dashboard (deploy/grafana/rapidkv-pd.json) and
Prometheus rules (deploy/prometheus/rapidkv-rules.yml), read as files: the
dashboard is well formed (ids, queries, a layout without overlaps, the data
source a variable), every alert says how bad and what, and every series they
name exists: a rapidkv series of docs/metrics.md, one vLLM 0.32 exports, a
recorded one of the rules, or Prometheus' `up`. That each query returns data
from a real fleet is tests/e2e/test_prometheus.py."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "rapidkv-pd.json").read_text())
RULES = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rapidkv-rules.yml").read_text())
# the series as they are (not the renamed ones' old names)
METRICS_DOC = (ROOT / "docs" / "metrics.md").read_text().split("## Renamed series")[0]
SERIES = re.compile(r"\b(?:rapidkv_[a-z0-9_]+|vllm:[a-z0-9_]+|rapidkv:[a-z0-9_:]+|up)\b")


def panels() -> list[dict]:
    return [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def rules() -> list[dict]:
    return [r for g in RULES["groups"] for r in g["rules"]]


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]] + [r["expr"] for r in rules()]


def vllm_series() -> set[str]:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    loggers = Path(spec.origin).parent / "v1" / "metrics" / "loggers.py"
    return set(re.findall(r'name="(vllm:[a-z0-9_]+)"', loggers.read_text()))


def test_the_dashboard_is_well_formed() -> None:
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in DASHBOARD["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
    assert len(panels()) >= 15
    for p in panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() for t in p["targets"]), p["title"]
    [variable] = DASHBOARD["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == (
        "datasource",
        "datasource",
        "prometheus",
    )


def test_the_dashboard_covers_what_an_operator_of_a_pd_fleet_watches() -> None:
    text = " ".join(exprs()[: sum(len(p["targets"]) for p in panels())])
    for series in (
        "rapidkv_router_placed_requests_total",  # request rate and errors by placement
        "rapidkv_router_ttft_seconds_bucket",  # TTFT
        "vllm:inter_token_latency_seconds_bucket",  # TPOT
        "rapidkv_transfer_seconds_bucket",
        "rapidkv_transfer_bytes_bucket",
        "rapidkv_kv_wait_seconds_bucket",
        "rapidkv_recompute_fallbacks_total",
        "rapidkv_held_blocks",
        "rapidkv_free_blocks",  # leaked: neither free nor held while idle
        "rapidkv_router_instance_up",
    ):
        assert series in text, series


def test_every_alert_has_a_severity_a_summary_and_a_duration() -> None:
    alerts = [r for r in rules() if "alert" in r]
    assert len(alerts) >= 5
    for a in alerts:
        assert a["labels"]["severity"] in ("critical", "warning", "info"), a["alert"]
        assert a["annotations"]["summary"], a["alert"]
        assert re.fullmatch(r"\d+[sm]", a["for"]), a["alert"]


def unknown_series(expressions: list[str]) -> set[str]:
    """The series `expressions` name that neither docs/metrics.md, vLLM 0.32,
    the rules' recordings nor Prometheus (`up`) provide."""
    recorded = {r["record"] for r in rules() if "record" in r}
    vllm = vllm_series()
    unknown = set()
    for expr in expressions:
        for name in SERIES.findall(expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if name.startswith("rapidkv_"):
                known = f"`{name}`" in METRICS_DOC or f"`{base}`" in METRICS_DOC
            elif name.startswith("vllm:"):
                known = base in vllm
            else:
                known = name in recorded or name == "up"
            if not known:
                unknown.add(name)
    return unknown


def test_every_series_named_exists() -> None:
    assert unknown_series(exprs()) == set()
    # what it catches: a series renamed away, a vLLM name of another version
    assert unknown_series(
        ["rate(rapidkv_transfer_ms_sum_total[1m])", "vllm:time_per_output_token_seconds_bucket"]
    ) == {"rapidkv_transfer_ms_sum_total", "vllm:time_per_output_token_seconds_bucket"}
