"""Exact DFlash attention ops under context parallelism: Split-KV and its two baselines.

Per-step metadata reuse: `prepare_splitkv_metadata(...)` once per training step, then
`op(..., metadata=meta)` in every layer (see `megatron_splitkv.ops.metadata`; built by `ops.prepare`, or on
the host by `ops.host_metadata`). Split-KV's query all-gather can be started before the layer's k/v
projections: `h = splitkv_start_query_gather(q, metadata=meta)`, then `splitkv_attention(..., metadata=meta,
query_gather=h)` (`ops.query_gather`).

Source: arXiv 2611.05926 (Split-KV), DESIGN.md section 2.
"""

from .agreement import check_environment_agreement
from .allgather_kv import allgather_kv_attention
from .host_metadata import prepare_splitkv_metadata_from_plan
from .metadata import SplitKVMetadata
from .prepare import prepare_splitkv_metadata
from .ring_kv import ring_kv_attention
from .splitkv import SplitKVQueryGather, splitkv_attention, splitkv_start_query_gather

__all__ = ["splitkv_attention", "allgather_kv_attention", "ring_kv_attention", "prepare_splitkv_metadata",
           "prepare_splitkv_metadata_from_plan", "SplitKVMetadata", "splitkv_start_query_gather", "SplitKVQueryGather",
           "check_environment_agreement"]
