"""The router's learned costs against the simulated instances' true ones.

The simulated engines (`simulate.instance`) run vLLM's steps: every decode
gains a token in every step, a prompt's forward included, and a prompt that
arrives mid-step waits for that step's end. The real `FleetState` and `Models`
see only dispatches, first tokens and finishes, as the router does; what they
learn under load must still be the engine's own step and prefill costs, or
the policy's TPOT predictions drift with the load.
"""

from __future__ import annotations

import pytest

from rapidkv.bench.common.shared_prefix import SHARED_PREFIX
from rapidkv.bench.simulate.engine import Simulation
from rapidkv.bench.simulate.fit import DEFAULT_FIT, Fit, load_fit
from rapidkv.bench.simulate.goodput import reference_slo
from rapidkv.bench.simulate.routers import AdaptiveRouter, make_router
from rapidkv.bench.simulate.workload import WORKLOADS, arrival_times, requests


def learned(fit: Fit, workload: object, rate: float) -> AdaptiveRouter:
    specs = requests(workload, 400, 0)
    slo, _ = reference_slo(fit, workload, 0)
    router = make_router("adaptive", 2, fit, slo)
    assert isinstance(router, AdaptiveRouter)
    caching = bool(getattr(workload, "prefix_caching", False))
    Simulation(fit, 2, router, routed=True, prefix_caching=caching).run(
        specs, arrivals=arrival_times(workload, specs, rate, 0)
    )
    return router


@pytest.mark.parametrize(
    ("fit_name", "workload", "rate"),
    [("tiny", WORKLOADS["chat"], 6.0), ("smollm2", SHARED_PREFIX, 3.0)],
    ids=["tiny-chat", "smollm2-shared-prefix"],
)
def test_the_decode_step_learned_under_load_is_the_engines(
    fit_name: str, workload: object, rate: float
) -> None:
    """At a rate near the pair's goodput (prompts computed beside most
    decodes), the step learned at batches 1-4 is the engine's within 6 %
    (a decode's tokens during another prompt's forward are steps too: taking
    the whole forward out of its time, tokens kept, learnt a step up to 20 %
    short and flat in the batch)."""
    fit = DEFAULT_FIT if fit_name == "tiny" else load_fit("smollm2")[0]
    models = learned(fit, workload, rate).models
    for batch in (1, 2, 4):
        truth = fit.step_time(batch, 0)
        for k in (0, 1):
            assert models.step_ms(k, batch) == pytest.approx(truth, rel=0.06), (k, batch)


def test_the_prefill_learned_under_load_is_the_engines_beyond_its_step() -> None:
    """A prompt's forward beyond the step it runs in, learned from service
    times that include the wait for the step in flight: within 10 % at 500
    tokens."""
    fit = DEFAULT_FIT
    models = learned(fit, WORKLOADS["chat"], 6.0).models
    truth = fit.step_time(1, 500) - fit.step_time(1, 0)
    for k in (0, 1):
        assert models.prefill_ms(k, 500) == pytest.approx(truth, rel=0.10), k
