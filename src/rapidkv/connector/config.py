"""The connector's settings, read from `kv_connector_extra_config`.

Every key is optional. Unknown keys are refused (a typo must not silently fall
back to a default).

The control plane's shared secret comes from `secret_file` (read when the
connector loads; the flag and vLLM's start-up log hold only the path) or,
for tests, inline as `secret`, which `--kv-transfer-config` shows in `ps` and
vLLM logs among its non-default arguments: the scheduler role warns once
(`warn_if_inline_secret`).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import msgspec

from rapidkv.control.address import WILDCARD_HOSTS
from rapidkv.control.framing import read_secret_file
from rapidkv.kvt.faults import SendFaults

log = logging.getLogger(__name__)

TransferKVMode = Literal["step", "bypass", "substep"]


class ConnectorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # control plane: where this instance's RPC server listens (P side), and the
    # host peers and routers are told to reach it at (default: control_host;
    # required when control_host is a wildcard such as 0.0.0.0)
    control_host: str = "127.0.0.1"
    control_advertise_host: str | None = None
    control_port: int = 0  # 0: pick a free port (logged); give one for the router
    # the shared secret authenticating control messages: a file holding it
    # (surrounding whitespace dropped), or inline (tests only: visible in `ps`
    # and vLLM's start-up log); at most one of the two
    secret_file: str | None = None
    secret: str | None = None
    # data plane
    transport: Literal["nixl", "tcp"] = "nixl"
    # the data plane's address (None: loopback for tcp, UCX's own choice for
    # nixl). tcp binds it and advertises kvt_advertise_host (default: kvt_host;
    # required with a wildcard); nixl runs UCX over TCP on the interface holding
    # it (`transport_options`)
    kvt_host: str | None = None
    kvt_advertise_host: str | None = None
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
    # agrees (kvt.faults); 0 in production. `debug_fail_ranks`: only these TP
    # ranks fail them (the others write their heads whole); empty: every rank
    debug_fail_transfer_rate: float = 0.0
    debug_send_delay_s: float = 0.0
    debug_fail_ranks: tuple[int, ...] = ()
    # testing aid: the debug faults (`debug_layer_delay_s`,
    # `debug_fail_transfer_rate`, `debug_send_delay_s`) touch only transfers
    # whose xfer_id starts with this (empty: every transfer), so that one
    # instance serves faulty and healthy transfers side by side
    debug_fault_prefix: str = ""
    # fleet membership (rapidkv.membership): with etcd endpoints (base URLs),
    # this instance keeps its record (advertise_url, control address, roles,
    # block size, identity) under `<etcd_prefix>instances/<instance id>` with a
    # lease of etcd_ttl_s while it runs, from when advertise_url/health answers
    etcd_endpoints: tuple[str, ...] = ()
    etcd_prefix: str = "/rapidkv/"
    etcd_ttl_s: float = 5.0
    advertise_url: str | None = None  # this instance's HTTP base URL, as routers reach it

    def __post_init__(self) -> None:
        for problem in self.address_problems():
            raise ValueError(problem)
        if self.secret is not None and self.secret_file is not None:
            raise ValueError("give secret_file or secret, not both")
        if self.secret == "":
            raise ValueError("secret is empty: an empty secret authenticates nothing")
        if self.secret_file is not None:
            try:  # refused now, with the key's name, rather than at the first peer
                read_secret_file(self.secret_file)
            except ValueError as e:
                raise ValueError(f"secret_file: {e}") from None
        if not 0.0 <= self.debug_fail_transfer_rate <= 1.0:
            raise ValueError("debug_fail_transfer_rate must be between 0 and 1")
        if self.debug_send_delay_s < 0:
            raise ValueError("debug_send_delay_s must be >= 0")
        if any(r < 0 for r in self.debug_fail_ranks):
            raise ValueError("debug_fail_ranks are TP ranks: >= 0")
        if not self.peer_idle_ttl_s > 0:
            raise ValueError("peer_idle_ttl_s must be > 0")
        if self.etcd_endpoints and not self.advertise_url:
            raise ValueError(
                "etcd_endpoints needs advertise_url: the HTTP base URL routers reach "
                "this instance at (e.g. http://10.0.0.5:8000)"
            )
        if self.advertise_url is not None and not self.advertise_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError(f"advertise_url is http(s)://host:port, not {self.advertise_url!r}")
        if self.etcd_ttl_s < 2:
            raise ValueError("etcd_ttl_s must be >= 2 (etcd's shortest lease)")
        if not self.etcd_prefix.startswith("/") or not self.etcd_prefix.endswith("/"):
            raise ValueError(f"etcd_prefix starts and ends with '/', not {self.etcd_prefix!r}")

    def address_problems(self) -> list[str]:
        """What is wrong with the bind and advertised addresses (empty: nothing)."""
        out = []
        if not self.control_host:
            out.append("control_host must name a host (0.0.0.0 for every interface)")
        elif self.control_host in WILDCARD_HOSTS and not self.control_advertise_host:
            out.append(
                f"control_host {self.control_host!r} binds every interface: give "
                "control_advertise_host, the address peers and routers reach this instance at"
            )
        if self.control_advertise_host is not None and (
            self.control_advertise_host in WILDCARD_HOSTS
        ):
            out.append(f"control_advertise_host {self.control_advertise_host!r} names no host")
        if self.kvt_advertise_host is not None and self.kvt_host is None:
            out.append("kvt_advertise_host needs kvt_host (the address to bind)")
        if self.kvt_advertise_host is not None and self.kvt_advertise_host in WILDCARD_HOSTS:
            out.append(f"kvt_advertise_host {self.kvt_advertise_host!r} names no host")
        if self.kvt_host is None:
            return out
        if self.transport == "nixl":
            if self.kvt_host in WILDCARD_HOSTS:
                out.append(
                    f"kvt_host {self.kvt_host!r} with transport nixl: give the address of "
                    "one interface (UCX runs over TCP on the interface holding it)"
                )
            if self.kvt_advertise_host not in (None, self.kvt_host):
                out.append(
                    "kvt_advertise_host with transport nixl: UCX advertises the interface's "
                    "own address; only transport tcp can advertise another"
                )
        elif self.kvt_host in WILDCARD_HOSTS and not self.kvt_advertise_host:
            out.append(
                f"kvt_host {self.kvt_host!r} binds every interface: give kvt_advertise_host, "
                "the address peers write to"
            )
        return out

    def shared_secret(self) -> bytes | None:
        """The control plane's shared secret (None: no authentication): the
        content of `secret_file`, read now, or the inline `secret`."""
        if self.secret_file is not None:
            return read_secret_file(self.secret_file)
        return self.secret.encode() if self.secret is not None else None

    @property
    def control_advertised_host(self) -> str:
        """The host of the control address this instance gives peers and routers."""
        return self.control_advertise_host or self.control_host

    def send_faults(self, rank: int) -> SendFaults:
        """The injected send faults of TP rank `rank`'s worker (`kvt.faults`):
        the failure rate only on the ranks `debug_fail_ranks` names (all when
        it is empty), the send delay on every rank, both only for the
        transfers `debug_fault_prefix` picks."""
        failing = not self.debug_fail_ranks or rank in self.debug_fail_ranks
        rate = self.debug_fail_transfer_rate if failing else 0.0
        return SendFaults(rate, self.debug_send_delay_s, self.debug_fault_prefix)

    def faulted(self, xfer_id: str) -> bool:
        """The debug faults touch transfer `xfer_id` (`debug_fault_prefix`)."""
        return xfer_id.startswith(self.debug_fault_prefix)

    def transport_options(self) -> dict[str, Any]:
        """Options of `create_transport` for this instance's data plane: tcp's
        bind and advertised hosts, nixl's interface address (None: defaults)."""
        if self.kvt_host is None:
            return {}
        if self.transport == "tcp":
            return {"host": self.kvt_host, "advertise_host": self.kvt_advertise_host}
        return {"host": self.kvt_host}

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        try:
            return msgspec.convert(extra or {}, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"rapidkv: bad kv_connector_extra_config: {e}") from None


_warned_inline_secret = False


def warn_if_inline_secret(config: ConnectorConfig) -> bool:
    """Log, once per process, that an inline `secret` is visible in `ps` and in
    vLLM's start-up log, naming `secret_file` as the way out; whether it logged."""
    global _warned_inline_secret
    if config.secret is None or _warned_inline_secret:
        return False
    _warned_inline_secret = True
    log.warning(
        "rapidkv: the shared secret is inline in kv_connector_extra_config (`secret`): "
        "it shows in `ps` and in vLLM's start-up log; put it in a file readable only "
        "by this service and give the path as `secret_file`"
    )
    return True


def kv_roles(kv_role: str | None) -> tuple[str, ...]:
    """The roles an instance with vLLM's `kv_role` may play for a router."""
    return {"kv_producer": ("prefill",), "kv_consumer": ("decode",)}.get(
        kv_role or "", ("prefill", "decode")
    )


def kv_transfer_config(control_port: int, **extra: Any) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for an instance running RapidKVConnector
    (P, D or both) whose control plane listens on `control_port`; `extra` goes
    into `kv_connector_extra_config` (validated here, as the connector will).
    It names `kv_connector_module_path`, for vLLM run with a checkout's `src`
    on its path (the harness); an installed rapidkv needs only the name."""
    ConnectorConfig.from_extra({"control_port": control_port, **extra})
    return {
        "kv_connector": "RapidKVConnector",
        "kv_connector_module_path": "rapidkv.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"control_port": control_port, **extra},
    }
