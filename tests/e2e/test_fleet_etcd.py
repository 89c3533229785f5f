"""Two routers that know no instance but an etcd server (`--etcd`), over the
shared pair, whose connectors register there (`fleet_etcd`): both routers
find both instances, serve a load at once with the single instance's outputs,
drop an instance killed as by a crash within its lease's TTL (serving on with
the other), and take it back once it is started again. Skipped, with the
reason, where etcd cannot run."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from pd_harness import ETCD_TTL_S, MAX_TOKENS, Pair, assert_back_to_baseline

from rapidkv.harness import get_metrics, metric_sum, wait_until
from rapidkv.harness.client import complete_many
from rapidkv.harness.etcd import EtcdServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def fleet(url: str) -> set[str]:
    """The decode instances a router's /health lists and dispatches to."""
    health = httpx.get(f"{url}/health", timeout=10, trust_env=False).json()
    return {c["url"] for c in health["decode"] if c["dispatching"]}


def crossed(url: str) -> float:
    """Requests a router placed across two instances (pd or split)."""
    metrics = get_metrics(url)
    name = "rapidkv_router_placements_total"
    return metric_sum(metrics, name, kind="pd") + metric_sum(metrics, name, kind="split")


def load(routers: list[str], prompts: list, concurrency: int = 2) -> list[list[int]]:
    """`prompts` split between the routers, sent through all of them at once;
    the outputs in prompt order."""
    out: list[list[int] | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        mine = list(range(k, len(prompts), len(routers)))
        try:
            got = complete_many(
                routers[k], [prompts[i] for i in mine], MAX_TOKENS, concurrency=concurrency
            )
        except BaseException as e:  # reported by the test's thread
            errors.append(e)
            return
        for i, tokens in zip(mine, got, strict=True):
            out[i] = tokens

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(routers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out  # type: ignore[return-value]


def test_routers_following_etcd_serve_the_pair_and_follow_a_kill_and_a_restart(
    pd_pair: Pair, fleet_etcd: EtcdServer | str, workloads: dict
) -> None:
    from rapidkv.router.config import RouterConfig
    from rapidkv.router.server import start_router

    if isinstance(fleet_etcd, str):
        pytest.skip(f"etcd cannot run here: {fleet_etcd}")
    prompts, expected = workloads["fleet-etcd"]
    p, d = pd_pair.p.base_url, pd_pair.d.base_url
    config = RouterConfig(etcd=(fleet_etcd.url,), port=0)  # no instance of its own
    with start_router(config) as first, start_router(config) as second:
        routers = [first.url, second.url]
        for url in routers:
            wait_until(lambda u=url: fleet(u) == {p, d}, 30, what="both instances found")
        assert load(routers, prompts) == expected

        pd_pair.d.stop(grace=0)  # a crash: its lease is no longer refreshed
        t0 = time.monotonic()
        for url in routers:
            wait_until(lambda u=url: fleet(u) == {p}, 2 * ETCD_TTL_S, what="D gone")
        assert time.monotonic() - t0 < ETCD_TTL_S + 2.0  # the TTL, and etcd's expiry slack
        assert load(routers, prompts[:2], concurrency=1) == expected[:2]  # P alone

        pd_pair.d.launch()
        pd_pair.d.wait_ready()
        for url in routers:
            wait_until(lambda u=url: fleet(u) == {p, d}, 10, what="D back")
        assert load(routers, prompts) == expected
        for router in (first, second):  # with both up, prompts crossed from one to the other
            assert crossed(router.url) > 0
    assert_back_to_baseline(pd_pair)
