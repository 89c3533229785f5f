"""The real model through P and D: SmolLM2-135M-Instruct (float32, converted
from its package) answering ShareGPT questions and a conversation through the
router, token for token what one instance answers.

The references are taken on one SmolLM2 instance first (at most two servers
run), the conversation's later prompts built from its answers (each turn the
history so far through the chat template, as a chat client sends it); then a
SmolLM2 P/D pair, prefix caching on as vLLM runs by default, serves the same
prompts through the router: with split prefill (at concurrency 1 the router
splits every prompt between P and D) and without (P computes the prompt).
Later turns of the conversation repeat the history: vLLM's own prefix-cache
counters must show hits on the pair.
"""

from __future__ import annotations

from typing import Any

import pytest

from rapidkv.connector.config import kv_transfer_config
from rapidkv.control.client import RpcClient
from rapidkv.control.messages import StatsRequest
from rapidkv.harness import ServerPool, ServerSpec, free_port
from rapidkv.harness.client import complete_full, get_metrics, metric_sum, stream_many
from rapidkv.harness.server import pd_specs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_TOKENS = 20
BLOCK = 128  # vLLM-CPU's block size: prefix-cache hits are whole blocks
QUESTIONS = 4  # per router variant: distinct prompts, no prefix hits between variants


def rpc_stats(address: str) -> dict[str, float]:
    with RpcClient() as rpc:
        return rpc.call(address, StatsRequest(), 10).counters


def prefix_hits(*base_urls: str) -> float:
    """Prompt tokens the engines found in their own prefix caches (vLLM's count
    of prompt tokens by source, as test_pd_connector reads it)."""
    return sum(
        metric_sum(get_metrics(u), "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
        for u in base_urls
    )


@pytest.fixture(scope="session")
def smollm2_case(server_pool: ServerPool) -> dict[str, Any]:
    from rapidkv.demo.workload import Chat, sharegpt_conversations, sharegpt_turns
    from rapidkv.models.smollm2 import ensure_smollm2

    model = ensure_smollm2("float32")
    chat = Chat(model)
    # long enough that a split leaves whole blocks on both sides
    drawn = sharegpt_turns(chat, 400, 77, 600)
    questions = [t.prompt_ids for t in drawn if len(t.prompt_ids) >= 2 * BLOCK + 10]
    questions = questions[: 2 * QUESTIONS]
    assert len(questions) == 2 * QUESTIONS
    # a conversation whose second turn's prompt spans whole blocks (its third
    # turn then starts with cached ones)
    conversation = next(
        c
        for c in sharegpt_conversations(40, 78, 3, max_chars=500)
        if sum(len(m) for m in c[:2]) >= 800
    )
    single = server_pool.get_one(
        "single_smollm2", ServerSpec(model=model, name="single-smollm2", cpus=(1,))
    )
    refs = [complete_full(single.base_url, q, MAX_TOKENS).token_ids for q in questions]
    history: list[dict[str, str]] = []
    turns, turn_refs = [], []
    for question in conversation:
        history.append({"role": "user", "content": question})
        turns.append(chat.prompt(history))
        turn_refs.append(complete_full(single.base_url, turns[-1], MAX_TOKENS).token_ids)
        history.append({"role": "assistant", "content": chat.text(turn_refs[-1])})
    server_pool.stop("single_smollm2")
    pc, dc = free_port(), free_port()
    chunked = ("--max-num-batched-tokens", "256")
    p, d = server_pool.get(
        "pd_smollm2", pd_specs(model, kv_transfer_config(pc), kv_transfer_config(dc), chunked)
    )
    return {
        "questions": questions,
        "refs": refs,
        "turns": turns,
        "turn_refs": turn_refs,
        "p": p,
        "d": d,
        "controls": (f"127.0.0.1:{pc}", f"127.0.0.1:{dc}"),
    }


def router_config(case: dict[str, Any], **kw: Any) -> Any:
    from rapidkv.router.config import Instance, RouterConfig

    d_control = case["controls"][1]
    return RouterConfig(
        prefill=(Instance(case["p"].base_url),),
        decode=(Instance(case["d"].base_url, d_control),),
        port=0,
        **kw,
    )


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_smollm2_through_p_and_d_answers_as_one_instance(
    smollm2_case: dict[str, Any], split: bool
) -> None:
    from rapidkv.router.server import start_router

    case = smollm2_case
    lo = 0 if split else QUESTIONS
    questions, refs = case["questions"][lo : lo + QUESTIONS], case["refs"][lo : lo + QUESTIONS]
    p_control = case["controls"][0]
    before = rpc_stats(p_control)
    with start_router(router_config(case, split_prefill=split)) as router:
        outs = stream_many(router.url, questions, MAX_TOKENS)
        splits = router.router.metrics.registry.get_sample_value(
            "rapidkv_router_split_prefills_total"
        )
    after = rpc_stats(p_control)
    assert [o.token_ids for o in outs] == refs
    crossed = after.get("transfers_ok", 0) - before.get("transfers_ok", 0)
    assert crossed == QUESTIONS  # every prompt crossed
    assert (splits or 0) == (QUESTIONS if split else 0)


def test_a_conversation_hits_the_prefix_cache_and_stays_token_identical(
    smollm2_case: dict[str, Any],
) -> None:
    from rapidkv.router.server import start_router

    case = smollm2_case
    p, d = case["p"], case["d"]
    hits = [prefix_hits(p.base_url, d.base_url)]
    outs = []
    with start_router(router_config(case)) as router:
        for turn in case["turns"]:
            outs += stream_many(router.url, [turn], MAX_TOKENS)
            hits.append(prefix_hits(p.base_url, d.base_url))
    assert [o.token_ids for o in outs] == case["turn_refs"]
    # each later turn starts with the previous turn's prompt: its whole blocks
    # (vLLM-CPU's 128 tokens) are cached where they were computed or loaded
    for k in (1, 2):
        assert hits[k + 1] - hits[k] >= BLOCK * (len(case["turns"][k - 1]) // BLOCK), hits
    assert hits[3] - hits[2] >= BLOCK, hits  # the third turn's history spans a block
