"""The source side of a live migration, on a real `SchedulerSide` (its control
plane on loopback, driven by a real `RpcClient`; its bypass channel into a real
`BypassReceiver` that records what the worker would send), with vLLM's engine
replaced by `Engine` below (the hook sequence of docs/vllm-connector-contract.md
§4 over the stand-ins of `vllm_stand_ins`) and the worker's SendDones written
by the test.

What is checked: a migration TransferKV for a request not running here is GONE;
one whose prompt is not the source's tokens is ERROR and leaves the source as
it was; an accepted one sends at once, over the bypass channel and in every
`transfer_kv_mode`, every block from `first_block` on that a finished step
computed (the source's prefix-cache hits only once the step that first
scheduled it ended), and the rest with the steps that compute it; a source
that finishes while a migration from it is not over holds its blocks until
every migration from it is over, then releases them once; preemption, the
destination's Abort and a dead destination fail the migration and leave the
source running. `MigrationMachine` runs every
interleaving of admissions, finish, settles, Aborts and preemption.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from vllm_stand_ins import KVCacheManager, Request, SchedulerOutput, Status

from rapidkv.connector.bypass import BypassMsg, BypassReceiver
from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.metadata import RankInfo, StepMeta, WorkerMeta
from rapidkv.connector.scheduler_side import SchedulerSide
from rapidkv.control.client import RpcClient
from rapidkv.control.codes import Code
from rapidkv.control.messages import (
    Abort,
    AbortReason,
    Handshake,
    RankEndpoint,
    StatsRequest,
    TimelineRequest,
    TransferKV,
    TransferKVReply,
    prompt_hash,
)
from rapidkv.kvt.messages import SendDone
from rapidkv.kvt.task import Task

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

BS = 16  # tokens per block
D_BLOCKS = 64  # the destination's pool
WAIT_S = 5.0


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.002)


class Engine:
    """vLLM's scheduler as the scheduler side sees it (one step at a time):
    `schedule` allocates blocks, builds the step's metadata and counts the
    scheduled tokens computed (vLLM's `_update_after_schedule`); `end` is the
    forward's end and `update_from_output`: decoding requests get their token,
    finished requests go through `request_finished`, then the step's output
    (the SendDones given, and `finished_sending` as a worker reports it: released
    by the scheduler side and named in an earlier `finished_req_ids`)."""

    def __init__(self, side: SchedulerSide) -> None:
        self.side = side
        self.kv = KVCacheManager()
        side.kv_cache_manager = self.kv  # bind_kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.metas: list[StepMeta] = []
        self.in_flight: dict[str, int] = {}
        self._next_block = 100
        self._finished_since: set[str] = set()  # finished_req_ids of the next step
        self._worker_finished: set[str] = set()  # ids the worker was handed
        self.delayed: set[str] = set()  # request_finished said: hold the blocks
        self.freed: list[str] = []  # finished_sending, in order

    def admit(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.side.on_new_request(request)

    def schedule(self, scheduled: dict[str, int] | None = None, preempted: tuple = ()) -> StepMeta:
        scheduled = dict(scheduled or {})
        for req_id in preempted:  # vLLM frees the blocks at once, inside schedule()
            req = self.requests[req_id]
            req.status, req.num_computed_tokens = Status.PREEMPTED, 0
            self.kv.blocks.pop(req_id, None)
        for req_id, n in scheduled.items():  # allocate_slots
            req = self.requests[req_id]
            req.status = Status.RUNNING
            blocks = self.kv.blocks.setdefault(req_id, [])
            while len(blocks) * BS < req.num_computed_tokens + n:
                blocks.append(self._next_block)
                self._next_block += 1
        meta = self.side.build_meta(
            SchedulerOutput(scheduled, set(preempted), sum(scheduled.values()))
        )
        for req_id, n in scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        self._worker_finished |= self._finished_since
        self._finished_since = set()
        self.in_flight = scheduled
        self.metas.append(meta)
        return meta

    def end(
        self,
        settled: tuple[SendDone, ...] = (),
        finish: tuple[str, ...] = (),
        abort: tuple[str, ...] = (),
    ) -> dict[str, tuple[bool, Any]]:
        for req_id in self.in_flight:
            req = self.requests[req_id]
            if req.num_computed_tokens >= req.num_tokens:  # sampled a token
                req.output_token_ids.append(1000 + req.num_tokens % 97)
        self.in_flight = {}
        results = {}
        for req_id, status in [(r, Status.FINISHED_LENGTH_CAPPED) for r in finish] + [
            (r, Status.FINISHED_ABORTED) for r in abort
        ]:
            req = self.requests[req_id]
            req.status = status
            held, params = self.side.request_finished(req, self.kv.blocks.get(req_id, []))
            results[req_id] = (held, params)
            self._finished_since.add(req_id)
            if held:
                self.delayed.add(req_id)
            else:
                self.kv.blocks.pop(req_id, None)
        released = {r for m in self.metas for r in m.release}
        sending = (released & self._worker_finished) - set(self.freed)
        # vLLM's own check (it kills the engine otherwise)
        assert sending <= self.delayed, f"finished_sending for {sending - self.delayed}"
        self.side.update_output(WorkerMeta(settled=list(settled)), None, sending or None)
        for req_id in sorted(sending):
            self.freed.append(req_id)
            self.kv.blocks.pop(req_id, None)
        return results

    def step(self, scheduled: dict[str, int] | None = None, **end: Any) -> StepMeta:
        meta = self.schedule(scheduled)
        self.end(**end)
        return meta

    def releases(self, req_id: str) -> int:
        """How many steps' metadata released `req_id`'s blocks."""
        return sum(m.release.count(req_id) for m in self.metas)


@dataclass
class Source:
    """The instance a request migrates from, and its destination D."""

    side: SchedulerSide
    engine: Engine
    client: RpcClient
    received: list[BypassMsg] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.side.server.address

    def stats(self) -> dict[str, float]:
        return self.client.call(self.address, StatsRequest(), WAIT_S).counters

    def handshake(self, instance: str = "D", port: int = 7001) -> None:
        assert self.side.spec is not None
        endpoint = RankEndpoint(
            rank=0,
            transport="tcp",
            transport_metadata=instance.encode(),
            layout=b"layout",
            num_blocks=D_BLOCKS,
        )
        hs = Handshake(
            instance_id=instance,
            control_address=f"127.0.0.1:{port}",
            spec=self.side.spec,
            endpoints=[endpoint],
            incarnation="a",
        )
        assert self.client.call(self.address, hs, WAIT_S).code == Code.OK

    def bypass_settled(self) -> list[BypassMsg]:
        """What reached the worker's bypass channel so far (every message sent)."""
        bypass = self.side.shared.bypass
        assert bypass is not None
        sent = bypass.sent
        wait_until("the bypass channel", lambda: len(self.received) >= sent)
        return list(self.received)

    def full_sends(self) -> list[Task]:
        return [t for m in self.bypass_settled() if m.kind == "full" for t in m.tasks]


@pytest.fixture
def make_source() -> Iterator[Callable[..., Source]]:
    made: list[tuple[SchedulerSide, RpcClient, BypassReceiver]] = []

    def make(**config: Any) -> Source:
        received: list[BypassMsg] = []
        lock = threading.Lock()

        def record(msg: BypassMsg) -> None:
            with lock:
                received.append(msg)

        receiver = BypassReceiver(0, record)
        side = SchedulerSide(ConnectorConfig(transport="tcp", **config), "S", BS, 1, "fp")
        side.set_ranks(
            {
                0: RankInfo(
                    rank=0,
                    bypass_address=receiver.address,
                    transport="tcp",
                    transport_metadata=b"s-rank-0",
                    layout=b"layout",
                    num_blocks=256,
                    block_bytes=(4096,),
                    runs_per_block=(1,),
                    dtype="float32",
                    kernel_blocks_per_block=1,
                )
            }
        )
        client = RpcClient()
        made.append((side, client, receiver))
        source = Source(side, Engine(side), client, received)
        source.handshake()
        return source

    yield make
    for side, client, receiver in made:
        client.close()
        side.close()
        receiver.close()


_ids = iter(range(1 << 30))


def new_request(role: str = "local", prompt_len: int = 40) -> Request:
    xfer_id = f"src-{next(_ids)}"
    return Request(
        request_id=f"cmpl-{xfer_id}-0-0123abcd",
        kv_transfer_params={"rapidkv": {"xfer_id": xfer_id, "role": role}},
        num_prompt_tokens=prompt_len,
        prompt_token_ids=[(7 * i + 3) % 1000 for i in range(prompt_len)],
    )


def xfer_of(request: Request) -> str:
    return request.kv_transfer_params["rapidkv"]["xfer_id"]


def decoding(s: Source, role: str = "local", generated: int = 10) -> Request:
    """A request that computed its prompt (one step) and `generated` tokens."""
    req = new_request(role)
    s.engine.admit(req)
    s.engine.step({req.request_id: req.num_prompt_tokens})
    for _ in range(generated - 1):
        s.engine.step({req.request_id: 1})
    assert len(req.output_token_ids) == generated
    assert req.num_computed_tokens == req.num_tokens - 1
    return req


def migration(
    source_req: Request,
    xfer_id: str,
    num_tokens: int | None = None,
    first_block: int = 0,
    mode: str | None = None,
    dst: str = "D",
    tokens: list[int] | None = None,
) -> TransferKV:
    """D's TransferKV for a prompt of the source's first `num_tokens + 1` tokens."""
    n = source_req.num_tokens - 1 if num_tokens is None else num_tokens
    ids = tokens if tokens is not None else source_req.all_token_ids[: n + 1]
    return TransferKV(
        xfer_id=xfer_id,
        dst_instance=dst,
        dst_blocks=list(range(10, 10 + -(-n // BS))),
        first_block=first_block,
        num_tokens=n,
        prompt_hash=prompt_hash(ids),
        migration=True,
        source_xfer_id=xfer_of(source_req),
        transfer_kv_mode=mode,
    )


def accepted(s: Source, msg: TransferKV) -> Any:
    """Send `msg`; return its reply's future once the source took it up."""
    before = s.side.stats().get("migration_transfers", 0)
    fut = s.client.submit(s.address, msg, WAIT_S * 4)
    wait_until(
        "the migration to be accepted",
        lambda: fut.done() or s.side.stats().get("migration_transfers", 0) > before,
    )
    assert not fut.done(), fut.result()
    return fut


def done(msg: TransferKV, ok: bool = True, error: str = "") -> SendDone:
    """The worker's SendDone once every write of `msg`'s transfer settled."""
    return SendDone(msg.xfer_id, 0, msg.num_tokens if ok else 0, ok, error)


def step_until(s: Source, fut: Any, **end: Any) -> TransferKVReply:
    """Steps until `fut` is answered (the first with `end`)."""
    s.engine.step(**end)
    wait_until("the reply", lambda: fut.done())
    reply = fut.result()
    assert isinstance(reply, TransferKVReply)
    return reply


# -- refusals ---------------------------------------------------------------------------


def test_a_migration_of_a_request_not_running_here_is_gone_at_once(
    make_source: Callable[..., Source],
) -> None:
    s = make_source()
    req = decoding(s)
    stranger = msgspec.structs.replace(migration(req, "m1"), source_xfer_id="no-such-request")
    reply = s.client.call(s.address, stranger, WAIT_S)
    assert reply.code == Code.GONE and "no-such-request unknown" in reply.message
    # a source that finished is no source any more
    s.engine.end(finish=(req.request_id,))
    reply = s.client.call(s.address, migration(req, "m2"), WAIT_S)
    assert reply.code == Code.GONE
    st_ = s.stats()
    assert st_["migration_unknown_source"] == 2
    assert st_.get("migration_transfers", 0) == 0 and st_["parked_now"] == 0
    assert not s.full_sends()


def test_a_preempted_source_is_not_running_and_gone(make_source: Callable[..., Source]) -> None:
    s = make_source()
    req = decoding(s)
    s.engine.schedule({}, preempted=(req.request_id,))
    s.engine.end()
    reply = s.client.call(s.address, migration(req, "m1", num_tokens=20), WAIT_S)
    assert reply.code == Code.GONE and "not running" in reply.message


def test_a_prompt_that_is_not_the_sources_tokens_is_refused_and_the_source_untouched(
    make_source: Callable[..., Source],
) -> None:
    s = make_source()
    req = decoding(s)
    wrong = list(req.all_token_ids)
    wrong[-1] += 1  # D's prompt ends with a token the source never generated
    for msg in (
        migration(req, "m1", tokens=wrong),
        # more tokens than the source has
        migration(req, "m2", num_tokens=req.num_tokens, tokens=[*req.all_token_ids, 5]),
    ):
        reply = s.client.call(s.address, msg, WAIT_S)
        assert reply.code == Code.ERROR and "differ from the destination's prompt" in reply.message
    st_ = s.stats()
    assert st_["migration_prompt_mismatch"] == 2
    assert st_["transfers_live"] == 0 and st_["migration_sources"] == 1
    assert not s.full_sends()
    # the source goes on, and a right migration of it is served
    s.engine.step({req.request_id: 1})
    fut = accepted(s, migration(req, "m3"))
    assert step_until(s, fut, settled=(done(migration(req, "m3")),)).code == Code.OK
    assert s.engine.end(finish=(req.request_id,))[req.request_id] == (False, None)


def test_a_migration_is_never_parked_and_over_the_per_destination_cap_is_busy(
    make_source: Callable[..., Source],
) -> None:
    s = make_source(max_transfers_per_peer=1)
    req = decoding(s)
    first = accepted(s, migration(req, "m1"))
    reply = s.client.call(s.address, migration(req, "m2"), WAIT_S)
    assert reply.code == Code.BUSY
    # the same migration asked twice gets the first one's answer
    again = s.client.submit(s.address, migration(req, "m1"), WAIT_S)
    wait_until("the duplicate", lambda: s.side.stats().get("duplicate_transfer_kv", 0) == 1)
    s.engine.step(settled=(done(migration(req, "m1")),))
    assert first.result(WAIT_S).code == again.result(WAIT_S).code == Code.OK
    st_ = s.stats()
    assert st_["duplicate_transfer_kv"] == 1 and st_["migration_transfers"] == 1


# -- what is sent, and when ---------------------------------------------------------------


@pytest.mark.parametrize("mode", [None, "step", "bypass", "substep"])
def test_an_accepted_migration_sends_every_computed_block_at_once_from_first_block(
    make_source: Callable[..., Source], mode: str | None
) -> None:
    """40 prompt tokens + 10 generated: D's prompt is the 50, it loads 49 tokens
    (4 blocks, the last holding one token) and already holds the first 2 (a
    pre-copy's blocks in its prefix cache): blocks 2-3 go at once, whatever the
    mode, into D's blocks 2-3."""
    s = make_source(transfer_kv_mode="step")
    req = decoding(s)
    msg = migration(req, "m1", first_block=2, mode=mode)
    fut = accepted(s, msg)
    src = s.engine.kv.blocks[req.request_id]
    assert s.full_sends() == [
        Task(
            xfer_id="m1",
            peer="D",
            src_blocks=tuple(src[2:4]),
            dst_blocks=tuple(msg.dst_blocks[2:4]),
            seen_tokens=2 * BS,
            new_tokens=49 - 2 * BS,
            has_last_token=True,
        )
    ]
    st_ = s.stats()
    assert st_["migration_transfers"] == 1 and st_["migration_blocks_skipped"] == 2
    assert st_["migrations_live"] == 1
    # the source decodes on; the steps send nothing more of the migration
    meta = s.engine.step({req.request_id: 1})
    assert not (meta.full_tasks or meta.step_tasks or meta.rank_full_tasks)
    reply = step_until(s, fut, settled=(done(msg),))
    assert (reply.code, reply.tokens_sent) == (Code.OK, 49)
    st_ = s.stats()
    assert st_["migration_transfers_ok"] == 1 and st_.get("migration_transfers_failed", 0) == 0
    assert st_["migrations_live"] == 0 and st_["transfers_live"] == 0
    assert st_.get("transfers_ok", 0) == 0  # P's own transfers are counted apart
    tl = s.client.call(s.address, TimelineRequest(["m1"]), WAIT_S).xfers["m1"]
    assert tl.mode == "migration" and tl.state_at_arrival == "between_steps"
    assert {"transfer_kv", "accepted", "bypass_sent", "settled"} <= set(tl.events)
    # a source whose migrations are over finishes as if there had been none
    assert s.engine.end(finish=(req.request_id,))[req.request_id] == (False, None)
    assert s.engine.releases(req.request_id) == 0


def test_arriving_while_the_sources_step_is_in_flight_only_what_a_forward_wrote_goes(
    make_source: Callable[..., Source],
) -> None:
    """A source in its chunked prefill: chunk 2 of 64 tokens is in flight when
    D asks for 48 tokens (3 blocks): the first chunk's 2 blocks go at once, the
    third with the next step, once the forward wrote it."""
    s = make_source()
    req = new_request(prompt_len=64)
    s.engine.admit(req)
    s.engine.step({req.request_id: 32})
    s.engine.schedule({req.request_id: 32})  # in flight: vLLM counts it computed already
    assert req.num_computed_tokens == 64
    msg = migration(req, "m1", num_tokens=48)
    fut = accepted(s, msg)
    src = s.engine.kv.blocks[req.request_id]
    [first] = s.full_sends()
    assert (first.src_blocks, first.seen_tokens, first.new_tokens) == (tuple(src[:2]), 0, 32)
    assert not first.has_last_token
    tl = s.client.call(s.address, TimelineRequest(["m1"]), WAIT_S).xfers["m1"]
    assert tl.state_at_arrival == "in_step"
    s.engine.end()  # the forward wrote tokens 32-63 (and sampled a token)
    meta = s.engine.step({req.request_id: 1})
    assert meta.full_tasks == [Task("m1", "D", (src[2],), (msg.dst_blocks[2],), 2 * BS, 16, True)]
    assert len(s.full_sends()) == 1  # nothing more over the bypass channel
    assert step_until(s, fut, settled=(done(msg),)).code == Code.OK


def test_a_sources_prefix_cache_hits_are_not_final_before_the_step_that_scheduled_it_ended(
    make_source: Callable[..., Source],
) -> None:
    """vLLM counts a request's prefix-cache hits computed when it schedules it,
    but it hashed those blocks into its cache as it scheduled the request that
    computes them: in the same step. A migration arriving while that step is in
    flight sends nothing at once (the hit blocks may still hold old KV); the
    next step sends the whole prompt, once the forward wrote it."""
    s = make_source()
    req = new_request(prompt_len=40)
    s.engine.admit(req)
    req.num_computed_tokens = 2 * BS  # 2 blocks hit, computed by another request in this step
    s.engine.schedule({req.request_id: 40 - 2 * BS})
    assert req.num_computed_tokens == 40
    msg = migration(req, "m1", num_tokens=39)
    fut = accepted(s, msg)
    assert s.full_sends() == []  # before the step ended, none of it is final
    s.engine.end()  # the forward wrote the hits' blocks (the other request's) and the rest
    meta = s.engine.step({req.request_id: 1})
    src = s.engine.kv.blocks[req.request_id]
    assert meta.full_tasks == [
        Task("m1", "D", tuple(src[:3]), tuple(msg.dst_blocks[:3]), 0, 39, True)
    ]
    assert step_until(s, fut, settled=(done(msg),)).code == Code.OK


def test_a_migration_of_a_source_not_yet_stepped_sends_its_hits_with_the_steps_layers(
    make_source: Callable[..., Source],
) -> None:
    """A migration taken up after vLLM scheduled its source (hits counted
    computed) but before the step's metadata: that step's layers carry the
    hits with what it computes; nothing goes as a full send."""
    s = make_source()
    req = new_request(prompt_len=40)
    s.engine.admit(req)
    req.num_computed_tokens = 2 * BS  # inside schedule(): the hits, before build_meta
    s.engine.kv.blocks[req.request_id] = [900, 901, 902]
    msg = migration(req, "m1", num_tokens=39)
    fut = accepted(s, msg)
    assert s.full_sends() == []
    meta = s.engine.schedule({req.request_id: 40 - 2 * BS})
    assert not meta.full_tasks
    assert meta.step_tasks == [
        Task("m1", "D", (900, 901, 902), tuple(msg.dst_blocks[:3]), 0, 39, True)
    ]
    s.engine.end()
    assert step_until(s, fut, settled=(done(msg),)).code == Code.OK
    assert s.full_sends() == []


# -- the source finishing, and two migrations --------------------------------------------


@pytest.mark.parametrize("how", ["finish", "abort"])
def test_a_source_that_finishes_mid_transfer_holds_its_blocks_until_it_settled(
    make_source: Callable[..., Source], how: str
) -> None:
    s = make_source()
    req = decoding(s)
    msg = migration(req, "m1")
    fut = accepted(s, msg)
    # the router closed the source's stream at cut-over (abort), or it ran out
    results = s.engine.end(**{how: (req.request_id,)})
    assert results[req.request_id] == (True, None)  # held; no identity: not a prefill
    for _ in range(3):
        s.engine.step()
        assert s.engine.releases(req.request_id) == 0
        assert s.side.pending_block_frees()
    g = s.side.gauges()
    assert g["held_requests"] == 1 and g["held_blocks"] == len(s.engine.kv.blocks[req.request_id])
    assert not fut.done()  # the migration goes on (an abort of the source is not one of it)
    assert step_until(s, fut, settled=(done(msg),)).code == Code.OK
    for _ in range(3):
        s.engine.step()
    assert s.engine.releases(req.request_id) == 1 and s.engine.freed == [req.request_id]
    assert s.side.gauges()["held_requests"] == 0 and s.stats()["transfers_live"] == 0


def test_two_migrations_from_one_request_release_its_blocks_once_both_are_over(
    make_source: Callable[..., Source],
) -> None:
    """A pre-copy settles while the source runs (forgotten); the cut-over and a
    third are in flight when the source finishes: the blocks go once both settled."""
    s = make_source()
    req = decoding(s)
    pre = migration(req, "pre", num_tokens=30)
    fut_pre = accepted(s, pre)
    assert step_until(s, fut_pre, scheduled={req.request_id: 1}, settled=(done(pre),)).code == (
        Code.OK
    )
    s.engine.step({req.request_id: 1})
    cut, third = migration(req, "cut", first_block=1), migration(req, "third", dst="E")
    s.handshake("E", 7002)
    fut_cut, fut_third = accepted(s, cut), accepted(s, third)
    assert s.stats()["migrations_live"] == 2
    s.engine.schedule({req.request_id: 1})
    assert s.engine.end(abort=(req.request_id,))[req.request_id] == (True, None)
    assert step_until(s, fut_cut, settled=(done(cut),)).code == Code.OK
    for _ in range(2):
        s.engine.step()
    assert s.engine.releases(req.request_id) == 0  # the third still holds them
    assert step_until(
        s, fut_third, settled=(done(third, ok=False, error="write failed"),)
    ).code == (Code.ERROR)
    for _ in range(3):
        s.engine.step()
    assert s.engine.releases(req.request_id) == 1 and s.engine.freed == [req.request_id]
    st_ = s.stats()
    assert (st_["migration_transfers"], st_["migration_transfers_ok"]) == (3, 2)
    assert st_["migration_transfers_failed"] == 1 and st_["transfers_live"] == 0


def test_a_prefill_request_that_is_also_a_source_is_released_after_both_transfers(
    make_source: Callable[..., Source],
) -> None:
    """P's own transfer (no TransferKV for it yet) and a migration of the same
    request: the blocks go once, when the later of them is over."""
    s = make_source(finished_ttl_s=0.05)
    req = decoding(s, role="prefill", generated=1)
    msg = migration(req, "m1")
    fut = accepted(s, msg)
    held, params = s.engine.end(finish=(req.request_id,))[req.request_id]
    assert held and params is not None and params["rapidkv"]["control"]  # P's identity
    time.sleep(0.1)  # P's own transfer expires (no TransferKV came for it)
    for _ in range(2):
        s.engine.step()
    assert s.stats()["finished_expired"] == 1
    assert s.engine.releases(req.request_id) == 0  # the migration still holds them
    assert step_until(s, fut, settled=(done(msg),)).code == Code.OK
    for _ in range(3):
        s.engine.step()
    assert s.engine.releases(req.request_id) == 1 and s.engine.freed == [req.request_id]


def test_a_finished_source_that_never_computed_what_was_asked_fails_the_migration(
    make_source: Callable[..., Source],
) -> None:
    s = make_source()
    req = new_request(prompt_len=64)
    s.engine.admit(req)
    s.engine.step({req.request_id: 32})
    s.engine.schedule({req.request_id: 32})
    msg = migration(req, "m1", num_tokens=48)
    fut = accepted(s, msg)  # blocks 0-1 went; block 2 is being computed
    assert len(s.full_sends()) == 1
    s.engine.end(abort=(req.request_id,))  # aborted before update_from_output: 64 computed
    # request_finished saw all 64 computed (the forward ended): the step sends block 2
    meta = s.engine.step()
    assert [t.xfer_id for t in meta.full_tasks] == ["m1"]
    assert step_until(s, fut, settled=(done(msg),)).code == Code.OK

    req2 = new_request(prompt_len=64)
    s.engine.admit(req2)
    s.engine.step({req2.request_id: 32})
    msg2 = migration(req2, "m2", num_tokens=48)
    fut2 = accepted(s, msg2)
    s.engine.end(abort=(req2.request_id,))  # only 32 computed, ever
    meta = s.engine.step()
    assert ("m2", "migration source finished before computing it") in meta.fail_xfers
    assert step_until(s, fut2, settled=(done(msg2, ok=False),)).code == Code.ERROR
    for _ in range(2):
        s.engine.step()
    assert s.engine.releases(req2.request_id) == 1


# -- failures that leave the source running -----------------------------------------------


def test_preemption_mid_transfer_fails_the_migration_and_the_source_goes_on(
    make_source: Callable[..., Source],
) -> None:
    s = make_source()
    req = decoding(s)
    msg = migration(req, "m1")
    fut = accepted(s, msg)
    assert s.full_sends()  # sent from blocks vLLM is about to free
    meta = s.engine.schedule({}, preempted=(req.request_id,))
    assert meta.preempted_xfers == ["m1"]  # the worker fences them before the forward
    s.engine.end()
    reply = step_until(s, fut, settled=(done(msg, ok=False, error="request preempted on P"),))
    assert reply.code == Code.ERROR
    st_ = s.stats()
    assert st_["migration_transfers_failed"] == 1 and st_["preempted_transfers"] == 1
    assert st_["migrations_live"] == 0 and st_["migration_sources"] == 1
    # resumed, it is a source again for a later migration
    s.engine.step({req.request_id: req.num_tokens})
    fut = accepted(s, migration(req, "m2"))
    assert step_until(s, fut, settled=(done(migration(req, "m2")),)).code == Code.OK


def test_preempted_before_anything_was_sent_is_gone_at_once(
    make_source: Callable[..., Source],
) -> None:
    s = make_source()
    req = new_request(prompt_len=64)
    s.engine.admit(req)
    s.engine.schedule({req.request_id: 32})  # nothing computed yet
    fut = accepted(s, migration(req, "m1", num_tokens=20, tokens=req.prompt_token_ids[:21]))
    assert not s.full_sends()
    s.engine.end()
    meta = s.engine.schedule({}, preempted=(req.request_id,))
    assert meta.preempted_xfers == []
    reply = fut.result(WAIT_S)
    assert reply.code == Code.GONE and "preempted" in reply.message
    s.engine.end()
    assert s.stats()["migration_transfers_failed"] == 1


@pytest.mark.parametrize("in_flight", [True, False])
def test_the_destinations_abort_stops_the_migration_behind_the_fence_and_the_source_goes_on(
    make_source: Callable[..., Source], in_flight: bool
) -> None:
    s = make_source()
    req = decoding(s) if in_flight else new_request(prompt_len=64)
    if not in_flight:  # nothing computed yet: nothing was sent
        s.engine.admit(req)
        s.engine.schedule({req.request_id: 32})
    msg = migration(req, "m1", num_tokens=20, tokens=req.all_token_ids[:21])
    fut = accepted(s, msg)
    aborts = s.side.stats().get("aborts_client_abort", 0)
    abort = s.client.submit(s.address, Abort(xfer_id="m1", reason=AbortReason.CLIENT_ABORT), WAIT_S)
    if in_flight:
        wait_until(
            "the Abort at the source",
            lambda: s.side.stats().get("aborts_client_abort", 0) > aborts,
        )
        assert not abort.done()  # writes of it may still land: not yet
        meta = s.engine.step()
        assert [x for x, _ in meta.fail_xfers] == ["m1"]  # the worker fails it
        s.engine.step(settled=(done(msg, ok=False, error="aborted"),))
    else:
        s.engine.end()
    assert abort.result(WAIT_S).code == Code.OK
    assert fut.result(WAIT_S).code in (Code.ERROR, Code.GONE)
    st_ = s.stats()
    assert st_["migration_transfers_failed"] == 1 and st_["migrations_live"] == 0
    assert st_["migration_sources"] == 1 and req.status == Status.RUNNING
    # a late TransferKV of it is GONE (tombstoned)
    assert s.client.call(s.address, msg, WAIT_S).code == Code.GONE
    s.engine.schedule({req.request_id: 1})
    assert s.engine.end(finish=(req.request_id,))[req.request_id] == (False, None)


def test_a_dead_destination_fails_its_migrations_and_the_source_goes_on(
    make_source: Callable[..., Source],
) -> None:
    s = make_source()
    req = decoding(s)
    msg = migration(req, "m1")
    fut = accepted(s, msg)
    generation = int(s.stats()["peers_added"])
    s.side.update_output(WorkerMeta(broken_peers=[("D", generation)]), None)  # writes failed
    meta = s.engine.step({req.request_id: 1})
    assert [x for x, _ in meta.fail_xfers] == ["m1"]
    assert step_until(s, fut, settled=(done(msg, ok=False, error="peer gone"),)).code == Code.ERROR
    st_ = s.stats()
    assert st_["transfers_failed_peer_gone"] == 1 and st_["migration_transfers_failed"] == 1
    assert st_["migration_sources"] == 1
    s.engine.step({req.request_id: 1})
    assert s.engine.end(finish=(req.request_id,))[req.request_id] == (False, None)


@pytest.mark.parametrize("role", ["local", "decode", "prefill"])
def test_a_source_without_migrations_finishes_as_before(
    make_source: Callable[..., Source], role: str
) -> None:
    s = make_source()
    req = decoding(s, role=role, generated=2)
    assert s.stats()["migration_sources"] == 1
    held, params = s.engine.end(finish=(req.request_id,))[req.request_id]
    assert held == (role == "prefill")  # P holds its blocks for its own transfer, as always
    assert (params is not None) == (role == "prefill")
    assert s.stats()["migration_sources"] == 0


def test_a_request_without_our_params_is_no_source(make_source: Callable[..., Source]) -> None:
    s = make_source()
    req = new_request()
    req.kv_transfer_params = {}
    s.engine.admit(req)
    assert s.stats()["migration_sources"] == 0


# -- every interleaving ------------------------------------------------------------------


class MigrationMachine(RuleBasedStateMachine):
    """One decoding source; migrations from it arrive, settle (ok or not), are
    aborted by their destination, and the source may be preempted (then
    resumed) or finish (or be aborted) at any point between, one engine step at
    a time. The blocks of a finished source go exactly once, and only once
    every migration from it is over; `request_finished` holds them exactly when
    one is not; the source never changes because of its migrations."""

    def __init__(self, make: Callable[..., Source]) -> None:
        super().__init__()
        self.make = make

    @initialize()
    def start(self) -> None:
        self.source = self.make()
        self.req = decoding(self.source, generated=3)
        self.futures: dict[str, Any] = {}  # migration -> its TransferKV reply
        self.msgs: dict[str, TransferKV] = {}
        self.aborts: dict[str, Any] = {}
        self.fail_asked: set[str] = set()  # the worker was told to fail it
        self.settled: set[str] = set()  # the worker settled it
        self.finished = False
        self.held: bool | None = None
        self.tokens = self.req.num_tokens

    # -- the test's worker: what it must send, what it settles

    def issued(self) -> set[str]:
        sent = {t.xfer_id for t in self.source.full_sends()}
        for m in self.source.engine.metas:
            sent |= {t.xfer_id for t in m.full_tasks + m.step_tasks}
            self.fail_asked |= {x for x, _ in m.fail_xfers} | set(m.preempted_xfers)
        return sent

    def step(self, settle: tuple[SendDone, ...] = ()) -> None:
        running = not self.finished and self.req.status == Status.RUNNING
        self.source.engine.step({self.req.request_id: 1} if running else {}, settled=settle)
        self.issued()  # the step may fail some

    @rule()
    def idle_step(self) -> None:
        self.step()

    @precondition(lambda self: not self.finished and len(self.futures) < 4)
    @rule()
    def migrate(self) -> None:
        xfer_id = f"m{len(self.futures)}"
        msg = migration(self.req, xfer_id, num_tokens=min(self.req.num_tokens - 1, 40))
        self.msgs[xfer_id] = msg
        if self.req.status != Status.RUNNING:
            reply = self.source.client.call(self.source.address, msg, WAIT_S)
            assert reply.code == Code.GONE
            self.futures[xfer_id] = None
            return
        self.futures[xfer_id] = accepted(self.source, msg)

    def unsettled_issued(self) -> list[str]:
        issued = self.issued()
        return sorted(x for x in self.futures if x in issued and x not in self.settled)

    @precondition(lambda self: self.unsettled_issued())
    @rule(data=st.data(), ok=st.booleans())
    def settle(self, data: st.DataObject, ok: bool) -> None:
        xfer_id = data.draw(st.sampled_from(self.unsettled_issued()))
        ok = ok and xfer_id not in self.fail_asked  # kvt settles a failed one with an error
        self.settled.add(xfer_id)
        self.step((done(self.msgs[xfer_id], ok=ok, error="" if ok else "failed"),))

    @precondition(lambda self: any(f is not None for f in self.futures.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        xfer_id = data.draw(st.sampled_from(sorted(x for x, f in self.futures.items() if f)))
        side = self.source.side
        before = side.stats().get("aborts_client_abort", 0)
        self.aborts[xfer_id] = self.source.client.submit(
            self.source.address, Abort(xfer_id=xfer_id, reason=AbortReason.CLIENT_ABORT), WAIT_S
        )
        # it reaches the source before the next step
        wait_until(
            "the Abort at the source",
            lambda: side.stats().get("aborts_client_abort", 0) > before,
        )

    @precondition(lambda self: not self.finished and self.req.status == Status.RUNNING)
    @rule()
    def preempt(self) -> None:
        self.source.engine.schedule({}, preempted=(self.req.request_id,))
        self.source.engine.end()
        self.issued()

    @precondition(lambda self: not self.finished and self.req.status == Status.PREEMPTED)
    @rule()
    def resume(self) -> None:
        self.source.engine.step({self.req.request_id: self.req.num_tokens})

    @precondition(lambda self: not self.finished)
    @rule(aborted=st.booleans())
    def finish(self, aborted: bool) -> None:
        live = self.source.side.gauges()["migrations_live"]
        how = "abort" if aborted else "finish"
        self.source.engine.schedule()
        results = self.source.engine.end(**{how: (self.req.request_id,)})
        self.held, params = results[self.req.request_id]
        assert self.held == (live > 0) and params is None
        self.finished = True

    @invariant()
    def the_blocks_go_once_and_only_when_every_migration_is_over(self) -> None:
        if not hasattr(self, "req"):
            return
        engine, req_id = self.source.engine, self.req.request_id
        released = engine.releases(req_id)
        assert released <= 1
        if released:
            assert self.finished and self.held
            assert self.source.side.gauges()["migrations_live"] == 0
            # never while a write from them may be in flight: whatever the worker
            # was given to send, it had settled
            unsettled = self.issued() - self.settled
            assert not unsettled, f"released with {unsettled} in flight"
        if not self.finished:
            assert self.req.status in (Status.RUNNING, Status.PREEMPTED)
            assert self.req.num_tokens >= self.tokens  # its migrations never touch it
            self.tokens = self.req.num_tokens

    def teardown(self) -> None:
        if not hasattr(self, "req"):
            return
        # drain: settle what was issued, step until every reply is in
        for _ in range(20):
            pending = self.unsettled_issued()
            settle = tuple(
                done(self.msgs[x], ok=x not in self.fail_asked, error="failed") for x in pending
            )
            self.settled |= set(pending)
            self.step(settle)
            if all(f is None or f.done() for f in self.futures.values()):
                break
        for xfer_id, f in self.futures.items():
            if f is not None:
                assert f.result(WAIT_S).code in (Code.OK, Code.ERROR, Code.GONE), xfer_id
        for a in self.aborts.values():
            assert a.result(WAIT_S).code in (Code.OK, Code.GONE, Code.NOT_FOUND)
        if not self.finished:
            self.finish(aborted=False)
        for _ in range(3):
            self.step()
        engine = self.source.engine
        assert engine.releases(self.req.request_id) == (1 if self.held else 0)
        assert engine.freed == ([self.req.request_id] if self.held else [])
        s = self.source.side.stats()
        assert s["transfers_live"] == 0 and s["migrations_live"] == 0
        assert s["held_requests"] == 0 and s["migration_sources"] == 0
        accepted_n = sum(f is not None for f in self.futures.values())
        assert s.get("migration_transfers", 0) == accepted_n
        assert s.get("migration_transfers_ok", 0) + s.get("migration_transfers_failed", 0) == (
            accepted_n
        )


def test_every_interleaving_of_finish_settle_abort_and_preemption(
    make_source: Callable[..., Source],
) -> None:
    run_state_machine_as_test(
        lambda: MigrationMachine(make_source),
        settings=settings(
            max_examples=25,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
