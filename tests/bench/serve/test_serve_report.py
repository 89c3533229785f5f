"""`rapidkv bench serve`'s report (`serve/report.py`): the stall report, the
acceptance ratios (paired and unpaired), and deep closed loops reported."""

from __future__ import annotations

import argparse
import math

import pytest

from rapidkv.bench.common.stats import Histogram, RequestResult, load_summary
from rapidkv.bench.serve.options import Options
from rapidkv.bench.serve.report import acceptance_report, stall_report


@pytest.mark.unit
def test_at_deep_loads_throughput_is_held_against_vllm_nixl_and_half_of_dp2() -> None:
    def config(rate: float) -> dict:
        load = {"ttft_ms": {"p50": 100.0, "p90": 120.0, "p99": 150.0, "max": 160.0}}
        load.update(ttft_over_1s=0, throughput_req_s=rate, itl_max_ms=20.0)
        load.update(gaps_over_250ms=0, lumped_share=0.0, engine_ttft_ms_p90=110.0)
        load.update(client_ttft_over_engine_p90=120 / 110, client_ttft_within_engine_bound=True)
        return {"loads": {"c16": load, "c32": dict(load)}}

    configs = {"vllm-nixl": config(20.0), "dp2": config(50.0), "rapidkv": config(26.0)}
    st = stall_report(configs)
    assert st["met"] is True
    assert st["rapidkv c32"]["throughput_over_vllm_nixl"] == pytest.approx(1.3)
    assert st["rapidkv c32"]["throughput_over_dp2"] == pytest.approx(0.52)
    configs["rapidkv"] = config(24.0)  # above vllm-nixl, under half of dp2
    assert stall_report(configs)["met"] is False
    configs["dp2"] = config(40.0)
    configs["rapidkv"] = config(19.0)  # half of dp2, under vllm-nixl
    assert stall_report(configs)["met"] is False


def test_a_stall_shows_in_the_stall_report_whatever_the_p50() -> None:
    def config(
        p50: float,
        p99: float,
        over: int,
        rate: float,
        gap: float = 12.0,
        p90: float = 300.0,
        engine: float = 250.0,
    ) -> dict:
        ttft = {"p50": p50, "p90": p90, "p99": p99, "max": p99}
        load = {"ttft_ms": ttft, "ttft_over_1s": over, "throughput_req_s": rate}
        load.update(itl_max_ms=gap, gaps_over_250ms=int(gap > 250), lumped_share=0.1)
        load.update(engine_ttft_ms_p90=engine, client_ttft_over_engine_p90=p90 / engine)
        load["client_ttft_within_engine_bound"] = (
            p90 <= 1.5 * engine + 50 if not math.isnan(engine) else None
        )
        return {"loads": {"c1": load, "c4": load}}

    configs = {
        "vllm-nixl": config(200.0, 2900.0, 3, 10.0, gap=3000.0),  # a baseline's are not ours
        "rapidkv": config(160.0, 600.0, 0, 12.0),
        "rapidkv-whole": config(170.0, 650.0, 0, 11.0),
    }
    st = stall_report(configs)
    assert st["met"] is True
    assert st["rapidkv c4"]["throughput_over_vllm_nixl"] == pytest.approx(1.2)
    assert "throughput_over_vllm_nixl" not in st["rapidkv c1"]
    assert st["rapidkv c1"]["itl_max_ms"] == 12.0 and st["rapidkv c1"]["lumped_share"] == 0.1
    assert st["rapidkv c1"]["client_ttft_over_engine_p90"] == pytest.approx(1.2)
    configs["rapidkv-whole"] = config(161.0, 2885.0, 4, 11.0)  # the p50 looks fine
    st = stall_report(configs)
    assert st["met"] is False and st["rapidkv-whole c1"]["ttft_over_1s"] == 4
    assert st["rapidkv-whole c1"]["ttft_p99_over_p50"] == pytest.approx(2885 / 161)
    configs["rapidkv-whole"] = config(161.0, 900.0, 0, 11.0)  # p99 / p50 5.6: context only
    assert stall_report(configs)["met"] is True
    configs["rapidkv-whole"] = config(161.0, 600.0, 0, 9.0)  # slower than vllm-nixl at c4
    assert stall_report(configs)["met"] is False
    # whole streams: a gap over 1 s fails, gaps over 250 ms are shown, not a target
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, gap=1000.5)
    st = stall_report(configs)
    assert st["met"] is False and st["rapidkv-whole c1"]["gaps_over_250ms"] == 1
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, gap=1000.0)
    assert stall_report(configs)["met"] is True
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, gap=math.nan)  # one token each
    assert stall_report(configs)["met"] is True
    # the client's TTFT against the engines' own: waits outside the engines fail
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, p90=425.0, engine=250.0)
    assert stall_report(configs)["met"] is True  # 425 <= 1.5 x 250 + 50
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, p90=426.0, engine=250.0)
    st = stall_report(configs)
    assert st["met"] is False and st["rapidkv-whole c1"]["client_ttft_within_engine_bound"] is False
    configs["rapidkv-whole"] = config(170.0, 650.0, 0, 11.0, engine=math.nan)  # not read
    assert stall_report(configs)["met"] is False
    assert "engines' TTFT p90" in st["targets"] and "gap over 1 s" in st["targets"]


@pytest.mark.unit
def test_acceptance_holds_rapidkv_to_single_vllm_nixl_and_dp2() -> None:
    def config(ttft: float, tpot: float, tok_s: float = 40.0, gap: float = 60.0) -> dict:
        load = {
            "ttft_ms": {"p50": ttft, "mean": ttft},
            "tpot_ms": {"p50": tpot},
            "output_tok_s": tok_s,
            "itl_max_ms": gap,
        }
        return {"hard_mismatches": 0, "loads": {"c1": load, "c4": dict(load)}}

    configs = {
        "single": config(200.0, 40.0),
        "single-noop-connector": config(200.0, 48.0),  # 1.2x: context, no target
        "vllm-nixl": config(300.0, 50.0),
        "dp2": config(260.0, 50.0, tok_s=44.0),
        "rapidkv": config(140.0, 52.0, tok_s=45.0),
    }
    a = acceptance_report(configs)
    assert a["ttft_p50_rapidkv_over_single_c1"] == pytest.approx(0.7)
    assert a["ttft_p50_rapidkv_over_vllm_nixl_c4"] == pytest.approx(140 / 300)
    assert a["tpot_p50_rapidkv_over_dp2_c1"] == pytest.approx(1.04)
    assert a["output_tok_s_rapidkv_over_dp2_c4"] == pytest.approx(45 / 44)
    assert a["tpot_p50_rapidkv_over_single_c4"] == pytest.approx(1.3)  # context
    assert a["floor_tpot_p50_noop_connector_over_single_c1"] == pytest.approx(1.2)
    assert a["itl_max_ms_rapidkv"] == 60.0 and a["met"] is True
    for worse in (
        config(150.0, 52.0, tok_s=45.0),  # TTFT 0.75x single's
        config(140.0, 53.0, tok_s=45.0),  # TPOT 1.06x dp2's
        config(140.0, 52.0, tok_s=43.0),  # fewer tokens/s than dp2
        config(140.0, 52.0, tok_s=45.0, gap=1001.0),  # a gap over a second
    ):
        assert acceptance_report({**configs, "rapidkv": worse})["met"] is False
    del configs["dp2"], configs["single-noop-connector"]  # not measured: not judged
    a = acceptance_report(configs)
    assert math.isnan(a["tpot_p50_rapidkv_over_dp2_c1"]) and a["met"] is True
    assert math.isnan(a["floor_tpot_p50_noop_connector_over_single_c1"])
    configs["vllm-nixl"]["hard_mismatches"] = 1
    assert acceptance_report(configs)["met"] is False


@pytest.mark.unit
def test_paired_tpot_ratios_over_single_are_context_beside_the_unpaired_ones() -> None:
    """Where a configuration was measured in blocks beside `single`, its TPOT
    over `single`'s is the ratio to those blocks, with their interval; the
    unpaired ratio stays beside it. Neither is a target."""

    def config(tpot: float, paired_ratio: float | None = None) -> dict:
        load: dict = {"ttft_ms": {"p50": 40.0, "mean": 40.0}, "tpot_ms": {"p50": tpot}}
        if paired_ratio is not None:
            load["paired_single"] = {
                "tpot_p50_over_paired_single": paired_ratio,
                "tpot_p50_over_paired_single_ci95": [paired_ratio - 0.1, paired_ratio + 0.1],
            }
        return {"hard_mismatches": 0, "paired_single_hard_mismatches": 0, "loads": {"c1": load}}

    configs = {
        "single": config(5.0),
        "single-noop-connector": config(5.5, paired_ratio=1.01),
        "rapidkv": config(6.0, paired_ratio=1.02),  # 1.2x the unpaired `single`
    }
    a = acceptance_report(configs)
    assert a["tpot_p50_rapidkv_over_single_c1"] == pytest.approx(1.02)
    assert a["unpaired_tpot_p50_rapidkv_over_single_c1"] == pytest.approx(1.2)
    assert a["paired_c1"] is True
    assert a["ci95_tpot_p50_rapidkv_over_single_c1"] == pytest.approx([0.92, 1.12])
    assert a["floor_tpot_p50_noop_connector_over_single_c1"] == pytest.approx(1.01)
    configs["rapidkv"]["paired_single_hard_mismatches"] = 1
    assert acceptance_report(configs)["hard_mismatches_all_configs"] == 1
    assert acceptance_report(configs)["met"] is False


def _entry(loads: dict[str, list[RequestResult]]) -> dict:
    """A configuration's JSON entry as `report.config_report` builds it, from
    each load's results (one round, no references, 1 s per load)."""
    entry: dict = {"error": None, "startup_s": 1.0, "first_request_ms": [], "affinity": {}}
    entry.update(errors=0, hard_mismatches=0, near_tie_mismatches=0, loads={})
    entry["paired_single_hard_mismatches"] = 0
    engine = Histogram(((0.01, 0.0), (0.05, 4.0), (math.inf, 4.0)), 4.0)  # p90 46 ms
    for load, results in loads.items():
        s = load_summary(results, None, 1.0, {"decode": 0.5}, {"decode": engine})
        s.update(prompt_tokens={}, kv_transferred_fraction=1.0, prefix_cache_hit_fraction=0.0)
        s.update(client_cpu_s=0.1)
        s.update(other_cpu_s=0.0, other_cpu_cores=0.0)
        entry["loads"][load] = s
    return entry


@pytest.mark.unit
def test_deep_closed_loops_are_accepted_and_reported() -> None:
    """`--loads c1,c4,c16,c32,poisson8`: parsed, counted, reported and printed
    like any other; paired blocks of 8 cannot hold 16 in flight, which is said."""
    import io

    from rapidkv.bench.serve import register
    from rapidkv.bench.serve.report import print_report
    from rapidkv.bench.serve.run import total_units

    parser = argparse.ArgumentParser()
    register(parser)
    names = ["c1", "c4", "c16", "c32", "poisson8"]
    opts = Options.from_args(parser.parse_args(["--loads", ",".join(names)]))
    assert [load.name for load in opts.loads] == names
    assert [load.concurrency for load in opts.loads] == [1, 4, 16, 32, None]
    # rapidkv is paired at c1 only: its deeper loads run whole, as the baselines'
    assert opts.paired("rapidkv", opts.loads[0]) and opts.pairing
    assert not any(opts.paired("rapidkv", load) for load in opts.loads[1:])
    assert opts.units("single") == 2 + 5 * 64 and opts.units("rapidkv") == 2 + 6 * 64
    assert total_units(opts) > 0
    deep = Options.from_args(parser.parse_args(["--loads", "c4,c16"]))
    assert not deep.pairing and not deep.paired("rapidkv")
    unpaired = Options.from_args(parser.parse_args(["--loads", "c1", "--pair-block", "0"]))
    assert not unpaired.paired("rapidkv")

    ok = [RequestResult(i, (1, 2), (40.0, 45.0), 46.0, 0.0) for i in range(4)]
    entries = {name: _entry(dict.fromkeys(names, ok)) for name in ("single", "rapidkv")}
    a = acceptance_report(entries)
    assert a["tpot_p50_rapidkv_over_single_c32"] == pytest.approx(1.0)
    st = stall_report(entries)
    assert set(st) >= {f"rapidkv {n}" for n in names} and st["met"] is True
    report = {
        "configs": entries,
        "acceptance": {"tiny": a},
        "stalls": {"tiny": st},
        "reference": {"tiny": {"error": None}},
        "failed_baselines": [],
        "ok": True,
        "meta": {
            "models": {"tiny": "/m"},
            "dtype": {"tiny": "float32"},
            "dataset": "random",
            "cpu": "X",
        },
    }
    report["meta"]["cpus"] = 2
    out = io.StringIO()
    print_report(report, out)
    rows = [line.split()[:2] for line in out.getvalue().splitlines()]
    assert ["rapidkv", "c16"] in rows and ["rapidkv", "c32"] in rows
    assert "rapidkv c32" in out.getvalue()
    assert "rapidkv bench serve: tiny (float32), random prompts; CPU X (2 cpus)" in out.getvalue()
