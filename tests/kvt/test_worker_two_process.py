"""kvt end to end between two processes, over each transport: chunked transfers
driven by engine-like steps land byte-exact (non-contiguous blocks, partial
tails), and a destination killed mid-stream turns every unfinished transfer into
an error completion within the write timeout."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import threading
import time

import msgspec
import pytest
import torch
from worker_peer import BLOCK_TOKENS, BLOCKS, LAYERS, kv_memory, serve

from rapidkv.kvt.layout import Layout
from rapidkv.kvt.messages import SendDone
from rapidkv.kvt.task import Task
from rapidkv.kvt.transport import create_transport
from rapidkv.kvt.worker import KvtWorker

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

KINDS = ["tcp", "nixl"]


class Source:
    """This process: a source KvtWorker connected to a destination child."""

    def __init__(self, kind: str, write_timeout_s: float = 10.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(kind, child), daemon=True)
        self.proc.start()
        meta, layout = self.conn.recv()
        self.mem, src_layout = kv_memory(fill=True, seed=1)
        self.done: list[SendDone] = []
        self.done_cond = threading.Condition()
        self.worker = KvtWorker(
            create_transport(kind, "src"),
            src_layout,
            rank=0,
            block_size=BLOCK_TOKENS,
            on_send_done=self._on_done,
            write_timeout_s=write_timeout_s,
            boost=False,
        )
        self.peer = self.worker.add_peer(meta, msgspec.msgpack.decode(layout, type=Layout))

    def _on_done(self, done: SendDone) -> None:
        with self.done_cond:
            self.done.append(done)
            self.done_cond.notify_all()

    def wait_done(self, n: int, timeout: float) -> list[SendDone]:
        with self.done_cond:
            self.done_cond.wait_for(lambda: len(self.done) >= n, timeout)
            return list(self.done)

    def wait_settled(self, xfer_id: str, timeout: float) -> None:
        with self.done_cond:
            self.done_cond.wait_for(lambda: any(d.xfer_id == xfer_id for d in self.done), timeout)

    def step(self, step_id: int, tasks: list[Task]) -> None:
        self.worker.begin_step(step_id, tasks)
        for layer in range(LAYERS):
            self.worker.layer_done(layer)
        self.worker.freeze_step()

    def dst_blocks(self, ids: list[int]) -> torch.Tensor:
        self.conn.send(("blocks", ids))
        raw = bytearray(self.conn.recv())
        return torch.frombuffer(raw, dtype=torch.float32).view(LAYERS, len(ids), -1)

    def close(self) -> None:
        self.worker.close()
        if self.proc.is_alive():
            with contextlib.suppress(OSError, EOFError):
                self.conn.send(("close",))
                self.conn.recv()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def chunk_plan(rng: random.Random, prompt: int) -> list[int]:
    """Token counts of prefill chunks: full blocks, then whatever is left."""
    chunks, left = [], prompt
    while left > 0:
        full = rng.randint(1, 3) * BLOCK_TOKENS
        chunks.append(full if full < left else left)
        left -= chunks[-1]
    return chunks


def test_chunked_transfers_land_byte_exact(kind: str) -> None:
    rng = random.Random(11)
    src = Source(kind)
    try:
        # Four requests, prompts of 1..6 blocks with partial tails; destination
        # blocks scattered; the first request has 2 prefix-hit blocks at D.
        dst_pool = rng.sample(range(BLOCKS), BLOCKS)
        plans = {}
        for i, prompt in enumerate([1, 5 * BLOCK_TOKENS + 3, 2 * BLOCK_TOKENS, 97]):
            hit = 2 * BLOCK_TOKENS if i == 0 else 0
            prompt += hit
            nblocks = -(-prompt // BLOCK_TOKENS)
            plans[f"r{i}"] = {
                "hit": hit,
                "prompt": prompt,
                "src": rng.sample(range(BLOCKS), nblocks),
                "dst": [dst_pool.pop() for _ in range(nblocks)],
                "chunks": chunk_plan(rng, prompt - hit),
            }
        step_id = 0
        while any(p["chunks"] for p in plans.values()):
            tasks = []
            for xfer_id, p in plans.items():
                if not p["chunks"]:
                    continue
                new = p["chunks"].pop(0)
                seen = p["prompt"] - sum(p["chunks"]) - new
                first, stop = seen // BLOCK_TOKENS, -(-(seen + new) // BLOCK_TOKENS)
                tasks.append(
                    Task(
                        xfer_id,
                        src.peer,
                        tuple(p["src"][first:stop]),
                        tuple(p["dst"][first:stop]),
                        seen,
                        new,
                        has_last_token=not p["chunks"],
                    )
                )
            step_id += 1
            src.step(step_id, tasks)
        dones = src.wait_done(len(plans), 20)
        assert sorted(d.xfer_id for d in dones) == sorted(plans)
        assert all(d.ok and d.tokens_sent == plans[d.xfer_id]["prompt"] for d in dones), dones
        src.conn.send(("received", len(plans), 20))
        received = {d["xfer_id"]: d for d in src.conn.recv()}
        assert set(received) == set(plans) and all(d["ok"] for d in received.values())
        for p in plans.values():
            written = slice(p["hit"] // BLOCK_TOKENS, None)
            got = src.dst_blocks(p["dst"][written])
            assert torch.equal(got, src.mem[:, p["src"][written]])
            if p["hit"]:  # prefix-hit blocks at the destination are never written
                assert not src.dst_blocks(p["dst"][: p["hit"] // BLOCK_TOKENS]).any()
        used = {b for p in plans.values() for b in p["dst"][p["hit"] // BLOCK_TOKENS :]}
        assert not src.dst_blocks(sorted(set(range(BLOCKS)) - used)).any()
    finally:
        src.close()


def test_killed_destination_gives_error_completions_within_the_timeout(kind: str) -> None:
    timeout = 3.0
    src = Source(kind, write_timeout_s=timeout)
    per = 4  # blocks per transfer

    def send(i: int, first_block: int) -> None:
        blocks = tuple(range(first_block, first_block + per))
        src.worker.send_full([Task(f"f{i}", src.peer, blocks, blocks, 0, per * BLOCK_TOKENS, True)])

    try:
        # Transfers flow through 8 slots of destination blocks; each slot is
        # reused once its previous transfer settled. Kill the destination while
        # they flow, then send 8 more to fresh blocks.
        for i in range(20):
            if i >= 8:
                src.wait_settled(f"f{i - 8}", 10)  # the slot's previous transfer
            send(i, (i % 8) * per)
        src.proc.kill()
        src.proc.join(10)
        killed_at = time.monotonic()
        for i in range(20, 28):
            send(i, 32 + (i - 20) * per)
        dones = src.wait_done(28, timeout + 5)
        settled_in = time.monotonic() - killed_at
        assert len(dones) == 28, f"{28 - len(dones)} transfers never settled"
        assert len({d.xfer_id for d in dones}) == 28
        failed = [d for d in dones if not d.ok]
        assert {f"f{i}" for i in range(20, 28)} <= {d.xfer_id for d in failed}
        assert all(d.tokens_sent == 0 and d.error for d in failed)
        assert settled_in < timeout + 5
        assert not src.worker.busy()
    finally:
        src.close()
