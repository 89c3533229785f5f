"""Free loopback TCP ports.

Invariant: every port handed out here was bindable on 127.0.0.1 at the moment it
was returned, and no port is handed out twice by one Python process (so two
servers started back to back never race for the same number). Another process
can still take the port before the server binds it: callers that start a server
retry with a new port when the server reports the address in use.
"""

from __future__ import annotations

import socket
import threading

_lock = threading.Lock()
_handed_out: set[int] = set()

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that is free on `host` now and was not returned before."""
    with _lock:
        for _ in range(64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no fresh free port on {host} after 64 tries")


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """True if `port` can be bound on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
