"""A small client of etcd's v3 API over its JSON gateway: leases, puts, prefix
reads and a prefix watch, on httpx.

Every etcd from 3.4 on serves the gateway (``POST /v3/...``, the gRPC messages
as JSON) on its client URLs, so no gRPC stack is needed for what membership
uses. Keys and values are bytes to etcd (base64 in the JSON); here they are
UTF-8 strings. A call goes to the endpoints in turn until one answers;
`EtcdError` says why none did, or what etcd refused.

Invariants: a client never retries a request etcd answered (an answered error
is final); a watch yields the events of one revision in order and never one
at or below the revision it started after.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx


class EtcdError(Exception):
    """No endpoint answered, or etcd refused the request."""


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix: `put` (with its value) or `delete`."""

    kind: str
    key: str
    value: str | None
    revision: int


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text(b64: str | None) -> str:
    return base64.b64decode(b64 or "").decode()


def prefix_end(prefix: str) -> str:
    """The range end that makes `[prefix, end)` every key starting with `prefix`
    (its last byte plus one, as etcd's clients compute it)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return "\0"  # every key
    raw[-1] += 1
    return raw.decode(errors="surrogateescape")


class EtcdClient:
    """etcd's v3 JSON gateway at `endpoints` (base URLs, e.g.
    ``http://127.0.0.1:2379``), each call within `timeout_s`."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 5.0) -> None:
        if not endpoints:
            raise ValueError("etcd: at least one endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout_s = timeout_s
        self._http = httpx.Client(timeout=timeout_s, trust_env=False)
        self._watching: httpx.Response | None = None  # the watch stream being read

    def close(self) -> None:
        self._http.close()

    def interrupt_watch(self) -> None:
        """End a watch waiting for its next event, from another thread: its
        socket is shut down, which wakes the blocked read (the watch then ends
        as `stop` says)."""
        resp = self._watching
        stream = resp.extensions.get("network_stream") if resp is not None else None
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        errors = []
        for endpoint in self.endpoints:
            try:
                resp = self._http.post(endpoint + path, json=body)
            except httpx.HTTPError as e:
                errors.append(f"{endpoint}: {type(e).__name__}: {e}")
                continue
            try:
                data = resp.json()
            except ValueError:
                data = {}
            if resp.status_code != 200 or "error" in data:
                message = data.get("message") or data.get("error") or resp.text[:300]
                raise EtcdError(f"etcd {endpoint}{path}: HTTP {resp.status_code}: {message}")
            return data
        raise EtcdError("no etcd endpoint answered: " + "; ".join(errors))

    def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; its id."""
        return int(self._post("/v3/lease/grant", {"TTL": int(ttl_s)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh `lease`; the seconds it has now (0: it expired or was revoked)."""
        data = self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(data.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """Revoke `lease` (its keys go at once); one that is gone already is fine."""
        try:
            self._post("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as e:
            if "not found" not in str(e):
                raise

    def put(self, key: str, value: str, lease: int | None = None) -> int:
        """Set `key` (under `lease`, if given); the revision it made."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = str(lease)
        return int(self._post("/v3/kv/put", body)["header"]["revision"])

    def delete(self, key: str) -> None:
        self._post("/v3/kv/deleterange", {"key": _b64(key)})

    def get_prefix(self, prefix: str) -> tuple[int, dict[str, str]]:
        """Every key under `prefix` and its value, and the revision they are at."""
        data = self._post(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        )
        kvs = {_text(kv["key"]): _text(kv.get("value")) for kv in data.get("kvs", ())}
        return int(data["header"]["revision"]), kvs

    def watch_prefix(
        self, prefix: str, after_revision: int, stop: threading.Event
    ) -> Iterator[WatchEvent]:
        """The changes under `prefix` after `after_revision`, as they happen,
        until `stop` is set (then `interrupt_watch()` ends a wait at once)
        or the stream breaks (`EtcdError`: read the prefix again and watch from
        there)."""
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(after_revision + 1),
            }
        }
        timeout = httpx.Timeout(self.timeout_s, read=None)  # a quiet prefix sends nothing
        errors = []
        for endpoint in self.endpoints:
            started = False
            try:
                with self._http.stream(
                    "POST", endpoint + "/v3/watch", json=body, timeout=timeout
                ) as resp:
                    if resp.status_code != 200:
                        raise EtcdError(f"etcd {endpoint}/v3/watch: HTTP {resp.status_code}")
                    started = True
                    self._watching = resp
                    try:
                        yield from self._events(resp, stop)
                    finally:
                        self._watching = None
                    if not stop.is_set():
                        raise EtcdError(f"etcd {endpoint} ended the watch")
                    return
            except (httpx.HTTPError, RuntimeError) as e:  # RuntimeError: the client was closed
                if stop.is_set():
                    return
                if started:
                    raise EtcdError(f"etcd {endpoint}: the watch broke: {e!r}") from None
                errors.append(f"{endpoint}: {type(e).__name__}: {e}")
        raise EtcdError("no etcd endpoint answered the watch: " + "; ".join(errors))

    def _events(self, resp: httpx.Response, stop: threading.Event) -> Iterator[WatchEvent]:
        for line in resp.iter_lines():
            if stop.is_set():
                return
            if not line.strip():
                continue
            result = json.loads(line).get("result", {})
            if result.get("canceled"):
                raise EtcdError(f"etcd cancelled the watch: {result.get('cancel_reason')}")
            for event in result.get("events", ()):
                kv = event["kv"]
                kind = "delete" if event.get("type") == "DELETE" else "put"
                yield WatchEvent(
                    kind,
                    _text(kv["key"]),
                    None if kind == "delete" else _text(kv.get("value")),
                    int(kv["mod_revision"]),
                )
