"""How P's transfers end (`TransferLedger`): the transfers live on P, how each
is settled, aborted, preempted or expired, the tombstones they leave, and when
their request's blocks may be released. `ProducerSide` (producer_side.py)
creates the transfers and decides what ends them; this keeps the record.

Invariants (all under the shared lock, which every caller holds, except
`pending_block_frees`, which takes it):

- a transfer is in `produced` from its creation (`add`) until released or,
  for a migration over while its source runs, forgotten; `live_by_req[req_id]`
  counts those from one request (its own and every migration from it);
- `migrations[req_id]` holds the migrations from that request that are not
  over (settled, or aborted with nothing sent); one over while its source runs
  is forgotten;
- a transfer settles once every (source rank, destination rank) pair that
  exchanges KV sent its SendDone; its TransferKV is answered then (OK only if
  every pair wrote its part, with the tokens all of them sent);
- a settled or aborted transfer is tombstoned for `tombstone_ttl_s`
  (`tombstones`, oldest first);
- a finished request's blocks are released (`PendingMeta.release`) only once
  no write from them can be in flight: its transfer settled on every rank, or
  was aborted before anything was sent, and no other transfer from the
  request holds them; without a TransferKV they go after `finished_ttl_s`;
- a transfer aborted while sends of it are in flight fails on the ranks
  (`PendingMeta.fail`) and settles with an error; one aborted before any send
  is answered GONE at once;
- a released request is in `freeing` until vLLM freed its blocks
  (`blocks_freed`).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable

from rapidkv.connector.metadata import StepMeta
from rapidkv.connector.producer import Produced
from rapidkv.connector.shared_state import SharedState
from rapidkv.control.codes import Code
from rapidkv.control.messages import TransferKVReply
from rapidkv.kvt.messages import SendDone


class TransferLedger:
    """P's live transfers and their end: settling, aborting, tombstones, and
    releasing the blocks they held."""

    def __init__(self, shared: SharedState) -> None:
        self._shared = shared
        # the shared state's own objects, never reassigned
        self._config = shared.config
        self._counters = shared.counters
        self._lock = shared.lock
        self._block_size = shared.block_size
        # never reassigned (ProducerSide reads them)
        self.produced: dict[str, Produced] = {}  # xfer_id -> (not yet released)
        self.tombstones: OrderedDict[str, float] = OrderedDict()  # xfer_id -> when, oldest first
        self.freeing: set[str] = set()  # released req ids whose blocks vLLM still holds
        # req_id -> migrations from it not over (xfer_ids)
        self.migrations: dict[str, set[str]] = {}
        # req_id -> its transfers in produced (its own and migrations from it)
        self.live_by_req: Counter[str] = Counter()

    # -- the record (caller holds the lock) ---------------------------------------

    def add(self, p: Produced) -> None:
        """`p` is live from now on."""
        self.produced[p.xfer_id] = p
        self.live_by_req[p.req_id] += 1
        if p.migration:
            self.migrations.setdefault(p.req_id, set()).add(p.xfer_id)

    def tombstone(self, xfer_id: str) -> None:
        self.tombstones[xfer_id] = time.monotonic()
        self.tombstones.move_to_end(xfer_id)  # oldest first, for expire

    def count_migration(self, p: Produced, ok: bool) -> None:
        """A migration is over: count how it ended."""
        if p.migration:
            self._counters["migration_transfers_ok" if ok else "migration_transfers_failed"] += 1

    # -- how a transfer ends (caller holds the lock) ------------------------------

    def take_settled(self, settled: Iterable[SendDone]) -> None:
        """Transfers settled on a rank; one settled on every rank is over."""
        for s in settled:
            p = self.produced.get(s.xfer_id)
            if p is None:
                continue
            p.settled_ranks[(s.rank, s.dst_rank)] = (s.ok, s.tokens_sent, s.error)
            if p.all_settled:
                self._settle(p)

    def abort(self, p: Produced, why: str) -> None:
        """End `p`: sends of it in flight fail (it settles with an error), else
        its TransferKV is answered GONE now."""
        first = not p.aborted
        p.aborted = True
        self.tombstone(p.xfer_id)
        if p.issued and not p.all_settled:
            self._shared.pending.fail.append((p.xfer_id, why))  # settles with an error
        elif p.reply is not None:
            if first and not p.issued:  # over now (one issued is counted as it settles)
                self.count_migration(p, ok=False)
            p.reply.resolve(TransferKVReply(xfer_id=p.xfer_id, code=Code.GONE, message=why))

    def preempted(self, p: Produced, meta: StepMeta) -> None:
        """`p`'s request was preempted: its blocks are gone, the transfer cannot
        finish; D recomputes (the worker fences what was sent from them)."""
        self._counters["preempted_transfers"] += 1
        p.aborted = True
        if p.issued:
            meta.preempted_xfers.append(p.xfer_id)
        elif p.reply is not None:
            self.count_migration(p, ok=False)
            p.reply.resolve(
                TransferKVReply(xfer_id=p.xfer_id, code=Code.GONE, message="request preempted on P")
            )
        self.tombstone(p.xfer_id)
        self.maybe_release(p)

    def expire(self, now: float) -> None:
        """Finished requests no TransferKV came for, old tombstones. (Parked
        TransferKVs expire in their RPC handler, which runs even if P never steps.)"""
        for p in list(self.produced.values()):
            if (
                p.finished
                and not p.released
                and p.window is None
                and not p.issued
                and now - p.finished_at > self._config.finished_ttl_s
            ):
                self._counters["finished_expired"] += 1
                self.abort(p, "no TransferKV in time")
                self._release(p)
        while (
            self.tombstones
            and now - next(iter(self.tombstones.values())) > self._config.tombstone_ttl_s
        ):
            self.tombstones.popitem(last=False)

    # -- the blocks (caller holds the lock, but for pending_block_frees) ----------

    def maybe_release(self, p: Produced, settled: bool = False) -> None:
        """Free a finished request's blocks once nothing can be sent from them:
        its transfer settled on every rank, or it was aborted before any send
        (and no other transfer from the request holds them). A migration over
        while its source runs is forgotten."""
        if p.released:
            return
        over = settled or (p.issued and p.all_settled) or (p.aborted and not p.issued)
        if p.migration and not p.finished:
            if over:
                self._drop(p)
            return
        if p.finished and over:
            self._release(p)

    def blocks_freed(self, req_ids: Iterable[str]) -> None:
        """vLLM freed these released requests' blocks (`finished_sending`)."""
        self.freeing.difference_update(req_ids)

    def pending_block_frees(self) -> bool:
        """Finished P requests still hold blocks that will be freed without
        preempting anyone (their transfer settles, or they were released and vLLM
        frees them at the next step): vLLM then waits a step instead of preempting
        a running request."""
        with self._lock:
            pending = bool(self.freeing) or any(
                p.finished and not p.released for p in self.produced.values()
            )
            if pending:
                self._counters["pending_block_frees_waits"] += 1
            return pending

    # -- internals (caller holds the lock) ---------------------------------------

    def _settle(self, p: Produced) -> None:
        self._shared.timeline.event(p.xfer_id, "settled")
        oks = [v[0] for v in p.settled_ranks.values()]
        tokens = min(v[1] for v in p.settled_ranks.values())
        ok = all(oks)
        if p.migration:
            self.count_migration(p, ok)
        else:
            self._counters["transfers_ok" if ok else "transfers_failed"] += 1
        if ok and p.accepted_at:
            # TransferKV taken up -> every rank confirmed: the hand-off as D sees it
            prefix = "migration_" if p.migration else ""
            observations = self._shared.observations
            observations.observe(f"{prefix}transfer_seconds", time.monotonic() - p.accepted_at)
            nbytes = self._bytes_written(p, tokens)
            if nbytes is not None:
                observations.observe(f"{prefix}transfer_bytes", nbytes)
        if p.reply is not None:
            errors = "; ".join(v[2] for v in p.settled_ranks.values() if v[2])
            p.reply.resolve(
                TransferKVReply(
                    xfer_id=p.xfer_id,
                    code=Code.OK if ok else Code.ERROR,
                    tokens_sent=tokens,
                    message=errors,
                )
            )
        p.window = None  # nothing more to send
        p.last_issued = True
        self.tombstone(p.xfer_id)
        self.maybe_release(p, settled=True)

    def _bytes_written(self, p: Produced, tokens: int) -> int | None:
        """The KV bytes of the blocks `p`'s transfer wrote to hold `tokens`
        tokens at D (every rank's heads; D's prefix hits not included), from
        this instance's KV spec; None before the spec is known."""
        spec = self._shared.spec
        if spec is None or p.window is None:
            return None
        blocks = max(-(-tokens // self._block_size) - p.window.first_block, 0)
        return blocks * sum(spec.layer_block_bytes) * spec.tp_size

    def _release(self, p: Produced) -> None:
        if self._drop(p):
            return  # another transfer from the request still holds its blocks
        self._shared.pending.release.append(p.req_id)
        self.freeing.add(p.req_id)  # until vLLM frees the blocks (finished_sending)

    def _drop(self, p: Produced) -> int:
        """`p` is over: forget it; how many transfers from its request remain."""
        p.released = True
        self.produced.pop(p.xfer_id, None)
        if p.migration:
            same = self.migrations.get(p.req_id)
            if same is not None:
                same.discard(p.xfer_id)
                if not same:
                    del self.migrations[p.req_id]
        self.live_by_req[p.req_id] -= 1
        left = self.live_by_req[p.req_id]
        if left <= 0:
            del self.live_by_req[p.req_id]
        return left
