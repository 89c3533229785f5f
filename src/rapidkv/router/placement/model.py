"""Learned costs of one fleet: prefill, decode step and KV transfer times.

Every cost is a line, ``ms = intercept + slope * x``, fitted by exponentially
weighted least squares to what the router observed (`LinearCost`), starting
from a prior (`Priors`) that counts as `Priors.prior_weight` observations
forever. Per instance ``i`` (`Models`):

- ``prefill_ms(i, tokens)``: the time a forward on ``i`` that computes `tokens`
  prompt tokens takes *beyond* a decode step at the same batch (the step is the
  decode model's). So a request computed alone on ``i`` reaches its first token
  ``prefill_ms + step_ms`` after its forward starts.
- ``step_ms(i, batch)``: one decode step of ``i`` with `batch` requests
  decoding, prefill work excluded.
- ``transfer_ms(i, j, tokens)``: from P's (``i``) prefill answer to the KV of
  `tokens` tokens being usable on D (``j``): the TransferKV round trip, the
  bytes, D's scheduling; D's own step excluded. Learned per ordered pair; a pair
  never observed uses the prior.

Observations come from `state.FleetState`'s events (`PrefillObservation`,
`TransferObservation`, `DecodeObservation`) through `Models.learn`, which
takes the decode step out of the prefill and transfer observations with the
current decode model; or directly through ``observe_*``.

Priors (`Priors`, from docs/benchmarks/ (bench serve): the tiny model, float32, on one core
of the 2-core machine; bf16 on AMX is about 3x faster, so before any
observation prefills look slower than they may be, which only makes crossing
less attractive):

- prefill: 2 ms + 0.12 ms/token. A single instance's TTFT was 112 ms at 900
  tokens and about 55 ms p50 over 128-900 tokens, one ~5 ms step included.
- decode step: 4.5 ms + 0.6 ms per decoding request (TPOT p50 4.4-5.4 ms at
  concurrency 1, 5.5-7.7 ms at concurrency 4).
- transfer: 12 ms + 0.005 ms/token. P + D took 13 ms more than one instance at
  900 tokens, almost all of it fixed per-request costs (P's HTTP request, the
  TransferKV round trip, the SendDone, D's scheduling); the KV bytes, a
  few KiB a token at 5-13 GB/s, cost well under 0.005 ms/token.

With these priors, on an idle fleet a whole-prompt PD never beats local (it is
the same prefill plus a transfer), and a split (head on another instance at the
same time) only saves time from about 130 prompt tokens on (and `policy` asks
it to save more than `Policy.tie_ms`): short prompts stay local.

Invariants:
- predictions are finite and never negative (a fit below 0 predicts 0), and
  never fall as their x grows (a slope below 0 is fitted as a flat line);
- a model changes only through ``observe_*`` / `learn`: reading predicts only;
- a fit is the exact minimiser, among lines of slope >= 0, of the weighted
  squared error over its prior's two pseudo-observations and its decayed
  observations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillObservation:
    """Instance `instance` computed `tokens` prompt tokens of one request in
    `ms` (its service time: from the later of its dispatch and the instance's
    previous prefill end, to its end), while `batch` requests were decoding there."""

    instance: int
    tokens: int
    ms: float
    batch: int


@dataclass(frozen=True)
class TransferObservation:
    """`ms` from P's (`src`) prefill answer to D's (`dst`) first token, less
    the time D spent computing other prompts meanwhile, for a prompt of
    `tokens` tokens, with `batch` requests decoding on D before it."""

    src: int
    dst: int
    tokens: int
    ms: float
    batch: int


@dataclass(frozen=True)
class DecodeObservation:
    """One finished request decoded on `instance` at `step_ms` per output token
    (prefill work the instance did meanwhile taken out), with `batch` requests
    decoding there on average, itself included."""

    instance: int
    batch: float
    step_ms: float


Observation = PrefillObservation | TransferObservation | DecodeObservation


class LinearCost:
    """``ms = intercept + slope * x``, fitted by exponentially weighted least
    squares with ``slope >= 0`` (a cost never falls as its x grows).

    Each observation's weight is multiplied by `decay` at every later
    observation (memory of about ``1 / (1 - decay)`` observations). The prior is
    two pseudo-observations of weight ``prior_weight / 2`` each, at ``x = 0`` and
    ``x = prior_x``, on the prior line; they do not decay, so the fit is always
    defined (observations all at one `x` pull the line through them, pivoting
    on the prior's other point) and the prior's share of the weight never drops
    below ``prior_weight / (prior_weight + 1 / (1 - decay))`` (1 % by default).
    """

    def __init__(
        self,
        intercept: float,
        slope: float,
        *,
        prior_x: float,
        prior_weight: float = 1.0,
        decay: float = 0.99,
    ) -> None:
        if not (prior_x > 0 and prior_weight > 0 and 0 < decay <= 1):
            raise ValueError(
                f"need prior_x > 0, prior_weight > 0, 0 < decay <= 1 "
                f"(got {prior_x}, {prior_weight}, {decay})"
            )
        self.decay = decay
        self.observations = 0
        w = prior_weight / 2
        y1 = intercept + slope * prior_x
        # the prior's sums: weight, sum x, sum y, sum x^2, sum xy
        self._prior = (2 * w, w * prior_x, w * (intercept + y1), w * prior_x**2, w * prior_x * y1)
        self._data = [0.0] * 5
        self._intercept = intercept
        self._slope = slope

    @property
    def intercept(self) -> float:
        return self._intercept

    @property
    def slope(self) -> float:
        return self._slope

    def observe(self, x: float, ms: float) -> None:
        """One more observation: `ms` at `x` (non-finite values are ignored)."""
        if not (math.isfinite(x) and math.isfinite(ms)):
            return
        d = [v * self.decay for v in self._data]
        for k, v in enumerate((1.0, x, ms, x * x, x * ms)):
            d[k] += v
        self._data = d
        self.observations += 1
        w, sx, sy, sxx, sxy = (p + q for p, q in zip(self._prior, d, strict=True))
        det = w * sxx - sx * sx  # > 0: the prior has weight at two distinct x
        if not det > 0:
            return
        # no cost falls as its x grows (more tokens, a bigger batch): a fit
        # whose slope is below 0 (a few noisy observations) is the best flat
        # line, the weighted mean, instead (least squares with slope >= 0)
        self._slope = max((w * sxy - sx * sy) / det, 0.0)
        self._intercept = (sy - self._slope * sx) / w

    def predict(self, x: float) -> float:
        """The cost at `x`, never below 0."""
        return max(self._intercept + self._slope * x, 0.0)

    def total(self, count: int, sum_x: float) -> float:
        """The cost of `count` items whose `x` add up to `sum_x` (0 for none)."""
        if count <= 0:
            return 0.0
        return max(count * self._intercept + self._slope * sum_x, 0.0)


@dataclass(frozen=True)
class Priors:
    """The costs assumed before any observation (see the module docstring)."""

    prefill_ms: float = 2.0
    prefill_ms_per_token: float = 0.12
    step_ms: float = 4.5
    step_ms_per_request: float = 0.6
    transfer_ms: float = 12.0
    transfer_ms_per_token: float = 0.005
    prior_weight: float = 1.0
    decay: float = 0.99
    # where each prior's second pseudo-observation sits
    prefill_x: float = 512.0
    step_x: float = 8.0
    transfer_x: float = 512.0

    def prefill(self) -> LinearCost:
        return self._line(self.prefill_ms, self.prefill_ms_per_token, self.prefill_x)

    def step(self) -> LinearCost:
        return self._line(self.step_ms, self.step_ms_per_request, self.step_x)

    def transfer(self) -> LinearCost:
        return self._line(self.transfer_ms, self.transfer_ms_per_token, self.transfer_x)

    def _line(self, intercept: float, slope: float, x: float) -> LinearCost:
        return LinearCost(
            intercept, slope, prior_x=x, prior_weight=self.prior_weight, decay=self.decay
        )


class Models:
    """The learned costs of instances ``0..n-1`` (see the module docstring)."""

    def __init__(self, n: int, priors: Priors | None = None) -> None:
        if n < 0:
            raise ValueError(f"a number of instances is >= 0, not {n}")
        self.n = n
        self.priors = Priors() if priors is None else priors
        self.prefill = [self.priors.prefill() for _ in range(n)]
        self.step = [self.priors.step() for _ in range(n)]
        # learned per ordered pair (P, D), created by its first observation
        self.transfer: dict[tuple[int, int], LinearCost] = {}
        self._transfer_prior = self.priors.transfer()

    def add(self) -> int:
        """One more instance, its costs the priors'; its index."""
        self.prefill.append(self.priors.prefill())
        self.step.append(self.priors.step())
        self.n += 1
        return self.n - 1

    # predictions

    def prefill_ms(self, i: int, tokens: float) -> float:
        """A forward on `i` computing `tokens` prompt tokens, beyond a decode step (0 for none)."""
        return self.prefill[i].predict(tokens) if tokens > 0 else 0.0

    def prefill_queue_ms(self, i: int, count: int, tokens: float) -> float:
        """`count` prefills of `tokens` tokens in all, queued on `i`, beyond their steps."""
        return self.prefill[i].total(count, tokens)

    def step_ms(self, i: int, batch: float) -> float:
        """One decode step of `i` with `batch` requests decoding."""
        return self.step[i].predict(batch)

    def transfer_ms(self, i: int, j: int, tokens: float) -> float:
        """The KV of `tokens` tokens from P `i` to D `j`, after P's answer."""
        return self.transfer_cost(i, j).predict(tokens)

    def transfer_cost(self, i: int, j: int) -> LinearCost:
        """The pair's learned line, or the prior's while it has no observation."""
        return self.transfer.get((i, j), self._transfer_prior)

    # learning

    def observe_prefill(self, i: int, tokens: int, ms: float) -> None:
        self.prefill[self._check(i)].observe(tokens, ms)

    def observe_step(self, i: int, batch: float, ms: float) -> None:
        self.step[self._check(i)].observe(batch, ms)

    def observe_transfer(self, i: int, j: int, tokens: int, ms: float) -> None:
        key = (self._check(i), self._check(j))
        if key not in self.transfer:
            self.transfer[key] = self.priors.transfer()
        self.transfer[key].observe(tokens, ms)

    def learn(self, obs: Observation) -> None:
        """Feed one observation from `state.FleetState` (decode steps taken out
        of prefill and transfer times with the current step model, floored at 0)."""
        if isinstance(obs, PrefillObservation):
            step = self.step_ms(obs.instance, obs.batch)
            self.observe_prefill(obs.instance, obs.tokens, max(obs.ms - step, 0.0))
        elif isinstance(obs, TransferObservation):
            step = self.step_ms(obs.dst, obs.batch + 1)
            self.observe_transfer(obs.src, obs.dst, obs.tokens, max(obs.ms - step, 0.0))
        else:
            self.observe_step(obs.instance, obs.batch, obs.step_ms)

    def _check(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"instance {i} out of range 0..{self.n - 1}")
        return i
