"""One way to open a listening TCP socket, shared by the control plane and the
kvt TCP transport: bound to exactly the given host (a name, an IPv4 or IPv6
literal; empty means every interface) and port (0 picks one), non-blocking,
ready to hand to an asyncio loop. Raises `OSError` on failure, leaking nothing."""

from __future__ import annotations

import socket


def listen_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
