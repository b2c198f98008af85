"""Split-KV attention: exact context-parallel DFlash attention with query-sized communication.

Source: arXiv 2611.05926 (Split-KV), DESIGN.md section 2. Each CP rank owns some query blocks and some
context keys. Forward, per chunk of the gathered queries (`ops.chunking`: rows or heads):

1. gather Q: all-gather of every rank's query rows ("splitkv.fwd.q"; `ops.query_gather`);
2. local attention: ONE kernel call of all gathered queries against this rank's keys, its own blocks'
   keys appended after the sorted context (`common.with_own_keys`), so (O_r, lse_r) include the own block;
3. return [O_r | lse_r] to the rows' owners: an all-to-all (`ops.transport`: flat or two-level);
4. lse merge: the owner merges the partials of its rows in fp32 (-inf rows give O = 0, lse = -inf).

Backward, the mirror: all-gather dO with the global (delta, lse); the local kernel backward with those
global statistics (dK / dV stay local); return the dQ partials to their owners, who sum them in fp32.
Every collective moves O(Lq * Hq * D) bytes, independent of the context length; each chunk's collectives
overlap the next chunk's kernel. Design notes and measurements: docs/lab/splitkv_notes.md.
"""

from __future__ import annotations

import torch

from ..comm import all_gather
from .chunking import chunking_for
from .common import (
    cast,
    delta_and_dout,
    kernel_backward,
    kernel_forward,
    pack_dout_stats,
    split_own_grad,
    unpack_dout_stats,
    unsort,
)
from .fused_merge import merge_received_partials, merges_in_place
from .prepare import run_op
from .query_gather import QueryChunks, SplitKVQueryGather, UnconsumedQueryGatherWarning, splitkv_start_query_gather
from .transport import sum_dq_partials, transport_for

__all__ = ["splitkv_attention", "splitkv_start_query_gather", "SplitKVQueryGather",
           "UnconsumedQueryGatherWarning"]


class _SplitKV(torch.autograd.Function):
    """The op over one call's `plan` (`ops.metadata`: metadata, kernel, scale, group). Inputs q [Tq_local, Hq, D],
    k_ctx / v_ctx [Tk_local, Hkv, D], k_blk / v_blk [Tq_local, Hkv, D] or None; with `gather` (the state of a
    consumed `SplitKVQueryGather`) q is None and `q_gathered` are its gathered chunks. Returns (out [Tq_local,
    Hq, D] in q's dtype, lse [Tq_local, Hq] in the accumulation dtype)."""

    @staticmethod
    def forward(ctx, plan, q, k_ctx, v_ctx, k_blk, v_blk, gather=None, *q_gathered):
        meta, dtype, acc, d = plan.meta, plan.meta.dtype, plan.acc, plan.meta.head_dim
        chunking, transport = chunking_for(meta), transport_for(meta)
        rows, rows_max, n = meta.tq_local, max(plan.n_blocks) * plan.block_size, len(chunking)
        own = k_blk is not None
        masks = meta.chunk_masks_own if own else meta.chunk_masks
        # 1. gather Q, chunk by chunk, one chunk ahead of the kernel (or started by the layer)
        if gather is None:
            queries = QueryChunks(chunking.sends(q, rows_max, valid_rows=meta.valid_rows), plan.group)
        else:
            queries = gather.queries(q_gathered)
        queries.prefetch(1)
        strided = bool(getattr(plan.kernel, "strided_heads", False))
        k_xs, k_saved = chunking.local_keys(k_ctx, meta.order, k_blk, plan.valid_rows, strided)
        v_xs, v_saved = chunking.local_keys(v_ctx, meta.order, v_blk, plan.valid_rows, strided)
        exchange = transport.exchange("fwd", acc, d, k_xs[0].device)
        q_chunks, states = [], []
        for c in range(n):
            q_c = queries.wait(c)
            # 2. local attention of every gathered query of the chunk against this rank's keys
            o_r, lse_r, state = kernel_forward(plan, q_c, k_xs[c], v_xs[c], masks[c], native=True)
            q_chunks.append(q_c)
            states.append(state)
            # 3. return the partial [O_r | lse_r] of every row to its owner
            packed = transport.pack_out(o_r, lse_r, dtype)
            del o_r, lse_r, q_c  # the fp32 partial: freed before the receive buffer is allocated
            exchange.send(packed, chunking.segment(c)[0])
            del packed
        exchange.finish()
        # 4. lse merge: the owner merges the partials of its rows in fp32
        out, lse = _merge_owner(exchange.pending, chunking, transport, rows, rows_max, d, dtype, acc, k_xs[0].device)
        ctx.plan, ctx.masks, ctx.states, ctx.own, ctx.gather = plan, masks, states, own, gather
        # the merged fp32 out is needed only for delta = rowsum(dO * O): an attribute (not a saved tensor), released
        # by backward before its kernel; for fp32 / fp64 inputs it IS the returned output, saved normally (an
        # attribute holding an output would form a reference cycle through the graph)
        alias = dtype == acc
        ctx.out = None if alias else out
        ctx.n_kv = len(k_saved)
        ctx.save_for_backward(lse, out if alias else None, *q_chunks, *k_saved, *v_saved)
        # an unused output gets None in backward (no zero fill, no dlse term: delta - 0 == delta bit for bit)
        ctx.set_materialize_grads(False)
        return out.to(dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # backward is not differentiable: double backward raises
    def backward(ctx, dout, dlse):
        plan, gather = ctx.plan, ctx.gather
        meta, dt, acc, d = plan.meta, plan.meta.dtype, plan.acc, plan.meta.head_dim
        chunking, transport = chunking_for(meta), transport_for(meta)
        rows, rows_max, n, nk = meta.tq_local, max(plan.n_blocks) * plan.block_size, len(chunking), ctx.n_kv
        lse, out, *saved = ctx.saved_tensors
        q_chunks = saved[:n]
        k_xs, v_xs = chunking.saved_keys(saved[n:n + nk]), chunking.saved_keys(saved[n + nk:])
        del saved
        if out is None:
            out, ctx.out = ctx.out, None
        if out is None:
            raise RuntimeError("splitkv_attention: backward ran a second time through the same call "
                               "(retain_graph=True); its forward state is released by the first backward")
        if dout is None:  # only lse was used downstream
            dout = torch.zeros(out.shape, dtype=dt, device=out.device)
        dout, delta = delta_and_dout(plan, dout, dlse, out, lse, None)
        del out  # the merged fp32 O: freed before the kernel backward
        # 1. gather dO and the GLOBAL statistics (delta, lse) every rank's local backward needs
        stats = torch.stack([delta, lse], -1)
        sends = list(zip(chunking.sends(dout, rows_max), chunking.sends(stats, rows_max, float("-inf"))))
        del delta, stats
        grads_in = _DoutChunks(sends, plan.group, transport.fused_dout_gather, dt, acc, d)
        exchange = transport.exchange("bwd", acc, d, lse.device)
        kv_grads = chunking.kv_grads(meta, dt, acc)
        for c in range(n):
            do_all, stats_all = grads_in.wait(c, chunking.segment(c)[1])
            # rows whose global lse is -inf (padding, rows that see no key: P = 0) get delta 0; any other delta
            # stays as it is, a non-finite one too, as in the reference
            delta_all = stats_all[..., 0].masked_fill(torch.isneginf(stats_all[..., 1]), 0.0)
            # 2. local backward with the global statistics
            dq_r, dk_c, dv_c = kernel_backward(plan, q_chunks[c], k_xs[c], v_xs[c], ctx.masks[c], do_all,
                                               stats_all[..., 1], delta_all, ctx.states[c], native=True)
            ctx.states[c] = None
            del do_all, stats_all, delta_all
            # 3. return every row's dQ partial to its owner; dK / dV stay here
            exchange.send(transport.pack_dq(dq_r, dt), chunking.segment(c)[0])
            del dq_r
            kv_grads.add(c, dk_c, dv_c)
            del dk_c, dv_c
        del q_chunks, k_xs, v_xs
        dk_x, dv_x, order = kv_grads.result()
        tk = plan.n_ctx[plan.group.rank]
        dk_s, dk_b = split_own_grad(dk_x, tk, ctx.own)
        dv_s, dv_b = split_own_grad(dv_x, tk, ctx.own)
        grads_kv = (unsort(dk_s, order).to(dt), unsort(dv_s, order).to(dt), cast(dk_b, dt), cast(dv_b, dt))
        exchange.finish()  # a two-level last stage 2: in flight while the caller's backward runs
        if gather is None:  # 4. the owner sums the partials of its rows in fp32
            return (None, sum_dq_partials(exchange.pending, chunking, transport, rows, d, dt, acc)) + grads_kv
        # query_gather: the dQ exchanges are the gradient of the gathered chunks, NOT waited for here:
        # _QueryGather.backward waits and sums them after the k/v projections' backward ran
        if any(ctx.needs_input_grad[7:]):
            gather.dq.append(exchange.pending)
            d_gathered = transport.gathered_grads(exchange.pending, chunking, dt, grads_kv[0].device, d)
        else:  # issued anyway (every rank issues the same collectives); nothing consumes them
            for pend in exchange.pending:
                pend.wait()
            d_gathered = (None,) * n
        return (None, None) + grads_kv + (None,) + d_gathered


def _merge_owner(pending, chunking, transport, rows, rows_max, head_dim, dtype, acc, device):
    """Forward step 4: waits each chunk's exchange and lse-merges the partials of this rank's rows in `acc`
    (`fused_merge.merge_received_partials`: max, weights, sums; the received buffer released once merged). Returns
    (out [rows, Hq, D], lse [rows, Hq]) in `acc`: more than one chunk are merged straight into their rows /
    heads of one output where the merge writes in place (`fused_merge.merges_in_place`) or the chunks split the
    heads, else concatenated."""
    merged = None
    if len(pending) > 1 and (chunking.merges_into_one
                             or merges_in_place(device, transport.recv_dtype(dtype, acc), head_dim, acc)):
        merged = (torch.empty((rows_max, chunking.num_heads_q, head_dim), dtype=acc, device=device),
                  torch.empty((rows_max, chunking.num_heads_q), dtype=acc, device=device))
    outs, lses = [], []
    for c in range(len(pending)):
        (r0, r1), (h0, h1) = chunking.rows(c), chunking.heads(c)
        dst = None if merged is None else (merged[0][r0:r1, h0:h1], merged[1][r0:r1, h0:h1])
        o_c, l_c = merge_received_partials(pending[c], transport.partials, r1 - r0, head_dim, acc, out=dst)
        pending[c] = None
        outs.append(o_c)
        lses.append(l_c)
        del o_c, l_c, dst
    if merged is not None:
        return merged[0][:rows], merged[1][:rows]
    if len(outs) == 1:
        return outs[0][:rows], lses[0][:rows]
    return torch.cat(outs)[:rows], torch.cat(lses)[:rows]


class _DoutChunks:
    """Backward step 1: per chunk, all-gather this rank's rows of dO and of the global statistics (delta, lse)
    (`sends`: per chunk the pair, from the chunking's `sends`; padding rows dO 0, statistics -inf), one chunk
    ahead of the kernel. `fused`: ONE all-gather "splitkv.bwd.dout" of both bit-packed in the inputs' dtype
    (`common.pack_dout_stats`), else two ("splitkv.bwd.dout", "splitkv.bwd.stats")."""

    def __init__(self, sends, group, fused: bool, dtype, acc, head_dim: int):
        self.sends, self.group, self.fused = sends, group, fused
        self.dtype, self.acc, self.head_dim = dtype, acc, head_dim
        self.pending, self.issued = {}, 0

    def _issue(self, c):
        do_c, st_c = self.sends[c]
        self.sends[c] = None
        if self.fused:
            return all_gather(pack_dout_stats(do_c, st_c, self.dtype), self.group, "splitkv.bwd.dout", async_op=True)
        return (all_gather(do_c, self.group, "splitkv.bwd.dout", async_op=True),
                all_gather(st_c, self.group, "splitkv.bwd.stats", async_op=True))

    def wait(self, c: int, heads: int):
        """(dO [P * rc, Hc, D] in the inputs' dtype, statistics [P * rc, Hc, 2] in acc) of chunk c, contiguous;
        the gathers of chunks <= c + 1 issued first. The received buffer is released here."""
        while self.issued < min(c + 2, len(self.sends)):
            self.pending[self.issued] = self._issue(self.issued)
            self.issued += 1
        pend = self.pending.pop(c)
        if self.fused:
            return unpack_dout_stats(pend.take(), self.group.size, heads, self.head_dim, self.acc)
        return pend[0].take(), pend[1].take()


def splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, q_seq=None, q_anchor=None, kv_seq=None, kv_pos=None, *,
                      block_size=None, cp_group=None, softmax_scale=None, backend="auto", return_lse=False,
                      metadata=None, num_chunks=None, query_gather=None, cp_ranks_per_node=None, chunk_axis=None,
                      config=None, check_group=None, window=None, causal=False):
    """Exact DFlash drafter attention under Split-KV context parallelism (arXiv 2611.05926; DESIGN.md
    section 2).

    Each CP rank passes its own query blocks and its own (arbitrary, planner-chosen) context tokens.
    Forward: all-gather Q (block metadata: once per step); attend all gathered queries to the local
    context, and this rank's own blocks also to their own B keys, in ONE local-kernel call (fp32
    out/lse; the own keys are appended after the sorted context, `common.with_own_keys`); send each
    row's partial (O in q's dtype, lse bit-exact) to its owner in one all-to-all, where the P partials
    merge by lse in fp32. Backward: ONE all-gather of dO with the global (delta, lse) bit-packed beside
    it; local kernel backward with the global statistics; all-to-all of the dQ partials (q's dtype),
    summed in fp32 by the owner; dK/dV of the context and of the own block stay local. With
    `cp_ranks_per_node` = L (1 < L < P) both all-to-alls run in two stages, inside each node of L ranks
    and then between nodes in fp32 (`ops.transport`). Both passes run over
    `num_chunks` query chunks, overlapping each chunk's collectives with the next chunk's kernel. Every
    collective is query-sized (O(Lq * Hq * D)), independent of the context length and of the chunk count.

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
        block_size: B (keyword; required without `metadata=`). Mask: a row of block b sees context keys with
            kv_seq == q_seq[b] and kv_pos < q_anchor[b] (strictly) on every rank, plus all B keys of its own
            block (unless k_blk is None).
        cp_group: the CP ProcessGroup; None = the default group if initialised, else single process.
            Ranks may hold different numbers of blocks and context tokens, including zero.
        softmax_scale: defaults to 1 / sqrt(D).
        backend: local kernel, "auto" | "math" | "flex" | "te" | "staircase" | "fa4" (see
            `megatron_splitkv.kernels`; "auto" = fa4 where FlashAttention-4 is installed (Hopper,
            bf16 / fp16), else staircase on CUDA from 32K context keys on the largest rank, else flex / math).
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
            when the metadata has `group_check=True` (the default); without it the ranks' first collectives do not
            match and the call fails or hangs until the process group's timeout. softmax_scale is
            compared across ranks by calls without `metadata=` and by `group_check` calls.
        num_chunks: chunks of the pipeline (`ops.chunking`): None = `config.num_chunks`, else 1; a positive
            int is clamped to [1, max(max(n_blocks), 1)] (`ops.metadata.resolve_num_chunks`). Chunk c =
            blocks [c * nb // k, (c + 1) * nb // k) of every rank's padded segment (nb = max(n_blocks)).
            Must be the same on every rank. With
            `metadata=` the chunking was fixed by `prepare_splitkv_metadata(..., num_chunks=...)`: pass
            None, or a positive int that clamps to the metadata's `num_chunks` (e.g. the value given
            to prepare). With chunk_axis "heads" the chunks split the heads instead (below).
        chunk_axis: what the `num_chunks` chunks split (`ops.chunking`): "rows" (the query blocks above, all
            heads) or "heads" (chunk c = kv heads [g0, g1) = `chunk_bounds(k, Hkv)[c]` and q heads
            [g0 * G, g1 * G), G = Hq // Hkv, of ALL rows; k clamped to [1, Hkv], uneven splits allowed: Hkv 8,
            k 3 -> 2 / 3 / 3 kv heads). None = `config.chunk_axis` (default "rows"). Must be the same on
            every rank (agreed group-wide like num_chunks). With `metadata=` it was fixed by
            `prepare_splitkv_metadata(..., chunk_axis=...)`: pass None or that value. The same results up
            to fp rounding, the same bytes per collective name.
        query_gather: a `SplitKVQueryGather` from `splitkv_start_query_gather(q, metadata=metadata)`,
            started right after q was computed (before the k/v projections, which then overlap the
            query all-gather in forward and the dQ all-to-all in backward; `ops.query_gather`).
            Requires `metadata=` (the same object); q must be the very tensor given to the start,
            unmodified; a handle serves exactly one call. The call then issues no "splitkv.fwd.q"
            all-gather of its own, and its results are bit-identical to the call without it. Every rank
            of the CP group must pass one, or none (a mixed group is detected with `group_check`).
        cp_ranks_per_node: L, CP ranks per node of the two-level all-to-all (`ops.transport`; our
            extension of DESIGN.md section 2's merge for CP groups spanning several nodes): None =
            `config.cp_ranks_per_node` (clamped to P), else 1; otherwise a
            positive int dividing P (`ops.metadata.resolve_ranks_per_node`). 1 or P: the single
            all-to-all over the CP group (bit-identical to the op without this option); 1 < L < P: node n
            = CP ranks [n * L, (n + 1) * L), which must share a node for the traffic split to pay off
            (correct anyway). Must be the same on every rank (agreed group-wide like num_chunks). With
            `metadata=` it was fixed by `prepare_splitkv_metadata(..., cp_ranks_per_node=...)`: pass
            None or that value.
        config: `megatron_splitkv.SplitKVConfig`, the options of the op and its kernels (None: the
            defaults); the keyword arguments above override its fields. With `metadata=` the metadata's
            config applies: pass None or the config given to the prepare.
        check_group: None (the call's verdict row goes over cp_group, on its device), or a gloo ProcessGroup
            with cp_group's ranks in its order: the row goes over it as a CPU tensor, no device sync
            (`prepare_splitkv_metadata`'s `check_group`; ValueError naming it otherwise). Give it on every
            rank or none, as the metadata of the ranks calling with `metadata=` has it; with `metadata=`
            pass None or the metadata's.
        window: None, or the sliding window W >= 1 of a `sliding_attention` layer (z-lab's dflash 0.1.0
            semantics, `reference.dflash_attention_mask`): row j of block b (position anchor + j) sees only
            context positions > anchor + j - W, and own-block keys i with j - i < W (and i - j < W unless
            causal). Blocks no key of this rank's windows reaches cost no kernel work here (their key
            interval is empty).
        causal: own-block keys i <= j only (dflash's is_causal: True for its sliding layers by default).
            window=None, causal=False is the full DFlash mask above, bit for bit. Must be the same on every
            rank: the call's first exchange compares them (ValueError naming "window / causal", each rank's
            values and the ranks that differ, on every rank). With `metadata=` both must equal the metadata's
            (`prepare_splitkv_metadata(..., window=, causal=)`). Kernels: math,
            flex and fa4 take windowed / causal masks; "auto" never picks staircase then, and "te" or
            "staircase" given explicitly raise ValueError naming the backend and window.

    Returns:
        out [Tq_local, Hq, D] in q's dtype (or (out, lse) with lse [Tq_local, Hq] float32, float64 for
        float64 inputs, natural log; rows that see no key have out = 0, lse = -inf). Differentiable in
        q, k_ctx, v_ctx, k_blk, v_blk (and through lse); with k_blk = v_blk = None their gradients are
        None. Grouped-query attention: q head h uses kv head
        h // (Hq // Hkv). Dtypes: bf16, fp16, fp32, fp64 (all five tensors the same).

    Raises:
        ValueError (on every rank of the group, same message): window not None or an int >= 1, causal not
            a bool, bad shapes/dtypes/devices, only one of
            k_blk / v_blk None, Hq % Hkv != 0,
            block_size not dividing Tq_local, metadata of wrong length or dtype, num_chunks not a
            positive int, chunk_axis not "rows" / "heads", cp_ranks_per_node (or the config's)
            not a positive int or not dividing the CP group size P (the limit is named in the message),
            or block_size / Hq / Hkv / D / dtype / resolved softmax_scale / requested num_chunks / chunk_axis /
            cp_ranks_per_node / window / causal differing across ranks; the node sub-groups of 1 < L < P not creatable
            consistently (`comm.node_groups`). With `metadata=`: ValueError
            on this rank when a tensor's shape (Tq_local, Tk_local, Hq, Hkv, D), dtype or device differs
            from what the metadata implies, when num_chunks, chunk_axis or cp_ranks_per_node differs from the
            metadata's, or when the metadata is for another impl; other ranks may then block in the call's
            first collective (as in Megatron-Core) unless the metadata was prepared with
            `group_check=True` (the default), in which case every rank raises the same ValueError. A dtype the
            backend cannot run (backend "te": bf16/fp16 only; "flex": no float64 on CUDA) raises on every
            rank that uses that backend, before any data collective. With `query_gather=`: no
            `metadata=`, a handle already consumed or discarded, started with another metadata, or a q
            other than (or modified in place since) the one given to `splitkv_start_query_gather`.
        ImportError: backend "flex"/"te" not available.
    """
    return run_op(_SplitKV, "splitkv", q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                  block_size=block_size, cp_group=cp_group, softmax_scale=softmax_scale, backend=backend,
                  return_lse=return_lse, metadata=metadata, num_chunks=num_chunks, query_gather=query_gather,
                  cp_ranks_per_node=cp_ranks_per_node, chunk_axis=chunk_axis, config=config,
                  check_group=check_group, window=window, causal=causal)
