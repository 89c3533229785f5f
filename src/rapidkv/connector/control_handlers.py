"""The control-plane server's handlers (`ControlHandlers`, on the RPC server's
loop thread) and the destinations that handshook with this instance.

What each request gets:

- `Handshake`: this instance's spec, ranks and incarnation, if they match the
  peer's and this instance's KV heads map onto the peer's ranks (equal TP
  sizes, or different ones whose heads split: `rank_pairs`; otherwise ERROR
  naming every reason); the peer is then known as a destination (`KnownPeer`) and its ranks
  go to the workers as transport peers (with the next step's metadata, and at
  once over the bypass channel, ahead of any bypass send to them).
- `TransferKV`: UNKNOWN_PEER from a destination that did not handshake (it
  handshakes again and asks once more), ERROR for block ids outside its pool;
  otherwise P's role takes it up (`ProducerSide.receive_transfer_kv`) and the
  answer comes when its transfer is over.
- `Abort`: P's role answers it once no write of the transfer can land.
- `StatsRequest`, `TimelineRequest`: the scheduler side's stats and timeline.

Invariants (under the shared lock):

- at most one `KnownPeer` per instance id: a handshake from a new process of
  it (another incarnation) replaces the old one;
- a peer added from a control address with a host (not a wildcard) replaces
  every peer known at that address;
- each peer added gets a `generation` higher than any before, so the workers
  apply a newer entry of it over an older one;
- a peer forgotten (replaced, its writes failed, or idle for `peer_idle_ttl_s`
  with nothing parked or in flight) has its parked and in-flight transfers
  failed, and its next TransferKV is answered UNKNOWN_PEER.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rapidkv.connector.bypass import BypassMsg, Peer
from rapidkv.connector.producer import Reply
from rapidkv.connector.producer_side import ProducerSide
from rapidkv.connector.rank_pairs import rank_pairs
from rapidkv.connector.shared_state import SharedState
from rapidkv.control.address import WILDCARD_HOSTS, parse_address
from rapidkv.control.codes import Code
from rapidkv.control.messages import (
    Abort,
    ErrorReply,
    Handshake,
    HandshakeReply,
    RankEndpoint,
    Stats,
    StatsRequest,
    Timeline,
    TimelineRequest,
    TransferKV,
    TransferKVReply,
    answer_handshake,
)
from rapidkv.kvt.head_map import MappingError

log = logging.getLogger(__name__)


@dataclass
class KnownPeer:
    """A destination instance that handshook with this P (one process start of it)."""

    endpoints: list[RankEndpoint]
    incarnation: str
    control_address: str
    generation: int  # of its Peer entries in the workers
    last_used: float  # monotonic time of its handshake or latest TransferKV


class ControlHandlers:
    """Answers the control plane's requests; keeps the destinations we may write to."""

    def __init__(
        self,
        shared: SharedState,
        producer: ProducerSide,
        stats: Callable[[], dict[str, float]],
        timeline: Callable[[list[str]], Timeline],
    ) -> None:
        self._shared = shared
        self._counters = shared.counters  # the shared state's own, never reassigned
        self._lock = shared.lock
        self._producer = producer
        self._stats = stats
        self._timeline = timeline
        self._peers: dict[str, KnownPeer] = {}  # instance id -> (D instances we may write to)
        self._generations = itertools.count(1)  # of the workers' Peer entries
        self._idle_check_at = 0.0  # `forget_idle` looks no more often than this

    async def handle(self, msg: Any) -> Any:
        """The RPC server's handler: the answer to one request."""
        if isinstance(msg, TransferKV):
            return await self._on_transfer_kv(msg)
        if isinstance(msg, Handshake):
            return self._on_handshake(msg)
        if isinstance(msg, Abort):
            return await self._producer.abort(msg)
        if isinstance(msg, StatsRequest):
            return Stats(counters=self._stats())
        if isinstance(msg, TimelineRequest):
            return self._timeline(msg.xfer_ids)
        return ErrorReply(code=Code.ERROR, message=f"unexpected {type(msg).__name__}")

    def writes_failed(self, broken_peers: list[tuple[str, int]]) -> None:
        """The workers' transport failed writes to these `(instance_id,
        generation)`: forget each, unless a newer handshake of it came since
        (caller holds the lock)."""
        for instance_id, generation in broken_peers:
            known = self._peers.get(instance_id)
            if known is not None and known.generation == generation:
                self._forget_peer(instance_id, "writes to it failed")

    def forget_idle(self, now: float) -> None:
        """Forget the destinations that sent nothing for `peer_idle_ttl_s` and
        have no transfer parked or in flight here (caller holds the lock)."""
        ttl = self._shared.config.peer_idle_ttl_s
        if now < self._idle_check_at:
            return  # called every engine step: look a few times per TTL only
        self._idle_check_at = now + ttl / 10
        for instance_id, known in list(self._peers.items()):
            if now - known.last_used > ttl and not self._producer.outstanding(instance_id):
                self._forget_peer(instance_id, f"idle for over {ttl:g}s")

    def gauges(self) -> dict[str, float]:
        """D instances that handshook with us (caller holds the lock)."""
        return {"peers_decode": float(len(self._peers))}

    def _on_handshake(self, hs: Handshake) -> HandshakeReply:
        shared = self._shared
        if shared.spec is None:
            return HandshakeReply(
                code=Code.BUSY, instance_id=shared.instance_id, reasons=["instance still starting"]
            )
        reply = answer_handshake(
            hs,
            instance_id=shared.instance_id,
            spec=shared.spec,
            endpoints=shared.endpoints,
            incarnation=shared.incarnation,
        )
        pairs = 0
        if reply.code == Code.OK:
            try:
                pairs = rank_pairs(shared.endpoints, hs.endpoints)
            except MappingError as e:
                reply = HandshakeReply(
                    code=Code.ERROR,
                    instance_id=shared.instance_id,
                    spec=shared.spec,
                    reasons=[f"KV heads do not map onto {hs.instance_id}: {e}"],
                    incarnation=shared.incarnation,
                )
        if reply.code != Code.OK:
            log.warning(
                "rapidkv %s: handshake from %s refused: %s",
                shared.instance_id,
                hs.instance_id,
                reply.reasons,
            )
            return reply
        with self._lock:
            self._shared.peer_pairs[hs.instance_id] = pairs
            known = self._peers.get(hs.instance_id)
            if known is not None and known.incarnation == hs.incarnation:
                known.control_address = hs.control_address
                known.last_used = time.monotonic()
                return reply  # the same process again (it dropped its cached handshake)
            if known is not None:
                # same id, new process: its new transport metadata replaces the old
                # in the workers (a newer Peer entry), the old one's transfers fail now
                self._forget_peer(hs.instance_id, "restarted", drop=False)
            if parse_address(hs.control_address)[0] not in WILDCARD_HOSTS:
                for other, info in list(self._peers.items()):
                    if info.control_address == hs.control_address:
                        self._forget_peer(other, f"{hs.instance_id} now at its address")
            self._counters["peers_added"] += 1
            generation = next(self._generations)
            self._peers[hs.instance_id] = KnownPeer(
                list(hs.endpoints),
                hs.incarnation,
                hs.control_address,
                generation,
                time.monotonic(),
            )
            peers = [
                Peer(hs.instance_id, e.rank, e.transport_metadata, e.layout, generation)
                for e in hs.endpoints
            ]
            shared.pending.new_peers.extend(peers)
            if shared.bypass is not None:  # ahead of any bypass send to them
                shared.bypass.send(BypassMsg(kind="peers", peers=peers))
        return reply

    def _forget_peer(self, instance_id: str, why: str, drop: bool = True) -> None:
        """`instance_id` is gone (restarted, or replaced at its address): fail
        what was parked for or in flight to it (its held blocks are freed as soon
        as no write of theirs is in flight, not after `finished_ttl_s`) and, with
        `drop`, have the workers drop its transport peer. Its next TransferKV is
        answered UNKNOWN_PEER until it handshakes again (caller holds the lock)."""
        known = self._peers.pop(instance_id, None)
        if known is None:
            return
        log.warning(
            "rapidkv %s: forgetting peer %s (%s); its transfers fail",
            self._shared.instance_id,
            instance_id,
            why,
        )
        self._counters["peers_forgotten"] += 1
        self._producer.fail_transfers_to(instance_id, why)
        if drop:
            self._shared.pending.drop_peers.append((instance_id, known.generation))

    async def _on_transfer_kv(self, msg: TransferKV) -> TransferKVReply:
        loop = asyncio.get_running_loop()
        reply = Reply(loop, loop.create_future())
        with self._lock:
            dst = self._peers.get(msg.dst_instance)
            if not self._shared.endpoints:
                problems = ["instance still starting"]
            elif dst is None:
                self._counters["unknown_peer_replies"] += 1
                return TransferKVReply(
                    xfer_id=msg.xfer_id,
                    code=Code.UNKNOWN_PEER,
                    message=f"no handshake from {msg.dst_instance}",
                )
            else:  # the destination's block ids, checked against its own pool
                dst.last_used = time.monotonic()
                problems = msg.problems(
                    self._shared.block_size, min(e.num_blocks for e in dst.endpoints)
                )
            if problems:
                return TransferKVReply(
                    xfer_id=msg.xfer_id, code=Code.ERROR, message="; ".join(problems)
                )
            answer = self._producer.receive_transfer_kv(msg, reply)
            if isinstance(answer, TransferKVReply):
                return answer
        return await self._producer.wait_for_answer(msg, answer)
