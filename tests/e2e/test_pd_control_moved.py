"""P and then D of the shared pair restarted with their control planes on
other ports, the router left running: both are followed. Run after every
other user of the shared pair (it leaves the pair stopped: the next group
starts anyway)."""

from __future__ import annotations

import contextlib
import time

import pytest
from pd_harness import (
    MAX_TOKENS,
    Pair,
    connector_config,
    served_with_transfer,
)

from rapidkv.harness import ServerPool, VLLMServer, free_port
from rapidkv.harness.client import complete_full

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_p_then_d_restarted_with_their_control_plane_elsewhere_are_followed(
    pd_pair: Pair, workloads: dict, server_pool: ServerPool
) -> None:
    """P comes back on its HTTP address with its control plane on another port,
    before the router saw it down: the first request's D asks the old address
    and recomputes (the client sees nothing); P's answer names the new address,
    and the next request crosses with a real transfer. Then D comes back with
    its control plane elsewhere: its first request after it is healthy crosses
    with a real transfer (its Handshake tells P where it is)."""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    prompts, expected = workloads["moved-p"]
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url, None),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
        split_prefill=False,
    )

    def restart_elsewhere(server: VLLMServer) -> str:
        """`server` killed and started again on its HTTP address, its control
        plane on a new port: that control address."""
        server.stop(grace=0)
        port = free_port()
        server.spec = server.spec.replace(kv_transfer_config=connector_config(port))
        server.launch()
        server.wait_ready()
        return f"127.0.0.1:{port}"

    with start_router(config) as router, contextlib.ExitStack() as undo:
        # the pair as configured again for whoever needs it next
        undo.callback(server_pool.stop, "pd")
        served_with_transfer(pd_pair, router.url, prompts[0], expected[0])
        pd_pair.p_control = restart_elsewhere(pd_pair.p)
        healthy = time.monotonic()
        d0 = pd_pair.stats("d")
        assert complete_full(router.url, prompts[1], MAX_TOKENS).token_ids == expected[1]
        assert pd_pair.since({"d": d0}, "d", "recompute_fallbacks") == 1
        served_with_transfer(pd_pair, router.url, prompts[2], expected[2])
        assert time.monotonic() - healthy < 5.0

        # then D, likewise: P learns its new control address from its Handshake
        pd_pair.d_control = restart_elsewhere(pd_pair.d)
        healthy = time.monotonic()
        served_with_transfer(pd_pair, router.url, prompts[3], expected[3])
        assert time.monotonic() - healthy < 5.0
