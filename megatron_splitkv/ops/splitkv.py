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
   The backward's dO and (delta, lse) travel in ONE all-gather per chunk ("splitkv.bwd.dout"): each
   rank's segment is its chunk rows of dO, then of (delta, lse) bit-packed in q's dtype like lse in item
   2 (fp32, fp64 for fp64 inputs; `ops.common.pack_dout_stats`; padding rows dO = 0, statistics -inf),
   unpacked bit-exact into a contiguous dO and the statistics (one collective latency per chunk less;
   same arithmetic, bit-identical results). Cost: a pack copy of this rank's chunk rows and an unpack
   copy of the gathered rows on the compute stream (long contiguous runs, memcpy speed): a gain where a
   collective's latency is large (many ranks, inter-node rings), a loss on a small NVLink group. Measured
   on 2 x H200 (P = 2, Hq = 32, D = 128, bf16, GPU time of pack + gather + unpack vs the two gathers):
   37 vs 31 us (256 gathered rows), 84 vs 68 us (2048), 227 vs 182 us (8192; unpack 39 us, pack 20 us).
   Head chunks (docs/perf-notes.md item 21; opt-in: `chunk_axis="heads"` or SplitKVConfig(chunk_axis="heads"),
   agreed group-wide like num_chunks): chunk c = the kv heads [g0, g1) = `chunk_bounds(k, Hkv)[c]` and the q
   heads [g0 G, g1 G) (G = Hq / Hkv, GQA groups whole) of ALL rows (`SplitKVMetadata.chunk_heads`; chunks =
   [(0, nb_max)] * k, k clamped to [1, Hkv], uneven splits allowed), the one-call masks shared (the same
   `IntervalMask` objects: a kernel's cached tables built once). Each chunk's send tensors are its heads made
   contiguous by the copy that pads them anyway (`_head_sends`: for chunks of equal width ONE chunk-major
   buffer per tensor, written by one select / copy of q, dO and the statistics and one fill, each chunk a
   contiguous view of it; an uneven split one copy per chunk; docs/perf-notes.md item 24); its local keys are
   the kv-head views [:, g0:g1] of the one call's keys for a kernel with `strided_heads` (math;
   kernels/base.py; `_key_views`), else built from the kv-head slice by `with_own_keys` (the gathering copy
   split by heads: fa4, flex, te, staircase); the owner merges each
   chunk into [rows, h0:h1] of one output (the Triton merge writes the strided destination, the torch merge
   copies there) and writes its dQ sums there; dK / dV of a head chunk are final: written in the inputs' dtype
   straight into its kv heads of the gradient, in context order where the kernel returns them in that dtype
   (`_grad_rows`: the unsort folded into that one `index_copy_`, no sorted buffer unsorted again; an fp32
   result for bf16 / fp16 inputs is cast by a copy and unsorted once after the chunks), no fp32 accumulation
   across chunks. Same collectives per chunk and
   the same bytes per collective name as row chunks (each carries Hq / k heads of every row instead of rows /
   k of every head). Why: FA4's backward iterates key tiles over query tiles, so halving the rows per call
   doubles its per-CTA prologue / epilogue and dK / dV writes; k = 2 query chunks cost 1.132x one call's
   kernel time on the H200, k = 2 head chunks 1.041x (tools/chunk_cost.py, CP 64 shard). Results equal row
   chunks up to fp rounding (tests/test_splitkv_head_chunks.py). Measured (docs/perf-notes.md item 21): k = 2
   at CP = 2, 128K: NVLink 0.956x of k = 1 (rows 0.914x), sockets 1.233x (rows 1.211x).
4. Early query all-gather (perf-notes item 3; `splitkv_start_query_gather` -> `query_gather=`): a layer
   that has q before k/v starts every chunk's Q all-gather right after q (`_QueryGather`, an autograd
   Function of its own), computes k/v while it is in flight, then calls the op, which waits instead of
   gathering. In backward the op issues the dQ all-to-alls and returns their receive buffers UNWAITED
   as the gradient of the gathered queries; `_QueryGather.backward` waits and sums the P partials. That
   node was created before the k/v projections, so autograd (which runs the ready node with the highest
   sequence number first) runs the k/v projections' backward in between, while the all-to-all is in
   flight (on the GPU: NCCL's stream synchronises with the current stream at launch, the compute stream
   waits for it only in `Pending.wait()`). Same collectives and bytes, bit-identical results.
5. Two-level all-to-all for CP groups spanning several nodes (`cp_ranks_per_node` = L; our extension of
   DESIGN.md section 2's merge rule, not in the paper): the P CP ranks form N = P / L nodes of L
   consecutive CP ranks (node n = ranks [n * L, (n + 1) * L), local index j = rank % L), with two cached
   sub-groups per (CP group, L) (`comm.node_groups`). Forward merge of each chunk: stage 1
   ("splitkv.fwd.out.intra", an all-to-all among the node's L ranks) sends local peer j' the packed
   partials [O_r | lse_r] (q's dtype, as in item 2) of the rows of every owner (m, j') (rows reordered in
   the packing copy, `ops.common.pack_partial_local_major`); the receiver lse-merges the L partials of
   each row in fp32 (`merge_partials` semantics: max, weights, sums, -inf rows safe) into a node partial;
   stage 2 ("splitkv.fwd.out.inter", an all-to-all among the N ranks with local index j) sends owner
   (m, j) the node partial of its rows as fp32 [O | lse] (no second rounding), and the owner merges the N
   node partials in fp32: the same result up to fp32 reassociation. dQ likewise ("splitkv.bwd.dq.intra"
   / ".inter"): the L partials in q's dtype summed in fp32, the fp32 node sums summed in fp32 by the
   owner and cast once. Inter-node bytes per rank drop from ~(P - 1) / P * Lq * Hq * D * 2 (bf16) to
   ~(N - 1) / N * Lq / L * Hq * D * 4, the rest moves over the intra-node links. Overlap: chunk c's
   stage 1 is issued where the single all-to-all was; its reduction and stage 2 are issued right after
   chunk c + 1's stage 1 (so stage 1 overlaps the next chunk's kernel, stage 2 the one after), the last
   chunk's right after the loop (forward: before the owner merges; backward: after dK/dV are final, so
   its stage 2 overlaps the caller's backward, e.g. the k/v projections with `query_gather`, whose
   gradient placeholders are then zero-stride tensors: no receive buffer has the gathered chunk's
   shape). L = 1 or P: the single all-to-all of item 2, unchanged (default: L = 1).
   Relay (docs/perf-notes.md item 18; CUDA, `ops.common.RelayStream`): the
   wait for stage 1, the node merge / node sum and the issue of
   stage 2 run on a relay stream (after an event recorded on the caller's stream when stage 1 was issued),
   in the same host order, so the caller's stream never waits for stage 1: chunk c's node merge and stage
   2 run during chunk c + 1's kernel, and after the last kernel the op's epilogue and (backward, with
   `query_gather`) the caller's k/v projection backward run while the last chunk's stage 1, node sum and
   stage 2 proceed; only the owner's merge / dQ sum waits, for stage 2. Model (tools/simulate_scaling.py
   replay of the seventh run, P = 64, L = 8, 50 GB/s NICs, + projection overlap): -0.33 ms at k = 1
   (87.6% -> 89.6%), -0.24 ms at k = 2 (90.05% -> 91.6%). Bit-identical to no relay (same kernels and
   reductions on the same inputs); the node merge shares the GPU with the next kernel (not modelled).
   Backward [dO | stats] gather: with the two-level all-to-all the packed segment of item 3 is always
   fused and gathered in one flat ring over the P ranks, as the forward's Q all-gather.

Memory (tools/memory_breakdown.py measures it from this code at the real shapes): the fp32 partial O_r
is released before the all-to-all buffers are allocated (a kernel with `native_dtype_results`, FlexAttention,
makes none: its O_r and dQ / dK / dV stay in the inputs' dtype, `ops.common.native_results`), the packed send buffer is written in place, the
received buffer and the fp32 partials are released as soon as they are merged (in-place division), the
merged fp32 O is released right after delta = rowsum(dO * O) in backward (it is a ctx attribute, not a
saved tensor: a second backward through the same call raises RuntimeError), the padded q / dO / stats
send tensors are dropped once their last chunk is packed / issued, each received [dO | stats] buffer is
released as soon as it is unpacked into a contiguous dO and the statistics (one dO-sized copy per chunk,
alive together with that buffer only briefly), and the dQ partials are summed in one fp32 reduction
(`fused_merge.sum_partials`: no [P, rows, Hq, D] fp32 temporary). The [O | lse] merges (owner and node)
run as one Triton kernel on CUDA (`fused_merge.merge_packed`: no fp32 copy of the P partials; the torch
path elsewhere). Two-level all-to-all: the stage-1 receive buffer is released once reduced, and stage 2
moves 1 / L of the rows in fp32. Two-level [dO | stats] gather: besides the gathered chunk in flight (as
with one ring), the stage-1 buffers (N of the P segments) of up to two chunks, each released when its
stage 2 is waited.
"""

from __future__ import annotations

import collections
import warnings
import weakref

import torch

from ..comm import all_gather, all_to_all
from .agreement import check_query_gather_start
from .common import (
    RelayStream,
    cast,
    delta_and_dout,
    kernel_backward,
    kernel_forward,
    local_index_major,
    merge_received_partials,
    fuse_bwd_gather,
    pack_dout_stats,
    pack_partial,
    pack_partial_local_major,
    pad_rows,
    unpack_dout_stats,
    split_own_grad,
    unsort,
    with_own_keys,
    zero_invalid_rows,
    zero_scalar,
)
from .fused_merge import merges_in_place, sum_partials
from .prepare import run_op

__all__ = ["splitkv_attention", "splitkv_start_query_gather", "SplitKVQueryGather",
           "UnconsumedQueryGatherWarning"]


class UnconsumedQueryGatherWarning(RuntimeWarning):
    """A `SplitKVQueryGather` was garbage-collected without being consumed by `splitkv_attention` or
    released with `discard()` (its collectives were issued for nothing)."""


def _head_split(meta) -> bool:
    """Whether the metadata's chunks split the heads (`chunk_axis="heads"` with k > 1; module docstring,
    item 3 "Head chunks"): chunk c is then every row of the q heads `meta.chunk_heads[c]`."""
    return meta.chunk_axis == "heads" and meta.num_chunks > 1


def _chunk_heads(meta) -> list:
    """Per chunk its q-head range (h0, h1): `meta.chunk_heads`, or every head for metadata without it (built
    before head chunks existed, e.g. unpickled)."""
    return meta.chunk_heads or [(0, meta.num_heads_q)] * len(meta.chunks)


def _kv_heads(meta, c):
    """The kv-head range [g0, g1) of chunk c (GQA groups whole: q heads [g0 * G, g1 * G))."""
    h0, h1 = meta.chunk_heads[c]
    grp = meta.num_heads_q // meta.num_heads_kv
    return h0 // grp, h1 // grp


def _head_sends(x, meta, rows_max, fill=0, valid_rows=None):
    """Per head chunk (`meta.chunk_heads`), the q heads [h0, h1) of every row of x [rows, Hq, ...] as ONE
    contiguous [rows_max, h1 - h0, ...] tensor (a collective's send buffer), rows >= rows filled with `fill`;
    valid_rows [rows] bool given: the rows of invalid blocks zeroed (`zero_invalid_rows`, padding 0). Chunks of
    equal width: views of one chunk-major [k, rows_max, Hc, ...] buffer written by ONE copy (select) of the
    strided head slices and one fill (docs/perf-notes.md item 24; the buffer, this rank's rows only, lives until
    the last chunk's collective is waited, not chunk by chunk); unequal ones (k not dividing Hkv): one copy
    (select) and fill per chunk. The same values either way (copies and the same elementwise select)."""
    heads, rows = meta.chunk_heads, x.shape[0]
    widths = {h1 - h0 for h0, h1 in heads}
    if len(widths) > 1:
        if valid_rows is not None:
            return [zero_invalid_rows(x[:, h0:h1], valid_rows, rows_max) for h0, h1 in heads]
        return [pad_rows(x[:, h0:h1], rows_max, fill) for h0, h1 in heads]
    k, hc = len(heads), widths.pop()
    buf = x.new_empty((k, rows_max, hc) + tuple(x.shape[2:]))
    src = x.unflatten(1, (k, hc)).transpose(0, 1)  # [k, rows, Hc, ...] view
    if valid_rows is None:
        buf[:, :rows].copy_(src)
    else:
        torch.where(valid_rows[:, None, None], src, zero_scalar(x.dtype, x.device), out=buf[:, :rows])
    if rows_max > rows:
        buf[:, rows:].fill_(fill)
    return list(buf.unbind(0))


def _key_views(x, meta):
    """Per chunk its local keys (or values) as views of the one call's x [Tk', Hkv, D] (`with_own_keys`): the
    kv heads [g0, g1) of a head chunk (for kernels with `strided_heads`), else x itself."""
    if not _head_split(meta):
        return [x] * len(meta.chunks)
    return [x[:, g0:g1] for g0, g1 in (_kv_heads(meta, c) for c in range(len(meta.chunks)))]


def _query_sends(q, meta, rows_max):
    """Per chunk, the tensor its "splitkv.fwd.q" all-gather sends: this rank's padded q (invalid blocks' rows
    zeroed, `zero_invalid_rows`) restricted to the chunk, contiguous. Rows: slices [b0 * B, b1 * B) of ONE
    padded copy; head chunks: the chunk's heads of every row (`_head_sends`: one chunk-major copy for equal
    chunks)."""
    if _head_split(meta):
        return _head_sends(q, meta, rows_max, valid_rows=meta.valid_rows)
    q_pad, bsz = zero_invalid_rows(q, meta.valid_rows, rows_max), meta.block_size
    return [q_pad[b0 * bsz:b1 * bsz] for b0, b1 in meta.chunks]


#: per metadata (weakly held), per local key count: `_grad_rows`' index
_GRAD_ROWS = weakref.WeakKeyDictionary()


def _grad_rows(meta, num_keys: int, device):
    """Where a head chunk's dK / dV rows go (docs/perf-notes.md item 24): None when the local context is
    already sorted (`meta.order` None: the kernel's key rows are the result's rows), else an int64 index
    [num_keys] for `index_copy_`: sorted context row i -> its context token `meta.order[i]` (the `unsort`),
    every later row (the own-key padding and the own keys of `with_own_keys`) to itself. Built once per
    metadata and key count (the same in every layer)."""
    order = meta.order
    if order is None:
        return None
    cache = _GRAD_ROWS.setdefault(meta, {})
    idx = cache.get(num_keys)
    if idx is None:
        n = order.shape[0]
        idx = cache[num_keys] = torch.cat([order, torch.arange(n, num_keys, dtype=order.dtype, device=device)])
    return idx


def _gather_q_chunk(sends, meta, c):
    """Issue the asynchronous all-gather of query chunk c (`_query_sends`: rows [b0 * B, b1 * B) of every
    rank's padded segment, or a head chunk's heads of all rows): the one collective per chunk named
    "splitkv.fwd.q". The send tensor is dropped from `sends` (its Pending keeps it until waited)."""
    x, sends[c] = sends[c], None
    return all_gather(x, meta.group, "splitkv.fwd.q", async_op=True)


def _sum_dq_partials(pending, meta, rows, dtype, acc):
    """Wait the dQ all-to-alls (one `Pending` per chunk; the received [P * rc, Hc, D] holds every rank's
    partial of this rank's rows rc of the chunk, Hc its q heads) and sum the P partials in `acc` (fp32) in one
    reduction (`fused_merge.sum_partials`: no [P, rc, Hc, D] fp32 temporary, no per-partial launches). Returns
    dq [rows, Hq, D] in `dtype` (chunks written into their rows / heads as they are summed).

    Two-level all-to-all (`meta.node_groups`): one `_TwoStage` per chunk, whose received [N * rc, Hc, D]
    (acc dtype) holds the N node sums of this rank's rows, summed the same way in node order."""
    g, bsz = meta.group, meta.block_size
    k = g.size if meta.node_groups is None else meta.node_groups[1].size
    dq = None
    for p, (b0, b1), (h0, h1) in zip(pending, meta.chunks, _chunk_heads(meta)):
        recv = p.take()
        rc = (b1 - b0) * bsz  # explicit: a chunk may hold no rows at all when every rank has zero blocks
        parts = recv.view(k, rc, *recv.shape[1:])
        if dq is None:
            dq = recv.new_empty((rows, meta.num_heads_q, meta.head_dim), dtype=dtype)
        r0, r1 = b0 * bsz, min(b1 * bsz, rows)
        if r1 <= r0:
            continue
        dst = dq[r0:r1] if h1 - h0 == meta.num_heads_q else dq[r0:r1, h0:h1]
        if k == 1:  # one partial: its values cast straight (their fp32 upcast and cast back are exact)
            dst.copy_(parts[0, : r1 - r0])
        else:
            dst.copy_(sum_partials(parts[:, : r1 - r0], acc))
        del recv, parts, dst
    return dq


class _TwoStage:
    """One chunk's two-level collective in flight (`cp_ranks_per_node` = L, 1 < L < P): `first` (a
    `comm.Pending`) is stage 1, issued by the caller; `advance()` hands it to `reduce`, which waits for it
    (`Pending.wait` / `take`: a stream wait on CUDA), does what lies between the stages and returns the
    issued stage 2 (a `comm.Pending`), once. `wait()` / `take()` behave like `comm.Pending`'s for the
    stage-2 result, advancing first if needed.

    All-to-alls (forward [O | lse], dQ): stage 1 over this rank's node (`meta.node_groups[0]`), `reduce`
    = the fp32 lse-merge or sum of the L partials received per row, stage 2 over the ranks with this
    local index (`meta.node_groups[1]`). The op advances chunk c - 1 right after issuing chunk c's stage
    1, so stage 1 overlaps the next chunk's kernel and stage 2 the one after (or the final merges); the
    last chunk is advanced as soon as the loop ends.

    Relay (`relay`, an `ops.common.RelayStream`; the all-to-alls on CUDA, docs/perf-notes.md item 18): the
    current stream is marked when stage 1 is issued; `advance()` runs `reduce` (its wait for stage 1, the
    node merge / sum and the issue of stage 2) on the relay stream after that mark, so the caller's stream
    never waits for stage 1; `wait()` / `take()` make the current stream wait for stage 2 (whose NCCL stream
    followed the relay) and mark its result as used there. Same host order, same arithmetic: bit-identical
    to relay None (every stage on the caller's stream, the schedule before item 18; always so off CUDA).
    """

    __slots__ = ("_first", "_reduce", "_second", "_relay", "_mark")

    def __init__(self, first, reduce, relay=None):
        self._first, self._reduce, self._second = first, reduce, None
        self._relay = relay
        self._mark = None if relay is None else relay.mark()

    def advance(self):
        if self._first is not None:
            first, reduce = self._first, self._reduce
            self._first = self._reduce = None
            if self._relay is None:
                self._second = reduce(first)
            else:
                mark, self._mark = self._mark, None
                self._second = self._relay.run(mark, first, lambda: reduce(first))
        return self

    def wait(self):
        res = self.advance()._second.wait()
        return res if self._relay is None else self._relay.taken(res)

    def take(self):
        res = self.advance()._second.take()
        return res if self._relay is None else self._relay.taken(res)


def _out_stage2(meta, rc, head_dim, acc):
    """Stage 2 of the forward merge: the L partials [O | lse] (inputs' dtype) received in stage 1 for the
    rows of the N owners with this local index, lse-merged in fp32 (`merge_received_partials`: max,
    weights, sums; -inf rows give O = 0, lse = -inf), sent to those owners as fp32 [O | lse]."""
    intra, inter = meta.node_groups

    def reduce(first):
        o, lse = merge_received_partials(first, intra.size, inter.size * rc, head_dim, acc)
        packed = pack_partial(o, lse, acc)
        del o, lse
        return all_to_all(packed, inter, "splitkv.fwd.out.inter", async_op=True)

    return reduce


def _dq_stage2(meta, rc, acc):
    """Stage 2 of the dQ exchange: the L partials (inputs' dtype) received in stage 1 for the rows of the N
    owners with this local index, summed in fp32 (`fused_merge.sum_partials`: one reduction), sent to those
    owners in fp32."""
    intra, inter = meta.node_groups

    def reduce(first):
        recv = first.take()
        node_sum = sum_partials(recv.view(intra.size, inter.size * rc, *recv.shape[1:]), acc)
        del recv
        return all_to_all(node_sum, inter, "splitkv.bwd.dq.inter", async_op=True)

    return reduce


class _GatherShared:
    """What the gather's and the op's autograd nodes share (no reference to the handle, so that a handle
    dropped unconsumed is freed at once instead of sitting in a reference cycle through the graph)."""

    __slots__ = ("metadata", "pending", "dq", "__weakref__")

    def __init__(self, metadata):
        self.metadata = metadata
        self.pending = None  # forward all-gathers, one Pending per chunk (waited by _SplitKV.forward)
        self.dq = collections.deque()  # per backward of _SplitKV: its dQ all-to-alls, for _QueryGather

    def wait_forward(self, c):
        self.pending[c].wait()
        if c == len(self.pending) - 1:
            self.pending = None


class SplitKVQueryGather:
    """Handle of the in-flight query all-gather of one Split-KV call (`splitkv_start_query_gather`).

    Created by `splitkv_start_query_gather(q, metadata=meta)`, right after the layer computed q; pass it
    as `splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, metadata=meta, query_gather=handle)` once k/v
    exist. Consumed exactly once: a second use raises ValueError. If the layer fails between the two calls,
    call `discard()` (or let it be garbage-collected: an `UnconsumedQueryGatherWarning` is issued then);
    neither waits for the collectives (they complete on their own on every rank that issued them).

    Attributes: metadata (the `SplitKVMetadata`), state ("pending", "consumed" or "discarded").
    """

    def __init__(self, metadata, q):
        self.metadata = metadata
        self.state = "pending"
        self._q = q
        self._q_version = q._version
        self._shared = _GatherShared(metadata)
        self._gathered = None  # the gathered chunks: outputs of _QueryGather, inputs of _SplitKV

    def __repr__(self):
        return f"SplitKVQueryGather(state={self.state!r}, chunks={len(self.metadata.chunks)})"

    @property
    def pending(self) -> bool:
        """True until consumed by `splitkv_attention` or discarded."""
        return self.state == "pending"

    def discard(self) -> None:
        """Release an unconsumed gather (e.g. when the layer raised before its attention call): drops the
        references to q and the gathered buffers without waiting; later use raises ValueError. No-op on a
        consumed or discarded handle."""
        if self.state == "pending":
            self.state = "discarded"
            self._q = self._gathered = None
            self._shared.pending = None

    def _check_consume(self, meta, q):
        """ValueError unless this handle may be consumed by a call with metadata `meta` and query q."""
        if self.state != "pending":
            raise ValueError(f"query_gather was already {self.state}; a SplitKVQueryGather serves exactly one "
                             "splitkv_attention call: call splitkv_start_query_gather again for the next one")
        if meta is not self.metadata:
            raise ValueError("query_gather was started with another metadata: pass the same metadata= to "
                             "splitkv_start_query_gather and splitkv_attention")
        if q is not self._q:
            raise ValueError("q must be the very tensor given to splitkv_start_query_gather (its rows are "
                             "already being gathered)")
        if q._version != self._q_version:
            raise ValueError("q was modified in place after splitkv_start_query_gather (its rows are already "
                             "being gathered): compute q completely before starting the gather")

    def _consume(self):
        """Mark consumed; return (the state shared with the autograd nodes, the gathered chunk tensors:
        the op's inputs in place of q)."""
        gathered = self._gathered
        self.state = "consumed"
        self._q = self._gathered = None
        return self._shared, gathered

    def __del__(self):
        try:
            if self.state == "pending":
                self._shared.pending = None
                warnings.warn("a SplitKVQueryGather was never consumed by splitkv_attention(..., "
                              "query_gather=) nor discarded (its all-gathers were issued for nothing)",
                              UnconsumedQueryGatherWarning, stacklevel=2)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _QueryGather(torch.autograd.Function):
    """q -> the gathered padded query chunks (`SplitKVMetadata.chunks`), issued asynchronously.

    Created before the layer's k/v projections, so in backward the autograd engine (highest sequence
    number first among ready nodes) runs the k/v projections' backward between `_SplitKV.backward`, which
    issues the dQ all-to-alls without waiting, and this backward, which waits them and sums the P
    partials of this rank's rows in fp32 (two-level all-to-all: the N fp32 node sums, `_sum_dq_partials`).
    """

    @staticmethod
    def forward(ctx, shared, q):
        meta = shared.metadata
        rows_max = max(meta.n_blocks) * meta.block_size
        sends = _query_sends(q, meta, rows_max)  # each held by its Pending until its wait
        shared.pending = [_gather_q_chunk(sends, meta, c) for c in range(len(meta.chunks))]
        ctx.shared, ctx.rows, ctx.dtype = shared, q.shape[0], q.dtype
        return tuple(p.result for p in shared.pending)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        shared = ctx.shared
        if not shared.dq:
            raise RuntimeError("splitkv query gather: no dQ all-to-all to wait for (the gathered queries "
                               "must reach no other op than splitkv_attention)")
        pending = shared.dq.popleft()
        meta = shared.metadata
        dq = _sum_dq_partials(pending, meta, ctx.rows, ctx.dtype, torch.float64 if ctx.dtype == torch.float64
                              else torch.float32)
        return None, dq


def splitkv_start_query_gather(q, *, metadata) -> SplitKVQueryGather:
    """Start Split-KV's query all-gather of one layer early (perf-notes item 3), before k/v exist.

    Issues exactly the collectives `splitkv_attention` would issue first in its forward: per query chunk
    of the metadata (`num_chunks`), one asynchronous all-gather "splitkv.fwd.q" of this rank's padded q
    rows (invalid blocks' rows zeroed), same bytes in `comm_stats`. Call it right after q is computed
    (projection, q-norm, RoPE), then compute k/v (their projections overlap the gather on the GPU: NCCL
    runs it on its own stream) and pass the handle to

        out = splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, metadata=metadata, query_gather=handle)

    with the very same q tensor, unmodified. Results are bit-identical to the call without
    `query_gather=`. In backward the dQ all-to-alls are waited for only after the autograd nodes created
    between the two calls (the k/v projections) have run their backward, so these overlap the dQ
    all-to-all too.

    Every rank of the CP group must do the same: all start a gather for the layer's call and pass it,
    or none (with `group_check` metadata a mismatch raises the same ValueError on every rank; without it
    the collectives do not match and the call fails or hangs, as documented for `metadata=`). A handle
    serves one call; see `SplitKVQueryGather` for the error path (`discard()`).

    Args:
        q: [Tq_local, Hq, D] this rank's query rows (the shape, dtype and device the metadata implies).
        metadata: a `SplitKVMetadata` from `prepare_splitkv_metadata(..., impl="splitkv")` (required: the
            chunking and the gathered block layout are fixed there).

    Returns:
        `SplitKVQueryGather`. Differentiable: the gradient of q flows through it (the gathered rows'
        gradients are summed over ranks in fp32, as in `splitkv_attention`).

    Raises:
        ValueError: metadata not a splitkv `SplitKVMetadata`; q's shape / dtype / device not the
            metadata's (on this rank; on every rank with `group_check`).
    """
    check_query_gather_start(metadata, q)
    handle = SplitKVQueryGather(metadata, q)
    handle._gathered = _QueryGather.apply(handle._shared, q)
    for p in handle._shared.pending:  # the handle holds the gathered tensors; a Pending holding these
        p.result = None  # outputs of _QueryGather too would close a cycle through its node's ctx
    return handle


class _SplitKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, q, k_ctx, v_ctx, k_blk, v_blk, gather=None, *q_gathered):
        # with `gather` (the `_GatherShared` of a consumed SplitKVQueryGather): q_gathered are its gathered
        # chunks (outputs of _QueryGather) and q is None
        g, bsz, meta = plan.group, plan.block_size, plan.meta
        rows, d, dtype = meta.tq_local, meta.head_dim, meta.dtype
        rows_max = max(plan.n_blocks) * bsz
        chunks = meta.chunks
        n, P = len(chunks), g.size
        hsplit = _head_split(meta)  # head chunks: chunk c = every row of the q heads meta.chunk_heads[c]
        heads = _chunk_heads(meta)
        hier = meta.node_groups  # (intra, inter) of the two-level all-to-all, or None
        own = k_blk is not None
        masks = meta.chunk_masks_own if own else meta.chunk_masks
        # 1. all-gather Q chunk by chunk (invalid blocks' rows zeroed, padded to the largest block count;
        #    block metadata gathered once per step into the metadata, pads are invalid), prefetched one
        #    chunk ahead; issued before the local keys are built so that the copies overlap the first
        #    gather. With `gather`: every chunk's gather was issued by splitkv_start_query_gather.
        #    Memory: every large temporary is released before the next large allocation (fp32 partial
        #    before the all-to-all buffers, received buffer and fp32 partials before the merge result).
        if gather is None:
            # each chunk's padded q is dropped from `q_sends` once issued (its Pending keeps it until waited)
            q_sends = _query_sends(q, meta, rows_max)
            pend_q = {}
        issued = [0]  # Q chunks whose all-gather is issued

        def prefetch(upto):  # issue the Q all-gathers of chunks < upto (gather=None path)
            while gather is None and issued[0] < min(upto, n):
                c = issued[0]
                pend_q[c] = _gather_q_chunk(q_sends, meta, c)
                issued[0] += 1

        prefetch(1)
        # local keys: sorted context (order precomputed per step, no host sync) [+ padding + own block]; head
        # chunks: for a kernel taking strided heads (`strided_heads`, kernels/base.py) views [:, g0:g1] of the
        # one call's keys (`_key_views`: no copy per chunk); else one per chunk from its kv heads (the same
        # gathering copy, split by heads: no extra copy but for k_blk None with sorted context, where the head
        # slice is made contiguous)
        if hsplit and not getattr(plan.kernel, "strided_heads", False):
            kv_h = [_kv_heads(meta, c) for c in range(n)]
            k_xs = [with_own_keys(k_ctx[:, g0:g1], meta.order, None if k_blk is None else k_blk[:, g0:g1],
                                  plan.valid_rows) for g0, g1 in kv_h]
            v_xs = [with_own_keys(v_ctx[:, g0:g1], meta.order, None if v_blk is None else v_blk[:, g0:g1],
                                  plan.valid_rows) for g0, g1 in kv_h]
            kv_saved = k_xs + v_xs
        else:
            k_x = with_own_keys(k_ctx, meta.order, k_blk, plan.valid_rows)
            v_x = with_own_keys(v_ctx, meta.order, v_blk, plan.valid_rows)
            k_xs, v_xs, kv_saved = _key_views(k_x, meta), _key_views(v_x, meta), [k_x, v_x]
            del k_x, v_x
        dev = k_xs[0].device
        # two-level on CUDA: stage 1 waited, node-merged and stage 2 issued on the relay stream (item 18)
        relay = None if hier is None else RelayStream.get(dev)

        def launch(c):
            prefetch(c + 2)  # Q one chunk ahead of this kernel
            if gather is None:
                q_c = pend_q.pop(c).wait()
            else:
                gather.wait_forward(c)
                q_c = q_gathered[c]
            # 2. local attention of the chunk's gathered queries against this rank's keys (context and,
            #    for this rank's own blocks, the own block); intervals precomputed per step. O_r in the
            #    kernel's own dtype where it has one (flex: the input dtype, `native_results`): packed
            #    into the transport dtype below without an fp32 round trip (the same values).
            return (q_c,) + kernel_forward(plan, q_c, k_xs[c], v_xs[c], masks[c], native=True)

        # pend_o: one exchange per chunk; rows_o: the owner's rows [r0, r1) and q heads [h0, h1) each one
        # delivers, in issue order
        q_chunks, states, pend_o, rows_o = [], [], [], []
        for c in range(n):
            q_c, o_r, lse_r, state = launch(c)
            q_chunks.append(q_c)
            states.append(state)
            # 3. send every owner the partial (O_r in q's dtype, lse_r bit-packed beside it) of its rows:
            #    one asynchronous all-to-all per chunk, overlapping the next chunk's kernel.
            if hier is None:
                packed = pack_partial(o_r, lse_r, dtype)
                del o_r, lse_r  # the fp32 partial: freed before the receive buffer is allocated
                pend_o.append(all_to_all(packed, g, "splitkv.fwd.out", async_op=True))
                rows_o.append((chunks[c][0] * bsz, chunks[c][1] * bsz) + tuple(heads[c]))
            else:
                # two-level: stage 1 sends local peer j' the rows of the owners (m, j') of every node m
                # (rows reordered local-index-major in the packing copy); after each stage 1 the chunk
                # before advances to stage 2
                b0, b1 = chunks[c]
                packed = pack_partial_local_major(o_r, lse_r, dtype, hier[1].size, hier[0].size)
                del o_r, lse_r
                pend_o.append(_TwoStage(all_to_all(packed, hier[0], "splitkv.fwd.out.intra", async_op=True),
                                        _out_stage2(meta, (b1 - b0) * bsz, d, plan.acc), relay))
                rows_o.append((b0 * bsz, b1 * bsz) + tuple(heads[c]))
                if len(pend_o) > 1:
                    pend_o[-2].advance()
            del packed, q_c
        if hier is not None:
            pend_o[-1].advance()  # the last exchange's stage 2 overlaps the merges of the others
        # chunked, with the Triton merge: every exchange merged straight into its rows of one output
        # (no cat). Head chunks: always into one output, at [rows, h0:h1] (the Triton merge writes the strided
        # destination itself; the torch merge copies its result there, as a cat along the heads would)
        n_ex = len(pend_o)
        merged = None
        if n_ex > 1 and (hsplit or merges_in_place(dev, dtype if hier is None else plan.acc, d, plan.acc)):
            merged = (torch.empty((rows_max, meta.num_heads_q, d), dtype=plan.acc, device=dev),
                      torch.empty((rows_max, meta.num_heads_q), dtype=plan.acc, device=dev))
        out_parts, lse_parts = [], []
        for i, (r0, r1, h0, h1) in enumerate(rows_o):
            # 4. the owner merges the P partials of its rows in fp32 (fused lse merge: max, weights, sums;
            #    the received buffer and the fp32 partials are released as soon as they are used). Two-
            #    level: the N fp32 node partials, with the same merge.
            if merged is None:
                dst = None
            elif hsplit:
                dst = (merged[0][r0:r1, h0:h1], merged[1][r0:r1, h0:h1])
            else:
                dst = (merged[0][r0:r1], merged[1][r0:r1])
            o_c, l_c = merge_received_partials(pend_o[i], P if hier is None else hier[1].size, r1 - r0, d, plan.acc,
                                               out=dst)
            pend_o[i] = None
            out_parts.append(o_c)
            lse_parts.append(l_c)
            del o_c, l_c, dst
        if merged is not None:
            out, lse = merged[0][:rows], merged[1][:rows]
        else:
            out = (out_parts[0] if n_ex == 1 else torch.cat(out_parts))[:rows]
            lse = (lse_parts[0] if n_ex == 1 else torch.cat(lse_parts))[:rows]
        del out_parts, lse_parts, merged
        ctx.plan, ctx.masks, ctx.states, ctx.own, ctx.gather = plan, masks, states, own, gather
        # the merged fp32 out is needed only for delta = rowsum(dO * O) at the start of backward: kept as
        # an attribute (not a saved tensor) so that backward can release it before the kernel backward.
        # For fp32 / fp64 inputs it IS the returned output (no cast): then it is saved normally (an
        # attribute holding an output would form a reference cycle through the graph).
        alias = dtype == plan.acc
        ctx.out = None if alias else out
        # the local keys: one per head chunk (copies), else the one call's (every chunk's, or their views)
        ctx.save_for_backward(lse, out if alias else None, *q_chunks, *kv_saved)
        del k_xs, v_xs, kv_saved
        # an output nobody uses gets None in backward (not a materialised zero tensor): no zero fill and no
        # dlse term (the same delta: delta - 0 == delta bit for bit), no zero dO when only lse is used
        ctx.set_materialize_grads(False)
        return out.to(dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # backward is not differentiable: double backward raises
    def backward(ctx, dout, dlse):
        plan, meta, gather = ctx.plan, ctx.plan.meta, ctx.gather
        chunks = meta.chunks
        n, hsplit, heads = len(chunks), _head_split(meta), _chunk_heads(meta)
        lse, out, *saved = ctx.saved_tensors
        n_kv = (len(saved) - n) // 2  # n: one per head chunk; 1: the one call's keys
        q_chunks = saved[:n]
        k_xs, v_xs = saved[n:n + n_kv], saved[n + n_kv:]
        if n_kv == 1:
            k_xs, v_xs = _key_views(k_xs[0], meta), _key_views(v_xs[0], meta)
        del saved
        g, bsz = plan.group, plan.block_size
        hier = meta.node_groups
        rows, rows_max, dt = meta.tq_local, max(plan.n_blocks) * bsz, meta.dtype
        if out is None:
            out, ctx.out = ctx.out, None
        if out is None:
            raise RuntimeError("splitkv_attention: backward ran a second time through the same call "
                               "(retain_graph=True); its forward state is released by the first backward")
        if dout is None:  # only lse was used downstream
            dout = torch.zeros(out.shape, dtype=dt, device=out.device)
        dout, delta = delta_and_dout(plan, dout, dlse, out, lse, None)
        del out  # the merged fp32 O: not needed any more (freed before the kernel backward)
        # all-gather dO and the GLOBAL statistics (delta, lse) every rank's local backward needs, chunk by
        # chunk (one ahead). Fused (`fuse_bwd_gather`: groups larger than one node, or the two-level
        # all-to-all): ONE all-gather per chunk of this rank's chunk rows of dO then of (delta, lse)
        # bit-packed, in q's dtype (`pack_dout_stats`); otherwise two
        # back-to-back all-gathers (on one NVLink node the second one costs less than the fused path's
        # pack/unpack copies). Padding rows: dO = 0, statistics -inf. The padded tensors are dropped once
        # the last chunk is issued (each Pending keeps its segment).
        fused = fuse_bwd_gather(g.size, hier is not None)
        # head chunks: each chunk's heads of every row padded into contiguous send tensors by the padding copy
        # itself (`_head_sends`: one chunk-major copy of dO and one of the statistics for equal chunks)
        stats = torch.stack([delta, lse], -1)
        if hsplit:
            send = [_head_sends(dout, meta, rows_max), _head_sends(stats, meta, rows_max, float("-inf"))]
        else:
            send = [pad_rows(dout, rows_max), pad_rows(stats, rows_max, float("-inf"))]
        del delta, stats

        def gather_stats(c):
            if hsplit:
                do_c, st_c = send[0][c], send[1][c]
            else:
                b0, b1 = chunks[c]
                sl = slice(b0 * bsz, b1 * bsz)
                do_c, st_c = send[0][sl], send[1][sl]
            if fused:
                pend_c = all_gather(pack_dout_stats(do_c, st_c, dt), g, "splitkv.bwd.dout", async_op=True)
            else:
                pend_c = (all_gather(do_c, g, "splitkv.bwd.dout", async_op=True),
                          all_gather(st_c, g, "splitkv.bwd.stats", async_op=True))
            if c == n - 1:
                send.clear()
            return pend_c

        # chunks 0..k-1 in order: gathers, kernels and dQ exchanges, the dQ pendings kept by chunk
        pend_g, pend_dq, dk_x, dv_x, rows_kv = {}, [None] * n, None, None, None
        issued = [0]  # chunks whose gather is issued

        def prefetch(c):
            """Before chunk c's kernel: the [dO | stats] gathers of chunks <= c + 1 issued, so the next chunk's
            is in flight while this kernel runs."""
            while issued[0] < min(c + 2, n):
                pend_g[issued[0]] = gather_stats(issued[0])
                issued[0] += 1

        dev = lse.device
        relay = None if hier is None else RelayStream.get(dev)  # as in forward (item 18)

        def launch(c):
            prefetch(c)  # one chunk ahead of this kernel
            pend = pend_g.pop(c)
            if fused:  # unpacked bit-exact into a contiguous dO and (delta, lse); the received buffer dies here
                buf = pend.take()
                hc = heads[c][1] - heads[c][0]
                do_all, stats_all = unpack_dout_stats(buf, g.size, hc, meta.head_dim, plan.acc)
                del buf
            else:
                do_all, stats_all = pend[0].take(), pend[1].take()
            # rows whose global lse is -inf (padding rows, rows that see no key: their P is 0) get delta 0;
            # any other delta stays as it is, a non-finite one too (e.g. from a NaN / inf gradient of the
            # returned lse), as in the reference
            delta_all = stats_all[..., 0].masked_fill(torch.isneginf(stats_all[..., 1]), 0.0)
            # gradients in the kernel's own dtype where it has one (`native_results`): dQ goes to the
            # all-to-all in q's dtype anyway, dK / dV are summed in fp32 (k > 1) or cast once (k = 1)
            grads = kernel_backward(plan, q_chunks[c], k_xs[c], v_xs[c], ctx.masks[c], do_all,
                                    stats_all[..., 1], delta_all, ctx.states[c], native=True)
            ctx.states[c] = None
            return grads

        for c in range(n):
            dq_r, dk_c, dv_c = launch(c)
            # send every owner its rows' dQ partial (q's dtype) while the next chunk's backward runs
            if hier is None:
                pend_dq[c] = all_to_all(dq_r.to(dt), g, "splitkv.bwd.dq", async_op=True)
            else:  # two-level, as in forward: stage 1 now, the chunk before to stage 2
                rc = (chunks[c][1] - chunks[c][0]) * bsz
                send_dq = local_index_major(dq_r, hier[1].size, hier[0].size, dt)
                pend_dq[c] = _TwoStage(all_to_all(send_dq, hier[0], "splitkv.bwd.dq.intra", async_op=True),
                                       _dq_stage2(meta, rc, plan.acc), relay)
                del send_dq
                if c:
                    pend_dq[c - 1].advance()
            del dq_r
            if hsplit:  # a head chunk's dK / dV are final: written (in dt) into its kv heads of the result. In
                # the kernel's dtype dt (`native_results`, or fp32 / fp64 inputs) in context order (`_grad_rows`: the
                # unsort in the same copy, nothing left to unsort after the loop); else (an fp32 result for bf16 /
                # fp16 inputs: index_copy_ does not cast) cast by a copy in sorted order and unsorted after the loop
                if dk_x is None:
                    dk_x = dk_c.new_empty((dk_c.shape[0], meta.num_heads_kv, dk_c.shape[2]), dtype=dt)
                    dv_x = dv_c.new_empty((dv_c.shape[0], meta.num_heads_kv, dv_c.shape[2]), dtype=dt)
                    if dk_c.dtype == dt:
                        rows_kv = _grad_rows(meta, dk_c.shape[0], dk_c.device)
                g0, g1 = _kv_heads(meta, c)
                for dst, src in ((dk_x, dk_c), (dv_x, dv_c)):
                    if rows_kv is None:
                        dst[:, g0:g1].copy_(src)
                    else:
                        dst[:, g0:g1].index_copy_(0, rows_kv, src)
            elif dk_x is None:  # the fp32 sums of a chunked pass start from the first chunk's exact upcast
                dk_x, dv_x = (dk_c, dv_c) if n == 1 else (dk_c.to(plan.acc), dv_c.to(plan.acc))
            else:  # fp32 += input dtype: the same fp32 additions as adding the upcast
                dk_x += dk_c
                dv_x += dv_c
            del dk_c, dv_c
        del q_chunks, k_xs, v_xs
        tk = plan.n_ctx[g.rank]
        dk_s, dk_b = split_own_grad(dk_x, tk, ctx.own)
        dv_s, dv_b = split_own_grad(dv_x, tk, ctx.own)
        order_kv = meta.order if rows_kv is None else None  # head chunks through `_grad_rows`: in context order
        grads_kv = (unsort(dk_s, order_kv).to(dt), unsort(dv_s, order_kv).to(dt), cast(dk_b, dt), cast(dv_b, dt))
        if hier is not None:
            pend_dq[-1].advance()  # the last chunk's stage 2: in flight while the caller's backward runs
        if gather is None:
            # the owner sums the P partials of its rows in fp32
            return (None, _sum_dq_partials(pend_dq, meta, rows, dt, plan.acc)) + grads_kv
        # query_gather: the received dQ partials are the gradient of the gathered chunks, NOT waited for
        # here: _QueryGather.backward waits and sums them after the k/v projections' backward ran.
        if any(ctx.needs_input_grad[7:]):
            gather.dq.append(pend_dq)
            if hier is None:
                d_gathered = tuple(p.result for p in pend_dq)
            else:  # no receive buffer has the gathered chunk's shape: a zero-stride placeholder
                z = torch.zeros((), dtype=dt, device=grads_kv[0].device)
                d_gathered = tuple(z.expand(g.size * (b1 - b0) * bsz, h1 - h0, meta.head_dim)
                                   for (b0, b1), (h0, h1) in zip(chunks, heads))
        else:  # issued anyway (every rank issues the same collectives); nothing consumes them
            for pend in pend_dq:
                pend.wait()
            d_gathered = (None,) * n
        return (None, None) + grads_kv + (None,) + d_gathered


def splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, q_seq=None, q_anchor=None, kv_seq=None, kv_pos=None, *,
                      block_size=None, cp_group=None, softmax_scale=None, backend="auto", return_lse=False,
                      metadata=None, num_chunks=None, query_gather=None, cp_ranks_per_node=None, chunk_axis=None,
                      config=None, check_group=None, window=None, causal=False):
    """Exact DFlash drafter attention under Split-KV context parallelism (arXiv 2611.05926; DESIGN.md
    section 2).

    Each CP rank passes its own query blocks and its own (arbitrary, planner-chosen) context tokens.
    Forward: all-gather Q (block metadata: once per step); attend all gathered queries to the local
    context, and this rank's own blocks also to their own B keys, in ONE local-kernel call (fp32
    out/lse; the own keys are appended after the sorted context, see the module docstring); send each
    row's partial (O in q's dtype, lse bit-exact) to its owner in one all-to-all, where the P partials
    merge by lse in fp32. Backward: ONE all-gather of dO with the global (delta, lse) bit-packed beside
    it; local kernel backward with the global statistics; all-to-all of the dQ partials (q's dtype),
    summed in fp32 by the owner; dK/dV of the context and of the own block stay local. With
    `cp_ranks_per_node` = L (1 < L < P) both all-to-alls run in two stages, inside each node of L ranks
    and then between nodes in fp32 (module docstring, item 5). Both passes run over
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
        block_size: B (keyword; required without `metadata=`). Mask: a row of block b sees context keys with kv_seq == q_seq[b] and
            kv_pos < q_anchor[b] (strictly) on every rank, plus all B keys of its own block (unless
            k_blk is None).
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
        num_chunks: query chunks of the merge pipeline (docs/perf-notes.md item 2): None =
            `config.num_chunks`, else 1 (2 pays off on slow
            inter-node links: docs/perf-notes.md); a positive int is clamped to [1, max(max(n_blocks), 1)]
            (see `ops.metadata.resolve_num_chunks`). Chunk c = blocks [c * nb // k, (c + 1) * nb // k)
            of every rank's padded segment (nb = max(n_blocks)). Must be the same on every rank. With
            `metadata=` the chunking was fixed by `prepare_splitkv_metadata(..., num_chunks=...)`: pass
            None, or a positive int that clamps to the metadata's `num_chunks` (e.g. the value given
            to prepare). With chunk_axis "heads" the chunks split the heads instead (below).
        chunk_axis: what the `num_chunks` chunks split (module docstring, item 3 "Head chunks";
            docs/perf-notes.md item 21): "rows" (the query blocks above, all heads) or "heads" (chunk c = kv
            heads [g0, g1) = `chunk_bounds(k, Hkv)[c]` and q heads [g0 * G, g1 * G), G = Hq // Hkv, of ALL
            rows; k clamped to [1, Hkv], uneven splits allowed: Hkv 8, k 3 -> 2 / 3 / 3 kv heads). None =
            `config.chunk_axis` (default "rows"). Must be the same
            on every rank (agreed group-wide like num_chunks). With `metadata=` it was fixed by
            `prepare_splitkv_metadata(..., chunk_axis=...)`: pass None or that value. The same results up
            to fp rounding, the same bytes per collective name.
        query_gather: a `SplitKVQueryGather` from `splitkv_start_query_gather(q, metadata=metadata)`,
            started right after q was computed (before the k/v projections, which then overlap the
            query all-gather in forward and the dQ all-to-all in backward; docs/perf-notes.md item 3).
            Requires `metadata=` (the same object); q must be the very tensor given to the start,
            unmodified; a handle serves exactly one call. The call then issues no "splitkv.fwd.q"
            all-gather of its own, and its results are bit-identical to the call without it. Every rank
            of the CP group must pass one, or none (a mixed group is detected with `group_check`).
        cp_ranks_per_node: L, CP ranks per node of the two-level all-to-all (module docstring, item 5; our
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
