"""P never sends a prefix-cache hit's blocks before the step that computes them.

vLLM hashes a request's blocks into its prefix cache as it *schedules* them
(`KVCacheManager.allocate_slots` caches up to `num_computed + num_new` tokens),
so a request admitted later in the same `schedule()` hits blocks whose KV the
step being built has yet to compute, and vLLM counts them in its
`num_computed_tokens`. P's plan must not take those tokens as final: sent as a
full task (at `bind`, before the forward) or over the bypass channel while the
step runs, they would carry the blocks' old contents to D, which computes from
them and caches them (found by `rapidkv bench goodput`, shared prefixes under
load: D's first token differed from P's). They go layer by layer with the step
that computes them.

A real `SchedulerSide` (its control-plane server on loopback), vLLM's objects
replaced by the stand-ins, the bypass channel by a recorder.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_stand_ins import (
    KVCacheManager,
    Request,
    SchedulerOutput,
    handshake,
    rank_info,
    wait_counter,
)

from rapidkv.connector.bypass import BypassMsg
from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.scheduler_side import SchedulerSide
from rapidkv.control.client import RpcClient
from rapidkv.control.codes import Code
from rapidkv.control.messages import TransferKV, prompt_hash
from rapidkv.kvt.task import Task

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

BLOCK = 16
SHARED = list(range(100, 100 + 2 * BLOCK))  # two full blocks both prompts begin with
R1 = [*SHARED, 1, 2, 3, 4, 5]
R2 = [*SHARED, 6, 7, 8, 9, 10]  # 37 tokens: D asks for 36 of them, 3 blocks
SHARED_BLOCKS = (5, 6)  # R1's, computed by R1 in the step; R2's prefix-cache hit
P_BLOCKS = {"req-1": [*SHARED_BLOCKS, 7], "req-2": [*SHARED_BLOCKS, 8]}


class Recorder:
    """The bypass channel, as `BypassSender`: what was sent, in order."""

    def __init__(self) -> None:
        self.sent = 0
        self.msgs: list[BypassMsg] = []

    def send(self, msg: BypassMsg) -> None:
        self.msgs.append(msg)
        self.sent += 1

    def close(self) -> None:
        pass


@pytest.fixture
def side() -> Iterator[tuple[SchedulerSide, RpcClient, Recorder]]:
    side = SchedulerSide(
        ConnectorConfig(park_ttl_s=30.0, transport="tcp", transfer_kv_mode="substep"),
        "P",
        BLOCK,
        1,
        "fingerprint",
    )
    side.set_ranks({0: rank_info(b"p-rank-0")})
    side.shared.bypass.close()
    recorder = Recorder()
    side.shared.bypass = recorder
    side.kv_cache_manager = KVCacheManager(blocks={k: list(v) for k, v in P_BLOCKS.items()})
    client = RpcClient()
    assert side.spec is not None
    hello = handshake(side, "D", "a", "127.0.0.1:7001")
    assert client.call(side.server.address, hello, 5).code == Code.OK
    try:
        yield side, client, recorder
    finally:
        client.close()
        side.close()


def ask(side: SchedulerSide, client: RpcClient) -> None:
    """D's TransferKV for R2 (D holds none of it: from block 0), not waited for."""
    msg = TransferKV(
        xfer_id="x2",
        dst_instance="D",
        dst_blocks=[20, 21, 22],
        first_block=0,
        num_tokens=len(R2) - 1,
        prompt_hash=prompt_hash(R2),
    )
    client.submit(side.server.address, msg, 30)


def admit_both(side: SchedulerSide) -> None:
    """R1 computes the shared blocks in the next step; R2, admitted after it in
    the same schedule(), hits them (vLLM: num_computed_tokens = 32)."""
    for req_id, xfer_id, ids, hits in (("req-1", "x1", R1, 0), ("req-2", "x2", R2, 2 * BLOCK)):
        params = {"rapidkv": {"xfer_id": xfer_id, "role": "prefill"}}
        side.on_new_request(Request(req_id, params, len(ids), ids, num_computed_tokens=hits))


def step() -> SchedulerOutput:
    """The step computing R1's whole prompt and R2's last 5 tokens."""
    return SchedulerOutput({"req-1": len(R1), "req-2": len(R2) - 2 * BLOCK}, set(), 42)


def early(tasks: list[Task]) -> list[Task]:
    """Tasks (sent before the step's layers are computed) carrying a shared block."""
    return [t for t in tasks if set(t.src_blocks) & set(SHARED_BLOCKS)]


def test_a_hit_on_blocks_the_step_computes_goes_with_the_step_not_before_it(
    side: tuple[SchedulerSide, RpcClient, Recorder],
) -> None:
    """D's TransferKV came first (parked): R2's whole transfer is a step task."""
    p, client, recorder = side
    ask(p, client)
    wait_counter(p, client, "parked")
    admit_both(p)
    meta = p.build_meta(step())
    assert early(meta.full_tasks) == []
    assert not any(early(m.tasks or []) for m in recorder.msgs)
    (task,) = [t for t in meta.step_tasks if t.xfer_id == "x2"]
    assert task.src_blocks == tuple(P_BLOCKS["req-2"]) and task.seen_tokens == 0
    assert task.new_tokens == len(R2) - 1 and task.has_last_token


def test_a_transfer_kv_arriving_mid_step_attaches_the_hit_to_the_step(
    side: tuple[SchedulerSide, RpcClient, Recorder],
) -> None:
    """D's TransferKV arrives while the step runs (substep mode): nothing of the
    shared blocks goes over the bypass channel at once; the substep carries them."""
    p, client, recorder = side
    admit_both(p)
    meta = p.build_meta(step())
    assert meta.step_tasks == [] and meta.full_tasks == []  # no TransferKV yet
    ask(p, client)
    wait_counter(p, client, "substeps_opened")
    sends = [m for m in recorder.msgs if m.kind in ("full", "substep")]
    assert [m.kind for m in sends] == ["substep"]
    (task,) = sends[0].tasks
    assert task.src_blocks == tuple(P_BLOCKS["req-2"]) and task.seen_tokens == 0
