"""A P/D pair of its own (`pd-faulty`, run after the users of the shared pair
so that it costs no restart of it) whose P fails every transfer and gives up
on a finished request after 1 s: D recomputes, the outputs stay exact, the
router says degraded; and a request no D asks for is freed after its TTL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pd_harness import (
    MAX_TOKENS,
    Pair,
    assert_back_to_baseline,
    connector_config,
    log_mark,
    logged_since,
    wait_for,
)

from rapidkv.harness import ServerPool, free_port, wait_until
from rapidkv.harness.client import complete_full, get_metrics, metric_sum

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def faulty_pair(server_pool: ServerPool, tiny_model: Path, workloads: dict) -> Iterator[Pair]:
    """P: `debug_fail_transfer_rate` 1, `finished_ttl_s` 1 (a TransferKV comes
    within milliseconds of P's answer in dual dispatch, long before that)."""
    from rapidkv.connector.config import kv_transfer_config
    from rapidkv.harness.server import pd_specs

    pc, dc = free_port(), free_port()
    p_cfg = kv_transfer_config(pc, debug_fail_transfer_rate=1.0, finished_ttl_s=1.0)
    p, d = server_pool.get("pd-faulty", pd_specs(tiny_model, p_cfg, connector_config(dc)))
    pair = Pair(tiny_model, p, d, f"127.0.0.1:{pc}", f"127.0.0.1:{dc}")
    yield pair
    pair.close()


def test_finished_request_without_transfer_kv_is_freed_after_its_ttl(
    faulty_pair: Pair, workloads: dict
) -> None:
    """A P request whose D never asks (no TransferKV): P holds its blocks for
    `finished_ttl_s`, then frees them."""
    pair = faulty_pair
    baseline = pair.stats("p")
    (ids,), _ = workloads["gone"]
    pk = {"rapidkv": {"xfer_id": "ttl-1", "role": "prefill"}}
    complete_full(pair.p.base_url, ids, 1, kv_transfer_params=pk)
    held = pair.stats("p")
    assert held["transfers_live"] == 1 and held["free_blocks"] < baseline["free_blocks"]

    def freed() -> bool:
        s = pair.stats("p")
        return s["free_blocks"] == baseline["free_blocks"] and s["transfers_live"] == 0

    assert wait_for(freed, 1.0 + 2.0), "P kept the blocks past finished_ttl_s"
    assert pair.since({"p": baseline}, "p", "finished_expired") == 1


def test_with_every_transfer_failing_outputs_stay_exact_and_the_router_says_degraded(
    faulty_pair: Pair, workloads: dict
) -> None:
    """Transport errors injected on P (`debug_fail_transfer_rate` 1: every
    transfer fails after its first layers, as a write the transport gave up
    on): every answer is still the single instance's (D recomputes), P and D
    hold nothing afterwards, and the router, which reads D's connector, shows
    the pair as up but degraded."""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    pair = faulty_pair
    p, d = pair.p, pair.d
    prompts, expected = workloads["failing"]
    before = {"p": pair.stats("p"), "d": pair.stats("d")}
    mark = log_mark(d)
    config = RouterConfig(
        prefill=(Instance(p.base_url, pair.p_control),),
        decode=(Instance(d.base_url, pair.d_control),),
        port=0,
        split_prefill=False,
        transfer_check_interval_s=0.2,
    )
    with start_router(config) as router:
        for ids, want in zip(prompts, expected, strict=True):
            assert complete_full(router.url, ids, MAX_TOKENS).token_ids == want
        assert pair.since(before, "d", "recompute_fallbacks") == len(prompts)
        assert pair.since(before, "p", "debug_injected_failures") == len(prompts)
        logged = logged_since(d, mark)  # D says why, once per transfer
        assert logged.count("TransferKV answered ERROR") == len(prompts), logged[-2000:]

        def health() -> dict:
            return httpx.get(f"{router.url}/health", timeout=10).json()

        wait_until(lambda: health()["status"] == "degraded", 5, what="the router to say degraded")
        assert health()["decode"][0]["transfers"] == "degraded"
        assert (
            metric_sum(
                get_metrics(router.url),
                "rapidkv_router_transfers_degraded",
                upstream=d.base_url,
            )
            == 1
        )
    assert_back_to_baseline(pair)
