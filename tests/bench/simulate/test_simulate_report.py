"""`rapidkv bench simulate` from the command line: the JSON, the table, the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rapidkv.cli import main

pytestmark = pytest.mark.unit

SMALL = ["--requests", "20", "--refine", "1", "--workloads", "prefill-heavy"]


def run_cli(args: list[str]) -> int:
    return main(["bench", "simulate", *args])


def strip_router(report: dict) -> dict:
    """The report less what is not a function of the options (date, wall-clock timings)."""
    out = json.loads(json.dumps(report))
    out.pop("date")
    for w in out["workloads"].values():
        for size in w["sizes"].values():
            for s in size["policies"].values():
                for p in s["points"]:
                    p.pop("router")
    return out


def test_the_json_has_goodput_per_size_policy_and_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sim.json"
    argv = [*SMALL, "--sizes", "2,4", "--json", str(path), "--plot", str(tmp_path / "s.png")]
    assert run_cli(argv) == 0
    printed = capsys.readouterr().out
    assert "prefill-heavy: SLO TTFT" in printed and "fit check" in printed
    report = json.loads(path.read_text())
    assert report["bench"] == "simulate"
    assert report["options"]["sizes"] == [2, 4]
    assert report["fit"]["source"] == "defaults" and report["fit"]["warnings"] == []
    assert {r["config"] for r in report["fit_check"]} >= {"single", "dp2", "rapidkv"}
    w = report["workloads"]["prefill-heavy"]
    assert w["slo"]["tpot_ms"] == pytest.approx(1.5 * w["slo"]["single_c1_tpot_p50_ms"])
    assert set(w["sizes"]) == {"2", "4"}
    for n, size in w["sizes"].items():
        assert size["requests"] == max(400, 20 * int(n))
        assert set(size["policies"]) == {"dp", "fixed-pd", "adaptive"}
        for s in size["policies"].values():
            assert s["goodput_per_instance_req_s"] == pytest.approx(s["goodput_req_s"] / int(n))
            assert s["attainment"] and all(0 <= a <= 1 for a in s["attainment"].values())
            rates = [p["rate"] for p in s["points"]]
            assert [f"{r:g}" for r in rates] == list(s["attainment"])
            for p in s["points"]:
                assert set(p) >= {"ttft_ms", "tpot_ms", "placements", "misses", "router"}
                assert sum(p["placements"].values()) == size["requests"]
    assert len(report["summary"]) == 2 * 3
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_the_same_options_give_the_same_report(tmp_path: Path) -> None:
    reports = []
    for k in range(2):
        path = tmp_path / f"{k}.json"
        assert run_cli([*SMALL, "--sizes", "2", "--seed", "7", "--json", str(path)]) == 0
        reports.append(strip_router(json.loads(path.read_text())))
    assert reports[0] == reports[1]


def test_given_slos_replace_the_derived_ones(tmp_path: Path) -> None:
    path = tmp_path / "slo.json"
    args = [*SMALL, "--sizes", "2", "--policies", "dp", "--ttft-slo-ms", "150"]
    assert run_cli([*args, "--tpot-slo-ms", "9", "--json", str(path)]) == 0
    slo = json.loads(path.read_text())["workloads"]["prefill-heavy"]["slo"]
    assert (slo["ttft_ms"], slo["tpot_ms"]) == (150.0, 9.0)
    assert slo["source"].startswith("TTFT, TPOT from the options")


def test_compare_reads_a_goodput_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    real = {
        "workloads": {
            "prefill-heavy": {
                "slo": {"ttft_ms": 220.0, "tpot_ms": 8.1},
                "configs": {"dp2": {"goodput_req_s": 4.0, "attainment": {"2": 1.0, "4": 0.95}}},
            }
        }
    }
    src, out = tmp_path / "goodput.json", tmp_path / "cmp.json"
    src.write_text(json.dumps(real))
    assert run_cli(["--requests", "20", "--compare", str(src), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "every goodput's error within 15 %" in printed
    assert "every crossing's error within 15 %" in printed
    report = json.loads(out.read_text())
    assert report["workloads"] == {}  # --compare runs no sweep
    c = report["compare"]["workloads"]["prefill-heavy"]["configs"]["dp2"]
    assert c["measured"]["goodput_req_s"] == 4.0
    assert c["requests"] == 400


def test_compare_runs_the_engines_with_the_real_runs_slots(tmp_path: Path) -> None:
    """A run whose servers had ``--max-num-seqs 16`` is simulated with 16
    sequence slots an engine (8, the harness's, would queue what the real
    engines ran), unless --max-num-seqs says otherwise."""
    real = {
        "meta": {"server_args": ["--max-model-len", "1280", "--max-num-seqs", "16"]},
        "workloads": {
            "chat": {
                "slo": {"ttft_ms": 250.0, "tpot_ms": 18.0},
                "configs": {"dp2": {"attainment": {"2": 1.0}}},
            }
        },
    }
    src = tmp_path / "goodput.json"
    src.write_text(json.dumps(real))
    for extra, slots in (([], 16), (["--max-num-seqs", "4"], 4)):
        out = tmp_path / "cmp.json"
        args = ["--requests", "20", "--compare", str(src), *extra, "--json", str(out)]
        assert run_cli(args) == 0
        assert json.loads(out.read_text())["fit"]["max_num_seqs"] == slots
    del real["meta"]
    src.write_text(json.dumps(real))
    assert run_cli(["--requests", "20", "--compare", str(src), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["fit"]["max_num_seqs"] == 8


def test_a_fit_that_cannot_be_read_warns_and_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    path = tmp_path / "out.json"
    args = [*SMALL, "--sizes", "2", "--policies", "dp", "--fit", str(bad), "--json", str(path)]
    assert run_cli(args) == 0
    assert "warning: --fit" in capsys.readouterr().err
    assert json.loads(path.read_text())["fit"]["warnings"]


@pytest.mark.parametrize(
    "args",
    [
        ["--policies", "round-robin"],
        ["--workloads", "batch"],
        ["--sizes", "0"],
        ["--max-num-seqs", "0"],
    ],
)
def test_bad_options_are_refused(args: list[str]) -> None:
    with pytest.raises(SystemExit):
        run_cli(args)


def test_the_workloads_of_shared_prefixes_report_hits_and_fetches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "prefix.json"
    argv = ["--workloads", "shared-prefix,multiturn", "--sizes", "2", "--requests", "20"]
    argv += ["--refine", "0", "--tokenizer", "chars", "--cache-blocks", "200", "--json", str(path)]
    assert run_cli(argv) == 0
    printed = capsys.readouterr().out
    assert "prefix caches (200 blocks an instance)" in printed
    report = json.loads(path.read_text())
    assert report["options"]["policies"]["shared-prefix"] == [
        "dp",
        "adaptive-blind",
        "adaptive-nofetch",
        "adaptive",
    ]
    assert report["fit"]["prefix_cache_blocks"] == 200
    for name in ("shared-prefix", "multiturn"):
        w = report["workloads"][name]
        assert w["prefix_caching"] and w["cache_blocks"] == 200
        for s in w["sizes"]["2"]["policies"].values():
            for p in s["points"]:
                t = p["prefix_tokens"]
                assert 0 <= t["hit_fraction"] <= 1 and set(t["placed"]) == {
                    "hit",
                    "fetched",
                    "computed",
                }
    rows = [r for r in report["summary"] if r["workload"] == "multiturn"]
    assert len(rows) == 4 and all(r["hit_fraction"] is not None for r in rows)
    assert report["workloads"]["multiturn"]["sizes"]["2"]["requests"] == 400  # whole conversations


def test_cache_options_are_checked() -> None:
    for bad in (["--cache-blocks", "0"], ["--kv-cache-bytes", "lots"], ["--tokenizer", "/nope"]):
        with pytest.raises(SystemExit):
            run_cli([*SMALL, "--sizes", "2", *bad])
