"""Real numbers from flags and environment variables go through the package's strict parser
(`_ints.parse_float` / `float_arg`): a finite plain decimal within its limits, else an error naming the flag or
variable and the limit. Bare float() took "nan", "inf" and "1_0", so a NaN learning rate, bandwidth model or
RoPE base only showed as NaN results (or as Python's own error deep inside a run). The tools' subprocess cases are in tests/test_cli_errors.py."""

import importlib.util
import math
import os
import sys

import pytest
import torch
from _warning_marks import MEGATRON_ENV  # marks of the warnings megatron's parser triggers here

from megatron_splitkv._ints import float_arg, parse_float

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("text,want", [("0.5", 0.5), (" 2 ", 2.0), ("-1", -1.0), ("1e-3", 1e-3), (".5", 0.5),
                                       ("3.", 3.0), ("1E2", 100.0)])
def test_parse_float_accepts_plain_decimals(text, want):
    assert parse_float(text, "X") == want


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999", "1_0", "0x1p3", "", " ", ".",
                                  "e5", "1e", "\u0663", "1,5", "2 3", None])
def test_parse_float_rejects_non_finite_and_other_forms(text):
    with pytest.raises(ValueError) as exc:
        parse_float(text, "MY_VAR", minimum=0)
    assert str(exc.value) == f"MY_VAR must be a finite number >= 0, got {text!r}"


def test_parse_float_limits():
    assert parse_float("0", "X", minimum=0) == 0.0
    with pytest.raises(ValueError, match=r"^X must be a finite number > 0, got '0'$"):
        parse_float("0", "X", minimum=0, above=True)
    with pytest.raises(ValueError, match=r"^X must be a finite number >= 0 and <= 1, got '1.5'$"):
        parse_float("1.5", "X", minimum=0, maximum=1)
    with pytest.raises(ValueError, match=r"^X must be a rate, got 'nan'$"):
        parse_float("nan", "X", what="a rate")
    msg = str(pytest.raises(ValueError, parse_float, "9" * 5000, "X", maximum=1).value)
    assert msg.startswith("X must be a finite number <= 1, got '9999") and "(5000 characters)" in msg


def test_float_arg_is_an_argparse_error_naming_the_flag(capsys):
    import argparse

    ap = argparse.ArgumentParser(prog="tool")
    ap.add_argument("--lr", type=float_arg(0), default=1.0)
    assert ap.parse_args(["--lr", "0.25"]).lr == 0.25
    for bad in ("nan", "inf", "-1"):
        with pytest.raises(SystemExit) as e:
            ap.parse_args(["--lr", bad])
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == \
            f"tool: error: argument --lr: must be a finite number >= 0, got {bad!r}"


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv,flag", [(["--lr", "nan"], "--lr"), (["--lr", "-0.1"], "--lr"),
                                       (["--target-init-std", "inf"], "--target-init-std"),
                                       (["--loss-decay-gamma", "nan"], "--loss-decay-gamma"),
                                       (["--loss-decay-gamma", "0"], "--loss-decay-gamma")])
def test_train_demo_real_flags(argv, flag, capsys):
    from examples.train_demo import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and f"argument {flag}: must be a finite number" in capsys.readouterr().err
    args = parse_args(["--lr", "0.001", "--loss-decay-gamma", "7", "--target-init-std", "0.02"])
    assert (args.lr, args.loss_decay_gamma, args.target_init_std) == (0.001, 7.0, 0.02)


@pytest.mark.parametrize("argv,flag", [(["--gap", "nan"], "--gap"), (["--gap", "-1"], "--gap"),
                                       (["--switch-interval", "0"], "--switch-interval"),
                                       (["--switch-interval", "inf"], "--switch-interval")])
def test_pipeline_cost_real_flags(monkeypatch, capsys, argv, flag):
    """--gap nan was time.sleep's own ValueError per item; --switch-interval 0 was silently skipped."""
    mod = _load("tools/pipeline_cost.py", "pipeline_cost_flags")
    monkeypatch.setattr(sys, "argv", ["pipeline_cost.py", *argv])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 2 and f"argument {flag}: must be a finite number" in capsys.readouterr().err


def test_step_overhead_pg_timeout_env(monkeypatch):
    mod = _load("tools/step_overhead.py", "step_overhead_env")
    monkeypatch.delenv(mod.PG_TIMEOUT_ENV, raising=False)
    assert mod.pg_timeout_s() == 600.0
    monkeypatch.setenv(mod.PG_TIMEOUT_ENV, " 30 ")
    assert mod.pg_timeout_s() == 30.0
    for bad in ("nan", "inf", "0", "-5", "ten"):
        monkeypatch.setenv(mod.PG_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=rf"^STEP_OVERHEAD_PG_TIMEOUT_S must be a finite number > 0, got '{bad}'$"):
            mod.pg_timeout_s()


def test_loss_decay_gamma_flag_of_pretrain_dflash(monkeypatch, capsys):
    pytest.importorskip("megatron.core")
    mod = _load("examples/pretrain_dflash.py", "pretrain_dflash_gamma")
    base = ["--parse-only", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
            "--transformer-impl", "local", "--ffn-hidden-size", "128"]
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    for bad in ("nan", "inf", "0"):
        with pytest.raises(SystemExit) as e:
            mod.main([*base, "--loss-decay-gamma", bad])
        assert e.value.code == 2
        assert f"argument --loss-decay-gamma: must be a finite number > 0, got {bad!r}" in capsys.readouterr().err
    args = mod.main([*base, "--loss-decay-gamma", "3.5"])
    assert math.isclose(args.loss_decay_gamma, 3.5)


for _mark in MEGATRON_ENV:
    test_loss_decay_gamma_flag_of_pretrain_dflash = _mark(test_loss_decay_gamma_flag_of_pretrain_dflash)
