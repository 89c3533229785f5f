"""What the two sides of the connector tell each other each step.

- `StepMeta` (scheduler -> every worker, vLLM's per-step connector metadata):
  the step id we number ourselves, the tasks of the step and the full sends to
  start, peers to connect, which requests' blocks may be freed, which D requests
  wait for which transfer.
- `WorkerMeta` (worker -> scheduler, `build_connector_worker_meta`, merged over
  ranks by `aggregate`): the ack of the step and the transfers that settled on
  this rank as source.
- `RankInfo` (worker -> scheduler once, `get_handshake_metadata`): what a peer
  needs to reach this rank's KV memory.

Tasks in `StepMeta` name the destination *instance* as their peer; each worker
rank sends to the ranks of the destination it routes KV heads to (the same rank
at equal TP sizes; `rank_links`), each of whose transports is named
`peer_name(instance, rank)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from rapidkv.connector.bypass import Peer
from rapidkv.kvt.messages import SendDone
from rapidkv.kvt.task import Task


def peer_name(instance_id: str, rank: int) -> str:
    """The transport name of rank `rank` of instance `instance_id`."""
    return f"{instance_id}.r{rank}"


@dataclass
class RankInfo(KVConnectorHandshakeMetadata):
    rank: int
    bypass_address: str  # where the rank's bypass channel listens (connector.bypass)
    transport: str
    transport_metadata: bytes
    layout: bytes  # msgspec-encoded kvt Layout
    num_blocks: int
    block_bytes: tuple[int, ...]  # per layer
    runs_per_block: tuple[int, ...]  # per layer
    dtype: str
    kernel_blocks_per_block: int


@dataclass
class StepMeta(KVConnectorMetadata):
    step_id: int
    step_tasks: list[Task] = field(default_factory=list)  # substep 0: sent per layer
    full_tasks: list[Task] = field(default_factory=list)  # KV complete: sent at once
    # substeps some ranks rejected and others sent: resent by those ranks only
    rank_full_tasks: dict[int, list[Task]] = field(default_factory=dict)
    new_peers: list[Peer] = field(default_factory=list)  # connect (or reconnect)
    # destination instances gone, with the generation they were added under
    drop_peers: list[tuple[str, int]] = field(default_factory=list)
    fail_xfers: list[tuple[str, str]] = field(default_factory=list)  # (xfer_id, reason)
    preempted_xfers: list[str] = field(default_factory=list)  # P: blocks freed this step
    release: list[str] = field(default_factory=list)  # P: req ids whose blocks may go
    expect_recv: dict[str, str] = field(default_factory=dict)  # D: xfer_id -> req_id
    recv_failed: list[str] = field(default_factory=list)  # D: req ids to report failed
    # D: split prefills this step computes the tail of, waiting layer by layer for
    # the head's KV: xfer_id -> the blocks P writes
    split_recv: dict[str, list[int]] = field(default_factory=dict)
    # P: `debug_layer_delay_s` slows this step's layers: it computes prompt
    # tokens of a transfer the debug faults cover (`ConnectorConfig.faulted`)
    delays_layers: bool = False
    # P: bypass messages sent before this step was built; a worker applies all of
    # them before this step's tasks, so the step path never overtakes the bypass
    bypass_seq: int = 0


@dataclass
class WorkerMeta(KVConnectorWorkerMetadata):
    """Always truthy (vLLM drops falsy metas): never define __len__/__bool__."""

    acks: list[tuple[int, int, int]] = field(default_factory=list)  # (step, ack, rank)
    settled: list[SendDone] = field(default_factory=list)  # transfers settled as source
    counters: dict[str, int] = field(default_factory=dict)  # increments, summed over ranks
    # destinations whose writes the transport failed: (instance_id, generation)
    broken_peers: list[tuple[str, int]] = field(default_factory=list)
    # the step's worker timings, one per rank: (step_id, forward_s, layer_wait_s, hooks_s)
    timings: list[tuple[int, float, float, float]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, WorkerMeta)
        counters = dict(self.counters)
        for k, v in other.counters.items():
            counters[k] = counters.get(k, 0) + v
        return WorkerMeta(
            self.acks + other.acks,
            self.settled + other.settled,
            counters,
            self.broken_peers + other.broken_peers,
            self.timings + other.timings,
        )
