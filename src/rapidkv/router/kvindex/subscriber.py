"""`MemberSubscriber`: one member's ZMQ sockets, feeding the index core.

The thin I/O shell around `index.KVIndex` for one vLLM publisher: a SUB socket
connected to its PUB endpoint (and that socket's monitor, for the link's ups
and downs), and, for each replay the core asks for, a fresh DEALER on its
replay endpoint. It decides nothing: every frame and link event goes to the
core, and the core's `Action`s come back to `handle`.

Invariants:
- Runs on one asyncio loop; the core is only called from that loop.
- Monitor events are read before the next SUB message, so a batch of a
  restarted publisher is not taken for one of the old (the disconnect is
  queued before the reconnect that brings it).
- At most one replay runs; a new request cancels the old one (its DEALER is
  closed, so no late answer can be read as the new one's). A replay whose
  socket stays silent for `replay_timeout_s` ends as a timeout: the core is
  told `replay_ended`, as for the end marker.
- `stop` cancels the tasks and closes every socket (linger 0); the core is not
  told (the caller decides whether the member left).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from rapidkv.router.kvindex.actions import Action, RequestReplay, Reset
from rapidkv.router.kvindex.index import KVIndex
from rapidkv.router.kvindex.wire import WireError, parse_live, parse_replay, replay_request

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 5.0
RCVHWM = 100_000  # vLLM's PUB side keeps as many (KVEventsConfig.hwm)
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 6000
RECONNECT_IVL_MAX_MS = 2000
_LINK_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


@dataclass(frozen=True)
class Member:
    """Where one vLLM publisher is: `endpoint` is its PUB socket as this side
    connects to it (vLLM started with ``"endpoint": "tcp://*:PORT"`` binds
    PORT), `replay_endpoint` its ROUTER socket (None: vLLM has none), `topic`
    its ``KVEventsConfig.topic``; `identity` the process it is (an instance id
    from etcd or discovery; None: unknown)."""

    key: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    identity: str | None = None

    def same_sockets(self, other: Member) -> bool:
        return (self.endpoint, self.replay_endpoint, self.topic) == (
            other.endpoint,
            other.replay_endpoint,
            other.topic,
        )


class MemberSubscriber:
    """SUB + monitor + replay DEALER for one member; see the module docstring."""

    def __init__(
        self,
        member: Member,
        core: KVIndex,
        context: zmq.asyncio.Context,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        on_link: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.member = member
        self.core = core
        self.context = context
        self.replay_timeout_s = replay_timeout_s
        self.on_link = on_link  # told (key, up) after the core, at each link event
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        return self.member.key

    def start(self) -> None:
        """Connect the SUB socket and start reading (on the running loop)."""
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self.member.topic.encode())
        self._monitor = sub.get_monitor_socket(_LINK_EVENTS)
        sub.connect(self.member.endpoint)
        self._sub = sub
        self._task = asyncio.get_running_loop().create_task(
            self._read(), name=f"kvindex-sub {self.key}"
        )

    async def stop(self) -> None:
        for task in (self._replay_task, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._replay_task = self._task = None
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._sub = self._monitor = None

    def handle(self, actions: list[Action]) -> None:
        """Carry out what the core asked for this member."""
        for action in actions:
            if isinstance(action, RequestReplay):
                log.debug("kvindex %s: replay from %d", self.key, action.start_seq)
                self._start_replay(action.start_seq, action.token)
            elif isinstance(action, Reset):
                log.warning(
                    "kvindex %s: dropped its blocks%s (%s); learning again from batch %d",
                    self.key,
                    " and hash translations" if action.full else "",
                    action.reason,
                    action.resume_seq,
                )

    # ---------------------------------------------------------------- reading

    async def _read(self) -> None:
        try:
            await self._read_forever()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: the member must not keep claiming blocks
            log.exception("kvindex %s: the reader failed; the member claims nothing", self.key)
            self.core.disconnected(self.key)
            raise

    async def _read_forever(self) -> None:
        assert self._sub is not None and self._monitor is not None
        sub, monitor = self._sub, self._monitor
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            while await monitor.poll(0):
                self._link(parse_monitor_message(await monitor.recv_multipart())["event"])
            if sub in ready and await sub.poll(0):
                self._live(await sub.recv_multipart())

    def _link(self, event: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            log.info("kvindex %s: connected to %s", self.key, self.member.endpoint)
            self.handle(self.core.connected(self.key))
        elif event == zmq.EVENT_DISCONNECTED:
            log.info("kvindex %s: disconnected from %s", self.key, self.member.endpoint)
            self.handle(self.core.disconnected(self.key))
        else:
            return
        if self.on_link is not None:
            try:
                self.on_link(self.key, event == zmq.EVENT_CONNECTED)
            except Exception:
                log.exception("kvindex %s: on_link failed", self.key)

    def _live(self, frames: list[bytes]) -> None:
        try:
            seq, payload = parse_live(frames)
        except WireError as e:
            log.warning("kvindex %s: unreadable message: %s", self.key, e)
            self.handle(self.core.refused(self.key))
            return
        self.handle(self.core.received(self.key, seq, payload))

    # ---------------------------------------------------------------- replays

    def _start_replay(self, start_seq: int, token: int) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
        if self.member.replay_endpoint is None:  # the core was told it cannot replay
            self.handle(self.core.replay_ended(self.key, token))
            return
        self._replay_task = asyncio.get_running_loop().create_task(
            self._replay(start_seq, token), name=f"kvindex-replay {self.key}"
        )

    async def _replay(self, start_seq: int, token: int) -> None:
        assert self.member.replay_endpoint is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.member.replay_endpoint)
            await dealer.send_multipart(replay_request(start_seq))
            while await dealer.poll(self.replay_timeout_s * 1000):
                try:
                    answer = parse_replay(await dealer.recv_multipart())
                except WireError as e:
                    log.warning("kvindex %s: unreadable replay message: %s", self.key, e)
                    self.handle(self.core.refused(self.key))
                    continue
                if answer is None:
                    break
                self.handle(self.core.replayed(self.key, token, *answer))
            else:
                log.warning(
                    "kvindex %s: replay from %d silent for %.1fs at %s",
                    self.key,
                    start_seq,
                    self.replay_timeout_s,
                    self.member.replay_endpoint,
                )
        finally:
            dealer.close(linger=0)
        self.handle(self.core.replay_ended(self.key, token))
