"""Live migration through a router, as the e2e tests drive it: a streamed
greedy request (`stream`), the router's admin call that moves it
(`migrate`), and a hook that moves a stream there and back at given token
counts (`mover`)."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from pd_harness import MIGRATION_TOKENS, migration_chat_body

from rapidkv.harness.client import completion_body

TOKEN = "migration-test-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@dataclass
class Run:
    """One streamed request through the router."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""  # completions' text, or chat's delta contents
    objects: set[str] = field(default_factory=set)  # the events' `object`s
    xfer_id: str = ""
    decode: int = -1  # the instance it was placed on
    migrations: list[Any] = field(default_factory=list)  # admin answers


def _decode_index(placement: str) -> int:
    parts = dict(kv.split("=") for kv in placement.split(";"))
    return int(parts["decode"])


async def stream(
    client: httpx.AsyncClient,
    router: str,
    ids: list[int] | None,
    on_tokens: Callable[[Run], Any] | None = None,
    stop_after: int | None = None,
    events: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> Run:
    """Stream a greedy completion of `ids` (None: the chat request
    `migration_chat_body`); `on_tokens(run)` after every event (it may order
    migrations; awaited if it is a coroutine function); `stop_after`: the
    client leaves after that many tokens; `events`: every event is appended
    there, error events allowed (without it an error event fails the test)."""
    run = Run()
    if ids is None:
        path, body = "/v1/chat/completions", migration_chat_body(True)
    else:
        path, body = "/v1/completions", completion_body(ids, MIGRATION_TOKENS, stream=True, **extra)
    async with client.stream("POST", f"{router}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, await r.aread()
        run.xfer_id = r.headers["x-rapidkv-xfer-id"]
        run.decode = _decode_index(r.headers["x-rapidkv-placement"])
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if events is None:
                assert "error" not in event, event
            else:
                events.append(event)
            run.objects.add(event.get("object"))
            for choice in event.get("choices", ()):
                run.tokens.extend(choice.get("token_ids") or [])
                run.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if on_tokens is not None and inspect.isawaitable(done := on_tokens(run)):
                await done
            if stop_after is not None and len(run.tokens) >= stop_after:
                break
    return run


async def migrate(
    client: httpx.AsyncClient, router: str, xfer_id: str, to: str, precopy: bool = True
) -> httpx.Response:
    return await client.post(
        f"{router}/admin/migrate",
        json={"xfer_id": xfer_id, "to": to, "precopy": precopy},
        headers=AUTH,
        timeout=120,
    )


def mover(client: httpx.AsyncClient, router: str, urls: list[str], plan: list[int]):
    """An `on_tokens` hook: once the stream has `plan[k]` tokens and the k-th
    migration is answered, order the next one (to the other instance)."""

    def hook(run: Run) -> None:
        pending = run.migrations and not run.migrations[-1].done()
        k = len(run.migrations)
        if pending or k >= len(plan) or len(run.tokens) < plan[k]:
            return
        to = 1 - run.decode if k % 2 == 0 else run.decode  # there, back, there...
        run.migrations.append(asyncio.ensure_future(migrate(client, router, run.xfer_id, urls[to])))

    return hook
