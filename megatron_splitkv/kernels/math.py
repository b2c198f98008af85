"""Pure-PyTorch local attention kernel for interval masks (CPU, tests, and a device-agnostic fallback).

Implements the contract of `megatron_splitkv.kernels.base` exactly (DESIGN.md section 2, steps 2 of the
forward and backward; arXiv 2611.05926 Split-KV): attention of query blocks against the contiguous key
interval [lo[b], hi[b]) of the sorted local context keys.

Memory stays bounded: blocks that see at least one key are sorted by `lo` and grouped greedily so that
each group's score tile (rows x key span of the group x Hq) holds at most `max_elements` entries (one
block per group at least); only that tile is materialised. Blocks that see nothing are never computed
(out = 0, lse = -inf, zero gradients). Grouped-query attention is computed by viewing the query heads as
[Hkv, Hq // Hkv] so K/V are never repeated. Arithmetic is float32 (float64 for float64 inputs).

Non-finite masked entries: keys of a group's span that no row of the group sees are selected to 0 and
masked score entries are selected (torch.where, never multiplied by 0), so a NaN/inf in a key or value
that no query sees never reaches an output or gradient. A NaN/inf in a key that SOME row of the group
sees reaches that group's other rows through the tile matmul (as in any dense attention tile).
"""

import torch

from .base import IntervalMask


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

    def __init__(self, max_elements: int = 1 << 22):
        self.max_elements = int(max_elements)

    def _groups(self, mask: IntervalMask, num_heads: int):
        """List of (block indices [n] int64 on the mask's device, key lo, key hi) for groups of non-empty
        blocks.

        Reading lo/hi is a host sync, so the grouping is cached on the mask object
        (`mask._math_groups`, keyed by heads and `max_elements`): a mask reused by every layer of a
        step (`prepare_splitkv_metadata`) is read once. The cache assumes lo/hi are not modified in
        place afterwards.
        """
        cache = mask.__dict__.setdefault("_math_groups", {})
        key = (num_heads, self.max_elements)
        if key not in cache:
            dev = mask.lo.device
            cache[key] = [(torch.tensor(b, dtype=torch.long, device=dev), lo, hi)
                          for b, lo, hi in self._make_groups(mask, num_heads)]
        return cache[key]

    def _make_groups(self, mask: IntervalMask, num_heads: int):
        lo, hi = mask.lo.tolist(), mask.hi.tolist()
        bsz = mask.block_size
        live = sorted((b for b in range(len(lo)) if hi[b] > lo[b]), key=lambda b: lo[b])
        cur, clo, chi = [], 0, 0
        for b in live:
            if cur:
                nlo, nhi = min(clo, lo[b]), max(chi, hi[b])
                if (len(cur) + 1) * bsz * (nhi - nlo) * num_heads <= self.max_elements:
                    cur.append(b)
                    clo, chi = nlo, nhi
                    continue
                yield cur, clo, chi
            cur, clo, chi = [b], lo[b], hi[b]
        if cur:
            yield cur, clo, chi

    @staticmethod
    def _tile(q, k, v, mask, blocks, klo, khi, scale, acc):
        """Scores of one group: returns (row index, q [R,Hkv,G,D], k, v [S,Hkv,D], s [Hkv,G,R,S], vis [R,S])."""
        bsz = mask.block_size
        hkv = k.shape[1]
        dev = q.device
        blk = blocks.to(dev) if isinstance(blocks, torch.Tensor) else torch.tensor(blocks, dtype=torch.long,
                                                                                  device=dev)
        rows = (blk[:, None] * bsz + torch.arange(bsz, device=dev)[None, :]).reshape(-1)
        qg = q.index_select(0, rows).to(acc)
        qg = qg.view(qg.shape[0], hkv, qg.shape[1] // hkv, qg.shape[2])
        rlo = (mask.lo.to(dev).index_select(0, blk) - klo).repeat_interleave(bsz)
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
        return rows, qg, kg, vg, s, vis

    def forward(self, q, k, v, mask: IntervalMask, scale: float):
        """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> (out [Tq, Hq, D], lse [Tq, Hq], None), float32 (float64
        for float64 inputs); rows with no visible key: out 0, lse -inf (see `kernels/base.py`)."""
        tq, hq, _ = q.shape
        acc = _acc_dtype(q.dtype)
        out = torch.zeros(tq, hq, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full((tq, hq), float("-inf"), dtype=acc, device=q.device)
        for blocks, klo, khi in self._groups(mask, hq):
            rows, _, _, vg, s, _ = self._tile(q, k, v, mask, blocks, klo, khi, scale, acc)
            mx = s.amax(-1, keepdim=True)  # finite: every row of a group sees >= 1 key
            p = torch.exp(s - mx)
            denom = p.sum(-1, keepdim=True)
            o = torch.einsum("kgrs,skd->rkgd", p / denom, vg)
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
        for blocks, klo, khi in self._groups(mask, hq):
            rows, qg, kg, vg, s, vis = self._tile(q, k, v, mask, blocks, klo, khi, scale, acc)
            r = rows.shape[0]

            def heads_first(x):  # [R, Hq] -> [Hkv, G, R, 1]
                return x.index_select(0, rows).to(acc).t().reshape(hkv, hq // hkv, r, 1)

            lse_g = heads_first(lse)
            lse_g = torch.where(torch.isfinite(lse_g), lse_g, torch.full_like(lse_g, float("inf")))
            p = torch.exp(s - lse_g)  # 0 on masked entries and on rows with lse = -inf
            do_g = dout.index_select(0, rows).to(acc).view(r, hkv, hq // hkv, -1)
            dv[klo:khi] += torch.einsum("kgrs,rkgd->skd", p, do_g)
            dp = torch.einsum("rkgd,skd->kgrs", do_g, vg)
            ds = torch.where(vis, p * (dp - heads_first(delta)), 0)  # select: dp may be inf/NaN where masked
            dq.index_copy_(0, rows, (torch.einsum("kgrs,skd->rkgd", ds, kg) * scale).reshape(r, hq, d))
            dk[klo:khi] += torch.einsum("kgrs,rkgd->skd", ds, qg) * scale
        return dq, dk, dv
