"""Polling a condition with a deadline: the only way this package waits.

Invariant: `wait_until` returns the first truthy value the predicate produced, or
raises `TimeoutError` after at most `timeout` seconds (plus one predicate call); it
never waits a fixed time in place of checking the condition.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    *,
    interval: float = 0.05,
    max_interval: float = 0.5,
    what: str = "condition",
) -> T:
    """Call `predicate` until it returns something truthy; return that value.

    Polls every `interval` seconds (growing to at most `max_interval`). Raises
    `TimeoutError` naming `what` when `timeout` seconds pass without success.
    """
    deadline = time.monotonic() + timeout
    delay = interval
    while True:
        value = predicate()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(min(delay, remaining))
        delay = min(delay * 1.5, max(max_interval, interval))
