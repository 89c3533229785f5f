"""The event loop: requests arrive, a router places them, instances serve them.

`simulate(fit, n, router, specs, arrivals=... | concurrency=...)` runs one
load to its end and returns one `Outcome` per request, in request order.
Time is simulated milliseconds on one clock; events are a heap of ``(time,
sequence number)``, so equal times run in the order they were scheduled and a
run is a pure function of its inputs.

A request's path:

- it arrives (an open loop's given time; in a closed loop of `concurrency`,
  the first ones at 0 and each next one when one finishes) and the router
  places it (`routers`); its parts go to their instances (`instance`);
- ``pd``: when P's part is over, the router hears `prefill_done`; the KV is
  usable on D `Fit.transfer_time` later (the router's connector), and D's part
  may then be scheduled; with `Router.p_first_token` the client's first token
  is P's;
- ``split``: when P's head is over, D's tail may end `Fit.split_handoff_ms`
  later (`Instance.head_ready`);
- ``fetch`` (a split whose head P holds cached): P's part is the head and one
  token more, which it hits but for that token; D's tail may end
  `Fit.split_handoff_ms` plus the transfer of the head's KV (what D does not
  hold of it, `Fit.transfer_time`) after P's part is over;
- the decoder's first token (`first_token`), then its last (`finished`,
  with the output's tokens).

Client-side figures (`Outcome`): TTFT from arrival to the first token the
client gets, plus a fixed `Fit.http_ms` (plus `Fit.router_ms` when `routed`):
latency the instances do not spend; TPOT from that first token to the last,
over the output's tokens after the first; E2E from arrival to the last, plus
the same fixed latency.

`shared_core`: the 2-core testbed, where the router's front and the client
run on instance 0's core (P's, in a P/D pair): each request that arrives
while instance 0 computes adds `Fit.shared_core_ms` to its next step. A fleet
whose router and clients have cores of their own runs without it.

`prefix_caching` (the workloads of shared prefixes, served with prefix
caching on): every instance has a `prefix_cache.PrefixCache` of
`Fit.cache_blocks` blocks, empty at the start (`bench goodput` empties every
cache before every rate), and each request's parts carry the keys of its
blocks (`Spec.content`; the answer's blocks keyed by `Spec.answer`, else by
the request's own). The router is told, per instance, the prompt's leading
tokens that instance's cache holds when the request arrives (`Router.place`'s
`cached`: whole blocks): the real router learns it from the instances' KV
events; here it is instant and exact. What crosses in a PD, a split or a
fetch is what the decoder does not hold of P's part at that moment. A
request that follows another (`Spec.follows`, in an open loop) arrives
`Spec.think_ms` after that one's last token.

A request still unfinished when nothing is left to happen (a deadlock), or
never sent because the one it follows never finished, has None for what it
never reached (an unsent one: kind ``unsent``, arrival NaN).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rapidkv.bench.simulate.fit import Fit
from rapidkv.bench.simulate.instance import Instance, Part
from rapidkv.bench.simulate.prefix_cache import PrefixCache, block_hashes
from rapidkv.bench.simulate.routers import Router
from rapidkv.bench.simulate.workload import Spec
from rapidkv.router.placement import Placement

OWN_ANSWER = 0  # the segment kind of an answer no later prompt repeats


@dataclass(frozen=True)
class Outcome:
    """One request, as the client saw it (ms)."""

    prompt: int
    output: int
    arrival_ms: float
    kind: str
    prefill: int
    decode: int
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None


class _Request:
    __slots__ = (
        "arrival_ms",
        "d_part",
        "first_ms",
        "index",
        "keys",
        "last_ms",
        "placement",
        "rid",
        "spec",
    )

    def __init__(self, index: int, spec: Spec, arrival_ms: float) -> None:
        self.index = index
        self.rid = f"r{index}"
        self.spec = spec
        self.arrival_ms = arrival_ms
        self.placement: Placement | None = None
        self.first_ms: float | None = None  # the client's first token, instance time
        self.last_ms: float | None = None
        self.d_part: Part | None = None  # its part on the decoder (pd, split, fetch)
        self.keys: list[int] = []  # its prompt's full blocks' keys (prefix caching)


class Simulation:
    """One fleet, one router, one load (see the module docstring)."""

    def __init__(
        self,
        fit: Fit,
        n: int,
        router: Router,
        *,
        routed: bool = True,
        shared_core: bool = False,
        prefix_caching: bool = False,
    ) -> None:
        if router.n != n:
            raise ValueError(f"the router has {router.n} instances, the fleet {n}")
        self.fit = fit
        self.router = router
        self.prefix_caching = prefix_caching
        self.instances = [
            Instance(i, fit, self, PrefixCache(fit.cache_blocks) if prefix_caching else None)
            for i in range(n)
        ]
        self.placed_tokens: Counter[str] = Counter()  # prompt tokens hit / fetched / computed
        self.kinds: Counter[str] = Counter()  # placements by kind
        self.count_from = 0  # requests before this index are a warm-up: not counted
        self.latency_ms = fit.http_ms + (fit.router_ms if routed else 0.0)
        self.shared_core = shared_core
        self.now_ms = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._requests: list[_Request] = []
        self._specs: Sequence[Spec] = ()
        self._next = 0  # a closed loop's next request
        self._closed = False

    # Host (for the instances)

    def schedule(self, t_ms: float, callback: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (t_ms, next(self._seq), callback, args))

    def prefill_over(self, part: Part, now_ms: float) -> None:
        req: _Request = part.req  # type: ignore[assignment]
        assert req.placement is not None
        self.router.prefill_done(req.rid, now_ms)
        if req.placement.kind == "pd":
            if self.router.p_first_token:
                req.first_ms = now_ms
            d_part = req.d_part
            assert d_part is not None
            ready = now_ms + self.fit.transfer_time(d_part.external_sent, self.router.connector)
            self.schedule(ready, self._kv_ready, req.placement.decode, d_part)
        else:  # a split's head
            assert req.d_part is not None
            self.instances[req.placement.decode].head_ready(req.d_part, now_ms)

    def first_token(self, part: Part, now_ms: float) -> None:
        req: _Request = part.req  # type: ignore[assignment]
        self.router.first_token(req.rid, now_ms)
        if req.first_ms is None:
            req.first_ms = now_ms

    def finished(self, part: Part, now_ms: float) -> None:
        req: _Request = part.req  # type: ignore[assignment]
        req.last_ms = now_ms
        self.router.finished(req.rid, now_ms, req.spec.output)
        if self._next < len(self._specs) and self._closed:
            self.schedule(now_ms, self._arrive, self._next)
            self._next += 1
        k = req.index + 1
        if not self._closed and k < len(self._specs) and self._specs[k].follows:
            self.schedule(now_ms + self._specs[k].think_ms, self._arrive, k)

    # the run

    def run(
        self,
        specs: Sequence[Spec],
        *,
        arrivals: Sequence[float] | None = None,
        concurrency: int | None = None,
    ) -> list[Outcome]:
        """Serve `specs`, arriving at `arrivals` (ms; NaN, or `Spec.follows`:
        after the request before it) or `concurrency` at a time."""
        if (arrivals is None) == (concurrency is None):
            raise ValueError("give arrivals (an open loop) or concurrency (a closed one)")
        self._specs = specs
        self._closed = concurrency is not None
        if arrivals is not None:
            if len(arrivals) != len(specs):
                raise ValueError("one arrival time per request")
            for k, t in enumerate(arrivals):
                if specs[k].follows or math.isnan(t):
                    if k == 0:
                        raise ValueError("the first request follows none")
                    continue
                self.schedule(t, self._arrive, k)
        else:
            assert concurrency is not None
            if concurrency < 1:
                raise ValueError("concurrency must be >= 1")
            self._next = min(concurrency, len(specs))
            for k in range(self._next):
                self.schedule(0.0, self._arrive, k)
        heap = self._heap
        while heap:
            t, _, callback, args = heapq.heappop(heap)
            self.now_ms = t
            callback(t, *args)
        by_index = {r.index: r for r in self._requests}
        return [
            self._outcome(by_index[k]) if k in by_index else _unsent(spec)
            for k, spec in enumerate(specs)
        ]

    def prefix_tokens(self) -> dict[str, Any]:
        """What the prefix caches did (the requests from `count_from` on, but
        evictions: the whole run's): the instances' prompt tokens by source
        (cached, external, computed; a PD's prompt counts on both), the share
        of them the caches served (`hit_fraction`), the router's prompt tokens
        hit / fetched / computed as its placements counted them (the real
        router's `prefix_tokens`), evictions; {} without prefix caching."""
        if not self.prefix_caching:
            return {}
        pooled: Counter[str] = Counter()
        for inst in self.instances:
            pooled.update(inst.tokens)
        counted = sum(pooled.values())
        return {
            "instances": {k: pooled[k] for k in ("cached", "external", "computed")},
            "hit_fraction": pooled["cached"] / counted if counted else 0.0,
            "placed": {k: self.placed_tokens[k] for k in ("hit", "fetched", "computed")},
            "evictions": sum(inst.cache.evictions for inst in self.instances if inst.cache),
            "cache_blocks": self.fit.cache_blocks,
        }

    def _kv_ready(self, now_ms: float, i: int, part: Part) -> None:
        self.instances[i].kv_ready(part, now_ms)

    def _arrive(self, now_ms: float, k: int) -> None:
        spec = self._specs[k]
        req = _Request(k, spec, now_ms)
        first = self.instances[0]
        if self.shared_core and first.busy:
            first.debt_ms += self.fit.shared_core_ms
        self._requests.append(req)
        cached: tuple[int, ...] = ()
        if self.prefix_caching:
            block = self.fit.block_size
            req.keys = block_hashes(spec.content, block)
            cached = tuple(
                inst.cache.longest_hit(req.keys) * block if inst.cache else 0
                for inst in self.instances
            )
        pl = self.router.place(req.rid, spec.prompt, spec.output, now_ms, cached=cached)
        req.placement = pl
        if k >= self.count_from:
            self.kinds[pl.kind] += 1
            self._count_placed(pl, spec.prompt)
        held = cached[pl.decode] if cached else 0  # what D holds: it is not sent
        prefiller, decoder = self.instances[pl.prefill], self.instances[pl.decode]
        if pl.kind == "local":
            decoder.add(self._keyed(req, Part(req, "local", spec.prompt, spec.output)), now_ms)
        elif pl.kind == "pd":
            d_part = Part(req, "decode", 1, spec.output)
            d_part.tokens, d_part.external = spec.prompt, spec.prompt - 1
            d_part.external_sent = max(spec.prompt - held, 0)
            req.d_part = self._keyed(req, d_part)
            prefiller.add(self._keyed(req, Part(req, "prefill", spec.prompt, 0)), now_ms)
            decoder.add(d_part, now_ms)
        else:
            head = pl.head_tokens
            d_part = Part(req, "tail", spec.prompt - head, spec.output)
            d_part.tokens, d_part.external = spec.prompt, head
            d_part.external_sent = max(head - held, 0)
            p_tokens = head
            if pl.kind == "fetch":  # P hits the head it holds, computes one token more
                p_tokens = head + 1
                transfer = self.fit.transfer_time(d_part.external_sent, self.router.connector)
                d_part.handoff_ms = self.fit.split_handoff_ms + transfer
            req.d_part = self._keyed(req, d_part)
            prefiller.add(self._keyed(req, Part(req, "head", p_tokens, 0)), now_ms)
            decoder.add(d_part, now_ms)

    def _keyed(self, req: _Request, part: Part) -> Part:
        """`part` with its blocks' keys (prefix caching), else as it is."""
        part.counted = req.index >= self.count_from
        if not self.prefix_caching:
            return part
        block = self.fit.block_size
        keys = req.keys[: part.tokens // block]
        if part.role in ("prefill", "head"):
            return part.with_keys(keys)
        spec = req.spec
        answer = spec.answer if spec.answer is not None else (OWN_ANSWER, req.index)
        sequence = (*spec.content, (answer, spec.output))
        return part.with_keys(keys, block_hashes(sequence, block, spec.prompt + spec.output - 1))

    def _count_placed(self, pl: Placement, prompt: int) -> None:
        """The prompt's tokens by what the placement made of them, as the real
        router counts them (`proxy`'s `_count_prefix_tokens`)."""
        if not self.prefix_caching:
            return
        tokens = max(prompt, pl.head_tokens + 1)
        computed = sum(pl.work(tokens).values())
        fetched = pl.transferred(tokens) if pl.kind == "fetch" else 0
        self.placed_tokens["computed"] += computed
        self.placed_tokens["fetched"] += fetched
        self.placed_tokens["hit"] += max(tokens - computed - fetched, 0)

    def _outcome(self, r: _Request) -> Outcome:
        pl = r.placement
        assert pl is not None
        ttft = tpot = e2e = None
        if r.first_ms is not None:
            ttft = r.first_ms - r.arrival_ms + self.latency_ms
        if r.last_ms is not None:
            e2e = r.last_ms - r.arrival_ms + self.latency_ms
            if r.spec.output > 1 and r.first_ms is not None:
                tpot = (r.last_ms - r.first_ms) / (r.spec.output - 1)
        return Outcome(
            r.spec.prompt,
            r.spec.output,
            r.arrival_ms,
            pl.kind,
            pl.prefill,
            pl.decode,
            ttft,
            tpot,
            e2e,
        )


def _unsent(spec: Spec) -> Outcome:
    return Outcome(spec.prompt, spec.output, math.nan, "unsent", -1, -1, None, None, None)


def simulate(
    fit: Fit,
    n: int,
    router: Router,
    specs: Sequence[Spec],
    *,
    arrivals: Sequence[float] | None = None,
    concurrency: int | None = None,
    routed: bool = True,
    shared_core: bool = False,
    prefix_caching: bool = False,
) -> list[Outcome]:
    """One run (see `Simulation.run`); outcomes in request order."""
    sim = Simulation(
        fit, n, router, routed=routed, shared_core=shared_core, prefix_caching=prefix_caching
    )
    return sim.run(specs, arrivals=arrivals, concurrency=concurrency)
