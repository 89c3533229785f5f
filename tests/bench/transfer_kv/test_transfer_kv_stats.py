"""`rapidkv bench transfer-kv`: its pure parts (metrics, sampling windows, the
cap, step lookups, the layer-0 offset, the report and the acceptance points).
Correctness only: no servers, nothing timed."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from rapidkv.bench.transfer_kv.dest import as_values, rel_diff
from rapidkv.bench.transfer_kv.noise import is_noisy, noisy_between
from rapidkv.bench.transfer_kv.run import Options
from rapidkv.bench.transfer_kv.stats import (
    MODES,
    STATES,
    DelaySampler,
    Sample,
    Step,
    acceptance,
    busy_step_ms,
    choose_cap,
    last_chunk_end,
    layer0_offsets,
    next_target,
    percentiles,
    ready_delays,
    sample_metrics,
    step_at,
    step_beginning_at,
    summarize_phase,
)

pytestmark = pytest.mark.unit

NAN = math.nan


def sample(
    mode: str = "bypass",
    state: str = "finished",
    arrival: float = 10.0,
    landed: list[list[float]] | None = None,
    last_byte: float | None = 10.004,
    events: dict[str, float] | None = None,
    **kw: Any,
) -> Sample:
    ev = {"admitted": 9.5, "last_chunk_begin": 9.8, "transfer_kv": arrival}
    ev.update(events or {})
    lce = ev.pop("last_chunk_end", 9.9)
    s = Sample(
        xfer_id=kw.pop("xfer_id", "x"),
        mode=mode,
        blocks=(1, 3),
        t_request=9.4,
        t_submit=arrival - 0.0002,
        state=state,
        events=ev,
        landed=landed if landed is not None else [[arrival + 0.001, arrival + 0.0012]] * 2,
        last_byte=last_byte,
        send_done_ok=True,
        reply_code="OK",
        written=True,
        last_chunk_end=lce,
    )
    for k, v in kw.items():
        setattr(s, k, v)
    return s


# ---------------------------------------------------------------- one sample


def test_metrics_are_ms_after_arrival_and_exposed_after_the_later_of_arrival_and_last_chunk():
    m = sample_metrics(sample())
    assert m is not None
    assert m["first_byte_ms"] == pytest.approx(1.0)
    assert m["last_byte_ms"] == pytest.approx(4.0)
    assert m["exposed_ms"] == pytest.approx(4.0)  # arrival after last_chunk_end
    # arrival during the last chunk: exposed counts from the end of that step
    m = sample_metrics(sample(state="last_chunk", events={"last_chunk_end": 10.003}))
    assert m is not None and m["exposed_ms"] == pytest.approx(1.0)
    assert m["last_byte_ms"] == pytest.approx(4.0)
    # confirmed before that step ended: fully hidden, nothing exposed
    m = sample_metrics(sample(state="last_chunk", events={"last_chunk_end": 10.006}))
    assert m is not None and m["exposed_ms"] == 0.0
    # without the end of the last chunk there is no exposed time: no metrics
    assert sample_metrics(sample(last_chunk_end=None)) is None


def test_last_chunk_end_is_ps_event_or_the_end_of_the_step_stamped_last_chunk_begin():
    assert last_chunk_end({"last_chunk_end": 1.5, "last_chunk_begin": 1.041}, STEPS) == 1.5
    assert last_chunk_end({"last_chunk_begin": 1.041}, STEPS) == 1.08
    assert last_chunk_end({"last_chunk_begin": 1.05}, STEPS) is None  # no such step
    assert last_chunk_end({}, STEPS) is None


def test_first_byte_is_the_earliest_landing_of_any_layer_and_block():
    s = sample(landed=[[10.003, NAN], [10.0015, 10.002]])
    assert s.first_byte == pytest.approx(10.0015)
    assert sample(landed=[[NAN, NAN]]).first_byte is None


@pytest.mark.parametrize(
    "change",
    [
        {"reply_code": "ERROR"},
        {"send_done_ok": False},
        {"written": False},
        {"last_byte": None},
        {"error": "P request failed"},
        {"landed": [[NAN, NAN]]},
    ],
)
def test_a_failed_sample_has_no_metrics(change: dict[str, Any]) -> None:
    s = sample()
    for k, v in change.items():
        setattr(s, k, v)
    assert not s.ok
    assert sample_metrics(s) is None


def test_a_sample_without_p_arrival_event_has_no_metrics():
    s = sample()
    del s.events["transfer_kv"]
    assert sample_metrics(s) is None


def test_sample_json_has_nulls_for_blocks_never_seen():
    row = sample(landed=[[10.001, NAN]]).to_json()
    assert row["landed"] == [[10.001, None]]
    assert row["metrics"]["first_byte_ms"] == pytest.approx(1.0)


# ---------------------------------------------------------------- percentiles, steps


def test_percentiles_interpolate_like_numpy_and_ignore_nan():
    xs = [float(x) for x in range(1, 101)] + [NAN]
    p = percentiles(xs)
    assert p["n"] == 100
    assert p["p50"] == pytest.approx(np.percentile(range(1, 101), 50))
    assert p["p99"] == pytest.approx(np.percentile(range(1, 101), 99))
    empty = percentiles([])
    assert empty["n"] == 0 and math.isnan(empty["p50"])


STEPS = [Step(1, 1.00, 1.04, 256), Step(2, 1.041, 1.08, 256), Step(3, 1.081, 1.082, 0)]


def test_step_at_finds_the_step_in_flight_or_none_between_steps():
    assert step_at(STEPS, 1.02).step_id == 1
    assert step_at(STEPS, 1.041).step_id == 2
    assert step_at(STEPS, 1.0405) is None  # between steps 1 and 2
    assert step_at(STEPS, 0.5) is None
    assert step_at(STEPS, 2.0) is None


def test_step_beginning_at_matches_ps_stamp():
    assert step_beginning_at(STEPS, 1.041).step_id == 2
    assert step_beginning_at(STEPS, 1.0415) is None


def test_busy_steps_are_those_begun_in_the_window_that_computed_tokens():
    assert busy_step_ms(STEPS, 1.0, 1.1) == pytest.approx([40.0, 39.0])
    assert busy_step_ms(STEPS, 1.01, 1.1) == pytest.approx([39.0])


def test_layer0_offset_comes_from_blocks_sent_layer_by_layer_in_step_mode():
    step = Step(7, 2.0, 2.04, 256)
    spread = [[2.003], [2.013], [2.023], [2.033]]  # one block, 4 layers over the step
    at_once = [[2.001], [2.001], [2.001], [2.001]]  # a full send: not a layer-0 time
    s1 = sample(mode="step", landed=spread)
    s1.blocks = (1,)
    s2 = sample(mode="step", landed=at_once)
    s2.blocks = (1,)
    s3 = sample(mode="substep", landed=spread)  # other modes do not count
    s3.blocks = (1,)
    assert layer0_offsets([s1, s2, s3], [step]) == pytest.approx([3.0])


def test_ready_delay_counts_from_the_later_of_arrival_and_the_first_layer():
    # step began at 9.990, first layer ready 5 ms later (9.995); arrival 9.992;
    # block 1 (an earlier chunk's) landed at 9.9935, block 3 (the last chunk's) at 9.9962
    landed = [[9.9935, 9.9962], [9.9936, 9.998]]
    s = sample(state="last_chunk", arrival=9.992, landed=landed, step_begin=9.990)
    d = ready_delays(s, 5.0)
    assert d["any_block"] == pytest.approx((-1.5, 1.5))
    assert d["last_block"] == pytest.approx((1.2, 4.2))
    # arrival after the first layer: both count from arrival
    s = sample(state="last_chunk", arrival=9.999, landed=[[9.9995]], step_begin=9.990)
    s.blocks = (1,)
    d = ready_delays(s, 5.0)
    assert d["any_block"] == pytest.approx((0.5, 0.5)) and d["last_block"] == d["any_block"]
    assert ready_delays(sample(step_begin=None), 5.0) is None


# ---------------------------------------------------------------- sampling


def test_sampler_is_uniform_over_1_5x_the_guess_before_it_has_seen_a_timeline():
    s = DelaySampler(guess_s=0.4, seed=1)
    assert s.window("last_chunk") == (0.0, pytest.approx(0.6))
    assert all(0 <= s.draw("finished") <= 0.6 for _ in range(100))


def test_sampler_windows_follow_the_median_timeline_of_ps_events():
    s = DelaySampler(guess_s=1.0, seed=1)
    for shift in (-0.01, 0.0, 0.01):
        events = {"admitted": 100.02 + shift, "last_chunk_begin": 100.3 + shift}
        s.observe(100.0, events, 100.35 + shift)
    assert s.prefill_s() == pytest.approx(0.35)
    # two step lengths (0.05 s each) before the last chunk
    assert s.window("earlier_chunk") == pytest.approx((0.2, 0.3))
    assert s.window("last_chunk") == pytest.approx((0.3, 0.35))
    assert s.window("finished") == pytest.approx((0.35, 0.45))
    early = DelaySampler(guess_s=1.0)
    early.observe(100.0, {"admitted": 100.25, "last_chunk_begin": 100.3}, 100.35)
    assert early.window("earlier_chunk") == pytest.approx((0.25, 0.3))  # not before admitted
    for state in STATES:
        lo, hi = s.window(state)
        assert all(lo <= s.draw(state) <= hi for _ in range(50))
    uniform = DelaySampler(guess_s=1.0, uniform=True)
    uniform.observe(100.0, {"admitted": 100.02, "last_chunk_begin": 100.3}, 100.4)
    assert uniform.window("last_chunk") == pytest.approx((0.0, 0.6))


def test_next_target_is_the_state_with_fewest_samples_short_of_the_goal():
    assert next_target({}, 3) == "finished"
    assert next_target({"finished": 3, "last_chunk": 1, "earlier_chunk": 2}, 3) == "last_chunk"
    assert next_target(dict.fromkeys(STATES, 3), 3) is None


# ---------------------------------------------------------------- cap, content


def test_cap_makes_a_full_transfer_take_the_given_fraction_of_a_step():
    cap = choose_cap(step_ms=40.0, request_bytes=5 << 20, fraction=0.25)
    wire_ms = (5 << 20) / (cap * 1e9) * 1000
    assert wire_ms == pytest.approx(10.0)
    with pytest.raises(ValueError):
        choose_cap(0.0, 1, 0.25)


def test_kv_bytes_decode_per_dtype_and_relative_difference():
    x = np.array([1.5, -2.0, 0.25], dtype=np.float32)
    assert as_values(x.view(np.uint8), "float32") == pytest.approx([1.5, -2.0, 0.25])
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)  # exact in bf16
    assert as_values(bf.view(np.uint8), "bfloat16") == pytest.approx([1.5, -2.0, 0.25])
    with pytest.raises(ValueError):
        as_values(x.view(np.uint8), "int8")
    ref = np.array([1.0, -4.0, 2.0])
    assert rel_diff(ref.copy(), ref) == 0.0
    assert rel_diff(ref + np.array([0, 0.04, 0]), ref) == pytest.approx(0.01)
    assert rel_diff(np.array([1.0, NAN, 2.0]), ref) == math.inf
    assert rel_diff(ref[:2], ref) == math.inf


# ---------------------------------------------------------------- report


def fake_phase(step_ms: float, cells: dict[tuple[str, str, str], tuple[float, float]]) -> dict:
    """A phase report with every cell NaN except `cells[(mode, state, metric)] = (p50, p99)`."""
    modes: dict[str, Any] = {}
    for m in MODES:
        modes[m] = {}
        for st in STATES:
            modes[m][st] = {}
            for k in ("first_byte_ms", "last_byte_ms", "exposed_ms"):
                p50, p99 = cells.get((m, st, k), (NAN, NAN))
                modes[m][st][k] = {"p50": p50, "p99": p99, "n": 20}
    return {"step_ms": {"p50": step_ms}, "modes": modes}


def test_acceptance_points_follow_the_issue():
    unc = fake_phase(
        40.0,
        {
            ("bypass", "finished", "first_byte_ms"): (0.5, 1.9),
            ("substep", "finished", "first_byte_ms"): (0.5, 2.5),  # over max(2, 2): miss
            ("step", "finished", "first_byte_ms"): (20.0, 39.0),
            ("step", "finished", "last_byte_ms"): (22.0, 41.0),
            ("bypass", "finished", "last_byte_ms"): (2.0, 3.0),
        },
    )
    cap = fake_phase(
        60.0,
        {
            ("substep", "last_chunk", "exposed_ms"): (4.0, 9.0),
            ("step", "last_chunk", "exposed_ms"): (16.0, 20.0),
        },
    )
    cap["last_chunk_first_byte_after_ready_ms"] = {
        "substep": {
            "any_block": {"estimated": {"p50": -0.5, "p99": 1.0, "n": 20}},
            "last_block": {"estimated": {"p50": 0.8, "p99": 3.5, "n": 20}},
        }
    }
    points = {p["point"]: p for p in acceptance({"uncapped": unc, "capped": cap})}
    ok = {k: p["ok"] for k, p in points.items()}
    assert ok["uncapped finished bypass: p99 arrival->first byte (ms)"] is True
    assert ok["uncapped finished substep: p99 arrival->first byte (ms)"] is False
    step_ratio = points["uncapped finished step: p50 arrival->first byte / step p50"]
    assert step_ratio["value"] == pytest.approx(0.5) and step_ratio["ok"] is True
    ratio = points["uncapped finished: p50 arrival->last byte, step / bypass"]
    assert ratio["value"] == pytest.approx(11.0) and ratio["ok"] is True
    assert points["capped last chunk: p50 exposed, substep / step"]["value"] == pytest.approx(0.25)
    ready = "capped last chunk substep: {} first byte ({}) after max(arrival, first layer) (ms)"
    assert ok[ready.format("p50", "any block")] is True
    assert ok[ready.format("p99", "any block")] is True
    assert ok[ready.format("p50", "last block")] is True  # <= max(2, 3)
    assert ok[ready.format("p99", "last block")] is False


def test_acceptance_of_an_empty_cell_is_not_measurable():
    unc = fake_phase(40.0, {})
    cap = fake_phase(40.0, {})
    empty = {"estimated": {"p50": NAN, "p99": NAN, "n": 0}}
    cap["last_chunk_first_byte_after_ready_ms"] = {
        "substep": {"any_block": empty, "last_block": empty}
    }
    assert all(p["ok"] is None for p in acceptance({"uncapped": unc, "capped": cap}))


def test_phase_summary_has_every_mode_and_state_and_counts_other_states_and_failures():
    samples = [
        sample(mode="step", state="finished"),
        sample(mode="bypass", state="last_chunk", events={"last_chunk_end": 10.002}),
        sample(mode="substep", state="between_steps"),
        sample(mode="substep", state="finished", reply_code="GONE", xfer_id="bad"),
    ]
    samples[0].content_rel_diff = 0.0
    samples[1].content_rel_diff = 1e-6
    out = summarize_phase(samples, STEPS, 0.0, 2.0)
    for mode in MODES:
        for state in STATES:
            for k in ("first_byte_ms", "last_byte_ms", "exposed_ms"):
                assert set(out["modes"][mode][state][k]) == {"p50", "p99", "n"}
    assert out["modes"]["step"]["finished"]["first_byte_ms"]["n"] == 1
    assert out["modes"]["bypass"]["last_chunk"]["exposed_ms"]["p50"] == pytest.approx(2.0)
    assert out["modes"]["substep"]["finished"]["first_byte_ms"]["n"] == 0  # failed
    assert out["other_states"] == {"substep": {"between_steps": 1}}
    assert out["checks"]["failed"] == 1 and out["checks"]["failed_xfers"][0].startswith("bad")
    assert out["checks"]["content_max_rel_diff"] == pytest.approx(1e-6)
    assert out["step_ms"]["n"] == 2


def test_last_chunk_blocks_sent_after_the_step_ended_are_counted():
    # block 3 (the last chunk's) landed 1 ms after that step ended: a later step sent it
    late = sample(
        mode="substep", state="last_chunk", landed=[[10.001, 10.006]], last_chunk_end=10.005
    )
    on_time = sample(
        mode="substep", state="last_chunk", landed=[[10.001, 10.002]], last_chunk_end=10.005
    )
    for s in (late, on_time):
        s.step_begin = 9.95
    out = summarize_phase([late, on_time], STEPS, 0.0, 2.0)
    ready = out["last_chunk_first_byte_after_ready_ms"]["substep"]
    assert ready["last_block_after_step_end"] == 1
    assert ready["last_block"]["estimated"]["n"] == 2


def test_noisy_samples_and_steps_are_left_out_of_the_figures_but_not_the_checks():
    quiet = sample(mode="bypass", state="finished")
    loud = sample(mode="bypass", state="finished", last_byte=10.5, noisy=True)
    loud.content_rel_diff = 0.25
    windows = [(1.0, 1.0405, {0: 0.5, 1: 0.0})]  # overlaps step 1 only
    out = summarize_phase([quiet, loud], STEPS, 0.0, 2.0, lambda a, b: noisy_between(windows, a, b))
    cell = out["modes"]["bypass"]["finished"]["last_byte_ms"]
    assert cell["n"] == 1 and cell["p50"] == pytest.approx(4.0)
    assert out["noisy_samples"] == 1 and out["samples"] == 2
    assert out["step_ms"]["n"] == 1  # step 2 only
    assert out["checks"]["content_max_rel_diff"] == 0.25


def test_a_window_is_noisy_above_a_fifth_of_a_core_on_any_core():
    assert not is_noisy({0: 0.2, 1: 0.1})
    assert is_noisy({0: 0.0, 1: 0.21})
    assert not is_noisy({})
    windows = [(0.0, 2.0, {0: 0.0}), (2.0, 4.0, {0: 0.9}), (4.0, 6.0, {0: 0.1})]
    assert not noisy_between(windows, 0.5, 1.9)
    assert noisy_between(windows, 1.9, 2.1)
    assert noisy_between(windows, 3.0, 3.5)
    assert not noisy_between(windows, 4.0, 5.0)  # touching the end is not overlapping


# ---------------------------------------------------------------- options, JSON


def test_options_and_strict_json():
    import argparse

    from rapidkv.bench.transfer_kv import register

    parser = argparse.ArgumentParser()
    register(parser)
    quick = Options.from_args(parser.parse_args(["--quick"]))
    assert quick.samples == 3 and quick.phases == ("uncapped", "capped")
    with pytest.raises(ValueError):
        Options.from_args(parser.parse_args(["--phases", "capped"]))  # no cap to derive from
    with pytest.raises(ValueError):
        Options.from_args(parser.parse_args(["--cap-fraction", "0.1"]))
    assert Options.from_args(parser.parse_args(["--phases", "capped", "--cap-gbps", "1"]))
