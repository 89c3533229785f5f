"""The fleet's shape (`placement.shape`): when instances that may do anything
specialise, and what roles they take."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidkv.router.placement import SLO, FleetState, Models, Placement, Request, decide
from rapidkv.router.placement.shape import Shaping, Specializer, poisson_quantile, poisson_tail
from rapidkv.router.placement.state import Role

pytestmark = pytest.mark.unit


def test_the_poisson_quantile() -> None:
    assert poisson_quantile(0.0, 0.95) == 0
    assert poisson_quantile(1.0, 0.5) == 1  # P(0) = 0.37, P(<= 1) = 0.74
    assert poisson_quantile(1.0, 0.95) == 3  # P(<= 2) = 0.92, P(<= 3) = 0.98
    assert poisson_quantile(0.05, 0.95) == 0  # P(0) = 0.951
    big = poisson_quantile(1000.0, 0.95)  # the normal approximation
    assert 1045 <= big <= 1056


def test_the_recent_rate_and_means_follow_the_arrivals() -> None:
    s = Specializer(Shaping(tau_s=2.0))
    for k in range(200):  # 10 req/s for 20 s
        s.arrived(k / 10, 400 if k % 2 else 600, 16)
    assert s.rate_per_s == pytest.approx(10.0, rel=0.05)
    assert s.prompt_tokens == pytest.approx(500, abs=10) and s.output_tokens == 16
    s.arrived(40.0, 500, 16)  # 20 s of silence: the rate has decayed away
    assert s.rate_per_s < 0.6
    s.arrived(39.0, 500, 16)  # out of order: taken as the latest time, no decay
    assert s.rate_per_s < 1.2


def loaded(rate: float, prompt: int, output: int) -> Specializer:
    s = Specializer()
    for k in range(int(rate * 20)):
        s.arrived(k / rate, prompt, output)
    return s


def test_pressure_is_the_tail_of_prompts_landing_beside_a_decode_over_its_slack() -> None:
    models = Models(2)
    s = loaded(8.0, 500, 16)
    step, pf = models.step_ms(0, 2), models.prefill_ms(0, s.prompt_tokens)
    landings = poisson_quantile(s.rate_per_s / 2 * 16 * step / 1000, 0.95)
    for tpot in (9.0, 12.0, 18.0):
        want = landings * pf / ((tpot - step) * 16)
        assert s.pressure(models, [0, 1], tpot) == pytest.approx(want)
    assert s.pressure(models, [0, 1], 9.0) > s.pressure(models, [0, 1], 18.0)
    assert s.pressure(models, [0, 1], step) == math.inf  # a step alone breaks the SLO
    assert s.pressure(models, [], 9.0) == 0.0
    assert Specializer().pressure(models, [0, 1], 9.0) == 0.0  # no load seen
    # long outputs spread a prompt's stall over more tokens
    assert loaded(8.0, 500, 144).pressure(models, [0, 1], 12.0) < s.pressure(models, [0, 1], 12.0)


def roles(fleet: FleetState) -> list[Role]:
    return [load.role for load in fleet.view()]


def test_a_tight_slo_pins_half_to_prefill_half_to_decode_and_a_loose_one_lets_go() -> None:
    models, fleet, anyway = Models(2), FleetState(2), ["any", "any"]
    s = loaded(8.0, 500, 16)
    assert s.apply(fleet, anyway, models, 9.0) and roles(fleet) == ["prefill", "decode"]
    assert s.switches == 1 and s.last_pressure >= 1.0
    # specialised, no local option is left, and the prompt goes to instance 0
    d = decide(fleet, models, Request(500, 16, True), SLO(250.0, 9.0))
    assert d.placement.kind in ("pd", "split") and (d.prefill, d.decode) == (0, 1)
    assert not s.apply(fleet, anyway, models, 40.0) and roles(fleet) == ["any", "any"]
    assert s.switches == 2


def test_between_off_and_on_the_shape_holds() -> None:
    models, fleet, anyway = Models(2), FleetState(2), ["any", "any"]
    s = loaded(8.0, 500, 16)
    p9 = s.pressure(models, [0, 1], 9.0)
    # an SLO whose pressure lies between off (0.7) and on (1.0) of the shaping
    tpot = next(t / 10 for t in range(90, 400) if 0.75 <= s.pressure(models, [0, 1], t / 10) < 0.95)
    assert p9 >= 1.0
    assert not s.apply(fleet, anyway, models, tpot)  # not on yet: stays replicas
    assert s.apply(fleet, anyway, models, 9.0)
    assert s.apply(fleet, anyway, models, tpot)  # not below off: stays specialised
    assert s.switches == 1


def test_configured_roles_are_kept_and_two_free_instances_are_needed() -> None:
    models = Models(3)
    s = loaded(8.0, 500, 16)
    fleet = FleetState(3, ("prefill", "any", "any"))
    assert s.apply(fleet, ["prefill", "any", "any"], models, 9.0)
    assert roles(fleet) == ["prefill", "prefill", "decode"]  # the free ones split in half
    one_free = FleetState(2, ("prefill", "any"))
    assert not Specializer().apply(one_free, ["prefill", "any"], models, 9.0)
    assert not loaded(8.0, 500, 16).apply(one_free, ["prefill", "any"], models, 9.0)
    assert roles(one_free) == ["prefill", "any"]
    # an instance that goes down leaves one free instance: back to as configured
    fleet.set_healthy(2, False)
    assert not s.apply(fleet, ["prefill", "any", "any"], models, 9.0)
    assert roles(fleet) == ["prefill", "any", "any"]


def test_the_decodes_in_flight_are_the_tail_of_littles_law() -> None:
    models = Models(2)
    s = loaded(20.0, 500, 64)
    step = models.step_ms(0, 2)
    want = poisson_quantile(s.rate_per_s * 64 * step / 1000, 0.95)
    assert s.decodes(models, [0, 1]) == want > 20 * 64 * step / 1000  # a tail, above the mean
    assert s.decodes(models, []) == 0 and Specializer().decodes(models, [0, 1]) == 0
    assert loaded(20.0, 500, 16).decodes(models, [0, 1]) < want  # shorter outputs, fewer


def test_no_specialising_when_the_decoders_alone_could_not_hold_the_decodes() -> None:
    models, fleet, anyway = Models(2), FleetState(2), ["any", "any"]
    s = loaded(20.0, 500, 64)  # ~7 decodes in flight, 12 at the tail: one instance steps past 9 ms
    assert s.pressure(models, [0, 1], 9.0) >= 1.0  # prompts beside decodes would break the SLO
    assert models.step_ms(1, s.decodes(models, [0, 1]) + 1) >= 9.0
    assert not s.apply(fleet, anyway, models, 9.0) and roles(fleet) == ["any", "any"]
    assert s.held_by == "decodes"
    short = loaded(20.0, 500, 16)  # the same rate of 16-token answers: one decoder holds them
    assert short.apply(fleet, anyway, models, 9.0) and roles(fleet) == ["prefill", "decode"]


def test_decodes_waiting_behind_a_busy_prefill_instance_do_not_unpin_the_fleet() -> None:
    models, fleet, anyway = Models(2), FleetState(2), ["any", "any"]
    s = loaded(8.0, 500, 16)
    assert s.apply(fleet, anyway, models, 9.0)
    for k in range(20):  # a burst: 20 PDs queued on the prefill instance, all bound for 1
        fleet.on_dispatch(f"r{k}", Placement("pd", 0, 1), 500, 0.0, 16)
        s.arrived(20.0, 500, 16)
    assert fleet.view()[1].decodes == 20 and models.step_ms(1, 21) >= 9.0
    assert s.apply(fleet, anyway, models, 9.0) and roles(fleet) == ["prefill", "decode"]


@pytest.mark.parametrize(("holder", "pinned"), [(0, True), (1, False)])
def test_the_fleet_is_not_pinned_where_its_prefill_half_would_lose_the_hits(
    holder: int, pinned: bool
) -> None:
    """The load that pins a pair (8 req/s, 500 tokens of prompt work, 16-token
    answers, TPOT SLO 9 ms), each prompt 1,500 tokens of which 1,000 are
    cached on one instance: held by instance 0, the prefill half, the pair is
    pinned as without a cache; held by 1 alone, pinning would have 0
    recompute 1,000 tokens a prompt, more than the 500 the fleet computes,
    and it stays as configured (a kv-aware pair pinned to PD had one
    instance's cache for every prefix: bench goodput, 2026-12-07)."""
    models, fleet, anyway = Models(2), FleetState(2), ["any", "any"]
    s = Specializer()
    cached = (1000, 0) if holder == 0 else (0, 1000)  # of 1,500-token prompts
    for k in range(160):
        s.arrived(k / 8.0, 1500, 16, cached)
        s.apply(fleet, anyway, models, 9.0)
    assert s.lost_tokens == pytest.approx(0 if pinned else 1000)
    assert s.pressure(models, [0, 1], 9.0) >= 1.0
    assert s.specialized is pinned
    assert s.held_by == (None if pinned else "hits")
    assert roles(fleet) == (["prefill", "decode"] if pinned else ["any", "any"])


def hits_and_cold(ttft_ms: float) -> tuple[Specializer, Models]:
    """A pair under a tight TPOT SLO (8 ms, the priors' costs) at 4 req/s:
    40-token prompts (the rest of each prompt held cached everywhere) and
    every 8th one 8,000 tokens cold (~1 s of prefill), 16-token answers; the
    shape applied at each arrival with `ttft_ms` as the TTFT SLO."""
    models, fleet, s = Models(2), FleetState(2), Specializer()
    for k in range(200):
        s.arrived(k / 4.0, 8000 if k % 8 == 0 else 40, 16)
        s.apply(fleet, ["any", "any"], models, 8.0, ttft_ms)
    return s, models


def test_the_fleet_is_not_pinned_where_its_prefill_half_would_queue_prompts_past_the_ttft_slo() -> (
    None
):
    """Hits behind cold prompts (a shared-prefix load on a CPU whose cold
    prefill is slow: bench goodput, 2026-12-07): pinned, one instance
    computes every prompt and the hits wait behind the cold ones, more of
    them than unpinned would miss on TTFT and TPOT together; the TPOT
    pressure alone would pin the pair all the same."""
    s, models = hits_and_cold(300.0)
    assert s.pressure(models, [0, 1], 8.0) >= 1.0
    pinned = s.ttft_miss(models, [0], 300.0, pinned=True)
    unpinned = s.ttft_miss(models, [0, 1], 300.0, pinned=False)
    assert pinned > 0.1 and unpinned + s.tpot_miss(models, [0, 1], 8.0) < pinned
    assert not s.specialized and s.held_by == "ttft" and s.switches <= 2
    loose, _ = hits_and_cold(3000.0)  # a TTFT SLO the prefill instance meets pinned
    assert loose.ttft_miss(models, [0], 3000.0, pinned=True) < 0.07
    assert loose.specialized and loose.held_by is None
    no_slo, _ = hits_and_cold(math.inf)
    assert no_slo.specialized and no_slo.switches == 1


def test_the_share_of_prompts_queued_past_the_ttft_slo_is_an_m_g_1_tail() -> None:
    """Uniform prompts (M/D/1 in their tokens): the share by hand from the
    priors' costs, and what bounds it."""
    models, fleet, s = Models(2), FleetState(2), Specializer()
    for k in range(100):
        s.arrived(k / 5.0, 500, 16)
        s.apply(fleet, ["any", "any"], models, 100.0)
    queued = models.prefill[0].slope * 500  # a forward's fixed cost is shared, not queued
    own = models.prefill_ms(0, 500) + models.step_ms(0, 1)
    lam = s.rate_per_s / 1000
    rho = lam * queued
    wait = lam * queued**2 / (2 * (1 - rho))
    want = rho * math.exp(-rho * (250.0 - own) / wait)
    assert s.ttft_miss(models, [0], 250.0, pinned=True) == pytest.approx(want)
    assert 0 < want < s.ttft_miss(models, [0], 100.0, pinned=True) < 1
    spread = s.ttft_miss(models, [0, 1], 250.0, pinned=False)  # half the rate each
    assert spread < want
    assert s.ttft_miss(models, [0], own - 1, pinned=True) == 1.0  # its own forward misses
    assert s.ttft_miss(models, [0], math.inf, pinned=True) == 0.0  # no SLO
    assert s.ttft_miss(models, [], 250.0, pinned=True) == 0.0
    assert Specializer().ttft_miss(models, [0], 250.0, pinned=True) == 0.0  # no load seen
    for k in range(100, 400):  # 20 req/s of 500 tokens: more than one instance computes
        s.arrived(k / 20.0, 500, 16)
        s.apply(fleet, ["any", "any"], models, 100.0)
    assert s.ttft_miss(models, [0], 1e9, pinned=True) == 1.0


def test_the_share_of_decodes_past_the_tpot_slo_unpinned_is_a_poisson_tail() -> None:
    models = Models(2)
    s = loaded(8.0, 500, 16)
    step = models.step_ms(0, 2)
    mean = s.rate_per_s / 2 * 16 * step / 1000
    pf = models.prefill_ms(0, s.prompt_tokens)
    for tpot in (9.0, 12.0, 30.0):
        absorbed = math.floor((tpot - step) * 16 / pf)
        want = 1 - sum(math.exp(-mean) * mean**j / math.factorial(j) for j in range(absorbed + 1))
        assert s.tpot_miss(models, [0, 1], tpot) == pytest.approx(want)
    assert s.tpot_miss(models, [0, 1], 9.0) > s.tpot_miss(models, [0, 1], 30.0)
    assert s.tpot_miss(models, [0, 1], step) == 1.0  # a step alone breaks the SLO
    assert s.tpot_miss(models, [], 9.0) == 0.0 and Specializer().tpot_miss(models, [0, 1], 9.0) == 0


@pytest.mark.timeout(60)
def test_the_poisson_tail() -> None:
    assert poisson_tail(1.0, -1) == 1.0 and poisson_tail(0.0, 0) == 0.0
    assert poisson_tail(1.0, 0) == pytest.approx(1 - math.exp(-1))
    assert poisson_tail(1.0, 2) == pytest.approx(1 - 2.5 * math.exp(-1))
    assert poisson_tail(1000.0, 1000) == pytest.approx(0.5, abs=0.02)  # the normal approximation
    # a decode's slack for 10^12 tiny prefills: the sum ends where the CDF
    # stops moving (the test's timeout), not at k
    assert poisson_tail(3.0, 10**12) == 0.0
    for mean in (0.05, 1.0, 7.0):
        k = poisson_quantile(mean, 0.95)
        assert poisson_tail(mean, k) <= 0.05 < poisson_tail(mean, k - 1)


def test_shaping_is_validated() -> None:
    bad_ones = ({"tau_s": 0}, {"quantile": 1.0}, {"off": 1.2, "on": 1.0}, {"off": 0})
    for bad in (*bad_ones, {"ttft_miss": 0.0}, {"ttft_miss": 1.0}):
        with pytest.raises(ValueError):
            Shaping(**bad)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["any", "any", "prefill", "decode"]), min_size=1, max_size=6),
    st.lists(
        st.tuples(
            st.floats(0.0, 0.5),  # gap before the request, s
            st.integers(1, 2000),  # prompt tokens
            st.integers(1, 300),  # output tokens
            st.floats(5.0, 60.0),  # TPOT SLO, ms
            st.integers(0, 5),  # an instance whose health flips
        ),
        max_size=40,
    ),
    st.floats(20.0, 2000.0),  # TTFT SLO, ms
)
def test_the_roles_always_follow_the_shape_and_the_configuration(
    configured: list[Role], events: list[tuple[float, int, int, float, int]], ttft: float
) -> None:
    n = len(configured)
    models, fleet, s = Models(n), FleetState(n, tuple(configured)), Specializer()
    now, flips, was = 0.0, 0, False
    for gap, prompt, output, tpot, flip in events:
        now += gap
        if flip < n:
            up = fleet.view()[flip].healthy
            fleet.set_healthy(flip, not up)
        s.arrived(now, prompt, output)
        on = s.apply(fleet, configured, models, tpot, ttft)
        flips += on != was
        was = on
        loads = fleet.view()
        free = [k for k, load in enumerate(loads) if load.available and configured[k] == "any"]
        half = set(free[: max(1, len(free) // 2)])
        for k, load in enumerate(loads):
            assert fleet.available(k) == load.available
            if on and k in free:
                assert load.role == ("prefill" if k in half else "decode")
            else:
                assert load.role == configured[k]  # pinned by configuration, or not shaped
        assert not on or len(free) >= 2
        for pinned in (False, True):
            assert 0.0 <= s.ttft_miss(models, free, ttft, pinned) <= 1.0
        assert on == s.specialized and s.switches == flips
