"""Placing one request: the option with the lowest predicted TTFT that keeps TPOT.

`decide(fleet, models, request, slo, policy)` is a pure function of its
arguments (no I/O, no clock, nothing mutated): the same inputs give the same
`Decision`.

Options (`options`), for a request of ``P`` prompt tokens, over the instances
that are healthy and not draining:

- ``local`` on ``j`` (role ``any``): ``j`` computes the prompt and decodes;
- ``pd`` from ``i`` to ``j != i`` (``i`` of role ``any`` / ``prefill``,
  ``j`` of role ``any`` / ``decode``): ``i`` computes the prompt, its KV goes
  to ``j``;
- ``split`` from ``i`` to ``j`` (same roles, the request `splittable` and
  ``i``'s block size known): ``i`` computes a head of ``H`` tokens (whole
  blocks, `split.split_point`), ``j`` the tail ``T = P - H`` at the same time.
  ``H`` balances the two halves' predicted finish times, or is
  `Policy.split_fraction` of the prompt when that is set; no split leaves
  either part under `Policy.split_min_tokens`. Only between two
  instances with no split of their own in flight (`InstanceLoad.splits`): a
  split's decoder holds its engine until the head arrives, so two splits in
  opposite directions would each wait for a head the other engine cannot
  compute.

- ``fetch`` from ``i`` to ``j`` (any roles but ``j`` one that decodes, the
  request `splittable`, `Policy.fetch`): ``i`` holds the prompt's first ``H``
  tokens in its prefix cache (whole blocks, leaving ``j`` at least one token,
  more than ``j`` holds, at least `Policy.split_min_tokens`), sends their KV
  and ``j`` computes the rest: a split whose head is a cache hit. ``i`` may be
  busy (its part is one token), or draining (it takes no request of its own,
  but lends what it holds: a drain before a restart moves the conversations'
  prefixes instead of recomputing them), but not in a split of its own.

Every prediction counts only what each instance computes: ``P`` less the
prompt's leading tokens it holds cached (`Request.cached`, from the router's
index of the instances' prefix caches; a part that ends the prompt or the head
computes at least one token), and a transfer moves only what the decoder does
not hold (`Placement.work`, `Placement.transferred`). An index that is wrong
(a block evicted since it said so) costs a recompute, never an answer.

A crossing (PD or split) borrows its prefill instance ``i`` only while ``i``
holds no request (`InstanceLoad.idle`) when ``i``'s role is ``any``
(`Policy.idle_crossings`; an instance pinned to ``prefill``, by configuration
or by the fleet's shape, is there to prefill and always qualifies). On a
busy ``i`` the prompt's forward stalls ``i``'s own decodes and queues behind
its prompts, costs the predictions see only at the mean, while ``i``'s
requests could have been served there anyway: replicas balanced by least
outstanding beat a policy that crossed to busy instances whenever it
predicted a gain. Simulated (`bench simulate`, default fit, TTFT SLO 250 ms,
TPOT SLO 18 ms, prefill-heavy, seeds 0 / 1 / 2): on 2 instances 16 / 15 / 12
req/s against 13 / 12 / 10 when crossing to busy instances too (replicas
15 / 14 / 11, a fixed P/D pair 13 / 11 / 9); on 4 instances, seed 0, 40
against 36 (replicas 36); at 9 and 12 ms and on chat the same, but for
one point a sweep step under (chat, 12 ms, seed 2: 4.5 against 5). One real
run (`bench goodput`, 2026-12-04 21:33, SLOs 250 / 18 ms) did not tell the
two apart: 12 against 14 req/s on prefill-heavy, 7 and 7 on chat, inside
each other's intervals (docs/benchmarks/history.md).

If no instance qualifies by role, a ``local`` on an available ``decode``
instance is the only option (as today's router sends a request to D alone when
no P is up); its reason is ``role-fallback``. With no available instance that
can decode, `NoPlacement`.

Predictions, with per instance ``k``: ``b_k`` its decodes (`InstanceLoad.decodes`),
``W_k`` its queued prefill work (`Models.prefill_queue_ms`), ``Q_k = W_k + n_k
step_k(b_k) + Z_k`` the time until its queued prefills are done (each of its
``n_k`` queued prefills a forward that also runs the step of its decodes) and
it has a sequence slot for this request, ``pf``, ``step``, ``xfer`` the
`Models` costs. ``Z_k`` is 0 while ``k`` holds fewer requests
(`InstanceLoad.outstanding`) than its engine runs at once (`max_num_seqs`, 0
when not known); beyond, vLLM queues the request until ``e`` of its ``c``
running requests finish (``e`` the requests beyond the slots, this one
included): taking each running one halfway through its output, the first of
``c`` ends about ``1 / (c + 1)`` of an output in, so ``Z_k = e * L * step_k(c)
/ (c + 1)``, ``L`` the mean output its running requests asked for:

- TTFT, the client's first token: the later of the prompt's last KV being
  ready on the decoder and the decoder's own queue, then one decoder step
  with this request in the batch:

  - local: ``Q_j + pf_j(P) + step_j(b_j + 1)``
  - pd: ``max(Q_i + pf_i(P) + xfer_ij(P), Q_j) + step_j(b_j + 1)``; when the
    router stitches P's first token into the stream (`Policy.stitch`, its
    default dual dispatch), P's answer is the client's first token:
    ``Q_i + pf_i(P) + step_i(b_i + 1)``, and the wait from it to D's first
    token is the new request's TPOT, spread over its ``L - 1`` gaps
  - split: ``max(Q_i + pf_i(H) + xfer_ij(H), Q_j + pf_j(T)) + step_j(b_j + 1)``;
    a fetch the same without ``pf_i(H)``: its head is in ``i``'s cache, its
    KV crosses from ``i``'s admission on (``i``'s one computed token stalls
    ``i``'s decodes all the same)

- TPOT, of the decodes of every instance the option touches, the worst: on an
  instance with ``b_k`` decodes and ``e`` (1 on the decoder, else 0) added,
  ``step_k(b_k + e) + max_r (D_r + A_r + S_k) / L_r`` over its decodes ``r``
  that can still meet the TPOT SLO, and the new request's own (a step, plus a
  stitched PD's wait). ``D_r`` is the stall ``r`` has already suffered
  (`InstanceLoad.running`): a decode's TPOT carries every prefill that ran
  beside it, so stalls each within the SLO add up past it when they land on
  the same requests one after another. ``A_r`` is the queued prefill work
  that will stall ``r``: all of ``W_k`` once ``r`` decodes, before its first
  token only the work queued after it (`Decode.behind_prefills`; what is
  queued ahead of it is done before it starts). ``S_k`` is the stall this
  request's prefill work inflicts on ``k``'s decodes (a CPU forward that
  computes a prompt holds back every decode in it): ``pf`` of what ``k``
  computes, and for a split's decoder the whole time its tail forward lasts,
  waiting for the head included (``max(...) - Q_j``). ``L_r =
  max(output_tokens_r, min_horizon_tokens)`` is the stretch of output
  ``r``'s stalls are spread over: a short answer suffers a stall more than a
  long one. A decode whose length is not known (or not listed in `running`)
  is taken as long as this request's output, decoding and not stalled yet.
  A decode already past the SLO without this request (``step_k(b_k) + (D_r +
  A_r) / L_r`` over it) misses it whatever is chosen: it is left out, so it
  does not veto every option touching its instance (with no SLO given to
  `options`, none is left out). An instance with no decodes before this
  request harms nobody's TPOT: the new request's own decode starts after its
  prefill and the queue ahead of it, so its TPOT is ``step_j(1)``; a
  prefill-only instance does not count.

Choice: among the options whose TPOT is within `SLO.tpot_ms`, the lowest TTFT;
options within `Policy.tie_ms` of it are tied, and so is every option whose
TTFT is within `Policy.ttft_headroom` of the TTFT SLO; ties go first to the
options whose TPOT is *safe* (`safe_tpot_ms`): within a lone decode step (the
fastest available instance's ``step(1)``) plus `Policy.tpot_margin` of the
slack the TPOT SLO leaves above it. The slack, not the whole SLO: a real
model's step can take most of its SLO (SmolLM2-135M on a CPU core: 43 ms
under 65), and 0.6 of the SLO (39 ms) then left no option safe and the fleet
always tight, so every tie kept an instance free and decodes piled onto the
other (simulated, SmolLM2 fit, shared-prefix of 8 groups, warm caches:
goodput 3.8 req/s against `dp`'s 7.0; with the slack, 7.5; on the tiny
model's fit, whose step is a fraction of its SLO, no goodput changed);
then to a *free split*: from an instance pinned to ``prefill`` to a decoder,
both holding no request (`Policy.free_split`; a fixed P/D pair's split while
idle: the idle decoder computes the tail, so the prefill instance is free
again sooner, and nobody's decode is stalled. Simulated, TTFT SLO 250 ms,
seeds 0 / 1 / 2, prefill-heavy: on 2 instances at TPOT 9 ms 13 / 10 / 9 req/s
against 12 / 9 / 9 without (a fixed pair 13 / 11 / 9), at 12 ms 13 / 11 / 8
against 13 / 9 / 8; on 4 instances 4 of 12 points up a step, none down; on
8, at the default SLOs, seed 0, 60 against 64, the same elsewhere; chat the
same everywhere); then, when the fleet is *tight* (some option computing
prompt work beside a decode that can still meet the SLO is not safe), to the
options that leave some instance other than their decoder with no such
decode (`Policy.keep_free`: a prompt computed there later stalls nobody); then to
``local``, then ``pd``, then ``split`` (the fewer crossings); then to the
lower TPOT (to 0.1 ms: the instance the request slows least, which balances
the fleet), the lower TTFT, the fewer outstanding requests, the lower
indices. With `Policy.balance` off: `keep_free` always, then the kinds, then
the lower TTFT (the order before the margin existed). `tie_ms` defaults to 5 ms,
about one decode step: a crossing must save more than that to be taken, which
keeps the predictions' noise and the costs no model sees (a text prompt's
``/tokenize`` before a split) from sending short prompts across (on an idle
fleet, with the priors and 16-token blocks, prompts under about 190 tokens
stay local, when the TTFT SLO leaves no headroom). `ttft_headroom` (0.5)
serves goodput: a request counts when it meets both SLOs, so a TTFT below
half its SLO gains nothing from being lower, while every crossing costs TPOT
somewhere (a split's decoder holds its decodes for the whole tail) and
carries costs the models do not see. Measured (`bench goodput`, 23:10 run,
docs/benchmarks/history.md): minimising TTFT alone split 40 of 60 prompts at 4 req/s
and lost TPOT where `dp2`, all local, did not. `keep_free` lets a fleet
specialise when the TPOT SLO is tight: with every instance holding decodes,
any prompt stalls someone (a 16-token answer has ~60 ms of stall to spare
under a TPOT SLO of 9 ms with 5.4 ms steps, a 900-token prompt takes ~90),
while a fleet that keeps an instance free of decodes computes prompts there
and decodes elsewhere, as a fixed P/D pair does. Simulated (`bench
simulate`'s instance models, 2 instances, prefill-heavy, SLOs 250 / 9 ms):
goodput 4 req/s without it, 8 with it (fixed P/D 10, least outstanding 5).
But taken always, `keep_free` unbalances a loose fleet: on two idle-ish
instances, every local prompt went to the one already decoding, to keep the
other free (`bench goodput`, 2026-12-04, SLOs 250 / 18 ms, prefill-heavy at 4
req/s: one instance's engine used 7.7 CPU s, the other 15.0, TPOT p90 13.1
ms against `dp2`'s 6.8). Predictions are right at the median (measured over
predicted 0.9-1.1 per kind, `bench goodput`'s `by_placement`) but an option
predicted just inside the SLO misses it in the tail, so `tpot_margin` (0.6)
prefers options with room, and `keep_free` waits for a tight fleet. Measured
in one run (2026-12-04 11:35, SLOs 250 / 18 ms): chat goodput 7 req/s against
`dp2`'s 6 (5 against 7 before); prefill-heavy 8 against `dp2`'s 12
(unchanged). Simulated: 8 / 4, 8 / 5, 12 / 6 req/s (prefill-heavy / chat) at
TPOT SLOs of 9, 12 and 18 ms, against 8 / 3, 8 / 5, 12 / 6 before.
If no option meets the TPOT SLO: the one with the lowest TPOT (the least
violation), then the lowest TTFT.

`keep_free` only orders ties, one request at a time; committing instances to
prefill or to decode under a tight TPOT SLO is the fleet's shape
(`shape.Specializer`), which sets the instances' roles before `decide` reads
them.

Reasons: ``only-option`` (one option, and it meets TPOT), ``lowest-ttft``
(the best TTFT of all, within `tie_ms`), ``tpot-slo`` (a lower TTFT was passed
over for TPOT), ``ttft-headroom`` (a lower TTFT, by more than `tie_ms`, was
passed over for fewer crossings, the TTFT being within the headroom),
``no-option-meets-tpot``, ``role-fallback``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from rapidkv.router.config import SPLIT_MIN_TOKENS
from rapidkv.router.placement.model import Models
from rapidkv.router.placement.state import (
    HEADED,
    Decode,
    FleetState,
    InstanceLoad,
    Kind,
    Placement,
    beyond_slots,
)
from rapidkv.router.split import split_point

Reason = Literal[
    "lowest-ttft",
    "tpot-slo",
    "ttft-headroom",
    "only-option",
    "no-option-meets-tpot",
    "role-fallback",
]
REASONS: tuple[str, ...] = get_args(Reason)
KIND_RANK: dict[str, int] = {"local": 0, "pd": 1, "fetch": 1, "split": 2}  # ties: fewer crossings


class NoPlacement(ValueError):
    """No available instance can decode the request."""


@dataclass(frozen=True)
class SLO:
    """The latency targets, in ms: time to first token, time per output token after it."""

    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLOs must be > 0 ms: {self}")


@dataclass(frozen=True)
class Request:
    """What placement knows of a request: its prompt's tokens, the output it
    expects (`max_tokens`, or a guess), whether it may be split (`split.splittable`),
    and per instance index the prompt's leading tokens it holds in its prefix
    cache (`cached`, from the router's index; an instance not listed holds none)."""

    prompt_tokens: int
    output_tokens: int = 16
    splittable: bool = False
    cached: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"a request has at least one prompt and one output token: {self}")
        if any(c < 0 or c > self.prompt_tokens for c in self.cached):
            raise ValueError(f"cached tokens are within the prompt: {self}")

    def hit(self, k: int) -> int:
        """The prompt's leading tokens instance `k` holds cached."""
        return self.cached[k] if k < len(self.cached) else 0


@dataclass(frozen=True)
class Policy:
    """How `decide` chooses. `split_fraction` None: the head balances the
    halves; `stitch`: a PD's first token is P's (the router's dual dispatch
    with `prefill_first_token`); `idle_crossings`: PD and split only from an
    idle instance of role ``any``; `tpot_margin`, `free_split`, `keep_free`,
    `balance`: the order among tied options (see the module docstring)."""

    pd: bool = True
    split: bool = True
    split_fraction: float | None = None
    split_min_tokens: int = SPLIT_MIN_TOKENS  # no split with a head or tail under this
    tie_ms: float = 5.0
    min_horizon_tokens: int = 16
    ttft_headroom: float = 0.5  # of the TTFT SLO: TTFTs below it are tied (0: none)
    keep_free: bool = True  # ties: first the options leaving an instance no decode to stall
    tpot_margin: float = 0.6  # of the TPOT SLO's slack above a step: ties go first within it
    balance: bool = True  # ties: the lower predicted TPOT before keep_free
    stitch: bool = True  # a PD's first token is P's (the router's dual dispatch stitches it)
    idle_crossings: bool = True  # PD / split only from an idle prefill instance of role any
    free_split: bool = True  # ties: first a split from an idle pinned P to an idle decoder
    fetch: bool = True  # a prefix cached on one instance may be sent to the decoder

    def __post_init__(self) -> None:
        if self.split_fraction is not None and not 0 < self.split_fraction < 1:
            raise ValueError(f"split_fraction must be in (0, 1), not {self.split_fraction}")
        if not 0 <= self.tpot_margin <= 1:
            raise ValueError(f"tpot_margin must be in [0, 1], not {self.tpot_margin}")
        if not 0 <= self.ttft_headroom <= 1:
            raise ValueError(f"ttft_headroom must be in [0, 1], not {self.ttft_headroom}")
        if self.tie_ms < 0 or self.min_horizon_tokens < 1:
            raise ValueError(f"need tie_ms >= 0 and min_horizon_tokens >= 1: {self}")


@dataclass(frozen=True)
class Option:
    """One placement with its predicted TTFT and TPOT (ms), and whether it
    leaves an instance other than its decoder with no decode that can still
    meet the TPOT SLO (`keeps_free`)."""

    placement: Placement
    ttft_ms: float
    tpot_ms: float
    keeps_free: bool = False
    beside_decodes: bool = False  # computes prompt work where a decode can still meet the SLO


@dataclass(frozen=True)
class Decision:
    """The chosen `Option` and why (`Reason`)."""

    placement: Placement
    ttft_ms: float
    tpot_ms: float
    reason: Reason
    meets_ttft: bool
    meets_tpot: bool

    @property
    def kind(self) -> Kind:
        return self.placement.kind

    @property
    def prefill(self) -> int:
        """The instance computing the prompt (a split's head; the decoder when local)."""
        return self.placement.prefill

    @property
    def decode(self) -> int:
        return self.placement.decode

    @property
    def head_tokens(self) -> int:
        return self.placement.head_tokens

    def header_value(self) -> str:
        """``x-rapidkv-placement``: ``kind=pd;prefill=1;decode=0;reason=lowest-ttft;...``
        (``head=H`` after ``decode`` for a split or a fetch; then the prompt
        tokens the index said the decoder holds cached, ``hit``, and a fetch's
        or a PD's on its prefill instance, ``prefill_hit``, when not 0;
        predictions last, in ms)."""
        p = self.placement
        head = f";head={p.head_tokens}" if p.kind in HEADED else ""
        hits = f";hit={p.decode_hit}" if p.decode_hit else ""
        hits += f";prefill_hit={p.prefill_hit}" if p.prefill_hit else ""
        return (
            f"kind={p.kind};prefill={p.prefill};decode={p.decode}{head};reason={self.reason}"
            f"{hits};ttft_ms={self.ttft_ms:.1f};tpot_ms={self.tpot_ms:.1f}"
        )


def parse_header(value: str) -> dict[str, str]:
    """An ``x-rapidkv-placement`` value (`Decision.header_value`, or a fixed
    router's ``kind=...;reason=fixed``) -> its fields; a malformed part is skipped."""
    fields = {}
    for part in value.split(";"):
        key, sep, v = part.partition("=")
        if sep and key.strip():
            fields[key.strip()] = v.strip()
    return fields


def options(
    fleet: FleetState | Sequence[InstanceLoad],
    models: Models,
    request: Request,
    policy: Policy = Policy(),
    slo: SLO | None = None,
) -> list[Option]:
    """Every option `decide` chooses among (see the module docstring), predicted."""
    loads = _loads(fleet, models)
    up = [k for k, load in enumerate(loads) if load.available]
    prefillers = [k for k in up if loads[k].role != "decode"]
    decoders = [k for k in up if loads[k].role != "prefill"]
    p = _Predictor(loads, models, request, policy, slo)
    out = [p.local(j) for j in up if loads[j].role == "any"]
    for i in prefillers:
        if policy.idle_crossings and loads[i].role == "any" and not loads[i].idle:
            continue  # a crossing borrows an idle instance only
        for j in decoders:
            if i == j:
                continue
            if policy.pd:
                out.append(p.pd(i, j))
            if policy.split and request.splittable and not (loads[i].splits or loads[j].splits):
                head = p.head(i, j)
                if head > request.hit(j):  # else the decoder holds the head: nothing to split
                    out.append(p.split(i, j, head))
    if policy.fetch and request.splittable:
        lenders = [k for k, load in enumerate(loads) if load.healthy]  # draining ones too
        for i in lenders:  # a holder lends a cached prefix, busy or not: its part is a hit
            head = p.lendable(i)
            if not head or loads[i].splits:
                continue
            for j in decoders:
                if i != j and head > request.hit(j) and not loads[j].splits:
                    out.append(p.split(i, j, head, "fetch"))
    if not out:
        out = [p.local(j) for j in decoders]
    return out


def decide(
    fleet: FleetState | Sequence[InstanceLoad],
    models: Models,
    request: Request,
    slo: SLO = SLO(),
    policy: Policy = Policy(),
) -> Decision:
    """Where to run `request` (see the module docstring). `NoPlacement` if no
    available instance can decode it."""
    loads = _loads(fleet, models)
    opts = options(loads, models, request, policy, slo)
    if not opts:
        states = ", ".join(
            f"{k}: {load.role}" + ("" if load.healthy else " down") + (" draining" * load.draining)
            for k, load in enumerate(loads)
        )
        raise NoPlacement(f"no available instance can decode ({states})")

    safe_ms = safe_tpot_ms(loads, models, slo, policy)
    tight = any(o.beside_decodes and o.tpot_ms > safe_ms for o in opts)

    def rank(o: Option) -> tuple:
        pl = o.placement
        busy = sum(loads[k].outstanding for k in {pl.prefill, pl.decode})
        crowded = policy.keep_free and not o.keeps_free
        tail = (o.ttft_ms, busy, pl.prefill, pl.decode, pl.head_tokens)
        if not policy.balance:
            return (crowded, KIND_RANK[pl.kind], *tail)
        unsafe = o.tpot_ms > safe_ms
        kept = (crowded and tight, KIND_RANK[pl.kind], round(o.tpot_ms, 1), *tail)
        return (unsafe, not (policy.free_split and is_free_split(pl, loads)), *kept)

    meets = [o for o in opts if o.tpot_ms <= slo.tpot_ms]
    reason: Reason
    if meets:
        best = min(o.ttft_ms for o in meets)
        tied = max(best + policy.tie_ms, policy.ttft_headroom * slo.ttft_ms)
        chosen = min((o for o in meets if o.ttft_ms <= tied), key=rank)
        if len(opts) == 1:
            reason = "only-option"
        elif chosen.ttft_ms <= min(o.ttft_ms for o in opts) + policy.tie_ms:
            reason = "lowest-ttft"
        elif chosen.ttft_ms <= best + policy.tie_ms:
            reason = "tpot-slo"
        else:
            reason = "ttft-headroom"
    else:
        chosen = min(opts, key=lambda o: (o.tpot_ms, o.ttft_ms, rank(o)))
        reason = "no-option-meets-tpot"
    pl = chosen.placement
    if pl.kind == "local" and loads[pl.decode].role == "decode":
        reason = "role-fallback"
    return Decision(
        placement=pl,
        ttft_ms=chosen.ttft_ms,
        tpot_ms=chosen.tpot_ms,
        reason=reason,
        meets_ttft=chosen.ttft_ms <= slo.ttft_ms,
        meets_tpot=chosen.tpot_ms <= slo.tpot_ms,
    )


def safe_tpot_ms(loads: Sequence[InstanceLoad], models: Models, slo: SLO, policy: Policy) -> float:
    """The TPOT a tied option may predict and still count as safe: a lone
    decode step (the fastest available instance's) plus `Policy.tpot_margin`
    of the slack the TPOT SLO leaves above it."""
    steps = [models.step_ms(k, 1) for k, load in enumerate(loads) if load.available]
    floor = min(min(steps, default=0.0), slo.tpot_ms)
    return floor + policy.tpot_margin * (slo.tpot_ms - floor)


def is_free_split(placement: Placement, loads: Sequence[InstanceLoad]) -> bool:
    """A split from an instance pinned to ``prefill`` to a decoder, both
    holding no request (`Policy.free_split`)."""
    i, j = loads[placement.prefill], loads[placement.decode]
    return placement.kind == "split" and i.role == "prefill" and i.idle and j.idle


def _loads(fleet: FleetState | Sequence[InstanceLoad], models: Models) -> tuple[InstanceLoad, ...]:
    loads = fleet.view() if isinstance(fleet, FleetState) else tuple(fleet)
    if len(loads) != models.n:
        raise ValueError(f"{len(loads)} instances in the fleet, {models.n} in the models")
    return loads


class _Predictor:
    """The formulas of the module docstring, for one request on one fleet snapshot."""

    def __init__(
        self,
        loads: tuple[InstanceLoad, ...],
        models: Models,
        request: Request,
        policy: Policy,
        slo: SLO | None = None,
    ) -> None:
        self.loads = loads
        self.slo = None if slo is None else slo.tpot_ms
        self.stitch = policy.stitch
        self.m = models
        self.tokens = request.prompt_tokens
        self.hit = request.hit
        self.min_horizon = policy.min_horizon_tokens
        self.horizon = max(request.output_tokens, self.min_horizon)
        self.fraction = policy.split_fraction
        self.min_part = policy.split_min_tokens
        self.work = [  # W_k: queued prefill work beyond steps
            models.prefill_queue_ms(k, load.waiting_prefills, load.waiting_prefill_tokens)
            for k, load in enumerate(loads)
        ]
        self.queue = [  # Q_k: until the queued prefills are done, their steps included
            self.work[k]
            + load.waiting_prefills * models.step_ms(k, load.decodes)
            + self.slot_wait(k, load)
            for k, load in enumerate(loads)
        ]
        # per instance, its decodes that can still meet the TPOT SLO, as (the
        # stall and queued work ahead of each, its horizon): what `tpot` adds to
        self.live = [
            [
                (d.stalled_ms + self.ahead(k, d), self.horizon_of(d))
                for d in self.decodes(k)
                if not self.doomed(k, d)
            ]
            for k in range(len(loads))
        ]
        self.free = [not live for live in self.live]  # no decode that can still meet the SLO
        self.free_count = sum(self.free)
        self.first = [models.step_ms(k, load.decodes + 1) for k, load in enumerate(loads)]
        self.own_tpot: dict[tuple[int, float], float | None] = {}  # `tpot(k, 0, pf)`, memoized

    def ahead(self, k: int, d: Decode) -> float:
        """The queued prefill work on `k` that will stall decode `d`: all of it
        once `d` decodes, the work queued after it before."""
        if d.started:
            return self.work[k]
        return self.m.prefill_queue_ms(k, d.behind_prefills, d.behind_tokens)

    def horizon_of(self, d: Decode) -> int:
        if d.output_tokens is None:
            return self.horizon
        return max(d.output_tokens, self.min_horizon)

    def doomed(self, k: int, d: Decode) -> bool:
        """Whether decode `d` on `k` misses the TPOT SLO whatever this request
        does: its stall and the work queued ahead of it already take it past
        (never, without an SLO)."""
        if self.slo is None:
            return False
        b = self.loads[k].decodes
        return (
            self.m.step_ms(k, b) + (d.stalled_ms + self.ahead(k, d)) / self.horizon_of(d) > self.slo
        )

    def decodes(self, k: int) -> list[Decode]:
        """`k`'s decodes, the unlisted ones as not stalled yet and decoding."""
        load = self.loads[k]
        return list(load.running) + [Decode()] * (load.decodes - len(load.running))

    def keeps_free(self, j: int) -> bool:
        """Whether an instance other than the decoder `j` is left with no decode
        that can still meet the TPOT SLO (a prompt computed there stalls nobody)."""
        return self.free_count - self.free[j] > 0

    def slot_wait(self, k: int, load: InstanceLoad) -> float:
        """Until `k` has a free sequence slot for one more request: 0 below its
        `max_num_seqs` (or when it is not known); at or above it, the ``e``-th
        of its ``c`` running requests to finish, ``e`` the requests beyond the
        slots, each running one taken halfway through its output, the earliest
        of ``c`` about ``1 / (c + 1)`` of an output in."""
        excess, cap = beyond_slots(load.outstanding, load.max_num_seqs), load.max_num_seqs
        if not excess or cap is None:
            return 0.0
        lengths = [d.output_tokens or self.horizon for d in load.running] or [self.horizon]
        mean_len = sum(lengths) / len(lengths)
        return excess * mean_len * self.m.step_ms(k, min(load.decodes, cap)) / (cap + 1)

    def first_step(self, j: int) -> float:
        """`j`'s decode step with one request more than it decodes."""
        return self.first[j]

    def tpot(
        self, k: int, added: int, stall_ms: float, own_ms: float | None = None
    ) -> float | None:
        """TPOT of `k`'s decodes with `added` more and `stall_ms` more prefill
        work, the worst of them; None when `k` has no decode to slow down.
        `own_ms`: the added request's own TPOT, when more than a step."""
        load = self.loads[k]
        b = load.decodes
        if b + added == 0:
            return None
        step = self.m.step_ms(k, b + added)
        worst = max(own_ms - step, 0.0) if own_ms is not None and added else 0.0
        for ahead, horizon in self.live[k]:
            worst = max(worst, (ahead + stall_ms) / horizon)
        return step + worst

    def local(self, j: int) -> Option:
        placement = Placement("local", j, j, decode_hit=self.hit(j))
        pf = self.m.prefill_ms(j, placement.work(self.tokens)[j])
        ttft = self.queue[j] + pf + self.first_step(j)
        tpot = self.tpot(j, 1, pf)
        assert tpot is not None
        return Option(placement, ttft, tpot, self.keeps_free(j), not self.free[j])

    def pd(self, i: int, j: int) -> Option:
        placement = Placement("pd", i, j, prefill_hit=self.hit(i), decode_hit=self.hit(j))
        pf = self.m.prefill_ms(i, placement.work(self.tokens)[i])
        answered = self.queue[i] + pf
        ready = answered + self.m.transfer_ms(i, j, placement.transferred(self.tokens))
        ttft = max(ready, self.queue[j]) + self.first_step(j)
        own = None
        if self.stitch:  # the client's first token is P's; the wait for D's next is TPOT
            first = answered + self.first_step(i)  # as local's
            own = self.first_step(j) + max(ttft - first, 0.0) / max(self.horizon - 1, 1)
            ttft = first
        tpot = self._worst(self.tpot(j, 1, 0.0, own), i, pf)
        return Option(placement, ttft, tpot, self.keeps_free(j), not self.free[i])

    def split(self, i: int, j: int, head: int, kind: Kind = "split") -> Option:
        placement = Placement(kind, i, j, head, self.hit(i), self.hit(j))
        work = placement.work(self.tokens)
        pf_head = self.m.prefill_ms(i, work[i])
        # a fetch's head is final once its holder admits the request (cache
        # hits): it crosses while the holder computes its one token
        computed = 0.0 if kind == "fetch" else pf_head
        head_ready = self.queue[i] + computed
        head_ready += self.m.transfer_ms(i, j, placement.transferred(self.tokens))
        tail_done = self.queue[j] + self.m.prefill_ms(j, work[j])
        end = max(head_ready, tail_done)
        ttft = end + self.first_step(j)
        stall = end - self.queue[j]
        tpot = self._worst(self.tpot(j, 1, stall), i, pf_head)
        beside = not (self.free[i] and self.free[j])
        return Option(placement, ttft, tpot, self.keeps_free(j), beside)

    def lendable(self, i: int) -> int:
        """The head a fetch from `i` sends (to a decoder holding less of it):
        the whole blocks of the prompt `i` holds cached, leaving at least one
        token; 0 when that is under `Policy.split_min_tokens` or when `i`'s
        block size is unknown."""
        block = self.loads[i].block_size
        if block is None:
            return 0
        head = min(self.hit(i), self.tokens - 1) // block * block
        return head if head >= max(self.min_part, 1) else 0

    def head(self, i: int, j: int) -> int:
        """The head `i` computes in a split with `j`: whole blocks of `i`, leaving
        `j` at least one token; 0 when no block fits, when the head or the tail
        would be under `Policy.split_min_tokens`, or when `i`'s block size is
        unknown."""
        block = self.loads[i].block_size
        if block is None or self.tokens < 2:
            return 0
        fraction = self.fraction
        if fraction is None:  # Q_i + pf_i(H) + xfer_ij(H) = Q_j + pf_j(P - H), solved for H
            pi, pj = self.m.prefill[i], self.m.prefill[j]
            xf = self.m.transfer_cost(i, j)
            slope = pi.slope + xf.slope + pj.slope
            if slope <= 0:
                fraction = 0.5
            else:
                balance = self.queue[j] + pj.intercept + pj.slope * self.tokens
                balance -= self.queue[i] + pi.intercept + xf.intercept
                fraction = min(max(balance / slope / (self.tokens - 1), 0.0), 1.0)
        return split_point(self.tokens, block, fraction, self.min_part)

    def _worst(self, decoder_tpot: float | None, i: int, pf: float) -> float:
        key = (i, pf)
        if key not in self.own_tpot:  # the same for every decoder a P crosses to
            self.own_tpot[key] = self.tpot(i, 0, pf)
        values = [t for t in (decoder_tpot, self.own_tpot[key]) if t is not None]
        return max(values)
