"""What a `TimelineRequest` answers: when things happened to each transfer on
this instance, and the recent engine steps.

Invariants:

- an event keeps the time it first happened (a repeat of it is ignored);
- at most `TIMELINE_MEMORY` transfers are remembered, the one first recorded
  longest ago forgotten first; at most `STEP_MEMORY` steps, the oldest
  forgotten first, and only steps that scheduled tokens (an engine whose
  requests wait for KV, or hold blocks for a transfer, steps with nothing
  scheduled as fast as it can: those steps would crowd out the others);
- not thread-safe: the scheduler side's lock guards every call.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from rapidkv.control.messages import StepTiming, Timeline, XferTimeline

TIMELINE_MEMORY = 4096  # transfers whose events are remembered
STEP_MEMORY = 4096  # engine steps whose timing is remembered
STEPS_ANSWERED = 1024  # the most recent steps a snapshot carries


class TimelineRecorder:
    """Per-transfer events (`XferTimeline`) and engine step timings
    (`StepTiming`), bounded."""

    def __init__(self) -> None:
        self._xfers: OrderedDict[str, XferTimeline] = OrderedDict()  # xfer_id ->
        self._steps: list[StepTiming] = []  # oldest first

    def event(self, xfer_id: str, name: str, t: float | None = None) -> None:
        """Record that `name` happened to `xfer_id` at `t` (default: now)."""
        tl = self._xfers.get(xfer_id)
        if tl is None:
            tl = self._xfers[xfer_id] = XferTimeline(events={})
            while len(self._xfers) > TIMELINE_MEMORY:
                self._xfers.popitem(last=False)
        tl.events.setdefault(name, time.monotonic() if t is None else t)

    def arrival(self, xfer_id: str, state: str, mode: str) -> None:
        """Note where `xfer_id`'s request was when its TransferKV arrived and
        the mode it is served in (its `transfer_kv` event is recorded)."""
        old = self._xfers[xfer_id]
        self._xfers[xfer_id] = XferTimeline(events=old.events, state_at_arrival=state, mode=mode)

    def step(self, timing: StepTiming) -> None:
        """Remember an engine step that returned, unless it scheduled nothing."""
        if not timing.scheduled_tokens:
            return
        self._steps.append(timing)
        if len(self._steps) > STEP_MEMORY:
            del self._steps[: len(self._steps) - STEP_MEMORY]

    def snapshot(self, xfer_ids: list[str]) -> Timeline:
        """Copies of the remembered transfers among `xfer_ids`, and the
        `STEPS_ANSWERED` most recent steps."""
        xfers = {
            x: XferTimeline(events=dict(t.events), state_at_arrival=t.state_at_arrival, mode=t.mode)
            for x in xfer_ids
            if (t := self._xfers.get(x)) is not None
        }
        return Timeline(xfers, list(self._steps[-STEPS_ANSWERED:]))
