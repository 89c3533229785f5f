"""The token-exact check: every output against the reference of its prompt.

The reference is the `single` instance's greedy output with `logprobs: 2`
(`take_references`): its tokens and, per position, the margin between its two
most likely tokens. A mismatch is a *near-tie* when, at the first position
where the two differ, the reference's top-2 logprob margin is at most the
model's dtype's `near_tie_margin` (two candidates so close that a different
batch shape or summation order may legitimately pick the other one); any other
difference, including a missing or extra token, is *hard*.

The margin is a difference of two logits (the log-softmax's normaliser cancels),
so in bf16 it is a multiple of the logits' spacing: bf16 carries 8 significant
bits, and a real model's top logits of 16-32 are 0.125 apart, of 32-64 0.25.
Two candidates one or two representable values apart are tied at bf16's
resolution: which one wins depends on rounding, i.e. on batch shape and
summation order. On SmolLM2-135M in bf16, one vLLM instance diverged from its
own reference (the same prompts in other batches) on 6 of 16 ShareGPT
questions, at margins of exactly 0.125 and 0.25, and every configuration
diverged at the same ones; hence 0.25 for bf16. In float32 (the correctness
oracle, token-exact) and float16 (10 significant bits) a tie is within 0.05.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

NEAR_TIE_MARGIN = 0.05
"""Largest top-2 logprob margin at the first divergence that makes a mismatch a
near-tie, in float32 and float16."""
NEAR_TIE_MARGINS = {"bfloat16": 0.25}
"""The dtypes whose near-tie margin is another (see the module docstring)."""


def near_tie_margin(dtype: str) -> float:
    """The near-tie margin for a model served in `dtype` (vLLM's spelling)."""
    return NEAR_TIE_MARGINS.get(dtype, NEAR_TIE_MARGIN)


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
    found = divergence(reference, token_ids)
    if found is None:
        return "match"
    _, margin = found
    return "near_tie" if margin <= tie else "hard"  # nan compares False: hard


def divergence(reference: Reference, token_ids: Sequence[int]) -> tuple[int, float] | None:
    """Where an output first differs from its reference, and the reference's
    top-2 margin there (nan where unknown, and for a length difference: one is
    a strict prefix of the other); None when they are equal."""
    ref, got = reference.token_ids, tuple(token_ids)
    if got == ref:
        return None
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            return i, reference.margins[i] if i < len(reference.margins) else math.nan
    return min(len(ref), len(got)), math.nan


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
    return [ref for ref, _ in _answers(url, prompts, max_tokens, timeout)]


def take_conversation_references(
    url: str, conversations: Any, timeout: float
) -> tuple[list[list[int]], list[Reference]]:
    """`dataset.Conversations` turn after turn on `url` (`single`), as
    `take_references` does: turn k's prompts are made from the answers of
    turns before it (their text, as a chat client keeps it). The prompts and
    references, conversation by conversation, turn by turn."""
    n, turns = len(conversations.exchanges), conversations.turns
    answers: list[list[str]] = [[] for _ in range(n)]
    prompts: list[list[int]] = [[] for _ in range(n * turns)]
    refs: list[Reference | None] = [None] * (n * turns)
    for turn in range(turns):
        index = [c * turns + turn for c in range(n)]
        asked = [conversations.prompt(c, turn, answers[c]) for c in range(n)]
        caps = [conversations.max_tokens[i] for i in index]
        for c, (ref, text) in enumerate(_answers(url, asked, caps, timeout)):
            prompts[index[c]], refs[index[c]] = asked[c], ref
            answers[c].append(text)
    assert all(r is not None for r in refs)
    return prompts, refs  # type: ignore[return-value]


def _answers(
    url: str, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int], timeout: float
) -> list[tuple[Reference, str]]:
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
    out = []
    for c in done:
        choice = c.raw["choices"][0]
        top = (choice.get("logprobs") or {}).get("top_logprobs") or []
        out.append((Reference(tuple(c.token_ids), margins_from_logprobs(top)), choice["text"]))
    return out
