"""A step's timing joins the scheduler's view with its workers' (`SharedState.end_step`)."""

from __future__ import annotations

import pytest

from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.metadata import WorkerMeta
from rapidkv.connector.shared_state import SharedState

pytestmark = pytest.mark.unit


def test_a_step_keeps_the_slowest_ranks_figures_of_its_own_step() -> None:
    shared = SharedState(ConnectorConfig(), "inst", 16, 2)
    shared.step_id = 7
    shared.begin_step(1.0, 130, {"a": 128, "b": 1, "c": 1})
    rank0 = WorkerMeta(timings=[(6, 9.0, 9.0, 9.0), (7, 0.050, 0.0, 0.002)])
    rank1 = WorkerMeta(timings=[(7, 0.040, 0.010, 0.003)])
    merged = rank0.aggregate(rank1)
    assert isinstance(merged, WorkerMeta)
    assert shared.end_step(merged.timings) is not None
    (step,) = shared.timeline.snapshot([]).steps
    assert (step.step_id, step.begin, step.scheduled_tokens, step.requests) == (7, 1.0, 130, 3)
    # another step's figures (6) are not this step's
    assert (step.forward, step.layer_wait, step.hooks) == (0.050, 0.010, 0.003)


def test_a_step_no_worker_timed_has_zeros() -> None:
    shared = SharedState(ConnectorConfig(), "inst", 16, 1)
    shared.begin_step(1.0, 1, {"a": 1})
    shared.end_step()
    (step,) = shared.timeline.snapshot([]).steps
    assert (step.requests, step.forward, step.layer_wait, step.hooks) == (1, 0.0, 0.0, 0.0)
    assert shared.end_step() is None  # no step in flight: nothing recorded
    shared.begin_step(2.0, 0, {})  # an empty step: not remembered
    assert shared.end_step() is not None
    assert len(shared.timeline.snapshot([]).steps) == 1
