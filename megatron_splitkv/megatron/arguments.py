"""Command-line flags of the Split-KV backend for Megatron-LM, and their validation.

Use `add_splitkv_args` as (or inside) Megatron's `extra_args_provider`:

    from megatron.training import pretrain
    from megatron_splitkv.megatron import add_splitkv_args, validate_splitkv_args
    pretrain(..., extra_args_provider=add_splitkv_args)
    # after parse: validate_splitkv_args(get_args()); splitkv_config_from_args(get_args()) is the op's
    # SplitKVConfig, for get_dflash_layer_spec(splitkv_config=...) and the host-built metadata

Flags (skipped when the parser already defines them, e.g. after applying `patches/`):
    --context-parallel-impl {splitkv,allgather-kv,ring-kv}  CP algorithm of the DFlash attention
                                                            (default None = Megatron's native CP)
    --cp-chunk-size N        planner chunk size in tokens (default: auto)
    --cp-balance {lpt,contiguous,zigzag,hypergraph}         context sharding strategy (default lpt)
    --dflash-block-size B    draft block size (default 16)
    --dflash-num-anchors N   query budget: anchors (blocks) per sequence (default 512)
    (`aliases=` adds other spellings of a flag to ITS action, e.g. examples/pretrain_dflash.py's
    --num-anchors / --block-size: one option, one help text, one default)
    --splitkv-no-overlap-q-gather  issue Split-KV's query all-gather inside the attention op, after the
                             k/v projections, instead of before them (A/B of docs/lab/perf-notes.md item 3;
                             default: overlapped; SplitKVConfig.overlap_q_gather)
    --splitkv-kernel {auto,math,flex,te,staircase,fa4}  local attention kernel of the CP op (`backend=`,
                             the layer spec's `kernel_backend`; default auto = fa4 where FlashAttention-4
                             is installed (Hopper, bf16 / fp16), else staircase on CUDA from
                             32K context keys per call, else flex on CUDA; see docs/kernels.md)
    --splitkv-cp-ranks-per-node L  CP ranks per node of the two-level all-to-all (divides the CP size;
                             SplitKVConfig.cp_ranks_per_node; default: automatic from the launcher's processes per node / TP when the CP group spans
                             nodes (`auto_cp_ranks_per_node`), else 1)
    --splitkv-num-chunks N   query chunks of Split-KV's merge pipeline (SplitKVConfig.num_chunks)
    --splitkv-chunk-axis {rows,heads}  what the chunks split (SplitKVConfig.chunk_axis)
                             (these two unset: 2 head chunks when the CP
                             group spans nodes, else the op's defaults: `auto_pipeline`)
    --dflash-data-workers N  worker processes of the data pipeline that plan and shard each batch ahead of
                             the step (torch DataLoader; default 1 on CUDA, 0 without; 0 = synchronous,
                             in forward_step; at most MAX_DATA_WORKERS = 32 per rank)
    --dflash-data-prefetch N batches each data worker prepares ahead (DataLoader prefetch_factor; default 2)
    --dflash-host-metadata {on,off}  build the Split-KV attention metadata in the data workers from the plan
                             (the step binds it); default on with splitkv and data workers > 0; "on" with
                             --dflash-data-workers 0: the synchronous pipeline builds it on the host in
                             forward_step (as DataLoader num_workers=0 runs the same work in the main process)
    --dflash-device-prefetch {on,off}  upload the next batch (and bind its metadata) while the current
                             step's forward runs, one batch ahead; default on
    --dflash-layer-types T,T,...  attention type of each drafter layer, full_attention or sliding_attention
                             (one per --num-layers; default: all full_attention), as dflash's config.layer_types
    --dflash-sliding-window W  window of the sliding_attention layers (int >= 1; required with any)
    --dflash-is-causal {true,false}  dflash's config.is_causal (default unset: causal exactly for the
                             sliding layers); `layer_attention_from_args` gives each layer's (window, causal)

Source: DESIGN.md sections 3-4; arXiv 2611.05926.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from typing import Optional

import torch

from .._ints import _shown, as_int, int_arg, parse_int
from ..config import CHUNK_AXES, SplitKVConfig
from ..kernels import fa4 as fa4_kernel  # `fa4_available` finds flash_attn.cute without importing CuTe DSL
from ..layer_types import LAYER_TYPES, MAX_WINDOW, layer_attention_kinds, layer_windows
from ..planning import CostModel

__all__ = [
    "CP_IMPLS",
    "CP_BALANCE",
    "SplitKVArgumentError",
    "add_splitkv_args",
    "validate_splitkv_args",
    "check_attention_heads",
    "overlap_query_gather_from_args",
    "KERNEL_BACKENDS",
    "kernel_backend_from_args",
    "data_workers_from_args",
    "data_prefetch_from_args",
    "host_metadata_from_args",
    "HOST_METADATA_CHOICES",
    "device_prefetch_from_args",
    "DEVICE_PREFETCH_CHOICES",
    "MAX_DATA_WORKERS",
    "format_parsed_args",
    "runtime_flag_values",
    "auto_cp_ranks_per_node",
    "auto_pipeline",
    "LOCAL_SIZE_ENVS",
    "WORLD_SIZE_ENV",
    "check_world_size",
    "check_launcher_ints",
    "launcher_env_from",
    "layer_attention_from_args",
    "planner_cost_model_from_args",
]

CP_IMPLS = ("splitkv", "allgather-kv", "ring-kv")
CP_BALANCE = ("lpt", "contiguous", "zigzag", "hypergraph")
# the op's local kernels (`megatron_splitkv.kernels.BACKENDS`; kept literal so parsing imports no torch)
KERNEL_BACKENDS = ("auto", "math", "flex", "te", "staircase", "fa4")
#: the pipeline's flags: (args attribute, flag, the `SplitKVConfig` field it sets, the op's default)
_PIPELINE_FLAGS = (("splitkv_num_chunks", "--splitkv-num-chunks", "num_chunks", 1),
                   ("splitkv_chunk_axis", "--splitkv-chunk-axis", "chunk_axis", "rows"))
# upper bound of --dflash-data-workers, per rank: every worker is a process holding `prefetch` batches in
# pinned host memory, and one keeps the step fed (docs/benchmarks.md "Training-step overhead"); with 8 ranks
# per node 32 is already 256 processes. A fixed number, not os.cpu_count(): --parse-only checks a command
# line on another machine than the training one.
MAX_DATA_WORKERS = 32


class SplitKVArgumentError(ValueError):
    """A bad flag combination; the message names the offending flag(s)."""


def _as_int(value, flag: str) -> int:
    """value as an int (any `__index__` integer; a bool, float or string is a SplitKVArgumentError
    naming `flag`)."""
    return as_int(value, flag, what="an integer", error=SplitKVArgumentError)


def _int_arg(args, attr: str, flag: str, default, minimum: int):
    """args.<attr> checked as an int >= minimum; unset (missing or None) gives `default`. No `x or 1`
    coercion: 0 and negative values are errors showing the value given."""
    value = getattr(args, attr, None)
    if value is None:
        return default
    value = _as_int(value, flag)
    if value < minimum:
        raise SplitKVArgumentError(f"{flag} must be >= {minimum}, got {value}")
    return value


def check_attention_heads(num_attention_heads: int, num_query_groups, tp_size: int) -> None:
    """Raise SplitKVArgumentError unless the DFlash head split under TP is well defined.

    Requires `num_attention_heads % tp_size == 0`, `num_query_groups % tp_size == 0` (each TP rank
    holds whole kv heads; kv-head replication for num_query_groups < TP is not supported) and
    `num_attention_heads % num_query_groups == 0`. `num_query_groups=None` means MHA (= heads).
    Case C7: H=12, Hkv=3, TP=2 fails here, at construction, naming `--num-query-groups`."""
    h = _as_int(num_attention_heads, "--num-attention-heads")
    g = h if num_query_groups is None else _as_int(num_query_groups, "--num-query-groups")
    tp = _as_int(tp_size, "--tensor-model-parallel-size")
    if h < 1:
        raise SplitKVArgumentError(f"--num-attention-heads must be >= 1, got {h}")
    if tp < 1:
        raise SplitKVArgumentError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if h % tp:
        raise SplitKVArgumentError(
            f"--num-attention-heads ({h}) must be divisible by --tensor-model-parallel-size ({tp})"
        )
    if g < 1 or h % g:
        raise SplitKVArgumentError(
            f"--num-attention-heads ({h}) must be a multiple of --num-query-groups ({g})"
        )
    if g % tp:
        raise SplitKVArgumentError(
            f"--num-query-groups ({g}) must be divisible by --tensor-model-parallel-size ({tp}) for the "
            "Split-KV DFlash attention (each TP rank must hold whole kv heads; config.num_query_groups="
            f"{g}, tensor_model_parallel_size={tp})"
        )


def _has(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions  # noqa: SLF001 - argparse has no public query


def _add_aliases(parser: argparse.ArgumentParser, flag: str, aliases) -> None:
    """Make each of `aliases` another spelling of the existing option `flag` (the same argparse action: one
    help text, one default, one dest). For a flag the parser had before `add_splitkv_args` (e.g. from a
    patched Megatron-LM), where the alias cannot go into the `add_argument` call. ValueError naming the
    alias when it is already an option of another action."""
    action = parser._option_string_actions[flag]  # noqa: SLF001 - argparse has no public alias API
    for alias in aliases:
        other = parser._option_string_actions.get(alias)  # noqa: SLF001
        if other is action:
            continue
        if other is not None:
            raise ValueError(f"cannot make {alias} an alias of {flag}: it is already the option "
                             f"{'/'.join(other.option_strings)}")
        action.option_strings.append(alias)
        parser._option_string_actions[alias] = action  # noqa: SLF001


def _checked_aliases(parser: argparse.ArgumentParser, aliases) -> dict:
    """`aliases` of `add_splitkv_args` as {flag: tuple of option strings}, checked before the parser is touched:
    a dict; each value one option string or an iterable of them; each an option string argparse takes (starts
    with one of the parser's prefix characters, e.g. '--num-anchors'). A bare string is one alias (iterating
    it would give one alias per character). ValueError naming the flag and the alias otherwise."""
    if aliases is None:
        return {}
    if not isinstance(aliases, dict):
        raise ValueError(f"add_splitkv_args: aliases must be a dict {{flag: (other spelling, ...)}}, got "
                         f"{type(aliases).__name__}")
    out = {}
    for flag, extra in aliases.items():
        if isinstance(extra, str):
            extra = (extra,)
        try:
            extra = tuple(extra)
        except TypeError:
            raise ValueError(f"add_splitkv_args: aliases[{flag!r}] must be an option string or a tuple of them, "
                             f"got {extra!r}") from None
        for alias in extra:
            if not isinstance(alias, str) or len(alias) < 2 or alias[0] not in parser.prefix_chars \
                    or any(c.isspace() for c in alias):
                raise ValueError(f"add_splitkv_args: alias {alias!r} of {flag} must be an option string such as "
                                 f"'--num-anchors' (starting with {parser.prefix_chars!r}, no spaces)")
        out[flag] = extra
    return out


#: values of --dflash-host-metadata
HOST_METADATA_CHOICES = ("on", "off")

#: values of --dflash-device-prefetch
DEVICE_PREFETCH_CHOICES = ("on", "off")

#: values of --dflash-is-causal
IS_CAUSAL_CHOICES = ("true", "false")


def _layer_types_arg(text: str) -> tuple:
    """argparse `type=` of --dflash-layer-types: a comma-separated list of LAYER_TYPES (spaces around commas
    allowed); a bad entry is argparse's error line naming the flag."""
    types = tuple(t.strip() for t in str(text).split(","))
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of {' / '.join(LAYER_TYPES)} (one per "
                                         f"--num-layers), got {_shown(bad[0])} in {_shown(text)}")
    return types

#: the plugin's own flags, added by `add_splitkv_args` where the parser does not have them: (flag, add_argument kwargs)
_FLAG_SPECS = (
    ("--context-parallel-impl", dict(
        type=str,
        default=None,
        choices=CP_IMPLS,
        help="Context-parallel algorithm of the DFlash drafter attention: splitkv (query-sized "
             "communication, arXiv 2611.05926), allgather-kv or ring-kv (baselines). Default: %(default)s "
             "(a parser where it is unset, None: Megatron's native context parallelism).")),
    ("--cp-chunk-size", dict(
        type=int_arg(),
        default=None,
        help="Context chunk size (tokens) of the CP planner; default: chosen automatically.")),
    ("--cp-balance", dict(
        type=str,
        default="lpt",
        choices=CP_BALANCE,
        help="How context chunks are assigned to CP ranks (default lpt).")),
    ("--dflash-block-size", dict(
        type=int_arg(),
        default=16,
        help="DFlash draft block size B: tokens per draft block, >= 2 (default 16).")),
    ("--dflash-num-anchors", dict(
        type=int_arg(),
        default=512,
        help="DFlash query budget: anchors (query blocks) per sequence (default 512).")),
    ("--splitkv-no-overlap-q-gather", dict(
        action="store_true",
        default=None,
        help="Split-KV: do not start the query all-gather before the key/value projections (it then "
             "runs inside the attention op, exposed; SplitKVConfig.overlap_q_gather=False). Default: overlapped. "
             "For A/B measurements; results are identical.")),
    ("--splitkv-cp-ranks-per-node", dict(
        type=int_arg(),
        default=None,
        help="Split-KV: CP ranks per node (L) for the two-level all-to-all of the output merge and the dQ "
             "exchange (within a node over NVLink, then fp32 node partials between nodes: ~4x fewer NIC bytes "
             "at L=8). Must divide --context-parallel-size (values >= it are clamped to it); 1 or the CP size = "
             "one all-to-all. Usually the "
             "GPUs per node / --tensor-model-parallel-size (SplitKVConfig.cp_ranks_per_node). Default: automatic: "
             "the launcher's processes per node (LOCAL_WORLD_SIZE, "
             "SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE) / TP when the CP group spans whole nodes, else 1 (auto_cp_ranks_per_node). "
             "docs/lab/perf-notes.md item 9.")),
    ("--splitkv-num-chunks", dict(
        type=int_arg(),
        default=None,
        help="Split-KV: chunks of the merge pipeline (a positive int; chunk c's [O | lse] and dQ exchanges "
             "overlap chunk c+1's local kernel); the op clamps it to the query blocks per rank, or with "
             "--splitkv-chunk-axis heads to the kv heads per TP rank (SplitKVConfig.num_chunks). "
             "Default: automatic (auto_pipeline): 2 head chunks when the CP group spans "
             "nodes and each TP rank holds >= 2 kv heads, else 1. docs/lab/perf-notes.md items 2, 21, 25.")),
    ("--splitkv-chunk-axis", dict(
        type=str,
        default=None,
        choices=CHUNK_AXES,
        help="Split-KV: what the pipeline's chunks split: rows (query blocks of every rank) or heads (kv "
             "heads, whole GQA groups, of all rows; SplitKVConfig.chunk_axis). Default: automatic (heads with "
             "the automatic 2 chunks, else rows).")),
    ("--splitkv-kernel", dict(
        type=str,
        default="auto",
        choices=KERNEL_BACKENDS,
        help="Local attention kernel of the context-parallel DFlash attention (the op's backend=): "
             "auto (fa4 where FlashAttention-4 is installed on a Hopper GPU and not in "
             "deterministic mode, else staircase on CUDA from 32K context keys per call, else FlexAttention "
             "on CUDA, math otherwise), math, flex, te (Transformer Engine), staircase (dense cuDNN "
             "rectangles + flex remainder) or fa4 (FlashAttention-4, extra 'fa4'). Default auto; see "
             "docs/kernels.md.")),
    ("--dflash-data-workers", dict(
        type=int_arg(),
        default=None,
        help="Worker processes (torch DataLoader) of the DFlash data pipeline: they compute each packed "
             "batch's CP plan, this rank's shard, draft blocks and feature rows ahead of the training step, in "
             "pinned memory; the step only uploads them. 0 = synchronous (planned and sharded in forward_step, "
             "on the step's critical path). Default: 1 when CUDA is available, else 0. At most %d per rank." % MAX_DATA_WORKERS)),
    ("--dflash-data-prefetch", dict(
        type=int_arg(),
        default=None,
        help="Batches each data-pipeline worker prepares ahead (the DataLoader's prefetch_factor, >= 1; "
             "default 2). Host memory: about workers x prefetch + 2 prepared batches (offline feature rows).")),
    ("--dflash-host-metadata", dict(
        type=str,
        default=None,
        choices=HOST_METADATA_CHOICES,
        help="Build each batch's Split-KV attention metadata (key intervals, chunk masks, FlexAttention "
             "block tables) in the data pipeline's workers from the plan, on the host, instead of in the first "
             "drafter layer of the step (collectives + host syncs + BlockMask build); the step only binds it to "
             "the CP group (no copy beyond the batch's upload). Only with --context-parallel-impl splitkv. "
             "Default: on with --context-parallel-impl splitkv and --dflash-data-workers > 0, else off. 'on' with "
             "--dflash-data-workers 0 is the synchronous mode: the same metadata is built on the host in "
             "forward_step, on the step's critical path (debugging / A/B; as a DataLoader with num_workers=0 "
             "does its workers' work in the main process).")),
    ("--dflash-device-prefetch", dict(
        type=str,
        default=None,
        choices=DEVICE_PREFETCH_CHOICES,
        help="Take the next batch from the data pipeline, upload it (non-blocking) and bind its Split-KV "
             "metadata right after the current micro-batch's forward is issued, while the GPU runs it, instead "
             "of at the start of the next step where the GPU waits for the host "
             "(megatron_splitkv.data.prefetch.DevicePrefetcher; docs/lab/perf-notes.md item 16). Holds one more "
             "batch on the device (the upload set: ids, blocks, metadata; with a feature store its rows). "
             "Default: on.")),
    ("--dflash-layer-types", dict(
        type=_layer_types_arg,
        default=None,
        help="Attention type of each drafter layer, comma-separated, one per --num-layers: full_attention "
             "(context before the anchor, bidirectional block) or sliding_attention (the last "
             "--dflash-sliding-window positions, causal block), as the layer_types of dflash's drafter config "
             "(written to the exported config.json). Default: every layer full_attention.")),
    ("--dflash-sliding-window", dict(
        type=int_arg(1, MAX_WINDOW, what="a positive int < 2**63"),
        default=None,
        help="Sliding window W of the sliding_attention layers (an int >= 1): the query at position q sees "
             "keys at positions > q - W (dflash's config.sliding_window). Required when --dflash-layer-types "
             "has a sliding_attention layer, refused otherwise.")),
    ("--dflash-is-causal", dict(
        type=str,
        default=None,
        choices=IS_CAUSAL_CHOICES,
        help="dflash's config.is_causal: true = every layer causal inside the draft block, false = none. "
             "Default: unset (sliding_attention layers causal, full_attention layers bidirectional).")),
)


def add_splitkv_args(parser: argparse.ArgumentParser, *, aliases: Optional[dict] = None) -> argparse.ArgumentParser:
    """Add the Split-KV flags (see module docstring) to `parser` and return it (Megatron's
    `extra_args_provider` contract). Idempotent: flags the parser already has are skipped.

    `aliases`: {flag: (other spelling, ...)} for flags of this function, e.g. {"--dflash-num-anchors":
    ("--num-anchors",)}: the other spellings become option strings of the SAME action (one help text, one
    default, listed together by --help), never a second action with the same dest. A value may be one option
    string or a tuple of them. ValueError (before the parser is changed) for an alias that is not an option
    string ('--x'), and for a key that is not an option of the parser or an alias that is already another
    option (argparse.ArgumentError when the parser had it before this call)."""
    aliases = _checked_aliases(parser, aliases)
    group = parser.add_argument_group(title="split-kv context parallelism")
    names = {}  # flag -> its option strings for add_argument

    def spellings(flag):
        return (flag, *names.setdefault(flag, tuple(aliases.get(flag, ()))))
    for flag, kwargs in _FLAG_SPECS:
        if not _has(parser, flag):
            group.add_argument(*spellings(flag), **kwargs)
    for flag, extra in aliases.items():
        if not _has(parser, flag):
            raise ValueError(f"add_splitkv_args: aliases key {flag!r} is not an option of the parser")
        if flag not in names:  # the parser had it before: attach the other spellings to its action
            _add_aliases(parser, flag, extra)
    return parser


def device_prefetch_from_args(args) -> bool:
    """Whether forward_step prepares the next batch during the current forward (`--dflash-device-prefetch`,
    unset/None = on); SplitKVArgumentError naming the flag for any value other than "on" / "off"."""
    value = getattr(args, "dflash_device_prefetch", None)
    if value is None:
        return True
    if value not in DEVICE_PREFETCH_CHOICES:
        raise SplitKVArgumentError(f"--dflash-device-prefetch must be one of {DEVICE_PREFETCH_CHOICES}, "
                                   f"got {value!r}")
    return value == "on"


def host_metadata_from_args(args, num_workers: Optional[int] = None) -> bool:
    """Whether the data pipeline builds the Split-KV metadata (`--dflash-host-metadata`): unset/None = on when
    --context-parallel-impl is splitkv and the pipeline has workers (`num_workers`, default
    `data_workers_from_args`), else off. SplitKVArgumentError naming the flag for an unknown value, or for
    "on" with another --context-parallel-impl (the baselines' metadata needs the other ranks' context)."""
    value = getattr(args, "dflash_host_metadata", None)
    impl = getattr(args, "context_parallel_impl", None)
    if value is None:
        workers = data_workers_from_args(args) if num_workers is None else num_workers
        return impl == "splitkv" and workers > 0
    if value not in HOST_METADATA_CHOICES:
        raise SplitKVArgumentError(f"--dflash-host-metadata must be one of {HOST_METADATA_CHOICES}, got {value!r}")
    if value == "on" and impl != "splitkv":
        raise SplitKVArgumentError(f"--dflash-host-metadata on needs --context-parallel-impl splitkv (got {impl}): "
                                   "the baselines prepare their metadata in the step; use --dflash-host-metadata off")
    return value == "on"


def data_workers_from_args(args) -> int:
    """Data-pipeline worker processes from `--dflash-data-workers` (unset/None: 1 when CUDA is available,
    else 0); SplitKVArgumentError naming the flag for a non-integer value, a negative one or one above
    MAX_DATA_WORKERS (32)."""
    value = getattr(args, "dflash_data_workers", None)
    if value is None:
        return 1 if torch.cuda.is_available() else 0
    value = _as_int(value, "--dflash-data-workers")
    if value < 0:
        raise SplitKVArgumentError(f"--dflash-data-workers must be >= 0 (0 = synchronous), got {value}")
    if value > MAX_DATA_WORKERS:
        raise SplitKVArgumentError(f"--dflash-data-workers must be at most {MAX_DATA_WORKERS} (worker processes per "
                                   f"rank, each holding --dflash-data-prefetch batches in pinned memory), got {value}")
    return value


def runtime_flag_values(args) -> dict:
    """What each Split-KV / data-pipeline flag left unset (None after parsing) resolves to at run time, for
    `--parse-only` and logs: {args attribute: value}. A value that depends on the training machine is a
    string 'auto (-> X on CUDA, Y on CPU)'; the others are the value itself. Flags set on the command line
    are not listed, except `--dflash-host-metadata on` with `--dflash-data-workers 0`, shown as
    'on (synchronous: ...)' (the metadata is then built on the host in forward_step). Pure: reads
    `validate_splitkv_args`' records of its automatic choices, imports nothing, never checks for CUDA.
    Values are not validated here (`validate_splitkv_args` does that)."""
    out = {}
    impl = getattr(args, "context_parallel_impl", None)
    workers = getattr(args, "dflash_data_workers", None)
    if workers is None:
        out["dflash_data_workers"] = "auto (-> 1 on CUDA, 0 on CPU)"
    if getattr(args, "dflash_data_prefetch", None) is None:
        out["dflash_data_prefetch"] = 2
    host = getattr(args, "dflash_host_metadata", None)
    if host is None:
        if impl != "splitkv":
            out["dflash_host_metadata"] = "off"
        elif workers is None:
            out["dflash_host_metadata"] = "auto (-> on on CUDA, off on CPU)"
        else:
            out["dflash_host_metadata"] = "on" if workers > 0 else "off"
    elif host == "on" and workers == 0:
        out["dflash_host_metadata"] = "on (synchronous: built on the host in forward_step, --dflash-data-workers 0)"
    if getattr(args, "dflash_device_prefetch", None) is None:
        out["dflash_device_prefetch"] = "on"
    if getattr(args, "splitkv_no_overlap_q_gather", None) is None:
        out["splitkv_no_overlap_q_gather"] = False
    if getattr(args, "splitkv_cp_ranks_per_node", None) is None:
        auto = getattr(args, "splitkv_cp_ranks_per_node_auto", None)
        out["splitkv_cp_ranks_per_node"] = auto or ("auto (launcher's processes per node / TP when the CP group "
                                                    "spans nodes, else 1)")
    auto, chosen = getattr(args, "splitkv_pipeline_auto", None), getattr(args, "splitkv_auto_fields", None) or {}
    for attr, _, name, default in _PIPELINE_FLAGS:
        if getattr(args, attr, None) is not None:
            continue
        if auto:
            out[attr] = f"auto -> {chosen.get(name, default)} (splitkv_pipeline_auto)"
        else:
            out[attr] = f"auto (automatic pipeline across nodes, else {default})"
    if getattr(args, "cp_chunk_size", None) is None:
        out["cp_chunk_size"] = "auto (per batch: planning.auto_chunk_size)"
    if getattr(args, "splitkv_kernel", None) is None:
        out["splitkv_kernel"] = "auto"
    return out


def format_parsed_args(args) -> str:
    """The text `--parse-only` prints: one `name = value` line per attribute of the namespace `args` (an
    argparse.Namespace, or a dict), sorted by name; values as repr() (strings quoted, so that None and
    'None' differ). No trailing newline."""
    values = args if isinstance(args, dict) else vars(args)
    return "\n".join(f"{name} = {values[name]!r}" for name in sorted(values))


def layer_attention_from_args(args):
    """Each drafter layer's (window, causal) from `--dflash-layer-types`, `--dflash-sliding-window`,
    `--dflash-is-causal` and `--num-layers` (`layer_types.layer_attention_kinds`: dflash's rule), or None when
    none of the three is set (every layer full attention, non-causal: the ops' default). SplitKVArgumentError
    naming the flag: a layer count other than --num-layers, a sliding layer without a window, a window
    without a sliding layer, an unknown type or value."""
    types = getattr(args, "dflash_layer_types", None)
    window = getattr(args, "dflash_sliding_window", None)
    causal = getattr(args, "dflash_is_causal", None)
    if types is None and window is None and causal is None:
        return None
    if isinstance(types, str):
        try:
            types = _layer_types_arg(types)
        except argparse.ArgumentTypeError as exc:
            raise SplitKVArgumentError(f"--dflash-layer-types {exc}") from None
    if causal is not None and causal not in IS_CAUSAL_CHOICES:
        raise SplitKVArgumentError(f"--dflash-is-causal must be one of {IS_CAUSAL_CHOICES}, got {_shown(causal)}")
    layers = getattr(args, "num_layers", None)
    if layers is None:
        layers = len(types) if types is not None else 1
    names = {"layer_types": "--dflash-layer-types", "sliding_window": "--dflash-sliding-window",
             "is_causal": "--dflash-is-causal", "num_layers": "--num-layers"}
    try:
        return layer_attention_kinds(types, num_layers=layers, sliding_window=window,
                                     is_causal=None if causal is None else causal == "true", names=names)
    except ValueError as exc:
        raise SplitKVArgumentError(str(exc)) from None


def planner_cost_model_from_args(args):
    """The planner's `CostModel` of a drafter job: default coefficients, `layer_windows` from the layer types
    (`layer_attention_from_args`); None (the planner's default) when no layer has a window."""
    windows = layer_windows(layer_attention_from_args(args))
    if windows is None:
        return None
    return CostModel(layer_windows=windows)


def data_prefetch_from_args(args) -> int:
    """Batches each data worker prepares ahead, from `--dflash-data-prefetch` (unset/None: 2);
    SplitKVArgumentError naming the flag for a non-integer value or one < 1."""
    return _int_arg(args, "dflash_data_prefetch", "--dflash-data-prefetch", 2, 1)


def kernel_backend_from_args(args) -> str:
    """`kernel_backend` for `get_dflash_layer_spec` / `DFlashDraftModel` from parsed args:
    `--splitkv-kernel` (unset/None = "auto"); SplitKVArgumentError naming the flag for an unknown value."""
    value = getattr(args, "splitkv_kernel", None)
    if value is None:
        return "auto"
    if value not in KERNEL_BACKENDS:
        raise SplitKVArgumentError(f"--splitkv-kernel must be one of {KERNEL_BACKENDS}, got {value!r}")
    return value


def overlap_query_gather_from_args(args):
    """`overlap_query_gather` for `get_dflash_layer_spec` / `DFlashDraftModel` from parsed args: False
    with `--splitkv-no-overlap-q-gather`, else None (the layer's `SplitKVConfig` decides, default on)."""
    return False if getattr(args, "splitkv_no_overlap_q_gather", None) else None


def splitkv_config_from_args(args) -> SplitKVConfig:
    """The op's `SplitKVConfig` of a Megatron job: the one `validate_splitkv_args` built from the flags and its
    automatic choices (args.splitkv_config), else one built from the flags alone (no automatic choice).
    It goes to the layer spec (`get_dflash_layer_spec(splitkv_config=)`), the host-built metadata
    (`splitkv_metadata_spec`) and `check_environment_agreement`. SplitKVArgumentError naming a bad flag."""
    config = getattr(args, "splitkv_config", None)
    if isinstance(config, SplitKVConfig):
        return config
    return _config_from_flags(args, None, {})


def _config_from_flags(args, ranks_per_node, auto_fields: dict) -> SplitKVConfig:
    """SplitKVConfig of the flags (--splitkv-num-chunks, --splitkv-chunk-axis, --splitkv-no-overlap-q-gather),
    `ranks_per_node` (L, None: unset) and the automatic choices `auto_fields` (for unset flags only)."""
    chunks = _int_arg(args, "splitkv_num_chunks", "--splitkv-num-chunks", None, 1)
    axis = getattr(args, "splitkv_chunk_axis", None)
    if axis is not None and axis not in CHUNK_AXES:
        raise SplitKVArgumentError(f"--splitkv-chunk-axis must be one of {CHUNK_AXES}, got {axis!r}")
    fields = dict(auto_fields)
    fields.update({k: v for k, v in (("num_chunks", chunks), ("chunk_axis", axis)) if v is not None})
    try:
        return SplitKVConfig(cp_ranks_per_node=ranks_per_node,
                             overlap_q_gather=not getattr(args, "splitkv_no_overlap_q_gather", None), **fields)
    except ValueError as exc:
        raise SplitKVArgumentError(str(exc)) from exc


def _te_available() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception:  # pragma: no cover - megatron import failure
        return importlib.util.find_spec("transformer_engine") is not None
    return bool(HAVE_TE)


def _fa4_available() -> bool:
    return fa4_kernel.fa4_available()


#: the launcher's processes per node, in the order they are read by `auto_cp_ranks_per_node`: torchrun / torch
#: elastic's LOCAL_WORLD_SIZE, then Slurm's SLURM_NTASKS_PER_NODE and SLURM_TASKS_PER_NODE ("8", "8(x4)", or a
#: list such as "8(x2),4": `_per_node_counts`)
LOCAL_SIZE_ENVS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
#: the launcher's total process count: torchrun's WORLD_SIZE, the variable Megatron's parser reads into
#: args.world_size (checked against TP x PP x CP by `validate_splitkv_args`)
WORLD_SIZE_ENV = "WORLD_SIZE"
_PER_NODE_ITEM = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


def launcher_env_from(environ) -> dict:
    """The launcher's variables of `environ` (a mapping: the entry script passes its process environment),
    {name: text} for the names of `LOCAL_SIZE_ENVS` (processes per node) and `WORLD_SIZE_ENV` (processes in all)
    it holds: the `launcher_env` argument of `validate_splitkv_args`. The library itself reads no environment
    variable."""
    return {name: environ[name] for name in (*LOCAL_SIZE_ENVS, WORLD_SIZE_ENV) if name in environ}


#: the launcher's variables Megatron-LM's parser (megatron/training/arguments.py) converts with int() when it is
#: built and when it parses (WORLD_SIZE default "1", RANK default "0"), with the smallest value each may take
MEGATRON_INT_ENVS = {WORLD_SIZE_ENV: 1, "RANK": 0}


def check_launcher_ints(environ) -> None:
    """Raise SplitKVArgumentError naming the variable when one of `MEGATRON_INT_ENVS` is in `environ` (a
    mapping: the entry script passes its process environment) but not a plain decimal >= its minimum
    (`parse_int`; an empty value included). Megatron-LM's parser reads them with int() and would end in a
    ValueError traceback (or, for "+8" or "８", take a value our checks refuse); the entry script calls this
    before building the parser."""
    for name, minimum in MEGATRON_INT_ENVS.items():
        if name in environ:
            parse_int(str(environ[name]), f"the launcher's {name}", minimum=minimum, error=SplitKVArgumentError)


def check_world_size(tp: int, pp: int, cp: int, launcher_env=None) -> None:
    """Raise SplitKVArgumentError unless the launcher's world size (`WORLD_SIZE_ENV` of `launcher_env`, a
    {name: text} mapping; absent, empty or None: not checked) is a multiple of TP x PP x CP, i.e. unless
    --context-parallel-size `cp` divides world size / (TP x PP) (Megatron's data-parallel size is the quotient).
    The message names the flags and the numbers. A WORLD_SIZE that is not a plain positive decimal is an error
    naming it."""
    raw = str((launcher_env or {}).get(WORLD_SIZE_ENV, "") or "").strip()
    if not raw:
        return
    world = parse_int(raw, f"the launcher's {WORLD_SIZE_ENV}", minimum=1, error=SplitKVArgumentError)
    if world % (tp * pp * cp) == 0:  # cp divides world / (tp x pp)
        return
    raise SplitKVArgumentError(
        f"--context-parallel-size ({cp}) must divide the launcher's {WORLD_SIZE_ENV} ({world}) / "
        f"(--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp})): {world} processes "
        f"do not split into groups of TP x PP x CP = {tp * pp * cp}"
    )


def _per_node_counts(raw: str, name: str) -> tuple:
    """The distinct ranks-per-node counts of a launcher size text, sorted: "8" or "8(x4)" -> (8,), Slurm's
    heterogeneous "8(x2),4" (two nodes of 8 ranks, one of 4) -> (4, 8). The text is a comma-separated list of
    `N` or `N(xK)` (N ranks on each of K nodes), N and K plain ASCII decimals >= 1 (`parse_int`); ValueError
    naming `name` otherwise."""
    counts = set()
    for item in raw.strip().split(","):
        m = _PER_NODE_ITEM.fullmatch(item.strip())
        if m is None:
            raise ValueError(f"{name} must be N, N(xK) or a comma-separated list of them, got {_shown(raw)}")
        if m.group(2) is not None:
            parse_int(m.group(2), name, minimum=1)  # K nodes
        counts.add(parse_int(m.group(1), name, minimum=1))
    return tuple(sorted(counts))


def auto_cp_ranks_per_node(tp: int, cp: int, launcher_env=None):
    """The CP ranks per node L of Split-KV's two-level all-to-all when `--splitkv-cp-ranks-per-node` is
    unset: (L, why), L = 1 when the two-level path does not apply.

    Megatron's rank order puts the CP dimension right after TP (tp-cp-ep-dp-pp, and tp-cp-ep-pp-dp), and
    launchers give each node a contiguous block of global ranks, so with n processes per node (the first of
    `LOCAL_SIZE_ENVS` that is a positive int) a CP group of size cp covers whole nodes of L = n / tp of its
    ranks when tp divides n, 1 < L < cp and L divides cp: then the all-to-all of the output merge and the dQ
    exchange runs in two stages (NVLink inside the node, fp32 node partials between nodes; docs/lab/perf-notes.md
    items 9 and 18; simulated at CP 64 on 8-GPU nodes: 90-92% weak-scaling efficiency against 81% with one
    all-to-all, docs/benchmarks.md twelfth run). A group within one node (cp <= n / tp), an unknown or
    malformed launcher size, a heterogeneous one (Slurm's "8(x2),4": nodes of different sizes), tp not
    dividing n, or L not dividing cp: L = 1 (one all-to-all, as before).
    Exact either way (the same sums in fp32); only the schedule changes. `launcher_env`: the launcher's
    variables, a mapping of `LOCAL_SIZE_ENVS` names to their text, read by the caller (the entry script) from
    its process environment (None or {}: no launcher size, L = 1). Every rank of a homogeneous job
    computes the same L; should ranks differ, the op's per-step agreement check raises naming
    cp_ranks_per_node (no hang)."""
    L, why = _cp_ranks_per_node(tp, cp, launcher_env)
    if L is None:
        return 1, why
    if L <= 1:
        return 1, f"{why}: 1 CP rank per node (one all-to-all)"
    if cp % L:
        return 1, f"{why}: {L} CP ranks per node do not divide --context-parallel-size {cp}"
    return L, why


def _cp_ranks_per_node(tp: int, cp: int, launcher_env=None):
    """(L, src) with L = the launcher's processes per node (the first of `LOCAL_SIZE_ENVS` that is a positive
    int) / tp when the CP group spans nodes (L < cp) and src the text 'NAME=n / TP tp'; else (None, why not):
    an unknown, malformed or heterogeneous launcher size, tp not dividing it, or the group within one node."""
    env = launcher_env or {}
    n, src, bad = None, None, []
    for name in LOCAL_SIZE_ENVS:
        raw = str(env.get(name, "") or "").strip()
        if not raw:
            continue
        try:  # a plain ASCII decimal (str.isdigit() takes '²', which int() refuses, and non-ASCII digits)
            counts = _per_node_counts(raw, name)
        except ValueError:
            bad.append(f"{name}={_shown(raw)} is not a positive int")
            continue
        src = f"{name}={raw if len(raw) <= 40 else _shown(raw)}"
        if len(counts) > 1:
            return None, f"{src}: a heterogeneous allocation (nodes hold {' or '.join(map(str, counts))} ranks)"
        n = counts[0]
        break
    if n is None:
        return None, "no launcher size per node (" + ("; ".join(bad) if bad else " / ".join(LOCAL_SIZE_ENVS) + " unset") + ")"
    if n % tp:
        return None, f"{src} is not a multiple of --tensor-model-parallel-size {tp}"
    if n // tp >= cp:
        return None, f"{src}, TP {tp}: the CP group of {cp} fits in one node"
    return n // tp, f"{src} / TP {tp}"


def auto_pipeline(tp: int, cp: int, kv_heads, launcher_env=None):
    """Split-KV's chunked merge pipeline when neither --splitkv-num-chunks nor --splitkv-chunk-axis is given:
    (fields, why), fields = the `SplitKVConfig` fields to set (empty: the op's defaults, one call).

    Rule: when the CP group spans nodes (the launcher's processes per node / tp < cp, as in
    `auto_cp_ranks_per_node`; an unknown launcher size or tp not dividing it: no change) and each TP rank holds
    `kv_heads` >= 2 kv heads (None: unknown, no change): 2 head chunks (num_chunks=2, chunk_axis="heads"). Why
    (docs/lab/perf-notes.md item 25, docs/benchmarks.md twelfth run): over a slow link (2 x H200 over NCCL sockets,
    128K per rank) 2 head chunks took 0.818x of one call; on NVLink one call stays best (k = 2 heads
    1.024-1.119x), hence across nodes only; simulated CP 64 on 8-GPU nodes: the CP 64 gain is small; the socket
    A/B is the evidence. Not measured across real nodes. Exact either way (head chunks sum nothing across
    chunks). `launcher_env`: the launcher's variables, a mapping (as `auto_cp_ranks_per_node`)."""
    L, why = _cp_ranks_per_node(tp, cp, launcher_env)
    if L is None:
        return {}, why
    why = f"{why} = {L} CP ranks per node < CP {cp}: the group spans nodes"
    if kv_heads is None or kv_heads < 2:
        return {}, f"{why}, but {kv_heads} kv heads per TP rank: no head chunks"
    return {"num_chunks": 2, "chunk_axis": "heads"}, f"{why}; {kv_heads} kv heads per TP rank"


def _pipeline_label(fields) -> str:
    """`auto_pipeline`'s fields in words: '2 head chunks', or 'off'."""
    return f"{fields['num_chunks']} head chunks" if fields else "off"


def _kv_heads(args):
    """The model's kv heads: --num-query-groups with --group-query-attention, else --num-attention-heads (None
    when that is unset)."""
    heads = getattr(args, "num_attention_heads", None)
    groups = getattr(args, "num_query_groups", None)
    if not getattr(args, "group_query_attention", groups is not None) or groups is None:
        return heads
    return groups


def _local_kernel(args, kernel: str, have_fa4) -> str:
    """The local kernel as far as start-up knows it, for `auto_pipeline`: "fa4" for --splitkv-kernel fa4, and for
    auto where it will pick fa4 (FlashAttention-4 installed or `have_fa4`, not --deterministic-mode, bf16 / fp16
    parameters); else the flag's value ("auto" = not fa4 here)."""
    if kernel != "auto" or getattr(args, "deterministic_mode", False):
        return kernel
    if not (getattr(args, "bf16", True) or getattr(args, "fp16", False)):  # fa4 runs bf16 / fp16 only
        return kernel
    return "fa4" if (_fa4_available() if have_fa4 is None else have_fa4) else kernel


#: args attributes of `validate_splitkv_args`' automatic choices (shown by the start-up line and --parse-only),
#: of the config fields it chose ({field: value}) and of the config it built
_AUTO_ATTRS = ("splitkv_cp_ranks_per_node_auto", "splitkv_pipeline_auto", "splitkv_auto_fields", "splitkv_config")


def validate_splitkv_args(args, *, have_te=None, have_fa4=None, launcher_env=None) -> None:
    """Check a parsed Megatron `args` namespace for the Split-KV backend; raise SplitKVArgumentError
    naming the offending flag. Does nothing when `--context-parallel-impl` is unset.

    Checks: --tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size,
    --micro-batch-size >= 1 and --dflash-num-anchors >= 1 (integers; unset/None = default, 0 is an error),
    --dflash-block-size >= 2; the launcher's WORLD_SIZE (in `launcher_env`) a multiple of TP x PP x CP
    (`check_world_size`);
    --num-attention-heads >= 1; the implementation name; heads/query groups vs TP (`check_attention_heads`);
    CP size vs the query blocks of a micro-batch (`--micro-batch-size` x `--dflash-num-anchors` must be
    divisible by `--context-parallel-size`: every CP rank owns the same number of blocks);
    `--cp-chunk-size` > 0; `--cp-balance hypergraph` needs kahypar; `--transformer-impl
    transformer_engine` and `--splitkv-kernel te` need Transformer Engine, `--splitkv-kernel fa4`
    FlashAttention-4 (flash_attn.cute installed) and not `--deterministic-mode`; `--splitkv-kernel` is one of
    KERNEL_BACKENDS; `--attention-dropout` must be 0; the local spec cannot run `--sequence-parallel`;
    `--dflash-data-workers` in 0..MAX_DATA_WORKERS (32), `--dflash-data-prefetch` >= 1; `--dflash-host-metadata on` only with
    `--context-parallel-impl splitkv`; `--dflash-device-prefetch` on / off;
    `--splitkv-cp-ranks-per-node` a positive int, clamped to the CP size, then a divisor of it (unset, impl
    splitkv: `auto_cp_ranks_per_node` from the launcher's processes per node, the choice and why in
    args.splitkv_cp_ranks_per_node_auto); `--splitkv-num-chunks` >= 1, `--splitkv-chunk-axis` rows / heads
    (neither set, impl splitkv: `auto_pipeline`, the choice and why in args.splitkv_pipeline_auto).
    Builds the op's `SplitKVConfig` from them (args.splitkv_config, `splitkv_config_from_args`); nothing is
    written to the process environment, and calling it again on any namespace gives what it gets alone.
    `have_te` / `have_fa4` override the TE / FA4 detection (tests, and --parse-only on another machine).
    `launcher_env`: the launcher's variables ({name: text} for the names in `LOCAL_SIZE_ENVS` and
    `WORLD_SIZE_ENV`, as `launcher_env_from` picks them from a mapping such as the entry script's process
    environment); None or {}: no launcher size, so no automatic two-level all-to-all or pipeline and no world
    size check."""
    impl = getattr(args, "context_parallel_impl", None)
    if impl is None:
        return
    for attr in _AUTO_ATTRS:  # an earlier call's choices on this namespace
        vars(args).pop(attr, None)
    if getattr(args, "dflash_data_workers", None) is not None:  # None: resolved at run time (CUDA or not)
        data_workers_from_args(args)
    data_prefetch_from_args(args)
    device_prefetch_from_args(args)
    if getattr(args, "dflash_host_metadata", None) is not None:
        host_metadata_from_args(args, num_workers=0)
    kinds = layer_attention_from_args(args)
    if impl not in CP_IMPLS:
        raise SplitKVArgumentError(f"--context-parallel-impl must be one of {CP_IMPLS}, got {impl!r}")
    tp = _int_arg(args, "tensor_model_parallel_size", "--tensor-model-parallel-size", 1, 1)
    cp = _int_arg(args, "context_parallel_size", "--context-parallel-size", 1, 1)
    pp = _int_arg(args, "pipeline_model_parallel_size", "--pipeline-model-parallel-size", 1, 1)
    check_world_size(tp, pp, cp, launcher_env)
    mbs = _int_arg(args, "micro_batch_size", "--micro-batch-size", 1, 1)
    heads = getattr(args, "num_attention_heads", None)
    if heads is not None:
        check_attention_heads(heads, _kv_heads(args), tp)
    anchors = _int_arg(args, "dflash_num_anchors", "--dflash-num-anchors", None, 1)
    if anchors is not None:
        if (mbs * anchors) % cp:
            raise SplitKVArgumentError(
                f"--micro-batch-size ({mbs}) x --dflash-num-anchors ({anchors}) = {mbs * anchors} query "
                f"blocks must be divisible by --context-parallel-size ({cp}): every CP rank owns the "
                "same number of query blocks"
            )
    # a draft block is [anchor token, MASK, ...]: B >= 2 (as `dflash.build_draft_blocks` requires)
    _int_arg(args, "dflash_block_size", "--dflash-block-size", None, 2)
    chunk = getattr(args, "cp_chunk_size", None)
    if chunk is not None and (_as_int(chunk, "--cp-chunk-size") < 1):
        raise SplitKVArgumentError(f"--cp-chunk-size must be a positive number of tokens, got {chunk}")
    balance = getattr(args, "cp_balance", "lpt")
    if balance not in CP_BALANCE:
        raise SplitKVArgumentError(f"--cp-balance must be one of {CP_BALANCE}, got {balance!r}")
    if balance == "hypergraph" and importlib.util.find_spec("kahypar") is None:
        raise SplitKVArgumentError("--cp-balance hypergraph needs the kahypar package (pip install kahypar)")
    impl_te = getattr(args, "transformer_impl", None) == "transformer_engine"
    if impl_te and not (_te_available() if have_te is None else have_te):
        raise SplitKVArgumentError(
            "--transformer-impl transformer_engine selects the Transformer Engine spec, but "
            "transformer_engine is not installed; install it or pass --transformer-impl local"
        )
    kernel = kernel_backend_from_args(args)
    if kernel == "te" and not (_te_available() if have_te is None else have_te):
        raise SplitKVArgumentError(
            "--splitkv-kernel te needs Transformer Engine (pip install 'megatron-splitkv[te]'); "
            "transformer_engine is not installed; use --splitkv-kernel auto"
        )
    if kernel in ("te", "staircase") and kinds and any(w is not None or c for w, c in kinds):
        # the op refuses these kernels for windowed / causal layers (no per-row bounds): fail here, not in step 1
        raise SplitKVArgumentError(
            f"--splitkv-kernel {kernel} does not support sliding-window / causal layers (--dflash-layer-types, "
            "--dflash-is-causal); use --splitkv-kernel auto, math, flex or fa4"
        )
    if kernel == "fa4" and getattr(args, "deterministic_mode", False):
        # Megatron's --deterministic-mode turns on torch.use_deterministic_algorithms, under which the fa4
        # kernel raises in its first call (kernels/fa4.py: no deterministic block-sparse backward): fail here
        raise SplitKVArgumentError(
            "--splitkv-kernel fa4 has no deterministic mode (FlashAttention-4 accumulates dQ with atomics) and "
            "--deterministic-mode is set; use --splitkv-kernel auto (picks flex then) or flex"
        )
    if kernel == "fa4" and not (_fa4_available() if have_fa4 is None else have_fa4):
        raise SplitKVArgumentError(
            "--splitkv-kernel fa4 needs FlashAttention-4 (pip install 'megatron-splitkv[fa4]': flash-attn-4 and "
            "nvidia-cutlass-dsl, on a Hopper GPU); flash_attn.cute is not installed; use "
            "--splitkv-kernel auto"
        )
    if float(getattr(args, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise SplitKVArgumentError(
            f"--attention-dropout must be 0 with --context-parallel-impl {impl} (got {args.attention_dropout})"
        )
    rpn = getattr(args, "splitkv_cp_ranks_per_node", None)
    flag = "--splitkv-cp-ranks-per-node"
    if rpn is not None:
        rpn = _as_int(rpn, flag)
        if rpn < 1:
            raise SplitKVArgumentError(f"{flag} must be a positive int, got {rpn}")
        rpn = min(rpn, cp)  # as the op clamps SplitKVConfig.cp_ranks_per_node: L >= CP = one all-to-all
        if cp % rpn:
            raise SplitKVArgumentError(
                f"{flag} ({rpn}) must divide --context-parallel-size ({cp}) (or be >= it: one all-to-all)")
    elif impl == "splitkv":  # no flag: from the launcher's processes per node
        auto, why = auto_cp_ranks_per_node(tp, cp, launcher_env)
        args.splitkv_cp_ranks_per_node_auto = f"auto -> {auto} ({why})"
        rpn = auto if auto > 1 else None
    if impl != "splitkv":  # the baselines have no merge pipeline: a flag given for it would be ignored silently
        for attr, flag, _, _ in _PIPELINE_FLAGS:
            if getattr(args, attr, None) is not None:
                raise SplitKVArgumentError(f"{flag} applies to --context-parallel-impl splitkv only (the merge "
                                           f"pipeline), got --context-parallel-impl {impl}")
    auto_fields = {}
    flags_set = [flag for attr, flag, _, _ in _PIPELINE_FLAGS if getattr(args, attr, None) is not None]
    if impl == "splitkv" and flags_set:
        args.splitkv_pipeline_auto = f"auto -> off (set by a flag: {', '.join(flags_set)})"
    elif impl == "splitkv":  # none of the pipeline's flags: 2 head chunks when the group spans nodes
        kv = _kv_heads(args)
        auto_fields, why = auto_pipeline(tp, cp, None if kv is None else int(kv) // tp, launcher_env)
        args.splitkv_pipeline_auto = f"auto -> {_pipeline_label(auto_fields)} ({why})"
        args.splitkv_auto_fields = auto_fields
    args.splitkv_config = _config_from_flags(args, rpn, auto_fields)
    if getattr(args, "transformer_impl", None) == "local" and getattr(args, "sequence_parallel", False):
        raise SplitKVArgumentError(
            "--sequence-parallel is not supported by the local spec (torch norms); use "
            "--transformer-impl transformer_engine or drop --sequence-parallel"
        )
