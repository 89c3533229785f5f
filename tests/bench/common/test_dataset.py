"""`bench serve --dataset`: the requests every configuration of a run gets."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rapidkv.bench.common.dataset import (
    SHAREGPT_MAX_TOKENS,
    random_workload,
    sharegpt_workload,
)
from rapidkv.bench.serve.options import Options

pytestmark = pytest.mark.unit


def options(*argv: str) -> Options:
    from rapidkv.bench.serve import register

    parser = argparse.ArgumentParser()
    register(parser)
    return Options.from_args(parser.parse_args(list(argv)))


def test_the_dataset_and_its_output_length_are_options() -> None:
    assert options().dataset == "random" and options().max_tokens == 16
    sharegpt = options("--dataset", "sharegpt")
    assert sharegpt.dataset == "sharegpt" and sharegpt.max_tokens == SHAREGPT_MAX_TOKENS
    assert options("--dataset", "sharegpt", "--max-tokens", "40").max_tokens == 40
    assert "smollm2-135m" in options("--models", "smollm2-135m").models


def test_random_prompts_have_the_lengths_asked_for(tiny_model: Path) -> None:
    w = random_workload(tiny_model, 6, 20, 40, 16, seed=3)
    assert len(w.prompts) == 6 and w.max_tokens == [16] * 6
    assert all(20 <= len(p) <= 40 for p in w.prompts)
    assert w == random_workload(tiny_model, 6, 20, 40, 16, seed=3)


def test_sharegpt_prompts_are_first_questions_through_the_chat_template(
    tiny_model: Path,
) -> None:
    from transformers import AutoTokenizer

    w = sharegpt_workload(tiny_model, 8, 300, 48, seed=1)
    assert len(w.prompts) == 8 and all(4 <= len(p) <= 300 for p in w.prompts)
    assert all(4 <= n <= 48 for n in w.max_tokens)  # the answer's length, capped
    assert w == sharegpt_workload(tiny_model, 8, 300, 48, seed=1)
    text = AutoTokenizer.from_pretrained(tiny_model).decode(w.prompts[0])
    assert text.startswith("<s>user: ") and text.endswith("assistant:")  # the template
