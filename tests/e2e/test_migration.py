"""Live migration through the router, on the shared pair as two `kv_both`
instances (A = the pair's P, B = its D) with local dispatch: a streamed
greedy completion moved once, twice (A -> B -> A), during a concurrent load
and by a drain gives the single instance's output token for token, its KV
moved (the destination's engine counts the tokens as loaded, nothing fell back
to recompute); a migration that cannot happen leaves the request running on
its source; nothing is held afterwards."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from migration_harness import AUTH, TOKEN, Run, migrate, mover, stream
from pd_harness import (
    BLOCK,
    MIGRATION_TOKENS,
    Pair,
    assert_back_to_baseline,
    engine_idle,
    wait_for,
)

from rapidkv.harness import get_metrics, metric_sum, random_prompts
from rapidkv.harness.client import completion_body

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))  # the fake vLLM server
from fake_vllm import FakeVLLM

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def external_tokens(url: str) -> float:
    return metric_sum(
        get_metrics(url), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )


@pytest.fixture
def fleet(pd_pair: Pair):
    """A router over the pair as two instances, local dispatch, admin on."""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    config = RouterConfig(
        instances=(Instance(pd_pair.p.base_url), Instance(pd_pair.d.base_url)),
        dispatch="local",
        admin_token=TOKEN,
        port=0,
    )
    with start_router(config) as router:
        yield router


def both_stats(pair: Pair) -> dict[str, dict[str, float]]:
    return {"p": pair.stats("p"), "d": pair.stats("d")}


def since(pair: Pair, before: dict, name: str) -> float:
    return sum(pair.since(before, w, name) for w in ("p", "d"))


def test_a_request_migrated_once_continues_token_for_token_and_loads_only_the_delta(
    pd_pair: Pair, fleet, workloads: dict
) -> None:
    """A -> B after 24 tokens: the output is the single instance's; B loaded the
    pre-copy and, at cut-over, only what its prefix cache did not hold; no
    recompute; both back to their baseline."""
    prompts, expected = workloads["migrate-once"]
    urls = [pd_pair.p.base_url, pd_pair.d.base_url]
    before = both_stats(pd_pair)
    ext_before = [external_tokens(u) for u in urls]

    async def main() -> Run:
        async with httpx.AsyncClient() as client:
            run = await stream(client, fleet.url, prompts[0], mover(client, fleet.url, urls, [24]))
            answers = [await m for m in run.migrations]
            run.migrations = answers
            return run

    run = asyncio.run(main())
    assert run.tokens == expected[0]
    [answer] = run.migrations
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["precopy"] is True and result["to"] == urls[1 - run.decode]
    n, m = result["precopy_tokens"], len(prompts[0]) + result["tokens_at_cutover"]
    assert result["tokens_at_cutover"] >= 24 and m >= n
    dest = 1 - run.decode
    loaded = external_tokens(urls[dest]) - ext_before[dest]
    # the pre-copy loads all but its last token; the cut-over all but its
    # last, less the full blocks the pre-copy left in the prefix cache
    assert loaded == (n - 1) + (m - 1) - (n // BLOCK) * BLOCK, (loaded, n, m)
    assert external_tokens(urls[run.decode]) == ext_before[run.decode]
    assert since(pd_pair, before, "recompute_fallbacks") == 0
    assert since(pd_pair, before, "transfer_kv_ok") == 2
    assert_back_to_baseline(pd_pair)
    metrics = get_metrics(fleet.url)
    assert metric_sum(metrics, "rapidkv_router_migrations_total", outcome="ok") == 1


def test_a_request_migrated_there_and_back_and_one_moved_under_load_match_a_single_instance(
    pd_pair: Pair, fleet, workloads: dict
) -> None:
    """A -> B -> A for one request; during four concurrent streams, one of them
    moved: every output is the single instance's, every migration succeeded,
    nothing fell back to recompute."""
    (twice,), (twice_expected,) = workloads["migrate-twice"]
    load, load_expected = workloads["migrate-load"]
    urls = [pd_pair.p.base_url, pd_pair.d.base_url]
    before = both_stats(pd_pair)

    async def main() -> tuple[Run, list[Run]]:
        async with httpx.AsyncClient() as client:
            there_and_back = await stream(
                client, fleet.url, twice, mover(client, fleet.url, urls, [20, 120])
            )
            there_and_back.migrations = [await m for m in there_and_back.migrations]
            runs = await asyncio.gather(
                *(
                    stream(
                        client,
                        fleet.url,
                        ids,
                        mover(client, fleet.url, urls, [30]) if i == 1 else None,
                    )
                    for i, ids in enumerate(load)
                )
            )
            for run in runs:
                run.migrations = [await m for m in run.migrations]
            return there_and_back, list(runs)

    there_and_back, runs = asyncio.run(main())
    assert there_and_back.tokens == twice_expected
    assert [a.status_code for a in there_and_back.migrations] == [200, 200], [
        a.text for a in there_and_back.migrations
    ]
    first, second = (a.json() for a in there_and_back.migrations)
    assert first["to"] == second["from"] and second["to"] == first["from"]
    assert [r.tokens for r in runs] == load_expected
    assert [a.status_code for a in runs[1].migrations] == [200], runs[1].migrations
    assert since(pd_pair, before, "recompute_fallbacks") == 0
    assert since(pd_pair, before, "transfer_kv_ok") == 6  # two per migration
    assert_back_to_baseline(pd_pair)


def test_a_chat_request_migrated_there_and_back_streams_the_single_instances_chat_answer(
    pd_pair: Pair, fleet, workloads: dict
) -> None:
    """A streamed chat completion moved A -> B -> A: its chunks are chat
    chunks throughout (the continuations are completions requests, rewritten),
    its tokens and its text the single instance's answer to the same chat,
    both migrations loaded their KV, nothing held afterwards."""
    (text,), (expected,) = workloads["migrate-chat"]
    urls = [pd_pair.p.base_url, pd_pair.d.base_url]
    before = both_stats(pd_pair)

    async def main() -> Run:
        async with httpx.AsyncClient() as client:
            run = await stream(client, fleet.url, None, mover(client, fleet.url, urls, [20, 120]))
            run.migrations = [await m for m in run.migrations]
            return run

    run = asyncio.run(main())
    assert [a.status_code for a in run.migrations] == [200, 200], [a.text for a in run.migrations]
    assert run.tokens == expected
    assert run.text == text
    assert since(pd_pair, before, "recompute_fallbacks") == 0
    assert since(pd_pair, before, "transfer_kv_ok") == 4  # a pre-copy and a cut-over each
    assert run.objects == {"chat.completion.chunk"}
    assert_back_to_baseline(pd_pair)


def test_a_request_not_streamed_migrated_there_and_back_is_answered_whole_and_exactly(
    pd_pair: Pair, fleet, workloads: dict
) -> None:
    """A non-streamed completion (streamed from its instances, assembled by the
    router) moved A -> B -> A, ordered as `/admin/requests` shows its tokens
    grow: one answer, the single instance's tokens, `usage` of the original
    prompt and the whole output."""
    (ids,), (expected,) = workloads["migrate-unstreamed"]
    urls = [pd_pair.p.base_url, pd_pair.d.base_url]
    before = both_stats(pd_pair)

    async def main() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient() as client:
            answer = asyncio.create_task(
                client.post(
                    f"{fleet.url}/v1/completions",
                    json=completion_body(ids, MIGRATION_TOKENS),
                    timeout=120,
                )
            )
            moves: list[httpx.Response] = []
            for at in (20, 120):
                while True:
                    listed = (await client.get(f"{fleet.url}/admin/requests", headers=AUTH)).json()
                    assert len(listed["requests"]) <= 1, listed
                    entry = listed["requests"][0] if listed["requests"] else {}
                    if (entry.get("tokens") or 0) >= at:
                        break
                    assert not answer.done(), "the request ended before it could be moved"
                    await asyncio.sleep(0.005)
                assert entry["migratable"] is True, entry
                to = urls[1] if entry["decode"] == urls[0] else urls[0]
                moves.append(await migrate(client, fleet.url, entry["xfer_id"], to))
            return await answer, moves

    answer, moves = asyncio.run(main())
    assert [m.status_code for m in moves] == [200, 200], [m.text for m in moves]
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    body = answer.json()
    assert body["object"] == "text_completion"
    [choice] = body["choices"]
    assert choice["token_ids"] == expected and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == MIGRATION_TOKENS
    assert since(pd_pair, before, "recompute_fallbacks") == 0
    assert since(pd_pair, before, "transfer_kv_ok") == 4
    assert_back_to_baseline(pd_pair)


def test_a_drain_moves_every_running_stream_away_and_sends_new_ones_elsewhere(
    pd_pair: Pair, fleet, workloads: dict
) -> None:
    """Eight streams over A and B; A drained once each has a few tokens: every
    stream on A moves to B and all eight end token for token; A is left with
    nothing running and its free blocks at their baseline; a new request goes
    to B until A is undrained."""
    prompts, expected = workloads["migrate-drain"]
    urls = [pd_pair.p.base_url, pd_pair.d.base_url]
    before = both_stats(pd_pair)
    started: list[Run] = []

    async def main() -> tuple[list[Run], Any, int]:
        async with httpx.AsyncClient() as client:
            ready = asyncio.Event()

            def hook(run: Run) -> None:
                if run not in started and len(run.tokens) >= 5:
                    started.append(run)
                    if len(started) == len(prompts):
                        ready.set()

            streams = asyncio.gather(*(stream(client, fleet.url, ids, hook) for ids in prompts))
            await asyncio.wait_for(ready.wait(), 60)
            drained = await client.post(
                f"{fleet.url}/admin/drain", json={"instance": urls[0]}, headers=AUTH, timeout=120
            )
            runs = await streams
            while_drained = await stream(client, fleet.url, prompts[0][:100])
            await client.post(
                f"{fleet.url}/admin/undrain", json={"instance": urls[0]}, headers=AUTH
            )
            return list(runs), drained, while_drained.decode

    runs, drained, new_decode = asyncio.run(main())
    assert drained.status_code == 200, drained.text
    result = drained.json()
    on_a = [r for r in runs if r.decode == 0]
    assert on_a, "local dispatch put no stream on A"
    assert result["failed"] == {} and result["staying"] == {}
    assert sorted(m["xfer_id"] for m in result["migrated"]) == sorted(r.xfer_id for r in on_a)
    assert [r.tokens for r in runs] == expected
    assert new_decode == 1
    assert wait_for(lambda: engine_idle(pd_pair.p), 5)
    assert since(pd_pair, before, "recompute_fallbacks") == 0
    assert_back_to_baseline(pd_pair)


def test_a_migration_that_cannot_happen_leaves_the_request_running_on_its_source(
    pd_pair: Pair, workloads: dict
) -> None:
    """The destination refuses the cut-over (503, as one without room does),
    or dies during the pre-copy; the client leaves during a migration. Each stream that runs to its
    end is the single instance's output; both instances end at their baseline."""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    prompts, expected = workloads["migrate-fail"]
    urls = [pd_pair.p.base_url, pd_pair.d.base_url]

    refusing, dying = FakeVLLM("refusing", "decode"), FakeVLLM("dying", "decode")
    stopped: list[FakeVLLM] = []

    def kill_dying() -> None:  # on the router's client loop: the fake's own thread kills it
        if dying not in stopped:
            stopped.append(dying)
            threading.Thread(target=dying.die, daemon=True).start()

    config = RouterConfig(
        instances=tuple(Instance(u) for u in [urls[0], refusing.url, dying.url, urls[1]]),
        dispatch="local",
        admin_token=TOKEN,
        port=0,
    )

    async def main(router: str) -> dict[str, Any]:
        async with httpx.AsyncClient() as client:

            async def admin(path: str, **body: Any) -> httpx.Response:
                return await client.post(
                    f"{router}/admin/{path}", json=body, headers=AUTH, timeout=120
                )

            for url in (refusing.url, dying.url, urls[1]):  # new requests go to A only
                await admin("drain", instance=url, migrate=False)

            async def moved(ids: list[int], to: str, precopy: bool = True, **kw: Any) -> Any:
                """Stream `ids` from A, ordering a move to `to` after 20 tokens."""
                answers: list[asyncio.Future] = []

                async def order(xfer_id: str) -> httpx.Response:
                    await admin("undrain", instance=to)
                    try:
                        return await migrate(client, router, xfer_id, to, precopy)
                    finally:
                        await admin("drain", instance=to, migrate=False)

                def hook(run: Run) -> None:
                    if len(run.tokens) >= 20 and not answers:
                        answers.append(asyncio.ensure_future(order(run.xfer_id)))
                        if to == dying.url:
                            asyncio.get_running_loop().call_later(0.3, kill_dying)

                run = await stream(client, router, ids, hook, **kw)
                return run, await answers[0]

            out: dict[str, Any] = {}
            out["refused"] = await moved(prompts[0], refusing.url, False, fake={"decode": "error"})
            out["died"] = await moved(prompts[1], dying.url, fake={"decode": "hang"})
            out["left"] = await moved(prompts[0], urls[1], stop_after=22)
            return out

    try:
        with start_router(config) as router:
            out = asyncio.run(main(router.url))
    finally:
        refusing.stop()
        if dying not in stopped:
            dying.stop()
    for case, i in (("refused", 0), ("died", 1)):
        run, answer = out[case]
        assert run.tokens == expected[i], case
        assert answer.status_code == 409, (case, answer.text)
    assert "503" in out["refused"][1].text
    # the client left: whatever the migration's outcome, nothing is held
    assert out["left"][1].status_code in (200, 409), out["left"][1].text
    assert_back_to_baseline(pd_pair)


def move_and_kill(
    pd_pair: Pair, router: str, ids: list[int], kill: str, events: list[dict[str, Any]]
) -> tuple[Run, httpx.Response, int]:
    """Stream `ids` through `router`; at 20 tokens freeze the request's source
    (SIGSTOP), order a move to the other instance and, once the destination's
    pre-copy waits there for KV the frozen source cannot send, kill (`kill`:
    ``source`` or ``destination``) as by a crash, then thaw the source if it
    lives. Every server is thawed and started again afterwards, whatever
    happened. The run, the migration's answer and the killed server's index."""
    servers = [pd_pair.p, pd_pair.d]
    killed: list[int] = []

    async def main() -> tuple[Run, httpx.Response]:
        async with httpx.AsyncClient() as client:
            moved: list[asyncio.Future] = []

            async def freeze_move_kill(run: Run) -> None:
                if len(run.tokens) < 20 or moved:
                    return
                source, dest = run.decode, 1 - run.decode
                servers[source].signal(signal.SIGSTOP)
                try:
                    to = servers[dest].base_url
                    moved.append(asyncio.ensure_future(migrate(client, router, run.xfer_id, to)))
                    name = "pd"[dest]  # pd_pair.stats' name of the destination

                    def loading() -> bool:
                        return pd_pair.stats(name)["waiting_for_kv"] >= 1

                    assert await asyncio.to_thread(wait_for, loading, 30), pd_pair.stats(name)
                    killed.append(source if kill == "source" else dest)
                    servers[killed[0]].stop(grace=0)
                finally:
                    if servers[source].running:
                        servers[source].signal(signal.SIGCONT)

            run = await stream(client, router, ids, freeze_move_kill, events=events)
            assert moved, "the request ended before it could be moved"
            return run, await moved[0]

    try:
        run, answer = asyncio.run(asyncio.wait_for(main(), 90))
    finally:
        for server in servers:
            if server.running:
                server.signal(signal.SIGCONT)
            else:
                server.launch()
                server.wait_ready()
    return run, answer, killed[0]


def test_a_source_that_dies_mid_migration_ends_the_stream_with_an_error_and_frees_the_dest(
    pd_pair: Pair, fleet, tiny_model: Path
) -> None:
    """The source is killed once the destination's pre-copy waits for its KV
    (`move_and_kill`). The client's stream ends at once with an error event
    naming the source (no hang), the migration is answered 409, and the
    destination, once the dead source refuses its Abort, frees everything; the
    source is started again for the tests after."""
    (ids,) = random_prompts(tiny_model, [330], seed=2506)
    events: list[dict[str, Any]] = []
    run, answer, killed = move_and_kill(pd_pair, fleet.url, ids, "source", events)
    assert killed == run.decode
    source = [pd_pair.p, pd_pair.d][killed]
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1 and errors[-1] is events[-1], events[-3:]
    error = errors[0]["error"]
    assert error["code"] == 502 and source.base_url in error["message"], error
    assert len(run.tokens) < MIGRATION_TOKENS
    assert answer.status_code == 409, answer.text
    assert_back_to_baseline(pd_pair, within=10.0)


def test_a_destination_that_dies_mid_migration_leaves_the_stream_on_its_source(
    pd_pair: Pair, fleet, workloads: dict
) -> None:
    """The destination is killed once its pre-copy waits for KV the frozen
    source has not sent (`move_and_kill`), and the source thawed. The client's
    stream runs on on its source to the single instance's output (a pause, no
    error event), the migration is answered 409, and the source, whose
    TransferKV now names a dead destination, frees everything; the destination
    is started again for the tests after."""
    (ids,), (expected,) = workloads["migrate-once"]
    events: list[dict[str, Any]] = []
    run, answer, killed = move_and_kill(pd_pair, fleet.url, ids, "destination", events)
    assert killed == 1 - run.decode
    assert [e for e in events if "error" in e] == []
    assert run.tokens == expected
    assert answer.status_code == 409, answer.text
    assert_back_to_baseline(pd_pair, within=10.0)
