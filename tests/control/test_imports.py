"""The control plane stays free of vLLM and torch (it runs in the router too)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def test_control_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys\n"
        "import rapidkv.control.client, rapidkv.control.server, rapidkv.control.messages\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
