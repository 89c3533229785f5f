"""What P sends when (`TransferSender`): each step's plan for P's live
transfers, the sends that go over the bypass channel the moment a TransferKV
is accepted, and the substeps' resolution by the ranks' acks. Which transfers
are live, and how they end, is the ledger's (transfer_ledger.py); admission
and the control plane are `ProducerSide`'s (producer_side.py).

- every step (`plan_step`), every live transfer sends what is computed and
  asked for and not sent yet: KV final before the step as full sends, KV the
  step computes layer by layer (`Produced.next_tasks`, plan.py); a request's
  prefix-cache hits count as final only once the step that first scheduled
  it ended (`Sources.stepped`); KV past a prefill's prompt is never sent;
- what a step computed is final once it returned (`step_ended`);
- `bypass` mode, or a finished request: its KV is complete (its blocks are
  held for the transfer), all of it goes at once as a full send;
- `substep` mode: a request whose last chunk the step in flight computes gets
  that step's part attached to the step as a substep (journal.py); what
  earlier steps computed goes at once as a full send; anything else waits for
  the next step, as in `step` mode;
- a migration: what its source computed and is final goes at once as a full
  send, whatever the `transfer_kv_mode`; the rest with the next steps;
- once every rank acked a step with substeps (`take_acks`), what no rank sent
  is rolled back on its transfer (`sent_upto`, `issued`, `last_issued` as
  before the substep: the next step sends it), and the ranks that missed a
  substep send it alone (`PendingMeta.rank_full`), unless its transfer is over
  by now (aborted, failed or settled).

All under the shared lock, which every caller holds. Without the bypass
channel nothing goes between steps (the next step sends it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from rapidkv.connector.bypass import BypassMsg
from rapidkv.connector.journal import Entry, JournalError, Resolution, SubstepJournal
from rapidkv.connector.metadata import StepMeta
from rapidkv.connector.producer import Produced
from rapidkv.connector.shared_state import SharedState
from rapidkv.connector.sources import Source, Sources
from rapidkv.connector.transfer_ledger import TransferLedger

log = logging.getLogger(__name__)

# what a rolled-back substep restores on its Produced: (sent_upto, issued, last_issued)
Undo = tuple[int, bool, bool]


class TransferSender:
    """What P's transfers send when: each step's plan, full sends and
    substeps over the bypass channel, and what becomes of the substeps once
    the ranks acked them."""

    def __init__(
        self,
        shared: SharedState,
        sources: Sources,
        ledger: TransferLedger,
        requests: dict[str, Any],
    ) -> None:
        self._shared = shared
        self._sources = sources
        self._ledger = ledger
        # ProducerSide's: req_id -> vLLM's request, for num_computed_tokens (read only)
        self._requests = requests
        # the shared state's own objects, never reassigned
        self._counters = shared.counters
        self._block_size = shared.block_size
        # substeps attached to the step in flight, awaiting every rank's ack
        self._journal: SubstepJournal[Undo] = SubstepJournal(shared.tp_size)

    def plan_step(self, meta: StepMeta, so: Any, now: float) -> None:
        """Into the metadata of step `shared.step_id` (vLLM's scheduler output
        `so`): what every live transfer may send now, full sends and this
        step's layer-by-layer sends (caller handled preemptions first)."""
        scheduled = so.num_scheduled_tokens
        step_id = self._shared.step_id
        for p in list(self._ledger.produced.values()):
            n = scheduled.get(p.req_id)
            if n is not None:
                p.block_ids = tuple(self._shared.kv_cache_manager.get_block_ids(p.req_id)[0])
                request = self._requests.get(p.req_id)
                start = p.computed
                if request is not None:  # (KV past the prompt is not ours to send)
                    start = min(request.num_computed_tokens, p.prompt_len)
                    if self._sources.stepped(p.req_id):
                        p.computed = start
                    # else its first step: vLLM counts its prefix-cache hits computed,
                    # but it hashed blocks into its cache as it *scheduled* them: a
                    # hit may be on blocks another request computes in this very
                    # step. Final only once the step that first scheduled the
                    # request ended (`Sources.stepped`: a prefill request is a
                    # source too); until then they go layer by layer, as this
                    # step computes them.
                p.in_flight_end = min(start + n, p.prompt_len)
                p.scheduled_step = step_id
                if not p.migration:  # a migration's source computes no prompt of ours
                    if p.computed < p.prompt_len and self._shared.config.faulted(p.xfer_id):
                        meta.delays_layers = True
                    if p.computed < p.prompt_len - 1 <= p.in_flight_end:
                        p.last_chunk_step = step_id
                        self._shared.timeline.event(p.xfer_id, "last_chunk_begin", now)
            full, step = p.next_tasks(self._block_size, scheduled=n is not None)
            if full is not None:
                meta.full_tasks.append(full)
            if step is not None:
                meta.step_tasks.append(step)

    def step_ended(self, step_id: int, now: float) -> None:
        """Step `step_id` returned at `now`: what it computed is final."""
        for p in self._ledger.produced.values():
            if p.last_chunk_step == step_id:
                self._shared.timeline.event(p.xfer_id, "last_chunk_end", now)
            if p.scheduled_step == step_id:
                p.scheduled_step = None
                p.computed = max(p.computed, p.in_flight_end)

    def send_now(self, p: Produced, substep: bool) -> None:
        """bypass / substep: act on a TransferKV the moment it is accepted.

        A finished request's KV is complete (its blocks are held for the
        transfer): send it all now over the bypass channel. With `substep`, a
        request whose last chunk the step in flight computes gets that step's
        part attached to the step (what earlier steps computed goes now). Anything
        else waits for the next step, as in `step` mode."""
        bypass = self._shared.bypass
        if bypass is None or p.aborted or p.window is None:
            return
        if p.finished:
            full, _ = p.next_tasks(self._block_size, scheduled=False)
            if full is not None:
                bypass.send(BypassMsg(kind="full", tasks=[full]))
                self._counters["bypass_full_sends"] += 1
                self._shared.timeline.event(p.xfer_id, "bypass_sent")
            return
        step_id = self._shared.step_in_flight
        in_flight = step_id is not None and p.scheduled_step == step_id
        if not substep or not in_flight or p.in_flight_end < p.window.num_tokens:
            return
        issued_before = p.issued
        full, step = p.next_tasks(self._block_size, scheduled=True)
        if full is not None:
            bypass.send(BypassMsg(kind="full", tasks=[full]))
            self._counters["bypass_full_sends"] += 1
        if step is None:
            return
        assert step_id is not None
        undo = (step.seen_tokens, issued_before or full is not None, False)
        substep_id = self._journal.open_substep(step_id, [Entry(p.xfer_id, (step,), undo)])
        bypass.send(BypassMsg(kind="substep", tasks=[step], step_id=step_id, substep_id=substep_id))
        self._counters["substeps_opened"] += 1
        self._shared.timeline.event(p.xfer_id, "substep_sent")

    def send_migration_now(self, p: Produced, source: Source) -> int:
        """Send over the bypass channel every block of the migration whose KV
        is final now (in every `transfer_kv_mode`); the rest goes with the steps
        that compute it (`plan_step`). How many tokens were final."""
        final = self._sources.final_tokens(source)
        bypass = self._shared.bypass
        if bypass is None:
            return final
        p.computed = max(p.computed, final)
        p.in_flight_end = max(p.in_flight_end, p.computed)
        p.block_ids = self._sources.block_ids(source)
        try:
            full, _ = p.next_tasks(self._block_size, scheduled=False)
        except ValueError as e:  # no blocks: vLLM preempted it just now (the step fails it)
            log.warning("rapidkv %s: migration %s: %s", self._shared.instance_id, p.xfer_id, e)
            return final
        if full is not None:
            bypass.send(BypassMsg(kind="full", tasks=[full]))
            self._counters["bypass_full_sends"] += 1
            self._shared.timeline.event(p.xfer_id, "bypass_sent")
        return final

    def take_acks(self, acks: Iterable[tuple[int, int, int]]) -> None:
        """The ranks' `(step, ack, rank)`: resolve the substeps of fully acked steps."""
        for step_id, ack, rank in acks:
            try:
                resolution = self._journal.ack(step_id, rank, ack)
            except JournalError:
                log.exception("rapidkv %s: bad ack from rank %d", self._shared.instance_id, rank)
                continue
            if resolution is not None:
                self._resolve(resolution)

    def _resolve(self, r: Resolution[Undo]) -> None:
        """Every rank acked a step with substeps: roll back what no rank sent (the
        next step sends it), have the ranks that missed a substep send it alone
        (unless its transfer is over by now: aborted, failed or settled)."""
        self._counters["substeps_accepted"] += len(r.accepted)
        for entry in r.rolled_back:
            self._counters["substeps_rolled_back"] += 1
            p = self._ledger.produced.get(entry.xfer_id)
            if p is not None and p.window is not None:
                p.sent_upto, p.issued, p.last_issued = entry.undo
                self._ledger.maybe_release(p)
        for entry, ranks in r.resend:
            p = self._ledger.produced.get(entry.xfer_id)
            if p is None or p.aborted or p.window is None:
                continue  # aborted, failed or settled since: nothing to send
            self._counters["substeps_resent"] += 1
            for rank in ranks:
                self._shared.pending.rank_full.setdefault(rank, []).extend(entry.tasks)
