"""Inbound side of the TCP transport: the listening socket and its connections.

Theory of operation
-------------------
`Server.serve()` accepts connections on the transport's loop thread. Each
connection first runs the handshake (bounded in time and size; see `tcp_wire`),
then feeds an `Inbound` state machine: payload bytes are read (`recvmsg_into`,
a scatter read) straight into registered memory, landed WRITEs are acknowledged
after each read, notifications are
handed to `on_notif` with the sender's name.

Rules
-----
- Nothing a peer sends is acted on, and nothing is sent to it but the CHALLENGE,
  until its HELLO verified (with a secret: the HMAC) and named this instance.
- On any protocol error (bad frame, size over a limit, destination outside
  registered memory, failed authentication) the connection is dropped at once and
  a warning names the peer's address and claimed name; nothing more is read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from rapidkv.kvt.transport.tcp_inbound import Inbound, Landed
from rapidkv.kvt.transport.tcp_io import PeerClosed, hard_close, read_body, tune, wait_readable
from rapidkv.kvt.transport.tcp_memory import RegionTable
from rapidkv.kvt.transport.tcp_wire import (
    MAX_NAME,
    NONCE_BYTES,
    Challenge,
    Hello,
    Kind,
    ProtocolError,
    Welcome,
    encode_body,
    hello_mac,
    mac_ok,
    pack_header,
    welcome_mac,
)

log = logging.getLogger("rapidkv.kvt.transport.tcp")


@dataclass(frozen=True)
class ServerConfig:
    name: str
    instance: bytes
    secret: bytes | None
    handshake_timeout: float
    max_rows: int
    max_notif: int


class Server:
    """Accepts and serves inbound connections; every method runs on the loop thread."""

    def __init__(
        self,
        lsock: socket.socket,
        config: ServerConfig,
        regions: Callable[[], RegionTable],
        on_notif: Callable[[str, bytes], None],
    ) -> None:
        self._lsock = lsock
        self._config = config
        self._regions = regions
        self._on_notif = on_notif
        self._conns: set[asyncio.Task[None]] = set()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    conn, addr = self._lsock.accept()
                except (BlockingIOError, InterruptedError):
                    await wait_readable(loop, self._lsock)
                    continue
                except OSError as e:  # e.g. out of file descriptors: back off, go on
                    log.warning("tcp %s: accept failed: %r", self._config.name, e)
                    await asyncio.sleep(0.1)
                    continue
                tune(conn)
                task = loop.create_task(self._connection(conn, _addr(addr)))
                self._conns.add(task)
                task.add_done_callback(self._conns.discard)
        finally:
            for task in list(self._conns):
                task.cancel()
            loop.call_soon(self._lsock.close)

    async def _connection(self, sock: socket.socket, peer: str) -> None:
        cfg, name = self._config, None
        loop = asyncio.get_running_loop()
        try:
            name = await asyncio.wait_for(self._handshake(sock), cfg.handshake_timeout)
            log.debug("tcp %s: %s connected from %s", cfg.name, name, peer)
            await self._receive(sock, name)
        except ProtocolError as e:
            log.warning(
                "tcp %s: refusing %s from %s: %s", cfg.name, name or "unauthenticated peer", peer, e
            )
        except TimeoutError:
            log.warning("tcp %s: handshake with %s timed out", cfg.name, peer)
        except PeerClosed:
            log.debug("tcp %s: %s (%s) disconnected", cfg.name, name, peer)
        except OSError as e:
            log.info("tcp %s: connection from %s (%s) lost: %r", cfg.name, peer, name, e)
        except Exception:  # a bug must drop this connection, not the server
            log.exception("tcp %s: unexpected error serving %s (%s)", cfg.name, peer, name)
        finally:
            loop.call_soon(hard_close, sock)  # after the cancelled read unregistered the fd

    async def _receive(self, sock: socket.socket, name: str) -> None:
        """Read frames until the connection ends; ack landed writes after each read."""
        cfg, loop = self._config, asyncio.get_running_loop()
        inbound = Inbound(self._regions, max_rows=cfg.max_rows, max_notif=cfg.max_notif)
        while True:
            try:
                n = sock.recvmsg_into(inbound.want())[0]
            except (BlockingIOError, InterruptedError):
                await wait_readable(loop, sock)
                continue
            if n == 0:
                raise PeerClosed("connection closed by peer")
            acks = []
            for event in inbound.received(n):
                if isinstance(event, Landed):
                    acks.append(pack_header(Kind.ACK, 0, event.req_id))
                else:
                    self._on_notif(name, event.payload)
            if acks:
                await loop.sock_sendall(sock, b"".join(acks))

    async def _handshake(self, sock: socket.socket) -> str:
        """Run the receiver's half of the handshake; return the verified peer name."""
        cfg, loop = self._config, asyncio.get_running_loop()
        nonce = os.urandom(NONCE_BYTES)
        challenge = Challenge(nonce=nonce, auth=cfg.secret is not None)
        await loop.sock_sendall(sock, encode_body(Kind.CHALLENGE, challenge))
        hello = await read_body(loop, sock, Kind.HELLO, Hello)
        if len(hello.nonce) != NONCE_BYTES or not 0 < len(hello.name) <= MAX_NAME:
            raise ProtocolError("malformed HELLO")
        if cfg.secret is not None and not mac_ok(
            hello_mac(cfg.secret, nonce, hello.nonce, hello.name, hello.instance), hello.mac
        ):
            raise ProtocolError(f"authentication failed (claimed name {hello.name!r})")
        if hello.instance != cfg.instance:
            raise ProtocolError(f"{hello.name!r} used stale metadata (another instance)")
        mac = b""
        if cfg.secret is not None:
            mac = welcome_mac(cfg.secret, nonce, hello.nonce, cfg.name, cfg.instance)
        welcome = Welcome(name=cfg.name, instance=cfg.instance, mac=mac)
        await loop.sock_sendall(sock, encode_body(Kind.WELCOME, welcome))
        return hello.name


def _addr(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)
