"""Every transfer failing on a real P/D pair (a pair of its own, `pd-failing`,
run after the users of the shared pair so that it costs no restart of it):
D recomputes, the outputs stay exact, the router says degraded."""

from __future__ import annotations

import contextlib
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
)

from rapidkv.harness import ServerPool, free_port, wait_until
from rapidkv.harness.client import complete_full, get_metrics, metric_sum

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_with_every_transfer_failing_outputs_stay_exact_and_the_router_says_degraded(
    server_pool: ServerPool, tiny_model: Path, workloads: dict
) -> None:
    """Transport errors injected on P (`debug_fail_transfer_rate` 1: every
    transfer fails after its first layers, as a write the transport gave up
    on): every answer is still the single instance's (D recomputes), P and D
    hold nothing afterwards, and the router, which reads D's connector, shows
    the pair as up but degraded."""
    from rapidkv.connector.config import kv_transfer_config
    from rapidkv.harness.server import pd_specs
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    pc, dc = free_port(), free_port()
    p_cfg = kv_transfer_config(pc, debug_fail_transfer_rate=1.0)
    p, d = server_pool.get("pd-failing", pd_specs(tiny_model, p_cfg, connector_config(dc)))
    pair = Pair(tiny_model, p, d, f"127.0.0.1:{pc}", f"127.0.0.1:{dc}")
    cleanup = contextlib.ExitStack()
    cleanup.callback(pair.close)  # after the last Stats read below
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
    with cleanup:
        with start_router(config) as router:
            for ids, want in zip(prompts, expected, strict=True):
                assert complete_full(router.url, ids, MAX_TOKENS).token_ids == want
            assert pair.since(before, "d", "recompute_fallbacks") == len(prompts)
            assert pair.since(before, "p", "debug_injected_failures") == len(prompts)
            logged = logged_since(d, mark)  # D says why, once per transfer
            assert logged.count("TransferKV answered ERROR") == len(prompts), logged[-2000:]

            def health() -> dict:
                return httpx.get(f"{router.url}/health", timeout=10).json()

            wait_until(
                lambda: health()["status"] == "degraded", 5, what="the router to say degraded"
            )
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
