"""DFlash drafter training end to end on CPU: a Hugging Face target in, a DFlash drafter out, tau measured.

    python examples/train_demo.py                    # CP=2 over gloo, 30 steps, a few minutes on 2 cores

What runs (DESIGN.md sections 1-3 and 6; arXiv 2611.05926):
0. The target: a tiny Qwen3 made with transformers and briefly trained on the same ShareGPT conversations
   (`examples/demo_target.py`), saved in Hugging Face format to OUT_DIR/target-hf (default
   out/demo) with its compact vocabulary (`token_map.json`) and made once: reused while its fingerprint
   matches. `--target-hf-path DIR` takes any Qwen3 directory instead; `--random-target` a random Megatron
   target (no round trip).
1. ShareGPT conversations (Qwen chat template, loss on assistant tokens) packed into batches of
   `--max-tokens` tokens; `--num-anchors` DFlash anchors sampled per sequence
   (`megatron_splitkv.data.ShareGPTLoader`).
2. The LPT planner (`megatron_splitkv.planning.plan_context_parallel`) assigns context chunks to the CP
   ranks; `shard_batch` gives each rank its tokens with global positions and an equal share of the query
   blocks.
3. The frozen target, imported through `megatron_splitkv.megatron.hf.load_hf_target` into a Megatron-Core
   `GPTModel`, computes the tapped hidden states of each rank's context tokens, exactly causal under the
   permuted layout.
4. The DFlash drafter (fc + RMSNorm fusion, DFlash layers with Split-KV attention, frozen target
   embedding / LM head) computes the decayed loss normalised over the CP group; gradients of the
   replicated parameters are summed over the group; AdamW step.
5. The drafter is exported in the DFlash Hugging Face layout (`megatron_splitkv.megatron.hf.export_drafter`)
   before training (OUT_DIR/drafter-hf-init) and after (OUT_DIR/drafter-hf), and the official DFlash
   inference code measures the acceptance length tau of both on held-out ShareGPT prompts
   (`megatron_splitkv.acceptance`; OUT_DIR/tau.json, tau.png).

With the random target the vocabulary is compacted to the token ids that occur in the loaded conversations
(a bijection, so the data is unchanged) plus one MASK row, as the demo target's `token_map.json` does.
Progress: tqdm on rank 0 with the loss of every step; a closing summary with first/last loss, tokens/s,
planner imbalance and bytes moved per rank by the attention collectives (`megatron_splitkv.comm_stats`),
then the held-out tau of the untrained and the trained drafter.

Checkpoints (Megatron-like flags): `--save DIR` writes ``DIR/iter_0000NNN/`` every `--save-interval`
steps and at the end, then ``DIR/latest_checkpointed_iteration.txt``; `--load DIR` resumes from the
latest one (or `--ckpt-step N`) and continues the same loss curve: rank 0 writes ``common.pt`` (the
drafter's trainable parameters, AdamW state, step, data position = epoch + next batch index, the
checked config), every rank ``rng_rank{r}.pt`` (torch / numpy / python RNG states); each file is written
to a temporary name and renamed; ``manifest.json`` (size and SHA-256 of each file,
`megatron_splitkv.checkpoint`) is written last, before the tracker. `--load` verifies it first: a damaged,
truncated, empty or missing file, or a garbage tracker, is one error line naming the file and the last
complete checkpoint (exit status 2). A non-finite loss or gradient stops the run before the optimizer step
(`NonFiniteLossError`, exit status 2). A checkpoint whose config differs (`--cp`, model sizes, data, seed,
lr, loss decay) raises `CheckpointMismatchError` naming the flag; a `--load` directory without a checkpoint starts
from scratch with a warning, as in Megatron.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository: its package, tools

from megatron_splitkv.checkpoint import (MANIFEST, TRACKER, CheckpointError, iteration_dir,  # noqa: E402
                                         resolve_checkpoint, write_manifest)

#: the largest --cp: the demo runs one gloo process per CP rank on the CPU
MAX_CP = 16
#: the fewest steps of a run from step 1 whose loss trend the exit status judges: the means of its first and last
#: 3 steps (`_trend_window`); over fewer steps the per-batch noise of the loss decides the sign
MIN_JUDGED_STEPS = 10


def parse_args(argv=None):
    """The demo's command line, validated here (argparse types and ranges, and the sizes the model and the
    data loader accept): a bad flag is argparse's one error line naming it and its limit, exit status 2."""
    # strict ints; finite reals (float() takes "nan"); --save created at parse time
    from megatron_splitkv._ints import DefaultsHelpFormatter, float_arg, int_arg, writable_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    add_round_trip_args(p)
    p.add_argument("--steps", type=int_arg(1), default=30, help="training steps (the last step's number)")
    p.add_argument("--cp", type=int_arg(1, MAX_CP), default=2,
                   help=f"context-parallel size = number of gloo processes on this CPU (at most {MAX_CP})")
    p.add_argument("--context-parallel-impl", default="splitkv", choices=("splitkv", "allgather-kv", "ring-kv"),
                   help="the drafter's context-parallel attention")
    p.add_argument("--cp-balance", default="lpt", choices=("lpt", "contiguous", "zigzag"),
                   help="planner strategy")
    p.add_argument("--max-tokens", type=int_arg(2), default=4096, help="tokens per packed batch")
    p.add_argument("--num-anchors", type=int_arg(1), default=16, help="anchors (query blocks) per sequence")
    p.add_argument("--block-size", type=int_arg(2), default=16, help="DFlash block size B (anchor + B-1 predicted)")
    p.add_argument("--loss-decay-gamma", type=float_arg(0, above=True), default=None,
                   help="loss weight exp(-(k-1)/gamma) per offset k (default: 7 for B=16, scaled with B)")
    p.add_argument("--limit", type=int_arg(1), default=400, help="ShareGPT conversations to load")
    p.add_argument("--hidden", type=int_arg(16), default=128, help="hidden size (target and drafter)")
    p.add_argument("--target-layers", type=int_arg(1), default=6, help="layers of the random frozen target")
    p.add_argument("--draft-layers", type=int_arg(1), default=2, help="drafter layers")
    p.add_argument("--target-init-std", type=float_arg(0), default=0.1, help="random target's init std")
    p.add_argument("--lr", type=float_arg(0), default=1e-2, help="AdamW learning rate")
    p.add_argument("--seed", type=int_arg(0, 2**32 - 1), default=0, help="data, target and drafter seed")
    p.add_argument("--threads", type=int_arg(1), default=1, help="torch threads per process")
    p.add_argument("--save", type=writable_dir, default=None, help="checkpoint directory to write")
    p.add_argument("--save-interval", type=int_arg(1), default=None,
                   help="save every N steps (needs --save; a final checkpoint is always written)")
    p.add_argument("--load", type=str, default=None, help="checkpoint directory to resume from")
    p.add_argument("--ckpt-step", type=int_arg(0), default=None,
                   help="step of the checkpoint to load (default: the latest in --load)")
    args = p.parse_args(argv)
    _check_flag_combinations(p, args)
    return args


# ----------------------------------------------------------------------------------------------- round trip
DEMO_OUT = os.path.join("out", "demo")


def add_round_trip_args(p):
    """The flags of the Hugging Face round trip: target in, drafter out, tau measured."""
    from megatron_splitkv._ints import hf_model_dir, int_arg, output_dir

    g = p.add_argument_group("round trip (Hugging Face target in, DFlash drafter out, acceptance length)")
    t = g.add_mutually_exclusive_group()
    t.add_argument("--target-hf-path", type=hf_model_dir, default=None,
                   help="Hugging Face Qwen3 target directory, imported with megatron_splitkv.megatron.hf "
                        "(default: the demo target, made once in OUT_DIR/target-hf and reused)")
    t.add_argument("--random-target", action="store_true",
                   help="a random Megatron target instead (--target-init-std); no export, no tau")
    g.add_argument("--out-dir", type=output_dir, default=DEMO_OUT, help=f"where the round trip writes (default {DEMO_OUT})")
    g.add_argument("--mask-token-id", type=int_arg(0), default=None,
                   help="MASK token id for a target without token_map.json (a compact target has its own)")
    g.add_argument("--target-train-steps", type=int_arg(0, 100000), default=300,
                   help="training steps of the demo target on the --limit conversations (default 300)")
    g.add_argument("--eval-prompts", type=int_arg(0, 64), default=16,
                   help="held-out ShareGPT prompts for tau (default 16; 0: no evaluation)")
    g.add_argument("--eval-new-tokens", type=int_arg(1, 4096), default=64,
                   help="greedy tokens generated per prompt for tau (default 64)")
    g.add_argument("--no-regenerate", dest="regenerate", action="store_false",
                   help="train the drafter on ShareGPT's own assistant text instead of the target's regenerated "
                        "responses (default: regenerate, megatron_splitkv.data.regenerate)")
    g.add_argument("--regen-new-tokens", type=int_arg(1, 4096), default=64,
                   help="greedy response tokens the target writes per training conversation (default 64)")
    g.add_argument("--regen-prompt-tokens", type=int_arg(1, 1 << 20), default=256,
                   help="prompt tokens kept (the last ones) when regenerating (default 256)")


def demo_target_spec(args):
    """The `DemoTargetSpec` the demo's flags describe (--limit, --hidden, --target-layers, --seed,
    --max-tokens, --target-train-steps; the demo target's init std is Qwen3's 0.02)."""
    from examples.demo_target import DemoTargetSpec

    return DemoTargetSpec(limit=args.limit, hidden=args.hidden, num_layers=args.target_layers,
                          steps=args.target_train_steps, max_positions=max(4096, args.max_tokens), seed=args.seed)


def prepare_target(args, log=print) -> None:
    """Before the ranks start: unless --random-target or --target-hf-path, make (or reuse) the demo target
    in OUT_DIR/target-hf and set `args.target_hf_path` to it; then check the target against the flags
    (`map_corpus`, `check_hf_target`), so that a bad target fails here with its message."""
    if args.random_target:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the demo prints its own lines (weights loading / writing bars off)
    if args.target_hf_path is None:
        from examples.demo_target import ensure_demo_target

        path = os.path.join(args.out_dir, "target-hf")
        t0 = time.time()
        meta, made = ensure_demo_target(demo_target_spec(args), path, threads=args.threads,
                                        log=log)
        what = f"made in {time.time() - t0:.0f} s" if made else "reused (fingerprint matches)"
        log(f"demo target {path}: {what}; {meta['vocab_ids']} Qwen ids + MASK, training loss "
            f"{meta['loss_first']:.2f} -> {meta['loss_last']:.2f}, greedy distinct tokens of 32: "
            f"{meta['greedy_distinct_tokens_of_32']}")
        args.target_hf_path = path
    if args.regenerate:
        regenerate_responses(args, log=log)
    _, _, ids_used = map_corpus(args, training_corpus(args))
    check_hf_target(args, ids_used=ids_used)


def regenerate_responses(args, log=print):
    """The target's greedy responses to the --limit conversations' prompts (`data.regenerate`, at most
    --regen-new-tokens each), made once into OUT_DIR/regenerated.npz and reused while the target and the
    settings match; sets `args.train_corpus_path` to it."""
    from megatron_splitkv.data.regenerate import RegenerateSpec, ensure_regenerated

    path = os.path.join(args.out_dir, "regenerated.npz")
    spec = RegenerateSpec(limit=args.limit, max_new_tokens=args.regen_new_tokens,
                          max_prompt_tokens=args.regen_prompt_tokens)
    t0 = time.time()
    _, meta, made = ensure_regenerated(args.target_hf_path, spec, path, threads=args.threads, log=log)
    what = f"made in {time.time() - t0:.0f} s" if made else "reused (fingerprint matches)"
    log(f"regenerated responses {path}: {what}; {meta['conversations']} conversations, mean response "
        f"{meta['mean_response_tokens']:.1f} tokens ({meta['stopped_share']:.0%} stopped), "
        f"{meta['distinct_response_tokens']} distinct response tokens")
    args.train_corpus_path = path


def training_corpus(args):
    """The drafter's training conversations (tokenizer ids): the regenerated corpus at
    `args.train_corpus_path` when set (`regenerate_responses`), else the first --limit ShareGPT
    conversations with their own assistant text (`load_sharegpt`)."""
    import numpy as np

    from megatron_splitkv.data.sharegpt import TokenizedCorpus, load_sharegpt

    path = getattr(args, "train_corpus_path", None)
    if path is None:
        return load_sharegpt(args.limit)
    with np.load(path) as z:
        return TokenizedCorpus(z["tokens"], z["loss_mask"], z["offsets"])


def target_vocab(args):
    """(`CompactVocab` of --target-hf-path's ``token_map.json``, MASK id = its MASK row), or (None,
    --mask-token-id) for a target with Qwen's ids. Raises `HFCheckpointError` when neither names MASK."""
    from megatron_splitkv.data.vocab import TOKEN_MAP_FILE, CompactVocab
    from megatron_splitkv.megatron.hf import HFCheckpointError

    vocab = CompactVocab.load(args.target_hf_path)
    if vocab is not None:
        return vocab, vocab.mask_token_id
    if args.mask_token_id is None:
        raise HFCheckpointError(f"{args.target_hf_path}: no {TOKEN_MAP_FILE}, so the target uses Qwen's ids: pass "
                                "--mask-token-id (an unused row of its embedding)")
    return None, args.mask_token_id


def map_corpus(args, corpus):
    """The corpus in the Hugging Face target's vocabulary (`target_vocab`). Returns (corpus, mask id, ids
    used). Raises `HFCheckpointError` naming ``token_map.json`` for ids outside the map."""
    from megatron_splitkv.data.vocab import TOKEN_MAP_FILE
    from megatron_splitkv.megatron.hf import HFCheckpointError

    vocab, mask_id = target_vocab(args)
    if vocab is None:
        return corpus, mask_id, int(corpus.tokens.max()) + 1
    try:
        tokens = vocab.encode(corpus.tokens, f"{os.path.join(args.target_hf_path, TOKEN_MAP_FILE)}: the --limit "
                                             f"{args.limit} conversations")
    except ValueError as exc:
        raise HFCheckpointError(str(exc)) from None
    return type(corpus)(tokens, corpus.loss_mask, corpus.offsets), mask_id, len(vocab)


def check_hf_target(args, ids_used=None):
    """config.json of --target-hf-path against the flags (`megatron.hf.read_qwen3_config`: Qwen3, the
    mask row, hidden size = --hidden), num_hidden_layers = --target-layers and, with `ids_used` (the data's
    largest token id + 1 in the target's ids, `map_corpus`), vocab_size >= ids_used. Raises
    `HFCheckpointError` naming the field."""
    from megatron_splitkv.megatron.hf import HFCheckpointError, read_qwen3_config

    _, mask_id = target_vocab(args)
    hf = read_qwen3_config(args.target_hf_path, mask_token_id=mask_id, drafter_hidden_size=args.hidden)
    where = os.path.join(args.target_hf_path, "config.json")
    if hf["num_hidden_layers"] != args.target_layers:
        raise HFCheckpointError(f"{where}: field num_hidden_layers = {hf['num_hidden_layers']}, but --target-layers "
                                f"{args.target_layers}; pass --target-layers {hf['num_hidden_layers']}")
    if ids_used is not None and ids_used > hf["vocab_size"]:
        raise HFCheckpointError(f"{where}: field vocab_size = {hf['vocab_size']}, but the --limit {args.limit} "
                                f"conversations use token ids up to {ids_used - 1} (largest id); use a target "
                                "with Qwen's vocabulary or one with a token_map.json")
    return hf


def build_target_and_vocab(args, corpus, pgs):
    """The frozen target and the data in its vocabulary. With `args.target_hf_path`: the Hugging Face
    Qwen3 target through `megatron.hf.load_hf_target` and `map_corpus`; else a random `build_target_model`
    (--target-init-std) over the compacted corpus. Returns (target GPTModel, corpus, mask id, ids used)."""
    from megatron_splitkv.models import build_target_model, qwen3_config

    if args.target_hf_path is None:
        corpus, v_used = _compact_corpus(corpus)
        H, heads = args.hidden, max(2, args.hidden // 16)
        tcfg = qwen3_config(num_layers=args.target_layers, hidden_size=H, num_attention_heads=heads,
                            num_query_groups=max(1, heads // 2), kv_channels=16, ffn_hidden_size=2 * H,
                            init_method_std=args.target_init_std)
        target = build_target_model(tcfg, vocab_size=(v_used + 1 + 63) // 64 * 64,
                                    max_sequence_length=args.max_tokens, pg_collection=pgs, seed=args.seed)
        return target, corpus, v_used, v_used
    from megatron_splitkv.megatron.hf import load_hf_target

    check_hf_target(args)
    corpus, mask_id, used = map_corpus(args, corpus)
    target = load_hf_target(args.target_hf_path, pg_collection=pgs, mask_token_id=mask_id,
                            drafter_hidden_size=args.hidden, max_sequence_length=args.max_tokens)
    return target, corpus, mask_id, used


def export_kwargs(args, taps, vocab_rows):
    """The keyword arguments of `megatron.hf.export_drafter` / `drafter_export_meta` for this run: the taps,
    the target's layer count, `vocab_rows` (the target's embedding rows) and the position limit. The
    in-memory export and the checkpoint's export metadata both use them, so the two exports agree."""
    return dict(target_layer_ids=list(taps), num_target_layers=args.target_layers, vocab_size=int(vocab_rows),
                max_position_embeddings=max(4096, args.max_tokens))


def export_round_trip(drafter, args, export_kw, name, rank):
    """Write the drafter to OUT_DIR/`name` in the DFlash Hugging Face layout (`megatron.hf.export_drafter`
    with `export_kw` from `export_kwargs`; collective over TP, rank 0 writes). Returns the directory, or None
    without a Hugging Face target."""
    if args.target_hf_path is None:
        return None
    from megatron_splitkv.megatron.hf import export_drafter

    d = os.path.join(args.out_dir, name)
    export_drafter(drafter, d if rank == 0 else None, **export_kw)
    return d


def report_round_trip(args, hist, t0, log=print):
    """The closing lines of a run with a Hugging Face target: tau of the untrained vs the trained drafter
    (`evaluate_round_trip`) and the directories the run leaves."""
    if hist.get("drafter_hf") is None:
        return
    log("")
    taus = evaluate_round_trip(args, log=log)
    if taus:
        log(f"held-out tau (B = {args.block_size}): untrained drafter {taus['untrained']:.3f} -> trained "
            f"{taus['trained']:.3f} after {args.steps} steps at CP={args.cp}")
    log(f"left: {args.target_hf_path} (Hugging Face Qwen3 target + token_map.json), {hist['drafter_hf']} (the "
        f"trained DFlash drafter, Hugging Face layout); serve or evaluate them with tools/eval_acceptance.py")
    log(f"wall time {time.time() - t0:.0f} s")


def evaluate_round_trip(args, log=print):
    """After training: tau of the untrained and the trained drafter (OUT_DIR/drafter-hf-init,
    OUT_DIR/drafter-hf) on --eval-prompts held-out ShareGPT prompts; writes OUT_DIR/tau.json and tau.png.
    Returns {label: mean tau} ({} with --eval-prompts 0 or without a Hugging Face target)."""
    if args.target_hf_path is None or args.eval_prompts == 0:
        return {}
    import torch

    from megatron_splitkv.acceptance import (HELDOUT_FIRST_RECORD, evaluate_acceptance, format_report, heldout_prompts, load_pair,
                             write_report)

    torch.set_num_threads(args.threads)
    prompts = heldout_prompts(args.eval_prompts)
    results = {}
    for label, name in (("untrained", "drafter-hf-init"), ("trained", "drafter-hf")):
        target, vocab, drafter = load_pair(args.target_hf_path, os.path.join(args.out_dir, name))
        results[label] = evaluate_acceptance(target, vocab, drafter, prompts, max_new_tokens=args.eval_new_tokens,
                                             desc=f"tau {label}", progress=sys.stdout.isatty())
    meta = {"target": args.target_hf_path, "steps": args.steps, "cp": args.cp,
            "prompts": f"ShareGPT V3 records >= {HELDOUT_FIRST_RECORD}, first {args.eval_prompts} usable"}
    jpath, ppath = write_report(results, os.path.join(args.out_dir, "tau"), meta)
    for label, r in results.items():
        log(format_report(r, label))
    log(f"wrote {jpath} and {ppath}")
    return {label: r["mean_tau"] for label, r in results.items()}


def _check_flag_combinations(p, args):
    """Limits that involve two flags (argparse's `type=` sees one): p.error naming both, exit status 2."""
    from megatron_splitkv.dflash import target_layer_ids

    if args.save_interval is not None and args.save is None:
        p.error("--save-interval needs --save")
    if args.ckpt_step is not None and args.load is None:
        p.error("--ckpt-step needs --load")
    try:
        target_layer_ids(args.target_layers, args.draft_layers)
    except ValueError:
        p.error(f"--draft-layers {args.draft_layers} needs --target-layers >= 4 (the drafter taps one target layer "
                f"per drafter layer, spread over layers 1..n-3), got --target-layers {args.target_layers}")
    if args.block_size > args.max_tokens:
        p.error(f"--block-size {args.block_size} must be <= --max-tokens {args.max_tokens}")
    if args.save is not None and os.path.exists(args.save) and not os.path.isdir(args.save):
        p.error(f"--save {args.save}: exists and is not a directory")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        p.error(f"--load {args.load}: not a directory")


# ---------------------------------------------------------------------------------------------- checkpoints
CKPT_FORMAT = 1
# args attribute -> flag: must equal the checkpoint's to resume (model shapes, CP size, data and seed
# that define the data position and the frozen random target, lr as Megatron's scheduler check)
_CHECKED = (("cp", "--cp"), ("hidden", "--hidden"), ("target_layers", "--target-layers"),
            ("draft_layers", "--draft-layers"), ("block_size", "--block-size"),
            ("target_init_std", "--target-init-std"), ("limit", "--limit"), ("max_tokens", "--max-tokens"),
            ("num_anchors", "--num-anchors"), ("seed", "--seed"), ("lr", "--lr"),
            ("loss_decay_gamma", "--loss-decay-gamma"))


class CheckpointMismatchError(ValueError):
    """A `--load` checkpoint that does not fit this run's configuration."""


def checkpoint_config(args, world=None):
    """The config a checkpoint must match: {flag: value}."""
    cfg = {flag: getattr(args, attr) for attr, flag in _CHECKED}
    if world is not None:
        cfg["--cp"] = int(world)
    return cfg


def find_checkpoint(load_dir, step=None):
    """The iteration directory to resume from, verified against its manifest
    (`megatron_splitkv.checkpoint.resolve_checkpoint`): ``iter_{step}`` or the one named by the tracker file;
    None when `load_dir` holds no checkpoint (and no `step` is asked for). Raises FileNotFoundError for a
    `--ckpt-step` without its directory, `CheckpointError` (one line naming the damaged file and the last
    complete checkpoint) for a damaged or incomplete one."""
    if step is not None and not os.path.isdir(iteration_dir(load_dir, step)):
        raise FileNotFoundError(f"--ckpt-step {step}: no checkpoint {iteration_dir(load_dir, step)}")
    try:
        return resolve_checkpoint(load_dir, step)
    except CheckpointError as exc:
        raise CheckpointError(f"--load {load_dir}: {exc}") from None


def _torch_load(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def check_checkpoint_config(saved, args, world=None, where=""):
    """Raise `CheckpointMismatchError` naming the first flag whose value differs from the checkpoint's."""
    want = checkpoint_config(args, world)
    for flag, value in want.items():
        if flag not in saved:
            raise CheckpointMismatchError(f"--load {where}: checkpoint has no value for {flag}")
        if saved[flag] != value:
            raise CheckpointMismatchError(
                f"--load {where}: checkpoint was saved with {flag} {saved[flag]}, this run has {flag} "
                f"{value}; resume with the same {flag} (or start without --load)")


def verify_load(args, world=None):
    """Check `--load`'s checkpoint against the run's config before spawning ranks. Returns the
    iteration directory or None (no checkpoint: the run starts from scratch)."""
    d = find_checkpoint(args.load, args.ckpt_step)
    if d is None:
        return None
    common = _torch_load(os.path.join(d, "common.pt"))
    check_checkpoint_config(common["config"], args, world, d)
    return d


def _atomic_save(obj, path):
    import torch

    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state():
    import random

    import numpy as np
    import torch

    name, key, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}


def _set_rng_state(st):
    import random

    import numpy as np
    import torch

    torch.set_rng_state(st["torch"])
    py = st["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = st["numpy"]
    np.random.set_state((n["name"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))


def save_checkpoint(root, *, step, data_pos, rank, world, args, named_params, opt, group, export_meta):
    """Write ``root/iter_{step}``: rank 0 the shared state (replicated over CP) with `export_meta`
    (`megatron.hf.drafter_export_meta`, under `EXPORT_META_KEY`: what `python -m megatron_splitkv.export`
    needs for config.json), every rank its RNG states; once all ranks are done rank 0 writes the manifest (`megatron_splitkv.checkpoint.write_manifest`),
    then the tracker file. Returns the iteration directory."""
    import torch.distributed as dist

    from megatron_splitkv.megatron.hf import EXPORT_META_KEY

    d = iteration_dir(root, step)
    os.makedirs(d, exist_ok=True)
    if rank == 0 and os.path.exists(os.path.join(d, MANIFEST)):
        os.remove(os.path.join(d, MANIFEST))  # a save over an older one: complete again only when this one is
    dist.barrier(group=group)
    if rank == 0:
        _atomic_save({"format": CKPT_FORMAT, "step": int(step),
                      "data": {"epoch": int(data_pos[0]), "batch": int(data_pos[1])},
                      "config": checkpoint_config(args, world), "args": dict(vars(args)),
                      "model": {n: p.detach().clone() for n, p in named_params},
                      "optimizer": opt.state_dict(), EXPORT_META_KEY: export_meta}, os.path.join(d, "common.pt"))
    _atomic_save({"format": CKPT_FORMAT, "step": int(step), "rank": rank, "world": world, "rng": _rng_state()},
                 os.path.join(d, f"rng_rank{rank}.pt"))
    dist.barrier(group=group)
    if rank == 0:
        write_manifest(d)  # every file is on disk: the checkpoint is complete; then the tracker names it
        tmp = os.path.join(root, f"{TRACKER}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(f"{int(step)}\n")
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier(group=group)
    return d


def load_checkpoint(d, *, rank, world, args, named_params, opt):
    """Restore the drafter's trainable parameters and the optimizer from ``d`` (see `save_checkpoint`);
    returns (step, (epoch, next batch index), rng state of this rank) - the RNG is set by the caller
    right before training."""
    import torch

    common = _torch_load(os.path.join(d, "common.pt"))
    check_checkpoint_config(common["config"], args, world, d)
    rpath = os.path.join(d, f"rng_rank{rank}.pt")
    if not os.path.exists(rpath):
        raise CheckpointMismatchError(f"--load {d}: no {os.path.basename(rpath)} (saved with another --cp?)")
    rng = _torch_load(rpath)
    if rng["step"] != common["step"] or rng["world"] != world:
        raise CheckpointMismatchError(f"--load {d}: {os.path.basename(rpath)} is from step {rng['step']} / "
                                      f"--cp {rng['world']}, common.pt from step {common['step']}")
    saved = common["model"]
    names = [n for n, _ in named_params]
    if sorted(saved) != sorted(names):
        raise CheckpointMismatchError(f"--load {d}: the drafter's trainable parameters differ (checkpoint "
                                      f"{sorted(set(saved) ^ set(names))[:4]}...); same --hidden / "
                                      f"--draft-layers / --limit (vocabulary) needed")
    with torch.no_grad():
        for n, p in named_params:
            if saved[n].shape != p.shape:
                raise CheckpointMismatchError(f"--load {d}: parameter {n} has shape {tuple(saved[n].shape)} "
                                              f"in the checkpoint, {tuple(p.shape)} here (--limit changes the "
                                              f"vocabulary; model sizes must match)")
            p.copy_(saved[n])
    opt.load_state_dict(common["optimizer"])
    return int(common["step"]), (int(common["data"]["epoch"]), int(common["data"]["batch"])), rng["rng"]


def _compact_corpus(corpus):
    """Renumber token ids to 0..V_used-1 (bijective on the loaded data). Returns (corpus, V_used)."""
    import numpy as np

    from megatron_splitkv.data.sharegpt import TokenizedCorpus

    uniq, inv = np.unique(corpus.tokens, return_inverse=True)
    return TokenizedCorpus(inv.astype(np.int64), corpus.loss_mask, corpus.offsets), int(uniq.shape[0])


class NonFiniteLossError(RuntimeError):
    """A non-finite loss or gradient: training stops before the optimizer step (Megatron's
    --check-for-nan-in-loss-and-grad)."""


class RankFailedError(RuntimeError):
    """A rank of the demo failed (raised by `tools.launch.run_gloo`, which kills the others)."""


# the demo's own errors: the parent prints their one line, not the rank's traceback
_KNOWN_ERRORS = (NonFiniteLossError, CheckpointError, CheckpointMismatchError)


def _rank_main(rank, world, args):
    """One rank of `main` (run by `run_gloo`, which set up the gloo group): `--threads` torch threads, train."""
    import torch

    torch.set_num_threads(args.threads)
    return _train(rank, world, args)


def _rank_failure_text(message: str) -> str:
    """The launcher's report of a failed rank, shortened to "rank r of w: <error line>" when the error is one
    of the demo's own (`_KNOWN_ERRORS`: their message is complete); anything else keeps the rank's traceback."""
    lines = message.rstrip().splitlines()
    last = lines[-1] if lines else ""
    for cls in _KNOWN_ERRORS:  # "module.Class: text"; the module is __mp_main__ when run as a script
        m = re.match(rf"(?:[\w.]+\.)?{cls.__qualname__}: (.*)", last)
        if m:
            return f"{lines[0].split(' failed')[0]}: {m.group(1)}"
    return message


def _check_finite(loss, grad, step):
    """Raise `NonFiniteLossError` when the loss or the (CP-summed) gradient holds a NaN or an inf; the same
    values on every CP rank (the loss is the group's, the gradient all-reduced), so every rank raises."""
    import torch

    if not torch.isfinite(loss).all():
        raise NonFiniteLossError(f"step {step}: the loss is {float(loss)}; training stopped before the optimizer "
                                 f"step (non-finite loss; resume from the last checkpoint, e.g. with a lower --lr)")
    if not torch.isfinite(grad).all():
        bad = int((~torch.isfinite(grad)).sum())
        raise NonFiniteLossError(f"step {step}: {bad} gradient entries are NaN or inf (loss {float(loss):.4f}); "
                                 f"training stopped before the optimizer step (non-finite gradient)")


def _train(rank, world, args):
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)
    # torch warns "No CUDA runtime is found" when megatron imports its extension helpers on CPU
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_splitkv import comm_stats
    from megatron_splitkv.data import ShareGPTLoader, shard_batch
    from megatron_splitkv.dflash import build_draft_blocks, target_layer_ids
    from megatron_splitkv.models import DFlashDraftModel, TargetFeatureProvider, qwen3_config
    from megatron_splitkv.megatron.hf import drafter_export_meta
    from megatron_splitkv.planning import plan_context_parallel

    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=world)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    cp = pgs.cp

    target, corpus, mask_id, v_used = build_target_and_vocab(args, training_corpus(args), pgs)
    loader = ShareGPTLoader(max_tokens=args.max_tokens, num_anchors=args.num_anchors, seed=args.seed,
                            corpus=corpus)
    B = args.block_size
    H = args.hidden
    heads = max(2, H // 16)
    taps = target_layer_ids(args.target_layers, args.draft_layers)
    provider = TargetFeatureProvider(target, taps)
    dcfg = qwen3_config(num_layers=args.draft_layers, hidden_size=H, num_attention_heads=heads,
                        num_query_groups=max(1, heads // 2), kv_channels=16, ffn_hidden_size=2 * H)
    torch.manual_seed(args.seed + 1)
    drafter = DFlashDraftModel(dcfg, num_taps=len(taps), word_embeddings=provider.word_embeddings,
                               output_layer=provider.output_layer, mask_token_id=mask_id, block_size=B,
                               cp_impl=args.context_parallel_impl,
                               pg_collection=pgs)
    export_kw = export_kwargs(args, taps, provider.word_embeddings.num_embeddings)
    export_round_trip(drafter, args, export_kw, "drafter-hf-init", rank)  # the untrained drafter, for tau
    named_params = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    params = [p for _, p in named_params]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    n_train = sum(p.numel() for p in params)
    step, epoch, start = 0, 0, 0
    rng_state, loaded_from = None, None
    if args.load:
        loaded_from = find_checkpoint(args.load, args.ckpt_step)
        if loaded_from is not None:
            step, (epoch, start), rng_state = load_checkpoint(loaded_from, rank=rank, world=world, args=args,
                                                              named_params=named_params, opt=opt)

    pbar = None
    if rank == 0:
        from tqdm import tqdm

        print(f"DFlash drafter training demo: CP={world} ({args.context_parallel_impl}, {args.cp_balance} "
              f"planner), {len(corpus)} ShareGPT conversations, vocab {v_used} used ids + MASK, target "
              f"{args.target_hf_path or 'random'} ({args.target_layers} layers, taps {taps}), drafter {args.draft_layers} layers, "
              f"{n_train:,} trainable parameters, B={B}, {args.num_anchors} anchors/sequence", flush=True)
        if args.load and loaded_from is None:
            print(f"WARNING: --load {args.load}: no checkpoint ({TRACKER} missing), starting from step 0",
                  flush=True)
        elif loaded_from is not None:
            print(f"resumed from {loaded_from}: step {step}, epoch {epoch}, batch {start}", flush=True)
        # one bar in one process: a thread lock. tqdm's default lock adds a multiprocessing RLock, a named semaphore
        # registered with the resource tracker that this rank's os._exit (exit_process) never releases: the
        # tracker's "leaked semaphore objects" warning at the end of the run
        tqdm.set_lock(threading.RLock())
        # the bar only on a terminal; the per-step lines alone when the output goes to a file or CI log
        pbar = tqdm(total=args.steps, initial=min(step, args.steps), desc="train", unit="step", file=sys.stdout,
                    dynamic_ncols=True, disable=not sys.stdout.isatty())

    hist = dict(loss=[], weight=[], tokens=0, queries=0, supervised=0.0, imb=[], bytes_attn=0, bytes_target=0, time=0.0)
    saved_step = step if loaded_from is not None else None
    data_pos = (epoch, start)  # (epoch, index of the next batch): the loader position after `step` steps

    def _save():
        d = save_checkpoint(args.save, step=step, data_pos=data_pos, rank=rank, world=world, args=args,
                            named_params=named_params, opt=opt, group=cp,
                            export_meta=drafter_export_meta(drafter, **export_kw))
        if pbar is not None:
            pbar.write(f"saved checkpoint {d}")

    if rng_state is not None:
        _set_rng_state(rng_state)  # last, after model building re-seeded torch
    while step < args.steps:
        loader.set_epoch(epoch, start=start)
        b = start
        start = 0
        for batch in loader:
            if step >= args.steps:
                break
            t0 = time.perf_counter()
            plan = plan_context_parallel(batch.seq_lens, batch.anchors, block_size=B, cp_size=world,
                                         strategy=args.cp_balance)
            data = batch.to_dict()
            shard = shard_batch(data, plan, rank)
            sl = plan.query_slice(rank)
            blocks = build_draft_blocks(batch.input_ids, batch.seq_lens, plan.q_seq[sl], plan.q_anchor[sl],
                                        block_size=B, mask_token_id=mask_id, loss_mask=batch.loss_mask,
                                        gamma=args.loss_decay_gamma)
            ids = torch.as_tensor(shard["input_ids"])
            kv_seq, kv_pos = torch.as_tensor(shard["kv_seq"]), torch.as_tensor(shard["kv_pos"])
            with comm_stats() as st_target:
                feats = provider(ids, kv_seq, kv_pos)
            with comm_stats() as st_attn:
                out = drafter(feats, blocks, kv_seq, kv_pos)
                opt.zero_grad(set_to_none=True)
                out.loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=cp)  # replicated parameters: exact gradient = sum over CP ranks
            _check_finite(out.total.detach(), flat, step + 1)
            o = 0
            for p in params:
                p.grad.copy_(flat[o:o + p.numel()].view_as(p))
                o += p.numel()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            dt = time.perf_counter() - t0
            loss = float(out.total)
            hist["loss"].append(loss)
            hist["weight"].append(float(out.weight_sum))  # 0: no supervised token, the loss 0 is no measurement
            hist["tokens"] += batch.num_tokens
            hist["queries"] += int(plan.q_seq.shape[0]) * B
            hist["supervised"] += float(out.weight_sum)
            hist["imb"].append(float(plan.imbalance))
            hist["bytes_attn"] += st_attn.total_bytes
            hist["bytes_target"] += st_target.total_bytes
            hist["time"] += dt
            step += 1
            b += 1
            data_pos = (epoch, b)
            if pbar is not None:
                pbar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{batch.num_tokens / dt:,.0f}",
                                 imb=f"{plan.imbalance:.3f}")
                pbar.write(f"step {step:3d}  loss {loss:7.4f}  tokens {batch.num_tokens:5d}  "
                           f"seqs {len(batch.seq_lens):2d}  query blocks {plan.q_seq.shape[0]:3d}  "
                           f"imbalance {plan.imbalance:6.3f}  {dt:5.2f} s")
                pbar.update(1)
            if args.save and args.save_interval and step % args.save_interval == 0:
                _save()
                saved_step = step
        epoch += 1
    if args.save and saved_step != step:
        _save()  # the final checkpoint, as Megatron at the end of training
    if pbar is not None:
        pbar.close()
    hist["drafter_hf"] = export_round_trip(drafter, args, export_kw, "drafter-hf", rank)
    # per-rank byte totals summed over ranks
    tot = torch.tensor([hist["bytes_attn"], hist["bytes_target"]], dtype=torch.float64)
    dist.all_reduce(tot, group=cp)
    hist["bytes_attn_all"], hist["bytes_target_all"] = float(tot[0]), float(tot[1])
    return hist


def _trend_window(n: int) -> int:
    """The number k of first and of last steps whose mean losses the summary compares over a run of `n` steps:
    n // 3, at least 1 and at most 5."""
    return max(1, min(5, n // 3))


def _not_judged_why(n: int, resumed: bool):
    """Why the loss trend of a run of `n` steps is not judged by the exit status, or None when it is: a resumed
    run (--load) continues a curve for a few steps where the noise of the per-batch loss decides the sign (the
    README's resume command runs steps 21-30), and a run from step 1 of fewer than `MIN_JUDGED_STEPS` steps is
    as noisy (one step: first and last are the same step)."""
    if resumed:
        return "resumed run: these steps only"
    if n < 2:
        return "one step: no trend"
    if n < MIN_JUDGED_STEPS:
        return f"{n} steps: fewer than {MIN_JUDGED_STEPS}, too few to tell a trend from noise"
    return None


def judged_losses(h) -> list:
    """The losses of the steps that had supervised tokens (`h["weight"]` > 0; a history without weights: every
    step): a step without any (no query block on any rank) reports loss 0, which is no measurement and would
    make any run's loss look falling."""
    weights = h.get("weight") or [1.0] * len(h["loss"])
    return [loss for loss, w in zip(h["loss"], weights) if w > 0]


def _summary(h, args, world, wall, resumed=False):
    """The summary's lines and the mean losses (first, last) of the loss trend, over `judged_losses`."""
    import numpy as np

    judged, steps = judged_losses(h), len(h["loss"])
    loss = judged or h["loss"]
    n = len(loss)
    empty = steps - len(judged)
    k = _trend_window(n)
    first, last = float(np.mean(loss[:k])), float(np.mean(loss[-k:]))
    why = _not_judged_why(n, resumed)
    lines = [
        "",
        "summary",
        f"  steps              {steps} (CP={world}, {args.context_parallel_impl}, planner {args.cp_balance})"
        + (f"; {empty} without supervised tokens (loss 0), left out of the loss trend" if empty else ""),
        f"  loss first/last    {loss[0]:.4f} -> {loss[-1]:.4f}   (mean of first/last {k}: {first:.4f} -> "
        f"{last:.4f}, {'falling' if last < first else 'NOT falling'}"
        + (f"; {why}, not judged by the exit status)" if why else ")"),
        f"  tokens/s           {h['tokens'] / h['time']:,.0f} context tokens/s, "
        f"{h['queries'] / h['time']:,.0f} query tokens/s ({h['tokens']:,} context tokens, "
        f"{h['queries']:,} query tokens in {h['time']:.1f} s of steps; {wall:.1f} s wall incl. start-up and, on a first run, making the target)",
        f"  planner imbalance  mean {np.mean(h['imb']):.4f}, max {np.max(h['imb']):.4f} (max/mean load - 1)",
        f"  bytes moved        drafter attention {h['bytes_attn_all'] / world / steps / 1e6:.2f} MB/rank/step "
        f"({args.context_parallel_impl}, forward+backward), target features "
        f"{h['bytes_target_all'] / world / steps / 1e6:.2f} MB/rank/step (all-gather KV, forward only); means over "
        f"the {steps} steps run (the batches' contexts differ)",
    ]
    return "\n".join(lines), first, last


def _loss_failure(first, last, resumed, steps):
    """The one line saying why the run fails its loss check, or None when it passes: a run from step 1 of
    `steps` >= `MIN_JUDGED_STEPS` steps passes when the mean loss of its last k steps (`_trend_window`) is below
    that of its first k (`last`, `first`); a resumed run (--load) or a shorter one is not judged
    (`_not_judged_why`)."""
    if _not_judged_why(steps, resumed) or last < first:
        return None
    k = _trend_window(steps)
    return (f"error: the loss did not fall over the {steps} steps: expected the mean loss of the last {k} steps "
            f"below that of the first {k}, measured {first:.4f} -> {last:.4f}")


def _exit_status(first, last, resumed, steps) -> int:
    """1 when the run fails its loss check (`_loss_failure`: a run from step 1 of at least `MIN_JUDGED_STEPS`
    steps whose loss did not fall, mean of its first vs last steps), else 0; a resumed run (--load) or a
    shorter one is not judged (0), so that a correct short or resumed run does not exit with a failure."""
    return 0 if _loss_failure(first, last, resumed, steps) is None else 1


def main(argv=None) -> int:
    """Spawn `--cp` gloo processes, train, print the summary. Returns 0 on success (loss falling; any
    trend after --load or over fewer than `MIN_JUDGED_STEPS` steps), 1 if the loss of a run from step 1 did not
    fall (with one line on stderr saying what was expected and measured), 2 if a rank failed."""
    args = parse_args(argv)
    from tools.launch import run_gloo

    t0 = time.time()
    world = args.cp
    resumed = False
    if args.load:  # a mismatched checkpoint fails here, before any rank starts; None: no checkpoint (fresh run)
        resumed = verify_load(args, world) is not None
    prepare_target(args)
    try:  # a rank that raises or dies: the others are killed, its message printed (no wait)
        results = run_gloo(_rank_main, world, args, timeout=600 + 120 * args.steps, error=RankFailedError)
    except RankFailedError as exc:
        print(f"error: {_rank_failure_text(str(exc))}", file=sys.stderr)
        return 2
    if not results[0]["loss"]:
        print(f"no steps to run: the checkpoint is at step >= --steps {args.steps}", flush=True)
        return 0
    text, first, last = _summary(results[0], args, world, time.time() - t0, resumed=resumed)
    print(text, flush=True)
    report_round_trip(args, results[0], t0)
    failure = _loss_failure(first, last, resumed=resumed, steps=len(judged_losses(results[0])))
    if failure is not None:
        print(failure, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (CheckpointMismatchError, CheckpointError, FileNotFoundError, ValueError) as exc:  # bad --load / target
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
