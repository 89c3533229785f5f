"""`rapidkv bench goodput`: the run: `single` first (references,
c1, the SLOs), then every other group, each workload swept rate by rate (every
group up at once, each rate on every configuration in turn, unless
`--one-group-at-a-time`).

The method and its outputs are in the package's docstring (`rapidkv.bench.goodput`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from rapidkv.bench.common.options import log_dir as make_log_dir
from rapidkv.bench.common.progress import Progress
from rapidkv.bench.common.provenance import git_describe
from rapidkv.bench.common.run import command_line, finish, parse_options
from rapidkv.bench.goodput.options import Options, fixed_fronts, is_adaptive
from rapidkv.bench.goodput.results import ConfigRun, RateRun, SweepResult, WorkloadRun


def run(args: argparse.Namespace) -> int:
    from rapidkv.bench.goodput.report import build_report, print_report

    opts = parse_options(Options.from_args, args, "goodput")
    if opts is None:
        return 2
    git_describe()  # the checkout measured: as it is now (cached)
    log_dir = make_log_dir(args, "goodput")
    progress = Progress(opts.units())
    t0 = time.monotonic()
    try:
        sweep = Sweep(opts, log_dir, progress).run()
    finally:
        progress.close()
    report = build_report(sweep, opts, log_dir, time.monotonic() - t0, command_line("goodput"))

    def draw(path: Path) -> None:
        from rapidkv.bench.goodput.plot import plot

        plot(report, path)

    return finish(report, args, print_report, log_dir, draw)


# ------------------------------------------------------------------ running


class Sweep(SweepResult):
    """`single` first (references, c1, SLOs), then the other groups: by default
    all started together and swept rate by rate, each rate on every
    configuration in turn (`run_groups_together`); with `together` off, each
    group started, swept on every workload and stopped in turn
    (`serve.configs.GROUPS` order)."""

    def __init__(self, opts: Options, log_dir: Path, progress: Any) -> None:
        from rapidkv.bench.common.options import model_dir
        from rapidkv.bench.goodput.workloads import requests_of

        self.opts = opts
        self.log_dir = log_dir
        self.progress = progress
        self.model_dir = model_dir(opts.model, opts.dtype)
        self.workloads: dict[str, WorkloadRun] = {
            name: requests_of(
                name, self.model_dir, opts.requests, opts.seed, opts.dataset, opts.rate_warm_up
            )
            for name in opts.workloads
        }
        self.configs = {name: ConfigRun(name) for name in opts.configs}

    def run(self) -> Sweep:
        from rapidkv.bench.common.groups import CONFIGS, GROUPS

        wanted = {CONFIGS[c].group for c in self.opts.configs} | {"single"}
        groups = {
            g: [c for c in self.opts.configs if CONFIGS[c].group == g]
            for g in GROUPS
            if g in wanted
        }
        self.run_single(groups.pop("single"))
        if not any(w.slo is not None for w in self.workloads.values()):
            for members in groups.values():
                self.fail(members, "not run: single gave no SLO (see its workloads' errors)")
                self.progress.advance(sum(self.config_units(m) for m in members))
        elif self.opts.together:
            self.run_groups_together(groups)
        else:
            for group, members in groups.items():
                self.run_group(group, members)
        return self

    def config_units(self, name: str) -> int:
        n = sum(len(self.opts.rates[w]) * self.opts.count(w) for w in self.workloads)
        return n + (0 if name == "single" else self.opts.warmup * len(self.workloads))

    def fail(self, members: list[str], why: str) -> None:
        for name in members:
            if not self.configs[name].error:
                self.configs[name].error = why[:4000]

    # -------------------------------------------------------------- groups

    def start(self, group_name: str, members: list[str], fronts: set[str | None]) -> Any:
        """The started group, or the reason it did not start (its members fail).
        With prefix caching (a workload of shared prefixes), the rapidkv
        group's servers publish their KV events when an adaptive router runs."""
        from rapidkv.bench.common.groups import CONFIGS, start_group

        self.progress.stage(f"starting {group_name}")
        caching = self.opts.prefix_caching
        try:
            group = start_group(
                group_name,
                self.model_dir,
                self.log_dir,
                self.opts.server_args,
                fronts=fronts,
                prefix_caching=caching,
                # the adaptive routers' prefix index reads them
                kv_events=caching and any(is_adaptive(CONFIGS[m].front) for m in members),
            )
        except Exception as e:
            why = f"{group_name} did not start: {type(e).__name__}: {e}"
            self.progress.say(why[:3000])
            self.fail(members, why)
            return why
        for name in members:
            self.configs[name].startup_s = group.startup_s
            self.configs[name].affinity = group.affinity()
        return group

    def stop(self, group: Any, members: list[str]) -> None:
        crashes = group.crashes()
        if crashes:
            why = "; ".join(crashes)
            self.progress.say(f"{group.name}: {why}")
            for name in members:
                c = self.configs[name]
                c.error = (why + (f"; then: {c.error}" if c.error else ""))[:4000]
        self.progress.stage(f"stopping {group.name}")
        group.stop()

    def run_single(self, members: list[str]) -> None:
        """`single`: every workload's reference, warm-up and c1 (the SLOs), then
        its own sweep when it is a configuration of the run."""
        from rapidkv.bench.common.groups import CONFIGS

        group = self.start("single", members, set())
        if isinstance(group, str):
            for w in self.workloads.values():
                w.error = group[:4000]
                self.progress.advance(2 * w.requests + self.opts.warmup)
            self.progress.advance(sum(self.config_units(m) for m in members))
            return
        try:
            url = group.url(CONFIGS["single"])
            for w in self.workloads.values():
                self.reference(w, url)
                if not w.prompts:  # multiturn: its reference pass makes them, and failed
                    self.progress.advance(w.requests + self.opts.warmup)
                    continue
                self.warm_up("single", w, url, CONFIGS["single"])
                self.single_c1(w, url, group)
                if w.slo is not None:
                    self.progress.say(
                        f"{w.name}: SLOs TTFT {w.slo.ttft_ms:.1f} ms, TPOT {w.slo.tpot_ms:.2f} ms"
                    )
            if "single" in members:
                self.sweep({"single": group})
        except Exception as e:
            why = f"single failed: {type(e).__name__}: {e}"
            self.progress.say(why[:3000])
            self.fail(members, why)
            for w in self.workloads.values():
                if w.slo is None and w.error is None:
                    w.error = why[:4000]
        finally:
            self.stop(group, members)

    def run_group(self, group_name: str, members: list[str]) -> None:
        fixed = fixed_fronts(members)
        group = self.start(group_name, members, fixed)
        if isinstance(group, str):
            self.progress.advance(sum(self.config_units(m) for m in members))
            return
        try:
            self.sweep({m: group for m in members})
        finally:
            self.stop(group, members)

    def run_groups_together(self, groups: dict[str, list[str]]) -> None:
        """Every group started first and kept up to the end, so that each rate
        runs on every configuration in turn: the machine's drift over the run
        (its speed moves by up to 1.8x within an hour here) then falls on all of
        them alike instead of on whichever group ran last. The idle groups cost
        the measured one their vLLM servers' idle polling (`other` CPU)."""

        started: dict[str, Any] = {}
        try:
            for name, members in groups.items():
                fixed = fixed_fronts(members)
                group = self.start(name, members, fixed)
                if isinstance(group, str):
                    self.progress.advance(sum(self.config_units(m) for m in members))
                else:
                    started[name] = group
            self.sweep({m: g for name, g in started.items() for m in groups[name]})
        finally:
            for name, group in started.items():
                self.stop(group, groups[name])

    def sweep(self, placed: dict[str, Any]) -> None:
        """Per workload: (re)start the adaptive routers with its SLOs, warm every
        configuration up, then each rate on each configuration in turn (`placed`:
        configuration -> its running group), rates ascending, the configurations'
        order reversed at every other rate. A group that fails (a server died,
        /metrics failed...) fails its configurations; the others go on."""
        from rapidkv.bench.common.groups import CONFIGS

        def guarded(m: str, action: Any, *args: Any) -> None:
            try:
                action(*args)
            except Exception as e:
                group = placed[m]
                why = f"{group.name} failed while measured: {type(e).__name__}: {e}"
                self.progress.say(why[:3000])
                self.fail([c for c, g in placed.items() if g is group], why)

        for w in self.workloads.values():
            live = [m for m in placed if not self.configs[m].error]
            skipped = [m for m in placed if m not in live]
            per_config = w.requests * len(self.opts.rates[w.name])
            self.progress.advance(per_config * len(skipped))
            if w.slo is None:
                for m in live:
                    self.configs[m].rates.setdefault(w.name, {})
                self.progress.advance(per_config * len(live))
                continue
            for m in live:
                if is_adaptive(CONFIGS[m].front):
                    guarded(m, self.start_adaptive, m, placed[m], w)
                if m != "single" and not self.configs[m].error:
                    url = placed[m].url(CONFIGS[m])
                    guarded(m, self.warm_up, m, w, url, CONFIGS[m])
            for i, rate in enumerate(self.opts.rates[w.name]):
                for m in live if i % 2 == 0 else live[::-1]:
                    if self.configs[m].error:  # failed, or timed out at a lower rate
                        self.progress.advance(w.requests)
                        continue
                    guarded(m, self.measure, m, placed[m], w, rate)

    def start_adaptive(self, name: str, group: Any, w: WorkloadRun) -> None:
        """(Re)start `name`'s adaptive router with workload `w`'s SLOs."""
        from rapidkv.bench.common.groups import CONFIGS

        extra = ["--ttft-slo-ms", f"{w.slo.ttft_ms:.3f}"]
        extra += ["--tpot-slo-ms", f"{w.slo.tpot_ms:.3f}", *self.opts.router_args]
        self.progress.stage(f"{w.name}: starting {name}'s router ({' '.join(extra)})")
        front = CONFIGS[name].front
        group.start_front(front, extra, label=f"{front}.{w.name}")
        self.configs[name].router_args[w.name] = extra
        self.configs[name].affinity = group.affinity()  # its router's too

    # -------------------------------------------------------------- requests

    def reference(self, w: WorkloadRun, url: str) -> None:
        """`single`'s greedy outputs with top-2 margins, at the workload's longest
        `max_tokens`; each request's reference is its prefix of that. A
        conversation's turns (`multiturn`) are asked turn after turn, and the
        prompts are made of the answers (`take_conversation_references`)."""
        from rapidkv.bench.common.reference import take_conversation_references, take_references

        self.progress.stage(f"{w.name}: reference (single, logprobs=2)")
        try:
            if w.conversations is not None:
                w.prompts, w.references = take_conversation_references(
                    url, w.conversations, self.opts.timeout
                )
            else:
                refs = take_references(url, w.prompts, max(w.max_tokens), self.opts.timeout)
                w.references = [r.prefix(m) for r, m in zip(refs, w.max_tokens, strict=True)]
        except Exception as e:
            w.error = f"reference pass failed: {type(e).__name__}: {e}"[:4000]
            self.progress.say(w.error)
        self.progress.advance(w.requests)

    def warm_up(self, name: str, w: WorkloadRun, url: str, config: Any) -> None:
        from rapidkv.bench.common.loads import warm_up

        k = min(self.opts.warmup, len(w.prompts))
        if k == 0:
            return
        self.progress.stage(f"{w.name}: warm-up {name}")
        o = self.opts
        results = warm_up(
            url,
            w.prompts[:k],
            w.max_tokens[:k],
            config,
            o.timeout,
            self.progress.advance,
            o.include_usage,
            w.follows[:k] if w.follows else None,
        )
        for r in results:
            if r.error:
                self.progress.say(f"{name}: {w.name} warm-up request failed: {r.error}")
                if name in self.configs:
                    self.configs[name].warmup_errors.append(r.error)

    def single_c1(self, w: WorkloadRun, url: str, group: Any) -> None:
        """Every request once on `single`, one at a time: the SLOs' base."""
        from rapidkv.bench.common.groups import CONFIGS, PAIR_PAUSE_S, helper_cpus
        from rapidkv.bench.common.loads import Load, run_load
        from rapidkv.bench.common.stats import summarize
        from rapidkv.bench.goodput.slo import derive, given

        self.progress.stage(f"{w.name}: single c1 (the SLOs)")
        self.empty_caches("single", w, group)
        time.sleep(PAIR_PAUSE_S)  # vLLM spins on its queues for 1 s after a step
        cpu = CpuWindow(group)
        results, wall = run_load(
            url,
            w.prompts,
            w.max_tokens,
            Load("c1", concurrency=1),
            timeout_s=self.opts.timeout,
            on_done=self.progress.advance,
            cpus=helper_cpus(CONFIGS["single"].group),
            include_usage=self.opts.include_usage,
            follows=w.follows,  # a conversation in order; no think time at c1
        )
        w.single_c1, w.single_c1_wall_s = results, wall
        w.single_c1_other_cpu_s = cpu.close()[2]
        ok = [r for r in results if r.error is None]
        try:
            w.slo = given(
                derive(
                    summarize([r.ttft_ms for r in ok])["p50"],
                    summarize([r.tpot_ms for r in ok])["p50"],
                    self.opts.ttft_slo_factor,
                    self.opts.tpot_slo_factor,
                ),
                self.opts.ttft_slo_ms,
                self.opts.tpot_slo_ms,
            )
        except ValueError as e:
            w.error = f"{e} ({len(results) - len(ok)} of {len(results)} c1 requests failed)"
            self.progress.say(f"{w.name}: {w.error}")

    def empty_caches(self, name: str, w: WorkloadRun, group: Any) -> list[str]:
        """With prefix caching, empty every server's prefix cache of `group`
        (every configuration starts cold at every rate); what failed."""
        if not self.opts.prefix_caching:
            return []
        failed = group.reset_prefix_cache()
        for why in failed:
            self.progress.say(f"{w.name}: {name}: {why}")
        return failed

    def measure(self, name: str, group: Any, w: WorkloadRun, rate: float) -> None:
        """All the workload's requests on `name`, open loop at `rate` (a
        conversation's later turns each after the answer before it and a
        think time), from empty prefix caches; the servers' prompt tokens by
        source and a rapidkv router's counters over the rate."""
        from rapidkv.bench.common.arrivals import session_arrivals
        from rapidkv.bench.common.groups import CONFIGS, PAIR_PAUSE_S
        from rapidkv.bench.common.loads import TIMEOUT
        from rapidkv.bench.goodput import router_counters
        from rapidkv.bench.goodput.slo import rate_key

        config = CONFIGS[name]
        self.progress.stage(f"{w.name}: {name} at {rate_key(rate)} req/s")
        follows = w.follows or [False] * w.requests
        arrivals = session_arrivals(follows, rate, w.arrival_seed)
        url = group.url(config)
        router = (config.front or "").startswith("router")
        reset_errors = self.empty_caches(name, w, group)
        time.sleep(PAIR_PAUSE_S)  # vLLM spins on its queues for 1 s after a step
        if w.warm_prompts:
            self.warm_caches(name, w, url, rate)
        before = router_counters.read(url) if router else None
        scraped = group.scrape()
        cpu = CpuWindow(group)
        results, wall = self.open_loop(
            name,
            url,
            w.prompts,
            w.max_tokens,
            rate,
            arrivals,
            on_done=self.progress.advance,
            follows=w.follows,
            think_s=w.think_s or 0.0,
        )
        run = RateRun(rate, arrivals, results, wall, reset_errors=reset_errors)
        run.server_cpu_s, run.client_cpu_s, run.other_cpu_s = cpu.close()
        run.prompt_tokens = prompt_tokens_since(group, scraped)
        if before is not None:
            counted = router_counters.read(url).since(before)
            run.placements, run.reasons = counted.kinds, counted.reasons
            run.prefix_tokens = counted.prefix_tokens
            run.learned = counted.learned or None
        self.configs[name].rates.setdefault(w.name, {})[rate] = run
        if any(r.error and r.error.startswith(TIMEOUT) for r in results):
            why = (
                f"{name}: a request at {rate_key(rate)} req/s ({w.name}) had no complete "
                f"answer within {self.opts.timeout:.0f}s; its higher rates were not run"
            )
            self.progress.say(why)
            self.configs[name].error = why

    def warm_caches(self, name: str, w: WorkloadRun, url: str, rate: float) -> None:
        """`w`'s warm-up requests on `name`, open loop at `rate`, to their
        last answer: the caches the placement fills, before a rate is
        measured. Not counted; a failed one is said and recorded."""
        from rapidkv.bench.common.arrivals import session_arrivals
        from rapidkv.bench.goodput.slo import rate_key

        k = len(w.warm_prompts)
        self.progress.stage(f"{w.name}: {name} warm-up, {k} requests at {rate_key(rate)} req/s")
        arrivals = session_arrivals([False] * k, rate, w.arrival_seed + WARM_UP_SALT)
        results, _ = self.open_loop(name, url, w.warm_prompts, w.warm_max_tokens, rate, arrivals)
        for r in results:
            if r.error:
                self.progress.say(f"{name}: {w.name} warm-up request failed: {r.error}")
                self.configs[name].warmup_errors.append(r.error)

    def open_loop(
        self,
        name: str,
        url: str,
        prompts: list[list[int]],
        max_tokens: tuple[int, ...],
        rate: float,
        arrivals: list[float],
        **more: Any,
    ) -> tuple[list[Any], float]:
        """`prompts` on configuration `name` at `url`, open loop at `rate`
        with these `arrivals` (`more`: `run_load`'s other options): its
        results and wall time."""
        from rapidkv.bench.common.groups import CONFIGS, helper_cpus
        from rapidkv.bench.common.loads import Load, run_load
        from rapidkv.bench.goodput.slo import rate_key

        config = CONFIGS[name]
        return run_load(
            url,
            prompts,
            max_tokens,
            Load(f"poisson{rate_key(rate)}", rate=rate),
            params=config.params,
            timeout_s=self.opts.timeout,
            cpus=helper_cpus(config.group),
            arrivals=arrivals,
            include_usage=self.opts.include_usage,
            **more,
        )


WARM_UP_SALT = 104_729
"""Keeps a rate's warm-up arrivals apart from its measured ones under one seed."""


class CpuWindow:
    """CPU seconds used from its creation to `close`: by each of the group's
    process trees, by this process (the client), and by everything else on the
    machine (another user's work: noise that lands on some configurations and
    not on others)."""

    def __init__(self, group: Any) -> None:
        from rapidkv.harness.procs import machine_busy_cpu_seconds, tree_cpu_seconds

        self.group = group
        self.busy = machine_busy_cpu_seconds()
        self.client = tree_cpu_seconds([os.getpid()])
        self.trees = group.cpu_seconds()

    def close(self) -> tuple[dict[str, float], float, float]:
        """(server CPU s per tree, client CPU s, other CPU s)."""
        from rapidkv.harness.procs import machine_busy_cpu_seconds, tree_cpu_seconds

        trees = self.group.cpu_seconds()
        client = tree_cpu_seconds([os.getpid()]) - self.client
        busy = machine_busy_cpu_seconds() - self.busy
        servers = {k: v - self.trees.get(k, 0.0) for k, v in trees.items()}
        return servers, client, busy - sum(servers.values()) - client


def prompt_tokens_since(group: Any, scraped: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per server of `group`, vLLM's prompt tokens by source (`external`,
    `local`, `cached`: the prefix cache's hits) since its `scraped` /metrics."""
    before = group.prompt_tokens(scraped)
    return {
        server: {src: v - before[server].get(src, 0.0) for src, v in counts.items()}
        for server, counts in group.prompt_tokens().items()
    }
