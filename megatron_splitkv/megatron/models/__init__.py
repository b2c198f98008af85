"""Megatron-Core models of megatron-splitkv: the DFlash drafter and the frozen target feature provider.

* `DFlashDraftModel`: fc + RMSNorm over tapped target layers, DFlash layers (Split-KV CP), final norm,
  the target's frozen embedding / LM head, decayed loss normalised over the batch's ranks.
* `FeatureStore` / `FeatureWriter` / `write_features`: offline features (memory-mapped, indexed).
* `TargetFeatureProvider` / `build_target_model` / `qwen3_config`: a frozen Qwen3-style `GPTModel`
  run forward-only and exactly causal under any planner layout, returning tapped hidden states.

Source: DESIGN.md sections 1 and 4; DFlash; arXiv 2611.05926.
"""

from . import dflash, features, target
from .dflash import *  # noqa: F401,F403 (re-exports each module's __all__)
from .features import *  # noqa: F401,F403
from .target import *  # noqa: F401,F403

__all__ = [*dflash.__all__, *features.__all__, *target.__all__]
