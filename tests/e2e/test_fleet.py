"""A fleet of `kv_both` instances under the adaptive router: every instance
prefills and decodes, the router picks local, PD or split per request, and the
outputs are the single instance's, token for token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from pd_harness import MAX_TOKENS, Pair, assert_back_to_baseline, connector_config, wait_for

from rapidkv.harness import ServerPool, free_port, get_metrics, metric_sum
from rapidkv.harness.client import acomplete_stream, complete_many

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

IDLE = 4  # prompts sent one at a time to the idle fleet (short, long, short, long)
BUSY = 4  # then this many at once, 4 in flight; the rest go to the pinned router


def test_an_adaptive_fleet_of_two_uses_every_placement_and_matches_a_single_instance(
    pd_pair: Pair, workloads: dict
) -> None:
    """Both instances of the pair as `--instance` (either role per request),
    SLOs loose: on the idle fleet a short prompt stays local and a long one is
    split (the lowest TTFT by far), then some at once. Then an adaptive
    router with P pinned to prefill, D to decode and splitting off: PD is the
    only option, and every prompt goes P to D under concurrency. Every output
    equals the single instance's, no transfer fell back to recompute, nothing
    is held after.

    (In a fleet of equal instances PD wins only on TPOT or queues, by margins
    that are noise at this scale, so the test pins the roles to see PD for
    sure; the choice itself is unit-tested in tests/router/test_placement.py.)"""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    prompts, expected = workloads["fleet"]
    before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}
    p, d = Instance(pd_pair.p.base_url), Instance(pd_pair.d.base_url)  # controls discovered
    # the lowest TTFT, whatever the headroom: idle long prompts split
    either = RouterConfig(instances=(p, d), placement="adaptive", ttft_headroom=0.0, port=0)
    pinned = RouterConfig(
        prefill=(p,), decode=(d,), placement="adaptive", split_prefill=False, port=0
    )

    async def main(url: str, one_by_one: list, at_once: list) -> list:
        async with httpx.AsyncClient() as client:
            outs = [await acomplete_stream(client, url, ids, MAX_TOKENS) for ids in one_by_one]
            gate = asyncio.Semaphore(4)

            async def one(ids: list[int]):
                async with gate:
                    return await acomplete_stream(client, url, ids, MAX_TOKENS)

            return outs + list(await asyncio.gather(*(one(ids) for ids in at_once)))

    used: dict[str, dict[str, float]] = {}
    outs = []
    for name, config, one_by_one, at_once in (
        ("either", either, prompts[:IDLE], prompts[IDLE : IDLE + BUSY]),
        ("pinned", pinned, [], prompts[IDLE + BUSY :]),
    ):
        with start_router(config) as router:
            got = asyncio.run(main(router.url, one_by_one, at_once))
            metrics = get_metrics(router.url)
        outs += got
        used[name] = {
            kind: metric_sum(metrics, "rapidkv_router_placements_total", kind=kind)
            for kind in ("local", "pd", "split")
        }
        decisions = "\n".join(str(o.headers.get("x-rapidkv-placement")) for o in got)
        assert sum(used[name].values()) == len(got), decisions
        assert metric_sum(metrics, "rapidkv_router_split_prefills_total") == used[name]["split"]
        for inst, server in ((p, pd_pair.p), (d, pd_pair.d)):  # what each engine runs at once
            seqs = metric_sum(metrics, "rapidkv_router_instance_max_num_seqs", upstream=inst.url)
            assert seqs == server.spec.max_num_seqs, (name, inst.url)
    assert [o.token_ids for o in outs] == expected
    headers = [o.headers.get("x-rapidkv-placement", "") for o in outs[:IDLE]]
    assert [h.split(";")[0] for h in headers] == ["kind=local", "kind=split"] * 2, headers
    assert used["pinned"]["pd"] == len(prompts) - IDLE - BUSY, used
    for w in ("p", "d"):
        assert pd_pair.stats(w).get("recompute_fallbacks", 0) == before[w].get(
            "recompute_fallbacks", 0
        )
    crossed = sum(u["pd"] + u["split"] for u in used.values())
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
    assert_back_to_baseline(pd_pair)


def test_one_prefill_and_two_decode_instances_spread_requests_over_both_decoders(
    server_pool: ServerPool, pd_pair: Pair, tiny_model: Path, workloads: dict
) -> None:
    """Three instances, roles pinned (`--prefill`, `--decode` twice), fixed
    placement: the shared pair and a second decoder beside it (on D's core).
    Requests go to both decoders, every one's KV from the one P, and every
    output is the single instance's."""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    dc2 = free_port()  # D's spec on its own control and HTTP ports, registered nowhere
    d2_spec = pd_pair.d.spec.replace(
        name="decode2", port=None, kv_transfer_config=connector_config(dc2)
    )
    (d2,) = server_pool.get("fleet3-d2", [d2_spec], keep=("pd",))
    pairs = [
        pd_pair,
        Pair(tiny_model, pd_pair.p, d2, pd_pair.p_control, f"127.0.0.1:{dc2}"),
    ]
    try:
        assert pd_pair.p.running and pd_pair.d.running  # kept beside the new decoder
        prompts, expected = workloads["fleet-3"]
        before = [{"p": pair.stats("p"), "d": pair.stats("d")} for pair in pairs]
        config = RouterConfig(
            prefill=(Instance(pd_pair.p.base_url),),
            decode=tuple(Instance(x.d.base_url, x.d_control) for x in pairs),
            port=0,
        )
        with start_router(config) as router:
            got = complete_many(router.url, prompts, MAX_TOKENS, concurrency=4)
        assert got == expected
        sent = [
            pair.since(b, "d", "transfer_kv_sent") for pair, b in zip(pairs, before, strict=True)
        ]
        assert all(sent) and sum(sent) == len(prompts), sent
        for pair, b in zip(pairs, before, strict=True):
            assert pair.since(b, "d", "recompute_fallbacks") == 0
            assert_back_to_baseline(pair)
    finally:
        pairs[1].close()
        server_pool.stop("fleet3-d2")  # three servers on two cores: give one back
