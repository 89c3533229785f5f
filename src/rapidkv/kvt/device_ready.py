"""KV written by a device: when a layer's bytes may leave, and what memory the
transport registers.

On the CPU a layer's KV is in memory when vLLM calls `save_kv_layer`. On a GPU
it is not: the forward only *queued* the layer's kernels on its stream, and
`save_kv_layer` returns long before the device has run them. A send posted then
would move stale bytes. So the engine thread records a CUDA event on the
forward stream after each layer (`record(layer)`, from `KvtWorker.layer_done`),
and the thread that posts the writes waits for that event first (`wait(layer)`,
on the kvt owner thread). Events of one stream complete in order, so waiting
for layer i's event also covers every layer before it.

- `AlwaysReady`: tensors in host memory: nothing to wait for.
- `CudaReady`: one event per layer, the latest recorded. A `wait` that meets an
  event recorded for a later step waits for that one: later, never too early.
  Events are made with `blocking=True`, so a waiting thread sleeps in the
  driver instead of spinning on a core.
- `memory_kind(tensor)`: "DRAM" or "VRAM", what NIXL registers it as;
  `nixl_options(tensors)`: the transport options for a worker's KV caches
  (all of one kind and device, or a clear error).
- `layer_ready_for(tensor, num_layers)`: `AlwaysReady` or `CudaReady`, by the
  tensor's memory kind.
- `kv_memory(transport, tensors)`: the kind and device as a `KvMemory`, with
  the options `create_transport(transport, ...)` registers them with, or a
  `ValueError` (mixed kinds or devices; VRAM over `tcp`).

Whoever builds a `KvtWorker` over KV caches asks this module what they are:
`kv_memory(transport, kv_caches)` (the kind and device, and the transport
options that register them: NIXL's `mem_type`/`device_id`; VRAM over a
transport that moves host memory only, `tcp`, is refused naming both) and
`layer_ready_for(first_kv_cache, num_layers)`, passed as `KvtWorker(ready=...)`.
The connector's worker side does so at registration (`WorkerSide.register`):
on the CPU nothing changes (DRAM, `AlwaysReady`), CUDA KV caches register as
VRAM with a `CudaReady`, and vLLM's `save_kv_layer` -> `WorkerSide.layer_saved`
-> `KvtWorker.layer_done(i)` records layer i's event on the engine thread right
after vLLM queued the layer. `scripts/device-check` builds a `KvtWorker` over
CUDA caches itself. Nothing has run on a GPU here yet (no device was lent):
`scripts/device-check` is the check to run on one.

The receiving side needs no event: a destination whose KV caches are VRAM
takes NIXL's writes straight into them, and its engine reads them only after
kvt reported them: a whole load once its SendDone arrived (`finished_recving`:
vLLM schedules the request in a later step, whose kernels are queued after
that), a split prefill's head layer by layer once `LayersLanded` covered the
layer (`wait_for_layer_load` returns, and only then is that layer's attention
queued). D's own forward does not write those blocks meanwhile: they belong
to the request that waits for them.

Nothing else of kvt knows about CUDA.
Only this module imports torch, and only for CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class LayerReady(Protocol):
    def record(self, layer: int) -> None:
        """Engine thread, after layer `layer`'s KV writes were issued: mark the
        point in the forward's stream where they are done."""

    def wait(self, layer: int) -> None:
        """Sending thread: return once layer `layer`'s KV (and every earlier
        layer's on the same stream) is written."""


class AlwaysReady:
    """KV in host memory: written when the forward's call returns."""

    def record(self, layer: int) -> None:
        return None

    def wait(self, layer: int) -> None:
        return None


class CudaReady:
    """One CUDA event per layer, recorded on the caller's current stream."""

    def __init__(self, num_layers: int, device: Any = None) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CudaReady needs CUDA: torch.cuda.is_available() is False")
        self._torch = torch
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaReady needs a CUDA device, not {self.device}")
        self._events: list[Any] = [None] * num_layers

    def record(self, layer: int) -> None:
        event = self._torch.cuda.Event(blocking=True)
        event.record(self._torch.cuda.current_stream(self.device))
        self._events[layer] = event  # one reference swap: the waiter sees old or new

    def wait(self, layer: int) -> None:
        event = self._events[layer]
        if event is not None:
            event.synchronize()  # releases the GIL while it waits

    def done(self, layer: int) -> bool:
        """Layer `layer`'s latest event completed (or none was recorded)."""
        event = self._events[layer]
        return event is None or bool(event.query())


def memory_kind(tensor: Any) -> str:
    """What NIXL registers `tensor`'s memory as: "DRAM" (host) or "VRAM" (CUDA)."""
    kind = tensor.device.type
    if kind == "cpu":
        return "DRAM"
    if kind == "cuda":
        return "VRAM"
    raise ValueError(f"KV caches on {tensor.device} cannot be registered (cpu or cuda only)")


def device_id(tensor: Any) -> int:
    """The device index NIXL's descriptors carry (0 for host memory)."""
    index = tensor.device.index
    return 0 if tensor.device.type == "cpu" or index is None else int(index)


def nixl_options(tensors: Iterable[Any]) -> dict[str, Any]:
    """`create_transport("nixl", ...)` options for a worker's KV caches:
    `mem_type` and `device_id`; raises `ValueError` if they mix kinds or devices."""
    kinds = {(memory_kind(t), device_id(t)) for t in tensors}
    if len(kinds) != 1:
        raise ValueError(f"KV caches must share one memory kind and device, not {sorted(kinds)}")
    ((mem_type, device),) = kinds
    return {"mem_type": mem_type, "device_id": device}


def layer_ready_for(tensor: Any, num_layers: int) -> LayerReady:
    """`CudaReady` for KV caches on a CUDA device, `AlwaysReady` for host memory."""
    if memory_kind(tensor) == "VRAM":
        return CudaReady(num_layers, f"cuda:{device_id(tensor)}")
    return AlwaysReady()


HOST_ONLY = frozenset({"tcp"})
"""Transports that move host memory only: tcp reads and writes registered
memory through host pointers (`tcp_memory`) and takes no memory kind."""


@dataclass(frozen=True)
class KvMemory:
    """A worker's KV caches as its transport registers them."""

    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    options: dict[str, Any] = field(default_factory=dict)  # create_transport's, for them

    @property
    def host(self) -> bool:
        """In host memory (huge pages apply to it, `KvtWorker(hugepages=...)`)."""
        return self.mem_type == "DRAM"

    def __str__(self) -> str:
        return self.mem_type if self.host else f"{self.mem_type} on cuda:{self.device_id}"


def kv_memory(transport: str, tensors: Sequence[Any]) -> KvMemory:
    """What `tensors` (a worker's KV caches) are and the `create_transport(transport,
    ...)` options that register them: NIXL's `mem_type` and `device_id`, none for
    a host-only transport. Raises `ValueError` where they mix kinds or devices,
    or are VRAM and `transport` moves host memory only."""
    options = nixl_options(tensors)
    mem_type, device = options["mem_type"], options["device_id"]
    if transport not in HOST_ONLY:
        return KvMemory(mem_type, device, options)
    if mem_type != "DRAM":
        raise ValueError(
            f"transport {transport!r} cannot move {mem_type}: the KV caches are on "
            f"cuda:{device} and {transport} reads and writes host memory only; "
            "use transport 'nixl'"
        )
    return KvMemory(mem_type, device)
