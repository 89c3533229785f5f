"""A fleet of `kv_both` instances under the adaptive router: every instance
prefills and decodes, the router picks local, PD or split per request, and the
outputs are the single instance's, token for token."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from pd_harness import MAX_TOKENS, Pair, assert_back_to_baseline, wait_for

from rapidkv.harness import get_metrics, metric_sum
from rapidkv.harness.client import acomplete_stream

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SEQUENTIAL = 4  # the first prompts one at a time (an idle fleet), the rest 4 at once


def test_an_adaptive_fleet_of_two_uses_every_placement_and_matches_a_single_instance(
    pd_pair: Pair, workloads: dict
) -> None:
    """Both instances of the pair as `--instance` (either role per request):
    on the idle fleet a short prompt stays local and a long one is split; under
    concurrency with a tight TPOT SLO, prompts are also prefilled on one
    instance and decoded on the other (PD). Every output equals the single
    instance's, no transfer fell back to recompute, nothing is held after."""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    prompts, expected = workloads["fleet"]
    before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}
    config = RouterConfig(
        instances=(  # control addresses and block sizes discovered
            Instance(pd_pair.p.base_url),
            Instance(pd_pair.d.base_url),
        ),
        placement="adaptive",
        tpot_slo_ms=6.0,
        port=0,
    )

    async def main(url: str) -> list:
        async with httpx.AsyncClient() as client:
            outs = [
                await acomplete_stream(client, url, ids, MAX_TOKENS) for ids in prompts[:SEQUENTIAL]
            ]
            gate = asyncio.Semaphore(4)

            async def one(ids: list[int]):
                async with gate:
                    return await acomplete_stream(client, url, ids, MAX_TOKENS)

            return outs + list(await asyncio.gather(*(one(ids) for ids in prompts[SEQUENTIAL:])))

    with start_router(config) as router:
        outs = asyncio.run(main(router.url))
        metrics = get_metrics(router.url)
    assert [o.token_ids for o in outs] == expected
    used = {
        kind: metric_sum(metrics, "rapidkv_router_placements_total", kind=kind)
        for kind in ("local", "pd", "split")
    }
    print(f"placements used: {used}")
    assert sum(used.values()) == len(prompts)
    assert all(used.values()), f"placements used: {used}"
    assert metric_sum(metrics, "rapidkv_router_split_prefills_total") == used["split"]
    for w in ("p", "d"):  # each instance took the decode role of some crossings
        assert pd_pair.stats(w).get("recompute_fallbacks", 0) == before[w].get(
            "recompute_fallbacks", 0
        )
    crossed = used["pd"] + used["split"]
    assert wait_for(
        lambda: (
            sum(
                pd_pair.stats(w).get("transfers_ok", 0) - before[w].get("transfers_ok", 0)
                for w in ("p", "d")
            )
            == crossed
        ),
        2.0,
    )
    assert_back_to_baseline(pd_pair, before)
