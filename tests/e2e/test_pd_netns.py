"""P and D as on two hosts: P in one Linux network namespace, D in another,
joined by a veth pair capped at `RATE` (`harness.netns`), the router and the
client in the root namespace (which reaches each side over an uncapped veth of
its own). The control plane and the data plane between P and D cross the
capped link only:

- P's control plane binds every interface (``control_host: 0.0.0.0``) and
  advertises its link address (``control_advertise_host``); D's binds its link
  address only;
- each side's data plane is given its link address (``kvt_host``): NIXL/UCX
  over TCP on that interface (``UCX_NET_DEVICES``, ``UCX_TLS=tcp``, set by the
  connector);
- the HTTP servers listen on the link addresses too (reached from the root
  namespace by a host route each).

Greedy outputs through the router are the single instance's, token for
token; every prompt's KV moved (no recompute fallback), at least as many bytes
as D loaded crossed P's end of the veth, and nothing is held afterwards.

Skips, with the reason, where this machine does not allow network namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pd_harness import (
    BLOCK,
    MAX_TOKENS,
    Pair,
    assert_back_to_baseline,
    block_bytes,
    connector_config,
    wait_for,
)

from rapidkv.harness import ServerPool, free_port
from rapidkv.harness.client import acomplete_stream, get_metrics, metric_sum, stream_many
from rapidkv.harness.netns import NetnsLink, NetnsUnavailable, netns_link
from rapidkv.harness.server import pd_specs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

RATE = "1gbit"
KEY = "pd-netns"


@pytest.fixture(scope="module")
def netns_pair(
    request: pytest.FixtureRequest, server_pool: ServerPool, tiny_model: Path
) -> Iterator[tuple[NetnsLink, Pair]]:
    """The link first (a machine without namespaces skips before any server
    starts), then the reference outputs, then the pair in the namespaces;
    stopped before the link goes."""
    with contextlib.ExitStack() as stack:
        try:
            link = stack.enter_context(netns_link(rate=RATE))
        except NetnsUnavailable as e:
            pytest.skip(f"network namespaces not allowed here: {e}")
        request.getfixturevalue("workloads")  # computed before the pair takes the cores
        pc, dc = free_port(), free_port()
        p_cfg = connector_config(
            pc, control_host="0.0.0.0", control_advertise_host=link.a.host, kvt_host=link.a.host
        )
        d_cfg = connector_config(dc, control_host=link.b.host, kvt_host=link.b.host)
        chunked = ("--max-num-batched-tokens", "256")
        p_spec, d_spec = pd_specs(tiny_model, p_cfg, d_cfg, chunked)
        specs = [
            p_spec.replace(netns=link.a.name, host=link.a.host),
            d_spec.replace(netns=link.b.name, host=link.b.host),
        ]
        stack.callback(server_pool.stop, KEY)
        p, d = server_pool.get(KEY, specs)
        pair = Pair(tiny_model, p, d, f"{link.a.host}:{pc}", f"{link.b.host}:{dc}")
        stack.callback(pair.close)
        yield link, pair


def loaded_tokens(pair: Pair) -> float:
    """Prompt tokens D's engine took from the connector, by its /metrics."""
    return metric_sum(
        get_metrics(pair.d.base_url),
        "vllm:prompt_tokens_by_source_total",
        source="external_kv_transfer",
    )


def router_config(pair: Pair):
    from rapidkv.router.config import Instance, RouterConfig

    return RouterConfig(
        prefill=(Instance(pair.p.base_url),),  # control address and block size discovered
        decode=(Instance(pair.d.base_url, pair.d_control),),
        port=0,
    )


def assert_moved_over_the_link(
    link: NetnsLink, pair: Pair, before: dict, n: int, sent0: int, loaded0: float
) -> None:
    """`n` transfers, none recomputed, and what D loaded went through P's veth."""
    d = pair.stats("d")
    assert d.get("recompute_fallbacks", 0) == before["d"].get("recompute_fallbacks", 0)
    assert d.get("split_loads_failed", 0) == before["d"].get("split_loads_failed", 0)
    assert wait_for(
        lambda: pair.stats("p").get("transfers_ok", 0) - before["p"].get("transfers_ok", 0) == n,
        2.0,
    ), f"P counted {pair.stats('p').get('transfers_ok', 0) - before['p'].get('transfers_ok', 0)}"
    loaded = loaded_tokens(pair) - loaded0
    assert loaded > 0, "D's engine counted no prompt tokens loaded over the connector"
    crossed = link.tx_bytes(link.a) - sent0
    kv_bytes = loaded * block_bytes(pair.model) / BLOCK
    assert crossed >= kv_bytes, f"{crossed} bytes left P's veth for {kv_bytes:.0f} loaded"
    assert_back_to_baseline(pair)


def test_p_advertises_its_link_address_not_the_wildcard_it_binds(
    netns_pair: tuple[NetnsLink, Pair],
) -> None:
    """The router's discovery request to P (HTTP across the root namespace's
    veth): P names its link address and the port it bound on every interface."""
    from rapidkv.router.fleet.discovery import probe_body

    link, pair = netns_pair
    body = {**probe_body(), "model": str(pair.model)}
    answer = httpx.post(f"{pair.p.base_url}/v1/completions", json=body, timeout=60).json()
    assert answer["kv_transfer_params"]["rapidkv"]["control"] == pair.p_control
    assert pair.p_control.startswith(f"{link.a.host}:")


def test_pd_across_two_namespaces_equals_a_single_instance(
    netns_pair: tuple[NetnsLink, Pair], workloads: dict
) -> None:
    """Four at a time through the router (P computes each prompt, its first
    token opens the stream): outputs the single instance's, KV over the link."""
    link, pair = netns_pair
    prompts, expected = workloads["netns"]
    before = {"p": pair.stats("p"), "d": pair.stats("d")}
    sent0, loaded0 = link.tx_bytes(link.a), loaded_tokens(pair)

    from rapidkv.router.server import start_router

    with start_router(router_config(pair)) as router:
        outs = stream_many(router.url, prompts, MAX_TOKENS, concurrency=4)
    assert [o.token_ids for o in outs] == expected
    assert_moved_over_the_link(link, pair, before, len(prompts), sent0, loaded0)


def test_split_prefills_across_two_namespaces_equal_a_single_instance(
    netns_pair: tuple[NetnsLink, Pair], workloads: dict
) -> None:
    """One at a time (P and D idle): the router splits each prompt; D waits for
    each layer of P's head as it crosses the link."""
    link, pair = netns_pair
    prompts, expected = workloads["netns-split"]
    before = {"p": pair.stats("p"), "d": pair.stats("d")}
    sent0, loaded0 = link.tx_bytes(link.a), loaded_tokens(pair)

    from rapidkv.router.server import start_router

    async def main(url: str):
        async with httpx.AsyncClient() as client:
            return [await acomplete_stream(client, url, ids, MAX_TOKENS) for ids in prompts]

    with start_router(router_config(pair)) as router:
        outs = asyncio.run(main(router.url))
        split = metric_sum(get_metrics(router.url), "rapidkv_router_split_prefills_total")
    assert [o.token_ids for o in outs] == expected
    assert split == len(prompts)
    d = pair.stats("d")
    assert d.get("split_loads_ok", 0) - before["d"].get("split_loads_ok", 0) == len(prompts)
    assert_moved_over_the_link(link, pair, before, len(prompts), sent0, loaded0)
