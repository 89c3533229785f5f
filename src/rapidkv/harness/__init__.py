"""Test/benchmark harness: start vLLM servers, talk to them, never leak them.

    from rapidkv.harness import ServerSpec, running, complete
    pd = [ServerSpec(model=m, name="prefill", role="prefill", cpus=(0,),
                     kv_transfer_config=cfg_p),
          ServerSpec(model=m, name="decode", role="decode", cpus=(1,),
                     kv_transfer_config=cfg_d)]
    with running(pd, log_dir) as (prefill, decode):
        ids = complete(decode.base_url, prompt_ids, 16)

Modules: `server` (ServerSpec, VLLMServer, start_servers, running), `pool`
(ServerPool, shared lazily started groups), `client` (completions, metrics),
`prompts` (token-id prompts), `iterations` (per-step composition, from the
log), `process` (process-group lifecycle), `watchdog` (kills our servers if
this process dies), `procs` (/proc views), `shm` (the /dev/shm files a
stopped tree left), `ports`, `kv_events` (vLLM's KV-event publisher bound to
one address), `waiting`.
"""

from rapidkv.harness.client import (
    Completion,
    complete,
    complete_full,
    complete_many,
    complete_many_full,
    get_metrics,
    metric_sum,
)
from rapidkv.harness.iterations import Iteration, parse_iterations, read_iterations
from rapidkv.harness.pool import ServerPool
from rapidkv.harness.ports import free_port
from rapidkv.harness.process import ManagedProcess, ProcessLeftBehind
from rapidkv.harness.prompts import prompt_vocab, random_prompts
from rapidkv.harness.server import (
    ServerSpec,
    ServerStartError,
    VLLMServer,
    running,
    start_servers,
)
from rapidkv.harness.waiting import wait_until
from rapidkv.harness.watchdog import Watchdog, get_watchdog

__all__ = [
    "Completion",
    "Iteration",
    "ManagedProcess",
    "ProcessLeftBehind",
    "ServerPool",
    "ServerSpec",
    "ServerStartError",
    "VLLMServer",
    "Watchdog",
    "complete",
    "complete_full",
    "complete_many",
    "complete_many_full",
    "free_port",
    "get_metrics",
    "get_watchdog",
    "metric_sum",
    "parse_iterations",
    "prompt_vocab",
    "random_prompts",
    "read_iterations",
    "running",
    "start_servers",
    "wait_until",
]
