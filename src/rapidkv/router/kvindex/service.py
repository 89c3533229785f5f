"""`KVIndexService`: the index core and one subscriber per member, on one loop.

The fleet-level shell: whoever knows the membership (static instances,
discovery, etcd) calls `add`, `remove` or `sync`; whoever places requests
reads `index` (`index.match(token_ids)`, `index.longest_prefix(hashes)`).

    service = KVIndexService(block_size=16)
    await service.add(Member("http://p0:8000", "tcp://p0:5557", "tcp://p0:5558"))
    service.index.match(prompt_ids)   # {"http://p0:8000": 3}
    await service.close()

Invariants:
- Every call, and every use of `index`, happens on the loop the service runs on.
- A member is in `index` exactly while it is subscribed: `add` joins it before
  its sockets open, `remove` stops the sockets and then makes it leave.
- `add` of a known key with the same sockets and another identity is a restart
  (the core drops the old entries); with other sockets, or for a key the
  caller made leave the index meanwhile, it is a remove and an add.
- `on_link(key, up)` is called when a member's link goes up or down, after the
  core was told; an exception from it is logged, never raised into the reader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import zmq.asyncio

from rapidkv.router.kvindex.index import KVIndex
from rapidkv.router.kvindex.subscriber import REPLAY_TIMEOUT_S, Member, MemberSubscriber


class KVIndexService:
    """Subscribes to members' KV events and keeps `index` up to date."""

    def __init__(
        self,
        block_size: int,
        *,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        context: zmq.asyncio.Context | None = None,
        index: KVIndex | None = None,
        on_link: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.index = index if index is not None else KVIndex(block_size)
        self.on_link = on_link  # told (member key, link up) at each link event
        self.replay_timeout_s = replay_timeout_s
        self._own_context = context is None
        self.context = context if context is not None else zmq.asyncio.Context()
        self._subscribers: dict[str, MemberSubscriber] = {}

    def subscribed(self) -> dict[str, Member]:
        return {key: sub.member for key, sub in self._subscribers.items()}

    async def add(self, member: Member) -> None:
        """Follow `member` (see the invariants for a key already followed)."""
        sub = self._subscribers.get(member.key)
        joined = member.key in self.index.members()  # a caller may have made it leave
        if sub is not None and joined and sub.member.same_sockets(member):
            if member.identity is not None and member.identity != sub.member.identity:
                sub.member = member
                sub.handle(self.index.join(member.key, member.identity))
            return
        if sub is not None:
            await self.remove(member.key)
        self.index.join(member.key, member.identity, can_replay=member.replay_endpoint is not None)
        sub = MemberSubscriber(
            member, self.index, self.context, self.replay_timeout_s, self.on_link
        )
        self._subscribers[member.key] = sub
        sub.start()

    async def remove(self, key: str) -> None:
        """Stop following `key`; the index forgets it."""
        sub = self._subscribers.pop(key, None)
        if sub is not None:
            await sub.stop()
        self.index.leave(key)

    async def sync(self, members: Iterable[Member]) -> None:
        """Follow exactly `members`: add the new, restart the re-identified,
        remove the rest."""
        wanted = {m.key: m for m in members}
        for key in [k for k in self._subscribers if k not in wanted]:
            await self.remove(key)
        for member in wanted.values():
            await self.add(member)

    async def close(self) -> None:
        """Remove every member; close the ZMQ context if the service made it."""
        for key in list(self._subscribers):
            await self.remove(key)
        if self._own_context:
            self.context.term()
