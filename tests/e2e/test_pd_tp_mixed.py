"""P and D at different tensor-parallel sizes, end to end on real vLLM (CPU)
and NIXL: P at TP 2 -> D at TP 1 (each of P's ranks writes its KV head into
D's one rank, which waits for both ranks' SendDones) and P at TP 1 -> D at
TP 2 (P's one rank writes each of D's ranks the head it holds).

No server of its own: the mixed pairs are made of the groups that already
exist in the session, both running at once (the pool keeps each while asking
for the other: four servers, idle but for the pair under test): the TP 2 pair
of test_pd_tp (`tp_harness.tp2_pair`, pool key `pd_tp2`) and the suite's
shared TP 1 pair (`pd_pair_specs`, pool key `pd`). P TP 2 is pd_tp2's prefill
(core 0) with the shared decode (core 1); P TP 1 is the shared prefill (core 0)
with pd_tp2's decode (core 1). The connector configs of the two groups pair
as they are (no secret, the same transport).

References: a mixed pair computes the prompt at one TP size and decodes at
the other, so its outputs may follow either instance's order of reductions
(TP changes the all-reduce sums). Each output is compared with both the TP 1
single instance's and the TP 2 single instance's (`single_tp2`, as test_pd_tp
uses it; both taken once a session, before their pairs start: `workloads` and
`tp2_references`), with top-2 logprobs: equal to either passes; otherwise it must
be a near-tie of one of them (at the first divergence, that reference's two
best tokens within `NEAR_TIE_MARGIN`: a different summation order may pick
either), else it is a hard mismatch and fails. How many outputs matched and
how many were near-ties is printed.

Through a `rapidkv router`, for each direction:

1. dual dispatch without split prefill, prompts at concurrency 4: outputs as
   above, every transfer settled ok, D recomputed nothing, P's ranks together
   wrote every block of every prompt once, all heads (`bytes_sent`, exact);
2. the router's defaults, one prompt at a time (split prefill while idle:
   each of D's ranks waits layer by layer for every P rank that writes it):
   outputs as above, one split load ok per D rank per prompt, nothing
   recomputed;
3. afterwards every block of both pools is free, nothing parked, held or
   awaited.

And live migration across TP sizes: a stream on one of the two decode
instances (TP 2 and TP 1) moved to the other and back, its KV crossing TP
sizes both ways.
"""

from __future__ import annotations

import functools
from collections import Counter
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

from rapidkv.bench.common.reference import NEAR_TIE_MARGIN, Reference, classify
from rapidkv.harness import ServerPool, ServerSpec, random_prompts
from rapidkv.harness.client import complete_many, get_metrics, metric_sum, stream_many

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

SHARED = "pd"  # the shared TP 1 pair's pool key (tests/e2e/conftest.py: pd_pair)


def verdict(token_ids: list[int], refs: tuple[Reference, Reference]) -> str:
    """ "match" (equal to the TP 1 or the TP 2 reference), "near_tie" (a
    near-tie of either) or "hard"."""
    found = [classify(r, token_ids, NEAR_TIE_MARGIN) for r in refs]
    if "match" in found:
        return "match"
    return "near_tie" if "near_tie" in found else "hard"


@pytest.fixture(scope="module")
def mixed(
    server_pool: ServerPool,
    tiny_model: Path,
    workloads: dict,
    tp2_references: dict,
    pd_pair_specs: tuple[list[ServerSpec], tuple[str, str]],
) -> Iterator[dict]:
    """The references of both single instances (TP 1: `workloads`, TP 2:
    `tp2_references`, both taken once a session before their pairs start), then
    both pairs running at once, and the two mixed pairs made of them; the TP 2
    pair is stopped after."""
    refs: dict[str, list[tuple[Reference, Reference]]] = {}
    for name, key in (
        ("dual", "tp-mixed"),
        ("split", "tp-mixed-split"),
        ("migrate", "tp-mixed-migrate"),
    ):
        prompts, tp1 = workloads[key]
        tp2_prompts, tp2 = tp2_references[key]
        assert tp2_prompts == prompts
        refs[name] = list(zip(tp1, tp2, strict=True))
    prompts, split = workloads["tp-mixed"][0], workloads["tp-mixed-split"][0]
    migrated = workloads["tp-mixed-migrate"][0]
    shared_specs, (shared_pc, shared_dc) = pd_pair_specs
    shared_p, shared_d = server_pool.get(SHARED, shared_specs, keep=[PD_TP2])
    tp2_specs, (tp2_pc, tp2_dc) = tp2_pair(tiny_model)
    tp2_p, tp2_d = server_pool.get(PD_TP2, tp2_specs, keep=[SHARED])
    # a fresh TP 2 engine's first forwards are slow enough for the router's
    # discovery probe to give up
    warm = random_prompts(tiny_model, [100, 300], seed=3902)
    for server in (tp2_p, tp2_d):
        complete_many(server.base_url, warm, 2)
    pairs = {
        "2->1": Pair(tiny_model, tp2_p, shared_d, tp2_pc, shared_dc),
        "1->2": Pair(tiny_model, shared_p, tp2_d, shared_pc, tp2_dc),
        # not a P and a D: two instances a stream moves between, of
        # different TP sizes, and both at TP 2
        "tp2-tp1": Pair(tiny_model, tp2_d, shared_d, tp2_dc, shared_dc),
        "tp2-tp2": Pair(tiny_model, tp2_p, tp2_d, tp2_pc, tp2_dc),
    }
    try:
        yield {
            "pairs": pairs,
            "prompts": prompts,
            "split": split,
            "migrated": migrated,
            "refs": refs,
        }
    finally:
        for pair in pairs.values():
            pair.close()
        # the TP 2 pair's last user: its four rank processes stop taking cores
        # from the shared pair's tests that follow
        server_pool.stop(PD_TP2)


def run_direction(mixed: dict, direction: str, d_ranks: int) -> dict[str, Counter]:
    """Both router runs of one mixed pair, asserted; the verdicts of each."""
    from rapidkv.router.server import start_router

    pair: Pair = mixed["pairs"][direction]
    prompts, split = mixed["prompts"], mixed["split"]

    router = functools.partial(pair_router, pair)

    verdicts: dict[str, Counter] = {}
    before = {"p": pair.stats("p"), "d": pair.stats("d")}
    with start_router(router(split_prefill=False)) as r:
        outs = stream_many(r.url, prompts, MAX_TOKENS, concurrency=4)
    found = [verdict(o.token_ids, ref) for o, ref in zip(outs, mixed["refs"]["dual"], strict=True)]
    verdicts["dual"] = Counter(found)
    assert "hard" not in found, (direction, found)
    assert wait_for(lambda: pair.since(before, "p", "transfers_ok") == len(prompts), 5), (
        direction,
        pair.since(before, "p", "transfers_ok"),
    )
    assert pair.since(before, "p", "transfers_failed") == 0
    assert pair.since(before, "d", "recompute_fallbacks") == 0
    blocks = sum(-(-(len(ids) - 1) // BLOCK) for ids in prompts)
    # every head of every block once, whichever ranks wrote it
    assert pair.since(before, "p", "bytes_sent") == blocks * block_bytes(pair.model)
    assert_back_to_baseline(pair)

    before = {"p": pair.stats("p"), "d": pair.stats("d")}
    with start_router(router()) as r:
        outs = stream_many(r.url, split, MAX_TOKENS, concurrency=1)
        splits = metric_sum(get_metrics(r.url), "rapidkv_router_split_prefills_total")
    found = [verdict(o.token_ids, ref) for o, ref in zip(outs, mixed["refs"]["split"], strict=True)]
    verdicts["split"] = Counter(found)
    assert "hard" not in found, (direction, found)
    assert splits == len(split)
    assert pair.since(before, "d", "recompute_fallbacks") == 0
    assert pair.since(before, "d", "split_loads_ok") == d_ranks * len(split)
    assert pair.since(before, "d", "split_loads_failed") == 0
    assert_back_to_baseline(pair)
    return verdicts


def test_p_at_tp_2_to_d_at_tp_1(mixed: dict) -> None:
    verdicts = run_direction(mixed, "2->1", d_ranks=1)
    print(f"P TP {TP} -> D TP 1: {verdicts}")


def test_p_at_tp_1_to_d_at_tp_2(mixed: dict) -> None:
    verdicts = run_direction(mixed, "1->2", d_ranks=TP)
    print(f"P TP 1 -> D TP {TP}: {verdicts}")


MOVES = ["tp2-tp1", "tp2-tp2"]  # each with a prompt of its own: no prefix-cache hits


@pytest.mark.parametrize("moves", MOVES)
def test_a_stream_moved_to_another_instance_and_back_at_tp_2_goes_on_as_one_instance(
    mixed: dict, moves: str
) -> None:
    """Live migration at TP 2: a stream placed on one of two instances (local
    dispatch; "tp2-tp1": the TP 2 pair's decode instance and the shared TP 1
    pair's, its KV crossing TP sizes both ways; "tp2-tp2": the TP 2 pair's
    two instances) is moved to the other after 20 tokens and back after 120
    (pre-copy and cut-over each time): its answer is the TP 1 or the TP 2
    instance's or a near-tie, both migrations succeeded, nothing was
    recomputed, both instances are back to their baseline."""
    import asyncio

    import httpx
    from migration_harness import TOKEN, mover, stream

    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    pair: Pair = mixed["pairs"][moves]
    k = MOVES.index(moves)
    prompt, refs = mixed["migrated"][k], mixed["refs"]["migrate"][k]
    urls = [pair.p.base_url, pair.d.base_url]
    config = RouterConfig(
        instances=(Instance(urls[0]), Instance(urls[1])),
        dispatch="local",
        admin_token=TOKEN,
        port=0,
    )
    before = {"p": pair.stats("p"), "d": pair.stats("d")}

    async def main(router: str):
        async with httpx.AsyncClient() as client:
            run = await stream(client, router, prompt, mover(client, router, urls, [20, 120]))
            run.migrations = [await m for m in run.migrations]
            return run

    with start_router(config) as router:
        run = asyncio.run(main(router.url))
    assert [a.status_code for a in run.migrations] == [200, 200], [a.text for a in run.migrations]
    found = verdict(run.tokens, refs)
    print(f"{moves}: moved from instance {run.decode} and back: {found}")
    assert found != "hard", (run.tokens, [r.token_ids for r in refs])
    since = lambda name: sum(pair.since(before, w, name) for w in ("p", "d"))  # noqa: E731
    assert since("recompute_fallbacks") == 0
    assert since("transfer_kv_ok") == 4  # two per migration: the pre-copy, the cut-over
    assert_back_to_baseline(pair)
