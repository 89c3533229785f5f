"""A pool of server groups shared by the tests of one session.

A *group* is a list of `ServerSpec`s started together (a single server, or a
prefill/decode pair) under a key. `get(key, specs)` returns the running group,
starting it on first use; at most `max_running` servers run at once, the least
recently used groups being stopped to make room (2 cores: one or two servers),
but for the groups a caller asks to `keep` beside the new one.

Invariants: a key always maps to the same specs (asking again with different
specs is an error, so two tests cannot silently share a differently configured
server); `close` stops every server the pool started, and the watchdog covers
the rest if the process dies first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from rapidkv.harness.server import ServerSpec, VLLMServer, start_servers


class ServerPool:
    """Lazily started, shared server groups with a cap on how many run at once."""

    def __init__(self, log_dir: Path, max_running: int = 2) -> None:
        self.log_dir = Path(log_dir)
        self.max_running = max_running
        self._specs: dict[str, tuple[ServerSpec, ...]] = {}
        self._running: OrderedDict[str, list[VLLMServer]] = OrderedDict()
        self._lock = threading.RLock()
        self.startups: list[tuple[str, float]] = []  # (server name, seconds), every start

    def get(
        self, key: str, specs: Sequence[ServerSpec], *, keep: Sequence[str] = ()
    ) -> list[VLLMServer]:
        """The running group `key` (started from `specs` if it is not running).
        The groups named in `keep` are not stopped to make room for it, even if
        that runs more than `max_running` servers (one more server beside a
        running pair costs less than starting three)."""
        specs = tuple(spec.replace(name=f"{key}.{spec.name}") for spec in specs)
        with self._lock:
            known = self._specs.setdefault(key, specs)
            if known != specs:
                raise ValueError(f"pool key {key!r} already used with other specs")
            group = self._running.get(key)
            if group is not None and all(s.running for s in group):
                self._running.move_to_end(key)
                return group
            if group is not None:  # something died: restart the whole group
                self.stop(key)
            self._make_room(len(specs), keep)
            group = start_servers(specs, self.log_dir)
            self._record(group)
            self._running[key] = group
            return group

    def running(self, key: str) -> list[VLLMServer] | None:
        """The group `key` if every server of it runs; None otherwise (nothing
        is started)."""
        with self._lock:
            group = self._running.get(key)
            return group if group is not None and all(s.running for s in group) else None

    def get_one(self, key: str, spec: ServerSpec) -> VLLMServer:
        """`get` for a group of one server."""
        return self.get(key, [spec])[0]

    def restart(self, key: str) -> list[VLLMServer]:
        """Stop group `key` and start it again from the same specs."""
        with self._lock:
            if key not in self._specs:
                raise KeyError(key)
            self.stop(key)
            self._make_room(len(self._specs[key]))
            group = start_servers(self._specs[key], self.log_dir)
            self._record(group)
            self._running[key] = group
            return group

    def stop(self, key: str) -> None:
        """Stop group `key` if it runs."""
        with self._lock:
            group = self._running.pop(key, None)
            for server in group or ():
                server.stop()

    def close(self) -> None:
        """Stop every group; raises the first stop error after trying them all."""
        with self._lock:
            errors: list[Exception] = []
            for key in list(self._running):
                try:
                    self.stop(key)
                except Exception as e:
                    errors.append(e)
            if errors:
                raise errors[0]

    def running_count(self) -> int:
        with self._lock:
            return sum(len(g) for g in self._running.values())

    def _make_room(self, n: int, keep: Sequence[str] = ()) -> None:
        while self.running_count() + n > self.max_running:
            oldest = next((k for k in self._running if k not in keep), None)
            if oldest is None:
                return
            self.stop(oldest)

    def _record(self, group: list[VLLMServer]) -> None:
        for server in group:
            if server.startup_s is not None:
                self.startups.append((server.spec.name, server.startup_s))
