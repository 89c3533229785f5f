"""The fleet's shape: when instances that may do anything should specialise.

`decide` places one request at a time, and under a tight TPOT SLO that is not
enough: every prompt computed beside a decode stalls it, and no single
decision commits an instance to decoding only, which is what a fixed P/D
pair does and why it wins there. `Specializer` chooses the shape instead, from
the load the router sees and the costs the `Models` learned:

    pressure = N_q * pf(P) / ((SLO_tpot - step(2)) * L)

the tail number of prompts that will land on a new decode's instance while it
decodes, times the stall of one prompt spread over the decode, over the slack
the TPOT SLO leaves beside a step of two decodes. ``N_q`` is the
`Shaping.quantile` of a Poisson count of mean ``lambda / n * L * step(2) /
1000`` (``lambda`` the recent arrival rate, req/s, decayed over
`Shaping.tau_s`; ``n`` the available instances; ``L`` and ``P`` the recent
mean output tokens and prompt work (`prompt_work`: the prompt less what some
instance holds cached); ``pf`` and ``step`` the mean learned costs
over those instances). Pressure 1 says: at the tail, the prompts landing
beside a decode take it past the SLO. The fleet specialises when pressure
reaches `Shaping.on`, unless its decoders alone could not hold the decodes
within the SLO, and goes back when pressure falls below `Shaping.off`
(hysteresis: a load near the threshold does not flap). The decodes are those
the recent load keeps in flight, by Little's law: the `Shaping.quantile` of a
Poisson count of mean ``lambda * L * step(2) / 1000``, shared among the
decoders, plus the new one; they could not be held when a step of that many
reaches the SLO (long outputs need every instance decoding). Not the decodes
the fleet holds this instant: while the prefill instances queue, the
requests waiting there for their KV already count as decodes of the
decoders, and a veto from them unpinned the fleet exactly when it was
busiest (simulated, default SLOs, prefill-heavy, 32 instances: attainment
1.0 at 224 req/s, then 0.60 at 240 as the fleet flapped between shapes;
counted by Little's law, goodput 240, a fixed P/D split 256).

Nor does it specialise while its prefill half would recompute more than the
fleet computes: per request, the prompt tokens some instance holds cached
and no would-be prefill instance does (`Specializer.arrived`'s ``cached``),
against the prompt work no instance holds (`prompt_work`), both as recent
means. Pinned, every prompt is computed on the prefill half, whose caches
must then hold every prefix the fleet held. Simulated (`bench simulate`,
SmolLM2 fit, `bench goodput`'s shared-prefix: 12 system prompts of 8 blocks,
90-block caches, 2 instances, a warm-up of 16 requests an instance): the
kv-aware router with fetches 5.0 req/s against 3.2 without this veto; the
length workloads, multiturn and shared-prefix's other routers unchanged.

Nor while pinning alone would queue prompts past the TTFT SLO. Pinned,
every prompt is computed on the prefill half, one after another, and a cold
prompt there delays every prompt behind it. A set of instances computing
every prompt among them is taken as M/G/1 queues (`Specializer.ttft_miss`):
Poisson arrivals at ``lambda / h`` each (``h`` the instances), service
``S = b w`` for a prompt of ``w`` tokens (``b`` the learned prefill cost a
token: queued prompts share forwards, so a forward's fixed cost is not
queued), whose first two moments come from the recent means of ``w`` and
``w^2`` (`TAIL_WEIGHT`). The mean wait is Pollaczek-Khinchine's ``W =
lambda_h E[S^2] / (2 (1 - rho))``, ``rho = lambda_h E[S]``, and the share
of prompts that wait past the SLO less a mean prompt's own forward
(``step(1) + pf(E[w])``) is taken as ``rho * exp(-rho t / W)`` (the
exponential tail with that mean and that chance of waiting at all; 1 for
``rho >= 1``). The fleet is not pinned while that share on the prefill half
(``w`` a prompt's work plus its lost tokens) is above `Shaping.ttft_miss`
(times ``off / on`` to pin: the pressure's hysteresis) and above what
unpinned misses: that share on all the instances (``w`` its prompt work)
plus the share of decodes whose TPOT the prompts landing beside them break
(`Specializer.tpot_miss`: the pressure's Poisson count above the prompts
whose prefills fit in a decode's slack). Not weighed: the crossing's
transfer, D's first step, and the decodes beside an unpinned instance's
prompts in its TTFT. What this veto does to simulated goodput:
docs/benchmarks/simulate.md, "Since 2026-12-07".

Specialised, among the available instances configured ``any``, the first half
by index (at least one) only prefill and the rest only decode (the roles
`decide` reads: PD and split from the first to the second, no local); an
instance with a configured role keeps it, one not available keeps ``any``.
Fewer than two available ``any`` instances never specialise.

Simulated (`bench simulate`'s instance models, default fit, 2 instances, TTFT
SLO 250 ms, 400 requests a rate, seeds 0 / 1 / 2), goodput in req/s of
`decide` with a `Specializer` against `decide` alone: prefill-heavy at a TPOT
SLO of 9 ms 12 / 9 / 9 against 5.5 / 5.5 / 5.5 (a fixed P/D pair 13 / 11 /
9), at 12 ms 13 / 9 / 8 against 11 / 9 / 8, at 18 ms 16 / 15 / 12 against
the same; chat the same at every SLO and seed. Lower thresholds (on 0.7 /
off 0.5, or 0.5 / 0.35) gain a step at 9 and 12 ms and lose one to four at
18 ms; a quantile of 0.8 loses at 9 and 12 ms. At the default SLOs
(TTFT 4x, TPOT 1.5x a single instance's), prefill-heavy on 2 / 4 / 8 / 16 /
32 / 64 instances, with `Policy.idle_crossings` and `Policy.free_split`: 11 /
26 / 60 / 112 / 240 / 512 req/s (fixed P/D 11 / 28 / 64 / 120 / 256 / 576,
replicas 5 / 16 / 40 / 88 / 192 / 448); chat level with replicas from 4 instances on
(docs/benchmarks/simulate.md, the default simulated run).

Pure: every call takes its time (monotonic seconds) as an argument.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from rapidkv.router.placement.model import Models
from rapidkv.router.placement.state import FleetState, Role

MEAN_WEIGHT = 0.05
"""The weight of each new request in the recent mean prompt and output tokens."""

TAIL_WEIGHT = 0.01
"""The weight of each new request in the recent means that weigh the TTFT of
pinning (prompt work and its square, pinned and not): longer memory, as a
few cold prompts among many hits make that tail."""


@dataclass(frozen=True)
class Shaping:
    """`Specializer`'s parameters (module docstring)."""

    tau_s: float = 2.0
    quantile: float = 0.95
    on: float = 1.0
    off: float = 0.7
    ttft_miss: float = 0.1  # the share of prompts pinning may queue past the TTFT SLO

    def __post_init__(self) -> None:
        if not (
            self.tau_s > 0
            and 0 < self.quantile < 1
            and 0 < self.off <= self.on
            and 0 < self.ttft_miss < 1
        ):
            raise ValueError(
                f"need tau_s > 0, 0 < quantile < 1, 0 < off <= on, 0 < ttft_miss < 1: {self}"
            )


DEFAULT_SHAPING = Shaping()

HELD_BY = ("decodes", "hits", "ttft")
"""What may keep the fleet unpinned though the pressure calls for pinning
(`Specializer.held_by`): its decoders alone could not hold the decodes
within the TPOT SLO; the prefill half would lose the caches' hits; pinning
alone would queue prompts past the TTFT SLO (the module docstring)."""


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest n with P(N <= n) >= q for N ~ Poisson(mean)."""
    if mean <= 0:
        return 0
    if mean > 500:  # the normal approximation; exp(-mean) underflows
        return math.ceil(mean + NormalDist().inv_cdf(q) * math.sqrt(mean))
    return next(n for n, cdf in enumerate(_poisson_cdf(mean)) if cdf >= q)


class Specializer:
    """The recent load and the shape it calls for (module docstring)."""

    def __init__(self, shaping: Shaping = DEFAULT_SHAPING) -> None:
        self.shaping = shaping
        self.rate_per_s = 0.0  # recent arrivals, decayed
        self.prompt_tokens = 0.0  # recent mean
        self.output_tokens = 0.0  # recent mean
        self.specialized = False
        self.switches = 0
        self.last_pressure = 0.0  # at the last `apply`
        # at the last `apply`, what kept the fleet unpinned though the pressure
        # called for pinning (`HELD_BY`), else None
        self.held_by: str | None = None
        self.lost_tokens = 0.0  # recent mean: cached tokens pinning would recompute
        # the tail's recent means (`TAIL_WEIGHT`): a prompt's work and its
        # square, as it is (`work`) and pinned (plus its lost tokens)
        self.work = (0.0, 0.0)
        self.pinned_work = (0.0, 0.0)
        self._last_s: float | None = None
        # the last arrival's prompt work and cached tokens per instance, until `apply`
        self._pending: tuple[int, Sequence[int]] | None = None
        self._counted = 0  # arrivals counted by `_count_lost`

    def arrived(
        self, now_s: float, tokens: int, output_tokens: int, cached: Sequence[int] = ()
    ) -> None:
        """One request arrived at `now_s` (an earlier time counts as `now_s`
        of the last one): a prompt of `tokens` tokens, `output_tokens` asked
        for, and per instance the prompt's leading tokens it holds cached
        (`cached`). Its prompt work is `prompt_work`; what pinning would
        recompute of it, the next `apply` counts."""
        work = prompt_work(tokens, cached)
        self._pending = (work, cached)
        tau = self.shaping.tau_s
        if self._last_s is None:
            self.prompt_tokens, self.output_tokens = float(work), float(output_tokens)
        else:
            if now_s > self._last_s:
                self.rate_per_s *= math.exp(-(now_s - self._last_s) / tau)
            self.prompt_tokens += MEAN_WEIGHT * (work - self.prompt_tokens)
            self.output_tokens += MEAN_WEIGHT * (output_tokens - self.output_tokens)
        self._last_s = now_s if self._last_s is None else max(now_s, self._last_s)
        self.rate_per_s += 1 / tau

    def pressure(self, models: Models, available: Sequence[int], tpot_ms: float) -> float:
        """The module docstring's pressure over the `available` instances (inf
        when a step alone breaks the SLO, 0 with no instance or no load)."""
        if not available or self.rate_per_s <= 0 or self.output_tokens <= 0:
            return 0.0
        mean, slack, pf = self._landings(models, available, tpot_ms)
        if slack <= 0:
            return math.inf
        landings = poisson_quantile(mean, self.shaping.quantile)
        return landings * pf / (slack * self.output_tokens)

    def _landings(
        self, models: Models, available: Sequence[int], tpot_ms: float
    ) -> tuple[float, float, float]:
        """Over the `available` instances (not empty): the mean number of
        prompts that land on a new decode's instance while it decodes, the
        slack the TPOT SLO leaves beside a step of two, and a mean prompt's
        prefill (ms)."""
        n = len(available)
        step = _mean_step(models, available)
        pf = sum(models.prefill_ms(k, self.prompt_tokens) for k in available) / n
        mean = self.rate_per_s / n * self.output_tokens * step / 1000
        return mean, tpot_ms - step, pf

    def decodes(self, models: Models, available: Sequence[int]) -> int:
        """The decodes the recent load keeps in flight over the `available`
        instances, at the tail (module docstring; 0 with no load seen)."""
        if not available or self.rate_per_s <= 0 or self.output_tokens <= 0:
            return 0
        mean = self.rate_per_s * self.output_tokens * _mean_step(models, available) / 1000
        return poisson_quantile(mean, self.shaping.quantile)

    def ttft_miss(
        self, models: Models, instances: Sequence[int], ttft_ms: float, pinned: bool
    ) -> float:
        """The share of prompts `instances` would queue past `ttft_ms`,
        computing every prompt among them: pinned to prefill (`pinned`: each
        prompt's work plus its lost tokens) or the whole fleet (its prompt
        work). Module docstring; 0 with no load seen, no instance or no SLO
        (an infinite `ttft_ms`), 1 where they could not keep up."""
        if not instances or self.rate_per_s <= 0 or self._counted == 0 or math.isinf(ttft_ms):
            return 0.0
        w, w_sq = self.pinned_work if pinned else self.work
        h = len(instances)
        b = sum(models.prefill[k].slope for k in instances) / h
        own = sum(models.prefill_ms(k, w) + models.step_ms(k, 1) for k in instances) / h
        lam = self.rate_per_s / h / 1000  # per ms
        rho = lam * b * w  # queued prompts share forwards: their tokens are the work
        slack = ttft_ms - own  # less a prompt's own forward
        if rho >= 1 or slack <= 0:
            return 1.0
        wait = lam * b * b * w_sq / (2 * (1 - rho))
        return rho * math.exp(-rho * slack / wait) if wait > 0 else 0.0

    def tpot_miss(self, models: Models, available: Sequence[int], tpot_ms: float) -> float:
        """The share of decodes that more prompts land beside than the TPOT
        SLO absorbs, on the `available` instances unpinned: ``P(N > k)``
        for the Poisson count of the pressure (its mean, not its quantile)
        and ``k`` the prompts whose prefills fit in a decode's slack, ``(SLO
        - step(2)) * L / pf(P)`` (module docstring; 0 with no load seen or
        no instance, 1 when a step alone breaks the SLO)."""
        if not available or self.rate_per_s <= 0 or self.output_tokens <= 0:
            return 0.0
        mean, slack, pf = self._landings(models, available, tpot_ms)
        if slack <= 0:
            return 1.0
        if pf <= 0:
            return 0.0
        return poisson_tail(mean, math.floor(slack * self.output_tokens / pf))

    def apply(
        self,
        fleet: FleetState,
        configured: Sequence[Role],
        models: Models,
        tpot_ms: float,
        ttft_ms: float = math.inf,
    ) -> bool:
        """Decide the shape for the load seen so far and set `fleet`'s roles
        to it (`configured`: each instance's role as configured; `ttft_ms`
        the TTFT SLO, none by default); whether the fleet is specialised now."""
        free = [k for k, role in enumerate(configured) if role == "any" and fleet.available(k)]
        half = max(1, len(free) // 2)  # free[:half] prefill, free[half:] decode
        self._count_lost(free[:half])
        want = False
        self.last_pressure = 0.0
        if len(free) >= 2:
            p = self.last_pressure = self.pressure(models, free, tpot_ms)
            want = p >= (self.shaping.off if self.specialized else self.shaping.on)
        self.held_by = None
        if want:  # unless the decoders alone could not hold the decodes within the SLO
            crowded = self.decodes(models, free) / (len(free) - half) + 1
            if not all(models.step_ms(k, crowded) < tpot_ms for k in free[half:]):
                self.held_by = "decodes"
        if want and not self.held_by and self.lost_tokens > self.prompt_tokens:
            self.held_by = "hits"  # the prefill half would recompute more than the fleet computes
        if want and not self.held_by:  # unless pinning alone would queue prompts past the TTFT SLO
            miss = self.shaping.ttft_miss
            limit = miss if self.specialized else miss * self.shaping.off / self.shaping.on
            pinned = self.ttft_miss(models, free[:half], ttft_ms, pinned=True)
            if pinned > limit:
                unpinned = self.ttft_miss(models, free, ttft_ms, pinned=False)
                if unpinned + self.tpot_miss(models, free, tpot_ms) < pinned:
                    self.held_by = "ttft"
        want = want and not self.held_by
        if want != self.specialized:
            self.specialized = want
            self.switches += 1
        prefill = set(free[:half]) if want else set()
        for k, role in enumerate(configured):
            if role == "any" and k in free and want:
                fleet.set_role(k, "prefill" if k in prefill else "decode")
            else:
                fleet.set_role(k, role)
        return want

    def _count_lost(self, prefill: Sequence[int]) -> None:
        """The last arrival's prompt tokens that some instance holds cached
        and the would-be prefill instances `prefill` do not, into the recent
        mean, and its work pinned (its prompt work plus those) into theirs
        (once per arrival)."""
        last, self._pending = self._pending, None
        if last is None:
            return
        work, held = last
        best = max(held, default=0)
        lost = best - max((held[k] for k in prefill if k < len(held)), default=0)
        self._counted += 1
        if self._counted == 1:
            self.lost_tokens = float(lost)
        else:
            self.lost_tokens += MEAN_WEIGHT * (lost - self.lost_tokens)
        self.work = _moments(self.work, work, self._counted)
        self.pinned_work = _moments(self.pinned_work, work + lost, self._counted)


def prompt_work(tokens: int, cached: Sequence[int]) -> int:
    """The prompt work a request brings the fleet (what `Specializer.arrived`
    counts): its prompt tokens less the longest prefix an instance holds
    cached (`cached`: per instance; a conversation's next turn is its new
    tokens, not its history), at least 1."""
    return max(tokens - max(cached, default=0), 1)


def poisson_tail(mean: float, k: int) -> float:
    """P(N > k) for N ~ Poisson(mean) (1 for k < 0)."""
    if k < 0:
        return 1.0
    if mean <= 0:
        return 0.0
    if mean > 500:  # the normal approximation; exp(-mean) underflows
        return 1 - NormalDist(mean, math.sqrt(mean)).cdf(k + 0.5)
    previous = -1.0
    for n, cdf in enumerate(_poisson_cdf(mean)):
        # past the mean the terms shrink: once the CDF stops moving it stays,
        # so a k of millions (a prefill of almost nothing) ends early
        if n == k or (n > mean and cdf == previous):
            return max(1.0 - cdf, 0.0)
        previous = cdf
    raise AssertionError("unreachable: _poisson_cdf never ends")


def _poisson_cdf(mean: float) -> Iterator[float]:
    """P(N <= 0), P(N <= 1), ... for N ~ Poisson(mean), mean <= 500."""
    term = cdf = math.exp(-mean)
    n = 0
    while True:
        yield cdf
        n += 1
        term *= mean / n
        cdf += term


def _moments(seen: tuple[float, float], x: float, count: int) -> tuple[float, float]:
    """The recent means of x and x^2 with `x` seen, the `count`-th: the plain
    means while ``1 / count`` exceeds `TAIL_WEIGHT`, then exponentially
    weighted by it (a first cold prompt does not stand for a hundred)."""
    m, m2 = seen
    a = max(TAIL_WEIGHT, 1 / count)
    return m + a * (x - m), m2 + a * (x * x - m2)


def _mean_step(models: Models, instances: Sequence[int]) -> float:
    """The mean learned step of two decodes over `instances` (not empty)."""
    return sum(models.step_ms(k, 2) for k in instances) / len(instances)
