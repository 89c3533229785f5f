"""The connector's settings, read from `kv_connector_extra_config`.

Every key is optional. Unknown keys are refused (a typo must not silently fall
back to a default).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

TransferKVMode = Literal["step", "bypass", "substep"]


class ConnectorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # control plane: where this instance's RPC server listens (P side)
    control_host: str = "127.0.0.1"
    control_port: int = 0  # 0: pick a free port (logged); give one for the router
    secret: str | None = None  # shared secret authenticating control messages
    # data plane
    transport: Literal["nixl", "tcp"] = "nixl"
    transfer_kv_mode: TransferKVMode = "substep"
    write_timeout_s: float = 10.0
    hugepages: bool = True  # back registered KV memory with huge pages
    # lifecycle bounds (seconds, not milliseconds)
    park_ttl_s: float = 10.0  # a TransferKV waits this long for its request on P
    finished_ttl_s: float = 30.0  # P holds a finished request's blocks this long
    rpc_timeout_s: float = 30.0  # D's wait for a TransferKV reply
    # D: how long blocks P may still write into stay held while P does not
    # confirm an Abort of their transfer (frozen, cut off); see ConsumerSide.abort_p
    fence_timeout_s: float = 300.0
    tombstone_ttl_s: float = 60.0
    # P: a destination that sent no TransferKV this long and has none in flight
    # is forgotten (a D that restarted elsewhere with a new id leaves no entry)
    peer_idle_ttl_s: float = 600.0
    max_parked: int = 1024
    # P: TransferKVs one D may have outstanding here (accepted and not settled,
    # or parked); more are answered BUSY and D retries with backoff
    max_transfers_per_peer: int = 64
    # benchmark aid: confirm writes as if they crossed a link of this many GB/s
    # (0: no cap); see kvt.worker
    bandwidth_cap_gbps: float = 0.0
    # testing aid: sleep this long after each layer's save in steps that compute
    # prompt tokens of a transfer (widens them so that layer-by-layer sending and
    # substeps can be observed); 0 in production
    debug_layer_delay_s: float = 0.0
    # testing aid: the worker holds each bypass message this long before acting on
    # it (forces substeps to arrive after their step froze: rollback); 0 in production
    debug_bypass_delay_s: float = 0.0
    # testing aid (`rapidkv bench chaos`), P's workers: fail this share of
    # transfers at one of their layers, as a write the transport gave up on would
    # (D recomputes, P frees), and hold each transfer's sends for a random time up
    # to `debug_send_delay_s`; both decided from the xfer_id, so every TP rank
    # agrees (kvt.faults); 0 in production
    debug_fail_transfer_rate: float = 0.0
    debug_send_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.debug_fail_transfer_rate <= 1.0:
            raise ValueError("debug_fail_transfer_rate must be between 0 and 1")
        if self.debug_send_delay_s < 0:
            raise ValueError("debug_send_delay_s must be >= 0")
        if not self.peer_idle_ttl_s > 0:
            raise ValueError("peer_idle_ttl_s must be > 0")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        try:
            return msgspec.convert(extra or {}, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"rapidkv: bad kv_connector_extra_config: {e}") from None


def kv_transfer_config(control_port: int, **extra: Any) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for an instance running RapidKVConnector
    (P, D or both) whose control plane listens on `control_port`; `extra` goes
    into `kv_connector_extra_config` (validated here, as the connector will)."""
    ConnectorConfig.from_extra({"control_port": control_port, **extra})
    return {
        "kv_connector": "RapidKVConnector",
        "kv_connector_module_path": "rapidkv.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"control_port": control_port, **extra},
    }
