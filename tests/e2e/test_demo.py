"""`rapidkv demo`, the README's first command, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_demo_serves_through_p_and_d_and_matches_a_single_instance(tmp_path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rapidkv.cli",
            "demo",
            "--requests",
            "6",
            "--json",
            "--log-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "outputs equal to the single instance: 6/6  -> PASS" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kv_transfers"] == 6 and result["recompute_fallbacks"] == 0
    assert result["kv_bytes_moved"] > 0 and result["mismatches"] == 0
