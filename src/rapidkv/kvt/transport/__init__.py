"""Transports move bytes between registered memory of two workers.

`create_transport(kind, name, **options)` builds one by its kind name; the
implementations are imported lazily (NIXL is heavy and optional for `tcp`).
"""

from __future__ import annotations

import importlib
from typing import Any

from rapidkv.kvt.transport.base import Transport, TransportError, XferState

KINDS: dict[str, str] = {
    "nixl": "rapidkv.kvt.transport.nixl:NixlTransport",
    "tcp": "rapidkv.kvt.transport.tcp:TcpTransport",
}


def create_transport(kind: str, name: str, **options: Any) -> Transport:
    """Build the transport `kind` ("nixl" or "tcp") for the worker called `name`."""
    try:
        module, cls = KINDS[kind].split(":")
    except KeyError:
        raise ValueError(f"unknown transport {kind!r}; choose one of {sorted(KINDS)}") from None
    return getattr(importlib.import_module(module), cls)(name, **options)


__all__ = ["KINDS", "Transport", "TransportError", "XferState", "create_transport"]
