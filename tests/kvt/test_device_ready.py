"""KV written by a device: the memory kind a tensor registers as, the layer
events (CUDA's stood in for where there is no GPU), and a KvtWorker that posts
no byte of a layer before that layer's event completed; a worker sending to a
peer of another TP size moves each head where the mapping says."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch
from cuda_stand_ins import FakeEvent
from cuda_stand_ins import install as install_fake_cuda

from rapidkv.kvt import device_ready
from rapidkv.kvt.device_ready import (
    AlwaysReady,
    CudaReady,
    device_id,
    layer_ready_for,
    memory_kind,
    nixl_options,
)
from rapidkv.kvt.head_map import MappingError, heads_from_tensor, rank_heads
from rapidkv.kvt.layout import Layout, layer_layout_from_tensor
from rapidkv.kvt.task import Task
from rapidkv.kvt.transport import create_transport
from rapidkv.kvt.worker import KvtWorker

pytestmark = pytest.mark.unit


def fake_tensor(kind: str, index: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(device=SimpleNamespace(type=kind, index=index))


def test_host_tensors_register_as_dram_and_cuda_tensors_as_vram() -> None:
    assert memory_kind(torch.zeros(4)) == "DRAM"
    assert device_id(torch.zeros(4)) == 0
    assert memory_kind(fake_tensor("cuda", 3)) == "VRAM"
    assert device_id(fake_tensor("cuda", 3)) == 3
    with pytest.raises(ValueError, match="cpu or cuda only"):
        memory_kind(torch.zeros(4, device="meta"))


def test_transport_options_come_from_the_kv_caches() -> None:
    assert nixl_options([torch.zeros(2), torch.zeros(2)]) == {"mem_type": "DRAM", "device_id": 0}
    assert nixl_options([fake_tensor("cuda", 1)] * 2) == {"mem_type": "VRAM", "device_id": 1}
    with pytest.raises(ValueError, match="one memory kind and device"):
        nixl_options([fake_tensor("cuda", 0), fake_tensor("cuda", 1)])
    with pytest.raises(ValueError, match="one memory kind and device"):
        nixl_options([torch.zeros(2), fake_tensor("cuda", 0)])


def test_host_kv_is_always_ready() -> None:
    ready = layer_ready_for(torch.zeros(4), num_layers=3)
    assert isinstance(ready, AlwaysReady)
    ready.record(0)
    ready.wait(2)  # returns at once, also for a layer never recorded


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_events_without_cuda_are_refused_with_the_reason() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available"):
        CudaReady(4)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> type[FakeEvent]:
    return install_fake_cuda(monkeypatch)


def test_cuda_ready_records_on_the_current_stream_and_waits_for_the_latest(fake_cuda) -> None:
    ready = CudaReady(2)
    assert ready.done(0)  # nothing recorded: nothing to wait for
    ready.wait(0)
    ready.record(0)
    (first,) = fake_cuda.made
    assert first.stream == "forward stream of cuda:0"
    assert first.blocking  # a waiting thread sleeps in the driver, not spinning
    assert not ready.done(0)
    ready.record(0)  # the next step's: a waiter now waits for this one (later, never earlier)
    first.fired.set()
    assert not ready.done(0)
    fake_cuda.made[1].fired.set()
    ready.wait(0)
    assert ready.done(0)


def test_cuda_tensors_get_cuda_events(fake_cuda) -> None:
    ready = layer_ready_for(fake_tensor("cuda", 0), num_layers=2)
    assert isinstance(ready, CudaReady)
    assert str(ready.device) == "cuda:0"


def test_only_cuda_code_imports_torch() -> None:
    source = Path(device_ready.__file__).read_text()
    head = source.split("class CudaReady")[0]
    assert "import torch" not in head


# -- a KvtWorker with events ------------------------------------------------------

LAYERS, BLOCKS = 3, 8


class GatedReady:
    """Layer events the test completes by hand; remembers who called what."""

    def __init__(self) -> None:
        self.gates = [threading.Event() for _ in range(LAYERS)]
        self.recorded: list[tuple[int, str]] = []
        self.waited: list[tuple[int, str]] = []

    def record(self, layer: int) -> None:
        self.recorded.append((layer, threading.current_thread().name))

    def wait(self, layer: int) -> None:
        self.waited.append((layer, threading.current_thread().name))
        assert self.gates[layer].wait(10)


def memory(fill: bool) -> tuple[torch.Tensor, Layout]:
    t = torch.arange(LAYERS * BLOCKS * 64, dtype=torch.int32).view(LAYERS, BLOCKS, 64)
    if not fill:
        t = torch.zeros_like(t)
    layers = tuple(
        layer_layout_from_tensor(t[i].data_ptr(), t[i].shape, t[i].stride(), 4, 0)
        for i in range(LAYERS)
    )
    return t, Layout(layers, BLOCKS)


def wait_for(cond, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_no_byte_of_a_layer_leaves_before_its_event() -> None:
    ready = GatedReady()
    src_mem, src_layout = memory(fill=True)
    dst_mem, dst_layout = memory(fill=False)
    done = []
    src = KvtWorker(
        create_transport("tcp", "gated-src"),
        src_layout,
        rank=0,
        block_size=16,
        on_send_done=done.append,
        ready=ready,
        hugepages=False,
    )
    dst = KvtWorker(create_transport("tcp", "gated-dst"), dst_layout, rank=0, block_size=16)
    try:
        peer = src.add_peer(dst.metadata, dst_layout)
        src.begin_step(1, [Task("x", peer, (1, 2), (5, 6), 0, 32, True)])
        for layer in range(LAYERS):
            src.layer_done(layer)
        wait_for(lambda: len(ready.waited) >= 1)  # the owner waits on layer 0's event
        assert not dst_mem.any(), "bytes left before their layer's event completed"
        ready.gates[0].set()
        wait_for(lambda: bool(dst_mem[0].any()))
        wait_for(lambda: len(ready.waited) >= 2)  # and then on layer 1's
        assert not dst_mem[1:].any()
        ready.gates[1].set()
        ready.gates[2].set()
        src.freeze_step()
        wait_for(lambda: bool(done))
        assert done[0].ok
        assert torch.equal(dst_mem[:, [5, 6]], src_mem[:, [1, 2]])
        engine = threading.current_thread().name
        assert ready.recorded == [(layer, engine) for layer in range(LAYERS)]
        assert {layer for layer, _ in ready.waited} == set(range(LAYERS))
        assert all(name.startswith("kvt-owner") for _, name in ready.waited)
    finally:
        src.close()
        dst.close()


def test_full_sends_do_not_wait_for_layer_events() -> None:
    ready = GatedReady()  # no gate ever opens
    src_mem, src_layout = memory(fill=True)
    dst_mem, dst_layout = memory(fill=False)
    done = []
    src = KvtWorker(
        create_transport("tcp", "full-src"),
        src_layout,
        rank=0,
        block_size=16,
        on_send_done=done.append,
        ready=ready,
        hugepages=False,
    )
    dst = KvtWorker(create_transport("tcp", "full-dst"), dst_layout, rank=0, block_size=16)
    try:
        peer = src.add_peer(dst.metadata, dst_layout)
        src.send_full([Task("f", peer, (0,), (3,), 0, 16, True)])
        wait_for(lambda: bool(done))
        assert done[0].ok and ready.waited == []
        assert torch.equal(dst_mem[:, 3], src_mem[:, 0])
    finally:
        src.close()
        dst.close()


# -- a KvtWorker sending to a peer of another TP size --------------------------------

TOTAL, N, D = 4, 4, 8  # KV heads, block size, head size


def rank_kv(full: torch.Tensor, tp: int, rank: int) -> tuple[torch.Tensor, Layout]:
    """Rank `rank` of `tp`'s KV: vLLM CPU layers `[blocks, heads, N, 2D]`."""
    heads = rank_heads(TOTAL, tp, rank)
    t = full[:, :, heads.start : heads.stop].contiguous()
    layers = []
    for i in range(t.shape[0]):
        x = t[i]
        lay = layer_layout_from_tensor(x.data_ptr(), x.shape, x.stride(), x.element_size(), 0)
        h = heads_from_tensor(
            x.shape,
            x.element_size(),
            0,
            1,
            total=TOTAL,
            tp_size=tp,
            rank=rank,
            head_size=D,
            block_size=N,
        )
        layers.append(msgspec.structs.replace(lay, heads=h))
    return t, Layout(tuple(layers), t.shape[1])


@pytest.mark.parametrize("kind", ["tcp", "nixl"])
def test_two_p_ranks_fill_one_d_rank_each_with_its_heads(kind: str) -> None:
    full = torch.randn(LAYERS, BLOCKS, TOTAL, N, 2 * D)
    dst_mem, dst_layout = rank_kv(torch.zeros_like(full), 1, 0)
    dst = KvtWorker(create_transport(kind, f"tp-dst-{kind}"), dst_layout, rank=0, block_size=N)
    srcs, done = [], []
    try:
        for p in range(2):
            mem, layout = rank_kv(full, 2, p)
            w = KvtWorker(
                create_transport(kind, f"tp-src{p}-{kind}"),
                layout,
                rank=p,
                block_size=N,
                on_send_done=done.append,
                hugepages=False,
            )
            srcs.append((w, mem))
            peer = w.add_peer(dst.metadata, dst_layout)
            w.send_full([Task(f"t{p}", peer, (0, 3, 4), (7, 1, 2), 0, 3 * N, True)])
        dst.set_awaiting(True)
        wait_for(lambda: len(done) == 2)
        assert all(x.ok for x in done)
        assert torch.equal(dst_mem[:, [7, 1, 2]], full[:, [0, 3, 4]])
        assert not dst_mem[:, [0, 3, 4, 5, 6]].any()
    finally:
        for w, _ in srcs:
            w.close()
        dst.close()


def test_a_peer_whose_heads_cannot_map_is_refused_at_add_peer() -> None:
    full = torch.zeros(LAYERS, BLOCKS, TOTAL, N, 2 * D)
    _, src_layout = rank_kv(full, 2, 0)
    _, dst_layout = rank_kv(full, 1, 0)
    bad = Layout(
        tuple(
            msgspec.structs.replace(x, heads=msgspec.structs.replace(x.heads, head_size=2 * D))
            for x in dst_layout.layers
        ),
        dst_layout.num_blocks,
    )
    src = KvtWorker(
        create_transport("tcp", "refuse-src"), src_layout, rank=0, block_size=N, hugepages=False
    )
    try:
        with pytest.raises(MappingError, match="head size 8 vs 16"):
            src.add_peer(b"unused", bad)
    finally:
        src.close()
