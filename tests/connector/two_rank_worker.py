"""One P worker rank in its own process, for tests/connector/test_two_rank_acks.py.

`serve(conn, instance_id, rank, config)` runs in a child process. It builds a KV
cache shaped like vLLM's CPU cache (one float32 buffer, layer-major; each layer
a `[NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM]` view named
`model.layers.{i}.self_attn.attn`), filled with values that differ in every
element and on every rank, hands it to a real `WorkerSide` (real `KvtWorker`
over NIXL, real `BypassReceiver`), answers `("ok", RankInfo)` and then runs the
commands the parent sends, one at a time on its main thread (the thread vLLM's
worker hooks run on), answering `("ok", result)` or `("error", traceback)`:

  ("bind", meta)           handle_preemptions + bind_connector_metadata
  ("layer_saved", name)    save_kv_layer
  ("step_done",)           wait_for_save (freezes the step: the ack)
  ("finished", ids)        get_transfer_results(finished_req_ids)
  ("worker_meta",)         build_connector_worker_meta
  ("stats",)               the kvt worker's counters (`KvtStats` as a dict)
  ("blocks", ids)          this rank's KV of those blocks, every layer (numpy)
  ("close",)               close the WorkerSide and exit
"""

from __future__ import annotations

import dataclasses
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

LAYERS = 4
NUM_BLOCKS = 32
KV_HEADS = 2
BLOCK_SIZE = 16  # tokens per block
HEAD_DIM = 8
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
BLOCK_LAYER_BYTES = KV_HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 4  # one block of one layer
SHAPE = (LAYERS, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)


def kv_cache(fill_rank: int | None) -> torch.Tensor:
    """The KV buffer of one rank: zeros (`None`), or distinct non-zero values
    (exact float32 integers, disjoint between ranks) for source rank `fill_rank`."""
    n = 1
    for size in SHAPE:
        n *= size
    if fill_rank is None:
        return torch.zeros(SHAPE, dtype=torch.float32)
    assert n < 1 << 22
    base = 1 + fill_rank * (1 << 22)
    return (torch.arange(n, dtype=torch.float32) + base).view(SHAPE)


def layer_views(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """What vLLM hands `register_kv_caches`: one view per attention layer."""
    return {name: buf[i] for i, name in enumerate(LAYER_NAMES)}


def serve(conn: Connection, instance_id: str, rank: int, config: dict[str, Any]) -> None:
    try:
        from rapidkv.connector.config import ConnectorConfig
        from rapidkv.connector.worker_side import WorkerSide

        buf = kv_cache(rank)
        ws = WorkerSide(ConnectorConfig(**config), instance_id, rank, BLOCK_SIZE)
        ws.register(layer_views(buf), NUM_BLOCKS)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", ws.info))
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:  # the parent went away
            ws.close()
            return
        try:
            if cmd == "close":
                ws.close()
                conn.send(("ok", None))
                return
            if cmd == "bind":
                ws.preempted(args[0])
                result: Any = ws.bind(args[0])
            elif cmd == "layer_saved":
                result = ws.layer_saved(args[0])
            elif cmd == "step_done":
                result = ws.step_done()
            elif cmd == "finished":
                result = ws.finished(args[0])
            elif cmd == "worker_meta":
                result = ws.worker_meta()
            elif cmd == "stats":
                assert ws.kvt is not None
                result = dataclasses.asdict(ws.kvt.stats)
            elif cmd == "blocks":
                result = buf[:, list(args[0])].numpy().copy()
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))
