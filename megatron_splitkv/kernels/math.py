"""Pure-PyTorch local attention kernel for interval masks (CPU, tests, and a device-agnostic fallback).

Implements the contract of `megatron_splitkv.kernels.base` exactly (DESIGN.md section 2, steps 2 of the
forward and backward; arXiv 2611.05926 Split-KV): attention of query blocks against the contiguous key
interval [lo[b], hi[b]) of the sorted local context keys, united (when the mask has second intervals)
with the block's own B keys [lo2[b], lo2[b] + B) appended after the context (DESIGN.md section 1: the
own block is seen bidirectionally).

Memory stays bounded: blocks that see at least one key are sorted by `lo` and grouped greedily so that
each group's score tile (rows x (key span of the group + B own keys) x Hq) holds at most `max_elements`
entries (one block per group at least); only that tile is materialised. The own keys are gathered per
block (block-diagonal, B x B per block), never as a span. Blocks that see nothing are never computed
(out = 0, lse = -inf, zero gradients). Grouped-query attention is computed by viewing the query heads as
[Hkv, Hq // Hkv] so K/V are never repeated. Arithmetic is float32 (float64 for float64 inputs).

Non-finite masked entries: keys of a group's span that no row of the group sees, and the own keys of
blocks without a second interval, are selected to 0 and masked score entries are selected
(torch.where, never multiplied by 0), so a NaN/inf in a key or value that no query sees never reaches an
output or gradient. A NaN/inf in a key that SOME row of the group sees reaches that group's other rows
through the tile matmul (as in any dense attention tile).
"""

import torch

from .base import IntervalMask, mask_cache


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class MathAttentionKernel:
    """Chunked dense-tile reference kernel; see the module docstring and `kernels/base.py`.

    Args:
        max_elements: upper bound on the entries of one score tile (rows x keys x heads) a group of
            blocks may build (default 2**22, i.e. 16 MiB in float32); a single block larger than this
            is still computed in one tile.
    """

    name = "math"
    #: reads the masks' per-row bounds (`IntervalMask.row_lo / row_lo2 / row_hi2`: windowed / causal layers)
    row_intervals = True
    #: q / k / v / dout may be head slices (any row / head strides): every tile is selected into a new tensor
    strided_heads = True

    def __init__(self, max_elements: int = 1 << 22):
        self.max_elements = int(max_elements)

    def _groups(self, mask: IntervalMask, num_heads: int):
        """List of (block indices [n] int64 on the mask's device, key lo, key hi, has own keys) for
        groups of blocks that see at least one key.

        Reading lo/hi (lo2/hi2) is a host sync, so the grouping is cached on the mask object
        (`mask._math_groups`, keyed by heads and `max_elements`): a mask reused by every layer of a
        step (`prepare_splitkv_metadata`) is read once. The cache assumes the intervals are not
        modified in place afterwards.
        """
        dev = mask.lo.device
        return mask_cache(mask, "_math_groups", (num_heads, self.max_elements), lambda: [
            (torch.tensor(b, dtype=torch.long, device=dev), lo, hi, own) for b, lo, hi, own in self._make_groups(mask, num_heads)])

    def _make_groups(self, mask: IntervalMask, num_heads: int):
        lo, hi = mask.lo.tolist(), mask.hi.tolist()
        n = len(lo)
        own = [False] * n
        if mask.has_union:
            own = [b > a for a, b in zip(mask.lo2.tolist(), mask.hi2.tolist())]
        bsz = mask.block_size
        ctx = [b for b in range(n) if hi[b] > lo[b]]
        # blocks that see only their own keys: grouped among themselves (empty context span)
        only_own = [b for b in range(n) if own[b] and hi[b] <= lo[b]]
        for live, spans in ((sorted(ctx, key=lambda b: lo[b]), True), (only_own, False)):
            cur, clo, chi, cown = [], 0, 0, False
            for b in live:
                blo, bhi = (lo[b], hi[b]) if spans else (0, 0)
                if cur:
                    nlo, nhi, nown = min(clo, blo), max(chi, bhi), cown or own[b]
                    if (len(cur) + 1) * bsz * (nhi - nlo + bsz * nown) * num_heads <= self.max_elements:
                        cur.append(b)
                        clo, chi, cown = nlo, nhi, nown
                        continue
                    yield cur, clo, chi, cown
                cur, clo, chi, cown = [b], blo, bhi, own[b]
            if cur:
                yield cur, clo, chi, cown

    @staticmethod
    def _tile(q, k, v, mask, blocks, klo, khi, has_own, scale, acc):
        """Scores of one group: returns (row index, q [R,Hkv,G,D], context part (k, v [S,Hkv,D]), own
        part (key index [n*B], k, v [n,B,Hkv,D]) or None, s [Hkv,G,R,S(+B)], vis [R,S(+B)]).

        Own keys (when the group has any): block j's B keys [lo2, lo2 + B), scored block-diagonally and
        appended after the context span in the key dim of s (R = n * B rows, row r of block r // B)."""
        bsz = mask.block_size
        hkv = k.shape[1]
        dev = q.device
        blk = blocks.to(dev)
        n = blk.shape[0]
        ar = torch.arange(bsz, device=dev)
        rows = (blk[:, None] * bsz + ar[None, :]).reshape(-1)
        qg = q.index_select(0, rows).to(acc)
        qg = qg.view(qg.shape[0], hkv, qg.shape[1] // hkv, qg.shape[2])
        if mask.row_lo is None:
            rlo = (mask.lo.to(dev).index_select(0, blk) - klo).repeat_interleave(bsz)
        else:  # per-row bounds (sliding window): row r sees [row_lo[r], hi[b])
            rlo = mask.row_lo.to(dev).index_select(0, rows) - klo
        rhi = (mask.hi.to(dev).index_select(0, blk) - klo).repeat_interleave(bsz)
        j = torch.arange(khi - klo, device=dev)
        vis = (j[None, :] >= rlo[:, None]) & (j[None, :] < rhi[:, None])
        # keys of the span that no row of the group sees are SELECTED to 0 (not multiplied): a NaN/inf in
        # a masked key or value must not reach the outputs/gradients through p @ V or dS @ K (0 * NaN)
        seen = vis.any(0)[:, None, None]
        kg = torch.where(seen, k[klo:khi].to(acc), 0)
        vg = torch.where(seen, v[klo:khi].to(acc), 0)
        s = torch.einsum("rkgd,skd->kgrs", qg, kg) * scale
        s = s.masked_fill(~vis, float("-inf"))
        own = None
        if has_own:
            lo2 = mask.lo2.to(dev).index_select(0, blk)
            has2 = mask.hi2.to(dev).index_select(0, blk) > lo2  # [n]
            idx = (torch.where(has2, lo2, 0)[:, None] + ar[None, :]).reshape(-1).clamp(max=k.shape[0] - 1)
            sel = has2[:, None, None, None]
            k2 = torch.where(sel, k.index_select(0, idx).to(acc).view(n, bsz, hkv, -1), 0)
            v2 = torch.where(sel, v.index_select(0, idx).to(acc).view(n, bsz, hkv, -1), 0)
            q5 = qg.view(n, bsz, hkv, qg.shape[2], qg.shape[3])
            s2 = torch.einsum("nikgd,njkd->kgnij", q5, k2) * scale  # [Hkv, G, n, B, B]
            s2 = s2.reshape(s2.shape[0], s2.shape[1], n * bsz, bsz)
            vis2 = has2.repeat_interleave(bsz)[:, None].expand(n * bsz, bsz)
            if mask.row_lo2 is not None:  # per-row own-block bounds (windowed / causal layer)
                start = lo2.repeat_interleave(bsz)
                i = ar[None, :]
                vis2 = vis2 & (i >= (mask.row_lo2.to(dev).index_select(0, rows) - start)[:, None]) \
                    & (i < (mask.row_hi2.to(dev).index_select(0, rows) - start)[:, None])
            s = torch.cat([s, s2.masked_fill(~vis2, float("-inf"))], -1)
            vis = torch.cat([vis, vis2], -1)
            own = (idx, k2, v2)
        return rows, qg, (kg, vg), own, s, vis

    @staticmethod
    def _own_pv(p2, v2):
        """Block-diagonal p2 [Hkv, G, n*B, B] @ v2 [n, B, Hkv, D] -> [n*B, Hkv, G, D]."""
        n, bsz = v2.shape[0], v2.shape[1]
        p5 = p2.reshape(p2.shape[0], p2.shape[1], n, bsz, bsz)
        return torch.einsum("kgnij,njkd->nikgd", p5, v2).reshape(n * bsz, p2.shape[0], p2.shape[1], -1)

    def forward(self, q, k, v, mask: IntervalMask, scale: float):
        """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> (out [Tq, Hq, D], lse [Tq, Hq], None), float32 (float64
        for float64 inputs); rows with no visible key: out 0, lse -inf (see `kernels/base.py`)."""
        tq, hq, _ = q.shape
        acc = _acc_dtype(q.dtype)
        out = torch.zeros(tq, hq, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full((tq, hq), float("-inf"), dtype=acc, device=q.device)
        for blocks, klo, khi, has_own in self._groups(mask, hq):
            rows, _, (_, vg), own, s, _ = self._tile(q, k, v, mask, blocks, klo, khi, has_own, scale, acc)
            mx = s.amax(-1, keepdim=True)  # finite: every row of a group sees >= 1 key (unless per-row bounds)
            if mask.has_rows:  # a row of a live block may see nothing (window < its offset): out 0, lse -inf
                mx = torch.where(torch.isfinite(mx), mx, 0.0)
            p = torch.exp(s - mx)
            denom = p.sum(-1, keepdim=True)
            p = p / (torch.where(denom > 0, denom, 1.0) if mask.has_rows else denom)
            span = khi - klo
            o = torch.einsum("kgrs,skd->rkgd", p[..., :span], vg)
            if own is not None:
                o = o + self._own_pv(p[..., span:], own[2])
            out.index_copy_(0, rows, o.reshape(o.shape[0], hq, -1))
            lse_g = (mx + torch.log(denom)).squeeze(-1)  # [Hkv, G, R]
            lse.index_copy_(0, rows, lse_g.reshape(hq, -1).t())
        return out, lse, None

    def backward(self, q, k, v, mask: IntervalMask, scale: float, dout, lse, delta, state=None):
        """(dq [Tq, Hq, D], dk, dv [Tk, Hkv, D]) with the GLOBAL lse and delta [Tq, Hq] (see
        `kernels/base.py`); rows with lse = -inf contribute nothing."""
        tq, hq, d = q.shape
        hkv = k.shape[1]
        acc = _acc_dtype(q.dtype)
        dq = torch.zeros(tq, hq, d, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for blocks, klo, khi, has_own in self._groups(mask, hq):
            rows, qg, (kg, vg), own, s, vis = self._tile(q, k, v, mask, blocks, klo, khi, has_own, scale, acc)
            r = rows.shape[0]
            span = khi - klo

            def heads_first(x):  # [R, Hq] -> [Hkv, G, R, 1]
                return x.index_select(0, rows).to(acc).t().reshape(hkv, hq // hkv, r, 1)

            lse_g = heads_first(lse)
            lse_g = torch.where(torch.isfinite(lse_g), lse_g, torch.full_like(lse_g, float("inf")))
            p = torch.exp(s - lse_g)  # 0 on masked entries and on rows with lse = -inf
            do_g = dout.index_select(0, rows).to(acc).view(r, hkv, hq // hkv, -1)
            dp = torch.einsum("rkgd,skd->kgrs", do_g, vg)
            dv[klo:khi] += torch.einsum("kgrs,rkgd->skd", p[..., :span], do_g)
            if own is not None:
                idx, k2, v2 = own
                n, bsz = k2.shape[0], k2.shape[1]
                do5 = do_g.view(n, bsz, hkv, hq // hkv, -1)
                p5 = p[..., span:].reshape(hkv, hq // hkv, n, bsz, bsz)
                dv.index_add_(0, idx, torch.einsum("kgnij,nikgd->njkd", p5, do5).reshape(n * bsz, hkv, -1))
                dp2 = torch.einsum("nikgd,njkd->kgnij", do5, v2).reshape(hkv, hq // hkv, r, bsz)
                dp = torch.cat([dp, dp2], -1)
            ds = torch.where(vis, p * (dp - heads_first(delta)), 0)  # select: dp may be inf/NaN where masked
            dqg = torch.einsum("kgrs,skd->rkgd", ds[..., :span], kg)
            dk[klo:khi] += torch.einsum("kgrs,rkgd->skd", ds[..., :span], qg) * scale
            if own is not None:
                ds5 = ds[..., span:].reshape(hkv, hq // hkv, n, bsz, bsz)
                dqg = dqg + torch.einsum("kgnij,njkd->nikgd", ds5, k2).reshape(r, hkv, hq // hkv, -1)
                q5 = qg.view(n, bsz, hkv, hq // hkv, -1)
                dk.index_add_(0, idx, (torch.einsum("kgnij,nikgd->njkd", ds5, q5) * scale).reshape(n * bsz, hkv, -1))
            dq.index_copy_(0, rows, (dqg * scale).reshape(r, hq, d))
        return dq, dk, dv
