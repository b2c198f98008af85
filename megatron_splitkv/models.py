"""`megatron_splitkv.models`: the DFlash drafter and target feature provider, imported lazily.

Importing this module does not import Megatron-Core; the first attribute access does (from
`megatron_splitkv.megatron.models`). Names: `DFlashDraftModel`, `TargetFeatureProvider`,
`build_target_model`, `qwen3_config`, `CausalCPCoreAttention`, `target_layer_spec`,
`target_packed_seq_params`, `load_target_weights`, `FeatureStore`, `FeatureWriter`,
`write_features`. Raises ImportError (naming megatron-core) when Megatron-Core is missing.
"""

import importlib

__all__ = [
    "DFlashDraftModel",
    "TargetFeatureProvider",
    "build_target_model",
    "qwen3_config",
    "CausalCPCoreAttention",
    "target_layer_spec",
    "target_packed_seq_params",
    "load_target_weights",
    "FeatureStore",
    "FeatureWriter",
    "write_features",
]


def __getattr__(name):
    if name not in __all__:
        raise AttributeError(f"module 'megatron_splitkv.models' has no attribute {name!r}")
    try:
        mod = importlib.import_module("megatron_splitkv.megatron.models")
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"megatron_splitkv.models.{name} needs megatron-core (pip install megatron-splitkv[megatron])"
        ) from exc
    value = getattr(mod, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
