"""Control addresses: ``"host:port"`` strings (``"[::1]:port"`` for IPv6).

This is the form routers put in `kv_transfer_params` and handshakes carry.
"""

from __future__ import annotations

MAX_ADDRESS = 300
# hosts that name no host: a server bound there is reached at some other name
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"``; ValueError naming the address if it is not one."""
    if not 0 < len(address) <= MAX_ADDRESS:
        raise ValueError(f"invalid control address {address[:MAX_ADDRESS]!r}")
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 host must be bracketed
    port_ok = port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536
    if not sep or not host or not port_ok:
        raise ValueError(f"invalid control address {address!r} (expected host:port)")
    return host, int(port_text)
