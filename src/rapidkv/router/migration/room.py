"""Whether a migration's destination has room for the request, asked before
anything is sent to it.

A vLLM instance without free blocks for a request does not refuse it: it
queues it until blocks free up. A cut-over queued that way would keep the
client waiting until the relay's cut-over timeout. So before a pre-copy (or a
stop-and-copy cut-over) the router asks the destination's connector for its
`Stats` and refuses the migration at once (`Busy`: the request runs on where
it is) when the blocks that the tokens so far need are more than its free
blocks. vLLM's free blocks include cached blocks no request holds (they are
evicted on demand), so a pre-copy's own blocks never make its cut-over look
busy.

Rules: the check never raises but `Busy`; a destination that cannot say
(no control address, no connector, no answer within the timeout, a connector
too old to report `block_size`) is not refused here: the migration goes on
and its own timeouts apply. The RPC client (and its thread) is created on the
first check.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from rapidkv.control.messages import Stats, StatsRequest
from rapidkv.router.rpc import LazyRpc

log = logging.getLogger(__name__)


class Busy(Exception):
    """The destination has no room for the request now (the reason is the message)."""


def blocks_needed(tokens: int, block_size: int) -> int:
    """Blocks that `tokens` tokens of KV occupy, and the one the next token is
    written to when `tokens` fills its last block."""
    return tokens // block_size + 1


def lacking_room(counters: Mapping[str, float], tokens: int) -> str | None:
    """Why a destination whose connector reports `counters` has no room for a
    request of `tokens` tokens (None: it has, or it cannot tell)."""
    free, size = counters.get("free_blocks"), counters.get("block_size")
    if free is None or size is None or size < 1:
        return None
    need = blocks_needed(tokens, int(size))
    if need <= free:
        return None
    return f"no room: {tokens} tokens need {need} blocks, {int(free)} free"


class RoomCheck:
    """Asks destinations' connectors for their free blocks."""

    def __init__(self, secret: bytes | None, timeout_s: float) -> None:
        self._rpc = LazyRpc(secret)
        self._timeout_s = timeout_s

    async def require(self, url: str, control: str | None, tokens: int) -> None:
        """Raise `Busy` if the instance at `url` (its connector at `control`)
        reports no room for `tokens` tokens."""
        client = self._rpc.get() if control is not None else None
        if client is None:  # nothing to ask, or shutting down
            return
        try:
            future = client.submit(control, StatsRequest(), self._timeout_s)
            reply = await asyncio.wrap_future(future)
        except Exception as e:  # cannot tell: the migration's own timeouts apply
            log.debug("room check of %s at %s failed: %r", url, control, e)
            return
        why = lacking_room(reply.counters, tokens) if isinstance(reply, Stats) else None
        if why is not None:
            raise Busy(f"{url} is busy: {why}")

    def close(self) -> None:
        """Stop the RPC client. Blocks up to a few seconds."""
        self._rpc.close()
