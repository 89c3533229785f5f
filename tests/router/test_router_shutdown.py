"""`rapidkv router` shutting down on SIGTERM, as a real process in front of
fake vLLM instances: new requests refused, running ones finished within the
grace (or cut at its end), then exit 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from fake_vllm import FakeVLLM, MakeFake

from rapidkv.harness import free_port, wait_until
from rapidkv.router.shutdown import ShutdownState

pytestmark = pytest.mark.unit

SLOW = {"prompt": [1, 2, 3], "max_tokens": 6, "stream": True, "fake": {"decode": "hang_stream"}}
# ... and a P slower than D: its request outlives the client's answer (dual dispatch)
SLOW_P = dict(SLOW, fake={"decode": "hang_stream", "prefill": "hang"})


class RouterProcess:
    """`rapidkv router` in front of `p` and `d`, its stderr captured."""

    def __init__(self, p: FakeVLLM, d: FakeVLLM, grace_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "rapidkv.cli", "router", f"--prefill={p.url}"]
        argv += [f"--decode={d.url}", f"--port={self.port}", "--no-discover"]
        argv += [f"--shutdown-grace-s={grace_s}", "--log-level=info"]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        wait_until(self._live, 60, what="the router process to serve")

    def _live(self) -> bool:
        assert self.proc.poll() is None, self.log()
        try:
            return httpx.get(f"{self.url}/livez", trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.proc.stderr.read() if self.proc.stderr else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


@pytest.fixture
def fakes(make_fake: MakeFake) -> tuple[FakeVLLM, FakeVLLM]:
    return make_fake("P0", "prefill"), make_fake("D0", "decode")


@pytest.fixture
def start() -> Iterator[type[RouterProcess]]:
    started: list[RouterProcess] = []

    def make(p: FakeVLLM, d: FakeVLLM, grace_s: float) -> RouterProcess:
        router = RouterProcess(p, d, grace_s)
        started.append(router)
        return router

    yield make  # type: ignore[misc]
    for router in started:
        router.stop()


def events(lines: Iterator[str], n: int) -> list[str]:
    """The next `n` SSE data lines of a stream."""
    out: list[str] = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line.removeprefix("data: "))
            if len(out) == n:
                break
    return out


def test_sigterm_refuses_new_requests_finishes_the_running_stream_then_exits_0(
    fakes: tuple[FakeVLLM, FakeVLLM], start: type[RouterProcess]
) -> None:
    p, d = fakes
    router = start(p, d, grace_s=30)
    with (
        httpx.Client(timeout=30, trust_env=False) as client,
        httpx.Client(timeout=30, trust_env=False) as other,
    ):
        assert other.get(f"{router.url}/readyz").json()["ready"] is True
        with client.stream("POST", f"{router.url}/v1/completions", json=SLOW_P) as stream:
            lines = stream.iter_lines()
            first = events(lines, 1)
            assert json.loads(first[0])["choices"][0]["text"]  # the stream runs, held by D
            router.proc.send_signal(signal.SIGTERM)
            t_term = time.monotonic()

            def refused() -> httpx.Response | None:
                resp = other.post(
                    f"{router.url}/v1/completions", json={"prompt": [1], "max_tokens": 1}
                )
                return resp if resp.status_code == 503 else None

            resp = wait_until(refused, 10, what="new requests to be refused")
            assert "shutting down" in resp.json()["error"]["message"]
            assert resp.headers["connection"] == "close"
            assert other.get(f"{router.url}/livez").status_code == 200
            ready = other.get(f"{router.url}/readyz")
            assert ready.status_code == 503 and "shutting down" in ready.json()["reason"]
            assert router.proc.poll() is None  # the stream still runs
            d.release()
            rest = events(lines, 100)
        assert rest[-1] == "[DONE]" and len(rest) == 6  # every token after the first
    with pytest.raises(subprocess.TimeoutExpired):  # P's request still runs: it waits
        router.proc.wait(0.5)
    (p_seen,) = p.requests("/v1/completions")
    assert not p_seen.disconnected and not p_seen.answered_seq
    p.release()
    assert router.proc.wait(10) == 0
    assert p.wait_answered(p_seen.request_id).disconnected is False
    assert time.monotonic() - t_term < 10  # it exited once idle, not at the grace's end
    assert "closing: new requests are refused; 1 running got up to 30s" in router.log()


def test_a_stream_still_running_at_the_graces_end_is_cut_and_the_router_exits_0(
    fakes: tuple[FakeVLLM, FakeVLLM], start: type[RouterProcess]
) -> None:
    p, d = fakes
    router = start(p, d, grace_s=0.5)
    with (
        httpx.Client(timeout=30, trust_env=False) as client,
        client.stream("POST", f"{router.url}/v1/completions", json=SLOW) as stream,
    ):
        lines = stream.iter_lines()
        assert events(lines, 1)
        router.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError):  # cut before its end
            events(lines, 100)
    assert router.proc.wait(10) == 0
    assert 0.5 <= time.monotonic() - t_term < 4  # the grace, uvicorn's half second, slack
    assert "grace over: 1 request(s) still running are cancelled (and 0 P" in router.log()


def test_shutdown_state_is_over_when_closing_and_idle_or_past_the_grace() -> None:
    background = [0]
    state = ShutdownState(lambda: background[0])
    assert not state.closing and not state.over(0.0)  # not closing: never over
    state.running = 1
    state.close()
    assert state.closing and state.running_at_close == 1
    assert not state.over(60.0)  # a request runs, within the grace
    assert state.over(0.0)  # the grace has passed
    state.running, background[0] = 0, 1
    assert not state.over(60.0)  # a P request outlives its answer
    background[0] = 0
    assert state.over(60.0)
    since = state.closing_since
    state.close()
    assert state.closing_since == since  # the first signal's time stays
