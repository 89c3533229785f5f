"""Byte-level BPE tokenizer trained offline on the shipped corpus.

Invariants:
- special tokens have fixed ids: `<unk>`=0, `<s>`=1 (bos), `</s>`=2 (eos);
- the vocabulary has exactly `vocab_size` entries (ValueError otherwise), so
  every id the model can emit decodes;
- encoding prepends `<s>` (post-processor), decoding is byte-level and
  round-trips any text (no normalizer, no unknown bytes);
- training is deterministic: same corpus and vocab size give the same
  `tokenizer.json` bytes;
- `untextual_token_ids` are the ids that do not decode, on their own, to
  printable text (special tokens, lone UTF-8 fragment bytes, control bytes);
  the weights make sure greedy decoding never emits them (see `weights`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS: tuple[str, ...] = (UNK, BOS, EOS)
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

# Plain-text chat format; the model is random, so the format only needs to be
# stable and parseable. Starts with bos because vLLM tokenizes chat prompts
# without adding special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train the BPE on `texts` (in order); ValueError if the corpus is too small."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"corpus yields {tok.get_vocab_size()} tokens, spec wants {vocab_size}")
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def untextual_token_ids(tok: Tokenizer) -> list[int]:
    """Sorted ids whose standalone decode is empty, not valid UTF-8, or has control chars.

    Every other id decodes to printable text (plus newline and tab) by itself,
    so any sequence of them decodes cleanly and incrementally.
    """
    bad = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=True)
        printable = all(c.isprintable() or c in "\n\t" for c in text)
        if not text or "\ufffd" in text or not printable:
            bad.append(i)
    return bad


def write_tokenizer(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    added = {
        str(i): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, name in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "added_tokens_decoder": added,
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(
        out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    )


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
