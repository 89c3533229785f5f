"""The requests a `bench serve` run sends, the same for every configuration.

- ``random`` (default): `--requests` prompts of random token ids, lengths
  uniform in [--min-len, --max-len], each asking for `--max-tokens` tokens;
- ``sharegpt``: vLLM's ``sharegpt`` sampling of the packaged ShareGPT
  (`rapidkv.data.sharegpt.single_turn`): each conversation's first question
  through the model's chat template, prompts of at most --max-len tokens, the
  first answer's length in tokens as the output length, capped at
  --max-tokens (a CPU decodes a few dozen tokens a second: uncapped, one
  answer of 1,000 tokens takes most of a minute).

Seeded by --seed. With ``ignore_eos`` (as every `bench serve` request) each
request yields exactly its output length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from rapidkv.harness.server import ServerSpec

DATASETS = ("random", "sharegpt")
SHAREGPT_MAX_TOKENS = 128  # --max-tokens' default for sharegpt: the cap on an answer
MAX_MODEL_LEN: int = ServerSpec.__dataclass_fields__["max_model_len"].default  # the servers'


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]  # one per prompt


def random_lengths(requests: int, min_len: int, max_len: int, seed: int) -> list[int]:
    """`requests` prompt lengths, uniform in [min_len, max_len], seeded."""
    rng = random.Random(seed)
    return [rng.randint(min_len, max_len) for _ in range(requests)]


def random_workload(model_dir: Path, requests: int, min_len: int, max_len: int,
                    max_tokens: int, seed: int) -> Workload:  # fmt: skip
    from rapidkv.harness import random_prompts

    prompts = random_prompts(model_dir, random_lengths(requests, min_len, max_len, seed), seed=seed)
    return Workload(prompts, [max_tokens] * requests)


def sharegpt_workload(
    model_dir: Path, requests: int, max_len: int, max_tokens: int, seed: int
) -> Workload:
    """ShareGPT's first turns (see the module); fewer than `requests` raises."""
    from transformers import AutoTokenizer

    from rapidkv.data.sharegpt import load, single_turn

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def chat_ids(messages: list[dict[str, str]]) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def text_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    chosen = single_turn(
        load().conversations,
        requests,
        seed,
        chat_ids,
        text_tokens,
        max_prompt_len=max_len,
        max_total_len=MAX_MODEL_LEN,
    )
    if len(chosen) < requests:
        raise ValueError(f"ShareGPT has only {len(chosen)} requests within the length limits")
    return Workload([r.prompt_ids for r in chosen], [min(r.max_tokens, max_tokens) for r in chosen])
