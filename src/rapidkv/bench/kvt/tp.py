"""`rapidkv bench kvt --tp-from P --tp-to D`: what moving KV between tensor-parallel
sizes costs, next to moving it whole.

One model's KV, 1 GiB on each side: 32 layers x 512 blocks (`--blocks`), 8 KV
heads of 128 two-byte elements, 16 tokens a block (64 KiB a block and layer
over all heads).
P's ranks are `P` KvtWorkers in this process (pinned to the sender CPU), D's
ranks `D` KvtWorkers in a spawned process (pinned to the receiver CPU); every
rank holds its heads as vLLM splits them, in one of two block layouts:

- `cpu`: vLLM CPU's `[blocks, H, N, 2D]`: a rank's heads are one run a block,
  so P at TP 2 -> D at TP 1 moves 32 KiB halves of each D block;
- `nhd`: the GPU (FlashAttention) `[2, blocks, N, H, D]`: heads inside each
  token, so the same move is 1 KiB segments, 32 a block (K and V, 16 tokens).

Each measured send is one `send_full` of every block (block i -> block i) from
every P rank to every D rank the head mapping pairs it with (`kvt.head_map`),
from the first call to the last SendDone, best of `--repeats`. `contiguous` is
the same KV at TP 1 -> 1 in the same layout (whole blocks, coalesced). After
the runs D checks every byte of every rank against the KV it should hold.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

from rapidkv.bench.kvt.sender import BLOCKS, LAYERS

KV_HEADS = 8
HEAD_SIZE = 128
ELEMENT_BYTES = 2
TOKENS = 16
HEAD_LAYOUTS = ("cpu", "nhd")
TP_SIZES = (1, 2, 4, 8)
WRITE_TIMEOUT_S = 60.0  # a scattered send of 1 GiB over TCP takes several seconds


def layer_shape(kind: str, heads: int, blocks: int = BLOCKS) -> list[int]:
    """One layer's KV tensor of a rank holding `heads` heads."""
    if kind == "cpu":
        return [blocks, heads, TOKENS, 2 * HEAD_SIZE]
    if kind == "nhd":
        return [2, blocks, TOKENS, heads, HEAD_SIZE]
    raise ValueError(f"unknown head layout {kind!r}; choose from {HEAD_LAYOUTS}")


def dims(kind: str) -> tuple[int, int]:
    """(block dimension, head dimension) of `layer_shape`."""
    return (0, 1) if kind == "cpu" else (1, 3)


def model_layer(kind: str, layer: int, blocks: int = BLOCKS) -> Any:
    """Layer `layer` of the whole model's KV (every head), the same in both processes."""
    import torch

    g = torch.Generator().manual_seed(1000 + layer)
    shape = layer_shape(kind, KV_HEADS, blocks)
    return torch.randint(-32768, 32767, shape, dtype=torch.int16, generator=g)


def rank_kvs(
    kind: str, tp: int, fill: bool, layers: int = LAYERS, blocks: int = BLOCKS
) -> list[tuple[Any, Any]]:
    """Every rank of `tp`'s KV memory `[LAYERS, *layer]` and its `Layout` (with
    `Heads`): filled with its heads of `model_layer`, or zeros."""
    import msgspec
    import torch

    from rapidkv.kvt.head_map import heads_from_tensor, rank_heads
    from rapidkv.kvt.layout import Layout, layer_layout_from_tensor

    held = [rank_heads(KV_HEADS, tp, r) for r in range(tp)]
    block_dim, head_dim = dims(kind)
    storages = [
        torch.zeros([layers, *layer_shape(kind, len(h), blocks)], dtype=torch.int16) for h in held
    ]
    if fill:
        for i in range(layers):
            whole = model_layer(kind, i, blocks)
            for heads, storage in zip(held, storages, strict=True):
                storage[i] = whole.narrow(head_dim, heads.start, len(heads))
    out = []
    for rank, storage in enumerate(storages):
        described = []
        for i in range(layers):
            x = storage[i]
            layer = layer_layout_from_tensor(
                x.data_ptr(), x.shape, x.stride(), x.element_size(), block_dim
            )
            heads = heads_from_tensor(
                x.shape,
                x.element_size(),
                block_dim,
                head_dim,
                total=KV_HEADS,
                tp_size=tp,
                rank=rank,
                head_size=HEAD_SIZE,
                block_size=TOKENS,
            )
            described.append(msgspec.structs.replace(layer, heads=heads))
        out.append((storage, Layout(tuple(described), blocks)))
    return out


def wrong_elements(kind: str, storages: list[Any], blocks: int = BLOCKS) -> list[int]:
    """Per D rank, the elements of its memory that are not the KV its heads
    should hold."""
    from rapidkv.kvt.head_map import rank_heads

    tp, head_dim = len(storages), dims(kind)[1]
    wrong = [0] * tp
    for i in range(LAYERS):
        whole = model_layer(kind, i, blocks)
        for r, storage in enumerate(storages):
            held = rank_heads(KV_HEADS, tp, r)
            wrong[r] += int((storage[i] != whole.narrow(head_dim, held.start, len(held))).sum())
    return wrong


# -- D's ranks, in their own process -------------------------------------------------


def receiver_main(transport: str, cpu: int, conn: Any) -> None:
    """D: on ("setup", layout, tp, blocks) its ranks' KvtWorkers over zeroed memory
    (answering their metadata and layouts); ("check",) the elements wrong per
    rank; ("close",) the workers closed; None: exit."""
    import msgspec

    from rapidkv.kvt.transport import create_transport
    from rapidkv.kvt.worker import KvtWorker

    os.sched_setaffinity(0, {cpu})
    ranks: list[tuple[Any, Any]] = []
    kind, blocks = "cpu", BLOCKS
    n = 0
    while (msg := conn.recv()) is not None:
        if msg[0] == "setup":
            _, kind, tp, blocks = msg
            n += 1
            ranks = []
            for r, (storage, layout) in enumerate(rank_kvs(kind, tp, False, blocks=blocks)):
                worker = KvtWorker(
                    create_transport(transport, f"tp-dst{n}-{r}"), layout, rank=r, block_size=TOKENS
                )
                worker.set_awaiting(True)
                ranks.append((worker, storage))
            conn.send([(w.metadata, msgspec.msgpack.encode(w.layout)) for w, _ in ranks])
        elif msg[0] == "check":
            conn.send(wrong_elements(kind, [s for _, s in ranks], blocks))
        elif msg[0] == "close":
            for worker, _ in ranks:
                worker.close()
            ranks = []
            conn.send(True)
    for worker, _ in ranks:
        worker.close()


class Receiver:
    def __init__(self, transport: str, cpu: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(transport, cpu, child))
        self.proc.start()
        child.close()

    def ask(self, msg: Any, timeout: float = 300) -> Any:
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the receiver did not answer {msg[0]!r} in {timeout} s")
        return self.conn.recv()

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send(None)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


# -- P's ranks, here ------------------------------------------------------------------


def send_gbps(
    transport: str,
    receiver: Receiver,
    kind: str,
    tp_from: int,
    tp_to: int,
    repeats: int,
    n_blocks: int = BLOCKS,
) -> dict[str, Any]:
    """P at `tp_from` -> D at `tp_to` in layout `kind`, `n_blocks` blocks a
    layer: best throughput of `repeats` full sends, the descriptors one send
    hands the transports (after merging rows that touch), the smallest
    segment, and D's check."""
    import threading

    import msgspec
    import numpy as np

    from rapidkv.kvt.head_map import pairs, peer_pieces, piece_descs
    from rapidkv.kvt.layout import Layout, layer_descs
    from rapidkv.kvt.task import Task
    from rapidkv.kvt.transport import create_transport
    from rapidkv.kvt.transport.nixl import coalesce
    from rapidkv.kvt.worker import KvtWorker

    peers = receiver.ask(("setup", kind, tp_to, n_blocks))
    dst_layouts = [msgspec.msgpack.decode(layout, type=Layout) for _, layout in peers]
    done: list[Any] = []
    cond = threading.Condition()

    def on_done(d: Any) -> None:
        with cond:
            done.append(d)
            cond.notify_all()

    workers, names = [], []  # per P rank: its worker, D rank -> peer name
    routes = pairs(KV_HEADS, tp_from, tp_to)
    rows = segment = 0
    blocks = tuple(range(n_blocks))
    ranks = rank_kvs(kind, tp_from, fill=True, blocks=n_blocks)
    try:
        for p, (_, layout) in enumerate(ranks):
            worker = KvtWorker(
                create_transport(transport, f"tp-src-{kind}-{tp_from}-{tp_to}-{p}"),
                layout,
                rank=p,
                block_size=TOKENS,
                on_send_done=on_done,
                write_timeout_s=WRITE_TIMEOUT_S,
            )
            workers.append(worker)
            names.append({})
            for d in (d for pp, d in routes if pp == p):
                names[p][d] = worker.add_peer(peers[d][0], dst_layouts[d])
                pieces = peer_pieces(layout, dst_layouts[d])
                for i in range(LAYERS):
                    src, dst = layout.layers[i], dst_layouts[d].layers[i]
                    descs = (
                        layer_descs(src, dst, blocks, blocks)
                        if pieces is None
                        else piece_descs(src, dst, pieces[i], blocks, blocks)
                    )
                    rows += len(coalesce(descs))  # what the transport is handed
                    segment = int(np.min(descs[:, 2]))
        best = float("inf")
        for r in range(repeats):
            with cond:
                done.clear()
            t = time.perf_counter()
            for p, worker in enumerate(workers):
                tasks = [
                    Task(f"r{r}-{p}-{d}", name, blocks, blocks, 0, n_blocks * TOKENS, True)
                    for d, name in names[p].items()
                ]
                if tasks:
                    worker.send_full(tasks)
            with cond:
                if not cond.wait_for(lambda: len(done) == len(routes), WRITE_TIMEOUT_S + 30):
                    raise TimeoutError(f"{kind} TP {tp_from} -> {tp_to}: sends did not settle")
            best = min(best, time.perf_counter() - t)
            failed = [d for d in done if not d.ok]
            if failed:
                raise RuntimeError(f"{kind} TP {tp_from} -> {tp_to}: {failed[0].error}")
        wrong = receiver.ask(("check",))
    finally:
        for worker in workers:
            worker.close()
        receiver.ask(("close",))
    if any(wrong):
        raise AssertionError(f"{kind} TP {tp_from} -> {tp_to}: D's ranks hold wrong KV {wrong}")
    total = LAYERS * n_blocks * KV_HEADS * TOKENS * 2 * HEAD_SIZE * ELEMENT_BYTES
    return {
        "gbps": round(total / best / 1e9, 2),
        "descriptors": rows,
        "smallest_segment_bytes": segment,
        "pairs": [list(x) for x in routes],
    }


def measure_tp(
    transports: list[str],
    head_layouts: list[str],
    tp_from: int,
    tp_to: int,
    repeats: int,
    sender_cpu: int,
    receiver_cpu: int,
    progress: Callable[[str], None] | None,
    blocks: int = BLOCKS,
) -> dict[str, Any]:
    from rapidkv.bench.kvt.sender import memcpy_gbps

    say = progress or (lambda msg: None)
    os.sched_setaffinity(0, {sender_cpu})
    say("memcpy of 1 GiB ...")
    memcpy = round(memcpy_gbps(repeats), 2)
    result: dict[str, Any] = {
        "mode": "tp",
        "tp_from": tp_from,
        "tp_to": tp_to,
        "kv_heads": KV_HEADS,
        "head_size": HEAD_SIZE,
        "element_bytes": ELEMENT_BYTES,
        "block_size": TOKENS,
        "layers": LAYERS,
        "blocks": blocks,
        "memcpy_gbps": memcpy,
        "transports": {},
    }
    for transport in transports:
        receiver = Receiver(transport, receiver_cpu)
        entry: dict[str, Any] = {}
        try:
            for kind in head_layouts:
                say(f"{transport} {kind}: TP 1 -> 1 ...")
                whole = send_gbps(transport, receiver, kind, 1, 1, repeats, blocks)
                say(f"{transport} {kind}: TP {tp_from} -> {tp_to} ...")
                mapped = send_gbps(transport, receiver, kind, tp_from, tp_to, repeats, blocks)
                entry[kind] = {
                    "contiguous_gbps": whole["gbps"],
                    "tp_gbps": mapped["gbps"],
                    "tp_vs_contiguous": round(mapped["gbps"] / whole["gbps"], 3),
                    "tp_vs_memcpy": round(mapped["gbps"] / memcpy, 3),
                    "contiguous_descriptors": whole["descriptors"],
                    "tp_descriptors": mapped["descriptors"],
                    "tp_segment_bytes": mapped["smallest_segment_bytes"],
                    "pairs": mapped["pairs"],
                }
        finally:
            receiver.close()
        result["transports"][transport] = entry
    return result
