"""The simulated router: where each request runs, and what the router learns.

Every router answers `place` for each request and hears the events the real
router sees: `prefill_done` (P's answer), `first_token` (D's own first
token), `finished` (D's answer over). Policies (`POLICIES`):

- ``dp``: `dp2` generalised, the real `balance.LeastOutstanding` over every
  instance, each request local;
- ``fixed-pd``: rapidkv's fixed 1P1D generalised: the first half of the fleet
  prefills, the second half decodes, P and D each by least outstanding
  (`LeastOutstanding`, a turn per role, as the router's `_acquire`), P's first
  token opens the stream, and a prompt is split (`split.split_point`,
  `Fit.split_fraction`, whole blocks, neither part under the router's
  `SPLIT_MIN_TOKENS`) when nothing else is in flight on P or
  on any decoder (the router's `_may_split`);
- ``nixl``: tuned `vllm-nixl` generalised: the same halves and balancing,
  never split, the transfer of `Fit.nixl_transfer_ms` (a serial proxy: D is
  asked after P's answer), the client's first token from D;
- ``adaptive``: the real policy, `placement.decide`, over a `FleetState`
  fed by the same events at the same points as the router's `placer.Placer`
  feeds it, and `Models` learning from what those events return; every
  instance may prefill and decode, block sizes known, requests splittable
  (`bench goodput` sends token-id completions), the run's SLOs, and the
  router's `Specializer` choosing the fleet's shape before each decision,
  told each prompt and what the policy is told the caches hold, and the
  run's SLOs, as `Placer.decide` tells it;
- ``adaptive-unshaped``: the same without the `Specializer` (every instance
  free to do anything at every decision, as before 2026-12-04);
- ``adaptive-busy-crossings``: the same with the router's `--busy-crossings`
  (`Policy.idle_crossings` off: PD and split from instances that hold
  requests too);
- ``adaptive-fit-priors``: the same, its `Models` starting from priors that
  are the simulation's own prefill and step costs (`Fit`) instead of the
  placement's (`Priors()`; the transfer prior unchanged): a what-if, for a
  router that knew its instances before observing them.

With prefix caching (`engine`'s ``prefix_caching``), `place` is told per
instance the prompt's leading tokens its cache holds (``cached``): ``adaptive``
passes them to `decide` as `Request.cached` (the real router's prefix index,
fetching with `Policy.fetch`: `rapidkv-adaptive`); two more policies are the
real router's other two on the workloads of shared prefixes:

- ``adaptive-blind``: ``adaptive`` with ``cached`` always empty (the
  router's ``--no-prefix-index``: `rapidkv-adaptive-blind`);
- ``adaptive-nofetch``: ``adaptive`` that counts the hits but never fetches
  (`Policy(fetch=False)`, ``--no-prefix-fetch``: `rapidkv-kv-aware-nofetch`).

``dp`` and the fixed routers never look at ``cached`` (`dp2` knows nothing
of the caches: its hits are luck).

A router never sees the simulation's truth (`Fit`): the adaptive one starts
from the placement's own priors and learns, as the real one does.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Literal, get_args

from rapidkv.bench.simulate.fit import Fit
from rapidkv.router.config import SPLIT_MIN_TOKENS
from rapidkv.router.fleet.balance import LeastOutstanding
from rapidkv.router.placement import (
    SLO,
    FleetState,
    Models,
    Placement,
    Policy,
    Priors,
    Request,
    Shaping,
    Specializer,
    decide,
)
from rapidkv.router.placement.shape import DEFAULT_SHAPING
from rapidkv.router.split import split_point

PolicyName = Literal[
    "dp",
    "fixed-pd",
    "nixl",
    "adaptive",
    "adaptive-blind",
    "adaptive-nofetch",
    "adaptive-fit-priors",
    "adaptive-unshaped",
    "adaptive-busy-crossings",
]
POLICIES: tuple[str, ...] = get_args(PolicyName)
Connector = Literal["rapidkv", "nixl"]


class Router:
    """A policy's placement and bookkeeping (see the module docstring)."""

    name: str = ""
    connector: Connector = "rapidkv"
    p_first_token: bool = True  # a PD request's first token is P's (rapidkv's dual dispatch)

    def __init__(self, n: int) -> None:
        self.n = n
        self.kinds: Counter[str] = Counter()

    def place(
        self, rid: str, prompt: int, output: int, now_ms: float, cached: tuple[int, ...] = ()
    ) -> Placement:
        """Where request `rid` runs; `cached`: per instance, the prompt's leading
        tokens its prefix cache holds (empty without prefix caching)."""
        raise NotImplementedError

    def prefill_done(self, rid: str, now_ms: float) -> None:
        pass

    def first_token(self, rid: str, now_ms: float) -> None:
        pass

    def finished(self, rid: str, now_ms: float, output_tokens: int) -> None:
        pass

    def diagnostics(self) -> dict[str, object]:
        """What the run says about the router beyond the placements (not deterministic)."""
        return {}


class LocalRouter(Router):
    """``dp``: least outstanding requests, every request local."""

    name = "dp"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.balancer = LeastOutstanding(n)
        self.where: dict[str, int] = {}

    def place(
        self, rid: str, prompt: int, output: int, now_ms: float, cached: tuple[int, ...] = ()
    ) -> Placement:
        i = self.balancer.acquire(turn="decode")
        self.where[rid] = i
        self.kinds["local"] += 1
        return Placement("local", i, i)

    def finished(self, rid: str, now_ms: float, output_tokens: int) -> None:
        self.balancer.release(self.where.pop(rid))


class FixedPdRouter(Router):
    """``fixed-pd`` and ``nixl``: half the fleet prefills, half decodes."""

    def __init__(self, n: int, fit: Fit, *, nixl: bool = False, split: bool = True) -> None:
        if n < 2:
            raise ValueError("a P/D fleet needs at least 2 instances")
        super().__init__(n)
        self.name = "nixl" if nixl else "fixed-pd"
        self.connector = "nixl" if nixl else "rapidkv"
        self.p_first_token = not nixl
        self.split = split and not nixl  # False: `rapidkv-whole` (--no-split-prefill)
        self.fit = fit
        self.prefill_pool = list(range(n // 2))
        self.decode_pool = list(range(n // 2, n))
        self.balancer = LeastOutstanding(n)
        self.where: dict[str, tuple[int, int]] = {}

    def place(
        self, rid: str, prompt: int, output: int, now_ms: float, cached: tuple[int, ...] = ()
    ) -> Placement:
        b = self.balancer
        d = b.acquire(self.decode_pool, turn="decode")
        p = b.acquire(self.prefill_pool, turn="prefill")
        self.where[rid] = (p, d)
        head = 0
        if self.split and all(
            b.outstanding(i) == (1 if i in (p, d) else 0) for i in {p, *self.decode_pool}
        ):
            head = split_point(
                prompt, self.fit.block_size, self.fit.split_fraction, SPLIT_MIN_TOKENS
            )
        placement = Placement("split", p, d, head) if head else Placement("pd", p, d)
        self.kinds[placement.kind] += 1
        return placement

    def prefill_done(self, rid: str, now_ms: float) -> None:
        self.balancer.release(self.where[rid][0])

    def finished(self, rid: str, now_ms: float, output_tokens: int) -> None:
        self.balancer.release(self.where.pop(rid)[1])


class AdaptiveRouter(Router):
    """``adaptive``: `placement.decide` over a `FleetState`, `Models` learning."""

    name = "adaptive"

    def __init__(
        self,
        n: int,
        fit: Fit,
        slo: SLO,
        policy: Policy | None = None,
        priors: Priors | None = None,
        shaping: Shaping | None = DEFAULT_SHAPING,
        blind: bool = False,
    ) -> None:
        super().__init__(n)
        self.blind = blind  # never told what the instances hold (--no-prefix-index)
        self.slo = slo
        self.policy = Policy() if policy is None else policy
        self.fleet = FleetState(n)
        self.shape = None if shaping is None else Specializer(shaping)
        for i in range(n):
            self.fleet.set_block_size(i, fit.block_size)
            self.fleet.set_max_num_seqs(i, fit.max_num_seqs)
        self.models = Models(n, priors)
        self.check = False  # FleetState.check() after every event (tests)
        self.reasons: Counter[str] = Counter()
        self.decide_s = 0.0

    def place(
        self, rid: str, prompt: int, output: int, now_ms: float, cached: tuple[int, ...] = ()
    ) -> Placement:
        t = time.perf_counter()
        seen = () if self.blind else cached  # what the router is told the instances hold
        if self.shape is not None:  # as the router's `Placer.decide`
            self.shape.arrived(now_ms / 1000, prompt, output, seen)
            self.shape.apply(
                self.fleet, ("any",) * self.n, self.models, self.slo.tpot_ms, self.slo.ttft_ms
            )
        request = Request(prompt, output, True, seen)
        d = decide(self.fleet, self.models, request, self.slo, self.policy)
        self.decide_s += time.perf_counter() - t
        self.kinds[d.kind] += 1
        self.reasons[d.reason] += 1
        self.fleet.on_dispatch(
            rid, d.placement, max(prompt, d.head_tokens + 1), now_ms / 1000, output_tokens=output
        )
        self._checked()
        return d.placement

    def prefill_done(self, rid: str, now_ms: float) -> None:
        self._learn(self.fleet.on_prefill_done(rid, now_ms / 1000, ok=True))

    def first_token(self, rid: str, now_ms: float) -> None:
        self._learn(self.fleet.on_first_token(rid, now_ms / 1000))

    def finished(self, rid: str, now_ms: float, output_tokens: int) -> None:
        self._learn(self.fleet.on_finish(rid, now_ms / 1000, output_tokens=output_tokens))

    def diagnostics(self) -> dict[str, object]:
        decisions = sum(self.kinds.values())
        m = self.models
        return {
            "reasons": dict(sorted(self.reasons.items())),
            "decide_ms_mean": 1000 * self.decide_s / decisions if decisions else None,
            "learned": {
                "prefill_ms_per_token": _mean(c.slope for c in m.prefill),
                "prefill_ms": _mean(c.intercept for c in m.prefill),
                "step_ms": _mean(c.intercept for c in m.step),
                "step_ms_per_request": _mean(c.slope for c in m.step),
                "transfer_ms": _mean(c.intercept for c in m.transfer.values()),
            },
        }

    def _learn(self, observations: list) -> None:
        for obs in observations:
            self.models.learn(obs)
        self._checked()

    def _checked(self) -> None:
        if self.check:
            self.fleet.check()


def make_router(policy: str, n: int, fit: Fit, slo: SLO) -> Router:
    """The router of `policy` (one of `POLICIES`) for `n` instances."""
    if policy == "dp":
        return LocalRouter(n)
    if policy == "fixed-pd":
        return FixedPdRouter(n, fit)
    if policy == "nixl":
        return FixedPdRouter(n, fit, nixl=True)
    if policy == "adaptive":
        return AdaptiveRouter(n, fit, slo)
    if policy == "adaptive-blind":
        router = AdaptiveRouter(n, fit, slo, blind=True)
        router.name = policy
        return router
    if policy == "adaptive-nofetch":
        router = AdaptiveRouter(n, fit, slo, policy=Policy(fetch=False))
        router.name = policy
        return router
    if policy == "adaptive-unshaped":
        router = AdaptiveRouter(n, fit, slo, shaping=None)
        router.name = policy
        return router
    if policy == "adaptive-busy-crossings":
        router = AdaptiveRouter(n, fit, slo, policy=Policy(idle_crossings=False))
        router.name = policy
        return router
    if policy == "adaptive-fit-priors":
        router = AdaptiveRouter(n, fit, slo, priors=fit_priors(fit))
        router.name = policy
        return router
    raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")


def fit_priors(fit: Fit) -> Priors:
    """The placement's priors with the prefill and step lines of `fit` (the transfer's kept)."""
    return Priors(
        prefill_ms=fit.prefill_ms,
        prefill_ms_per_token=fit.prefill_ms_per_token,
        step_ms=fit.step_ms,
        step_ms_per_request=fit.step_ms_per_seq,
    )


def _mean(values: object) -> float | None:
    vs = list(values)  # type: ignore[call-overload]
    return sum(vs) / len(vs) if vs else None
