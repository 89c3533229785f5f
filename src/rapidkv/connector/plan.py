"""Which blocks of a request go out, and when: a pure function of token counts.

A transfer (one `xfer_id`) moves the KV of tokens `[0, num_tokens)` of a prompt
from P to D, where `num_tokens = prompt_len - 1` (D recomputes the last prompt
token), or, in a split prefill, P's whole prompt (a block-aligned head of D's,
whose tail D computes itself). D's prefix-cache hits, the first `first_block` blocks, are never
written. P computes the prompt in chunks; at any moment three token counts
describe a request on P:

    sent_upto          ready_upto          <= in_flight_upto
    at D already or    KV final at P       KV final once the step
    covered by issued  (completed steps)   in flight finishes its layers
    tasks (starts at
    D's prefix hits)

`plan` splits what is not yet sent into a *full* task (KV already final: send
every layer now) and a *step* task (computed by the step in flight: send each
layer as it finishes). Rules, for every plan and every sequence of plans:

- tasks start where the previous one ended: together they cover
  `[first_block * block_size, num_tokens)` exactly once, in order;
- a task ends on a block boundary unless it carries the last token
  (`end == num_tokens`); a block is therefore written exactly once, and a
  partially filled tail only by the last task;
- nothing is planned past `in_flight_upto` (KV not computed) nor past
  `num_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidkv.kvt.task import Task


@dataclass(frozen=True)
class Window:
    """What the destination asked for (from its TransferKV)."""

    xfer_id: str
    peer: str
    dst_blocks: tuple[int, ...]  # one per block of tokens [0, num_tokens)
    first_block: int  # blocks before this are D's prefix hits: never written
    num_tokens: int
    notify_layers: bool = False  # D computes with the layers as they land

    def start(self, block_size: int) -> int:
        return self.first_block * block_size


@dataclass(frozen=True)
class Plan:
    full: Task | None  # KV final now: send all layers at once
    step: Task | None  # KV computed by the step in flight: send layer by layer
    sent_upto: int  # tokens at D or covered once these tasks are issued


def _end(upto: int, window: Window, block_size: int) -> int:
    """How far a task may reach when the KV is final up to `upto` tokens."""
    if upto >= window.num_tokens:
        return window.num_tokens
    return upto // block_size * block_size


def _task(window: Window, src_blocks: tuple[int, ...], start: int, end: int, bs: int) -> Task:
    first, stop = start // bs, -(-end // bs)
    if stop > len(src_blocks) or stop > len(window.dst_blocks):
        raise ValueError(
            f"xfer {window.xfer_id}: tokens up to {end} need {stop} blocks; P has "
            f"{len(src_blocks)}, D gave {len(window.dst_blocks)}"
        )
    return Task(
        xfer_id=window.xfer_id,
        peer=window.peer,
        src_blocks=src_blocks[first:stop],
        dst_blocks=window.dst_blocks[first:stop],
        seen_tokens=start,
        new_tokens=end - start,
        has_last_token=end == window.num_tokens,
        notify_layers=window.notify_layers,
    )


def plan(
    window: Window,
    block_size: int,
    src_blocks: tuple[int, ...],
    sent_upto: int,
    ready_upto: int,
    in_flight_upto: int,
) -> Plan:
    """Tasks for everything computable that is not sent yet (see module doc).

    `src_blocks` is P's block table for the request (block i holds tokens
    `[i * block_size, (i + 1) * block_size)`).
    """
    if not ready_upto <= in_flight_upto:
        raise ValueError(
            f"xfer {window.xfer_id}: need ready <= in flight, got {ready_upto}, {in_flight_upto}"
        )
    if sent_upto % block_size and sent_upto != window.num_tokens:
        raise ValueError(f"xfer {window.xfer_id}: sent_upto {sent_upto} not on a block boundary")
    start = max(sent_upto, window.start(block_size))
    full_end = max(start, _end(ready_upto, window, block_size))
    step_end = max(full_end, _end(in_flight_upto, window, block_size))
    full = _task(window, src_blocks, start, full_end, block_size) if full_end > start else None
    step = (
        _task(window, src_blocks, full_end, step_end, block_size) if step_end > full_end else None
    )
    return Plan(full, step, step_end)
