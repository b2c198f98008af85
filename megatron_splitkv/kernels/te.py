"""Transformer Engine fused-attention local kernel for interval masks (GPU, bf16/fp16).

Source: Transformer Engine 2.x `fused_attn_fwd` / `fused_attn_bwd` (cuDNN F16_arbitrary_seqlen backend,
`thd_thd_thd` layout, "padding" mask, ragged offsets through `cu_seqlens_*_padded`), serving the local
attention of Split-KV (arXiv 2611.05926, section 3; DESIGN.md sections 2 and 5). The kernel contract is
`megatron_splitkv.kernels.base`; facts about TE on the H200 are in /work/shared/gpu/README.md.

What TE can and cannot do for the DFlash mask
---------------------------------------------
A `thd` call attends segment i's query rows [off_q[i], off_q[i] + len_q[i]) to its key rows
[off_kv[i], off_kv[i] + len_kv[i]) (dense inside the segment). Segments may READ overlapping rows, but
every output is WRITTEN per segment: the forward writes O and the softmax statistics at the query
offsets, the backward writes dQ at the query offsets and dK/dV at the key offsets, overwriting (not
accumulating) what another segment wrote to the same rows (measured on the H200: dk/dv relative error
~0.8 when query segments share key prefixes). So one call is exact only for what its segments write
disjointly. The DFlash context mask gives every query block b a PREFIX [lo[b], hi[b]) of its sequence's
sorted local keys (all blocks of a sequence share lo), so:

* query-major segments (query rows disjoint, key rows overlapping). Exact: O, lse (forward) and dQ
  (backward). Not dK/dV. Blocks of a sequence are sorted by hi and taken in PAIRS: call A attends the
  pair (2 x B x G rows: 128 for B 16, G 4, one full query tile) to the prefix both see, [lo, hi_first);
  call B attends the pair's second block to the rest of its prefix, [hi_first, hi_second) (short).
* key-major segments (one per key chunk between consecutive distinct interval ends of a sequence, against
  the SUFFIX of that sequence's blocks, sorted by hi, that see the whole chunk): key rows disjoint, query
  rows overlapping. Exact: dK/dV. Not O or dQ.
* own-block segments (the `IntervalMask` second intervals lo2/hi2: each block against its own B keys,
  appended after the context keys): disjoint on both sides. Exact: everything.

Forward = query-major calls A and B + own-block call, merged by lse in fp32 (3 TE forward calls).
Backward = query-major A and B (keep dQ) + key-major (keep dK/dV) + own-block (keep all): 4 TE backward
calls; the context backward runs twice, the price of exactness with a kernel that overwrites. Every
visible (row, key) pair is computed once per pass (no masked work besides TE's tile padding). All calls
run on one permuted copy of the folded rows (blocks that see context sorted by (lo, hi), then the rest).

Further details:
* Grouped-query attention is folded into rows: query head h * G + g (G = Hq // Hkv) of row r becomes row
  r * G + g of kv head h, so a B-row block is a B * G-row segment (64 rows for B 16, G 4, instead of 16)
  and TE runs as multi-head attention over Hkv heads. One copy of q (and dO) per call.
* The backward needs the GLOBAL lse and delta (contract). TE takes the softmax statistics as input (the
  global lse is passed; rows with lse = -inf get +1e30 so P = 0) but computes delta itself as
  rowsum(dO * O) from an O tensor. The kernel passes O' = dO * delta / rowsum(dO * dO) (rounded to the
  input dtype; relative error of the implied delta <= 2**-8 for bf16), which gives rowsum(dO * O') =
  delta. Rows with dO = 0 and delta != 0 (only possible through a gradient of the returned lse) cannot be
  expressed that way, nor rows whose |dO|^2 is subnormal in fp32 while delta != 0 (the ratio is then
  inexact or overflows) or whose O' overflows the input dtype (tiny dO with a large lse gradient, e.g.
  |dO| ~ 1e-7 in fp16): when any exists (one host sync per backward call), the whole call falls back to
  the math kernel's backward, which is exact.
* Segment tables (cu_seqlens, offsets, the key-major permutation) are built on the host once per mask
  and cached on the mask object (`mask._te_plans`; one host sync per step when the mask comes from
  `prepare_splitkv_metadata`). max_seqlen values are rounded up to buckets so cuDNN graphs are reused.
* Rows that see no key (empty interval, invalid block): out 0, lse -inf, zero gradients.

Dtypes: bfloat16 and float16 only (TE fused attention); anything else raises ValueError. Device: CUDA
(an injected `fused_attn` backend, e.g. `tests/te_emulator.py`, may run elsewhere).
Masks: every group of blocks sharing `lo` must own a key range [lo, max hi) disjoint from the other
groups' (true for the DFlash mask: one group per sequence); otherwise ValueError at plan time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..lse import merge
from .base import IntervalMask, mask_cache
from .dense import acc_dtype, fold_heads, out_for_delta, unfold_heads
from .flex import bucket_length
from .math import MathAttentionKernel

__all__ = ["TEAttentionKernel", "TESegments", "te_plan", "load_fused_attn"]

_BIG = 1.0e30  # statistics for rows with lse = -inf: exp(s - 1e30) = 0


class _FusedAttn:
    """The two Transformer Engine entry points and the backend enum (imported lazily)."""

    def __init__(self):
        from transformer_engine.pytorch.cpp_extensions.fused_attn import (  # noqa: PLC0415
            FusedAttnBackend,
            fused_attn_bwd,
            fused_attn_fwd,
        )

        self.fwd, self.bwd = fused_attn_fwd, fused_attn_bwd
        self.backend = FusedAttnBackend["F16_arbitrary_seqlen"]
        self.dtypes = (torch.bfloat16, torch.float16)


def load_fused_attn():
    """Import Transformer Engine's fused attention (ImportError when TE is missing)."""
    return _FusedAttn()


@dataclass
class TESegments:
    """One `thd` call's segment tables (int32 on the kernel's device, shape [n + 1]).

    cu_q / cu_kv: cumulative actual lengths; off_q / off_kv: row offsets of each segment (the last entry
    is the total row count); max_q / max_kv: bucketed maxima (>= every length); n: number of segments.
    """

    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    off_q: torch.Tensor
    off_kv: torch.Tensor
    max_q: int
    max_kv: int
    n: int


def _segments(off_q, len_q, off_kv, len_kv, total_q, total_kv, device):
    if not off_q:
        return None

    def cum(lengths):
        out = [0]
        for n in lengths:
            out.append(out[-1] + n)
        return out

    t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return TESegments(cu_q=t(cum(len_q)), cu_kv=t(cum(len_kv)), off_q=t(list(off_q) + [total_q]),
                      off_kv=t(list(off_kv) + [total_kv]), max_q=bucket_length(max(len_q), 2, 64),
                      max_kv=bucket_length(max(len_kv), 2, 64), n=len(off_q))


@dataclass
class _Plan:
    """Segment tables of one mask, all over the PERMUTED folded rows (blocks in `perm` order)."""

    qmaj: list  # [(TESegments, rows [nb * R] bool)]: query-major context calls (pairs, then remainders)
    kmaj: TESegments | None  # context, one segment per key chunk (suffix of blocks x chunk)
    own: tuple | None  # (TESegments, rows bool) for the own-block region (second intervals)
    perm: torch.Tensor  # [nb] int64: block at permuted position i is perm[i]
    rows_per_block: int


def _flags(positions, nb, rows, dev):
    flags = torch.zeros(nb, dtype=torch.bool)
    if positions:
        flags[positions] = True
    return flags.repeat_interleave(rows).to(dev)


def te_plan(mask: IntervalMask, groups: int, pair_blocks: bool = True) -> _Plan:
    """Build the segment tables of `mask` for folded rows (R = B * groups rows per block).

    Blocks are permuted: blocks that see context keys sorted by (lo, hi), then the others. Query-major
    calls: with `pair_blocks`, consecutive blocks of a group (same lo) go in pairs: call A attends the pair
    (2R rows, one tile of 128 rows for B 16 and G 4) to the prefix both see, [lo, hi_first); call B
    attends the pair's second block to the rest of its prefix, [hi_first, hi_second). Without pairing,
    one call with one segment per block. Key-major call: one segment per chunk between consecutive
    distinct interval ends of a group, against the suffix of the group's blocks that see it whole.

    Host side (reads lo/hi, lo2/hi2 once). Raises ValueError when blocks sharing `lo` overlap the key
    range of another group (the key-major decomposition would then write the same dK rows twice).
    """
    dev = mask.lo.device
    nb, bsz = mask.num_blocks, mask.block_size
    rows = bsz * groups
    lo, hi = mask.lo.tolist(), mask.hi.tolist()
    total_q, n_keys = nb * rows, int(mask.num_keys)
    nonempty = sorted((b for b in range(nb) if hi[b] > lo[b]), key=lambda b: (lo[b], hi[b]))
    order = nonempty + [b for b in range(nb) if hi[b] <= lo[b]]
    # groups of blocks sharing lo: [start, stop) positions in `order`
    spans, start, prev_end = [], 0, None
    while start < len(nonempty):
        g_lo, stop = lo[nonempty[start]], start
        while stop < len(nonempty) and lo[nonempty[stop]] == g_lo:
            stop += 1
        if prev_end is not None and g_lo < prev_end:
            raise ValueError(
                "backend='te' needs blocks that share an interval start to own disjoint key ranges "
                f"(a group starting at key {g_lo} overlaps the previous group ending at {prev_end}); "
                "use backend='flex' or 'math' for this mask")
        spans.append((start, stop))
        prev_end = hi[nonempty[stop - 1]]
        start = stop
    # query-major calls
    a, b_ = ([], [], [], []), ([], [], [], [])
    a_pos, b_pos = [], []
    for start, stop in spans:
        step = 2 if pair_blocks else 1
        for i in range(start, stop, step):
            first = order[i]
            n = min(step, stop - i)
            a[0].append(i * rows); a[1].append(n * rows); a[2].append(lo[first]); a[3].append(hi[first] - lo[first])
            a_pos.extend(range(i, i + n))
            if n == 2 and hi[order[i + 1]] > hi[first]:
                b_[0].append((i + 1) * rows); b_[1].append(rows); b_[2].append(hi[first])
                b_[3].append(hi[order[i + 1]] - hi[first])
                b_pos.append(i + 1)
    qmaj = [(seg, _flags(pos, nb, rows, dev)) for seg, pos in
            ((_segments(*a, total_q, n_keys, dev), a_pos), (_segments(*b_, total_q, n_keys, dev), b_pos))
            if seg is not None]
    # key-major call
    off_q, len_q, off_kv, len_kv = [], [], [], []
    for start, stop in spans:
        his = [hi[b] for b in order[start:stop]]
        edge = lo[order[start]]
        for e in sorted(set(his)):
            first = bisect.bisect_left(his, e)  # blocks with hi >= e see the whole chunk [edge, e)
            off_q.append((start + first) * rows)
            len_q.append((stop - start - first) * rows)
            off_kv.append(edge)
            len_kv.append(e - edge)
            edge = e
    kmaj = _segments(off_q, len_q, off_kv, len_kv, total_q, n_keys, dev)
    own = None
    if getattr(mask, "lo2", None) is not None:
        lo2, hi2 = mask.lo2.tolist(), mask.hi2.tolist()
        owned = [i for i, b in enumerate(order) if hi2[b] > lo2[b]]
        seg = _segments([i * rows for i in owned], [rows] * len(owned), [lo2[order[i]] for i in owned],
                        [hi2[order[i]] - lo2[order[i]] for i in owned], total_q, n_keys, dev)
        own = (seg, _flags(owned, nb, rows, dev)) if seg is not None else None
    perm = torch.tensor(order, dtype=torch.long, device=dev)
    return _Plan(qmaj, kmaj, own, perm, rows)


#: fp32 accumulation (float64 stays float64: the CPU emulator in tests); GQA folding (kernels/dense.py)
_acc, _fold, _unfold = acc_dtype, fold_heads, unfold_heads


def _permute_rows(x: torch.Tensor, perm: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows of x grouped per block ([nb * rows, ...]) reordered to the blocks `perm`."""
    return x.view(-1, rows, *x.shape[1:])[perm].reshape(x.shape)


def _unpermute_rows(x: torch.Tensor, perm: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of `_permute_rows`."""
    out = torch.empty_like(x).view(-1, rows, *x.shape[1:])
    out[perm] = x.view(-1, rows, *x.shape[1:])
    return out.view(x.shape)


class TEAttentionKernel:
    """Transformer Engine fused attention for interval masks (see the module docstring).

    Args:
        fused_attn: the TE entry points (default: `load_fused_attn()`, importing Transformer Engine); an
            object with `fwd`, `bwd`, `backend` and `dtypes` attributes of the same signatures (tests
            inject a CPU emulator).

    Raises:
        ImportError: Transformer Engine is not installed (at construction).
        ValueError: inputs other than the backend's dtypes (bf16/fp16 for TE); masks TE cannot split
            exactly (see `te_plan`).
    """

    name = "te"

    def __init__(self, fused_attn=None):
        self.te = fused_attn if fused_attn is not None else load_fused_attn()

    # ------------------------------------------------------------------ plumbing
    def plan(self, mask: IntervalMask, groups: int) -> _Plan:
        return mask_cache(mask, "_te_plans", groups, lambda: te_plan(mask, groups))

    def check_dtype(self, dtype, device=None, head_dim=None):  # noqa: ARG002 - the kernels' protocol (base)
        """Raise ValueError when this backend cannot run `dtype` (the ops call it once per call, before
        their first data collective, so that every rank raises instead of only the ranks whose kernel
        runs: a rank without keys never calls the kernel)."""
        if dtype not in self.te.dtypes:
            raise ValueError(f"backend='te' supports q/k/v dtypes {self.te.dtypes}, got {dtype}; use "
                             "backend='flex' or 'math'")

    def _check(self, q, k, v):
        if q.dtype not in self.te.dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"backend='te' supports q/k/v dtypes {self.te.dtypes}, got {q.dtype}/{k.dtype}/"
                             f"{v.dtype}; use backend='flex' or 'math'")

    def _call_fwd(self, q, k, v, seg: TESegments, scale):
        out, aux = self.te.fwd(True, seg.max_q, seg.max_kv, seg.cu_q, seg.cu_kv, q, k, v, q.dtype,
                               self.te.backend, cu_seqlens_q_padded=seg.off_q, cu_seqlens_kv_padded=seg.off_kv,
                               attn_scale=scale, qkv_layout="thd_thd_thd", o_format="thd",
                               attn_mask_type="padding")
        stats = aux[0]
        if stats.dim() != 3:
            raise RuntimeError(f"backend='te' needs thd softmax stats [T, H, 1]; this cuDNN returned shape "
                               f"{tuple(stats.shape)} (cuDNN too old)")
        return out, stats[..., 0], aux[1]

    def _call_bwd(self, q, k, v, o, do, stats, rng, seg: TESegments, scale):
        grads = self.te.bwd(seg.max_q, seg.max_kv, seg.cu_q, seg.cu_kv, q, k, v, o, do, q.dtype,
                            [stats[..., None].contiguous(), rng], self.te.backend,
                            cu_seqlens_q_padded=seg.off_q, cu_seqlens_kv_padded=seg.off_kv, attn_scale=scale,
                            qkv_layout="thd_thd_thd", o_format="thd", do_format="thd",
                            dqkv_layout="thd_thd_thd", attn_mask_type="padding")
        return grads[0], grads[1], grads[2]

    # ------------------------------------------------------------------ contract
    def forward(self, q, k, v, mask: IntervalMask, scale):
        """Contract of `kernels/base.py`: (out [Tq, Hq, D] fp32, lse [Tq, Hq] fp32, state = TE's rng_state)."""
        self._check(q, k, v)
        hq, hkv = q.shape[1], k.shape[1]
        acc = _acc(q.dtype)
        plan = self.plan(mask, hq // hkv)
        q_p = _permute_rows(_fold(q, hkv), plan.perm, plan.rows_per_block).contiguous()
        k, v = k.contiguous(), v.contiguous()
        out, lse, rng = None, None, None
        for seg, rows in plan.qmaj + ([plan.own] if plan.own is not None else []):
            o_s, s_s, rng = self._call_fwd(q_p, k, v, seg, scale)
            o_s = torch.where(rows[:, None, None], o_s.to(acc), 0.0)
            s_s = torch.where(rows[:, None], s_s.to(acc), float("-inf"))
            out, lse = merge(out, lse, o_s, s_s)
        if out is None:
            out = torch.zeros(q_p.shape[0], hkv, v.shape[2], dtype=acc, device=q.device)
            lse = torch.full(q_p.shape[:2], float("-inf"), dtype=acc, device=q.device)
        unp = lambda x: _unfold(_unpermute_rows(x, plan.perm, plan.rows_per_block), hq)  # noqa: E731
        return unp(out), unp(lse), rng

    def backward(self, q, k, v, mask: IntervalMask, scale, dout, lse, delta, state):
        """Contract of `kernels/base.py` with the GLOBAL lse and delta: (dq, dk, dv) fp32."""
        self._check(q, k, v)
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        acc = _acc(q.dtype)
        plan = self.plan(mask, hq // hkv)
        rows = plan.rows_per_block
        prm = lambda x: _permute_rows(_fold(x, hkv), plan.perm, rows).contiguous()  # noqa: E731
        do_p = prm(dout.to(q.dtype))
        delta_p = prm(delta.to(acc))
        o_p, bad = out_for_delta(do_p, delta_p, q.dtype)
        # delta not expressible as rowsum(dO * O'): dO = 0 (or |dO|^2 subnormal, the ratio then inexact
        # or overflowing) with delta != 0, or O' overflowing q's dtype (one host sync)
        if bool(bad.any()):
            dq, dk, dv = MathAttentionKernel().backward(q, k, v, mask, scale, dout, lse, delta, None)
            return dq.to(acc), dk.to(acc), dv.to(acc)
        lse_p = prm(lse.to(acc))
        stats = torch.where(torch.isfinite(lse_p), lse_p, _BIG).contiguous()
        q_p = prm(q)
        k, v = k.contiguous(), v.contiguous()
        rng = state if state is not None else torch.zeros(2, dtype=torch.int64, device=q.device)
        dq = torch.zeros(q_p.shape[0], hkv, d, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for seg, _ in plan.qmaj:  # dQ of the context (their dK/dV are overwritten garbage: dropped)
            dq += self._call_bwd(q_p, k, v, o_p, do_p, stats, rng, seg, scale)[0].to(acc)
        if plan.kmaj is not None:  # dK/dV of the context (its dQ is overwritten garbage: dropped)
            _, dk_c, dv_c = self._call_bwd(q_p, k, v, o_p, do_p, stats, rng, plan.kmaj, scale)
            dk += dk_c.to(acc)
            dv += dv_c.to(acc)
        if plan.own is not None:  # own blocks: disjoint on both sides, all three exact
            dq_o, dk_o, dv_o = self._call_bwd(q_p, k, v, o_p, do_p, stats, rng, plan.own[0], scale)
            dq += dq_o.to(acc)
            dk += dk_o.to(acc)
            dv += dv_o.to(acc)
        return _unfold(_unpermute_rows(dq, plan.perm, rows), hq), dk, dv
