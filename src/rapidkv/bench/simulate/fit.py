"""The simulated instances' parameters, fitted from this machine's measurements.

`Fit` is everything the simulator assumes about one vLLM CPU instance and the
paths between instances; `fit_from(Measurements)` derives it from a handful of
client-side figures that `rapidkv bench serve` measures, and `load_fit(PATH)`
reads those figures from a JSON (`--fit`), falling back to the defaults (with
a warning) for each one it cannot find.

The instance model (`instance`): a step runs every request decoding there plus
at most `max_num_batched_tokens` prompt tokens (vLLM's chunked prefill), for
at most `max_num_seqs` requests, and takes

    step_ms + step_ms_per_seq * seqs + prefill_ms_per_token * prompt_tokens
            + context_ms_per_token * context_tokens
            (+ prefill_ms when the step computes any prompt token)

(``context_tokens``: what the requests computing those prompt tokens already
hold in their KV; `context_ms_per_token` is 0 in every fit `fit_from` makes,
and only `calibrate` sets it), so a request alone on an idle instance has TTFT
``http_ms + step(1) + prefill_ms + prefill_ms_per_token * P`` and TPOT
``step(1)``.

The fit (`fit_from`), from `Measurements`:

- ``step_ms_per_seq = (c4 TPOT p50 - c1 TPOT p50) / 3`` and ``step_ms = c1
  TPOT p50 - step_ms_per_seq``: at ``c1`` one request decodes, at ``c4`` four
  (a closed loop of four that starts together stays mostly in step, so c4's
  p50 is mostly stall-free; what stalls remain make the slope an upper bound);
- ``prefill_ms_per_token = (c1 TTFT p50 - http_ms - step(1) - prefill_ms) /
  prompt_mean``: the p50 of a line over uniform prompts is its value at the
  median, which for a uniform draw is about the mean;
- ``router_ms``: a routed request's extra latency, from `rapidkv-whole`'s c1
  TTFT p50 (P's first token through the router) minus single's;
- ``nixl_transfer_ms``: tuned `vllm-nixl`'s c1 TTFT p50 minus single's, less
  the router and D's first step (its serial proxy asks D only after P's
  answer, and D's first token is the client's);
- ``transfer_ms``: 0, rapidkv's default `substep` mode sends each layer as it
  is computed, and the KV is on D before P's scheduler has its step's output
  (`serve.timeline`: hand-off -7.9 to -8.3 ms at c1);
- per-token transfer costs: the tiny model's KV, ~2 KiB a token (1 MiB per
  ~510-token request), at ~4 GB/s: 0.0005 ms a token;
- ``split_handoff_ms``: from a split head's end on P to D's first token
  (`serve.timeline`, rapidkv c1: 9 ms: the head's last layer, D's last
  layers, sampling);
- ``shared_core_ms``, the testbed only (`engine`'s ``shared_core``): the CPU
  the router and the client take, per request, from the core of instance 0
  (P's) while it computes. 12 ms is where `rapidkv-whole`'s simulated c4
  TTFT p50 meets the measured 157.3 ms (`check`; 0 ms gives 129); the
  router's own share was measured at 4.1 ms a request (docs/benchmarks/history.md),
  the client's and P's HTTP front's are the rest. Not refitted from `--fit`.

Defaults (`Measurements()`): docs/benchmarks/history.md, "Latest run (2026-12-01, tiny
float32 model, 64 prompts, --rounds 2, paired)": `single` TTFT p50 54.9 ms at
c1, TPOT p50 5.4 at c1 and 7.6 at c4; `rapidkv-whole` c1 TTFT p50 59.2;
`vllm-nixl` c1 TTFT p50 75.6; prompts uniform in [128, 900]. `max_num_seqs`
8 is the harness's `--max-num-seqs` (`bench simulate --max-num-seqs` sets
another; `--compare` takes the real run's from its server args).
`max_num_batched_tokens` is 4096, not vLLM's CPU default of 2048: with 2048
the model chunks a closed loop of four prompts (~2,050 tokens) over two steps
and falls out of step, and puts `single`'s c4 TPOT p50 at 11.0 ms against
the 7.6 measured (TTFT 165 against 185); with 4096, 7.6 and 185 (`check`).
`block_size` 128 is the CPU backend's (a split head is whole 128-token
blocks). The prefix cache (the workloads of shared prefixes only) holds
`cache_blocks`: vLLM's ``kv_cache_bytes // (block_size * kv_bytes_per_token)``
less its null block, from the harness's ``--kv-cache-memory-bytes 256M``
(2**28 bytes, as vLLM reads ``M``) and the model's KV a token, every layer's
K and V (`harness.server.kv_bytes_per_token`): 4,096 bytes for the tiny
float32 model of the default fit (511 blocks, 65,408 tokens), 23,040 for
SmolLM2-135M in bf16 (90 blocks, 11,520 tokens), 46,080 in float32 (44
blocks); `bench simulate --kv-cache-bytes`, `--kv-bytes-per-token` and
`--cache-blocks` set them. `http_ms` (1 ms, a direct request's HTTP front and stream) is
assumed, not measured: it only moves cost between the fitted prefill's fixed
and per-token parts.

`--fit smollm2` (`PRESETS`) is the fit of the same figures for SmolLM2-135M
in bf16, from docs/benchmarks/serve.md's "SmolLM2-135M, random prompts" run
(2026-12-06, at `37d4681`, one round, prompts 128-900 tokens: `single` c1
TTFT p50 274.3 ms, TPOT p50 43.3 at c1 and 50.2 at c4, `rapidkv-whole` c1
TTFT 313.1, `vllm-nixl` c1 TTFT 344.9), with SmolLM2's KV (23,040 bytes a
token: 90 blocks a prefix cache, and 0.00576 ms a token at ~4 GB/s); the
split hand-off (9 ms) and the shared core (12 ms) are the tiny model's, not
refitted.

`--fit PATH` reads, wherever they are in the JSON, the ``ttft_ms.p50`` /
``tpot_ms.p50`` of `single` at ``c1`` and ``c4``, of `rapidkv-whole` (else
`rapidkv`) at ``c1`` and of `vllm-nixl` at ``c1``: a `bench serve --json`
file has them under ``configs.<name>.loads.<load>``; a `bench goodput` file
has `single`'s ``c1`` as ``workloads.<w>.single_c1`` (prefill-heavy's is
taken first) and none of the others. The mean prompt comes from
``meta.prompt_len.mean`` (serve) or the middle of
``workloads.prefill-heavy.prompt_len`` (goodput). A `bench serve` JSON of one
model also gives that model's KV a token (``meta.models``' directory, read
here, in ``meta.dtype``: `harness.server.kv_bytes_per_token`), and with it the
prefix cache's blocks and the transfer a token at ~4 GB/s (`KV_BYTES_PER_S`);
else the tiny model's stay. A JSON written by `bench
simulate --json` gives its ``fit`` back as is. Every figure not found keeps
its default, with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KV_BYTES_PER_S = 4e9  # the KV's path from P to D (NIXL over loopback), ~4 GB/s
KV_MS_PER_TOKEN = 0.0005  # ~2 KiB of tiny-model KV a token at ~4 GB/s
KV_CACHE_BYTES = 256 * 2**20  # `harness.server.ServerSpec.kv_cache_memory_bytes`, "256M"
KV_BYTES_PER_TOKEN = 4096  # the tiny float32 model: 4 layers x (K, V) x 2 heads x 64 x 4 bytes


@dataclass(frozen=True)
class Measurements:
    """The client-side figures the fit starts from, in ms (defaults: see the module docstring)."""

    single_c1_ttft_p50: float = 54.9
    single_c1_tpot_p50: float = 5.4
    single_c4_tpot_p50: float = 7.6
    prompt_mean: float = 514.0
    routed_c1_ttft_p50: float = 59.2
    nixl_c1_ttft_p50: float = 75.6
    split_handoff_ms: float = 9.0


@dataclass(frozen=True)
class Fit:
    """What the simulator assumes (ms unless said otherwise)."""

    step_ms: float
    step_ms_per_seq: float
    prefill_ms_per_token: float
    prefill_ms: float = 0.0
    # a prompt chunk's cost a token already in its request's KV (a prefix hit,
    # KV received, an earlier chunk): attention over it (0: not modelled)
    context_ms_per_token: float = 0.0
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 8
    block_size: int = 128
    http_ms: float = 1.0
    router_ms: float = 4.3
    transfer_ms: float = 0.0
    transfer_ms_per_token: float = KV_MS_PER_TOKEN
    nixl_transfer_ms: float = 11.0
    nixl_transfer_ms_per_token: float = KV_MS_PER_TOKEN
    split_handoff_ms: float = 9.0
    shared_core_ms: float = 12.0
    split_fraction: float = 0.55  # the fixed router's head share (`RouterConfig.split_fraction`)
    kv_cache_bytes: int = KV_CACHE_BYTES  # the harness's --kv-cache-memory-bytes 256M
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN  # every layer's K and V of one token
    prefix_cache_blocks: int = 0  # blocks a prefix cache holds (0: from the two above)
    source: str = "defaults"
    measurements: Measurements = field(default_factory=Measurements)

    def __post_init__(self) -> None:
        values = [v for v in dataclasses.astuple(self) if isinstance(v, float | int)]
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"every fitted parameter must be finite and >= 0: {self}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.block_size < 1:
            raise ValueError(f"token budget, sequences and block size must be >= 1: {self}")
        if not 0 < self.split_fraction < 1:
            raise ValueError(f"split_fraction must be in (0, 1): {self.split_fraction}")

    @property
    def cache_blocks(self) -> int:
        """The blocks an instance's prefix cache holds: `prefix_cache_blocks`
        when set, else vLLM's count for `kv_cache_bytes` (`prefix_cache.blocks_of`)."""
        if self.prefix_cache_blocks:
            return self.prefix_cache_blocks
        from rapidkv.bench.simulate.prefix_cache import blocks_of

        return blocks_of(self.kv_cache_bytes, self.block_size, self.kv_bytes_per_token)

    def step_time(self, seqs: int, prefill_tokens: int, context_tokens: int = 0) -> float:
        """One engine step with `seqs` requests in it computing `prefill_tokens`
        prompt tokens, whose requests already hold `context_tokens` in their KV."""
        ms = self.step_ms + self.step_ms_per_seq * seqs + self.prefill_ms_per_token * prefill_tokens
        ms += self.context_ms_per_token * context_tokens
        return ms + (self.prefill_ms if prefill_tokens > 0 else 0.0)

    def transfer_time(self, tokens: int, connector: str = "rapidkv") -> float:
        """From P's prefill end to the KV of `tokens` tokens usable on D."""
        if connector == "nixl":
            return self.nixl_transfer_ms + self.nixl_transfer_ms_per_token * tokens
        return self.transfer_ms + self.transfer_ms_per_token * tokens

    def single_ttft(self, prompt_tokens: int) -> float:
        """A request alone on an idle instance, sent to it directly."""
        return self.http_ms + self.step_time(1, prompt_tokens)

    def single_tpot(self) -> float:
        return self.step_time(1, 0)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fit_from(
    m: Measurements, *, http_ms: float = 1.0, prefill_ms: float = 0.0, source: str = "defaults"
) -> Fit:
    """The `Fit` of the module docstring from `m` (each derived value floored at 0)."""
    per_seq = max((m.single_c4_tpot_p50 - m.single_c1_tpot_p50) / 3, 0.0)
    step = max(m.single_c1_tpot_p50 - per_seq, 0.0)
    step1 = step + per_seq
    per_token = max((m.single_c1_ttft_p50 - http_ms - step1 - prefill_ms) / m.prompt_mean, 0.0)
    router = max(m.routed_c1_ttft_p50 - m.single_c1_ttft_p50, 0.0)
    nixl = max(m.nixl_c1_ttft_p50 - m.single_c1_ttft_p50 - router - step1, 0.0)
    return Fit(
        step_ms=step,
        step_ms_per_seq=per_seq,
        prefill_ms_per_token=per_token,
        prefill_ms=prefill_ms,
        http_ms=http_ms,
        router_ms=router,
        nixl_transfer_ms=nixl,
        split_handoff_ms=m.split_handoff_ms,
        source=source,
        measurements=m,
    )


DEFAULT_FIT = fit_from(Measurements())

SMOLLM2_KV_BYTES_PER_TOKEN = 23040  # 30 layers x (K, V) x 3 heads x 64 x 2 bytes (bf16)
PRESETS: dict[str, Fit] = {
    "smollm2": dataclasses.replace(
        fit_from(
            Measurements(
                single_c1_ttft_p50=274.3,
                single_c1_tpot_p50=43.3,
                single_c4_tpot_p50=50.2,
                routed_c1_ttft_p50=313.1,
                nixl_c1_ttft_p50=344.9,
            ),
            source=(
                "smollm2 (docs/benchmarks/serve.md, SmolLM2-135M bf16, random prompts, 2026-12-06)"
            ),
        ),
        kv_bytes_per_token=SMOLLM2_KV_BYTES_PER_TOKEN,
        transfer_ms_per_token=SMOLLM2_KV_BYTES_PER_TOKEN / KV_BYTES_PER_S * 1000,
    )
}
"""Fits by name (`--fit NAME`), from figures docs/benchmarks/ gives (the module docstring)."""

# Measurements field -> (configurations tried in order, load, metric)
_WANTED: dict[str, tuple[tuple[str, ...], str, str]] = {
    "single_c1_ttft_p50": (("single",), "c1", "ttft_ms"),
    "single_c1_tpot_p50": (("single",), "c1", "tpot_ms"),
    "single_c4_tpot_p50": (("single",), "c4", "tpot_ms"),
    "routed_c1_ttft_p50": (("rapidkv-whole", "rapidkv"), "c1", "ttft_ms"),
    "nixl_c1_ttft_p50": (("vllm-nixl",), "c1", "ttft_ms"),
}


def load_fit(path: str | Path) -> tuple[Fit, list[str]]:
    """The fit from the JSON at `path` (or the preset of that name, `PRESETS`)
    and the warnings it gave (see the module docstring). An unreadable file,
    or one with none of the figures, gives the defaults, with a warning."""
    if str(path) in PRESETS:
        return PRESETS[str(path)], []
    warnings: list[str] = []
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        return DEFAULT_FIT, [f"--fit {path}: unreadable ({e}); using the default fit"]
    if not isinstance(data, dict):
        return DEFAULT_FIT, [f"--fit {path}: not a JSON object; using the default fit"]
    if data.get("bench") == "simulate" and isinstance(data.get("fit"), dict):
        try:
            return _fit_from_dict(data["fit"], f"{path} (bench simulate)"), warnings
        except (TypeError, ValueError) as e:
            warnings.append(f"--fit {path}: its 'fit' is not usable ({e}); reading figures")
    found: dict[str, float] = {}
    scope = _get(data, "workloads", "prefill-heavy")  # bench goodput: its serve-like workload
    scopes = [scope, data] if isinstance(scope, dict) else [data]
    for name, (configs, load, metric) in _WANTED.items():
        value = next(
            (v for s in scopes if (v := find_figure(s, configs, load, metric)) is not None), None
        )
        if value is None:
            default = getattr(Measurements(), name)
            warnings.append(
                f"--fit {path}: no {'/'.join(configs)} {load} {metric}.p50; default {default}"
            )
        else:
            found[name] = value
    mean = _number(_get(data, "meta", "prompt_len", "mean"))
    span = scope.get("prompt_len") if isinstance(scope, dict) else None
    if mean is None and isinstance(span, list) and len(span) == 2:
        low, high = _number(span[0]), _number(span[1])
        mean = None if low is None or high is None else (low + high) / 2
    if mean is not None and mean > 0:
        found["prompt_mean"] = mean
    else:
        warnings.append(
            f"--fit {path}: no meta.prompt_len.mean nor workloads.prefill-heavy.prompt_len; "
            f"default {Measurements().prompt_mean}"
        )
    if not any(k.startswith("single") for k in found):
        warnings.append(f"--fit {path}: no single-instance figure at all; using the default fit")
        return DEFAULT_FIT, warnings
    try:
        fit = fit_from(dataclasses.replace(Measurements(), **found), source=str(path))
    except ValueError as e:
        return DEFAULT_FIT, [*warnings, f"--fit {path}: {e}; using the default fit"]
    kv = _served_kv_bytes_per_token(data, path, warnings)
    if kv is not None:
        fit = dataclasses.replace(
            fit, kv_bytes_per_token=kv, transfer_ms_per_token=kv / KV_BYTES_PER_S * 1000
        )
    return fit, warnings


def _served_kv_bytes_per_token(
    data: dict[str, Any], path: str | Path, warnings: list[str]
) -> int | None:
    """The KV bytes a token of the model a `bench serve` JSON served (its
    ``meta.models`` directory's config.json, in its ``meta.dtype``), or None
    (with a warning where the JSON names models this machine cannot read, or
    several): the fit then keeps the tiny model's."""
    models = _get(data, "meta", "models")
    if not isinstance(models, dict) or not models:
        return None
    if len(models) > 1:
        warnings.append(
            f"--fit {path}: {len(models)} models ({', '.join(models)}); the figures are the "
            f"first found, the KV a token the default ({KV_BYTES_PER_TOKEN} bytes)"
        )
        return None
    ((name, directory),) = models.items()
    dtypes = _get(data, "meta", "dtype")
    dtype = dtypes.get(name) if isinstance(dtypes, dict) else None
    from rapidkv.harness.server import kv_bytes_per_token

    try:
        return kv_bytes_per_token(Path(str(directory)), dtype if isinstance(dtype, str) else None)
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.append(
            f"--fit {path}: {name}'s KV a token is not readable here ({e!r}); "
            f"default {KV_BYTES_PER_TOKEN} bytes"
        )
        return None


def _fit_from_dict(d: dict[str, Any], source: str) -> Fit:
    names = {f.name for f in dataclasses.fields(Fit)} - {"measurements", "source"}
    m = d.get("measurements") or {}
    mnames = {f.name for f in dataclasses.fields(Measurements)}
    measurements = Measurements(**{k: float(v) for k, v in m.items() if k in mnames})
    kwargs = {k: v for k, v in d.items() if k in names}
    return Fit(**kwargs, source=source, measurements=measurements)


def find_figure(data: Any, configs: tuple[str, ...], load: str, metric: str) -> float | None:
    """The first ``<config>...<load>.<metric>.p50`` in `data` (``loads.`` between
    them or not, or a ``<config>_<load>`` key) for the first of `configs` that
    has one; None for none."""
    for config in configs:
        for node in _find_key(data, config):
            value = _number(_get(node, "loads", load, metric, "p50"))
            if value is None:
                value = _number(_get(node, load, metric, "p50"))
            if value is not None and value > 0:
                return value
        for node in _find_key(data, f"{config}_{load}"):
            value = _number(_get(node, metric, "p50"))
            if value is not None and value > 0:
                return value
    return None


def _find_key(data: Any, key: str, depth: int = 0) -> Iterator[Any]:
    """Every value under `key`, anywhere in `data` (depth first, a node's own key first)."""
    if depth > 6:
        return
    if isinstance(data, dict):
        if key in data:
            yield data[key]
        for k, v in data.items():
            if k != key:
                yield from _find_key(v, key, depth + 1)
    elif isinstance(data, list):
        for v in data:
            yield from _find_key(v, key, depth + 1)


def _get(data: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(k)
    return data


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)
