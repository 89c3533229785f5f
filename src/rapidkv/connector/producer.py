"""P-side bookkeeping of one transfer (one `xfer_id`): what is computed, what D
asked for, what was sent, and when P's blocks may be freed.

Lifecycle of a `Produced` (all transitions under the scheduler side's lock):

    admitted --(TransferKV)--> window known --(tasks issued)--> sending
        --(SendDone from every rank)--> settled
    finished (request_finished; blocks held) + settled          -> released
    finished + no TransferKV within finished_ttl_s              -> released
    aborted before anything was sent                            -> released, GONE
    aborted while sending                                       -> kvt fail, settles

A *migration* (`migration=True`) is the same record for a request that is
running here (`req_id`: the source request; `prompt_len`: D's prompt, the
source's tokens so far): it is accepted at creation (its TransferKV created
it), and it is over once settled, or aborted before anything was sent. Over
while its source runs, it is forgotten (the request holds its own blocks);
`finished` set means the source finished while it was not over, and its
blocks are held until it is.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from rapidkv.connector.plan import Window, plan
from rapidkv.kvt.task import Task


@dataclass
class Reply:
    """Where the answer to a waiting TransferKV goes (a future on the RPC loop)."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def resolve(self, value: object) -> None:
        def set_once() -> None:
            if not self.future.done():
                self.future.set_result(value)

        self.loop.call_soon_threadsafe(set_once)


@dataclass
class Produced:
    xfer_id: str
    req_id: str
    prompt_len: int
    prompt_hash: str
    # the hash of the prompt but its last token: a split's head sent to P with
    # one token more (a fetch: P holds the head cached and computes that one)
    head_hash: str = ""
    computed: int = 0  # tokens whose KV is final at P
    in_flight_end: int = 0  # computed + tokens of the step being built
    scheduled_step: int | None = None  # the step in flight computes some of it
    last_chunk_step: int | None = None  # the step that computes its last prompt token
    block_ids: tuple[int, ...] = ()
    window: Window | None = None
    reply: Reply | None = None
    mode: str = "step"  # transfer_kv_mode of its TransferKV
    accepted_at: float = 0.0  # time.monotonic() the TransferKV was taken up
    sent_upto: int = 0
    issued: bool = False  # some task of it went to the workers
    last_issued: bool = False
    # (source rank, destination rank) -> (ok, tokens_sent, error): its SendDones
    settled_ranks: dict[tuple[int, int], tuple[bool, int, str]] = field(default_factory=dict)
    # how many (source rank, destination rank) pairs send it: settled once every
    # one's SendDone came (equal TP: one a rank; `kvt.head_map.pairs` otherwise)
    settles: int = 1
    finished: bool = False
    finished_at: float = 0.0
    aborted: bool = False
    released: bool = False
    migration: bool = False  # D asked for the KV of a request running here

    def accept(
        self, window: Window, reply: Reply, block_size: int, mode: str, settles: int
    ) -> None:
        self.window = window
        self.settles = settles
        self.reply = reply
        self.mode = mode
        self.accepted_at = time.monotonic()
        self.sent_upto = window.first_block * block_size

    @property
    def all_settled(self) -> bool:
        """Every (source rank, destination rank) pair's SendDone came."""
        return len(self.settled_ranks) >= self.settles

    def next_tasks(self, block_size: int, scheduled: bool) -> tuple[Task | None, Task | None]:
        """Full and per-layer tasks for what is computable and not sent yet
        (`scheduled`: the step in flight computes up to `in_flight_end`)."""
        if self.window is None or self.last_issued or self.aborted:
            return None, None
        in_flight = self.in_flight_end if scheduled else self.computed
        p = plan(self.window, block_size, self.block_ids, self.sent_upto, self.computed, in_flight)
        self.sent_upto = p.sent_upto
        for t in (p.full, p.step):
            if t is not None:
                self.issued = True
                self.last_issued |= t.has_last_token
        return p.full, p.step
