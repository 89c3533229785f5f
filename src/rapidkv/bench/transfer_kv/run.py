"""`rapidkv bench transfer-kv`: the run: its options, the phases (`Bench`, `Phase`),
each sample and the JSON.

The method and its outputs are in the package's docstring (`rapidkv.bench.transfer_kv`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rapidkv.bench.common.options import from_namespace, model_dtype
from rapidkv.bench.common.options import log_dir as make_log_dir
from rapidkv.bench.common.output import to_json, write_json
from rapidkv.bench.common.progress import Progress
from rapidkv.bench.common.run import parse_options

MODELS = ("small", "tiny")
PHASES = ("uncapped", "capped")


@dataclass(frozen=True)
class Options:
    model: str
    dtype: str
    samples: int
    budget_s: float
    phases: tuple[str, ...]
    prompt_len: int
    chunk: int
    load_concurrency: int
    load_len: tuple[int, int]
    cap_fraction: float
    cap_gbps: float | None
    uniform: bool
    warmup: int
    poll_s: float
    wait_quiet_s: float
    p_cpu: int
    d_cpu: int
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        phases = tuple(p for p in args.phases.split(",") if p)
        if not phases or any(p not in PHASES for p in phases):
            raise ValueError(f"--phases: comma-separated of {', '.join(PHASES)}")
        if "capped" in phases and "uncapped" not in phases and not args.cap_gbps:
            raise ValueError("capped without uncapped needs --cap-gbps")
        lo, hi = (int(x) for x in args.load_len.split(","))
        samples = args.samples if args.samples is not None else (3 if args.quick else 20)
        budget = args.budget_s if args.budget_s is not None else (150.0 if args.quick else 900.0)
        if samples < 1 or budget <= 0 or not 1 <= lo <= hi or args.prompt_len < 3:
            raise ValueError("need --samples >= 1, --budget-s > 0, 1 <= load min <= max")
        if args.cap_fraction < 0.2:
            raise ValueError("--cap-fraction must be >= 0.2 (the issue's minimum)")
        return from_namespace(
            cls,
            args,
            dtype=model_dtype(args.model, args.dtype),
            samples=samples,
            budget_s=budget,
            phases=phases,
            load_len=(lo, hi),
            poll_s=args.poll_us / 1e6,
        )


def run(args: argparse.Namespace) -> int:
    opts = parse_options(Options.from_args, args, "transfer-kv")
    if opts is None:
        return 2
    os.sched_setaffinity(0, {opts.d_cpu})  # before any thread starts: they inherit it
    # SIGTERM unwinds like Ctrl-C: every `with` stops what it started (P included)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    # the memory watcher must not wait the default 5 ms for the GIL behind a
    # busy thread of ours
    sys.setswitchinterval(0.0005)
    log_dir = make_log_dir(args, "transfer-kv")
    progress = Progress()
    trace = open(args.trace, "w") if args.trace else None  # noqa: SIM115 - closed below
    try:
        report, values = Bench(opts, log_dir, progress, trace).run()
    except KeyboardInterrupt:  # everything started was stopped on the way out
        progress.say(f"interrupted; P stopped (logs: {log_dir})")
        return 130
    finally:
        if trace:
            trace.close()
    from rapidkv.bench.transfer_kv.plot import plot, table

    # with `--json -` stdout carries the JSON only; the table goes to stderr
    shown = table(report, [p for p in PHASES if p in report])
    print(shown, file=sys.stderr if args.json == "-" else sys.stdout)
    write_json(report, args.json)
    if args.plot:
        steps = {p: report[p]["step_ms"]["p50"] for p in values}
        title = (
            f"rapidkv bench transfer-kv: {opts.model}, prompt {opts.prompt_len} tokens, "
            f"chunk {opts.chunk}, busy P"
        )
        plot(values, steps, args.plot, title)
        progress.say(f"plot: {args.plot}")
    progress.say(f"P logs: {log_dir}")
    return 0 if report["ok"] else 1


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


# ------------------------------------------------------------------ the run


class Bench:
    def __init__(
        self, opts: Options, log_dir: Path, progress: Progress, trace: IO[str] | None
    ) -> None:
        import random

        from rapidkv.harness import random_prompts
        from rapidkv.models import ensure_model

        self.opts = opts
        self.log_dir = log_dir
        self.progress = progress
        self.trace = trace
        self.model_dir = ensure_model(opts.model, dtype=opts.dtype)
        self.prompt = random_prompts(self.model_dir, [opts.prompt_len], seed=opts.seed)[0]
        rng = random.Random(opts.seed + 1)
        lengths = [rng.randint(*opts.load_len) for _ in range(16)]
        self.load_prompts = random_prompts(self.model_dir, lengths, seed=opts.seed + 2)

    def run(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from rapidkv.bench.transfer_kv.stats import acceptance, choose_cap

        o = self.opts
        report: dict[str, Any] = {"meta": self.meta()}
        values: dict[str, Any] = {}
        for name in o.phases:
            cap = 0.0
            if name == "capped":
                if o.cap_gbps:
                    cap = o.cap_gbps
                else:
                    cap = choose_cap(
                        report["uncapped"]["step_ms"]["p50"],
                        report["uncapped"]["request_bytes"],
                        o.cap_fraction,
                    )
            phase = Phase(self, name, cap)
            report[name], values[name] = phase.run()
        ok = all(report[p]["checks"]["failed"] == 0 for p in o.phases)
        if all(p in report for p in PHASES):
            report["acceptance"] = acceptance(report)
        report["ok"] = ok
        return report, values

    def meta(self) -> dict[str, Any]:
        o = self.opts
        return {
            "model": o.model,
            "dtype": o.dtype,
            "prompt_len": o.prompt_len,
            "num_tokens": o.prompt_len - 1,
            "max_num_batched_tokens": o.chunk,
            "prefix_caching": False,
            "background": {"concurrency": o.load_concurrency, "prompt_len": list(o.load_len)},
            "samples_per_cell": o.samples,
            "budget_s": o.budget_s,
            "sampling": "uniform" if o.uniform else "stratified",
            "cap_fraction": o.cap_fraction,
            "poll_us": o.poll_s * 1e6,
            "cpus": {"p": o.p_cpu, "d": o.d_cpu},
            "command": shlex.join(["rapidkv", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }


class Phase:
    """One phase: start P, connect D, keep P busy, sample, summarize, stop P."""

    def __init__(self, bench: Bench, name: str, cap_gbps: float) -> None:
        self.bench = bench
        self.opts = bench.opts
        self.name = name
        self.cap_gbps = cap_gbps
        self.say = bench.progress.say
        self.steps: dict[int, Any] = {}
        self.reference: Any = None  # content of the first transfer of the phase
        self.count = 0
        self.p_counters: dict[str, float] = {}

    def run(self) -> tuple[dict[str, Any], dict[Any, Any]]:
        import httpx

        from rapidkv.bench.transfer_kv.dest import Destination
        from rapidkv.bench.transfer_kv.load import BackgroundLoad
        from rapidkv.connector.config import kv_transfer_config
        from rapidkv.harness import ServerSpec, VLLMServer, free_port

        o = self.opts
        port = free_port()
        extra = {"bandwidth_cap_gbps": self.cap_gbps} if self.cap_gbps else {}
        spec = ServerSpec(
            model=self.bench.model_dir,
            name=f"prefill-{self.name}",
            role="prefill",
            cpus=(o.p_cpu,),
            kv_transfer_config=kv_transfer_config(port, **extra),
            extra_args=("--max-num-batched-tokens", str(o.chunk), "--no-enable-prefix-caching"),
        )
        cap = f" (cap {self.cap_gbps:.3f} GB/s)" if self.cap_gbps else ""
        self.wait_quiet()
        self.say(f"{self.name}{cap}: starting P")
        with VLLMServer.start(spec, self.bench.log_dir) as p:
            self.say(f"{self.name}: P up in {p.startup_s:.0f} s; connecting D")
            self.p = p
            self.p_control = f"127.0.0.1:{port}"
            with Destination(self.p_control, self.blocks_needed, poll_s=o.poll_s) as dst:
                self.dst = dst
                self.nblocks = -(-(o.prompt_len - 1) // dst.spec.block_size)
                # two alternating sets of scattered destination blocks
                self.block_sets = [
                    tuple(range(1, 2 * self.nblocks + 1, 2)),
                    tuple(range(2 * self.nblocks, 0, -2)),
                ]
                load = BackgroundLoad(p.base_url, self.bench.load_prompts, o.load_concurrency)
                with (
                    load,
                    concurrent.futures.ThreadPoolExecutor(1) as pool,
                    httpx.Client(timeout=120.0) as http,
                ):
                    self.pool, self.http = pool, http
                    self.monitor = self.noise_monitor(p).start()
                    try:
                        samples, t0, t1 = self.sample_all(load)
                    finally:
                        self.monitor.stop()
                    for s in samples:  # every window is closed now
                        s.noisy = self.monitor.noisy(s.t_request, s.t_end)
                self.say(
                    f"{self.name}: background load: {load.done} requests, {load.errors} errors"
                )
                self.collect_steps()
                self.p_counters = self.read_counters()
        return self.summarize(samples, t0, t1, load)

    def wait_quiet(self) -> None:
        """Wait (up to --wait-quiet-s) until other processes leave both cores alone."""
        from rapidkv.bench.transfer_kv.noise import NOISY_CORES, CpuNoise

        o = self.opts
        deadline = time.monotonic() + o.wait_quiet_s
        cores = {o.p_cpu: lambda: [], o.d_cpu: lambda: [os.getpid()]}
        said = False
        while True:
            noise = CpuNoise(cores).start()
            time.sleep(3.0)
            busy = noise.cores()
            if max(busy.values()) <= NOISY_CORES:
                return
            if time.monotonic() > deadline:
                self.say(f"{self.name}: cores still busy with other work ({busy}); going on")
                return
            if not said:
                self.say(f"{self.name}: other processes use {busy} cores; waiting for quiet")
                said = True

    def noise_monitor(self, p: Any) -> Any:
        """CPU others take from P's core and ours, in windows (see `noise`)."""
        from rapidkv.bench.transfer_kv.noise import NoiseMonitor
        from rapidkv.harness.procs import live_in_group

        o = self.opts
        return NoiseMonitor(
            {o.p_cpu: lambda: live_in_group(p.pgid), o.d_cpu: lambda: [os.getpid()]}
        )

    def blocks_needed(self, spec: Any) -> int:
        """D's memory: two sets of scattered blocks for one request, block 0 unused."""
        return 2 * -(-(self.opts.prompt_len - 1) // spec.block_size) + 2

    # -- sampling ---------------------------------------------------------------

    def sample_all(self, load: Any) -> tuple[list[Any], float, float]:
        """Warm up, then sample until every (mode, state) has enough quiet
        samples or the budget is spent. Returns the samples and the window."""
        from rapidkv.bench.transfer_kv.stats import MODES, STATES, DelaySampler, next_target

        o = self.opts
        sampler = DelaySampler(guess_s=0.5, uniform=o.uniform, seed=o.seed)
        self.say(f"{self.name}: warm-up ({o.warmup} per mode)")
        for i in range(o.warmup * len(MODES)):
            s = self.one(f"w{i}", MODES[i % len(MODES)], sampler, "last_chunk")
            sampler.observe(s.t_request, s.events, s.last_chunk_end)
            if not s.ok:
                self.say(f"{self.name}: warm-up {s.xfer_id} ({s.mode}) failed: {s.error}")
        counts: dict[str, Counter[str]] = {m: Counter() for m in MODES}
        samples: list[Any] = []
        t0 = time.monotonic()
        last_say = t0
        failures_in_a_row = 0
        i = 0
        while time.monotonic() - t0 < o.budget_s:
            pending = [m for m in MODES if next_target(counts[m], o.samples)]
            if not pending:
                break
            mode = pending[i % len(pending)]
            target = next_target(counts[mode], o.samples)
            assert target is not None
            s = self.one(str(i), mode, sampler, target)
            sampler.observe(s.t_request, s.events, s.last_chunk_end)
            s.noisy = self.monitor.noisy(s.t_request, s.t_end)  # so far; final at the end
            samples.append(s)
            if self.bench.trace is not None:
                self.bench.trace.write(to_json({"phase": self.name, **s.to_json()}))
                self.bench.trace.write("\n")
            if s.ok:
                failures_in_a_row = 0
                if s.state in STATES and not s.noisy:
                    counts[mode][s.state] += 1
            else:
                failures_in_a_row += 1
                self.say(f"{self.name}: {s.xfer_id} ({mode}, {s.state}) failed: {s.error}")
                if failures_in_a_row >= 10:
                    self.say(f"{self.name}: 10 failures in a row; phase stopped")
                    break
            i += 1
            if time.monotonic() - last_say > 15:
                last_say = time.monotonic()
                have = " ".join(
                    f"{m}:" + "/".join(str(counts[m][st]) for st in STATES) for m in MODES
                )
                recent = self.monitor.windows[-8:]
                others = (
                    ", ".join(
                        f"core {c} {max(w.get(c, 0.0) for _, _, w in recent):.2f}"
                        for c in (o.p_cpu, o.d_cpu)
                    )
                    if recent
                    else "-"
                )
                self.say(
                    f"{self.name}: {len(samples)} samples ({sum(x.noisy for x in samples)} "
                    f"noisy), fin/last/earlier {have} (want {o.samples}), load {load.done} done "
                    f"{load.errors} errors, other processes' CPU (max, 16 s): {others}"
                )
        return samples, t0, time.monotonic()

    def one(self, tag: str, mode: str, sampler: Any, target: str) -> Any:
        """One sample: P's request, TransferKV after a delay aimed at `target`,
        then what happened."""
        from rapidkv.bench.transfer_kv.stats import Sample
        from rapidkv.control.messages import TransferKV, prompt_hash
        from rapidkv.harness.client import complete_full

        xfer = f"tkv-{self.name}-{tag}"
        delay = sampler.draw(target)
        self.count += 1
        blocks = self.block_sets[self.count % 2]
        prompt = self.bench.prompt
        dst = self.dst
        dst.reset(blocks)
        watch = dst.watch(xfer, blocks)
        params = {"rapidkv": {"xfer_id": xfer, "role": "prefill"}}
        t_request = time.monotonic()
        http = self.pool.submit(
            complete_full, self.p.base_url, prompt, 1, client=self.http, kv_transfer_params=params
        )
        msg = TransferKV(
            xfer_id=xfer,
            dst_instance=dst.instance_id,
            dst_blocks=list(blocks),
            first_block=0,
            num_tokens=len(prompt) - 1,
            prompt_hash=prompt_hash(prompt),
            transfer_kv_mode=mode,  # type: ignore[arg-type]
        )
        pause = t_request + delay - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        t_submit = time.monotonic()
        reply_future = dst.rpc.submit(self.p_control, msg, 60.0)
        s = Sample(xfer, mode, tuple(blocks), t_request, t_submit, target=target, delay_s=delay)
        errors = []
        try:
            try:
                reply = reply_future.result(70)
                s.reply_code, s.tokens_sent = reply.code.name, reply.tokens_sent
                if reply.code.name != "OK":
                    errors.append(f"TransferKV {reply.code.name}: {reply.message}")
                elif reply.tokens_sent != msg.num_tokens:
                    errors.append(f"{reply.tokens_sent} of {msg.num_tokens} tokens sent")
            except Exception as e:
                errors.append(f"TransferKV: {type(e).__name__}: {e}")
            if not watch.wait(5.0 if s.reply_code == "OK" else 0.5):
                errors.append("no SendDone within 5 s of the reply")
            try:
                http.result(120)
            except Exception as e:
                errors.append(f"P request: {type(e).__name__}: {e}")
        finally:
            dst.unwatch()
        s.landed = watch.landed.tolist()
        if watch.done is not None:
            s.last_byte = watch.t_done
            s.send_done_ok = bool(watch.done.ok)
            if not watch.done.ok:
                errors.append(f"SendDone error: {watch.done.error}")
        early = [t for row in s.landed for t in row if t == t and t < t_submit]
        if early:
            errors.append("destination memory changed before the TransferKV was sent")
        if s.reply_code == "OK":
            left = dst.unwritten_words(blocks)
            s.written = left == 0
            if left:
                errors.append(f"{left} 8-byte words of the destination blocks never written")
            self.compare_content(s)
        errors += self.read_timeline(s)
        s.error = "; ".join(errors)
        s.max_poll_gap_ms = watch.max_gap * 1000
        s.t_end = time.monotonic()
        return s

    def compare_content(self, s: Any) -> None:
        from rapidkv.bench.transfer_kv.dest import rel_diff

        full = (len(self.bench.prompt) - 1) // self.dst.spec.block_size
        if not full or not s.written:
            return
        got = self.dst.content(s.blocks[:full])
        if self.reference is None:
            self.reference = got
            s.content_rel_diff = 0.0
        else:
            s.content_rel_diff = rel_diff(got, self.reference)

    def read_timeline(self, s: Any) -> list[str]:
        """Fill in P's view of the sample; returns what went wrong."""
        from rapidkv.control.messages import TimelineRequest

        for attempt in range(3):  # a starved P may answer late; the request is idempotent
            try:
                tl = self.dst.rpc.call(self.p_control, TimelineRequest([s.xfer_id]), 10.0)
                break
            except Exception as e:
                if attempt == 2:
                    return [f"timeline: {type(e).__name__}: {e}"]
        from rapidkv.bench.transfer_kv.stats import last_chunk_end

        self.add_steps(tl.steps)
        x = tl.xfers.get(s.xfer_id)
        if x is not None:
            s.events = dict(x.events)
            s.state = x.state_at_arrival
            # P stamps last_chunk_begin with the begin of the step computing it
            s.step_begin = s.events.get("last_chunk_begin")
            s.last_chunk_end = last_chunk_end(s.events, self.sorted_steps(tl.steps))
        if s.last_chunk_end is None:
            return ["P's timeline has no last chunk for this request"]
        return []

    @staticmethod
    def sorted_steps(steps: Any) -> list[Any]:
        from rapidkv.bench.transfer_kv.stats import Step

        out = [Step(st.step_id, st.begin, st.end, st.scheduled_tokens) for st in steps]
        return sorted(out, key=lambda st: st.begin)

    def add_steps(self, steps: Any) -> None:
        from rapidkv.bench.transfer_kv.stats import Step

        for st in steps:
            self.steps[st.step_id] = Step(st.step_id, st.begin, st.end, st.scheduled_tokens)

    def read_counters(self) -> dict[str, float]:
        """P's connector counters at the end of the phase (bypass and substep ones)."""
        from rapidkv.control.messages import StatsRequest

        try:
            counters = self.dst.rpc.call(self.p_control, StatsRequest(), 10.0).counters
        except Exception as e:
            self.say(f"{self.name}: could not read P's counters: {e}")
            return {}
        keep = ("bypass", "substep", "transfers_", "busy", "park", "prompt_mismatch")
        return {k: v for k, v in sorted(counters.items()) if k.startswith(keep)}

    def collect_steps(self) -> None:
        from rapidkv.control.messages import TimelineRequest

        try:
            self.add_steps(self.dst.rpc.call(self.p_control, TimelineRequest([]), 10.0).steps)
        except Exception as e:
            self.say(f"{self.name}: could not read P's last steps: {e}")

    # -- report -------------------------------------------------------------------

    def summarize(
        self, samples: list[Any], t0: float, t1: float, load: Any
    ) -> tuple[dict[str, Any], dict[Any, Any]]:
        from rapidkv.bench.transfer_kv.noise import NOISY_CORES
        from rapidkv.bench.transfer_kv.stats import sample_metrics, summarize_phase

        steps = sorted(self.steps.values(), key=lambda s: s.begin)
        out = summarize_phase(samples, steps, t0, t1, self.monitor.noisy)
        block_bytes = sum(self.dst.spec.layer_block_bytes)
        out["request_bytes"] = self.nblocks * block_bytes
        out["bandwidth_cap_gbps"] = self.cap_gbps
        if self.cap_gbps:
            wire_ms = out["request_bytes"] / (self.cap_gbps * 1e9) * 1000
            out["wire_ms"] = round(wire_ms, 3)
            step = out["step_ms"]["p50"]
            out["wire_fraction_of_step"] = round(wire_ms / step, 3) if step == step else None
        out["wall_s"] = round(t1 - t0, 1)
        out["background"] = {"done": load.done, "errors": load.errors, "last": load.last_error}
        out["p_log"] = str(self.p.log_path)
        out["p_counters"] = self.p_counters  # warm-up included
        # CPU (in cores) that processes other than P and this one used on each
        # core, and how much of the time a window was noisy (those samples and
        # steps are left out of the figures)
        out.update(self.monitor.summary())
        if out["noisy_time_fraction"] > 0.05:
            self.say(
                f"{self.name}: other processes used P's or D's core more than {NOISY_CORES} "
                f"of a core {out['noisy_time_fraction']:.0%} of the time "
                f"({out['noisy_samples']} samples set aside)"
            )
        values: dict[Any, Any] = {}
        for s in samples:
            m = sample_metrics(s)
            if m is not None:
                cell = values.setdefault((s.mode, s.state), {})
                for k, v in m.items():
                    cell.setdefault(k, []).append(v)
        self.say(
            f"{self.name}: {len(samples)} samples in {t1 - t0:.0f} s, step p50 "
            f"{out['step_ms']['p50']} ms, {out['checks']['failed']} failed"
        )
        return out, values
