"""Whether each decode instance's transfers work: a pair can be up (both
answer ``/health``) and still never transfer (every TransferKV failing, D
recomputing every prompt). The router reads each decode instance's connector
counters over the control plane every `transfer_check_interval_s`
(`transfer_watcher.TransferWatcher`) and feeds them here.

`TransferWatch` is pure bookkeeping (no I/O, no clock). Per decode instance it
keeps the last cumulative counts of the two ends a TransferKV can come to
(`transfer_kv_ok`: P answered that the KV was sent; `recompute_fallbacks`: it
was not, D recomputes) and a state:

- ``unknown``: not read yet, unreadable, or no TransferKV ended since then;
- ``ok``: since the previous reading some TransferKV succeeded;
- ``degraded``: since the previous reading TransferKVs ended and every one
  fell back to recompute.

Outcomes, not sends, are compared: a TransferKV sent before a reading and
ended after it counts in the window where it ended, so a reading taken while
transfers are in flight cannot make a failing pair look healthy.

Invariants: a state changes only on a reading that shows TransferKVs ended (an
idle instance keeps its state); counters that went down (the instance
restarted) start over from that reading, as does an unreadable one.
"""

from __future__ import annotations

STATES = ("unknown", "ok", "degraded")


class TransferWatch:
    """Transfer state of decode instances, by index (any not observed: ``unknown``)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, float]] = {}
        self._state: dict[int, str] = {}

    def observe(self, i: int, counters: dict[str, float] | None) -> str | None:
        """A reading of instance `i`'s counters (None: it could not be read);
        returns the new state if it changed."""
        if counters is None:
            self._last.pop(i, None)
            return self._set(i, "unknown")
        now = (counters.get("transfer_kv_ok", 0.0), counters.get("recompute_fallbacks", 0.0))
        last = self._last.get(i)
        self._last[i] = now
        if last is None or now[0] < last[0] or now[1] < last[1]:
            return None  # a first reading, or a restarted instance: nothing to compare
        ok, fell_back = now[0] - last[0], now[1] - last[1]
        if ok <= 0 and fell_back <= 0:
            return None
        return self._set(i, "ok" if ok > 0 else "degraded")

    def state(self, i: int) -> str:
        return self._state.get(i, "unknown")

    def _set(self, i: int, state: str) -> str | None:
        if self.state(i) == state:
            return None
        self._state[i] = state
        return state
