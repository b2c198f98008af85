"""Baseline: ring KV context parallelism (Ring Attention / LV-XAttn family).

Source: DESIGN.md section 2 ("Baselines"), arXiv 2611.05926. Communication is context-sized: every rank
sends and receives every other rank's K/V shard once per forward and K/V plus dK/dV once per backward.
"""

from __future__ import annotations

import torch

from ..comm import RingExchange
from ..lse import merge
from .common import (
    baseline_backward_inputs,
    cast,
    intervals,
    kernel_backward,
    kernel_forward,
    save_baseline_forward,
    split_own_grad,
    unsort,
    with_own_keys,
    zero_invalid_rows,
)
from .prepare import run_op

__all__ = ["ring_kv_attention"]


def _next_shard(plan, step, tensors, op):
    """Post the exchange that brings the shard needed at `step + 1` (sizes known from the metadata
    gather: the shard of group rank (rank - step - 1) mod P); sends `tensors` to rank + 1."""
    g = plan.group
    n = plan.n_ctx[(g.rank - step - 1) % g.size]
    specs = [((n,) + tuple(t.shape[1:]), t.dtype, t.device) for t in tensors]
    return RingExchange(g, op, tensors, specs)


class _RingKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, q, k_ctx, v_ctx, k_blk, v_blk):
        g, bsz, meta = plan.group, plan.block_size, plan.meta
        tk = plan.n_ctx[g.rank]
        own = k_blk is not None
        # step 0 computes this rank's sorted shard together with the own block (its keys appended after
        # the shard, `meta.mask_own`): the own-block attention is part of the first kernel call.
        k_x = with_own_keys(k_ctx, meta.order, k_blk, plan.valid_rows)
        v_x = with_own_keys(v_ctx, meta.order, v_blk, plan.valid_rows)
        k_s, v_s = k_x[:tk], v_x[:tk]  # the shard that travels (views)
        keys, order = meta.keys, meta.order
        # With per-step metadata (`prepare_splitkv_metadata`) every step's IntervalMask is precomputed
        # from the gathered context keys, so only K/V travel. Without it the sorted keys travel with K/V
        # and each step's mask is built on arrival (step 0's is always precomputed).
        pre = meta.step_masks
        q = zero_invalid_rows(q, plan.valid_rows)  # no NaN/inf of an invalid block reaches a tile
        out, lse = None, None
        cur, masks, states = ((k_s, v_s) if pre is not None else (k_s, v_s, keys)), [], []
        for step in range(g.size):
            # overlap: the next shard travels while this one is computed.
            ex = _next_shard(plan, step, cur, "ring_kv.fwd.kv") if step < g.size - 1 else None
            if step == 0:
                mask, kk, vv = (meta.mask_own if own else meta.mask), k_x, v_x
            else:
                mask = (pre[step] if pre is not None
                        else intervals(cur[2], plan.q_seq, plan.q_anchor, bsz, meta.window))
                kk, vv = cur[0], cur[1]
            o_t, lse_t, state = kernel_forward(plan, q, kk, vv, mask)
            out, lse = merge(out, lse, o_t, lse_t)
            masks.append(mask)
            states.append(state)
            if ex is not None:
                cur = tuple(ex.wait())
        ctx.order, ctx.masks, ctx.states, ctx.own = order, masks, states, own
        return save_baseline_forward(ctx, plan, q, k_x, v_x, keys, out, lse)

    @staticmethod
    @torch.autograd.function.once_differentiable  # backward is not differentiable: double backward raises
    def backward(ctx, dout, dlse):
        plan, q, k_x, v_x, keys, lse, dout, delta = baseline_backward_inputs(ctx, dout, dlse)
        g = plan.group
        tk = plan.n_ctx[g.rank]
        k_s, v_s = k_x[:tk], v_x[:tk]
        # (without per-step metadata the keys travel again, as they always did; the masks are saved)
        cur = (k_s, v_s) if plan.meta.step_masks is not None else (k_s, v_s, keys)
        ex_grad, dq, dk_b, dv_b = None, None, None, None
        for step in range(g.size):
            ex_kv = _next_shard(plan, step, cur, "ring_kv.bwd.kv") if step < g.size - 1 else None
            kk, vv = (k_x, v_x) if step == 0 else (cur[0], cur[1])
            dq_t, dk_t, dv_t = kernel_backward(plan, q, kk, vv, ctx.masks[step], dout, lse, delta,
                                               ctx.states[step])
            dq = dq_t if dq is None else dq + dq_t
            if step == 0:  # the own-block rows of the first step's keys are dk_blk / dv_blk
                dk_t, dk_b = split_own_grad(dk_t, tk, ctx.own)
                dv_t, dv_b = split_own_grad(dv_t, tk, ctx.own)
            if ex_grad is not None:  # dK/dV accumulated by the ranks this shard visited before
                dk_in, dv_in = ex_grad.wait()
                dk_t, dv_t = dk_t + dk_in, dv_t + dv_in
            if g.size > 1:  # pass the accumulators on; after the last step they reach the owner
                ex_grad = _next_shard(plan, step, (dk_t, dv_t), "ring_kv.bwd.dkv")
            if ex_kv is not None:
                cur = tuple(ex_kv.wait())
        dk_s, dv_s = ex_grad.wait() if ex_grad is not None else (dk_t, dv_t)
        dt = q.dtype
        return (None, dq.to(dt), unsort(dk_s, ctx.order).to(dt), unsort(dv_s, ctx.order).to(dt),
                cast(dk_b, dt), cast(dv_b, dt))


def ring_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, q_seq=None, q_anchor=None, kv_seq=None, kv_pos=None, *,
                      block_size=None, cp_group=None, softmax_scale=None, backend="auto", return_lse=False,
                      metadata=None, config=None, check_group=None, window=None, causal=False):
    """Baseline CP DFlash attention: rotate context K/V shards around the ring (DESIGN.md section 2,
    "Baselines"; Ring Attention / LV-XAttn family, compared in arXiv 2611.05926).

    Same signature (config=, check_group=, window= and causal= included), inputs, outputs, dtypes, mask,
    validation and errors as `megatron_splitkv.splitkv_attention` (see there).
    Each rank sorts its context by (sequence,
    position) once; the sorted K, V and keys rotate P - 1 steps with batch_isend_irecv, the transfer of
    the next shard overlapping the local kernel on the current one; partial results are merged by lse
    (fp32). The first step's kernel call also covers the own block (its keys appended after the own
    shard with block-diagonal second intervals, as in `splitkv_attention`; none with
    k_blk = v_blk = None). Backward rotates K/V
    again with fp32 dK/dV accumulators travelling one step behind, which
    reach their owner after P hops. Uneven and empty shards work (sizes come from the metadata gather).
    Communication per rank is O(Lk * Hkv * D).

    `metadata=`: a `SplitKVMetadata` from `prepare_splitkv_metadata(..., impl="ring_kv")`, once per
    step: the sorted keys of every rank are all-gathered once per step ("ring_kv.ctx_meta") and the P
    per-step IntervalMasks precomputed, so per call only K/V (and dK/dV) travel, no "ring_kv.meta"
    all-gather, no sort; rules and errors as in `splitkv_attention`. Every rank of the CP group must
    call it the same way: all with `metadata=` or all without (see `splitkv_attention`).
    """
    return run_op(_RingKV, "ring_kv", q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                  block_size=block_size, cp_group=cp_group, softmax_scale=softmax_scale, backend=backend,
                  return_lse=return_lse, metadata=metadata, config=config, check_group=check_group,
                  window=window, causal=causal)
