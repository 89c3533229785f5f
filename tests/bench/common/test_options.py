"""The options every served benchmark takes the same way."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from rapidkv.bench.common.options import (
    add_served_options,
    check_known,
    from_namespace,
    model_dtype,
    served_fields,
)


@dataclass(frozen=True)
class _Opts:
    seed: int
    timeout_s: float
    dtype: str
    server_args: tuple[str, ...]
    model: str = "tiny"
    dataset: str = "random"
    rounds: int = 1


@pytest.mark.unit
def test_fields_are_copied_by_name_computed_ones_win_and_defaults_stay() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=9.0)
    add_served_options(parser)
    args = parser.parse_args(["--dtype", "bf16", "--server-args=--x 1", "--model", "small"])
    opts = from_namespace(_Opts, args, timeout_s=args.timeout, **served_fields(args))
    assert opts == _Opts(3, 9.0, "bfloat16", ("--x", "1"), "small", "random", 1)
    assert set(vars(args)) >= {"json", "plot", "log_dir", "include_usage", "dataset"}


@pytest.mark.unit
def test_an_unknown_name_is_refused_naming_the_known_ones() -> None:
    check_known(["a", "b"], ["a", "b", "c"], "thing")
    with pytest.raises(ValueError, match=r"unknown thing 'd' \(known: a, b, c\)"):
        check_known(["a", "d"], ["a", "b", "c"], "thing")


@pytest.mark.unit
def test_without_dtype_each_model_is_served_in_its_own() -> None:
    parser = argparse.ArgumentParser()
    add_served_options(parser)
    for model, dtype in (("smollm2-135m", "bfloat16"), ("tiny", "float32"), ("/ckpt", "float32")):
        assert served_fields(parser.parse_args(["--model", model]))["dtype"] == dtype
    given = parser.parse_args(["--model", "smollm2-135m", "--dtype", "float32"])
    assert served_fields(given)["dtype"] == "float32"
    assert model_dtype("smollm2-135m", "bf16") == model_dtype("smollm2-135m", None) == "bfloat16"
