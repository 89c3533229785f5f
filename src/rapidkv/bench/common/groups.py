"""The configurations the served benchmarks compare, and the server groups behind them.

A *group* is what is started together: vLLM servers (pinned: P or the first
instance on core 0, D or the second on core 1, `single` on core 1, where every
decode runs) plus the HTTP front the client talks to (the rapidkv router, or the
NIXL serial proxy in `proxy`), each front a process of its own. The fronts
and, during loads, the client's event loop run on core 0 (`helper_cpus`), so
that core 1 runs the decoding instance alone: left to float they were woken on
the decoding core and took their time from every token relayed (not in the
`-stock` NIXL groups, whose P runs on both cores). Several configurations can
share a group: every rapidkv configuration runs on one P/D pair, behind the
routers its configurations need (dual dispatch, serial dispatch, ..., adaptive
placement over both instances as `--instance`), started side by side, and a
configuration differs from another only by its front and by the
`kv_transfer_params` the client adds to each request. `RunningGroup.start_front`
(re)starts one front with options appended (`bench goodput`: the adaptive
router with the SLOs of the run).

Groups run one at a time, except `single`: when a configuration is `paired`
with it, `single` stays up through the round beside the others (`rapidkv.bench.serve`,
"Pairing"), idle but for the blocks it serves.

Every group starts with prefix caching off (`COMMON_ARGS`: a benchmark that
sends the same prompts again would measure its cache) unless it is started
with `prefix_caching` (`bench serve`, which empties the caches before each
load; `bench goodput` with a workload of shared prefixes, before each rate),
and `extra_args` appended to every server's command line. Started with
`kv_events`, every server of the rapidkv group publishes vLLM's KV cache
events over ZMQ on loopback ports of its own (`kv_events_args`); the
adaptive routers learn where from the connector and keep their prefix index
from them.
`RunningGroup.stop` stops the fronts and the servers, by process group; the
harness's watchdog stops them if this process dies.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TUNING = (
    "NIXL agents default to enable_prog_thread=False (UCX progress thread off), "
    "os.sched_setaffinity cannot move a thread off the instance's core, and on an AMX "
    "CPU every process asks for AMX tile data at start as rapidkv's connector does "
    "(else vLLM's bf16 attention kills the worker with SIGILL) "
    "(rapidkv.bench.common.nixl_tuning, loaded by sitecustomize)"
)

SIGILL_CRASH = "a vLLM worker of {server} died of SIGILL (exit code -4)"
AMX_CAUSE = (
    ": on this AMX CPU vLLM's bf16 attention runs AMX tile instructions that no "
    "process asked the kernel to permit (docs/environment.md, 'bf16 on AMX CPUs'); "
    "rapidkv's connector and the tuned NIXL baselines ask at start, stock vLLM does not"
)


@dataclass(frozen=True)
class Config:
    """One configuration: the group that serves it, its front, its per-request params."""

    name: str
    group: str
    front: str | None  # a front of the group; None: straight to the group's only server
    description: str
    params: dict[str, Any] | None = None  # the client's kv_transfer_params
    default: bool = True  # run when --configs is not given
    # measured in blocks that alternate with the same blocks on `single` (kept
    # running beside the group), for a TPOT ratio to `single` that this shared
    # machine's drift does not decide (`rapidkv.bench.serve`, "Pairing")
    paired: bool = False


def _rapidkv(
    name: str, front: str, what: str, mode: str | None = None, paired: bool = False
) -> Config:
    params = {"rapidkv": {"transfer_kv_mode": mode}} if mode else None
    return Config(name, "rapidkv", front, what, params, paired=paired)


CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("single", "single", None, "one vLLM instance, no connector, core 1"),
        Config(
            "single-noop-connector",
            "single-noop-connector",
            None,
            "one vLLM instance, core 1, with a KV connector whose every hook does nothing "
            "(rapidkv.connector.noop): vLLM's connector path alone, the floor under "
            "any connector's decode",
            paired=True,
        ),
        Config(
            "dp2",
            "dp2",
            "router-local",
            "two plain vLLM instances (cores 0 and 1) behind the rapidkv router's local "
            "dispatch (least outstanding requests, ties in turn: round-robin at concurrency 1)",
        ),
        Config(
            "vllm-nixl",
            "vllm-nixl",
            "proxy",
            "vLLM NixlConnector (pull), P core 0 / D core 1, serial proxy, tuned: " + TUNING,
        ),
        Config(
            "vllm-nixl-stock",
            "vllm-nixl-stock",
            "proxy",
            "vLLM NixlConnector (pull), P core 0 / D core 1, serial proxy, STOCK (untuned: "
            "UCX progress thread on, the NIXL worker moves P's forward to core 1)",
        ),
        Config(
            "vllm-nixl-push",
            "vllm-nixl-push",
            "proxy",
            "vLLM NixlPushConnector (push), P core 0 / D core 1, serial proxy, tuned as vllm-nixl",
        ),
        Config(
            "vllm-nixl-push-stock",
            "vllm-nixl-push-stock",
            "proxy",
            "vLLM NixlPushConnector, serial proxy, STOCK (untuned; not run by default)",
            default=False,
        ),
        _rapidkv(
            "rapidkv",
            "router-dual",
            "rapidkv P+D, router dual, connector default mode",
            paired=True,
        ),
        _rapidkv("rapidkv-step", "router-dual", "rapidkv, dual, transfer_kv_mode=step", "step"),
        _rapidkv(
            "rapidkv-bypass", "router-dual", "rapidkv, dual, transfer_kv_mode=bypass", "bypass"
        ),
        _rapidkv(
            "rapidkv-substep", "router-dual", "rapidkv, dual, transfer_kv_mode=substep", "substep"
        ),
        _rapidkv(
            "rapidkv-serial", "router-serial", "rapidkv, router serial dispatch, default mode"
        ),
        _rapidkv(
            "rapidkv-whole",
            "router-dual-whole",
            "rapidkv, dual, default mode, router --no-split-prefill (P computes every prompt)",
        ),
        _rapidkv(
            "rapidkv-d-first",
            "router-dual-d-first",
            "rapidkv, dual, default mode, router --no-split-prefill --no-prefill-first-token "
            "(P computes every prompt, every token from D)",
        ),
        Config(
            "rapidkv-local",
            "rapidkv",
            "router-local",
            "rapidkv's two instances (kv_both, connector loaded) behind the router's local "
            "dispatch, as dp2: no request crosses, so against dp2 it measures what the "
            "connector costs two plain replicas",
            default=False,
        ),
        Config(
            "rapidkv-adaptive",
            "rapidkv",
            "router-adaptive",
            "rapidkv, both instances given to the router as --instance (either may prefill or "
            "decode), --placement adaptive: local, PD, split or fetch per request (the router's "
            "default SLOs unless the benchmark sets them, as `bench goodput` does); with the "
            "servers' KV events (prefix caching on), its placement knows what each instance "
            "holds and may fetch a prefix from the one that holds it",
            default=False,
        ),
        Config(
            "rapidkv-adaptive-blind",
            "rapidkv",
            "router-adaptive-blind",
            "rapidkv-adaptive with --no-prefix-index: placed as if no instance held any "
            "prefix (the adaptive placement before it read the instances' KV events)",
            default=False,
        ),
        Config(
            "rapidkv-kv-aware-nofetch",
            "rapidkv",
            "router-adaptive-nofetch",
            "rapidkv-adaptive with --no-prefix-fetch: placement counts the prefix hits each "
            "instance would have, but never fetches a prefix from another instance",
            default=False,
        ),
        Config(
            "rapidkv-adaptive-unshaped",
            "rapidkv",
            "router-adaptive-unshaped",
            "rapidkv-adaptive with --no-specialize: each request placed on its own, the "
            "instances never pinned to prefill or to decode (against rapidkv-adaptive it "
            "measures what the fleet's shape does)",
            default=False,
        ),
        Config(
            "rapidkv-adaptive-busy-crossings",
            "rapidkv",
            "router-adaptive-busy-crossings",
            "rapidkv-adaptive with --busy-crossings: PD and split may compute a prompt on an "
            "instance that holds requests (against rapidkv-adaptive it measures what "
            "borrowing only idle instances does)",
            default=False,
        ),
        Config(
            "endpoint",
            "endpoint",
            None,
            "an endpoint already running (bench serve --base-url), started by its user",
            default=False,
        ),
    )
}

GROUPS: tuple[str, ...] = (
    "single",
    "single-noop-connector",
    "dp2",
    "vllm-nixl",
    "vllm-nixl-stock",
    "vllm-nixl-push",
    "vllm-nixl-push-stock",
    "rapidkv",
)
"""Start order (the reference, `single`, first)."""


@dataclass
class Front:
    """An HTTP front process (router or proxy)."""

    name: str
    url: str
    process: Any  # ManagedProcess


class EngineCounters:
    """vLLM's own counters read from what `scrape()` returns (per server, its
    `/metrics`): what a started group and an endpoint both report."""

    def scrape(self) -> dict[str, Any]:
        raise NotImplementedError

    def prompt_tokens(self, scraped: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
        """Per server, vLLM's prompt-token counters by source so far (or in
        `scraped`, a `scrape()`), as `PROMPT_TOKEN_SOURCES` names them."""
        from rapidkv.harness import metric_sum

        out = {}
        for key, m in (scraped if scraped is not None else self.scrape()).items():
            out[key] = {
                short: metric_sum(m, PROMPT_TOKENS_METRIC, source=source)
                for short, source in PROMPT_TOKEN_SOURCES
            }
        return out

    def ttft_histograms(self, scraped: dict[str, Any] | None = None) -> dict[str, Any]:
        """Per server, vLLM's histogram of its engine's TTFT so far (or in
        `scraped`), a `stats.Histogram` in seconds."""
        from rapidkv.bench.common.stats import TTFT_METRIC, histogram

        scraped = scraped if scraped is not None else self.scrape()
        return {key: histogram(m, TTFT_METRIC) for key, m in scraped.items()}


@dataclass
class RunningGroup(EngineCounters):
    """A started group: its servers by role, its fronts by name, how long it took."""

    name: str
    servers: dict[str, Any]  # "single", "a"/"b" (dp2) or "prefill"/"decode" -> VLLMServer
    fronts: dict[str, Front] = field(default_factory=dict)
    startup_s: float = 0.0  # launch -> every server and front healthy
    notes: list[str] = field(default_factory=list)
    controls: dict[str, str] = field(default_factory=dict)  # rapidkv: role -> control address
    plan: FrontPlan | None = None  # every front the group can have, as (name, argv)
    log_dir: Path | None = None

    def start_front(self, front: str, extra: Sequence[str] = (), label: str | None = None) -> Front:
        """Start front `front` of the group's plan, `extra` appended to its argv
        (a later option wins: `--tpot-slo-ms 9`), in place of a running one of
        that name; its log is `<group>.<label or front>.log`."""
        assert self.plan is not None and self.log_dir is not None
        argv = dict(self.plan(self))[front]
        self.stop_front(front)
        name = f"{self.name}.{label or front}"
        started = start_front(name, [*argv, *extra], self.log_dir, helper_cpus(self.name))
        self.fronts[front] = started
        return started

    def stop_front(self, front: str) -> None:
        """Stop front `front` if it runs."""
        running = self.fronts.pop(front, None)
        if running is not None:
            running.process.stop()

    def _timeline_replies(self, xfer_ids: Sequence[str]) -> dict[str, Any]:
        """rapidkv: per role, its connector's `Timeline` for these transfers."""
        from rapidkv.control.client import RpcClient
        from rapidkv.control.messages import TimelineRequest

        with RpcClient() as rpc:
            return {
                role: rpc.call(address, TimelineRequest(list(xfer_ids)), 10)
                for role, address in self.controls.items()
            }

    def timelines(self, xfer_ids: Sequence[str]) -> dict[str, dict[str, dict[str, float]]]:
        """rapidkv: per role, each transfer's connector events (time.monotonic())."""
        if not self.controls or not xfer_ids:
            return {}
        return {
            role: {x: dict(t.events) for x, t in reply.xfers.items()}
            for role, reply in self._timeline_replies(xfer_ids).items()
        }

    def steps(self, since: float) -> dict[str, list[Any]]:
        """rapidkv: per role, the engine steps (`StepTiming`) that began at or
        after `since` (time.monotonic()), of the most recent its connector keeps."""
        return {
            role: [s for s in reply.steps if s.begin >= since]
            for role, reply in self._timeline_replies([]).items()
        }

    def url(self, config: Config) -> str:
        if config.front is None:
            (server,) = self.servers.values()
            return server.base_url
        return self.fronts[config.front].url

    def crashes(self) -> list[str]:
        """Why servers of this group died, where their logs tell (SIGILL)."""
        from rapidkv.connector.amx import cpu_has_amx

        cause = AMX_CAUSE if cpu_has_amx() else ""
        return [
            SIGILL_CRASH.format(server=key) + cause
            for key, server in self.servers.items()
            if server.died_of_sigill()
        ]

    def trees(self) -> dict[str, Any]:
        """Every process tree of the group by name (servers, then fronts)."""
        out = {key: s.process for key, s in self.servers.items()}
        out.update({name: f.process for name, f in self.fronts.items()})
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by each live process tree."""
        from rapidkv.harness.procs import tree_cpu_seconds

        return {name: tree_cpu_seconds(proc.live_pids()) for name, proc in self.trees().items()}

    def scrape(self) -> dict[str, Any]:
        """Per server, its `/metrics` now (`harness.get_metrics`)."""
        from rapidkv.harness import get_metrics

        return {key: get_metrics(server.base_url) for key, server in self.servers.items()}

    def reset_prefix_cache(self) -> list[str]:
        """Empty every server's prefix cache (servers started with prefix
        caching); what failed, one line each (vLLM refuses while blocks are in use)."""
        import httpx

        failed = []
        for key, server in self.servers.items():
            try:
                r = httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=30)
                r.raise_for_status()
            except httpx.HTTPError as e:
                failed.append(f"{self.name}.{key}: /reset_prefix_cache: {type(e).__name__}: {e}")
        return failed

    def affinity(self) -> dict[str, list[str]]:
        """Per server and front, the distinct CPU lists its threads may run on."""
        from rapidkv.harness.procs import tree_affinity

        return {name: tree_affinity(proc.live_pids()) for name, proc in self.trees().items()}

    def stop(self) -> None:
        """Stop fronts, then servers; the first error is raised after all were tried."""
        errors = []
        for proc in [f.process for f in self.fronts.values()] + [s for s in self.servers.values()]:
            try:
                proc.stop()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]


@dataclass
class Endpoint(EngineCounters):
    """An endpoint already running (`bench serve --base-url`): measured as a
    group is, with nothing started or stopped. Its `/metrics`, when it has
    vLLM's (a vLLM instance; a rapidkv router has its own), give the prompt
    tokens by source and the engine's TTFT; no process of it is known here, so
    no CPU time, affinity or crash is."""

    base_url: str
    name: str = "endpoint"
    servers: dict[str, Any] = field(default_factory=dict)
    startup_s: float = 0.0

    def url(self, config: Config) -> str:
        return self.base_url

    def scrape(self) -> dict[str, Any]:
        """`{"endpoint": its /metrics}` when it has vLLM's counters, else `{}`."""
        from rapidkv.harness import get_metrics

        try:
            metrics = get_metrics(self.base_url)
        except Exception:  # no /metrics: nothing to count
            return {}
        has_vllm = any(name == PROMPT_TOKENS_METRIC for name, _ in metrics)
        return {"endpoint": metrics} if has_vllm else {}

    def cpu_seconds(self) -> dict[str, float]:
        return {}

    def timelines(self, xfer_ids: Sequence[str]) -> dict[str, dict[str, dict[str, float]]]:
        return {}

    def steps(self, since: float) -> dict[str, list[Any]]:
        return {}

    def crashes(self) -> list[str]:
        return []

    def affinity(self) -> dict[str, list[str]]:
        return {}

    def reset_prefix_cache(self) -> list[str]:
        return []  # not ours to reset

    def stop(self) -> None:
        pass


# --------------------------------------------------------------------- starting


def start_group(
    name: str,
    model: Path,
    log_dir: Path,
    extra_args: Sequence[str] = (),
    fronts: set[str | None] | None = None,
    link: Any = None,
    prefix_caching: bool = False,
    kv_events: bool = False,
) -> RunningGroup:
    """Start group `name` and wait until everything in it is healthy; of its
    HTTP fronts, only those named in `fronts` (all when None). With `link`
    (`harness.netns.NetnsLink`), rapidkv's P runs in its namespace A, D in B.
    With `prefix_caching`, the servers keep vLLM's default (prefix caching on)
    and serve `/reset_prefix_cache` (`RunningGroup.reset_prefix_cache`); with
    `kv_events` too, the rapidkv group's servers publish their KV cache
    events (`kv_events_args`; other groups publish none)."""
    from rapidkv.harness import start_servers

    if kv_events and not prefix_caching:
        raise ValueError("kv_events: the servers publish KV events with prefix caching only")
    t0 = time.monotonic()
    args = tuple(extra_args) if prefix_caching else (*COMMON_ARGS, *extra_args)
    keyed, plan = _group_plan(name, model, log_dir, args, link)
    if prefix_caching:
        keyed = [(k, s.replace(env={**s.env, **RESET_ENV})) for k, s in keyed]
    if kv_events and name == "rapidkv":
        keyed = [
            (k, s.replace(extra_args=(*s.extra_args, *kv_events_args(s.host)))) for k, s in keyed
        ]
    cpus = helper_cpus(name)
    servers = start_servers([spec for _, spec in keyed], log_dir)
    group = RunningGroup(name, {key: s for (key, _), s in zip(keyed, servers, strict=True)})
    group.plan, group.log_dir = plan, log_dir
    group.controls = {
        key: rapidkv_control(spec.kv_transfer_config)
        for key, spec in keyed
        if (spec.kv_transfer_config or {}).get("kv_connector") == "RapidKVConnector"
    }
    try:
        for front, argv in plan(group):
            if fronts is None or front in fronts:
                group.fronts[front] = start_front(f"{name}.{front}", argv, log_dir, cpus)
    except BaseException:
        group.stop()
        raise
    group.startup_s = time.monotonic() - t0
    return group


def rapidkv_control(kv_transfer_config: Any) -> str:
    """The control address a RapidKVConnector instance advertises (its fixed port)."""
    from rapidkv.connector.config import ConnectorConfig
    from rapidkv.control.address import format_address

    config = ConnectorConfig.from_extra(kv_transfer_config["kv_connector_extra_config"])
    return format_address(config.control_advertised_host, config.control_port)


def kv_events_args(host: str) -> list[str]:
    """vLLM's `--kv-events-config` for one server: its KV cache events
    published over ZMQ at a free port, with a replay endpoint at another on
    `host` (`rapidkv.connector.connector.kv_events_publisher` names both to a
    router). The publisher binds `host` only (`harness.kv_events.bound_endpoint`)."""
    import json

    from rapidkv.harness import free_port
    from rapidkv.harness.kv_events import bound_endpoint

    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": bound_endpoint(free_port(host), host),
        "replay_endpoint": f"tcp://{host}:{free_port()}",
    }
    return ["--kv-events-config", json.dumps(config)]


PAIR_PAUSE_S = 1.2
"""Before every block of a paired measurement: vLLM's engine and worker busy-wait
(sched_yield) on their shared-memory queues for 1 s after their last step, and
`single` shares the decoding core with the group."""

COMMON_ARGS = ("--no-enable-prefix-caching",)
"""Every server's arguments unless a group is started with prefix caching."""
RESET_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""What makes vLLM's API server serve `POST /reset_prefix_cache`."""
SINGLE_CPU = 1  # D's core: `single`'s decode and D's run on the same core
HELPER_CPU = 0  # P's core: fronts and the client stay off the decoding core


def helper_cpus(group: str) -> set[int] | None:
    """Where `group`'s fronts and the client's event loop run (None: anywhere).
    Not pinned in the stock NIXL groups: their P spreads over both cores and
    busy-polls UCX there; a front pinned to core 0 starved (requests timed out,
    SIGKILL took > 15 s)."""
    return None if group.endswith("-stock") else {HELPER_CPU}


PROMPT_TOKENS_METRIC = "vllm:prompt_tokens_by_source_total"
PROMPT_TOKEN_SOURCES = (
    ("external", "external_kv_transfer"),  # KV received through a connector
    ("local", "local_compute"),  # computed by the instance
    ("cached", "local_cache_hit"),  # found in the instance's prefix cache
)

FrontPlan = Callable[[RunningGroup], list[tuple[str, list[str]]]]


def _group_plan(
    name: str, model: Path, log_dir: Path, extra: tuple[str, ...], link: Any = None
) -> tuple[list[tuple[str, Any]], FrontPlan]:
    """The group's servers as (key, ServerSpec) and a function giving its fronts' argv."""
    from rapidkv.connector.config import kv_transfer_config
    from rapidkv.harness import ServerSpec, free_port
    from rapidkv.harness.server import pd_specs

    args = extra

    def spec(name: str, role: str, cpu: int, **kw: Any) -> ServerSpec:
        return ServerSpec(model=model, name=name, role=role, cpus=(cpu,), extra_args=args, **kw)  # type: ignore[arg-type]

    if name == "single":
        return [("single", spec("single", "single", SINGLE_CPU))], lambda g: []
    if name == "single-noop-connector":
        kv = {
            "kv_connector": "NoopConnector",
            "kv_connector_module_path": "rapidkv.connector.noop",
            "kv_role": "kv_both",
        }
        noop = spec(name, "single", SINGLE_CPU, kv_transfer_config=kv)
        return [("single", noop)], lambda g: []
    if name == "dp2":
        specs = [("a", spec("dp2-a", "single", 0)), ("b", spec("dp2-b", "single", 1))]

        def dp2_front(g: RunningGroup) -> list[tuple[str, list[str]]]:
            urls = [s.base_url for s in g.servers.values()]
            return [("router-local", router_argv("local", [], urls))]

        return specs, dp2_front
    if name == "rapidkv":
        pc, dc = free_port(), free_port()
        if link is None:
            p_cfg, d_cfg = kv_transfer_config(pc), kv_transfer_config(dc)
        else:  # as on two hosts: P binds everywhere, advertises its link address
            p_cfg = kv_transfer_config(
                pc,
                control_host="0.0.0.0",
                control_advertise_host=link.a.host,
                kvt_host=link.a.host,
            )
            d_cfg = kv_transfer_config(dc, control_host=link.b.host, kvt_host=link.b.host)
        specs = pd_specs(model, p_cfg, d_cfg, args)
        if link is not None:
            specs = [
                s.replace(netns=side.name, host=side.host)
                for s, side in zip(specs, (link.a, link.b), strict=True)
            ]
        specs = [(s.role, s.replace(name=f"rapidkv-{s.name}")) for s in specs]

        def rapidkv_fronts(g: RunningGroup) -> list[tuple[str, list[str]]]:
            urls = [g.servers["prefill"].base_url, g.servers["decode"].base_url]
            p = [f"{urls[0]}={rapidkv_control(p_cfg)}"]
            d = [f"{urls[1]}={rapidkv_control(d_cfg)}"]
            adaptive = router_argv("dual", [], [], instances=p + d)
            return [
                ("router-dual", router_argv("dual", p, d)),
                ("router-serial", router_argv("serial", p, d)),
                ("router-dual-whole", [*router_argv("dual", p, d), "--no-split-prefill"]),
                (
                    "router-dual-d-first",
                    [*router_argv("dual", p, d), "--no-split-prefill", "--no-prefill-first-token"],
                ),
                ("router-adaptive", [*adaptive, "--placement", "adaptive"]),
                (
                    "router-adaptive-blind",
                    [*adaptive, "--placement", "adaptive", "--no-prefix-index"],
                ),
                (
                    "router-adaptive-nofetch",
                    [*adaptive, "--placement", "adaptive", "--no-prefix-fetch"],
                ),
                (
                    "router-adaptive-unshaped",
                    [*adaptive, "--placement", "adaptive", "--no-specialize"],
                ),
                (
                    "router-adaptive-busy-crossings",
                    [*adaptive, "--placement", "adaptive", "--busy-crossings"],
                ),
                ("router-local", router_argv("local", [], urls)),
            ]

        return specs, rapidkv_fronts
    if name.startswith("vllm-nixl"):
        connector = "NixlPushConnector" if name.startswith("vllm-nixl-push") else "NixlConnector"
        tuned = not name.endswith("-stock")
        specs = []
        for role, cpu, kv_role in (("prefill", 0, "kv_producer"), ("decode", 1, "kv_consumer")):
            env = {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            }
            if tuned:
                env.update(_tuning_env(log_dir / "nixl-tuning", cpu))
            kv = {
                "kv_connector": connector,
                "kv_role": kv_role,
                "kv_buffer_device": "cpu",
                "kv_load_failure_policy": "recompute",
            }
            specs.append((role, spec(f"{name}-{role}", role, cpu, kv_transfer_config=kv, env=env)))

        def proxy_front(g: RunningGroup) -> list[tuple[str, list[str]]]:
            p, d = g.servers["prefill"].base_url, g.servers["decode"].base_url
            argv = [sys.executable, "-m", "rapidkv.bench.common.proxy", "--prefill", p]
            return [("proxy", [*argv, "--decode", d, "--port", str(free_port())])]

        return specs, proxy_front
    raise ValueError(f"unknown group {name!r}")


def _tuning_env(directory: Path, cpu: int) -> dict[str, str]:
    from rapidkv.bench.common.nixl_tuning import CPUS_ENV, write_sitecustomize
    from rapidkv.harness.server import SRC_DIR

    path = [str(write_sitecustomize(directory)), str(SRC_DIR), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, path)), CPUS_ENV: str(cpu)}


def router_argv(
    dispatch: str, prefill: list[str], decode: list[str], instances: Sequence[str] = ()
) -> list[str]:
    from rapidkv.harness import free_port

    argv = [sys.executable, "-m", "rapidkv.cli", "router", "--dispatch", dispatch]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    for url in instances:
        argv += ["--instance", url]
    return [*argv, "--port", str(free_port()), "--log-level", "warning"]


def start_front(
    name: str,
    argv: list[str],
    log_dir: Path,
    cpus: set[int] | None,
    timeout: float = 60.0,
) -> Front:
    """Start a front process (its argv ends with `--port N ...`), pinned to `cpus`
    unless None, and wait for its /health."""
    import httpx

    from rapidkv.harness import ManagedProcess, wait_until
    from rapidkv.harness.server import SRC_DIR, pinned

    port = argv[argv.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
    cmd = argv if cpus is None else pinned(argv, sorted(cpus))
    proc = ManagedProcess(cmd, env, log_dir / f"{name}.log", name=name)

    def healthy() -> bool:
        if proc.returncode() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode()}):\n{proc.log_tail(30)}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
        return False

    try:
        wait_until(healthy, timeout, interval=0.1, what=f"{name} /health")
    except BaseException:
        proc.stop()
        raise
    return Front(name, url, proc)
