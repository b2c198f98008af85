"""Megatron-Core 0.19 backend of megatron-splitkv: Split-KV as a context-parallel attention backend.

Only this subpackage imports `megatron.core`. Entry points:

* `get_dflash_layer_spec(cp_impl="splitkv", use_te=None)`: DFlash drafter layer spec for
  `TransformerBlock`; feed it `context=` (fused ctx features) and
  `packed_seq_params=DFlashPackedSeqParams(...)` (mask metadata).
* `splitkv_core_attention(cp_impl)`: the core-attention builder alone (e.g. for `CrossAttention`).
* `add_splitkv_args` / `validate_splitkv_args`: `--context-parallel-impl`, `--cp-chunk-size`,
  `--cp-balance`, `--splitkv-kernel`, `--splitkv-no-overlap-q-gather` (Megatron `extra_args_provider`;
  `arguments.kernel_backend_from_args` / `overlap_query_gather_from_args` map them to the spec options);
  the entry script passes `launcher_env=launcher_env_from(<its process environment>)` (the launcher's processes per node
  and in all, WORLD_SIZE: checked against TP x PP x CP).
* `create_cp_check_groups` (once at start-up, collective) / `cp_check_group`: the CP groups' gloo mirrors,
  over which the layers' ops exchange their per-call verdict rows on the host (no device sync).
* `get_batch_on_this_cp_rank_splitkv`: planner-driven data sharding of drafter batches;
  `prefetch_planned_batches`: the same in DataLoader workers ahead of the step (`--dflash-data-workers`).

See docs/megatron.md. Source: arXiv 2611.05926 (Split-KV); DESIGN.md section 4.
"""

from .arguments import (
    CP_BALANCE,
    CP_IMPLS,
    SplitKVArgumentError,
    add_splitkv_args,
    check_attention_heads,
    launcher_env_from,
    layer_attention_from_args,
    validate_splitkv_args,
)
from .attention import DFlashPackedSeqParams, SplitKVCoreAttention, resolve_cp_attention_fn
from .check_groups import cp_check_group, create_cp_check_groups
from .layers import DFlashAttention, DFlashAttentionSubmodules, DFlashTransformerLayer, apply_rope
from .sharding import (
    get_batch_on_this_cp_rank_splitkv,
    planner_kwargs_from_args,
    prefetch_planned_batches,
    splitkv_metadata_spec,
)
from .specs import (
    get_dflash_layer_local_spec,
    get_dflash_layer_spec,
    get_dflash_layer_te_spec,
    splitkv_core_attention,
)

__all__ = [
    "CP_BALANCE",
    "CP_IMPLS",
    "SplitKVArgumentError",
    "add_splitkv_args",
    "check_attention_heads",
    "launcher_env_from",
    "layer_attention_from_args",
    "validate_splitkv_args",
    "DFlashPackedSeqParams",
    "SplitKVCoreAttention",
    "resolve_cp_attention_fn",
    "create_cp_check_groups",
    "cp_check_group",
    "DFlashAttention",
    "DFlashAttentionSubmodules",
    "DFlashTransformerLayer",
    "apply_rope",
    "get_dflash_layer_spec",
    "get_dflash_layer_local_spec",
    "get_dflash_layer_te_spec",
    "splitkv_core_attention",
    "get_batch_on_this_cp_rank_splitkv",
    "planner_kwargs_from_args",
    "prefetch_planned_batches",
    "splitkv_metadata_spec",
]
