"""Substep acks aggregated over two worker ranks (tensor parallel 2), with the
real connector pieces and real data movement.

What runs for real: P's `SchedulerSide` (in this process: its control-plane
server, its bypass senders, its substep journal), two P worker processes, each
hosting a `WorkerSide` (its `KvtWorker` over NIXL and its `BypassReceiver`) over
a KV cache shaped like vLLM's CPU cache (`two_rank_worker`), and a destination D
with two ranks: two `KvtWorker`s in this process whose NIXL agents are named
`peer_name(D, rank)`, over zeroed memory of the same shape. D introduces itself
with a real `Handshake` and asks for the KV with a real `TransferKV`, both over
the control plane (`RpcClient`).

What is replaced: vLLM's engine. The test drives the hook sequence vLLM drives
(docs/vllm-connector-contract.md §2, §4.4, §6): per step the scheduler side's
`build_connector_meta` (`build_meta`), then on every worker
`handle_preemptions` + `bind_connector_metadata` -> per layer `save_kv_layer` ->
`wait_for_save` -> `get_transfer_results` -> `build_connector_worker_meta`, then
vLLM's aggregation (worker metas merged in worker order with
`WorkerMeta.aggregate`; an id in `finished_sending` forwarded once every worker
reported it), `request_finished` for a request that stopped, and
`update_connector_output` (`update_output`). Where the scheduler side reads vLLM
objects, small stand-ins carry exactly the attributes it reads (`Request`,
`SchedulerOutput`, `KVCacheManager`: `vllm_stand_ins`). Each worker is driven over a pipe, one
hook per command, so the test decides exactly where in a step each rank is
when the TransferKV arrives.

The scenario: a 70-token prompt prefilled in two chunks (48 + 22 tokens); the
transfer covers 69 tokens, 5 blocks (the last one partial). D's TransferKV
(`transfer_kv_mode="substep"`) arrives while step 2 computes the last chunk: the
scheduler side sends blocks 0-2 (KV final) over the bypass channel at once and
opens substep 1 of step 2 for blocks 3-4. A rank that is still inside step 2
attaches it (ack 1); a rank that already froze step 2 rejects it (ack 0). The
journal then resolves step 2 from both acks: accepted everywhere -> done;
rejected everywhere -> rolled back, step 3's `full_tasks` sends it on both
ranks; accepted by one rank only -> resent, step 3's `rank_full_tasks` sends it
on the rank that rejected it, and only there. In every case each D rank ends
with exactly its source rank's bytes, every block written once per rank.

A rank is made late in one of two ways: it freezes step 2 before the TransferKV
is sent (deterministic), or its bypass thread holds each message
(`debug_bypass_delay_s`) while it freezes step 2 after the substep was sent. In
both, the test lets the late rank's bypass thread process both messages (the
bypass full send, then the rejected substep) before step 2's output reaches the
scheduler side. vLLM would not wait for that thread; the case where it has not
caught up yet is `test_a_resend_never_overtakes_the_bypass_full_send` (the step
metadata's `bypass_seq` makes the worker apply the bypass first). One
more test has D's Handshake and first TransferKV arrive within the same P step.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import two_rank_worker
from two_rank_worker import (
    BLOCK_LAYER_BYTES,
    BLOCK_SIZE,
    LAYER_NAMES,
    LAYERS,
    NUM_BLOCKS,
    kv_cache,
    layer_views,
)
from vllm_stand_ins import BlockPool, KVCacheManager, Request, SchedulerOutput, Status

from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.metadata import RankInfo, StepMeta, WorkerMeta, peer_name
from rapidkv.connector.scheduler_side import SchedulerSide
from rapidkv.control.client import RpcClient
from rapidkv.control.codes import Code
from rapidkv.control.messages import (
    Handshake,
    HandshakeReply,
    KVSpec,
    RankEndpoint,
    TransferKV,
    TransferKVReply,
    prompt_hash,
)
from rapidkv.kvt.layout import Layout, layer_layout_from_tensor
from rapidkv.kvt.messages import SendDone
from rapidkv.kvt.task import Task
from rapidkv.kvt.transport import create_transport
from rapidkv.kvt.worker import KvtWorker

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

TP = 2
FINGERPRINT = "two-rank-acks"
DEADLINE = 20.0  # seconds any single wait may take before the test fails
START_DEADLINE = 90.0  # a worker process's start (the first one imports vLLM)
BYPASS_DELAY_S = 1.0  # the late rank's bypass thread holds each message this long
HOLD_S = 2.0  # the same, where the test must finish a step before the first message lands

PROMPT_LEN = 70
CHUNKS = (48, 22)  # prefill chunks: step 1, step 2 (the last chunk)
NUM_TOKENS = PROMPT_LEN - 1  # D recomputes the last prompt token
NBLOCKS = -(-NUM_TOKENS // BLOCK_SIZE)  # 5; the last one holds 5 tokens
SRC_BLOCKS = (7, 3, 12, 20, 5)  # P's block table for the request
DST_BLOCKS = (30, 2, 9, 10, 11)  # D's blocks for it
LAST_CHUNK_BLOCK = CHUNKS[0] // BLOCK_SIZE  # blocks from here on: step 2's substep
TRANSFER_BYTES = NBLOCKS * LAYERS * BLOCK_LAYER_BYTES  # what each rank must write

_preloaded = False


def mp_context() -> Any:
    """Worker processes fork from a fork server that imported the worker side
    (vLLM included) once, instead of importing it again in every process."""
    global _preloaded
    ctx = mp.get_context("forkserver")
    if not _preloaded:
        ctx.set_forkserver_preload(["rapidkv.connector.worker_side"])
        _preloaded = True
    return ctx


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.002)


# -- the ranks -------------------------------------------------------------------------------


class PRank:
    """A P worker process (`two_rank_worker.serve`), driven one hook at a time."""

    def __init__(self, ctx: Any, instance_id: str, rank: int, config: dict[str, Any]) -> None:
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=two_rank_worker.serve,
            args=(child, instance_id, rank, config),
            name=f"p-rank{rank}",
            daemon=True,
        )
        self.proc.start()
        child.close()

    def _answer(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"P rank {self.rank} did not answer within {timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"P rank {self.rank} failed:\n{value}")
        return value

    def ready(self) -> RankInfo:
        """What `get_handshake_metadata` returns on this rank."""
        info = self._answer(START_DEADLINE)
        assert isinstance(info, RankInfo) and info.rank == self.rank
        return info

    def call(self, *cmd: Any, timeout: float = DEADLINE) -> Any:
        self.conn.send(cmd)
        return self._answer(timeout)

    def layers(self, layers: Sequence[int]) -> None:
        for i in layers:
            self.call("layer_saved", LAYER_NAMES[i])

    def stats(self) -> dict[str, int]:
        return self.call("stats")

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.call("close", timeout=10)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class DRank:
    """One rank of the destination: a KvtWorker over zeroed KV memory."""

    def __init__(self, instance_id: str, rank: int) -> None:
        self.rank = rank
        self.buf = kv_cache(None)
        layout = Layout(
            tuple(
                layer_layout_from_tensor(v.data_ptr(), v.shape, v.stride(), v.element_size(), 0)
                for v in layer_views(self.buf).values()
            ),
            NUM_BLOCKS,
        )
        self.kvt = KvtWorker(
            create_transport("nixl", peer_name(instance_id, rank)),
            layout,
            rank=rank,
            block_size=BLOCK_SIZE,
            boost=False,
            hugepages=False,
        )
        self.endpoint = RankEndpoint(
            rank=rank,
            transport="nixl",
            transport_metadata=self.kvt.metadata,
            layout=msgspec.msgpack.encode(layout),
            num_blocks=NUM_BLOCKS,
        )
        self.received: list[SendDone] = []

    def wait_received(self, n: int) -> list[SendDone]:
        deadline = time.monotonic() + DEADLINE
        while True:
            self.received.extend(self.kvt.take_received())
            if len(self.received) >= n or time.monotonic() > deadline:
                return self.received
            self.kvt.wait_received(0.05)


# -- vLLM's engine, as far as the connector sees it --------------------------------------------


class Engine:
    """Schedules, runs worker hooks, aggregates outputs, like vLLM's EngineCore
    with the `mp` executor at TP=2 (no async scheduling on CPU: one step at a time)."""

    def __init__(self, sched: SchedulerSide, ranks: list[PRank], kv: KVCacheManager) -> None:
        self.sched = sched
        self.ranks = ranks
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()  # this step's SchedulerOutput.finished_req_ids
        self._finished_since: set[str] = set()  # finished since the last schedule()
        self._sending_counts: Counter[str] = Counter()  # KVOutputAggregator's countdown
        self.freed: set[str] = set()  # finished_sending forwarded to the scheduler
        self.settled: dict[int, list[SendDone]] = {r.rank: [] for r in ranks}
        self.metas: list[StepMeta] = []

    def admit(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.sched.on_new_request(request)

    def schedule(self, scheduled: dict[str, int]) -> StepMeta:
        for req_id, n in scheduled.items():  # allocate_slots: blocks for this step's tokens
            req = self.requests[req_id]
            self.kv.blocks[req_id] = list(
                SRC_BLOCKS[: -(-(req.num_computed_tokens + n) // BLOCK_SIZE)]
            )
        meta = self.sched.build_meta(
            SchedulerOutput(dict(scheduled), set(), sum(scheduled.values()))
        )
        for req_id, n in scheduled.items():  # _update_after_schedule
            self.requests[req_id].num_computed_tokens += n
        self.finished_req_ids, self._finished_since = self._finished_since, set()
        self.metas.append(meta)
        return meta

    def bind(self, meta: StepMeta) -> None:
        for r in self.ranks:
            r.call("bind", meta)

    def output(self, stopped: Sequence[Request] = ()) -> WorkerMeta:
        """The end of a step: every worker's `get_transfer_results` and
        `build_connector_worker_meta`, vLLM's aggregation, `request_finished`
        for requests that stopped, `update_connector_output`."""
        metas: list[WorkerMeta] = []
        for r in self.ranks:
            sending, recving, failed = r.call("finished", set(self.finished_req_ids))
            assert not recving and not failed  # P only
            self._sending_counts.update(sending)
            meta = r.call("worker_meta")
            assert isinstance(meta, WorkerMeta)
            self.settled[r.rank].extend(meta.settled)
            metas.append(meta)
        merged: WorkerMeta = metas[0]
        for meta in metas[1:]:
            merged = merged.aggregate(meta)
        sending = {x for x, n in self._sending_counts.items() if n == len(self.ranks)}
        for x in sending:
            del self._sending_counts[x]
        for req in stopped:  # e.g. max_tokens=1: the prefill step's token ends it
            req.status = Status.FINISHED_LENGTH_CAPPED
            delay_free, _ = self.sched.request_finished(req, self.kv.blocks[req.request_id])
            assert delay_free  # P holds the blocks until the transfer settled
            self._finished_since.add(req.request_id)
        self.sched.update_output(merged, None, sending or None)
        self.freed |= sending
        return merged

    def step(self, scheduled: dict[str, int] | None = None) -> tuple[StepMeta, WorkerMeta]:
        """A whole step, every rank through every hook."""
        meta = self.schedule(scheduled or {})
        self.bind(meta)
        for r in self.ranks:
            if scheduled:
                r.layers(range(LAYERS))
            r.call("step_done")
        return meta, self.output()


# -- the cluster -----------------------------------------------------------------------------


@dataclass
class Cluster:
    p_id: str
    d_id: str
    sched: SchedulerSide
    ranks: list[PRank]
    d_ranks: list[DRank]
    client: RpcClient
    engine: Engine

    def counter(self, name: str) -> float:
        return self.sched.stats().get(name, 0.0)

    def handshake(self) -> None:
        """D introduces itself (once per P, before its first TransferKV)."""
        reply = self.client.call(
            self.sched.server.address,
            Handshake(
                instance_id=self.d_id,
                control_address="127.0.0.1:9",  # D's control plane: not contacted here
                spec=d_spec(),
                endpoints=[d.endpoint for d in self.d_ranks],
            ),
            DEADLINE,
        )
        assert isinstance(reply, HandshakeReply) and reply.code == Code.OK, reply

    def transfer_kv(self, request: Request) -> Any:
        """D's TransferKV, as its scheduler side sends it (a future of the reply)."""
        return self.client.submit(
            self.sched.server.address,
            TransferKV(
                xfer_id=xfer_of(request),
                dst_instance=self.d_id,
                dst_blocks=list(DST_BLOCKS),
                first_block=0,
                num_tokens=NUM_TOKENS,
                prompt_hash=prompt_hash(request.prompt_token_ids),
                transfer_kv_mode="substep",
            ),
            DEADLINE,
        )


def d_spec() -> KVSpec:
    """D's KVSpec, from its own geometry (it must equal P's for the handshake)."""
    return KVSpec(
        block_size=BLOCK_SIZE,
        kernel_blocks_per_block=1,
        dtype="float32",
        num_layers=LAYERS,
        layer_block_bytes=(BLOCK_LAYER_BYTES,) * LAYERS,
        layer_runs_per_block=(1,) * LAYERS,
        tp_size=TP,
        model_fingerprint=FINGERPRINT,
    )


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    """Builds P (scheduler side + two worker processes) and D (two ranks);
    everything it started is stopped at the end of the test, also on failure."""
    with contextlib.ExitStack() as stack:

        def make(bypass_delay: dict[int, float] | None = None, handshake: bool = True) -> Cluster:
            uid = uuid.uuid4().hex[:8]
            p_id, d_id = f"P-{uid}", f"D-{uid}"
            ctx = mp_context()
            ranks = []
            for r in range(TP):
                config = {
                    "transfer_kv_mode": "substep",
                    "hugepages": False,
                    "debug_bypass_delay_s": (bypass_delay or {}).get(r, 0.0),
                }
                rank = PRank(ctx, p_id, r, config)
                stack.callback(rank.stop)
                ranks.append(rank)
            d_ranks = []
            for r in range(TP):
                d_rank = DRank(d_id, r)
                stack.callback(d_rank.kvt.close)
                d_ranks.append(d_rank)
            sched = SchedulerSide(
                ConnectorConfig(transfer_kv_mode="substep"), p_id, BLOCK_SIZE, TP, FINGERPRINT
            )
            stack.callback(sched.close)
            kv = KVCacheManager(block_pool=BlockPool(NUM_BLOCKS - NBLOCKS))
            sched.kv_cache_manager = kv  # bind_kv_cache_manager
            sched.set_ranks({r.rank: r.ready() for r in ranks})  # set_xfer_handshake_metadata
            client = RpcClient()
            stack.callback(client.close)
            c = Cluster(p_id, d_id, sched, ranks, d_ranks, client, Engine(sched, ranks, kv))
            if handshake:
                c.handshake()
            return c

        yield make


def new_request(name: str) -> Request:
    xfer_id = f"{name}-{uuid.uuid4().hex[:8]}"
    return Request(
        request_id=f"cmpl-{xfer_id}-0-0123abcd",
        kv_transfer_params={"rapidkv": {"xfer_id": xfer_id, "role": "prefill"}},
        num_prompt_tokens=PROMPT_LEN,
        prompt_token_ids=[(7 * i + 3) % 1000 for i in range(PROMPT_LEN)],
    )


def xfer_of(request: Request) -> str:
    return request.kv_transfer_params["rapidkv"]["xfer_id"]


def last_chunk_task(c: Cluster, request: Request) -> Task:
    """Step 2's part of the transfer: blocks 3-4, with the last token."""
    return Task(
        xfer_id=xfer_of(request),
        peer=c.d_id,
        src_blocks=SRC_BLOCKS[LAST_CHUNK_BLOCK:],
        dst_blocks=DST_BLOCKS[LAST_CHUNK_BLOCK:],
        seen_tokens=CHUNKS[0],
        new_tokens=NUM_TOKENS - CHUNKS[0],
        has_last_token=True,
    )


def first_chunk(c: Cluster, request: Request) -> StepMeta:
    """Admit the request and run step 1 (its first chunk) on both ranks."""
    c.engine.admit(request)
    meta1, _ = c.engine.step({request.request_id: CHUNKS[0]})
    assert not (meta1.step_tasks or meta1.full_tasks or meta1.rank_full_tasks)
    return meta1


def begin_last_chunk(c: Cluster, request: Request) -> None:
    """Schedule and bind step 2 (the last chunk). No TransferKV yet: no tasks."""
    meta2 = c.engine.schedule({request.request_id: CHUNKS[1]})
    assert meta2.delays_layers
    assert not (meta2.step_tasks or meta2.full_tasks or meta2.rank_full_tasks)
    c.engine.bind(meta2)


def finish_step(r: PRank, layers: Sequence[int]) -> None:
    r.layers(layers)
    r.call("step_done")  # wait_for_save: the step is frozen, its ack taken


def step_until_answered(c: Cluster, reply: Any) -> TransferKVReply:
    """Run empty steps, as P's engine does while it holds a finished request's
    blocks, until the TransferKV is answered."""
    deadline = time.monotonic() + DEADLINE
    while not reply.done() and time.monotonic() < deadline:
        c.engine.step()
        time.sleep(0.001)  # the engine's pause between empty steps
    answer = reply.result(0)
    assert isinstance(answer, TransferKVReply)
    return answer


def release(c: Cluster, request: Request) -> None:
    """The settled transfer frees the blocks: the next step releases them and
    both ranks report the request in finished_sending."""
    for _ in range(3):
        if request.request_id in c.engine.freed:
            break
        c.engine.step()
    assert c.engine.freed == {request.request_id}
    assert [m.release for m in c.engine.metas].count([request.request_id]) == 1
    assert c.counter("transfers_live") == 0


def check_destination(c: Cluster, request: Request) -> None:
    """Each D rank holds exactly its source rank's bytes of the 5 blocks, and
    nothing else was touched; each rank settled the transfer once, ok."""
    untouched = sorted(set(range(NUM_BLOCKS)) - set(DST_BLOCKS))
    for r, d in zip(c.ranks, c.d_ranks, strict=True):
        src = r.call("blocks", SRC_BLOCKS)
        dst = d.buf[:, list(DST_BLOCKS)].numpy()
        missing = [i for i in range(NBLOCKS) if not np.array_equal(dst[:, i], src[:, i])]
        assert not missing, f"D rank {r.rank}: blocks {missing} differ from P rank {r.rank}'s"
        assert not d.buf[:, untouched].any(), f"D rank {r.rank}: a block outside the transfer"
        received = d.wait_received(1)
        assert [(x.xfer_id, x.rank, x.tokens_sent, x.ok) for x in received] == [
            (xfer_of(request), r.rank, NUM_TOKENS, True)
        ]
        assert [(x.xfer_id, x.tokens_sent, x.ok) for x in c.engine.settled[r.rank]] == [
            (xfer_of(request), NUM_TOKENS, True)
        ]


def check_written_once(c: Cluster, writes: dict[int, int]) -> None:
    """Every block written exactly once per rank: each rank posted the bytes of
    the 5 blocks (all layers), in the writes its schedule implies."""
    for r in c.ranks:
        stats = r.stats()
        assert stats["bytes_posted"] == TRANSFER_BYTES, (r.rank, stats)
        assert stats["writes_failed"] == stats["transfers_failed"] == 0, (r.rank, stats)
        assert stats["transfers_ok"] == 1, (r.rank, stats)
        assert stats["writes_posted"] == writes[r.rank], (r.rank, stats)
    assert c.counter("bytes_sent") == TP * TRANSFER_BYTES  # the workers' count, aggregated
    assert c.counter("transfers_ok") == 1
    assert c.counter("transfers_failed") == 0
    # the histograms: one transfer, its size (from P's KV spec) what the ranks posted
    assert c.counter("transfer_bytes_count") == c.counter("transfer_seconds_count") == 1
    assert c.counter("transfer_bytes_sum") == TP * TRANSFER_BYTES
    assert 0 < c.counter("transfer_seconds_sum") < DEADLINE


# A rank that attached the substep posts the bypass full send (1 write), the
# substep's computed layer 0 at attach (1) and layers 1-3 as they are computed
# (3); a rank that rejected it posts the bypass full send and the resend (2).
WRITES_ATTACHED = 1 + LAYERS
WRITES_REJECTED = 2


# -- the tests -------------------------------------------------------------------------------

CASES = {
    # name: (ack of rank 0, ack of rank 1, how the late rank misses the substep)
    "rank1-lower": (1, 0, "freeze"),
    "rank0-lower": (0, 1, "freeze"),
    "rank1-lower-bypass-delay": (1, 0, "bypass_delay"),
    "all-rejected": (0, 0, "freeze"),
    "all-accepted": (1, 1, "freeze"),
}


@pytest.mark.parametrize(("ack0", "ack1", "late_by"), list(CASES.values()), ids=list(CASES))
def test_substep_acks_of_two_ranks(
    make_cluster: Callable[..., Cluster], ack0: int, ack1: int, late_by: str
) -> None:
    acks = {0: ack0, 1: ack1}
    delay = {r: BYPASS_DELAY_S for r, a in acks.items() if a == 0 and late_by == "bypass_delay"}
    c = make_cluster(delay)
    eng = c.engine
    early = [r for r in c.ranks if acks[r.rank] == 1]
    late = [r for r in c.ranks if acks[r.rank] == 0]
    req = new_request("acks")
    meta1 = first_chunk(c, req)  # its metadata connects D's ranks too
    assert sorted((p.instance_id, p.rank) for p in meta1.new_peers) == [(c.d_id, 0), (c.d_id, 1)]

    # Step 2 computes the last chunk: every rank is mid-step (one layer
    # computed), except a rank made late by freezing, which finished the step.
    begin_last_chunk(c, req)
    for r in c.ranks:
        if late_by == "freeze" and r in late:
            finish_step(r, range(LAYERS))  # ack 0: step 2 closed before the substep
        else:
            r.layers([0])

    # D's TransferKV arrives while step 2 is in flight.
    reply = c.transfer_kv(req)
    wait_until("the substep to be opened", lambda: c.counter("substeps_opened") == 1)
    assert c.counter("bypass_full_sends") == 1  # blocks 0-2 went at once, to every rank
    if late_by == "bypass_delay":
        for r in late:  # its bypass thread still holds the messages
            finish_step(r, range(1, LAYERS))
    for r in early:
        wait_until(
            f"rank {r.rank} to attach the substep", lambda r=r: r.stats()["substeps_attached"] == 1
        )
        finish_step(r, range(1, LAYERS))  # ack 1
    for r in late:
        # Let the late rank's bypass thread apply the bypass full send and
        # reject the substep before step 2's output goes on (vLLM would not
        # wait: test_a_resend_never_overtakes_the_bypass_full_send).
        wait_until(
            f"rank {r.rank} to reject the substep",
            lambda r=r: r.stats()["substeps_rejected"] == 1,
            DEADLINE + 3 * BYPASS_DELAY_S,
        )
        assert r.stats()["substeps_attached"] == 0
    # the prefill step's token ends the request (max_tokens=1): P holds its blocks
    merged = eng.output(stopped=[req])
    assert merged.acks == [(2, ack0, 0), (2, ack1, 1)]  # (step, ack, rank), worker order
    if early and late:  # accepted by some ranks only: resent by the others
        assert c.counter("substeps_resent") == 1
        assert c.counter("substeps_rolled_back") == c.counter("substeps_accepted") == 0
    elif late:  # rejected everywhere: rolled back, the next step sends it
        assert c.counter("substeps_rolled_back") == 1
        assert c.counter("substeps_resent") == c.counter("substeps_accepted") == 0
    else:
        assert c.counter("substeps_accepted") == 1
        assert c.counter("substeps_rolled_back") == c.counter("substeps_resent") == 0

    # Step 3: an empty step (P's engine steps while it holds finished blocks).
    meta3 = eng.schedule({})
    expected = last_chunk_task(c, req)
    assert not meta3.step_tasks
    if early and late:  # only the rank that rejected it sends it again
        assert meta3.rank_full_tasks == {late[0].rank: [expected]}
        assert not meta3.full_tasks
    elif late:
        assert meta3.full_tasks == [expected]
        assert not meta3.rank_full_tasks
    else:
        assert not (meta3.full_tasks or meta3.rank_full_tasks)
    eng.bind(meta3)
    for r in c.ranks:
        finish_step(r, [])
    eng.output()

    # Every rank's writes settle; the next steps bring the SendDones to the
    # scheduler side, which answers the TransferKV and then releases the blocks.
    for r in c.ranks:
        wait_until(f"rank {r.rank} to settle", lambda r=r: r.stats()["transfers_ok"] == 1)
    answer = step_until_answered(c, reply)
    assert (answer.code, answer.tokens_sent) == (Code.OK, NUM_TOKENS), answer
    release(c, req)
    check_destination(c, req)
    check_written_once(
        c, {r.rank: WRITES_ATTACHED if r in early else WRITES_REJECTED for r in c.ranks}
    )
    assert c.counter("substeps_opened") == 1
    # the workers' verdicts, reported in their metas and summed by aggregate
    assert c.counter("substeps_attached") == len(early)
    assert c.counter("substeps_rejected") == len(late)
    # the two chunks' steps are remembered (the empty ones are not), each with
    # its workers' figures (the slowest rank's)
    steps = {s.step_id: s for s in c.sched.timeline([]).steps}
    assert sorted(steps) == [1, 2]
    assert [(s.scheduled_tokens, s.requests) for s in steps.values()] == [(48, 1), (22, 1)]
    assert all(s.forward > 0 and s.hooks > 0 and s.layer_wait == 0 for s in steps.values())


def test_first_transfer_kv_in_the_step_of_the_handshake(
    make_cluster: Callable[..., Cluster],
) -> None:
    """D sends its first TransferKV the moment P answers its Handshake, so both
    can arrive within one P step; the ranks must be connected to D before the
    bypass sends reach them (the step metadata would connect them one step late)."""
    c = make_cluster(handshake=False)
    req = new_request("first")
    meta1 = first_chunk(c, req)
    assert not meta1.new_peers
    begin_last_chunk(c, req)
    for r in c.ranks:
        r.layers([0])
    c.handshake()
    reply = c.transfer_kv(req)
    wait_until("the substep to be opened", lambda: c.counter("substeps_opened") == 1)
    for r in c.ranks:
        wait_until(
            f"rank {r.rank} to attach the substep", lambda r=r: r.stats()["substeps_attached"] == 1
        )
        finish_step(r, range(1, LAYERS))
    c.engine.output(stopped=[req])
    assert c.counter("substeps_accepted") == 1
    answer = step_until_answered(c, reply)
    assert (answer.code, answer.tokens_sent) == (Code.OK, NUM_TOKENS), answer
    release(c, req)
    check_destination(c, req)
    check_written_once(c, {r: WRITES_ATTACHED for r in range(TP)})


@pytest.mark.parametrize("accepting", [(0,), ()], ids=["resent", "rolled-back"])
def test_a_resend_never_overtakes_the_bypass_full_send(
    make_cluster: Callable[..., Cluster], accepting: tuple[int, ...]
) -> None:
    """vLLM does not wait for a worker's bypass thread. A rank that froze step 2
    before its bypass thread applied the bypass full send (blocks 0-2) and the
    substep (blocks 3-4) acks 0 at once; step 3 then sends it blocks 3-4 again
    (`rank_full_tasks`, or `full_tasks` after a rollback) while blocks 0-2 still
    wait in its bypass thread. When P answers OK, every rank's KV must be in
    place at D, and nothing may be refused later."""
    late = [r for r in range(TP) if r not in accepting]
    c = make_cluster({r: HOLD_S for r in late})
    req = new_request("overtake")
    first_chunk(c, req)
    begin_last_chunk(c, req)
    for r in c.ranks:
        if r.rank in late:
            finish_step(r, range(LAYERS))
        else:
            r.layers([0])
    reply = c.transfer_kv(req)
    wait_until("the substep to be opened", lambda: c.counter("substeps_opened") == 1)
    for r in c.ranks:
        if r.rank in accepting:
            wait_until(
                f"rank {r.rank} to attach the substep",
                lambda r=r: r.stats()["substeps_attached"] == 1,
            )
            finish_step(r, range(1, LAYERS))
    c.engine.output(stopped=[req])  # at once, as vLLM does
    answer = step_until_answered(c, reply)
    assert (answer.code, answer.tokens_sent) == (Code.OK, NUM_TOKENS), answer
    check_destination(c, req)
