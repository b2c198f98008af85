"""ModuleSpec builders for the DFlash drafter layer with a swappable context-parallel backend.

    spec = get_dflash_layer_spec(cp_impl="splitkv", use_te=None)   # TE when installed, else local
    block = TransformerBlock(config, spec, pg_collection=pgs)
    out = block(hidden_states=h, attention_mask=None, context=ctx, packed_seq_params=params)

`h` [sq, b, hidden]: block-token embeddings of this CP rank's query blocks; `ctx` [sk, b, hidden]: this
rank's fused context features; `params`: `DFlashPackedSeqParams` (mask metadata). See docs/megatron.md.

`splitkv_core_attention(cp_impl)` is the core-attention builder alone; put it in
`CrossAttentionSubmodules.core_attention` to run Megatron's standard `CrossAttention` (Lq << Lk, context
sequence-sharded over CP) on the same backend.

Source: Megatron-Core 0.19 `gpt_layer_specs.py` / `backends.py` conventions; DESIGN.md section 4.
"""

from __future__ import annotations

import functools
from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from ..config import SplitKVConfig
from .arguments import CP_IMPLS, SplitKVArgumentError
from .attention import SplitKVCoreAttention
from .layers import DFlashAttention, DFlashAttentionSubmodules, DFlashTransformerLayer

__all__ = [
    "splitkv_core_attention",
    "get_dflash_layer_spec",
    "get_dflash_layer_local_spec",
    "get_dflash_layer_te_spec",
    "have_te",
]


def have_te() -> bool:
    """Whether Megatron-Core found Transformer Engine."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def splitkv_core_attention(cp_impl: str = "splitkv", kernel_backend: str = "auto",
                           splitkv_config: Optional[SplitKVConfig] = None, layer_attention=None):
    """Core-attention builder (Megatron-Core 0.19 `CoreAttentionBuilder`) bound to a CP implementation
    (`splitkv`, `allgather-kv`, `ring-kv`), a kernel backend, the op's `SplitKVConfig` (None: defaults) and
    the per-layer attention kinds `layer_attention` (None, or one (window, causal) per model layer; each
    layer takes its own by its layer number, `SplitKVCoreAttention`). Raises SplitKVArgumentError naming
    `--context-parallel-impl` for anything else."""
    if cp_impl not in CP_IMPLS:
        raise SplitKVArgumentError(f"--context-parallel-impl must be one of {CP_IMPLS}, got {cp_impl!r}")
    if layer_attention is not None:
        layer_attention = tuple((w, bool(c)) for w, c in layer_attention)
    return functools.partial(SplitKVCoreAttention, cp_impl=cp_impl, kernel_backend=kernel_backend,
                             splitkv_config=splitkv_config, layer_attention=layer_attention)


def _dflash_spec(linear_col, linear_row, norm, qk_norm, mlp, cp_impl, kernel_backend, qk_layernorm,
                 rotary_base, rotary_percent, fused_pre_mlp_norm, overlap_query_gather=None, splitkv_config=None,
                 layer_attention=None):
    attn = ModuleSpec(
        module=DFlashAttention,
        params={
            "attn_mask_type": AttnMaskType.no_mask,
            "rotary_base": rotary_base,
            "rotary_percent": rotary_percent,
            "overlap_query_gather": overlap_query_gather,
            "splitkv_config": splitkv_config,
        },
        submodules=DFlashAttentionSubmodules(
            linear_q=linear_col,
            linear_kv=linear_col,
            core_attention=splitkv_core_attention(cp_impl, kernel_backend, splitkv_config, layer_attention),
            linear_proj=linear_row,
            q_layernorm=qk_norm if qk_layernorm else None,
            k_layernorm=qk_norm if qk_layernorm else None,
        ),
    )
    return ModuleSpec(
        module=DFlashTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attn,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if fused_pre_mlp_norm else norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def get_dflash_layer_local_spec(cp_impl: str = "splitkv", *, qk_layernorm: bool = True,
                                rotary_base: Optional[float] = 1_000_000.0, rotary_percent: float = 1.0,
                                kernel_backend: str = "auto",
                                overlap_query_gather: Optional[bool] = None,
                                splitkv_config: Optional[SplitKVConfig] = None, layer_attention=None) -> ModuleSpec:
    """DFlash drafter layer with Megatron-Core's own modules (ColumnParallelLinear/RowParallelLinear,
    torch norms following `config.normalization`, e.g. RMSNorm; MLP from the local backend, gated if
    `config.gated_linear_unit`). Runs on CPU. See `get_dflash_layer_spec` for the arguments."""
    mlp = get_mlp_module_spec_for_backend(backend=LocalSpecProvider())
    return _dflash_spec(ColumnParallelLinear, RowParallelLinear, WrappedTorchNorm, WrappedTorchNorm, mlp,
                        cp_impl, kernel_backend, qk_layernorm, rotary_base, rotary_percent, False,
                        overlap_query_gather, splitkv_config, layer_attention)


def get_dflash_layer_te_spec(cp_impl: str = "splitkv", *, qk_layernorm: bool = True,
                             rotary_base: Optional[float] = 1_000_000.0, rotary_percent: float = 1.0,
                             kernel_backend: str = "auto",
                             overlap_query_gather: Optional[bool] = None,
                             splitkv_config: Optional[SplitKVConfig] = None, layer_attention=None) -> ModuleSpec:
    """DFlash drafter layer with Transformer Engine linears and norms (TEColumnParallelLinear,
    TERowParallelLinear, TENorm; the MLP's pre-norm fused into TELayerNormColumnParallelLinear).
    The input norm stays a separate TENorm because its output feeds both q and k/v projections.
    Raises SplitKVArgumentError naming `--transformer-impl` when TE is not installed."""
    if not have_te():
        raise SplitKVArgumentError(
            "the Transformer Engine spec (--transformer-impl transformer_engine) needs transformer_engine, "
            "which is not installed; use --transformer-impl local (get_dflash_layer_local_spec)"
        )
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm, TERowParallelLinear
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    backend = TESpecProvider()
    mlp = get_mlp_module_spec_for_backend(backend=backend)
    return _dflash_spec(TEColumnParallelLinear, TERowParallelLinear, TENorm, backend.layer_norm(for_qk=True),
                        mlp, cp_impl, kernel_backend, qk_layernorm, rotary_base, rotary_percent,
                        backend.fuse_layernorm_and_linear(), overlap_query_gather, splitkv_config, layer_attention)


def get_dflash_layer_spec(cp_impl: Optional[str] = "splitkv", use_te: Optional[bool] = None, *,
                          qk_layernorm: bool = True, rotary_base: Optional[float] = 1_000_000.0,
                          rotary_percent: float = 1.0, kernel_backend: str = "auto",
                          overlap_query_gather: Optional[bool] = None,
                          splitkv_config: Optional[SplitKVConfig] = None, layer_attention=None) -> ModuleSpec:
    """ModuleSpec of one DFlash drafter layer (`DFlashTransformerLayer`), fanned out by
    `TransformerBlock` to `config.num_layers` (per pipeline stage).

    Args:
        cp_impl: context-parallel implementation `splitkv` | `allgather-kv` | `ring-kv` (None = splitkv).
        use_te: True = Transformer Engine spec, False = local spec, None = TE when installed.
        qk_layernorm: per-head q/k norms (Qwen3 style; the norm class follows `config.normalization`).
        rotary_base: RoPE theta (Qwen3: 1e6); None disables RoPE. rotary_percent: rotated fraction.
        kernel_backend: local attention kernel passed to the op (`backend=`), default "auto".
        overlap_query_gather: start Split-KV's query all-gather before the k/v projections
            (`DFlashAttention`; docs/lab/perf-notes.md item 3); None = `splitkv_config.overlap_q_gather`
            (default on). No effect for the baselines.
        splitkv_config: the op's `SplitKVConfig` (None: the defaults), in the attention's and the core
            attention's params (`megatron.arguments.splitkv_config_from_args` builds it from the flags).
        layer_attention: None (every layer full attention, non-causal), or one (window, causal) per layer of
            the block (`arguments.layer_attention_from_args` from `--dflash-layer-types`,
            `--dflash-sliding-window`, `--dflash-is-causal`); layer i (1-based layer number) runs entry i - 1.
    Config requirements: `attention_dropout == 0`; num_attention_heads and num_query_groups divisible
    by TP (checked at construction); `add_bias_linear=False` matches Qwen3.
    Raises SplitKVArgumentError for an unknown cp_impl or use_te=True without TE."""
    cp_impl = cp_impl or "splitkv"
    if cp_impl not in CP_IMPLS:
        raise SplitKVArgumentError(f"--context-parallel-impl must be one of {CP_IMPLS}, got {cp_impl!r}")
    if use_te is None:
        use_te = have_te()
    fn = get_dflash_layer_te_spec if use_te else get_dflash_layer_local_spec
    return fn(cp_impl, qk_layernorm=qk_layernorm, rotary_base=rotary_base, rotary_percent=rotary_percent,
              kernel_backend=kernel_backend, overlap_query_gather=overlap_query_gather,
              splitkv_config=splitkv_config, layer_attention=layer_attention)
