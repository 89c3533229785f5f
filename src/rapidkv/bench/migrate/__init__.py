"""`rapidkv bench migrate`: a decoding request's downtime when moved, pre-copy vs stop-and-copy.

Two vLLM instances with RapidKVConnector as `kv_both` (A on core 0, B on core
1; prefix caching on, `VLLM_SERVER_DEV_MODE` for `/reset_prefix_cache`), the
rapidkv router over them as two `--instance`s in local dispatch with an admin
token (a process of its own on core 0, beside A and this client, as in the
other benchmarks).

For each sequence length (`--lengths`; one longer than the model allows with
`--max-tokens` of output is cut to the longest that fits), per round: a fresh
random prompt of that length is streamed once unmigrated through the router
(the reference), then once per mode (`precopy`, and `stop-and-copy`: the
router's `"precopy": false`, stop, copy everything, resume), greedy with
`ignore_eos` and token ids. After `--migrate-after` tokens the client orders
`POST /admin/migrate` to the other instance; `--gap-tokens` after that cut-over
it orders the request back. Before each migration the destination's prefix
cache is reset (it would otherwise hold the prompt from the reference, or the
request's own blocks on the way back, and load less than a migration must).

Measured per migration (`report`): the client's downtime (its last token from
the source to its first from the destination: the arrival of token
`tokens_at_cutover` minus that of the one before), the router's answer
(`downtime_ms`, `cutover_ms`, `precopy_ms`, ...), the KV loaded before and at
the cut-over (tokens x `kv_bytes_per_token`; checked against the destination's
`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`), the
destination's decode step (the client's inter-token gaps after the cut-over),
and from the destination connector's timeline (one monotonic clock on the
machine) where the downtime went: until the destination admitted the
continuation, its TransferKV, the delta's transfer, its first token. Every
output is compared with the reference, token for token.

`--netns-link RATE` runs A and B in two network namespaces joined by a veth
pair capped at RATE (`harness.netns`), control plane and KV on their link
addresses: the migrations' KV crosses the cap as it would cross a network
between two hosts, while the router and the client reach both uncapped.

Output: a table and the acceptance (stdout), a progress line (stderr),
`--json PATH|-` and `--plot PATH` (`plot`). Exit status 1 on a mismatch, a
failed migration or a run that did not complete; the acceptance is printed,
not enforced.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from rapidkv.bench.common.options import add_numbers, add_served_options
    from rapidkv.bench.migrate.run import DEFAULT_LENGTHS, MODES, run

    parser.description = (__doc__ or "").split("\n\n")[0]
    add = parser.add_argument
    add(
        "--lengths",
        default=None,
        help=f"prompt lengths, tokens, comma-separated (default {DEFAULT_LENGTHS}; one that "
        "does not fit with --max-tokens is cut to the longest that does; --quick: 128)",
    )
    add(
        "--modes",
        default=",".join(MODES),
        help="comma-separated, of %(default)s (default: both)",
    )
    add("--rounds", type=int, default=None, help="prompts per length (default 12; --quick 1)")
    add_numbers(
        parser,
        int,
        (
            ("--warmup-rounds", 1, "unmeasured rounds at the shortest length first (%(default)s)"),
            ("--max-tokens", 128, "output tokens per request (%(default)s)"),
            ("--migrate-after", 16, "tokens before the first migration is ordered (%(default)s)"),
            (
                "--gap-tokens",
                32,
                "tokens after a cut-over before the request is ordered back (%(default)s); "
                "the destination's decode step is measured over them",
            ),
        ),
    )
    add("--seed", type=int, default=0, help="prompts (%(default)s)")
    add("--timeout", type=float, default=120.0, help="per request, seconds (%(default)s)")
    add(
        "--netns-link",
        default=None,
        metavar="RATE",
        help="run A and B in two network namespaces joined by a veth capped at RATE (tc "
        "tbf, e.g. 1gbit): the migrations' KV crosses it, as between two hosts (root)",
    )
    add("--quick", action="store_true", help="one length (128), one round: a smoke run")
    add_served_options(parser, include_usage=False, servers="both servers")
    return run
