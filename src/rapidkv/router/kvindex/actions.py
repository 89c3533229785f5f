"""What the index core asks its shell to do, or tells it happened."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestReplay:
    """Ask `member`'s replay socket for every batch from `start_seq` on. The
    shell feeds each batch that comes back to ``KVIndex.replayed(member, token,
    seq, payload)`` and the end marker, or a timeout, to
    ``KVIndex.replay_ended(member, token)``. A later request for the same member
    supersedes this one (the core ignores the old token)."""

    member: str
    start_seq: int
    token: int


@dataclass(frozen=True, slots=True)
class Reset:
    """The index dropped what it held for `member` (with `full`, its hash
    translations too, for a new process) and learns again from the batch
    `resume_seq` on. Nothing for the shell to do but log it."""

    member: str
    reason: str
    full: bool
    resume_seq: int


Action = RequestReplay | Reset
