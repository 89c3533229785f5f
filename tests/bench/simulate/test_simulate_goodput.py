"""`bench simulate`'s sweeps: attainment, goodput, determinism, the policies."""

from __future__ import annotations

import itertools

import pytest

from rapidkv.bench.simulate.engine import Outcome, simulate
from rapidkv.bench.simulate.fit import DEFAULT_FIT
from rapidkv.bench.simulate.goodput import (
    TARGET,
    Point,
    attainment,
    goodput_of,
    meets,
    reference_slo,
    run_point,
    sweep,
)
from rapidkv.bench.simulate.routers import AdaptiveRouter, fit_priors, make_router
from rapidkv.bench.simulate.workload import WORKLOADS, poisson_arrivals, requests, spread
from rapidkv.router.placement import SLO, Policy

pytestmark = pytest.mark.unit

FIT = DEFAULT_FIT
HEAVY = WORKLOADS["prefill-heavy"]
CHAT = WORKLOADS["chat"]


def outcome(ttft: float | None, tpot: float | None, output: int = 16) -> Outcome:
    e2e = None if ttft is None or tpot is None else ttft + tpot * (output - 1)
    return Outcome(500, output, 0.0, "local", 0, 0, ttft, tpot, e2e)


def test_a_request_meets_the_slos_only_with_both() -> None:
    slo = SLO(100.0, 8.0)
    assert meets(outcome(100.0, 8.0), slo)
    assert not meets(outcome(100.1, 5.0), slo)
    assert not meets(outcome(50.0, 8.1), slo)
    assert not meets(outcome(None, None), slo)  # never finished
    assert meets(Outcome(500, 1, 0.0, "local", 0, 0, 90.0, None, 90.0), slo)  # no TPOT
    outs = [outcome(50, 5)] * 9 + [outcome(500, 5)]
    assert attainment(outs, slo) == pytest.approx(0.9)
    assert attainment([], slo) == 0.0


def test_goodput_is_the_highest_rate_that_attains_the_target() -> None:
    assert goodput_of({1.0: 1.0, 2.0: 0.95, 4.0: 0.5}) == 2.0
    assert goodput_of({1.0: 0.5, 2.0: 0.92}) == 2.0  # highest, whatever lies below
    assert goodput_of({1.0: TARGET - 1e-9}) == 0.0
    assert goodput_of({}) == 0.0


def test_the_sweep_doubles_then_bisects_scaled_by_the_fleet() -> None:
    capacity = 5.3  # per instance: rates above fail

    def evaluate(rate: float) -> Point:
        return Point(rate, 1.0 if rate <= capacity * 4 else 0.5, None, None, None, None, 0, {}, {})

    s = sweep(evaluate, n=4, refine=3)
    assert sorted(s.points) == [4.0, 8.0, 16.0, 20.0, 22.0, 24.0, 32.0]
    assert s.goodput == 20.0  # 5 per instance: within 1/8 of the last doubling step
    low = sweep(lambda r: Point(r, 1.0 if r <= 0.3 else 0.0, None, None, None, None, 0, {}, {}), 1)
    assert 0.25 <= low.goodput <= 0.3
    none = sweep(lambda r: Point(r, 0.0, None, None, None, None, 0, {}, {}), 2)
    assert none.goodput == 0.0


def test_arrivals_and_requests_are_seeded() -> None:
    assert poisson_arrivals(50, 4.0, 1) == poisson_arrivals(50, 4.0, 1)
    assert poisson_arrivals(50, 4.0, 1) != poisson_arrivals(50, 4.0, 2)
    slow, fast = poisson_arrivals(50, 2.0, 1), poisson_arrivals(50, 8.0, 1)
    assert [4 * t for t in fast] == pytest.approx(slow)  # one pattern, scaled
    assert requests(CHAT, 30, 3) == requests(CHAT, 30, 3) != requests(CHAT, 30, 4)
    specs = requests(CHAT, 500, 0)
    assert all(100 <= s.prompt <= 900 and 32 <= s.output <= 256 for s in specs)
    even = sorted(s.prompt for s in spread(HEAVY, 4, 0))
    assert even == [128 + round(772 * q) for q in (0.125, 0.375, 0.625, 0.875)]


@pytest.mark.parametrize("policy", ["dp", "fixed-pd", "nixl", "adaptive"])
def test_a_run_is_a_function_of_its_seed(policy: str) -> None:
    slo = SLO(220.0, 8.1)
    specs = requests(HEAVY, 120, 5)
    a = run_point(FIT, 4, policy, specs, 20.0, 5, slo)
    b = run_point(FIT, 4, policy, specs, 20.0, 5, slo)
    assert a == b  # the router's wall-clock diagnostics excluded
    other = run_point(FIT, 4, policy, requests(HEAVY, 120, 6), 20.0, 6, slo)
    assert other != a


def test_the_slos_are_four_and_one_and_a_half_times_single_c1() -> None:
    slo, ref = reference_slo(FIT, HEAVY)
    assert ref["single_c1_ttft_p50_ms"] == pytest.approx(FIT.single_ttft(514), abs=0.5)
    assert ref["single_c1_tpot_p50_ms"] == pytest.approx(FIT.single_tpot())
    assert slo.ttft_ms == pytest.approx(4 * ref["single_c1_ttft_p50_ms"])
    assert slo.tpot_ms == pytest.approx(1.5 * ref["single_c1_tpot_p50_ms"])


def test_queueing_grows_ttft_with_the_load() -> None:
    specs = requests(HEAVY, 300, 0)
    slo = SLO(220.0, 8.1)
    low = run_point(FIT, 1, "dp", specs, 1.0, 0, slo)
    high = run_point(FIT, 1, "dp", specs, 15.0, 0, slo)
    assert low.ttft_p50_ms == pytest.approx(FIT.single_ttft(514) + FIT.router_ms, rel=0.1)
    assert high.ttft_p90_ms > 2 * low.ttft_p90_ms
    assert high.ttft_p50_ms > low.ttft_p50_ms
    assert high.attainment < low.attainment


@pytest.mark.parametrize(
    ("idle_crossings", "kinds"), [(True, {"local", "pd"}), (False, {"local", "split"})]
)
def test_the_adaptive_router_keeps_its_fleet_state_consistent(
    idle_crossings: bool, kinds: set[str]
) -> None:
    slo = SLO(220.0, 8.1)
    router = AdaptiveRouter(3, FIT, slo, policy=Policy(idle_crossings=idle_crossings))
    router.check = True  # FleetState.check() after every event
    specs = requests(CHAT, 150, 1)
    out = simulate(FIT, 3, router, specs, arrivals=poisson_arrivals(150, 6.0, 1))
    assert all(o.e2e_ms is not None for o in out)  # no deadlock: every request ended
    assert router.fleet.in_flight == 0
    assert kinds <= set(router.kinds)  # it used what the policy offers
    learned = router.diagnostics()["learned"]
    assert learned["prefill_ms_per_token"] == pytest.approx(FIT.prefill_ms_per_token, rel=0.15)


def test_dp_goodput_grows_with_the_fleet() -> None:
    slo, _ = reference_slo(FIT, HEAVY)
    per_instance = []
    for n in (2, 4, 8):
        specs = requests(HEAVY, max(100, 40 * n), 0)
        s = sweep(lambda r, n=n, specs=specs: run_point(FIT, n, "dp", specs, r, 0, slo), n, 2)
        per_instance.append(s.goodput / n)
    totals = [g * n for g, n in zip(per_instance, (2, 4, 8), strict=True)]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    # monotone-ish per instance: a bigger fleet never loses more than 10 % per instance
    assert all(b >= 0.9 * a for a, b in itertools.pairwise(per_instance))


def _goodput_at_two(policy: str) -> float:
    slo, _ = reference_slo(FIT, HEAVY)
    specs = requests(HEAVY, 200, 0)
    return sweep(lambda r: run_point(FIT, 2, policy, specs, r, 0, slo), 2, 3).goodput


def test_fixed_pd_beats_dp_at_two_instances_on_prefill_heavy() -> None:
    assert _goodput_at_two("fixed-pd") > 1.5 * _goodput_at_two("dp")


def test_under_a_tight_tpot_the_fleet_specialises_and_serves_more() -> None:
    """`placement.shape`: on prefill-heavy with a TPOT SLO of 9 ms, placing one
    request at a time keeps every instance computing prompts beside decodes
    (two replicas' goodput); the `Specializer` pins one to prefill and one to
    decode while the load calls for it. On chat (long outputs) it stays out."""

    def at_two(policy: str, workload, tpot: float) -> float:
        specs = requests(workload, 400, 0)
        slo = SLO(250.0, tpot)
        return sweep(lambda r: run_point(FIT, 2, policy, specs, r, 0, slo), 2, 3).goodput

    shaped, unshaped = at_two("adaptive", HEAVY, 9.0), at_two("adaptive-unshaped", HEAVY, 9.0)
    assert shaped >= 1.5 * unshaped
    assert at_two("adaptive", CHAT, 12.0) == at_two("adaptive-unshaped", CHAT, 12.0)


def test_every_policy_is_known() -> None:
    with pytest.raises(ValueError):
        make_router("round-robin", 2, FIT, SLO())
    with pytest.raises(ValueError):
        make_router("fixed-pd", 1, FIT, SLO())


def test_fit_priors_start_the_models_from_the_simulation_costs() -> None:
    router = make_router("adaptive-fit-priors", 2, FIT, SLO())
    assert isinstance(router, AdaptiveRouter) and router.name == "adaptive-fit-priors"
    assert router.models.prefill[1].slope == pytest.approx(FIT.prefill_ms_per_token)
    assert router.models.step[0].predict(4) == pytest.approx(FIT.step_time(4, 0))
    plain = make_router("adaptive", 2, FIT, SLO())
    assert isinstance(plain, AdaptiveRouter)
    assert plain.models.prefill[1].slope > FIT.prefill_ms_per_token  # the placement's prior


def test_adaptive_concentrates_on_the_instances_it_has_learned() -> None:
    """What the simulator finds (docs/benchmarks/simulate.md):
    an instance never observed keeps the placement's prior (0.12 ms a prompt
    token), one observed learns the fit's 0.094, and `decide` ranks TTFT before
    load, so at low load a 16-instance fleet decodes on its first few instances
    and leaves the others nearly idle; from priors equal to the truth it spreads."""
    n, slo = 16, SLO(220.0, 8.1)
    specs = requests(HEAVY, 250, 0)
    spread_of = {}
    # unshaped: a specialised fleet decodes on half its instances by design
    for name, priors in (("adaptive", None), ("adaptive-fit-priors", fit_priors(FIT))):
        router = AdaptiveRouter(n, FIT, slo, priors=priors, shaping=None)
        out = run_router(router, n, specs, 16.0)
        spread_of[name] = sorted(sum(o.decode == i for o in out) for i in range(n))
    lazy = spread_of["adaptive"]
    assert sum(lazy[: n // 2]) < 0.15 * len(specs)  # half the fleet decodes under 15 %
    assert sum(spread_of["adaptive-fit-priors"][: n // 2]) > 0.3 * len(specs)


def run_router(router, n: int, specs, rate: float) -> list[Outcome]:
    return simulate(FIT, n, router, specs, arrivals=poisson_arrivals(len(specs), rate, 0))


@pytest.mark.parametrize("blind", [False, True])
def test_the_simulated_fleet_shape_counts_the_prompt_work_no_instance_holds_cached(
    blind: bool,
) -> None:
    """As the router's `Placer`: 10 req/s of 500-token prompts of which
    every instance holds 480 cached is 20-token work to the fleet's shape,
    which stays unspecialised; blind to the caches, the same load is
    500-token work and specialises the fleet (and then every prompt crosses)."""
    router = AdaptiveRouter(2, FIT, SLO(250.0, 9.0), blind=blind)
    for k in range(40):
        now_ms = k * 100.0
        placement = router.place(f"r{k}", 500, 16, now_ms, cached=(480, 480))
        if placement.kind != "local":
            router.fleet.on_prefill_done(f"r{k}", now_ms / 1000, ok=False)
        router.fleet.on_finish(f"r{k}", now_ms / 1000, output_tokens=16, ok=False)
    assert router.shape is not None
    assert router.shape.prompt_tokens == pytest.approx(500 if blind else 20)
    assert router.shape.specialized is blind
