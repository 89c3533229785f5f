"""The destination D of `rapidkv bench transfer-kv`, in the benchmark's process.

A real kvt receiver: a `KvtWorker` over NIXL with registered memory shaped like
P's KV (same bytes and runs per block and layer), introduced to P with the real
control protocol, so P's connector writes into it exactly as into a D worker's
KV cache. What it adds for measurement:

- **Sentinel memory.** Every byte starts as 0xFF; `reset(blocks)` restores it.
  An 8-byte word of all ones is a pair of NaNs in float32 or bf16: no KV value
  has it.
- **A watcher thread** (`watch`) that, while a transfer is watched, reads the
  first 8-byte word of every destination block of every layer every `poll_s`
  and stamps (`time.monotonic()`) the first read at which each differs from the
  sentinel: the moment that block's first byte of that layer landed (a block is
  one contiguous copy, first word first). The same thread drains the kvt's
  received SendDones and stamps the one of the watched transfer: the moment
  the last byte was confirmed to us. The thread runs first in the fair class (nice -20,
  like kvt's owner thread) so that this process's other threads do not delay
  its reads.
  Resolution: `poll_s` for memory; for the
  SendDone, the kvt owner thread's notification polling (`NOTIF_POLL_S`,
  lowered from kvt's 2 ms default: this process does nothing else) plus `poll_s`.
- `unwritten_words(blocks)`: 8-byte words still equal to the sentinel in those
  blocks, all layers (0: every byte of every block was overwritten).

Handshake: a first `Handshake` with a spec that cannot match (fingerprint
`probe`) is refused by P with P's own `KVSpec`; the memory is built from that
spec and a second `Handshake` with P's spec and our endpoint is accepted, and P
adds us as a kvt peer at its next step. TP 1 only (one rank here).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rapidkv.kvt.priority import boost_current_thread

log = logging.getLogger(__name__)

SENTINEL_BYTE = 0xFF
SENTINEL_WORD = -1  # int64 view of eight 0xFF bytes
NOTIF_POLL_S = 0.00025


@dataclass
class Watch:
    """One watched transfer. `landed[layer, i]`: first moment block `blocks[i]`
    of `layer` changed (NaN: not yet). `done`/`t_done`: its SendDone."""

    xfer_id: str
    blocks: tuple[int, ...]
    landed: np.ndarray
    done: Any = None  # kvt SendDone
    t_done: float | None = None
    last_poll: float = 0.0
    max_gap: float = 0.0  # longest time between two reads of the memory, s
    finished: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float) -> bool:
        return self.finished.wait(timeout)


class Destination:
    """See the module docstring. `blocks_for(P's KVSpec)` sizes the memory (at
    most P's block count: P bounds-checks destination ids against it). `close()`
    releases everything (the constructor does too when it fails)."""

    def __init__(
        self,
        p_control: str,
        blocks_for: Callable[[Any], int],
        *,
        poll_s: float = 0.0001,
        timeout_s: float = 60.0,
    ) -> None:
        from rapidkv.control.client import RpcClient
        from rapidkv.control.server import RpcServer

        self.p_control = p_control
        self.num_blocks = 0
        self.poll_s = poll_s
        self.instance_id = f"bench-d-{uuid.uuid4().hex[:8]}"
        self.rpc = RpcClient()
        self.server = RpcServer(self._handle, "127.0.0.1", 0)
        self.kvt: Any = None
        self._watch: Watch | None = None
        self._watch_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._dones: dict[str, tuple[Any, float]] = {}
        self._thread: threading.Thread | None = None
        self.boosted = False  # the watcher thread runs at nice -20 (`kvt.priority`)
        try:
            self.server.start()
            self.spec = self._probe(timeout_s)
            self.num_blocks = blocks_for(self.spec)
            self._build_memory()
            self.p_num_blocks = self._handshake(timeout_s)
            if self.num_blocks > self.p_num_blocks:
                raise RuntimeError(
                    f"P has {self.p_num_blocks} KV blocks; it refuses destination ids beyond"
                )
            self._thread = threading.Thread(target=self._run, name="bench-d-watch", daemon=True)
            self._thread.start()
        except BaseException:
            self.close()
            raise

    # -- set-up -----------------------------------------------------------------

    async def _handle(self, msg: Any) -> Any:
        from rapidkv.control.codes import Code
        from rapidkv.control.messages import ErrorReply, Stats, StatsRequest

        if isinstance(msg, StatsRequest):
            return Stats(counters={})
        return ErrorReply(code=Code.ERROR, message="a benchmark destination answers Stats only")

    def _hello(self, spec: Any, endpoints: list[Any], instance_id: str, timeout_s: float) -> Any:
        """Send a Handshake until P answers something other than BUSY (starting)."""
        from rapidkv.control.codes import Code
        from rapidkv.control.messages import Handshake

        hs = Handshake(
            instance_id=instance_id,
            control_address=self.server.address,
            spec=spec,
            endpoints=endpoints,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self.rpc.call(self.p_control, hs, timeout_s)
            if reply.code != Code.BUSY:
                return reply
            if time.monotonic() > deadline:
                raise RuntimeError(f"P stayed BUSY to handshakes: {reply.reasons}")
            time.sleep(0.2)

    def _probe(self, timeout_s: float) -> Any:
        """P's KVSpec, from its refusal of a spec that cannot match."""
        from rapidkv.control.messages import KVSpec, RankEndpoint

        probe = KVSpec(
            block_size=1,
            kernel_blocks_per_block=1,
            dtype="probe",
            num_layers=1,
            layer_block_bytes=(1,),
            layer_runs_per_block=(1,),
            tp_size=1,
            model_fingerprint="probe",
        )
        endpoint = RankEndpoint(
            rank=0, transport="nixl", transport_metadata=b"", layout=b"", num_blocks=1
        )
        reply = self._hello(probe, [endpoint], f"{self.instance_id}-probe", timeout_s)
        if reply.spec is None:
            raise RuntimeError(f"P's handshake reply carries no spec: {reply}")
        if reply.spec.tp_size != 1:
            raise RuntimeError(f"P runs TP {reply.spec.tp_size}; this destination is one rank")
        return reply.spec

    def _build_memory(self) -> None:
        """One sentinel-filled uint8 tensor per layer, `[runs, num_blocks, run_bytes]`."""
        import msgspec
        import torch

        from rapidkv.connector.metadata import peer_name
        from rapidkv.kvt.layout import Layout, layer_layout_from_tensor
        from rapidkv.kvt.transport import create_transport
        from rapidkv.kvt.worker import KvtWorker

        spec = self.spec
        self.layers: list[Any] = []  # keep the tensors alive while registered
        self.words: list[np.ndarray] = []  # int64 views [runs, blocks, words per run]
        layouts = []
        for nbytes, runs in zip(spec.layer_block_bytes, spec.layer_runs_per_block, strict=True):
            run_bytes = nbytes // runs
            t = torch.full((runs, self.num_blocks, run_bytes), SENTINEL_BYTE, dtype=torch.uint8)
            self.layers.append(t)
            self.words.append(t.numpy().view(np.int64))
            layouts.append(layer_layout_from_tensor(t.data_ptr(), t.shape, t.stride(), 1, 1))
        self.layout = Layout(tuple(layouts), self.num_blocks)
        # the same per-layer figures a worker reports (connector.worker_side.register)
        block_bytes = tuple(x.run_bytes * len(x.run_offsets) for x in layouts)
        runs = tuple(len(x.run_offsets) for x in layouts)
        if block_bytes != spec.layer_block_bytes or runs != spec.layer_runs_per_block:
            raise AssertionError(f"memory built as {block_bytes}/{runs}, P has {spec}")

        class Receiver(KvtWorker):
            IDLE_POLL_S = NOTIF_POLL_S

        self.kvt = Receiver(
            create_transport("nixl", peer_name(self.instance_id, 0)),
            self.layout,
            rank=0,
            block_size=spec.block_size,
        )
        self._layout_blob = msgspec.msgpack.encode(self.layout)

    def _handshake(self, timeout_s: float) -> int:
        """Introduce our memory to P; returns P's block count."""
        from rapidkv.control.codes import Code
        from rapidkv.control.messages import RankEndpoint

        endpoint = RankEndpoint(
            rank=0,
            transport="nixl",
            transport_metadata=self.kvt.metadata,
            layout=self._layout_blob,
            num_blocks=self.num_blocks,
        )
        reply = self._hello(self.spec, [endpoint], self.instance_id, timeout_s)
        if reply.code != Code.OK:
            raise RuntimeError(f"P refused the handshake: {reply.reasons}")
        return reply.endpoints[0].num_blocks

    # -- per transfer -----------------------------------------------------------

    def reset(self, blocks: Sequence[int]) -> None:
        """Fill `blocks` of every layer with the sentinel (nothing may write them)."""
        idx = list(blocks)
        for t in self.layers:
            t[:, idx, :] = SENTINEL_BYTE

    def watch(self, xfer_id: str, blocks: Sequence[int]) -> Watch:
        """Start watching `blocks` for `xfer_id` (one watch at a time)."""
        w = Watch(xfer_id, tuple(blocks), np.full((len(self.layers), len(blocks)), np.nan))
        with self._watch_lock:
            if self._watch is not None:
                raise RuntimeError(f"already watching {self._watch.xfer_id}")
            self._watch = w
        self._wake.set()
        return w

    def unwatch(self) -> None:
        with self._watch_lock:
            self._watch = None

    def unwritten_words(self, blocks: Sequence[int]) -> int:
        idx = list(blocks)
        return int(sum(int((w[:, idx, :] == SENTINEL_WORD).sum()) for w in self.words))

    def content(self, blocks: Sequence[int]) -> np.ndarray:
        """The KV of `blocks` (every layer) as float64 values, in block order."""
        raw = np.concatenate([t.numpy()[:, list(blocks), :].reshape(-1) for t in self.layers])
        return as_values(raw, self.spec.dtype)

    # -- watcher thread ---------------------------------------------------------

    def _run(self) -> None:
        # first in the fair class, like kvt's owner thread: a normal thread waits
        # behind this process's other threads for a scheduler slice (measured:
        # gaps of 2-5 ms between reads during a sample); without the privilege
        # it stays normal
        why = boost_current_thread()
        self.boosted = why is None
        if why is not None:
            log.warning("bench destination: watcher stays at normal priority (%s)", why)
        while not self._stopping:
            with self._watch_lock:
                w = self._watch
            if w is None:
                self._drain(time.monotonic())
                self._wake.wait(0.002)
                self._wake.clear()
                continue
            self._poll_memory(w)
            self._drain(None)
            hit = self._dones.pop(w.xfer_id, None)
            if hit is not None:
                self._poll_memory(w)  # every write landed before the SendDone
                w.done, w.t_done = hit
                with self._watch_lock:
                    if self._watch is w:
                        self._watch = None
                w.finished.set()
                continue
            time.sleep(self.poll_s)

    def _poll_memory(self, w: Watch) -> None:
        now = time.monotonic()
        if w.last_poll:
            w.max_gap = max(w.max_gap, now - w.last_poll)
        w.last_poll = now
        idx = np.asarray(w.blocks)
        for layer, words in enumerate(self.words):
            changed = words[0, idx, 0] != SENTINEL_WORD
            new = changed & np.isnan(w.landed[layer])
            if new.any():
                w.landed[layer][new] = now

    def _drain(self, now: float | None) -> None:
        if self.kvt is None:
            return
        got = self.kvt.take_received()
        if got:
            t = time.monotonic() if now is None else now
            for done in got:
                self._dones[done.xfer_id] = (done, t)
            while len(self._dones) > 1024:  # never watched: drop the oldest
                self._dones.pop(next(iter(self._dones)))

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.kvt is not None:
            self.kvt.close()
        self.rpc.close()
        self.server.stop()

    def __enter__(self) -> Destination:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def as_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    """uint8 bytes of KV in `dtype` (float32, float16, bfloat16) as float64."""
    if dtype == "float32":
        return raw.view(np.float32).astype(np.float64)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    raise ValueError(f"cannot compare KV of dtype {dtype!r}")


def rel_diff(a: np.ndarray, ref: np.ndarray) -> float:
    """max |a - ref| / max |ref| (0 when both are zero; inf on NaN or shape change)."""
    if a.shape != ref.shape or np.isnan(a).any():
        return float("inf")
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    diff = float(np.abs(a - ref).max()) if ref.size else 0.0
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))
