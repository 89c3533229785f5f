"""Faults on a real P/D pair behind the router: an instance killed and started
again on its address heals without restarting the other side or the router; a
request that cannot succeed costs P nothing; a client that leaves at any phase
leaves nothing behind."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from pd_harness import (
    MAX_TOKENS,
    Pair,
    assert_back_to_baseline,
    connector_config,
    listening,
    log_mark,
    logged_since,
    router_healthy,
    served_with_transfer,
    shm_held_by_anyone,
    shm_paths,
    tcp_port_closed,
    unix_socket_closed,
    wait_for,
)

from rapidkv.harness import (
    ManagedProcess,
    VLLMServer,
    free_port,
    random_prompts,
    wait_until,
)
from rapidkv.harness.client import complete_full, get_metrics, metric_sum, open_request
from rapidkv.harness.etcd import EtcdServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


# -- an instance killed and started again on its address, the other side and the
# router left running: the first request after it is healthy crosses with a
# real transfer (D re-handshakes with a restarted P; P forgets a restarted D's
# old process when the new one handshakes from its control address)


def p_idle(pair: Pair) -> bool:
    """Every block of P's pool free, no transfer live."""
    s = pair.stats("p")
    return s["free_blocks"] == s["usable_blocks"] and s["transfers_live"] == 0


def p_prompt_tokens(pair: Pair) -> float:
    return metric_sum(get_metrics(pair.p.base_url), "vllm:prompt_tokens_total")


def router_dispatches_to(router_url: str, role: str) -> bool:
    health = httpx.get(f"{router_url}/health", timeout=10).json()
    return all(i["dispatching"] for i in health[role])


def a_known_dead_d_costs_p_nothing(pair: Pair, router_url: str, ids: list[int]) -> None:
    """The router knows D is down: it answers 503 at once, naming why, and P is
    not asked."""
    asked = p_prompt_tokens(pair)
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    resp = httpx.post(f"{router_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 503, resp.text
    assert "no decode instance is up" in resp.json()["error"]["message"]
    assert p_prompt_tokens(pair) == asked
    assert p_idle(pair)


def test_a_request_d_refuses_costs_p_nothing_within_a_second(
    pd_pair: Pair, workloads: dict
) -> None:
    """D refuses (min_tokens over max_tokens) what P accepted (P is asked for
    one token, min_tokens at most 1): the client gets D's 400 as is, and P,
    aborted by the router, holds nothing within 1 s."""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    (ids,), _ = workloads["gone"]
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url, pd_pair.p_control),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
        split_prefill=False,
    )
    idle = pd_pair.stats("p")
    aborts = idle.get("aborts_decode_failed", 0)
    with start_router(config) as router:
        body = {"prompt": ids, "max_tokens": 8, "min_tokens": 9, "temperature": 0.0}
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 400, resp.text
        assert wait_for(lambda: p_idle(pd_pair), 1.0), pd_pair.stats("p")
    assert pd_pair.stats("p")["aborts_decode_failed"] == aborts + 1


@pytest.mark.parametrize("side", ["p", "d"])
def test_an_instance_killed_mid_transfer_and_restarted_on_its_address_heals(
    pd_pair: Pair, workloads: dict, side: str, caplog: pytest.LogCaptureFixture
) -> None:
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    prompts, expected = workloads[f"restart-{side}"]
    config = RouterConfig(  # P's control address discovered, as a user would run it
        prefill=(Instance(pd_pair.p.base_url, None),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
        split_prefill=False,
    )
    with start_router(config) as router, ThreadPoolExecutor(1) as pool:
        served_with_transfer(pd_pair, router.url, prompts[0], expected[0])
        restarted = pd_pair.p if side == "p" else pd_pair.d
        other = pd_pair.d if side == "p" else pd_pair.p
        mark = log_mark(other)
        before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}
        url = restarted.base_url
        # killed, as by a crash, while a request's KV crosses
        inflight = pool.submit(complete_full, router.url, prompts[3], MAX_TOKENS)
        leave_when(pd_pair, None, "kv_crossing")
        restarted.stop(grace=0)
        if side == "p":  # D computes what P could not send: the client sees nothing
            assert inflight.result(60).token_ids == expected[3]
            assert pd_pair.since(before, "d", "recompute_fallbacks") == 1
        else:  # a clear error, and P, told by the router, holds nothing within 1 s
            with pytest.raises(httpx.HTTPStatusError) as failed:
                inflight.result(60)
            assert failed.value.response.status_code == 502
            assert "did not answer" in failed.value.response.json()["error"]["message"]
            assert any(
                "decode instance" in r.getMessage() and "is down" in r.getMessage()
                for r in caplog.records
            ), "the router did not log why it stopped dispatching to D"
            assert wait_for(lambda: p_idle(pd_pair), 1.0), pd_pair.stats("p")
            a_known_dead_d_costs_p_nothing(pd_pair, router.url, prompts[1])
        restarted.launch()
        restarted.wait_ready()
        assert restarted.base_url == url
        healthy = time.monotonic()
        # the router probes a down instance's /health every second
        role = "prefill" if side == "p" else "decode"
        wait_until(lambda: router_dispatches_to(router.url, role), 2.0, what=f"{role} back")
        served_with_transfer(pd_pair, router.url, prompts[1], expected[1])
        assert time.monotonic() - healthy < 5.0
        served_with_transfer(pd_pair, router.url, prompts[2], expected[2])
    logged = logged_since(other, mark)  # the surviving side says what it saw
    if side == "p":  # D learnt of the restart from P's answer and handshook again
        assert pd_pair.since(before, "d", "rehandshakes") == 1
        assert "D recomputes" in logged and "handshaking again" in logged, logged[-2000:]
    else:  # P replaced the old D, whose control address the new one handshook from
        assert pd_pair.since(before, "p", "peers_forgotten") == 1
        assert pd_pair.stats("p")["peers_decode"] == 1
        # why depends on which came first: a write to the dead D failing, or
        # the new D's handshake from its address
        assert "forgetting peer" in logged, logged[-2000:]
    # the restarted process has its own pool: nothing parked, live or awaited,
    # the engines idle, free blocks steady
    assert_back_to_baseline(pd_pair)


# -- a client that goes away at every phase of its request: nothing stays behind
# (phase: dispatch, stream, the moment the client leaves)
LEAVE_AT = {
    "before_p_starts": ("dual", False, "sent"),
    "mid_prefill": ("dual", False, "p_computes"),
    "mid_transfer": ("dual", False, "kv_crossing"),
    "mid_decode": ("dual", False, "d_decodes"),
    "mid_decode_streaming": ("dual", True, "streamed"),
    "serial_mid_prefill": ("serial", False, "p_computes"),
}


def engine_gauge(server: VLLMServer, name: str) -> float:
    return metric_sum(get_metrics(server.base_url), f"vllm:{name}")


def leave_when(pair: Pair, sock: socket.socket | None, when: str) -> None:
    """Block until the request is at `when`, then return (the caller closes)."""
    what = f"the request to reach {when}"
    if when == "p_computes":
        # P holds the request: its connector has the transfer live (from the
        # moment P's scheduler admits it until D has the KV), polled every 5 ms.
        # Not P's engine gauge alone: vLLM sets it from the stats a step ends
        # with, and a 900-token prefill on the tiny model is one ~0.2 s step,
        # so a poll of /metrics can miss the whole window.
        wait_until(
            lambda: (
                pair.stats("p").get("transfers_live", 0) >= 1
                or engine_gauge(pair.p, "num_requests_running") >= 1
            ),
            30,
            interval=0.005,
            max_interval=0.005,
            what=what,
        )
    elif when == "kv_crossing":
        # P holds the transfer live (it admitted the request: it computes the
        # prompt, sending each layer as it is done) and D waits for the KV.
        # Not "P's bytes_sent grew": P's workers report bytes at the end of its
        # step, and the SendDone follows at once, so that window is a few ms
        # and a poll of two RPCs can miss it.
        wait_until(
            lambda: (
                pair.stats("p").get("transfers_live", 0) >= 1
                and pair.stats("d")["waiting_for_kv"] >= 1
            ),
            30,
            interval=0.005,
            what=what,
        )
    elif when == "d_decodes":
        base = engine_gauge(pair.d, "generation_tokens_total")
        wait_until(
            lambda: engine_gauge(pair.d, "generation_tokens_total") >= base + 3, 30, what=what
        )
    elif when == "streamed":
        assert sock is not None
        seen = b""
        while seen.count(b"data: ") < 3:
            chunk = sock.recv(65536)
            assert chunk, f"the stream ended early: {seen!r}"
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("phase", list(LEAVE_AT))
def test_a_client_that_leaves_at_any_phase_leaves_nothing_behind(
    pd_pair: Pair, tiny_model: Path, phase: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The router sees the client go (counted `client_abort`), cancels what it
    sent, tells P's connector (where P was asked), and within 2 s P and D hold
    nothing: free blocks as before, nothing parked, live or awaited, no request
    running or waiting."""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    dispatch, stream, when = LEAVE_AT[phase]
    (ids,) = random_prompts(tiny_model, [900], seed=2300 + list(LEAVE_AT).index(phase))
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url, pd_pair.p_control),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
        dispatch=dispatch,
        split_prefill=False,
    )
    before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}
    body = {"prompt": ids, "max_tokens": 100, "temperature": 0.0, "ignore_eos": True}
    caplog.set_level(logging.DEBUG, logger="rapidkv.router")
    with start_router(config) as router:
        sock = open_request(router.url, "/v1/completions", dict(body, stream=stream))
        try:
            leave_when(pd_pair, sock, when)
        finally:
            sock.close()
        wait_until(
            lambda: (
                metric_sum(
                    get_metrics(router.url), "rapidkv_router_requests_total", outcome="client_abort"
                )
                == 1
            ),
            5,
            what="the router to count the client's abort",
        )
        assert router.router.fleet.outstanding("prefill") == [0]
        assert router.router.fleet.outstanding("decode") == [0]
        assert_back_to_baseline(pd_pair)
    if when != "sent":  # P was asked: its connector was told (by the router, and
        # by D too when D's request was waiting for the KV), and the router says why
        assert pd_pair.since(before, "p", "aborts_client_abort") >= 1
        assert any("client_abort; stopping the prefill" in r.getMessage() for r in caplog.records)


def test_a_p_frozen_past_ds_timeout_cannot_write_into_reused_blocks(
    pd_pair: Pair, workloads: dict
) -> None:
    """P is frozen (SIGSTOP) while a prompt's KV crosses, past D's TransferKV
    timeout: D gives the transfer up but keeps its blocks (nothing recomputed
    into them, nothing freed) until P confirms the Abort, which P does, once
    resumed, only when no more of its writes can land. Then D recomputes: the
    output is exact and both sides return to their baseline."""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    prompts, expected = workloads["frozen-p"]
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url, pd_pair.p_control),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
        split_prefill=False,
    )
    before = {"p": pd_pair.stats("p"), "d": pd_pair.stats("d")}
    mark = log_mark(pd_pair.d)
    with start_router(config) as router, ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(complete_full, router.url, prompts[0], MAX_TOKENS)
        leave_when(pd_pair, None, "kv_crossing")
        pd_pair.p.signal(signal.SIGSTOP)
        try:
            # past D's 10 s TransferKV timeout: D has given up the transfer...
            wait_until(
                lambda: pd_pair.since(before, "d", "recompute_fallbacks") == 1,
                20,
                what="D to give up the transfer",
            )
            time.sleep(1.0)
            held = pd_pair.stats("d")
            # ...but holds its blocks: the request still waits for them
            assert held["waiting_for_kv"] == 1
            assert held["free_blocks"] < before["d"]["free_blocks"]
            assert not inflight.done()
        finally:
            pd_pair.p.signal(signal.SIGCONT)
        assert inflight.result(60).token_ids == expected[0]
    logged = logged_since(pd_pair.d, mark)  # D says why it gave up
    assert "TimeoutError" in logged and "D recomputes" in logged, logged[-2000:]
    assert_back_to_baseline(pd_pair, within=5.0)


# -- a P sent SIGTERM (as by its orchestrator) while it holds KV for D: it
# exits within seconds, on its own, and leaves nothing behind; D, and every
# request that went to it, go on as if it had never been there

SIGTERM_EXIT_S = 30.0  # P's whole tree is gone within this
SHUTDOWN_TIMEOUT_S = 60  # vLLM's drain bound: past it, vLLM kills its engine


def etcd_urls(etcd: EtcdServer) -> dict[str, str]:
    """The instance records in `etcd`: key -> the instance's URL."""
    from rapidkv.membership.etcd import EtcdClient
    from rapidkv.membership.record import decode_record

    with EtcdClient([etcd.url]) as client:
        _, records = client.get_prefix("/rapidkv/instances/")
    return {key: decode_record(value).url for key, value in records.items()}


def test_a_p_sent_sigterm_while_it_holds_kv_for_d_exits_leaving_nothing_behind(
    pd_pair: Pair,
    workloads: dict,
    fleet_etcd: EtcdServer | str,
    harness_log_dir: Path,
    tiny_model: Path,
) -> None:
    """A second P beside the shared pair (whose D it serves), started as
    instances are deployed (vLLM's `--shutdown-timeout`, here 60 s; registered
    in etcd, here with a 30 s lease), holds KV for D in every way at once: a
    prompt it prefilled that D has not asked for, a TransferKV D parked for a
    request P never got (D holds blocks for it), and a prompt a router sent to
    both that it is computing. SIGTERM to its API server only, as Kubernetes
    sends it. Then:

    - its whole process tree exits on its own within `SIGTERM_EXIT_S` (vLLM
      killed nothing), the API server with status 0, its connector closed;
    - every TCP port it listened on (HTTP, control plane, whatever NIXL/UCX
      and vLLM opened) refuses connections and can be bound again, every unix
      socket refuses connections, no /dev/shm file it created and no rapidkv
      file in its TMPDIR is left;
    - its etcd record is gone within seconds of the signal (revoked: its
      lease is renewed every 10 s, so it could not have expired yet);
    - the parked request is answered GONE at once and D recomputes it, the
      router's request is finished: both outputs are the single instance's,
      and D is back at its baseline (every block free, nothing awaited)."""
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    prompts, expected = workloads["sigterm-p"]
    port, control = free_port(), free_port()
    etcd: dict = {}
    if isinstance(fleet_etcd, EtcdServer):
        etcd = {
            "etcd_endpoints": [fleet_etcd.url],
            "etcd_ttl_s": 30.0,
            "advertise_url": f"http://127.0.0.1:{port}",
        }
    spec = pd_pair.p.spec.replace(
        name="prefill-sigterm",
        port=port,
        # 50 ms after each layer: its prompt's 4 chunks take a second or more
        kv_transfer_config=connector_config(control, debug_layer_delay_s=0.05, **etcd),
        extra_args=(*pd_pair.p.spec.extra_args, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)),
    )
    shm_before = set(os.listdir("/dev/shm"))
    with contextlib.ExitStack() as undo:
        p = VLLMServer.start(spec, harness_log_dir)
        undo.callback(p.stop, grace=0)
        pair = Pair(tiny_model, p, pd_pair.d, f"127.0.0.1:{control}", pd_pair.d_control)
        undo.callback(pair.close)
        config = RouterConfig(
            prefill=(Instance(p.base_url, pair.p_control),),
            decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
            port=0,
            split_prefill=False,
        )
        with start_router(config) as router, ThreadPoolExecutor(2) as pool:
            if etcd:
                wait_until(
                    lambda: p.base_url in etcd_urls(fleet_etcd).values(), 10, what="P in etcd"
                )
            # prefilled, its blocks held for a D that has not asked
            pk, _ = pair.params("sigterm-held")
            complete_full(p.base_url, prompts[0], 1, kv_transfer_params=pk)
            # D's request alone: its TransferKV is parked on P, D holds its blocks
            _, dk = pair.params("sigterm-parked")

            def timed(*args, **kwargs):
                out = complete_full(*args, **kwargs)
                return out, time.monotonic()

            parked = pool.submit(
                timed, pd_pair.d.base_url, prompts[1], MAX_TOKENS, kv_transfer_params=dk
            )
            wait_until(lambda: pair.stats("p")["parked_now"] == 1, 10, what="a parked TransferKV")
            # through the router: P computes it when the SIGTERM comes
            routed = pool.submit(complete_full, router.url, prompts[2], MAX_TOKENS)
            wait_until(
                lambda: (
                    pair.stats("p")["transfers_live"] == 2
                    and engine_gauge(p, "num_requests_running") >= 1
                ),
                30,
                interval=0.005,
                what="P to compute the router's prompt",
            )
            held = pair.stats("p")
            assert held["held_requests"] >= 1 and held["parked_now"] == 1, held
            pids = p.process.live_pids()
            tcp, unix = listening(pids)
            assert {("127.0.0.1", port), ("127.0.0.1", control)} <= tcp, tcp
            shm = shm_paths(pids)
            key = (
                [k for k, url in etcd_urls(fleet_etcd).items() if url == p.base_url] if etcd else []
            )

            os.kill(p.pid, signal.SIGTERM)
            sent = time.monotonic()
            if etcd:  # revoked: its lease (30 s, renewed every 10) cannot expire this soon
                assert key, "P's etcd record"
                wait_until(lambda: key[0] not in etcd_urls(fleet_etcd), 10, what="P's revoke")
            wait_until(lambda: not p.process.live_pids(), SIGTERM_EXIT_S, what="P to exit")
            exited = time.monotonic() - sent
            (out, answered) = parked.result(60)
            assert out.token_ids == expected[1]
            assert answered - sent < 5.0, f"D waited {answered - sent:.1f}s for a P shutting down"
            assert routed.result(60).token_ids == expected[2]
        assert p.process.returncode() == 0
        logged = logged_since(p, 0)
        assert "force killing" not in logged, logged[-3000:]  # vLLM killed nothing
        assert "vLLM is shutting down: 1 parked TransferKVs answered GONE" in logged, logged[-3000:]
        assert "connector closed" in logged, logged[-3000:]
        for host, tcp_port in sorted(tcp):
            assert tcp_port_closed(host, tcp_port), f"{host}:{tcp_port} still taken"
        for path in sorted(unix):
            assert unix_socket_closed(path), f"unix socket {path} still accepts"
        held_now = shm_held_by_anyone()
        left = {x for x in shm if os.path.exists(x)} | {
            f"/dev/shm/{x}" for x in set(os.listdir("/dev/shm")) - shm_before
        }
        assert not left - held_now, f"left in /dev/shm: {sorted(left - held_now)}"
        assert p.tmp_dir is not None and not list(p.tmp_dir.glob("rapidkv-*"))
        logging.getLogger(__name__).info("P exited %.1fs after its SIGTERM", exited)
    assert_back_to_baseline(pd_pair)


def router_process(pair: Pair, port: int, log_dir: Path) -> ManagedProcess:
    """`rapidkv router` in its own process (so that it can be killed), healthy."""
    argv = [
        sys.executable, "-m", "rapidkv", "router",
        "--prefill", f"{pair.p.base_url}={pair.p_control}",
        "--decode", f"{pair.d.base_url}={pair.d_control}",
        "--port", str(port), "--no-split-prefill",
    ]  # fmt: skip
    proc = ManagedProcess(argv, dict(os.environ), log_dir / f"router-{port}.log", name="router")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: router_healthy(url), 30, what="the router to start")
    except BaseException:
        proc.stop(grace=0)
        raise
    return proc


def test_a_router_killed_while_requests_run_leaves_nothing_and_a_new_one_serves(
    pd_pair: Pair, workloads: dict, tiny_model: Path, harness_log_dir: Path
) -> None:
    """Requests in flight when the router dies get a broken connection (the
    client's clear signal); vLLM aborts their P and D parts, whose connectors
    free everything within 3 s; a router started again on the same port serves
    with a real transfer."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    long = random_prompts(tiny_model, [900, 800, 700, 600], seed=2400)
    router = router_process(pd_pair, port, harness_log_dir)
    try:
        with ThreadPoolExecutor(len(long)) as pool:
            inflight = [pool.submit(complete_full, url, ids, 200, ignore_eos=True) for ids in long]
            wait_until(
                lambda: engine_gauge(pd_pair.d, "num_requests_running") >= 1, 30, what="D busy"
            )
            router.stop(grace=0)
            for f in inflight:
                with pytest.raises(httpx.TransportError):
                    f.result(30)
        assert_back_to_baseline(pd_pair, within=3.0)
        router = router_process(pd_pair, port, harness_log_dir)
        prompts, expected = workloads["router-restart"]
        served_with_transfer(pd_pair, url, prompts[0], expected[0])
    finally:
        router.stop(grace=0)
