"""`rapidkv bench serve`: the run: each model's rounds of server groups
(`ModelRun`) and the paired blocks.

The method and its outputs are in the package's docstring (`rapidkv.bench.serve`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path
from typing import IO, Any

from rapidkv.bench.common.groups import PAIR_PAUSE_S
from rapidkv.bench.common.options import log_dir as make_log_dir
from rapidkv.bench.common.output import table_stream, to_json
from rapidkv.bench.common.progress import Progress
from rapidkv.bench.common.provenance import git_describe
from rapidkv.bench.common.run import finish, open_link, parse_options
from rapidkv.bench.serve.options import MULTITURN, PAIR_SEED_STRIDE, Options
from rapidkv.bench.serve.results import ConfigRun, LoadRun, ModelResult
from rapidkv.bench.serve.timeline import STEP_FIELDS


def run(args: argparse.Namespace) -> int:
    opts = parse_options(Options.from_args, args, "serve")
    if opts is None:
        return 2
    git_describe()  # the checkout measured: as it is now (cached)
    log_dir = make_log_dir(args, "serve")
    progress = Progress(total_units(opts))
    trace = open(args.trace, "w") if args.trace else None  # noqa: SIM115 - closed below
    link_info: dict[str, Any] | None = None
    try:
        with contextlib.ExitStack() as stack:
            link, link_info = open_link(stack, opts.netns_link, progress, "serve")
            runs = [
                ModelRun(model, opts, log_dir, progress, trace, link).run() for model in opts.models
            ]
    finally:
        progress.close()
        if trace:
            trace.close()
    from rapidkv.bench.serve.report import build_report, print_report

    report = build_report(runs, opts, log_dir)
    report["meta"]["netns_link"] = link_info
    if link_info is not None:
        print(
            f"rapidkv's P in {link_info['a']['netns']}, D in {link_info['b']['netns']}: "
            f"{link_info['qdisc']}; one TCP stream across it: {link_info['tcp']['gbps']} GB/s",
            file=table_stream(args.json),
        )

    def draw(path: Path) -> None:
        from rapidkv.bench.serve.plot import plot

        samples = {r.model: r.samples() for r in runs}
        title = (
            f"rapidkv bench serve: {opts.requests} {opts.dataset} prompts, "
            f"max_tokens {opts.max_tokens}"
        )
        plot(samples, [load.name for load in opts.loads], path, title)

    return finish(report, args, print_report, log_dir, draw)


# ------------------------------------------------------------------ running


class ModelRun(ModelResult):
    """The benchmark on one model: every group, every round."""

    def __init__(
        self,
        model: str,
        opts: Options,
        log_dir: Path,
        progress: Progress,
        trace: IO[str] | None,
        link: Any = None,  # harness.netns.NetnsLink: rapidkv's P and D across it
    ) -> None:
        from rapidkv.bench.common.dataset import (
            multiturn_workload,
            random_workload,
            sharegpt_workload,
        )
        from rapidkv.bench.common.options import model_dir
        from rapidkv.bench.common.reference import near_tie_margin

        self.model = model
        self.opts = opts
        self.log_dir = log_dir / Path(model).name
        self.progress = progress
        self.trace = trace
        self.link = link
        self.dtype = opts.dtype_of(model)
        self.model_dir = model_dir(model, self.dtype)
        self.tie = near_tie_margin(self.dtype)
        self.conversations: Any = None  # dataset.Conversations (sharegpt-multiturn)
        self.follows: list[bool] | None = None  # per prompt: sent after the one before
        if opts.dataset == MULTITURN:  # prompts made by the reference pass, turn by turn
            self.conversations = multiturn_workload(
                self.model_dir, opts.requests, opts.max_len, opts.max_tokens, opts.seed
            )
            self.prompts: list[Any] = []
            self.max_tokens = self.conversations.max_tokens
            self.follows = self.conversations.follows()
        else:
            if opts.dataset == "sharegpt":
                workload = sharegpt_workload(
                    self.model_dir, opts.requests, opts.max_len, opts.max_tokens, opts.seed
                )
            else:
                workload = random_workload(
                    self.model_dir,
                    opts.requests,
                    opts.min_len,
                    opts.max_len,
                    opts.max_tokens,
                    opts.seed,
                )
            self.prompts = workload.prompts
            self.max_tokens = workload.max_tokens  # one per prompt
        self.references: list[Any] | None = None  # stats.Reference per prompt
        self.reference_error: str | None = None
        self.configs = {name: ConfigRun(name) for name in opts.configs}
        self.single: Any = None  # RunningGroup: `single`, up for the round when pairing

    def run(self) -> ModelRun:
        from rapidkv.bench.common.groups import CONFIGS, GROUPS

        if self.opts.base_url:
            self.run_endpoint(self.opts.base_url)
            return self

        wanted = {CONFIGS[c].group for c in self.opts.configs} | {"single"}
        order = [g for g in GROUPS if g in wanted]
        for r in range(1, self.opts.rounds + 1):
            try:
                if self.opts.pairing:
                    single_members = self.skip_failed("single")
                    self.single = self.open_group("single", single_members, r)
                for group in order if r % 2 else order[::-1]:
                    if group == "single" and self.opts.pairing:
                        if self.single is not None:  # else: open_group counted its units
                            self.measure_group(self.single, single_members, r)
                        continue
                    members = self.skip_failed(group)
                    if members or (self.references is None and self.reference_error is None):
                        self.run_group(group, members, r)
            finally:
                if self.single is not None:
                    self.note_crashes(self.single, single_members)
                    self.progress.stage(f"{self.model} r{r}: stopping single")
                    self.single.stop()
                    self.single = None
        return self

    def run_endpoint(self, base_url: str) -> None:
        """`--base-url`: the reference on `--reference-url` if given, then every
        round's warm-up and loads on the endpoint, which nothing here starts or stops."""
        from rapidkv.bench.common.groups import Endpoint

        (name,) = self.opts.configs
        endpoint = Endpoint(base_url, name=name)
        if self.opts.reference_url:
            self.take_reference(self.opts.reference_url)
        else:
            self.reference_error = "no --reference-url given: outputs not checked"
            self.progress.advance(len(self.prompts))
        for r in range(1, self.opts.rounds + 1):
            self.warm_up(name, base_url)
            self.measure_group(endpoint, [name], r)

    def skip_failed(self, group: str) -> list[str]:
        """The group's configurations but those that failed earlier (not measured
        again: their progress units are counted here)."""
        from rapidkv.bench.common.groups import CONFIGS

        members = [c for c in self.opts.configs if CONFIGS[c].group == group]
        live = [c for c in members if not self.configs[c].error]
        self.progress.advance(sum(self.opts.units(c) for c in members if c not in live))
        return live

    def run_group(self, group_name: str, members: list[str], rnd: int) -> None:
        group = self.open_group(group_name, members, rnd)
        if group is None:
            return
        try:
            self.measure_group(group, members, rnd)
        finally:
            self.note_crashes(group, members)
            self.progress.stage(f"{self.model} r{rnd}: stopping {group_name}")
            group.stop()

    def open_group(self, group_name: str, members: list[str], rnd: int) -> Any:
        """Start a group, take the reference on `single` if still missing, warm it
        up; the RunningGroup, or None (the members then carry the error)."""
        from rapidkv.bench.common.groups import CONFIGS, start_group

        p = self.progress
        p.stage(f"{self.model} r{rnd}: starting {group_name}")
        try:
            group = start_group(
                group_name,
                self.model_dir,
                self.log_dir,
                self.opts.server_args,
                fronts={CONFIGS[name].front for name in members},
                link=self.link,
                prefix_caching=self.opts.prefix_caching,
            )
        except Exception as e:
            why = f"{group_name} did not start: {type(e).__name__}: {e}"
            p.say(why[:3000])
            self.fail(members, why)
            units = sum(self.opts.units(name) for name in members)
            if group_name == "single" and self.opts.pairing and "single" not in members:
                units += self.opts.warmup
            if group_name == "single" and self.references is None:
                self.reference_error = why[:4000]
                units += len(self.prompts)
            p.advance(units)
            return None
        try:
            for name in members:
                c = self.configs[name]
                c.startup_s.append(group.startup_s)
                c.server_startup_s.append({k: s.startup_s for k, s in group.servers.items()})
            if group_name == "single" and self.references is None:
                self.take_reference(group.url(CONFIGS["single"]))
            warm = members
            if group_name == "single" and self.opts.pairing and not members:
                warm = ["single"]  # its blocks are paired with others' from the start
            for name in warm:
                self.warm_up(name, group.url(CONFIGS[name]))
            for name in members:
                self.configs[name].affinity = group.affinity()
        except Exception as e:
            why = f"{group_name} failed while warmed up: {type(e).__name__}: {e}"
            p.say(why[:3000])
            self.fail(members, why)
            self.note_crashes(group, members)
            group.stop()
            return None
        return group

    def note_crashes(self, group: Any, members: list[str]) -> None:
        """A group whose server died says why first in its members' error."""
        crashes = group.crashes()
        if not crashes:
            return
        why = "; ".join(crashes)
        self.progress.say(f"{group.name}: {why}")
        for name in members:
            c = self.configs[name]
            if not (c.error or "").startswith(why):
                c.error = (why + (f"; then: {c.error}" if c.error else ""))[:4000]

    def measure_group(self, group: Any, members: list[str], rnd: int) -> None:
        p = self.progress
        try:
            for load in self.opts.loads:
                for name in members:
                    if self.configs[name].error:  # timed out earlier: the rest is skipped
                        p.advance(self.opts.load_units(name, load))
                    else:
                        self.measure(name, group, load, rnd)
        except Exception as e:  # a server died, /metrics failed...: the next group still runs
            why = f"{group.name} failed while measured: {type(e).__name__}: {e}"
            p.say(why[:3000])
            self.fail(members, why)

    def fail(self, members: list[str], why: str) -> None:
        for name in members:
            self.configs[name].error = why[:4000]

    def take_reference(self, url: str) -> None:
        from rapidkv.bench.common.reference import take_conversation_references, take_references

        self.progress.stage(f"{self.model}: reference (single, logprobs=2)")
        n = len(self.max_tokens)
        try:
            if self.conversations is not None:
                self.prompts, refs = take_conversation_references(
                    url, self.conversations, self.opts.timeout
                )
            else:
                refs = take_references(url, self.prompts, self.max_tokens, self.opts.timeout)
        except Exception as e:
            self.reference_error = f"reference pass failed: {type(e).__name__}: {e}"[:4000]
            self.progress.say(self.reference_error)
            self.progress.advance(n)
            return
        self.references = refs
        self.progress.advance(n)

    def warm_up(self, name: str, url: str) -> None:
        from rapidkv.bench.common.groups import CONFIGS
        from rapidkv.bench.common.loads import warm_up

        n = self.opts.warmup
        if n == 0:
            return
        self.progress.stage(f"{self.model}: warm-up {name}")
        o = self.opts
        prompts, max_tokens = self.prompts[:n], self.max_tokens[:n]
        results = warm_up(
            url,
            prompts,
            max_tokens,
            CONFIGS[name],
            o.timeout,
            self.progress.advance,
            o.include_usage,
        )
        for r in results:
            if r.error:
                self.progress.say(f"{name}: warm-up request failed: {r.error}")
        if name in self.configs:  # else `single` warmed up for its paired blocks only
            self.configs[name].first_request_ms.append(results[0].e2e_ms)
            self.check_timeouts(name, "warm-up", results)

    def need_prompts(self) -> None:
        """sharegpt-multiturn: no prompts without the reference pass that makes them."""
        if not self.prompts:
            raise RuntimeError(f"no prompts: {self.reference_error or 'no reference pass'}")

    def check_timeouts(self, name: str, load: str, results: list[Any]) -> None:
        """After a timed-out request, the configuration is not measured further."""
        from rapidkv.bench.common.loads import TIMEOUT

        if any(r.error and r.error.startswith(TIMEOUT) for r in results):
            why = (
                f"{name}: a request of load {load} had no complete answer within "
                f"{self.opts.timeout:.0f}s; its later loads were not run (see the server logs)"
            )
            self.progress.say(why)
            self.configs[name].error = why

    def measure(self, name: str, group: Any, load: Any, rnd: int) -> None:
        """One load on one configuration: all prompts at once, or, paired, in
        blocks each followed (in alternate order) by the same block on `single`."""
        from rapidkv.bench.common.groups import CONFIGS
        from rapidkv.bench.common.loads import TIMEOUT
        from rapidkv.bench.common.stats import histogram_delta

        self.progress.stage(f"{self.model} r{rnd}: {name} {load.name}")
        self.need_prompts()
        pair = self.single if self.opts.paired(name, load) else None
        n = len(self.prompts)
        if self.opts.paired(name, load) and pair is None:  # `single` did not start this round
            self.progress.advance(n)  # its blocks, counted in `load_units`, are not run
        size = self.opts.pair_block if pair is not None else n
        if self.opts.prefix_caching:  # every load starts cold, on both sides if paired
            for side in [group] if pair is None else [group, pair]:
                for why in side.reset_prefix_cache():
                    self.progress.say(f"{name} {load.name}: {why}")
        before = group.scrape()
        run = LoadRun(rnd, paired_single=None if pair is None else [])
        for b, lo in enumerate(range(0, n, size)):
            seed = self.opts.seed + rnd + b * PAIR_SEED_STRIDE
            sides = [group] if pair is None else [group, pair][:: -1 if b % 2 else 1]
            for side in sides:
                if pair is not None:
                    time.sleep(PAIR_PAUSE_S)
                if side is group:
                    self.measure_block(run, group, CONFIGS[name], load, lo, lo + size, seed)
                else:
                    results, wall = self.block(pair, CONFIGS["single"], load, lo, lo + size, seed)
                    assert run.paired_single is not None
                    run.paired_single += results
                    run.paired_single_wall_s += wall
            if any(r.error and r.error.startswith(TIMEOUT) for r in run.results):
                left = max(0, n - lo - size)  # prompts not sent, on both sides if paired
                self.progress.advance(left * (1 if pair is None else 2))
                break
        after = group.scrape()
        tokens_before, ttft_before = group.prompt_tokens(before), group.ttft_histograms(before)
        run.prompt_tokens = {
            server: {src: v - tokens_before[server][src] for src, v in counts.items()}
            for server, counts in group.prompt_tokens(after).items()
        }
        run.engine_ttft = {
            server: histogram_delta(ttft_before[server], h)
            for server, h in group.ttft_histograms(after).items()
        }
        self.configs[name].loads.setdefault(load.name, []).append(run)
        self.check_timeouts(name, load.name, run.results)
        if self.trace is not None:
            xfers = [r.xfer_id for r in run.results if r.xfer_id]
            self.write_trace(name, load.name, rnd, run.results, group.timelines(xfers))
            self.write_steps(name, load.name, rnd, run.steps)
            if run.paired_single:
                self.write_trace("single", load.name, rnd, run.paired_single, {}, name)

    def measure_block(
        self, run: LoadRun, group: Any, config: Any, load: Any, lo: int, hi: int, seed: int
    ) -> None:
        """Prompts [lo, hi) on the configuration; results, wall and CPU added to
        `run` (with --trace also the engine steps of the block)."""
        from rapidkv.harness.procs import machine_busy_cpu_seconds, tree_cpu_seconds

        busy_before, client_before = machine_busy_cpu_seconds(), tree_cpu_seconds([os.getpid()])
        before = group.cpu_seconds()
        began = time.monotonic()
        results, wall = self.block(group, config, load, lo, hi, seed)
        after = group.cpu_seconds()
        client = tree_cpu_seconds([os.getpid()]) - client_before
        busy = machine_busy_cpu_seconds() - busy_before
        cpu = {k: after[k] - before.get(k, 0.0) for k in after}
        run.results += results
        run.wall_s += wall
        for k, v in cpu.items():
            run.cpu_s[k] = run.cpu_s.get(k, 0.0) + v
        run.client_cpu_s += client
        run.other_cpu_s += busy - sum(cpu.values()) - client
        if self.trace is not None:  # after the CPU counts: the RPCs are not the load's
            for role, steps in group.steps(began).items():
                run.steps.setdefault(role, []).extend(steps)

    def block(
        self, group: Any, config: Any, load: Any, lo: int, hi: int, seed: int
    ) -> tuple[list[Any], float]:
        """Prompts [lo, hi) under `load` on `group`'s front for `config`."""
        import dataclasses

        from rapidkv.bench.common.groups import helper_cpus
        from rapidkv.bench.common.loads import run_load

        results, wall = run_load(
            group.url(config),
            self.prompts[lo:hi],
            self.max_tokens[lo:hi],
            load,
            params=config.params,
            seed=seed,
            timeout_s=self.opts.timeout,
            on_done=self.progress.advance,
            cpus=helper_cpus(config.group),
            include_usage=self.opts.include_usage,
            follows=self.follows[lo:hi] if self.follows else None,
        )
        return [dataclasses.replace(r, prompt_index=r.prompt_index + lo) for r in results], wall

    def write_trace(
        self,
        name: str,
        load: str,
        rnd: int,
        results: list[Any],
        timelines: dict[str, dict[str, dict[str, float]]],
        paired_with: str | None = None,
    ) -> None:
        from rapidkv.bench.common.reference import classify, divergence

        assert self.trace is not None
        for r in results:
            verdict, where = None, None
            if self.references is not None and r.error is None:
                verdict = classify(self.references[r.prompt_index], r.token_ids, self.tie)
                where = divergence(self.references[r.prompt_index], r.token_ids)
            row = {
                "model": self.model,
                "config": name,
                "load": load,
                "round": rnd,
                "prompt": r.prompt_index,
                "prompt_len": len(self.prompts[r.prompt_index]),
                "xfer_id": r.xfer_id,
                "sent_s": r.sent_s,
                "sent_mono": r.sent_mono,
                "token_ms": [round(t, 3) for t in r.token_ms],
                "e2e_ms": r.e2e_ms,
                "verdict": verdict,
                # first differing position and the reference's top-2 margin there
                "divergence": None if where is None else {"at": where[0], "margin": where[1]},
                "error": r.error,
            }
            if paired_with is not None:
                row["paired_with"] = paired_with  # `single`'s block beside this configuration's
            for role, events in timelines.items():  # ms after the client sent it
                ev = events.get(r.xfer_id or "", {})
                row[f"{role}_ms"] = {k: round((t - r.sent_mono) * 1000, 3) for k, t in ev.items()}
            self.trace.write(to_json(row) + "\n")
        self.trace.flush()

    def write_steps(self, name: str, load: str, rnd: int, steps: dict[str, list[Any]]) -> None:
        """One trace row per role of a rapidkv configuration: its engine's steps
        during the load (`StepTiming` fields; times in time.monotonic() seconds,
        the clock of the request rows' `sent_mono`)."""
        assert self.trace is not None
        for role, timings in steps.items():
            row = {
                "kind": "steps",
                "model": self.model,
                "config": name,
                "load": load,
                "round": rnd,
                "role": role,
                "fields": list(STEP_FIELDS),
                "steps": [[getattr(s, f) for f in STEP_FIELDS] for s in timings],
            }
            self.trace.write(to_json(row) + "\n")
        self.trace.flush()


def prompt_lengths(opts: Options) -> list[int]:
    """`opts.requests` lengths, uniform in [min_len, max_len], seeded (the random dataset's)."""
    from rapidkv.bench.common.dataset import random_lengths

    return random_lengths(opts.requests, opts.min_len, opts.max_len, opts.seed)


def total_units(opts: Options) -> int:
    """Progress units: one per request (reference, warm-up and measured, paired
    `single` blocks included)."""
    per_round = sum(opts.units(c) for c in opts.configs)
    if opts.pairing and "single" not in opts.configs:
        per_round += opts.warmup  # `single` warmed up for its paired blocks
    return (opts.requests + opts.rounds * per_round) * len(opts.models)
