"""Fleet membership on a real etcd server (`harness.etcd.EtcdServer`, skipped
with the reason where etcd cannot run): records under leases, a watcher that
follows them through deaths, revocations and an etcd restart; and the pure
parts (records, prefix ranges)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rapidkv.harness import wait_until
from rapidkv.harness.etcd import EtcdServer
from rapidkv.harness.server import SRC_DIR
from rapidkv.membership.etcd import EtcdClient, EtcdError, prefix_end
from rapidkv.membership.record import (
    InstanceRecord,
    decode_record,
    encode_record,
    record_key,
)
from rapidkv.membership.registrar import Registrar
from rapidkv.membership.watcher import Members, MembershipWatcher

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PREFIX = "/rapidkv-test/"


def record(i: int, roles: tuple[str, ...] = ("prefill", "decode")) -> InstanceRecord:
    return InstanceRecord(
        url=f"http://127.0.0.1:{8000 + i}",
        control=f"127.0.0.1:{9000 + i}",
        roles=roles,
        block_size=128,
        instance_id=f"inst-{i}",
        incarnation=f"inc-{i}",
        max_num_seqs=8,
    )


# ------------------------------------------------------------------ pure


def test_a_record_round_trips_and_a_bad_one_says_what_is_wrong() -> None:
    r = record(1, ("decode",))
    assert decode_record(encode_record(r)) == r
    older = encode_record(r).replace(',"max_num_seqs":8', "")  # from an instance before it
    assert '"max_num_seqs"' not in older and decode_record(older).max_num_seqs is None
    assert record_key("/p/", "inst-1") == "/p/instances/inst-1"
    for bad, why in (
        ("{", "not JSON"),
        ('{"url": "http://a:1"}', "not an instance record"),
        (encode_record(r).replace("http://", "ftp://"), "http"),
        (encode_record(r).replace('["decode"]', '["cook"]'), "roles"),
        (encode_record(r).replace('"block_size":128', '"block_size":0'), "block_size"),
        (encode_record(r).replace('"max_num_seqs":8', '"max_num_seqs":0'), "max_num_seqs"),
        ("x" * 5000, "at most"),
    ):
        with pytest.raises(ValueError, match=why):
            decode_record(bad)


def test_a_prefix_range_ends_after_its_last_byte() -> None:
    assert prefix_end("/rapidkv/") == "/rapidkv0"
    assert prefix_end("a") == "b"


# ------------------------------------------------------------------ on etcd


class Seen:
    """What a watcher reported, for waiting on."""

    def __init__(self) -> None:
        self.latest: Members = {}

    def __call__(self, members: Members) -> None:
        self.latest = members  # one assignment: atomic for the test's thread

    def wait_for(self, ids: set[str], timeout: float = 10.0) -> Members:
        """Wait until the latest report is exactly the instances `ids`."""
        wait_until(
            lambda: set(self.latest) == ids,
            timeout,
            what=f"the watcher to report {sorted(ids)} (it has {sorted(self.latest)})",
        )
        return self.latest


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return f"{PREFIX}{request.node.name}/"


def registrar(etcd: EtcdServer, prefix: str, r: InstanceRecord, ttl: float = 2.0) -> Registrar:
    reg = Registrar([etcd.url], record_key(prefix, r.instance_id), encode_record(r), ttl)
    reg.start()
    assert reg.wait_registered(10), "the registrar never put its key"
    return reg


def test_a_registered_instance_is_seen_and_a_revoked_one_goes_at_once(
    etcd: EtcdServer, prefix: str
) -> None:
    seen = Seen()
    watcher = MembershipWatcher([etcd.url], prefix, seen)
    watcher.start()
    try:
        a = registrar(etcd, prefix, record(1))
        b = registrar(etcd, prefix, record(2, ("decode",)))
        members = seen.wait_for({"inst-1", "inst-2"})
        assert members["inst-2"] == record(2, ("decode",))
        t0 = time.monotonic()
        a.stop()  # an orderly end: the lease is revoked
        seen.wait_for({"inst-2"}, timeout=1.0)
        assert time.monotonic() - t0 < 1.0
        b.stop()
        seen.wait_for(set())
    finally:
        t0 = time.monotonic()
        watcher.stop()
    assert time.monotonic() - t0 < 1.0, "stop() waited for the watch"


def test_an_instance_that_dies_drops_out_within_its_lease_ttl(
    etcd: EtcdServer, prefix: str
) -> None:
    """The registrar in a process of its own, SIGKILLed: no revoke, the key
    goes when the 2 s lease expires (etcd checks leases about every 500 ms)."""
    seen = Seen()
    watcher = MembershipWatcher([etcd.url], prefix, seen)
    watcher.start()
    code = (
        "import sys, time\n"
        "from rapidkv.membership.registrar import Registrar\n"
        "r = Registrar([sys.argv[1]], sys.argv[2], sys.argv[3], 2.0)\n"
        "r.start(); assert r.wait_registered(10); print('up', flush=True); time.sleep(600)\n"
    )
    r = record(3)
    child = subprocess.Popen(
        [sys.executable, "-c", code, etcd.url, record_key(prefix, r.instance_id), encode_record(r)],
        env={"PYTHONPATH": str(SRC_DIR), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"up"
        seen.wait_for({"inst-3"})
        child.kill()
        child.wait()
        t0 = time.monotonic()
        seen.wait_for(set(), timeout=6.0)
        # expiry <= its last refresh + TTL; etcd checks leases every ~0.5 s
        assert time.monotonic() - t0 < 2.0 + 2.0, "gone later than its TTL allows"
    finally:
        if child.poll() is None:
            child.kill()
        watcher.stop()


def test_the_watcher_and_the_registrar_ride_out_an_etcd_restart(
    etcd: EtcdServer, prefix: str
) -> None:
    """etcd killed and started again: the watcher reads the prefix again and
    follows it on (a member registered after the restart is seen), the
    registrar keeps its key (or puts it again under a new lease)."""
    seen = Seen()
    watcher = MembershipWatcher([etcd.url], prefix, seen, retry_s=0.2)
    watcher.start()
    try:
        a = registrar(etcd, prefix, record(4), ttl=3.0)
        seen.wait_for({"inst-4"})
        etcd.restart()
        b = registrar(etcd, prefix, record(5), ttl=3.0)
        seen.wait_for({"inst-4", "inst-5"}, timeout=15.0)
        time.sleep(3.5)  # longer than a TTL: both kept their keys alive
        assert set(seen.latest) == {"inst-4", "inst-5"}
        a.stop()
        b.stop()
        seen.wait_for(set())
    finally:
        watcher.stop()


def test_a_record_that_does_not_decode_is_left_out_and_the_rest_followed(
    etcd: EtcdServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    with EtcdClient([etcd.url]) as client:
        client.put(f"{prefix}instances/garbage", "{not json")
        seen = Seen()
        watcher = MembershipWatcher([etcd.url], prefix, seen)
        watcher.start()
        try:
            a = registrar(etcd, prefix, record(6))
            seen.wait_for({"inst-6"})
            assert any("garbage left out" in m for m in caplog.messages), caplog.messages
            a.stop()
            seen.wait_for(set())
        finally:
            watcher.stop()
            client.delete(f"{prefix}instances/garbage")


def test_no_endpoint_answering_is_a_clear_error() -> None:
    from rapidkv.harness import free_port

    with (
        EtcdClient([f"http://127.0.0.1:{free_port()}"], timeout_s=1) as client,
        pytest.raises(EtcdError, match="no etcd endpoint answered"),
    ):
        client.grant(5)
