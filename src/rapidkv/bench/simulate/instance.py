"""One simulated vLLM CPU instance: continuous batching in engine steps.

Work arrives as `Part`s, one request's share of work on this instance:

- ``local``: the whole prompt, then the whole output;
- ``prefill``: a PD request's prompt, computed here for another instance (its
  answer is one token: the part is over when its last chunk is computed);
- ``head``: a split's head, the same for a split;
- ``decode``: a PD request on its decoder: one prompt token to compute (the
  last, as vLLM computes it over received KV) once its KV is here
  (`kv_ready`), then the whole output;
- ``tail``: a split's tail on its decoder: the tail's tokens, then the output;
  a step that computes part of a tail cannot end before the head's KV is here
  (`head_ready` plus `Fit.split_handoff_ms`), and until then it holds the whole
  engine, every decode in it included: rapidkv's D forward waits layer by
  layer for the head.

A step (vLLM's scheduler, simplified): every running request that decodes
adds one token, running requests with prompt left add a chunk, then waiting
parts are admitted first come, first served (a ``decode`` part whose KV is not
here yet is skipped, as vLLM skips a request waiting for remote KV), while
fewer than `Fit.max_num_seqs` run and `Fit.max_num_batched_tokens` is not spent.
It lasts `Fit.step_time(seqs, prompt tokens, context)`, the context being
what the requests computing those prompt tokens already hold in their KV (a
hit, KV received, earlier chunks). At its end each computed chunk
counts; a part whose prompt is done yields its first token (``local``,
``decode``, ``tail``) or is over (``prefill``, ``head``); a decoding part
yields one more token, and is over after its last. The instance reports
through `Host` callbacks; it schedules its own step ends on the host's clock.

`debt_ms`: CPU time something else took from this instance's core while it
was busy (`engine`'s shared core); the next step lasts that much longer.

With a prefix cache (`cache`, a `prefix_cache.PrefixCache`; the workloads of
shared prefixes, served with prefix caching on), a part that carries its
engine request's block keys (`Part.keys`) is admitted only when the cache
can give it the blocks of its prompt and output (else it and those behind it
wait, as vLLM's scheduler stops at a request it cannot allocate); it then
computes only what it neither holds (its prompt's leading cached blocks,
`prefix_cache.hit_tokens`: whole blocks, never the last token) nor receives
(`Part.external`: a PD decode's prompt but its last token, a split's or a
fetch's head): ``tokens - max(hit, external)``. Each chunk it computes, and
what it receives, gives its full blocks their keys as it is scheduled (vLLM
caches a block when its tokens are scheduled, so a request admitted in the
same step hits it); a decoding part's answer gives the full blocks of its
prompt and output but the last token when it is over (vLLM caches generated
tokens' blocks as they fill), and every part's blocks are released when it
is over (cached ones stay, evictable, until the cache needs them). The
instance counts its prompt tokens by source as vLLM's servers do
(`tokens`: ``cached``, ``external``, ``computed``).

Not modelled: preemption (a part takes its output's blocks when admitted),
KV memory without prefix caching (the length workloads run without a cache),
the CPU the instance's HTTP front takes beyond what the fitted step times hold.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from typing import Literal, Protocol

from rapidkv.bench.simulate.fit import Fit
from rapidkv.bench.simulate.prefix_cache import Allocation, PrefixCache, hit_tokens

Role = Literal["local", "prefill", "head", "decode", "tail"]


class Part:
    """One request's work on one instance. With a prefix cache: `tokens`, the
    prompt tokens of its engine request here (a head's, a fetch's head and one
    more, else the whole prompt), `external` of them received from another
    instance, `keys` its prompt's full blocks' keys, `answer_keys` those of its
    prompt and output (a decoding part), `handoff_ms` from the head's end on
    its P to the end of a tail's step."""

    __slots__ = (
        "alloc",
        "answer_keys",
        "counted",
        "decoding",
        "external",
        "external_sent",
        "handoff_ms",
        "head_ready_ms",
        "keys",
        "output_tokens",
        "prefill_left",
        "ready",
        "req",
        "role",
        "tokens",
        "tokens_left",
    )

    def __init__(self, req: object, role: Role, prefill_tokens: int, output_tokens: int) -> None:
        self.req = req  # the engine's request
        self.role = role
        self.prefill_left = prefill_tokens
        self.tokens_left = output_tokens
        self.output_tokens = output_tokens
        self.ready = role != "decode"  # a decode part waits for its KV
        self.decoding = False
        self.head_ready_ms: float | None = None  # a tail: when its head's KV is here
        self.handoff_ms: float | None = None  # a tail: None is `Fit.split_handoff_ms`
        self.tokens = prefill_tokens
        self.external = 0
        self.external_sent = prefill_tokens  # of `external`, what crosses (D holds the rest)
        self.keys: Sequence[int] | None = None  # None: no prefix caching for this part
        self.answer_keys: Sequence[int] = ()
        self.alloc: Allocation | None = None
        self.counted = True  # in `Instance.tokens` (not a warm-up's)

    def with_keys(self, keys: Sequence[int], answer_keys: Sequence[int] = ()) -> Part:
        """This part with its blocks' keys (see the class docstring); itself."""
        self.keys = keys
        self.answer_keys = answer_keys
        return self


class Host(Protocol):
    """What an instance needs from the event loop."""

    def schedule(self, t_ms: float, callback: object, *args: object) -> None: ...

    def prefill_over(self, part: Part, now_ms: float) -> None: ...

    def first_token(self, part: Part, now_ms: float) -> None: ...

    def finished(self, part: Part, now_ms: float) -> None: ...


class Instance:
    """One instance's queues and engine (see the module docstring)."""

    def __init__(self, index: int, fit: Fit, host: Host, cache: PrefixCache | None = None) -> None:
        self.index = index
        self.fit = fit
        self.host = host
        self.cache = cache
        self.tokens: Counter[str] = Counter()  # prompt tokens by source (with a cache)
        self.waiting: deque[Part] = deque()
        self.running: list[Part] = []
        self.busy = False
        self.batch: list[tuple[Part, int]] = []
        self.step_start_ms = 0.0
        self.step_ms = 0.0
        self.blocked = False  # the step waits for a split head's KV
        self.steps = 0
        self.busy_ms = 0.0  # time in steps, waits for heads included
        self.blocked_ms = 0.0  # of which waiting for heads beyond the step's own time
        self.debt_ms = 0.0  # CPU others took from this instance's core, added to its next step

    # arrivals

    def add(self, part: Part, now_ms: float) -> None:
        self.waiting.append(part)
        self._kick(now_ms)

    def kv_ready(self, part: Part, now_ms: float) -> None:
        part.ready = True
        self._kick(now_ms)

    def head_ready(self, part: Part, now_ms: float) -> None:
        """The head of `part` (a tail here) is computed on its P, at `now_ms`."""
        part.head_ready_ms = now_ms
        if self.blocked and any(p is part for p, _ in self.batch):
            self._schedule_end()

    # the engine

    def _kick(self, now_ms: float) -> None:
        if not self.busy:
            self._start(now_ms)

    def _start(self, now_ms: float) -> None:
        fit = self.fit
        budget = fit.max_num_batched_tokens
        batch: list[tuple[Part, int]] = []
        prefill = context = 0
        for p in self.running:
            if p.decoding:
                batch.append((p, 0))
                budget -= 1
            elif p.prefill_left > 0 and budget > 0:
                chunk = min(p.prefill_left, budget)
                batch.append((p, chunk))
                budget -= chunk
                prefill += chunk
                context += p.tokens - p.prefill_left
                self._computing(p, chunk)
        if self.waiting and budget > 0 and len(self.running) < fit.max_num_seqs:
            kept: deque[Part] = deque()
            while self.waiting:
                if budget <= 0 or len(self.running) >= fit.max_num_seqs:
                    kept.extend(self.waiting)
                    break
                p = self.waiting.popleft()
                if not p.ready:  # a decode part whose KV is not here yet
                    kept.append(p)
                    continue
                if not self._admit(p):  # no blocks for it: it and those behind it wait
                    kept.append(p)
                    kept.extend(self.waiting)
                    break
                self.running.append(p)
                chunk = min(p.prefill_left, budget)
                batch.append((p, chunk))
                budget -= chunk
                prefill += chunk
                context += p.tokens - p.prefill_left
                self._computing(p, chunk)
            self.waiting = kept
        if not batch:
            self.busy = False
            return
        self.busy = True
        self.batch = batch
        self.step_start_ms = now_ms
        self.step_ms = fit.step_time(len(batch), prefill, context) + self.debt_ms
        self.debt_ms = 0.0
        self._schedule_end()

    def _admit(self, p: Part) -> bool:
        """Take `p`'s blocks and its hit (a part without keys, or no cache: nothing)."""
        cache = self.cache
        if cache is None or p.keys is None:
            return True
        block = self.fit.block_size
        saved = hit_tokens(cache.longest_hit(p.keys), block, p.tokens)
        blocks = math.ceil((p.tokens + max(p.output_tokens - 1, 0)) / block)
        alloc = cache.admit(p.keys, blocks, saved // block)
        if alloc is None:
            return False
        p.alloc = alloc
        have = max(saved, p.external)
        p.prefill_left = p.tokens - have
        if p.counted:
            self.tokens["cached"] += saved
            self.tokens["external"] += have - saved
            self.tokens["computed"] += p.prefill_left
        cache.cache(alloc, p.keys[: have // block])
        return True

    def _computing(self, p: Part, chunk: int) -> None:
        """`p`'s next `chunk` prompt tokens are scheduled: their full blocks are cached."""
        if p.alloc is not None and self.cache is not None and p.keys is not None:
            done = p.tokens - p.prefill_left + chunk
            self.cache.cache(p.alloc, p.keys[: done // self.fit.block_size])

    def _over(self, p: Part) -> None:
        """`p` is over: its answer's full blocks cached (a decoding part), its blocks released."""
        if p.alloc is None or self.cache is None:
            return
        if p.answer_keys:
            self.cache.cache(p.alloc, p.answer_keys)
        self.cache.release(p.alloc)
        p.alloc = None

    def _schedule_end(self) -> None:
        end = self.step_start_ms + self.step_ms
        for p, chunk in self.batch:
            if p.role == "tail" and chunk:
                if p.head_ready_ms is None:
                    self.blocked = True
                    return
                handoff = self.fit.split_handoff_ms if p.handoff_ms is None else p.handoff_ms
                end = max(end, p.head_ready_ms + handoff)
        self.blocked = False
        self.host.schedule(end, self._end)

    def _end(self, now_ms: float) -> None:
        self.steps += 1
        self.busy_ms += now_ms - self.step_start_ms
        self.blocked_ms += max(now_ms - self.step_start_ms - self.step_ms, 0.0)
        over: list[Part] = []
        for p, chunk in self.batch:
            if p.decoding:
                p.tokens_left -= 1
                if p.tokens_left <= 0:
                    over.append(p)
                continue
            p.prefill_left -= chunk
            if p.prefill_left > 0:
                continue
            if p.role in ("prefill", "head"):
                over.append(p)
                self.host.prefill_over(p, now_ms)
                continue
            p.decoding = True
            p.tokens_left -= 1
            self.host.first_token(p, now_ms)
            if p.tokens_left <= 0:
                over.append(p)
        self.batch = []
        for p in over:  # still busy: what the callbacks add waits for the next step
            self.running.remove(p)
            self._over(p)
            if p.role != "prefill" and p.role != "head":
                self.host.finished(p, now_ms)
        self._start(now_ms)
