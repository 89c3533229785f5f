"""Stand-ins for the vLLM objects the connector's scheduler side reads, with
exactly the attributes it reads (docs/vllm-connector-contract.md §4, §8): a
`Request`, the `SchedulerOutput`, the `KVCacheManager` and its block pool.
Also `rank_info`, one rank's handshake metadata as a worker reports it, and
what the scheduler-side tests ask of a real `SchedulerSide` over its control
plane (`handshake`, `stats`, `wait_counter`). Shared by the scheduler-side
tests."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from rapidkv.connector.metadata import RankInfo
from rapidkv.connector.scheduler_side import SchedulerSide
from rapidkv.control.client import RpcClient
from rapidkv.control.messages import Handshake, RankEndpoint, StatsRequest


class Status(enum.Enum):
    """`vllm.v1.request.RequestStatus`, as far as the connector looks (by name)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()


@dataclass
class Request:
    request_id: str
    kv_transfer_params: dict[str, Any]
    num_prompt_tokens: int
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    status: Status = Status.RUNNING
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: set[str]
    total_num_scheduled_tokens: int


@dataclass
class BlockPool:
    free: int = 0
    num_gpu_blocks: int = 1  # vLLM's: every block, the null block included

    def get_num_free_blocks(self) -> int:
        return self.free


@dataclass
class KVCacheManager:
    blocks: dict[str, list[int]] = field(default_factory=dict)
    block_pool: BlockPool = field(default_factory=BlockPool)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """As vLLM's: an unknown request (never allocated, freed, preempted) has none."""
        return (list(self.blocks.get(request_id, [])),)


def rank_info(transport_metadata: bytes) -> RankInfo:
    """Rank 0 of a one-layer float32 instance on the tcp transport, 64 blocks."""
    return RankInfo(
        rank=0,
        bypass_address="tcp://127.0.0.1:9",
        transport="tcp",
        transport_metadata=transport_metadata,
        layout=b"layout",
        num_blocks=64,
        block_bytes=(4096,),
        runs_per_block=(1,),
        dtype="float32",
        kernel_blocks_per_block=1,
    )


def handshake(side: SchedulerSide, instance: str, incarnation: str, control: str) -> Handshake:
    """`instance`'s Handshake to `side`: one tcp rank of 64 blocks."""
    assert side.spec is not None
    endpoint = RankEndpoint(
        rank=0,
        transport="tcp",
        transport_metadata=f"{instance}/{incarnation}".encode(),
        layout=b"layout",
        num_blocks=64,
    )
    return Handshake(
        instance_id=instance,
        control_address=control,
        spec=side.spec,
        endpoints=[endpoint],
        incarnation=incarnation,
    )


def stats(side: SchedulerSide, client: RpcClient) -> dict[str, float]:
    """`side`'s counters, asked over its control plane."""
    return client.call(side.server.address, StatsRequest(), 5).counters


def wait_counter(
    side: SchedulerSide, client: RpcClient, name: str, n: int = 1, within: float = 5
) -> None:
    """Wait until `side`'s counter `name` is at least `n` (fails after `within` s)."""
    deadline = time.monotonic() + within
    while stats(side, client).get(name, 0) < n:
        assert time.monotonic() < deadline, f"{name} below {n} after {within} s"
        time.sleep(0.01)
