"""Split-KV core attention for Megatron-Core 0.19 and the DFlash metadata object it reads.

Two public pieces:

* `DFlashPackedSeqParams`: a subclass of Megatron-Core's `PackedSeqParams` that carries the DFlash mask
  metadata (query blocks' sequence ids and anchors; local context tokens' sequence ids and global
  positions). `packed_seq_params` is the one per-batch object that Megatron-Core 0.19 already threads
  from `TransformerBlock.forward` -> `TransformerLayer.forward` -> `Attention.forward` ->
  `core_attention(...)`, so the metadata travels through the block without globals.
* `SplitKVCoreAttention`: a core-attention module honouring Megatron-Core 0.19's contract
  (`megatron/core/transformer/attention.py`, `CoreAttentionBuilder` / `CoreAttentionInterface`): built
  with `config, layer_number, attn_mask_type, attention_type, cp_comm_type, softmax_scale,
  pg_collection`, called with `(query, key, value, attention_mask, *, attn_mask_type, attention_bias,
  packed_seq_params)`; sbhd and thd layouts. Its context-parallel implementation is chosen at build
  time: `splitkv` (query-sized communication), `allgather-kv` or `ring-kv` (baselines).

Source: arXiv 2611.05926 (Split-KV), DESIGN.md sections 1, 2 and 4.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from .arguments import CP_IMPLS

__all__ = [
    "CP_IMPLS",
    "DFlashPackedSeqParams",
    "SplitKVCoreAttention",
    "resolve_cp_attention_fn",
]

_OP_NAMES = {
    "splitkv": "splitkv_attention",
    "allgather-kv": "allgather_kv_attention",
    "ring-kv": "ring_kv_attention",
}


# --------------------------------------------------------------------------------------------------
# Metadata object
# --------------------------------------------------------------------------------------------------


@dataclass
class DFlashPackedSeqParams(PackedSeqParams):
    """`PackedSeqParams` carrying the DFlash drafter mask metadata of one CP rank's micro-batch.

    Pass it as `packed_seq_params=` to `TransformerBlock.forward` (or to `DFlashAttention` /
    `SplitKVCoreAttention` directly); every DFlash layer reads the same object.

    Token order ("flattened order"): tokens are numbered sample-major, i.e. an sbhd tensor
    `[s, b, ...]` is read as `x.transpose(0, 1).reshape(b * s, ...)` (b = 1 is the usual drafter case,
    where this is simply the sequence order); a thd tensor `[t, ...]` is read as is.

    Fields (all int64 tensors on the activations' device; the inherited `PackedSeqParams` fields stay
    unused except `qkv_format`):
        q_seq: [n_blocks_local] sequence id of each local query block.
        q_anchor: [n_blocks_local] anchor position a_b of each block; `< 0` marks an invalid (padding)
            block, which sees nothing (its rows output 0).
        kv_seq: [Tk_local] sequence id of each local context token (flattened order).
        kv_pos: [Tk_local] GLOBAL position of each local context token (also its RoPE position).
        block_size: B, query tokens per block; the local query length must be n_blocks_local * B.
        qkv_format: "sbhd" (default) or "thd".

    Every CP rank holds the same number of query blocks (pad with invalid blocks); context shards may
    have any length, including 0. Query block b's tokens have positions `a_b + 0 .. B-1`.

    Errors: `validate()` raises ValueError on shape/dtype mismatches.
    Source: DESIGN.md section 1 (DFlash mask), arXiv 2611.05926.
    """

    q_seq: Tensor = None
    q_anchor: Tensor = None
    kv_seq: Tensor = None
    kv_pos: Tensor = None
    block_size: int = None

    def __post_init__(self):
        if self.qkv_format is None:
            self.qkv_format = "sbhd"
        super().__post_init__()

    @property
    def num_blocks(self) -> int:
        """Local number of query blocks."""
        return int(self.q_seq.numel())

    @property
    def num_query_tokens(self) -> int:
        """Local number of query tokens, n_blocks_local * block_size."""
        return self.num_blocks * int(self.block_size)

    @property
    def num_ctx_tokens(self) -> int:
        """Local number of context tokens."""
        return int(self.kv_seq.numel())

    def query_positions(self) -> Tensor:
        """[n_blocks_local * B] int64 global positions of the query tokens, `a_b + i`
        (invalid blocks get positions 0 .. B-1; they see nothing anyway)."""
        B = int(self.block_size)
        anchor = self.q_anchor.clamp(min=0)
        offs = torch.arange(B, device=anchor.device, dtype=torch.int64)
        return (anchor[:, None] + offs[None, :]).reshape(-1)

    def validate(self) -> None:
        """Raise ValueError when the metadata is inconsistent."""
        for name in ("q_seq", "q_anchor", "kv_seq", "kv_pos"):
            t = getattr(self, name)
            if not isinstance(t, Tensor) or t.dim() != 1:
                raise ValueError(f"DFlashPackedSeqParams.{name} must be a 1-D int64 tensor, got {t!r}")
            if t.dtype != torch.int64:
                raise ValueError(f"DFlashPackedSeqParams.{name} must be int64, got {t.dtype}")
        if self.q_seq.numel() != self.q_anchor.numel():
            raise ValueError("DFlashPackedSeqParams: q_seq and q_anchor must have the same length")
        if self.kv_seq.numel() != self.kv_pos.numel():
            raise ValueError("DFlashPackedSeqParams: kv_seq and kv_pos must have the same length")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"DFlashPackedSeqParams.block_size must be a positive int, got {self.block_size!r}")
        if self.qkv_format not in ("sbhd", "thd"):
            raise ValueError(f"DFlashPackedSeqParams.qkv_format must be 'sbhd' or 'thd', got {self.qkv_format!r}")


# --------------------------------------------------------------------------------------------------
# Dense, autograd-exact fallback (used when the fused op is absent, and for plain cross-attention)
# --------------------------------------------------------------------------------------------------


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 (equal sizes); backward sums the gradient over ranks and keeps the
    local slice (gloo-safe: all_reduce instead of reduce_scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.n = x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return g[r * ctx.n : (r + 1) * ctx.n], None


class _ReduceScatterRows(torch.autograd.Function):
    """Sum over ranks, keep this rank's dim-0 slice; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        p = dist.get_world_size(group)
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        n = x.shape[0] // p
        r = dist.get_rank(group)
        return y[r * n : (r + 1) * n].clone()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, g.contiguous(), group=ctx.group)
        return torch.cat(parts, 0), None


def _gather_meta(x: Tensor, group) -> Tensor:
    if _group_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, 0)


def _safe_lse(x: Tensor, dim: int) -> Tensor:
    """log-sum-exp along `dim` that returns -inf (with zero, finite gradients) for all -inf slices."""
    m = x.detach().amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(x - m).sum(dim=dim, keepdim=True)
    pos = s > 0
    out = torch.where(pos, m + torch.log(torch.where(pos, s, torch.ones_like(s))), torch.full_like(s, -math.inf))
    return out.squeeze(dim)


def _partial_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float):
    """Masked attention of q [T, Hq, D] over k, v [S, Hkv, D]; mask [T, S] or [Hq, T, S] bool (True =
    visible). Returns (o [T, Hq, D] normalised over the visible keys, lse [T, Hq] fp32-or-wider; rows
    with no visible key give o = 0, lse = -inf). Query head h uses kv head h // (Hq // Hkv)."""
    hq, hkv = q.shape[1], k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = hq // hkv
    kk = k.to(acc).repeat_interleave(rep, dim=1)
    vv = v.to(acc).repeat_interleave(rep, dim=1)
    s = torch.einsum("thd,shd->hts", q.to(acc), kk) * scale
    s = s.masked_fill(~mask.expand_as(s), -math.inf)
    lse = _safe_lse(s, -1)  # [H, T]
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe[..., None])
    o = torch.einsum("hts,shd->thd", p, vv)
    return o, lse.transpose(0, 1)


def _merge_states(os_: list, lses: list):
    """Exact merge of normalised partial states: o = sum_i exp(lse_i - lse) o_i, lse = lse-sum."""
    lse_stack = torch.stack(lses, 0)  # [n, T, H]
    lse = _safe_lse(lse_stack, 0)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    o = 0
    for oi, li in zip(os_, lses):
        o = o + torch.exp(li - lse_safe)[..., None] * oi
    return o, lse


def dense_splitkv_attention(
    q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos, *, block_size, cp_group=None,
    softmax_scale=None, backend="auto",
):
    """Dense, autograd-exact Split-KV DFlash attention (same signature and semantics as
    `megatron_splitkv.splitkv_attention`): all-gather Q and block metadata, local masked attention over
    this rank's context shard, exact lse merge reduce-scattered back to the query owners, then the
    owner merges its own-block attention. Materialises [H, Lq, Tk_local] scores: a fallback for tests
    and small shapes, used only when the fused op is unavailable. Returns [Tq_local, Hq, D] in q.dtype.
    """
    del backend
    tq, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    B = int(block_size)
    p = _group_size(cp_group)
    q_all = _GatherRows.apply(q, cp_group) if p > 1 else q
    q_seq_all = _gather_meta(q_seq, cp_group)
    q_anchor_all = _gather_meta(q_anchor, cp_group)
    valid = q_anchor_all >= 0
    m = (kv_seq[None, :] == q_seq_all[:, None]) & (kv_pos[None, :] < q_anchor_all[:, None]) & valid[:, None]
    m = m.repeat_interleave(B, dim=0)
    o_c, lse_c = _partial_attention(q_all, k_ctx, v_ctx, m, scale)  # [Lq, H, D], [Lq, H]
    if p > 1:
        lse_ranks = _GatherRows.apply(lse_c.unsqueeze(0), cp_group)  # [P, Lq, H]
        lse_g = _safe_lse(lse_ranks, 0)
        lse_g_safe = torch.where(torch.isfinite(lse_g), lse_g, torch.zeros_like(lse_g))
        o_c = _ReduceScatterRows.apply(torch.exp(lse_c - lse_g_safe)[..., None] * o_c, cp_group)
        r = dist.get_rank(cp_group)
        lse_c = lse_g[r * tq : (r + 1) * tq]
    nb = tq // B
    vq = q_anchor >= 0
    own = (torch.eye(nb, dtype=torch.bool, device=q.device) & vq[:, None])
    own = own.repeat_interleave(B, 0).repeat_interleave(B, 1)
    o_b, lse_b = _partial_attention(q, k_blk, v_blk, own, scale)
    o, _ = _merge_states([o_c, o_b], [lse_c, lse_b])
    return o.to(q.dtype)


def dense_cross_attention(q, k, v, *, key_mask=None, cp_group=None, softmax_scale=None):
    """Plain (non-causal) cross-attention with the context sequence-sharded over the CP group,
    exact by the Split-KV merge: q [b, Tq_local, Hq, D], k/v [b, Tk_local, Hkv, D], key_mask optional
    [b, Tk_local] bool (True = visible). Each sample's queries see every visible key of that sample on
    every rank. Returns [b, Tq_local, Hq, D]."""
    b, tq, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    p = _group_size(cp_group)
    qf = q.transpose(0, 1)  # [Tq, b, H, D] so dim 0 gathers along the sequence
    q_all = _GatherRows.apply(qf.contiguous(), cp_group) if p > 1 else qf
    outs, lses = [], []
    for i in range(b):
        mk = torch.ones(q_all.shape[0], k.shape[1], dtype=torch.bool, device=q.device)
        if key_mask is not None:
            mk = mk & key_mask[i][None, :]
        o_i, l_i = _partial_attention(q_all[:, i], k[i], v[i], mk, scale)
        outs.append(o_i)
        lses.append(l_i)
    o = torch.stack(outs, 1)  # [Lq, b, H, D]
    lse = torch.stack(lses, 1)  # [Lq, b, H]
    if p > 1:
        lse_ranks = _GatherRows.apply(lse.unsqueeze(0), cp_group)
        lse_g = _safe_lse(lse_ranks, 0)
        lse_g_safe = torch.where(torch.isfinite(lse_g), lse_g, torch.zeros_like(lse_g))
        o = _ReduceScatterRows.apply(torch.exp(lse - lse_g_safe)[..., None] * o, cp_group)
    return o.transpose(0, 1).to(q.dtype)


# --------------------------------------------------------------------------------------------------
# Op resolution
# --------------------------------------------------------------------------------------------------

_warned_fallback = set()


def resolve_cp_attention_fn(cp_impl: str) -> Callable:
    """The DFlash attention function for `cp_impl` in CP_IMPLS: `megatron_splitkv.splitkv_attention`,
    `allgather_kv_attention` or `ring_kv_attention` (signature documented in DESIGN.md section 2).
    Imported lazily; when the package does not (yet) export it, falls back to
    `dense_splitkv_attention` (exact, dense) with a one-time warning.

    Raises ValueError naming `--context-parallel-impl` for an unknown implementation."""
    if cp_impl not in CP_IMPLS:
        raise ValueError(f"--context-parallel-impl must be one of {CP_IMPLS}, got {cp_impl!r}")
    import megatron_splitkv

    fn = getattr(megatron_splitkv, _OP_NAMES[cp_impl], None)
    if fn is None:
        if cp_impl not in _warned_fallback:
            _warned_fallback.add(cp_impl)
            warnings.warn(
                f"megatron_splitkv.{_OP_NAMES[cp_impl]} is not available; using the dense "
                "autograd fallback dense_splitkv_attention (exact, not memory-efficient)."
            )
        return dense_splitkv_attention
    return fn


# --------------------------------------------------------------------------------------------------
# Core attention module
# --------------------------------------------------------------------------------------------------


class SplitKVCoreAttention(MegatronModule):
    """Context-parallel core attention for cross-attention-shaped workloads (Lq << Lk).

    Construction (Megatron-Core 0.19 `CoreAttentionBuilder`): `config, layer_number, attn_mask_type,
    attention_type, cp_comm_type, softmax_scale, pg_collection`, plus `cp_impl` (bind it with
    `functools.partial` in a spec; see `megatron_splitkv.megatron.specs.splitkv_core_attention`).
    The CP group is `pg_collection.cp`, else `parallel_state.get_context_parallel_group()`.
    `cp_comm_type` is ignored (the implementation is chosen by `cp_impl`).

    Call: `forward(query, key, value, attention_mask, *, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None)` with heads already split by TP:

    * DFlash mode (`packed_seq_params` is a `DFlashPackedSeqParams`): sbhd query `[sq, b, Hq_tp, D]`,
      key/value `[sk_ctx + sq, b, Hkv_tp, D]` = `[context keys | block keys]` concatenated along the
      sequence (sk_ctx = Tk_local / b), or thd query `[t, Hq_tp, D]`, key/value `[Tk_local + t, Hkv_tp, D]`.
      The mask is the DFlash mask (DESIGN.md section 1) built from the metadata; the CP algorithm is
      `cp_impl` (Split-KV exact merge, all-gather-KV or ring-KV).
    * Plain cross-attention (Megatron's `CrossAttention`, `packed_seq_params=None`): sbhd query
      `[sq_local, b, Hq, D]`, key/value `[sk_local, b, Hkv, D]`, both sequence-sharded over CP; every
      query sees every key of its sample (optionally minus `attention_mask` [b, 1, 1|sq, sk_local],
      True = masked, Megatron's convention). Computed by the dense exact Split-KV merge.

    Returns sbhd `[sq, b, Hq_tp * D]` or thd `[t, Hq_tp * D]`, dtype of `query`.

    Errors: NotImplementedError for `attention_bias`, causal masks in plain mode; ValueError for
    inconsistent shapes/metadata. Source: Megatron-Core 0.19 `attention.py` contract; arXiv 2611.05926.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: Optional[str] = None,
        softmax_scale: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        cp_impl: str = "splitkv",
        kernel_backend: str = "auto",
        **unused,
    ):
        super().__init__(config=config)
        if cp_impl not in CP_IMPLS:
            raise ValueError(f"--context-parallel-impl must be one of {CP_IMPLS}, got {cp_impl!r}")
        if config.attention_dropout:
            raise ValueError(
                "SplitKVCoreAttention does not implement attention dropout: set --attention-dropout 0 "
                f"(config.attention_dropout={config.attention_dropout})"
            )
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = softmax_scale
        self.cp_impl = cp_impl
        self.kernel_backend = kernel_backend
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp is None and parallel_state.model_parallel_is_initialized():
            cp = parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_group = cp

    def _scale(self, d: int) -> float:
        return 1.0 / math.sqrt(d) if self.softmax_scale is None else self.softmax_scale

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        **unused,
    ) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SplitKVCoreAttention does not support attention_bias")
        if isinstance(packed_seq_params, DFlashPackedSeqParams):
            return self._dflash(query, key, value, packed_seq_params)
        if packed_seq_params is not None:
            raise NotImplementedError(
                "SplitKVCoreAttention: packed_seq_params must be DFlashPackedSeqParams or None "
                f"(got {type(packed_seq_params).__name__})"
            )
        return self._cross(query, key, value, attention_mask, attn_mask_type or self.attn_mask_type)

    def _dflash(self, query, key, value, params: DFlashPackedSeqParams) -> Tensor:
        params.validate()
        fmt = params.qkv_format
        if fmt == "sbhd":
            if query.dim() != 4:
                raise ValueError(f"sbhd query must be [s, b, h, d], got {tuple(query.shape)}")
            sq, b = query.shape[0], query.shape[1]
            n_ctx_total = params.num_ctx_tokens
            if n_ctx_total % b:
                raise ValueError(f"kv_seq length {n_ctx_total} not divisible by batch {b}")
            sk_ctx = n_ctx_total // b
            if key.shape[0] != sk_ctx + sq:
                raise ValueError(
                    f"key length {key.shape[0]} != context {sk_ctx} + block tokens {sq} (per sample)"
                )

            def flat(x):  # [s, b, h, d] -> [b*s, h, d] (sample-major)
                return x.transpose(0, 1).reshape(-1, x.shape[2], x.shape[3])

            q = flat(query)
            k_ctx, k_blk = flat(key[:sk_ctx]), flat(key[sk_ctx:])
            v_ctx, v_blk = flat(value[:sk_ctx]), flat(value[sk_ctx:])
        else:
            if query.dim() == 4:  # [t, 1, h, d] tolerated
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            t = query.shape[0]
            n_ctx = params.num_ctx_tokens
            if key.shape[0] != n_ctx + t:
                raise ValueError(f"key length {key.shape[0]} != context {n_ctx} + block tokens {t}")
            q, k_ctx, k_blk = query, key[:n_ctx], key[n_ctx:]
            v_ctx, v_blk = value[:n_ctx], value[n_ctx:]
        if q.shape[0] != params.num_query_tokens:
            raise ValueError(
                f"query tokens {q.shape[0]} != n_blocks {params.num_blocks} x block_size {params.block_size}"
            )
        if q.shape[1] % k_ctx.shape[1]:
            raise ValueError(
                f"query heads per TP rank ({q.shape[1]}) must be a multiple of kv heads per TP rank "
                f"({k_ctx.shape[1]}): check --num-query-groups vs --tensor-model-parallel-size"
            )
        fn = resolve_cp_attention_fn(self.cp_impl)
        out = fn(
            q, k_ctx, v_ctx, k_blk, v_blk, params.q_seq, params.q_anchor, params.kv_seq, params.kv_pos,
            block_size=int(params.block_size), cp_group=self.cp_group,
            softmax_scale=self._scale(q.shape[-1]), backend=self.kernel_backend,
        )
        if fmt == "sbhd":
            out = out.reshape(b, sq, -1).transpose(0, 1).contiguous()
        else:
            out = out.reshape(out.shape[0], -1)
        return out

    def _cross(self, query, key, value, attention_mask, mask_type) -> Tensor:
        if mask_type == AttnMaskType.causal:
            raise NotImplementedError(
                "SplitKVCoreAttention: causal masks need DFlash metadata (pass DFlashPackedSeqParams)"
            )
        if query.dim() != 4:
            raise ValueError(f"plain cross-attention expects sbhd [s, b, h, d], got {tuple(query.shape)}")
        key_mask = None
        if attention_mask is not None:
            # Megatron convention: True = masked out; shape broadcastable to [b, 1, sq, sk].
            am = attention_mask
            if am.dim() != 4 or am.shape[2] != 1:
                raise NotImplementedError(
                    "SplitKVCoreAttention: only key-padding masks [b, 1, 1, sk] are supported"
                )
            key_mask = ~am[:, 0, 0, :].to(torch.bool)
        out = dense_cross_attention(
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), key_mask=key_mask,
            cp_group=self.cp_group if _group_size(self.cp_group) > 1 else None,
            softmax_scale=self._scale(query.shape[-1]),
        )  # [b, sq, H, D]
        return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1).contiguous()
