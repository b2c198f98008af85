"""Export a trained DFlash drafter in the DFlash Hugging Face layout (z-lab dflash, SpecForge, SGLang, vLLM).

    python -m megatron_splitkv.export --load CKPT --out DIR [--step N] [--mask-token-id ID] ...

Reads a drafter checkpoint (the demo's `--save` directory, or Megatron's `--ckpt-format torch` of
examples/pretrain_dflash.py, TP shards gathered) and writes DIR/config.json and DIR/model.safetensors
(`megatron_splitkv.megatron.hf.export_checkpoint`, where the formats and the metadata are described). The
flags after --out replace or complete the metadata the checkpoint carries. A bad flag or checkpoint is one
error line naming it, exit status 2. From Python: `megatron_splitkv.megatron.hf.export_drafter(model, out,
...)` exports an in-memory model on any TP size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from ._ints import float_arg, int_arg, is_int_text, output_dir

MAX_BLOCK_SIZE = 1024  # --block-size: tokens of one draft block
MAX_LAYERS = 1024  # --num-target-layers
MAX_VOCAB = 1 << 24  # --vocab-size (16.7M rows; the largest vocabularies in use have ~260K)
MAX_ROPE_THETA = 1e12  # --rope-theta (Qwen3 uses 1e6)


def _ids(text: str):
    """`--target-layer-ids`: comma-separated distinct plain decimal ints in [0, MAX_LAYERS) ("1,9,17"); an empty
    item, a repeat, "+1" / "1_0" / "1.0" or a negative id is argparse's error naming the flag (a repeated id
    would write a wrong `target_layer_ids` into the exported config)."""
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not is_int_text(x) for x in items):
        raise argparse.ArgumentTypeError(f"must be comma-separated plain decimal layer ids, got {text!r}")
    ids = [int(x) for x in items]
    if min(ids) < 0 or max(ids) >= MAX_LAYERS:
        raise argparse.ArgumentTypeError(f"must be layer ids in [0, {MAX_LAYERS}), got {text!r}")
    if len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"must be distinct layer ids, got {text!r}")
    return ids


#: the files an export writes (`hf.save_dflash_hf`), complete or, after a killed export, partial
_EXPORT_FILES = {name + suffix for name in ("config.json", "model.safetensors") for suffix in ("", ".partial")}


def _previous_export(out: str) -> bool:
    """True when `out` holds a previous export (config.json of a DFlashDraftModel) or only the files of an
    export that was interrupted (no config.json yet): the export may overwrite it."""
    if set(os.listdir(out)) <= _EXPORT_FILES - {"config.json"}:
        return True
    try:
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and cfg.get("architectures") == ["DFlashDraftModel"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_splitkv.export", description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory (or one iteration directory of it)")
    p.add_argument("--out", required=True,
                   help="output directory (config.json, model.safetensors); it must be new, empty, or hold a "
                        "previous export (config.json of a DFlashDraftModel), which is overwritten")
    p.add_argument("--step", type=int_arg(0), default=None, help="iteration to export (default: the latest)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="tensor dtype written (default: the checkpoint's)")
    m = p.add_argument_group("metadata (default: what the checkpoint carries)")
    m.add_argument("--mask-token-id", type=int_arg(0, MAX_VOCAB - 1), default=None, help="< the vocabulary size")
    m.add_argument("--target-layer-ids", type=_ids, default=None, help="comma-separated 0-based target layer ids")
    m.add_argument("--num-target-layers", type=int_arg(1, MAX_LAYERS), default=None)
    m.add_argument("--block-size", type=int_arg(2, MAX_BLOCK_SIZE), default=None)
    m.add_argument("--vocab-size", type=int_arg(1, MAX_VOCAB), default=None)
    m.add_argument("--rope-theta", type=float_arg(0, MAX_ROPE_THETA, above=True), default=None)
    args = p.parse_args(argv)
    if args.mask_token_id is not None and args.vocab_size is not None and args.mask_token_id >= args.vocab_size:
        p.error(f"argument --mask-token-id: must be < --vocab-size {args.vocab_size}, got {args.mask_token_id}")
    if args.target_layer_ids is not None and args.num_target_layers is not None \
            and max(args.target_layer_ids) >= args.num_target_layers:
        p.error(f"argument --target-layer-ids: must be < --num-target-layers {args.num_target_layers}, "
                f"got {args.target_layer_ids}")
    if os.path.exists(args.out):
        if not os.path.isdir(args.out):
            p.error(f"argument --out: {args.out} is an existing file, not a directory")
        if os.listdir(args.out) and not _previous_export(args.out):
            p.error(f"argument --out: {args.out} is not empty and holds no previous export (config.json of a "
                    "DFlashDraftModel); choose a new directory")
    try:  # a path under a file or not writable: the flag's error line, not makedirs' traceback; nothing created
        output_dir(args.out)
    except argparse.ArgumentTypeError as exc:
        p.error(f"argument --out: {exc}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from .megatron.hf import HFCheckpointError, export_checkpoint  # noqa: PLC0415 - optional: megatron-core

    meta = {k: getattr(args, k) for k in ("mask_token_id", "target_layer_ids", "num_target_layers", "block_size",
                                          "vocab_size", "rope_theta") if getattr(args, k) is not None}
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        cfg = export_checkpoint(args.load, args.out, step=args.step, meta=meta, dtype=dtype)
    except HFCheckpointError as exc:
        print(f"python -m megatron_splitkv.export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: DFlashDraftModel, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"block size {cfg['block_size']}, target_layer_ids {cfg['dflash_config']['target_layer_ids']}, "
          f"mask token {cfg['dflash_config']['mask_token_id']}"
          + (f", layer types {','.join(cfg['layer_types'])} (sliding window {cfg['sliding_window']})"
             if cfg.get("use_sliding_window") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
