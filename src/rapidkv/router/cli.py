"""`rapidkv router`: serve the OpenAI-compatible PD router until interrupted.

Every flag defaults to None here, so that a flag left out leaves the config
file's setting (``--config``) or `RouterConfig`'s default in place
(`config_file.merge`); help texts name `RouterConfig`'s defaults."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rapidkv.router.config import DISPATCH_MODES, PLACEMENTS, RouterConfig
from rapidkv.router.config_file import KEYS, LOG_LEVELS, merge, read_file, resolve

# RouterConfig's defaults, named in the help texts
D = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(RouterConfig)})


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add the router's options to `parser`; return the runner."""
    inst = "URL[=CONTROL_ADDR]"
    parser.add_argument(
        "--prefill",
        action="append",
        metavar=inst,
        help="a prefill instance: its base URL (http://host:port) and, optionally, its "
        "rapidkv control address host:port; without one the router asks the instance "
        "(repeatable)",
    )
    parser.add_argument(
        "--decode", action="append", metavar=inst, help="a decode instance (repeatable)"
    )
    parser.add_argument(
        "--instance",
        action="append",
        metavar=inst,
        help="an instance that may prefill or decode (its connector runs as kv_both): the "
        "router chooses its role per request (repeatable; combines with --prefill/--decode, "
        "which pin a role)",
    )
    parser.add_argument(
        "--etcd",
        action="append",
        metavar="URL",
        help="an etcd endpoint (http://host:2379; repeatable): instances registered there "
        "(the connector's etcd_endpoints) join the fleet as they register and leave it when "
        "their lease expires; with it, the fleet may start empty",
    )
    parser.add_argument(
        "--etcd-prefix",
        metavar="PREFIX",
        help=f"the key prefix the instances register under (default {D.etcd_prefix})",
    )
    parser.add_argument("--host", help=f"address to bind (default {D.host})")
    parser.add_argument("--port", type=int, help=f"port (default {D.port})")
    parser.add_argument(
        "--dispatch",
        choices=DISPATCH_MODES,
        help=f"dual: P and D at once; serial: P, then D; local: D only (default {D.dispatch})",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        help="fixed: the decoder by least outstanding requests, the prefill instance among "
        "the others; adaptive: local, PD or split per request, for the lowest predicted TTFT "
        f"that keeps the decoder's TPOT within --tpot-slo-ms (dual dispatch; default "
        f"{D.placement})",
    )
    parser.add_argument(
        "--ttft-slo-ms", type=float, metavar="MS", help=f"(default {D.ttft_slo_ms})"
    )
    parser.add_argument(
        "--tpot-slo-ms",
        type=float,
        metavar="MS",
        help="adaptive placement: the TPOT no placement may push a decoder's requests past "
        f"(default {D.tpot_slo_ms})",
    )
    parser.add_argument(
        "--no-specialize",
        dest="specialize",
        action="store_false",
        default=None,
        help="adaptive placement: never pin instances that may do anything to prefill or to "
        "decode (by default half of them prefill and half decode while the prompts landing "
        "beside decodes would, at the tail, push them past --tpot-slo-ms)",
    )
    parser.add_argument(
        "--busy-crossings",
        dest="idle_crossings",
        action="store_false",
        default=None,
        help="adaptive placement: let PD and split compute a prompt on an instance that may do "
        "anything while it holds requests (by default a crossing borrows an idle one only; "
        "an instance pinned to prefill always may)",
    )
    parser.add_argument(
        "--no-prefix-index",
        dest="prefix_index",
        action="store_false",
        default=None,
        help="adaptive placement: ignore what the instances hold in their prefix caches (by "
        "default the router follows the vLLM KV events of every instance that publishes them, "
        "--kv-events-config with the zmq publisher, and counts each instance's cached prefix)",
    )
    parser.add_argument(
        "--no-prefix-fetch",
        dest="prefix_fetch",
        action="store_false",
        default=None,
        help="adaptive placement with the prefix index: never send a prefix one instance holds "
        "to another that computes the rest and decodes",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the served model's tokenizer directory, for the prefix index's text and chat "
        "prompts (default: the model directory an instance's /v1/models names, when it "
        "exists on this host; token-id prompts need none)",
    )
    parser.add_argument(
        "--ttft-headroom",
        type=float,
        metavar="FRACTION",
        help="adaptive placement: options whose predicted TTFT is below this fraction of "
        "--ttft-slo-ms count as equally fast, and the one with the fewest crossings is taken "
        f"(0: always the lowest TTFT; default {D.ttft_headroom})",
    )
    parser.add_argument(
        "--tpot-margin",
        type=float,
        metavar="FRACTION",
        help="adaptive placement: among options equally fast, those whose predicted TPOT is "
        "within a lone decode step plus this fraction of the slack --tpot-slo-ms leaves above it "
        "come first, then the fewest crossings, then the "
        f"lowest TPOT (1: every option within the SLO counts as safe; default {D.tpot_margin})",
    )
    parser.add_argument(
        "--secret-file",
        help="file holding the control plane's shared secret (for Abort messages)",
    )
    parser.add_argument(
        "--admin-token-file",
        help="file holding the token the /admin routes require (without one they do not exist)",
    )
    parser.add_argument(
        "--upstream-timeout",
        type=float,
        dest="upstream_read_timeout_s",
        metavar="S",
        help=f"seconds to wait for each piece of an upstream answer (default "
        f"{D.upstream_read_timeout_s})",
    )
    parser.add_argument(
        "--keep-alive",
        type=float,
        dest="keep_alive_s",
        metavar="S",
        help="seconds an idle client connection is kept open; longer than clients keep "
        f"theirs, so they close first (default {D.keep_alive_s})",
    )
    parser.add_argument(
        "--upstream-keep-alive",
        type=float,
        dest="upstream_keep_alive_s",
        metavar="S",
        help="seconds an idle connection to an instance is kept for reuse; shorter than "
        f"vLLM's own keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) (default "
        f"{D.upstream_keep_alive_s})",
    )
    parser.add_argument(
        "--no-discover",
        dest="discover",
        action="store_false",
        default=None,
        help="do not ask prefill instances for their control address (they then get "
        "no TransferKV: decode instances compute the prompt)",
    )
    parser.add_argument(
        "--no-prefill-first-token",
        dest="prefill_first_token",
        action="store_false",
        default=None,
        help="dual dispatch: always stream D's answer alone (by default P's first token "
        "opens the stream of a streamed greedy completion; docs/configuration.md)",
    )
    parser.add_argument(
        "--no-split-prefill",
        dest="split_prefill",
        action="store_false",
        default=None,
        help="dual dispatch: always have P compute the whole prompt (by default, while P "
        "and D are idle, P computes a head of a completion's prompt and D the tail at the "
        "same time; docs/configuration.md)",
    )
    parser.add_argument(
        "--split-fraction",
        type=float,
        metavar="F",
        help="split prefill: the share of the prompt P computes, rounded to whole blocks "
        f"(default {D.split_fraction})",
    )
    parser.add_argument(
        "--split-min-tokens",
        type=int,
        metavar="N",
        help=f"split prefill: no split whose head or tail is under N tokens (default "
        f"{D.split_min_tokens})",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        metavar="S",
        help="on SIGTERM, new requests are refused (503) while the running ones get this "
        f"long to finish; then it exits (default {D.shutdown_grace_s})",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send the router's OpenTelemetry spans there (OTLP, as vLLM's flag of that name; "
        "needs the otel extra; docs/configuration.md)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a TOML file of settings (every flag's and more: docs/configuration.md); "
        "flags given as well override it",
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, help="(default info)")
    return run


# flags whose dest is not the setting's name
_RENAMED = {"instance": "instances"}


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gives (flags left out are not in it),
    keyed as in a config file (`config_file`)."""
    out = {}
    for dest, value in vars(args).items():
        key = _RENAMED.get(dest, dest)
        if value is not None and key in KEYS:
            out[key] = str(value) if isinstance(value, Path) else value
    return out


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings in effect: the config file's (``--config``), overridden by the flags'."""
    from_file = read_file(args.config) if getattr(args, "config", None) is not None else {}
    return merge(from_file, settings_from_args(args))


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The `RouterConfig` the parsed command line (and its config file) asks
    for; ValueError if it is invalid (an unreadable or empty secret file too)."""
    return resolve(settings(args))


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; 2 for a bad configuration."""
    from rapidkv.router.server import run_router
    from rapidkv.router.tracing import otlp_provider

    try:
        given = settings(args)
        config = resolve(given)
        if config.otlp_traces_endpoint is not None:  # the packages are there, before binding
            otlp_provider(config.otlp_traces_endpoint).shutdown()
    except (ValueError, OSError) as e:
        print(f"rapidkv router: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=given.get("log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run_router(config)
    return 0
