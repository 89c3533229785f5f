"""rapidkv's vLLM KV connector: the only package that imports vLLM.

`RapidKVConnector` is imported lazily, so `rapidkv.connector.plan` and friends
stay importable without vLLM. Load it in vLLM with
`kv_connector_module_path: "rapidkv.connector"` (see `connector.connector`).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "RapidKVConnector":
        from rapidkv.connector.connector import RapidKVConnector

        return RapidKVConnector
    raise AttributeError(f"module 'rapidkv.connector' has no attribute {name!r}")
