"""The destination's room check (`router.migration.room`): the pure verdict, and
`RoomCheck` against a real control server on loopback (the connector's `Stats`
answer), including destinations that cannot tell."""

from __future__ import annotations

import asyncio

import pytest

from rapidkv.control.codes import Code
from rapidkv.control.messages import ErrorReply, Request, Stats, StatsRequest
from rapidkv.control.server import RpcServer
from rapidkv.router.migration.room import Busy, RoomCheck, blocks_needed, lacking_room

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SECRET = b"room-secret"


@pytest.mark.parametrize(
    ("tokens", "block_size", "blocks"),
    [(0, 16, 1), (1, 16, 1), (15, 16, 1), (16, 16, 2), (17, 16, 2), (330, 128, 3), (384, 128, 4)],
)
def test_blocks_needed_covers_the_tokens_and_the_next_ones_slot(
    tokens: int, block_size: int, blocks: int
) -> None:
    assert blocks_needed(tokens, block_size) == blocks


def test_lacking_room_compares_the_blocks_needed_with_the_free_ones() -> None:
    assert lacking_room({"free_blocks": 3, "block_size": 128}, 383) is None
    why = lacking_room({"free_blocks": 3, "block_size": 128}, 384)
    assert why == "no room: 384 tokens need 4 blocks, 3 free"
    assert lacking_room({"free_blocks": 0, "block_size": 16}, 0) is not None


@pytest.mark.parametrize(
    "counters", [{}, {"free_blocks": 0}, {"block_size": 16}, {"free_blocks": 0, "block_size": 0}]
)
def test_a_connector_that_cannot_tell_is_not_called_busy(counters: dict[str, float]) -> None:
    assert lacking_room(counters, 10_000) is None


def _serve(reply: Stats | ErrorReply, secret: bytes | None = SECRET) -> RpcServer:
    seen: list[Request] = []

    async def handler(request: Request) -> Stats | ErrorReply:
        seen.append(request)
        assert isinstance(request, StatsRequest)
        return reply

    server = RpcServer(handler, secret=secret)
    server.seen = seen  # type: ignore[attr-defined]
    return server


def test_room_check_asks_the_destinations_connector_and_refuses_when_it_is_full() -> None:
    full = Stats(counters={"free_blocks": 2, "block_size": 16})
    with _serve(full) as server:
        check = RoomCheck(SECRET, timeout_s=5)
        try:
            asyncio.run(check.require("http://dest", server.address, 31))  # 2 blocks: fits
            with pytest.raises(Busy, match=r"http://dest is busy: no room: 32 tokens need 3"):
                asyncio.run(check.require("http://dest", server.address, 32))
        finally:
            check.close()
        assert len(server.seen) == 2  # type: ignore[attr-defined]


def test_room_check_lets_a_destination_that_cannot_answer_go_on() -> None:
    """No control address, an error answer, a wrong secret, nobody listening:
    not Busy (the migration's own timeouts apply)."""
    check = RoomCheck(SECRET, timeout_s=2)
    try:
        asyncio.run(check.require("http://dest", None, 10**6))
        with _serve(ErrorReply(Code.ERROR, "no")) as server:
            asyncio.run(check.require("http://dest", server.address, 10**6))
            address = server.address
        asyncio.run(check.require("http://dest", address, 10**6))  # nobody listens now
        with _serve(Stats(counters={"free_blocks": 0, "block_size": 1})) as other:
            other._secret = None  # type: ignore[attr-defined]
            asyncio.run(check.require("http://dest", other.address, 10**6))
    finally:
        check.close()
