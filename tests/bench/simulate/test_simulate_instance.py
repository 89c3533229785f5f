"""`bench simulate`'s instance and event loop: the fitted costs, reproduced."""

from __future__ import annotations

import dataclasses

import pytest

from rapidkv.bench.simulate.engine import Simulation, simulate
from rapidkv.bench.simulate.fit import DEFAULT_FIT
from rapidkv.bench.simulate.routers import FixedPdRouter, LocalRouter, Router
from rapidkv.bench.simulate.workload import Spec
from rapidkv.router.placement import Placement

pytestmark = pytest.mark.unit

FIT = DEFAULT_FIT


class Scripted(Router):
    """Places the k-th request where `placements[k]` says."""

    def __init__(self, n: int, placements: list[Placement]) -> None:
        super().__init__(n)
        self.placements = placements
        self.events: list[tuple[str, str, float]] = []

    def place(self, rid: str, prompt: int, output: int, now_ms: float, cached=()) -> Placement:
        self.events.append(("dispatch", rid, now_ms))
        return self.placements[int(rid[1:])]

    def prefill_done(self, rid: str, now_ms: float) -> None:
        self.events.append(("prefill_done", rid, now_ms))

    def first_token(self, rid: str, now_ms: float) -> None:
        self.events.append(("first_token", rid, now_ms))

    def finished(self, rid: str, now_ms: float, output_tokens: int) -> None:
        self.events.append(("finished", rid, now_ms))


def test_one_request_alone_has_the_fitted_ttft_and_tpot() -> None:
    for prompt in (128, 514, 900):
        (o,) = simulate(FIT, 1, LocalRouter(1), [Spec(prompt, 16)], concurrency=1, routed=False)
        assert o.ttft_ms == pytest.approx(FIT.http_ms + FIT.step_time(1, prompt))
        assert o.ttft_ms == pytest.approx(FIT.single_ttft(prompt))
        assert o.tpot_ms == pytest.approx(FIT.step_time(1, 0))
        assert o.e2e_ms == pytest.approx(o.ttft_ms + 15 * o.tpot_ms)


def test_the_default_fit_reproduces_its_measurements_at_low_load() -> None:
    m = FIT.measurements
    (o,) = simulate(FIT, 1, LocalRouter(1), [Spec(514, 16)], concurrency=1, routed=False)
    assert o.ttft_ms == pytest.approx(m.single_c1_ttft_p50)
    assert o.tpot_ms == pytest.approx(m.single_c1_tpot_p50)
    assert FIT.step_time(4, 0) == pytest.approx(m.single_c4_tpot_p50)


def test_through_the_router_a_request_pays_the_router_latency() -> None:
    (o,) = simulate(FIT, 2, LocalRouter(2), [Spec(300, 8)], concurrency=1)
    assert o.ttft_ms == pytest.approx(FIT.single_ttft(300) + FIT.router_ms)


def test_a_long_prompt_is_chunked_by_the_token_budget() -> None:
    fit = dataclasses.replace(FIT, max_num_batched_tokens=256)
    (o,) = simulate(fit, 1, LocalRouter(1), [Spec(600, 4)], concurrency=1, routed=False)
    steps = fit.step_time(1, 256) * 2 + fit.step_time(1, 88)
    assert o.ttft_ms == pytest.approx(fit.http_ms + steps)


def test_max_num_seqs_makes_a_request_wait_for_a_slot() -> None:
    fit = dataclasses.replace(FIT, max_num_seqs=1)
    a, b = simulate(fit, 1, LocalRouter(1), [Spec(200, 5), Spec(200, 5)], arrivals=[0.0, 1.0])
    assert b.ttft_ms > a.e2e_ms - 1.0  # b starts only once a is over
    assert b.tpot_ms == pytest.approx(fit.step_time(1, 0))


def test_a_pd_request_opens_with_p_first_token_and_decodes_on_d() -> None:
    # a prompt under one block cannot be split: PD
    (o,) = simulate(FIT, 2, FixedPdRouter(2, FIT), [Spec(100, 11)], concurrency=1)
    p_end = FIT.step_time(1, 100)
    assert o.kind == "pd" and (o.prefill, o.decode) == (0, 1)
    assert o.ttft_ms == pytest.approx(p_end + FIT.http_ms + FIT.router_ms)
    d_first = p_end + FIT.transfer_time(100) + FIT.step_time(1, 1)
    last = d_first + 10 * FIT.step_time(1, 0)
    assert o.tpot_ms == pytest.approx((last - p_end) / 10)


def test_nixl_waits_for_its_transfer_and_d_first_token() -> None:
    (o,) = simulate(FIT, 2, FixedPdRouter(2, FIT, nixl=True), [Spec(600, 8)], concurrency=1)
    d_first = FIT.step_time(1, 600) + FIT.transfer_time(600, "nixl") + FIT.step_time(1, 1)
    assert o.kind == "pd"
    assert o.ttft_ms == pytest.approx(d_first + FIT.http_ms + FIT.router_ms)
    assert o.tpot_ms == pytest.approx(FIT.step_time(1, 0))


def test_an_idle_fixed_pair_splits_and_the_tail_waits_for_the_head() -> None:
    (o,) = simulate(FIT, 2, FixedPdRouter(2, FIT), [Spec(514, 16)], concurrency=1)
    assert o.kind == "split"
    head = 256  # 55 % of 513 in whole 128-token blocks
    expected = max(FIT.step_time(1, head) + FIT.split_handoff_ms, FIT.step_time(1, 514 - head))
    assert o.ttft_ms == pytest.approx(expected + FIT.http_ms + FIT.router_ms)


def test_a_split_tail_blocks_its_instance_until_the_head_arrives() -> None:
    """Instance 1 decodes request 0; request 1 is a long local prompt on 0;
    request 2 splits with its head on 0 (queued behind request 1) and its tail
    on 1: instance 1's engine, request 0's decode included, waits for it."""
    placements = [
        Placement("local", 1, 1),
        Placement("local", 0, 0),
        Placement("split", 0, 1, 256),
    ]
    specs = [Spec(128, 60), Spec(900, 2), Spec(514, 4)]
    arrivals = [0.0, 100.0, 100.5]

    def run(with_split: bool) -> tuple[list, Simulation]:
        router = Scripted(2, placements if with_split else placements[:2])
        sim = Simulation(FIT, 2, router)
        k = len(router.placements)
        out = sim.run(specs[:k], arrivals=arrivals[:k])
        return out, sim

    base, _ = run(False)
    out, sim = run(True)
    # on 0: request 1's prompt, then its second token with the head beside it
    head_end = 100.0 + FIT.step_time(1, 900) + FIT.step_time(2, 256)
    tail_end = head_end + FIT.split_handoff_ms
    ttft = tail_end - 100.5 + FIT.http_ms + FIT.router_ms
    assert out[2].kind == "split"
    assert out[2].ttft_ms == pytest.approx(ttft)
    # instance 1 took the tail in at its next step (within one decode step of
    # 100.5) and waited for the head far beyond that step's own time
    own = FIT.step_time(2, 514 - 256)
    assert sim.instances[1].blocked_ms == pytest.approx(
        tail_end - 100.5 - own, abs=FIT.step_time(1, 0)
    )
    # and request 0's decode waited with it: its TPOT grew by that wait over its tokens
    assert out[0].tpot_ms > base[0].tpot_ms + sim.instances[1].blocked_ms / 60 * 0.9


def test_events_reach_the_router_in_the_real_router_order() -> None:
    router = Scripted(2, [Placement("pd", 0, 1), Placement("split", 1, 0, 128)])
    sim = Simulation(FIT, 2, router)
    sim.run([Spec(300, 4), Spec(300, 4)], arrivals=[0.0, 500.0])
    for rid in ("r0", "r1"):
        kinds = [k for k, r, _ in router.events if r == rid]
        assert kinds == ["dispatch", "prefill_done", "first_token", "finished"]
        times = [t for _, r, t in router.events if r == rid]
        assert times == sorted(times)
