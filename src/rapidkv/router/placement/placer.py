"""The router's adaptive placement: the pure `placement` core fed from what the
router sees, one instance index per fleet member (`fleet.Fleet`: the
configured `RouterConfig.members`, then those that joined).

`Placer` keeps a `FleetState` and learned `Models`; the request path and the
fleet call it on the router's one event loop (no locks). `adaptive_placer`
makes a router's (``--placement adaptive``; None for ``fixed``).

The request path (`proxy`, `prefill`, `answer`, `migration.controller`) calls:

- `decide` for each request (``--placement adaptive``), then `dispatched`
  with the placement it really used; before deciding, its `Specializer` (if
  any) hears of the request and sets the fleet's roles for the load seen
  (`placement.shape`: instances configured ``both`` may be pinned to prefill
  or to decode);
- `prefill_done` when P's part is over, `first_token` when D's own first
  output event is relayed (streamed answers: a non-streamed one has no first
  token the router can see, and teaches the models nothing), `finished` when
  D's answer is over; each feeds the observations it yields to the models;
- `migrated` when a live migration moved the request's decode.

The fleet calls `set_healthy`, `set_draining`, `set_block_size` and
`set_max_num_seqs` as it learns them, and `join` when an instance joins
through etcd or comes back.

A request's prompt length is its token ids' count when the router knows them
(`fleet.prefix_caches`: token-id prompts, or text and chat through the
model's tokenizer), else estimated: text is taken as `CHARS_PER_TOKEN`
characters a token (the policy needs magnitudes, not counts); what each
instance holds of it in its prefix cache comes with the ids. Its output
length is its ``max_tokens`` (or ``max_completion_tokens``),
`DEFAULT_OUTPUT_TOKENS` without one.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from rapidkv.router.config import Member, RouterConfig
from rapidkv.router.placement import (
    SLO,
    Decision,
    FleetState,
    Models,
    Placement,
    Policy,
    Request,
    Specializer,
    decide,
)
from rapidkv.router.placement.state import Role
from rapidkv.router.rewrite import Body, Endpoint, token_ids

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4
DEFAULT_OUTPUT_TOKENS = 16


def estimate_prompt_tokens(body: Body, endpoint: Endpoint) -> int:
    """About how many tokens the request's prompt has (at least 1)."""
    if endpoint == "completions":
        prompt = body.get("prompt")
        ids = token_ids(prompt)
        if ids is not None:
            return len(ids)
        text = prompt if isinstance(prompt, str) else str(prompt)
    else:
        text = "".join(_message_text(m) for m in body.get("messages") or ())
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def requested_output_tokens(body: Body) -> int:
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_OUTPUT_TOKENS


def _message_text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _role(member: Member) -> Role:
    return "any" if member.label == "both" else member.label  # type: ignore[return-value]


def adaptive_placer(config: RouterConfig) -> Placer | None:
    """The placer of a router with `config` over its configured members (None:
    ``--placement fixed``)."""
    if config.placement != "adaptive":
        return None
    return Placer(
        config.members,
        SLO(config.ttft_slo_ms, config.tpot_slo_ms),
        Policy(
            split=config.split_prefill,
            split_min_tokens=config.split_min_tokens,
            ttft_headroom=config.ttft_headroom,
            tpot_margin=config.tpot_margin,
            idle_crossings=config.idle_crossings,
            fetch=config.prefix_fetch,
            stitch=config.prefill_first_token and config.dispatch == "dual",
        ),
        Specializer() if config.specialize else None,
    )


class Placer:
    """Adaptive placement over the router's members."""

    def __init__(
        self,
        members: tuple[Member, ...],
        slo: SLO,
        policy: Policy,
        shape: Specializer | None = None,
    ) -> None:
        self.slo = slo
        self.policy = policy
        self.roles: list[Role] = [_role(m) for m in members]  # as configured
        self.fleet = FleetState(len(members), tuple(self.roles))
        self.models = Models(len(members))
        self.shape = shape

    def decide(
        self,
        body: Body,
        endpoint: Endpoint,
        splittable: bool,
        prompt_ids: list[int] | None = None,
        cached: tuple[int, ...] = (),
    ) -> tuple[Decision, Request]:
        """The decision for this request and the request as placement saw it
        (its prompt tokens, counted from `prompt_ids` when given, else
        estimated; the output it asks for; per instance index the prompt's
        leading tokens it holds cached, `cached`); `placement.NoPlacement` if
        no available instance can decode it."""
        tokens = len(prompt_ids) if prompt_ids else estimate_prompt_tokens(body, endpoint)
        cached = tuple(min(c, tokens) for c in cached)
        request = Request(tokens, requested_output_tokens(body), splittable, cached)
        if self.shape is not None:
            self.shape.arrived(time.monotonic(), tokens, request.output_tokens, cached)
            self.shape.apply(
                self.fleet, self.roles, self.models, self.slo.tpot_ms, self.slo.ttft_ms
            )
        return decide(self.fleet, self.models, request, self.slo, self.policy), request

    def dispatched(
        self, xfer_id: str, placement: Placement, prompt_tokens: int, output_tokens: int
    ) -> None:
        self.fleet.on_dispatch(
            xfer_id, placement, prompt_tokens, time.monotonic(), output_tokens=output_tokens
        )

    def prefill_done(self, xfer_id: str, ok: bool) -> None:
        self._learn(self.fleet.on_prefill_done, xfer_id, ok=ok)

    def first_token(self, xfer_id: str) -> None:
        self._learn(self.fleet.on_first_token, xfer_id)

    def finished(self, xfer_id: str, output_tokens: int, ok: bool) -> None:
        self._learn(self.fleet.on_finish, xfer_id, output_tokens=output_tokens, ok=ok)

    def migrated(self, xfer_id: str, index: int) -> None:
        """The request's decode moved to instance `index` (a migration's cut-over)."""
        if xfer_id in self.fleet:
            self.fleet.on_migrated(xfer_id, index, time.monotonic())

    def join(self, index: int, member: Member) -> None:
        """Member `index` joined the fleet (a new one: the next index) or came
        back (`fleet.Fleet.follow`): healthy, with its role, block size and max_num_seqs."""
        if index == len(self.fleet):
            self.models.add()
            self.fleet.add(_role(member))
            self.roles.append(_role(member))
        self.roles[index] = _role(member)
        self.fleet.set_role(index, _role(member))
        self.fleet.set_healthy(index, True)
        self.fleet.set_block_size(index, member.instance.block_size)
        self.fleet.set_max_num_seqs(index, member.instance.max_num_seqs)

    def set_healthy(self, index: int, healthy: bool) -> None:
        self.fleet.set_healthy(index, healthy)

    def set_draining(self, index: int, draining: bool) -> None:
        self.fleet.set_draining(index, draining)

    def set_block_size(self, index: int, block_size: int | None) -> None:
        self.fleet.set_block_size(index, block_size)

    def set_max_num_seqs(self, index: int, max_num_seqs: int | None) -> None:
        self.fleet.set_max_num_seqs(index, max_num_seqs)

    def _learn(self, event: Any, xfer_id: str, **kwargs: Any) -> None:
        if xfer_id not in self.fleet:
            return
        try:
            observations = event(xfer_id, time.monotonic(), **kwargs)
        except ValueError:  # out of order for this request: a router bug, not the client's
            log.exception("xfer %s: placement bookkeeping refused an event", xfer_id)
            return
        for obs in observations:
            self.models.learn(obs)
