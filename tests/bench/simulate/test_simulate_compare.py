"""`bench simulate --compare`: the simulator's goodput next to a real run's."""

from __future__ import annotations

import pytest

from rapidkv.bench.simulate.compare import (
    Target,
    compare,
    crossing,
    goodput_rule,
    max_num_seqs_of,
    policy_for,
    rates_of,
    relative_error,
    table,
    target_for,
)
from rapidkv.bench.simulate.fit import DEFAULT_FIT

pytestmark = pytest.mark.unit


def test_relative_error() -> None:
    assert relative_error(11.5, 10.0) == pytest.approx(0.15)
    assert relative_error(8.0, 10.0) == pytest.approx(-0.2)
    assert relative_error(0.0, 0.0) == 0.0
    assert relative_error(2.0, 0.0) is None


def test_goodput_is_bench_goodputs_rule_the_last_rate_before_the_first_miss() -> None:
    assert goodput_rule({4.0: 1.0, 6.0: 0.95, 8.0: 0.5, 10.0: 0.92}) == 6.0  # max rule: 10
    assert goodput_rule({4.0: 0.5, 6.0: 0.95}) == 0.0
    assert goodput_rule({4.0: 0.9, 6.0: 0.91}) == 6.0
    assert goodput_rule({}) == 0.0


def test_the_crossing_resolves_what_a_sweep_step_cannot() -> None:
    # 10 req/s at 87 % or at 91 %: the step rule says 8 or 10 (25 % apart),
    # the crossing 9.5 or 10.1 (6 % apart)
    assert goodput_rule({8.0: 0.98, 10.0: 0.87, 12.0: 0.7}) == 8.0
    assert goodput_rule({8.0: 0.98, 10.0: 0.91, 12.0: 0.7}) == 10.0
    assert crossing({8.0: 0.98, 10.0: 0.87, 12.0: 0.7}) == pytest.approx(8 + 2 * 0.08 / 0.11)
    assert crossing({8.0: 0.98, 10.0: 0.91, 12.0: 0.7}) == pytest.approx(10 + 2 * 0.01 / 0.21)
    assert crossing({4.0: 1.0, 6.0: 0.95}) == 6.0  # above the sweep: the highest rate
    assert crossing({4.0: 0.5}) == 0.0 == crossing({})


def test_configurations_map_to_policies() -> None:
    assert policy_for("dp2") == "dp"
    assert policy_for("vllm-nixl") == "nixl"
    assert policy_for("rapidkv") == "fixed-pd"
    assert policy_for("rapidkv-fixed") == "fixed-pd"
    assert policy_for("rapidkv-adaptive") == "adaptive"
    assert policy_for("rapidkv-adaptive-unshaped") == "adaptive-unshaped"
    assert policy_for("rapidkv-adaptive-busy-crossings") == "adaptive-busy-crossings"
    assert policy_for("single") == "dp"
    assert target_for("single") == Target("dp", 1, routed=False, shared_core=False)
    assert target_for("dp2") == Target("dp", 2)
    assert target_for("rapidkv-local") == Target("dp", 2)  # two replicas, connector unused
    assert target_for("baseline") is None


def test_rates_are_read_tolerantly() -> None:
    assert rates_of({"2": 1.0, "4.5": 0.8, "x": 1.0, "-1": 1.0, "3": "nan"}) == {2.0: 1.0, 4.5: 0.8}
    assert rates_of(None) == {}


def real_run() -> dict:
    return {
        "workloads": {
            "prefill-heavy": {
                "slo": {"ttft_ms": 220.0, "tpot_ms": 8.1},
                "requests": 100,
                "configs": {
                    # measured 4 req/s; what the simulator makes of it is its business
                    "dp2": {"goodput_req_s": 4.0, "attainment": {"2": 0.97, "4": 0.93, "8": 0.7}},
                    # no goodput_req_s: taken from the attainment
                    "rapidkv": {"attainment": {"4": 0.99, "8": 0.95, "16": 0.4}},
                    # a pass above a miss: bench goodput's rule stops at the miss
                    "rapidkv-step": {"attainment": {"2": 0.95, "4": 0.5, "8": 0.95}},
                    "single": {"attainment": {"1": 1.0, "4": 0.5}},
                    "baseline": {"attainment": {"4": 1.0}},
                    "rapidkv-adaptive": {"goodput_req_s": 3.0},
                },
            },
            "long-context": {"configs": {}},
        }
    }


def test_compare_simulates_the_real_rates_and_reports_the_errors() -> None:
    out = compare(real_run(), DEFAULT_FIT, seed=0)
    w = out["workloads"]["prefill-heavy"]
    assert w["slo"] == {"ttft_ms": 220.0, "tpot_ms": 8.1, "source": "the real run's"}
    assert set(w["configs"]) == {"dp2", "rapidkv", "rapidkv-step", "single"}
    assert w["configs"]["single"]["instances"] == 1
    dp2, pd = w["configs"]["dp2"], w["configs"]["rapidkv"]
    assert (dp2["policy"], dp2["instances"], dp2["requests"]) == ("dp", 2, 100)
    assert pd["measured"]["goodput_req_s"] == 8.0  # the last rate before the first miss
    assert w["configs"]["rapidkv-step"]["measured"]["goodput_req_s"] == 2.0  # not 8
    for c in (dp2, pd):
        sim = c["simulated"]
        assert list(sim["attainment"]) == list(c["measured"]["attainment"])  # the same rates
        rates = sorted(float(r) for r in sim["attainment"])
        first_miss = next(
            (i for i, r in enumerate(rates) if sim["attainment"][f"{r:g}"] < 0.9), len(rates)
        )
        assert sim["goodput_req_s"] == (rates[first_miss - 1] if first_miss else 0.0)
        measured = c["measured"]["goodput_req_s"]
        err = (sim["goodput_req_s"] - measured) / measured
        assert c["relative_error"] == pytest.approx(err)
        assert c["within"] == (abs(err) <= 0.15)
        cm, cs = c["measured"]["crossing_req_s"], sim["crossing_req_s"]
        assert cm == pytest.approx(
            crossing({float(r): a for r, a in c["measured"]["attainment"].items()})
        )
        assert c["crossing_relative_error"] == pytest.approx((cs - cm) / cm)
    errors = [abs(c["relative_error"]) for c in w["configs"].values()]
    assert out["max_abs_error"] == pytest.approx(max(errors))
    assert out["within"] == all(e <= 0.15 for e in errors)
    skipped = "\n".join(out["skipped"])
    assert "baseline" in skipped and "rapidkv-adaptive" in skipped and "long-context" in skipped
    text = table(out)
    assert "dp2" in text and "rapidkv" in text and "skipped" in text


def test_a_run_the_simulator_made_itself_compares_at_zero_error() -> None:
    first = compare(real_run(), DEFAULT_FIT, seed=3)
    echo = {
        "workloads": {
            "prefill-heavy": {
                "slo": {"ttft_ms": 220.0, "tpot_ms": 8.1},
                "requests": 100,
                "configs": {},
            }
        }
    }
    for name, c in first["workloads"]["prefill-heavy"]["configs"].items():
        echo["workloads"]["prefill-heavy"]["configs"][name] = {
            "attainment": c["simulated"]["attainment"]
        }
    again = compare(echo, DEFAULT_FIT, seed=3)
    assert again["within"] and again["max_abs_error"] == 0.0 and again["crossing_within"]


def test_nothing_to_compare_is_said_not_raised() -> None:
    out = compare({"configs": {}}, DEFAULT_FIT)
    assert out["within"] is False and out["skipped"]
    no_slo = compare(
        {"workloads": {"chat": {"configs": {"dp2": {"attainment": {"1": 1.0}}}}}},
        DEFAULT_FIT,
        requests_per_instance=20,
        min_requests=40,
    )
    chat = no_slo["workloads"]["chat"]
    assert chat["slo"]["source"].startswith("simulated single c1")
    assert chat["configs"]["dp2"]["requests"] == 40


def test_requests_per_rate_come_from_the_real_run_meta() -> None:
    real = {
        "meta": {"requests_per_rate": 30},
        "workloads": {
            "chat": {
                "slo": {"ttft_ms": 200.0, "tpot_ms": 9.0},
                "configs": {"dp2": {"attainment": {"1": 1.0}, "requests": 150}},
            }
        },
    }
    c = compare(real, DEFAULT_FIT)["workloads"]["chat"]["configs"]["dp2"]
    assert c["requests"] == 30  # per rate, not the configuration's total over its rates


def test_the_measured_interval_says_whether_the_simulation_lies_in_it() -> None:
    run = real_run()
    configs = run["workloads"]["prefill-heavy"]["configs"]
    configs["dp2"]["goodput_interval_req_s"] = [0, 1000]  # any simulated goodput is in it
    configs["rapidkv"]["goodput_interval_req_s"] = [999, 1000]  # none is
    configs["single"]["goodput_interval_req_s"] = "bad"
    result = compare(run, DEFAULT_FIT, seed=3)
    out = result["workloads"]["prefill-heavy"]["configs"]
    assert out["dp2"]["measured"]["goodput_interval_req_s"] == (0.0, 1000.0)
    assert out["dp2"]["inside_interval"] is True and out["rapidkv"]["inside_interval"] is False
    assert out["single"]["inside_interval"] is None  # no usable interval: not judged
    assert out["rapidkv-step"]["measured"]["goodput_interval_req_s"] is None
    text = table(result)
    assert "[0, 1000] in" in text and "[999, 1000] out" in text


def test_the_real_runs_slots_are_the_last_max_num_seqs_of_its_server_args() -> None:
    def of(args: object) -> int | None:
        return max_num_seqs_of({"meta": {"server_args": args}})

    assert of(["--max-model-len", "1280", "--max-num-seqs", "16"]) == 16
    assert of(["--max-num-seqs", "16", "--max-num-seqs=4"]) == 4  # vLLM takes the last
    assert of(["--max-num-seqs=4", "--max-num-seqs", "x"]) is None
    assert of(["--max-num-seqs"]) is None and of(["--max-num-seqs", "0"]) is None
    assert of("--max-num-seqs 16") is None and of(None) is None
    assert max_num_seqs_of({}) is None and max_num_seqs_of({"meta": []}) is None
