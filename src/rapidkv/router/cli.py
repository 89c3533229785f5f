"""`rapidkv router`: serve the OpenAI-compatible PD router until interrupted."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from rapidkv.router.config import (
    DISPATCH_MODES,
    PLACEMENTS,
    SPLIT_MIN_TOKENS,
    Instance,
    RouterConfig,
    read_secret,
)

LOG_LEVELS = ("debug", "info", "warning", "error")


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add the router's options to `parser`; return the runner."""
    inst = "URL[=CONTROL_ADDR]"
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar=inst,
        help="a prefill instance: its base URL (http://host:port) and, optionally, its "
        "rapidkv control address host:port; without one the router asks the instance "
        "(repeatable)",
    )
    parser.add_argument(
        "--decode", action="append", default=[], metavar=inst, help="a decode instance (repeatable)"
    )
    parser.add_argument(
        "--instance",
        action="append",
        default=[],
        metavar=inst,
        help="an instance that may prefill or decode (its connector runs as kv_both): the "
        "router chooses its role per request (repeatable; combines with --prefill/--decode, "
        "which pin a role)",
    )
    parser.add_argument(
        "--etcd",
        action="append",
        default=[],
        metavar="URL",
        help="an etcd endpoint (http://host:2379; repeatable): instances registered there "
        "(the connector's etcd_endpoints) join the fleet as they register and leave it when "
        "their lease expires; with it, the fleet may start empty",
    )
    parser.add_argument(
        "--etcd-prefix",
        default="/rapidkv/",
        metavar="PREFIX",
        help="the key prefix the instances register under (default %(default)s)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    parser.add_argument(
        "--dispatch",
        choices=DISPATCH_MODES,
        default="dual",
        help="dual: P and D at once; serial: P, then D; local: D only (default %(default)s)",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="fixed",
        help="fixed: the decoder by least outstanding requests, the prefill instance among "
        "the others; adaptive: local, PD or split per request, for the lowest predicted TTFT "
        "that keeps the decoder's TPOT within --tpot-slo-ms (dual dispatch; default "
        "%(default)s)",
    )
    parser.add_argument(
        "--ttft-slo-ms", type=float, default=1000.0, metavar="MS", help="(default %(default)s)"
    )
    parser.add_argument(
        "--tpot-slo-ms",
        type=float,
        default=100.0,
        metavar="MS",
        help="adaptive placement: the TPOT no placement may push a decoder's requests past "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--no-specialize",
        dest="specialize",
        action="store_false",
        help="adaptive placement: never pin instances that may do anything to prefill or to "
        "decode (by default half of them prefill and half decode while the prompts landing "
        "beside decodes would, at the tail, push them past --tpot-slo-ms)",
    )
    parser.add_argument(
        "--busy-crossings",
        dest="idle_crossings",
        action="store_false",
        help="adaptive placement: let PD and split compute a prompt on an instance that may do "
        "anything while it holds requests (by default a crossing borrows an idle one only; "
        "an instance pinned to prefill always may)",
    )
    parser.add_argument(
        "--no-prefix-index",
        dest="prefix_index",
        action="store_false",
        help="adaptive placement: ignore what the instances hold in their prefix caches (by "
        "default the router follows the vLLM KV events of every instance that publishes them, "
        "--kv-events-config with the zmq publisher, and counts each instance's cached prefix)",
    )
    parser.add_argument(
        "--no-prefix-fetch",
        dest="prefix_fetch",
        action="store_false",
        help="adaptive placement with the prefix index: never send a prefix one instance holds "
        "to another that computes the rest and decodes",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the served model's tokenizer directory, for the prefix index's text and chat "
        "prompts (default: the model directory an instance's /v1/models names, when it "
        "exists on this host; token-id prompts need none)",
    )
    parser.add_argument(
        "--ttft-headroom",
        type=float,
        default=0.5,
        metavar="FRACTION",
        help="adaptive placement: options whose predicted TTFT is below this fraction of "
        "--ttft-slo-ms count as equally fast, and the one with the fewest crossings is taken "
        "(0: always the lowest TTFT; default %(default)s)",
    )
    parser.add_argument(
        "--tpot-margin",
        type=float,
        default=0.6,
        metavar="FRACTION",
        help="adaptive placement: among options equally fast, those whose predicted TPOT is "
        "within this fraction of --tpot-slo-ms come first, then the fewest crossings, then the "
        "lowest TPOT (1: every option within the SLO counts as safe; default %(default)s)",
    )
    parser.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help="file holding the control plane's shared secret (for Abort messages)",
    )
    parser.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="file holding the token the /admin routes require (without one they do not exist)",
    )
    parser.add_argument(
        "--upstream-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait for each piece of an upstream answer (default %(default)s)",
    )
    parser.add_argument(
        "--keep-alive",
        type=float,
        default=75.0,
        metavar="S",
        help="seconds an idle client connection is kept open; longer than clients keep "
        "theirs, so they close first (default %(default)s)",
    )
    parser.add_argument(
        "--upstream-keep-alive",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds an idle connection to an instance is kept for reuse; shorter than "
        "vLLM's own keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) (default %(default)s)",
    )
    parser.add_argument(
        "--no-discover",
        dest="discover",
        action="store_false",
        help="do not ask prefill instances for their control address (they then get "
        "no TransferKV: decode instances compute the prompt)",
    )
    parser.add_argument(
        "--no-prefill-first-token",
        dest="prefill_first_token",
        action="store_false",
        help="dual dispatch: always stream D's answer alone (by default P's first token "
        "opens the stream of a streamed greedy completion; docs/configuration.md)",
    )
    parser.add_argument(
        "--no-split-prefill",
        dest="split_prefill",
        action="store_false",
        help="dual dispatch: always have P compute the whole prompt (by default, while P "
        "and D are idle, P computes a head of a completion's prompt and D the tail at the "
        "same time; docs/configuration.md)",
    )
    parser.add_argument(
        "--split-fraction",
        type=float,
        default=0.55,
        metavar="F",
        help="split prefill: the share of the prompt P computes, rounded to whole blocks "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--split-min-tokens",
        type=int,
        default=SPLIT_MIN_TOKENS,
        metavar="N",
        help="split prefill: no split whose head or tail is under N tokens (default %(default)s)",
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    return run


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The `RouterConfig` the parsed command line asks for; ValueError if it is invalid."""
    return RouterConfig(
        prefill=tuple(Instance.parse(text) for text in args.prefill),
        decode=tuple(Instance.parse(text) for text in args.decode),
        instances=tuple(Instance.parse(text) for text in args.instance),
        etcd=tuple(url.rstrip("/") for url in args.etcd),
        etcd_prefix=args.etcd_prefix,
        host=args.host,
        port=args.port,
        dispatch=args.dispatch,
        placement=args.placement,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        ttft_headroom=args.ttft_headroom,
        tpot_margin=args.tpot_margin,
        specialize=args.specialize,
        idle_crossings=args.idle_crossings,
        prefix_index=args.prefix_index,
        prefix_fetch=args.prefix_fetch,
        tokenizer=args.tokenizer,
        secret=read_secret(args.secret_file) if args.secret_file is not None else None,
        admin_token=(
            read_secret(args.admin_token_file).decode()
            if args.admin_token_file is not None
            else None
        ),
        upstream_read_timeout_s=args.upstream_timeout,
        keep_alive_s=args.keep_alive,
        upstream_keep_alive_s=args.upstream_keep_alive,
        discover=args.discover,
        prefill_first_token=args.prefill_first_token,
        split_prefill=args.split_prefill,
        split_fraction=args.split_fraction,
        split_min_tokens=args.split_min_tokens,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; 2 for a bad configuration."""
    from rapidkv.router.server import run_router

    try:
        config = config_from_args(args)
    except (ValueError, OSError) as e:
        print(f"rapidkv router: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_router(config)
    return 0
