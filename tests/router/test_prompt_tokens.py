"""`PromptTokens`: a request's prompt as token ids, as vLLM's server makes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapidkv.router.prompt_tokens import PromptTokens

pytestmark = pytest.mark.unit

MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from rapidkv.models.smollm2 import ensure_smollm2

    return ensure_smollm2("float32")


def test_token_id_prompts_need_no_tokenizer() -> None:
    tokens = PromptTokens()
    assert tokens.ids({"prompt": [5, 6, 7]}, "completions") == [5, 6, 7]
    assert tokens.ids({"prompt": "text"}, "completions") is None  # no tokenizer
    assert tokens.ids({"prompt": [[1, 2], [3]]}, "completions") is None  # a batch
    assert tokens.ids({"messages": MESSAGES}, "chat") is None


def test_text_and_chat_are_tokenized_as_the_model_s_template_says(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(smollm2))
    tokens = PromptTokens(smollm2)
    text = "The quick brown fox"
    assert tokens.ids({"prompt": text}, "completions") == reference.encode(text)
    assert tokens.ids({"prompt": text, "add_special_tokens": False}, "completions") == (
        reference.encode(text, add_special_tokens=False)
    )
    chat = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokens.ids({"messages": MESSAGES}, "chat")
    assert ids == reference.encode(chat, add_special_tokens=False)
    assert reference.decode(ids).endswith("<|im_start|>assistant\n")
    without = tokens.ids({"messages": MESSAGES, "add_generation_prompt": False}, "chat")
    assert without is not None and ids[: len(without)] == without and len(without) < len(ids)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": MESSAGES, "chat_template": "{{ messages }}"},
        {"messages": []},
        {"messages": MESSAGES, "chat_template_kwargs": "nope"},
    ],
)
def test_what_it_cannot_render_as_vllm_does_is_none(smollm2: Path, body: dict) -> None:
    assert PromptTokens(smollm2).ids(body, "chat") is None


def test_a_directory_that_is_no_tokenizer_gives_none(tmp_path: Path) -> None:
    tokens = PromptTokens(tmp_path)
    assert tokens.ids({"prompt": "text"}, "completions") is None
    assert tokens.ids({"prompt": [1, 2]}, "completions") == [1, 2]
    offered = PromptTokens()
    offered.offer(tmp_path / "absent")
    assert offered.path is None
    offered.offer(tmp_path)
    assert offered.path == tmp_path
