"""The SmolLM2 (float32) P/D pair that test_pd_smollm2 and test_kv_aware share
(pool key `KEY`), as docs/install.md has an operator start it: the connector
by name (no module path), the shared secret from a file; chunked prefill of
256 tokens; each instance publishing its vLLM KV events on loopback (what the
router's prefix index follows) and serving `POST /reset_prefix_cache`
(`VLLM_SERVER_DEV_MODE`: test_kv_aware empties both caches before it starts),
neither of which changes an output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rapidkv.connector.config import kv_transfer_config
from rapidkv.harness import ServerSpec, free_port
from rapidkv.harness.kv_events import bound_endpoint
from rapidkv.harness.server import pd_specs

KEY = "pd_smollm2"


def by_name(control_port: int, secret_file: Path) -> dict[str, Any]:
    """`--kv-transfer-config` as docs/install.md writes it: the connector by
    name, no module path, the secret from a file."""
    config = kv_transfer_config(control_port, secret_file=str(secret_file))
    del config["kv_connector_module_path"]
    return config


def events_args(port: int, replay_port: int) -> tuple[str, ...]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": bound_endpoint(port),  # on loopback only
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    return ("--kv-events-config", json.dumps(config))


def specs(model: Path, secret_file: Path) -> tuple[list[ServerSpec], tuple[str, str]]:
    """P's and D's specs (P on core 0, D on core 1), and their control
    addresses."""
    pc, dc = free_port(), free_port()
    chunked = ("--max-num-batched-tokens", "256")
    out = pd_specs(model, by_name(pc, secret_file), by_name(dc, secret_file), chunked)
    out = [
        s.replace(
            extra_args=(*s.extra_args, *events_args(free_port(), free_port())),
            env={**s.env, "VLLM_SERVER_DEV_MODE": "1"},
            executor="mp",  # vLLM CPU's default, as installed
        )
        for s in out
    ]
    return out, (f"127.0.0.1:{pc}", f"127.0.0.1:{dc}")
