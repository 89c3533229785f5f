"""P's finished requests that no D asks for: held for `finished_ttl_s`, then
freed. On a P of its own (`p-ttl`, a TTL of 1 s), run beside the single
instance's group so that it costs no restart of the shared pair."""

from __future__ import annotations

from pathlib import Path

import pytest
from pd_harness import wait_for

from rapidkv.connector.config import kv_transfer_config
from rapidkv.control.client import RpcClient
from rapidkv.control.messages import StatsRequest
from rapidkv.harness import ServerPool, free_port
from rapidkv.harness.client import complete_full

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_finished_request_without_transfer_kv_is_freed_after_its_ttl(
    server_pool: ServerPool, tiny_model: Path, workloads: dict
) -> None:
    """A P request whose D never asks (no TransferKV): P holds its blocks for
    `finished_ttl_s`, then frees them."""
    from rapidkv.harness import ServerSpec

    port = free_port()
    p = server_pool.get_one(
        "p-ttl",
        ServerSpec(
            model=tiny_model,
            name="prefill",
            role="prefill",
            cpus=(0,),
            kv_transfer_config=kv_transfer_config(port, finished_ttl_s=1.0),
        ),
    )
    control = f"127.0.0.1:{port}"
    with RpcClient() as rpc:
        baseline = rpc.call(control, StatsRequest(), 10).counters
        (ids,), _ = workloads["gone"]
        pk = {"rapidkv": {"xfer_id": "ttl-1", "role": "prefill"}}
        complete_full(p.base_url, ids, 1, kv_transfer_params=pk)
        held = rpc.call(control, StatsRequest(), 10).counters
        assert held["transfers_live"] == 1 and held["free_blocks"] < baseline["free_blocks"]

        def freed() -> bool:
            s = rpc.call(control, StatsRequest(), 10).counters
            return s["free_blocks"] == baseline["free_blocks"] and s["transfers_live"] == 0

        assert wait_for(freed, 1.0 + 2.0), "P kept the blocks past finished_ttl_s"
        assert rpc.call(control, StatsRequest(), 10).counters["finished_expired"] == 1
