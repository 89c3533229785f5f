"""Tensor parallelism on P and D: both at TP 2 (vLLM CPU runs each rank in a
process of its own; P's two ranks share core 0, D's core 1: "0|0" and "1|1"),
RapidKVConnector on every rank, each rank sending its own half of the KV heads
to the same rank of D.

TP changes the order of the reductions, so the oracle is one instance at TP 2
(float32, greedy), run before the pair starts and stopped after
(`tp2_references`). P and D are warmed first (a fresh TP 2 engine's first
forwards are slow enough for the router's discovery probe to give up). Then,
through the router:

1. without split prefill, prompts at concurrency 4 (dual dispatch: P's ranks
   send layer by layer and acknowledge substeps): every output is the TP 2
   instance's, every transfer settled ok on both ranks, D recomputed nothing,
   and P's ranks together wrote every block of every prompt once (each rank
   its half of each block's bytes);
2. with the router's defaults, one prompt at a time (split prefill while idle:
   D's ranks each wait for their half of the head's layers): the outputs are
   the TP 2 instance's, D recomputed nothing;
3. afterwards every block of both pools is free again, nothing parked, held
   or awaited.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_harness import (
    BLOCK,
    MAX_TOKENS,
    Pair,
    assert_back_to_baseline,
    block_bytes,
    wait_for,
)
from tp_harness import PD_TP2, TP, pair_router, tp2_pair

from rapidkv.harness import ServerPool, random_prompts
from rapidkv.harness.client import complete_many, get_metrics, metric_sum, stream_many

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tp_case(server_pool: ServerPool, tiny_model: Path, tp2_references: dict) -> Iterator[dict]:
    """The TP 2 instance's answers (`tp2_references`, taken before the TP 2
    pair starts), then the TP 2 pair (`tp_harness`: test_pd_tp_faults and
    test_pd_tp_mixed use it too, and the last of them stops it), warmed, the
    shared TP 1 pair left running beside it for those modules."""
    prompts, refs = tp2_references["tp"]
    specs, (p_control, d_control) = tp2_pair(tiny_model)
    p, d = server_pool.get(PD_TP2, specs, keep=["pd"])
    warm = random_prompts(tiny_model, [100, 300], seed=3902)
    for server in (p, d):
        complete_many(server.base_url, warm, 2)
    pair = Pair(tiny_model, p, d, p_control, d_control)
    try:
        yield {"pair": pair, "prompts": prompts, "refs": refs, "split": tp2_references["tp-split"]}
    finally:
        pair.close()


def test_p_and_d_at_tp_2_answer_as_one_tp_2_instance_and_free_everything(tp_case: dict) -> None:
    from rapidkv.router.server import start_router

    pair: Pair = tp_case["pair"]
    prompts, refs = tp_case["prompts"], tp_case["refs"]

    router = functools.partial(pair_router, pair)

    before = {"p": pair.stats("p"), "d": pair.stats("d")}
    with start_router(router(split_prefill=False)) as r:
        outs = stream_many(r.url, prompts, MAX_TOKENS, concurrency=4)
    assert [o.token_ids for o in outs] == refs
    assert wait_for(lambda: pair.since(before, "p", "transfers_ok") == len(prompts), 5)
    assert pair.since(before, "p", "transfers_failed") == 0
    assert pair.since(before, "d", "recompute_fallbacks") == 0
    blocks = sum(-(-(len(ids) - 1) // BLOCK) for ids in prompts)
    assert pair.since(before, "p", "bytes_sent") == blocks * block_bytes(pair.model)
    assert_back_to_baseline(pair)

    split, split_refs = tp_case["split"]
    before = {"p": pair.stats("p"), "d": pair.stats("d")}
    with start_router(router()) as r:
        outs = stream_many(r.url, split, MAX_TOKENS, concurrency=1)
        splits = metric_sum(get_metrics(r.url), "rapidkv_router_split_prefills_total")
    assert [o.token_ids for o in outs] == split_refs
    assert splits == len(split)
    assert pair.since(before, "d", "recompute_fallbacks") == 0
    assert pair.since(before, "d", "split_loads_ok") == TP * len(split)  # each rank its half
    assert_back_to_baseline(pair)
