"""`rapidkv bench chaos`: killing P and D during the run, and how long they take to recover.

Schedule (`FaultSchedule.before`, awaited before each request is sent):

- P is killed (SIGKILL to its whole tree: `VLLMServer.stop(grace=0)`) when
  request `p_at` (~1/3 of the run) is about to be sent, and started again on
  its address at once (same HTTP port, same control port); meanwhile the
  router serves on D alone;
- requests from `d_at` (~2/3) on wait until P is healthy again and the router
  dispatches to it (at most `GATE_S` after it was healthy), so that P's
  recovery is measured by requests, not by a workload that ran out; D is
  killed the same way at the first of them sent after P has recovered (below)
  or its recovery timed out;
- the last `tail` requests wait for D's restart in the same way (and, should P
  not have recovered yet, for P's recovery first), so that the run ends with
  requests that can show D's recovery. Requests sent while D is down get 503
  (the client backs off: `driver`).

Each restart (a thread of its own) records the instance's Stats just before
the kill (its counters die with it), the launch, when it answered `/health`
again (its own start-up) and its Stats then: its baseline free blocks (leaks
are counted against it) and counters. A monitor then polls P's Stats every
`POLL_S`: the instance has *recovered* at the first poll where P's
`transfers_ok` exceeds its value when the instance became healthy, that is
when a request after the restart was served with a real transfer: every write
confirmed, D's TransferKV answered OK (D loaded that KV instead of
recomputing it). For a restarted P the counter is the new process's; for a
restarted D, P's (the old D is dead: any transfer P confirms is to the new
one). `recovery_s` = healthy -> recovered; it includes the router's
`probe_interval_s` (1 s: the router dispatches to an instance it saw die only
after a `/health` probe succeeds).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

POLL_S = 0.05
GATE_S = 10.0  # requests held for the router to dispatch to a restarted instance, at most


@dataclass
class Incarnation:
    """One process of an instance: its baseline, its counters when it ended."""

    started_s: float  # healthy, after the run began
    baseline_free_blocks: float | None
    baseline: dict[str, float] = field(default_factory=dict)
    final: dict[str, float] = field(default_factory=dict)  # Stats just before it ended


@dataclass
class Restart:
    role: str  # "prefill" | "decode"
    at_request: int
    killed_s: float | None = None  # after the run began
    healthy_s: float | None = None
    startup_s: float | None = None  # launch -> /health 200
    recovered_s: float | None = None
    recovery_s: float | None = None  # healthy -> first request served with a real transfer
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    healthy: threading.Event = field(default_factory=threading.Event, repr=False)
    # the router dispatches to it again (seen once: later requests need not ask)
    dispatched: threading.Event = field(default_factory=threading.Event, repr=False)
    healthy_at: float = field(default=0.0, repr=False)  # monotonic

    def row(self) -> dict[str, Any]:
        return {
            k: v
            for k, v in self.__dict__.items()
            if not isinstance(v, threading.Event) and v is not None and k != "healthy_at"
        }


class Instances:
    """The pair: each role's server and control address, and its processes' history."""

    def __init__(self, servers: dict[str, Any], controls: dict[str, str], t_run: float) -> None:
        from rapidkv.control.client import RpcClient

        self.servers = servers  # role -> VLLMServer
        self.controls = controls  # role -> host:port
        self.t_run = t_run
        self.rpc = RpcClient()
        self.incarnations: dict[str, list[Incarnation]] = {role: [] for role in servers}

    def stats(self, role: str, timeout: float = 5.0) -> dict[str, float]:
        from rapidkv.control.messages import StatsRequest

        return dict(self.rpc.call(self.controls[role], StatsRequest(), timeout).counters)

    def engine(self, role: str) -> dict[str, float]:
        """vLLM's running and waiting requests (its /metrics)."""
        from rapidkv.harness import get_metrics, metric_sum

        m = get_metrics(self.servers[role].base_url)
        return {
            "running": metric_sum(m, "vllm:num_requests_running"),
            "waiting": metric_sum(m, "vllm:num_requests_waiting"),
        }

    def begin(self, role: str) -> Incarnation:
        """The role's process just became healthy: note its baseline."""
        s = self.stats(role)
        inc = Incarnation(time.monotonic() - self.t_run, s.get("free_blocks"), s)
        self.incarnations[role].append(inc)
        return inc

    def close(self) -> None:
        self.rpc.close()


class FaultSchedule:
    def __init__(
        self,
        pair: Instances,
        n: int,
        roles: tuple[str, ...],
        *,
        tail: int,
        router_url: str,
        recovery_timeout_s: float = 60.0,
        say: Any = print,
    ) -> None:
        self.pair = pair
        self.router_url = router_url
        self.say = say
        self.recovery_timeout_s = recovery_timeout_s
        self.restarts: dict[str, Restart] = {}
        at = {"prefill": n // 3, "decode": (2 * n) // 3}
        self.at = {role: at[role] for role in roles}
        self.tail_from = max(n - tail, self.at.get("decode", n))
        self._threads: list[threading.Thread] = []

    async def before(self, i: int) -> None:
        p_at, d_at = self.at.get("prefill"), self.at.get("decode")
        if p_at is not None and i >= p_at and "prefill" not in self.restarts:
            self._start("prefill", i)
        p = self.restarts.get("prefill")
        if d_at is not None and i >= d_at:
            if p is not None:  # D is not killed while P is down
                await self._back("prefill")
            if "decode" not in self.restarts and (p is None or p.done.is_set()):
                self._start("decode", i)
        if d_at is not None and i >= self.tail_from:
            if "decode" not in self.restarts:
                if p is not None:
                    await _wait(p.done)
                if "decode" not in self.restarts:
                    self._start("decode", i)
            await self._back("decode")

    async def _back(self, role: str) -> None:
        """Until `role` is healthy again after its restart and the router
        dispatches to it (or `GATE_S` passed since it was healthy)."""
        r = self.restarts[role]
        await _wait(r.healthy)
        if r.error is not None or r.dispatched.is_set():
            return
        deadline = r.healthy_at + GATE_S
        while time.monotonic() < deadline:
            if await asyncio.to_thread(self._dispatching, role):
                r.dispatched.set()
                return
            await asyncio.sleep(0.1)

    def _dispatching(self, role: str) -> bool:
        import httpx

        try:
            health = httpx.get(f"{self.router_url}/health", timeout=5).json()
            return all(i["dispatching"] for i in health[role])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False

    def _start(self, role: str, i: int) -> None:
        r = self.restarts[role] = Restart(role, i)
        t = threading.Thread(target=self._restart, args=(r,), name=f"chaos-{role}", daemon=True)
        self._threads.append(t)
        t.start()

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)

    def _restart(self, r: Restart) -> None:
        pair, role = self.pair, r.role
        server = pair.servers[role]
        try:
            try:
                pair.incarnations[role][-1].final = pair.stats(role, 2.0)
            except Exception as e:  # counters of the killed process are then missing
                self.say(f"chaos: {role}: no Stats before the kill: {e}")
            r.killed_s = time.monotonic() - pair.t_run
            self.say(f"chaos: killing {role} (request {r.at_request}); starting it again")
            server.restart(grace=0)
            r.startup_s = server.startup_s
            healthy = r.healthy_at = time.monotonic()
            r.healthy_s = healthy - pair.t_run
            pair.begin(role)
            p_ok0 = pair.stats("prefill").get("transfers_ok", 0.0)
        except Exception as e:
            r.error = f"{type(e).__name__}: {e}"[:3000]
            self.say(f"chaos: {role} restart failed: {r.error}")
            r.healthy.set()
            r.done.set()
            return
        r.healthy.set()
        self.say(f"chaos: {role} healthy again after {r.startup_s:.1f}s")
        try:
            deadline = healthy + self.recovery_timeout_s
            while time.monotonic() < deadline:
                try:
                    ok = pair.stats("prefill", 2.0).get("transfers_ok", 0.0)
                except Exception:
                    ok = p_ok0
                if ok > p_ok0:
                    now = time.monotonic()
                    r.recovered_s = now - pair.t_run
                    r.recovery_s = now - healthy
                    self.say(f"chaos: {role} recovered {r.recovery_s:.2f}s after it was healthy")
                    return
                time.sleep(POLL_S)
            r.error = f"no request served with a transfer within {self.recovery_timeout_s:.0f}s"
            self.say(f"chaos: {role}: {r.error}")
        finally:
            r.done.set()


async def _wait(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.05)
