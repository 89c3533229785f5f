"""The worker side registers its KV caches as what they are (`kvt.device_ready`):
host tensors as DRAM with nothing to wait for, CUDA tensors as VRAM with a CUDA
event per layer that `save_kv_layer` records and the sending thread waits for;
caches of mixed kinds or devices, and VRAM over tcp, are refused at
registration with the reason. There is no GPU here: "CUDA" tensors are host
tensors that say they are on a CUDA device, and CUDA's events are stood in for
by events the test completes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cuda_stand_ins import FakeEvent
from cuda_stand_ins import install as install_fake_cuda

from rapidkv.connector import worker_side
from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.worker_side import WorkerSide
from rapidkv.kvt.device_ready import AlwaysReady, CudaReady, kv_memory
from rapidkv.kvt.layout import Layout, layer_layout_from_tensor
from rapidkv.kvt.task import Task
from rapidkv.kvt.transport import create_transport
from rapidkv.kvt.worker import KvtWorker

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LAYERS, BLOCKS, BLOCK = 3, 8, 16


class CudaStandIn:
    """A host tensor that says it is on CUDA device `index`: what registration
    reads of a KV cache (shape, strides, address, dtype) is the host tensor's."""

    def __init__(self, tensor: torch.Tensor, index: int = 0) -> None:
        self.tensor = tensor
        self.device = SimpleNamespace(type="cuda", index=index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tensor, name)


def host_caches(fill: bool = True) -> dict[str, torch.Tensor]:
    """vLLM CPU layers `[blocks, kv heads, block size, 2 * head size]`."""
    out = {}
    for i in range(LAYERS):
        t = torch.arange(BLOCKS * 2 * BLOCK * 8, dtype=torch.float32).view(BLOCKS, 2, BLOCK, 8)
        out[f"model.layers.{i}.attn"] = t + 1000 * i if fill else torch.zeros_like(t)
    return out


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> type[FakeEvent]:
    return install_fake_cuda(monkeypatch)


class Built:
    """What the worker side asked `create_transport` and `KvtWorker` for."""

    def __init__(self) -> None:
        self.transports: list[tuple[str, str, dict[str, Any]]] = []
        self.workers: list[dict[str, Any]] = []


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Built:
    """Record the worker side's calls. The transport it gets is always a real
    tcp one over the host memory (a stand-in's too), whatever it asked for, so
    the KvtWorker it builds runs."""
    seen = Built()

    def transport(kind: str, name: str, **options: Any) -> Any:
        seen.transports.append((kind, name, options))
        return create_transport("tcp", name)

    class Recorded(KvtWorker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen.workers.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(worker_side, "create_transport", transport)
    monkeypatch.setattr(worker_side, "KvtWorker", Recorded)
    return seen


@pytest.fixture
def sides() -> Iterator[list[WorkerSide]]:
    made: list[WorkerSide] = []
    yield made
    for w in made:
        w.close()


def side(sides: list[WorkerSide], transport: str = "nixl") -> WorkerSide:
    w = WorkerSide(ConnectorConfig(transport=transport), "P", 0, BLOCK)
    sides.append(w)
    return w


def test_host_caches_register_as_dram_with_nothing_to_wait_for(
    built: Built, sides: list[WorkerSide]
) -> None:
    w = side(sides, "nixl")
    w.register(host_caches(), BLOCKS)
    ((kind, name, options),) = built.transports
    assert (kind, name) == ("nixl", "P.r0")
    assert options == {"mem_type": "DRAM", "device_id": 0}
    (kwargs,) = built.workers
    assert isinstance(kwargs["ready"], AlwaysReady)
    assert kwargs["hugepages"] is True
    assert w.kvt is not None and isinstance(w.kvt.ready, AlwaysReady)


def test_host_caches_over_tcp_get_no_memory_options(built: Built, sides: list[WorkerSide]) -> None:
    w = side(sides, "tcp")
    w.register(host_caches(), BLOCKS)
    ((kind, _, options),) = built.transports
    assert (kind, options) == ("tcp", {})  # TcpTransport takes no mem_type
    assert isinstance(built.workers[0]["ready"], AlwaysReady)


def test_host_caches_register_with_a_real_nixl_agent_as_dram(sides: list[WorkerSide]) -> None:
    w = side(sides, "nixl")
    w.register(host_caches(), BLOCKS)
    assert w.kvt is not None
    assert (w.kvt.transport.mem_type, w.kvt.transport.device_id) == ("DRAM", 0)
    assert isinstance(w.kvt.ready, AlwaysReady)


def test_cuda_caches_register_as_vram_with_cuda_events(
    built: Built, sides: list[WorkerSide], fake_cuda: type[FakeEvent]
) -> None:
    caches = {name: CudaStandIn(t, 1) for name, t in host_caches().items()}
    w = side(sides, "nixl")
    w.register(caches, BLOCKS)  # type: ignore[arg-type]
    ((kind, _, options),) = built.transports
    assert kind == "nixl"
    assert options == {"mem_type": "VRAM", "device_id": 1}
    (kwargs,) = built.workers
    ready = kwargs["ready"]
    assert isinstance(ready, CudaReady)
    assert str(ready.device) == "cuda:1"
    assert kwargs["hugepages"] is False  # madvise is for host memory
    assert w.info is not None and w.info.dtype == "float32"


def wait_for(cond: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_a_layer_saved_leaves_only_once_its_event_completed(
    built: Built, sides: list[WorkerSide], fake_cuda: type[FakeEvent]
) -> None:
    """`save_kv_layer` -> `layer_saved` -> `KvtWorker.layer_done(i)`: layer i's
    event is recorded on the engine thread, on the forward's stream, and no
    byte of layer i reaches D before that event completed."""
    src = host_caches()
    w = side(sides, "nixl")
    w.register({name: CudaStandIn(t, 0) for name, t in src.items()}, BLOCKS)  # type: ignore[arg-type]
    dst_caches = list(host_caches(fill=False).values())
    dst_layout = Layout(
        tuple(
            layer_layout_from_tensor(t.data_ptr(), t.shape, t.stride(), t.element_size(), 0)
            for t in dst_caches
        ),
        BLOCKS,
    )
    dst = KvtWorker(create_transport("tcp", "D.r0"), dst_layout, rank=0, block_size=BLOCK)
    try:
        kvt = w.kvt
        assert kvt is not None
        peer = kvt.add_peer(dst.metadata, dst_layout)
        kvt.begin_step(1, [Task("x", peer, (1, 2), (5, 6), 0, 2 * BLOCK, True)])
        names = list(src)
        for name in names:
            w.layer_saved(name)
        engine = threading.current_thread().name
        events = fake_cuda.made
        assert [(e.stream, e.thread, e.blocking) for e in events] == [
            ("forward stream of cuda:0", engine, True)
        ] * LAYERS
        time.sleep(0.1)  # the owner thread had its chance to send
        assert not any(t.any() for t in dst_caches), "sent before the layer's event completed"
        events[0].fired.set()
        wait_for(lambda: bool(dst_caches[0].any()))
        assert not dst_caches[1].any() and not dst_caches[2].any()
        events[1].fired.set()
        events[2].fired.set()
        w.step_done()
        for i, name in enumerate(names):
            wait_for(lambda i=i: bool(dst_caches[i].any()))
            assert torch.equal(dst_caches[i][[5, 6]], src[name][[1, 2]])
    finally:
        dst.close()


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda t, i: CudaStandIn(t, i % 2), r"one memory kind and device.*VRAM', 0.*VRAM', 1"),
        (lambda t, i: CudaStandIn(t, 0) if i else t, r"one memory kind and device.*DRAM.*VRAM"),
    ],
    ids=["two devices", "host and device"],
)
def test_caches_of_mixed_kinds_or_devices_are_refused(
    built: Built, sides: list[WorkerSide], make: Any, why: str
) -> None:
    caches = {name: make(t, i) for i, (name, t) in enumerate(host_caches().items())}
    w = side(sides, "nixl")
    with pytest.raises(ValueError, match=why):
        w.register(caches, BLOCKS)
    assert built.transports == [] and built.workers == [] and w.kvt is None


def test_vram_over_tcp_is_refused_naming_the_transport_and_the_memory(
    built: Built, sides: list[WorkerSide]
) -> None:
    caches = {name: CudaStandIn(t, 0) for name, t in host_caches().items()}
    w = side(sides, "tcp")
    with pytest.raises(ValueError, match=r"transport 'tcp' cannot move VRAM.*cuda:0.*'nixl'"):
        w.register(caches, BLOCKS)  # type: ignore[arg-type]
    assert built.transports == [] and built.workers == [] and w.kvt is None


def test_kv_memory_says_what_each_transport_registers() -> None:
    host = list(host_caches().values())
    gpu = [CudaStandIn(t, 2) for t in host]
    assert kv_memory("nixl", host).options == {"mem_type": "DRAM", "device_id": 0}
    assert kv_memory("tcp", host).options == {}
    assert kv_memory("tcp", host).host and str(kv_memory("tcp", host)) == "DRAM"
    vram = kv_memory("nixl", gpu)
    assert (vram.mem_type, vram.device_id, vram.host) == ("VRAM", 2, False)
    assert vram.options == {"mem_type": "VRAM", "device_id": 2}
    assert str(vram) == "VRAM on cuda:2"
    with pytest.raises(ValueError, match="cannot move VRAM"):
        kv_memory("tcp", gpu)
