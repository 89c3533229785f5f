"""What the roles of the scheduler side share (`SharedState`): who this instance
is, its ranks, the one lock, the counters and histogram observations, the
metadata pending for the next step, the engine step in flight, the timeline.

Threads: the engine thread, the control-plane server's loop thread, and the
RPC client's callback and retry-timer threads all reach the roles. Every
mutable structure of `SharedState` and of the roles is touched only under
`lock` (the exceptions say so where they are); the engine thread never waits
on the network.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rapidkv.connector.bypass import BypassSender, Peer
from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.metadata import StepMeta
from rapidkv.connector.observations import Observations
from rapidkv.connector.timeline import TimelineRecorder
from rapidkv.control.messages import KVSpec, RankEndpoint, StepTiming
from rapidkv.kvt.task import Task


@dataclass
class PendingMeta:
    """What goes to the workers with the next step's metadata (`StepMeta`),
    gathered between two `build_meta` calls."""

    new_peers: list[Peer] = field(default_factory=list)
    drop_peers: list[tuple[str, int]] = field(default_factory=list)
    fail: list[tuple[str, str]] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    expect: dict[str, str] = field(default_factory=dict)
    recv_failed: list[str] = field(default_factory=list)
    split_recv: dict[str, list[int]] = field(default_factory=dict)
    rank_full: dict[int, list[Task]] = field(default_factory=dict)

    def fill(self, meta: StepMeta) -> None:
        """Hand all of it to `meta`."""
        meta.rank_full_tasks = self.rank_full
        meta.new_peers = self.new_peers
        meta.drop_peers = self.drop_peers
        meta.fail_xfers = self.fail
        meta.release = self.release
        meta.expect_recv = self.expect
        meta.recv_failed = self.recv_failed
        meta.split_recv = self.split_recv


# counters exported from the start, at 0, rather than at their first increment:
# those the dashboard and the alert rules read (deploy/), whose rate must be 0,
# not missing, on a fleet where nothing went wrong yet
COUNTED_FROM_START = (
    "transfers_ok",
    "transfers_failed",
    "bytes_sent",
    "transfer_kv_sent",
    "transfer_kv_ok",
    "recompute_fallbacks",
)


class SharedState:
    """State of the scheduler side that more than one role reads or writes.

    `spec`, `endpoints` and `bypass` describe this instance's ranks: empty until
    the workers' handshake metadata arrived, then set once, without the lock
    (`SchedulerSide.set_ranks`). `control_address` is where this instance's
    control plane listens (set once its server started). `kv_cache_manager` is
    vLLM's, once bound. `step_id` is the latest step numbered by `build_meta`
    (written on the engine thread only, without the lock); `step_in_flight` is
    that step between its `build_meta` and its `update_output`, else None, and
    `step_scheduled` what it schedules (vLLM's `num_scheduled_tokens`: request
    id -> tokens; empty between steps); `step_ended_id` the latest step whose
    `update_output` ran (0 before any). `closing` is set (once, by a signal
    handler: a plain write, no lock) when vLLM's engine was asked to shut down
    (`shutdown_signal.py`).
    """

    def __init__(
        self, config: ConnectorConfig, instance_id: str, block_size: int, tp_size: int
    ) -> None:
        self.config = config
        self.instance_id = instance_id
        # drawn per process start: peers tell a restarted instance from the old one
        self.incarnation = secrets.token_hex(8)
        self.block_size = block_size
        self.tp_size = tp_size
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTED_FROM_START, 0))
        self.observations = Observations()  # histograms' values (observations.py)
        # re-entrant: a future that is already done runs its callback (which takes
        # the lock) inside add_done_callback, on the thread that holds it
        self.lock = threading.RLock()
        self.pending = PendingMeta()
        self.timeline = TimelineRecorder()
        self.spec: KVSpec | None = None
        self.endpoints: list[RankEndpoint] = []
        # destination instance -> how many (rank here, rank there) pairs exchange
        # KV with it (`kvt.head_map.plan`, at its handshake; absent: one a rank)
        self.peer_pairs: dict[str, int] = {}
        self.bypass: BypassSender | None = None
        self.control_address = ""
        self.kv_cache_manager: Any = None
        self.step_id = 0
        self.step_in_flight: int | None = None
        self.step_scheduled: dict[str, int] = {}
        self.step_ended_id = 0
        self.step_began = 0.0
        self.step_tokens = 0
        self.closing = False

    def take_pending(self) -> PendingMeta:
        """What was gathered for the next step; gathering starts afresh."""
        pending, self.pending = self.pending, PendingMeta()
        return pending

    def begin_step(
        self, began: float, scheduled_tokens: int, scheduled: dict[str, int] | None = None
    ) -> None:
        """`step_id` goes to the workers now: it is the step in flight
        (`scheduled`: its tokens per request id)."""
        self.step_in_flight = self.step_id
        self.step_scheduled = scheduled if scheduled is not None else {}
        self.step_began = began
        self.step_tokens = scheduled_tokens

    def end_step(
        self, worker_timings: Iterable[tuple[int, float, float, float]] = ()
    ) -> tuple[int, float] | None:
        """The step in flight returned: record its timing, with the workers'
        (`WorkerMeta.timings`: the slowest rank's of each figure, of those that
        timed this step); its id and the time it ended (None if no step was in
        flight)."""
        now = time.monotonic()
        step_id, self.step_in_flight = self.step_in_flight, None
        requests, self.step_scheduled = len(self.step_scheduled), {}
        if step_id is None:
            return None
        self.step_ended_id = step_id
        mine = [t for t in worker_timings if t[0] == step_id]
        forward = layer_wait = hooks = 0.0
        if mine:
            _, forward, layer_wait, hooks = (max(column) for column in zip(*mine, strict=True))
        self.timeline.step(
            StepTiming(
                step_id,
                self.step_began,
                now,
                self.step_tokens,
                requests,
                forward,
                layer_wait,
                hooks,
            )
        )
        return step_id, now
