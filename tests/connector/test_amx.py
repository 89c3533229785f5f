"""AMX tile permission: asked for in the worker role before any thread of ours.

Each check runs in a fresh interpreter (permission is per process and, once
granted, cannot be dropped). The child wraps `threading.Thread.start` and the
transport factory to record, at each, whether the kernel already grants tile
data (`ARCH_GET_XCOMP_PERM`), then starts the connector's worker role and
registers real KV cache tensors (kvt's owner thread, the bypass receiver and
the transport start there).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from rapidkv.connector.amx import cpu_has_amx, tile_data_permitted

pytestmark = pytest.mark.unit

needs_amx = pytest.mark.skipif(not cpu_has_amx(), reason="this CPU has no AMX tiles")

CHILD = r"""
import json, sys, threading
import torch
from rapidkv.connector import amx, worker_side
from rapidkv.connector.config import ConnectorConfig
from rapidkv.connector.connector import start_worker_side

seen = []
start = threading.Thread.start
def recording_start(self, *a, **k):
    seen.append(("thread " + self.name, amx.tile_data_permitted()))
    return start(self, *a, **k)
threading.Thread.start = recording_start
create = worker_side.create_transport
def recording_create(*a, **k):
    seen.append(("transport", amx.tile_data_permitted()))
    return create(*a, **k)
worker_side.create_transport = recording_create

before = amx.tile_data_permitted()
threads_before = threading.active_count()
side = start_worker_side(ConnectorConfig(transport=sys.argv[1], hugepages=False), "amx-test", 0, 16)
caches = {f"layer.{i}": torch.zeros(2, 8, 16, 2, 4, dtype=torch.bfloat16) for i in range(2)}
side.register(caches, 8)
print(json.dumps({"before": before, "threads_before": threads_before, "seen": seen,
                  "outcome": amx.request_tile_permission(), "after": amx.tile_data_permitted()}))
side.kvt.close()
"""


def _child(transport: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, transport], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_amx
@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_permission_is_granted_before_the_first_thread_starts(transport: str) -> None:
    got = _child(transport)
    assert got["before"] is False, "a fresh interpreter should not have tile data yet"
    assert got["threads_before"] == 1
    assert any(what.startswith("thread") for what, _ in got["seen"]), got["seen"]
    assert ["transport", True] in got["seen"]
    late = [what for what, permitted in got["seen"] if not permitted]
    assert late == [], f"started before AMX tile data was permitted: {late}"
    assert got["outcome"] == "granted" and got["after"] is True


@pytest.mark.skipif(cpu_has_amx(), reason="this CPU has AMX (the test above covers it)")
def test_without_amx_nothing_is_asked() -> None:
    got = _child("tcp")
    assert got["outcome"] == "no_amx" and got["after"] is False
    assert tile_data_permitted() is False


def test_amx_is_read_from_the_cpu_flags(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert cpu_has_amx(cpuinfo) is (platform.machine() == "x86_64")
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tilex\n")
    assert cpu_has_amx(cpuinfo) is False
    assert cpu_has_amx(tmp_path / "missing") is False


@needs_amx
def test_the_tuned_nixl_start_up_hook_asks_too(tmp_path: Path) -> None:
    """The tuned vllm-nixl servers' sitecustomize asks at interpreter start."""
    from rapidkv.bench.common.nixl_tuning import write_sitecustomize
    from rapidkv.harness.server import SRC_DIR

    site = write_sitecustomize(tmp_path / "site")
    probe = "from rapidkv.connector.amx import tile_data_permitted; print(tile_data_permitted())"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{site}:{SRC_DIR}"}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    assert "AMX tile data: granted" in out.stderr
    plain = subprocess.run(
        [sys.executable, "-c", probe], env={**env, "PYTHONPATH": str(SRC_DIR)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert plain.stdout.strip() == "False", "without the hook nothing should ask"
