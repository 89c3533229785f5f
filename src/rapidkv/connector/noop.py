"""A vLLM KV connector whose every hook does nothing: the `single-noop-connector`
configuration of `rapidkv bench serve` (here because only `rapidkv.connector`
imports vLLM). Load it with `kv_connector_module_path: "rapidkv.connector.noop"`.

Loading any KV connector puts vLLM on its connector path (per step: connector
metadata built and shipped to the worker, the worker's connector context around
the forward, per-layer hooks around attention, a connector output back). This
connector does no work of its own, so an instance with it measures that path
alone: the floor under any connector's decode, rapidkv's included.

Invariants: it never matches a token (`get_num_new_matched_tokens` -> 0), never
delays a free, never reports a transfer; outputs are the plain instance's.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NoopMetadata(KVConnectorMetadata):
    """Empty: there is nothing to tell the worker."""


class NoopConnector(KVConnectorBase_V1):
    # worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return NoopMetadata()
