"""`rapidkv bench chaos`'s driver (`chaos/driver.py`): how an answer is
classified, usage events, and the backoff after a 503, against a fake router."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import pytest

from rapidkv.bench.chaos.driver import run_one
from rapidkv.bench.chaos.workload import Plan


def _fake_router(seen: list[dict] | None = None):
    """An ASGI app answering each prompt's first token with a canned behaviour;
    each request's body is appended to `seen`. A stream that asks for
    `stream_options.include_usage` ends with a usage event, as vLLM's does."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def event(payload: object) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def completions(request: Request) -> Response:
        body = await request.json()
        if seen is not None:
            seen.append(body)
        how = body["prompt"][0]
        usage = (body.get("stream_options") or {}).get("include_usage")
        if how == 1:  # fine, streamed or not
            if not body["stream"]:
                return JSONResponse({"choices": [{"token_ids": [7, 8, 9]}]})

            async def ok():
                for t in (7, 8, 9):
                    yield event({"choices": [{"token_ids": [t]}]})
                    await asyncio.sleep(0.01)
                if usage:
                    numbers = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
                    yield event({"choices": [], "usage": numbers})
                yield "data: [DONE]\n\n"

            return StreamingResponse(ok(), media_type="text/event-stream")
        if how == 2:  # a stream whose decode died: an error event

            async def broken():
                yield event({"choices": [{"token_ids": [7]}]})
                yield event({"error": {"message": "decode instance broke off", "code": 502}})
                yield "data: [DONE]\n\n"

            return StreamingResponse(broken(), media_type="text/event-stream")
        if how == 3:  # a stream cut with no word

            async def cut():
                yield event({"choices": [{"token_ids": [7]}]})

            return StreamingResponse(cut(), media_type="text/event-stream")
        if how == 4:
            return JSONResponse({"error": {"message": "no decode instance is up"}}, 503)
        if how == 5:
            return Response("Internal Server Error", 500)
        await asyncio.sleep(30)  # how == 6: never answers
        return Response("late")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.mark.unit
def test_every_answer_is_classified_as_the_bench_documents() -> None:
    import aiohttp

    from rapidkv.bench.chaos.workload import Abort
    from rapidkv.router.server import ThreadedServer

    cases = [  # (first prompt id, stream, expected tokens, abort, kind)
        (1, True, [7, 8, 9], None, "completed"),
        (1, False, [7, 8, 9], None, "completed"),
        (1, True, [7, 8, 0], None, "mismatch"),
        (1, False, [7, 8], None, "mismatch"),
        (1, True, [7, 8, 9], Abort(after_tokens=2), "aborted"),
        (6, False, [7], Abort(after_s=0.2), "aborted"),
        (2, True, [7, 8], None, "failed_clear"),
        (4, False, [7], None, "failed_clear"),
        (3, True, [7], None, "failed_unclear"),
        (5, False, [7], None, "failed_unclear"),
        (6, True, [7], None, "hung"),
    ]

    async def main(url: str) -> list:
        async with aiohttp.ClientSession() as session:
            return [
                await run_one(
                    session,
                    url,
                    [how, 100],
                    Plan(i, 2, 3, stream, "decode" if abort else None, 0.5),
                    expected,
                    abort,
                    1.0,
                    time.monotonic(),
                )
                for i, (how, stream, expected, abort, _) in enumerate(cases)
            ]

    with ThreadedServer(_fake_router()) as server:
        outcomes = asyncio.run(main(server.url))
    assert [o.kind for o in outcomes] == [c[-1] for c in cases]
    assert outcomes[2].first_diff == 2 and outcomes[3].first_diff == 2
    assert outcomes[4].tokens == 2 and outcomes[4].seen == "tokens"
    assert outcomes[5].seen == "nothing"
    assert "decode instance broke off" in outcomes[6].error
    assert outcomes[7].error == "HTTP 503: no decode instance is up"
    assert "without [DONE]" in outcomes[8].error
    assert outcomes[10].e2e_s == pytest.approx(1.0, abs=0.5)


@pytest.mark.unit
def test_streams_ask_for_usage_whose_event_is_neither_a_token_nor_an_error() -> None:
    """A streamed request carries `stream_options: {"include_usage": true}`
    unless told not to, a non-streamed one never; the usage event at the end
    (no choices) is kept, the answer is complete and counted right."""
    import aiohttp

    from rapidkv.router.server import ThreadedServer

    cases = [(True, True), (True, False), (False, True)]  # (stream, include_usage)

    async def main(url: str) -> list:
        async with aiohttp.ClientSession() as session:
            return [
                await run_one(
                    session,
                    url,
                    [1, 100],
                    Plan(i, 2, 3, stream, None, 0.0),
                    [7, 8, 9],
                    None,
                    5.0,
                    time.monotonic(),
                    include_usage=usage,
                )
                for i, (stream, usage) in enumerate(cases)
            ]

    seen: list[dict] = []
    with ThreadedServer(_fake_router(seen)) as server:
        outcomes = asyncio.run(main(server.url))
    assert seen[0]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in seen[1] and "stream_options" not in seen[2]
    assert [o.kind for o in outcomes] == ["completed"] * 3
    assert [o.tokens for o in outcomes] == [3, 3, 3] and outcomes[0].error is None
    assert outcomes[0].usage == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert outcomes[1].usage is None and outcomes[2].usage is None

    import argparse

    from rapidkv.bench.chaos import register
    from rapidkv.bench.chaos.run import Options

    parser = argparse.ArgumentParser()
    register(parser)
    assert Options.from_args(parser.parse_args([])).include_usage is True
    assert Options.from_args(parser.parse_args(["--no-include-usage"])).include_usage is False
    # the references: from a running instance, given by its URL (else one started)
    assert Options.from_args(parser.parse_args([])).reference_url is None
    url = Options.from_args(parser.parse_args(["--reference-url", "http://h:8000"])).reference_url
    assert url == "http://h:8000"
    with pytest.raises(ValueError, match="--reference-url"):
        Options.from_args(parser.parse_args(["--reference-url", "h:8000"]))


@pytest.mark.unit
def test_after_a_503_the_client_sends_one_request_per_backoff_until_it_is_answered() -> None:
    from rapidkv.bench.chaos.driver import drive
    from rapidkv.router.server import ThreadedServer

    hows = [4] * 7 + [1] * 4  # 503 until D is "up" again
    plans = [Plan(i, 2, 3, False, None, 0.0) for i in range(len(hows))]
    with ThreadedServer(_fake_router()) as server:
        outcomes, _ = asyncio.run(
            drive(
                server.url,
                plans,
                [[h, 100] for h in hows],
                [[7, 8, 9]] * len(hows),
                concurrency=4,
                timeout_s=5.0,
                backoff_s=0.2,
            )
        )
    assert [o.kind for o in outcomes] == ["failed_clear"] * 7 + ["completed"] * 4
    sent = [o.sent_s for o in outcomes]
    assert max(sent[:4]) - min(sent[:4]) < 0.1  # not degraded yet: all at once
    gaps = [b - a for a, b in itertools.pairwise(sent[3:8])]
    assert all(g >= 0.19 for g in gaps), gaps  # then one at a time, a backoff apart
    assert max(sent[8:]) - sent[7] < 0.15  # answered: at full concurrency again
