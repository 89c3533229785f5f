"""What the router knows of each instance's queues, and the observations they yield.

`FleetState` is pure bookkeeping, like `balance.LeastOutstanding`: no I/O, no
clock, no lock (the router calls it from its one event loop). Every event takes
its time as an argument, in seconds of one monotonic clock (`time.monotonic()`);
the observations it returns are in milliseconds.

Theory of operation
-------------------
A request is dispatched (`on_dispatch`) with a `Placement`:

- ``local``: instance ``j`` computes the whole prompt and decodes;
- ``pd``: ``i`` computes the whole prompt, its KV goes to ``j``, which decodes;
- ``split``: ``i`` computes the first `head_tokens` tokens, ``j`` the rest at
  the same time and decodes (`router.split`);
- ``fetch``: a split whose head ``i`` holds in its prefix cache: ``i``'s part
  is a cache hit, its KV goes to ``j``, which computes the rest and decodes.

A placement carries the prompt tokens each of its instances holds cached
(`Placement.prefill_hit`, `Placement.decode_hit`): each computes only what it
does not hold (`Placement.work`), and only what the decoder lacks crosses.

Its prefill work is queued on the instance(s) computing it, and it counts as a
decode on ``j`` from dispatch on (it will decode there; prefill work queued
after it stalls it). Then, for each request, in this order per side:

- `on_prefill_done`, for every kind but ``local``: P's request is over (its
  one-token answer, or a failure). P's work leaves ``i``'s queue;
- `on_first_token`: D's first token (D's own, not P's stitched one). The
  prefill work on ``j`` (local prompt, split or fetch tail) leaves ``j``'s queue, and the
  request starts decoding there;
- `on_finish`: D's answer is over, whatever the outcome.

A request is forgotten once D's answer is over and, but for ``local``, P's
too (P's request may outlive D's in dual dispatch). A request that never got
its first token leaves its remaining work with it.

Measures (what the observations say):

- a prefill's service time on an instance is from the later of its dispatch and
  the end of that instance's previous prefill, to its own end (P's answer, or
  D's first token for a local prompt): right for one prefill at a time, an
  approximation when vLLM batches several;
- a transfer is from P's answer to D's first token, less the prefill service
  time D spent on other prompts in that window (D's queue, which the policy
  counts on its own; `Models.learn` takes D's step out too); none when D's
  first token comes first;
- a decode step is the request's time from first token to finish, minus the
  prefill service time its instance spent in that window, over its output
  tokens after the first; its batch is the mean number of requests decoding on
  the instance over that window (from a running time integral).
A split tail's time on D (spent partly waiting for the head) counts as D busy
but yields no prefill observation; a failed answer (``ok=False``) yields none.
Nor does a request dispatched to an instance already holding its
`max_num_seqs` requests (when known) yield a prefill or transfer observation
of that instance: vLLM queued it for a slot for a time no event shows.

Invariants (`check` verifies them; the tests call it after every event):
- each instance's counters (`InstanceLoad`) are the sums over the requests
  tracked now, so they are never negative and are all 0 once every request is
  over;
- an instance's flags (healthy, draining, role, block size) change only through
  their setters, never through request events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

from rapidkv.router.placement.model import (
    DecodeObservation,
    Observation,
    PrefillObservation,
    TransferObservation,
)

Role = Literal["any", "prefill", "decode"]
ROLES: tuple[str, ...] = get_args(Role)
Kind = Literal["local", "pd", "split", "fetch"]
HEADED: tuple[str, ...] = ("split", "fetch")  # the kinds with a head computed elsewhere
KINDS: tuple[str, ...] = get_args(Kind)


def beyond_slots(outstanding: int, max_num_seqs: int | None) -> int:
    """How many requests, one more included, an instance holding `outstanding`
    has beyond its engine's `max_num_seqs` (0: a slot is free, or the capacity
    is not known)."""
    return 0 if max_num_seqs is None else max(outstanding - max_num_seqs + 1, 0)


class Decode(NamedTuple):
    """One request dispatched to decode on an instance: the prefill service
    time the instance spent since its first token (the stall it has suffered,
    which its final TPOT carries; 0 before its first token), the output
    tokens it asked for (None: not known), and, before its first token
    (`started` False), the prefill work queued on the instance after it
    (`behind_prefills` parts of `behind_tokens` tokens): the only queued work
    that will stall it, the rest being done before its first token."""

    stalled_ms: float = 0.0
    output_tokens: int | None = None
    started: bool = True
    behind_prefills: int = 0
    behind_tokens: int = 0


@dataclass(frozen=True)
class InstanceLoad:
    """A snapshot of one instance, what the policy decides from.

    - `role`: ``any``; ``prefill`` (only computes prompts whose KV goes
      elsewhere: a PD prefill, a split head); ``decode`` (only decodes, a split
      tail included, as rapidkv's D computes it);
    - `decodes`: requests dispatched to decode here and not finished (started
      decoding or not);
    - `waiting_prefills` / `waiting_prefill_tokens`: prefill work dispatched
      here and not done, as parts and tokens (a split counts its head on P and
      its tail on D);
    - `outstanding`: requests with any part still in flight here;
    - `splits`: split requests in flight with a part here whose split is not
      over (the head's answer or the tail's first token still to come);
    - `block_size`: its KV block size when known (a split's head is whole blocks);
    - `max_num_seqs`: how many requests its engine runs at once when known
      (vLLM's ``--max-num-seqs``; more wait for a slot);
    - `running`: a `Decode` per request of `decodes` (fewer in a hand-made
      load: the others' stall and length are then not known).
    """

    role: Role = "any"
    healthy: bool = True
    draining: bool = False
    decodes: int = 0
    waiting_prefills: int = 0
    waiting_prefill_tokens: int = 0
    outstanding: int = 0
    block_size: int | None = None
    splits: int = 0
    running: tuple[Decode, ...] = ()
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
        counts = (self.decodes, self.waiting_prefills, self.waiting_prefill_tokens)
        stalls = (d.stalled_ms for d in self.running)
        if min(*counts, self.outstanding, self.splits, *stalls) < 0:
            raise ValueError(f"negative load: {self}")
        if len(self.running) > self.decodes:
            raise ValueError(f"more entries in running than decodes: {self}")
        if any(d.output_tokens is not None and d.output_tokens < 1 for d in self.running):
            raise ValueError(f"a decode asks for at least one token: {self}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {self.block_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, not {self.max_num_seqs}")

    @property
    def stalled_ms(self) -> float:
        """The most stall any of its decodes has suffered (0 with none)."""
        return max((d.stalled_ms for d in self.running), default=0.0)

    @property
    def available(self) -> bool:
        """Healthy and not draining: new requests may be placed here."""
        return self.healthy and not self.draining

    @property
    def idle(self) -> bool:
        """Nothing here: no request outstanding, decoding or waiting to prefill
        (a hand-made load may give any of the three without the others)."""
        return not (self.outstanding or self.decodes or self.waiting_prefills)


@dataclass(frozen=True)
class Placement:
    """Where one request runs: `prefill` computes the prompt (its head for a
    split or a fetch; the tail is computed on `decode`), `decode` decodes.

    ``local``: ``prefill == decode``, no head; ``pd``: ``prefill != decode``,
    no head; ``split`` and ``fetch``: ``prefill != decode`` and ``0 <
    head_tokens``; a fetch's head is within what `prefill` holds cached
    (``head_tokens <= prefill_hit``). `prefill_hit` / `decode_hit`: the
    prompt's leading tokens each instance holds in its prefix cache, as the
    router's index tells (0 for a local placement's `prefill_hit`: its one
    instance's is `decode_hit`).
    """

    kind: Kind
    prefill: int
    decode: int
    head_tokens: int = 0
    prefill_hit: int = 0
    decode_hit: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if min(self.prefill, self.decode, self.prefill_hit, self.decode_hit) < 0:
            raise ValueError(f"instance indices and hits are >= 0: {self}")
        if (self.kind == "local") != (self.prefill == self.decode):
            raise ValueError(f"a local placement, and only one, has prefill == decode: {self}")
        if (self.kind in HEADED) != (self.head_tokens > 0):
            raise ValueError(f"a split or a fetch, and only those, has a head: {self}")
        if self.kind == "fetch" and self.head_tokens > self.prefill_hit:
            raise ValueError(f"a fetch's head is cached on its prefill instance: {self}")
        if self.kind == "local" and self.prefill_hit:
            raise ValueError(f"a local placement's hit is its decode_hit: {self}")

    def work(self, prompt_tokens: int) -> dict[int, int]:
        """Prompt tokens each instance computes: what it does not hold cached of
        its part (a split's tail on `decode`), at least one token of a part
        that ends the prompt or the head (vLLM computes the last token of a
        prompt whatever it holds); a fetch's holder computes one."""
        if self.kind in HEADED:
            if not 0 < self.head_tokens < prompt_tokens:
                raise ValueError(
                    f"a head of {self.head_tokens} tokens must leave the decoder "
                    f"some of the {prompt_tokens} prompt tokens"
                )
            head = max(self.head_tokens - self.prefill_hit, 1)
            tail = prompt_tokens - max(self.head_tokens, min(self.decode_hit, prompt_tokens - 1))
            return {self.prefill: head, self.decode: tail}
        hit = self.decode_hit if self.kind == "local" else self.prefill_hit
        return {self.prefill: prompt_tokens - min(hit, prompt_tokens - 1)}

    def transferred(self, prompt_tokens: int) -> int:
        """Prompt tokens whose KV crosses to `decode` (0 for a local placement):
        the prefill instance's part less what the decoder holds cached."""
        if self.kind == "local":
            return 0
        part = self.head_tokens if self.kind in HEADED else prompt_tokens
        return max(part - self.decode_hit, 0)


@dataclass
class _Instance:
    role: Role = "any"
    healthy: bool = True
    draining: bool = False
    block_size: int | None = None
    max_num_seqs: int | None = None
    decodes: int = 0
    decoding: int = 0  # first token seen, not finished
    waiting_prefills: int = 0
    waiting_tokens: int = 0
    outstanding: int = 0
    last_prefill_end_s: float | None = None
    decode_area: float = 0.0  # integral of `decoding` over time, request-seconds
    area_s: float | None = None  # when `decode_area` was last brought up to date
    prefill_busy_ms: float = 0.0  # prefill service time spent here, all in all

    def advance(self, now_s: float) -> None:
        if self.area_s is not None and now_s > self.area_s:
            self.decode_area += self.decoding * (now_s - self.area_s)
        if self.area_s is None or now_s > self.area_s:
            self.area_s = now_s

    def prefill_ended(self, dispatched_s: float, now_s: float) -> float:
        """The service time (ms) of a prefill dispatched at `dispatched_s` that ended now."""
        start = dispatched_s
        if self.last_prefill_end_s is not None:
            start = max(start, self.last_prefill_end_s)
        ms = max(now_s - start, 0.0) * 1000
        if self.last_prefill_end_s is None or now_s > self.last_prefill_end_s:
            self.last_prefill_end_s = now_s
        self.prefill_busy_ms += ms
        return ms


@dataclass
class _Request:
    placement: Placement
    prompt_tokens: int
    dispatched_s: float
    pending: dict[int, int]  # instance -> prefill tokens not done there
    prefill_over: bool  # P's part over (always for local)
    decoder: int  # the instance decoding it now (`placement.decode` until moved)
    output_tokens: int | None  # what it asked for (None: not known)
    prefill_done_s: float | None = None  # P's successful answer
    busy_at_done: float = 0.0  # the decoder's `prefill_busy_ms` then
    first_token_s: float | None = None
    area_at_first: float = 0.0
    busy_at_first: float = 0.0
    decode_over: bool = False
    moved: bool = False  # migrated: what it cost spans two instances (nothing is learnt)
    queued: frozenset[int] = frozenset()  # instances it found with no free sequence slot


class FleetState:
    """Queues of instances ``0..n-1`` (see the module docstring)."""

    def __init__(self, n: int, roles: tuple[Role, ...] | None = None) -> None:
        if n < 0:
            raise ValueError(f"a number of instances is >= 0, not {n}")
        if roles is not None and len(roles) != n:
            raise ValueError(f"{len(roles)} roles for {n} instances")
        self._inst = [_Instance() for _ in range(n)]
        for i, role in enumerate(roles or ()):
            self.set_role(i, role)
        self._requests: dict[str, _Request] = {}

    def __len__(self) -> int:
        return len(self._inst)

    def add(self, role: Role = "any") -> int:
        """One more instance, healthy, idle; its index."""
        self._inst.append(_Instance())
        self.set_role(len(self._inst) - 1, role)
        return len(self._inst) - 1

    @property
    def in_flight(self) -> int:
        """Requests tracked now (dispatched, some part not over)."""
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        """Whether `request_id` is tracked now."""
        return request_id in self._requests

    def tracked(self) -> dict[str, Placement]:
        """The requests tracked now, by id, with their placements."""
        return {rid: r.placement for rid, r in self._requests.items()}

    def view(self) -> tuple[InstanceLoad, ...]:
        """Every instance's `InstanceLoad`, by index."""
        splits = [0] * len(self._inst)
        running: list[list[Decode]] = [[] for _ in self._inst]
        # prefill work queued on each instance after each request, in dispatch order
        behind: dict[int, tuple[int, int]] = {}
        queued = [[0, 0] for _ in self._inst]
        for r in reversed(self._requests.values()):
            behind[id(r)] = tuple(queued[r.decoder])  # type: ignore[assignment]
            for i, tokens in r.pending.items():
                queued[i][0] += 1
                queued[i][1] += tokens
        for r in self._requests.values():
            p = r.placement
            tail_pending = r.first_token_s is None and not r.decode_over
            if p.kind in HEADED and (not r.prefill_over or tail_pending):
                splits[p.prefill] += 1
                splits[r.decoder] += 1
            if r.decode_over:
                continue
            if r.first_token_s is not None:
                suffered = self._inst[r.decoder].prefill_busy_ms - r.busy_at_first
                running[r.decoder].append(Decode(suffered, r.output_tokens))
            else:
                count, tokens = behind[id(r)]
                running[r.decoder].append(Decode(0.0, r.output_tokens, False, count, tokens))
        return tuple(
            InstanceLoad(
                role=s.role,
                healthy=s.healthy,
                draining=s.draining,
                decodes=s.decodes,
                waiting_prefills=s.waiting_prefills,
                waiting_prefill_tokens=s.waiting_tokens,
                outstanding=s.outstanding,
                block_size=s.block_size,
                splits=splits[i],
                running=tuple(running[i]),
                max_num_seqs=s.max_num_seqs,
            )
            for i, s in enumerate(self._inst)
        )

    def available(self, i: int) -> bool:
        """Instance `i` is healthy and not draining (as `InstanceLoad.available`,
        without building the whole `view`)."""
        s = self._at(i)
        return s.healthy and not s.draining

    # instance flags

    def set_healthy(self, i: int, healthy: bool) -> None:
        self._at(i).healthy = healthy

    def set_draining(self, i: int, draining: bool) -> None:
        self._at(i).draining = draining

    def set_role(self, i: int, role: Role) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self._at(i).role = role

    def set_block_size(self, i: int, block_size: int | None) -> None:
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {block_size}")
        self._at(i).block_size = block_size

    def set_max_num_seqs(self, i: int, max_num_seqs: int | None) -> None:
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, not {max_num_seqs}")
        self._at(i).max_num_seqs = max_num_seqs

    # request events

    def on_dispatch(
        self,
        request_id: str,
        placement: Placement,
        prompt_tokens: int,
        now_s: float,
        output_tokens: int | None = None,
    ) -> None:
        """`request_id` was sent where `placement` says, asking for
        `output_tokens` (None: not known). ValueError for an id already in
        flight, a placement outside the fleet, an empty prompt or output."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        if prompt_tokens < 1:
            raise ValueError(f"request {request_id!r}: a prompt has at least one token")
        if output_tokens is not None and output_tokens < 1:
            raise ValueError(f"request {request_id!r}: an output has at least one token")
        self._at(placement.prefill)
        self._at(placement.decode)
        pending = placement.work(prompt_tokens)
        for i, tokens in pending.items():
            s = self._inst[i]
            s.waiting_prefills += 1
            s.waiting_tokens += tokens
        queued = frozenset(
            i
            for i in {placement.prefill, placement.decode}
            if beyond_slots(self._inst[i].outstanding, self._inst[i].max_num_seqs)
        )
        for i in {placement.prefill, placement.decode}:
            self._inst[i].outstanding += 1
        self._inst[placement.decode].decodes += 1
        self._requests[request_id] = _Request(
            placement=placement,
            prompt_tokens=prompt_tokens,
            dispatched_s=now_s,
            pending=pending,
            prefill_over=placement.kind == "local",
            decoder=placement.decode,
            output_tokens=output_tokens,
            queued=queued,
        )

    def on_prefill_done(self, request_id: str, now_s: float, ok: bool = True) -> list[Observation]:
        """P's request for `request_id` (not ``local``) is over: answered
        (`ok`) or failed. A repeated call changes nothing. KeyError for an id
        not tracked (never dispatched, or over on both sides), ValueError for a
        local request (it has no P)."""
        r = self._get(request_id)
        p = r.placement
        if p.kind == "local":
            raise ValueError(f"request {request_id!r} is local: it has no prefill answer")
        if r.prefill_over:
            return []
        r.prefill_over = True
        out: list[Observation] = []
        s = self._inst[p.prefill]
        s.outstanding -= 1
        tokens = self._take(r, p.prefill)
        if tokens:
            ms = s.prefill_ended(r.dispatched_s, now_s)
            if ok:
                r.prefill_done_s = now_s
                r.busy_at_done = self._inst[r.decoder].prefill_busy_ms
                if p.prefill not in r.queued:
                    out.append(PrefillObservation(p.prefill, tokens, ms, s.decoding))
        self._forget_if_over(request_id, r)
        return out

    def on_first_token(self, request_id: str, now_s: float) -> list[Observation]:
        """D's first token for `request_id`. A repeated call, or one after
        `on_finish`, changes nothing; KeyError for an id not tracked."""
        r = self._get(request_id)
        if r.first_token_s is not None or r.decode_over:
            return []
        p = r.placement
        j = self._inst[r.decoder]
        out: list[Observation] = []
        tokens = self._take(r, r.decoder)
        if tokens and not r.moved:  # local prompt or split tail: j's prefill work is done
            ms = j.prefill_ended(r.dispatched_s, now_s)
            if p.kind == "local" and p.decode not in r.queued:
                out.append(PrefillObservation(p.decode, tokens, ms, j.decoding))
        elif (
            p.kind == "pd"
            and r.prefill_done_s is not None
            and not r.moved
            and p.decode not in r.queued
        ):
            busy_ms = j.prefill_busy_ms - r.busy_at_done  # D computing other prompts
            gap = max((now_s - r.prefill_done_s) * 1000 - busy_ms, 0.0)
            tokens = max(p.transferred(r.prompt_tokens), 1)
            out.append(TransferObservation(p.prefill, p.decode, tokens, gap, j.decoding))
        j.advance(now_s)
        j.decoding += 1
        r.first_token_s = now_s
        r.area_at_first = j.decode_area
        r.busy_at_first = j.prefill_busy_ms
        return out

    def on_finish(
        self, request_id: str, now_s: float, output_tokens: int = 0, ok: bool = True
    ) -> list[Observation]:
        """D's answer for `request_id` is over, after `output_tokens` tokens;
        `ok` False for an error or a broken stream (no observation then). A
        repeated call changes nothing; KeyError for an id not tracked."""
        r = self._get(request_id)
        if r.decode_over:
            return []
        r.decode_over = True
        j = self._inst[r.decoder]
        out: list[Observation] = []
        self._take(r, r.decoder)  # work left on D: it never got to its first token
        if r.first_token_s is not None:
            j.advance(now_s)
            window_s = now_s - r.first_token_s
            if ok and not r.moved and output_tokens >= 2 and window_s > 0:
                batch = (j.decode_area - r.area_at_first) / window_s
                busy_ms = j.prefill_busy_ms - r.busy_at_first
                step_ms = (window_s * 1000 - busy_ms) / (output_tokens - 1)
                if step_ms > 0:
                    out.append(DecodeObservation(r.decoder, batch, step_ms))
            j.decoding -= 1
        j.decodes -= 1
        j.outstanding -= 1
        self._forget_if_over(request_id, r)
        return out

    def on_migrated(self, request_id: str, to: int, now_s: float) -> None:
        """`request_id`'s decode moved to instance `to` (a live migration's
        cut-over): it counts there from now on, and teaches the models nothing
        more (its decode spans two instances). A move to where it is, or after
        `on_finish`, changes nothing; KeyError for an id not tracked,
        IndexError for an instance outside the fleet."""
        r = self._get(request_id)
        new = self._at(to)
        if r.decode_over or to == r.decoder:
            return
        old = self._inst[r.decoder]
        self._take(r, r.decoder)  # the prompt work it had there is not done there now
        if r.first_token_s is not None:
            old.advance(now_s)
            old.decoding -= 1
            new.advance(now_s)
            new.decoding += 1
            # the stall it suffered moves with it; it suffers `new`'s from now on
            r.busy_at_first = new.prefill_busy_ms - (old.prefill_busy_ms - r.busy_at_first)
        old.decodes -= 1
        old.outstanding -= 1
        new.decodes += 1
        new.outstanding += 1
        r.decoder = to
        r.moved = True

    # checks

    def check(self) -> None:
        """AssertionError unless every counter is the sum over tracked requests."""
        n = len(self._inst)
        decodes, decoding, waiting, tokens, outstanding = ([0] * n for _ in range(5))
        for r in self._requests.values():
            p = r.placement
            for i, t in r.pending.items():
                waiting[i] += 1
                tokens[i] += t
            if not r.decode_over:
                decodes[r.decoder] += 1
                outstanding[r.decoder] += 1
                if r.first_token_s is not None:
                    decoding[r.decoder] += 1
            if p.kind != "local" and not r.prefill_over:
                outstanding[p.prefill] += 1
        for i, s in enumerate(self._inst):
            got = (s.decodes, s.decoding, s.waiting_prefills, s.waiting_tokens, s.outstanding)
            want = (decodes[i], decoding[i], waiting[i], tokens[i], outstanding[i])
            assert got == want, f"instance {i}: counters {got}, tracked requests say {want}"

    # helpers

    def _take(self, r: _Request, i: int) -> int:
        """Remove `r`'s pending prefill work on `i`; the tokens it had (0 for none)."""
        tokens = r.pending.pop(i, 0)
        if tokens:
            s = self._inst[i]
            s.waiting_prefills -= 1
            s.waiting_tokens -= tokens
        return tokens

    def _forget_if_over(self, request_id: str, r: _Request) -> None:
        if r.decode_over and r.prefill_over:
            del self._requests[request_id]

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not in flight") from None

    def _at(self, i: int) -> _Instance:
        if not 0 <= i < len(self._inst):
            raise IndexError(f"instance {i} out of range 0..{len(self._inst) - 1}")
        return self._inst[i]
