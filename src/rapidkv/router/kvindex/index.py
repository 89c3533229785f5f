"""`KVIndex`: every member's prefix cache, and the longest cached prefix of a prompt.

Pure: no socket, no clock, no logging. The shell (`service.KVIndexService`)
calls one method per thing that happened and carries out the `Action`s each
call returns; queries never change state.

Theory of operation
-------------------
A *member* is one vLLM publisher (one engine core: with data parallelism
each rank publishes on a port of its own and is a member of its own), named by
a key of the caller's choosing (its URL). Per member the index keeps a
`Sequencer` (which batch comes next, gaps, replays, restarts) and a
`Holdings` (what blocks it holds, under the index's own hashes). Events in:

- `join(member, identity)`, from the membership (static, discovered, etcd):
  a known member with a new identity restarted: `Reset`, `RequestReplay`.
- `leave(member)`, from the membership: the member is forgotten.
- `connected(member)` / `disconnected(member)`, from the SUB socket's monitor:
  `RequestReplay` (verify the publisher, catch up).
- `received(member, seq, payload)`, from the SUB socket: `RequestReplay` on a
  gap, `Reset` on a restart.
- `replayed(member, token, seq, payload)` and `replay_ended(member, token)`,
  from the replay socket (or a timeout): `Reset`, another `RequestReplay`.

Payloads are decoded here (`wire.decode_batch`, pure); one that cannot be read
is applied as "unknown events": what is held is dropped (`Reset`), counted.

Invariants (tests/router/test_kvindex_stateful.py, against a model of vLLM):
- Soundness: a member the index is in sync with claims only blocks it held
  right after the last batch the index applied for it, and that batch is of
  its current process once the end of the old one was seen (a dropped link, a
  new identity, a replay that does not match). So the only blocks claimed that
  the member no longer holds are those removed by batches the index has not
  applied yet (in flight, or lost with nothing after them to show the loss).
  While a loss is known and not repaired (a replay outstanding, the link
  down), the member claims nothing.
- Agreement: once the member's batches have all been delivered or replayed,
  the index claims exactly the indexable blocks the member holds, unless it
  had to `Reset` since the member joined; then it claims the held blocks last
  stored since the batch it resumed at, those of them whose parent it could
  name (every one whose parents were stored since then too), and no others.
- A new identity, a seq that restarts, or a replay that cannot show the same
  publisher, drops everything held; `AllBlocksCleared` clears; `leave` forgets.
- The undetectable case: a restart whose link drop the shell never saw, whose
  first batches were all lost and whose identity nobody announced is taken
  for the old process until the next replay verifies it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import blake2b

from rapidkv.router.kvindex.actions import Action, RequestReplay, Reset
from rapidkv.router.kvindex.hashing import prompt_hashes
from rapidkv.router.kvindex.holdings import TRANSLATION_CAP, Holdings
from rapidkv.router.kvindex.sequencer import (
    PENDING_CAP,
    Apply,
    AskReplay,
    Batch,
    Forget,
    Sequencer,
    Step,
)
from rapidkv.router.kvindex.wire import MAX_PAYLOAD_BYTES, WireError, decode_batch


@dataclass
class _Member:
    identity: str | None
    sequencer: Sequencer
    holdings: Holdings


class KVIndex:
    """Per member, the blocks it holds; per prompt, each member's cached prefix."""

    def __init__(
        self,
        block_size: int,
        *,
        translation_cap: int = TRANSLATION_CAP,
        pending_cap: int = PENDING_CAP,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {block_size}")
        self.block_size = block_size
        self.translation_cap = translation_cap
        self.pending_cap = pending_cap
        self.max_payload_bytes = max_payload_bytes
        self.counts: Counter[str] = Counter()  # events about members not (or no longer) joined
        self._members: dict[str, _Member] = {}

    # ---------------------------------------------------------------- membership

    def join(
        self, member: str, identity: str | None = None, *, can_replay: bool = True
    ) -> list[Action]:
        """`member` is in the fleet, as process `identity` (None: unknown).
        Joining again with another identity is a restart: what it held is
        dropped. The first identity told of a member joined without one is
        taken as it is."""
        m = self._members.get(member)
        if m is None:
            self._members[member] = _Member(
                identity,
                Sequencer(can_replay=can_replay, pending_cap=self.pending_cap),
                Holdings(self.block_size, self.translation_cap),
            )
            return []
        old, m.identity = m.identity, identity if identity is not None else m.identity
        if identity is None or old is None or identity == old:
            return []
        return self._run(member, m, m.sequencer.restarted(f"identity {identity} (was {old})"))

    def leave(self, member: str) -> list[Action]:
        """`member` left the fleet: forget it."""
        self._members.pop(member, None)
        return []

    def members(self) -> tuple[str, ...]:
        return tuple(self._members)

    # ---------------------------------------------------------------- the link

    def connected(self, member: str) -> list[Action]:
        return self._call(member, lambda m: m.sequencer.connected())

    def disconnected(self, member: str) -> list[Action]:
        return self._call(member, lambda m: m.sequencer.disconnected())

    # ---------------------------------------------------------------- batches

    def received(self, member: str, seq: int, payload: bytes) -> list[Action]:
        """A live batch (`wire.parse_live`)."""
        return self._call(member, lambda m: m.sequencer.live(self._batch(seq, payload)))

    def replayed(self, member: str, token: int, seq: int, payload: bytes) -> list[Action]:
        """A batch of the replay `token` (`wire.parse_replay`)."""
        return self._call(member, lambda m: m.sequencer.replayed(token, self._batch(seq, payload)))

    def replay_ended(self, member: str, token: int) -> list[Action]:
        """The replay `token` ended: its end marker came, or it timed out."""
        return self._call(member, lambda m: m.sequencer.replay_ended(token))

    def refused(self, member: str) -> list[Action]:
        """A message without a readable seq (`WireError` from `wire.parse_*`):
        counted; the next batch shows the gap it left."""
        return self._call(member, lambda m: self._count(m, "refused_frames"))

    # ---------------------------------------------------------------- queries

    def longest_prefix(self, own_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per member, how many leading blocks of a prompt (its own-hash chain,
        `hashing.prompt_hashes`) it holds; 0 for a member not in sync."""
        return {
            key: m.holdings.leading(own_hashes) if m.sequencer.synced else 0
            for key, m in self._members.items()
        }

    def match(self, token_ids: Sequence[int]) -> dict[str, int]:
        """`longest_prefix` of a prompt given as token ids."""
        return self.longest_prefix(prompt_hashes(token_ids, self.block_size))

    def blocks(self, member: str) -> frozenset[bytes]:
        """The own hashes `member` is claimed to hold (none while not in sync)."""
        m = self._members[member]
        return m.holdings.blocks() if m.sequencer.synced else frozenset()

    def synced(self, member: str) -> bool:
        return self._members[member].sequencer.synced

    def last_applied(self, member: str) -> tuple[int, bytes] | None:
        """(seq, payload digest) of the last batch applied for `member`, if any."""
        return self._members[member].sequencer.last

    def member_counts(self, member: str) -> dict[str, int]:
        """What happened to `member`'s events, by name (applied, replays,
        duplicates, refused, skipped_* ...)."""
        m = self._members[member]
        return dict(m.sequencer.counts + m.holdings.counts)

    # ---------------------------------------------------------------- internals

    def _batch(self, seq: int, payload: bytes) -> Batch:
        digest = blake2b(payload, digest_size=16).digest()
        try:
            body: object = decode_batch(payload, self.max_payload_bytes)
        except WireError as e:
            body = e
        return Batch(seq, digest, body)

    def _count(self, m: _Member, name: str) -> list[Step]:
        m.holdings.counts[name] += 1
        return []

    def _call(self, member: str, event: Callable[[_Member], list[Step]]) -> list[Action]:
        m = self._members.get(member)
        if m is None:
            self.counts["unknown_member"] += 1
            return []
        return self._run(member, m, event(m))

    def _run(self, member: str, m: _Member, steps: list[Step]) -> list[Action]:
        actions: list[Action] = []
        for step in steps:
            if isinstance(step, Apply):
                batch = step.batch
                if isinstance(batch.body, WireError):
                    m.holdings.counts["refused"] += 1
                    m.holdings.forget(full=False)
                    why = f"batch {batch.seq} unreadable: {batch.body}"
                    actions.append(Reset(member, why, False, batch.seq + 1))
                else:
                    m.holdings.apply(batch.body)
            elif isinstance(step, Forget):
                m.holdings.forget(full=step.full)
                actions.append(Reset(member, step.reason, step.full, step.resume_seq))
            elif isinstance(step, AskReplay):
                actions.append(RequestReplay(member, step.start_seq, step.token))
        return actions
