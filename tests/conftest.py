"""Session-wide fixtures: the tiny test model and lazily started vLLM servers.

Servers live in one `ServerPool` per test session: each configuration is
started the first time a test asks for it, shared by later tests, and stopped
at the end of the session (or when the pool needs room: at most two servers run
at once on this 2-core machine). The harness's watchdog stops them even if the
test runner is killed. Logs go to `<pytest tmp>/vllm-logs` unless
`RAPIDKV_LOG_DIR` is set.

One-rank servers run vLLM's "uni" executor unless their spec or the
environment says otherwise (`RAPIDKV_VLLM_EXECUTOR`, set here if unset): the
worker in the engine core's process, as vLLM runs one GPU, which starts in
two thirds of the time of "mp" (one interpreter fewer imports vLLM). "mp",
vLLM CPU's default (a worker process of its own), is what the TP tests, the
SmolLM2 pair installed from the wheel and the harness's teardown test run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rapidkv.harness import ServerPool, ServerSpec, VLLMServer, free_port
from rapidkv.harness.iterations import FLAG as ITERATION_LOG_FLAG
from rapidkv.harness.kv_events import bound_endpoint
from rapidkv.harness.server import EXECUTOR_ENV, TOOL_CALLING_ARGS

os.environ.setdefault(EXECUTOR_ENV, "uni")  # inherited by the bench and demo commands run here

CHUNK_TOKENS = 256
"""`--max-num-batched-tokens` of the chunked-prefill server."""

_pool: ServerPool | None = None


@pytest.fixture(scope="session")
def etcd() -> Iterator[Any]:
    """A real etcd server on loopback for the session (`harness.etcd`); the
    tests that need it skip, saying why, where etcd cannot run."""
    from rapidkv.harness.etcd import EtcdServer, EtcdUnavailable

    server = EtcdServer()
    try:
        server.start()
    except EtcdUnavailable as e:
        pytest.skip(f"etcd cannot run here: {e}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Directory of the tiny float32 random-weight Llama (built once, cached)."""
    from rapidkv.models import ensure_model

    return ensure_model("tiny", dtype="float32")


@pytest.fixture(scope="session")
def harness_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where server and watchdog logs of this session go."""
    env = os.environ.get("RAPIDKV_LOG_DIR")
    if env:
        path = Path(env)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def server_pool(harness_log_dir: Path) -> Iterator[ServerPool]:
    """The session's pool of shared servers; every server is stopped at session end."""
    global _pool
    pool = ServerPool(harness_log_dir, max_running=2)
    _pool = pool
    try:
        yield pool
    finally:
        pool.close()


def single_spec(model: Path) -> ServerSpec:
    """The reference single instance: default batching, pinned to core 0.

    Logs one line per engine step (`rapidkv.harness.iterations`), so tests can
    see how steps were composed.
    """
    return ServerSpec(
        model=model,
        name="server",
        role="single",
        cpus=(0,),
        extra_args=(ITERATION_LOG_FLAG, *TOOL_CALLING_ARGS),
    )


def chunked_spec(model: Path, kv_events: tuple[int, int, str]) -> ServerSpec:
    """A single instance that must prefill in chunks of `CHUNK_TOKENS`, on core 1.

    It also publishes its KV cache events (ZMQ; `kv_events`: the publisher's
    port, the replay port, the topic) and serves `POST /reset_prefix_cache`
    (test_kv_events), which change none of its outputs."""
    pub, replay, topic = kv_events
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": bound_endpoint(pub),  # on loopback only
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": topic,
    }
    return ServerSpec(
        model=model,
        name="server",
        role="single",
        cpus=(1,),
        extra_args=(
            ITERATION_LOG_FLAG,
            "--max-num-batched-tokens",
            str(CHUNK_TOKENS),
            "--enable-prefix-caching",
            "--kv-events-config",
            json.dumps(config),
        ),
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )


@pytest.fixture
def single_server(server_pool: ServerPool, tiny_model: Path) -> VLLMServer:
    """Tiny float32 model, default batching (started on first use, then shared)."""
    return server_pool.get_one("single", single_spec(tiny_model))


@pytest.fixture(scope="session")
def single_server_starter(server_pool: ServerPool, tiny_model: Path):
    """For session fixtures: a function returning the reference single instance
    (started, or restarted if the pool stopped it to make room)."""
    return lambda: server_pool.get_one("single", single_spec(tiny_model))


@pytest.fixture(scope="session")
def chunked_kv_events() -> tuple[int, int, str]:
    """Where the chunked-prefill server publishes its KV events: (publisher's
    port, replay port, topic)."""
    return free_port(), free_port(), "kv"


@pytest.fixture
def single_server_chunked(
    server_pool: ServerPool, tiny_model: Path, chunked_kv_events: tuple[int, int, str]
) -> VLLMServer:
    """Tiny float32 model with `--max-num-batched-tokens 256` (chunked prefill),
    publishing its KV events (`chunked_spec`)."""
    return server_pool.get_one("single_chunked", chunked_spec(tiny_model, chunked_kv_events))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test is `unit` or `e2e` (``-m unit`` runs no vLLM server): one that
    names neither is marked by its directory, `e2e` under tests/e2e, else `unit`."""
    for item in items:
        if not any(item.iter_markers("unit")) and not any(item.iter_markers("e2e")):
            e2e = "e2e" in item.path.relative_to(Path(__file__).parent).parts
            item.add_marker(pytest.mark.e2e if e2e else pytest.mark.unit)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Report every vLLM server start-up of the session and where the logs are."""
    if _pool is None or not _pool.startups:
        return
    terminalreporter.section("vLLM servers")
    for name, seconds in _pool.startups:
        terminalreporter.write_line(f"{name}: healthy after {seconds:.1f}s")
    terminalreporter.write_line(f"logs: {_pool.log_dir}")
