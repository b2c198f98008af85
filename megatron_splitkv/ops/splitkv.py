"""Split-KV attention: exact context-parallel DFlash attention with query-sized communication.

Source: arXiv 2611.05926 (Split-KV), DESIGN.md section 2. Every collective moves O(Lq * H * D) bytes,
independent of the context length.
"""

from __future__ import annotations

import torch

from ..comm import all_gather, all_reduce_max, reduce_scatter
from .common import (
    add_grad,
    cast,
    delta_and_dout,
    finalize,
    kernel_backward,
    kernel_forward,
    lse_weights,
    merge,
    own_block_backward,
    own_block_forward,
    pad_rows,
    sorted_context,
    unsort,
)
from .metadata import run_op

__all__ = ["splitkv_attention"]


class _SplitKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, q, k_ctx, v_ctx, k_blk, v_blk):
        g, bsz, acc = plan.group, plan.block_size, plan.acc
        rows_max = max(plan.n_blocks) * bsz
        rows = q.shape[0]
        d = q.shape[2]
        # 1. all-gather Q (padded to the largest block count); the block metadata was gathered once per
        #    step into the metadata (`SplitKVMetadata.block_meta`; pads are invalid).
        q_all = all_gather(pad_rows(q, rows_max), g, "splitkv.fwd.q")
        # 2. local context attention of all gathered queries against this rank's sorted keys
        #    (order and intervals precomputed per step: no host sync here).
        meta = plan.meta
        k_s, v_s = sorted_context(meta, k_ctx, v_ctx)
        mask, order = meta.mask, meta.order
        o_r, lse_r, state = kernel_forward(plan, q_all, k_s, v_s, mask)
        # 3. merge across ranks: global row max, then reduce-scatter [O_r * w | w] to the owners.
        m = all_reduce_max(lse_r.clone(), g, "splitkv.fwd.lse_max")
        m_safe, w = lse_weights(lse_r, m)
        part = reduce_scatter(torch.cat([o_r * w[..., None], w[..., None]], -1), g, "splitkv.fwd.out")
        own = slice(g.rank * rows_max, g.rank * rows_max + rows)
        o_ctx, lse_ctx = finalize(part[:rows, :, :d], part[:rows, :, d], m_safe[own])
        # 4. merge the owner's own-block attention (none when k_blk is None).
        o_b, lse_b = own_block_forward(q, k_blk, v_blk, plan.valid, bsz, plan.scale, acc)
        out, lse = merge(o_ctx, lse_ctx, o_b, lse_b)
        ctx.plan, ctx.mask, ctx.order, ctx.state = plan, mask, order, state
        ctx.save_for_backward(q_all, k_s, v_s, q, k_blk, v_blk, out, lse)
        return out.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # backward is not differentiable: double backward raises
    def backward(ctx, dout, dlse):
        q_all, k_s, v_s, q, k_blk, v_blk, out, lse = ctx.saved_tensors
        plan = ctx.plan
        g, bsz, acc = plan.group, plan.block_size, plan.acc
        rows, rows_max = q.shape[0], q_all.shape[0] // g.size
        dout, delta = delta_and_dout(plan, dout, dlse, out, lse, q)
        # all-gather dO and (delta, lse): the GLOBAL statistics every rank's local backward needs.
        do_all = all_gather(pad_rows(dout, rows_max), g, "splitkv.bwd.dout")
        stats = pad_rows(torch.stack([delta, lse], -1), rows_max, float("-inf"))
        stats_all = all_gather(stats, g, "splitkv.bwd.stats")
        delta_all = torch.nan_to_num(stats_all[..., 0], neginf=0.0)
        dq_r, dk_s, dv_s = kernel_backward(plan, q_all, k_s, v_s, ctx.mask, do_all, stats_all[..., 1],
                                           delta_all, ctx.state)
        dq = reduce_scatter(dq_r, g, "splitkv.bwd.dq")[:rows]
        dq_b, dk_b, dv_b = own_block_backward(q, k_blk, v_blk, plan.valid, bsz, plan.scale, dout, lse,
                                              delta, acc)
        dt = q.dtype
        return (None, add_grad(dq, dq_b).to(dt), unsort(dk_s, ctx.order).to(dt),
                unsort(dv_s, ctx.order).to(dt), cast(dk_b, dt), cast(dv_b, dt))


def splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, q_seq=None, q_anchor=None, kv_seq=None, kv_pos=None, *,
                      block_size=None, cp_group=None, softmax_scale=None, backend="auto", return_lse=False,
                      metadata=None):
    """Exact DFlash drafter attention under Split-KV context parallelism (arXiv 2611.05926; DESIGN.md
    section 2).

    Each CP rank passes its own query blocks and its own (arbitrary, planner-chosen) context tokens.
    Forward: all-gather Q and block metadata; attend all gathered queries to the local context (local
    kernel, fp32 out/lse); merge by lse with an all-reduce MAX and a reduce-scatter of
    [O * exp(lse - max) | exp(lse - max)] (fp32) back to the query owners; merge the owner's own-block
    attention. Backward: all-gather dO and the global (delta, lse); local kernel backward with the global
    statistics; reduce-scatter dQ (fp32); dK/dV of the context stay local. Every collective is
    query-sized (O(Lq * Hq * D)), independent of the context length.

    Args:
        q: [Tq_local, Hq, D] this rank's query rows, block by block (Tq_local = n_blocks_local * B).
        k_ctx, v_ctx: [Tk_local, Hkv, D] this rank's context keys/values in any order (Tk_local may be 0).
        k_blk, v_blk: [Tq_local, Hkv, D] keys/values of this rank's query blocks (the blocks' own tokens),
            or both None: no own-block part, every row attends only the context keys its block sees
            (plain cross-attention; e.g. block_size=1, one row per block, q_anchor = 2**31 - 1 to see
            every context key of sequence q_seq, and kv_seq = -1 for masked-out keys).
        q_seq, q_anchor: [n_blocks_local] integer (int64); sequence id and anchor position per block;
            anchor < 0 marks an invalid (padding) block: its rows are 0 and get zero gradient.
        kv_seq, kv_pos: [Tk_local] integer (int64); sequence id and global position per context token.
            Ids and positions must lie in [-2**31, 2**31).
        block_size: B (keyword; required without `metadata=`). Mask: a row of block b sees context keys with kv_seq == q_seq[b] and
            kv_pos < q_anchor[b] (strictly) on every rank, plus all B keys of its own block (unless
            k_blk is None).
        cp_group: the CP ProcessGroup; None = the default group if initialised, else single process.
            Ranks may hold different numbers of blocks and context tokens, including zero.
        softmax_scale: defaults to 1 / sqrt(D).
        backend: local kernel, "auto" | "math" | "flex" | "te" (see `megatron_splitkv.kernels`).
        return_lse: also return the merged lse.
        metadata: a `SplitKVMetadata` from `prepare_splitkv_metadata(..., impl="splitkv")`, prepared once
            per training step and shared by every layer (see `megatron_splitkv.ops.metadata`). Then
            q_seq, q_anchor, kv_seq, kv_pos may be None (or must be the very tensors given to prepare),
            block_size and cp_group may be None (or must match), and the call does no host sync and no
            collective besides Q/O/dO/dQ movement: no "splitkv.meta" / "splitkv.fwd.block_meta"
            all-gather, no sort, no interval or BlockMask rebuild. The tensors are only checked for the
            shapes/dtype/device the metadata implies. Results are identical to a call without it.
            Every rank of the CP group must call the same way in a given layer: all with `metadata=`
            (prepared together, the same `group_check`) or all without, and with the same
            softmax_scale. A group mixing the two is detected (the same ValueError on every rank) only
            when the metadata has `group_check=True`; without it the ranks' first collectives do not
            match and the call fails or hangs until the process group's timeout. softmax_scale is
            compared across ranks by calls without `metadata=` and by `group_check` calls.

    Returns:
        out [Tq_local, Hq, D] in q's dtype (or (out, lse) with lse [Tq_local, Hq] float32, float64 for
        float64 inputs, natural log; rows that see no key have out = 0, lse = -inf). Differentiable in
        q, k_ctx, v_ctx, k_blk, v_blk (and through lse); with k_blk = v_blk = None their gradients are
        None. Grouped-query attention: q head h uses kv head
        h // (Hq // Hkv). Dtypes: bf16, fp16, fp32, fp64 (all five tensors the same).

    Raises:
        ValueError (on every rank of the group, same message): bad shapes/dtypes/devices, only one of
            k_blk / v_blk None, Hq % Hkv != 0,
            block_size not dividing Tq_local, metadata of wrong length or dtype, or block_size / Hq /
            Hkv / D / dtype / resolved softmax_scale differing across ranks. With `metadata=`: ValueError on this rank when a
            tensor's shape (Tq_local, Tk_local, Hq, Hkv, D), dtype or device differs from what the metadata
            implies, or when the metadata is for another impl; other ranks may then block in the call's
            first collective (as in Megatron-Core) unless the metadata was prepared with
            `group_check=True`, in which case every rank raises the same ValueError.
        ImportError: backend "flex"/"te" not available.
    """
    return run_op(_SplitKV, "splitkv", q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                  block_size=block_size, cp_group=cp_group, softmax_scale=softmax_scale, backend=backend,
                  return_lse=return_lse, metadata=metadata)
