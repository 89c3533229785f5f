"""Non-blocking socket helpers for the TCP transport's asyncio loop thread.

All of these run on the loop that owns the socket. They move bytes between the
socket and caller-provided buffers (`recv_into`, `sendmsg` of a buffer list):
they never copy a payload into a buffer of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from typing import TypeVar

import msgspec

from rapidkv.kvt.transport.tcp_wire import (
    HEADER_SIZE,
    MAX_HANDSHAKE_BODY,
    Kind,
    ProtocolError,
    decode_body,
    unpack_header,
)

IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024

Buffer = bytes | bytearray | memoryview
_S = TypeVar("_S", bound=msgspec.Struct)


class PeerClosed(ConnectionError):
    """The peer closed its end (EOF) while more bytes were expected."""


def tune(sock: socket.socket) -> None:
    """Non-blocking, no Nagle (acks and notifications are small and latency-bound),
    keepalive so a vanished host errors out instead of hanging forever."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def hard_close(sock: socket.socket | None) -> None:
    """Close at once, discarding unsent data (RST), so nothing more goes out."""
    if sock is None or sock.fileno() < 0:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, buf: memoryview) -> None:
    """Fill `buf` completely, reading straight into it. PeerClosed on EOF."""
    while buf:
        n = await loop.sock_recv_into(sock, buf)
        if n == 0:
            raise PeerClosed("connection closed by peer")
        buf = buf[n:]


async def wait_writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut = loop.create_future()
    fd = sock.fileno()
    loop.add_writer(fd, _set_done, fut)
    try:
        await fut
    finally:
        loop.remove_writer(fd)


async def wait_readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, _set_done, fut)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def sendmsg_all(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, bufs: list[Buffer]
) -> None:
    """Send every buffer, in order, with as few `sendmsg` calls as the kernel
    allows. `bufs` must hold no empty buffer; it is consumed (modified)."""
    i, n = 0, len(bufs)
    while i < n:
        try:
            sent = sock.sendmsg(bufs[i : i + IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await wait_writable(loop, sock)
            continue
        while sent:
            size = len(bufs[i])
            if sent >= size:
                sent -= size
                i += 1
            else:
                bufs[i] = memoryview(bufs[i])[sent:]
                sent = 0


async def read_body(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, kind: Kind, typ: type[_S]
) -> _S:
    """Read one handshake frame of `kind` (bounded size) and decode it."""
    header = bytearray(HEADER_SIZE)
    await recv_exact(loop, sock, memoryview(header))
    got, count, _ = unpack_header(header)
    if got is not kind:
        raise ProtocolError(f"expected {kind.name}, got {got.name}")
    if count > MAX_HANDSHAKE_BODY:
        raise ProtocolError(f"{kind.name} body of {count} bytes (limit {MAX_HANDSHAKE_BODY})")
    body = bytearray(count)
    await recv_exact(loop, sock, memoryview(body))
    return decode_body(bytes(body), typ)
