"""Which instances the router may dispatch to: up until a request to one fails to
get an answer, down until it answers ``/health`` again.

`InstanceHealth` is pure bookkeeping (no I/O, no clock). The fleet marks an
instance down when a request to it gets no status line (refused, reset, timed
out) and probes a down instance's ``/health`` until it answers 200
(`fleet.Fleet.mark_down`).

Invariants:
- Every instance starts up; it is down from `mark_down` until `mark_up`.
- `up()` lists the up instances in configuration order.
- A down instance keeps the reason of the failure that took it down (later
  failures while it is down change nothing).
"""

from __future__ import annotations


class InstanceHealth:
    """Up/down state of `n` instances (indices ``0..n-1``; more join with `add`)."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._down: dict[int, str] = {}  # index -> why it is down

    def add(self) -> int:
        """One more instance, up; its index."""
        self._n += 1
        return self._n - 1

    def mark_down(self, i: int, reason: str) -> bool:
        """Instance `i` failed to answer; True if it was up until now."""
        self._check(i)
        if i in self._down:
            return False
        self._down[i] = reason
        return True

    def mark_up(self, i: int) -> bool:
        """Instance `i` answered its health check; True if it was down until now."""
        self._check(i)
        return self._down.pop(i, None) is not None

    def is_up(self, i: int) -> bool:
        self._check(i)
        return i not in self._down

    def down(self, i: int) -> str | None:
        """Why instance `i` is down (None: it is up)."""
        self._check(i)
        return self._down.get(i)

    def up(self) -> list[int]:
        return [i for i in range(self._n) if i not in self._down]

    def _check(self, i: int) -> None:
        if not 0 <= i < self._n:
            raise IndexError(f"no instance {i} of {self._n}")
