"""`kvindex.KVIndex` against a model of the truth: vLLM publishers that store
chains of blocks, evict them, clear, restart (a new process: seqs from 0, a new
hash seed, a new identity), and a network that loses, duplicates and reorders
live batches, drops links, and serves replays late, partly, or not at all.
Payloads are encoded by vLLM's own structs and encoder.

What is proved, after every step (`Soundness`):
  a member the index is in sync with claims only blocks it held right after
  the last batch the index applied for it ("the truth at D"), and that batch
  comes from the member's current process once the old one's end was seen (a
  dropped link or a new identity); a member not in sync claims nothing. So the
  only over-claims are blocks removed by batches the index has not applied
  yet: those in flight, or lost with nothing after them to reveal the loss.

and after `settle` (every batch delivered, links up, replays served, then a
reconnect that forces a verifying replay) (`Agreement`):
  the index is in sync at the publisher's newest batch; if it never had to
  drop what it held since the member joined, it claims exactly the indexable
  blocks the member holds; otherwise it claims at least those stored (again)
  since the batch it resumed at, with parents stored there too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from hashlib import blake2b

import hypothesis
import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from rapidkv.router.kvindex import KVIndex, RequestReplay, Reset
from rapidkv.router.kvindex.hashing import ROOT, block_hash

pytestmark = pytest.mark.unit

kv_events = pytest.importorskip("vllm.distributed.kv_events")

B = 2  # tokens per block
MEMBERS = ("a", "b")
NET = st.sampled_from(["deliver", "deliver", "hold", "lose"])
_encode = msgspec.msgpack.Encoder().encode


@dataclass
class Era:
    """One publishing process of a member: its batches, and the truth after each."""

    identity: str
    seed: bytes
    payloads: list[bytes] = field(default_factory=list)
    events: list[list[tuple]] = field(default_factory=list)
    truth: list[frozenset[int]] = field(default_factory=list)  # held vLLM hashes after seq
    held: set[int] = field(default_factory=set)
    info: dict[int, tuple[int | None, tuple[int, ...], bool]] = field(default_factory=dict)

    def vhash(self, parent: int | None, tokens: tuple[int, ...], keyed: bool) -> int:
        data = self.seed + repr((parent, tokens, keyed)).encode()
        return int.from_bytes(blake2b(data, digest_size=8).digest(), "big")

    def own(self, h: int) -> bytes | None:
        """The index's hash of vLLM block `h`, None if not indexable (keyed chain)."""
        parent, tokens, keyed = self.info[h]
        if keyed:
            return None
        up = ROOT if parent is None else self.own(parent)
        return None if up is None else block_hash(up, tokens)

    def indexable(self, hashes) -> frozenset[bytes]:
        return frozenset(o for o in (self.own(h) for h in hashes) if o is not None)

    def at(self, seq: int) -> frozenset[int]:
        return self.truth[seq] if seq >= 0 else frozenset()


@dataclass
class MemberModel:
    eras: list[Era]
    joined: bool = True
    link_up: bool = True
    in_flight: deque = field(default_factory=deque)
    replays: list[RequestReplay] = field(default_factory=list)
    resume: int | None = None  # resume_seq of the last Reset since the member joined

    @property
    def era(self) -> Era:
        return self.eras[-1]


class KVIndexMachine(RuleBasedStateMachine):
    @initialize(
        buffer_steps=st.sampled_from([2, 5, 1000]),
        shared_seed=st.booleans(),
        caught_up=st.booleans(),
    )
    def init(self, buffer_steps: int, shared_seed: bool, caught_up: bool) -> None:
        self.buffer_steps = buffer_steps
        self.shared_seed = shared_seed  # vLLM's sha256 default: the same seed every start
        self.index = KVIndex(B, pending_cap=8)
        self.ts = 0.0
        self.published: dict[bytes, tuple[str, Era, int]] = {}
        self.m: dict[str, MemberModel] = {}
        for key in MEMBERS:
            self.m[key] = MemberModel([self.new_era(key, 0)])
            self.handle(key, self.index.join(key, self.m[key].era.identity))
            self.handle(key, self.index.connected(key))
            if caught_up:  # the first replay (from 0) answered: in sync from the start
                self.serve(key, self.m[key].replays.pop())

    def new_era(self, key: str, n: int) -> Era:
        seed = b"vllm-none-hash" if self.shared_seed else f"{key}/{n}".encode()
        return Era(identity=f"{key}#{n}", seed=seed)

    # ---------------------------------------------------------------- plumbing

    def handle(self, key: str, actions) -> None:
        for action in actions:
            assert action.member == key
            if isinstance(action, RequestReplay):
                self.m[key].replays.append(action)
            else:
                assert isinstance(action, Reset)
                hypothesis.event(
                    "reset: " + "".join(c for c in action.reason if not c.isdigit())[:30]
                )
                self.m[key].resume = action.resume_seq

    def publish(
        self, key: str, events: list[tuple], payload: bytes | None = None, net: str = "hold"
    ) -> None:
        """Publish one batch; `net`: it stays in flight ("hold"), is lost, or is
        delivered at once with everything before it ("deliver")."""
        m, era = self.m[key], self.m[key].era
        for event in events:
            if event[0] == "store":
                _, hashes, _parent, _tokens, _keyed = event
                era.held.update(hashes)
            elif event[0] == "remove":
                era.held.difference_update(event[1])
            else:
                era.held.clear()
        self.ts += 1
        if payload is None:
            batch = kv_events.KVEventBatch(ts=self.ts, events=[to_vllm(e) for e in events])
            payload = _encode(batch)
        era.payloads.append(payload)
        self.published[blake2b(payload, digest_size=16).digest()] = (
            key,
            era,
            len(era.payloads) - 1,
        )
        era.events.append(events)
        era.truth.append(frozenset(era.held))
        if m.link_up and m.joined and net != "lose":
            m.in_flight.append((len(era.payloads) - 1, payload))
            if net == "deliver":
                self.deliver_all(key)

    def deliver(self, key: str, seq: int, payload: bytes) -> None:
        self.handle(key, self.index.received(key, seq, payload))

    def serve(self, key: str, request: RequestReplay, cut: int | None = None) -> None:
        era = self.m[key].era
        first = max(0, len(era.payloads) - self.buffer_steps)
        seqs = [s for s in range(first, len(era.payloads)) if s >= request.start_seq]
        for seq in seqs[:cut]:
            self.handle(key, self.index.replayed(key, request.token, seq, era.payloads[seq]))
        self.handle(key, self.index.replay_ended(key, request.token))

    def locate(self, key: str, digest: bytes) -> tuple[Era, int]:
        """The process and seq of the batch whose payload has `digest` (the
        index's `last_applied`: blake2b-128 of the payload)."""
        found = self.published.get(digest)
        assert found is not None and found[0] == key, "the index applied a batch nobody published"
        return found[1], found[2]

    # ---------------------------------------------------------------- the publishers

    @rule(
        key=st.sampled_from(MEMBERS),
        pick=st.integers(0, 1000),
        from_root=st.booleans(),
        tokens=st.lists(st.integers(0, 2), min_size=B, max_size=3 * B),
        keyed_at=st.none() | st.integers(0, 2),
        net=NET,
    )
    def store(self, key, pick, from_root, tokens, keyed_at, net) -> None:
        era = self.m[key].era
        held = sorted(era.held)
        parent = None if from_root or not held else held[pick % len(held)]
        self.publish(key, [self.stored(era, parent, tokens, keyed_at)], net=net)

    def stored(self, era: Era, parent: int | None, tokens: list[int], keyed_at: int | None):
        """A store of `tokens`' full blocks after `parent`; block `keyed_at` has extra keys."""
        n = len(tokens) // B
        hashes, up = [], parent
        for i in range(n):
            block = tuple(tokens[i * B : (i + 1) * B])
            h = era.vhash(up, block, keyed_at == i)
            inherited = up is not None and era.info[up][2]
            era.info.setdefault(h, (up, block, keyed_at == i or inherited))
            hashes.append(h)
            up = h
        keyed = keyed_at if keyed_at is not None and keyed_at < n else None
        return ("store", hashes, parent, tuple(tokens[: n * B]), keyed)

    @rule(
        key=st.sampled_from(MEMBERS),
        picks=st.lists(st.integers(0, 1000), min_size=1, max_size=3),
        net=NET,
    )
    def evict(self, key, picks, net) -> None:
        held = sorted(self.m[key].era.held)
        if held:
            self.publish(key, [("remove", sorted({held[p % len(held)] for p in picks}))], net=net)

    @rule(key=st.sampled_from(MEMBERS), net=NET)
    def clear(self, key, net) -> None:
        self.publish(key, [("clear",)], net=net)

    @rule(key=st.sampled_from(MEMBERS), pick=st.integers(0, 1000), net=NET)
    def rereport(self, key, pick, net) -> None:
        """`kv_cache_report_mode="full"`: a cache hit re-reports its chain from the root."""
        era = self.m[key].era
        chains = []
        for h in sorted(era.held):
            chain = [h]
            while era.info[chain[-1]][0] is not None and era.info[chain[-1]][0] in era.held:
                chain.append(era.info[chain[-1]][0])
            if era.info[chain[-1]][0] is None:
                chains.append(chain[::-1])
        if chains:
            chain = chains[pick % len(chains)]
            tokens = tuple(t for h in chain for t in era.info[h][1])
            keyed = next((i for i, h in enumerate(chain) if era.info[h][2]), None)
            self.publish(key, [("store", chain, None, tokens, keyed)], net=net)

    @rule(key=st.sampled_from(MEMBERS), pick=st.integers(0, 1000))
    def unreadable(self, key, pick) -> None:
        """A batch the index cannot decode (an unknown event type), with an eviction behind it."""
        era, m = self.m[key].era, self.m[key]
        held = sorted(era.held)
        events = [("remove", [held[pick % len(held)]])] if held else []
        garbage = _encode([self.ts, [{"type": "BlockMoved", "n": len(era.payloads)}], 0])
        self.publish(key, events, payload=garbage + m.era.identity.encode())

    @rule(
        key=st.sampled_from(MEMBERS),
        announce=st.booleans(),
        flush=st.booleans(),
        busy=st.integers(0, 4),
    )
    def restart(self, key, announce, flush, busy) -> None:
        """The process dies (in-flight batches arrive first, or are lost) and a new
        one starts; it may publish `busy` batches before the link is back."""
        m = self.m[key]
        if flush:
            self.deliver_all(key)
        m.in_flight.clear()
        if m.joined and m.link_up:
            self.handle(key, self.index.disconnected(key))
        m.link_up = False
        m.eras.append(self.new_era(key, len(m.eras)))
        if announce and m.joined:
            self.handle(key, self.index.join(key, m.era.identity))
        for i in range(busy):
            self.publish(key, [self.stored(m.era, None, [i, i], None)])

    # ---------------------------------------------------------------- the network

    @rule(key=st.sampled_from(MEMBERS))
    def deliver_next(self, key) -> None:
        m = self.m[key]
        if m.in_flight:
            self.deliver(key, *m.in_flight.popleft())

    @rule(key=st.sampled_from(MEMBERS))
    def lose_next(self, key) -> None:
        if self.m[key].in_flight:
            self.m[key].in_flight.popleft()

    @rule(key=st.sampled_from(MEMBERS))
    def duplicate_next(self, key) -> None:
        if self.m[key].in_flight:
            self.deliver(key, *self.m[key].in_flight[0])

    @rule(key=st.sampled_from(MEMBERS))
    def reorder(self, key) -> None:
        q = self.m[key].in_flight
        if len(q) >= 2:
            q[0], q[1] = q[1], q[0]

    @rule(key=st.sampled_from(MEMBERS), newest=st.booleans(), cut=st.none() | st.integers(0, 3))
    def serve_replay(self, key, newest, cut) -> None:
        m = self.m[key]
        if m.replays and m.joined:
            self.serve(key, m.replays.pop(-1 if newest else 0), cut)

    @rule(key=st.sampled_from(MEMBERS))
    def blip(self, key) -> None:
        """The link drops (what was in flight is lost) and stays down until `reconnect`."""
        m = self.m[key]
        if m.link_up:
            m.in_flight.clear()
            m.link_up = False
            if m.joined:
                self.handle(key, self.index.disconnected(key))

    @rule(key=st.sampled_from(MEMBERS))
    def reconnect(self, key) -> None:
        m = self.m[key]
        if not m.link_up:
            m.link_up = True
            if m.joined:
                self.handle(key, self.index.connected(key))

    # ---------------------------------------------------------------- membership

    @rule(key=st.sampled_from(MEMBERS))
    def leave(self, key) -> None:
        m = self.m[key]
        if m.joined:
            self.handle(key, self.index.leave(key))
            m.joined, m.in_flight, m.replays = False, deque(), []
            assert key not in self.index.members()

    @rule(key=st.sampled_from(MEMBERS))
    def rejoin(self, key) -> None:
        m = self.m[key]
        if not m.joined:
            m.joined, m.resume = True, None
            self.handle(key, self.index.join(key, m.era.identity))
            if m.link_up:
                self.handle(key, self.index.connected(key))

    # ---------------------------------------------------------------- checks

    def deliver_all(self, key: str) -> None:
        m = self.m[key]
        while m.in_flight:
            self.deliver(key, *m.in_flight.popleft())

    @rule(key=st.sampled_from(MEMBERS))
    def settle(self, key) -> None:
        m = self.m[key]
        if not m.joined:
            return
        self.deliver_all(key)
        if m.link_up:
            self.handle(key, self.index.disconnected(key))
        m.link_up = True
        self.handle(key, self.index.connected(key))  # a verifying replay, to the newest batch
        for _ in range(50):
            if not m.replays:
                break
            self.serve(key, m.replays.pop())
            self.deliver_all(key)
        assert not m.replays and self.index.synced(key)
        last = self.index.last_applied(key)
        claims = self.index.blocks(key)
        if last is None:
            assert not claims
            return
        era, seq = self.locate(key, last[1])
        assert era is m.era and seq == len(era.payloads) - 1, "not at the newest batch"
        truth = era.indexable(era.at(seq))
        assert claims <= truth
        if m.resume is None:
            assert claims == truth, "in sync from the start, yet not in agreement"
        else:
            assert claims >= self.stored_since(era, m.resume, seq)

    def stored_since(self, era: Era, start: int, end: int) -> frozenset[bytes]:
        """Indexable blocks held at `end` last stored in [start, end], parents too."""
        known: set[int] = set()
        for seq in range(start, end + 1):
            for event in era.events[seq]:
                if event[0] == "store":
                    _, hashes, parent, _tokens, _keyed = event
                    if parent is None or parent in known:
                        known.update(hashes)
                elif event[0] == "clear":
                    known = set()  # stores before a clear are not held any more
                else:
                    known.difference_update(event[1])
        return era.indexable(known & era.at(end))

    def teardown(self) -> None:
        for key in self.index.members() if hasattr(self, "index") else ():
            for name, n in self.index.member_counts(key).items():
                if n:
                    hypothesis.event(f"count: {name}")

    @invariant()
    def sound(self) -> None:
        if not hasattr(self, "m"):
            return
        for key, m in self.m.items():
            if not m.joined:
                continue
            claims = self.index.blocks(key)
            if not self.index.synced(key):
                assert not claims
                continue
            last = self.index.last_applied(key)
            if last is None:
                assert not claims, "claims with no batch applied since the last reset"
                continue
            era, seq = self.locate(key, last[1])
            assert era is m.era, f"{key} is in sync with a process that has been replaced"
            truth = era.indexable(era.at(seq))
            assert claims <= truth, f"{key} claims blocks it did not hold at batch {seq}"
            chain = sorted(claims)[:1]
            assert self.index.longest_prefix(chain)[key] == len(chain)


def to_vllm(event: tuple) -> object:
    if event[0] == "store":
        _, hashes, parent, tokens, keyed = event
        extra = (
            None
            if keyed is None
            else [("salt",) if i == keyed else None for i in range(len(hashes))]
        )
        return kv_events.BlockStored(
            block_hashes=list(hashes),
            parent_block_hash=parent,
            token_ids=list(tokens),
            block_size=B,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=extra,
            group_idx=0,
        )
    if event[0] == "remove":
        return kv_events.BlockRemoved(block_hashes=list(event[1]), medium="GPU", group_idx=0)
    return kv_events.AllBlocksCleared()


KVIndexMachine.TestCase.settings = settings(max_examples=600, stateful_step_count=80, deadline=None)
TestKVIndex = KVIndexMachine.TestCase
