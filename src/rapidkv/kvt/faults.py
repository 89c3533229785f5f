"""Injected send faults: a testing aid (`rapidkv bench chaos`), off by default.

A sending `KvtWorker` given `SendFaults` fails some transfers and delays the
sends of others, as a flaky link would:

- a transfer is *failed* with probability `fail_rate`: its sends go out
  normally up to one of its layers, and the write that would carry that layer
  is never posted; the transfer settles with an error (once its earlier writes
  settled) and its error SendDone reaches the destination, as after a write the
  transport gave up on. The destination recomputes, the source frees;
- every transfer's sends are held back by a delay uniform in
  `[0, send_delay_s]`, from the moment its first write would have been posted
  (later writes of it queue behind, in order).

Both are decided from a hash of the `xfer_id` alone, so every TP rank of a
source fails the same transfers at the same layer and holds them equally long;
with a `prefix`, only transfers whose xfer_id starts with it are touched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

INJECTED = "injected failure (debug_fail_transfer_rate)"
"""The error an injected failure settles its transfer with."""


@dataclass(frozen=True)
class SendFaults:
    fail_rate: float = 0.0  # share of transfers failed, 0..1
    send_delay_s: float = 0.0  # each transfer's sends held up to this long
    prefix: str = ""  # only transfers whose xfer_id starts with this (all: "")

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError(f"fail_rate must be in [0, 1], not {self.fail_rate}")
        if self.send_delay_s < 0:
            raise ValueError(f"send_delay_s must be >= 0, not {self.send_delay_s}")

    def __bool__(self) -> bool:
        return self.fail_rate > 0 or self.send_delay_s > 0

    def plan(self, xfer_id: str, layers: int) -> tuple[int | None, float]:
        """`(layer, delay_s)` for a transfer: the layer whose write fails it (None:
        not failed) and how long its sends are held."""
        if not xfer_id.startswith(self.prefix):
            return None, 0.0
        h = int.from_bytes(hashlib.blake2b(xfer_id.encode(), digest_size=8).digest(), "big")
        fail = (h & 0xFFFFF) / 0x100000 < self.fail_rate
        layer = (h >> 20) % max(layers, 1) if fail else None
        delay = ((h >> 40) & 0xFFFF) / 0xFFFF * self.send_delay_s
        return layer, delay


SendPiece = tuple[Any, int, int]  # (a tracked task, whose .task.xfer_id, first layer, stop layer)


class FaultPlans:
    """Each transfer's `SendFaults.plan`, fixed when its first piece comes
    (its hold counted from then) and kept until `forget` (the oldest dropped
    past `memory`). A sending worker's owner thread only."""

    def __init__(self, faults: SendFaults, layers: int, memory: int = 4096) -> None:
        self.faults, self.layers, self.memory = faults, layers, memory
        self._plans: dict[str, tuple[int | None, float]] = {}  # xfer_id -> (layer, post at)

    def sort(
        self, pieces: Sequence[SendPiece], now: float
    ) -> tuple[list[SendPiece], list[SendPiece], list[tuple[float, SendPiece]]]:
        """`pieces` as (to post now, failing: each carries the layer that fails
        its transfer, held: (when to post, piece))."""
        post: list[SendPiece] = []
        failing: list[SendPiece] = []
        held: list[tuple[float, SendPiece]] = []
        for piece in pieces:
            tracked, first, stop = piece
            xfer_id = tracked.task.xfer_id
            plan = self._plans.get(xfer_id)
            if plan is None:
                layer, delay = self.faults.plan(xfer_id, self.layers)
                plan = self._plans[xfer_id] = (layer, now + delay)
                while len(self._plans) > self.memory:
                    del self._plans[next(iter(self._plans))]
            layer, post_at = plan
            if post_at > now:
                held.append((post_at, piece))
            elif layer is not None and first <= layer < stop:
                failing.append(piece)
            else:
                post.append(piece)
        return post, failing, held

    def forget(self, xfer_id: str) -> None:
        self._plans.pop(xfer_id, None)
