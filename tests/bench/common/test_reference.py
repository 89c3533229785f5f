"""`bench/common/reference.py`: how an output is classified against the
reference (match, near tie, hard mismatch) and the margins read from OpenAI
top logprobs."""

from __future__ import annotations

import math

import pytest

from rapidkv.bench.common.reference import Reference, classify, margins_from_logprobs

REF = Reference(token_ids=(5, 6, 7, 8), margins=(2.0, 0.03, 0.5, math.nan))


@pytest.mark.unit
def test_identical_output_is_a_match() -> None:
    assert classify(REF, [5, 6, 7, 8]) == "match"


@pytest.mark.unit
def test_divergence_where_the_reference_had_a_near_tie_is_a_near_tie() -> None:
    assert classify(REF, [5, 9, 1, 1]) == "near_tie"  # margin 0.03 at position 1


@pytest.mark.unit
def test_divergence_at_a_clear_margin_is_hard_even_after_a_near_tie_position() -> None:
    assert classify(REF, [9, 6, 7, 8]) == "hard"  # margin 2.0 at position 0
    assert classify(REF, [5, 6, 9, 8]) == "hard"  # margin 0.5 at position 2


@pytest.mark.unit
def test_the_margin_bound_is_inclusive_and_configurable() -> None:
    ref = Reference((1, 2), (0.05, 0.05))
    assert classify(ref, [3, 2]) == "near_tie"
    assert classify(ref, [3, 2], tie=0.01) == "hard"


@pytest.mark.unit
def test_unknown_margin_or_a_length_difference_is_hard() -> None:
    assert classify(REF, [5, 6, 7, 9]) == "hard"  # margin nan at position 3
    assert classify(REF, [5, 6, 7]) == "hard"
    assert classify(REF, [5, 6, 7, 8, 9]) == "hard"
    assert classify(REF, []) == "hard"


@pytest.mark.unit
def test_margins_are_top1_minus_top2_from_openai_top_logprobs() -> None:
    top = [{"token_id:3": -0.1, "token_id:9": -2.1}, {"token_id:4": -0.5}, None]
    m = margins_from_logprobs(top)
    assert m[0] == pytest.approx(2.0)
    assert math.isnan(m[1]) and math.isnan(m[2])
    # order of the dict does not matter
    assert margins_from_logprobs([{"a": -3.0, "b": -1.0}])[0] == pytest.approx(2.0)


@pytest.mark.unit
def test_divergence_is_where_the_output_first_differs_with_the_margin_there() -> None:
    from rapidkv.bench.common.reference import divergence

    assert divergence(REF, [5, 6, 7, 8]) is None
    assert divergence(REF, [5, 9, 7, 8]) == (1, 0.03)
    assert divergence(REF, [5, 6, 7, 1]) == (3, pytest.approx(math.nan, nan_ok=True))
    at, margin = divergence(REF, [5, 6])  # a length difference
    assert at == 2 and math.isnan(margin)


@pytest.mark.unit
def test_a_bf16_tie_is_one_or_two_representable_logits_apart() -> None:
    """bf16 logits of 16-64 are 0.125-0.25 apart: a divergence at such a margin
    is a near-tie in bf16, a hard mismatch in float32 (the token-exact oracle)."""
    from rapidkv.bench.common.reference import NEAR_TIE_MARGIN, near_tie_margin

    assert near_tie_margin("float32") == near_tie_margin("float16") == NEAR_TIE_MARGIN
    bf16 = near_tie_margin("bfloat16")
    ref = Reference(token_ids=(5, 6, 7), margins=(2.0, 0.25, 0.375))
    assert classify(ref, [5, 9, 9], bf16) == "near_tie"
    assert classify(ref, [5, 9, 9]) == "hard"
    assert classify(ref, [5, 6, 9], bf16) == "hard"  # three spacings apart: not a tie
