"""`bench goodput`'s acceptance interval: a paired block bootstrap of
adaptive's goodput over the best baseline's (interval.py)."""

from __future__ import annotations

import pytest

from rapidkv.bench.goodput.interval import goodput_interval, ratio_interval

pytestmark = pytest.mark.unit

RATES = (2.0, 4.0, 6.0)
BASE = ("dp2", "rapidkv")


def hits(n: int, misses: set[int]) -> list[bool]:
    return [i not in misses for i in range(n)]


def sweep(*per_rate: set[int], n: int = 60) -> dict[float, list[bool] | None]:
    """Per rate, the request indices that missed; a rate beyond them: not run."""
    return {r: hits(n, per_rate[k]) if k < len(per_rate) else None for k, r in enumerate(RATES)}


def test_the_same_misses_on_the_same_requests_give_ratio_one_in_every_resample() -> None:
    # paired: a resample draws the same requests for every configuration, so
    # identical outcomes can never tell them apart, however borderline
    borderline = (set(), set(range(0, 60, 10)), set(range(0, 60, 3)))  # 6 misses at 4 req/s
    same = {c: sweep(*borderline) for c in ("rapidkv-adaptive", *BASE)}
    iv = ratio_interval(same, "rapidkv-adaptive", BASE, 1.1)
    assert iv is not None
    assert (iv["ratio_low"], iv["ratio_high"], iv["p_met"]) == (1.0, 1.0, 0.0)
    low, high = iv["goodput_interval"]["dp2"]
    assert (low, high) == (2.0, 4.0)  # 6 of 60 is exactly 90 %: a resample tips it either way


def test_a_clear_win_has_an_interval_above_the_threshold() -> None:
    configs = {
        "rapidkv-adaptive": sweep(set(), set(), {1, 30}),
        "dp2": sweep(set(), set(range(0, 60, 2)), set(range(60))),
        "rapidkv": sweep(set(range(0, 60, 2)), set(range(60))),
    }
    iv = ratio_interval(configs, "rapidkv-adaptive", BASE, 1.1)
    assert iv is not None and iv["ratio_low"] == iv["ratio_high"] == 3.0 and iv["p_met"] == 1.0
    assert iv["goodput_interval"]["rapidkv"] == [0.0, 0.0]
    assert iv["resamples_used"] == iv["resamples"] == 2000


def test_a_borderline_baseline_gives_a_wide_interval_and_it_is_seeded() -> None:
    configs = {
        "rapidkv-adaptive": sweep(set(), set(range(0, 60, 12)), set(range(60))),  # 5 misses
        "dp2": sweep(set(), set(range(3, 60, 10)), set(range(60))),  # 6 misses: on the edge
        "rapidkv": sweep(set(range(60))),
    }
    iv = ratio_interval(configs, "rapidkv-adaptive", BASE, 1.1)
    assert iv is not None and iv["ratio_low"] == 0.5 and iv["ratio_high"] == 2.0
    assert 0.0 < iv["p_met"] < 1.0
    assert ratio_interval(configs, "rapidkv-adaptive", BASE, 1.1) == iv
    other = ratio_interval(configs, "rapidkv-adaptive", BASE, 1.1, seed=1)
    assert other is not None and other["p_met"] != iv["p_met"]


def test_a_block_is_drawn_whole() -> None:
    # one block of all 60 requests: every resample is the run itself
    burst = {
        "rapidkv-adaptive": sweep(set(), set()),
        "dp2": sweep(set(), set(range(6))),  # 6 misses in a burst: 90 %, on the edge
        "rapidkv": sweep(set(range(60))),
    }
    whole = ratio_interval(burst, "rapidkv-adaptive", BASE, 1.1, block=60)
    assert whole is not None and whole["ratio_low"] == whole["ratio_high"] == 1.0
    assert whole["p_met"] == 0.0
    # blocks of 6: the burst is drawn 0, 1, 2... times, dp2's goodput swings
    blocks = ratio_interval(burst, "rapidkv-adaptive", BASE, 1.1, block=6)
    assert blocks is not None and blocks["goodput_interval"]["dp2"] == [2.0, 4.0]
    assert blocks["ratio_high"] == 2.0 and 0.2 < blocks["p_met"] < 0.35  # P(burst >= 2 of 10)


def test_nothing_to_resample_or_configurations_that_disagree() -> None:
    full = sweep(set())
    assert (
        ratio_interval({"rapidkv-adaptive": full, "dp2": full}, "rapidkv-adaptive", BASE, 1.1)
        is None
    )
    none = {c: {2.0: None} for c in ("rapidkv-adaptive", *BASE)}
    assert ratio_interval(none, "rapidkv-adaptive", BASE, 1.1) is None
    odd = {"rapidkv-adaptive": sweep(set(), n=60), "dp2": sweep(set(), n=40), "rapidkv": full}
    with pytest.raises(ValueError, match="requests per rate differ"):
        ratio_interval(odd, "rapidkv-adaptive", BASE, 1.1)


def test_a_zero_baseline_counts_as_an_infinite_ratio_or_is_left_out() -> None:
    nothing = sweep(set(range(60)))
    win = {"rapidkv-adaptive": sweep(set()), "dp2": nothing, "rapidkv": nothing}
    iv = ratio_interval(win, "rapidkv-adaptive", BASE, 1.1)
    assert iv is not None and iv["ratio_low"] == float("inf") and iv["p_met"] == 1.0
    lose = {"rapidkv-adaptive": nothing, "dp2": nothing, "rapidkv": nothing}
    iv = ratio_interval(lose, "rapidkv-adaptive", BASE, 1.1)
    assert iv is not None and iv["resamples_used"] == 0 and iv["ratio_low"] is None
    assert iv["p_met"] is None


def test_one_configurations_interval_uses_the_same_draws_as_the_ratio() -> None:
    configs = {
        "rapidkv-adaptive": sweep(set(), set(range(0, 60, 12)), set(range(60))),
        "dp2": sweep(set(), set(range(3, 60, 10)), set(range(60))),
        "rapidkv": sweep(set(range(60))),
    }
    iv = ratio_interval(configs, "rapidkv-adaptive", BASE, 1.1)
    assert iv is not None
    for c, expected in iv["goodput_interval"].items():
        assert goodput_interval(configs[c]) == expected
    assert goodput_interval(configs["dp2"]) == [2.0, 4.0]
    assert goodput_interval(sweep(set(), set())) == [4.0, 4.0]  # 6 not run: a miss
    assert goodput_interval({2.0: None}) is None
