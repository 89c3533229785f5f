"""`rapidkv bench serve`: rapidkv next to a single vLLM, vLLM's NIXL connectors and dp2.

For each model, the configurations (`configs.CONFIGS`) are served one
server group after another (never two groups serving at once: 2 cores), each
group started, warmed up, measured under every load (`loads`) and stopped;
only `single` may stay up beside the others, idle between its blocks (Pairing).
All of them get the same seeded requests (`dataset`: random token ids of
lengths uniform in [--min-len, --max-len], or ShareGPT's first questions).
Prefix caching is on, as vLLM's default, and every server's cache is emptied
(`/reset_prefix_cache`) before each load, so that a load measures what its
own requests share (a chat template's system prompt) and not an earlier
load's prompts; `--no-prefix-caching` turns it off everywhere.

An endpoint already running (`--base-url URL`): nothing is started; the loads
run against it as against a configuration (named `endpoint`, or the one
`--configs` names), with the same statistics, table and JSON; `--reference-url`
names a plain vLLM instance for the correctness check. CPU time, engine TTFT
and prompt-token counts need the servers' processes or vLLM's `/metrics`, so
they are shown where the endpoint is itself a vLLM instance, and `-` elsewhere.

Correctness: before anything is measured, the `single` instance serves every
prompt once with `logprobs: 2` (the reference: greedy tokens and the
top-2 margin at each position, `stats.Reference`); every output of every
configuration and load, `single`'s own included, is compared with it.

Rounds (`--rounds N`): the whole sequence of groups is run N times, in reverse
order every other round, each round starting every group afresh, so slow drift
of this shared machine spreads over all configurations rather than landing on
one. Configurations that share a group (every rapidkv one) are interleaved load
by load. Samples of all rounds are pooled; per-round p50s are kept in the JSON.

Pairing (`--pair-block N`, default 8; at `c1` only): the TPOT ratio to
`single` compares rapidkv's decode with `single`'s, a few per cent apart, on a
shared machine whose speed drifts by more than that within a minute (the same
command gave `single` TPOT p50s 20 % apart, half a minute apart). The
configurations marked `paired` (`rapidkv` and the no-op connector) are
therefore measured at `c1` in blocks of N prompts, each followed by the same
block, under the same load and seed, on `single`, which stays up beside every
group of the round (idle, it costs ~1.5 % of a core: vLLM's engine and worker
busy-wait on their queues only for 1 s after their last step, so every block
waits `PAIR_PAUSE_S` for the other side to go quiet; block order alternates).
Those `single` samples are the configuration's `paired_single`; the unpaired
ratio stays in the JSON beside it. Deeper loads run whole: blocks would each
start empty and drain, which no unpaired baseline (`dp2`, `vllm-nixl`) does.

Separate hosts (`--netns-link RATE`): rapidkv's P runs in one Linux network
namespace and D in another, joined by a veth pair capped at RATE
(`harness.netns`); their control and data planes (NIXL/UCX over TCP on that
interface) cross it, the routers and the client reach both from the root
namespace over uncapped veths. The other groups that run (`single`,
`single-noop-connector`, `dp2`) are single-host configurations and run as
always; vLLM's NIXL baselines are refused (not placed across namespaces). The
JSON's `meta.netns_link` has the link and one plain TCP stream's throughput
across it.

Output (`report`): a summary table (stdout), a progress line (stderr),
`--json PATH|-`, `--plot PATH` (`plot`) and `--trace PATH` (one JSON
line per request, with the rapidkv router's `xfer_id` to join server-side
timelines, then per load and rapidkv role a line of that engine's steps;
`timeline` turns them into the TTFT stages and the per-step breakdown). The
exit status is 1 on a hard mismatch anywhere, or if `single`
or a rapidkv configuration failed to start or had a failed request; a
baseline that fails (dp2, vLLM's NIXL connectors) is reported, not fatal.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from rapidkv.bench.common.dataset import DATASETS, SHAREGPT_MAX_TOKENS
    from rapidkv.bench.common.groups import CONFIGS
    from rapidkv.bench.common.options import add_served_options
    from rapidkv.bench.serve.options import (
        DEFAULT_LOADS,
        DEFAULT_MODELS,
        MODELS,
        NETNS_DEFAULT_CONFIGS,
        QUICK_LOADS,
    )
    from rapidkv.bench.serve.run import run

    parser.description = (__doc__ or "").split("\n\n")[0]
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated: {', '.join(MODELS)} (built on first use: the random-weight "
        "test models, SmolLM2-135M-Instruct from its package) or a checkpoint's directory "
        "(%(default)s)",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated, of {', '.join(CONFIGS)} (default: "
        f"{','.join(name for name, c in CONFIGS.items() if c.default)}; "
        f"with --netns-link: {','.join(NETNS_DEFAULT_CONFIGS)})",
    )
    parser.add_argument(
        "--netns-link",
        metavar="RATE",
        default=None,
        help="rapidkv's P and D in two network namespaces joined by a veth capped at RATE "
        "(tc rate: 1gbit, 500mbit, ...), as on two hosts; needs root",
    )
    parser.add_argument(
        "--loads",
        default=None,
        help="comma-separated cN (concurrency N: c1, c4, c16, c32, ...) / poissonR (R req/s); "
        f"default {DEFAULT_LOADS} ({QUICK_LOADS} with --quick). A paired configuration's "
        "blocks hold --pair-block prompts: at most that many in flight",
    )
    parser.add_argument("--requests", type=int, default=None, help="prompts (default 64; 8 quick)")
    parser.add_argument("--min-len", type=int, default=128, help="shortest prompt, tokens")
    parser.add_argument("--max-len", type=int, default=900, help="longest prompt, tokens")
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default="random",
        help="random token-id prompts, or ShareGPT's first questions through the chat "
        "template (vLLM's sampling; --max-len caps the prompt)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="output tokens per request (random: 16); sharegpt: the first answer's length, "
        f"at most this ({SHAREGPT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every group N times, in reverse order every other round (servers restarted)",
    )
    parser.add_argument(
        "--pair-block",
        type=int,
        default=8,
        help="prompts per block of a paired configuration, each followed by the same block "
        "on `single` (0: no pairing; default %(default)s)",
    )
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured requests (2; 1 quick)")
    parser.add_argument("--quick", action="store_true", help="8 prompts, loads c1,c4, 1 warm-up")
    parser.add_argument("--seed", type=int, default=0, help="prompts and Poisson arrivals")
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="start every server with --no-enable-prefix-caching (default: vLLM's default, "
        "prefix caching on, every cache emptied before each load)",
    )
    parser.add_argument(
        "--base-url",
        metavar="URL",
        default=None,
        help="measure this endpoint, already running (your router or vLLM), with the same "
        "loads, statistics and JSON; nothing is started. --models names what it serves "
        "(tokenizer and prompts), --configs at most one name for its rows",
    )
    parser.add_argument(
        "--reference-url",
        metavar="URL",
        default=None,
        help="with --base-url: one plain vLLM instance of the same model whose greedy outputs "
        "every answer is checked against (else not checked)",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="per request, seconds (%(default)s)"
    )
    add_served_options(parser, model=False, trace="per-request JSONL")
    return run
