"""`rapidkv demo`, the README's first command, as a user runs it: SmolLM2
answering ShareGPT questions and a conversation through P and D, token for
token what one instance answers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.mark.slow
def test_demo_answers_questions_through_p_and_d_as_a_single_instance_does(tmp_path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rapidkv.cli",
            "demo",
            "--requests",
            "6",
            "--conversations",
            "1",
            "--json",
            "--log-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    n = 6 + 3  # the questions, and the conversation's three turns
    assert f"outputs equal to the single instance: {n}/{n}  -> PASS" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["model"] == "smollm2-135m" and result["requests"] == n
    assert result["kv_transfers"] == n and result["recompute_fallbacks"] == 0
    assert result["kv_bytes_moved"] > 0 and result["mismatches"] == 0
    shown = result["answers"]
    assert len(shown) == 3 and all(qa["question"] and qa["answer"] for qa in shown)
    assert all(f"Q: {qa['question'].split()[0]}" in proc.stdout for qa in shown)
    # real words: a model that answers, not a random-weight one
    words = " ".join(qa["answer"] for qa in shown).split()
    assert sum(w.isalpha() for w in words) > len(words) / 2, shown
