"""SmolLM2's reference answers for test_pd_smollm2 and test_kv_aware, taken on
one SmolLM2 instance (float32) started once for both (`conftest`'s
`late_references` runs it beside the bf16 one)."""

from __future__ import annotations

from typing import Any

from rapidkv.harness import ServerSpec
from rapidkv.harness.client import complete_full

SMOLLM2_BLOCK = 128  # vLLM-CPU's block size
SMOLLM2_QUESTIONS = 8  # test_pd_smollm2: 4 per router variant
SMOLLM2_CHATS = 2  # test_pd_smollm2's chat requests, split
SMOLLM2_PD_TOKENS = 20  # test_pd_smollm2's MAX_TOKENS
SMOLLM2_KV_AWARE_TOKENS = 16  # test_kv_aware's MAX_TOKENS


def single_spec(cpu: int) -> ServerSpec:
    """The reference instance: stock vLLM (no connector), float32, on core `cpu`."""
    from rapidkv.models.smollm2 import ensure_smollm2

    return ServerSpec(model=ensure_smollm2("float32"), name="single-smollm2", cpus=(cpu,))


def prepare() -> dict[str, Any]:
    """What `take` asks, drawn and tokenized (in the caller's thread:
    transformers' lazy imports are not safe from two threads at once)."""
    from rapidkv.demo.workload import Chat, sharegpt_conversations, sharegpt_turns
    from rapidkv.models.smollm2 import ensure_smollm2

    model = ensure_smollm2("float32")
    chat = Chat(model)
    drawn = sharegpt_turns(chat, 400, 77, 600)
    long = [t for t in drawn if len(t.prompt_ids) >= 2 * SMOLLM2_BLOCK + 10]
    long = long[: SMOLLM2_QUESTIONS + SMOLLM2_CHATS]
    assert len(long) == SMOLLM2_QUESTIONS + SMOLLM2_CHATS
    questions = [t.prompt_ids for t in long[:SMOLLM2_QUESTIONS]]
    chats = [t.question for t in long[SMOLLM2_QUESTIONS:]]
    conversation = next(
        c
        for c in sharegpt_conversations(40, 78, 3, max_chars=500)
        if sum(len(m) for m in c[:2]) >= 800
    )

    def tokens(messages: list[str]) -> int:
        return len(chat.prompt([{"role": "user", "content": m} for m in messages]))

    # its answers too within the servers' 1,024 positions
    kv_aware_questions = next(
        c
        for c in sharegpt_conversations(300, 91, 4, max_chars=1400)
        if tokens(c[:1]) >= 2 * SMOLLM2_BLOCK + 20 and tokens(c) <= 880
    )
    return {
        "model": model,
        "chat": chat,
        "questions": questions,
        "chats": chats,
        "conversation": conversation,
        "kv_aware_questions": kv_aware_questions,
    }


def take(base_url: str, asked: dict[str, Any]) -> dict[str, Any]:
    """Every SmolLM2 (float32) answer the e2e tests compare with, taken on the
    single instance at `base_url` (`single_spec`), for what `prepare` drew:

    - "questions", "refs": ShareGPT questions of two whole blocks and more, and
      their answers (test_pd_smollm2);
    - "chats", "chat_refs": more such questions' texts, and the answers of the
      instance's chat endpoint to each as a chat (test_pd_smollm2);
    - "turns", "turn_refs": a conversation whose second turn's prompt spans
      whole blocks, each turn the history so far with that instance's answers
      through the chat template (test_pd_smollm2);
    - "kv_aware": four turns of another conversation, its first of two whole
      blocks and more, the whole within 880 tokens: their "messages",
      "prompts" and "refs" (test_kv_aware)."""
    chat, questions = asked["chat"], asked["questions"]

    def converse(questions: list[str], max_tokens: int) -> tuple[list, list, list]:
        """Each turn's messages, prompt and the single instance's answer."""
        history: list[dict[str, str]] = []
        messages, prompts, refs = [], [], []
        for question in questions:
            history.append({"role": "user", "content": question})
            messages.append(list(history))
            prompts.append(chat.prompt(history))
            refs.append(complete_full(base_url, prompts[-1], max_tokens).token_ids)
            history.append({"role": "assistant", "content": chat.text(refs[-1])})
        return messages, prompts, refs

    refs = [complete_full(base_url, q, SMOLLM2_PD_TOKENS).token_ids for q in questions]
    chat_refs = [chat_answer(base_url, q, SMOLLM2_PD_TOKENS) for q in asked["chats"]]
    _, turns, turn_refs = converse(asked["conversation"], SMOLLM2_PD_TOKENS)
    messages, prompts, kv_refs = converse(asked["kv_aware_questions"], SMOLLM2_KV_AWARE_TOKENS)
    return {
        "model": asked["model"],
        "questions": questions,
        "refs": refs,
        "chats": asked["chats"],
        "chat_refs": chat_refs,
        "turns": turns,
        "turn_refs": turn_refs,
        "kv_aware": {"messages": messages, "prompts": prompts, "refs": kv_refs},
    }


def chat_body(question: str, max_tokens: int) -> dict[str, Any]:
    """`question` as a chat client asks it, greedy, exactly `max_tokens` long."""
    return {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def chat_answer(base_url: str, question: str, max_tokens: int) -> list[int]:
    """The token ids of the chat answer to `question` at `base_url`."""
    import httpx

    r = httpx.post(
        f"{base_url}/v1/chat/completions", json=chat_body(question, max_tokens), timeout=120
    )
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]
