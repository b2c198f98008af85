#!/usr/bin/env python
"""Train a DFlash drafter with Megatron-LM's `pretrain` (GPU) and Split-KV context parallelism.

    torchrun --nproc-per-node 8 examples/pretrain_dflash.py \\
        --context-parallel-impl splitkv --context-parallel-size 8 --tensor-model-parallel-size 1 \\
        --num-layers 5 --hidden-size 4096 --num-attention-heads 32 --group-query-attention \\
        --num-query-groups 8 --kv-channels 128 --ffn-hidden-size 12288 --normalization RMSNorm \\
        --qk-layernorm --swiglu --disable-bias-linear --position-embedding-type rope --rotary-base 1000000 \\
        --attention-dropout 0 --hidden-dropout 0 --untie-embeddings-and-output-weights \\
        --vocab-size 151936 --seq-length 131072 --max-position-embeddings 131072 \\
        --micro-batch-size 1 --global-batch-size 8 --train-iters 2000 --lr 6e-4 --min-lr 6e-5 \\
        --lr-decay-style cosine --lr-warmup-iters 100 --bf16 --transformer-impl local \\
        --num-anchors 512 --block-size 16 --loss-decay-gamma 7 \\
        --target-num-layers 36 --target-ffn-hidden-size 12288 --target-load /ckpt/qwen3-8b.pt \\
        --save /ckpt/dflash --load /ckpt/dflash --save-interval 500 --log-interval 1

Standard Megatron flags describe the DRAFTER (its layers, parallelism, optimizer, checkpointing).
Extra flags (`add_dflash_args`): `--context-parallel-impl {splitkv,allgather-kv,ring-kv}`, `--cp-balance`,
`--cp-chunk-size`, `--splitkv-kernel {auto,math,flex,te,staircase,fa4}` (the op's local kernel),
`--splitkv-no-overlap-q-gather`, `--splitkv-cp-ranks-per-node`, `--splitkv-num-chunks`, `--splitkv-chunk-axis`
(the last three automatic when unset for a CP group across nodes; the start-up line says
what was chosen) (from `megatron_splitkv.megatron.add_splitkv_args`); `--num-anchors` (query
budget per sequence) and `--block-size` (B), other spellings of `--dflash-num-anchors` / `--dflash-block-size`,
`--loss-decay-gamma`, `--mask-token-id`; target flags
`--target-num-layers`, `--target-ffn-hidden-size`, `--target-num-attention-heads`, `--target-num-query-groups`,
`--target-kv-channels`, `--target-load` (weights; random init when absent), `--target-seed`, `--target-hf-path`
(a Hugging Face Qwen3 checkpoint directory: sizes, vocabulary, rope theta and weights, TP-sharded); data flags
`--sharegpt-limit`, `--data-seed`, `--features-path` (offline features from tools/extract_features.py:
each CP rank reads only its shard's rows; of the target only the embedding and LM head the drafter borrows
are then built, no decoder layer); `--dflash-data-workers N`
(default 1 on CUDA; 0 = synchronous; at most 32 per rank) and `--dflash-data-prefetch N` (default 2): the data pipeline;
`--dflash-host-metadata {on,off}` (default on with splitkv and workers > 0): the Split-KV attention metadata
built there too, from the plan (the step binds it to the CP group instead of preparing it);
`--dflash-device-prefetch {on,off}` (default on): the next batch's upload + bind issued during the current
forward, one batch ahead (`megatron_splitkv.data.prefetch.DevicePrefetcher`).

Per micro-batch (one packed ShareGPT batch of up to --seq-length tokens per data-parallel rank; every CP
rank of a DP rank iterates the same deterministic loader): the LPT planner assigns context chunks to CP
ranks, `shard_batch` gives this rank its tokens (global positions), `build_draft_blocks` its query blocks
and the feature store its feature rows - all in DataLoader worker processes, batches ahead of the step, in
pinned memory (`megatron_splitkv.megatron.prefetch_planned_batches`; docs/megatron.md "Data pipeline");
with --dflash-host-metadata also this rank's Split-KV attention metadata
(`prepare_splitkv_metadata_from_plan`); the step uploads them (non-blocking), binds the metadata to the CP
group (`SplitKVMetadata.bind`: no collective, no copy beyond the upload), the frozen target (or the feature rows) gives the tapped hidden
states, the drafter computes the decayed DFlash loss normalised over the CP group. Logged per iteration
(Megatron's log line): the loss, `tokens-per-sec` (context tokens of the global batch per second) and
`planner-imbalance` (max/mean load - 1). Checkpoints: Megatron's `--save/--load` (drafter and optimizer;
the frozen shared embedding/LM head travel with it); on resume the data pipeline skips the batches
already consumed (without building them). Each saved iteration gets a manifest (size + SHA-256 per file,
`megatron_splitkv.megatron.checkpoint`), verified before `--load`: a damaged checkpoint is one error line
naming the file and the last complete one. A NaN / inf loss stops the run (Megatron's
--check-for-nan-in-loss-and-grad, on by default: the loss through its rerun state machine, the gradients
in its DDP).

Status: needs CUDA (megatron.training); on CPU this script only imports and parses its arguments
(`python examples/pretrain_dflash.py --help`: this script's flags with their defaults; `--help-all`: then every
Megatron-LM flag; `--parse-only` to print the parsed namespace: one `name = value` line per flag, sorted,
and a one-line verdict; it checks that the paths exist, so replace the /ckpt placeholders above first).
Source: DESIGN.md sections 1-4; arXiv 2611.05926 (Split-KV); DFlash.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

if __name__ == "__main__" and {"--parse-only", "-h", "--help", "--help-all"} & set(sys.argv[1:]):
    # a CPU check of a command line: megatron-core's import-time notes that Transformer Engine / Apex / absl are
    # not installed (and torch's "No CUDA runtime is found") describe this machine, not the flags: not shown
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import get_args, get_timers, pretrain, print_rank_0  # noqa: E402
from megatron.training import training as megatron_training  # noqa: E402

from megatron_splitkv._ints import DefaultsHelpFormatter, existing_dir, existing_path, float_arg, int_arg  # noqa: E402,E501
from megatron_splitkv.megatron import add_splitkv_args  # noqa: E402
from megatron_splitkv.megatron.arguments import check_launcher_ints  # noqa: E402
from megatron_splitkv.megatron.checkpoint import CheckpointError, install_checkpoint_manifest  # noqa: E402

QWEN3_FIRST_UNUSED_ID = 151669  # Qwen3 tokenizer ids end at 151668; rows up to 151935 are padding

# short spellings this script accepts for add_splitkv_args' flags (aliases: the same option)
DFLASH_FLAG_ALIASES = {"--dflash-num-anchors": ("--num-anchors",), "--dflash-block-size": ("--block-size",)}

_STATE = {"provider": None, "store": None, "stats": {}, "config": None, "pgs": None, "device_prefetch": False,
          "kernel": "auto"}


def _short_errors(parser: argparse.ArgumentParser) -> None:
    """A command-line error (bad choice, bad type, unknown flag) as argparse's own error line naming the flag
    (and the allowed values for a choice) plus a hint, exit status 2; without the usage argparse prints
    first, ~750 lines for Megatron's parser, under which the error line is lost."""
    def error(message):
        parser.exit(2, f"{parser.prog}: error: {message}\n{parser.prog}: run with --help for every flag\n")

    parser.error = error


def check_dflash_args(args) -> None:
    """Limits of this script's flags that involve Megatron's (argparse's `type=` sees one flag): the MASK id
    inside the padded vocabulary (Megatron pads --vocab-size to a multiple of --make-vocab-size-divisible-by
    times the TP size), --target-num-layers enough for the drafter's taps. Raises SplitKVArgumentError naming
    the flags (exit status 2 from the command line). With --target-hf-path, its config.json against the flags
    (`megatron.hf.read_qwen3_config`: a Qwen3 target, hidden_size = --hidden-size, --mask-token-id < its
    vocab_size, heads divisible by the TP size; its num_hidden_layers as the target's depth)."""
    from megatron_splitkv.dflash import target_layer_ids
    from megatron_splitkv.megatron.arguments import SplitKVArgumentError
    from megatron_splitkv.megatron.hf import HFCheckpointError, read_qwen3_config

    target_layers = args.target_num_layers
    hf_path = getattr(args, "target_hf_path", None)
    if hf_path:
        try:
            hf = read_qwen3_config(hf_path, mask_token_id=getattr(args, "mask_token_id", None),
                                   drafter_hidden_size=args.hidden_size,
                                   tp_size=args.tensor_model_parallel_size or 1)
        except HFCheckpointError as exc:
            raise SplitKVArgumentError(f"--target-hf-path {hf_path}: {exc} (--hidden-size {args.hidden_size}, "
                                       f"--mask-token-id {getattr(args, 'mask_token_id', None)})") from None
        target_layers = hf["num_hidden_layers"]
    vocab = getattr(args, "vocab_size", None)
    if vocab is not None and getattr(args, "mask_token_id", None) is not None:
        multiple = (getattr(args, "make_vocab_size_divisible_by", None) or 1) * (args.tensor_model_parallel_size or 1)
        padded = -(-vocab // multiple) * multiple
        if args.mask_token_id >= padded:
            raise SplitKVArgumentError(f"--mask-token-id {args.mask_token_id} must be < {padded} (--vocab-size {vocab} "
                                       f"padded to a multiple of {multiple}): the MASK token is a row of the vocabulary")
    layers = getattr(args, "num_layers", None)
    if layers is not None and target_layers is not None:
        try:
            target_layer_ids(target_layers, layers)
        except ValueError:
            raise SplitKVArgumentError(f"--target-num-layers {target_layers} must be >= 4 for a drafter of "
                                       f"--num-layers {layers} (one tapped target layer per drafter layer, spread "
                                       f"over layers 1..n-3)") from None


def add_dflash_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron `extra_args_provider`: Split-KV flags plus the DFlash, target and data flags; the parser's
    errors become two lines without the full usage (`_short_errors`)."""
    _short_errors(parser)
    # --num-anchors / --block-size: other spellings of add_splitkv_args' --dflash-num-anchors /
    # --dflash-block-size, the same argparse action (one help text, one default)
    add_splitkv_args(parser, aliases=DFLASH_FLAG_ALIASES)
    g = parser.add_argument_group(title="dflash drafter")
    g.add_argument("--loss-decay-gamma", type=float_arg(0, above=True), default=None,
                   help="Loss weight exp(-(k-1)/gamma) per offset k (default 7 for B=16, scaled with B).")
    g.add_argument("--mask-token-id", type=int_arg(0), default=QWEN3_FIRST_UNUSED_ID,
                   help="Reserved MASK token: an unused row of the target vocabulary.")
    t = parser.add_argument_group(title="dflash target (frozen, Qwen3-style; hidden size = --hidden-size)")
    t.add_argument("--target-num-layers", type=int_arg(1), default=36, help="decoder layers of the target")
    t.add_argument("--target-ffn-hidden-size", type=int_arg(1), default=None, help="default: --ffn-hidden-size")
    t.add_argument("--target-num-attention-heads", type=int_arg(1), default=None, help="default: --num-attention-heads")
    t.add_argument("--target-num-query-groups", type=int_arg(1), default=None, help="default: --num-query-groups")
    t.add_argument("--target-kv-channels", type=int_arg(1), default=None, help="default: --kv-channels")
    t.add_argument("--target-load", type=existing_path, default=None,
                   help="Target weights (torch state dict file or Megatron torch_dist dir); random init if unset.")
    t.add_argument("--target-seed", type=int_arg(0), default=1234, help="the random target's init seed")
    t.add_argument("--target-hf-path", type=existing_dir, default=None,
                   help="Hugging Face Qwen3 checkpoint directory (config.json + *.safetensors) of the target: its "
                   "config replaces the --target-* sizes and the weights are loaded TP-sharded "
                   "(megatron_splitkv.megatron.hf.load_hf_target); not with --target-load.")
    d = parser.add_argument_group(title="dflash data")
    d.add_argument("--sharegpt-limit", type=int_arg(1), default=None,
                   help="first N ShareGPT conversations only (default: all)")
    d.add_argument("--sharegpt-cache-dir", default=None,
                   help="tokenized ShareGPT cache directory (whole corpus; default ~/.cache/megatron_splitkv)")
    d.add_argument("--data-seed", type=int_arg(0), default=0, help="anchor sampling and batch order seed")
    d.add_argument("--features-path", type=existing_dir, default=None,
                   help="Offline features directory (tools/extract_features.py) instead of the online target.")
    s = parser.add_argument_group(title="this script")
    # handled by main() before Megatron parses (removed from the command line there); declared here so that
    # --help lists it
    s.add_argument("--parse-only", action="store_true", default=argparse.SUPPRESS,
                   help="CPU check of a command line: parse it with Megatron's parser plus these flags, run the "
                   "Split-KV flag validation (validate_splitkv_args; a bad flag is one error line naming it, exit "
                   "status 2), print the parsed namespace (one 'name = value' line per flag, sorted; flags resolved "
                   "at run time shown as what they resolve to) and exit without training. Needs megatron-core, no GPU.")
    s.add_argument("--help-all", action="store_true", default=argparse.SUPPRESS,
                   help="show these flags, then every Megatron-LM flag, and exit")
    # the context-parallel DFlash attention has no dropout (validate_splitkv_args rejects it): default 0
    # here instead of Megatron's 0.1, so a plain command line runs; an explicit --attention-dropout > 0
    # is still an error naming the flag
    parser.set_defaults(attention_dropout=0.0, context_parallel_impl="splitkv")
    return parser


def _defaults(args):
    # unset (None) only: an explicit 0 / negative value is kept so that validate_splitkv_args rejects it
    if getattr(args, "dflash_block_size", None) is None:
        args.dflash_block_size = 16
    if getattr(args, "dflash_num_anchors", None) is None:
        args.dflash_num_anchors = 512


def _pgs(pg_collection):
    from megatron.core.process_groups_config import ProcessGroupCollection

    return pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()


def _target_config(args, params_dtype, cpu_init=False):
    from megatron_splitkv.megatron.models import qwen3_config

    return qwen3_config(
        num_layers=args.target_num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.target_num_attention_heads or args.num_attention_heads,
        num_query_groups=args.target_num_query_groups or args.num_query_groups,
        kv_channels=args.target_kv_channels or args.kv_channels,
        ffn_hidden_size=args.target_ffn_hidden_size or args.ffn_hidden_size,
        params_dtype=params_dtype, use_cpu_initialization=cpu_init,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
    )


def _build_target(args, params_dtype, taps, pgs, cpu_init=False):
    """The frozen target as a `TargetFeatureProvider` (not moved to CUDA).

    Online (no --features-path): the whole target (it computes the features every step). Offline
    (--features-path): only what the drafter borrows, the embedding and the LM head (plus the target's
    final norm, a hidden-size vector; `build_target_model(decoder_layers=False)`): none of the
    --target-num-layers decoder layers is kept (Qwen3-8B: ~2.5 GB instead of ~16 GB). With --target-load no
    decoder layer is built at all; without it (random target) each layer is built and freed once, one at a
    time, so that the random LM head equals the one of the target the features were extracted from
    (tools/extract_features.py with the same --target-seed). cpu_init: CPU initialisation (tests)."""
    from megatron_splitkv.megatron.hf import load_hf_target
    from megatron_splitkv.megatron.models import TargetFeatureProvider, build_target_model, load_target_weights

    offline = bool(args.features_path)
    hf_path = getattr(args, "target_hf_path", None)
    if hf_path:  # the target's sizes, vocabulary and rope theta from its config.json
        if args.target_load:
            raise ValueError("--target-hf-path and --target-load both name the target's weights: give one")
        target = load_hf_target(hf_path, pg_collection=pgs, params_dtype=params_dtype,
                                mask_token_id=args.mask_token_id, drafter_hidden_size=args.hidden_size,
                                max_sequence_length=args.max_position_embeddings, decoder_layers=not offline,
                                use_cpu_initialization=cpu_init)
        return TargetFeatureProvider(target, taps)
    target = build_target_model(_target_config(args, params_dtype, cpu_init), vocab_size=args.padded_vocab_size,
                                max_sequence_length=args.max_position_embeddings, rotary_base=args.rotary_base,
                                pg_collection=pgs, seed=args.target_seed, decoder_layers=not offline,
                                match_random_init=not args.target_load)
    if args.target_load:
        load_target_weights(target, args.target_load)
    return TargetFeatureProvider(target, taps)


def _head_dim(dcfg) -> int:
    """The drafter's attention head dim (kv_channels, else hidden size / heads)."""
    return dcfg.kv_channels or dcfg.hidden_size // dcfg.num_attention_heads


def _kernel_label(args, dcfg) -> str:
    """The --splitkv-kernel for the start-up line; "auto" with what it resolves to on this process's device
    for the drafter's dtype and head dim (`kernels.auto_backend_text`: fa4 where FlashAttention-4 runs, else
    flex / math; staircase, chosen per step from the context size, named with its threshold where it runs)."""
    name = getattr(args, "splitkv_kernel", None) or "auto"
    if name != "auto":
        return name
    from megatron_splitkv.kernels import auto_backend_code, auto_backend_text  # noqa: PLC0415

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return f"auto -> {auto_backend_text(auto_backend_code(dev, dcfg.params_dtype, _head_dim(dcfg)))}"


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build the drafter (the trained model) and the frozen target provider (with --features-path only its
    embedding and LM head, which the drafter borrows: `_build_target`)."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron_splitkv.dflash import target_layer_ids
    from megatron_splitkv.megatron import create_cp_check_groups
    from megatron_splitkv.megatron.arguments import (kernel_backend_from_args, layer_attention_from_args,
                                                     overlap_query_gather_from_args, splitkv_config_from_args)
    from megatron_splitkv.megatron.models import DFlashDraftModel, FeatureStore

    args = get_args()
    _defaults(args)
    if not (pre_process and post_process) or args.pipeline_model_parallel_size != 1:
        raise ValueError("the DFlash drafter runs on one pipeline stage: use --pipeline-model-parallel-size 1")
    pgs = _pgs(pg_collection)
    # the CP groups' gloo mirrors (collective, every rank): the layers' per-call verdict rows go over them on the
    # host, so the rank agreement never waits for the GPU (megatron/check_groups.py)
    create_cp_check_groups(pgs.cp)
    dcfg = core_transformer_config_from_args(args)
    if getattr(args, "target_hf_path", None):  # the target's depth is its config.json's
        from megatron_splitkv.megatron.hf import read_qwen3_config

        args.target_num_layers = read_qwen3_config(args.target_hf_path)["num_hidden_layers"]
    taps = target_layer_ids(args.target_num_layers, dcfg.num_layers)
    _STATE["config"], _STATE["pgs"] = dcfg, pgs  # the data pipeline's metadata shapes; the step's CP group
    _STATE["kernel"] = kernel_backend_from_args(args)  # the layers' local kernel (the env agreement's "auto" check)
    provider = _build_target(args, dcfg.params_dtype, taps, pgs).cuda()
    if args.features_path:
        store = FeatureStore(args.features_path)
        if store.dim != provider.feature_dim:
            raise ValueError(f"--features-path has dim {store.dim}, the drafter expects {provider.feature_dim}")
        _STATE["store"] = store  # the provider holds the target's embedding / LM head only (_build_target)
    else:
        _STATE["provider"] = provider
    if not 0 <= args.mask_token_id < args.padded_vocab_size:
        raise ValueError(f"--mask-token-id {args.mask_token_id} outside the vocabulary ({args.padded_vocab_size})")
    print_rank_0(f"DFlash: target {args.target_num_layers} layers, taps {taps}, drafter {dcfg.num_layers} "
                 f"layers, B={args.dflash_block_size}, {args.dflash_num_anchors} anchors/sequence, "
                 f"CP impl {args.context_parallel_impl} ({args.cp_balance} planner, "
                 f"{_kernel_label(args, dcfg)} kernel"
                 + (f", CP ranks per node {args.splitkv_cp_ranks_per_node_auto}"
                    if getattr(args, "splitkv_cp_ranks_per_node_auto", None) else "")
                 + (f", pipeline {args.splitkv_pipeline_auto}" if getattr(args, "splitkv_pipeline_auto", None) else "")
                 + ")")
    return DFlashDraftModel(
        dcfg, num_taps=len(taps), word_embeddings=provider.word_embeddings,
        output_layer=provider.output_layer, mask_token_id=args.mask_token_id,
        block_size=args.dflash_block_size, cp_impl=args.context_parallel_impl, pg_collection=pgs, loss_group=pgs.cp,
        rotary_base=args.rotary_base, use_te=args.transformer_impl == "transformer_engine",
        kernel_backend=kernel_backend_from_args(args), overlap_query_gather=overlap_query_gather_from_args(args),
        splitkv_config=splitkv_config_from_args(args), layer_attention=layer_attention_from_args(args),
    )


def _batch_source(skip: int):
    """This DP rank's packed batches as a zero-argument callable (what the data pipeline's workers call):
    endless, deterministic, `skip` already-consumed ones left out (without building them)."""
    from megatron.core import parallel_state as ps

    from megatron_splitkv.data import ShareGPTLoader, data_parallel_batches

    args = get_args()
    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    corpus = _STATE["store"].corpus() if _STATE["store"] is not None else None
    loader = ShareGPTLoader(max_tokens=args.seq_length, num_anchors=args.dflash_num_anchors,
                            seed=args.data_seed, limit=args.sharegpt_limit, corpus=corpus,
                            cache_dir=args.sharegpt_cache_dir)
    return partial(data_parallel_batches, loader, dp, dpr, skip)


def _batches(skip: int):
    """This DP rank's packed batches, endless, deterministic; `skip` already-consumed ones first."""
    return _batch_source(skip)()


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """External data iterators (`--dataloader-type external`): one planned and sharded batch per
    micro-batch (`megatron_splitkv.data.pipeline.PlannedBatch`: this CP rank's shard, draft blocks, kv_seq /
    kv_pos and feature rows), prepared by `--dflash-data-workers` DataLoader worker processes ahead of the
    step (0: in forward_step); resumes after `args.iteration * micro-batches-per-iteration` batches."""
    args = get_args()
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from megatron_splitkv.megatron import prefetch_planned_batches, splitkv_metadata_spec
    from megatron_splitkv.data.prefetch import DevicePrefetcher
    from megatron_splitkv.megatron.arguments import (
        data_workers_from_args,
        device_prefetch_from_args,
        host_metadata_from_args,
        kernel_backend_from_args,
        layer_attention_from_args,
        splitkv_config_from_args,
    )

    skip = int(args.iteration) * get_num_microbatches()
    spec = None
    if host_metadata_from_args(args, data_workers_from_args(args)):
        if _STATE["config"] is None:
            raise ValueError("--dflash-host-metadata on: the drafter's config is unknown (model_provider runs "
                             "before the data pipeline is built); use --dflash-host-metadata off")
        # the core attention's shapes: heads split over TP as Megatron's Attention splits them
        spec = splitkv_metadata_spec(_STATE["config"], tp_size=getattr(args, "tensor_model_parallel_size", 1),
                                     kernel_backend=kernel_backend_from_args(args),
                                     cuda=_device().type == "cuda", splitkv_config=splitkv_config_from_args(args),
                                     layer_attention=layer_attention_from_args(args))
        # before any metadata is built (here or in the workers): the build reads the Split-KV environment per
        # process, so a variable malformed on one rank raised there alone while the others waited in the
        # agreement's all-gather of the first micro-batch (hang); the same ValueError on every rank instead
        _check_environment()
    it = prefetch_planned_batches(_batch_source(skip), args, mask_token_id=args.mask_token_id,
                                  gamma=args.loss_decay_gamma, feature_store=_STATE["store"],
                                  cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
                                  metadata=spec)
    where = "synchronously in forward_step (--dflash-data-workers 0)"
    if it.num_workers:
        where = (f"in {it.num_workers} DataLoader worker process(es), {it.prefetch} batch(es) ahead each"
                 + (", pinned" if it.pin_memory else ""))
    what = "plan + shard + draft blocks" + (" + feature rows" if _STATE["store"] is not None else "")
    what += " + Split-KV metadata (--dflash-host-metadata)" if spec is not None else ""
    ahead = device_prefetch_from_args(args)
    _STATE["device_prefetch"] = ahead
    where += ("; the next batch uploaded" + (" and bound" if spec is not None else "")
              + " during the forward (--dflash-device-prefetch)" if ahead else "")
    print_rank_0(f"DFlash data pipeline: {what} {where}" + (f"; resuming after {skip} batches" if skip else ""))
    return DevicePrefetcher(it, _prepare_item), None, None


train_valid_test_datasets_provider.is_distributed = True


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _cp_group():
    """The drafter's CP group (its pg_collection's, else parallel_state's): what its core attention uses."""
    pgs = _STATE["pgs"]
    if pgs is not None:
        return getattr(pgs, "cp", None)
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def _check_environment():
    """Once per process, on every CP rank: host-built metadata resolves the job's `SplitKVConfig` (num_chunks,
    chunk axis, cp_ranks_per_node) per process; ranks that differ would issue different collectives in the op
    (abort / hang), a value that does not fit the group on one rank would raise there alone: the same ValueError
    on every rank instead (`ops.check_environment_agreement`, collective)."""
    from megatron_splitkv.megatron.arguments import splitkv_config_from_args
    from megatron_splitkv.ops import check_environment_agreement

    dcfg = _STATE["config"]  # and, with --splitkv-kernel auto, what it resolves to on each rank (mixed hardware)
    check_environment_agreement(_cp_group(), _device(), dtype=dcfg.params_dtype, head_dim=_head_dim(dcfg),
                                backend=_STATE["kernel"], config=splitkv_config_from_args(get_args()))
    _STATE["env_agreed"] = True


def _prepare_item(item):
    """A host PlannedBatch (plan, shard, blocks, features, metadata) -> PreparedItem (item, its upload on the
    device (non-blocking from pinned memory), the op's keyword arguments: its Split-KV metadata bound to the CP
    group when the pipeline built it (--dflash-host-metadata; bind only attaches the group, no copy)).
    A PreparedItem pickles as its host item only (`data.prefetch.PreparedItem`: Megatron's rerun-from-checkpoint
    saves the iteration's micro-batches; the bound metadata's ProcessGroup cannot be pickled)."""
    from megatron_splitkv.data.prefetch import PreparedItem
    from megatron_splitkv.megatron import cp_check_group

    dev = item.to(_device(), non_blocking=True)
    if dev.metadata is not None and not _STATE.get("env_agreed"):
        _check_environment()
    kw = {} if dev.metadata is None else {
        "metadata": dev.metadata.bind(_cp_group(), _device(), check_group=cp_check_group(_cp_group()))}
    return PreparedItem(item, dev, kw)


def _prefetcher(data_iterator):
    """The `DevicePrefetcher` under Megatron's wrappers of the training iterator (`RerunDataIterator` keeps
    it as `.iterable`; replaying the saved micro-batches reads none of it, so prefetching stays in order)."""
    from megatron_splitkv.data.prefetch import DevicePrefetcher

    it, seen = data_iterator, 0
    while not isinstance(it, DevicePrefetcher):
        inner = getattr(it, "iterable", None)
        if inner is None or seen > 8:
            raise TypeError(f"--dflash-device-prefetch: forward_step's data iterator {type(data_iterator).__name__} "
                            "does not wrap the DevicePrefetcher that train_valid_test_datasets_provider returned")
        it, seen = inner, seen + 1
    return it


def forward_step(data_iterator, model):
    """One micro-batch: the planned and sharded batch from the data pipeline, uploaded and its metadata bound
    (`_prepare_item`; with --dflash-device-prefetch already during the previous micro-batch's forward), its
    features (feature store rows, or the online target), the drafter loss; then, with
    --dflash-device-prefetch, the next batch is prepared while the GPU runs this forward."""
    timers = get_timers()
    from megatron_splitkv.data.prefetch import UnpreparedItem

    timers("batch-generator", log_level=2).start()
    x = next(data_iterator)  # a DevicePrefetcher over the pipeline, mapping _prepare_item
    if isinstance(x, UnpreparedItem):  # replayed from a rerun checkpoint (RerunDataIterator): host item only
        x = _prepare_item(x.host)
    item, dev, kw = x
    timers("batch-generator").stop()
    if _STATE["store"] is not None:
        feats = dev.features
    else:
        feats = _STATE["provider"](dev.input_ids, dev.kv_seq, dev.kv_pos)
    out = model(feats, dev.blocks, dev.kv_seq, dev.kv_pos, **kw)
    if _STATE.get("device_prefetch"):  # the GPU has this forward queued: hide the next batch's host work
        _prefetcher(data_iterator).prefetch()
    _STATE["stats"] = {"tokens": item.num_tokens, "imbalance": item.imbalance}
    return out.loss, partial(loss_func, out)


def _validate_loss(total):
    """Megatron's --check-for-nan-in-loss-and-grad (on by default) for the loss, as its pretrain_gpt.py does:
    the rerun state machine rejects a NaN or an inf loss (a RuntimeError naming the iteration when reruns are
    disabled; a re-run to attribute the fault otherwise). Gradients: Megatron's DDP checks them (the same flag)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    sm = get_rerun_state_machine()
    sm.validate_result(result=total, rejection_func=torch.isnan, message="found NaN in the DFlash loss",
                       tolerance=0.0, fatal=True)
    sm.validate_result(result=total, rejection_func=torch.isinf, message="found Inf in the DFlash loss",
                       tolerance=0.0, fatal=True)


def loss_func(out, output_tensor):
    """Megatron's legacy 2-output loss contract: the schedule multiplies by the CP size and DDP averages
    over the DP x CP group, so the CP-summed gradient of `out.loss` (this rank's share of the
    CP-normalised loss) is restored exactly. Reported: the global loss of the micro-batch
    ([loss, 1], summed over micro-batches and DP x CP ranks), `tokens-per-sec` (context tokens of this
    micro-batch times DP over the wall time since the previous micro-batch ended, i.e. including
    backward and the optimizer step) and `planner-imbalance` (max/mean load - 1 of this micro-batch)."""
    args = get_args()
    if getattr(args, "check_for_nan_in_loss_and_grad", True):
        _validate_loss(out.total)
    st = _STATE["stats"]
    dev = output_tensor.device
    now = time.perf_counter()
    last = _STATE.get("last_time")
    _STATE["last_time"] = now
    report = {"lm loss": torch.stack([out.total.to(dev, torch.float32), torch.ones((), device=dev)]),
              "planner-imbalance": torch.tensor([st["imbalance"]], device=dev, dtype=torch.float32)}
    if last is not None:
        report["tokens-per-sec"] = torch.tensor([st["tokens"] * args.data_parallel_size / max(now - last, 1e-9)],
                                                device=dev, dtype=torch.float32)
    return output_tensor, report


def _shown_args(args) -> argparse.Namespace:
    """A copy of the parsed namespace for --parse-only, with every flag the run resolves later shown as what
    it will resolve to (`megatron_splitkv.megatron.arguments.runtime_flag_values`, and this script's
    --loss-decay-gamma / --target-* defaults) instead of None; `args` itself is not changed."""
    from megatron_splitkv.dflash import default_gamma
    from megatron_splitkv.megatron.arguments import runtime_flag_values

    shown = argparse.Namespace(**vars(args))
    for k, v in runtime_flag_values(args).items():
        setattr(shown, k, v)
    vars(shown).pop("splitkv_cp_ranks_per_node_auto", None)  # shown as splitkv_cp_ranks_per_node's value
    vars(shown).pop("splitkv_auto_fields", None)  # validate's automatic config fields: shown as the flags' values
    if getattr(args, "loss_decay_gamma", None) is None:
        shown.loss_decay_gamma = default_gamma(args.dflash_block_size)
    for t, d in (("target_ffn_hidden_size", "ffn_hidden_size"), ("target_num_attention_heads", "num_attention_heads"),
                 ("target_num_query_groups", "num_query_groups"), ("target_kv_channels", "kv_channels")):
        if getattr(args, t, None) is None:
            v, flag = getattr(args, d, None), "--" + d.replace("_", "-")
            setattr(shown, t, f"{v} ({flag})" if v is not None else f"{flag} (as Megatron resolves it)")
    return shown


def _skip_helper_build_if_prebuilt():
    """pip wheels of megatron-core ship the dataset helpers prebuilt but no Makefile, and Megatron's
    initialisation runs `make` (and exits when it fails); this script uses no Megatron dataset, so the
    build is skipped when the prebuilt module imports."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
        import megatron.core.datasets.utils as dsu
    except ImportError:
        return
    dsu.compile_helpers = lambda: None


def parse_only_verdict(args) -> str:
    """The last line of --parse-only: the verdict on the command line, one line."""
    return (f"pretrain_dflash.py --parse-only: OK, {len(vars(args))} flags parsed and validated (Megatron's parser, "
            f"validate_splitkv_args, check_dflash_args); a run needs CUDA")


def _print_help(all_flags: bool = False):
    """--help: our groups (`add_dflash_args`: Split-KV, drafter, target, data, this script), every flag with its
    default, then one line pointing to --help-all; --help-all: the same groups first, then every Megatron-LM
    flag. Both parse nothing. Help strings that argparse cannot format (megatron-core 0.19.2 has one with a
    bare '%') are escaped so that --help-all works."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(
        prog="pretrain_dflash.py", usage="%(prog)s [Megatron-LM flags] [the flags below]",
        description="DFlash drafter training (Megatron-LM pretrain, Split-KV context parallelism).",
        allow_abbrev=False, formatter_class=DefaultsHelpFormatter))
    megatron_groups = len(parser._action_groups)
    megatron_flags = len(parser._actions) - 1  # less -h
    add_dflash_args(parser)
    groups = parser._action_groups  # [positionals, options, Megatron's..., ours...]
    ours = groups[megatron_groups:]
    groups[1:] = ours + (groups[1:megatron_groups] if all_flags else [])  # options holds -h only
    fmt = parser._get_formatter()
    for action in parser._actions:
        try:
            fmt._expand_help(action)
        except (ValueError, TypeError, KeyError):
            action.help = (action.help or "").replace("%", "%%")
    parser.print_help()
    if not all_flags:
        print(f"\nMegatron-LM's own {megatron_flags} flags (--tensor-model-parallel-size, --seq-length, --save, ...): "
              "--help-all")


def main(argv=None):
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    check_launcher_ints(os.environ)  # Megatron's parser reads WORLD_SIZE / RANK with int(): no traceback
    if "-h" in sys.argv or "--help" in sys.argv or "--help-all" in sys.argv:
        _print_help(all_flags="--help-all" in sys.argv)
        return None
    if "--parse-only" in sys.argv:  # CPU check: build the parser, parse and validate the Split-KV flags
        from megatron.training.arguments import parse_args

        from megatron_splitkv.megatron import launcher_env_from, validate_splitkv_args
        from megatron_splitkv.megatron.arguments import format_parsed_args

        sys.argv.remove("--parse-only")
        args = parse_args(add_dflash_args)
        _defaults(args)
        # the same flag checks as a real run, pure Python (CPU-safe); whether Transformer Engine or
        # FlashAttention-4 is installed is a property of the training machine, not of the flags: not checked here
        validate_splitkv_args(args, have_te=True, have_fa4=True, launcher_env=launcher_env_from(os.environ))
        check_dflash_args(args)
        print(format_parsed_args(_shown_args(args)))
        print(parse_only_verdict(args))
        return args
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_splitkv.megatron import launcher_env_from, validate_splitkv_args

    args = parse_and_validate_args(
        extra_args_provider=add_dflash_args,
        args_defaults={"tokenizer_type": "NullTokenizer", "dataloader_type": "external"},
    )
    _defaults(args)
    validate_splitkv_args(args, launcher_env=launcher_env_from(os.environ))  # the launcher's processes per node
    check_dflash_args(args)
    _skip_helper_build_if_prebuilt()
    install_checkpoint_manifest(megatron_training, args)  # manifest after each save, verified before the load
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    return args


if __name__ == "__main__":
    from megatron_splitkv.megatron.arguments import SplitKVArgumentError

    try:
        main()
    except (SplitKVArgumentError, CheckpointError) as exc:  # a bad flag or a damaged --load: one line, exit 2
        print(f"pretrain_dflash.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
