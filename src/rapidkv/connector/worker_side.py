"""The worker side of the connector: kvt driven by vLLM's per-step hooks.

Called on the worker's main thread, per step (docs/vllm-connector-contract.md
§2): `bind` (begin the step, start full sends, connect peers) -> per layer
`layer_saved` -> `step_done` (freeze: the ack) -> `finished` -> `worker_meta`.
Each step's timing (its forward from `bind` to `step_done`, the split layer
waits within it, the time in these hooks) goes to the scheduler side with the
worker metadata (`WorkerMeta.timings`), which records it in the step's
`StepTiming`.

Reporting rules (vLLM kills the engine otherwise):
- `finished_sending` holds a request only after the scheduler side released it
  (its free was delayed and its transfer settled or was given up) *and* the
  request id was handed to us in `finished_req_ids`;
- `finished_recving` holds a D request once, when its transfer's SendDone
  arrived (ok or not) or the scheduler side said it failed; failed ones are also
  in `failed_recving`.

Split prefills (D computes a prompt's tail while P computes its head, see
`SplitLoad`): before each layer's attention (`wait_layer`) the forward waits
until P said that layer of the head is in place (kvt `LayersLanded`, or the
SendDone), or until the load is over without it (a failed SendDone, or the
scheduler side's `recv_over` after P answered: no more writes can land). The
head's blocks of a load that did not complete are reported invalid
(`load_errors`): vLLM then recomputes them. Such requests never appear in
`finished_recving` (vLLM loads them synchronously).

Tensor parallelism: each layer's layout says which KV heads the rank holds
(`kvt.layout.Heads`, where the tensor's shape tells: `kvt.head_map.
find_head_dim`), so a destination of another TP size can be paired. A rank
connects to the ranks of a destination it sends KV heads to (`kvt.head_map.
route`: the same rank at equal TP; P at TP 1 -> D at TP 2: both) and sends each
task to every one of them (`_mine`). On D, kvt hands on a transfer once every
source rank that writes this rank sent its SendDone (`kvt.gather`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
import torch

from rapidkv.connector.bypass import BypassMsg, BypassReceiver, Peer
from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.metadata import RankInfo, StepMeta, WorkerMeta, peer_name
from rapidkv.connector.rank_links import ModelHeads, RankLinks, describe_heads
from rapidkv.kvt.coordinator import CoordinatorError
from rapidkv.kvt.device_ready import kv_memory, layer_ready_for
from rapidkv.kvt.head_map import route
from rapidkv.kvt.layout import Layout, layer_layout_from_tensor
from rapidkv.kvt.messages import SendDone
from rapidkv.kvt.task import Task
from rapidkv.kvt.transport import create_transport
from rapidkv.kvt.worker import KvtWorker

log = logging.getLogger(__name__)

KVT_COUNTERS = {
    "injected_failures": "debug_injected_failures",
    "late_tasks_dropped": "late_tasks_dropped",
}
"""kvt's own counters (`KvtStats` fields) reported as the connector's."""

SPLIT_POLL_S = 0.0002  # a waiting forward asks the kvt owner for notifications this often
SPLIT_MEMORY = 1024  # finished split loads whose late SendDones are dropped


@dataclass
class SplitLoad:
    """A split prefill's head, loaded while this step computes the tail."""

    blocks: list[int]  # what P writes: invalid unless every layer landed
    deadline: float  # perf_counter(): stop waiting, whatever P says
    ok: bool | None = None  # None: layers still arriving


class WorkerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        instance_id: str,
        rank: int,
        block_size: int,
        heads: ModelHeads | None = None,
    ):
        self.config = config
        self.instance_id = instance_id
        self.rank = rank
        self.block_size = block_size
        self.heads = heads
        self.kvt: KvtWorker | None = None
        self.bypass: BypassReceiver | None = None
        self._links = RankLinks()  # destination ranks connected (under _peers_lock)
        self._peers_lock = threading.Lock()
        self.info: RankInfo | None = None
        self.layer_index: dict[str, int] = {}
        self.step_id = -1
        self._lock = threading.Lock()  # guards what the kvt owner thread hands us
        self._settled: list[SendDone] = []
        self._acks: list[tuple[int, int, int]] = []
        self._release: set[str] = set()  # released by the scheduler side
        self._finished: set[str] = set()  # seen in finished_req_ids
        self._expect: dict[str, str] = {}  # xfer_id -> D request id
        self._received: dict[str, SendDone] = {}  # arrived, not yet mapped
        self._failed_now: set[str] = set()  # D requests the scheduler said failed
        self._splits: dict[str, SplitLoad] = {}  # this step's split loads
        self._split_over: dict[str, bool] = {}  # xfer_id -> ok, from the scheduler side
        self._split_done: OrderedDict[str, None] = OrderedDict()  # drop their SendDones
        self._load_errors: set[int] = set()
        self._counters: Counter[str] = Counter()
        # destinations whose writes failed (-> the generation then), not yet reported
        self._broken: dict[str, int] = {}
        # layer-by-layer evidence: when this step began, had step tasks, and when
        # its first per-layer write was handed to the transport
        self._step_began = 0.0
        self._step_has_tasks = False
        self._first_layer_post: float | None = None
        self._last_layer_done = 0.0
        self._delays_layers = False
        # kvt's counters already in _counters: KvtStats field -> what was counted
        self._kvt_counted = dict.fromkeys(KVT_COUNTERS, 0)
        # this step's timing (engine thread): bound at, its layer waits and hooks
        self._bound_at = 0.0
        self._layer_wait_s = 0.0
        self._hooks_s = 0.0
        self._forward_s = 0.0
        self._timings: list[tuple[int, float, float, float]] = []

    # -- start-up ---------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Describe and register the KV caches (one tensor per attention layer):
        host memory as DRAM, CUDA tensors as VRAM whose layers leave once the
        GPU wrote them (`kvt.device_ready`). Raises `ValueError` for caches of
        mixed kinds or devices, or VRAM over a transport that moves host
        memory only (tcp)."""
        caches = list(kv_caches.values())
        memory = kv_memory(self.config.transport, caches)
        ready = layer_ready_for(caches[0], len(caches))
        layouts = []
        for i, (name, kv) in enumerate(kv_caches.items()):
            self.layer_index[name] = i
            block_dim = 0 if kv.shape[0] % num_blocks == 0 else 1
            k = kv.shape[block_dim] // num_blocks
            layer = layer_layout_from_tensor(
                kv.data_ptr(), kv.shape, kv.stride(), kv.element_size(), block_dim, k
            )
            if self.heads is not None:
                layer, why = describe_heads(
                    layer,
                    tuple(kv.shape),
                    kv.element_size(),
                    block_dim,
                    k,
                    self.heads,
                    self.rank,
                    self.block_size,
                )
                if why and not i:
                    log.warning(
                        "rapidkv worker rank %d: KV heads not described (%s); only "
                        "instances of the same TP size can pair with this one",
                        self.rank,
                        why,
                    )
            layouts.append(layer)
        layout = Layout(tuple(layouts), num_blocks)
        first = caches[0]
        self.kvt = KvtWorker(
            create_transport(
                self.config.transport,
                peer_name(self.instance_id, self.rank),
                **self.config.transport_options(),
                **memory.options,
            ),
            layout,
            rank=self.rank,
            block_size=self.block_size,
            on_send_done=self._on_send_done,
            on_posted=self._on_posted,
            on_peer_failed=self._on_peer_failed,
            write_timeout_s=self.config.write_timeout_s,
            hugepages=self.config.hugepages and memory.host,
            bandwidth_cap_bps=self.config.bandwidth_cap_gbps * 1e9,
            faults=self.config.send_faults(self.rank),
            ready=ready,
        )
        self.bypass = BypassReceiver(self.rank, self._on_bypass, self.config.debug_bypass_delay_s)
        self.info = RankInfo(
            rank=self.rank,
            bypass_address=self.bypass.address,
            transport=self.config.transport,
            transport_metadata=self.kvt.metadata,
            layout=msgspec.msgpack.encode(layout),
            num_blocks=num_blocks,
            block_bytes=tuple(x.run_bytes * len(x.run_offsets) for x in layout.layers),
            runs_per_block=tuple(len(x.run_offsets) for x in layout.layers),
            dtype=str(first.dtype).removeprefix("torch."),
            kernel_blocks_per_block=first.shape[0] // num_blocks if num_blocks else 1,
        )
        log.info(
            "rapidkv worker rank %d: %d layers, %d blocks of %d bytes registered (%s, %s)",
            self.rank,
            len(layouts),
            num_blocks,
            layout.block_bytes,
            self.config.transport,
            memory,
        )

    # -- per step ---------------------------------------------------------------

    def preempted(self, meta: StepMeta) -> None:
        """vLLM freed these requests' blocks this step (P's, or a migration
        source's) and may overwrite them in this step's forward: stop their
        transfers and wait until no write from those blocks is in flight. The
        bypass messages sent before the step was built are applied first: a
        full send the scheduler side planned from those blocks just before vLLM
        freed them is then in kvt, and is failed and waited for too."""
        if not meta.preempted_xfers:
            return
        kvt = self._require_kvt()
        if self.bypass is not None and not self.bypass.wait_applied(
            meta.bypass_seq, self.config.write_timeout_s
        ):
            log.error(
                "rapidkv worker rank %d: bypass channel behind step %d at a preemption",
                self.rank,
                meta.step_id,
            )
        for xfer_id in meta.preempted_xfers:
            kvt.fail(xfer_id, "request preempted on P")
        if not kvt.wait_settled(meta.preempted_xfers, self.config.write_timeout_s + 1):
            log.error("rapidkv: sends of preempted %s still in flight", meta.preempted_xfers)

    def bind(self, meta: StepMeta) -> None:
        t0 = time.perf_counter()
        self._layer_wait_s = self._hooks_s = self._forward_s = 0.0
        kvt = self._require_kvt()
        if self.bypass is not None and not self.bypass.wait_applied(
            meta.bypass_seq, self.config.write_timeout_s
        ):
            log.error(
                "rapidkv worker rank %d: bypass channel behind step %d; its sends may "
                "reach the destination out of order",
                self.rank,
                meta.step_id,
            )
        for peer in meta.new_peers:
            self._add_peer(peer)
        for instance_id, generation in meta.drop_peers:
            self._drop_peer(instance_id, generation)
        for xfer_id, reason in meta.fail_xfers:
            kvt.fail(xfer_id, reason)
        self._release.update(meta.release)
        self._expect.update(meta.expect_recv)
        for req_id in meta.recv_failed:
            self._fail_recv(req_id)
        if meta.split_recv:
            wait_s = self.config.rpc_timeout_s + self.config.write_timeout_s
            deadline = time.perf_counter() + wait_s
            for xfer_id, blocks in meta.split_recv.items():
                self._splits[xfer_id] = SplitLoad(blocks, deadline)
        kvt.set_awaiting(bool(self._expect or self._splits))
        self.step_id = meta.step_id
        self._delays_layers = meta.delays_layers
        with self._lock:
            self._step_began = time.perf_counter()
            self._step_has_tasks = bool(meta.step_tasks)
            self._first_layer_post = None
        kvt.begin_step(meta.step_id, self._mine(meta.step_tasks))
        full = meta.full_tasks + meta.rank_full_tasks.get(self.rank, [])
        if full:
            kvt.send_full(self._mine(full))
        self._bound_at = time.perf_counter()
        self._hooks_s += self._bound_at - t0

    def wait_layer(self, layer_name: str) -> None:
        """Before a layer's attention: wait until that layer of every split
        load's head is in place, or the load is over without it."""
        if not self._splits:
            return
        t0 = time.perf_counter()
        try:
            self._wait_layer(self.layer_index[layer_name] + 1)
        finally:
            self._layer_wait_s += time.perf_counter() - t0

    def _wait_layer(self, need: int) -> None:
        kvt = self._require_kvt()
        waiting = [x for x, s in self._splits.items() if s.ok is None]
        while waiting:
            self._collect(kvt.poll_received())
            with self._lock:
                over = dict(self._split_over)
            now = time.perf_counter()
            still = []
            for xfer_id in waiting:
                load = self._splits[xfer_id]
                done = self._received.get(xfer_id)
                if done is not None or xfer_id in over:
                    load.ok = done.ok if done is not None else over[xfer_id]
                    if not load.ok:
                        log.warning(
                            "rapidkv worker rank %d: split prefill %s: head not loaded (%s); "
                            "its %d blocks are recomputed",
                            self.rank,
                            xfer_id,
                            done.error if done is not None else "TransferKV failed",
                            len(load.blocks),
                        )
                elif kvt.landed(xfer_id) < need:
                    if now < load.deadline:
                        still.append(xfer_id)
                        continue
                    log.error(
                        "rapidkv worker rank %d: split prefill %s: layer %d of the head "
                        "did not arrive in time; its blocks are recomputed",
                        self.rank,
                        xfer_id,
                        need - 1,
                    )
                    load.ok = False
            waiting = still
            if waiting:
                time.sleep(SPLIT_POLL_S)

    def load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _end_splits(self) -> None:
        """The step's forward is over: settle its split loads."""
        kvt = self._require_kvt()
        if any(load.ok is None for load in self._splits.values()):
            # the forward ran no attention layer for them: complete only if settled
            self._collect(kvt.poll_received())
        with self._lock:
            for xfer_id, load in self._splits.items():
                if load.ok is None:
                    done = self._received.get(xfer_id)
                    load.ok = done is not None and done.ok
                if not load.ok:
                    self._load_errors.update(load.blocks)
                self._counters["split_loads_ok" if load.ok else "split_loads_failed"] += 1
                self._received.pop(xfer_id, None)
                self._split_over.pop(xfer_id, None)
                self._split_done[xfer_id] = None
            while len(self._split_done) > SPLIT_MEMORY:
                self._split_done.popitem(last=False)
        kvt.forget_landed(list(self._splits))
        self._splits = {}

    def layer_saved(self, layer_name: str) -> None:
        t0 = time.perf_counter()
        self._require_kvt().layer_done(self.layer_index[layer_name])
        self._last_layer_done = now = time.perf_counter()
        self._hooks_s += now - t0
        if self.config.debug_layer_delay_s and self._delays_layers:
            time.sleep(self.config.debug_layer_delay_s)

    def step_done(self) -> None:
        t0 = time.perf_counter()
        if self._bound_at:
            self._forward_s = t0 - self._bound_at
            self._bound_at = 0.0
        ack = self._require_kvt().freeze_step()
        with self._lock:
            self._acks.append((self.step_id, ack, self.rank))
            if self._step_has_tasks:
                self._counters["steps_with_layer_sends"] += 1
                first = self._first_layer_post
                if first is not None and first < self._last_layer_done:
                    # the step's first layer left before its last layer was computed
                    self._counters["steps_sent_before_last_layer"] += 1
        self._hooks_s += time.perf_counter() - t0

    def finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str], set[str]]:
        """`(finished_sending, finished_recving, failed_recving)` for this step."""
        t0 = time.perf_counter()
        try:
            return self._finished_now(finished_req_ids)
        finally:
            self._hooks_s += time.perf_counter() - t0
            self._timings.append((self.step_id, self._forward_s, self._layer_wait_s, self._hooks_s))

    def _finished_now(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str], set[str]]:
        if self._splits:  # the forward is over (vLLM asks for load errors next)
            self._end_splits()
        self._finished.update(finished_req_ids)
        sending = self._release & self._finished
        self._release -= sending
        self._finished -= sending
        recving: set[str] = set()
        failed: set[str] = set()
        kvt = self._require_kvt()
        # SendDones matter only here, once a step: asked for while some are awaited
        self._collect(kvt.poll_received() if self._expect else kvt.take_received())
        for xfer_id in [x for x in self._received if x in self._expect]:
            done = self._received.pop(xfer_id)
            req_id = self._expect.pop(xfer_id)
            recving.add(req_id)
            if not done.ok:
                log.warning("rapidkv: transfer %s failed at source: %s", xfer_id, done.error)
                failed.add(req_id)
        kvt.set_awaiting(bool(self._expect))
        with self._lock:
            recving |= self._failed_now
            failed |= self._failed_now
            self._failed_now = set()
        return sending, recving, failed

    def worker_meta(self) -> WorkerMeta:
        if self.kvt is not None:
            for field, name in KVT_COUNTERS.items():
                n = getattr(self.kvt.stats, field)  # written by kvt's threads
                if n > self._kvt_counted[field]:
                    self._count(name, n - self._kvt_counted[field])
                    self._kvt_counted[field] = n
        with self._lock:
            meta = WorkerMeta(
                self._acks,
                self._settled,
                dict(self._counters),
                list(self._broken.items()),
                self._timings,
            )
            self._timings = []
            self._acks, self._settled = [], []
            self._counters.clear()
            self._broken.clear()
        return meta

    def close(self) -> None:
        if self.bypass is not None:
            self.bypass.close()
        if self.kvt is not None:
            self.kvt.close()

    # -- bypass channel (its own thread) ------------------------------------------

    def _on_bypass(self, msg: BypassMsg) -> None:
        kvt = self._require_kvt()
        if msg.kind == "recv_over":
            with self._lock:
                if msg.xfer_id not in self._split_done:
                    self._split_over[msg.xfer_id] = msg.ok
            return
        if msg.kind == "peers":
            for peer in msg.peers:
                self._add_peer(peer)
            return
        tasks = self._mine(msg.tasks)
        if msg.kind == "full":
            kvt.send_full(tasks)
            outcome = "bypass_full_received"
        else:
            try:
                outcome = f"substeps_{kvt.attach_substep(msg.step_id, msg.substep_id, tasks).value}"
            except CoordinatorError as e:  # out of order after a lost message: not attached
                log.warning("rapidkv worker rank %d: substep refused: %s", self.rank, e)
                outcome = "substeps_refused"
        with self._lock:
            self._counters[outcome] += 1

    # -- helpers ----------------------------------------------------------------

    def _add_peer(self, peer: Peer) -> None:
        """Connect to `peer` (one rank of a destination instance) if this rank
        sends KV heads to it (`kvt.head_map.route`: at equal TP, our own rank)
        and it is newer than what we have (peers arrive both with the step
        metadata and over the bypass channel, whichever comes first); a newer
        entry for a connected instance (it restarted) replaces the old
        connections, whose writes fail."""
        kvt = self._require_kvt()
        try:
            layout = msgspec.msgpack.decode(peer.layout, type=Layout)
            sends = route(kvt.layout, self.rank, layout, peer.rank).sends
        except Exception:  # its tasks go to our rank of it, an unknown peer: D recomputes
            log.exception(
                "rapidkv worker rank %d: bad layout of peer %s", self.rank, peer.instance_id
            )
            return
        with self._peers_lock:
            offer = self._links.offer(peer.instance_id, peer.generation, peer.rank, sends)
            if offer is None:
                return
            for rank in offer.remove:
                kvt.remove_peer(peer_name(peer.instance_id, rank))
            if offer.remove:
                self._count("peers_replaced")
            if not offer.add:
                return
            try:
                kvt.add_peer(peer.transport_metadata, layout, peer.rank)
            except Exception:  # its writes fail as to an unknown peer; D recomputes
                log.exception(
                    "rapidkv worker rank %d: cannot add peer %s rank %d",
                    self.rank,
                    peer.instance_id,
                    peer.rank,
                )

    def _drop_peer(self, instance_id: str, generation: int) -> None:
        """Forget a destination that is gone, unless a newer entry replaced it."""
        with self._peers_lock:
            ranks = self._links.drop(instance_id, generation)
            if ranks is None:
                return
            for rank in ranks:
                self._require_kvt().remove_peer(peer_name(instance_id, rank))
            self._count("peers_dropped")

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _collect(self, dones: list[SendDone]) -> None:
        """Keep arrived SendDones until acted on, except a finished split load's
        (it was used, or given up on, in its step)."""
        for done in dones:
            with self._lock:
                late = done.xfer_id in self._split_done
            if not late:
                self._received[done.xfer_id] = done

    def _fail_recv(self, req_id: str) -> None:
        xfers = [x for x, r in self._expect.items() if r == req_id]
        if not xfers:
            return  # already reported (its SendDone came first)
        for xfer_id in xfers:
            del self._expect[xfer_id]
        with self._lock:
            self._failed_now.add(req_id)

    def _mine(self, tasks: list[Task]) -> list[Task]:
        """The tasks as this rank sends them: to each rank of the destination it
        sends KV heads to (`_add_peer`; none: it holds no head they need), or,
        for a destination not connected yet, to the same rank (that fails as
        to an unknown peer: D recomputes)."""
        out = []
        for t in tasks:
            ranks = self._links.targets(t.peer)
            for rank in [self.rank] if ranks is None else list(ranks):
                out.append(msgspec.structs.replace(t, peer=peer_name(t.peer, rank)))
        return out

    def _on_posted(self, kind: str, t_event: float, t_post: float, nbytes: int) -> None:
        # kvt owner thread
        with self._lock:
            self._counters["bytes_sent"] += nbytes
            if kind == "layer" and t_event >= self._step_began and self._first_layer_post is None:
                self._first_layer_post = t_post

    def _on_peer_failed(self, peer: str, why: str) -> None:  # kvt owner thread
        """The transport failed a write to `peer`: the scheduler side forgets
        that destination, so its next TransferKV makes it handshake anew (and
        this rank connect again) instead of failing for ever."""
        instance_id = peer.rpartition(".r")[0]
        # not under _peers_lock: the engine thread holds it while it waits for
        # this thread to add or remove a peer (one dict read is atomic)
        generation = self._links.generation(instance_id)
        if generation is None:
            return  # already dropped
        with self._lock:
            if self._broken.get(instance_id) != generation:
                log.warning(
                    "rapidkv worker rank %d: writes to %s fail (%s); it will handshake anew",
                    self.rank,
                    instance_id,
                    why,
                )
            self._broken[instance_id] = generation

    def _on_send_done(self, done: SendDone) -> None:  # kvt owner thread
        with self._lock:
            self._settled.append(done)

    def _require_kvt(self) -> KvtWorker:
        if self.kvt is None:
            raise RuntimeError("rapidkv: KV caches were never registered")
        return self.kvt
