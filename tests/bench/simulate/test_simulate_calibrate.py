"""`bench simulate --compare --calibrate`: a fit calibrated on a run's own single c1."""

from __future__ import annotations

import dataclasses

import pytest

from rapidkv.bench.common.shared_prefix import SHARED_PREFIX
from rapidkv.bench.simulate.calibrate import calibrate, single_c1
from rapidkv.bench.simulate.compare import compare, table
from rapidkv.bench.simulate.fit import DEFAULT_FIT

pytestmark = pytest.mark.unit

WORKLOAD = dataclasses.replace(SHARED_PREFIX, groups=2, warm_up=0)
COUNT = 16


def test_a_prompt_chunk_pays_for_the_context_its_request_holds() -> None:
    fit = dataclasses.replace(DEFAULT_FIT, context_ms_per_token=0.02)
    assert fit.step_time(1, 50, 1024) == pytest.approx(DEFAULT_FIT.step_time(1, 50) + 20.48)
    assert fit.step_time(1, 0) == DEFAULT_FIT.step_time(1, 0)  # a decode step: none
    plain = single_c1(DEFAULT_FIT, WORKLOAD, COUNT)
    costly = single_c1(fit, WORKLOAD, COUNT)
    assert costly[1] == pytest.approx(plain[1])  # TPOT: decode steps only
    assert costly[0] > plain[0] + 15  # the p50 request is a hit on a 1024-token prefix


def test_calibration_recovers_the_speed_and_the_context_cost_a_run_had() -> None:
    truth = dataclasses.replace(
        DEFAULT_FIT,
        step_ms=DEFAULT_FIT.step_ms * 1.3,
        step_ms_per_seq=DEFAULT_FIT.step_ms_per_seq * 1.3,
        prefill_ms_per_token=DEFAULT_FIT.prefill_ms_per_token * 1.3,
        context_ms_per_token=0.02,
    )
    ttft, tpot = single_c1(truth, WORKLOAD, COUNT)
    cal = calibrate(DEFAULT_FIT, WORKLOAD, ttft, tpot, count=COUNT)
    assert cal.exact
    assert cal.speed == pytest.approx(1.3)
    assert cal.context_ms_per_token == pytest.approx(0.02, rel=0.1)
    assert cal.after[0] == pytest.approx(ttft, abs=0.5)
    assert cal.before == single_c1(DEFAULT_FIT, WORKLOAD, COUNT)
    # a TTFT below what the scaled fit gives without any context cost: no context, not met
    quick = calibrate(DEFAULT_FIT, WORKLOAD, cal.before[0] * 0.3, cal.before[1] * 0.5, count=COUNT)
    assert quick.speed == pytest.approx(0.5) and quick.context_ms_per_token == 0.0
    assert not quick.exact
    with pytest.raises(ValueError):
        calibrate(DEFAULT_FIT, WORKLOAD, 0.0, tpot, count=COUNT)


def test_compare_calibrates_each_workload_on_its_single_c1_when_asked() -> None:
    ttft, tpot = single_c1(DEFAULT_FIT, WORKLOAD, 10)
    real = {
        "workloads": {
            "shared-prefix": {
                "groups": 2,
                "warm_up": 0,
                "requests_per_rate": 10,
                "slo": {"ttft_ms": 4 * ttft, "tpot_ms": 1.5 * tpot},
                "single_c1": {"ttft_ms": {"p50": 2 * ttft}, "tpot_ms": {"p50": 2 * tpot}},
                "configs": {"dp2": {"attainment": {"2": 0.95}, "goodput_req_s": 2.0}},
            }
        }
    }
    plain = compare(real, DEFAULT_FIT, tokenizer="chars")
    assert plain["workloads"]["shared-prefix"]["calibration"] is None
    out = compare(real, DEFAULT_FIT, tokenizer="chars", calibrated=True)
    cal = out["workloads"]["shared-prefix"]["calibration"]
    assert cal["speed"] == pytest.approx(2.0)
    assert cal["single_c1_measured_ms"] == {"ttft_p50": 2 * ttft, "tpot_p50": 2 * tpot}
    assert "calibrated on the run's single c1" in table(out)
    slower = out["workloads"]["shared-prefix"]["configs"]["dp2"]["simulated"]["points"][0]
    faster = plain["workloads"]["shared-prefix"]["configs"]["dp2"]["simulated"]["points"][0]
    assert slower["tpot_ms"]["p50"] > faster["tpot_ms"]["p50"]
    del real["workloads"]["shared-prefix"]["single_c1"]
    out = compare(real, DEFAULT_FIT, tokenizer="chars", calibrated=True)
    assert out["workloads"]["shared-prefix"]["calibration"] is None
    assert any("uncalibrated" in s for s in out["skipped"])
