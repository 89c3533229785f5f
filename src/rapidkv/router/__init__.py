"""router: the OpenAI-compatible proxy for PD disaggregation. Imports no vLLM.

It talks HTTP to vLLM instances and the control protocol to their connectors:

- `config`: `Instance` (base URL + optional control address), `RouterConfig`.
- `rewrite`: the `kv_transfer_params` contract, as pure request rewriting.
- `balance`: least-outstanding instance choice, ties round-robin.
- `sse`: the first output event of a stream (router-side TTFT).
- `metrics`: the Prometheus metrics (names listed there).
- `aborts`: control-plane Abort to P after a client disconnect.
- `proxy`: `Router`, serving one request (dual / serial / local dispatch).
- `app`: the Starlette app (routes, /health, /v1/models, /metrics).
- `server`: `start_router` (in-process, on a thread) and `run_router` (blocking).
- `cli`: `rapidkv router`.

    from rapidkv.router import Instance, RouterConfig, start_router
    config = RouterConfig(prefill=(Instance(p_url, "127.0.0.1:7001"),),
                          decode=(Instance(d_url),), port=0)
    with start_router(config) as router:
        ...  # OpenAI requests to router.url
"""

from rapidkv.router.config import Dispatch, Instance, RouterConfig
from rapidkv.router.server import RunningRouter, ThreadedServer, run_router, start_router

__all__ = [
    "Dispatch",
    "Instance",
    "RouterConfig",
    "RunningRouter",
    "ThreadedServer",
    "run_router",
    "start_router",
]
