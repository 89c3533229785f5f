"""The prompts the benchmarks send, the same for every configuration of a run.

- ``random`` (default): `--requests` prompts of random token ids, lengths
  uniform in [--min-len, --max-len], each asking for `--max-tokens` tokens;
- ``sharegpt``: vLLM's ``sharegpt`` sampling of the packaged ShareGPT
  (`rapidkv.data.sharegpt.single_turn`): each conversation's first question
  through the model's chat template, prompts of at most --max-len tokens, the
  first answer's length in tokens as the output length, capped at
  --max-tokens (a CPU decodes a few dozen tokens a second: uncapped, one
  answer of 1,000 tokens takes most of a minute);
- ``sharegpt-multiturn``: whole conversations (`Conversations`): each turn's
  prompt is the history so far through the chat template, with the answers
  the model gave (the reference pass on `single` asks turn after turn, and
  every configuration then gets those same prompts); a conversation's next
  turn is sent when its previous answer is complete. `--requests` counts
  turns (`TURNS` per conversation); each answer's length is the dataset's,
  capped at --max-tokens, and the last turn's prompt fits in --max-len
  (`bench goodput`'s `multiturn` workload, `multiturn`, replays the same
  conversations, longer, by users who think between turns).

The benchmarks whose variable is the prompt length (`goodput`, `chaos`,
`migrate`) take prompts of given lengths (`prompts_of_lengths`): random token
ids, or ShareGPT's conversations as text (every turn, in order), cut to each
length: real text where only the length is chosen (`goodput`'s
`shared-prefix` cuts its system prompts and questions so).

Seeded by --seed. With ``ignore_eos`` (as every `bench serve` request) each
request yields exactly its output length.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rapidkv.harness.server import ServerSpec

DATASETS = ("random", "sharegpt", "sharegpt-multiturn")
TURNS = 3  # sharegpt-multiturn: turns per conversation
TEMPLATE_TOKENS = 12  # a chat template's tokens around one message (SmolLM2's: 5), a bound
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


def chat_tokenizer(
    model_dir: Path,
) -> tuple[Callable[[list[dict[str, str]]], list[int]], Callable[[str], int]]:
    """The model's chat template as token ids (with the generation prompt) and
    a text's length in tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def chat_ids(messages: list[dict[str, str]]) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def text_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return chat_ids, text_tokens


def sharegpt_workload(
    model_dir: Path, requests: int, max_len: int, max_tokens: int, seed: int
) -> Workload:
    """ShareGPT's first turns (see the module); fewer than `requests` raises."""
    from rapidkv.data.sharegpt import load, single_turn

    chat_ids, text_tokens = chat_tokenizer(model_dir)

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


@dataclass
class Conversations:
    """`sharegpt-multiturn`'s conversations: their questions, each answer's
    length, and each turn's prompt once the answers before it are known."""

    exchanges: list[list[Any]]  # data.sharegpt.Exchange, TURNS per conversation
    max_tokens: list[int]  # per request, conversation by conversation, turn by turn
    chat_ids: Callable[[list[dict[str, str]]], list[int]]

    @property
    def turns(self) -> int:
        return len(self.exchanges[0])

    def prompt(self, conversation: int, turn: int, answers: Sequence[str]) -> list[int]:
        """Turn `turn`'s prompt: every earlier question with its answer (`answers`,
        as the model gave them), then the turn's question, through the template."""
        said = self.exchanges[conversation]
        messages = []
        for k in range(turn):
            messages.append({"role": "user", "content": said[k].question})
            messages.append({"role": "assistant", "content": answers[k]})
        messages.append({"role": "user", "content": said[turn].question})
        return self.chat_ids(messages)

    def follows(self) -> list[bool]:
        """Per request: whether it is sent only once the request before it has its answer."""
        return [turn > 0 for _ in self.exchanges for turn in range(self.turns)]


def multiturn_workload(
    model_dir: Path, requests: int, max_len: int, max_tokens: int, seed: int, turns: int = TURNS
) -> Conversations:
    """`requests // turns` ShareGPT conversations of `turns` turns (see the
    module; `bench goodput`'s `multiturn` asks for more turns); too few raises."""
    from rapidkv.data.sharegpt import Exchange, exchanges, load

    chat_ids, text_tokens = chat_tokenizer(model_dir)

    def fits(chosen: list[Exchange]) -> bool:  # the last turn's prompt, answers at their cap
        questions = sum(text_tokens(e.question) + TEMPLATE_TOKENS for e in chosen)
        answers = sum(min(e.answer_tokens, max_tokens) + TEMPLATE_TOKENS for e in chosen[:-1])
        return questions + answers <= max_len

    count = requests // turns
    chosen = exchanges(load().conversations, count, seed, turns, text_tokens, fits=fits)
    if len(chosen) < count:
        raise ValueError(f"ShareGPT has only {len(chosen)} conversations within the length limits")
    caps = [min(e.answer_tokens, max_tokens) for c in chosen for e in c]
    return Conversations(chosen, caps, chat_ids)


def prompts_of_lengths(
    model_dir: Path, lengths: Sequence[int], seed: int, dataset: str = "random"
) -> list[list[int]]:
    """One prompt per length: random token ids, or (`sharegpt`) ShareGPT text
    (conversations shuffled with `seed`, each one's turns joined, as many as a
    length needs) tokenized and cut to that length."""
    if dataset == "random":
        from rapidkv.harness import random_prompts

        return random_prompts(model_dir, list(lengths), seed=seed)
    if dataset != "sharegpt":
        raise ValueError(f"prompts of given lengths: random or sharegpt, not {dataset!r}")
    from transformers import AutoTokenizer

    from rapidkv.data.sharegpt import load

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = list(load(limit=4000).conversations)
    random.Random(f"text:{seed}").shuffle(conversations)
    texts = ("\n\n".join(t.text for t in c.turns) for c in conversations)
    out = []
    for n in lengths:
        ids: list[int] = []
        while len(ids) < n:
            ids += tokenizer.encode(next(texts), add_special_tokens=False)
        out.append(ids[:n])
    return out
