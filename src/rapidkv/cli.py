"""The `rapidkv` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

# Each entry: name -> (help, function adding arguments and returning the runner).
Register = Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]]


def _commands() -> dict[str, tuple[str, Register]]:
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rapidkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    runners = {}
    for name, (help_text, register) in _commands().items():
        runners[name] = register(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    return runners[args.command](args) or 0


if __name__ == "__main__":
    sys.exit(main())
