"""The router's control-plane client, made on first use (`LazyRpc`).

A router that never sends a control message never starts an `RpcClient` (and
its thread). Safe from any thread; after `close()` no client is made again and
`get()` answers None.
"""

from __future__ import annotations

import threading

from rapidkv.control.client import RpcClient


class LazyRpc:
    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret
        self._client: RpcClient | None = None
        self._closed = False
        self._lock = threading.Lock()

    def get(self) -> RpcClient | None:
        """The client (made now if need be); None once closed."""
        with self._lock:
            if self._closed:
                return None
            if self._client is None:
                self._client = RpcClient(self._secret)
            return self._client

    def close(self) -> None:
        """Stop the client, if one was made. Blocks up to a few seconds."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
