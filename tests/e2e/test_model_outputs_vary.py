"""The tiny float32 test model, loaded with HF transformers (no server).

Greedy decoding must depend on the prompt: if every prompt produced the same
text, or one token repeated, "disaggregated output == single instance" would
prove nothing. Also checks the tokenizer files load with `AutoTokenizer`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidkv.models import ensure_model, text_token_ids
from rapidkv.models.tokenizer import BOS_ID

pytestmark = pytest.mark.e2e

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def hf_model() -> tuple[Any, Any, Path]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_model("tiny", "float32")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    model.eval()
    return tok, model, path


def _greedy(model: Any, ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy continuation of `ids` and the top-2 logit margin at each step."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    new = out.sequences[0, len(ids) :].tolist()
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return new, margins


def test_model_is_float32_llama(hf_model: tuple[Any, Any, Path]) -> None:
    _, model, _ = hf_model
    assert model.config.model_type == "llama"
    assert model.dtype == torch.float32
    assert model.config.num_hidden_layers == 4


def test_greedy_outputs_vary_with_the_prompt(hf_model: tuple[Any, Any, Path]) -> None:
    _, model, path = hf_model
    rng = random.Random(7)
    ok = text_token_ids(path)
    prompts = [[BOS_ID] + [rng.choice(ok) for _ in range(rng.randint(8, 40))] for _ in range(8)]
    outputs, margins = [], []
    for ids in prompts:
        new, m = _greedy(model, ids)
        assert len(new) == NEW_TOKENS
        assert len(set(new)) >= 3, f"degenerate greedy output {new}"
        assert set(new) <= set(ok), "generated a special or non-text token"
        outputs.append(tuple(new))
        margins.extend(m)
    assert len(set(outputs)) == len(outputs), "different prompts gave the same output"
    # Greedy is deterministic: the same prompt again gives the same tokens.
    assert tuple(_greedy(model, prompts[0])[0]) == outputs[0]
    # Decisions are not float32 near-ties: rounding noise is ~1e-5, margins far above.
    margins.sort()
    assert margins[0] > 1e-4
    assert margins[len(margins) // 2] > 0.05


def test_tokenizer_loads_with_autotokenizer(hf_model: tuple[Any, Any, Path]) -> None:
    tok, _, _ = hf_model
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert len(tok) == 2048
    text = "The old harbour was quiet at dawn, and Nadia walked to the lighthouse."
    ids = tok(text).input_ids
    assert ids[0] == BOS_ID
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s>user: hello there\nassistant:"
    # vLLM tokenizes a rendered chat without special tokens: exactly one bos.
    chat_ids = tok(chat, add_special_tokens=False).input_ids
    assert chat_ids[0] == BOS_ID and chat_ids.count(BOS_ID) == 1


def test_text_prompts_continue_differently(hf_model: tuple[Any, Any, Path]) -> None:
    tok, model, _ = hf_model
    texts = ["The old harbour was quiet at dawn.", "Copper wire conducts electricity."]
    outs = [_greedy(model, tok(t).input_ids)[0] for t in texts]
    assert outs[0] != outs[1]
    decoded = [tok.decode(o) for o in outs]
    assert all(d.strip() and "\ufffd" not in d for d in decoded)
