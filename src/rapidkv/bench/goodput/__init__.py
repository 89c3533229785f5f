"""`rapidkv bench goodput`: the highest Poisson rate each configuration serves within SLOs.

On the same two instances (one per core) as `bench serve`, each configuration
(`common.groups.CONFIGS`) is swept over request rates on each workload
(`workloads`):

- *prefill-heavy*, prompts 128-900 tokens and 16 output tokens (`bench
  serve`'s), and *chat*, prompts 100-900 and 32-256 output tokens (by
  default: both); their configurations by default `single`, `dp2`, tuned
  `vllm-nixl` 1P1D, `rapidkv` fixed 1P1D, i.e. today's router in dual
  dispatch, and `rapidkv-adaptive`: the same P/D pair given to the router as
  two `--instance`s with `--placement adaptive`;
- *shared-prefix* (`common.shared_prefix`: 12 groups, each a 1024-token
  system prompt, each request its group's and a 30-60-token question; at
  each rate 32 requests sent first and not counted, `--rate-warm-up`) and
  *multiturn* (`common.multiturn`: ShareGPT conversations of 4 turns, one
  user each, every later turn sent a think time after the answer before it,
  its prompt the history with `single`'s answers); their configurations by
  default `dp2` and the adaptive router three ways: `rapidkv-adaptive-blind`
  (`--no-prefix-index`: placed as if no instance held a prefix),
  `rapidkv-kv-aware-nofetch` (`--no-prefix-fetch`: it counts each
  instance's hits, never fetches) and `rapidkv-adaptive` (hits and fetches
  from the instance holding a prefix). They are served with prefix caching
  on, every server's cache emptied (`/reset_prefix_cache`) before every rate
  of every configuration (and `single`'s c1), so that each starts cold
  (shared-prefix's then from its own warm-up), on every workload of the
  run; the rapidkv pair's servers publish vLLM's KV events
  (`--kv-events-config`, ZMQ on loopback ports), from which the adaptive
  routers keep their prefix index.

Groups are started one at a time, as in `bench serve` (never two serving at
once: 2 cores), each swept on every workload and stopped. `single` comes
first: per workload it serves every request once with `logprobs: 2` (the
reference, `serve.stats.Reference`, at the workload's longest `max_tokens`;
a request's reference is its prefix), then every request at c1, whose TTFT
and TPOT p50s give the workload's SLOs (`slo.derive`: TTFT SLO = 4x, TPOT
SLO = 1.5x, `--ttft-slo-factor`, `--tpot-slo-factor`; or given in ms,
`--ttft-slo-ms`, `--tpot-slo-ms`). The adaptive router is
started, per workload, with those SLOs as `--ttft-slo-ms`/`--tpot-slo-ms`
(`serve.configs.RunningGroup.start_front`), beside `rapidkv`'s router on the
same P/D pair, on core 0 with P and the client.

A sweep: after `--warmup` unmeasured requests per configuration and workload,
each rate (ascending) runs on every configuration in turn, their order
reversed at every other rate: every group is started before the sweep and
stopped after it, so that the machine's drift over the run falls on all
configurations alike (`--one-group-at-a-time`: each group started, swept and
stopped in turn, only its own configurations interleaved). A rate
sends all `--requests` of the workload once, open loop, at Poisson arrival
times (`arrivals`: the same seeded pattern at every rate and on every
configuration, scaled by the rate; `multiturn`: its conversations start at
rate / turns per second, `--requests` counts turns, rounded up to whole
conversations), greedy with `ignore_eos` so each request
yields exactly its `max_tokens`, streamed with `stream_options:
{"include_usage": true}` (`--no-include-usage`: without). Every output is compared with `single`'s
reference (hard mismatch / near-tie, `serve.stats.classify`).

Attainment at a rate = the share of its requests that completed, were no
hard mismatch and met both SLOs; goodput = the highest swept rate with
attainment >= 90 % and no miss at a lower rate (`slo`: how a non-monotonic
curve is read, and DistServe's literal rule reported beside it).

Output (`report`): tables per workload (stdout), a progress line (stderr),
`--json PATH|-` (`workloads.<w>.configs.<c>.goodput_req_s`, `.attainment`
per rate, `.rates.<rate>` with TTFT/TPOT p50/p90, requests, errors,
mismatches, the servers' prompt tokens by source and prefix-cache hit share,
and a rapidkv router's placements by kind and its prompt tokens hit, fetched
and computed (`router_counters`); the CPU model in `meta`) and `--plot PATH`
(`plot`: attainment against rate; with prefix caching, hits against rate).
The acceptance: `rapidkv-adaptive`'s goodput over the best baseline's
(`options.baselines`: `dp2`, `vllm-nixl`, `rapidkv` on the length
workloads; `dp2` and `rapidkv-adaptive-blind` on the shared prefixes). The
exit status is 1 on a
hard mismatch anywhere, no SLO for a workload, or `single` or a rapidkv
configuration failing or having a failed request; a baseline that fails is
reported, not fatal.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from rapidkv.bench.common.groups import CONFIGS
    from rapidkv.bench.common.options import add_numbers, add_served_options
    from rapidkv.bench.goodput.options import DEFAULT_CONFIGS, PREFIX_CONFIGS
    from rapidkv.bench.goodput.run import run
    from rapidkv.bench.goodput.workloads import DEFAULT_WORKLOADS, WORKLOADS

    def rates(attr: str) -> str:
        return "; ".join(
            f"{w.name} {','.join(f'{r:g}' for r in getattr(w, attr))}" for w in WORKLOADS.values()
        )

    parser.description = (__doc__ or "").split("\n\n")[0]
    add = parser.add_argument
    add(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: %(default)s; "
        "shared-prefix and multiturn are served with prefix caching on, every cache emptied "
        "before every rate, on every workload of the run; multiturn replays ShareGPT's "
        "conversations whatever --dataset is)",
    )
    add(
        "--configs",
        default=None,
        help=f"comma-separated, of {', '.join(CONFIGS)} (default: {','.join(DEFAULT_CONFIGS)} "
        f"for prefill-heavy and chat, {','.join(PREFIX_CONFIGS)} for shared-prefix and "
        "multiturn, those of every workload of the run; `single` runs anyway, for the "
        "references and the SLOs)",
    )
    add(
        "--rates",
        action="append",
        default=None,
        metavar="[WORKLOAD=]R,R,...",
        help="req/s, comma-separated, for every workload, or for the one named (repeatable; "
        f"a named list wins; default: {rates('default_rates')}; with --quick: "
        f"{rates('quick_rates')})",
    )
    add(
        "--requests",
        type=int,
        default=None,
        help="requests per rate (default 40; 8 quick; multiturn: rounded up to whole "
        "conversations)",
    )
    add(
        "--warmup",
        type=int,
        default=None,
        help="unmeasured requests per configuration and workload (2; 1 quick)",
    )
    add(
        "--rate-warm-up",
        type=int,
        default=None,
        help="shared-prefix: requests sent at each rate, after the caches are emptied, "
        "before the measured ones, not counted (32; 4 quick)",
    )
    add("--seed", type=int, default=0, help="prompts, max_tokens and arrivals (%(default)s)")
    add_numbers(
        parser,
        float,
        (
            ("--ttft-slo-factor", 4.0, "TTFT SLO = this x single's c1 TTFT p50 (%(default)s)"),
            ("--tpot-slo-factor", 1.5, "TPOT SLO = this x single's c1 TPOT p50 (%(default)s)"),
            ("--ttft-slo-ms", None, "TTFT SLO in ms, the same in every run (not the factor)"),
            ("--tpot-slo-ms", None, "TPOT SLO in ms, the same in every run (not the factor)"),
        ),
    )
    add("--quick", action="store_true", help="8 requests per rate, 2 rates, 1 warm-up")
    add("--timeout", type=float, default=60.0, help="per request, seconds (%(default)s)")
    add(
        "--router-args",
        default="",
        help="extra arguments for the adaptive router, one string: --router-args='--flag value'",
    )
    add(
        "--one-group-at-a-time",
        action="store_true",
        help="start, sweep and stop each group in turn (default: every group up at once, each "
        "rate run on every configuration in turn, so that the machine's drift falls on all)",
    )
    add_served_options(parser)
    return run
