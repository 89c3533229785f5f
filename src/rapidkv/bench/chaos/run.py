"""`rapidkv bench chaos`: the run, from the reference outputs to the quiesce.

1. `single` (one vLLM instance, no connector, core 1) serves every prompt once
   (greedy, the longest `max_tokens` of the run: a shorter request's reference
   is its prefix) and is stopped; with `--reference-url`, the running instance
   there serves them instead;
2. P (core 0) and D (core 1) start with RapidKVConnector on fixed HTTP and
   control ports, injected transfer failures and send delays on P
   (`debug_fail_transfer_rate`, `debug_send_delay_s`), and the rapidkv router
   in dual dispatch (a process of its own, core 0, beside P and this client);
3. a few unmeasured streams warm the pair up (and seed the abort timing);
4. the workload runs at its concurrency (`driver.drive`), P and D each killed
   and restarted once on its address during it (`faults.FaultSchedule`);
5. quiesce: wait (at most `quiesce_timeout_s`) until, on P and D, vLLM runs and
   queues nothing and the connector holds nothing (free blocks back at the
   baseline the process had when it became healthy, no live transfer, no
   parked TransferKV, no request waiting for KV), then read it all once more:
   `leaked_blocks` = baseline - free blocks now.

Everything started is stopped on the way out (the harness's watchdog stops it
if this process dies).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rapidkv.bench.common.options import check_model, from_namespace, served_fields

WARMUP_LENGTHS = (64, 300, 600, 900)


@dataclass(frozen=True)
class Options:
    requests: int
    concurrency: int
    min_len: int
    max_len: int
    min_tokens: int
    max_tokens: int
    stream_share: float
    abort_share: float
    fail_rate: float
    send_delay_s: float
    restarts: tuple[str, ...]
    timeout_s: float
    quiesce_timeout_s: float
    recovery_timeout_s: float
    seed: int
    dtype: str
    server_args: tuple[str, ...]
    include_usage: bool = True  # streams ask for stream_options: {"include_usage": true}
    model: str = "tiny"  # options.MODELS, or a checkpoint's directory
    dataset: str = "random"  # the prompts of the plans' lengths
    reference_url: str | None = None  # a running instance that gives the references

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:

        roles = {"p": "prefill", "d": "decode", "prefill": "prefill", "decode": "decode"}
        restarts = []
        for name in (t.strip() for t in args.restarts.split(",")):
            if not name:
                continue
            if name not in roles:
                raise ValueError(f"--restarts: unknown instance {name!r} (p, d)")
            restarts.append(roles[name])
        if len(set(restarts)) != len(restarts):
            raise ValueError("--restarts: each instance at most once")
        check_model(getattr(args, "model", "tiny"))
        if args.requests < 1 or args.concurrency < 1:
            raise ValueError("--requests and --concurrency must be >= 1")
        if restarts and args.requests < 3 * args.concurrency:
            raise ValueError("with restarts, give at least 3 x --concurrency requests")
        if not 1 <= args.min_len <= args.max_len:
            raise ValueError("need 1 <= --min-len <= --max-len")
        if not 1 <= args.min_tokens <= args.max_tokens:
            raise ValueError("need 1 <= --min-tokens <= --max-tokens")
        if args.max_len + args.max_tokens > 1024:
            raise ValueError("--max-len + --max-tokens must fit the servers' 1024-token context")
        url = args.reference_url
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"--reference-url {url!r}: give an http:// or https:// URL")
        for name in ("stream_share", "abort_share", "fail_rate"):
            if not 0 <= getattr(args, name) <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be between 0 and 1")
        return from_namespace(
            cls,
            args,
            send_delay_s=args.send_delay,
            restarts=tuple(sorted(restarts, key=["prefill", "decode"].index)),
            timeout_s=args.timeout,
            quiesce_timeout_s=args.quiesce_timeout,
            recovery_timeout_s=args.recovery_timeout,
            **served_fields(args),
        )


def say(message: str) -> None:
    print(f"[{time.strftime('%T')}] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from rapidkv.bench.chaos.report import build_report, print_report
    from rapidkv.bench.common.options import log_dir as make_log_dir
    from rapidkv.bench.common.output import table_stream, to_json
    from rapidkv.bench.common.run import command_line, parse_options

    opts = parse_options(Options.from_args, args, "chaos")
    if opts is None:
        return 2
    log_dir = make_log_dir(args, "chaos")
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        result = Chaos(opts, log_dir).run()
    except SetupError as e:
        print(f"rapidkv bench chaos: {e}", file=sys.stderr)
        print(f"server logs: {log_dir}", file=sys.stderr)
        return 1
    from rapidkv.harness.procs import cpu_model

    extra = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(),
        "command": command_line("chaos"),
        "wall_s": time.monotonic() - t0,
        "run_s": result["run_s"],
        "log_dir": str(log_dir),
    }
    report = build_report(
        result["outcomes"],
        options={k: v for k, v in opts.__dict__.items()},
        restarts=result["restarts"],
        incarnations=result["incarnations"],
        quiesce=result["quiesce"],
        warmup=result["warmup"],
        timing=result["timing"],
        extra=extra,
    )
    if args.trace:
        with open(args.trace, "w") as f:
            for o in result["outcomes"]:
                f.write(to_json(o.row()) + "\n")
    print_report(report, table_stream(args.json))
    text = to_json(report, indent=1)
    if args.json and args.json != "-":
        Path(args.json).write_text(text + "\n")
    print(text)
    print(f"server logs: {log_dir}", file=sys.stderr)
    failed = not report["ok"] or (
        args.strict_recovery and not report["acceptance"]["recovery_within_bound"]
    )
    return 1 if failed else 0


class SetupError(RuntimeError):
    """The reference or the pair could not be set up: no run."""


class Chaos:
    def __init__(self, opts: Options, log_dir: Path) -> None:
        from rapidkv.bench.chaos.workload import make_plans
        from rapidkv.bench.common.dataset import prompts_of_lengths
        from rapidkv.bench.common.options import model_dir

        self.opts = opts
        self.log_dir = log_dir
        self.model = model_dir(opts.model, opts.dtype)
        self.plans = make_plans(
            opts.requests,
            seed=opts.seed,
            min_len=opts.min_len,
            max_len=opts.max_len,
            min_tokens=opts.min_tokens,
            max_tokens=opts.max_tokens,
            stream_share=opts.stream_share,
            abort_share=opts.abort_share,
        )
        lengths = [p.prompt_len for p in self.plans] + list(WARMUP_LENGTHS)
        self.prompts = prompts_of_lengths(self.model, lengths, opts.seed, opts.dataset)

    # ---------------------------------------------------------------- steps

    def reference(self) -> list[list[int]]:
        """Every prompt's greedy answer from the instance at `--reference-url`,
        else from `single`, started for it and stopped after."""
        from rapidkv.harness import ServerSpec, VLLMServer

        if self.opts.reference_url is not None:
            return self._answers(self.opts.reference_url)
        spec = ServerSpec(
            model=self.model,
            name="chaos-single",
            role="single",
            cpus=(1,),
            extra_args=self.opts.server_args,
            dtype=self.opts.dtype,
        )
        try:
            with VLLMServer.start(spec, self.log_dir) as single:
                return self._answers(single.base_url)
        except SetupError:
            raise
        except Exception as e:
            raise SetupError(f"reference failed: {type(e).__name__}: {e}") from e

    def _answers(self, url: str) -> list[list[int]]:
        from rapidkv.harness import complete_many

        say(f"reference: {url}, {len(self.prompts)} prompts")
        try:
            return complete_many(
                url, self.prompts, self.opts.max_tokens, concurrency=4, timeout=self.opts.timeout_s
            )
        except Exception as e:
            raise SetupError(f"reference from {url} failed: {type(e).__name__}: {e}") from e

    def start_pair(self) -> tuple[list[Any], dict[str, str]]:
        from rapidkv.connector.config import kv_transfer_config
        from rapidkv.harness import free_port, start_servers
        from rapidkv.harness.server import pd_specs

        pc, dc = free_port(), free_port()
        faults = {
            "debug_fail_transfer_rate": self.opts.fail_rate,
            "debug_send_delay_s": self.opts.send_delay_s,
        }
        specs = pd_specs(
            self.model,
            kv_transfer_config(pc, **faults),  # P sends: the faults are its
            kv_transfer_config(dc),
            self.opts.server_args,
        )
        # fixed ports: a restarted instance comes back on its address
        specs = [
            s.replace(name=f"chaos-{s.name}", port=free_port(), dtype=self.opts.dtype)
            for s in specs
        ]
        say("starting P (core 0) and D (core 1)")
        try:
            servers = start_servers(specs, self.log_dir)
        except Exception as e:
            raise SetupError(f"the pair did not start: {type(e).__name__}: {e}") from e
        return servers, {"prefill": f"127.0.0.1:{pc}", "decode": f"127.0.0.1:{dc}"}

    def start_router(self, servers: Sequence[Any], controls: dict[str, str]) -> Any:
        from rapidkv.bench.common.groups import HELPER_CPU, router_argv, start_front

        p, d = servers
        argv = router_argv(
            "dual", [f"{p.base_url}={controls['prefill']}"], [f"{d.base_url}={controls['decode']}"]
        )
        try:
            return start_front("chaos.router", argv, self.log_dir, {HELPER_CPU})
        except Exception as e:
            raise SetupError(f"the router did not start: {type(e).__name__}: {e}") from e

    def warm_up(self, url: str, refs: list[list[int]], timing: Any) -> list[Any]:
        from rapidkv.bench.chaos.driver import run_one
        from rapidkv.bench.chaos.workload import Plan

        n = len(self.plans)

        async def main() -> list[Any]:
            import aiohttp

            outs = []
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as session:
                for k, length in enumerate(WARMUP_LENGTHS):
                    plan = Plan(n + k, length, self.opts.max_tokens, True, None, 0.0)
                    out = await run_one(
                        session,
                        url,
                        self.prompts[n + k],
                        plan,
                        refs[n + k],
                        None,
                        self.opts.timeout_s,
                        time.monotonic(),
                        include_usage=self.opts.include_usage,
                    )
                    if out.kind == "completed" and out.ttft_s is not None and out.tokens > 1:
                        timing.add(length, out.ttft_s, (out.e2e_s - out.ttft_s) / (out.tokens - 1))
                    outs.append(out)
            return outs

        return asyncio.run(main())

    def run(self) -> dict[str, Any]:
        from rapidkv.bench.chaos.driver import drive
        from rapidkv.bench.chaos.faults import FaultSchedule, Instances
        from rapidkv.bench.chaos.workload import Timing
        from rapidkv.bench.common.groups import HELPER_CPU

        full = self.reference()
        refs = [r[: p.max_tokens] for r, p in zip(full, self.plans, strict=False)]
        refs += full[len(self.plans) :]
        servers, controls = self.start_pair()
        try:
            router = self.start_router(servers, controls)
            try:
                t_run = time.monotonic()
                pair = Instances(
                    dict(zip(("prefill", "decode"), servers, strict=True)), controls, t_run
                )
                try:
                    for role in pair.servers:
                        pair.begin(role)
                    previous = os.sched_getaffinity(0)
                    os.sched_setaffinity(0, {HELPER_CPU})  # this thread and those it starts
                    try:
                        return self._measure(pair, router.url, refs, drive, FaultSchedule, Timing)
                    finally:
                        os.sched_setaffinity(0, previous)
                finally:
                    pair.close()
            finally:
                router.process.stop()
        finally:
            from rapidkv.harness.server import stop_servers

            for name, e in stop_servers(servers):
                say(f"stopping {name}: {e}")

    def _measure(
        self, pair: Any, url: str, refs: list[list[int]], drive: Any, schedule: Any, timing_cls: Any
    ) -> dict[str, Any]:
        opts = self.opts
        n = len(self.plans)
        timing = timing_cls()
        say(f"warm-up: {len(WARMUP_LENGTHS)} streams")
        warmup = self.warm_up(url, refs, timing)
        faults = schedule(
            pair,
            n,
            opts.restarts,
            tail=max(2 * opts.concurrency, n // 10),
            router_url=url,
            recovery_timeout_s=opts.recovery_timeout_s,
            say=say,
        )
        done = [0]
        step = max(1, n // 10)

        def on_done(outcome: Any) -> None:
            done[0] += 1
            if done[0] % step == 0 or done[0] == n:
                say(f"{done[0]}/{n} requests done")

        say(
            f"workload: {n} requests at concurrency {opts.concurrency}; restarts "
            f"{', '.join(f'{r} at request {faults.at[r]}' for r in opts.restarts) or 'none'}"
        )
        t_start = time.monotonic()

        async def main() -> tuple[list[Any], Any]:
            return await drive(
                url,
                self.plans,
                self.prompts[:n],
                refs[:n],
                concurrency=opts.concurrency,
                timeout_s=opts.timeout_s,
                before=faults.before,
                on_done=on_done,
                timing=timing,
                include_usage=opts.include_usage,
            )

        outcomes, timing = asyncio.run(main())
        run_s = time.monotonic() - t_start
        faults.join(opts.recovery_timeout_s + 300)
        say("quiesce")
        quiesce = self.quiesce(pair, url)
        return {
            "outcomes": outcomes,
            "warmup": warmup,
            "restarts": [faults.restarts[r] for r in opts.restarts if r in faults.restarts],
            "incarnations": pair.incarnations,
            "quiesce": quiesce,
            "timing": timing.snapshot(),
            "run_s": run_s,
        }

    def quiesce(self, pair: Any, router_url: str) -> dict[str, Any]:
        keys = ("transfers_live", "parked_now", "waiting_for_kv", "held_blocks", "held_requests")
        t0 = time.monotonic()
        deadline = t0 + self.opts.quiesce_timeout_s
        read: dict[str, dict[str, Any]] = {}
        router: dict[str, Any] = {}

        def settled() -> bool:
            try:
                router.clear()  # an earlier failed reading is not this one's
                router.update(router_view(router_url))
                ok = not router["in_flight"] and not any(router["outstanding"].values())
            except Exception as e:
                router["error"] = f"{type(e).__name__}: {e}"
                ok = False
            for role in pair.servers:
                try:
                    stats, engine = pair.stats(role), pair.engine(role)
                except Exception as e:
                    read[role] = {"error": f"{type(e).__name__}: {e}"}
                    ok = False
                    continue
                base = pair.incarnations[role][-1].baseline_free_blocks
                row: dict[str, Any] = {**engine, "free_blocks": stats.get("free_blocks")}
                row["baseline_free_blocks"] = base
                row.update({k: stats.get(k, 0.0) for k in keys})
                row["stats"] = stats
                read[role] = row
                ok = ok and not engine["running"] and not engine["waiting"]
                ok = ok and row["free_blocks"] == base
                ok = ok and not any(row[k] for k in keys)
            return ok

        idle = settled()
        while not idle and time.monotonic() < deadline:
            time.sleep(0.2)
            idle = settled()
        return {
            "idle": idle,
            "took_s": time.monotonic() - t0,
            "timeout_s": self.opts.quiesce_timeout_s,
            "instances": read,
            "router": router,
        }


def router_view(url: str) -> dict[str, Any]:
    """The router's requests in flight, upstream requests outstanding per role,
    and its request outcomes and upstream errors so far (its /metrics)."""
    from rapidkv.harness import get_metrics

    m = get_metrics(url)
    out: dict[str, Any] = {
        "in_flight": 0.0,
        "outstanding": {},
        "outcomes": {},
        "upstream_errors": {},
    }
    for (name, labels), value in m.items():
        lab = dict(labels)
        if name == "rapidkv_router_requests_in_flight":
            out["in_flight"] += value
        elif name == "rapidkv_router_outstanding":
            role = lab.get("role", "?")
            out["outstanding"][role] = out["outstanding"].get(role, 0.0) + value
        elif name == "rapidkv_router_requests_total" and value:
            key = lab.get("outcome", "?")
            out["outcomes"][key] = out["outcomes"].get(key, 0.0) + value
        elif name == "rapidkv_router_upstream_errors_total" and value:
            key = f"{lab.get('role')} {lab.get('kind')}"
            out["upstream_errors"][key] = out["upstream_errors"].get(key, 0.0) + value
    return out
