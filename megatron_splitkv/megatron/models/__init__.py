"""Megatron-Core models of megatron-splitkv: the DFlash drafter and the frozen target feature provider.

* `DFlashDraftModel`: fc + RMSNorm over tapped target layers, DFlash layers (Split-KV CP), final norm,
  the target's frozen embedding / LM head, decayed loss normalised over the batch's ranks.
* `FeatureStore` / `FeatureWriter` / `write_features`: offline features (memory-mapped, indexed).
* `TargetFeatureProvider` / `build_target_model` / `qwen3_config`: a frozen Qwen3-style `GPTModel`
  run forward-only and exactly causal under any planner layout, returning tapped hidden states.

Source: DESIGN.md sections 1 and 4; DFlash; arXiv 2611.05926.
"""

from .dflash import DFlashDraftModel
from .features import FeatureStore, FeatureWriter, write_features
from .target import (
    CausalCPCoreAttention,
    SkippedTargetLayer,
    TargetFeatureProvider,
    build_target_model,
    load_target_weights,
    qwen3_config,
    target_layer_spec,
    target_packed_seq_params,
)

__all__ = [
    "DFlashDraftModel",
    "CausalCPCoreAttention",
    "SkippedTargetLayer",
    "TargetFeatureProvider",
    "build_target_model",
    "load_target_weights",
    "qwen3_config",
    "FeatureStore",
    "FeatureWriter",
    "write_features",
    "target_layer_spec",
    "target_packed_seq_params",
]
