"""`rapidkv bench serve --base-url`: an endpoint already running (a vLLM
instance, a router in front of it) is measured with the same loads,
statistics, table and JSON as a configuration the command starts itself, and
nothing is started or stopped. The started run is `started_serve`'s, shared
with test_serve_smoke (`--configs single,rapidkv`: its `single` rows are the
ones compared)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from bench_cli import run_bench
from started_serve import SERVED, StartedRun


def _rows(stdout: str, config: str | None = None) -> list[str]:
    """The summary table's header and the (config, load) of each row (only
    `config`'s rows when given)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("config"))
    rows = [lines[start]]
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        if config is None or line.split()[0] == config:
            rows.append(" ".join(line.split()[:2]))
    return rows


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_endpoint_gives_the_table_of_the_run_that_started_it(
    tmp_path: Path, started_run: StartedRun
) -> None:
    from rapidkv.bench.common.groups import router_argv, start_front, start_group
    from rapidkv.models import ensure_model

    model = ensure_model("tiny")
    proc = started_run.proc
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    # the user's instance: the no-op connector's configuration (one vLLM with
    # rapidkv's NoopConnector loaded, which must change nothing)
    group = start_group("single-noop-connector", model, tmp_path / "own", prefix_caching=True)
    router = None
    try:
        url = group.servers["single"].base_url
        # the user's router in front of it: rapidkv's, local dispatch
        argv = router_argv("local", [], [url])
        router = start_front("own.router", argv, tmp_path / "own", None)
        measured, routed = tmp_path / "endpoint.json", tmp_path / "router.json"
        proc2, _ = run_bench(
            "serve", "--base-url", url, "--reference-url", url, "--configs", "single",
            *SERVED, "--json", str(measured), "--log-dir", str(tmp_path / "none"),
        )  # fmt: skip
        assert proc2.returncode == 0, proc2.stdout + proc2.stderr[-3000:]
        proc3, _ = run_bench(
            "serve", "--base-url", router.url, "--reference-url", url, "--configs", "single",
            *SERVED, "--json", str(routed),
        )  # fmt: skip
        assert proc3.returncode == 0, proc3.stdout + proc3.stderr[-3000:]
        assert group.crashes() == [] and group.servers["single"].process.live_pids()
    finally:
        if router is not None:
            router.process.stop()
        group.stop()
    assert "NoopConnector" in (tmp_path / "own" / "single-noop-connector.log").read_text()
    assert _rows(proc2.stdout) == _rows(proc3.stdout) == _rows(proc.stdout, "single")
    assert re.search(r"\bhit\b", _rows(proc.stdout)[0])
    a, b = json.loads(started_run.json.read_text()), json.loads(measured.read_text())
    assert b["ok"] is True and b["meta"]["base_url"] == url and not (tmp_path / "none").exists()
    assert a["meta"]["prefix_caching"] is True and a["meta"]["server_args"] == []
    for report in (a, b):
        assert report["reference"]["tiny"]["error"] is None
    sa, sb = a["configs"]["single"], b["configs"]["single"]
    assert set(sa["loads"]) == set(sb["loads"]) == {"c1", "c4"}
    for load in ("c1", "c4"):
        la, lb = sa["loads"][load], sb["loads"][load]
        assert set(la) == set(lb), set(la) ^ set(lb)
        for s in (la, lb):
            assert s["requests"] == 4 and s["errors"] == 0 and s["matches"] == 4
            assert s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p50"] > 0
        # the endpoint is a vLLM instance: its /metrics count its prompt tokens
        assert set(lb["prompt_tokens"]) == {"endpoint"} and lb["engine_ttft_requests"] >= 4
        # no process of the endpoint is known: no CPU time
        assert lb["server_cpu_s_per_req"] is None
    # the command empties its own servers' caches before each load: c4 sends
    # c1's prompts again and finds none of them cached; an endpoint's cache is
    # its user's, left as it is, and c4 finds c1's prompts there
    assert sa["loads"]["c4"]["prefix_cache_hit_fraction"] < 0.2
    assert sb["loads"]["c4"]["prefix_cache_hit_fraction"] > 0.5
    # through the router: the same answers; its /metrics are the router's own,
    # so no engine figures (shown as -)
    c = json.loads(routed.read_text())
    assert c["ok"] is True and c["reference"]["tiny"]["error"] is None
    for load in ("c1", "c4"):
        lc = c["configs"]["single"]["loads"][load]
        assert set(lc) == set(sa["loads"][load])
        assert lc["requests"] == lc["matches"] == 4 and lc["errors"] == 0
        assert lc["prompt_tokens"] == {} and lc["prefix_cache_hit_fraction"] is None
