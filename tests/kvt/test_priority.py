"""The kvt owner thread's scheduling cannot hold a core: even busy-waiting, it
leaves a thread that sleeps and wakes on the same core its turn (the router,
the API server and the client live beside it). A real-time (SCHED_FIFO) owner
fails this: the sleeper waited 951 ms, until the kernel's real-time throttling
(`kvt.priority`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SPIN_S = 1.5

# A process with a KvtWorker (TCP transport, a small KV) whose owner thread,
# on `core`, stays in C code for SPIN_S (memset after memset: the GIL
# released, the core held, as a library spinning on a lock does) once a line
# arrives on its stdin.
CHILD = """
import ctypes, sys, time, torch
from rapidkv.kvt.layout import Layout, layer_layout_from_tensor
from rapidkv.kvt.transport import create_transport
from rapidkv.kvt.worker import KvtWorker
import os
os.sched_setaffinity(0, {int(sys.argv[1])})
storage = torch.zeros(2, 4, 2, 4, 8)
layers = tuple(
    layer_layout_from_tensor(t.data_ptr(), t.shape, t.stride(), 4, block_dim=0) for t in storage
)
worker = KvtWorker(create_transport("tcp", "spin"), Layout(layers, 4), rank=0, block_size=4)
libc = ctypes.CDLL(None)
buf = ctypes.create_string_buffer(1 << 24)
print("ready", flush=True)
sys.stdin.readline()
def spin():
    end = time.perf_counter() + float(sys.argv[2])
    while time.perf_counter() < end:
        libc.memset(buf, 1, len(buf))
worker._call(spin)
worker.close()
"""


def test_a_busy_waiting_owner_thread_leaves_a_sleeper_on_its_core_its_turn() -> None:
    core = min(os.sched_getaffinity(0))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(core), str(SPIN_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    gaps: list[float] = []
    on_core = threading.Event()

    def sleeper() -> None:
        os.sched_setaffinity(0, {core})  # this thread only
        last = time.perf_counter()
        end = last + SPIN_S + 0.5
        while time.perf_counter() < end:
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            on_core.set()

    thread = threading.Thread(target=sleeper)
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        thread.start()
        assert on_core.wait(5)
        child.stdin.write("spin\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
        thread.join()
    assert len(gaps) > 10
    assert max(gaps) < 0.3, f"the sleeper waited {max(gaps) * 1e3:.0f} ms for its core"
