"""Choosing an instance: least outstanding requests, ties taken in turn.

`LeastOutstanding` is pure bookkeeping (no I/O, no clock, no lock: the router
calls it from its one event loop).

Invariants:
- ``outstanding(i)`` is the number of `acquire` calls that returned ``i`` and
  have not been `release`d; it never goes negative (releasing more than was
  acquired is a bug and raises).
- `acquire` returns an eligible instance with the fewest outstanding requests
  among the eligible ones. Among
  several such instances it returns the first at or after a cursor that moves
  past each pick, so equal loads are served round-robin. Each `turn` (e.g. a
  role) has a cursor of its own, so picks for one role do not skip instances
  of another; the counts are shared.
"""

from __future__ import annotations

from collections.abc import Collection


class LeastOutstanding:
    """Least-outstanding choice among `n` instances (indices ``0..n-1``; more
    join with `add`)."""

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"a number of instances is >= 0, not {n}")
        self._counts = [0] * n
        self._cursors: dict[str, int] = {}

    def add(self) -> int:
        """One more instance, with nothing outstanding; its index."""
        self._counts.append(0)
        return len(self._counts) - 1

    def acquire(self, eligible: Collection[int] | None = None, turn: str = "") -> int:
        """Pick an instance (among `eligible`, default all) and count one more
        request outstanding on it. ValueError if `eligible` is empty."""
        n = len(self._counts)
        allowed = range(n) if eligible is None else eligible
        if not allowed:
            raise ValueError("no eligible instance")
        low = min(self._counts[i] for i in allowed)
        cursor = self._cursors.get(turn, 0)
        for k in range(n):
            i = (cursor + k) % n
            if self._counts[i] == low and i in allowed:
                break
        self._counts[i] += 1
        self._cursors[turn] = (i + 1) % n
        return i

    def hold(self, i: int) -> None:
        """Count one more request outstanding on instance `i`, chosen elsewhere
        (the cursors do not move)."""
        if not 0 <= i < len(self._counts):
            raise IndexError(f"no instance {i} of {len(self._counts)}")
        self._counts[i] += 1

    def release(self, i: int) -> None:
        """One request on instance `i` is over."""
        if self._counts[i] <= 0:
            raise ValueError(f"instance {i} has no outstanding request to release")
        self._counts[i] -= 1

    def outstanding(self, i: int) -> int:
        return self._counts[i]

    def __len__(self) -> int:
        return len(self._counts)
