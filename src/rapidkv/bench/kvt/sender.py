"""`rapidkv bench kvt`: the buffers, the receiving process and the sender measured."""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import time
from typing import Any

LAYERS = 32
BLOCKS = 512
BLOCK_BYTES = 64 * 1024
TOKENS_PER_BLOCK = 16


# -- memory -------------------------------------------------------------------


def kv_buffers(fill: bool) -> tuple[Any, Any]:
    """1 GiB of KV-cache-like memory: `[LAYERS, BLOCKS, BLOCK_BYTES]` bytes."""
    import torch

    from rapidkv.kvt.layout import Layout, layer_layout_from_tensor

    if fill:
        storage = torch.arange(LAYERS * BLOCKS * BLOCK_BYTES // 8, dtype=torch.int64)
        storage = storage.view(torch.uint8).view(LAYERS, BLOCKS, BLOCK_BYTES)
    else:
        storage = torch.zeros(LAYERS, BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    layers = tuple(
        layer_layout_from_tensor(
            storage[i].data_ptr(), storage[i].shape, storage[i].stride(), 1, block_dim=0
        )
        for i in range(LAYERS)
    )
    return storage, Layout(layers, BLOCKS)


def transport_options(kind: str, host: str | None) -> dict[str, Any]:
    """What the connector gives a transport for `kvt_host` = `host` (None: nothing)."""
    return {} if host is None else {"host": host}


def receiver_main(kind: str, cpu: int, conn: Any, host: str | None = None) -> None:
    """The destination: a KvtWorker over zeroed memory; answers checksum requests."""
    import msgspec

    from rapidkv.kvt.transport import create_transport
    from rapidkv.kvt.worker import KvtWorker

    os.sched_setaffinity(0, {cpu})
    storage, layout = kv_buffers(fill=False)
    worker = KvtWorker(
        create_transport(kind, "bench-dst", **transport_options(kind, host)),
        layout,
        rank=0,
        block_size=TOKENS_PER_BLOCK,
    )
    conn.send((worker.metadata, msgspec.msgpack.encode(layout)))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        layer, block = msg
        conn.send(int(storage[layer, block].sum()))
    worker.close()


# -- measurements -------------------------------------------------------------


def percentiles(samples: list[float]) -> dict[str, float | int]:
    """p50, p99 and max (rounded to 0.1) and n; nan for no samples."""
    from rapidkv.bench.common.stats import tail_summary

    return tail_summary(samples, 1, with_max=True)


def memcpy_gbps(repeats: int) -> float:
    import torch

    from rapidkv.kvt.memory import advise_hugepages

    src = torch.ones(LAYERS * BLOCKS * BLOCK_BYTES, dtype=torch.uint8)
    dst = torch.ones_like(src)
    # the same page size as the KvtWorkers' registered memory
    advise_hugepages([(t.data_ptr(), t.numel()) for t in (src, dst)])
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.numel() / best / 1e9


class Sender:
    """This process's side: a KvtWorker connected to a spawned receiver."""

    def __init__(self, kind: str, receiver_cpu: int, peer: dict[str, Any] | None = None) -> None:
        import multiprocessing as mp

        import msgspec

        from rapidkv.kvt.layout import Layout
        from rapidkv.kvt.transport import create_transport
        from rapidkv.kvt.worker import KvtWorker

        self.storage, layout = kv_buffers(fill=True)
        ctx = mp.get_context("spawn")
        self.script = None  # removed at close: /bin/sh opens it after the exec
        if peer is not None:  # the receiver's interpreter runs in namespace B
            self.script = netns_python(peer["b_netns"])
            ctx.set_executable(self.script)
        self.conn, child = ctx.Pipe()
        b_host = peer["b_host"] if peer else None
        self.proc = ctx.Process(target=receiver_main, args=(kind, receiver_cpu, child, b_host))
        self.proc.start()
        child.close()  # a receiver that dies is an EOF here
        try:
            if not self.conn.poll(120):
                raise TimeoutError("the receiver did not start in 120 s")
            meta, dst_layout = self.conn.recv()
        except BaseException:
            self.proc.kill()
            self._remove_script()
            raise
        self.posted: list[tuple[str, float, float, int]] = []
        self.done: dict[str, Any] = {}
        self.done_cond = threading.Condition()
        a_host = peer["a_host"] if peer else None
        self.worker = KvtWorker(
            create_transport(kind, "bench-src", **transport_options(kind, a_host)),
            layout,
            rank=0,
            block_size=TOKENS_PER_BLOCK,
            on_send_done=self._on_done,
            on_posted=lambda *a: self.posted.append(a),
            write_timeout_s=float(peer["write_timeout_s"]) if peer else 10.0,
        )
        self.peer = self.worker.add_peer(meta, msgspec.msgpack.decode(dst_layout, type=Layout))
        self.n = 0
        self.blocks_of: dict[str, list[int]] = {}  # xfer id -> its destination blocks

    def _on_done(self, done: Any) -> None:
        with self.done_cond:
            self.done[done.xfer_id] = done
            self.done_cond.notify_all()

    def task(self, src: list[int], dst: list[int]) -> Any:
        from rapidkv.kvt.task import Task

        self.n += 1
        xfer_id = f"b{self.n}"
        self.blocks_of[xfer_id] = list(dst)
        return Task(
            xfer_id, self.peer, tuple(src), tuple(dst), 0, len(dst) * TOKENS_PER_BLOCK, True
        )

    def wait(self, xfer_id: str, timeout: float = 60) -> Any:
        with self.done_cond:
            if not self.done_cond.wait_for(lambda: xfer_id in self.done, timeout):
                raise TimeoutError(f"{xfer_id} did not complete in {timeout} s")
            done = self.done[xfer_id]
        if not done.ok:
            raise RuntimeError(f"transfer {xfer_id} failed: {done.error}")
        return done

    def check(self, src: list[int], dst: list[int], samples: int = 8) -> None:
        for i in random.Random(1).sample(range(len(src)), min(samples, len(src))):
            layer = i % LAYERS
            self.conn.send((layer, dst[i]))
            theirs = self.conn.recv()
            mine = int(self.storage[layer, src[i]].sum())
            if theirs != mine:
                raise AssertionError(f"block {src[i]}->{dst[i]} layer {layer} differs")

    def full_send_gbps(self, scattered: bool, repeats: int) -> float:
        src = list(range(BLOCKS))
        best = float("inf")
        for r in range(repeats):
            dst = list(range(BLOCKS))
            if scattered:
                random.Random(r).shuffle(dst)
                random.Random(r + 100).shuffle(src)
            task = self.task(src, dst)
            t = time.perf_counter()
            self.worker.send_full([task])
            self.wait(task.xfer_id)
            best = min(best, time.perf_counter() - t)
            self.check(src, dst)
        return LAYERS * BLOCKS * BLOCK_BYTES / best / 1e9

    def busy_steps(self, steps: int, layer_ms: float) -> dict[str, Any]:
        """Steps that look like a forward; a second thread attaches substeps."""
        import torch

        torch.set_num_threads(1)
        size = 96
        a, w = torch.randn(size, size), torch.randn(size, size)
        t = time.perf_counter()  # calibrate matmuls per layer
        for _ in range(50):
            torch.tanh(a @ w)
        per_mm = (time.perf_counter() - t) / 50
        reps = max(1, round(layer_ms / 1000 / per_mm))
        self.posted.clear()
        free = list(range(BLOCKS))
        rng = random.Random(3)
        step = [0]
        open_step = threading.Event()
        stop = threading.Event()
        attach_results: list[str] = []
        blocks_lock = threading.Lock()
        xfers: list[str] = []

        def take(n: int) -> list[int]:
            with blocks_lock:
                if len(free) < n:
                    return []
                return [free.pop(rng.randrange(len(free))) for _ in range(n)]

        def attacher() -> None:
            next_sub: dict[int, int] = {}
            while not stop.is_set():
                open_step.wait(0.1)
                time.sleep(rng.random() * layer_ms * LAYERS / 1000)
                s = step[0]
                dst = take(2)
                if not dst:
                    continue
                task = self.task(rng.sample(range(BLOCKS), 2), dst)
                sub = next_sub.get(s, 1)
                result = self.worker.attach_substep(s, sub, [task])
                attach_results.append(result.value)
                if result.value == "rejected":
                    with blocks_lock:
                        free.extend(dst)
                else:
                    next_sub[s] = sub + 1
                    xfers.append(task.xfer_id)

        thread = threading.Thread(target=attacher, daemon=True)
        thread.start()
        step_s = []
        for s in range(1, steps + 1):
            dst = take(4)
            tasks = (
                [self.task(rng.sample(range(BLOCKS), 2), dst[i : i + 2]) for i in (0, 2)]
                if dst
                else []
            )
            xfers.extend(t.xfer_id for t in tasks)
            t0 = time.perf_counter()
            step[0] = s
            self.worker.begin_step(s, tasks)
            open_step.set()
            for layer in range(LAYERS):
                for _ in range(reps):
                    torch.tanh(a @ w)
                bookkeeping = {i: i * i for i in range(30)}  # a little Python per layer
                del bookkeeping
                self.worker.layer_done(layer)
            open_step.clear()
            self.worker.freeze_step()
            step_s.append(time.perf_counter() - t0)
            for xfer_id in [x for x in xfers if x in self.done]:
                xfers.remove(xfer_id)
                with blocks_lock:
                    free.extend(self.blocks_of.pop(xfer_id))
        stop.set()
        thread.join()
        for s in (steps + 1, steps + 2):  # let early substeps attach and finish
            self.worker.begin_step(s, [])
            for layer in range(LAYERS):
                self.worker.layer_done(layer)
            self.worker.freeze_step()
        layer_us = [(tp - te) * 1e6 for kind, te, tp, _ in self.posted if kind == "layer"]
        attach_us = [(tp - te) * 1e6 for kind, te, tp, _ in self.posted if kind == "attach"]
        return {
            "layer_to_send_us": percentiles(layer_us),
            "attach_to_send_us": percentiles(attach_us),
            "step_ms": percentiles([x * 1000 for x in step_s]),
            "substeps": {k: attach_results.count(k) for k in ("attached", "pending", "rejected")},
        }

    def close(self) -> None:
        self.worker.close()
        self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self._remove_script()

    def _remove_script(self) -> None:
        if self.script is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.script)
            self.script = None


def netns_python(netns: str) -> str:
    """An executable that runs this Python in network namespace `netns` (for
    multiprocessing's spawn: a script exec-ing ``ip netns exec NETNS python``,
    which keeps the file descriptors spawn hands over)."""
    import shlex
    import tempfile

    from rapidkv.harness.netns import netns_exec_prefix

    fd, path = tempfile.mkstemp(prefix="rapidkv-netns-python-", suffix=".sh")
    cmd = shlex.join([*netns_exec_prefix(netns), sys.executable])
    with os.fdopen(fd, "w") as f:
        f.write(f'#!/bin/sh\nexec {cmd} "$@"\n')
    os.chmod(path, 0o755)
    return path
