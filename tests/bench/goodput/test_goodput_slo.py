"""`rapidkv bench goodput`: its pure parts: Poisson arrivals, the workloads'
draws, SLOs, attainment and goodput."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from rapidkv.bench.common.arrivals import offered_rate, poisson_arrivals, unit_gaps
from rapidkv.bench.common.workloads import MAX_MODEL_LEN, WORKLOADS
from rapidkv.bench.goodput.slo import (
    SLO,
    TARGET,
    Outcome,
    attainment,
    attains,
    derive,
    given,
    goodput,
    rate_key,
)

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------- arrivals


def test_arrivals_are_seeded_and_start_at_once() -> None:
    a = poisson_arrivals(50, 4.0, seed=3)
    assert a == poisson_arrivals(50, 4.0, seed=3)
    assert a != poisson_arrivals(50, 4.0, seed=4)
    assert a[0] == 0.0 and len(a) == 50
    assert all(x < y for x, y in itertools.pairwise(a))
    assert poisson_arrivals(0, 4.0, seed=3) == [] and poisson_arrivals(1, 4.0, seed=3) == [0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, seed=0)


def test_arrivals_offer_exactly_the_rate_asked_for_with_exponential_gaps() -> None:
    for rate in (0.5, 4.0, 25.0):
        for n in (8, 40, 20_000):
            assert offered_rate(poisson_arrivals(n, rate, seed=n)) == pytest.approx(rate)
        a = poisson_arrivals(20_000, rate, seed=1)
        gaps = [y - x for x, y in itertools.pairwise(a)]
        # exponential gaps: the standard deviation is the mean
        assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.05)
        # independent: no correlation between one gap and the next
        assert abs(statistics.correlation(gaps[:-1], gaps[1:])) < 0.05


def test_every_rate_replays_the_same_pattern_scaled() -> None:
    """Common random numbers: the same seed at twice the rate is the same
    arrivals at half the times."""
    slow, fast = poisson_arrivals(40, 2.0, seed=9), poisson_arrivals(40, 4.0, seed=9)
    assert fast == pytest.approx([t / 2 for t in slow])
    assert len(unit_gaps(40, 9)) == 39
    assert math.isnan(offered_rate([0.0]))


# ---------------------------------------------------------------- workloads


def test_workloads_are_the_issues_and_fit_the_servers_context() -> None:
    heavy, chat = WORKLOADS["prefill-heavy"], WORKLOADS["chat"]
    assert (heavy.min_len, heavy.max_len, heavy.min_tokens, heavy.max_tokens) == (128, 900, 16, 16)
    assert (chat.min_len, chat.max_len, chat.min_tokens, chat.max_tokens) == (100, 900, 32, 256)
    for w in WORKLOADS.values():
        assert w.max_len + w.max_tokens <= MAX_MODEL_LEN
        assert list(w.default_rates) == sorted(w.default_rates) and len(w.quick_rates) == 2


def test_a_workload_plan_is_seeded_within_its_bounds_and_prefix_stable() -> None:
    chat = WORKLOADS["chat"]
    plan = chat.plan(200, seed=5)
    assert plan == chat.plan(200, seed=5) and plan != chat.plan(200, seed=6)
    assert all(100 <= n <= 900 for n in plan.prompt_lens)
    assert all(32 <= m <= 256 for m in plan.max_tokens)
    assert len(set(plan.max_tokens)) > 50  # drawn per request
    short = chat.plan(10, seed=5)
    assert short.prompt_lens == plan.prompt_lens[:10] and short.max_tokens == plan.max_tokens[:10]


def test_prefill_heavy_draws_bench_serves_prompt_lengths() -> None:
    import argparse

    from rapidkv.bench.serve import register
    from rapidkv.bench.serve.options import Options
    from rapidkv.bench.serve.run import prompt_lengths

    parser = argparse.ArgumentParser()
    register(parser)
    serve = Options.from_args(parser.parse_args(["--requests", "30", "--seed", "7"]))
    plan = WORKLOADS["prefill-heavy"].plan(30, seed=7)
    assert list(plan.prompt_lens) == prompt_lengths(serve)
    assert set(plan.max_tokens) == {16}
    assert WORKLOADS["chat"].plan(30, seed=7).prompt_lens != plan.prompt_lens


# ---------------------------------------------------------------- SLOs, attainment


def test_slos_are_factors_of_singles_c1_p50s() -> None:
    slo = derive(50.0, 5.0, 4.0, 1.5)
    assert slo == SLO(200.0, 7.5)
    for bad in (math.nan, 0.0, -1.0, math.inf):
        with pytest.raises(ValueError):
            derive(bad, 5.0, 4.0, 1.5)
        with pytest.raises(ValueError):
            derive(50.0, bad, 4.0, 1.5)


def test_an_slo_given_in_ms_replaces_the_derived_one() -> None:
    derived = derive(50.0, 5.0, 4.0, 1.5)
    assert given(derived, None, None) == derived
    assert given(derived, None, 12.0) == SLO(200.0, 12.0)
    assert given(derived, 300.0, 12.0) == SLO(300.0, 12.0)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError):
            given(derived, bad, None)


def test_a_request_attains_when_complete_right_and_within_both_slos() -> None:
    slo = SLO(200.0, 7.5)
    assert attains(Outcome(200.0, 7.5), slo)  # bounds inclusive
    assert not attains(Outcome(200.1, 5.0), slo)
    assert not attains(Outcome(100.0, 7.6), slo)
    assert not attains(Outcome(100.0, 5.0, error=True), slo)
    assert not attains(Outcome(100.0, 5.0, hard_mismatch=True), slo)
    assert not attains(Outcome(math.nan, math.nan, error=True), slo)
    assert attains(Outcome(100.0, math.nan), slo)  # one token: judged on TTFT alone
    assert not attains(Outcome(math.nan, 5.0), slo)


def test_attainment_counts_every_request_sent_and_each_slo_apart() -> None:
    slo = SLO(100.0, 10.0)
    rows = [
        Outcome(50.0, 5.0),
        Outcome(150.0, 5.0),  # TTFT missed
        Outcome(50.0, 15.0),  # TPOT missed
        Outcome(math.nan, math.nan, error=True),
    ]
    a = attainment(rows, slo)
    assert a == {
        "attainment": 0.25,
        "ttft_attainment": 0.5,
        "tpot_attainment": 0.5,
        "requests": 4,
    }
    assert math.isnan(attainment([], slo)["attainment"])


# ---------------------------------------------------------------- goodput


def test_goodput_is_the_highest_rate_meeting_the_target() -> None:
    g = goodput({2.0: 1.0, 4.0: 0.95, 8.0: 0.9, 12.0: 0.5, 16.0: 0.1})
    assert (g.req_s, g.max_req_s, g.bound, g.monotonic) == (8.0, 8.0, "within", True)
    assert g.interpolated_req_s == pytest.approx(8.0)  # exactly at the target at 8
    g = goodput({4.0: 0.95, 8.0: 0.85})  # the crossing, linearly: 4 + 0.05 / 0.1 x 4
    assert g.req_s == 4.0 and g.interpolated_req_s == pytest.approx(6.0)
    assert TARGET == 0.9


def test_a_miss_below_a_pass_ends_the_goodput_and_is_flagged() -> None:
    """Non-monotonic attainment: the last rate before the first miss, with
    DistServe's literal maximum beside it."""
    g = goodput({2.0: 1.0, 4.0: 0.85, 6.0: 0.95, 8.0: 0.2})
    assert g.req_s == 2.0 and g.max_req_s == 6.0
    assert g.bound == "within" and g.monotonic is False
    assert goodput({2.0: 1.0, 4.0: 0.85, 6.0: 0.5}).monotonic is True


def test_goodput_edge_cases() -> None:
    below = goodput({2.0: 0.5, 4.0: 0.1})
    assert (below.req_s, below.bound, below.interpolated_req_s) == (0.0, "below_sweep", None)
    above = goodput({2.0: 1.0, 4.0: 0.92})
    assert (above.req_s, above.bound, above.interpolated_req_s) == (4.0, "above_sweep", None)
    assert goodput({}).bound == "no_data" and goodput({}).req_s is None
    assert goodput({2.0: None, 4.0: math.nan}).req_s is None
    # a rate not measured (its configuration failed before it) is a miss
    g = goodput({2.0: 1.0, 4.0: None, 6.0: 1.0})
    assert g.req_s == 2.0 and g.interpolated_req_s == pytest.approx(2.0 + 0.1 / 1.0 * 2.0)
    assert g.monotonic is False
    assert goodput({8.0: 0.95, 2.0: 1.0, 4.0: 0.99}).req_s == 8.0  # order of the mapping
    one = goodput({5.0: 0.9})
    assert (one.req_s, one.bound) == (5.0, "above_sweep")
    assert goodput({3.0: 0.2, 6.0: 0.95}).max_req_s == 6.0  # below the sweep, yet a pass later
    assert set(goodput({2.0: 1.0}).as_dict()) == {
        "goodput_req_s",
        "goodput_max_req_s",
        "goodput_interpolated_req_s",
        "goodput_bound",
        "attainment_monotonic",
    }


def test_rates_name_their_json_entries_without_trailing_zeros() -> None:
    assert [rate_key(r) for r in (2.0, 2.5, 12.0, 0.25)] == ["2", "2.5", "12", "0.25"]
