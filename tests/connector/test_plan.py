"""`connector.plan`: the tasks planned over a request's chunked prefill cover the
transfer exactly once, in order, on block boundaries, never ahead of the KV."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidkv.connector.plan import Window, plan
from rapidkv.kvt.task import validate_task

pytestmark = pytest.mark.unit


@st.composite
def scenarios(draw: st.DrawFn):
    bs = draw(st.sampled_from([1, 4, 16]))
    prompt = draw(st.integers(2, 12 * bs))
    num_tokens = prompt - 1
    nblocks = -(-num_tokens // bs)
    first_block = draw(st.integers(0, max(0, nblocks - 1)))  # D's prefix hits
    p_hit = draw(st.integers(0, (prompt - 1) // bs)) * bs  # P's own prefix hits
    chunks, done = [], p_hit
    while done < prompt:
        n = draw(st.integers(1, max(1, 3 * bs)))
        chunks.append(min(n, prompt - done))
        done += chunks[-1]
    arrive = draw(st.integers(0, len(chunks) + 1))  # TransferKV before step `arrive`
    return bs, prompt, num_tokens, first_block, p_hit, chunks, arrive


@given(scenarios())
@settings(max_examples=500, deadline=None)
def test_plans_cover_the_transfer_exactly_once(scenario) -> None:
    bs, prompt, num_tokens, first_block, p_hit, chunks, arrive = scenario
    nblocks = -(-num_tokens // bs)
    window = Window("x", "d", tuple(range(100, 100 + nblocks)), first_block, num_tokens)
    src = tuple(range(500, 500 + -(-prompt // bs)))
    sent, ready, tasks = 0, p_hit, []

    def issue(in_flight: int) -> None:
        nonlocal sent
        p = plan(window, bs, src, sent, ready, in_flight)
        if p.full:
            assert p.full.end_tokens <= ready or (p.full.has_last_token and ready >= num_tokens), (
                "full send of KV not yet computed"
            )
            tasks.append(p.full)
        if p.step:
            assert p.step.end_tokens <= in_flight, "step task beyond the step's KV"
            tasks.append(p.step)
        sent = p.sent_upto

    for i, n in enumerate(chunks):  # step i computes tokens [ready, ready + n)
        if i >= arrive:
            issue(ready + n)
        ready += n
    if arrive >= len(chunks):  # TransferKV after prefill finished: one full send
        issue(ready)

    start = first_block * bs
    if start >= num_tokens:
        assert not tasks
        return
    assert tasks, "nothing planned"
    assert tasks[0].seen_tokens == start
    for a, b in itertools.pairwise(tasks):
        assert b.seen_tokens == a.end_tokens, "gap or overlap between tasks"
    assert tasks[-1].end_tokens == num_tokens and tasks[-1].has_last_token
    assert sum(t.has_last_token for t in tasks) == 1
    written = [b for t in tasks for b in t.dst_blocks]
    assert written == list(window.dst_blocks[first_block:]), "each block once, in order"
    for t in tasks:
        validate_task(t, bs)  # full blocks only, partial tail only with the last token
        assert t.src_blocks == tuple(500 + b - 100 for b in t.dst_blocks)


def test_nothing_is_planned_before_the_kv_exists() -> None:
    window = Window("x", "d", tuple(range(4)), 0, 50)
    p = plan(window, 16, tuple(range(4)), sent_upto=0, ready_upto=10, in_flight_upto=10)
    assert p.full is None and p.step is None and p.sent_upto == 0
    p = plan(window, 16, tuple(range(4)), sent_upto=0, ready_upto=10, in_flight_upto=40)
    assert p.full is None
    assert (p.step.seen_tokens, p.step.new_tokens, p.step.has_last_token) == (0, 32, False)


def test_inconsistent_counts_are_refused() -> None:
    window = Window("x", "d", (1, 2), 0, 20)
    with pytest.raises(ValueError, match="ready <= in flight"):
        plan(window, 16, (1, 2), sent_upto=16, ready_upto=20, in_flight_upto=0)
    with pytest.raises(ValueError, match="need 2 blocks"):
        plan(window, 16, (1,), sent_upto=0, ready_upto=20, in_flight_upto=20)


def test_a_split_prefills_window_makes_every_task_announce_its_layers() -> None:
    """P's whole (head) prompt is the window; its tasks carry `notify_layers`
    so that D can compute with each layer as it lands."""
    window = Window("x", "d", tuple(range(10, 14)), 0, 64, notify_layers=True)
    p = plan(window, 16, tuple(range(4)), 0, 32, 64)
    assert p.full is not None and p.step is not None
    assert p.full.notify_layers and p.step.notify_layers
    assert p.step.has_last_token and p.step.end_tokens == 64
    plain = plan(Window("y", "d", tuple(range(10, 14)), 0, 63), 16, tuple(range(4)), 0, 0, 63)
    assert plain.step is not None and not plain.step.notify_layers
