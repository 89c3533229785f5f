"""The harness's real Prometheus (`harness.prometheus`): it scrapes a target,
answers queries over what it scraped, loads and evaluates rule files, and
`check_rules` refuses a broken rule file with promtool's reason. Skips, saying
why, where Prometheus is not installed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from rapidkv.harness.ports import free_port
from rapidkv.harness.prometheus import PrometheusServer, PrometheusUnavailable, check_rules
from rapidkv.harness.waiting import wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

RULES = """\
groups:
  - name: t
    rules:
      - record: t:hits:rate
        expr: sum(rate(t_hits_total[5s]))
"""


def test_it_scrapes_a_target_answers_queries_and_evaluates_rules(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    hits = Counter("t_hits", "hits", registry=registry)
    port = free_port()
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    prom = PrometheusServer({"app": [f"127.0.0.1:{port}"]}, rule_files=[rules])
    try:
        prom.start()
    except PrometheusUnavailable as e:
        server.shutdown()
        pytest.skip(f"prometheus cannot run here: {e}")
    try:
        wait_until(lambda: prom.targets_up() == {f"app/127.0.0.1:{port}": "up"}, 15, what="up")
        for _ in range(4):
            hits.inc(10)
            time.sleep(0.5)

        def scraped() -> float:
            got = prom.query("t_hits_total")
            return float(got[0]["value"][1]) if got else -1.0

        wait_until(lambda: scraped() == 40, 10, what="the last count scraped")
        [sample] = prom.query('t_hits_total{job="app"}')
        assert sample["metric"]["instance"] == f"127.0.0.1:{port}"  # the scrape target's
        assert prom.query("absent_metric_name") == []
        wait_until(lambda: prom.query("t:hits:rate"), 10, what="the recording rule evaluated")
        [rule] = prom.rules()
        assert rule["name"] == "t:hits:rate" and rule["health"] == "ok", rule
        with pytest.raises(AssertionError, match="parse error"):
            prom.query("sum(")
    finally:
        prom.stop()
        server.shutdown()
    assert prom.process is not None and not prom.process.live_pids()
    assert not prom.data_dir.exists()


def test_check_rules_passes_a_good_file_and_refuses_a_broken_one(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yml", tmp_path / "bad.yml"
    good.write_text(RULES)
    bad.write_text(RULES.replace("sum(rate(t_hits_total[5s]))", "sum(rate(t_hits_total[5s])"))
    try:
        assert "SUCCESS" in check_rules(good)
    except PrometheusUnavailable as e:
        pytest.skip(f"promtool cannot run here: {e}")
    with pytest.raises(AssertionError, match=r"bad\.yml"):
        check_rules(bad)
