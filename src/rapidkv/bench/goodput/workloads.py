"""`rapidkv bench goodput`: the workloads it sweeps, by name, and their requests.

- the request length workloads (`common.workloads`: `prefill-heavy`, `chat`),
  served with prefix caching off unless a workload below runs too;
- `shared-prefix` (`common.shared_prefix`) and `multiturn`
  (`common.multiturn`), whose requests share prefixes: served with prefix
  caching on, every server's cache emptied before every rate.

`requests_of` turns one into a `results.WorkloadRun`: its prompts (none yet
for `multiturn`, whose prompts the reference pass makes), `max_tokens`,
which requests follow another and the think time before them, and
`shared-prefix`'s warm-up (`SharedPrefix.warm_up`: the first requests of
its plan, sent at each rate before the measured ones and not counted).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rapidkv.bench.common.multiturn import MULTITURN, Multiturn
from rapidkv.bench.common.shared_prefix import SHARED_PREFIX, SharedPrefix
from rapidkv.bench.common.workloads import WORKLOADS as LENGTH_WORKLOADS
from rapidkv.bench.goodput.results import WorkloadRun

WORKLOADS: dict[str, Any] = {
    **LENGTH_WORKLOADS,
    SHARED_PREFIX.name: SHARED_PREFIX,
    MULTITURN.name: MULTITURN,
}
"""Every workload by name: a `workloads.Workload`, `SharedPrefix` or `Multiturn`."""
DEFAULT_WORKLOADS = tuple(LENGTH_WORKLOADS)
"""`--workloads`' default."""


def requests_of(
    name: str,
    model_dir: Path,
    requests: int,
    seed: int,
    dataset: str,
    warm_up: int | None = None,
) -> WorkloadRun:
    """Workload `name`'s requests for `--requests requests`, drawn from `seed`,
    of `dataset`'s text (`multiturn`: ShareGPT's conversations whatever it is);
    `warm_up`: `shared-prefix`'s warm-up at each rate (None: its `warm_up`)."""
    from rapidkv.bench.common.dataset import prompts_of_lengths
    from rapidkv.bench.common.multiturn import multiturn_conversations
    from rapidkv.bench.common.shared_prefix import shared_prefix_prompts
    from rapidkv.bench.goodput.options import ARRIVAL_SALT

    w = WORKLOADS[name]
    arrival_seed = w.seed(seed) + ARRIVAL_SALT
    if isinstance(w, Multiturn):
        conversations = multiturn_conversations(w, model_dir, requests, seed)
        return WorkloadRun(
            name,
            tuple(conversations.max_tokens),
            [],
            arrival_seed,
            conversations=conversations,
            follows=w.follows(requests),
            think_s=w.think_times(requests, seed),
        )
    if isinstance(w, SharedPrefix):
        if warm_up is not None:
            w = dataclasses.replace(w, warm_up=warm_up)
        plan = w.plan(w.requests_with_warm_up(requests), seed)
        prompts = shared_prefix_prompts(w, model_dir, plan, w.seed(seed), dataset)
        k = w.warm_up
        return WorkloadRun(
            name,
            plan.max_tokens[k:],
            prompts[k:],
            arrival_seed,
            warm_prompts=prompts[:k],
            warm_max_tokens=plan.max_tokens[:k],
        )
    plan = w.plan(requests, seed)
    prompts = prompts_of_lengths(model_dir, plan.prompt_lens, w.seed(seed), dataset)
    return WorkloadRun(name, plan.max_tokens, prompts, arrival_seed)
