"""`rapidkv bench simulate`: the placement policies on fleets of 2-64 simulated instances.

A discrete-event simulator (`engine`) of vLLM CPU instances (`instance`:
continuous batching in steps, chunked prefill, a split's tail holding its
engine until the head arrives) whose costs are fitted from this machine's
measurements (`fit`), behind a router (`routers`) that runs the same policies
as the real one: ``dp`` and ``fixed-pd`` with the router's own balancer, and
``adaptive`` with the real `router.placement.decide`, `FleetState` and
`Models`, fed the events the real router feeds them. Workloads and arrivals
are `bench goodput`'s (`workload`); on its workloads of shared prefixes
(`prefix_workloads`: `shared-prefix`, `multiturn`) every instance has a
prefix cache (`prefix_cache`: blocks keyed by content, LRU, vLLM's hit
rule), the adaptive routers are told what each holds (blind, aware, aware
and fetching), and a fetch moves a held prefix to the decoder. `goodput`
sweeps Poisson rates that scale with the fleet and finds the highest whose
attainment of both SLOs is >= 90 %;
`report` prints goodput per fleet size, total and per instance, and writes the
JSON and a plot; `compare` puts the simulator's predictions next to a real
`bench goodput` run at 2 instances (with `--calibrate`, each workload's fit
first calibrated on that run's own single c1: `calibrate`); `check` puts the
fit next to the `bench serve` figures it came from.

Pure Python, no vLLM, no server: it runs anywhere the package imports.
docs/benchmarks/simulate.md describes the model and its
assumptions.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def register(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from rapidkv.bench.simulate.run import run

    parser.description = (__doc__ or "").split("\n\n")[0]
    add = parser.add_argument
    add("--sizes", default=None, help="fleet sizes, comma-separated (2,4,8,16,32,64)")
    add(
        "--policies",
        default=None,
        help="dp, fixed-pd, nixl, adaptive, adaptive-blind, adaptive-nofetch, "
        "adaptive-fit-priors, adaptive-unshaped, adaptive-busy-crossings; comma-separated "
        "(dp,fixed-pd,adaptive; on shared-prefix and multiturn "
        "dp,adaptive-blind,adaptive-nofetch,adaptive)",
    )
    add(
        "--workloads",
        default=None,
        help="prefill-heavy, chat, shared-prefix, multiturn; comma-separated "
        "(prefill-heavy,chat; the last two with prefix caching)",
    )
    add(
        "--requests",
        type=int,
        default=None,
        help="requests per instance in each run, at least 400 a run (50; --quick 10, 100)",
    )
    add(
        "--min-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests a run has at least, whatever the fleet size (400; --quick 100; "
        "40 with --requests 20 at 2 instances: bench goodput's default run)",
    )
    add("--seed", type=int, default=0, help="requests and arrivals (%(default)s)")
    add(
        "--ttft-slo-ms",
        type=float,
        default=None,
        help="TTFT SLO (default 4x single's simulated c1 TTFT p50, per workload)",
    )
    add(
        "--tpot-slo-ms",
        type=float,
        default=None,
        help="TPOT SLO (default 1.5x single's simulated c1 TPOT p50)",
    )
    add(
        "--fit",
        default=None,
        metavar="PATH",
        help="fit the instances from this bench serve / bench goodput / bench simulate JSON, "
        "or smollm2 (SmolLM2-135M bf16's bench serve figures in docs/benchmarks/serve.md)",
    )
    add(
        "--max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help="requests each simulated engine runs at once (the fit's, 8; with --compare, "
        "the real run's --max-num-seqs when its server args give one)",
    )
    add(
        "--kv-cache-bytes",
        default=None,
        metavar="BYTES",
        help="each instance's KV memory, as vLLM reads --kv-cache-memory-bytes "
        "(the harness's 256M = 2**28 bytes), for its prefix cache's blocks",
    )
    add(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        metavar="N",
        help="KV bytes a token takes, every layer's K and V (the fit's: 4096, the tiny "
        "float32 model; SmolLM2-135M 23040 in bf16, 46080 in float32)",
    )
    add(
        "--cache-blocks",
        type=int,
        default=None,
        metavar="N",
        help="blocks each prefix cache holds (default: KV memory // (block size x KV bytes "
        "a token), less vLLM's null block)",
    )
    add(
        "--tokenizer",
        default="auto",
        metavar="auto|chars|DIR",
        help="multiturn's token counts: SmolLM2's tokenizer when its checkpoint is built "
        "here (auto, as the real runs), a checkpoint directory, or 4 characters a token "
        "(chars) (%(default)s)",
    )
    add(
        "--warm-up",
        type=int,
        default=0,
        metavar="N",
        help="with prefix caching: N requests per instance served before the measured ones, "
        "not counted (warm caches; %(default)s: every rate starts cold, as bench goodput's)",
    )
    add(
        "--start",
        type=float,
        default=1.0,
        metavar="R",
        help="each sweep's first rate, req/s per instance (%(default)s; higher: fewer rates "
        "on a large fleet)",
    )
    add(
        "--refine",
        type=int,
        default=3,
        help="bisections after the doubling search of each sweep (%(default)s; --quick 2)",
    )
    add(
        "--compare",
        default=None,
        metavar="PATH",
        help="only compare: simulate the rates of this bench goodput JSON, report the errors",
    )
    add(
        "--calibrate",
        action="store_true",
        help="with --compare: simulate each workload with the fit calibrated on the run's own "
        "single c1 (`calibrate`: every compute cost scaled to its TPOT, a context cost to its "
        "TTFT), not as given",
    )
    add("--json", default=None, metavar="PATH", help="also write the JSON here (- = stdout only)")
    add("--plot", default=None, metavar="PATH", help="a PNG of goodput per instance vs size")
    add(
        "--quick",
        action="store_true",
        help="sizes 2,4,8; 10 requests per instance, at least 100 a run; 2 bisections",
    )
    return run
