"""`scripts/device-check` where there is no GPU: it skips the CUDA parts and says
why, refuses bad arguments, runs its machinery on host memory, and builds a kit
that stays under 64 MiB (or refuses to)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device-check"
LIMIT = 64 * 1024 * 1024


def device_check(*args: str, cwd: Path | None = None, script: Path = SCRIPT):
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
    )


def test_skip_cuda_writes_skipped_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = device_check("--skip-cuda", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["status"] == "skipped"
    assert result["reason"] == "--skip-cuda"
    assert result["checks"] == {
        "layerwise": "skipped: --skip-cuda",
        "throughput": "skipped: --skip-cuda",
        "vram_to_dram": "skipped: --skip-cuda",
    }
    assert result["blocks"] == 512 and result["args"]["layers"] == 32


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_skips_by_itself(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = device_check("--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert (result["status"], result["reason"]) == ("skipped", "torch.cuda.is_available() is False")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--layers", "0"], "--layers must be at least 1"),
        (["--size", "0"], "--size must be at least 1"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--timeout", "500"], "--timeout must be in (0, 470]"),
        (["--timeout", "0"], "--timeout must be in (0, 470]"),
        (["--size", "1", "--layers", "16"], "under 2 blocks"),
        (["--layers", "x"], "invalid int value"),
        (["--wheels", "w"], "--wheels goes with --kit"),
        (["--kit", "k"], "--kit needs --wheels"),
        (["--frobnicate"], "unrecognized arguments"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(args: list[str], says: str, tmp_path) -> None:
    proc = device_check(*args, "--out", str(tmp_path / "r.json"))
    assert proc.returncode == 2
    assert says in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_host_only_runs_the_machinery_on_host_memory(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = device_check(
        "--host-only",
        "--layers",
        "4",
        "--size",
        "8",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["status"], result["mode"]) == ("ok", "host-only")
    layerwise = result["checks"]["layerwise"]
    assert layerwise["ok"] and layerwise["stale_layers"] == [[], []]
    throughput = result["checks"]["throughput"]
    assert throughput["ok"] and throughput["contiguous_gbps"] > 0
    assert throughput["scattered_gbps"] > 0
    assert result["checks"]["vram_to_dram"].startswith("skipped")


def fake_wheels(folder: Path, nixl_bytes: int) -> Path:
    folder.mkdir()
    for name, size in (
        ("nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl", nixl_bytes),
        ("nixl-1.5.1-py3-none-any.whl", 11805),
        ("msgspec-0.23.0-cp312-cp312-manylinux_2_17_x86_64.whl", 236624),
    ):
        with open(folder / name, "wb") as f:
            f.truncate(size)  # sparse: counted at its size
    return folder


def test_the_kit_holds_the_script_kvt_and_the_wheels_under_64_mib(tmp_path: Path) -> None:
    kit = tmp_path / "kit"
    wheels = fake_wheels(tmp_path / "wheels", 58768877)  # nixl-cu13 1.5.1's size
    proc = device_check("--kit", str(kit), "--wheels", str(wheels))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    files = [p for p in kit.rglob("*") if p.is_file()]
    assert summary["bytes"] == sum(p.stat().st_size for p in files) < LIMIT
    assert (kit / "device-check").is_file()
    assert (kit / "src" / "rapidkv" / "kvt" / "head_map.py").is_file()
    assert (kit / "src" / "rapidkv" / "kvt" / "device_ready.py").is_file()
    assert len(list((kit / "wheels").glob("*.whl"))) == 3
    assert not list(kit.rglob("__pycache__"))
    # the kit's script runs from the kit, on the kit's own source
    out = tmp_path / "r.json"
    env_free = device_check("--skip-cuda", "--out", str(out), script=kit / "device-check")
    assert env_free.returncode == 0, env_free.stderr
    assert json.loads(out.read_text())["rapidkv_src"] == str((kit / "src").resolve())


def test_a_kit_of_64_mib_or_more_is_refused(tmp_path: Path) -> None:
    wheels = fake_wheels(tmp_path / "wheels", LIMIT)
    proc = device_check("--kit", str(tmp_path / "kit"), "--wheels", str(wheels))
    assert proc.returncode == 1
    assert "over the 64 MiB limit" in proc.stderr


def test_a_kit_without_its_wheels_is_refused(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    proc = device_check("--kit", str(tmp_path / "kit"), "--wheels", str(tmp_path / "wheels"))
    assert proc.returncode == 2
    assert "nixl_cu13-" in proc.stderr and "msgspec-" in proc.stderr


def test_the_script_is_executable() -> None:
    assert os.access(SCRIPT, os.X_OK)
