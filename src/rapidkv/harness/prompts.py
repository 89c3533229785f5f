"""Deterministic token-id prompts for a model directory.

Invariant: every id returned is a regular (non-special) token that both the
model's embedding (`config.json` `vocab_size`) and its tokenizer know, so vLLM
accepts the prompt and no id ends or restarts a sequence by accident, and that
decodes alone to printable text (a random-weight test model's `text_token_ids`;
for any other model, what its tokenizer decodes without a replacement
character), so that a prompt of them decodes cleanly. The same (model, seed, lengths) always gives
the same prompts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=16)
def prompt_vocab(model_dir: Path) -> tuple[int, ...]:
    """Sorted token ids usable in prompts for the model at `model_dir`."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    limit = int(config["vocab_size"])
    special = {config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    tok_file = model_dir / "tokenizer.json"
    if tok_file.exists():
        tok = json.loads(tok_file.read_text())
        vocab = tok.get("model", {}).get("vocab", {})
        ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
        special |= {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    else:
        ids = set(range(limit))
    stamp = model_dir / "rapidkv_model.json"
    if stamp.exists() and "suppressed_token_ids" in json.loads(stamp.read_text()):
        # A random-weight test model knows which ids decode cleanly on their own.
        from rapidkv.models import text_token_ids

        ids &= set(text_token_ids(model_dir))
    elif tok_file.exists():
        ids &= _printable_ids(model_dir, ids)
    usable = tuple(sorted(i for i in ids if 0 <= i < limit and i not in special))
    if len(usable) < 2:
        raise ValueError(f"{model_dir}: fewer than 2 usable prompt token ids")
    return usable


def random_prompts(model_dir: Path, lengths: Sequence[int], *, seed: int = 0) -> list[list[int]]:
    """One prompt per entry of `lengths`, of exactly that many ids, drawn with `seed`."""
    vocab = prompt_vocab(Path(model_dir))
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(n)] for n in lengths]


def _printable_ids(model_dir: Path, ids: set[int]) -> set[int]:
    """The ids the model's tokenizer decodes, alone, to printable text (no
    replacement character: a byte-level BPE token holding part of a UTF-8
    character decodes to one)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = set()
    for i in ids:
        text = tokenizer.decode([i])
        if text and "\ufffd" not in text and text.isprintable():
            out.add(i)
    return out
