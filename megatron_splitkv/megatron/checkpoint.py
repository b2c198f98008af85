"""Checkpoint manifests for Megatron-format checkpoints (`megatron_splitkv.checkpoint` on Megatron's save/load).

`install_checkpoint_manifest(training, args)` wraps `training.save_checkpoint` and `training.load_checkpoint`
(the names `megatron.training.training` calls; pass that module): after a persistent save of iteration N
returns on every rank (Megatron's save ends with a barrier; one more is taken here), rank 0 writes
``args.save/iter_{N:07d}/manifest.json`` (size + SHA-256 of each file of the iteration); before a load from
`args.load`, rank 0 verifies the checkpoint Megatron will read (``--ckpt-step`` or the tracker's) and every rank
raises the same `CheckpointError` (one line naming the damaged file and the last complete checkpoint) when it is
damaged. Megatron writes its tracker before this manifest: a run killed between the two leaves a checkpoint that
the tracker names but that is refused (no manifest), with the previous complete one offered.

Not covered (a warning once at install): `--async-save` (the files are finished after save_checkpoint returns),
whose checkpoints are neither written with a manifest nor verified.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist

from ..checkpoint import CheckpointError, iteration_dir, resolve_checkpoint, write_manifest

__all__ = ["install_checkpoint_manifest", "CheckpointError"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _agree_on_error(message):
    """Rank 0's verdict (None or an error message) on every rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def install_checkpoint_manifest(training, args) -> bool:
    """Wrap `training.save_checkpoint` / `training.load_checkpoint` (see the module docstring). `args`: Megatron's
    namespace (save, load, ckpt_step, async_save). Returns whether the wrappers were installed (not with
    --async-save)."""
    if getattr(args, "async_save", False):
        warnings.warn("--async-save: checkpoints are written without a manifest and loaded unverified "
                      "(megatron_splitkv.megatron.checkpoint)", stacklevel=2)
        return False
    save, load = training.save_checkpoint, training.load_checkpoint

    def save_checkpoint(iteration, *a, **kw):
        out = save(iteration, *a, **kw)
        if not kw.get("non_persistent_ckpt", False) and getattr(args, "save", None):
            _barrier()  # every rank's files are on disk
            if _rank() == 0:
                write_manifest(iteration_dir(args.save, iteration))
            _barrier()
        return out

    def load_checkpoint(*a, **kw):
        root = getattr(args, kw.get("load_arg", "load"), None)
        if root:
            message = None
            if _rank() == 0:
                try:
                    resolve_checkpoint(root, getattr(args, "ckpt_step", None))
                except CheckpointError as exc:
                    message = f"--load {root}: {exc}"
            message = _agree_on_error(message)
            if message is not None:
                raise CheckpointError(message)
        return load(*a, **kw)

    training.save_checkpoint, training.load_checkpoint = save_checkpoint, load_checkpoint
    return True
