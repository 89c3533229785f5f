"""The connector's series under prometheus_client's multiprocess mode, as
vLLM runs its API servers when there are several of them
(`PROMETHEUS_MULTIPROC_DIR`): each payload reaches one API server process, and
a scrape of any of them adds the counters and histograms up across the
processes and shows the most recent gauge level."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

# run in a fresh interpreter: the mode is chosen when prometheus_client is imported
CHILD = r"""
import json, os, sys, time
from types import SimpleNamespace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector
from rapidkv.connector.metrics import RapidKVPromMetrics

payloads = json.loads(sys.argv[1])
types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
config = SimpleNamespace(kv_transfer_config=None)
for payload in payloads:  # one API server process each, one after the other
    pid = os.fork()
    if pid == 0:
        m = RapidKVPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})
        m.observe(payload, 0)
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(0.01)  # "mostrecent": the later write wins
registry = CollectorRegistry()
MultiProcessCollector(registry)
labels = {"model_name": "m", "engine": "0"}
names = ["rapidkv_transfers_ok_total", "rapidkv_held_blocks", "rapidkv_transfer_seconds_count",
         "rapidkv_transfer_seconds_sum"]
out = {n: registry.get_sample_value(n, labels) for n in names}
out["le_0.01"] = registry.get_sample_value(
    "rapidkv_transfer_seconds_bucket", {**labels, "le": "0.01"})
print(json.dumps(out))
"""


def test_counters_and_histograms_add_up_across_api_servers_and_gauges_take_the_latest(
    tmp_path: Path,
) -> None:
    payloads = [
        {"counters": {"transfers_ok": 2.0}, "gauges": {"held_blocks": 7.0},
         "histograms": {"transfer_seconds": [0.002, 0.5]}},
        {"counters": {"transfers_ok": 1.0}, "gauges": {"held_blocks": 3.0},
         "histograms": {"transfer_seconds": [0.004]}},
    ]  # fmt: skip
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(payloads)],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {
        "rapidkv_transfers_ok_total": 3.0,
        "rapidkv_held_blocks": 3.0,
        "rapidkv_transfer_seconds_count": 3.0,
        "rapidkv_transfer_seconds_sum": pytest.approx(0.506),
        "le_0.01": 2.0,
    }
    assert len(list(tmp_path.glob("*.db"))) >= 2  # the two processes' files
