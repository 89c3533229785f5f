"""The scheduler side of the connector (EngineCore process, engine thread),
plus this instance's control-plane server (its own thread).

P role (requests with `kv_transfer_params.rapidkv.role == "prefill"`): tracks
each transfer (`Produced`), parks a TransferKV that arrives before its request,
plans sends each step (`build_meta`), holds finished requests' blocks until
their transfer settled, answers TransferKV when it did.

D role (`role == "decode"`): asks vLLM to load `prompt_len - 1 - local hits`
tokens asynchronously, sends Handshake (once per P) and TransferKV from
`after_alloc`, tells the workers which transfer each request waits for, and
turns a refused or failed transfer into a load failure (vLLM's "recompute"
policy then prefills locally). A *split prefill* (`split_tokens` in the
request's params: P was sent only that block-aligned head of the prompt) is
loaded synchronously instead: vLLM schedules the tail at once and the workers
wait for each layer of the head in `wait_for_layer_load`; the TransferKV's
answer reaches them over the bypass channel (`recv_over`), so a refused or
failed head stops their wait (its blocks are then reported invalid, and
recomputed).

Locking: every structure here is shared between the engine thread and the RPC
server's loop thread and touched only under `self._lock`; the engine thread
never waits on the network.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from rapidkv.connector.bypass import BypassMsg, BypassSender, Peer
from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.consumer_side import ConsumerSide
from rapidkv.connector.journal import Entry, JournalError, Resolution, SubstepJournal
from rapidkv.connector.metadata import RankInfo, StepMeta, WorkerMeta
from rapidkv.connector.plan import Window
from rapidkv.connector.producer import Produced, Reply
from rapidkv.connector.shared_state import SharedState
from rapidkv.control.address import WILDCARD_HOSTS, parse_address
from rapidkv.control.codes import Code
from rapidkv.control.messages import (
    Abort,
    AbortReply,
    ErrorReply,
    Handshake,
    HandshakeReply,
    KVSpec,
    RankEndpoint,
    Stats,
    StatsRequest,
    Timeline,
    TimelineRequest,
    TransferKV,
    TransferKVReply,
    answer_handshake,
    prompt_hash,
)
from rapidkv.control.server import RpcServer

log = logging.getLogger(__name__)


def rapidkv_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """Our part of a request's `kv_transfer_params`, if any."""
    if not params:
        return None
    ours = params.get("rapidkv")
    return ours if isinstance(ours, dict) and ours.get("xfer_id") else None


def is_discovery(params: dict[str, Any] | None) -> bool:
    """A router's probe for this instance's control address
    (`kv_transfer_params = {"rapidkv": {"discover": true}}`)."""
    ours = params.get("rapidkv") if params else None
    return isinstance(ours, dict) and ours.get("discover") is True


@dataclass
class _KnownPeer:
    """A destination instance that handshook with this P (one process start of it)."""

    endpoints: list[RankEndpoint]
    incarnation: str
    control_address: str
    generation: int  # of its Peer entries in the workers


@dataclass
class _Parked:
    msg: TransferKV
    reply: Reply


# what a rolled-back substep restores on its Produced: (sent_upto, issued, last_issued)
Undo = tuple[int, bool, bool]


class SchedulerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        instance_id: str,
        block_size: int,
        tp_size: int,
        fingerprint: str,
    ) -> None:
        self.config = config
        self.instance_id = instance_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.fingerprint = fingerprint
        self.shared = SharedState(config, instance_id, block_size, tp_size)
        self.incarnation = self.shared.incarnation
        self.counters = self.shared.counters
        self._lock = self.shared.lock
        self._produced: dict[str, Produced] = {}  # xfer_id ->
        self._p_by_req: dict[str, str] = {}  # req_id -> xfer_id
        self._parked: dict[str, _Parked] = {}
        self._tombstones: OrderedDict[str, float] = OrderedDict()
        self._peers: dict[str, _KnownPeer] = {}  # D instances we may write to
        self._generations = itertools.count(1)  # of the workers' Peer entries
        self._requests: dict[str, Any] = {}  # P requests, for num_computed_tokens
        self._freeing: set[str] = set()  # released P requests whose blocks vLLM still holds
        # substeps attached to the step in flight, awaiting every rank's ack
        self._journal: SubstepJournal[Undo] = SubstepJournal(tp_size)
        self.consumer = ConsumerSide(self.shared)
        self.server = RpcServer(
            self._handle, config.control_host, config.control_port, secret=config.secret
        )
        self.server.start()
        self.shared.control_address = self.server.address
        log.info("rapidkv %s: control plane on %s", instance_id, self.server.address)

    @property
    def spec(self) -> KVSpec | None:
        """This instance's KV spec, once `set_ranks` ran."""
        return self.shared.spec

    @property
    def endpoints(self) -> list[RankEndpoint]:
        """This instance's ranks as a peer reaches them, once `set_ranks` ran."""
        return self.shared.endpoints

    @property
    def kv_cache_manager(self) -> Any:
        """vLLM's KV cache manager (bound by `bind_kv_cache_manager`)."""
        return self.shared.kv_cache_manager

    @kv_cache_manager.setter
    def kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.shared.kv_cache_manager = kv_cache_manager

    # -- start-up ---------------------------------------------------------------

    def set_ranks(self, infos: dict[int, RankInfo]) -> None:
        first = infos[min(infos)]
        self.shared.spec = KVSpec(
            block_size=self.block_size,
            kernel_blocks_per_block=first.kernel_blocks_per_block,
            dtype=first.dtype,
            num_layers=len(first.block_bytes),
            layer_block_bytes=first.block_bytes,
            layer_runs_per_block=first.runs_per_block,
            tp_size=self.tp_size,
            model_fingerprint=self.fingerprint,
        )
        self.shared.endpoints = [
            RankEndpoint(
                rank=r,
                transport=i.transport,
                transport_metadata=i.transport_metadata,
                layout=i.layout,
                num_blocks=i.num_blocks,
            )
            for r, i in sorted(infos.items())
        ]
        self.shared.bypass = BypassSender({r: i.bypass_address for r, i in infos.items()})

    # -- request lifecycle (engine thread) ---------------------------------------

    def on_new_request(self, request: Any) -> None:
        ours = rapidkv_params(request.kv_transfer_params)
        if ours is None:
            return
        xfer_id = str(ours["xfer_id"])
        with self._lock:
            if ours.get("role") == "prefill":
                p = Produced(
                    xfer_id,
                    request.request_id,
                    request.num_prompt_tokens,
                    prompt_hash(request.prompt_token_ids),
                )
                self._produced[xfer_id] = p
                self._p_by_req[request.request_id] = xfer_id
                self.shared.timeline.event(xfer_id, "admitted")
                self._requests[request.request_id] = request
                parked = self._parked.pop(xfer_id, None)
                if parked is not None:
                    self.counters["parked_served"] += 1
                    self._accept(p, parked.msg, parked.reply)
            elif ours.get("role") == "decode":
                self.consumer.admit(request, xfer_id, ours)

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """D: tokens to load from P (`ConsumerSide.matched_tokens`)."""
        return self.consumer.matched_tokens(request, num_computed)

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        """D: blocks allocated; the TransferKV goes to P (`ConsumerSide.after_alloc`)."""
        self.consumer.after_alloc(request, blocks, num_external)

    def build_meta(self, so: Any) -> StepMeta:
        self.shared.step_id += 1
        meta = StepMeta(self.shared.step_id)
        now = time.monotonic()
        scheduled = so.num_scheduled_tokens
        with self._lock:
            self._expire(now)
            for req_id in so.preempted_req_ids or ():
                xfer_id = self._p_by_req.get(req_id)
                p = self._produced.get(xfer_id) if xfer_id else None
                if p is not None and not p.aborted:
                    # its blocks are gone: the transfer cannot finish; D recomputes
                    self.counters["preempted_transfers"] += 1
                    p.aborted = True
                    if p.issued:
                        meta.preempted_xfers.append(p.xfer_id)
                    elif p.reply is not None:
                        p.reply.resolve(
                            TransferKVReply(
                                xfer_id=p.xfer_id, code=Code.GONE, message="request preempted on P"
                            )
                        )
                    self._tombstone(p.xfer_id)
            for p in list(self._produced.values()):
                n = scheduled.get(p.req_id)
                if n is not None:
                    p.block_ids = tuple(self.shared.kv_cache_manager.get_block_ids(p.req_id)[0])
                    request = self._requests.get(p.req_id)
                    p.computed = request.num_computed_tokens if request else p.computed
                    p.in_flight_end = min(p.computed + n, p.prompt_len)
                    p.scheduled_step = self.shared.step_id
                    meta.computes_prompt |= p.computed < p.prompt_len
                    if p.computed < p.prompt_len - 1 <= p.in_flight_end:
                        p.last_chunk_step = self.shared.step_id
                        self.shared.timeline.event(p.xfer_id, "last_chunk_begin", now)
                full, step = p.next_tasks(self.block_size, scheduled=n is not None)
                if full is not None:
                    meta.full_tasks.append(full)
                if step is not None:
                    meta.step_tasks.append(step)
            pending = self.shared.take_pending()
            bypass_seq = self.shared.bypass.sent if self.shared.bypass is not None else 0
            self.shared.begin_step(now, so.total_num_scheduled_tokens)
        pending.fill(meta)
        meta.bypass_seq = bypass_seq
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if is_discovery(request.kv_transfer_params):
            # a router asks where our control plane listens (the answer goes out
            # in the response's kv_transfer_params)
            return False, self.identity()
        self._requests.pop(req_id, None)
        with self._lock:
            self.consumer.request_finished(req_id)
            xfer_id = self._p_by_req.pop(req_id, None)
            if xfer_id is None:
                return False, None
            p = self._produced[xfer_id]
            self.shared.timeline.event(xfer_id, "finished")
            p.finished = True
            p.finished_at = time.monotonic()
            p.computed = min(request.num_computed_tokens, p.prompt_len)
            p.block_ids = tuple(block_ids) or p.block_ids
            if request.status.name == "FINISHED_ABORTED":
                self._abort_produced(p, "request aborted on P")
            self._maybe_release(p)
        # who computed it: a router that knew another control address re-learns it
        return True, self.identity()

    def identity(self) -> dict[str, Any]:
        """What a router learns from our answers (`kv_transfer_params`): where
        our control plane listens, who we are, our block size."""
        return {
            "rapidkv": {
                "control": self.server.address,
                "instance_id": self.instance_id,
                "incarnation": self.incarnation,
                "block_size": self.block_size,
            }
        }

    def update_output(
        self,
        meta: WorkerMeta | None,
        finished_recving: set[str] | None,
        finished_sending: set[str] | None = None,
    ) -> None:
        with self._lock:
            self._freeing.difference_update(finished_sending or ())
            self._step_done()
            for step_id, ack, rank in meta.acks if meta is not None else ():
                try:
                    resolution = self._journal.ack(step_id, rank, ack)
                except JournalError:
                    log.exception("rapidkv %s: bad ack from rank %d", self.instance_id, rank)
                    continue
                if resolution is not None:
                    self._resolve(resolution)
            self.consumer.kv_received(finished_recving or set())
            if meta is not None:
                self.counters.update(meta.counters)
                for instance_id, generation in meta.broken_peers:
                    known = self._peers.get(instance_id)
                    if known is not None and known.generation == generation:
                        self._forget_peer(instance_id, "writes to it failed")
            for s in meta.settled if meta is not None else ():
                p = self._produced.get(s.xfer_id)
                if p is None:
                    continue
                p.settled_ranks[s.rank] = (s.ok, s.tokens_sent, s.error)
                if len(p.settled_ranks) == self.tp_size:
                    self._settle(p)

    def pending_block_frees(self) -> bool:
        """Finished P requests still hold blocks that will be freed without
        preempting anyone (their transfer settles, or they were released and vLLM
        frees them at the next step): vLLM then waits a step instead of preempting
        a running request."""
        with self._lock:
            pending = bool(self._freeing) or any(
                p.finished and not p.released for p in self._produced.values()
            )
            if pending:
                self.counters["pending_block_frees_waits"] += 1
            return pending

    # -- internals (caller holds the lock) ---------------------------------------

    def _accept(self, p: Produced, msg: TransferKV, reply: Reply) -> None:
        if msg.prompt_hash != p.prompt_hash:
            self.counters["prompt_mismatch"] += 1
            reply.resolve(
                TransferKVReply(
                    xfer_id=msg.xfer_id,
                    code=Code.ERROR,
                    message="prompt token ids differ between P and D",
                )
            )
            # nothing of it will ever be asked for: free it once it finishes
            self._abort_produced(p, "prompt token ids differ between P and D")
            self._maybe_release(p)
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
        p.accept(window, reply, self.block_size, mode)
        self.shared.timeline.event(p.xfer_id, "accepted")
        if mode != "step":
            self._send_now(p, substep=mode == "substep")

    def _send_now(self, p: Produced, substep: bool) -> None:
        """bypass / substep: act on a TransferKV the moment it is accepted.

        A finished request's KV is complete (its blocks are held for the
        transfer): send it all now over the bypass channel. With `substep`, a
        request whose last chunk the step in flight computes gets that step's
        part attached to the step (what earlier steps computed goes now). Anything
        else waits for the next step, as in `step` mode."""
        if self.shared.bypass is None or p.aborted or p.window is None:
            return
        if p.finished:
            full, _ = p.next_tasks(self.block_size, scheduled=False)
            if full is not None:
                self.shared.bypass.send(BypassMsg(kind="full", tasks=[full]))
                self.counters["bypass_full_sends"] += 1
                self.shared.timeline.event(p.xfer_id, "bypass_sent")
            return
        step_id = self.shared.step_in_flight
        in_flight = step_id is not None and p.scheduled_step == step_id
        if not substep or not in_flight or p.in_flight_end < p.window.num_tokens:
            return
        issued_before = p.issued
        full, step = p.next_tasks(self.block_size, scheduled=True)
        if full is not None:
            self.shared.bypass.send(BypassMsg(kind="full", tasks=[full]))
            self.counters["bypass_full_sends"] += 1
        if step is None:
            return
        assert step_id is not None
        undo = (step.seen_tokens, issued_before or full is not None, False)
        substep_id = self._journal.open_substep(step_id, [Entry(p.xfer_id, (step,), undo)])
        self.shared.bypass.send(
            BypassMsg(kind="substep", tasks=[step], step_id=step_id, substep_id=substep_id)
        )
        self.counters["substeps_opened"] += 1
        self.shared.timeline.event(p.xfer_id, "substep_sent")

    def _step_done(self) -> None:
        """The step in flight returned: what it computed is final."""
        ended = self.shared.end_step()
        if ended is None:
            return
        step_id, now = ended
        for p in self._produced.values():
            if p.last_chunk_step == step_id:
                self.shared.timeline.event(p.xfer_id, "last_chunk_end", now)
            if p.scheduled_step == step_id:
                p.scheduled_step = None
                p.computed = max(p.computed, p.in_flight_end)

    def _resolve(self, r: Resolution[Undo]) -> None:
        """Every rank acked a step with substeps: roll back what no rank sent (the
        next step sends it), have the ranks that missed a substep send it alone."""
        self.counters["substeps_accepted"] += len(r.accepted)
        for entry in r.rolled_back:
            self.counters["substeps_rolled_back"] += 1
            p = self._produced.get(entry.xfer_id)
            if p is not None and p.window is not None:
                p.sent_upto, p.issued, p.last_issued = entry.undo
                self._maybe_release(p)
        for entry, ranks in r.resend:
            self.counters["substeps_resent"] += 1
            for rank in ranks:
                self.shared.pending.rank_full.setdefault(rank, []).extend(entry.tasks)

    def _outstanding(self, dst_instance: str) -> int:
        """Transfers to `dst_instance` accepted and not yet settled, or parked."""
        live = sum(
            1
            for p in self._produced.values()
            if p.window is not None and p.window.peer == dst_instance
        )
        return live + sum(1 for x in self._parked.values() if x.msg.dst_instance == dst_instance)

    def _settle(self, p: Produced) -> None:
        self.shared.timeline.event(p.xfer_id, "settled")
        oks = [v[0] for v in p.settled_ranks.values()]
        tokens = min(v[1] for v in p.settled_ranks.values())
        ok = all(oks)
        self.counters["transfers_ok" if ok else "transfers_failed"] += 1
        if ok and p.accepted_at:
            # TransferKV taken up -> every rank confirmed: the hand-off as D sees it
            self.counters["transfer_ms_sum"] += (time.monotonic() - p.accepted_at) * 1000
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
        self._tombstone(p.xfer_id)
        self._maybe_release(p, settled=True)

    def _maybe_release(self, p: Produced, settled: bool = False) -> None:
        """Free a finished request's blocks once nothing can be sent from them:
        its transfer settled on every rank, or it was aborted before any send."""
        if not p.finished or p.released:
            return
        settled = settled or len(p.settled_ranks) == self.tp_size
        if settled or (p.aborted and not p.issued):
            self._release(p)

    def _release(self, p: Produced) -> None:
        p.released = True
        self.shared.pending.release.append(p.req_id)
        self._freeing.add(p.req_id)  # until vLLM frees the blocks (finished_sending)
        self._produced.pop(p.xfer_id, None)

    def _abort_produced(self, p: Produced, why: str) -> None:
        p.aborted = True
        self._tombstone(p.xfer_id)
        if p.issued and len(p.settled_ranks) < self.tp_size:
            self.shared.pending.fail.append((p.xfer_id, why))  # settles with an error
        elif p.reply is not None:
            p.reply.resolve(TransferKVReply(xfer_id=p.xfer_id, code=Code.GONE, message=why))

    def _expire(self, now: float) -> None:
        """Finished requests no TransferKV came for, old tombstones. (Parked
        TransferKVs expire in their RPC handler, which runs even if P never steps.)"""
        for p in list(self._produced.values()):
            if (
                p.finished
                and not p.released
                and p.window is None
                and not p.issued
                and now - p.finished_at > self.config.finished_ttl_s
            ):
                self.counters["finished_expired"] += 1
                self._abort_produced(p, "no TransferKV in time")
                self._release(p)
        while (
            self._tombstones
            and now - next(iter(self._tombstones.values())) > self.config.tombstone_ttl_s
        ):
            self._tombstones.popitem(last=False)

    def _tombstone(self, xfer_id: str) -> None:
        self._tombstones[xfer_id] = time.monotonic()
        self._tombstones.move_to_end(xfer_id)  # oldest first, for _expire

    # -- P side: the control-plane handler (RPC loop thread) ----------------------

    async def _handle(self, msg: Any) -> Any:
        if isinstance(msg, TransferKV):
            return await self._on_transfer_kv(msg)
        if isinstance(msg, Handshake):
            return self._on_handshake(msg)
        if isinstance(msg, Abort):
            return await self._on_abort(msg)
        if isinstance(msg, StatsRequest):
            return Stats(counters=self.stats())
        if isinstance(msg, TimelineRequest):
            return self.timeline(msg.xfer_ids)
        return ErrorReply(code=Code.ERROR, message=f"unexpected {type(msg).__name__}")

    def _on_handshake(self, hs: Handshake) -> HandshakeReply:
        if self.shared.spec is None:
            return HandshakeReply(
                code=Code.BUSY, instance_id=self.instance_id, reasons=["instance still starting"]
            )
        reply = answer_handshake(
            hs,
            instance_id=self.instance_id,
            spec=self.shared.spec,
            endpoints=self.shared.endpoints,
            incarnation=self.incarnation,
        )
        if reply.code != Code.OK:
            log.warning(
                "rapidkv %s: handshake from %s refused: %s",
                self.instance_id,
                hs.instance_id,
                reply.reasons,
            )
            return reply
        with self._lock:
            known = self._peers.get(hs.instance_id)
            if known is not None and known.incarnation == hs.incarnation:
                known.control_address = hs.control_address
                return reply  # the same process again (it dropped its cached handshake)
            if known is not None:
                # same id, new process: its new transport metadata replaces the old
                # in the workers (a newer Peer entry), the old one's transfers fail now
                self._forget_peer(hs.instance_id, "restarted", drop=False)
            if parse_address(hs.control_address)[0] not in WILDCARD_HOSTS:
                for other, info in list(self._peers.items()):
                    if info.control_address == hs.control_address:
                        self._forget_peer(other, f"{hs.instance_id} now at its address")
            self.counters["peers_added"] += 1
            generation = next(self._generations)
            self._peers[hs.instance_id] = _KnownPeer(
                list(hs.endpoints), hs.incarnation, hs.control_address, generation
            )
            peers = [
                Peer(hs.instance_id, e.rank, e.transport_metadata, e.layout, generation)
                for e in hs.endpoints
            ]
            self.shared.pending.new_peers.extend(peers)
            if self.shared.bypass is not None:  # ahead of any bypass send to them
                self.shared.bypass.send(BypassMsg(kind="peers", peers=peers))
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
            self.instance_id,
            instance_id,
            why,
        )
        self.counters["peers_forgotten"] += 1
        for xfer_id, parked in list(self._parked.items()):
            if parked.msg.dst_instance == instance_id:
                del self._parked[xfer_id]
                parked.reply.resolve(
                    TransferKVReply(xfer_id=xfer_id, code=Code.GONE, message=f"peer {why}")
                )
        for p in list(self._produced.values()):
            if p.window is not None and p.window.peer == instance_id and not p.released:
                self.counters["transfers_failed_peer_gone"] += 1
                self._abort_produced(p, f"destination {instance_id} {why}")
                self._maybe_release(p)
        if drop:
            self.shared.pending.drop_peers.append((instance_id, known.generation))

    async def _on_transfer_kv(self, msg: TransferKV) -> TransferKVReply:
        loop = asyncio.get_running_loop()
        reply = Reply(loop, loop.create_future())
        with self._lock:
            dst = self._peers.get(msg.dst_instance)
            if not self.shared.endpoints:
                problems = ["instance still starting"]
            elif dst is None:
                self.counters["unknown_peer_replies"] += 1
                return TransferKVReply(
                    xfer_id=msg.xfer_id,
                    code=Code.UNKNOWN_PEER,
                    message=f"no handshake from {msg.dst_instance}",
                )
            else:  # the destination's block ids, checked against its own pool
                problems = msg.problems(self.block_size, min(e.num_blocks for e in dst.endpoints))
            if problems:
                return TransferKVReply(
                    xfer_id=msg.xfer_id, code=Code.ERROR, message="; ".join(problems)
                )
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
                self.counters["duplicate_transfer_kv"] += 1
                reply = earlier
            else:
                refused = self._take_up(msg, p, reply)
                if refused is not None:
                    return refused
        try:  # parked: NOT_FOUND once the park TTL passes, even if P never steps
            return await asyncio.wait_for(asyncio.shield(reply.future), self.config.park_ttl_s)
        except TimeoutError:
            with self._lock:
                if self._parked.pop(msg.xfer_id, None) is not None:
                    self.counters["park_expired"] += 1
                    if not reply.future.done():  # for a duplicate waiting on it too
                        reply.future.set_result(
                            TransferKVReply(
                                xfer_id=msg.xfer_id,
                                code=Code.NOT_FOUND,
                                message="request not seen on P",
                            )
                        )
        return await reply.future

    def _take_up(self, msg: TransferKV, p: Produced | None, reply: Reply) -> TransferKVReply | None:
        """Accept `msg` for its request, or park it until the request arrives; the
        refusal if neither may be done now (caller holds the lock)."""
        self._arrived(msg, p)
        new = p is None or p.window is None
        if new and self._outstanding(msg.dst_instance) >= self.config.max_transfers_per_peer:
            self.counters["busy_replies"] += 1
            return TransferKVReply(
                xfer_id=msg.xfer_id,
                code=Code.BUSY,
                message=f"{self.config.max_transfers_per_peer} transfers to "
                f"{msg.dst_instance} outstanding",
            )
        if p is not None:
            self._accept(p, msg, reply)
        elif len(self._parked) >= self.config.max_parked:
            return TransferKVReply(
                xfer_id=msg.xfer_id, code=Code.BUSY, message="too many parked transfers"
            )
        else:
            self.counters["parked"] += 1
            self._parked[msg.xfer_id] = _Parked(msg, reply)
        return None

    async def _on_abort(self, msg: Abort) -> AbortReply:
        """Stop the transfer; answer once no more of its writes can land (its
        sends in flight settled), or BUSY if that is not confirmed within
        `write_timeout_s` (the sender keeps its blocks and asks again)."""
        in_flight: asyncio.Future | None = None
        with self._lock:
            self.counters[f"aborts_{msg.reason.value}"] += 1
            parked = self._parked.pop(msg.xfer_id, None)
            if parked is not None:
                parked.reply.resolve(
                    TransferKVReply(xfer_id=msg.xfer_id, code=Code.GONE, message="aborted")
                )
            p = self._produced.get(msg.xfer_id)
            if p is not None and not p.released:
                if p.issued and len(p.settled_ranks) < self.tp_size and p.reply is not None:
                    in_flight = p.reply.future  # resolved when every rank settled
                self._abort_produced(p, f"aborted by peer: {msg.reason.value}")
                self._maybe_release(p)
            self._tombstone(msg.xfer_id)
        if in_flight is not None:
            try:
                await asyncio.wait_for(asyncio.shield(in_flight), self.config.write_timeout_s)
            except TimeoutError:
                with self._lock:
                    self.counters["aborts_unconfirmed"] += 1
                return AbortReply(
                    xfer_id=msg.xfer_id, code=Code.BUSY, message="writes of it may still land"
                )
        return AbortReply(xfer_id=msg.xfer_id, code=Code.OK)

    # -- observability ------------------------------------------------------------

    def _arrived(self, msg: TransferKV, p: Produced | None) -> None:
        """Note a TransferKV's arrival and where its request was then."""
        self.shared.timeline.event(msg.xfer_id, "transfer_kv")
        if p is None:
            state = "not_admitted"
        elif p.finished or p.computed >= msg.num_tokens:
            state = "finished"
        elif (
            self.shared.step_in_flight is not None
            and p.scheduled_step == self.shared.step_in_flight
        ):
            state = "last_chunk" if p.in_flight_end >= msg.num_tokens else "earlier_chunk"
        else:
            state = "between_steps"
        self.shared.timeline.arrival(msg.xfer_id, state, self._mode(msg))

    def _mode(self, msg: TransferKV) -> str:
        """The `transfer_kv_mode` P serves `msg` in: the request's, else P's.
        A split prefill's head always goes layer by layer as computed (D's
        forward waits for each layer; in step/bypass mode it would wait for the
        whole head when the TransferKV came after P's step began)."""
        if msg.notify_layers:
            return "substep"
        return msg.transfer_kv_mode or self.config.transfer_kv_mode

    def timeline(self, xfer_ids: list[str]) -> Timeline:
        """Events of these transfers (P's, and on a D `d_admitted`,
        `d_transfer_kv_sent`, `d_kv_received`) and the recent steps."""
        with self._lock:
            return self.shared.timeline.snapshot(xfer_ids)

    def counter_totals(self) -> dict[str, float]:
        """Every counter's running total: this side's (the workers' increments
        included) and the control-plane server's, prefixed `rpc_`. Totals never
        decrease; a counter appears once first incremented (the server's are
        always there)."""
        with self._lock:
            out = {k: float(v) for k, v in self.counters.items()}
        out.update({f"rpc_{k}": float(v) for k, v in self.server.counters().items()})
        return out

    def gauges(self) -> dict[str, float]:
        """Current levels: parked TransferKVs, live transfers, tombstones, D
        requests waiting for KV, blocks of finished P requests held for their
        transfer, peers (D instances that handshook with us; P instances we
        handshook with, by state) and vLLM's free blocks (once bound)."""
        with self._lock:
            held = [p for p in self._produced.values() if p.finished and not p.released]
            out = {
                "parked_now": float(len(self._parked)),
                "transfers_live": float(len(self._produced)),
                "tombstones": float(len(self._tombstones)),
                "held_requests": float(len(held)),
                "held_blocks": float(sum(len(p.block_ids) for p in held)),
                "peers_decode": float(len(self._peers)),
                **self.consumer.gauges(),
            }
        if self.shared.kv_cache_manager is not None:
            out["free_blocks"] = float(
                self.shared.kv_cache_manager.block_pool.get_num_free_blocks()
            )
        return out

    def stats(self) -> dict[str, float]:
        """What `StatsRequest` answers: `counter_totals()` and `gauges()` (no
        name is in both)."""
        return {**self.counter_totals(), **self.gauges()}

    def close(self) -> None:
        self.server.stop()
        self.consumer.close()
        if self.shared.bypass is not None:
            self.shared.bypass.close()


def model_fingerprint(model_config: Any) -> str:
    """Hash of what shapes the KV and the tokens: layers, KV heads, head size,
    dtype, vocabulary size."""
    hf = model_config.hf_config
    parts = [
        getattr(hf, "num_hidden_layers", None),
        getattr(hf, "num_key_value_heads", None),
        model_config.get_head_size(),
        str(model_config.dtype),
        getattr(hf, "vocab_size", None),
    ]
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()
