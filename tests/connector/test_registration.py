"""The scheduler side keeps this instance's record in etcd (`membership`):
once its HTTP server answers `/health`, under a lease, gone at `close()`; on a
real etcd server (skipped with the reason where etcd cannot run)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from rapidkv.connector.config import ConnectorConfig, kv_roles
from rapidkv.connector.scheduler_side import SchedulerSide
from rapidkv.harness import wait_until
from rapidkv.membership.etcd import EtcdClient
from rapidkv.membership.record import decode_record

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class Health:
    """An HTTP server whose /health answers 200 once `up` is set (503 before)."""

    def __init__(self) -> None:
        self.up = threading.Event()
        up = self.up

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200 if up.is_set() and self.path == "/health" else 503)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def health() -> Iterator[Health]:
    h = Health()
    yield h
    h.close()


def records(etcd: Any, prefix: str) -> dict[str, str]:
    with EtcdClient([etcd.url]) as client:
        return client.get_prefix(prefix)[1]


def test_an_instance_registers_once_it_answers_health_and_leaves_at_close(
    etcd: Any, health: Health
) -> None:
    prefix = "/rapidkv-registration/"
    config = ConnectorConfig(
        etcd_endpoints=(etcd.url,), etcd_prefix=prefix, etcd_ttl_s=2.0, advertise_url=health.url
    )
    sched = SchedulerSide(
        config, "inst-r", 16, 1, "fp", roles=kv_roles("kv_consumer"), max_num_seqs=8
    )
    try:
        assert not sched.registrar.wait_registered(1.0), "registered before /health answered"
        assert records(etcd, prefix) == {}
        health.up.set()
        assert sched.registrar.wait_registered(10)
        ((key, value),) = records(etcd, prefix).items()
        assert key == f"{prefix}instances/inst-r"
        record = decode_record(value)
        assert (record.url, record.control, record.roles) == (
            health.url,
            sched.shared.control_address,
            ("decode",),
        )
        assert (record.block_size, record.instance_id, record.incarnation) == (
            16,
            "inst-r",
            sched.incarnation,
        )
        assert record.max_num_seqs == 8
    finally:
        sched.close()
    wait_until(lambda: records(etcd, prefix) == {}, 2.0, what="the record gone at close")


def test_etcd_without_an_advertised_url_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="etcd_endpoints needs advertise_url"):
        ConnectorConfig(etcd_endpoints=("http://127.0.0.1:2379",))
    with pytest.raises(ValueError, match="advertise_url is http"):
        ConnectorConfig(advertise_url="10.0.0.5:8000")
    with pytest.raises(ValueError, match="etcd_ttl_s"):
        ConnectorConfig(etcd_ttl_s=1.0)
    assert kv_roles("kv_producer") == ("prefill",) and kv_roles("kv_both") == ("prefill", "decode")


def test_an_instance_leaves_at_the_first_step_of_an_engine_shutdown(
    etcd: Any, health: Health
) -> None:
    """vLLM's engine drains before it closes the connector: the record goes
    at its first step after the shutdown signal (`closing`), not at close."""
    from vllm_stand_ins import SchedulerOutput

    prefix = "/rapidkv-leaving/"
    config = ConnectorConfig(
        etcd_endpoints=(etcd.url,), etcd_prefix=prefix, etcd_ttl_s=30.0, advertise_url=health.url
    )
    health.up.set()
    sched = SchedulerSide(config, "inst-l", 16, 1, "fp")
    try:
        assert sched.registrar.wait_registered(10)
        sched.shared.closing = True
        sched.build_meta(SchedulerOutput({}, set(), 0))
        wait_until(lambda: records(etcd, prefix) == {}, 2.0, what="the record gone")
    finally:
        sched.close()
