"""Routers that follow the fleet in a real etcd server (`--etcd`), over fake
vLLM instances whose records the test writes as their connectors would: a
router may start with no instance, an instance joins every router once its
record appears, leaves each within its lease's TTL once its holder stops
refreshing it (a crash), and a restarted instance's new record replaces the
old one. Skipped, with the reason, where etcd cannot run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fake_vllm import FakeVLLM, MakeFake, MakeRouter, StatsServer

from rapidkv.harness import get_metrics, metric_sum, wait_until
from rapidkv.harness.etcd import EtcdServer, EtcdUnavailable
from rapidkv.membership.etcd import EtcdClient
from rapidkv.membership.record import InstanceRecord, encode_record, record_key
from rapidkv.router import RunningRouter

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PREFIX = "/rapidkv-router-test/"
BODY = {"model": "m", "prompt": [11, 12, 13], "max_tokens": 3, "temperature": 0.0}


@pytest.fixture
def etcd(tmp_path) -> Iterator[EtcdServer]:
    server = EtcdServer(log_dir=tmp_path)
    try:
        server.start()
    except EtcdUnavailable as e:
        pytest.skip(f"etcd cannot run here: {e}")
    yield server
    server.stop()


def register(
    client: EtcdClient,
    fake: FakeVLLM,
    instance_id: str,
    ttl_s: int,
    control: int | str,
    roles: tuple[str, ...] = ("prefill", "decode"),
) -> int:
    """Put `fake`'s record under a lease of `ttl_s` that nobody refreshes (its
    holder gone: the key lives until the lease expires or is revoked); `control`
    a port on loopback or an address."""
    record = InstanceRecord(
        url=fake.url,
        control=control if isinstance(control, str) else f"127.0.0.1:{control}",
        roles=roles,
        block_size=16,
        instance_id=instance_id,
    )
    lease = client.grant(ttl_s)
    client.put(record_key(PREFIX, instance_id), encode_record(record), lease)
    return lease


def fleet(router: RunningRouter) -> set[str]:
    """The decode instances the router's /health lists and dispatches to."""
    health = httpx.get(f"{router.url}/health", timeout=10, trust_env=False).json()
    return {c["url"] for c in health["decode"] if c["dispatching"]}


def served_by(fakes: list[FakeVLLM]) -> list[int]:
    return [len(f.requests("/v1/completions")) for f in fakes]


def test_routers_following_etcd_add_instances_drop_dead_ones_and_follow_restarts(
    etcd: EtcdServer, make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    a, b = make_fake("A", "decode"), make_fake("B", "decode")
    routers = [
        make_router([], [], dispatch="local", etcd=(etcd.url,), etcd_prefix=PREFIX)
        for _ in range(2)
    ]
    empty = http.post(f"{routers[0].url}/v1/completions", json=BODY)
    assert empty.status_code == 503, empty.text
    assert "no instance that may decode is in the fleet" in empty.text

    with EtcdClient([etcd.url]) as client:
        register(client, a, "a-1", ttl_s=2, control=7001)  # never refreshed: it will expire
        lease_b = register(client, b, "b-1", ttl_s=60, control=7002)
        for router in routers:
            wait_until(lambda r=router: fleet(r) == {a.url, b.url}, 10, what="both joined")

        for _ in range(4):  # both routers spread requests over both instances
            for router in routers:
                assert http.post(f"{router.url}/v1/completions", json=BODY).status_code == 200
        assert served_by([a, b]) == [4, 4]

        # a's holder is gone: a leaves every router within its lease's TTL
        t0 = time.monotonic()
        for router in routers:
            wait_until(lambda r=router: fleet(r) == {b.url}, 10, what="a left")
        assert time.monotonic() - t0 < 2 + 2.0  # TTL, and etcd's expiry check's slack
        for router in routers:
            assert http.post(f"{router.url}/v1/completions", json=BODY).status_code == 200
        assert served_by([a, b]) == [4, 6]

        # b restarts: its new record (new id, new control address, decode only
        # now) comes before the old lease ends; the routers follow the new one,
        # and the old one going changes nothing
        register(client, b, "b-2", ttl_s=60, control=7003, roles=("decode",))
        client.revoke(lease_b)
        for router in routers:
            inner = router.router.fleet
            wait_until(
                lambda r=inner: any(m.instance.control == "127.0.0.1:7003" for m in r.members),
                10,
                what="b's new record followed",
            )
            assert fleet(router) == {b.url}
            [index] = inner.pool("decode")
            assert inner.members[index].instance.control == "127.0.0.1:7003"
            assert inner.pool("prefill") == ()
            up = get_metrics(router.url)
            assert metric_sum(up, "rapidkv_router_instance_up", role="decode", upstream=b.url) == 1
            # its series under the old role went with the old record (it stayed at 1)
            assert metric_sum(up, "rapidkv_router_instance_up", role="both", upstream=b.url) == 0


def test_health_answers_while_an_instance_joins_during_its_probes(
    etcd: EtcdServer, make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """/health reports the fleet as it was when it was asked: an instance that
    joins while the probes are out is in the next report, not a 500 in this
    one (CI at 784e2d8: D back through etcd mid-probe, `KeyError`)."""
    a, b = make_fake("A", "decode"), make_fake("B", "decode")
    router = make_router([], [], dispatch="local", etcd=(etcd.url,), etcd_prefix=PREFIX)
    with EtcdClient([etcd.url]) as client:
        register(client, a, "a-1", ttl_s=60, control=7001)
        wait_until(lambda: fleet(router) == {a.url}, 10, what="a joined")
        a.health_delay_s = 1.5  # under the router's health timeout (2 s)
        probed = a.health_asked
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(httpx.get, f"{router.url}/health", timeout=10, trust_env=False)
            # the router probes a healthy instance only for /health: its probe is out
            wait_until(lambda: a.health_asked > probed, 5, what="a probed")
            register(client, b, "b-1", ttl_s=60, control=7002)
            wait_until(
                lambda: b.url in http.get(f"{router.url}/readyz").json()["decode"],
                10,
                what="b joined",
            )
            assert not asked.done()  # b joined while a's probe was out
            report = asked.result()
        assert report.status_code == 200, report.text
        assert [c["url"] for c in report.json()["decode"]] == [a.url]
        a.health_delay_s = 0.0
        assert fleet(router) == {a.url, b.url}


def test_an_instance_that_joined_through_etcd_has_its_transfers_watched(
    etcd: EtcdServer, make_fake: MakeFake, make_router: MakeRouter, http: httpx.Client
) -> None:
    """Its control address comes from its record: the router reads its connector's
    counters as it reads a configured one's, and /health shows the state."""
    d = make_fake("D", "decode")
    stats = StatsServer(secret=None)
    try:
        router = make_router(
            [],
            [],
            dispatch="local",
            etcd=(etcd.url,),
            etcd_prefix=PREFIX,
            transfer_check_interval_s=0.05,
        )
        with EtcdClient([etcd.url]) as client:
            register(client, d, "d-1", ttl_s=60, control=stats.server.address)
            wait_until(lambda: fleet(router) == {d.url}, 10, what="d joined")
            wait_until(lambda: stats.asked >= 2, 5, what="two readings")

            def transfers() -> str:
                return http.get(f"{router.url}/health").json()["decode"][0]["transfers"]

            assert transfers() == "unknown"  # idle: nothing to judge
            stats.counters = {"transfer_kv_ok": 0, "recompute_fallbacks": 5}
            wait_until(lambda: transfers() == "degraded", 5, what="degraded")
            stats.counters = {"transfer_kv_ok": 2, "recompute_fallbacks": 5}
            wait_until(lambda: transfers() == "ok", 5, what="transferring")
    finally:
        stats.server.stop()
