"""placement: where a request runs (local, PD, split or fetch), from measured costs
and what each instance holds in its prefix cache.

A pure core (no I/O, no clock, no asyncio), driven by the router through its
shell, `placer` (`Placer`: the router's events in, with the clock's
timestamps, decisions out; imported from `placement.placer`, not from here):

- `model`: per-instance cost lines (prefill per token, decode step per batch
  size, KV transfer per token), learned from observations, with priors from
  this machine's benchmarks (`Models`, `Priors`, `LinearCost`).
- `state`: what the router tracks of each instance's queues (`FleetState`,
  snapshots as `InstanceLoad`); its events take timestamps and return the
  observations the models learn from.
- `policy`: `decide(fleet, models, request, slo)` -> `Decision`: the lowest
  predicted TTFT among options whose predicted TPOT meets the SLO.
- `shape`: when instances that may do anything specialise (`Specializer`).

What `placer` does with them, in short:

    fleet, models = FleetState(n), Models(n)
    d = decide(fleet, models, Request(prompt_tokens, max_tokens, splittable, cached), slo)
    fleet.on_dispatch(xfer_id, d.placement, prompt_tokens, time.monotonic(), max_tokens)
    response.headers["x-rapidkv-placement"] = d.header_value()
    ...
    for obs in fleet.on_first_token(xfer_id, time.monotonic()):  # likewise
        models.learn(obs)                  # on_prefill_done, on_finish
"""

from rapidkv.router.placement.model import (
    DecodeObservation,
    LinearCost,
    Models,
    Observation,
    PrefillObservation,
    Priors,
    TransferObservation,
)
from rapidkv.router.placement.policy import (
    SLO,
    Decision,
    NoPlacement,
    Option,
    Policy,
    Reason,
    Request,
    decide,
    options,
)
from rapidkv.router.placement.shape import Shaping, Specializer
from rapidkv.router.placement.state import (
    Decode,
    FleetState,
    InstanceLoad,
    Kind,
    Placement,
    Role,
)

__all__ = [
    "SLO",
    "Decision",
    "Decode",
    "DecodeObservation",
    "FleetState",
    "InstanceLoad",
    "Kind",
    "LinearCost",
    "Models",
    "NoPlacement",
    "Observation",
    "Option",
    "Placement",
    "Policy",
    "PrefillObservation",
    "Priors",
    "Reason",
    "Request",
    "Role",
    "Shaping",
    "Specializer",
    "TransferObservation",
    "decide",
    "options",
]
