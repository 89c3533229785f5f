"""`bench simulate` with prefix caching: hits, fetches, conversations, the
workloads of shared prefixes, and the kv-aware router against the blind one."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import pytest

from rapidkv.bench.common.arrivals import session_arrivals
from rapidkv.bench.common.multiturn import MULTITURN
from rapidkv.bench.common.shared_prefix import SHARED_PREFIX
from rapidkv.bench.goodput.options import ARRIVAL_SALT
from rapidkv.bench.simulate.compare import compare, policy_for
from rapidkv.bench.simulate.engine import Simulation
from rapidkv.bench.simulate.fit import DEFAULT_FIT
from rapidkv.bench.simulate.goodput import reference_slo, run_point
from rapidkv.bench.simulate.prefix_cache import block_hashes
from rapidkv.bench.simulate.prefix_workloads import (
    ANSWER,
    conversations,
    smollm2_dir,
    tokens_for,
)
from rapidkv.bench.simulate.routers import Router, make_router
from rapidkv.bench.simulate.workload import WORKLOADS, Spec, arrival_times, requests
from rapidkv.router.placement import SLO, Placement

pytestmark = pytest.mark.unit

FIT = DEFAULT_FIT
B = FIT.block_size
SYSTEM = ((1, 0), 1024)


def spec(question: int, q: int = 40, out: int = 16) -> Spec:
    return Spec(1024 + q, out, (SYSTEM, ((2, question), q)))


class Scripted(Router):
    """Places the k-th request where `placements[k]` says; records `cached`."""

    def __init__(self, n: int, placements: list[Placement]) -> None:
        super().__init__(n)
        self.placements = placements
        self.cached: list[tuple[int, ...]] = []

    def place(self, rid, prompt, output, now_ms, cached=()):  # type: ignore[no-untyped-def]
        self.cached.append(cached)
        return self.placements[int(rid[1:])]


def run(n: int, router: Router, specs: list[Spec], arrivals: list[float], fit=FIT) -> Simulation:  # type: ignore[no-untyped-def]
    sim = Simulation(fit, n, router, routed=False, prefix_caching=True)
    sim.outcomes = sim.run(specs, arrivals=arrivals)  # type: ignore[attr-defined]
    return sim


def test_a_hit_leaves_only_the_rest_of_the_prompt_to_compute() -> None:
    specs = [spec(0), spec(1, q=50)]
    told = Placement("local", 0, 0, decode_hit=1024)  # as the kv-aware router places it
    router = Scripted(1, [Placement("local", 0, 0), told])
    sim = run(1, router, specs, [0.0, 1000.0])
    first, second = sim.outcomes  # type: ignore[attr-defined]
    assert router.cached == [(0,), (1024,)]  # the router is told what the cache holds
    assert first.ttft_ms == pytest.approx(FIT.http_ms + FIT.step_time(1, 1064))
    assert second.ttft_ms == pytest.approx(FIT.http_ms + FIT.step_time(1, 50))
    assert sim.instances[0].tokens == {"cached": 1024, "external": 0, "computed": 1064 + 50}
    t = sim.prefix_tokens()
    assert t["hit_fraction"] == pytest.approx(1024 / (1064 + 1074))
    assert t["placed"] == {"hit": 1024, "fetched": 0, "computed": 1064 + 50}  # the router's view


def test_a_whole_prompt_held_still_computes_its_last_block() -> None:
    same = Spec(1024, 8, (SYSTEM,))
    router = Scripted(1, [Placement("local", 0, 0)] * 2)
    sim = run(1, router, [same, same], [0.0, 1000.0])
    assert sim.instances[0].tokens["computed"] == 1024 + B  # vLLM recomputes the last block


def test_a_fetch_sends_the_held_head_and_the_decoder_keeps_it() -> None:
    specs = [spec(0), spec(1, q=50), spec(2, q=30)]
    fetch = Placement("fetch", 0, 1, 1024, prefill_hit=1024)
    router = Scripted(2, [Placement("local", 0, 0), fetch, Placement("local", 1, 1)])
    sim = run(2, router, specs, [0.0, 1000.0, 2000.0])
    _, fetched, after = sim.outcomes  # type: ignore[attr-defined]
    p, d = sim.instances
    # the holder hits the head (its part is the head and one token more) and computes one token
    assert p.tokens == {"cached": 1024, "external": 0, "computed": 1064 + 1}
    # the decoder receives the head and computes the tail; then holds the head itself
    assert d.tokens["external"] == 1024 and d.tokens["computed"] == 50 + 30 - 0
    assert router.cached[2] == (1024, 1024)
    assert d.tokens["cached"] == 1024  # the third request hit what the fetch brought
    transfer = FIT.transfer_time(1024)
    assert fetched.ttft_ms >= FIT.http_ms + FIT.split_handoff_ms + transfer
    assert after.ttft_ms == pytest.approx(FIT.http_ms + FIT.step_time(1, 30))
    placed = sim.prefix_tokens()["placed"]  # as the placements say: the last one told no hit
    assert placed == {"hit": 0, "fetched": 1024, "computed": 1064 + (1 + 50) + 1054}


def test_a_pd_sends_only_what_the_decoder_lacks() -> None:
    specs = [spec(0), spec(1)]
    pd = Placement("pd", 1, 0, prefill_hit=0, decode_hit=1024)
    router = Scripted(2, [Placement("local", 0, 0), pd])
    sim = run(2, router, specs, [0.0, 1000.0])
    d, p = sim.instances
    assert p.tokens == {"cached": 0, "external": 0, "computed": 1064}
    # D: its own 1024 cached, the 39 other tokens but the last received, the last computed
    assert d.tokens["cached"] == 1024 and d.tokens["external"] == 39
    assert d.tokens["computed"] == 1064 + 1


def test_a_full_cache_makes_a_request_wait_for_blocks() -> None:
    small = dataclasses.replace(FIT, prefix_cache_blocks=12)  # one 9-block request at a time
    specs = [Spec(1064, 32, (((2, k), 1064),)) for k in range(2)]
    router = Scripted(1, [Placement("local", 0, 0)] * 2)
    sim = run(1, router, specs, [0.0, 0.0], small)
    first, second = sim.outcomes  # type: ignore[attr-defined]
    assert second.ttft_ms > first.e2e_ms  # admitted once the first released its blocks
    unbounded = run(1, Scripted(1, router.placements), specs, [0.0, 0.0])
    assert unbounded.outcomes[1].ttft_ms < first.e2e_ms  # type: ignore[attr-defined]


def test_a_later_turn_is_sent_a_think_time_after_the_answer_before_it() -> None:
    specs = requests(MULTITURN, 8, 0, "chars")
    assert [s.follows for s in specs] == [False, True, True, True] * 2
    arrivals = arrival_times(MULTITURN, specs, 1.0, 0)
    expected = session_arrivals([s.follows for s in specs], 1.0, MULTITURN.seed(0) + ARRIVAL_SALT)
    assert [math.isnan(a) for a in arrivals] == [math.isnan(e) for e in expected]
    sim = Simulation(FIT, 2, make_router("dp", 2, FIT, SLO()), prefix_caching=True)
    out = sim.run(specs, arrivals=arrivals)
    for k in (1, 2, 3, 5, 6, 7):
        before_end = out[k - 1].arrival_ms + out[k - 1].e2e_ms - sim.latency_ms
        assert out[k].arrival_ms == pytest.approx(before_end + specs[k].think_ms)
        assert 500 <= specs[k].think_ms <= 1500


def test_multiturn_prompts_repeat_the_history_with_its_answers() -> None:
    specs = requests(MULTITURN, 8, 0, "chars")
    for before, turn in itertools.pairwise(specs[:4]):
        assert before.answer is not None and before.answer[0] == ANSWER
        assert turn.content[: len(before.content) + 1] == (
            *before.content,
            (before.answer, before.output),
        )
        assert turn.prompt > before.prompt + before.output
        held = block_hashes(
            (*before.content, (before.answer, before.output)), B, before.prompt + before.output - 1
        )
        assert block_hashes(turn.content, B)[: len(held)] == held
    assert all(s.output <= MULTITURN.answer_cap for s in specs)
    assert all(s.prompt <= MULTITURN.max_len + 64 for s in specs)


def test_shared_prefix_requests_are_bench_goodputs_plan() -> None:
    plan = SHARED_PREFIX.plan(40, 3)
    specs = requests(SHARED_PREFIX, 40, 3)
    for k, s in enumerate(specs):
        assert s.content[0] == ((1, plan.groups[k]), 1024)
        assert s.prompt == 1024 + plan.question_lens[k] and s.output == plan.max_tokens[k]
    assert not any(s.follows for s in specs)


@pytest.mark.skipif(smollm2_dir() is None, reason="SmolLM2's checkpoint is not built here")
def test_with_smollm2s_tokenizer_the_conversations_are_the_real_runs() -> None:
    from rapidkv.bench.common.multiturn import multiturn_conversations

    real = multiturn_conversations(MULTITURN, smollm2_dir(), 12, 0)
    tokens = tokens_for("auto")
    assert conversations(MULTITURN, 12, 0, tokens) == real.exchanges
    specs = requests(MULTITURN, 12, 0)
    assert [s.output for s in specs] == real.max_tokens
    assert specs[0].prompt == len(real.prompt(0, 0, []))


def test_a_run_with_prefix_caching_is_a_function_of_its_seed() -> None:
    specs = requests(SHARED_PREFIX, 120, 0)
    slo = SLO(60.0, 8.1)
    a, b = (run_point(FIT, 2, "adaptive", specs, 8.0, 0, slo, workload=SHARED_PREFIX) for _ in "ab")
    assert a == b and a.prefix == b.prefix and a.prefix["hit_fraction"] > 0.5


def test_a_small_scaling_run_completes_fast() -> None:
    specs = requests(SHARED_PREFIX, 80, 0)
    slo, _ = reference_slo(FIT, SHARED_PREFIX, 0)
    start = time.monotonic()
    for policy in ("dp", "adaptive-blind", "adaptive-nofetch", "adaptive"):
        p = run_point(FIT, 8, policy, specs, 32.0, 0, slo, workload=SHARED_PREFIX)
        assert sum(p.placements.values()) == 80 and p.throughput_req_s > 0
        assert p.prefix["instances"]["cached"] > 0
    assert time.monotonic() - start < 30


def test_the_kv_aware_router_with_fetch_beats_the_blind_one_where_it_misses() -> None:
    """A property of the model, loosely: on shared-prefix, at a rate the blind
    adaptive router misses, the one that knows the caches (and fetches) meets it."""
    specs = requests(SHARED_PREFIX, 400, 0)
    slo, _ = reference_slo(FIT, SHARED_PREFIX, 0)
    rate = 12.0
    blind = run_point(FIT, 2, "adaptive-blind", specs, rate, 0, slo, workload=SHARED_PREFIX)
    aware = run_point(FIT, 2, "adaptive", specs, rate, 0, slo, workload=SHARED_PREFIX)
    assert blind.attainment < 0.9 <= aware.attainment
    assert aware.prefix["placed"]["hit"] > 0 == blind.prefix["placed"]["hit"]


def test_the_real_runs_prefix_configurations_map_to_the_policies() -> None:
    assert policy_for("rapidkv-adaptive-blind") == "adaptive-blind"
    assert policy_for("rapidkv-kv-aware-nofetch") == "adaptive-nofetch"
    assert policy_for("rapidkv-adaptive") == "adaptive"
    real = {
        "meta": {"requests_per_rate": 40},
        "workloads": {
            "shared-prefix": {
                "slo": {"ttft_ms": 60.0, "tpot_ms": 8.1},
                "configs": {
                    name: {
                        "attainment": {"2": 0.95, "4": 0.7},
                        "goodput_req_s": 2.0,
                        "prefix_cache_hit_fraction": 0.8,
                        "fetched_fraction": 0.1 if name == "rapidkv-adaptive" else 0.0,
                    }
                    for name in ("dp2", "rapidkv-adaptive-blind", "rapidkv-adaptive")
                },
            }
        },
    }
    out = compare(real, FIT, tokenizer="chars")
    configs = out["workloads"]["shared-prefix"]["configs"]
    assert {c: v["policy"] for c, v in configs.items()} == {
        "dp2": "dp",
        "rapidkv-adaptive-blind": "adaptive-blind",
        "rapidkv-adaptive": "adaptive",
    }
    for c in configs.values():
        assert c["requests"] == 40
        assert c["prefix"]["measured"]["prefix_cache_hit_fraction"] == 0.8
        assert 0 < c["prefix"]["simulated"]["prefix_cache_hit_fraction"] < 1


def test_a_warm_up_is_served_but_not_counted() -> None:
    specs = requests(SHARED_PREFIX, 160, 0)
    slo, _ = reference_slo(FIT, SHARED_PREFIX, 0)
    cold = run_point(FIT, 8, "dp", specs[80:], 16.0, 0, slo, workload=SHARED_PREFIX)
    warm = run_point(FIT, 8, "dp", specs, 16.0, 0, slo, workload=SHARED_PREFIX, warm_up=80)
    assert sum(warm.placements.values()) == 80 == sum(cold.placements.values())
    counted = sum(warm.prefix["instances"].values())
    assert counted == sum(cold.prefix["instances"].values())  # the same 80 requests' tokens
    assert warm.prefix["hit_fraction"] > cold.prefix["hit_fraction"]
    assert warm.attainment > cold.attainment  # dp's cold system prompts miss the TTFT SLO


def test_a_sweep_may_start_higher() -> None:
    from rapidkv.bench.simulate.goodput import Point, sweep

    def evaluate(rate: float) -> Point:
        return Point(rate, 1.0 if rate <= 40 else 0.0, None, None, None, None, 0, {}, {})

    assert min(sweep(evaluate, 8, 0, start=4.0).points) == 32.0
    assert sweep(evaluate, 8, 2, start=4.0).goodput == 40.0


def test_compare_takes_the_real_runs_groups_and_warm_up() -> None:
    """A run says its shared-prefix groups and warm-up at each rate: the
    simulation draws that many groups and warms that many requests first;
    a run that names no warm-up (before there was one) had none."""
    from rapidkv.bench.simulate.compare import as_run

    assert as_run(SHARED_PREFIX, {"groups": 4}) == dataclasses.replace(
        SHARED_PREFIX, groups=4, warm_up=0
    )
    assert as_run(SHARED_PREFIX, {"groups": 12, "warm_up": 32}) == SHARED_PREFIX
    assert as_run(SHARED_PREFIX, {"warm_up": 8}).groups == SHARED_PREFIX.groups
    assert as_run(WORKLOADS["multiturn"], {"groups": 4}) is WORKLOADS["multiturn"]
    real = {
        "workloads": {
            "shared-prefix": {
                "groups": 4,
                "warm_up": 6,
                "requests_per_rate": 10,
                "slo": {"ttft_ms": 60.0, "tpot_ms": 8.1},
                "configs": {"dp2": {"attainment": {"2": 0.95}, "goodput_req_s": 2.0}},
            }
        }
    }
    dp2 = compare(real, FIT, tokenizer="chars")["workloads"]["shared-prefix"]["configs"]["dp2"]
    assert (dp2["requests"], dp2["warm_up"]) == (10, 6)
