"""sharegpt-multiturn: conversations' prompts made turn by turn, and a load
that sends a conversation's next turn only once the previous one is answered."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from rapidkv.bench.common.dataset import Conversations
from rapidkv.bench.common.loads import Load, run_load
from rapidkv.data.sharegpt import Conversation, Exchange, Turn, exchanges


def _chat_ids(messages: list[dict[str, str]]) -> list[int]:
    """One token per message: its role's id, then its words' count."""
    role = {"user": 1, "assistant": 2}
    return [t for m in messages for t in (role[m["role"]], len(m["content"].split()))] + [9]


def _words(text: str) -> int:
    return len(text.split())


@pytest.mark.unit
def test_a_later_turn_s_prompt_holds_the_history_with_the_model_s_answers() -> None:
    said = [Exchange("a b c d", 5), Exchange("e f g h i", 6), Exchange("j k l m", 7)]
    conv = Conversations([said, said], [5, 6, 7, 5, 6, 7], _chat_ids)
    assert conv.turns == 3 and conv.follows() == [False, True, True] * 2
    assert conv.prompt(0, 0, []) == [1, 4, 9]
    # the answers are the model's (two words, then one), not the dataset's
    assert conv.prompt(1, 2, ["x y", "z"]) == [1, 4, 2, 2, 1, 5, 2, 1, 1, 4, 9]


@pytest.mark.unit
def test_exchanges_are_answered_user_turns_in_order_seeded_and_bounded() -> None:
    def conversation(i: int, turns: int) -> Conversation:
        said = []
        for k in range(turns):
            said += [
                Turn("user", f"q{i} turn {k} " + "w " * i),
                Turn("assistant", "an answer of six words"),
            ]
        return Conversation(str(i), (Turn("system", "be brief"), *said))

    pool = [conversation(i, 2 + i % 3) for i in range(30)]  # 2, 3 or 4 exchanges
    chosen = exchanges(pool, 5, 1, 3, _words)
    assert len(chosen) == 5 and chosen == exchanges(pool, 5, 1, 3, _words)
    assert chosen != exchanges(pool, 5, 2, 3, _words)
    for c in chosen:
        assert len(c) == 3 and [e.question.split()[1:3] for e in c] == [
            ["turn", "0"], ["turn", "1"], ["turn", "2"]
        ]  # fmt: skip
        assert all(e.answer_tokens == 5 for e in c)
    short = exchanges(pool, 30, 1, 3, _words, fits=lambda c: _words(c[0].question) <= 5)
    assert short and all(_words(c[0].question) <= 5 for c in short)


def _slow_vllm(log: list[tuple[str, int, float]]):
    """Streams two tokens over 50 ms per completion; logs (event, first prompt token, time)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        first = body["prompt"][0]
        log.append(("start", first, time.monotonic()))

        async def events():
            for t in (7, 8):
                await asyncio.sleep(0.025)
                yield f"data: {json.dumps({'choices': [{'token_ids': [t]}]})}\n\n"
            log.append(("end", first, time.monotonic()))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.mark.unit
@pytest.mark.parametrize("load", ["c4", "poisson50"])
def test_a_conversation_s_next_turn_waits_for_the_previous_answer(load: str) -> None:
    from rapidkv.router.server import ThreadedServer

    log: list[tuple[str, int, float]] = []
    prompts = [[c * 10 + t] for c in range(3) for t in range(3)]  # 3 conversations of 3 turns
    follows = [t > 0 for _ in range(3) for t in range(3)]
    with ThreadedServer(_slow_vllm(log)) as server:
        results, _ = run_load(server.url, prompts, 2, Load.parse(load), follows=follows)
    assert all(r.error is None and r.token_ids == (7, 8) for r in results)
    at = {(e, p): t for e, p, t in log}
    for c in range(3):
        for t in (1, 2):
            assert at[("start", c * 10 + t)] >= at[("end", c * 10 + t - 1)]
    # the conversations themselves overlap: each one's first turn starts before
    # another's last ends
    assert max(at[("start", c * 10)] for c in range(3)) < min(
        at[("end", c * 10 + 2)] for c in range(3)
    )
    with pytest.raises(ValueError, match="follows"):
        run_load(server.url, prompts, 2, Load.parse("c1"), follows=[True] * 9)


@pytest.mark.unit
def test_first_turns_arrive_when_given_and_later_turns_after_the_answer_and_a_think() -> None:
    """An open loop with given arrivals and `follows` (`bench goodput
    multiturn`): a conversation's first turn is sent at its arrival time, each
    later turn its think time after the turn before it is answered; the
    arrivals given for later turns (nan) are not read."""
    from rapidkv.router.server import ThreadedServer

    log: list[tuple[str, int, float]] = []
    prompts = [[c * 10 + t] for c in range(2) for t in range(3)]  # 2 conversations of 3 turns
    follows = [t > 0 for _ in range(2) for t in range(3)]
    nan = float("nan")
    arrivals = [0.0, nan, nan, 0.3, nan, nan]
    think = [0.0, 0.2, 0.1, 0.0, 0.2, 0.1]
    t0 = time.monotonic()
    with ThreadedServer(_slow_vllm(log)) as server:
        results, wall = run_load(
            server.url, prompts, 2, Load.parse("poisson1"), arrivals=arrivals, follows=follows,
            think_s=think,
        )  # fmt: skip
        with pytest.raises(ValueError, match="think_s"):
            run_load(server.url, prompts, 2, Load.parse("c1"), follows=follows, think_s=[0.1])
        with pytest.raises(ValueError, match="think_s"):
            run_load(server.url, prompts, 2, Load.parse("c1"), follows=follows, think_s=-1.0)
    assert all(r.error is None and r.token_ids == (7, 8) for r in results)
    at = {(e, p): t - t0 for e, p, t in log}
    assert at[("start", 0)] < 0.2 and at[("start", 10)] >= 0.3
    for c in range(2):
        for t in (1, 2):
            waited = at[("start", c * 10 + t)] - at[("end", c * 10 + t - 1)]
            assert waited >= think[c * 3 + t] - 0.01
    # conversation 1 started while conversation 0 was still thinking or talking
    assert at[("start", 10)] < at[("end", 2)]
    assert wall >= 0.3 + 3 * 0.05 + 0.3
