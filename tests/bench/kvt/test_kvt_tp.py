"""`rapidkv bench kvt --tp-from/--tp-to`: its options checked, and a smoke run
moving KV from P at TP 2 to D at TP 1 over NIXL, checked byte for byte by D."""

from __future__ import annotations

import json

import pytest
from bench_cli import run_bench

from rapidkv.bench.kvt.tp import KV_HEADS, layer_shape, rank_kvs
from rapidkv.cli import main
from rapidkv.kvt.head_map import rank_heads


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tp-from", "3"], "--tp-from 3 is not one of"),
        (["--tp-to", "16"], "--tp-to 16 is not one of"),
        (["--tp-from", "2", "--head-layouts", "hnd"], "unknown 'hnd'"),
        (["--tp-from", "2", "--head-layouts", ","], "names none"),
        (["--tp-from", "2", "--netns-link", "1gbit"], "does not combine"),
        (["--tp-to", "2", "--repeats", "0"], "--repeats must be at least 1"),
        (["--tp-to", "2", "--blocks", "0"], "--blocks must be at least 1"),
    ],
)
def test_bad_tp_options_exit_2_naming_the_problem(args, says, capsys) -> None:
    assert main(["bench", "kvt", *args]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["cpu", "nhd"])
def test_each_rank_holds_its_heads_of_the_one_model(kind: str) -> None:
    ranks = rank_kvs(kind, 2, fill=True, layers=2, blocks=3)
    ((whole, _),) = rank_kvs(kind, 1, fill=True, layers=2, blocks=3)
    head_dim = 1 + (1 if kind == "cpu" else 3)  # storage is [LAYERS, *layer]
    for r, (storage, layout) in enumerate(ranks):
        held = rank_heads(KV_HEADS, 2, r)
        assert list(storage.shape[1:]) == layer_shape(kind, len(held), blocks=3)
        assert (storage == whole.narrow(head_dim, held.start, len(held))).all()
        assert all(layer.heads is not None and layer.heads.rank == r for layer in layout.layers)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_kvt_tp_2_to_1_moves_every_head_and_reports_both_figures() -> None:
    proc, _ = run_bench(
        "kvt",
        "--tp-from",
        "2",
        "--tp-to",
        "1",
        "--repeats",
        "1",
        "--transports",
        "nixl",
        "--head-layouts",
        "cpu",
        "--blocks",
        "128",  # 256 MiB a side: every byte checked, in a quarter of the default's time
        "--json",
        timeout=380,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")))
    assert (result["mode"], result["tp_from"], result["tp_to"]) == ("tp", 2, 1)
    assert result["blocks"] == 128
    cpu = result["transports"]["nixl"]["cpu"]
    assert cpu["pairs"] == [[0, 0], [1, 0]]
    assert cpu["contiguous_gbps"] > 0 and cpu["tp_gbps"] > 0
    assert cpu["tp_segment_bytes"] == 32 * 1024  # half of each D block from each P rank
    assert cpu["contiguous_descriptors"] == 32  # one a layer: whole layers coalesced
