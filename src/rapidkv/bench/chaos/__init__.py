"""`rapidkv bench chaos`: a soak through the router with every fault we can cause.

A P/D pair (RapidKVConnector, P on core 0, D on core 1) behind the rapidkv
router in dual dispatch serves a mixed workload (`workload`: prompt lengths,
`max_tokens`, streamed or not) at a fixed concurrency (`driver`), while

- the client gives up on some requests at every phase (right after sending,
  mid-prefill, mid-transfer, mid-decode);
- P's connector fails a share of its transfers and delays the sends of the
  others (`debug_fail_transfer_rate`, `debug_send_delay_s`: `kvt.faults`);
- P and then D are killed (SIGKILL) and started again on their addresses, and
  the time from each being healthy again to its first request served with a
  real transfer is measured (`faults`).

Every completed output is checked token for token against one plain vLLM
instance (`single`, run first, or the one `--reference-url` names); after the
run the pair is quiesced and each instance's free blocks, vLLM's
running/waiting and the connector's gauges are read (`run`). `report` prints a
summary and the JSON, and says whether the run passed: no hung request, no
leaked block, no mismatch, every failure a clear error
(docs/benchmarks/chaos.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from rapidkv.bench.chaos.run import run
    from rapidkv.bench.common.options import add_numbers, add_served_options

    parser.description = (__doc__ or "").split("\n\n")[0]
    add = parser.add_argument
    add("--requests", type=int, default=500, help="requests in the run (%(default)s)")
    add("--concurrency", type=int, default=8, help="requests in flight (%(default)s)")
    add("--min-len", type=int, default=5, help="shortest prompt, tokens (%(default)s)")
    add("--max-len", type=int, default=900, help="longest prompt, tokens (%(default)s)")
    add("--min-tokens", type=int, default=4, help="fewest max_tokens (%(default)s)")
    add("--max-tokens", type=int, default=48, help="most max_tokens (%(default)s)")
    add("--stream-share", type=float, default=0.5, help="share streamed (%(default)s)")
    add_numbers(
        parser,
        float,
        (
            ("--abort-share", 0.2, "share the client aborts, at a random phase (%(default)s)"),
            (
                "--fail-rate",
                0.05,
                "share of transfers P fails on purpose (debug_fail_transfer_rate, %(default)s)",
            ),
            (
                "--send-delay",
                0.1,
                "P holds each transfer's sends up to this long, s "
                "(debug_send_delay_s, %(default)s)",
            ),
        ),
    )
    add(
        "--restarts",
        default="p,d",
        help="instances killed and restarted during the run, in this order: p at ~1/3, "
        "d at ~2/3 ('' = none; default %(default)s)",
    )
    add_numbers(
        parser,
        float,
        (
            ("--timeout", 120.0, "a request with no end by then hung, s"),
            (
                "--quiesce-timeout",
                90.0,
                "after the run, wait this long at most for P and D to hold nothing, s",
            ),
            (
                "--recovery-timeout",
                60.0,
                "after a restart, wait this long at most for a request with a transfer, s",
            ),
        ),
    )
    add("--seed", type=int, default=0, help="prompts and plans (%(default)s)")
    add(
        "--reference-url",
        metavar="URL",
        default=None,
        help="take the reference outputs from this running vLLM instance (the same model and "
        "dtype, greedy; no connector needed) instead of starting one",
    )
    add(
        "--strict-recovery",
        action="store_true",
        help="also fail when a recovery took over 5 s",
    )
    add_served_options(parser, plot=False, trace="one JSON line per request")
    return run
