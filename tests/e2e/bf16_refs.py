"""test_pd_bf16's prompts and the single bf16 SmolLM2 instance's answers to them,
with the top-2 logprob margins that classify a mismatch (`conftest`'s
`late_references` takes them beside SmolLM2's float32 ones)."""

from __future__ import annotations

from pathlib import Path

from rapidkv.bench.common.reference import Reference, margins_from_logprobs
from rapidkv.harness import ServerSpec, random_prompts
from rapidkv.harness.client import complete_many_full

MAX_TOKENS = 16
QUESTIONS = 6  # ShareGPT's, through the chat template
BOUNDARIES = [5, 127, 128, 129, 256, 257, 700]  # random token ids of these lengths
CONCURRENCY = (1, 4)  # test_pd_bf16's loads: each its own prompts


def model() -> Path:
    from rapidkv.models.smollm2 import ensure_smollm2

    return ensure_smollm2("bfloat16")


def single_spec(cpu: int) -> ServerSpec:
    """The reference instance: stock vLLM (no connector), bf16, on core `cpu`."""
    return ServerSpec(model=model(), name="single-bf16", cpus=(cpu,))


def prompts_for(seed: int) -> list[list[int]]:
    """ShareGPT questions and boundary-length token ids, the longest first: the
    reference is stock vLLM, whose own first forward must be large enough for
    oneDNN to ask for AMX on its behalf (see test_pd_bf16's module doc)."""
    from rapidkv.bench.common.dataset import sharegpt_workload

    m = model()
    questions = sharegpt_workload(m, QUESTIONS, 600, MAX_TOKENS, seed).prompts
    prompts = questions + random_prompts(m, BOUNDARIES, seed=seed)
    return sorted(prompts, key=len, reverse=True)


def prepare() -> dict[int, list[list[int]]]:
    """Per concurrency of `CONCURRENCY`, its prompts (D's prefix cache must not
    serve them), drawn and tokenized in the caller's thread (transformers'
    lazy imports are not safe from two threads at once)."""
    return {c: prompts_for(seed=1700 + c) for c in CONCURRENCY}


def take(
    base_url: str, asked: dict[int, list[list[int]]]
) -> dict[int, tuple[list[list[int]], list[Reference]]]:
    """Per concurrency, its prompts (`prepare`) and the answers of the single
    instance at `base_url`, one request at a time, each with its top-2
    margins."""
    cases = {}
    for c, prompts in asked.items():
        done = complete_many_full(
            base_url, prompts, MAX_TOKENS, logprobs=2, return_tokens_as_token_ids=True
        )
        top = [(x.raw["choices"][0].get("logprobs") or {})["top_logprobs"] for x in done]
        refs = [
            Reference(tuple(x.token_ids), margins_from_logprobs(t))
            for x, t in zip(done, top, strict=True)
        ]
        cases[c] = (prompts, refs)
    return cases
