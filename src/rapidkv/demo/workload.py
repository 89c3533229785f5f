"""What the demo sends: questions a user recognises (SmolLM2 and ShareGPT) or,
on the tiny test model, random token-id prompts.

A `Turn` is one request: its prompt's token ids (chat template applied) and, for
printing, the question. Conversations are built turn by turn by the caller: a
turn's prompt is the history so far (the answers the model gave included)
through the chat template (`chat_prompt`), as a chat client sends it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Turn:
    prompt_ids: list[int]
    question: str | None  # None: a random token-id prompt


class Chat:
    """The model's tokenizer: chat template in, token ids out, and back to text."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)).strip()


def sharegpt_turns(chat: Chat, count: int, seed: int, max_prompt: int) -> list[Turn]:
    """`count` first questions of ShareGPT conversations (vLLM's sampling)."""
    from rapidkv.data.sharegpt import load, single_turn

    loaded = load(limit=4000)  # plenty, and quick to read
    chosen = single_turn(
        loaded.conversations,
        count,
        seed,
        chat.prompt,
        chat.tokens,
        max_prompt_len=max_prompt,
    )
    by_id = {c.id: c for c in loaded.conversations}
    out = []
    for r in chosen:
        question = next(t.text for t in by_id[r.conversation].turns if t.role == "user")
        out.append(Turn(r.prompt_ids, question))
    return out


def sharegpt_conversations(count: int, seed: int, turns: int, max_chars: int) -> list[list[str]]:
    """`count` conversations' first `turns` user messages, each under `max_chars`."""
    from rapidkv.data.sharegpt import load, multi_turn

    pool = multi_turn(load(limit=4000).conversations, 50 * count, seed, min_turns=turns)
    short = [c[:turns] for c in pool if all(len(m) <= max_chars for m in c[:turns])]
    return short[:count]


def random_turns(model_dir: Path, count: int, seed: int) -> list[Turn]:
    from rapidkv.harness import random_prompts

    lengths = [20, 127, 128, 300, 513, 900]
    prompts = random_prompts(
        model_dir, [lengths[i % len(lengths)] for i in range(count)], seed=seed
    )
    return [Turn(p, None) for p in prompts]
