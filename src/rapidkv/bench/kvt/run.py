"""`rapidkv bench kvt`: the run, on this host or across a link (the method is in
the package's docstring)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from rapidkv.bench.kvt.sender import (
    BLOCK_BYTES,
    BLOCKS,
    LAYERS,
    Sender,
    memcpy_gbps,
)


def run(args: argparse.Namespace) -> int:
    if args.tp_from is not None or args.tp_to is not None:
        return run_tp(args)
    if args.netns_link is not None:
        return run_across_link(args)
    peer = json.loads(args.netns_peer) if args.netns_peer else None
    result = measure(
        transports=[t for t in args.transports.split(",") if t],
        repeats=args.repeats,
        steps=args.steps,
        layer_ms=args.layer_ms,
        sender_cpu=args.sender_cpu,
        receiver_cpu=args.receiver_cpu,
        progress=None if args.json else lambda msg: print(msg, file=sys.stderr),
        peer=peer,
    )
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def run_tp(args: argparse.Namespace) -> int:
    """`--tp-from/--tp-to`: P at one TP size to D at another (`tp.py`)."""
    from rapidkv.bench.kvt.tp import HEAD_LAYOUTS, TP_SIZES, measure_tp

    tp_from = 1 if args.tp_from is None else args.tp_from
    tp_to = 1 if args.tp_to is None else args.tp_to
    layouts = [x for x in args.head_layouts.split(",") if x]
    problems = [f"--tp-from {tp_from} is not one of {TP_SIZES}"] if tp_from not in TP_SIZES else []
    if tp_to not in TP_SIZES:
        problems.append(f"--tp-to {tp_to} is not one of {TP_SIZES}")
    problems += [
        f"--head-layouts: unknown {x!r} ({HEAD_LAYOUTS})" for x in layouts if x not in HEAD_LAYOUTS
    ]
    if not layouts:
        problems.append("--head-layouts names none")
    if args.netns_link is not None:
        problems.append("--netns-link does not combine with --tp-from/--tp-to")
    if args.repeats < 1:
        problems.append("--repeats must be at least 1")
    if args.blocks < 1:
        problems.append("--blocks must be at least 1")
    if problems:
        for problem in problems:
            print(f"rapidkv bench kvt: {problem}", file=sys.stderr)
        return 2
    result = measure_tp(
        transports=[t for t in args.transports.split(",") if t],
        head_layouts=layouts,
        tp_from=tp_from,
        tp_to=tp_to,
        repeats=args.repeats,
        sender_cpu=args.sender_cpu,
        receiver_cpu=args.receiver_cpu,
        progress=None if args.json else lambda msg: print(msg, file=sys.stderr),
        blocks=args.blocks,
    )
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def run_across_link(args: argparse.Namespace) -> int:
    """`--netns-link`: the link, a plain TCP stream across it, then this very
    command in namespace A with the receiver's side named (`--netns-peer`)."""
    import subprocess

    from rapidkv.harness.netns import (
        NetnsUnavailable,
        netns_exec_prefix,
        netns_link,
        rate_bits,
        tcp_throughput,
    )
    from rapidkv.harness.server import SRC_DIR

    say = (lambda msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr))
    # SIGTERM (a `timeout`) unwinds like Ctrl-C: the link is removed, the run in A stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        link_cm = netns_link(rate=args.netns_link)
        link = link_cm.__enter__()
    except (NetnsUnavailable, ValueError) as e:
        print(f"rapidkv bench kvt: --netns-link: {e}", file=sys.stderr)
        return 2
    child: subprocess.Popen | None = None
    try:
        say(f"link {link.a.name} <-> {link.b.name}: {' '.join(link.tbf) or 'no cap'}")
        say("one TCP stream across the link ...")
        tcp = tcp_throughput(link)
        # a full send is one write of 1 GiB: it must be confirmed within the
        # worker's write timeout, 10 s by default, ~9 s at 1 Gbit/s
        link_s = LAYERS * BLOCKS * BLOCK_BYTES * 8 / rate_bits(args.netns_link)
        peer = {
            "a_host": link.a.host,
            "b_host": link.b.host,
            "b_netns": link.b.name,
            "write_timeout_s": max(10.0, 4 * link_s),
        }
        argv = [sys.executable, "-m", "rapidkv.cli", "bench", "kvt", "--json"]
        argv += ["--transports", args.transports, "--repeats", str(args.repeats)]
        argv += ["--steps", str(args.steps), "--layer-ms", str(args.layer_ms)]
        argv += ["--sender-cpu", str(args.sender_cpu), "--receiver-cpu", str(args.receiver_cpu)]
        argv += ["--netns-peer", json.dumps(peer)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
        say(f"measuring in {link.a.name} ...")
        child = subprocess.Popen(
            [*netns_exec_prefix(link.a.name), *argv], env=env, stdout=subprocess.PIPE, text=True
        )
        out, _ = child.communicate()
        if child.returncode != 0:
            print(f"rapidkv bench kvt: the run in {link.a.name} failed", file=sys.stderr)
            return child.returncode or 1
        # the JSON is the last line (NIXL logs to stdout too)
        result = json.loads(next(x for x in reversed(out.splitlines()) if x.startswith("{")))
        result["link"] = {**link.describe(), "tcp": tcp}
        for entry in result["transports"].values():
            for key in ("contiguous", "scattered"):
                entry[f"{key}_vs_link_tcp"] = round(entry[f"{key}_gbps"] / tcp["gbps"], 3)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait(30)
        link_cm.__exit__(None, None, None)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def measure(
    transports: list[str],
    repeats: int,
    steps: int,
    layer_ms: float,
    sender_cpu: int,
    receiver_cpu: int,
    progress: Callable[[str], None] | None,
    peer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    say = progress or (lambda msg: None)
    os.sched_setaffinity(0, {sender_cpu})
    say("memcpy of 1 GiB ...")
    result: dict[str, Any] = {"memcpy_gbps": round(memcpy_gbps(repeats), 2), "transports": {}}
    for kind in transports:
        say(f"{kind}: full sends ...")
        sender = Sender(kind, receiver_cpu, peer)
        try:
            entry: dict[str, Any] = {
                "contiguous_gbps": round(sender.full_send_gbps(False, repeats), 2),
                "scattered_gbps": round(sender.full_send_gbps(True, repeats), 2),
            }
            say(f"{kind}: busy steps ...")
            entry.update(sender.busy_steps(steps, layer_ms))
        finally:
            sender.close()
        for key in ("contiguous", "scattered"):
            entry[f"{key}_vs_memcpy"] = round(entry[f"{key}_gbps"] / result["memcpy_gbps"], 3)
        result["transports"][kind] = entry
    default = "nixl" if "nixl" in result["transports"] else transports[0]
    result["latency_transport"] = default
    for key in ("layer_to_send_us", "attach_to_send_us", "step_ms"):
        result[key] = result["transports"][default][key]
    return result
