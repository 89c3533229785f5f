"""rapidkv's vLLM KV connector: the only package that imports vLLM.

`RapidKVConnector` is imported lazily, so `rapidkv.connector.plan` and friends
stay importable without vLLM. An installed rapidkv registers it with vLLM by
name (`plugin.register`, vLLM's `vllm.general_plugins` entry point):
`"kv_connector": "RapidKVConnector"` is enough; a checkout on `PYTHONPATH`
adds `"kv_connector_module_path": "rapidkv.connector"` (see `connector.connector`).
Either way the class is read here, and the running vLLM is checked first
against the supported range (`plugin.SUPPORTED_VLLM`; `UnsupportedVLLM` names
both versions).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "RapidKVConnector":
        from rapidkv.connector.plugin import require_supported_vllm

        require_supported_vllm()
        from rapidkv.connector.connector import RapidKVConnector

        return RapidKVConnector
    raise AttributeError(f"module 'rapidkv.connector' has no attribute {name!r}")
