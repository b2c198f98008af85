"""CPU emulator of Transformer Engine's `fused_attn_fwd` / `fused_attn_bwd` for `thd_thd_thd`, "padding".

Used by tests/test_te_kernel.py to check `megatron_splitkv.kernels.te`'s segment decomposition without
a GPU. It reproduces the semantics measured on the H200 (/work/shared/gpu/README.md), including the
unwanted one: every segment WRITES its outputs (O and softmax stats at the query offsets in the forward;
dQ at the query offsets, dK/dV at the key offsets in the backward), overwriting what an earlier segment
wrote to the same rows; the backward zero-fills dQ/dK/dV first (as TE does for thd) and computes delta as
rowsum(dO * O) from the O it is given. Segments with no keys write NaN (undefined on the GPU), and rows
in no segment keep uninitialised statistics (NaN here), so a caller that reads them fails the tests.
"""

import torch


class EmulatedFusedAttn:
    """Drop-in for `megatron_splitkv.kernels.te.load_fused_attn()` (attributes fwd, bwd, backend, dtypes).

    Records every call's segment count in `calls` as (kind, n_segments).
    """

    backend = "emulated"

    def __init__(self, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64)):
        self.dtypes = dtypes
        self.calls = []

    @staticmethod
    def _segments(max_q, max_kv, cu_q, cu_kv, off_q, off_kv, tq, tk):
        cu_q, cu_kv, off_q, off_kv = (t.tolist() for t in (cu_q, cu_kv, off_q, off_kv))
        segs = []
        for i in range(len(cu_q) - 1):
            lq, lk = cu_q[i + 1] - cu_q[i], cu_kv[i + 1] - cu_kv[i]
            assert 0 <= lq <= max_q and 0 <= lk <= max_kv, (lq, max_q, lk, max_kv)
            assert 0 <= off_q[i] and off_q[i] + lq <= tq and 0 <= off_kv[i] and off_kv[i] + lk <= tk
            segs.append((off_q[i], lq, off_kv[i], lk))
        return segs

    @staticmethod
    def _scores(q, k, scale):  # q [lq, H, D], k [lk, Hk, D] -> [H, lq, lk] in float64
        g = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(g, 1)
        return torch.einsum("ihd,jhd->hij", q.double(), kk) * scale

    def fwd(self, is_training, max_q, max_kv, cu_q, cu_kv, q, k, v, fake_dtype, backend, *,
            cu_seqlens_q_padded, cu_seqlens_kv_padded, attn_scale, qkv_layout, o_format, attn_mask_type):
        assert qkv_layout == "thd_thd_thd" and o_format == "thd" and attn_mask_type == "padding"
        assert q.dtype in self.dtypes and fake_dtype == q.dtype
        segs = self._segments(max_q, max_kv, cu_q, cu_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                              q.shape[0], k.shape[0])
        self.calls.append(("fwd", len(segs)))
        stat_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros_like(q)
        stats = torch.full((q.shape[0], q.shape[1], 1), float("nan"), dtype=stat_dtype)
        g = q.shape[1] // k.shape[1]
        for oq, lq, ok, lk in segs:
            if lk == 0:
                out[oq:oq + lq] = float("nan")
                continue
            s = self._scores(q[oq:oq + lq], k[ok:ok + lk], attn_scale)
            lse = torch.logsumexp(s, -1)  # [H, lq]
            p = torch.exp(s - lse[..., None])
            o = torch.einsum("hij,jhd->ihd", p, v[ok:ok + lk].double().repeat_interleave(g, 1))
            out[oq:oq + lq] = o.to(q.dtype)
            stats[oq:oq + lq, :, 0] = lse.t().to(stat_dtype)
        return out, [stats, torch.zeros(2, dtype=torch.int64)]

    def bwd(self, max_q, max_kv, cu_q, cu_kv, q, k, v, o, do, fake_dtype, aux, backend, *,
            cu_seqlens_q_padded, cu_seqlens_kv_padded, attn_scale, qkv_layout, o_format, do_format,
            dqkv_layout, attn_mask_type):
        assert qkv_layout == dqkv_layout == "thd_thd_thd" and o_format == do_format == "thd"
        assert o.dtype == do.dtype == q.dtype and o.shape == q.shape == do.shape
        stats = aux[0]
        assert stats.shape == (q.shape[0], q.shape[1], 1)
        segs = self._segments(max_q, max_kv, cu_q, cu_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                              q.shape[0], k.shape[0])
        self.calls.append(("bwd", len(segs)))
        g = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for oq, lq, ok, lk in segs:
            rows, keys = slice(oq, oq + lq), slice(ok, ok + lk)
            s = self._scores(q[rows], k[keys], attn_scale)
            p = torch.exp(s - stats[rows, :, 0].double().t()[..., None])  # [H, lq, lk]
            dd = (do[rows].double() * o[rows].double()).sum(-1).t()  # delta [H, lq]
            dov = do[rows].double()
            vv = v[keys].double().repeat_interleave(g, 1)
            kk = k[keys].double().repeat_interleave(g, 1)
            ds = p * (torch.einsum("ihd,jhd->hij", dov, vv) - dd[..., None])
            dq[rows] = (torch.einsum("hij,jhd->ihd", ds, kk) * attn_scale).to(q.dtype)  # overwrite
            dkh = torch.einsum("hij,ihd->jhd", ds, q[rows].double()) * attn_scale
            dvh = torch.einsum("hij,ihd->jhd", p, dov)
            dk[keys] = dkh.view(lk, k.shape[1], g, -1).sum(2).to(k.dtype)  # overwrite, not accumulate
            dv[keys] = dvh.view(lk, k.shape[1], g, -1).sum(2).to(v.dtype)
        return [dq, dk, dv]
