"""Migration sources (`Sources`): the requests this instance runs that a
migration destination may ask the KV of, by their `xfer_id`.

Every request with our `kv_transfer_params` (role `prefill`, `decode` or
`local`; a decode request after its KV arrived and one that was itself migrated
in included) is a source from its admission (`admit`, engine thread) until vLLM
finished it (`finished`, engine thread). A migration TransferKV (RPC loop
thread) names its source by `source_xfer_id`; `check` answers whether it may be
served (GONE: no such request running here; ERROR: D's prompt is not this
request's tokens), `final_tokens` and `block_ids` what may be sent of it now.
The transfer itself is P's machinery (`ProducerSide`): a `Produced` flagged as
a migration, on the source request's `req_id`.

Invariants (under the shared lock):

- a request is in `_by_req` exactly from `admit` to `finished`; `_by_xfer`
  holds the same sources by `xfer_id` (a list: a router that placed the prefill
  and the decode of one `xfer_id` on one instance makes two);
- `lookup` prefers the latest admitted source that is not a prefill (the one
  that goes on decoding).

Reading vLLM's objects off the engine thread. `check`, `final_tokens` and
`block_ids` run on the RPC loop thread, under the shared lock, while the engine
thread may be inside `schedule()` or a forward. What they read, and why it is
sound on vLLM 0.32's CPU build (no async scheduling, no speculative decoding,
one full-attention KV group):

- `request.status`, `num_computed_tokens`, `num_tokens`: single attribute
  reads (atomic under the GIL);
- `request.all_token_ids[:n]`: one list slice (atomic under the GIL); a
  request's tokens are only ever appended (streaming-input sessions, which
  truncate them, are not requests of ours), so a prefix read now is the prefix
  for ever;
- the block table (`kv_cache_manager.get_block_ids`): `req_to_blocks.get`
  (never inserts) and one pass over the request's block list, which the engine
  thread only appends to while the request runs (full attention: no block is
  ever replaced); so the ids of the blocks holding computed tokens are final.
  Preemption (the one exception: vLLM frees every block inside `schedule()`,
  before it calls `build_connector_meta`) is fenced: that step's metadata
  fails the migration (`StepMeta.preempted_xfers`) and the worker, before the
  step's forward may overwrite those blocks, applies every bypass message sent
  so far and waits until no write of it is in flight
  (`WorkerSide.preempted`);
- what is computed: vLLM adds a step's scheduled tokens to
  `num_computed_tokens` right after `build_connector_meta` returns, before the
  forward computes them; the scheduler side knows which step is in flight and
  what it schedules (`SharedState.step_scheduled`), so `final_tokens` counts
  only tokens whose KV a finished forward wrote (at worst it undercounts
  between our `build_connector_meta` and vLLM's update, and the rest goes with
  the next steps);
- prefix-cache hits: vLLM counts a request's hits in `num_computed_tokens`
  when it schedules the request, but it hashes blocks into its cache as it
  *schedules* them, so a hit may be on blocks that same step computes. A
  source's hits are final only once that step ended (`stepped`: its
  `first_step`, the step that scheduled it first since admission or its latest
  preemption, against `SharedState.step_ended_id`); until then `final_tokens`
  is 0, and P's plan (`ProducerSide.plan_step`, for P's own transfers and
  migrations alike) sends them layer by layer with that step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from rapidkv.connector.shared_state import SharedState
from rapidkv.control.codes import Code
from rapidkv.control.messages import TransferKV, TransferKVReply, prompt_hash

ROLES = ("prefill", "decode", "local")


@dataclass
class Source:
    """A running request a migration may copy the KV of."""

    xfer_id: str
    req_id: str
    role: str
    request: Any  # vLLM's Request (read off the engine thread: see the module doc)
    # the step that scheduled it first (since its latest preemption): its
    # prefix-cache hits are final once that step ended; None before it
    first_step: int | None = None


class Sources:
    """The migration sources of this instance, by `xfer_id` and by request id."""

    def __init__(self, shared: SharedState) -> None:
        self._shared = shared
        self._counters: Counter[str] = shared.counters  # the shared state's own
        self._by_req: dict[str, Source] = {}
        self._by_xfer: dict[str, list[Source]] = {}

    # -- engine thread (caller holds the lock) -------------------------------------

    def admit(self, request: Any, xfer_id: str, role: str) -> None:
        """`request` (role `role`) was admitted: a source from now on."""
        source = Source(xfer_id, request.request_id, role, request)
        self._by_req[source.req_id] = source
        self._by_xfer.setdefault(xfer_id, []).append(source)

    def on_step(self, step_id: int, scheduled: Any, preempted: Any) -> None:
        """Step `step_id` schedules `scheduled` (request ids) after vLLM
        preempted `preempted`: a source scheduled for the first time since its
        admission or preemption has its hits final once this step ended."""
        for req_id in preempted or ():
            source = self._by_req.get(req_id)
            if source is not None:
                source.first_step = None
        for req_id in scheduled:
            source = self._by_req.get(req_id)
            if source is not None and source.first_step is None:
                source.first_step = step_id

    def finished(self, req_id: str) -> None:
        """vLLM finished the request: no longer a source."""
        source = self._by_req.pop(req_id, None)
        if source is None:
            return
        same = self._by_xfer[source.xfer_id]
        same.remove(source)
        if not same:
            del self._by_xfer[source.xfer_id]

    # -- RPC loop thread (caller holds the lock) -----------------------------------

    def lookup(self, xfer_id: str) -> Source | None:
        """The source with this `xfer_id`: the latest admitted that is not a
        prefill, else the latest."""
        same = self._by_xfer.get(xfer_id)
        if not same:
            return None
        decoding = [s for s in same if s.role != "prefill"]
        return (decoding or same)[-1]

    def check(self, msg: TransferKV) -> Source | TransferKVReply:
        """The source `msg` (a migration) asks for, or the refusal: GONE when no
        such request runs here (counted `migration_unknown_source`), ERROR when
        D's prompt is not the request's first `num_tokens + 1` tokens (counted
        `migration_prompt_mismatch`; the source request is untouched)."""
        assert msg.source_xfer_id is not None
        source = self.lookup(msg.source_xfer_id)
        if source is None or source.request.status.name != "RUNNING":
            self._counters["migration_unknown_source"] += 1
            why = "not running" if source is not None else "unknown"
            return TransferKVReply(
                xfer_id=msg.xfer_id,
                code=Code.GONE,
                message=f"migration source {msg.source_xfer_id} {why} on "
                f"{self._shared.instance_id}",
            )
        tokens = source.request.all_token_ids[: msg.num_tokens + 1]
        if len(tokens) < msg.num_tokens + 1 or prompt_hash(tokens) != msg.prompt_hash:
            self._counters["migration_prompt_mismatch"] += 1
            return TransferKVReply(
                xfer_id=msg.xfer_id,
                code=Code.ERROR,
                message=f"migration source {msg.source_xfer_id}: its first "
                f"{msg.num_tokens + 1} tokens differ from the destination's prompt "
                f"(the source has {len(tokens)} of them)",
            )
        return source

    def stepped(self, req_id: str) -> bool:
        """The step that first scheduled request `req_id` (`on_step`) ended:
        what vLLM counts computed of it is no longer a hit on blocks being
        computed (True for no source: nothing of ours to guard)."""
        source = self._by_req.get(req_id)
        if source is None:
            return True
        return source.first_step is not None and self._shared.step_ended_id >= source.first_step

    def final_tokens(self, source: Source) -> int:
        """How many leading tokens of `source` have their KV written by a
        forward that finished (see the module doc): none before its first step
        ended."""
        if not self.stepped(source.req_id):
            return 0
        request = source.request
        in_flight = 0
        if self._shared.step_in_flight is not None:
            in_flight = self._shared.step_scheduled.get(source.req_id, 0)
        return max(0, min(request.num_tokens - 1, request.num_computed_tokens - in_flight))

    def block_ids(self, source: Source) -> tuple[int, ...]:
        """The request's block table now (block i holds tokens `[i * block_size,
        (i + 1) * block_size)`); empty if vLLM holds no blocks for it."""
        manager = self._shared.kv_cache_manager
        return tuple(manager.get_block_ids(source.req_id)[0]) if manager is not None else ()

    def gauges(self) -> dict[str, float]:
        """Requests addressable as migration sources (caller holds the lock)."""
        return {"migration_sources": float(len(self._by_req))}
