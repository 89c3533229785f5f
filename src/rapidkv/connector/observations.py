"""The connector's histogram observations (`Observations`, pure): values such
as one transfer's duration, kept until the next stats payload takes them, and
their running count and sum.

A name carries its unit as its suffix (``_seconds``, ``_bytes``), which picks
the Prometheus buckets it is exported with (`metrics.buckets_for`). Names
today: P's `transfer_seconds` and `transfer_bytes` (a transfer settled ok on
every rank), a migration source's `migration_transfer_seconds` and
`migration_transfer_bytes`, and D's `kv_wait_seconds` (a request's wait for
its remote KV, until loaded or failed; an abort while waiting observes none).

The values wait here between payloads (at most `STATS_INTERVAL_S` while the
engine steps: vLLM asks for a payload at every step); a name holds at most
`MAX_PENDING` of them, any beyond are dropped from the payload (never from
the count and sum) and counted in `dropped`.
"""

from __future__ import annotations

MAX_PENDING = 10_000  # values per name between two payloads


class Observations:
    """Values observed per name since the last `take`, and every value's
    count and sum since the start (the caller serializes access: the
    scheduler side's lock)."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self._max_pending = max_pending
        self._pending: dict[str, list[float]] = {}
        self._count: dict[str, int] = {}
        self._sum: dict[str, float] = {}
        self.dropped = 0  # values left out of a payload (over `max_pending`)

    def observe(self, name: str, value: float) -> None:
        self._count[name] = self._count.get(name, 0) + 1
        self._sum[name] = self._sum.get(name, 0.0) + value
        pending = self._pending.setdefault(name, [])
        if len(pending) < self._max_pending:
            pending.append(float(value))
        else:
            self.dropped += 1

    def take(self) -> dict[str, list[float]]:
        """The values observed since the previous call, per name (only names
        with some); they are not returned again."""
        out = {name: values for name, values in self._pending.items() if values}
        self._pending = {}
        return out

    def totals(self) -> dict[str, float]:
        """``<name>_count`` and ``<name>_sum`` of every name observed so far."""
        out: dict[str, float] = {}
        for name, count in self._count.items():
            out[f"{name}_count"] = float(count)
            out[f"{name}_sum"] = self._sum[name]
        return out
