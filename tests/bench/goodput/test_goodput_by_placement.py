"""`bench goodput`'s breakdown of one rate by placement: pure, no servers."""

import math

import pytest

from rapidkv.bench.goodput.by_placement import by_placement
from rapidkv.bench.goodput.slo import SLO, Outcome
from rapidkv.router.placement.policy import parse_header

LOCAL = "kind=local;prefill=0;decode=0;reason=lowest-ttft;ttft_ms=50.0;tpot_ms=5.0"
PD = "kind=pd;prefill=0;decode=1;reason=tpot-slo;ttft_ms=100.0;tpot_ms=8.0"


def test_parse_header_reads_every_field_and_skips_malformed_parts() -> None:
    assert parse_header("kind=split;head=64;;junk;ttft_ms=1.5") == {
        "kind": "split",
        "head": "64",
        "ttft_ms": "1.5",
    }


def test_each_kind_gets_its_shares_and_measured_over_predicted() -> None:
    slo = SLO(ttft_ms=120.0, tpot_ms=10.0)
    outcomes = [
        Outcome(40.0, 4.0),  # local: ratios 0.8, 0.8
        Outcome(60.0, 6.0),  # local: 1.2, 1.2
        Outcome(200.0, 16.0),  # pd: misses both, ratios 2, 2
        Outcome(100.0, 8.0),  # pd: meets both, ratios 1, 1
        Outcome(math.nan, math.nan, error=True),  # failed: left out
        Outcome(10.0, 1.0),  # no header: left out
    ]
    got = by_placement([LOCAL, LOCAL, PD, PD, PD, None], outcomes, slo)
    assert set(got) == {"local", "pd"}
    assert got["local"]["requests"] == 2 and got["local"]["attainment"] == 1.0
    assert got["local"]["ttft_measured_over_predicted"] == pytest.approx(1.0)
    assert got["local"]["ttft_p50_ms"] == pytest.approx(50.0)
    assert got["pd"]["requests"] == 2
    assert got["pd"]["attainment"] == 0.5 and got["pd"]["tpot_attainment"] == 0.5
    assert got["pd"]["tpot_measured_over_predicted"] == pytest.approx(1.5)


def test_a_fixed_routers_header_has_no_prediction_and_gives_nan_ratios() -> None:
    fixed = "kind=pd;prefill=0;decode=1;reason=fixed"
    got = by_placement([fixed], [Outcome(30.0, 3.0)], None)
    assert got["pd"]["requests"] == 1 and "attainment" not in got["pd"]
    assert math.isnan(got["pd"]["ttft_measured_over_predicted"])


def test_headers_and_outcomes_must_pair_up() -> None:
    with pytest.raises(ValueError):
        by_placement([LOCAL], [], None)
