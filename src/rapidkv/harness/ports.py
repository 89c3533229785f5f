"""Free loopback TCP ports.

Invariant: every port handed out here was bindable on 127.0.0.1 at the moment it
was returned, lies outside the kernel's ephemeral range
(`net.ipv4.ip_local_port_range`), and is handed out at most once by one Python
process (so two servers started back to back never race for the same number).
Outside the ephemeral range no outgoing connection can take the port between
the moment it is chosen and the moment a server binds it. That matters under
a benchmark's load, when thousands of connections draw source ports from that
range, and most for a control port: it is fixed in a server's
`--kv-transfer-config`, so every relaunch uses the same one. Another process
can still take the port: callers that start a server retry with a new port when
the server reports the address in use.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_lock = threading.Lock()
_handed_out: set[int] = set()
_rng = random.Random()  # seeded from the OS: processes choose differently

LOOPBACK = "127.0.0.1"


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: ports of well-known services


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (inclusive)."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return lo, hi


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that is free on `host` now, outside the ephemeral range,
    and was not returned before."""
    lo, hi = ephemeral_range()
    choices = [(LOWEST, lo - 1), (hi + 1, 65535)]
    choices = [(a, b) for a, b in choices if a <= b]
    if not choices:
        raise RuntimeError(f"the ephemeral range {lo}-{hi} leaves no port from {LOWEST} up")
    weights = [b - a + 1 for a, b in choices]
    with _lock:
        for _ in range(256):
            a, b = _rng.choices(choices, weights)[0]
            port = _rng.randint(a, b)
            if port not in _handed_out and port_is_free(port, host):
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no fresh free port on {host} outside {lo}-{hi} after 256 tries")


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """True if `port` can be bound on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
