"""P's role on the scheduler side (`ProducerSide`): requests whose KV this
instance computes and writes into another instance's (D's) blocks.

A request with `kv_transfer_params.rapidkv.role == "prefill"` is tracked as one
transfer (`Produced`, producer.py) from its admission until its blocks are
released. A TransferKV that arrives before its request is parked until the
request arrives; one accepted is planned every step (`plan_step`), at once over
the bypass channel, or as a substep of the step in flight (`transfer_kv_mode`;
what goes out when is `TransferSender`'s, transfer_sender.py); the ranks' acks
resolve substeps (journal.py). When every rank settled the transfer, its
TransferKV is answered and its request's blocks may go (`TransferLedger`,
transfer_ledger.py, keeps the live transfers and tombstones, settles, aborts
and releases them).

`ProducerSide` admits requests and parks TransferKVs, fails the transfers of
preempted requests and serves the control plane (TransferKV, Abort, a
destination gone): it decides what ends a transfer, the ledger ends it; it
composes both and is the only one other modules call.

Invariants (all under the shared lock):

- a transfer is in the ledger's `produced` from admission until released; its
  request is in `_xfer_by_req` and `_requests` until vLLM finished it;
- a TransferKV is parked only while its request is not admitted: at most
  `max_parked` of them, each answered NOT_FOUND once `park_ttl_s` passed;
- at most `max_transfers_per_peer` transfers to one destination are accepted
  and not settled, or parked (a new one beyond is answered BUSY);
- a TransferKV for a transfer the ledger tombstoned (settled or aborted, for
  `tombstone_ttl_s`) is answered GONE, and a request admitted for it is
  aborted at once (an Abort may overtake its request);
- a finished request of ours is held (`request_finished` True); its blocks go
  once no write from them can be in flight (the ledger's invariants); without
  a TransferKV they go after `finished_ttl_s`;
- P's write fence: an Abort is answered OK only once no write of its transfer
  can land any more (its sends in flight settled); BUSY if that takes longer
  than `write_timeout_s`;
- once vLLM's engine is shutting down (`SharedState.closing`, `shut_down`)
  nothing is parked and no finished request waits for its TransferKV: the
  engine, which steps on while a request holds blocks, can stop.

Migrations (`receive_transfer_kv` of a TransferKV with `migration`): the KV of
a request running here (a source, `sources.py`) goes to a destination that
will go on decoding it. It is a `Produced` flagged `migration`, keyed by the
migration's own `xfer_id`, on the source request's `req_id`; tombstones,
duplicates, `max_transfers_per_peer`, Abort and the write fence,
`fail_transfers_to` and settling are P's. It is never parked (no such source:
GONE at once). What the source computed is sent at once over the bypass
channel, whatever the `transfer_kv_mode` (`TransferSender.send_migration_now`);
the rest with the next steps (`plan_step`). Further invariants:

- a request that finished with a migration from it not over is held
  (`request_finished` True); its blocks go once no transfer from it holds
  them (its own and every migration from it: the ledger's `live_by_req`), and
  a migration over while its source runs is forgotten (the ledger's
  `migrations`);
- a migration whose source is preempted fails (as P's does: the worker fences
  the freed blocks); the source itself is never touched by its migrations.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rapidkv.connector.metadata import StepMeta
from rapidkv.connector.plan import Window
from rapidkv.connector.producer import Produced, Reply
from rapidkv.connector.shared_state import SharedState
from rapidkv.connector.sources import Sources
from rapidkv.connector.transfer_ledger import TransferLedger
from rapidkv.connector.transfer_sender import TransferSender
from rapidkv.control.codes import Code
from rapidkv.control.messages import (
    Abort,
    AbortReply,
    TransferKV,
    TransferKVReply,
    prompt_hash,
)
from rapidkv.kvt.messages import SendDone

log = logging.getLogger(__name__)

SHUTTING_DOWN = "P is shutting down"


@dataclass
class ParkedTransferKV:
    """A TransferKV that came before its request, and where its answer goes."""

    msg: TransferKV
    reply: Reply


class ProducerSide:
    """P's transfers: admitted and asked for (or parked), and what ends them;
    how they end and when the blocks may be freed is the ledger's
    (`TransferLedger`), what goes out when the sender's (`TransferSender`)."""

    def __init__(self, shared: SharedState, sources: Sources) -> None:
        self._shared = shared
        self._sources = sources
        # the shared state's own objects, never reassigned
        self._config = shared.config
        self._counters = shared.counters
        self._lock = shared.lock
        self._block_size = shared.block_size
        self._tp_size = shared.tp_size
        # how transfers end, and the blocks they hold (transfer_ledger.py)
        self._ledger = TransferLedger(shared)
        # the ledger's own objects, never reassigned
        self._produced = self._ledger.produced  # xfer_id -> (not yet released)
        self._tombstones = self._ledger.tombstones  # xfer_id -> when, oldest first
        self._migrations = self._ledger.migrations  # req_id -> migrations from it not over
        self._xfer_by_req: dict[str, str] = {}  # req_id -> xfer_id (until finished)
        # vLLM's request, for num_computed_tokens (the sender reads it)
        self._requests: dict[str, Any] = {}
        # what goes out when: each step's plan, bypass sends (transfer_sender.py)
        self._sender = TransferSender(shared, sources, self._ledger, self._requests)
        self._parked: dict[str, ParkedTransferKV] = {}  # xfer_id ->

    # -- request lifecycle (engine thread; caller holds the lock) -----------------

    def admit(self, request: Any, xfer_id: str) -> None:
        """A prefill request was admitted; a TransferKV parked for it is taken
        up. One whose transfer was aborted before it arrived here (D's local
        hits covered the prompt, the client left: the Abort overtook the
        request) is aborted at once: its blocks go when it finishes, not after
        `finished_ttl_s`."""
        p = Produced(
            xfer_id,
            request.request_id,
            request.num_prompt_tokens,
            prompt_hash(request.prompt_token_ids),
            prompt_hash(request.prompt_token_ids[:-1]),
        )
        self._ledger.add(p)
        self._xfer_by_req[request.request_id] = xfer_id
        self._shared.timeline.event(xfer_id, "admitted")
        self._requests[request.request_id] = request
        if xfer_id in self._tombstones:
            self._counters["aborted_before_admission"] += 1
            self._ledger.abort(p, "aborted before P admitted it")
            return
        parked = self._parked.pop(xfer_id, None)
        if parked is not None:
            self._counters["parked_served"] += 1
            self._accept(p, parked.msg, parked.reply)

    def plan_step(self, meta: StepMeta, so: Any, now: float) -> None:
        """Into the metadata of step `shared.step_id` (vLLM's scheduler output
        `so`): transfers whose request was preempted fail, what is computable
        and asked for goes out (`TransferSender.plan_step`); finished requests
        no TransferKV came for and old tombstones expire."""
        self._ledger.expire(now)
        for req_id in so.preempted_req_ids or ():
            xfer_id = self._xfer_by_req.get(req_id)
            p = self._produced.get(xfer_id) if xfer_id else None
            if p is not None and not p.aborted:
                self._ledger.preempted(p, meta)
            for mx in sorted(self._migrations.get(req_id, ())):
                m = self._produced[mx]
                if not m.aborted:
                    self._ledger.preempted(m, meta)
        self._sender.plan_step(meta, so, now)

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        """vLLM finished the request: whether its blocks are held until nothing
        can be sent from them (always for a prefill request of ours; for any
        other, while a migration from it is not over)."""
        req_id = request.request_id
        self._requests.pop(req_id, None)
        migrations = self._migrations.get(req_id, set())
        for mx in sorted(migrations):
            m = self._produced[mx]
            m.finished = True
            m.finished_at = time.monotonic()
            m.computed = min(request.num_computed_tokens, m.prompt_len)
            m.block_ids = tuple(block_ids) or m.block_ids
            self._shared.timeline.event(mx, "source_finished")
            if m.window is not None and m.computed < m.window.num_tokens:
                # what is asked for will never be computed now
                self._ledger.abort(m, "migration source finished before computing it")
        held = bool(migrations)
        for mx in sorted(migrations):
            self._ledger.maybe_release(self._produced[mx])
        xfer_id = self._xfer_by_req.pop(req_id, None)
        if xfer_id is None:
            return held
        p = self._produced[xfer_id]
        self._shared.timeline.event(xfer_id, "finished")
        p.finished = True
        p.finished_at = time.monotonic()
        p.computed = min(request.num_computed_tokens, p.prompt_len)
        p.block_ids = tuple(block_ids) or p.block_ids
        if request.status.name == "FINISHED_ABORTED":
            self._ledger.abort(p, "request aborted on P")
        elif self._shared.closing and p.window is None:
            # the engine is shutting down: no TransferKV is waited for
            self._counters["shutdown_released"] += 1
            self._ledger.abort(p, SHUTTING_DOWN)
        self._ledger.maybe_release(p)
        return True

    def shut_down(self) -> tuple[int, int]:
        """vLLM's engine is shutting down (it admits no request any more, and
        stops once no request holds a block): what waits for a TransferKV goes.
        Parked TransferKVs are answered GONE (their request will not come: D
        recomputes), finished requests that no TransferKV was accepted for are
        released (one that comes later is answered GONE). Transfers accepted
        run to their end, and so do migrations. How many TransferKVs were
        answered and requests released (engine thread; caller holds the lock)."""
        answered = released = 0
        for xfer_id, parked in list(self._parked.items()):
            del self._parked[xfer_id]
            self._ledger.tombstone(xfer_id)
            parked.reply.resolve(
                TransferKVReply(xfer_id=xfer_id, code=Code.GONE, message=SHUTTING_DOWN)
            )
            answered += 1
        for p in list(self._produced.values()):
            if p.finished and not p.released and p.window is None and not p.migration:
                self._ledger.abort(p, SHUTTING_DOWN)
                self._ledger.maybe_release(p)
                released += 1
        self._counters["shutdown_refused"] += answered
        self._counters["shutdown_released"] += released
        return answered, released

    # -- the workers' output (engine thread; caller holds the lock) ---------------

    def blocks_freed(self, req_ids: Iterable[str]) -> None:
        """vLLM freed these released requests' blocks (`finished_sending`)."""
        self._ledger.blocks_freed(req_ids)

    def step_ended(self, step_id: int, now: float) -> None:
        """Step `step_id` returned at `now`: what it computed is final
        (`TransferSender.step_ended`)."""
        self._sender.step_ended(step_id, now)

    def take_acks(self, acks: Iterable[tuple[int, int, int]]) -> None:
        """The ranks' `(step, ack, rank)`: resolve the substeps of fully acked
        steps (`TransferSender.take_acks`)."""
        self._sender.take_acks(acks)

    def take_settled(self, settled: Iterable[SendDone]) -> None:
        """Transfers settled on a rank; one settled on every rank is over
        (`TransferLedger.take_settled`)."""
        self._ledger.take_settled(settled)

    def pending_block_frees(self) -> bool:
        """Whether finished P requests still hold blocks that will be freed
        without preempting anyone (`TransferLedger.pending_block_frees`; takes
        the lock)."""
        return self._ledger.pending_block_frees()

    def gauges(self) -> dict[str, float]:
        """Parked TransferKVs, live transfers, tombstones, finished requests
        whose blocks are held for their transfer and those blocks (caller holds
        the lock)."""
        held: dict[str, int] = {}  # req_id -> its blocks (several transfers may hold one)
        for p in self._produced.values():
            if p.finished and not p.released:
                held[p.req_id] = max(held.get(p.req_id, 0), len(p.block_ids))
        return {
            "parked_now": float(len(self._parked)),
            "transfers_live": float(len(self._produced)),
            "tombstones": float(len(self._tombstones)),
            "held_requests": float(len(held)),
            "held_blocks": float(sum(held.values())),
            "migrations_live": float(sum(len(x) for x in self._migrations.values())),
        }

    # -- the control plane (RPC loop thread) -------------------------------------

    def receive_transfer_kv(self, msg: TransferKV, reply: Reply) -> TransferKVReply | Reply:
        """Take up `msg` from a destination that handshook with us: accept it,
        park it, or refuse it. The refusal, or where the answer will come: `reply`,
        or a duplicate's first TransferKV's (caller holds the lock)."""
        if msg.xfer_id in self._tombstones:
            return TransferKVReply(
                xfer_id=msg.xfer_id, code=Code.GONE, message="transfer aborted or timed out"
            )
        p = self._produced.get(msg.xfer_id)
        parked = self._parked.get(msg.xfer_id)
        earlier = parked.reply if parked is not None else p.reply if p and p.window else None
        if earlier is not None:
            # the same transfer asked for twice (a replay, or a confused D):
            # nothing changes; this one gets the first one's answer, when
            # no more writes of it can land
            self._counters["duplicate_transfer_kv"] += 1
            return earlier
        if msg.migration:
            refused = self._take_up_migration(msg, p, reply)
        else:
            refused = self._take_up(msg, p, reply)
        return refused if refused is not None else reply

    async def wait_for_answer(self, msg: TransferKV, reply: Reply) -> TransferKVReply:
        """The answer to a TransferKV taken up (`receive_transfer_kv`): once its
        transfer settled or failed. A parked one is answered NOT_FOUND once the
        park TTL passes, even if P never steps (caller does not hold the lock)."""
        try:
            return await asyncio.wait_for(asyncio.shield(reply.future), self._config.park_ttl_s)
        except TimeoutError:
            with self._lock:
                if self._parked.pop(msg.xfer_id, None) is not None:
                    self._counters["park_expired"] += 1
                    if not reply.future.done():  # for a duplicate waiting on it too
                        reply.future.set_result(
                            TransferKVReply(
                                xfer_id=msg.xfer_id,
                                code=Code.NOT_FOUND,
                                message="request not seen on P",
                            )
                        )
        return await reply.future

    async def abort(self, msg: Abort) -> AbortReply:
        """Stop the transfer; answer once no more of its writes can land (its
        sends in flight settled), or BUSY if that is not confirmed within
        `write_timeout_s` (the sender keeps its blocks and asks again)."""
        in_flight: asyncio.Future | None = None
        with self._lock:
            self._counters[f"aborts_{msg.reason.value}"] += 1
            parked = self._parked.pop(msg.xfer_id, None)
            if parked is not None:
                parked.reply.resolve(
                    TransferKVReply(xfer_id=msg.xfer_id, code=Code.GONE, message="aborted")
                )
            p = self._produced.get(msg.xfer_id)
            if p is not None and not p.released:
                if p.issued and not p.all_settled and p.reply is not None:
                    in_flight = p.reply.future  # resolved when every rank settled
                self._ledger.abort(p, f"aborted by peer: {msg.reason.value}")
                self._ledger.maybe_release(p)
            self._ledger.tombstone(msg.xfer_id)
        if in_flight is not None:
            try:
                await asyncio.wait_for(asyncio.shield(in_flight), self._config.write_timeout_s)
            except TimeoutError:
                with self._lock:
                    self._counters["aborts_unconfirmed"] += 1
                return AbortReply(
                    xfer_id=msg.xfer_id, code=Code.BUSY, message="writes of it may still land"
                )
        return AbortReply(xfer_id=msg.xfer_id, code=Code.OK)

    def fail_transfers_to(self, instance_id: str, why: str) -> None:
        """Destination `instance_id` is gone: what was parked for it is answered
        GONE, what is in flight to it fails (its held blocks are freed as soon
        as no write of theirs is in flight, not after `finished_ttl_s`; caller
        holds the lock)."""
        for xfer_id, parked in list(self._parked.items()):
            if parked.msg.dst_instance == instance_id:
                del self._parked[xfer_id]
                parked.reply.resolve(
                    TransferKVReply(xfer_id=xfer_id, code=Code.GONE, message=f"peer {why}")
                )
        for p in list(self._produced.values()):
            if p.window is not None and p.window.peer == instance_id and not p.released:
                self._counters["transfers_failed_peer_gone"] += 1
                self._ledger.abort(p, f"destination {instance_id} {why}")
                self._ledger.maybe_release(p)

    # -- internals (caller holds the lock) ---------------------------------------

    def _take_up(self, msg: TransferKV, p: Produced | None, reply: Reply) -> TransferKVReply | None:
        """Accept `msg` for its request, or park it until the request arrives; the
        refusal if neither may be done now."""
        self._arrived(msg, p)
        new = p is None or p.window is None
        if new and self.outstanding(msg.dst_instance) >= self._config.max_transfers_per_peer:
            self._counters["busy_replies"] += 1
            return TransferKVReply(
                xfer_id=msg.xfer_id,
                code=Code.BUSY,
                message=f"{self._config.max_transfers_per_peer} transfers to "
                f"{msg.dst_instance} outstanding",
            )
        if p is not None:
            self._accept(p, msg, reply)
        elif self._shared.closing:  # its request will not be admitted any more
            self._counters["shutdown_refused"] += 1
            self._ledger.tombstone(msg.xfer_id)
            return TransferKVReply(xfer_id=msg.xfer_id, code=Code.GONE, message=SHUTTING_DOWN)
        elif len(self._parked) >= self._config.max_parked:
            return TransferKVReply(
                xfer_id=msg.xfer_id, code=Code.BUSY, message="too many parked transfers"
            )
        else:
            self._counters["parked"] += 1
            self._parked[msg.xfer_id] = ParkedTransferKV(msg, reply)
        return None

    def _take_up_migration(
        self, msg: TransferKV, p: Produced | None, reply: Reply
    ) -> TransferKVReply | None:
        """Accept a migration of a request running here and send at once what
        it computed; the refusal if it may not be served (never parked)."""
        self._shared.timeline.event(msg.xfer_id, "transfer_kv")
        if p is not None:  # a prefill of ours under this xfer_id: a confused router
            return TransferKVReply(
                xfer_id=msg.xfer_id,
                code=Code.ERROR,
                message=f"xfer_id {msg.xfer_id} is a prefill transfer here, not a migration",
            )
        source = self._sources.check(msg)
        if isinstance(source, TransferKVReply):
            return source
        if self.outstanding(msg.dst_instance) >= self._config.max_transfers_per_peer:
            self._counters["busy_replies"] += 1
            return TransferKVReply(
                xfer_id=msg.xfer_id,
                code=Code.BUSY,
                message=f"{self._config.max_transfers_per_peer} transfers to "
                f"{msg.dst_instance} outstanding",
            )
        p = Produced(
            msg.xfer_id, source.req_id, msg.num_tokens + 1, msg.prompt_hash, migration=True
        )
        self._ledger.add(p)
        self._requests[p.req_id] = source.request  # read by plan_step until it finishes
        window = Window(
            msg.xfer_id, msg.dst_instance, tuple(msg.dst_blocks), msg.first_block, msg.num_tokens
        )
        p.accept(window, reply, self._block_size, "migration", self._settles(msg.dst_instance))
        self._counters["migration_transfers"] += 1
        self._counters["migration_blocks_skipped"] += msg.first_block
        # the step in flight computes some of it (empty between steps)
        in_step = self._shared.step_scheduled.get(source.req_id, 0)
        state = "in_step" if in_step else "between_steps"
        self._shared.timeline.arrival(msg.xfer_id, state, "migration")
        self._shared.timeline.event(msg.xfer_id, "accepted")
        final = self._sender.send_migration_now(p, source)
        log.info(
            "rapidkv %s: migration %s of %s (%s) to %s: %d tokens asked from block %d; the "
            "source has %d tokens, %d computed (%d of them scheduled in the step in flight), "
            "%d final: sent up to %d now",
            self._shared.instance_id,
            msg.xfer_id,
            source.xfer_id,
            source.role,
            msg.dst_instance,
            msg.num_tokens,
            msg.first_block,
            source.request.num_tokens,
            source.request.num_computed_tokens,
            in_step,
            final,
            p.sent_upto,
        )
        return None

    def _settles(self, dst_instance: str) -> int:
        """SendDones that settle a transfer to `dst_instance`: one per (source
        rank, destination rank) pair that exchanges KV (from its handshake)."""
        return self._shared.peer_pairs.get(dst_instance, self._tp_size)

    def _arrived(self, msg: TransferKV, p: Produced | None) -> None:
        """Note a TransferKV's arrival and where its request was then."""
        self._shared.timeline.event(msg.xfer_id, "transfer_kv")
        step_in_flight = self._shared.step_in_flight
        if p is None:
            state = "not_admitted"
        elif p.finished or p.computed >= msg.num_tokens:
            state = "finished"
        elif step_in_flight is not None and p.scheduled_step == step_in_flight:
            state = "last_chunk" if p.in_flight_end >= msg.num_tokens else "earlier_chunk"
        else:
            state = "between_steps"
        self._shared.timeline.arrival(msg.xfer_id, state, self._mode(msg))

    def _mode(self, msg: TransferKV) -> str:
        """The `transfer_kv_mode` P serves `msg` in: the request's, else P's.
        A split prefill's head always goes layer by layer as computed (D's
        forward waits for each layer; in step/bypass mode it would wait for the
        whole head when the TransferKV came after P's step began)."""
        if msg.notify_layers:
            return "substep"
        return msg.transfer_kv_mode or self._config.transfer_kv_mode

    def _accept(self, p: Produced, msg: TransferKV, reply: Reply) -> None:
        head = msg.notify_layers and msg.prompt_hash == p.head_hash  # a fetch's head
        if msg.prompt_hash != p.prompt_hash and not head:
            self._counters["prompt_mismatch"] += 1
            reply.resolve(
                TransferKVReply(
                    xfer_id=msg.xfer_id,
                    code=Code.ERROR,
                    message="prompt token ids differ between P and D",
                )
            )
            # nothing of it will ever be asked for: free it once it finishes
            self._ledger.abort(p, "prompt token ids differ between P and D")
            self._ledger.maybe_release(p)
            return
        window = Window(
            msg.xfer_id,
            msg.dst_instance,
            tuple(msg.dst_blocks),
            msg.first_block,
            msg.num_tokens,
            msg.notify_layers,
        )
        mode = self._mode(msg)
        p.accept(window, reply, self._block_size, mode, self._settles(msg.dst_instance))
        self._shared.timeline.event(p.xfer_id, "accepted")
        if mode != "step":
            self._sender.send_now(p, substep=mode == "substep")

    def outstanding(self, dst_instance: str) -> int:
        """Transfers to `dst_instance` accepted and not yet settled, or parked."""
        live = sum(
            1
            for p in self._produced.values()
            if p.window is not None and p.window.peer == dst_instance
        )
        return live + sum(1 for x in self._parked.values() if x.msg.dst_instance == dst_instance)
