"""A real P/D pair with RapidKVConnector (step mode): the KV crosses over kvt,
D's greedy output is token-identical to a single vLLM instance, and nothing
leaks. Dispatch is done here (P and D requests per prompt, as the router does)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import socket
import time

import httpx
import pytest
from pd_harness import (
    BLOCK,
    LATE_DECODE_TOKENS,
    LATE_LENGTHS,
    LATE_ROUNDS,
    LATE_SLOTS,
    MAX_TOKENS,
    MODE_RUNS,
    Pair,
    assert_back_to_baseline,
    block_bytes,
    wait_for,
)

from rapidkv.harness import free_port, random_prompts, wait_until
from rapidkv.harness.client import (
    acomplete_full,
    get_metrics,
    metric_sum,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


STALL_S = 0.5
"""No gap between two events of a stream through the router may be longer
than this: the bug this guards against lost a whole second."""

LOADED_STALL_S = 0.8
"""`STALL_S` for 32 streams at once, whose client and router share the two
cores with P and D: a scheduling hiccup there once made a gap of 507 ms on a
slow machine; a lost second still fails it."""


def assert_usage_and_no_stall(
    outs: list, prompts: list, ttft_s: float | None = None, stall_s: float = STALL_S
) -> None:
    """Every stream asked for `include_usage` (the harness's default, as vLLM's
    benchmark client and the OpenAI SDK do) and ends with the usage one vLLM
    instance reports for it; no event waited `stall_s` after the one before
    it, nor the first one `ttft_s` (when given: P and D were idle)."""
    for out, prompt in zip(outs, prompts, strict=True):
        n = len(prompt)
        assert out.usage == {
            "prompt_tokens": n,
            "completion_tokens": MAX_TOKENS,
            "total_tokens": n + MAX_TOKENS,
        }, out.usage
        longest = max(b - a for a, b in itertools.pairwise(out.chunk_ms))
        assert longest < stall_s * 1000, f"a {n}-token prompt's stream paused {longest:.0f} ms"
        if ttft_s is not None:
            assert out.ttft_ms < ttft_s * 1000, f"a {n}-token prompt's TTFT: {out.ttft_ms:.0f} ms"


@pytest.mark.parametrize("run", list(MODE_RUNS))
def test_pd_output_equals_single_instance_and_nothing_leaks(
    pd_pair: Pair, workloads: dict, run: str
) -> None:
    dispatch, mode = MODE_RUNS[run]
    prompts, expected = workloads[run]
    before = {w: pd_pair.stats(w) for w in ("p", "d")}
    d_metrics = get_metrics(pd_pair.d.base_url)

    outputs = pd_pair.run(prompts, run, serial=dispatch == "serial", mode=mode)

    mismatches = [i for i, (a, b) in enumerate(zip(outputs, expected, strict=True)) if a != b]
    assert not mismatches, f"{len(mismatches)} outputs differ from the single instance"
    # the KV really crossed: every prompt's KV came from P, none recomputed
    assert wait_for(
        lambda: (
            pd_pair.stats("p").get("transfers_ok", 0) - before["p"].get("transfers_ok", 0)
            == len(prompts)
        ),
        2.0,
    ), "P did not confirm every transfer"
    after_d, after_p = pd_pair.stats("d"), pd_pair.stats("p")
    assert after_d.get("recompute_fallbacks", 0) == before["d"].get("recompute_fallbacks", 0)
    m = get_metrics(pd_pair.d.base_url)

    def delta(source: str) -> float:
        return metric_sum(m, "vllm:prompt_tokens_by_source_total", source=source) - metric_sum(
            d_metrics, "vllm:prompt_tokens_by_source_total", source=source
        )

    assert delta("external_kv_transfer") == sum(len(p) - 1 for p in prompts)
    assert delta("local_compute") == len(prompts)
    # and the bytes: every block of every prompt's first len-1 tokens, once
    blocks = sum(-(-(len(p) - 1) // BLOCK) for p in prompts)
    moved = after_p["bytes_sent"] - before["p"].get("bytes_sent", 0)
    assert moved == blocks * block_bytes(pd_pair.model)

    def p_delta(name: str) -> float:
        return after_p.get(name, 0) - before["p"].get(name, 0)

    if run == "serial-bypass":
        # every TransferKV came after P finished: all sent at once, off the step path
        assert p_delta("bypass_full_sends") == len(prompts)
        assert p_delta("steps_with_layer_sends") == 0
    if dispatch == "dual":
        # TransferKV came before P computed: the chunks went layer by layer, each
        # step's first layer handed to the transport before its last layer was done
        layered = after_p["steps_with_layer_sends"] - before["p"].get("steps_with_layer_sends", 0)
        early = after_p["steps_sent_before_last_layer"] - before["p"].get(
            "steps_sent_before_last_layer", 0
        )
        assert layered >= len(prompts) // 2
        assert early == layered
    # within 2 s of the last response everything is back where it was
    assert_back_to_baseline(pd_pair)


def test_d_prefix_hits_are_not_transferred(pd_pair: Pair, workloads: dict) -> None:
    """D already holds the first blocks of a prompt (an earlier request shared
    them): only the missing blocks cross, and the output is still exact."""
    first, second = workloads["prefix"][0]
    m0 = get_metrics(pd_pair.d.base_url)
    p0, d0 = pd_pair.stats("p"), pd_pair.stats("d")
    out = pd_pair.run([first], "prefix-a", serial=False) + pd_pair.run(
        [second], "prefix-b", serial=False
    )
    m1 = get_metrics(pd_pair.d.base_url)

    def delta(source: str) -> float:
        return metric_sum(m1, "vllm:prompt_tokens_by_source_total", source=source) - metric_sum(
            m0, "vllm:prompt_tokens_by_source_total", source=source
        )

    # the second prompt's first two blocks were prefix hits on D, never sent
    assert delta("local_cache_hit") == 2 * BLOCK
    assert delta("external_kv_transfer") == (len(first) - 1) + (len(second) - 1 - 2 * BLOCK)
    assert pd_pair.stats("p")["transfers_ok"] - p0.get("transfers_ok", 0) == 2
    # bytes: all of the first prompt's blocks, the second's minus the 2 shared ones
    sent_blocks = -(-(len(first) - 1) // BLOCK) + -(-(len(second) - 1) // BLOCK) - 2
    moved = pd_pair.stats("p")["bytes_sent"] - p0.get("bytes_sent", 0)
    assert moved == sent_blocks * block_bytes(pd_pair.model)
    assert pd_pair.since({"d": d0}, "d", "recompute_fallbacks") == 0
    assert out == workloads["prefix"][1]


def test_transfer_kv_before_the_request_is_parked_and_served(
    pd_pair: Pair, workloads: dict
) -> None:
    """D's TransferKV reaches P long before P sees the request (the P call is
    held back until P reports the park): served from the park, no NOT_FOUND."""
    (ids,), (expected,) = workloads["late_p"]
    p0, d0 = pd_pair.stats("p"), pd_pair.stats("d")
    pk, _ = pd_pair.params("late-p")

    async def main():
        async with httpx.AsyncClient() as client:
            to_d = await pd_pair.start_d_and_wait_parked(client, "late-p", ids)
            await acomplete_full(client, pd_pair.p.base_url, ids, 1, kv_transfer_params=pk)
            return await to_d

    out = asyncio.run(main())
    assert out.token_ids == expected
    p1 = pd_pair.stats("p")
    assert p1["parked_served"] - p0.get("parked_served", 0) == 1
    assert p1.get("park_expired", 0) == p0.get("park_expired", 0)
    assert p1["transfers_ok"] - p0.get("transfers_ok", 0) == 1
    assert pd_pair.since({"d": d0}, "d", "recompute_fallbacks") == 0


def test_transfer_kv_for_an_aborted_request_gets_gone_and_d_recomputes(
    pd_pair: Pair, workloads: dict
) -> None:
    from rapidkv.control.messages import Abort, AbortReason

    (ids,), (expected,) = workloads["gone"]
    d0 = pd_pair.stats("d")
    reply = pd_pair.rpc.call(
        pd_pair.p_control, Abort(xfer_id="gone-1", reason=AbortReason.CLIENT_ABORT), 10
    )
    assert reply.code.name == "OK"
    _, dk = pd_pair.params("gone-1")

    async def main():
        async with httpx.AsyncClient() as client:
            return await acomplete_full(
                client, pd_pair.d.base_url, ids, MAX_TOKENS, kv_transfer_params=dk
            )

    assert asyncio.run(main()).token_ids == expected
    # here, and only here, D prefilled locally
    assert pd_pair.stats("d")["recompute_fallbacks"] - d0.get("recompute_fallbacks", 0) == 1


@pytest.mark.parametrize("dispatch", ["dual", "serial", "dual-continuation"])
def test_router_streams_pd_outputs_equal_to_single_instance(
    pd_pair: Pair, workloads: dict, dispatch: str
) -> None:
    """Streamed greedy completions through the router. In dual dispatch P's first
    token opens the client's stream and D's follows without it; with the
    router's mismatch hook every such stream continues instead from the prompt
    plus P's token (the path taken when D's first token differs)."""
    from rapidkv.harness.client import stream_many
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    prompts, expected = workloads[f"router-{dispatch}"]
    p0, d0 = pd_pair.stats("p"), pd_pair.stats("d")
    # dual: the router asks P for its control address; serial: it is given
    p_control = None if dispatch.startswith("dual") else pd_pair.p_control
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url, p_control),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
        dispatch="serial" if dispatch == "serial" else "dual",
        debug_first_token_mismatch=dispatch == "dual-continuation",
        split_prefill=False,  # P's first token opens the streams (splits: below)
    )

    with start_router(config) as router:
        outs = stream_many(router.url, prompts, MAX_TOKENS, concurrency=4)
        metrics = get_metrics(router.url)
    assert [o.token_ids for o in outs] == expected
    assert_usage_and_no_stall(outs, prompts)
    first = {
        source: metric_sum(metrics, "rapidkv_router_first_token_total", source=source)
        for source in ("prefill", "decode", "continuation")
    }
    if dispatch == "serial":
        assert sum(first.values()) == 0
    elif dispatch == "dual":
        assert first["continuation"] == 0
        assert first["prefill"] >= 1  # P's token did open streams
        assert first["prefill"] + first["decode"] == len(prompts)
    else:
        assert first["prefill"] == 0  # every stream P opened continued instead
        assert first["continuation"] >= 1
        assert first["continuation"] + first["decode"] == len(prompts)
    # P counts a transfer when its workers' confirmation reaches its scheduler,
    # a step or so after D got the KV
    assert wait_for(
        lambda: (
            pd_pair.stats("p").get("transfers_ok", 0) - p0.get("transfers_ok", 0) == len(prompts)
        ),
        2.0,
    )
    assert pd_pair.stats("d").get("recompute_fallbacks", 0) == d0.get("recompute_fallbacks", 0)
    assert_back_to_baseline(pd_pair)


def test_router_local_dispatch_streams_the_usage_one_vllm_reports(
    pd_pair: Pair, workloads: dict
) -> None:
    """`--dispatch local`: D alone answers, the client's bytes relayed as they
    come, with the usage one vLLM reports; P is not asked."""
    from rapidkv.harness.client import stream_many
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    prompts, expected = workloads["router-serial"]
    p0 = pd_pair.stats("p")
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url, pd_pair.p_control),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
        dispatch="local",
    )
    with start_router(config) as router:
        outs = stream_many(router.url, prompts[:8], MAX_TOKENS, concurrency=4)
    assert [o.token_ids for o in outs] == expected[:8]
    assert_usage_and_no_stall(outs, prompts[:8])
    assert pd_pair.stats("p").get("parked", 0) == p0.get("parked", 0)
    assert_back_to_baseline(pd_pair)


def test_router_split_prefills_equal_single_instance_outputs(
    pd_pair: Pair, workloads: dict
) -> None:
    """One request at a time through the router (P and D idle): every prompt
    with a whole block to spare is split, P computing a head of whole blocks
    while D computes the tail, waiting for each layer of the head as P sends it;
    the outputs are the single instance's."""
    from rapidkv.harness.client import acomplete_stream
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router
    from rapidkv.router.split import split_point

    prompts, expected = workloads["router-split"]
    before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url),),  # control and block size discovered
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
    )

    async def main(url: str):
        async with httpx.AsyncClient() as client:
            return [await acomplete_stream(client, url, ids, MAX_TOKENS) for ids in prompts]

    with start_router(config) as router:
        outs = asyncio.run(main(router.url))
        split = metric_sum(get_metrics(router.url), "rapidkv_router_split_prefills_total")
    assert [o.token_ids for o in outs] == expected
    assert_usage_and_no_stall(outs, prompts, ttft_s=1.0)
    splittable = sum(
        split_point(len(ids), BLOCK, config.split_fraction, config.split_min_tokens) > 0
        for ids in prompts
    )
    assert splittable >= len(prompts) // 2
    assert split == splittable
    d = pd_pair.stats("d")
    assert d.get("split_loads_ok", 0) - before["d"].get("split_loads_ok", 0) == splittable
    assert d.get("split_loads_failed", 0) == before["d"].get("split_loads_failed", 0)
    assert d.get("recompute_fallbacks", 0) == before["d"].get("recompute_fallbacks", 0)
    assert wait_for(
        lambda: (
            pd_pair.stats("p").get("transfers_ok", 0) - before["p"].get("transfers_ok", 0)
            == len(prompts)
        ),
        2.0,
    )
    assert_back_to_baseline(pd_pair)


def test_32_streams_through_the_router_start_as_the_engines_answer_and_flow_as_produced(
    pd_pair: Pair, workloads: dict
) -> None:
    """32 streams at once through the router with its defaults (dual dispatch,
    splits while idle), each asking for `include_usage`: the outputs are the
    single instance's, with its usage; the client's TTFT p90 is within 1.5x the
    engines' own (their `time_to_first_token` histograms, to the bucket) + 50 ms,
    so nothing waits outside them; no event waits `LOADED_STALL_S`; and the tokens
    come as they are produced, not in lumps (median gap over 1 ms)."""
    from rapidkv.bench.common.stats import (
        ENGINE_TTFT_FACTOR,
        ENGINE_TTFT_SLACK_MS,
        TTFT_METRIC,
        Histogram,
        histogram,
        histogram_delta,
        histogram_percentile,
        merge_histograms,
        percentile,
    )
    from rapidkv.harness.client import stream_many
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    prompts, expected = workloads["router-dual"]
    assert len(prompts) == 32
    urls = (pd_pair.p.base_url, pd_pair.d.base_url)
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
    )

    def engines_ttft(before: list[Histogram]) -> Histogram:
        """P's and D's TTFT histograms since `before`, merged."""
        now = [histogram(get_metrics(u), TTFT_METRIC) for u in urls]
        return merge_histograms(histogram_delta(b, h) for b, h in zip(before, now, strict=True))

    with start_router(config) as router:
        before = [histogram(get_metrics(u), TTFT_METRIC) for u in urls]
        outs = stream_many(router.url, prompts, MAX_TOKENS, concurrency=32)
        # P's first token of each request and D's: their API servers record
        # them as the outputs go out
        assert wait_for(lambda: engines_ttft(before).count >= 2 * len(prompts), 5)
        engines = engines_ttft(before)
    assert [o.token_ids for o in outs] == expected
    assert_usage_and_no_stall(outs, prompts, stall_s=LOADED_STALL_S)
    engine_p90_ms = histogram_percentile(engines, 90) * 1000
    client_p90_ms = percentile(sorted(o.ttft_ms for o in outs), 90)
    bound = ENGINE_TTFT_FACTOR * engine_p90_ms + ENGINE_TTFT_SLACK_MS
    assert client_p90_ms <= bound, (client_p90_ms, engine_p90_ms)
    gaps = sorted(b - a for o in outs for a, b in itertools.pairwise(o.token_ms))
    assert percentile(gaps, 50) > 1.0, f"tokens came in lumps: median gap {percentile(gaps, 50)} ms"
    assert_back_to_baseline(pd_pair)


def test_a_batch_of_prompts_through_the_router_is_answered_as_one_vllm_answers_it(
    pd_pair: Pair, workloads: dict
) -> None:
    """A completion whose `prompt` is a list of prompts (the API's batch form)
    hung in dual dispatch: vLLM made one engine request per prompt with one
    xfer_id, and D waited for KV that no transfer brought. It is served on D
    alone: every choice, in order, is the single instance's."""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    prompts, expected = workloads["router-serial"]
    batch = [prompts[1], prompts[6]]
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
    )
    body = {
        "prompt": batch,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    with start_router(config) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == [expected[1], expected[6]]
    assert_back_to_baseline(pd_pair)


def test_router_splits_a_text_prompt_after_tokenizing_it_on_p(
    pd_pair: Pair, workloads: dict
) -> None:
    """A text prompt: the router asks P's /tokenize for its ids, sends P the
    head's ids and D the text; D's own tokenization must agree (P checks the
    head's hash), and the outputs are the single instance's for the same text."""
    from rapidkv.harness.client import completion_body
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    texts, expected = workloads["split_text"]
    before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
    )
    with start_router(config) as router, httpx.Client(timeout=120) as client:
        outs = []
        for text in texts:
            body = completion_body([], MAX_TOKENS, prompt=text)
            resp = client.post(f"{router.url}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            outs.append(resp.json()["choices"][0]["token_ids"])
        split = metric_sum(get_metrics(router.url), "rapidkv_router_split_prefills_total")
    assert outs == expected
    assert split == len(texts)
    d = pd_pair.stats("d")
    assert d.get("split_loads_ok", 0) - before["d"].get("split_loads_ok", 0) == len(texts)
    assert pd_pair.stats("p").get("prompt_mismatch", 0) == before["p"].get("prompt_mismatch", 0)
    assert_back_to_baseline(pd_pair)


def test_a_split_prefills_head_goes_layer_by_layer_whatever_the_mode(
    pd_pair: Pair, workloads: dict
) -> None:
    """A split prefill asked for in `step` mode whose TransferKV reaches P while
    P computes the head's last chunk: in step mode that chunk would go after the
    step, but a head goes layer by layer whatever the mode (D's forward waits for
    each layer), so P attaches it to the step in flight as a substep. The output
    is the single instance's."""
    (ids,), (want,) = workloads["split_step"]
    before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}
    pk, dk = pd_pair.params("split-step", mode="step")
    head = 3 * BLOCK  # two chunks on P (256 tokens per step)
    dk["rapidkv"]["split_tokens"] = head

    assert pd_pair.d_during_last_chunk("split-step", ids[:head], ids, pk, dk).token_ids == want
    assert pd_pair.timeline("split-step").state_at_arrival == "last_chunk"
    assert pd_pair.timeline("split-step").mode == "substep"
    d = pd_pair.stats("d")
    assert d.get("split_loads_ok", 0) == before["d"].get("split_loads_ok", 0) + 1
    p = pd_pair.stats("p")
    assert p.get("substeps_opened", 0) == before["p"].get("substeps_opened", 0) + 1
    assert_back_to_baseline(pd_pair)


@pytest.mark.parametrize("failure", ["p_refuses", "p_unreachable"])
def test_a_split_prefill_whose_head_fails_is_recomputed_by_d(
    pd_pair: Pair, workloads: dict, failure: str
) -> None:
    """D waits for a head that never comes: P refuses the TransferKV (the head P
    was sent is not the start of D's prompt) or cannot be reached. The wait ends
    when the TransferKV fails, D reports the head's blocks as load errors, vLLM
    recomputes them, and the output is still the single instance's."""
    prompts, expected = workloads["split_fail"]
    ids = prompts[0] if failure == "p_refuses" else prompts[1]
    want = expected[0] if failure == "p_refuses" else expected[1]
    before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}
    head = 2 * BLOCK
    xfer_id = f"split-{failure}"
    pk, dk = pd_pair.params(xfer_id)
    dk["rapidkv"]["split_tokens"] = head
    if failure == "p_unreachable":
        dk["rapidkv"]["prefill_control"] = f"127.0.0.1:{free_port()}"

    async def main():
        async with httpx.AsyncClient() as client:
            to_d = acomplete_full(
                client, pd_pair.d.base_url, ids, MAX_TOKENS, kv_transfer_params=dk
            )
            if failure == "p_unreachable":
                return await to_d
            wrong_head = ids[1 : head + 1]
            to_p = acomplete_full(client, pd_pair.p.base_url, wrong_head, 1, kv_transfer_params=pk)
            return (await asyncio.gather(to_d, to_p))[0]

    assert asyncio.run(main()).token_ids == want
    d = pd_pair.stats("d")
    assert d.get("split_loads_failed", 0) == before["d"].get("split_loads_failed", 0) + 1
    assert d.get("recompute_fallbacks", 0) == before["d"].get("recompute_fallbacks", 0) + 1
    if failure == "p_refuses":
        assert pd_pair.stats("p").get("prompt_mismatch", 0) == (
            before["p"].get("prompt_mismatch", 0) + 1
        )
    assert_back_to_baseline(pd_pair)


def test_transfer_kv_late_from_a_busy_d_takes_the_fast_paths(
    pd_pair: Pair, workloads: dict
) -> None:
    """D is busy with decodes (every slot taken), so the PD requests wait in its
    queue and their TransferKVs reach P only when the decodes end, each round
    later into P's prefills: some find P finished with the prompt (bypass: sent
    at once), some may find P computing its last chunk (substep). Real timing, no
    debug delay on the bypass channel; rounds repeat until a bypass send was seen
    (at most LATE_ROUNDS). Whatever path each took, every block goes exactly once
    and the outputs are the single instance's. (Whether a late TransferKV lands
    in a last chunk is timing; the substep path is pinned down by
    test_transfer_kv_during_the_last_chunk_is_attached_as_a_substep.)"""
    pair = pd_pair
    before = {"p": pair.stats("p"), "d": pair.stats("d")}
    decodes = random_prompts(pair.model, [40] * LATE_SLOTS, seed=5100)

    async def round_(r: int) -> list[list[int]]:
        prompts, _ = workloads[f"late-{r}"]
        async with httpx.AsyncClient() as client:
            busy = [
                asyncio.create_task(acomplete_full(client, pair.d.base_url, ids, n))
                for ids in decodes
                for n in [LATE_DECODE_TOKENS[r]]
            ]
            deadline = time.monotonic() + 20
            while (
                metric_sum(get_metrics(pair.d.base_url), "vllm:num_requests_running") < LATE_SLOTS
            ):
                for task in busy:  # a decode that failed says why D is not busy
                    if task.done() and task.exception() is not None:
                        raise task.exception()
                if all(task.done() for task in busy):
                    # D was busy between two samples of its gauge (a round's
                    # decodes can be that short): this round's PD requests find
                    # D idle and show no fast path; the next rounds decode longer
                    break
                assert time.monotonic() < deadline, "D never got busy"
                await asyncio.sleep(0.01)
            outs = await asyncio.gather(
                *(
                    pair._one(client, f"late-{r}-{i}", ids, serial=False, mode="substep")
                    for i, ids in enumerate(prompts)
                )
            )
            await asyncio.gather(*busy)
        return [o.token_ids for o in outs]

    seen = functools.partial(pair.since, before, "p")

    rounds = 0
    while rounds < LATE_ROUNDS and not seen("bypass_full_sends"):
        assert asyncio.run(round_(rounds)) == workloads[f"late-{rounds}"][1]
        rounds += 1
    p1 = pair.stats("p")
    assert seen("bypass_full_sends") >= 1, f"no TransferKV found its request finished: {p1}"
    n = rounds * len(LATE_LENGTHS)
    assert wait_for(lambda: seen("transfers_ok") == n, 2.0)
    blocks = rounds * sum(-(-(length - 1) // BLOCK) for length in LATE_LENGTHS)
    assert seen("bytes_sent") == blocks * block_bytes(pair.model)  # every block once
    assert pair.stats("d").get("recompute_fallbacks", 0) == before["d"].get(
        "recompute_fallbacks", 0
    )
    assert_back_to_baseline(pair)


def test_transfer_kv_during_the_last_chunk_is_attached_as_a_substep(
    pd_pair: Pair, workloads: dict
) -> None:
    """D's TransferKV (substep mode) reaches P while P computes the prompt's last
    chunk: P attaches the chunk's blocks to the step in flight as a substep, the
    worker accepts it (the step has not frozen: 5 ms per layer), and every block
    goes exactly once. The output is the single instance's."""
    (ids,), (want,) = workloads["substep_late"]
    before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}
    pk, dk = pd_pair.params("substep-late", mode="substep")

    assert pd_pair.d_during_last_chunk("substep-late", ids, ids, pk, dk).token_ids == want
    assert pd_pair.timeline("substep-late").state_at_arrival == "last_chunk"

    delta = functools.partial(pd_pair.since, before)

    assert wait_for(lambda: delta("p", "transfers_ok") == 1, 2.0)
    assert delta("p", "substeps_opened") == 1
    assert delta("p", "substeps_accepted") == 1
    assert delta("p", "substeps_rolled_back") == 0
    blocks = -(-(len(ids) - 1) // BLOCK)
    assert delta("p", "bytes_sent") == blocks * block_bytes(pd_pair.model)  # each block once
    assert delta("d", "recompute_fallbacks") == 0
    assert_back_to_baseline(pd_pair)


def test_d_request_aborted_while_waiting_for_kv_frees_everything(
    pd_pair: Pair, workloads: dict
) -> None:
    """The client gives up on D while its TransferKV is parked on P (P never gets
    the request): D aborts, tells P, and only then reports the request done; P
    drops the park. Nothing is held afterwards on either side."""
    (ids,), _ = workloads["abort_d"]
    before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}

    async def main():
        async with httpx.AsyncClient() as client:
            to_d = await pd_pair.start_d_and_wait_parked(client, "abort-d", ids)
            to_d.cancel()  # the client disconnects: vLLM aborts the request on D
            with contextlib.suppress(asyncio.CancelledError):
                await to_d

    asyncio.run(main())
    assert_back_to_baseline(pd_pair)
    assert pd_pair.stats("p").get("aborts_client_abort", 0) > before["p"].get(
        "aborts_client_abort", 0
    )


def test_nothing_to_load_releases_p_at_once(pd_pair: Pair, workloads: dict) -> None:
    """D's prefix cache already covers all but the last token: D asks for nothing
    and tells P, which frees the finished request now (not after its TTL)."""
    (ids,), (expected,) = workloads["nothing"]
    assert len(ids) == BLOCK + 1
    pd_pair.run([ids], "nothing-warm", serial=True)  # D now caches the first block
    before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}
    assert pd_pair.run([ids], "nothing", serial=True) == [expected]
    assert_back_to_baseline(pd_pair)
    assert (
        pd_pair.stats("p").get("aborts_nothing_to_load", 0)
        == before["p"].get("aborts_nothing_to_load", 0) + 1
    )


# counters and gauges that change only on the engine thread (or the workers), or
# in this test only before the steps it causes: an idle instance's /metrics has
# them exactly as its control plane does (the series follow engine steps)
P_COUNTERS = ["transfers_ok", "transfers_failed", "bytes_sent", "rpc_frame_errors"]
D_COUNTERS = ["transfer_kv_sent", "recompute_fallbacks"]
GAUGES = [
    "parked_now",
    "transfers_live",
    "waiting_for_kv",
    "held_requests",
    "held_blocks",
    "peers_decode",
    "peers_prefill_ready",
    "free_blocks",
]


def test_p_and_d_metrics_carry_the_connectors_series(pd_pair: Pair) -> None:
    """Each instance's own /metrics carries the connector's counters, gauges
    and histograms (vLLM's KV-connector stats hooks), with vLLM's labels, equal
    to what its control plane answers once the instance is idle; a frame P's
    control server refused is counted there too."""
    (ids,) = random_prompts(pd_pair.model, [600], seed=6001)  # no D prefix hits
    before = {w: pd_pair.stats(w) for w in ("p", "d")}
    host, port = pd_pair.p_control.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")  # not a rapidkv-rpc client
        s.settimeout(10)
        while s.recv(4096):
            pass  # until P's control server closes it
    assert len(pd_pair.run([ids], "metrics", serial=False)[0]) == MAX_TOKENS
    assert pd_pair.since(before, "p", "transfers_ok") == 1
    assert pd_pair.since(before, "p", "rpc_frame_errors") == 1

    def exported(which: str) -> tuple[dict, dict]:
        server = pd_pair.p if which == "p" else pd_pair.d
        m = get_metrics(server.base_url)
        labels = {ls for (n, ls) in m if n == "vllm:num_requests_running"}
        assert len(labels) == 1, labels
        want = dict(next(iter(labels)))  # model_name and engine, as vLLM's own series
        assert set(want) == {"model_name", "engine"}
        ours = {
            n: v for (n, ls), v in m.items() if n.startswith("rapidkv_") and "le" not in dict(ls)
        }
        # a histogram's buckets carry `le` besides
        assert all(
            {k: v for k, v in ls if k != "le"} == want for (n, ls) in m if n.startswith("rapidkv_")
        ), want
        return ours, pd_pair.stats(which)

    def agree(which: str) -> bool:
        ours, live = exported(which)
        counters = P_COUNTERS if which == "p" else D_COUNTERS
        return all(
            ours.get(f"rapidkv_{k}_total", 0.0) == live.get(k, 0.0) for k in counters
        ) and all(ours.get(f"rapidkv_{k}") == live[k] for k in GAUGES)

    for which in ("p", "d"):
        wait_until(lambda w=which: agree(w), 10, what=f"{which}'s /metrics to match its Stats")
    p_ours, p_live = exported("p")
    d_ours, d_live = exported("d")
    assert p_ours["rapidkv_transfers_ok_total"] >= 1 and p_ours["rapidkv_bytes_sent_total"] > 0
    assert p_ours["rapidkv_rpc_frame_errors_total"] >= 1
    assert p_ours["rapidkv_rpc_oversized_frames_total"] >= 1  # "GET " read as a length
    # the histograms: P's transfer time and size, D's wait for its KV
    for name in ("transfer_seconds", "transfer_bytes"):
        assert p_ours[f"rapidkv_{name}_count"] == p_live[f"{name}_count"] >= 1
        assert p_ours[f"rapidkv_{name}_sum"] == pytest.approx(p_live[f"{name}_sum"])
    assert p_ours["rapidkv_transfer_bytes_sum"] <= p_ours["rapidkv_bytes_sent_total"]
    assert d_ours["rapidkv_kv_wait_seconds_count"] == d_live["kv_wait_seconds_count"] >= 1
    assert p_ours["rapidkv_peers_decode"] >= 1 and p_ours["rapidkv_transfers_live"] == 0
    assert d_ours["rapidkv_transfer_kv_sent_total"] >= 1
    assert d_ours["rapidkv_waiting_for_kv"] == 0 and d_ours["rapidkv_peers_prefill_ready"] >= 1
    # every gauge and every control-server counter is exported, not only those named here
    for ours, live in ((p_ours, p_live), (d_ours, d_live)):
        for k in live:
            if k.startswith("rpc_"):
                assert f"rapidkv_{k}_total" in ours, k
        for k in ("tombstones", "peers_prefill_connecting", "peers_prefill_failed"):
            assert f"rapidkv_{k}" in ours, k
