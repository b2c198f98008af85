#!/usr/bin/env python
"""Offline DFlash context features: run the frozen target over ShareGPT, store the tapped hidden states.

    python tools/extract_features.py --out /data/feat --sharegpt-limit 1000 \\
        --target-num-layers 36 --draft-num-layers 5 --hidden-size 4096 --num-attention-heads 32 \\
        --num-query-groups 8 --kv-channels 128 --ffn-hidden-size 12288 --target-load /ckpt/qwen3-8b.pt
    torchrun --nproc-per-node 4 tools/extract_features.py ...   # long conversations split over 4 CP ranks
    python tools/extract_features.py --out /data/feat --target-hf-path /ckpt/Qwen3-8B --draft-num-layers 5
        # a Hugging Face Qwen3 target: its sizes, vocabulary, rope theta and weights from the directory

Output (a directory, see `megatron_splitkv.megatron.models.features`): `features.bin`, a memory-mapped
[num_tokens, n_taps * hidden] array (bf16 by default), `index.npz` (row offsets, token ids, loss masks,
conversation ids) and `meta.json`. Training reads it with `examples/pretrain_dflash.py --features-path`
(or `FeatureStore(path).rows(...)`): each CP rank reads only the rows of its own context shard.

The target is the package's Qwen3-style `GPTModel` (`build_target_model`), exactly causal under CP
(all-gather-KV with block size 1); taps are `megatron_splitkv.dflash.target_layer_ids(n_target, n_draft)`
unless `--tap-layers` is given. Runs on CPU (gloo) or GPU (NCCL); without torchrun it starts a
one-process group itself. Source: DESIGN.md section 1 (context features); DFlash.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_args(argv=None):
    from megatron_splitkv._ints import existing_dir, existing_path, float_arg, int_arg, output_dir  # finite reals only

    p = argparse.ArgumentParser(description="Extract DFlash target features to a memory-mapped file.")
    p.add_argument("--out", type=output_dir, required=True, help="output directory")
    p.add_argument("--sharegpt-limit", type=int_arg(1), default=None, help="first N conversations (default all)")
    p.add_argument("--cache-dir", default=None,
                   help="tokenized ShareGPT cache directory (whole corpus; default ~/.cache/megatron_splitkv)")
    p.add_argument("--max-tokens", type=int_arg(2), default=32768, help="truncate conversations to this length")
    p.add_argument("--target-num-layers", type=int_arg(1), default=36)
    p.add_argument("--draft-num-layers", type=int_arg(1), default=5, help="determines the tap layers")
    p.add_argument("--tap-layers", type=int, nargs="*", default=None, help="override the tap layer ids")
    p.add_argument("--hidden-size", type=int_arg(1), default=4096)
    p.add_argument("--num-attention-heads", type=int_arg(1), default=32)
    p.add_argument("--num-query-groups", type=int_arg(1), default=8)
    p.add_argument("--kv-channels", type=int_arg(1), default=128)
    p.add_argument("--ffn-hidden-size", type=int_arg(1), default=12288)
    p.add_argument("--vocab-size", type=int_arg(1), default=151936)
    p.add_argument("--rotary-base", type=float_arg(0, above=True), default=1e6)
    p.add_argument("--target-load", type=existing_path, default=None, help="target weights (random init when unset)")
    p.add_argument("--target-hf-path", type=existing_dir, default=None,
                   help="Hugging Face Qwen3 checkpoint directory (config.json + *.safetensors): the target's sizes, "
                   "vocabulary, rope theta and weights (replaces --target-num-layers, --hidden-size, "
                   "--num-attention-heads, --num-query-groups, --kv-channels, --ffn-hidden-size, --vocab-size, "
                   "--rotary-base; not with --target-load)")
    p.add_argument("--target-seed", type=int_arg(0), default=1234)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="stored dtype; the target runs in bf16 on GPU, fp32 on CPU")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p, args):
    """Validate the flags before any process group or model is built (argparse error, exit 2)."""
    for flag in ("max_tokens", "target_num_layers", "draft_num_layers", "hidden_size", "num_attention_heads",
                 "num_query_groups", "kv_channels", "ffn_hidden_size", "vocab_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.sharegpt_limit is not None and args.sharegpt_limit < 1:
        p.error(f"--sharegpt-limit must be >= 1, got {args.sharegpt_limit}")
    if args.num_attention_heads % args.num_query_groups:
        p.error(f"--num-attention-heads ({args.num_attention_heads}) must be a multiple of --num-query-groups "
                f"({args.num_query_groups})")
    if args.target_hf_path:
        _sizes_from_hf(p, args)
    n = args.target_num_layers
    if args.tap_layers:
        bad = [i for i in args.tap_layers if not 0 <= i < n]
        if bad:
            p.error(f"--tap-layers {bad} out of range: tap layer ids must lie in [0, {n}) "
                    f"(--target-num-layers {n})")
    else:
        from megatron_splitkv.dflash import target_layer_ids

        try:
            target_layer_ids(n, args.draft_num_layers)
        except ValueError as e:
            p.error(f"--target-num-layers {n} / --draft-num-layers {args.draft_num_layers}: {e}")
    if args.target_load and not os.path.exists(args.target_load):
        p.error(f"--target-load: no such file {args.target_load!r}")


def _sizes_from_hf(p, args):
    """--target-hf-path: the target's sizes from its config.json (argparse error naming the file and the
    field when it is not a usable Qwen3 checkpoint)."""
    from megatron_splitkv.megatron.hf import HFCheckpointError, read_qwen3_config

    if args.target_load:
        p.error("--target-hf-path and --target-load both name the target's weights: give one")
    try:
        hf = read_qwen3_config(args.target_hf_path)
    except HFCheckpointError as exc:
        p.error(f"--target-hf-path: {exc}")
    args.target_num_layers, args.hidden_size = hf["num_hidden_layers"], hf["hidden_size"]
    args.num_attention_heads, args.num_query_groups = hf["num_attention_heads"], hf["num_key_value_heads"]
    args.kv_channels, args.ffn_hidden_size = hf["head_dim"], hf["intermediate_size"]
    args.vocab_size, args.rotary_base = hf["vocab_size"], hf["rope_theta"]


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_splitkv.data import load_sharegpt
    from megatron_splitkv.dflash import target_layer_ids
    from megatron_splitkv.megatron.hf import load_hf_target
    from megatron_splitkv.megatron.models import (
        TargetFeatureProvider,
        build_target_model,
        load_target_weights,
        qwen3_config,
        write_features,
    )

    cuda = torch.cuda.is_available()
    tmp = None
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        tmp = tempfile.mkdtemp()
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=world)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = qwen3_config(num_layers=args.target_num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                       kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size, params_dtype=dtype,
                       use_cpu_initialization=not cuda, context_parallel_size=world)
    if args.target_hf_path:
        target = load_hf_target(args.target_hf_path, pg_collection=pgs, params_dtype=dtype,
                                max_sequence_length=args.max_tokens, use_cpu_initialization=not cuda)
    else:
        target = build_target_model(cfg, vocab_size=args.vocab_size, max_sequence_length=args.max_tokens,
                                    rotary_base=args.rotary_base, pg_collection=pgs, seed=args.target_seed)
    if args.target_load:
        load_target_weights(target, args.target_load)
    taps = args.tap_layers or target_layer_ids(args.target_num_layers, args.draft_num_layers)
    provider = TargetFeatureProvider(target, taps)
    if cuda:
        provider = provider.cuda()
    corpus = load_sharegpt(args.sharegpt_limit, cache_dir=args.cache_dir)
    if len(corpus) and int(corpus.tokens.max()) >= args.vocab_size:
        print(f"extract_features.py: error: the ShareGPT token ids reach {int(corpus.tokens.max())}, beyond the "
              f"target's vocabulary (vocab_size {args.vocab_size}); use a target with the Qwen tokenizer's vocabulary",
              file=sys.stderr)
        raise SystemExit(2)

    def conversations():
        for i in range(len(corpus)):
            ids, lm = corpus.conversation(i)
            yield i, ids[: args.max_tokens], lm[: args.max_tokens]

    rank = dist.get_rank()
    total = [0]

    def progress(i, n):
        total[0] += n
        if i % 100 == 0 or i == len(corpus) - 1:
            print(f"[extract_features] {i + 1}/{len(corpus)} conversations, {total[0]:,} tokens", flush=True)

    meta = {"tap_layers": taps, "hidden_size": args.hidden_size, "target_num_layers": args.target_num_layers,
            "target_load": args.target_load, "target_hf_path": args.target_hf_path,
            "target_seed": args.target_seed, "source": "ShareGPT V3",
            "max_tokens": args.max_tokens}
    write_features(provider, conversations(), args.out, cp_group=pgs.cp, dtype=getattr(torch, args.dtype),
                   meta=meta, progress=progress if rank == 0 else None)
    if rank == 0:
        print(f"[extract_features] wrote {args.out}", flush=True)
    dist.destroy_process_group()
    return args.out


if __name__ == "__main__":
    main()
