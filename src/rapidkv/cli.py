"""The `rapidkv` command line: one subcommand per job.

Each subcommand lives in the module that owns the job, as a function
`register(parser) -> run(args) -> int`; modules are imported only when their
subcommand is parsed, so `rapidkv --help` stays fast and vLLM-free.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (one-line help, "module:function" of its register function)
COMMANDS: dict[str, tuple[str, str]] = {
    "model": ("build the locally generated test models", "rapidkv.models.cli:register"),
    "bench": ("run a benchmark and print JSON", "rapidkv.bench.cli:register"),
    "data": ("write a packaged data set for other tools", "rapidkv.data.cli:register"),
    "router": ("OpenAI-compatible router for PD disaggregation", "rapidkv.router.cli:register"),
    "demo": ("P + D + router on this machine: a small workload, checked", "rapidkv.demo:register"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="rapidkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, _) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints usage / the error and exits
    name = argv[0]
    module, func = COMMANDS[name][1].split(":")
    register = getattr(importlib.import_module(module), func)
    cmd_parser = argparse.ArgumentParser(prog=f"rapidkv {name}", description=COMMANDS[name][0])
    run = register(cmd_parser)
    return run(cmd_parser.parse_args(argv[1:])) or 0


if __name__ == "__main__":
    sys.exit(main())
