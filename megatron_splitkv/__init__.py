"""megatron-splitkv: Split-KV context parallelism for training DFlash diffusion drafters with
Megatron-Core (after arXiv 2611.05926; see DESIGN.md).

Public API:
    splitkv_attention, allgather_kv_attention, ring_kv_attention: exact CP DFlash attention (same
        signature; see `megatron_splitkv.ops`).
    prepare_splitkv_metadata: the per-step metadata work (validation, gathers, sorting, masks) done
        once and passed to every layer's op call as `metadata=`.
    prepare_splitkv_metadata_from_plan: the same metadata built on the host from the global plan (no
        process group; e.g. in a data-loader worker), attached to the CP group at step time with
        `SplitKVMetadata.bind`.
    splitkv_start_query_gather: start Split-KV's query all-gather before the k/v projections and pass
        the handle as `splitkv_attention(..., query_gather=)` (overlap; `megatron_splitkv.ops.splitkv`).
    comm_stats, CommStats, CommRecord: per-rank byte accounting of their collectives
        (`megatron_splitkv.comm`).
    dflash_attention_reference, dflash_attention_mask: single-process float64 ground truth.
    check_attention_type: a layer type (sliding window W, causal) as the ops take it (`window=`, `causal=`).
"""

from .comm import CommRecord, CommStats, comm_stats
from .config import FlexOptions, SplitKVConfig, StaircaseOptions
from .ops import (
    allgather_kv_attention,
    prepare_splitkv_metadata,
    prepare_splitkv_metadata_from_plan,
    ring_kv_attention,
    splitkv_attention,
    splitkv_start_query_gather,
)
from .reference import check_attention_type, dflash_attention_mask, dflash_attention_reference

__all__ = [
    "splitkv_attention",
    "allgather_kv_attention",
    "ring_kv_attention",
    "prepare_splitkv_metadata",
    "prepare_splitkv_metadata_from_plan",
    "splitkv_start_query_gather",
    "SplitKVConfig",
    "FlexOptions",
    "StaircaseOptions",
    "comm_stats",
    "CommStats",
    "CommRecord",
    "dflash_attention_reference",
    "dflash_attention_mask",
    "check_attention_type",
]
