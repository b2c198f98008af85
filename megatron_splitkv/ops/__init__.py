"""Exact DFlash attention ops under context parallelism: Split-KV and its two baselines.

Per-step metadata reuse: `prepare_splitkv_metadata(...)` once per training step, then
`op(..., metadata=meta)` in every layer (see `megatron_splitkv.ops.metadata`).

Source: arXiv 2611.05926 (Split-KV), DESIGN.md section 2.
"""

from .allgather_kv import allgather_kv_attention
from .metadata import SplitKVMetadata, prepare_splitkv_metadata
from .ring_kv import ring_kv_attention
from .splitkv import splitkv_attention

__all__ = ["splitkv_attention", "allgather_kv_attention", "ring_kv_attention", "prepare_splitkv_metadata",
           "SplitKVMetadata"]
