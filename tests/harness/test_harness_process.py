"""Unit tests of the harness's process handling, with dummy process trees (no vLLM)."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rapidkv.harness import (
    ManagedProcess,
    ServerSpec,
    free_port,
    procs,
    random_prompts,
    shm,
    wait_until,
)
from rapidkv.harness.ports import ephemeral_range, port_is_free
from rapidkv.harness.prompts import prompt_vocab
from rapidkv.harness.server import SRC_DIR, inductor_cache_dir
from rapidkv.harness.watchdog import GRACE_ENV, OWNER_ENV_PREFIX, _Reaper

pytestmark = pytest.mark.unit

# An idle process; argv[1] == "1" makes it ignore SIGTERM, argv[2] == "1" makes
# it leave its process group (setsid) first.
IDLE = """
import os, signal, sys
if sys.argv[2] == "1":
    os.setsid()
if sys.argv[1] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    signal.pause()
"""

# A process tree: the root (an IDLE) starts a child in its group and an
# "escaper" that leaves the group; argv[2] == "1" makes all three ignore SIGTERM.
# The root maps two files it made in /dev/shm (named in the pid file as "shm"),
# as vLLM's processes map their message queues, and never unlinks them, and
# the files named after argv[2] (made before it, 4096 bytes).
TREE = """
import json, mmap, os, signal, subprocess, sys
pidfile, ignore = sys.argv[1], sys.argv[2]
IDLE = __IDLE__
if ignore == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", IDLE, ignore, "0"])
escaper = subprocess.Popen([sys.executable, "-c", IDLE, ignore, "1"])
shm, maps = [f"/dev/shm/rapidkv-test-{os.getpid()}-{i}" for i in range(2)], []
for path in shm:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
for path in sys.argv[3:]:  # files made before the tree: mapped, not its own
    with open(path, "r+b") as f:
        maps.append(mmap.mmap(f.fileno(), 4096))
tmp = pidfile + ".tmp"
with open(tmp, "w") as f:
    json.dump({"root": os.getpid(), "child": child.pid, "escaper": escaper.pid, "shm": shm}, f)
os.rename(tmp, pidfile)
while True:
    signal.pause()
""".replace("__IDLE__", repr(IDLE))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
    return env


def _read_json_when_ready(path: Path, timeout: float = 30.0) -> dict:
    wait_until(path.exists, timeout, what=f"{path} to appear")
    return json.loads(path.read_text())


def _identities(pids: list[int]) -> list[tuple[int, int]]:
    out = []
    for pid in pids:
        st = procs.proc_stat(pid)
        assert st is not None and st.alive, f"pid {pid} should be running"
        out.append((pid, st.starttime))
    return out


def _kill_leftovers(idents: list[tuple[int, int]]) -> None:
    for pid, start in idents:
        if procs.is_alive(pid, start):
            os.kill(pid, signal.SIGKILL)


def _none_alive(idents: list[tuple[int, int]]) -> bool:
    return not any(procs.is_alive(pid, start) for pid, start in idents)


def test_free_port_is_bindable_fresh_and_outside_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert all(port_is_free(p) for p in ports)
    lo, hi = ephemeral_range()
    assert not any(lo <= p <= hi for p in ports), (lo, hi, ports)
    assert all(p >= 10000 for p in ports)


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(f) == (40000, 50000)
    assert ephemeral_range(tmp_path / "missing") == (32768, 60999)


def test_spec_command_line_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    spec = ServerSpec(
        model=tmp_path,
        role="prefill",
        cpus=(1,),
        kv_transfer_config={"kv_connector": "X", "kv_role": "kv_both"},
        extra_args=("--max-num-batched-tokens", "256"),
        env={"EXTRA": "1"},
    )
    argv = spec.argv(12345)
    assert argv[:3] == [argv[0], "-c", "1"] and argv[0].endswith("taskset")
    joined = " ".join(argv)
    for flag in (
        "-m vllm.entrypoints.openai.api_server",
        "--host 127.0.0.1",
        "--port 12345",
        "--enforce-eager",
        "--max-model-len 1024",
        "--max-num-seqs 8",
        "--kv-cache-memory-bytes 256M",
        "--seed 0",
        "--dtype float32",
    ):
        assert flag in joined
    cfg = argv[argv.index("--kv-transfer-config") + 1]
    assert json.loads(cfg) == {"kv_connector": "X", "kv_role": "kv_both"}
    assert argv[-2:] == ["--max-num-batched-tokens", "256"]
    env = spec.environment()
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(SRC_DIR)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["RAPIDKV_ROLE"] == "prefill" and env["EXTRA"] == "1"
    assert env["PYTHONFAULTHANDLER"] == "1"
    unpinned = spec.replace(cpus=None, dtype="bfloat16").argv(1)
    assert "taskset" not in unpinned[0] and "--dtype bfloat16" in " ".join(unpinned)


def test_servers_share_torch_inductors_cache_outside_their_own_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each launch's TMPDIR is its own, inductor's cache is not (else vLLM's
    logprob-rank kernel is rebuilt, ~15 s, on every fresh server's first
    request with logprobs); a cache directory already set, or the spec's, wins."""
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    spec = ServerSpec(model=tmp_path)
    assert spec.environment()["TORCHINDUCTOR_CACHE_DIR"] == inductor_cache_dir()
    assert inductor_cache_dir().startswith(os.path.join(tempfile.gettempdir(), "torchinductor_"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    assert spec.environment()["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"
    own = spec.replace(env={"TORCHINDUCTOR_CACHE_DIR": "/own"})
    assert own.environment()["TORCHINDUCTOR_CACHE_DIR"] == "/own"


@pytest.mark.parametrize(
    ("cpus", "ranks", "bind"),
    [
        ((1,), 1, "1"),
        ((0, 1), 1, "0,1"),
        ((0, 1), 2, "0|1"),
        ((0,), 2, "0|0"),
        ((0, 1, 2), 2, "0|1,2"),
        ((0, 1, 2, 3), 2, "0,1|2,3"),
        ((0, 1), 4, "0|1|0|1"),
    ],
)
def test_tensor_parallel_ranks_each_get_their_cores(
    tmp_path: Path, cpus: tuple[int, ...], ranks: int, bind: str
) -> None:
    """vLLM CPU wants one core list a rank, "|"-separated; taskset gets them all."""
    spec = ServerSpec(model=tmp_path, cpus=cpus, tensor_parallel_size=ranks)
    assert spec.environment()["VLLM_CPU_OMP_THREADS_BIND"] == bind
    argv = spec.argv(8000)
    assert argv[2] == ",".join(map(str, cpus))
    if ranks == 1:
        assert "--tensor-parallel-size" not in argv
    else:
        assert argv[argv.index("--tensor-parallel-size") + 1] == str(ranks)


def test_the_executor_comes_from_the_spec_then_the_environment_and_tp_is_always_mp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "uni" passes `--distributed-executor-backend uni` and turns vLLM's V1
    multiprocessing off (without which vLLM CPU runs "mp" anyway); "mp" passes
    neither (vLLM CPU's default). A spec's own choice beats the environment's;
    a TP spec ignores the environment and refuses "uni"; a bad name is refused."""
    from rapidkv.harness.server import EXECUTOR_ENV

    def runs(spec: ServerSpec) -> str:
        argv, env = spec.argv(8000), spec.environment()
        uni = "--distributed-executor-backend" in argv
        assert uni == (env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0")
        if uni:
            assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
        return "uni" if uni else "mp"

    monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    assert runs(ServerSpec(model=tmp_path)) == "mp"
    assert runs(ServerSpec(model=tmp_path, executor="uni")) == "uni"
    monkeypatch.setenv(EXECUTOR_ENV, "uni")
    assert runs(ServerSpec(model=tmp_path)) == "uni"
    assert runs(ServerSpec(model=tmp_path, executor="mp")) == "mp"
    assert runs(ServerSpec(model=tmp_path, tensor_parallel_size=2)) == "mp"
    with pytest.raises(ValueError, match="one rank"):
        ServerSpec(model=tmp_path, tensor_parallel_size=2, executor="uni").argv(8000)
    monkeypatch.setenv(EXECUTOR_ENV, "ray")
    with pytest.raises(ValueError, match=EXECUTOR_ENV):
        ServerSpec(model=tmp_path).argv(8000)


def test_a_spec_with_an_installed_rapidkvs_python_runs_vllm_off_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python`: that interpreter runs vLLM's API server, and neither the
    checkout's `src` nor an inherited PYTHONPATH reaches it: rapidkv is what
    that environment installed."""
    monkeypatch.setenv("PYTHONPATH", str(SRC_DIR))
    spec = ServerSpec(model=tmp_path, python="/opt/venv/bin/python", cpus=(0,))
    argv = spec.argv(8000)
    assert argv[argv.index("/opt/venv/bin/python") :][:5] == [
        "/opt/venv/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tmp_path),
    ]
    assert argv[argv.index("--port") + 1] == "8000"
    assert "PYTHONPATH" not in spec.environment()
    assert ServerSpec(model=tmp_path).environment()["PYTHONPATH"].startswith(str(SRC_DIR))


def test_a_server_process_killed_by_sigill_says_so_in_its_log(tmp_path: Path) -> None:
    """Any process of a server (vLLM's workers too: they inherit the
    environment) that dies of SIGILL leaves a line `died_of_sigill` knows,
    whether or not vLLM's engine reaped it before logging its exit code."""
    from rapidkv.harness.server import SIGILL_MARKS

    env = ServerSpec(model=tmp_path, role="decode").environment()
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
    out = subprocess.run([sys.executable, "-c", kill], env=env, capture_output=True, text=True)
    assert out.returncode == -signal.SIGILL
    assert any(mark in out.stderr for mark in SIGILL_MARKS), out.stderr


@pytest.mark.timeout(60)
def test_stop_kills_whole_tree_even_if_it_ignores_sigterm(tmp_path: Path) -> None:
    """And removes the files the tree made and left in /dev/shm, but one
    another process holds and one made before the tree."""
    shm_files: list[str] = []
    older = f"/dev/shm/rapidkv-test-{os.getpid()}-older"
    with open(older, "wb") as f:
        f.truncate(4096)
    time.sleep(0.1)  # made before the tree, by more than ctime's granularity
    pidfile = tmp_path / "pids.json"
    mp = ManagedProcess(
        [sys.executable, "-c", TREE, str(pidfile), "1", older],
        _env(),
        tmp_path / "tree.log",
        name="tree",
    )
    try:
        pids = _read_json_when_ready(pidfile)
        made, kept = shm_files = pids.pop("shm")
        idents = _identities(list(pids.values()))
        escaped = lambda: procs.proc_stat(pids["escaper"]).pgrp != mp.pgid  # noqa: E731
        wait_until(escaped, 10, what="the escaper to leave the group")
        assert set(mp.live_pids()) == set(pids.values())
        assert set(shm.held(mp.live_pids())) == {*shm_files, older}
        with open(kept, "r+b") as f, mmap.mmap(f.fileno(), 4096) as ours:
            rc = mp.stop(grace=0.5)
            assert rc == -signal.SIGKILL
            assert _none_alive(idents)
            assert mp.live_pids() == []
            assert mp.stop() == rc  # idempotent
            # the tree's file is gone; the one this process still maps is not
            assert not os.path.exists(made)
            assert os.path.exists(kept) and ours[:1] == b"\0"
            assert os.path.exists(older)
        assert "removed 1 file(s) it left in /dev/shm" in mp.log_tail()
    finally:
        mp.stop(grace=0.1)
        for path in [*shm_files, older]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_a_tree_killed_by_a_signal_leaves_no_shm_once_stopped(tmp_path: Path) -> None:
    """A test's SIGKILL through `signal` (the tree dies at once, its files
    held by nobody when `stop` comes): `stop` removes them all the same."""
    pidfile = tmp_path / "pids.json"
    mp = ManagedProcess(
        [sys.executable, "-c", TREE, str(pidfile), "0"], _env(), tmp_path / "tree.log", name="tree"
    )
    shm_files: list[str] = []
    try:
        shm_files = _read_json_when_ready(pidfile)["shm"]
        wait_until(lambda: set(shm.held(mp.live_pids())) == set(shm_files), 10, what="the maps")
        mp.signal(signal.SIGKILL)
        wait_until(lambda: not mp.live_pids() or mp.live_pids() == [mp.pid], 10, what="the kill")
        assert all(map(os.path.exists, shm_files))  # the kill leaves them
        mp.stop()
        assert not any(map(os.path.exists, shm_files))
    finally:
        mp.stop(grace=0.1)
        for path in shm_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


# Writes a file when it gets SIGTERM (as vLLM's API server starts a shutdown that
# answers in-flight requests), then goes on.
TERM_NOTED = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *a: open(sys.argv[1], "w").close())
open(sys.argv[1] + ".up", "w").close()
while True:
    signal.pause()
"""


@pytest.mark.timeout(60)
def test_stop_without_grace_kills_at_once_and_sends_no_sigterm(tmp_path: Path) -> None:
    """`stop(grace=0)` is a crash: SIGKILL only, so no shutdown handler runs."""
    noted = tmp_path / "sigterm"
    mp = ManagedProcess(
        [sys.executable, "-c", TERM_NOTED, str(noted)], _env(), tmp_path / "t.log", name="t"
    )
    try:
        wait_until((tmp_path / "sigterm.up").exists, 30, what="the process to start")
        assert mp.stop(grace=0) == -signal.SIGKILL
        assert not noted.exists()
    finally:
        mp.stop(grace=0.1)


@pytest.mark.timeout(60)
def test_returncode_does_not_reap_and_log_is_kept(tmp_path: Path) -> None:
    mp = ManagedProcess(
        [sys.executable, "-c", "print('hello from child'); raise SystemExit(3)"],
        _env(),
        tmp_path / "exit.log",
        name="exit3",
    )
    try:
        assert wait_until(lambda: mp.returncode() == 3, 30, what="exit 3")
        st = procs.proc_stat(mp.pid)
        assert st is not None and st.state == "Z"  # unreaped: the pgid stays ours
        assert mp.stop() == 3
        assert procs.proc_stat(mp.pid) is None
        assert "hello from child" in mp.log_tail()
    finally:
        mp.stop()


# Parent for the watchdog test: starts a tree through the harness and a
# stranger process outside it, gives the watchdog one directory to remove and
# one it takes back, reports pids, then idles until killed.
PARENT = r"""
import json, os, signal, subprocess, sys
from pathlib import Path
from rapidkv.harness import ManagedProcess, get_watchdog, wait_until
out, tree = Path(sys.argv[1]), sys.argv[2]
pidfile = out.parent / "tree-pids.json"
mp = ManagedProcess([sys.executable, "-c", tree, str(pidfile), "0"], dict(os.environ),
                    out.parent / "tree.log", name="tree")
owned, disowned = out.parent / "owned dir", out.parent / "disowned"
for d in (owned, disowned):
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "file").write_text("x")
    get_watchdog().own(d)
get_watchdog().disown(disowned)
wait_until(pidfile.exists, 30)
stranger = subprocess.Popen([sys.executable, "-c", "import signal\nwhile True: signal.pause()"],
                            start_new_session=True)
info = json.loads(pidfile.read_text())
info.update(stranger=stranger.pid, watchdog=get_watchdog().pid, pgid=mp.pgid,
            owned=str(owned), disowned=str(disowned))
out.with_suffix(".tmp").write_text(json.dumps(info))
os.rename(out.with_suffix(".tmp"), out)
while True:
    signal.pause()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_watchdog_kills_tree_when_parent_dies(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGKILL (no cleanup code runs) or SIGTERM (default action, none either)."""
    info_path = tmp_path / "info.json"
    env = _env()
    env[GRACE_ENV] = "2"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(info_path), TREE], env=env, start_new_session=True
    )
    stranger = None
    tree: list[tuple[int, int]] = []
    info: dict = {}
    try:
        info = _read_json_when_ready(info_path, 60)
        stranger = info["stranger"]
        tree = _identities([info["root"], info["child"], info["escaper"]])
        watchdog = _identities([info["watchdog"]])
        stranger_id = _identities([stranger])
        marks = [e for e in procs.environ(stranger) if e.startswith(OWNER_ENV_PREFIX.encode())]
        assert marks == []  # not started by a harness: must survive
        parent.send_signal(sig)
        parent.wait(10)
        wait_until(lambda: _none_alive(tree), 30, what="tree killed by the watchdog")
        wait_until(lambda: _none_alive(watchdog), 30, what="watchdog to exit")
        assert procs.live_in_group(info["pgid"]) == []
        assert not _none_alive(stranger_id), "the watchdog killed a process it did not own"
        assert not any(map(os.path.exists, info["shm"])), "the watchdog left the tree's /dev/shm"
        assert not Path(info["owned"]).exists(), "the watchdog left a directory it owned"
        assert (Path(info["disowned"]) / "sub" / "file").exists(), "it removed a disowned one"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if stranger is not None and procs.is_alive(stranger):
            os.kill(stranger, signal.SIGKILL)
        _kill_leftovers(tree)  # only if the test failed: never leak its processes
        for path in info.get("shm", []):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_watchdog_commands_are_validated_and_links_not_followed(tmp_path: Path) -> None:
    """Malformed lines change nothing; an owned symbolic link is not followed."""
    reaper = _Reaper("token", grace=1.0)
    for line in ["add 1\n", "add x 2\n", "del\n", "del -3\n", "own relative/dir\n", "own\n",
                 "disown\n", "kill 1\n", "\n"]:  # fmt: skip
        reaper.handle(line)
    assert reaper.groups == {} and reaper.dirs == set()
    spaced, target, link = tmp_path / "a b", tmp_path / "target", tmp_path / "link"
    for d in (spaced, target):
        d.mkdir()
        (d / "file").write_text("x")
    link.symlink_to(target)
    for line in ["add 5 7\n", "add 6 8\n", "del 6\n", f"own {spaced}\n", f"own {link}\n"]:
        reaper.handle(line)
    assert reaper.groups == {5: 7} and reaper.dirs == {str(spaced), str(link)}
    assert reaper.remove_dirs() == 1
    assert not spaced.exists() and (target / "file").exists() and link.is_symlink()
    assert reaper.dirs == set()


def test_random_prompts_are_deterministic_and_valid(tiny_model: Path) -> None:
    a = random_prompts(tiny_model, [5, 40, 300], seed=7)
    b = random_prompts(tiny_model, [5, 40, 300], seed=7)
    c = random_prompts(tiny_model, [5, 40, 300], seed=8)
    assert a == b and a != c
    assert [len(p) for p in a] == [5, 40, 300]
    config = json.loads((tiny_model / "config.json").read_text())
    vocab = set(prompt_vocab(tiny_model))
    specials = {config["bos_token_id"], config["eos_token_id"]}
    assert all(t in vocab and t not in specials for p in a for t in p)
    assert all(0 <= t < config["vocab_size"] for p in a for t in p)


def test_spec_in_a_network_namespace_runs_behind_ip_netns_exec(tmp_path: Path) -> None:
    """`netns`: `ip netns exec NS` first (it execs: the server keeps its pid and
    group), then taskset; `host` is what the server binds and its URL names."""
    spec = ServerSpec(model=tmp_path, cpus=(0,), netns="rapidkv-1-2-a", host="10.77.1.1")
    argv = spec.argv(8000)
    assert argv[0].endswith("/ip") and argv[1:4] == ["netns", "exec", "rapidkv-1-2-a"]
    assert argv[4].endswith("taskset") and argv[5:7] == ["-c", "0"]
    assert argv[argv.index("--host") + 1] == "10.77.1.1"
    from rapidkv.harness import VLLMServer

    server = VLLMServer(spec, tmp_path)
    server.port = 8000
    assert server.base_url == "http://10.77.1.1:8000"
    server6 = VLLMServer(spec.replace(host="::1"), tmp_path)
    server6.port = 8001
    assert server6.base_url == "http://[::1]:8001"
    assert spec.environment()["VLLM_HOST_IP"] == "10.77.1.1"
    plain = ServerSpec(model=tmp_path).argv(1)
    assert "netns" not in plain and plain[plain.index("--host") + 1] == "127.0.0.1"
    with pytest.raises(ValueError, match="namespace name"):
        spec.replace(netns="../x").argv(1)
