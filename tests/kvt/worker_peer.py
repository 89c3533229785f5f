"""A destination `KvtWorker` in a second process, for two-process kvt tests.

`serve(kind, conn)` runs in a spawned child: it builds KV-like memory
(`LAYERS x BLOCKS` blocks, zeroed), a `KvtWorker` over it, sends
`(metadata, encoded layout)` to the parent, then answers:
  ("blocks", [ids])          the bytes of those blocks in every layer
  ("received", n, timeout)   SendDones received so far (waits for at least n)
  ("close",)                 close and exit
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import msgspec
import torch

from rapidkv.kvt.layout import Layout, layer_layout_from_tensor
from rapidkv.kvt.messages import SendDone

LAYERS, BLOCKS, BLOCK_TOKENS, BLOCK_ELEMS = 3, 64, 16, 2 * 16 * 8


def kv_memory(fill: bool, seed: int = 0) -> tuple[torch.Tensor, Layout]:
    """`[LAYERS, BLOCKS, BLOCK_ELEMS]` float32, one storage; random or zero."""
    gen = torch.Generator().manual_seed(seed)
    storage = (
        torch.randn(LAYERS, BLOCKS, BLOCK_ELEMS, generator=gen)
        if fill
        else torch.zeros(LAYERS, BLOCKS, BLOCK_ELEMS)
    )
    layers = tuple(
        layer_layout_from_tensor(
            storage[i].data_ptr(), storage[i].shape, storage[i].stride(), 4, block_dim=0
        )
        for i in range(LAYERS)
    )
    return storage, Layout(layers, BLOCKS)


def serve(kind: str, conn: Connection) -> None:
    from rapidkv.kvt.transport import create_transport
    from rapidkv.kvt.worker import KvtWorker

    storage, layout = kv_memory(fill=False)
    worker = KvtWorker(
        create_transport(kind, "dst"), layout, rank=0, block_size=BLOCK_TOKENS, boost=False
    )
    conn.send((worker.metadata, msgspec.msgpack.encode(layout)))
    received: list[SendDone] = []
    while True:
        cmd = conn.recv()
        if cmd[0] == "blocks":
            conn.send(storage[:, cmd[1]].clone().numpy().tobytes())
        elif cmd[0] == "received":
            deadline = time.monotonic() + cmd[2]
            while True:
                received.extend(worker.take_received())
                if len(received) >= cmd[1] or time.monotonic() > deadline:
                    break
                worker.wait_received(0.05)
            conn.send([msgspec.structs.asdict(d) for d in received])
        elif cmd[0] == "close":
            worker.close()
            conn.send("closed")
            return
