"""The TP 2 server groups that the TP e2e modules share (`test_pd_tp`,
`test_pd_tp_faults`, `test_pd_tp_mixed`): one spec each, built once a session, so that every
module asks the pool for exactly the same group under the same key (the pool
refuses a key asked for with other specs) and a group one module started
serves the next.

- `single_tp2_spec`: the TP 2 reference instance (pool key `single_tp2`), its
  ranks on cores 0 and 1;
- `tp2_pair`: the TP 2 P/D pair (pool key `pd_tp2`), P's two ranks on core 0,
  D's on core 1, chunked prefill of 256 tokens, control ports fixed for the
  session; P injects `test_pd_tp_faults`' faults into the transfers whose
  xfer_id starts with `FAULTY` (`debug_fault_prefix`) and no other;
- `pair_router`: the config of a router in front of one pair;
- `tp_prompts`, `mixed_prompts`, `faults_prompts`: each module's prompts,
  whose references the session fixtures `tp2_references` and
  `workloads` (TP 1) take in tests/e2e/conftest.py.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from pd_harness import Pair, connector_config

from rapidkv.harness import ServerSpec, free_port, random_prompts
from rapidkv.harness.server import pd_specs

if TYPE_CHECKING:
    from rapidkv.router.config import RouterConfig

TP = 2
CORES = (0, 1)  # the TP 2 instance's ranks: rank 0 on core 0, rank 1 on core 1
SINGLE_TP2 = "single_tp2"
PD_TP2 = "pd_tp2"
FAULTY = "faulty-"  # xfer ids that P's faults touch
FAIL_RATE = 0.5  # of those, the share that P's rank 1 (alone) fails
LAYER_DELAY_S = 0.15  # P's steps computing their prompts: ~0.6 s each (4 layers)


def single_tp2_spec(model: Path) -> ServerSpec:
    """The reference instance at TP 2."""
    return ServerSpec(model=model, name="single-tp2", cpus=CORES, tensor_parallel_size=TP)


@functools.cache
def tp2_pair(model: Path) -> tuple[tuple[ServerSpec, ...], tuple[str, str]]:
    """The TP 2 pair's specs and its control addresses (P's, D's), the same
    for the whole session. Each instance's ranks share its own core
    (`pd_specs`' cores): with both instances' ranks on both cores, one
    instance's all-reduce spins while its peer rank waits behind the other
    instance's."""
    pc, dc = free_port(), free_port()
    chunked = ("--max-num-batched-tokens", "256")
    faults = {
        "debug_fault_prefix": FAULTY,
        "debug_fail_transfer_rate": FAIL_RATE,
        "debug_fail_ranks": [1],
        "debug_layer_delay_s": LAYER_DELAY_S,
    }
    specs = pd_specs(model, connector_config(pc, **faults), connector_config(dc), chunked)
    specs = [s.replace(tensor_parallel_size=TP) for s in specs]
    return tuple(specs), (f"127.0.0.1:{pc}", f"127.0.0.1:{dc}")


def tp_prompts(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    """test_pd_tp's prompts: for dual dispatch, for split prefill."""
    prompts = random_prompts(model, [5, 130, 300, 600, 900, 250, 400, 700], seed=3900)
    return prompts, random_prompts(model, [450, 800, 640], seed=3901)


def mixed_prompts(model: Path) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """test_pd_tp_mixed's prompts: for dual dispatch, for split prefill, and
    the migrated ones (one per migration test; answers `MIGRATION_TOKENS`
    long)."""
    prompts = random_prompts(model, [5, 130, 300, 600, 900, 250], seed=3950)
    split = random_prompts(model, [450, 800], seed=3951)
    return prompts, split, random_prompts(model, [330, 290], seed=3952)


def faults_prompts(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    """test_pd_tp_faults' prompts: those whose transfer one P rank fails; X
    (aborted mid-transfer) and Y (computed on D right after)."""
    failing = random_prompts(model, [300, 200], seed=3960)
    return failing, random_prompts(model, [800, 200], seed=3961)


def pair_router(pair: Pair, **kw: object) -> RouterConfig:
    """A router in front of `pair` alone: P by its URL (its control address
    discovered), D with its control address; `kw` as `RouterConfig` takes."""
    from rapidkv.router.config import Instance, RouterConfig

    return RouterConfig(
        prefill=(Instance(pair.p.base_url),),
        decode=(Instance(pair.d.base_url, pair.d_control),),
        port=0,
        **kw,
    )
