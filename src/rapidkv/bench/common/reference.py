"""The token-exact check: every output against the reference of its prompt.

The reference is the `single` instance's greedy output with `logprobs: 2`
(`take_references`): its tokens and, per position, the margin between its two
most likely tokens. A mismatch is a *near-tie* when, at the first position
where the two differ, the reference's top-2 logprob margin is at most
`NEAR_TIE_MARGIN` (two candidates so close that a different batch shape or
summation order may legitimately pick the other one); any other difference,
including a missing or extra token, is *hard*.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

NEAR_TIE_MARGIN = 0.05
"""Largest top-2 logprob margin at the first divergence that makes a mismatch a near-tie."""

Verdict = Literal["match", "near_tie", "hard"]


@dataclass(frozen=True)
class Reference:
    """The reference output of one prompt: its tokens and, per position, the
    margin between the reference's two most likely tokens (nan where unknown)."""

    token_ids: tuple[int, ...]
    margins: tuple[float, ...]

    def prefix(self, n: int) -> Reference:
        """The reference of the same prompt for `max_tokens=n` (greedy with
        `ignore_eos`: the first n tokens of a longer output)."""
        return Reference(self.token_ids[:n], self.margins[:n])


def classify(
    reference: Reference, token_ids: Sequence[int], tie: float = NEAR_TIE_MARGIN
) -> Verdict:
    """Compare one output with its reference (see module docstring)."""
    ref = reference.token_ids
    got = tuple(token_ids)
    if got == ref:
        return "match"
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            margin = reference.margins[i] if i < len(reference.margins) else math.nan
            return "near_tie" if margin <= tie else "hard"  # nan compares False: hard
    return "hard"  # one is a strict prefix of the other: a length difference


def margins_from_logprobs(top_logprobs: Sequence[Mapping[str, float] | None]) -> tuple[float, ...]:
    """Per position, top-1 minus top-2 logprob, from an OpenAI completions
    `logprobs.top_logprobs` list (requested with `logprobs >= 2`); nan where a
    position lists fewer than two candidates."""
    out = []
    for entry in top_logprobs:
        values = sorted((entry or {}).values(), reverse=True)
        out.append(values[0] - values[1] if len(values) >= 2 else math.nan)
    return tuple(out)


def take_references(
    url: str, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int], timeout: float
) -> list[Reference]:
    """Every prompt once on `url` (`single`), greedy with `logprobs: 2`, 4 at a
    time: each output's tokens and top-2 margins."""
    from rapidkv.harness import complete_many_full

    done = complete_many_full(
        url,
        prompts,
        max_tokens,
        concurrency=4,
        timeout=timeout,
        logprobs=2,
        return_tokens_as_token_ids=True,
    )
    refs = []
    for c in done:
        top = (c.raw["choices"][0].get("logprobs") or {}).get("top_logprobs") or []
        refs.append(Reference(tuple(c.token_ids), margins_from_logprobs(top)))
    return refs
