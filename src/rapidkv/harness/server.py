"""vLLM OpenAI API servers for tests, demos and benchmarks.

    spec = ServerSpec(model=path, name="prefill", role="prefill", cpus=(0,),
                      kv_transfer_config={...})
    with VLLMServer.start(spec, log_dir) as srv:
        complete(srv.base_url, [1, 2, 3], 16)

Invariants:
* A server listens on `ServerSpec.host` only (127.0.0.1 unless told), on a port
  that was free on 127.0.0.1 when chosen (a port clash at bind time is retried
  with a new port when the spec left the port open).
* With `netns` set, the whole tree runs in that network namespace (`ip netns
  exec`, which execs: the pid and process group are the server's own, stopped
  by group as any other); see `harness.netns`.
* `VLLM_CPU_KVCACHE_SPACE` is never passed on (it would override
  `--kv-cache-memory-bytes`); the clone's `src` is first on `PYTHONPATH`, so
  `kv_connector_module_path: rapidkv.connector` imports this checkout's code.
  A spec naming another interpreter (`ServerSpec.python`: a virtual environment
  with rapidkv installed) runs vLLM there with `PYTHONPATH` unset: rapidkv and
  its vLLM plugin are that environment's.
* With `cpus` set, the whole tree is pinned (`taskset -c`, inherited by every
  child) and vLLM's OpenMP threads are bound to the same cores.
* Every server is a `ManagedProcess`: it is stopped by process group, and the
  watchdog kills it if the Python process that started it dies.
* `start` returns only once `/health` answers 200; otherwise it stops the tree
  and raises `ServerStartError` carrying the log tail.
* Each launch gets a temporary directory of its own as `TMPDIR` and
  `VLLM_RPC_BASE_PATH` (vLLM's ZMQ IPC sockets and torch.distributed's init
  files land there, and a killed engine does not unlink them); `stop` removes it
  once the tree is gone, and the watchdog does if our process dies first. A
  `ServerSpec.env` that sets either variable wins.
* torch inductor's cache stays where it is without that `TMPDIR`
  (`TORCHINDUCTOR_CACHE_DIR`: this process's temporary directory's
  `torchinductor_<user>`, unless set): vLLM compiles its sampler's logprob
  ranks (`batched_count_greater_than`) on the first request with `logprobs`,
  and in a fresh cache that is a C++ build of ~15 s on this 2-core machine,
  every launch; from the shared cache, well under a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from rapidkv.control.address import format_address
from rapidkv.harness.netns import netns_exec_prefix
from rapidkv.harness.ports import LOOPBACK, free_port
from rapidkv.harness.process import ManagedProcess
from rapidkv.harness.watchdog import get_watchdog

Role = Literal["single", "prefill", "decode"]
Executor = Literal["mp", "uni"]
EXECUTORS: tuple[Executor, ...] = ("mp", "uni")
EXECUTOR_ENV = "RAPIDKV_VLLM_EXECUTOR"
"""The executor of the servers whose spec names none (`ServerSpec.worker_executor`)."""

SRC_DIR = Path(__file__).resolve().parents[2]
"""The `src` directory of the checkout this module was imported from."""

# Environment variables removed from every server's environment.
DROPPED_ENV = ("VLLM_CPU_KVCACHE_SPACE",)

_PORT_CLASH = ("address already in use", "errno 98")
SIGILL_MARKS = ("died unexpectedly (exit code: -4)", "Fatal Python error: Illegal instruction")
"""How a server's log says one of its processes died of SIGILL: the engine's
line when it reaped the worker first, faulthandler's (on in every server:
`ServerSpec.environment`) in any case."""
PORT_ATTEMPTS = 3
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache_dir() -> str:
    """torch inductor's default cache directory as this process places it
    (`torch._inductor.runtime.cache_dir_utils.default_cache_dir`, without
    importing torch): in this process's temporary directory, not a launch's."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(
        tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)
    )


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time. The message has its log tail."""


@dataclass(frozen=True)
class ServerSpec:
    """What to start: one vLLM OpenAI API server.

    `name` labels logs and errors; `role` ("single" | "prefill" | "decode") is a
    label as well (exported as `RAPIDKV_ROLE`): what an instance does in a
    disaggregated pair is decided by its `kv_transfer_config`, passed verbatim
    as JSON to `--kv-transfer-config`. `extra_args` are appended last, so they
    win over the defaults.

    `dtype` None means "the dtype in the model's config.json", passed
    explicitly: left to itself the CPU backend downcasts a float32 model to
    bfloat16, which breaks the float32 correctness oracle.

    `host` is the address the HTTP server binds and `base_url` names; `netns`
    a network namespace to run the server in (None: this process's).

    `tensor_parallel_size` ranks (vLLM CPU runs each in a process of its own)
    share `cpus`: split in order into one group a rank, given to vLLM as
    `VLLM_CPU_OMP_THREADS_BIND` ("0|1"); with fewer cores than ranks, rank r
    takes core r modulo their number.

    `executor` is how vLLM runs the worker of a one-rank server
    (`--distributed-executor-backend`): "mp", a process of its own beside the
    engine core (vLLM CPU's default, and every TP rank's); "uni", inside the
    engine core's process (vLLM's default on one GPU), which starts a third
    faster: one interpreter fewer imports vLLM. None: `$RAPIDKV_VLLM_EXECUTOR`
    ("mp" or "uni"), else "mp" (`worker_executor`).

    `python` is the interpreter that runs vLLM: None, this process's, with the
    checkout's `src` first on `PYTHONPATH`; or one of an environment where
    rapidkv is installed, run with `PYTHONPATH` unset, so that nothing of the
    checkout is on its path. (Either runs vLLM's API server module: the `vllm`
    command of vllm-cpu 0.32.0 dies at start-up, asking for the metadata of a
    distribution named `vllm`.)
    """

    model: Path
    name: str = "vllm"
    role: Role = "single"
    kv_transfer_config: Mapping[str, Any] | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] | None = None
    port: int | None = None
    max_model_len: int = 1024
    max_num_seqs: int = 8
    kv_cache_memory_bytes: str = "256M"
    enforce_eager: bool = True
    seed: int = 0
    dtype: str | None = None
    quiet: bool = True
    startup_timeout: float = 240.0
    host: str = LOOPBACK
    netns: str | None = None
    python: str | None = None
    tensor_parallel_size: int = 1
    executor: Executor | None = None

    def replace(self, **changes: Any) -> ServerSpec:
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)

    def worker_executor(self) -> Executor:
        """How vLLM runs this server's worker: `executor`, else
        `$RAPIDKV_VLLM_EXECUTOR` for one rank, else "mp" (vLLM CPU's default).
        More than one rank is always "mp"."""
        chosen = self.executor
        if chosen is None and self.tensor_parallel_size == 1:
            chosen = os.environ.get(EXECUTOR_ENV) or None  # type: ignore[assignment]
        chosen = chosen or "mp"
        if chosen not in EXECUTORS:
            raise ValueError(
                f"executor {chosen!r} (from {self.name!r} or ${EXECUTOR_ENV}): "
                f"expected one of {', '.join(EXECUTORS)}"
            )
        if chosen == "uni" and self.tensor_parallel_size != 1:
            raise ValueError(
                f"{self.name}: the uni executor runs one rank, not {self.tensor_parallel_size}"
            )
        return chosen

    def argv(self, port: int) -> list[str]:
        """The command line for a server on `port` (with `taskset` when pinned,
        behind `ip netns exec` with a namespace)."""
        cmd = [
            self.python or sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--kv-cache-memory-bytes",
            self.kv_cache_memory_bytes,
            "--seed",
            str(self.seed),
        ]
        dtype = self.dtype if self.dtype is not None else model_dtype(self.model)
        if dtype is not None:
            cmd += ["--dtype", dtype]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.quiet:
            # Drops uvicorn's per-request access lines; request logging is off by
            # default in 0.32. Stats logging stays on: it feeds /metrics.
            cmd += ["--uvicorn-log-level", "warning"]
        if self.tensor_parallel_size != 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.worker_executor() == "uni":
            cmd += ["--distributed-executor-backend", "uni"]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config))]
        cmd += list(self.extra_args)
        if self.cpus is not None:
            cmd = pinned(cmd, self.cpus)
        return netns_exec_prefix(self.netns) + cmd

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The server's environment, built from `base` (default: this process's)."""
        env = dict(os.environ if base is None else base)
        for key in DROPPED_ENV:
            env.pop(key, None)
        if self.python is None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
        else:  # an installed rapidkv: nothing of the checkout on the path
            env.pop("PYTHONPATH", None)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        # A worker killed by a signal names it in the log (SIGILL_MARKS): vLLM's
        # engine logs its exit code only when it was reaped first ("None" else).
        env.setdefault("PYTHONFAULTHANDLER", "1")
        env.setdefault(INDUCTOR_CACHE_ENV, inductor_cache_dir())  # see the module docstring
        env["RAPIDKV_ROLE"] = self.role
        if self.cpus is not None:
            bind = omp_threads_bind(self.cpus, self.tensor_parallel_size)
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        if self.worker_executor() == "uni":  # vLLM CPU keeps "mp" unless this is off
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.netns is not None:  # vLLM guesses its address by a default route; none here
            env["VLLM_HOST_IP"] = self.host
        env.update(self.env)
        return env


# tool calling on, as a chat deployment runs it (any model: the parser is only
# asked to parse what a request with tools produced)
TOOL_CALLING_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")


def pd_specs(
    model: Path,
    prefill_kv_config: dict[str, Any],
    decode_kv_config: dict[str, Any],
    extra_args: Sequence[str] = (),
) -> list[ServerSpec]:
    """A prefill instance pinned to core 0 and a decode instance on core 1."""
    return [
        ServerSpec(
            model=model,
            name=role,
            role=role,
            cpus=(cpu,),
            kv_transfer_config=cfg,
            extra_args=tuple(extra_args),
        )
        for role, cpu, cfg in (("prefill", 0, prefill_kv_config), ("decode", 1, decode_kv_config))
    ]


def model_dtype(model_dir: Path) -> str | None:
    """The dtype recorded in `model_dir/config.json` (`dtype` or `torch_dtype`), if any."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value) if value else None


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2, "float": 4}


def kv_bytes_per_token(model_dir: Path, dtype: str | None = None) -> int:
    """Bytes of KV one token takes across all layers (K and V), from the model's
    config.json, in `dtype` (default: the model's own, `model_dtype`)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    name = dtype or model_dtype(model_dir) or "float32"
    if name not in DTYPE_BYTES:
        raise ValueError(f"no element size known for dtype {name!r}")
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * DTYPE_BYTES[name]


def model_max_len(model_dir: Path) -> int | None:
    """The longest sequence the model allows (`max_position_embeddings`), if recorded."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if value else None


def pinned(cmd: Sequence[str], cpus: Sequence[int]) -> list[str]:
    """`cmd` run under `taskset -c`: it and every child may use only `cpus`."""
    taskset = shutil.which("taskset")
    if taskset is None:
        raise RuntimeError("pinning needs `taskset` (util-linux)")
    return [taskset, "-c", _cpu_list(cpus), *cmd]


def omp_threads_bind(cpus: Sequence[int], ranks: int = 1) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `ranks` ranks on `cpus`: the cores split
    in order into `ranks` groups ("0|1"; the last takes what does not divide),
    or, with fewer cores than ranks, core r modulo their number for rank r."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    cpus = list(cpus)
    if not cpus:
        raise ValueError("cpus must name at least one core")
    if len(cpus) < ranks:
        groups = [[cpus[r % len(cpus)]] for r in range(ranks)]
    else:
        per = len(cpus) // ranks
        groups = [cpus[r * per : (r + 1) * per] for r in range(ranks - 1)]
        groups.append(cpus[(ranks - 1) * per :])
    return "|".join(_cpu_list(g) for g in groups)


def _cpu_list(cpus: Sequence[int]) -> str:
    if not cpus:
        raise ValueError("cpus must name at least one core")
    return ",".join(str(c) for c in cpus)


class VLLMServer:
    """A running (or stopped) vLLM server started from a `ServerSpec`.

    Attributes once started: `port`, `base_url`, `pid`, `pgid`, `log_path`,
    `startup_s` (launch → first healthy `/health`, for the launch that succeeded).
    """

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.log_path = self.log_dir / f"{spec.name}.log"
        self.process: ManagedProcess | None = None
        self.tmp_dir: Path | None = None  # this launch's TMPDIR, removed by stop
        self.port = 0
        self.startup_s: float | None = None
        self._t_launch = 0.0
        self._lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def start(cls, spec: ServerSpec, log_dir: Path) -> VLLMServer:
        """Launch a server and wait until it is healthy (see module invariants)."""
        server = cls(spec, log_dir)
        server.launch()
        server.wait_ready()
        return server

    def launch(self) -> None:
        """Start the process tree without waiting for it."""
        self.port = self.spec.port if self.spec.port is not None else free_port()
        self._t_launch = time.monotonic()
        self.startup_s = None
        self._remove_tmp_dir()  # a relaunch after a port clash: the tree is stopped
        watchdog = get_watchdog(self.log_dir)  # raises if it is gone: nothing created yet
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="rapidkv-vllm-")).resolve()
        watchdog.own(self.tmp_dir)  # removed by the watchdog if we are killed
        env = self.spec.environment()
        for name in ("TMPDIR", "VLLM_RPC_BASE_PATH"):
            if name not in self.spec.env:
                env[name] = str(self.tmp_dir)
        self.process = ManagedProcess(
            self.spec.argv(self.port),
            env,
            self.log_path,
            name=f"{self.spec.name}:{self.port}",
        )

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until `/health` is 200. On failure stop the tree and raise `ServerStartError`.

        A port clash during bind is retried with a fresh port (when the spec's
        port is unset), up to `PORT_ATTEMPTS` launches in all.
        """
        timeout = self.spec.startup_timeout if timeout is None else timeout
        for attempt in range(1, PORT_ATTEMPTS + 1):
            proc = self._proc()
            deadline = self._t_launch + timeout
            with httpx.Client(timeout=2.0) as http:
                while True:
                    rc = proc.returncode()
                    if rc is not None:
                        break
                    if _healthy(http, self.base_url):
                        self.startup_s = time.monotonic() - self._t_launch
                        return
                    if time.monotonic() > deadline:
                        self._fail(f"not healthy after {timeout:.0f}s")
                    time.sleep(0.25)
            tail = proc.log_tail()
            clash = any(s in tail.lower() for s in _PORT_CLASH)
            if clash and self.spec.port is None and attempt < PORT_ATTEMPTS:
                proc.stop()
                self.launch()
                continue
            self._fail(f"exited with status {rc} before becoming healthy")

    def _fail(self, why: str) -> None:
        proc = self._proc()
        tail = proc.log_tail()
        with contextlib.suppress(Exception):
            self.stop()
        raise ServerStartError(
            f"vLLM server {self.spec.name!r} (port {self.port}, pid {proc.pid}) {why}; "
            f"log {self.log_path}, last lines:\n{tail}"
        )

    def stop(self, grace: float = 10.0) -> int | None:
        """Stop the whole tree (idempotent): SIGTERM, SIGKILL after `grace` s (0:
        killed at once, as a crash would); returns the leader's exit status."""
        with self._lock:
            if self.process is None:
                return None
            try:
                return self.process.stop(grace=grace)
            finally:
                if self.process.stopped:
                    self._remove_tmp_dir()

    def _remove_tmp_dir(self) -> None:
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            with contextlib.suppress(RuntimeError):  # a dead watchdog owns nothing any more
                get_watchdog(self.log_dir).disown(self.tmp_dir)
            self.tmp_dir = None

    def restart(self, grace: float = 10.0) -> None:
        """Stop (`grace` as in `stop`: 0 kills at once), then start again from the
        same spec (a new port unless the spec fixes one)."""
        self.stop(grace=grace)
        self.launch()
        self.wait_ready()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ views

    def _proc(self) -> ManagedProcess:
        if self.process is None:
            raise RuntimeError(f"server {self.spec.name!r} was never launched")
        return self.process

    @property
    def base_url(self) -> str:
        """`http://HOST:PORT` (no trailing slash; HOST: the spec's, 127.0.0.1 by default)."""
        return f"http://{format_address(self.spec.host, self.port)}"

    @property
    def pid(self) -> int:
        return self._proc().pid

    def signal(self, sig: int) -> None:
        """Send `sig` to every process of the server (SIGSTOP freezes it)."""
        self._proc().signal(sig)

    @property
    def pgid(self) -> int:
        return self._proc().pgid

    @property
    def running(self) -> bool:
        """True if launched, not stopped, and the leader has not exited."""
        p = self.process
        return p is not None and not p.stopped and p.returncode() is None

    def log_tail(self, lines: int = 80) -> str:
        return self._proc().log_tail(lines)

    def died_of_sigill(self) -> bool:
        """Whether a process of this server died of SIGILL, by its log: vLLM's
        engine logs a worker's exit code -4, Python's faulthandler the signal."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return False
        return any(mark in text for mark in SIGILL_MARKS)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<VLLMServer {self.spec.name} {self.base_url} {state}>"


def _healthy(http: httpx.Client, base_url: str) -> bool:
    try:
        return http.get(f"{base_url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def start_servers(specs: Sequence[ServerSpec], log_dir: Path) -> list[VLLMServer]:
    """Launch all `specs` at once, then wait for every one to be healthy.

    Either all are returned healthy, or all are stopped and the first error is raised.
    Names must be unique (they name the log files).
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"server names must be unique: {names}")
    servers: list[VLLMServer] = []
    try:
        for spec in specs:
            server = VLLMServer(spec, log_dir)
            servers.append(server)
            server.launch()
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop()
        raise
    return servers


@contextlib.contextmanager
def running(specs: Sequence[ServerSpec], log_dir: Path) -> Iterator[list[VLLMServer]]:
    """`start_servers` as a context manager that always stops them."""
    servers = start_servers(specs, log_dir)
    try:
        yield servers
    finally:
        errors = stop_servers(servers)
        if errors:
            raise errors[0][1]


def stop_servers(servers: Sequence[VLLMServer]) -> list[tuple[str, Exception]]:
    """Stop every server, each tried whatever the others did; the name of each
    that failed to stop, with why."""
    errors: list[tuple[str, Exception]] = []
    for server in servers:
        try:
            server.stop()
        except Exception as e:  # keep stopping the others
            errors.append((server.spec.name, e))
    return errors
