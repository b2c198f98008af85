"""The DFlash drafter attention and transformer layer for Megatron-Core 0.19.

Drafter layer (DESIGN.md section 1; arXiv 2611.05926):

    x  = norm(h)
    h  = h + o_proj(attn(q_proj(x), k/v_proj(cat[ctx, x])))     # DFlash mask, Split-KV over CP
    h  = h + mlp(norm(h))

Queries come from the draft-block tokens only; keys/values from `[context features | block tokens]`
through the same k/v projections; q/k norms (qk-layernorm, RMSNorm) per head; RoPE on GLOBAL positions
(query token i of block b: `anchor_b + i`; context token: `kv_pos`). The fused context `ctx` is the same
tensor for every layer (not re-normed per layer).

How ctx and the mask metadata reach the attention (read from mcore 0.19's `transformer_layer.py`):
`TransformerBlock.forward(hidden_states, attention_mask, context=..., packed_seq_params=...)` hands both
`context` and `packed_seq_params` to every layer, and each layer returns `(hidden_states, context)`, so
one ctx tensor is reused by all layers. But inside `TransformerLayer._forward_attention` the
self-attention slot receives `packed_seq_params` (and RoPE) but not `context`, while the cross-attention
slot receives `context` but neither `packed_seq_params` nor RoPE. Routing the metadata to the cross slot
would need globals, so `DFlashTransformerLayer` is a small `TransformerLayer` subclass that overrides
only `_forward_attention`: it calls its `self_attention` (a `DFlashAttention`) with
`key_value_states=context` and `packed_seq_params`. MLP, bias-dropout-add, recompute and the sharded
state dict are inherited unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.utils.checkpoint
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.typed_torch import apply_module
from megatron.core.utils import get_pg_size

from ..config import SplitKVConfig, resolve_config
from .arguments import check_attention_heads
from .attention import DFlashPackedSeqParams

__all__ = [
    "DFlashAttentionSubmodules",
    "DFlashAttention",
    "DFlashTransformerLayer",
    "apply_rope",
    "resolve_overlap_query_gather",
]

def resolve_overlap_query_gather(value: Optional[bool], config: Optional[SplitKVConfig] = None) -> bool:
    """`overlap_query_gather` of `DFlashAttention`: True / False as given; None = `config.overlap_q_gather`
    (None: the default, on)."""
    if value is not None:
        return bool(value)
    return resolve_config(config).overlap_q_gather


def apply_rope(x: Tensor, positions: Tensor, *, base: float, rotary_percent: float = 1.0) -> Tensor:
    """Rotary embedding (rotate-half / non-interleaved convention, as Megatron-Core's default and
    Qwen3) at explicit global positions.

    Args:
        x: [..., H, D] (e.g. sbhd [s, b, H, D]); positions: int64 of shape x.shape[:-2].
        base: rotary base (theta). rotary_percent: fraction of D rotated (the rest passes through).

    Returns a tensor like x. Angles are computed in float64 and cast to x.dtype."""
    d = x.shape[-1]
    rd = int(d * rotary_percent)
    rd -= rd % 2
    if rd == 0:
        return x
    inv_freq = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float64, device=x.device) / rd))
    ang = positions.to(torch.float64)[..., None] * inv_freq  # [..., rd/2]
    emb = torch.cat([ang, ang], dim=-1)[..., None, :]  # [..., 1, rd]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr.chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    out = xr * cos + rot * sin
    return torch.cat([out, xp], dim=-1) if rd < d else out


@dataclass
class DFlashAttentionSubmodules:
    """Submodules of `DFlashAttention`: TP-column-parallel `linear_q` (hidden -> H*D) and `linear_kv`
    (hidden -> 2*Hkv*D, laid out per kv head as [k_g | v_g] so a TP shard holds whole kv heads),
    the core attention (`SplitKVCoreAttention` bound to a CP implementation), row-parallel
    `linear_proj` (H*D -> hidden), and per-head `q_layernorm` / `k_layernorm` (None = no qk-norm)."""

    linear_q: type
    linear_kv: type
    core_attention: type
    linear_proj: type
    q_layernorm: Optional[type] = None
    k_layernorm: Optional[type] = None


class DFlashAttention(Attention):
    """DFlash drafter attention: Q from block tokens, K/V from [ctx | block tokens], DFlash mask.

    Built by `build_module` from a spec (see `megatron_splitkv.megatron.specs.get_dflash_layer_spec`)
    with `config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection`, plus spec
    params `rotary_base` (None = no RoPE), `rotary_percent`, `overlap_query_gather` and `splitkv_config`.

    Order of the forward (docs/lab/perf-notes.md item 3): q (projection, q-norm, RoPE) first; then, with
    `overlap_query_gather` (default: `splitkv_config.overlap_q_gather`, on; `--splitkv-no-overlap-q-gather`
    turns it off in the training scripts), the core attention
    starts Split-KV's query all-gather (`SplitKVCoreAttention.start_query_gather`; a no-op for the
    baselines and at CP size 1); then k/v of [context | block tokens] (projection, k-norm, RoPE), which
    overlap the gather; then the core attention consumes it (`query_gather=`). In backward the k/v
    projections' backward runs before the dQ all-to-all is waited for. Results are bit-identical with
    the overlap on or off.

    Head split under TP: `num_attention_heads` and `num_query_groups` must both be divisible by the TP
    size; TP rank r then holds q heads `[r*H/TP, (r+1)*H/TP)` and kv heads `[r*Hkv/TP, (r+1)*Hkv/TP)`,
    and q head h uses kv head `h // (H/Hkv)` (Megatron's grouping) - inside a shard the same rule holds
    with local indices. Violations raise ValueError at construction naming `--num-attention-heads`,
    `--num-query-groups` and `--tensor-model-parallel-size` (case C7).

    forward(hidden_states, attention_mask=None, key_value_states=ctx, packed_seq_params=params, ...):
        hidden_states: [sq, b, hidden] normed block-token states (sbhd; for thd params use b = 1).
        key_value_states: [sk, b, hidden] context features of this CP rank (b*sk = params.num_ctx_tokens).
        packed_seq_params: `DFlashPackedSeqParams` (required).
    Selective recompute (`config.recompute_granularity == "selective"` with "core_attn" in
    `config.recompute_modules`): the core attention is recomputed in backward (`_core_attention`).
    Returns (output [sq, b, hidden], bias or None), as Megatron's Attention.

    Errors: ValueError for a missing ctx/metadata; NotImplementedError for inference contexts.
    Source: DESIGN.md sections 1 and 4; Megatron-Core 0.19 `Attention`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: DFlashAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.no_mask,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        rotary_base: Optional[float] = 10000.0,
        rotary_percent: float = 1.0,
        pp_layer_offset: Optional[int] = None,
        name: Optional[str] = None,
        overlap_query_gather: Optional[bool] = None,
        splitkv_config: Optional[SplitKVConfig] = None,
    ):
        if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
            tp_size = get_pg_size(pg_collection.tp)
        elif parallel_state.model_parallel_is_initialized():
            tp_size = parallel_state.get_tensor_model_parallel_world_size()
        else:
            tp_size = config.tensor_model_parallel_size
        check_attention_heads(config.num_attention_heads, config.num_query_groups, tp_size)
        if config.rotary_interleaved:
            raise ValueError("DFlashAttention implements non-interleaved RoPE only (--rotary-interleaved unset)")
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="cross",
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            pp_layer_offset=pp_layer_offset,
            name=name,
        )
        self.rotary_base = rotary_base
        self.rotary_percent = rotary_percent
        self.overlap_query_gather = resolve_overlap_query_gather(overlap_query_gather, splitkv_config)
        bias = config.add_bias_linear or config.add_qkv_bias
        self.linear_q = submodules.linear_q(
            config.hidden_size,
            self.query_projection_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name=None,  # TE user buffers exist only for qkv/proj/fc1/fc2
            tp_group=self.pg_collection.tp,
        )
        self.linear_kv = submodules.linear_kv(
            config.hidden_size,
            2 * self.kv_projection_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name=None,
            tp_group=self.pg_collection.tp,
        )

        def norm(cls):
            if cls is None or cls is IdentityOp:
                return None
            return cls(config=config, hidden_size=self.hidden_size_per_attention_head, eps=config.layernorm_epsilon)

        self.q_layernorm = norm(submodules.q_layernorm)
        self.k_layernorm = norm(submodules.k_layernorm)

    def get_query_key_value_tensors(self, hidden_states, key_value_states, output_gate=False, split_qkv=True):
        """q [sq, b, H_tp, D] from hidden_states; k, v [sk + sq, b, Hkv_tp, D] from
        cat[key_value_states, hidden_states] (same projection for context and block tokens); q/k
        norms applied, RoPE not yet."""
        if output_gate:
            raise NotImplementedError("DFlashAttention: attention_output_gate is not supported")
        q = self._query_tensor(hidden_states)
        k, v = self._key_value_tensors(hidden_states, key_value_states)
        return q, k, v

    def _query_tensor(self, hidden_states):
        """q [sq, b, H_tp, D] = q_norm(linear_q(hidden_states)) (RoPE not yet)."""
        q, _ = apply_module(self.linear_q)(hidden_states)
        q = q.view(*q.shape[:2], self.num_attention_heads_per_partition, self.hidden_size_per_attention_head)
        if self.q_layernorm is not None:
            q = apply_module(self.q_layernorm)(q)
        return q

    def _key_value_tensors(self, hidden_states, key_value_states):
        """k (k-normed, RoPE not yet), v [sk + sq, b, Hkv_tp, D] = linear_kv(cat[context, block tokens])."""
        d = self.hidden_size_per_attention_head
        kv_in = torch.cat([key_value_states, hidden_states], dim=0)
        kv, _ = apply_module(self.linear_kv)(kv_in)
        kv = kv.view(*kv.shape[:2], self.num_query_groups_per_partition, 2 * d)
        k, v = kv[..., :d], kv[..., d:]
        if self.k_layernorm is not None:
            k = apply_module(self.k_layernorm)(k)
        return k, v

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        key_value_states: Optional[Tensor] = None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[DFlashPackedSeqParams] = None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("DFlashAttention: inference contexts are not supported")
        if not isinstance(packed_seq_params, DFlashPackedSeqParams):
            raise ValueError(
                "DFlashAttention needs packed_seq_params=DFlashPackedSeqParams(...) (the DFlash mask "
                f"metadata), got {type(packed_seq_params).__name__}"
            )
        if key_value_states is None:
            raise ValueError("DFlashAttention needs the context features: pass context= to TransformerBlock")
        params = packed_seq_params
        params.validate()
        if hidden_states.dim() == 2:  # thd hidden [t, h] tolerated
            hidden_states = hidden_states.unsqueeze(1)
        if key_value_states.dim() == 2:
            key_value_states = key_value_states.unsqueeze(1)
        sq, b = hidden_states.shape[:2]
        sk = key_value_states.shape[0]
        if key_value_states.shape[1] != b or b * sk != params.num_ctx_tokens:
            raise ValueError(
                f"context [{sk}, {key_value_states.shape[1]}, .] does not match hidden batch {b} and "
                f"{params.num_ctx_tokens} context tokens in the metadata"
            )
        if b * sq != params.num_query_tokens:
            raise ValueError(
                f"hidden_states has {b * sq} tokens but the metadata describes {params.num_blocks} "
                f"blocks x {params.block_size}"
            )
        thd = params.qkv_format == "thd"
        # 1. queries first (projection, q-norm, RoPE) ...
        q = self._query_tensor(hidden_states)
        if self.rotary_base is not None:
            q_pos = params.query_positions().view(b, sq).transpose(0, 1)
            q = apply_rope(q, q_pos, base=self.rotary_base, rotary_percent=self.rotary_percent)
        if thd:
            q = q.squeeze(1)
        # 2. ... so that Split-KV's query all-gather runs while k/v are computed (perf-notes item 3); not
        #    under selective recompute of the core attention, whose forward is then run twice (`_core_attention`)
        gather = None
        recompute = self.checkpoint_core_attention and self.training
        start = getattr(self.core_attention, "start_query_gather", None)
        if self.overlap_query_gather and start is not None and not recompute:
            gather = start(q, params, num_heads_kv=self.num_query_groups_per_partition)
        try:
            k, v = self._key_value_tensors(hidden_states, key_value_states)
            if self.rotary_base is not None:
                c_pos = params.kv_pos.view(b, sk).transpose(0, 1)
                k_pos = torch.cat([c_pos, q_pos], dim=0)
                k = apply_rope(k, k_pos, base=self.rotary_base, rotary_percent=self.rotary_percent)
            if thd:
                k, v = k.squeeze(1), v.squeeze(1)
        except BaseException:
            if gather is not None:  # never consumed: release it (no wait, no warning)
                gather.discard()
            raise
        # 3. core attention (consumes the gather: query_gather= only when one was started, so a core
        #    attention without that keyword keeps Megatron's plain contract)
        core_out = self._core_attention(q, k, v, attention_mask, attention_bias, params, gather, recompute)
        core_out = core_out.reshape(sq, b, core_out.shape[-1])  # explicit width: sq may be 0 on a CP rank
        output, bias = apply_module(self.linear_proj)(core_out)
        return output, bias


    def _core_attention(self, q, k, v, attention_mask, attention_bias, params, gather, recompute):
        """The core attention on (q, k, v). With Megatron's selective recompute of the core attention
        (`--recompute-granularity selective --recompute-modules core_attn`, i.e. `checkpoint_core_attention`)
        in training: under `torch.utils.checkpoint` (non-reentrant), so only its inputs are kept and the core
        attention, its collectives included, runs again in backward (every CP rank recomputes in the same
        order); the query gather is then not started early (`gather` is None). Megatron's own
        `_checkpointed_attention_forward` is not used: its RNG bookkeeping needs CUDA, and this attention has
        no dropout (validate_splitkv_args). Gradients equal the non-recompute ones bitwise
        (tests/test_faults_recompute.py)."""
        if recompute:
            return torch.utils.checkpoint.checkpoint(self._run_core, q, k, v, attention_mask, attention_bias, params,
                                                     None, use_reentrant=False)
        return self._run_core(q, k, v, attention_mask, attention_bias, params, gather)

    def _run_core(self, q, k, v, attention_mask, attention_bias, params, gather):
        extra = {} if gather is None else {"query_gather": gather}
        return apply_module(self.core_attention)(
            q, k, v, attention_mask,
            attn_mask_type=self.attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=params,
            **extra,
        )


class DFlashTransformerLayer(TransformerLayer):
    """A `TransformerLayer` whose attention sees the block-level `context` and `packed_seq_params`.

    `forward(hidden_states, attention_mask=None, context=ctx, packed_seq_params=params, ...)` computes
    `h = h + o_proj(attn(norm(h), ctx))` then the inherited `h = h + mlp(norm(h))`; returns
    `(h, ctx)` with ctx unchanged, so `TransformerBlock` passes the same ctx to the next layer.
    Shapes: h [sq, b, hidden]; ctx [sk, b, hidden] (this CP rank's context features).
    Build it from `get_dflash_layer_spec(...)`. Source: Megatron-Core 0.19 `TransformerLayer`.
    """

    def _forward_attention(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        context: Optional[Tensor] = None,
        context_mask: Optional[Tensor] = None,
        rotary_pos_emb: Optional[Tensor] = None,
        rotary_pos_cos: Optional[Tensor] = None,
        rotary_pos_sin: Optional[Tensor] = None,
        rotary_pos_cos_sin: Optional[Tensor] = None,
        attention_bias: Optional[Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        padding_mask=None,
        *,
        inference_params=None,
    ):
        normed = apply_module(self.input_layernorm)(hidden_states)
        if isinstance(normed, tuple):
            normed, residual = normed
        else:
            residual = hidden_states
        if self.config.fp32_residual_connection:
            residual = residual.float()
        attn_out = self.self_attention(
            normed,
            attention_mask=attention_mask,
            key_value_states=context,
            inference_context=inference_context,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
        with self.bias_dropout_add_exec_handler():
            hidden_states = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                attn_out, residual, self.hidden_dropout
            )
        return hidden_states, context
