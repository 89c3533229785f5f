"""`rapidkv bench kvt`: the data plane measured between two processes.

(a) full-send throughput of 1 GiB in 64 KiB blocks (32 layers x 512 blocks),
    contiguous (coalesced runs) and scattered (every block to a random
    destination slot), per transport, next to a memcpy of the same bytes in the
    same run (all buffers torch-allocated, then backed by huge pages as
    `KvtWorker` does with registered memory: see `kvt.memory`);
(b) `layer_done(i)` -> that layer's first byte handed to the transport, and
(c) `attach_substep` -> the first send of the layers already done,
    both inside busy synthetic steps: 32 layers of torch compute on the sender's
    own pinned core, a little Python between layers, a second thread attaching
    substeps at random moments.

The sender runs in this process, pinned to `--sender-cpu`; the receiver in a
spawned process pinned to `--receiver-cpu`. Results: JSON on stdout.

With `--netns-link RATE` (e.g. ``1gbit``) the two run as on two hosts: the
sender in one network namespace, the receiver in another, joined by a veth
pair capped at RATE (`harness.netns`); each transport is given its side's
address on that link, as the connector's ``kvt_host`` does (NIXL: UCX over TCP
on that interface). This process creates the link, measures one plain TCP
stream across it (`link.tcp`), runs the measurement in namespace A (the same
command, `--netns-peer`), and removes the link. Needs root; says why not
otherwise.

With `--tp-from P --tp-to D` it measures instead what moving KV between
tensor-parallel sizes costs: P's ranks send each head to the D rank that owns
it (`kvt.head_map`: strided pieces of every block), next to the same KV moved
whole at TP 1 -> 1, per head layout (`--head-layouts`; method in `tp.py`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("--transports", default="nixl,tcp", help="comma-separated (nixl,tcp)")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs (best counts)")
    parser.add_argument("--steps", type=int, default=60, help="busy steps per transport")
    parser.add_argument("--layer-ms", type=float, default=0.5, help="compute per layer")
    parser.add_argument("--sender-cpu", type=int, default=0)
    parser.add_argument("--receiver-cpu", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument(
        "--netns-link",
        metavar="RATE",
        default=None,
        help="sender and receiver in two network namespaces joined by a veth capped at "
        "RATE (tc rate: 1gbit, 500mbit, ...); needs root",
    )
    parser.add_argument("--netns-peer", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--tp-from",
        type=int,
        default=None,
        help="measure P at this TP size sending to D at --tp-to (1, 2, 4, 8)",
    )
    parser.add_argument(
        "--tp-to", type=int, default=None, help="D's TP size (with --tp-from; default 1)"
    )
    parser.add_argument(
        "--head-layouts",
        default="cpu,nhd",
        help="with --tp-from/--tp-to: block layouts (cpu: vLLM CPU, nhd: GPU FlashAttention)",
    )
    from rapidkv.bench.kvt.sender import BLOCKS

    parser.add_argument(
        "--blocks",
        type=int,
        default=BLOCKS,
        help="with --tp-from/--tp-to: blocks a layer on each side (512: 1 GiB of KV)",
    )
    from rapidkv.bench.kvt.run import run

    return run
