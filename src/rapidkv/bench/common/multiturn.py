"""The `multiturn` workload of `bench goodput`: ShareGPT conversations replayed
by users who think between turns, as a seeded plan.

Each conversation is one user (`dataset.multiturn_workload`: a ShareGPT
conversation's first `turns` exchanges, whatever `--dataset` says): its first
turn arrives at a Poisson time (`arrivals.session_arrivals`: conversations
start at rate / turns per second, so that a sweep's rate stays requests per
second), and each later turn is sent a think time after the answer before it
is complete (`think_times`: drawn uniform in [think_s / 2, 3 think_s / 2] per
turn from the seed, the same at every rate and on every configuration).
A turn's prompt is the history, every earlier question with the answer the
model gave, then its question, through the chat template: `single`'s answers
in the reference pass, turn after turn (`reference.take_conversation_references`),
so that every configuration gets the same prompts. Each answer is the
dataset's length capped at `answer_cap` tokens (greedy, `ignore_eos`), and the
last turn's prompt fits in `max_len` tokens, so that the longest request fits
the servers' `workloads.MAX_MODEL_LEN`.

Served with prefix caching on, a turn's history is a hit on the instance
that served the turn before, since it holds that prompt and its answer,
and computed again elsewhere.

`--requests` counts turns, rounded up to whole conversations (`requests`).
`default_rates` (req/s) are a first guess for SmolLM2 on this machine's 2
cores, not a measurement: an answer of 64 tokens takes about 3 s to decode.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar


@dataclass(frozen=True)
class Multiturn:
    name: str
    description: str
    turns: int
    max_len: int  # the last turn's prompt, answers at their cap
    answer_cap: int  # max_tokens of a turn: the dataset's answer length, at most this
    think_s: float  # a user's mean think time between an answer and the next turn
    default_rates: tuple[float, ...] = ()
    quick_rates: tuple[float, ...] = ()
    salt: int = 0  # keeps the workloads' draws apart under one --seed
    prefix_caching: ClassVar[bool] = True  # served with prefix caching: the point

    def __post_init__(self) -> None:
        if not (self.turns >= 2 and self.max_len >= 1 and self.answer_cap >= 1):
            raise ValueError(f"need turns >= 2, max_len and answer_cap >= 1: {self}")
        if not self.think_s >= 0:
            raise ValueError(f"need think_s >= 0: {self}")

    @property
    def max_tokens(self) -> int:
        return self.answer_cap

    def seed(self, seed: int) -> int:
        """The seed of this workload's draws (conversations, think times)."""
        return seed + self.salt * 1_000_003

    def conversations(self, n: int) -> int:
        """How many conversations `--requests n` makes: n turns, rounded up."""
        return max(1, math.ceil(n / self.turns))

    def requests(self, n: int) -> int:
        """How many requests `--requests n` makes: whole conversations."""
        return self.conversations(n) * self.turns

    def follows(self, n: int) -> list[bool]:
        """Per request of `requests(n)`, conversation by conversation, turn by
        turn: whether it is sent only after the turn before it is answered."""
        return [turn > 0 for _ in range(self.conversations(n)) for turn in range(self.turns)]

    def think_times(self, n: int, seed: int) -> tuple[float, ...]:
        """Per request of `requests(n)`: 0 for a first turn, else how long its
        user thinks after the answer before it (see the module)."""
        rng = random.Random(f"{self.name}:think:{self.seed(seed)}")
        return tuple(
            rng.uniform(self.think_s / 2, 1.5 * self.think_s) if f else 0.0 for f in self.follows(n)
        )

    def summary(self) -> dict[str, object]:
        return {
            "description": self.description,
            "prompt_len": [None, self.max_len],  # the history's: known after the reference
            "max_tokens": [4, self.answer_cap],  # exchanges' answers are >= 4 tokens
            "turns": self.turns,
            "think_s": [self.think_s / 2, 1.5 * self.think_s],
            "dataset": "sharegpt conversations",
            "prefix_caching": True,
        }


def multiturn_conversations(w: Multiturn, model_dir: Path, n: int, seed: int) -> Any:
    """The `dataset.Conversations` of `requests(n)` turns, drawn with `seed`."""
    from rapidkv.bench.common.dataset import multiturn_workload

    return multiturn_workload(
        model_dir, w.requests(n), w.max_len, w.answer_cap, w.seed(seed), turns=w.turns
    )


MULTITURN = Multiturn(
    "multiturn",
    "ShareGPT conversations of 4 turns, one user each, first turns at Poisson times, each "
    "later turn 0.5-1.5 s after the answer before it; prompts the history with single's "
    "answers (<= 1024 tokens), answers <= 64 tokens",
    turns=4,
    max_len=1024,
    answer_cap=64,
    think_s=1.0,
    default_rates=(0.25, 0.5, 0.75, 1.0, 1.5, 2.0),
    quick_rates=(0.5, 2.0),
    salt=3,
)
