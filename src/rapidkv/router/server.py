"""Running a router: in this process on a thread (`start_router`), or as the program (`run_router`).

    config = RouterConfig(prefill=(Instance(p_url, p_control),), decode=(Instance(d_url),))
    with start_router(config.replace(port=0)) as router:
        complete(router.url, prompt_ids, 16)

Invariants:
- The listening socket is bound to exactly ``config.host`` before anything else
  happens, so a bad host or a taken port raises at once (`OSError`); port 0
  picks a free port, and `ThreadedServer.port` is the one bound.
- `run_router` (the program) closes gracefully on SIGTERM/SIGINT (`shutdown`):
  new requests refused with 503 while the running ones get
  ``config.shutdown_grace_s`` to finish, then it returns.
- `start_router` returns only once the app has started (its upstream client is
  open) and the socket accepts connections; `stop` returns once the server
  thread has ended (in-flight requests get ``grace_s``, a router's
  ``shutdown_grace_s``, to finish, then are cancelled; the listening socket is
  closed at once) and is idempotent.
- uvicorn never configures logging here: the caller's logging setup stands.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from types import FrameType, TracebackType
from typing import Any, Literal

import uvicorn
from starlette.types import ASGIApp

from rapidkv.router.app import build_app
from rapidkv.router.config import RouterConfig
from rapidkv.router.shutdown import UVICORN_GRACE_S, DrainingServer

log = logging.getLogger(__name__)

GRACE_S = 3.0  # a `ThreadedServer`'s in-flight requests' time to finish at `stop`


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on exactly (`host`, `port`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def _uvicorn_config(
    app: ASGIApp, lifespan: Literal["on", "off"], keep_alive_s: float, grace_s: float
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        lifespan=lifespan,
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]  # call_later takes a float
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=grace_s,  # type: ignore[arg-type]  # a float works
        server_header=False,
    )


class ThreadedServer:
    """An ASGI app served by uvicorn on a thread of its own (see module invariants)."""

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        lifespan: Literal["on", "off"] = "on",
        name: str = "asgi",
        start_timeout: float = 30.0,
        keep_alive_s: float = 5.0,
        grace_s: float = GRACE_S,
    ) -> None:
        self.app = app
        sock = bind_socket(host, port)
        self.host = host
        self.port = int(sock.getsockname()[1])
        self._grace_s = grace_s
        self._server = uvicorn.Server(_uvicorn_config(app, lifespan, keep_alive_s, grace_s))
        self._failure: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(sock,), name=f"{name}-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + start_timeout
        while not self._server.started:  # set by uvicorn once lifespan startup is done
            if not self._thread.is_alive():
                raise RuntimeError(f"{name} on {self.url} failed to start: {self._failure!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{name} on {self.url} not started after {start_timeout}s")
            self._thread.join(0.01)

    def _run(self, sock: socket.socket) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[sock]))
        except BaseException as e:  # reported by the constructor or stop()
            self._failure = e
        finally:
            sock.close()

    @property
    def url(self) -> str:
        """``http://host:port`` (IPv6 hosts bracketed), no trailing slash."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the server to exit and wait for its thread (idempotent; by
        default up to the grace and 10 s more)."""
        timeout = self._grace_s + 10.0 if timeout is None else timeout
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"server on {self.url} did not stop within {timeout}s")

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RunningRouter(ThreadedServer):
    """A router served in this process; `.url`, `.config`, `.stop()`."""

    def __init__(
        self, config: RouterConfig, *, start_timeout: float = 30.0, tracer_provider: Any = None
    ) -> None:
        self.config = config
        app = build_app(config, tracer_provider=tracer_provider)
        self.router = app.state.router
        super().__init__(
            app,
            config.host,
            config.port,
            name="rapidkv-router",
            start_timeout=start_timeout,
            keep_alive_s=config.keep_alive_s,
            grace_s=config.shutdown_grace_s,
        )


def start_router(config: RouterConfig, *, tracer_provider: Any = None) -> RunningRouter:
    """Serve a router in this process, on a thread; returns once it accepts
    requests. `tracer_provider`: where its spans go (`app.build_app`)."""
    router = RunningRouter(config, tracer_provider=tracer_provider)
    log.info("router on %s: %s", router.url, describe(config))
    return router


def run_router(config: RouterConfig) -> None:
    """Serve a router until SIGINT/SIGTERM, then shut down gracefully
    (`shutdown`) and return.

    Blocks; for the command line. Called on the main thread, it turns those
    signals into a normal return (uvicorn re-raises them after its shutdown).
    """
    sock = bind_socket(config.host, config.port)
    port = sock.getsockname()[1]
    log.info("router on %s:%d: %s", config.host, port, describe(config))
    app = build_app(config)
    server = DrainingServer(
        _uvicorn_config(app, "on", config.keep_alive_s, UVICORN_GRACE_S),
        app.state.shutdown,
        config.shutdown_grace_s,
    )
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _stop_quietly) for s in _SIGNALS} if main else {}
    try:
        server.run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    log.info("router on %s:%d stopped", config.host, port)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Stopped(Exception):
    """A stop signal arrived outside uvicorn's own handling."""


def _stop_quietly(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signal.Signals(signum).name)


def describe(config: RouterConfig) -> str:
    """One line: dispatch mode and instances, by the roles they may play."""
    groups: dict[str, list[str]] = {}
    for member in config.members:
        groups.setdefault(member.label, []).append(str(member.instance))
    listed = "; ".join(f"{label} {', '.join(urls)}" for label, urls in groups.items())
    return f"dispatch {config.dispatch}; {listed}"
