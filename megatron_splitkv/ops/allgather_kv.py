"""Baseline: all-gather KV context parallelism (what Megatron DFlash ports do today).

Source: DESIGN.md section 2 ("Baselines"), arXiv 2611.05926 section on CP baselines. Communication is
context-sized, O(Lk * Hkv * D) per rank and layer.
"""

from __future__ import annotations

import torch

from ..comm import all_gather, reduce_scatter
from .common import (
    baseline_backward_inputs,
    cast,
    kernel_backward,
    kernel_forward,
    pad_rows,
    save_baseline_forward,
    split_own_grad,
    with_own_keys,
    zero_invalid_rows,
)
from .prepare import run_op

__all__ = ["allgather_kv_attention"]


class _AllGatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, q, k_ctx, v_ctx, k_blk, v_blk):
        g, hkv = plan.group, plan.hkv
        tk_max = max(plan.n_ctx)
        # all-gather context K|V (one tensor), padded to the largest shard. The context keys were
        # gathered and sorted once per step (`SplitKVMetadata.gather_index`: sorted position -> padded
        # gathered row; `.mask` / `.mask_own`: this rank's blocks against all sorted keys, + own block):
        # no host sync here.
        kv_all = all_gather(pad_rows(torch.cat([k_ctx, v_ctx], 1), tk_max), g, "allgather_kv.fwd.kv")
        idx = plan.meta.gather_index
        own = k_blk is not None
        mask = plan.meta.mask_own if own else plan.meta.mask
        # one kernel call: this rank's queries against [all sorted context ; padding ; own block keys]
        k_x = with_own_keys(kv_all[:, :hkv], idx, k_blk, plan.valid_rows)
        v_x = with_own_keys(kv_all[:, hkv:], idx, v_blk, plan.valid_rows)
        q_z = zero_invalid_rows(q, plan.valid_rows)  # no NaN/inf of an invalid block reaches a tile
        out, lse, state = kernel_forward(plan, q_z, k_x, v_x, mask)
        ctx.mask, ctx.state, ctx.rows_all, ctx.own = mask, state, kv_all.shape[0], own
        return save_baseline_forward(ctx, plan, q_z, k_x, v_x, idx, out, lse)

    @staticmethod
    @torch.autograd.function.once_differentiable  # backward is not differentiable: double backward raises
    def backward(ctx, dout, dlse):
        plan, q, k_x, v_x, idx, lse, dout, delta = baseline_backward_inputs(ctx, dout, dlse)
        g, acc, hkv = plan.group, plan.acc, plan.hkv
        dq, dk_x, dv_x = kernel_backward(plan, q, k_x, v_x, ctx.mask, dout, lse, delta, ctx.state)
        n_all = idx.shape[0]
        dk_s, dk_b = split_own_grad(dk_x, n_all, ctx.own)
        dv_s, dv_b = split_own_grad(dv_x, n_all, ctx.own)
        # reduce-scatter dK|dV (fp32) of the gathered context back to the owning ranks.
        dkv_all = torch.zeros((ctx.rows_all, 2 * hkv, q.shape[2]), dtype=acc, device=q.device)
        dkv_all.index_copy_(0, idx, torch.cat([dk_s, dv_s], 1))
        dkv = reduce_scatter(dkv_all, g, "allgather_kv.bwd.dkv")[: plan.n_ctx[g.rank]]
        dt = q.dtype
        return (None, dq.to(dt), dkv[:, :hkv].to(dt), dkv[:, hkv:].to(dt), cast(dk_b, dt), cast(dv_b, dt))


def allgather_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, q_seq=None, q_anchor=None, kv_seq=None,
                           kv_pos=None, *, block_size=None, cp_group=None, softmax_scale=None, backend="auto",
                           return_lse=False, metadata=None, config=None, check_group=None, window=None,
                           causal=False):
    """Baseline CP DFlash attention: all-gather the context K/V, attend local queries (DESIGN.md
    section 2, "Baselines"; arXiv 2611.05926).

    Same signature (config=, check_group=, window= and causal= included), inputs, outputs, dtypes, mask,
    validation and errors as `megatron_splitkv.splitkv_attention` (see there).
    Forward all-gathers context K|V and their
    (sequence, position) keys, padded to the largest shard (uneven shards allowed); each rank runs one
    local-kernel call of its own queries against all context plus its own-block keys (appended after the
    sorted context with block-diagonal second intervals, as in `splitkv_attention`; none with
    k_blk = v_blk = None).
    Backward reduce-scatters dK|dV (fp32) of the whole context back to the owners. Communication per
    rank is O(Lk * Hkv * D): it grows with the context. Every rank of the CP group must call it the same
    way: all with `metadata=` or all without (see `splitkv_attention`).
    """
    return run_op(_AllGatherKV, "allgather_kv", q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq,
                  kv_pos, block_size=block_size, cp_group=cp_group, softmax_scale=softmax_scale,
                  backend=backend, return_lse=return_lse, metadata=metadata, config=config, check_group=check_group,
                  window=window, causal=causal)
