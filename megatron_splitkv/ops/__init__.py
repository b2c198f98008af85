"""Exact DFlash attention ops under context parallelism: Split-KV and its two baselines.

Source: arXiv 2611.05926 (Split-KV), DESIGN.md section 2.
"""

from .allgather_kv import allgather_kv_attention
from .ring_kv import ring_kv_attention
from .splitkv import splitkv_attention

__all__ = ["splitkv_attention", "allgather_kv_attention", "ring_kv_attention"]
