"""A task: send some blocks of one request to one destination.

Invariants (checked by `validate_task`):
- `src_blocks` and `dst_blocks` pair up one to one, with no repeated block;
- the blocks cover tokens `[seen_tokens, seen_tokens + new_tokens)` of the
  request, starting on a block boundary (`seen_tokens % block_size == 0`);
- only the task that carries the request's last token (`has_last_token`) may
  write a partially filled tail block: every other task writes full blocks only.

Together with "a destination block appears in at most one task of a transfer"
(enforced by the completion tracker) this gives the data plane's rule: every
destination block is written exactly once, never by two writes in flight.
"""

from __future__ import annotations

import msgspec


class Task(msgspec.Struct, frozen=True):
    xfer_id: str
    peer: str  # the destination worker's transport peer name
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    seen_tokens: int  # tokens of this transfer already at the destination before this task
    new_tokens: int  # tokens this task's blocks add
    has_last_token: bool
    # the destination computes with these layers as they land (a split prefill):
    # the source tells it, per transfer, how many leading layers are in place
    notify_layers: bool = False

    @property
    def end_tokens(self) -> int:
        return self.seen_tokens + self.new_tokens


class InvalidTask(ValueError):
    """A task breaks one of the invariants in this module's docstring."""


def validate_task(task: Task, block_size: int) -> None:
    """Raise `InvalidTask` naming the task if it breaks an invariant."""

    def bad(why: str) -> InvalidTask:
        return InvalidTask(
            f"xfer {task.xfer_id}: {why} (seen={task.seen_tokens} new={task.new_tokens} "
            f"blocks={len(task.dst_blocks)} last={task.has_last_token})"
        )

    if len(task.src_blocks) != len(task.dst_blocks):
        raise bad("src_blocks and dst_blocks differ in length")
    if not task.dst_blocks:
        raise bad("no blocks")
    if min(task.src_blocks) < 0 or min(task.dst_blocks) < 0:
        raise bad("negative block id")
    if len(set(task.src_blocks)) != len(task.src_blocks) or len(set(task.dst_blocks)) != len(
        task.dst_blocks
    ):
        raise bad("a block appears twice")
    if task.seen_tokens < 0 or task.new_tokens <= 0:
        raise bad("token counts out of range")
    if task.seen_tokens % block_size:
        raise bad(f"does not start on a block boundary (block_size={block_size})")
    if task.has_last_token:
        if len(task.dst_blocks) != -(-task.new_tokens // block_size):
            raise bad("block count does not match the tokens")
    elif task.new_tokens != len(task.dst_blocks) * block_size:
        raise bad("a task without the last token may only carry full blocks")
