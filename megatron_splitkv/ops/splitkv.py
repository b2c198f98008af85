"""Split-KV attention: exact context-parallel DFlash attention with query-sized communication.

Source: arXiv 2611.05926 (Split-KV), DESIGN.md section 2. Every collective moves O(Lq * H * D) bytes,
independent of the context length. Three optimisations of docs/perf-notes.md are built in:

1. Own block fused into the local kernel: this rank's k_blk/v_blk are appended after its sorted context
   keys (padded to a multiple of 128, invalid blocks' rows zeroed: `ops.common.with_own_keys`) and its
   own query blocks (unchunked: gathered rows [rank * rows_max, rank * rows_max + Tq_local); in chunk c
   with rc rows per rank: rows [rank * rc, (rank + 1) * rc) where this rank has real blocks) get second
   intervals over them (`SplitKVMetadata.chunk_masks_own`, precomputed and validated once per step), so
   the kernel's (O_r, lse_r) already include the B x B own-block attention; the cross-rank merge does
   the rest (no separate own-block pass or merge), and the kernel's dk/dv of the appended rows are
   dk_blk/dv_blk. k_blk = v_blk = None: context keys only (`chunk_masks`).
2. Fused lse merge over an all-to-all: each rank sends every owner the partial state of the owner's rows,
   O_r in the inputs' dtype (the precision FlexAttention and TE store O in) with lse_r appended
   bit-exact (`ops.common.pack_partial`), in ONE all-to-all; the owner merges its P partials in fp32
   (`merge_partials`: max, weights, sums, -inf rows safe). This replaces the all-reduce MAX plus the fp32
   reduce-scatter of [O * w | w] of DESIGN.md section 2 (same result: the weights are formed from the
   same lse values, in fp32, at the owner), with half the bytes for bf16 inputs and one collective
   instead of two. dQ likewise: every rank sends its dQ partials in the inputs' dtype and the owner sums
   them in fp32.
3. Chunked merge pipeline (`num_chunks`, default 1): the gathered query rows are split into k chunks
   (chunk c = the blocks [b0_c, b1_c) of EVERY rank's padded segment, `SplitKVMetadata.chunks`), so each
   chunk's all-to-all delivers rows to their owners. Forward per chunk: all-gather the chunk's Q
   (prefetched one chunk ahead), local kernel, asynchronous all-to-all of [O | lse] (overlapping the
   next chunk's kernel); the owner's merges at the end. Backward per chunk: all-gather the chunk's dO and
   (delta, lse) (prefetched one chunk ahead), kernel backward against the full local keys (dk/dv
   accumulated in fp32 across chunks), asynchronous all-to-all of dQ. Exposed on the GPU (NCCL streams,
   `async_op=True`, compute on the current stream): the first Q / dO gathers and the last all-to-alls.
   Bytes per collective name are unchanged by chunking (only the record count grows, k per name).
"""

from __future__ import annotations

import torch

from ..comm import all_gather, all_to_all
from .common import (
    cast,
    delta_and_dout,
    kernel_backward,
    kernel_forward,
    merge_partials,
    pack_partial,
    pad_rows,
    split_own_grad,
    unpack_partial,
    unsort,
    with_own_keys,
    zero_invalid_rows,
)
from .metadata import run_op

__all__ = ["splitkv_attention"]


class _SplitKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, q, k_ctx, v_ctx, k_blk, v_blk):
        g, bsz, meta = plan.group, plan.block_size, plan.meta
        rows, d = q.shape[0], q.shape[2]
        rows_max = max(plan.n_blocks) * bsz
        chunks = meta.chunks
        own = k_blk is not None
        masks = meta.chunk_masks_own if own else meta.chunk_masks
        # local keys: sorted context (order precomputed per step, no host sync) [+ padding + own block]
        k_x = with_own_keys(k_ctx, meta.order, k_blk, plan.valid_rows)
        v_x = with_own_keys(v_ctx, meta.order, v_blk, plan.valid_rows)
        # 1. all-gather Q chunk by chunk (invalid blocks' rows zeroed, padded to the largest block count;
        #    block metadata gathered once per step into the metadata, pads are invalid), prefetched one
        #    chunk ahead.
        q_pad = zero_invalid_rows(q, plan.valid_rows, rows_max)

        def gather_q(c):
            b0, b1 = chunks[c]
            return all_gather(q_pad[b0 * bsz:b1 * bsz], g, "splitkv.fwd.q", async_op=True)

        n, P = len(chunks), g.size
        q_chunks, states, pend_o = [], [], []
        pend_q = gather_q(0)
        for c in range(n):
            nxt = gather_q(c + 1) if c + 1 < n else None
            q_c = pend_q.wait()
            pend_q = nxt
            # 2. local attention of the chunk's gathered queries against this rank's keys (context and,
            #    for this rank's own blocks, the own block); intervals precomputed per step.
            o_r, lse_r, state = kernel_forward(plan, q_c, k_x, v_x, masks[c])
            q_chunks.append(q_c)
            states.append(state)
            # 3. send every owner the partial (O_r in q's dtype, lse_r bit-packed beside it) of its rows:
            #    one asynchronous all-to-all per chunk, overlapping the next chunk's kernel.
            pend_o.append(all_to_all(pack_partial(o_r, lse_r, q.dtype), g, "splitkv.fwd.out", async_op=True))
            del o_r, lse_r
        out_parts, lse_parts = [], []
        for c in range(n):
            # 4. the owner merges the P partials of its rows in fp32 (fused lse merge: max, weights, sums)
            rc = (chunks[c][1] - chunks[c][0]) * bsz
            o_all, lse_all = unpack_partial(pend_o[c].wait(), d, plan.acc)
            o_c, l_c = merge_partials(o_all.view(P, rc, *o_all.shape[1:]),
                                      lse_all.view(P, rc, *lse_all.shape[1:]))  # rc may be 0: no -1
            out_parts.append(o_c)
            lse_parts.append(l_c)
        out = (out_parts[0] if n == 1 else torch.cat(out_parts))[:rows]
        lse = (lse_parts[0] if n == 1 else torch.cat(lse_parts))[:rows]
        ctx.plan, ctx.masks, ctx.states, ctx.own = plan, masks, states, own
        ctx.save_for_backward(k_x, v_x, q, out, lse, *q_chunks)
        return out.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # backward is not differentiable: double backward raises
    def backward(ctx, dout, dlse):
        k_x, v_x, q, out, lse, *q_chunks = ctx.saved_tensors
        plan, meta = ctx.plan, ctx.plan.meta
        g, bsz = plan.group, plan.block_size
        rows, rows_max = q.shape[0], max(plan.n_blocks) * bsz
        chunks = meta.chunks
        dout, delta = delta_and_dout(plan, dout, dlse, out, lse, q)
        # all-gather dO and (delta, lse) chunk by chunk (one ahead): the GLOBAL statistics every rank's
        # local backward needs.
        do_pad = pad_rows(dout, rows_max)
        stats = pad_rows(torch.stack([delta, lse], -1), rows_max, float("-inf"))

        def gather(c):
            b0, b1 = chunks[c]
            sl = slice(b0 * bsz, b1 * bsz)
            return (all_gather(do_pad[sl], g, "splitkv.bwd.dout", async_op=True),
                    all_gather(stats[sl], g, "splitkv.bwd.stats", async_op=True))

        n = len(chunks)
        pend, pend_dq, dk_x, dv_x = gather(0), [], None, None
        for c in range(n):
            nxt = gather(c + 1) if c + 1 < n else None
            do_all, stats_all = pend[0].wait(), pend[1].wait()
            pend = nxt
            delta_all = torch.nan_to_num(stats_all[..., 0], neginf=0.0)
            dq_r, dk_c, dv_c = kernel_backward(plan, q_chunks[c], k_x, v_x, ctx.masks[c], do_all,
                                               stats_all[..., 1], delta_all, ctx.states[c])
            ctx.states[c] = None
            # send every owner its rows' dQ partial (q's dtype) while the next chunk's backward runs
            pend_dq.append(all_to_all(dq_r.to(q.dtype), g, "splitkv.bwd.dq", async_op=True))
            if dk_x is None:
                dk_x, dv_x = dk_c, dv_c
            else:
                dk_x += dk_c
                dv_x += dv_c
        # the owner sums the P partials of its rows in fp32
        # (explicit row counts: a chunk may hold no rows at all when every rank has zero blocks)
        dq = [p.wait().view(g.size, (b1 - b0) * bsz, *q.shape[1:]).to(plan.acc).sum(0)
              for p, (b0, b1) in zip(pend_dq, chunks)]
        dq = (dq[0] if n == 1 else torch.cat(dq))[:rows]
        tk = plan.n_ctx[g.rank]
        dk_s, dk_b = split_own_grad(dk_x, tk, ctx.own)
        dv_s, dv_b = split_own_grad(dv_x, tk, ctx.own)
        dt = q.dtype
        return (None, dq.to(dt), unsort(dk_s, meta.order).to(dt), unsort(dv_s, meta.order).to(dt),
                cast(dk_b, dt), cast(dv_b, dt))


def splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, q_seq=None, q_anchor=None, kv_seq=None, kv_pos=None, *,
                      block_size=None, cp_group=None, softmax_scale=None, backend="auto", return_lse=False,
                      metadata=None, num_chunks=None):
    """Exact DFlash drafter attention under Split-KV context parallelism (arXiv 2611.05926; DESIGN.md
    section 2).

    Each CP rank passes its own query blocks and its own (arbitrary, planner-chosen) context tokens.
    Forward: all-gather Q (block metadata: once per step); attend all gathered queries to the local
    context, and this rank's own blocks also to their own B keys, in ONE local-kernel call (fp32
    out/lse; the own keys are appended after the sorted context, see the module docstring); send each
    row's partial (O in q's dtype, lse bit-exact) to its owner in one all-to-all, where the P partials
    merge by lse in fp32. Backward: all-gather dO and the global (delta, lse); local kernel backward with
    the global statistics; all-to-all of the dQ partials (q's dtype), summed in fp32 by the owner; dK/dV of the context and of the own block stay
    local. Both passes run over `num_chunks` query chunks, overlapping each chunk's collectives with the
    next chunk's kernel. Every collective is query-sized (O(Lq * Hq * D)), independent of the context
    length and of the chunk count.

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
        num_chunks: query chunks of the merge pipeline (docs/perf-notes.md item 2): None = the
            environment variable MEGATRON_SPLITKV_NUM_CHUNKS, else 1 (2 pays off on slow
            inter-node links: docs/perf-notes.md); a positive int is clamped to [1, max(max(n_blocks), 1)]
            (see `ops.metadata.resolve_num_chunks`). Chunk c = blocks [c * nb // k, (c + 1) * nb // k)
            of every rank's padded segment (nb = max(n_blocks)). Must be the same on every rank. With
            `metadata=` the chunking was fixed by `prepare_splitkv_metadata(..., num_chunks=...)`: pass
            None, or a positive int that clamps to the metadata's `num_chunks` (e.g. the value given
            to prepare).

    Returns:
        out [Tq_local, Hq, D] in q's dtype (or (out, lse) with lse [Tq_local, Hq] float32, float64 for
        float64 inputs, natural log; rows that see no key have out = 0, lse = -inf). Differentiable in
        q, k_ctx, v_ctx, k_blk, v_blk (and through lse); with k_blk = v_blk = None their gradients are
        None. Grouped-query attention: q head h uses kv head
        h // (Hq // Hkv). Dtypes: bf16, fp16, fp32, fp64 (all five tensors the same).

    Raises:
        ValueError (on every rank of the group, same message): bad shapes/dtypes/devices, only one of
            k_blk / v_blk None, Hq % Hkv != 0,
            block_size not dividing Tq_local, metadata of wrong length or dtype, num_chunks (or the
            environment variable) not a positive int, or block_size / Hq / Hkv / D / dtype / resolved
            softmax_scale / requested num_chunks differing across ranks. With `metadata=`: ValueError
            on this rank when a tensor's shape (Tq_local, Tk_local, Hq, Hkv, D), dtype or device differs
            from what the metadata implies, when num_chunks differs from the metadata's, or when the
            metadata is for another impl; other ranks may then block in the call's
            first collective (as in Megatron-Core) unless the metadata was prepared with
            `group_check=True`, in which case every rank raises the same ValueError. A dtype the
            backend cannot run (backend "te": bf16/fp16 only; "flex": no float64 on CUDA) raises on every
            rank that uses that backend, before any data collective.
        ImportError: backend "flex"/"te" not available.
    """
    return run_op(_SplitKV, "splitkv", q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                  block_size=block_size, cp_group=cp_group, softmax_scale=softmax_scale, backend=backend,
                  return_lse=return_lse, metadata=metadata, num_chunks=num_chunks)
