"""The `shared-prefix` workload of `bench goodput`: groups of users, each group
behind one long system prompt, as a seeded plan.

As llm-d's shared-prefix benchmark and SGLang's `generated-shared-prefix`
dataset: `groups` system prompts of `system_len` tokens, and every request is
its group's system prompt followed by a short question of its own
(`min_question`-`max_question` tokens), the group drawn at random per
request, asking for `min_tokens`-`max_tokens` tokens (greedy, `ignore_eos`:
exactly that many). Requests arrive at Poisson times (`arrivals`). Served
with prefix caching on, a request's system prompt is a hit on an instance
that served its group since the caches were emptied, and computed again on
one that did not: what a placement that knows what each instance holds can
use, and one blind to it cannot.

`system_len` 1024 is whole blocks both of vLLM-CPU's 128-token blocks and of
the GPU's 16: every token of a system prompt can hit. The longest request
(1024 + 60 + 32 tokens) fits the servers' `workloads.MAX_MODEL_LEN`.

`groups` 12: their system prompts (96 blocks of 128 tokens) exceed one
instance's prefix cache on SmolLM2-135M in bf16 (90 blocks in the harness's
256 MiB of KV memory) and fit two instances' (180), as llm-d's shared-prefix
benchmark sizes its groups against the fleet's caches: one instance cannot
hold every group, so where a request runs decides whether its system prompt
is a hit. With 4 groups (32 blocks) every instance held every group and no
placement could do better than any other (`docs/benchmarks/goodput.md`).

`warm_up` (32): at each rate, after the caches are emptied, the first 32
requests of a plan of `warm_up` + n are sent at that rate and not counted,
so that the n measured ones meet the caches the placement has filled (a
serving fleet's steady state) rather than 12 cold system prompts per
instance, each of which misses a TTFT SLO of a few hits' TTFT
(`requests_with_warm_up`; `bench simulate` warms the same requests).

The token ids (`prompts`): random ids, or (`--dataset sharegpt`) ShareGPT's
text cut to each length (`dataset.prompts_of_lengths`), the system prompts and
the questions from one seeded draw, so that no two of them share text.

`default_rates` (req/s) are a first guess for SmolLM2 on this machine's 2
cores, not a measurement: a cold 1024-token prefill takes about half a
second on one core, a hit about a tenth of that, 32 tokens about 1.5 s.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


@dataclass(frozen=True)
class SharedPrefixPlan:
    """Per request: its group, its question's length and its `max_tokens`."""

    groups: tuple[int, ...]
    question_lens: tuple[int, ...]
    max_tokens: tuple[int, ...]


@dataclass(frozen=True)
class SharedPrefix:
    name: str
    description: str
    groups: int
    system_len: int
    min_question: int
    max_question: int
    min_tokens: int
    max_tokens: int
    default_rates: tuple[float, ...] = ()
    quick_rates: tuple[float, ...] = ()
    salt: int = 0  # keeps the workloads' draws apart under one --seed
    warm_up: int = 0  # requests sent at each rate before the measured ones, not counted
    prefix_caching: ClassVar[bool] = True  # served with prefix caching: the point

    def __post_init__(self) -> None:
        questions = 1 <= self.min_question <= self.max_question
        if not (self.groups >= 1 and self.system_len >= 1 and questions):
            raise ValueError(f"need groups, system_len >= 1 and 1 <= min <= max questions: {self}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens: {self}")
        if self.warm_up < 0:
            raise ValueError(f"need warm_up >= 0: {self}")

    @property
    def max_len(self) -> int:
        """The longest prompt."""
        return self.system_len + self.max_question

    def seed(self, seed: int) -> int:
        """The seed of this workload's draws (groups, lengths, prompts)."""
        return seed + self.salt * 1_000_003

    def requests(self, n: int) -> int:
        """How many requests `--requests n` makes: n."""
        return n

    def requests_with_warm_up(self, n: int) -> int:
        """How many requests a plan for n measured ones draws: `warm_up` + n,
        the first `warm_up` of them the warm-up."""
        return self.warm_up + n

    def plan(self, n: int, seed: int) -> SharedPrefixPlan:
        """`n` requests drawn from `seed`: the same (n, seed) gives the same
        plan, and the first k requests of a longer plan are the plan of k."""
        rng = random.Random(self.seed(seed))
        groups, lens, tokens = [], [], []
        for _ in range(n):
            groups.append(rng.randrange(self.groups))
            lens.append(rng.randint(self.min_question, self.max_question))
            tokens.append(rng.randint(self.min_tokens, self.max_tokens))
        return SharedPrefixPlan(tuple(groups), tuple(lens), tuple(tokens))

    def prompts(self, plan: SharedPrefixPlan, texts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Each request's prompt: its group's system prompt, then its question.
        `texts`: the `groups` system prompts (`system_len` ids each), then one
        question per request (of its length), as `text_lengths` asks."""
        systems, questions = texts[: self.groups], texts[self.groups :]
        if len(questions) != len(plan.groups):
            raise ValueError(f"{len(questions)} questions for {len(plan.groups)} requests")
        return [[*systems[g], *q] for g, q in zip(plan.groups, questions, strict=True)]

    def text_lengths(self, plan: SharedPrefixPlan) -> list[int]:
        """The texts `prompts` takes: the system prompts, then the questions."""
        return [self.system_len] * self.groups + list(plan.question_lens)

    def summary(self) -> dict[str, object]:
        return {
            "description": self.description,
            "prompt_len": [self.system_len + self.min_question, self.max_len],
            "max_tokens": [self.min_tokens, self.max_tokens],
            "groups": self.groups,
            "system_len": self.system_len,
            "question_len": [self.min_question, self.max_question],
            "warm_up": self.warm_up,
            "prefix_caching": True,
        }


def shared_prefix_prompts(
    w: SharedPrefix, model_dir: Path, plan: SharedPrefixPlan, seed: int, dataset: str
) -> list[list[int]]:
    """`plan`'s prompts of token ids: random ids or ShareGPT's text (`dataset`)."""
    from rapidkv.bench.common.dataset import prompts_of_lengths

    return w.prompts(plan, prompts_of_lengths(model_dir, w.text_lengths(plan), seed, dataset))


SHARED_PREFIX = SharedPrefix(
    "shared-prefix",
    "12 groups, each a 1024-token system prompt; each request its group's (drawn) "
    "+ a 30-60-token question, 16-32 output tokens; 32 requests first at each rate, "
    "not counted",
    groups=12,
    system_len=1024,
    min_question=30,
    max_question=60,
    min_tokens=16,
    max_tokens=32,
    default_rates=(0.5, 1.0, 1.5, 2.0, 3.0, 4.0),
    quick_rates=(1.0, 4.0),
    salt=2,
    warm_up=32,
)
