"""Checkpoint integrity: a manifest of every file of a checkpoint directory with its size and SHA-256,
written last and atomically; verified before a load.

Layout (Megatron's and the CPU demo's): ``ROOT/iter_{step:07d}/...`` and the tracker file
``ROOT/latest_checkpointed_iteration.txt`` holding the latest step (Megatron also writes "release").
`write_manifest(iter_dir)` is called once every file of the checkpoint is on disk (after the save's barrier),
before the tracker moves to it: ``iter_dir/manifest.json`` = {"format", "algorithm", "files": {relative path:
{"size", "sha256"}}}, written to a temporary name, fsynced and renamed, so a save killed at any point leaves
either no manifest (an incomplete checkpoint) or a complete one.

`resolve_checkpoint(root, step)` reads the tracker (or takes `step`), verifies the iteration directory
against its manifest and returns it; any damage raises `CheckpointError`, a ValueError whose message is
ONE line naming the file (flipped bytes, truncated, empty, missing, no manifest, a tracker that is not an
iteration number) and the last complete checkpoint in ROOT, if any, to load instead.

Pure Python (hashlib, json, os): no torch, no Megatron.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

__all__ = ["MANIFEST", "TRACKER", "CheckpointError", "write_manifest", "verify_manifest", "read_tracker",
           "iteration_dir", "complete_steps", "resolve_checkpoint"]

MANIFEST = "manifest.json"
TRACKER = "latest_checkpointed_iteration.txt"
_FORMAT = 1
_CHUNK = 1 << 22  # bytes hashed per read
_ITER = re.compile(r"iter_([0-9]{7,})")


class CheckpointError(ValueError):
    """A damaged or incomplete checkpoint; the message is one line naming the file."""


def iteration_dir(root: str, step: int) -> str:
    """``root/iter_{step:07d}`` (Megatron's name of a checkpoint's directory)."""
    return os.path.join(root, f"iter_{int(step):07d}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_temporary(name: str) -> bool:
    return ".tmp" in name  # the atomic writers' temporary names (this module's and train_demo's)


def _files(directory: str) -> list[str]:
    """Regular files under `directory` (relative paths, '/'-separated, sorted), without the manifest and
    temporary files."""
    out = []
    for base, dirs, names in os.walk(directory):
        dirs.sort()
        for n in names:
            rel = os.path.relpath(os.path.join(base, n), directory).replace(os.sep, "/")
            if rel != MANIFEST and not _is_temporary(n):
                out.append(rel)
    return sorted(out)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(directory: str, files=None) -> str:
    """Write ``directory/manifest.json`` with the size and SHA-256 of `files` (relative paths; default: every
    regular file under `directory` but temporary ones), atomically (temporary name, fsync, rename). Call it
    after every file of the checkpoint is written and before the tracker names it. Returns its path."""
    names = _files(directory) if files is None else sorted(files)
    entries = {}
    for rel in names:
        path = os.path.join(directory, rel)
        entries[rel] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    path = os.path.join(directory, MANIFEST)
    _atomic_write_text(path, json.dumps({"format": _FORMAT, "algorithm": "sha256", "files": entries}, indent=1))
    return path


def _read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (the save did not complete, or the checkpoint predates manifests)")
    try:
        with open(path) as f:
            man = json.load(f)
        files = man["files"]
        if man.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError
        for entry in files.values():
            int(entry["size"]), str(entry["sha256"])
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: not a checkpoint manifest (damaged)") from None
    return files


def verify_manifest(directory: str, *, checksums: bool = True) -> None:
    """Check every file listed in ``directory/manifest.json``: present, of its size and (checksums=True) of
    its SHA-256. Raises `CheckpointError` naming the first bad file: missing manifest, missing file, empty
    or truncated file (size), changed bytes (checksum)."""
    files = _read_manifest(directory)
    for rel, entry in sorted(files.items()):
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        size = os.path.getsize(path)
        if size != int(entry["size"]):
            what = "empty" if size == 0 else ("truncated" if size < int(entry["size"]) else "too long")
            raise CheckpointError(f"{path}: {what} ({size} bytes, {entry['size']} in {MANIFEST})")
    if checksums:
        for rel, entry in sorted(files.items()):
            path = os.path.join(directory, rel)
            if _sha256(path) != entry["sha256"]:
                raise CheckpointError(f"{path}: damaged (its SHA-256 differs from {MANIFEST}'s)")


def read_tracker(root: str):
    """The step named by ``root/latest_checkpointed_iteration.txt``: an int, "release" (Megatron's release
    checkpoint), or None when the file does not exist. Raises `CheckpointError` naming the file when it
    holds anything else."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            text = f.read(64).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        text = None
    if text == "release":
        return text
    if text is None or not re.fullmatch(r"[0-9]{1,12}", text):
        raise CheckpointError(f"{path}: not an iteration number (damaged; got {text!r})"
                              + _offer(root, None))
    return int(text)


def complete_steps(root: str) -> list[int]:
    """Steps of the iteration directories in `root` whose manifest exists and whose files have the listed
    sizes (no checksum: a cheap scan), ascending."""
    out = []
    if not os.path.isdir(root):
        return out
    for name in os.listdir(root):
        m = _ITER.fullmatch(name)
        if m is None:
            continue
        try:
            verify_manifest(os.path.join(root, name), checksums=False)
        except CheckpointError:
            continue
        out.append(int(m.group(1)))
    return sorted(out)


def _offer(root: str, bad_step) -> str:
    steps = [s for s in complete_steps(root) if s != bad_step]
    if not steps:
        return "; no complete checkpoint in this directory"
    return f"; the last complete checkpoint is step {steps[-1]} ({iteration_dir(root, steps[-1])})"


def resolve_checkpoint(root: str, step=None, *, checksums: bool = True):
    """The verified iteration directory to load from `root`: ``iter_{step}`` when `step` is given, else
    the one the tracker names; None when `step` is None and `root` has no tracker (no checkpoint: a fresh
    run, as in Megatron). Raises `CheckpointError` (one line naming the file, and the last complete
    checkpoint to load instead) for a garbage tracker, a missing iteration directory, a missing manifest
    or a damaged file."""
    if step is None:
        step = read_tracker(root)
        if step is None:
            return None
    directory = os.path.join(root, "release") if step == "release" else iteration_dir(root, step)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory" + _offer(root, step))
    try:
        verify_manifest(directory, checksums=checksums)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}{_offer(root, step)}") from None
    return directory
