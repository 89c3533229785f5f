"""Whatever one vLLM answers, the router answers the same.

Every shape of `conformance.SHAPES` (completions and chat, streamed or not, with
usage, sampling, logprobs, batches, n > 1, structured output, tools, errors,
the Responses API, tokenize) is sent with the official `openai` SDK to the
reference single instance (`workloads["conformance"]`, before the pair started)
and through a router over the shared P/D pair: with its defaults (dual
dispatch, split prefill, P's first token stitched), and with migration on (an
admin token: streams relayed event by event, whole answers assembled). Tiny
model, float32, greedy or seeded: the answers must be identical (logprobs
within rounding), errors of the same status and type.
"""

from __future__ import annotations

import pytest
from conformance import SHAPES, differences, run
from pd_harness import Pair, assert_back_to_baseline

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROUTERS = {"defaults": {}, "migration-on": {"admin_token": "conformance-admin-token"}}


@pytest.mark.parametrize("variant", list(ROUTERS))
def test_the_router_answers_every_shape_as_one_vllm_does(
    pd_pair: Pair, workloads: dict, variant: str
) -> None:
    from rapidkv.router.config import Instance, RouterConfig
    from rapidkv.router.server import start_router

    model, reference = workloads["conformance"]
    config = RouterConfig(
        prefill=(Instance(pd_pair.p.base_url),),
        decode=(Instance(pd_pair.d.base_url, pd_pair.d_control),),
        port=0,
        **ROUTERS[variant],
    )
    failures = []
    with start_router(config) as router:
        for shape in SHAPES:
            want, got = reference[shape.name], run(router.url, model, shape)
            diff = differences(want, got)
            if diff:
                failures.append(f"{shape.name}: " + "; ".join(diff[:4]))
    assert not failures, "\n".join(failures)
    assert_back_to_baseline(pd_pair)


def test_the_reference_answers_are_what_the_shapes_ask_for(workloads: dict) -> None:
    """The table exercises what it names: errors are errors, batches and n > 1
    give several choices, seeded sampling differs from greedy."""
    _, reference = workloads["conformance"]
    for name, answer in reference.items():
        assert (answer["status"] >= 400) == name.startswith("error-"), (name, answer)
    assert reference["error-n3-greedy"]["status"] == 400  # vLLM refuses it
    assert len(reference["completion-batch"]["answer"]["choices"]) == 2
    assert len(reference["completion-batch-n2-seeded"]["answer"]["choices"]) == 4
    assert list(reference["chat-n2-seeded-stream"]["answer"]["choices"]) == [0, 1]
    n2 = reference["completion-n2-seeded"]["answer"]["choices"]
    assert n2[0]["text"] != n2[1]["text"]  # two samples, two seeds
    usage = reference["completion-batch-token-ids-stream"]["answer"]["usage"]
    assert usage["prompt_tokens"] == 9
    continuous = reference["chat-stream-continuous-usage"]["answer"]["choices"][0]["usages"]
    assert len(continuous) > 1
    named = reference["chat-tool-named-stream"]["answer"]["choices"][0]["delta"]["tool_calls"]
    assert list(named) == [0] and named[0]["function"]["name"] == "get_weather", named
    assert named[0]["function"]["arguments"], named  # the deltas' pieces, merged
