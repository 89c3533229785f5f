"""The request length workloads of `bench goodput` and `bench simulate`, as seeded plans.

Each request has a prompt length (uniform in [min_len, max_len]) and its own
`max_tokens` (uniform in [min_tokens, max_tokens]); requests are greedy with
`ignore_eos` (`rapidkv.harness.client`), so each yields exactly `max_tokens`
tokens and TPOT is measured over the same number of tokens on every
configuration.

- `prefill-heavy`: prompts 128-900 tokens, 16 output tokens: `bench serve`'s
  workload (with the same seed, the same prompt lengths as `bench serve`'s);
- `chat`: prompts 100-900 tokens, 32-256 output tokens.

The longest request (900 + 256 tokens) is past the 1024-token context the
harness gives every server, so the benchmark starts every server with
`--max-model-len` `MAX_MODEL_LEN` (the tiny model knows 2048 positions).

`bench goodput` sweeps two more, whose requests share prefixes and need
prefix caching: `shared_prefix` and `multiturn`. This module's two need
none (`prefix_caching`): they send the same prompts again at every rate, so a
run of them alone serves them without; in a run with the others, every
server's cache is emptied before every rate.

`default_rates` are the sweep (req/s) each workload gets without `--rates`,
picked from what `single` sustained within the default SLOs on this
machine's 2 cores (a first run, 24 requests per rate: goodput 3 req/s on
prefill-heavy, 1 on chat; the TPOT SLO binds first), up to about 3-5x that.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

MAX_MODEL_LEN = 1280


@dataclass(frozen=True)
class Plan:
    """The requests of one workload: a prompt length and a `max_tokens` each."""

    prompt_lens: tuple[int, ...]
    max_tokens: tuple[int, ...]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    min_len: int
    max_len: int
    min_tokens: int
    max_tokens: int
    default_rates: tuple[float, ...] = ()  # `bench goodput`'s sweep
    quick_rates: tuple[float, ...] = ()
    salt: int = 0  # keeps the workloads' draws apart under one --seed (0: serve's draws)
    prefix_caching: ClassVar[bool] = False  # nothing shared: caching would measure the cache

    def __post_init__(self) -> None:
        prompts = 1 <= self.min_len <= self.max_len
        if not (prompts and 1 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"need 1 <= min <= max for prompts and outputs: {self}")

    def seed(self, seed: int) -> int:
        """The seed of this workload's draws (prompt lengths, max_tokens, prompts)."""
        return seed + self.salt * 1_000_003

    def requests(self, n: int) -> int:
        """How many requests `--requests n` makes: n."""
        return n

    def plan(self, n: int, seed: int) -> Plan:
        """`n` requests, drawn from `seed`: the same (n, seed) gives the same plan,
        and the first k requests of a longer plan are the plan of k. A fixed
        `max_tokens` draws nothing: the prompt lengths are then `bench serve`'s
        (`serve.run.prompt_lengths`) for the same seed."""
        rng = random.Random(self.seed(seed))
        lens, tokens = [], []
        for _ in range(n):
            lens.append(rng.randint(self.min_len, self.max_len))
            if self.min_tokens == self.max_tokens:
                tokens.append(self.max_tokens)
            else:
                tokens.append(rng.randint(self.min_tokens, self.max_tokens))
        return Plan(tuple(lens), tuple(tokens))

    def spread(self, n: int, seed: int) -> Plan:
        """`n` requests whose prompts are evenly spread over the workload's range
        (the k-th at quantile (k + 1/2) / n) and `max_tokens` drawn, in a seeded
        order: a sample without a sample's noise in its median."""
        rng = random.Random(f"{self.name}:spread:{seed}")
        width = self.max_len - self.min_len
        pairs = [
            (
                self.min_len + round(width * (k + 0.5) / n),
                rng.randint(self.min_tokens, self.max_tokens),
            )
            for k in range(n)
        ]
        rng.shuffle(pairs)
        return Plan(tuple(p for p, _ in pairs), tuple(t for _, t in pairs))

    def summary(self) -> dict[str, object]:
        return {
            "description": self.description,
            "prompt_len": [self.min_len, self.max_len],
            "max_tokens": [self.min_tokens, self.max_tokens],
        }


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "prefill-heavy",
            "prompts 128-900 tokens, 16 output tokens (bench serve's workload)",
            128,
            900,
            16,
            16,
            default_rates=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0),
            quick_rates=(2.0, 8.0),
            salt=0,
        ),
        Workload(
            "chat",
            "prompts 100-900 tokens, 32-256 output tokens",
            100,
            900,
            32,
            256,
            default_rates=(0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0),
            quick_rates=(1.0, 4.0),
            salt=1,
        ),
    )
}
