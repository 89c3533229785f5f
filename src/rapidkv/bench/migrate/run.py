"""`rapidkv bench migrate`: the run: the two instances and the router, then
round by round each length's reference and its migrated requests.

The method and its outputs are in the package's docstring (`rapidkv.bench.migrate`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rapidkv.bench.common.loads import PLACEMENT_HEADER, XFER_HEADER
from rapidkv.bench.common.options import from_namespace, model_dtype, served_fields
from rapidkv.bench.common.options import log_dir as make_log_dir

MODES = ("precopy", "stop-and-copy")
MODE_KEYS = {"precopy": "precopy", "stop-and-copy": "stop_and_copy"}  # CLI -> JSON
LABELS = ("A", "B")  # instance 0 on core 0, instance 1 on core 1
BLOCK = 128  # --block-size of both instances (vLLM's CPU default, given explicitly)
EXTERNAL = "vllm:prompt_tokens_by_source_total"
RESET_TIMEOUT_S = 10.0  # a prefix cache reset retried while the connector holds blocks
DEFAULT_LENGTHS = "128,512,2048"  # --lengths
LENGTH_SALT = 7907  # a length's prompts are drawn from seed + this x length


@dataclass(frozen=True)
class Options:
    lengths: tuple[int, ...]  # ascending, each fitting max_model_len with max_tokens
    requested: dict[int, int]  # a length asked for -> the one used
    modes: tuple[str, ...]  # JSON keys: precopy, stop_and_copy
    rounds: int
    warmup_rounds: int
    max_tokens: int
    migrate_after: int
    gap_tokens: int
    seed: int
    timeout_s: float
    dtype: str
    server_args: tuple[str, ...]
    max_model_len: int
    netns_link: str | None = None  # tc rate: A and B in two namespaces across it
    dataset: str = "random"  # the prompts of each length

    @classmethod
    def from_args(cls, args: argparse.Namespace, max_model_len: int) -> Options:
        text = args.lengths or ("128" if args.quick else DEFAULT_LENGTHS)
        try:
            asked = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--lengths {text!r}: give token counts, comma-separated") from None
        if not asked or any(n < 2 for n in asked):
            raise ValueError("--lengths: at least one length, each >= 2 tokens")
        longest = max_model_len - args.max_tokens
        if longest < 2:
            raise ValueError(f"--max-tokens {args.max_tokens} leaves no room in {max_model_len}")
        requested = {n: min(n, longest) for n in asked}
        lengths = tuple(sorted(set(requested.values())))
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        for m in modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r} (known: {', '.join(MODES)})")
        if not modes or len(set(modes)) != len(modes):
            raise ValueError("--modes: each of precopy, stop-and-copy at most once, at least one")
        rounds = args.rounds if args.rounds is not None else (1 if args.quick else 12)
        if rounds < 1 or args.warmup_rounds < 0:
            raise ValueError("--rounds must be >= 1 and --warmup-rounds >= 0")
        if args.migrate_after < 1 or args.gap_tokens < 4:
            raise ValueError("--migrate-after must be >= 1 and --gap-tokens >= 4")
        # each cut-over comes a few tokens after its order (the pre-copy runs
        # meanwhile): leave the second one room, and the gaps after it
        if args.max_tokens < args.migrate_after + 2 * args.gap_tokens + 32:
            raise ValueError("--max-tokens must be >= --migrate-after + 2 x --gap-tokens + 32")
        netns = getattr(args, "netns_link", None)
        if netns:
            from rapidkv.harness.netns import rate_bits

            rate_bits(netns)  # ValueError naming the rate
        return from_namespace(
            cls,
            args,
            lengths=lengths,
            requested=requested,
            modes=tuple(MODE_KEYS[m] for m in MODES if m in modes),
            rounds=rounds,
            timeout_s=args.timeout,
            max_model_len=max_model_len,
            netns_link=netns or None,
            **{k: v for k, v in served_fields(args).items() if k != "model"},
        )


def run(args: argparse.Namespace) -> int:
    from rapidkv.bench.common.groups import HELPER_CPU
    from rapidkv.bench.common.options import check_model, model_dir
    from rapidkv.bench.common.progress import Progress
    from rapidkv.bench.common.provenance import git_describe
    from rapidkv.bench.common.run import command_line, finish, open_link
    from rapidkv.bench.migrate.report import build_report, print_report
    from rapidkv.harness.procs import cpu_model
    from rapidkv.harness.server import kv_bytes_per_token, model_max_len

    try:
        check_model(args.model)
    except ValueError as e:
        print(f"rapidkv bench migrate: error: {e}", file=sys.stderr)
        return 2
    model = model_dir(args.model, model_dtype(args.model, args.dtype))
    try:
        opts = Options.from_args(args, model_max_len(model) or 1024)
    except ValueError as e:
        print(f"rapidkv bench migrate: error: {e}", file=sys.stderr)
        return 2
    git_describe()  # the checkout measured: as it is now (cached)
    log_dir = make_log_dir(args, "migrate")
    log_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(
        (opts.warmup_rounds + opts.rounds * len(opts.lengths)) * (1 + len(opts.modes))
    )
    t0 = time.monotonic()
    link_info: dict[str, Any] | None = None
    try:
        with contextlib.ExitStack() as stack:
            link, link_info = open_link(stack, opts.netns_link, progress, "migrate")
            result = Bench(opts, model, log_dir, progress, link).run()
    except SetupError as e:
        progress.close()
        print(f"rapidkv bench migrate: {e}", file=sys.stderr)
        print(f"server logs: {log_dir}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "git": git_describe(),
        "command": command_line("migrate"),
        "model": str(model),
        "dataset": opts.dataset,
        "dtype": opts.dtype,
        "kv_bytes_per_token": kv_bytes_per_token(model, opts.dtype),
        "block_size": BLOCK,
        "max_model_len": opts.max_model_len,
        "lengths_requested": {str(k): v for k, v in opts.requested.items()},
        "modes": list(opts.modes),
        "rounds": opts.rounds,
        "warmup_rounds": opts.warmup_rounds,
        "max_tokens": opts.max_tokens,
        "migrate_after": opts.migrate_after,
        "gap_tokens": opts.gap_tokens,
        "seed": opts.seed,
        "server_args": list(SERVER_ARGS + opts.server_args),
        "instances": result["instances"],
        "router_cpus": [HELPER_CPU],
        "client_cpus": [HELPER_CPU],
        "wall_s": time.monotonic() - t0,
        "log_dir": str(log_dir),
        "netns_link": link_info,
    }
    report = build_report(result, meta)

    def draw(path: Path) -> None:
        from rapidkv.bench.migrate.plot import plot

        plot(report, path)

    return finish(report, args, print_report, log_dir, draw)


class SetupError(RuntimeError):
    """The instances or the router did not start: no run."""


SERVER_ARGS = ("--block-size", str(BLOCK))


# ------------------------------------------------------------------ the client


@dataclass
class Stream:
    """One streamed completion through the router, as the client saw it."""

    status: int | None = None
    xfer_id: str | None = None
    start: int | None = None  # the instance it was placed on
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.monotonic() per token
    t_sent: float = 0.0
    ended: bool = False
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Order:
    """One migration ordered during a stream, and the router's answer."""

    k: int  # 0: there, 1: back
    source: int
    dest: int
    ordered_at: int  # tokens the client had when it ordered
    t_order: float
    status: int | None = None
    answer: dict[str, Any] | None = None
    error: str | None = None
    reset_ms: float | None = None  # the destination's prefix cache reset before it


def _decode_index(placement: str | None) -> int | None:
    if not placement:
        return None
    from rapidkv.router.placement.policy import parse_header

    parts = parse_header(placement)
    return int(parts["decode"]) if "decode" in parts else None


async def _read(
    session: Any, url: str, body: dict[str, Any], st: Stream, changed: asyncio.Event
) -> None:
    """Stream `body` from the router into `st`, setting `changed` at every token."""
    st.t_sent = time.monotonic()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            st.status = resp.status
            st.xfer_id = resp.headers.get(XFER_HEADER)
            st.start = _decode_index(resp.headers.get(PLACEMENT_HEADER))
            changed.set()
            if resp.status != 200:
                st.error = f"HTTP {resp.status}: {(await resp.read())[:300]!r}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    st.error = f"error event: {event['error']!r}"[:500]
                    continue
                choices = event.get("choices") or []
                ids = choices[0].get("token_ids") or [] if choices else []
                if choices and choices[0].get("finish_reason"):
                    st.finish_reason = choices[0]["finish_reason"]
                if ids:
                    now = time.monotonic()
                    st.tokens.extend(int(t) for t in ids)
                    st.times.extend([now] * len(ids))
                    changed.set()
    except Exception as e:  # the stream broke: what the client got stays
        st.error = st.error or f"{type(e).__name__}: {e}"[:500]
    finally:
        st.ended = True
        changed.set()


async def _until(cond: Any, changed: asyncio.Event) -> None:
    while not cond():
        changed.clear()
        if cond():
            return
        await changed.wait()


class Client:
    """The requests of the run, one at a time, on one event loop."""

    def __init__(self, session: Any, router: str, urls: list[str], token: str, opts: Options):
        self.session = session
        self.router = router
        self.urls = urls
        self.auth = {"authorization": f"Bearer {token}"}
        self.opts = opts

    def body(self, prompt: list[int]) -> dict[str, Any]:
        from rapidkv.harness.client import completion_body

        return completion_body(prompt, self.opts.max_tokens, stream=True)

    async def reset(self, index: int) -> float:
        """Empty instance `index`'s prefix cache (retried while blocks are held:
        the connector keeps a migrated request's until its transfer settled);
        ms it took. Raises RuntimeError if it never succeeded."""
        t0 = time.monotonic()
        deadline = t0 + RESET_TIMEOUT_S
        url = f"{self.urls[index]}/reset_prefix_cache"
        while True:
            async with self.session.post(url) as resp:
                ok = resp.status == 200 and (await resp.json()).get("success") is True
            if ok:
                return (time.monotonic() - t0) * 1000
            if time.monotonic() > deadline:
                raise RuntimeError(f"{LABELS[index]}'s prefix cache could not be reset")
            await asyncio.sleep(0.01)

    async def plain(self, prompt: list[int]) -> Stream:
        st = Stream()
        await _read(self.session, self.router, self.body(prompt), st, asyncio.Event())
        return st

    async def migrated(self, prompt: list[int], precopy: bool) -> tuple[Stream, list[Order]]:
        """Stream `prompt`, moved there after `migrate_after` tokens and back
        `gap_tokens` after that cut-over."""
        st, changed = Stream(), asyncio.Event()
        reader = asyncio.create_task(
            _read(self.session, self.router, self.body(prompt), st, changed)
        )
        orders: list[Order] = []
        try:
            await _until(lambda: st.status is not None or st.ended, changed)
            if st.status != 200 or st.start is None:
                await reader
                return st, orders
            current = st.start
            for k in range(2):
                dest = 1 - current
                reset_ms = None
                if k > 0:  # its own blocks are in the destination's prefix cache
                    reset_ms = await self.reset(dest)
                want = (
                    self.opts.migrate_after
                    if k == 0
                    else orders[-1].answer["tokens_at_cutover"] + self.opts.gap_tokens  # type: ignore[index]
                )
                await _until(lambda w=want: len(st.tokens) >= w or st.ended, changed)
                order = Order(k, current, dest, len(st.tokens), time.monotonic(), reset_ms=reset_ms)
                orders.append(order)
                if st.ended:
                    order.error = (
                        f"the stream ended ({len(st.tokens)} tokens) before it was ordered"
                    )
                    break
                async with self.session.post(
                    f"{self.router}/admin/migrate",
                    json={"xfer_id": st.xfer_id, "to": self.urls[dest], "precopy": precopy},
                    headers=self.auth,
                ) as resp:
                    order.status = resp.status
                    text = await resp.text()
                if resp.status != 200:
                    order.error = f"HTTP {resp.status}: {text[:300]}"
                    break
                order.answer = json.loads(text)
                current = dest
            await reader
        finally:
            if not reader.done():
                reader.cancel()
        return st, orders


# ------------------------------------------------------------------ the run


class Bench:
    def __init__(
        self, opts: Options, model: Path, log_dir: Path, progress: Any, link: Any = None
    ) -> None:
        """`link` (`harness.netns.NetnsLink`): A runs in its namespace A, B in
        B, the migrations' KV crosses it (the router and the client reach both
        over uncapped veths of their own)."""
        from rapidkv.bench.common.dataset import prompts_of_lengths
        from rapidkv.harness.server import kv_bytes_per_token

        self.opts = opts
        self.model = model
        self.log_dir = log_dir
        self.progress = progress
        self.link = link
        self.bytes_per_token = kv_bytes_per_token(model, opts.dtype)
        self.prompts = {
            n: prompts_of_lengths(
                model, [n] * opts.rounds, opts.seed + LENGTH_SALT * n, opts.dataset
            )
            for n in opts.lengths
        }
        shortest = opts.lengths[0]
        self.warmup_prompts = prompts_of_lengths(
            model, [shortest] * opts.warmup_rounds, opts.seed + 1, opts.dataset
        )
        self.runs: list[dict[str, Any]] = []
        self.rows: list[dict[str, Any]] = []
        self.warmup: list[dict[str, Any]] = []

    # ------------------------------------------------------------ setup

    def start_servers(self) -> tuple[list[Any], list[str]]:
        from rapidkv.bench.common.groups import rapidkv_control
        from rapidkv.connector.config import kv_transfer_config
        from rapidkv.harness import ServerSpec, free_port, start_servers

        specs = []
        sides = (self.link.a, self.link.b) if self.link is not None else (None, None)
        for i, (label, side) in enumerate(zip(LABELS, sides, strict=True)):
            # across a link: control plane and KV on the instance's link address
            where = {} if side is None else {"control_host": side.host, "kvt_host": side.host}
            spec = ServerSpec(
                model=self.model,
                name=f"migrate-{label}",
                role="decode",
                cpus=(i,),
                kv_transfer_config=kv_transfer_config(free_port(), **where),
                extra_args=SERVER_ARGS + self.opts.server_args,
                env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache
                max_model_len=self.opts.max_model_len,
                dtype=self.opts.dtype,
            )
            specs.append(spec if side is None else spec.replace(netns=side.name, host=side.host))
        self.progress.stage("starting A (core 0) and B (core 1)")
        try:
            servers = start_servers(specs, self.log_dir)
        except Exception as e:
            raise SetupError(f"the instances did not start: {type(e).__name__}: {e}") from e
        return servers, [rapidkv_control(s.kv_transfer_config) for s in specs]

    def start_router(self, servers: list[Any], controls: list[str], token_file: Path) -> Any:
        from rapidkv.bench.common.groups import HELPER_CPU, router_argv, start_front

        instances = [f"{s.base_url}={c}" for s, c in zip(servers, controls, strict=True)]
        argv = [
            *router_argv("local", [], [], instances=instances),
            "--admin-token-file",
            str(token_file),
        ]
        try:
            return start_front("migrate.router", argv, self.log_dir, {HELPER_CPU})
        except Exception as e:
            raise SetupError(f"the router did not start: {type(e).__name__}: {e}") from e

    def run(self) -> dict[str, Any]:
        from rapidkv.bench.common.groups import HELPER_CPU
        from rapidkv.control.client import RpcClient

        token = secrets.token_hex(16)
        token_file = self.log_dir / "admin-token"
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        servers, controls = self.start_servers()
        try:
            router = self.start_router(servers, controls, token_file)
            previous = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {HELPER_CPU})  # the client beside A and the router
            rpc = RpcClient()
            try:
                urls = [s.base_url for s in servers]
                asyncio.run(self._measure(router.url, urls, controls, token, rpc))
                sent = self._bytes_sent(urls, controls, rpc)
            finally:
                rpc.close()
                os.sched_setaffinity(0, previous)
                router.process.stop()
        finally:
            from rapidkv.harness.server import stop_servers

            for name, e in stop_servers(servers):
                self.progress.say(f"stopping {name}: {e}")
        return {
            "runs": self.runs,
            "rows": self.rows,
            "warmup": self.warmup,
            "bytes_sent": sent,
            "bytes_per_token": self.bytes_per_token,
            "block": BLOCK,
            "instances": {
                label: {"url": s.base_url, "control": c, "cpus": [i]}
                for i, (label, s, c) in enumerate(zip(LABELS, servers, controls, strict=True))
            },
        }

    async def _measure(
        self, router: str, urls: list[str], controls: list[str], token: str, rpc: Any
    ) -> None:
        import aiohttp

        opts = self.opts
        timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            client = Client(session, router, urls, token, opts)
            for r, prompt in enumerate(self.warmup_prompts):
                self.progress.stage(f"warm-up round {r + 1}/{opts.warmup_rounds}")
                await self._round(client, urls, controls, rpc, prompt, r, warmup=True)
            for r in range(opts.rounds):
                order = opts.lengths if r % 2 == 0 else tuple(reversed(opts.lengths))
                for n in order:
                    self.progress.stage(f"round {r + 1}/{opts.rounds}: {n} tokens")
                    await self._round(client, urls, controls, rpc, self.prompts[n][r], r)

    async def _round(
        self,
        client: Client,
        urls: list[str],
        controls: list[str],
        rpc: Any,
        prompt: list[int],
        r: int,
        warmup: bool = False,
    ) -> None:
        """One prompt: its reference, then one migrated run per mode (their
        order alternates round by round)."""
        from rapidkv.bench.migrate.report import migration_rows

        n = len(prompt)
        ref = await client.plain(prompt)
        self.progress.advance()
        run_base = {"length": n, "round": r, "warmup": warmup}
        self.runs.append({**run_base, **_run_row(ref, None, "reference")})
        if ref.error or len(ref.tokens) != self.opts.max_tokens:
            self.progress.say(f"{n} tokens, round {r}: no reference ({ref.error})")
            self.progress.advance(len(self.opts.modes))
            return  # nothing to compare with (the run row says why)
        modes = self.opts.modes if r % 2 == 0 else tuple(reversed(self.opts.modes))
        for mode in modes:
            run_row: dict[str, Any] = {**run_base, "mode": mode}
            try:
                for i in range(len(urls)):  # nothing of the reference or earlier runs cached
                    await client.reset(i)
                before = [external_tokens(u) for u in urls]
                st, orders = await client.migrated(prompt, precopy=mode == "precopy")
                after = [external_tokens(u) for u in urls]
                timelines = dest_timelines(rpc, controls, orders)
            except Exception as e:
                run_row.update(error=f"{type(e).__name__}: {e}"[:500], outcome="error")
                self.runs.append(run_row)
                self.progress.say(f"{n} tokens, {mode}, round {r}: {run_row['error']}")
                self.progress.advance()
                continue
            run_row.update(_run_row(st, ref.tokens, mode))
            loaded = [a - b for a, b in zip(after, before, strict=True)]
            rows = migration_rows(
                st.times,
                orders_as_dicts(orders),
                prompt_len=n,
                block=BLOCK,
                bytes_per_token=self.bytes_per_token,
                loaded_by_instance=loaded,
                timelines=timelines,
                gap_tokens=self.opts.gap_tokens,
            )
            for row in rows:
                row.update(length=n, round=r, mode=mode, xfer_id=st.xfer_id)
            run_row["migrations_ok"] = sum(1 for x in rows if x["ok"])
            run_row["migrations_failed"] = sum(1 for x in rows if not x["ok"])
            self.runs.append(run_row)
            (self.warmup if warmup else self.rows).extend(rows)
            for row in rows:
                if not row["ok"]:
                    self.progress.say(f"{n} tokens, {mode}, round {r}: {row['error']}")
            if run_row.get("outcome") != "match":
                self.progress.say(f"{n} tokens, {mode}, round {r}: {run_row.get('outcome')}")
            self.progress.advance()

    def _bytes_sent(self, urls: list[str], controls: list[str], rpc: Any) -> dict[str, float]:
        """Each instance's connector `bytes_sent` (its workers' counters reach the
        scheduler with a step: one short request to each first)."""
        from rapidkv.control.messages import StatsRequest
        from rapidkv.harness.client import complete

        out = {}
        for label, url, control in zip(LABELS, urls, controls, strict=True):
            try:
                complete(url, [5, 6, 7], 2)
                out[label] = rpc.call(control, StatsRequest(), 10).counters.get("bytes_sent", 0.0)
            except Exception as e:
                self.progress.say(f"{label}: bytes_sent not read: {e}")
        return out


def _run_row(st: Stream, reference: list[int] | None, mode: str) -> dict[str, Any]:
    """What a run's row says of its stream: tokens, outcome against the reference."""
    row: dict[str, Any] = {
        "mode": mode,
        "xfer_id": st.xfer_id,
        "start": LABELS[st.start] if st.start is not None else None,
        "status": st.status,
        "tokens": len(st.tokens),
        "error": st.error,
        "finish_reason": st.finish_reason,
    }
    gaps = [(b - a) * 1000 for a, b in zip(st.times[1:], st.times[2:], strict=False)]
    row["gaps_ms"] = [round(g, 3) for g in gaps]  # a reference's: the unmigrated decode
    if reference is None:
        row["outcome"] = "reference" if st.error is None else "error"
        return row
    if st.tokens == reference:
        row["outcome"] = "match"
    elif st.error is not None or len(st.tokens) != len(reference):
        row["outcome"] = "incomplete" if reference[: len(st.tokens)] == st.tokens else "mismatch"
    else:
        row["outcome"] = "mismatch"
    if row["outcome"] == "mismatch":
        row["first_diff"] = next(
            (i for i, (a, b) in enumerate(zip(st.tokens, reference, strict=False)) if a != b),
            min(len(st.tokens), len(reference)),
        )
    return row


def orders_as_dicts(orders: list[Order]) -> list[dict[str, Any]]:
    return [
        {
            "k": o.k,
            "from": LABELS[o.source],
            "to": LABELS[o.dest],
            "dest": o.dest,
            "ordered_at": o.ordered_at,
            "t_order": o.t_order,
            "status": o.status,
            "answer": o.answer,
            "error": o.error,
            "reset_ms": o.reset_ms,
        }
        for o in orders
    ]


def external_tokens(url: str) -> float:
    """Prompt tokens instance `url` loaded through its connector so far."""
    from rapidkv.harness import get_metrics, metric_sum

    return metric_sum(get_metrics(url), EXTERNAL, source="external_kv_transfer")


def dest_timelines(
    rpc: Any, controls: list[str], orders: list[Order]
) -> dict[str, dict[str, float]]:
    """The connector events of each migration's pre-copy and cut-over
    transfers (the ids its answer names), from whichever instance has them."""
    from rapidkv.control.messages import TimelineRequest

    ids = [
        x
        for o in orders
        if o.answer is not None
        for x in (o.answer.get("precopy_xfer_id"), o.answer.get("cutover_xfer_id"))
        if x
    ]
    if not ids:
        return {}
    out: dict[str, dict[str, float]] = {}
    for control in controls:
        for x, t in rpc.call(control, TimelineRequest(ids), 10).xfers.items():
            out.setdefault(x, {}).update(t.events)
    return out
