"""router: the OpenAI-compatible proxy for PD disaggregation. Imports no vLLM.

It talks HTTP to vLLM instances and the control protocol to their connectors:

- `config`: `Instance` (base URL + optional control address), `Member`, `RouterConfig`.
- `rewrite`: the `kv_transfer_params` contract, as pure request rewriting.
- `proxy`: `Router`, the request path: one request placed and dispatched
  (dual / serial / local, split prefill); `exchange`: a request on its way;
  `prefill`: P's part of it; `answer`: D's answer relayed (stitched behind
  P's first token, or through a migratable relay).
- `fleet`: `Fleet`, the instances: members, pools, health, least-outstanding
  choice, discovery, draining, etcd membership, transfer state.
- `placement`: the adaptive placement (pure) and its shell (`placement.placer`).
- `migration`: live migration (bodies, splice, relay) and its controller.
- `fanout`: requests that are several sequences; `passthrough`: routes served
  on one instance; `admin`: the admin routes.
- `sse`, `stitch`, `split`: streams, first-token stitching, split prefill.
- `metrics`: the Prometheus metrics (names listed there).
- `aborts`: control-plane Abort to P (client disconnect, failures).
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
