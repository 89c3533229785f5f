"""The correctness oracle's foundation: a single vLLM instance is deterministic.

Later tests compare disaggregated output with a single instance's, token for
token. That only proves something if a single instance (tiny float32 model,
greedy, token-id prompts) gives the same tokens for the same prompt whatever
happens around it: repeated requests, a restart, concurrent requests batched
together, chunked versus one-shot prefill. And equal outputs prove little if all
outputs look alike, so we also check they depend on the prompt and vary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rapidkv.harness import (
    Iteration,
    ServerPool,
    VLLMServer,
    complete,
    complete_many,
    random_prompts,
    read_iterations,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_TOKENS = 24
SHORT_LENGTHS = [17, 23, 31, 40, 55, 64, 90, 120]  # < one 128-token block: no prefix hits
LONG_LENGTHS = [300, 517, 700, 900]  # 900 + 24 <= max-model-len 1024


def _steps_since(
    server: VLLMServer, start: int, *, context_tokens: int = 0, generation_tokens: int = 0
) -> list[Iteration]:
    """The steps `server` logged after its first `start` ones, once they account for
    at least the given prefill and decode work (log lines trail the responses)."""

    def logged() -> list[Iteration] | None:
        steps = read_iterations(server.log_path)[start:]
        ctx = sum(i.context_tokens for i in steps)
        gen = sum(i.generation_tokens for i in steps)
        return steps if ctx >= context_tokens and gen >= generation_tokens else None

    return wait_until(logged, 30, what=f"{server.spec.name} to log its steps")


def _n_steps(server: VLLMServer) -> int:
    return len(read_iterations(server.log_path))


def _assert_informative(outputs: list[list[int]]) -> None:
    """Outputs that make equality meaningful: full length, prompt-dependent, varied.

    A random-weight model sometimes falls into a short loop after a few tokens
    (seen on long prompts), so the bar is: no output is (nearly) one repeated
    token, and across all outputs at least half the tokens are distinct.
    """
    assert all(len(o) == MAX_TOKENS for o in outputs)
    assert len({tuple(o) for o in outputs}) == len(outputs), "different prompts, same output"
    for o in outputs:
        assert len(set(o)) >= 4, f"output is nearly one repeated token: {o}"
    distinct = len({t for o in outputs for t in o})
    assert distinct >= len(outputs) * MAX_TOKENS // 2, f"outputs too repetitive: {outputs}"


def test_same_prompt_same_tokens_on_repeat(single_server: VLLMServer, tiny_model: Path) -> None:
    prompts = random_prompts(tiny_model, [33, 77], seed=1)
    first = [complete(single_server.base_url, p, MAX_TOKENS) for p in prompts]
    _assert_informative(first)
    for _ in range(3):
        again = [complete(single_server.base_url, p, MAX_TOKENS) for p in prompts]
        assert again == first


def test_concurrency_1_and_4_agree(single_server: VLLMServer, tiny_model: Path) -> None:
    prompts = random_prompts(tiny_model, SHORT_LENGTHS, seed=2)
    decode_work = len(prompts) * (MAX_TOKENS - 1)  # the first token comes from prefill

    n0 = _n_steps(single_server)
    serial = complete_many(single_server.base_url, prompts, MAX_TOKENS, concurrency=1)
    serial_steps = _steps_since(single_server, n0, generation_tokens=decode_work)
    n1 = _n_steps(single_server)
    batched = complete_many(single_server.base_url, prompts, MAX_TOKENS, concurrency=4)
    batched_steps = _steps_since(single_server, n1, generation_tokens=decode_work)

    # The two runs really had different batch shapes.
    assert max(i.generation_requests for i in serial_steps) == 1
    assert max(i.generation_requests for i in batched_steps) >= 2
    _assert_informative(serial)
    assert batched == serial


def test_chunked_prefill_agrees_with_one_shot(
    single_server: VLLMServer, single_server_chunked: VLLMServer, tiny_model: Path
) -> None:
    prompts = random_prompts(tiny_model, LONG_LENGTHS, seed=3)  # fresh: no prefix-cache hits
    chunk = 256
    assert f"--max-num-batched-tokens {chunk}" in " ".join(single_server_chunked.spec.extra_args)

    n0, m0 = _n_steps(single_server), _n_steps(single_server_chunked)
    one_shot = complete_many(single_server.base_url, prompts, MAX_TOKENS)
    chunked = complete_many(single_server_chunked.base_url, prompts, MAX_TOKENS)
    one_shot_steps = _steps_since(single_server, n0, context_tokens=sum(LONG_LENGTHS))
    chunked_steps = _steps_since(single_server_chunked, m0, context_tokens=sum(LONG_LENGTHS))

    # Default: each prompt prefilled in one step. Chunked: never more than one
    # chunk per step, and every prompt took several steps.
    assert max(i.context_tokens for i in one_shot_steps) == max(LONG_LENGTHS)
    assert max(i.context_tokens for i in chunked_steps) == chunk
    prefill_steps = sum(1 for i in chunked_steps if i.context_tokens > 0)
    assert prefill_steps >= sum(-(-n // chunk) for n in LONG_LENGTHS)

    _assert_informative(one_shot)
    assert chunked == one_shot


def test_same_tokens_after_restart(
    server_pool: ServerPool, single_server: VLLMServer, tiny_model: Path
) -> None:
    prompts = random_prompts(tiny_model, [29, 101, 400], seed=4)
    before = complete_many(single_server.base_url, prompts, MAX_TOKENS)
    _assert_informative(before)
    old_pid = single_server.pid
    old_tmp = single_server.tmp_dir
    # vLLM's IPC sockets live in the server's own TMPDIR, not in the shared one
    assert old_tmp is not None and any(old_tmp.iterdir())

    (restarted,) = server_pool.restart("single")

    assert restarted.running and restarted.pid != old_pid
    assert not single_server.running
    assert not old_tmp.exists()  # removed with the stopped tree
    assert restarted.tmp_dir is not None and any(restarted.tmp_dir.iterdir())
    after = complete_many(restarted.base_url, prompts, MAX_TOKENS)
    assert after == before
