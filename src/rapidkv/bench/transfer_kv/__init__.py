"""`rapidkv bench transfer-kv`: how fast a TransferKV takes effect on a busy P,
per `transfer_kv_mode` (step, bypass, substep) and per state of the request
when it arrives (prefill finished, last chunk in flight, an earlier chunk in
flight).

One run, two phases (`uncapped`, then `capped`), each with a fresh P:

1. P: vLLM with RapidKVConnector on the `small` model, pinned to core 0,
   chunked prefill (`--max-num-batched-tokens 256`), prefix caching off (the
   same prompt is recomputed every time). In `capped`, P's kvt confirms writes
   as if they crossed a link of `bandwidth_cap_gbps`, chosen from the uncapped
   step p50 so that one request's full transfer takes `--cap-fraction` of a step.
2. A background load (`load`) keeps P's steps full.
3. This process, pinned to core 1, is the destination D (`dest`): a
   real kvt receiver over NIXL, handshaken with P over the control protocol.
4. Each sample: P gets the prompt (`role: prefill`, `max_tokens` 1); after a
   random delay (`DelaySampler`) D sends TransferKV with the sample's mode.
   Modes are cycled; P's timeline says in which state the TransferKV arrived.
   Sampling stops when every (mode, state) has `--samples` or the phase's
   `--budget-s` is spent.
5. Per sample: arrival (P's `transfer_kv` event), first byte (our memory
   changed), last byte (our kvt got the SendDone), exposed (last byte - the
   later of arrival and P's `last_chunk_end`). Checks: the reply is OK for
   every token, the SendDone is ok, every 8-byte word of every destination
   block of every layer was overwritten, and the full blocks equal (within
   float tolerance: chunking changes summation order) those of the phase's
   first transfer of the same prompt (`content_max_rel_diff`).
6. JSON (`--json`), a table on stdout, a plot (`--plot`), per-sample JSONL
   (`--trace`), progress on stderr. P is stopped after each phase, also on
   errors, Ctrl-C and SIGTERM. Exit status 1 if a sample failed (the
   acceptance points are reported, not enforced), 130 when interrupted.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from rapidkv.bench.common.options import add_dtype
    from rapidkv.bench.transfer_kv.run import MODELS, PHASES, run

    parser.description = (__doc__ or "").split("\n\n")[0]
    parser.add_argument("--model", choices=MODELS, default="small", help="(%(default)s)")
    add_dtype(parser)
    parser.add_argument(
        "--samples", type=int, default=None, help="per mode and state (default 20; 3 quick)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="per phase, seconds (default 900; 150 quick)"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke: few samples")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated")
    parser.add_argument("--prompt-len", type=int, default=641, help="measured prompt, tokens")
    parser.add_argument("--chunk", type=int, default=256, help="P's --max-num-batched-tokens")
    parser.add_argument("--load-concurrency", type=int, default=2, help="background clients")
    parser.add_argument(
        "--load-len", default="600,900", help="background prompt lengths: min,max tokens"
    )
    parser.add_argument(
        "--cap-fraction",
        type=float,
        default=0.3,
        help="capped: one request's full transfer / uncapped step p50 (>= 0.2; the margin "
        "absorbs step length drift between the phases)",
    )
    parser.add_argument(
        "--cap-gbps", type=float, default=None, help="capped: this cap instead (GB/s)"
    )
    parser.add_argument(
        "--uniform",
        action="store_true",
        help="TransferKV delay uniform over 0..1.5x the prefill time (default: stratified "
        "towards the states still short of samples)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="unrecorded samples per mode")
    parser.add_argument("--poll-us", type=float, default=100.0, help="D's memory polling period")
    parser.add_argument(
        "--wait-quiet-s",
        type=float,
        default=600.0,
        help="before each phase, wait up to this long for the two cores to be free of other "
        "processes' work (0: do not wait)",
    )
    parser.add_argument("--p-cpu", type=int, default=0)
    parser.add_argument("--d-cpu", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="the JSON (- = stdout)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH", help="a PNG")
    parser.add_argument("--trace", type=Path, default=None, metavar="PATH", help="samples, JSONL")
    parser.add_argument("--log-dir", type=Path, default=None, help="P's logs (default: tmp)")
    return run
