"""`bench goodput`'s workloads of shared prefixes as simulated requests: the
same requests for the same seed, with what their prompts are made of.

- `shared-prefix` (`common.shared_prefix`): `SharedPrefix.plan` draws each
  request's group, question length and output length, as `bench goodput`
  does; a prompt is its group's system prompt (segment ``(SYSTEM, g)``,
  `system_len` tokens, shared by the group) then its own question (``(QUESTION,
  k)``). The token ids do not matter to the model, only which prompts share
  which tokens: random ids or ShareGPT text give the same segments.
- `multiturn` (`common.multiturn`): the conversations `bench goodput` draws
  (`data.sharegpt.exchanges` with its seed, its turns and its length bound,
  `dataset.multiturn_workload`'s), each turn's answer as long as its
  `max_tokens` (the dataset's answer length, capped: `ignore_eos` makes it
  exactly that). Turn ``t``'s prompt is the chat template over the history:
  ``U_0 A_0 U_1 A_1 ... U_t``, where ``U_k`` (``(TURN, c, k)``) is the k-th
  question with its template tokens (for ``k > 0`` with the end of the answer
  before it) and ``A_k`` (``(ANSWER, c, k)``) the k-th answer; the request's
  output is ``A_t``. So a turn's prompt begins with the turn before it and
  that turn's answer (vLLM caches the full blocks of generated tokens too),
  as it does in a real run when the answer's text tokenizes back to the
  tokens generated (assumed). Every turn after the first follows the one
  before it, `Multiturn.think_times` later.

Token counts (`tokens_for`): the question's tokens and the template's come
from a tokenizer: ``auto`` (SmolLM2's, when its checkpoint is built here:
the model of the real runs, so the same conversations as theirs), a
checkpoint directory, or ``chars`` (no tokenizer: `CHARS_PER_TOKEN` characters
a token and SmolLM2's template sizes, `SMOLLM2_TEMPLATE`; the conversations
drawn may then differ from a real run's, as their lengths decide which fit).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rapidkv.bench.common.multiturn import Multiturn
from rapidkv.bench.common.shared_prefix import SharedPrefix
from rapidkv.bench.simulate.workload import Spec

SYSTEM, QUESTION, TURN, ANSWER = 1, 2, 3, 4  # segment kinds
CHARS_PER_TOKEN = 4
SMOLLM2_TEMPLATE = (30, 11)  # template tokens of a first turn, and of each later exchange


@dataclass(frozen=True)
class Tokens:
    """How `multiturn`'s texts are counted: `text_tokens(text)`; `first`, the
    template's tokens around a conversation's first question (system prompt,
    the user turn, the generation prompt); `later`, those each later exchange
    adds besides its answer and question (the answer's end, the user turn,
    the generation prompt)."""

    name: str
    text_tokens: Callable[[str], int]
    first: int
    later: int


def shared_prefix_specs(w: SharedPrefix, count: int, seed: int) -> list[Spec]:
    """`count` requests of `w`, seeded (the module docstring)."""
    plan = w.plan(count, seed)
    return [
        Spec(
            w.system_len + q,
            out,
            (((SYSTEM, g), w.system_len), ((QUESTION, k), q)),
        )
        for k, (g, q, out) in enumerate(
            zip(plan.groups, plan.question_lens, plan.max_tokens, strict=True)
        )
    ]


def multiturn_specs(w: Multiturn, count: int, seed: int, tokenizer: str = "auto") -> list[Spec]:
    """`w.requests(count)` requests of `w`, seeded, conversation by conversation,
    turn by turn (the module docstring)."""
    return list(_multiturn(w, count, seed, tokenizer))


@functools.lru_cache(maxsize=16)
def _multiturn(w: Multiturn, count: int, seed: int, tokenizer: str) -> tuple[Spec, ...]:
    tokens = tokens_for(tokenizer)
    chosen = conversations(w, count, seed, tokens)
    think = w.think_times(count, seed)
    specs: list[Spec] = []
    for c, exchanges in enumerate(chosen):
        content: list[tuple[tuple[int, ...], int]] = []
        for t, e in enumerate(exchanges):
            wrap = tokens.first if t == 0 else tokens.later
            content.append(((TURN, c, t), tokens.text_tokens(e.question) + wrap))
            answer = min(e.answer_tokens, w.answer_cap)
            k = len(specs)
            specs.append(
                Spec(
                    sum(n for _, n in content),
                    answer,
                    tuple(content),
                    (ANSWER, c, t),
                    follows=t > 0,
                    think_ms=think[k] * 1000.0,
                )
            )
            content.append(((ANSWER, c, t), answer))
    return tuple(specs)


def conversations(w: Multiturn, count: int, seed: int, tokens: Tokens) -> list[list]:
    """The conversations of `w.requests(count)` turns `bench goodput` draws
    (`dataset.multiturn_workload`'s draw, counted by `tokens`); too few raises."""
    from rapidkv.bench.common.dataset import TEMPLATE_TOKENS
    from rapidkv.data.sharegpt import Exchange, exchanges, load

    text_tokens = tokens.text_tokens

    def fits(chosen: list[Exchange]) -> bool:  # dataset.multiturn_workload's bound
        questions = sum(text_tokens(e.question) + TEMPLATE_TOKENS for e in chosen)
        answers = sum(min(e.answer_tokens, w.answer_cap) + TEMPLATE_TOKENS for e in chosen[:-1])
        return questions + answers <= w.max_len

    wanted = w.requests(count) // w.turns
    chosen = exchanges(load().conversations, wanted, w.seed(seed), w.turns, text_tokens, fits=fits)
    if len(chosen) < wanted:
        raise ValueError(f"ShareGPT has only {len(chosen)} conversations within the length limits")
    return chosen


@functools.lru_cache(maxsize=4)
def tokens_for(tokenizer: str = "auto") -> Tokens:
    """`Tokens` for ``auto``, ``chars`` or a checkpoint directory (the module docstring)."""
    if tokenizer == "chars":
        return Tokens("chars", _chars, *SMOLLM2_TEMPLATE)
    if tokenizer == "auto":
        found = smollm2_dir()
        return tokens_for(str(found)) if found is not None else tokens_for("chars")
    from rapidkv.bench.common.dataset import chat_tokenizer

    chat_ids, text_tokens = chat_tokenizer(Path(tokenizer))
    user, assistant = {"role": "user", "content": ""}, {"role": "assistant", "content": ""}
    first = len(chat_ids([user]))
    later = len(chat_ids([user, assistant, user])) - first
    return Tokens(str(tokenizer), text_tokens, first, later)


def smollm2_dir() -> Path | None:
    """SmolLM2's bf16 checkpoint (the real runs' model) when it is built here, else None."""
    try:
        from rapidkv.models.smollm2 import smollm2_path

        path = smollm2_path("bfloat16")
    except Exception:  # the package or its GGUF missing: no tokenizer here
        return None
    return path if (path / "tokenizer.json").is_file() else None


def _chars(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))
