"""`bench goodput`'s workloads of shared prefixes: `shared-prefix` (groups
behind one system prompt each) and `multiturn` (conversations by users who
think between turns), and the arrivals of conversations."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from rapidkv.bench.common.arrivals import offered_rate, poisson_arrivals, session_arrivals
from rapidkv.bench.common.multiturn import MULTITURN, Multiturn
from rapidkv.bench.common.shared_prefix import SHARED_PREFIX, SharedPrefix, shared_prefix_prompts
from rapidkv.bench.common.workloads import MAX_MODEL_LEN

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- shared-prefix


def test_shared_prefix_is_groups_of_long_system_prompts_and_short_questions() -> None:
    w = SHARED_PREFIX
    assert (w.groups, w.system_len, w.min_question, w.max_question) == (12, 1024, 30, 60)
    assert w.system_len % 128 == 0  # whole blocks of vLLM-CPU's prefix cache
    # the system prompts exceed one SmolLM2 bf16 instance's 90 cached blocks, fit two
    assert 90 < w.groups * w.system_len // 128 <= 180
    assert w.max_len + w.max_tokens <= MAX_MODEL_LEN
    assert list(w.default_rates) == sorted(w.default_rates) and len(w.quick_rates) == 2
    assert w.prefix_caching and w.requests(40) == 40
    assert w.warm_up == 32 and w.requests_with_warm_up(40) == 72


def test_a_shared_prefix_plan_is_seeded_within_its_bounds_and_prefix_stable() -> None:
    w = SHARED_PREFIX
    plan = w.plan(200, seed=5)
    assert plan == w.plan(200, seed=5) and plan != w.plan(200, seed=6)
    assert set(plan.groups) == set(range(12))  # every group drawn, each request's at random
    assert all(30 <= n <= 60 for n in plan.question_lens)
    assert all(16 <= m <= 32 for m in plan.max_tokens)
    short = w.plan(10, seed=5)
    assert short.groups == plan.groups[:10] and short.question_lens == plan.question_lens[:10]


def test_a_request_is_its_group_s_system_prompt_then_its_own_question() -> None:
    w = SharedPrefix("t", "", groups=2, system_len=3, min_question=1, max_question=2,
                     min_tokens=1, max_tokens=1)  # fmt: skip
    plan = w.plan(6, seed=1)
    lengths = w.text_lengths(plan)
    assert lengths[:2] == [3, 3] and lengths[2:] == list(plan.question_lens)
    texts = [[g * 10 + k for k in range(n)] for g, n in enumerate(lengths)]
    prompts = w.prompts(plan, texts)
    for i, (g, p) in enumerate(zip(plan.groups, prompts, strict=True)):
        assert p[:3] == texts[g] and p[3:] == texts[2 + i]
    with pytest.raises(ValueError):
        w.prompts(plan, texts[:-1])
    with pytest.raises(ValueError):
        SharedPrefix("t", "", 0, 3, 1, 2, 1, 1)


def test_shared_prefix_prompts_share_exactly_their_group_s_system_prompt(
    tiny_model: Path,
) -> None:
    w = SHARED_PREFIX
    plan = w.plan(12, seed=3)
    prompts = shared_prefix_prompts(w, tiny_model, plan, w.seed(3), "random")
    assert prompts == shared_prefix_prompts(w, tiny_model, plan, w.seed(3), "random")
    systems = {}
    for g, n, p in zip(plan.groups, plan.question_lens, prompts, strict=True):
        assert len(p) == 1024 + n
        assert systems.setdefault(g, p[:1024]) == p[:1024]
    assert len({tuple(s[:8]) for s in systems.values()}) == len(systems)  # groups differ


# ---------------------------------------------------------------- multiturn


def test_multiturn_is_whole_conversations_of_turns_that_follow() -> None:
    w = MULTITURN
    assert w.turns == 4 and w.prefix_caching
    assert w.max_len + w.answer_cap <= MAX_MODEL_LEN
    assert w.conversations(40) == 10 and w.requests(40) == 40
    assert w.conversations(6) == 2 and w.requests(6) == 8  # rounded up to whole ones
    assert w.requests(1) == 4
    assert w.follows(8) == [False, True, True, True] * 2
    with pytest.raises(ValueError):
        Multiturn("m", "", turns=1, max_len=10, answer_cap=4, think_s=1.0)


def test_users_think_between_turns_seeded_the_same_at_every_rate() -> None:
    w = MULTITURN
    think = w.think_times(40, seed=2)
    assert think == w.think_times(40, seed=2) and think != w.think_times(40, seed=3)
    for f, t in zip(w.follows(40), think, strict=True):
        assert (t == 0.0) if not f else (0.5 <= t <= 1.5)
    assert len(set(think)) > 20  # drawn per turn


def test_multiturn_conversations_fit_the_servers_context(tiny_model: Path) -> None:
    from rapidkv.bench.common.multiturn import multiturn_conversations

    conv = multiturn_conversations(MULTITURN, tiny_model, 6, seed=0)
    assert len(conv.exchanges) == 2 and conv.turns == 4
    assert conv.follows() == MULTITURN.follows(6)
    assert len(conv.max_tokens) == 8 and all(4 <= m <= 64 for m in conv.max_tokens)
    # the last turn's prompt, with answers as long as their caps (words: a bound)
    answers = [["word " * m for m in conv.max_tokens[c * 4 : c * 4 + 3]] for c in range(2)]
    for c in range(2):
        assert len(conv.prompt(c, 3, answers[c])) <= MAX_MODEL_LEN - 64


# ---------------------------------------------------------------- arrivals


def test_conversations_start_at_poisson_times_so_that_requests_keep_the_rate() -> None:
    follows = [False, True, True, True] * 10
    a = session_arrivals(follows, 2.0, seed=4)
    starts = [t for t in a if not math.isnan(t)]
    assert len(starts) == 10 and all(math.isnan(t) for t, f in zip(a, follows, strict=True) if f)
    # 10 conversations of 4 turns at 2 req/s: they start at 0.5 per second
    assert starts == pytest.approx(poisson_arrivals(10, 0.5, seed=4))
    assert offered_rate(a) == pytest.approx(2.0)
    assert all(x < y for x, y in itertools.pairwise(starts))
    # none following: the plain arrivals, exactly
    assert session_arrivals([False] * 7, 3.0, seed=1) == poisson_arrivals(7, 3.0, seed=1)
