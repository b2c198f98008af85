"""FlexAttention local kernel (`megatron_splitkv.kernels.flex`): CPU part always, GPU part with CUDA.

CPU: BlockMask construction from intervals (with and without the own-block second intervals, the union
contract of kernels/base.py) against a brute-force tile classification of the dense mask;
the kernel's algebra (padding, -inf rows, global-lse backward over a key split) through the plain-torch
flex emulation, which reads the same block tables. GPU (skipped without CUDA): compiled flex, bf16,
exactness against float64, and no recompilation across key lengths within a bucket.
"""

import math
import os

import pytest
import torch

from _splitkv_helpers import with_random_own_slots

from megatron_splitkv.kernels.base import IntervalMask

flex = pytest.importorskip("megatron_splitkv.kernels.flex")
if flex.BlockMask is None:  # pragma: no cover
    pytest.skip("torch without FlexAttention", allow_module_level=True)

from megatron_splitkv.kernels import flex_bwd_prep  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_intervals(gen, n_blocks, num_keys, p_empty=0.2):
    lo = torch.randint(0, num_keys + 1, (n_blocks,), generator=gen)
    span = torch.randint(0, num_keys + 1, (n_blocks,), generator=gen)
    hi = torch.minimum(lo + span, torch.tensor(num_keys))
    empty = torch.rand(n_blocks, generator=gen) < p_empty
    hi = torch.where(empty, lo, hi)
    return lo, hi


def dflash_like_intervals(gen, n_blocks, num_keys):
    """Sorted anchors of one sequence: block b sees keys [0, a_b) (the DFlash context rule)."""
    a = torch.sort(torch.randint(0, num_keys + 1, (n_blocks,), generator=gen)).values
    return torch.zeros_like(a), a


def dense_rows(lo, hi, B, q_len, kv_len, lo2=None, hi2=None):
    """Dense [q_len, kv_len] visibility of per-block intervals (rows past the blocks see nothing); with
    lo2/hi2 the union of both intervals."""
    rows = torch.arange(q_len)
    blk = rows // B
    valid = blk < lo.shape[0]
    blk = blk.clamp(max=lo.shape[0] - 1)
    j = torch.arange(kv_len)
    m = (j[None] >= lo[blk][:, None]) & (j[None] < hi[blk][:, None])
    if lo2 is not None:
        m |= (j[None] >= lo2[blk][:, None]) & (j[None] < hi2[blk][:, None])
    return m & valid[:, None]


def union_intervals(gen, n_blocks, num_ctx, B, kind="random", align=flex.TILE, p_own=0.7):
    """A mask with own-block second intervals: context intervals over num_ctx keys, own keys after
    C = num_ctx rounded up to `align` (align 1: no padding), a random subset of blocks owning disjoint
    B-key slots in random order (one slot per block, n_blocks slots). Returns an IntervalMask."""
    if kind == "random":
        lo, hi = random_intervals(gen, n_blocks, num_ctx)
    else:
        lo, hi = dflash_like_intervals(gen, n_blocks, num_ctx)
    return with_random_own_slots(gen, lo, hi, num_ctx, B, p_own, align)


def brute_force_tiles(dense, tile):
    q_len, kv_len = dense.shape
    t = dense.reshape(q_len // tile, tile, kv_len // tile, tile)
    needed = t.any(dim=(1, 3))
    full = t.all(dim=(1, 3))
    return needed & ~full, full


def tables_to_sets(num, idx):
    num, idx = num[0, 0], idx[0, 0]
    return [sorted(idx[i, : int(num[i])].tolist()) for i in range(num.shape[0])]


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_bucket_length_properties(steps):
    for n in list(range(1, 3000, 7)) + [16384, 16385, 65536, 70000, 131072]:
        b = flex.bucket_length(n, steps)
        assert b >= n and b % flex.TILE == 0
        assert b <= max(flex.TILE * steps, (steps + 1) / steps * n + flex.TILE)
    # monotone and few distinct shapes: `steps` per octave (200_000 / 128 < 2**11)
    vals = [flex.bucket_length(n, steps) for n in range(1, 200_000, 97)]
    assert vals == sorted(vals)
    assert len(set(vals)) <= steps * 11 + steps
    assert flex.bucket_length(16384, steps) == 16384 and flex.bucket_length(65536, steps) == 65536


def test_default_buckets():
    assert flex.DEFAULT_Q_BUCKET_STEPS == 2 and flex.DEFAULT_BUCKET_STEPS == 2
    # steps 1: powers of two x 128; steps 2: {2, 3} x 2**e x 128
    assert [flex.bucket_length(n, 1) for n in (100, 129, 5000, 8192, 8193, 20000)] == [
        128, 256, 8192, 8192, 16384, 32768]
    assert [flex.bucket_length(n, 2) for n in (100, 257, 5000, 15000, 16385, 40000)] == [
        128, 384, 6144, 16384, 24576, 49152]
    assert flex.padded_lengths(8000, 15000, 1, 2) == (8192, 16384)
    # packed 128K-token batches at CP=2 (ShareGPT): 0.61M-0.77M query rows, 62.9K-67.3K keys per rank
    assert {flex.padded_lengths(tq, tk)[0] for tq in (614080, 771168) for tk in (62918, 67294)} == {786432}


_TABLE_CASES = [
    (16, 40, 1000, "random"), (16, 64, 4000, "dflash"), (3, 50, 700, "random"), (16, 8, 128, "random"),
    (128, 5, 900, "random"), (16, 32, 5, "random"), (7, 30, 2000, "dflash"), (16, 24, 0, "random"),
]


# (no context keys at all exists only with the union: the kernel never runs on zero keys otherwise)
@pytest.mark.parametrize("B,n_blocks,num_keys,kind,union", [
    c + (u,) for c in _TABLE_CASES for u in (False, True) if c[2] > 0 or u])
def test_block_tables_match_brute_force(B, n_blocks, num_keys, kind, union):
    """Tables vs a brute-force tile classification of the dense mask; with `union` the own-block second
    intervals (region 2 starting on a tile boundary, as the ops build it): exact too."""
    gen = torch.Generator().manual_seed(n_blocks * 1000 + num_keys + B + 7 * union)
    for trial in range(3):
        if union:
            mask = union_intervals(gen, n_blocks, num_keys, B, kind)
        elif kind == "random":
            mask = IntervalMask(B, *random_intervals(gen, n_blocks, num_keys), num_keys)
        else:
            mask = IntervalMask(B, *dflash_like_intervals(gen, n_blocks, num_keys), num_keys)
        q_len = flex.bucket_length(n_blocks * B)
        kv_len = flex.bucket_length(mask.num_keys)
        lo_row, hi_row, lo2_row, hi2_row = flex._row_intervals(mask, q_len)
        assert (lo2_row is None) == (not union)
        dense = dense_rows(mask.lo, mask.hi, B, q_len, kv_len, mask.lo2, mask.hi2)
        part_bf, full_bf = brute_force_tiles(dense, flex.TILE)
        nq, nk = part_bf.shape
        kw = dict(lo2_row=lo2_row, hi2_row=hi2_row)
        kv_num1, kv_idx1, full_num1, full_idx1 = flex.interval_block_tables(lo_row, hi_row, q_len, kv_len, **kw)
        kv_num, kv_idx, full_num, full_idx = flex.interval_block_tables(lo_row, hi_row, q_len, kv_len,
                                                                        rows_per_block=B, **kw)
        for a, b in ((kv_num1, kv_num), (kv_idx1, kv_idx), (full_num1, full_num), (full_idx1, full_idx)):
            assert torch.equal(a, b)
        assert kv_num.shape == (1, 1, nq) and kv_idx.shape == (1, 1, nq, nk) and kv_idx.dtype == torch.int32
        assert tables_to_sets(kv_num, kv_idx) == [torch.nonzero(r).flatten().tolist() for r in part_bf]
        assert tables_to_sets(full_num, full_idx) == [torch.nonzero(r).flatten().tolist() for r in full_bf]
        # every row of kv_indices is a permutation of the key tiles (flex may read past kv_num)
        assert torch.equal(torch.sort(kv_idx[0, 0].long(), -1).values, torch.arange(nk).expand(nq, nk))
        # the BlockMask as a kernel sees it equals the dense interval mask
        bm = flex.build_block_mask(mask, q_len, kv_len)
        assert torch.equal(flex.block_mask_to_dense(bm, q_len, kv_len), dense)
        if union and B <= flex.TILE:
            # region 2 is block-diagonal: a query tile lists only key tiles its own blocks intersect
            c_tile = mask.num_ctx_keys // flex.TILE
            own_tiles = (part_bf | full_bf)[:, c_tile:].sum(1)
            assert int(own_tiles.max()) <= 2 * max(1, flex.TILE // B)


@pytest.mark.parametrize("B,n_blocks,num_ctx", [(16, 40, 1000), (4, 70, 300), (16, 16, 130)])
def test_union_tables_unaligned_region_still_correct(B, n_blocks, num_ctx):
    """Region 2 NOT on a tile boundary (not what the ops build): tiles covered only by the union are
    listed as partial instead of full, never wrongly; the dense visibility is exact."""
    gen = torch.Generator().manual_seed(B + n_blocks + num_ctx)
    for trial in range(3):
        mask = union_intervals(gen, n_blocks, num_ctx, B, "dflash", align=1, p_own=1.0)
        q_len, kv_len = flex.bucket_length(n_blocks * B), flex.bucket_length(mask.num_keys)
        lo_row, hi_row, lo2_row, hi2_row = flex._row_intervals(mask, q_len)
        dense = dense_rows(mask.lo, mask.hi, B, q_len, kv_len, mask.lo2, mask.hi2)
        part_bf, full_bf = brute_force_tiles(dense, flex.TILE)
        kv_num, kv_idx, full_num, full_idx = flex.interval_block_tables(
            lo_row, hi_row, q_len, kv_len, rows_per_block=B, lo2_row=lo2_row, hi2_row=hi2_row)
        part = tables_to_sets(kv_num, kv_idx)
        full = tables_to_sets(full_num, full_idx)
        for i in range(part_bf.shape[0]):
            need_bf = torch.nonzero(part_bf[i] | full_bf[i]).flatten().tolist()
            assert sorted(part[i] + full[i]) == need_bf
            assert set(full[i]) <= set(torch.nonzero(full_bf[i]).flatten().tolist())
        bm = flex.build_block_mask(mask, q_len, kv_len)
        assert torch.equal(flex.block_mask_to_dense(bm, q_len, kv_len), dense)


def _reference_parts(q, ks, vs, masks, scale):
    """float64 autograd reference of attention over the union of key parts (each with its own mask)."""
    qd = q.detach().double().requires_grad_()
    kds = [k.detach().double().requires_grad_() for k in ks]
    vds = [v.detach().double().requires_grad_() for v in vs]
    Hq = q.shape[1]
    scores, values = [], []
    for k, v, m in zip(kds, vds, masks):
        g = Hq // k.shape[1]
        dense = dense_rows(m.lo.cpu(), m.hi.cpu(), m.block_size, q.shape[0], k.shape[0]).to(q.device)
        s = torch.einsum("qhd,khd->hqk", qd, k.repeat_interleave(g, 1)) * scale
        scores.append(s.masked_fill(~dense[None], -math.inf))
        values.append(v.repeat_interleave(g, 1))
    s = torch.cat(scores, -1)
    v = torch.cat(values, 0)
    lse = torch.logsumexp(s, -1)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse_safe[..., None]), v)
    return qd, kds, vds, out, lse.transpose(0, 1)


def _rel(a, b):
    b = b.double()
    return ((a.to(b.device).double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_split_exactness(device, dtype, compile=None, seed=0, B=16, n_blocks=24, Hq=8, Hkv=2, D=32,
                          key_parts=(300, 500), ref_device="cpu"):
    """Forward per key part, lse merge, backward with GLOBAL lse/delta; compare with float64 autograd."""
    gen = torch.Generator().manual_seed(seed)
    kern = flex.FlexAttentionKernel(compile=compile)
    scale = D ** -0.5
    q = torch.randn(n_blocks * B, Hq, D, generator=gen).to(device, dtype)
    ks, vs, masks = [], [], []
    for i, tk in enumerate(key_parts):
        ks.append(torch.randn(tk, Hkv, D, generator=gen).to(device, dtype))
        vs.append(torch.randn(tk, Hkv, D, generator=gen).to(device, dtype))
        if i == 0:
            lo, hi = dflash_like_intervals(gen, n_blocks, tk)
        else:
            lo, hi = random_intervals(gen, n_blocks, tk, p_empty=0.3)
        lo[1], hi[1] = 0, 0  # a block that sees nothing in this part
        if i == 0:
            lo[2], hi[2] = 0, 0
        masks.append(IntervalMask(B, lo.to(device), hi.to(device), tk))
    for m in masks:
        m.lo[2], m.hi[2] = 0, 0  # block 2 sees nothing anywhere: global lse = -inf
    outs, lses, states = [], [], []
    for k, v, m in zip(ks, vs, masks):
        o, l, st = kern.forward(q, k, v, m, scale)
        assert o.dtype == torch.float32 and l.dtype == torch.float32
        assert o.shape == q.shape and l.shape == q.shape[:2]
        outs.append(o), lses.append(l), states.append(st)
    lse = torch.logsumexp(torch.stack(lses), 0)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = sum(torch.exp(l - safe)[..., None] * o for o, l in zip(outs, lses))
    rd = ref_device
    qd, kds, vds, out_ref, lse_ref = _reference_parts(q.to(rd), [k.to(rd) for k in ks], [v.to(rd) for v in vs],
                                                      [IntervalMask(m.block_size, m.lo.to(rd), m.hi.to(rd),
                                                                    m.num_keys) for m in masks], scale)
    dout = torch.randn(out_ref.shape, generator=gen, dtype=torch.float64).to(rd)
    out_ref.backward(dout)
    delta = (dout.to(device).float() * out).sum(-1)
    dq = 0
    dks, dvs = [], []
    for k, v, m, st in zip(ks, vs, masks, states):
        a, b, c = kern.backward(q, k, v, m, scale, dout.to(device, dtype), lse, delta, st)
        assert a.dtype == b.dtype == c.dtype == torch.float32
        dq = dq + a
        dks.append(b), dvs.append(c)
    res = {"out": _rel(out.to(rd), out_ref), "dq": _rel(dq.to(rd), qd.grad)}
    res["dk"] = _rel(torch.cat(dks).to(rd), torch.cat([k.grad for k in kds]))
    res["dv"] = _rel(torch.cat(dvs).to(rd), torch.cat([v.grad for v in vds]))
    fin = torch.isfinite(lse_ref)
    res["lse"] = (lse.to(rd).double()[fin] - lse_ref.detach()[fin]).abs().max().item()
    assert torch.equal(torch.isfinite(lse.to(rd)), fin)
    for t in [out, dq, *dks, *dvs]:
        assert torch.isfinite(t).all()
    assert (out[2 * B:3 * B] == 0).all() and (dq[2 * B:3 * B] == 0).all()
    return res


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_emulated_split_exactness(dtype, tol):
    res = check_split_exactness("cpu", dtype)
    for name, err in res.items():
        assert err < (tol * 10 if name == "lse" else tol), (name, err, res)


def test_cpu_recompute_path_matches_saved_graph():
    gen = torch.Generator().manual_seed(3)
    B, nb, Tk, H, D = 4, 10, 200, 2, 16
    q = torch.randn(nb * B, H, D, generator=gen)
    k = torch.randn(Tk, H, D, generator=gen)
    v = torch.randn(Tk, H, D, generator=gen)
    lo, hi = random_intervals(gen, nb, Tk)
    m = IntervalMask(B, lo, hi, Tk)
    dout = torch.randn(nb * B, H, D, generator=gen)
    results = []
    for save in (True, False):
        kern = flex.FlexAttentionKernel(save_graph=save)
        o, l, st = kern.forward(q, k, v, m, 0.25)
        assert (st is None) == (not save)
        delta = (dout * o).sum(-1)
        results.append(kern.backward(q, k, v, m, 0.25, dout, l, delta, st))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nb", [16, 13])  # 256 rows: already a bucket length (no copy); 208: padded
def test_backward_memory_paths_are_exact(monkeypatch, dtype, nb):
    """The memory-saving paths (issue 6) change no bit: a query length that already is a bucket length
    makes the graph leaf an alias of q (no padded copy); grad_out / grad_lse are computed in row chunks
    (any chunk size gives the same bits); the gradients are contiguous in the accumulation dtype."""
    gen = torch.Generator().manual_seed(21)
    B, Hq, Hkv, D, Tk = 16, 4, 2, 16, 300
    q, k, v = (torch.randn(n, h, D, generator=gen).to(dtype) for n, h in ((nb * B, Hq), (Tk, Hkv), (Tk, Hkv)))
    lo, hi = dflash_like_intervals(gen, nb, Tk)
    m = IntervalMask(B, lo, hi, Tk)
    dout = torch.randn(nb * B, Hq, D, generator=gen).to(dtype)
    res = []
    for chunk in (1 << 22, 3 * Hq * D, Hq * D):
        monkeypatch.setattr(flex_bwd_prep, "ROW_CHUNK_ELEMS", chunk)
        kern = flex.FlexAttentionKernel()
        o, l, st = kern.forward(q, k, v, m, 0.3)
        qp = st["leaves"][0]
        assert (qp.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()) == (nb * B == 256)
        lse_g = l - 0.5 * (torch.arange(nb * B) % 3 == 0)[:, None].float()  # some rows with c != 1
        lse_g[:B] = float("-inf")
        grads = kern.backward(q, k, v, m, 0.3, dout, lse_g, (dout.float() * o).sum(-1), st)
        for g_, like in zip(grads, (q, k, v)):
            assert g_.dtype == torch.float32 and g_.shape == like.shape and g_.is_contiguous()
        assert torch.isfinite(grads[0]).all() and (grads[0][:B] == 0).all()
        res.append((o, l) + tuple(grads))
    for other in res[1:]:
        for a, b in zip(res[0], other):
            assert torch.equal(a, b)


def _tangent_inputs(gen, Tq, Hq, D, dtype, device):
    """dO, a permuted O_r view (as flex's [1, Hq, T, D] output gives it), lse_r with -inf rows, a global
    lse >= lse_r with -inf rows of its own, delta."""
    dout = torch.randn(Tq, Hq, D, generator=gen).to(dtype).to(device)
    o_r = torch.randn(1, Hq, Tq + 5, D, generator=gen).to(dtype).to(device)[0, :, :Tq].permute(1, 0, 2)
    lse_r = torch.randn(Tq, Hq, generator=gen)
    lse_r[::7] = float("-inf")
    lse_g = lse_r.clone().nan_to_num(neginf=0.0) + torch.rand(Tq, Hq, generator=gen)
    lse_g[3::11] = float("-inf")
    delta = torch.randn(Tq, Hq, generator=gen)
    return dout, o_r, lse_r.to(device), lse_g.to(device), delta.to(device)


def test_grad_tangents_torch_matches_formula():
    """The torch tangents (any row chunk) equal grad_out = round(c * dO), grad_lse = rowsum(grad_out *
    O_r) - c * delta computed in float64 from the same inputs (c = exp(lse_r - lse), 0 where not finite)."""
    gen = torch.Generator().manual_seed(3)
    Tq, Hq, D = 50, 3, 16
    dout, o_r, lse_r, lse_g, delta = _tangent_inputs(gen, Tq, Hq, D, torch.bfloat16, "cpu")
    fin = torch.isfinite(lse_r) & torch.isfinite(lse_g)
    c = torch.where(fin, (lse_r.double() - lse_g.double()).nan_to_num(0.0).exp(), 0.0)
    ref_go = (dout.double() * c[..., None]).to(torch.bfloat16)
    ref_gl = torch.where(fin, (ref_go.double() * o_r.double()).sum(-1) - c * delta.double(), 0.0)
    for chunk in (None, Hq * D, 7 * Hq * D):
        g_out = torch.full((Tq + 4, Hq, D), 9.0, dtype=torch.bfloat16)
        g_lse = torch.full((Tq + 4, Hq), 9.0)
        flex_bwd_prep.grad_tangents_torch(dout, o_r, lse_r, lse_g, delta, g_out, g_lse, row_chunk_elems=chunk)
        assert (g_out[Tq:] == 9).all() and (g_lse[Tq:] == 9).all()  # only rows [0, Tq) written
        torch.testing.assert_close(g_out[:Tq].double(), ref_go.double(), rtol=8e-3, atol=1e-6)
        torch.testing.assert_close(g_lse[:Tq].double(), ref_gl, rtol=1e-5, atol=1e-5)
        assert (g_lse[:Tq][~fin] == 0).all() and (g_out[:Tq][~fin] == 0).all()


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [128, 64, 80])
def test_grad_tangents_triton_matches_torch(dtype, D):
    """The fused Triton tangents equal the torch ones: grad_out to one rounding of the input dtype (exp may
    differ in the last fp32 bit), and grad_lse equals rowsum(grad_out * O_r) - c * delta computed in
    float64 from the kernel's OWN grad_out; on a permuted O_r view, -inf rows and a D that is not a power
    of two."""
    assert flex_bwd_prep._triton_kernel() is not None
    gen = torch.Generator().manual_seed(4)
    Tq, Hq = 333, 5
    ins = _tangent_inputs(gen, Tq, Hq, D, dtype, "cuda")
    dout, o_r, lse_r, lse_g, delta = ins
    assert flex_bwd_prep.use_triton(dout, o_r)
    outs = []
    for fn in (flex_bwd_prep.grad_tangents_torch, flex_bwd_prep.grad_tangents_triton):
        g_out = torch.full((Tq + 3, Hq, D), 7.0, dtype=dtype, device="cuda")
        g_lse = torch.full((Tq + 3, Hq), 7.0, device="cuda")
        fn(*ins, g_out, g_lse)
        assert (g_out[Tq:] == 7).all() and (g_lse[Tq:] == 7).all()
        outs.append((g_out[:Tq], g_lse[:Tq]))
    eps = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(outs[1][0].float(), outs[0][0].float(), rtol=eps, atol=1e-6)
    fin = torch.isfinite(lse_r) & torch.isfinite(lse_g)
    c = torch.where(fin, (lse_r.double() - lse_g.double()).nan_to_num(0.0).exp(), 0.0)
    ref_gl = torch.where(fin, (outs[1][0].double() * o_r.double()).sum(-1) - c * delta.double(), 0.0)
    torch.testing.assert_close(outs[1][1].double(), ref_gl, rtol=1e-5, atol=1e-5)
    assert (outs[1][1][~fin] == 0).all() and (outs[1][0][~fin] == 0).all()


def test_shape_errors():
    kern = flex.FlexAttentionKernel()
    q = torch.randn(8, 4, 16)
    k = torch.randn(10, 3, 16)
    m = IntervalMask(4, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long), 10)
    with pytest.raises(ValueError):
        kern.forward(q, k, k, m, 1.0)
    with pytest.raises(ValueError):
        kern.forward(q, torch.randn(11, 2, 16), torch.randn(11, 2, 16), m, 1.0)


def _counting_compiled_flex(monkeypatch):
    """Route the kernel's compiled flex through dynamo with a counting aot_eager backend (CPU stand-in).

    Why not inductor: compiled flex on CPU (inductor) supports neither the lse output the kernel always
    requests nor backward in torch 2.11, and eager flex refuses requires_grad inputs on CPU. Recompiles
    are decided by dynamo's guards, which do not depend on the backend, so dynamo + AOTAutograd
    (aot_eager: the flex higher-order op runs its math fallback, backward included) with flex's CPU
    device check lifted sees exactly the guards of the GPU path: same flex call, BlockMask, mask_mod
    closure, scale, kernel_options, grad mode. Counts: dynamo graphs, forward and backward compiles.
    """
    dyn = pytest.importorskip("torch._dynamo")
    from torch._dynamo.backends.common import aot_autograd
    from torch.nn.attention import flex_attention as fa

    try:
        from functorch.compile import make_boxed_func
    except ImportError:  # pragma: no cover
        pytest.skip("functorch.compile.make_boxed_func unavailable")
    if not hasattr(fa, "_validate_device"):  # pragma: no cover
        pytest.skip("torch.nn.attention.flex_attention._validate_device not found (torch layout changed)")
    counts = {"graphs": 0, "fw": 0, "bw": 0}

    def fw(gm, example_inputs):
        counts["fw"] += 1
        return make_boxed_func(gm.forward)

    def bw(gm, example_inputs):
        counts["bw"] += 1
        return make_boxed_func(gm.forward)

    aot = aot_autograd(fw_compiler=fw, bw_compiler=bw)

    def backend(gm, example_inputs):
        counts["graphs"] += 1
        return aot(gm, example_inputs)

    flex.compiled_flex_attention()  # the real setup (recompile limits), then swap the backend
    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    monkeypatch.setattr(flex, "_COMPILED", torch.compile(flex.flex_attention, dynamic=False, backend=backend))
    monkeypatch.setattr(flex, "_COMPILED_KV_BUCKETS", {})
    dyn.reset()
    return counts


def test_cpu_compile_count_across_shapes(monkeypatch):
    """One compiled graph (one forward + one backward compile) per (Tq bucket, Tk bucket): varying query
    and key lengths inside a bucket, fresh IntervalMask / BlockMask / mask_mod closure every call, a new
    kernel object, an outer no_grad and recomputing backward add nothing; a new bucket adds exactly one."""
    counts = _counting_compiled_flex(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    B, Hq, Hkv, D, scale = 16, 4, 2, 16, 0.25
    kern = flex.FlexAttentionKernel(compile=True, kernel_options={"fwd_num_stages": 2}, q_bucket_steps=2,
                                    bucket_steps=2)

    def step(nb, tk, kernel=kern):
        q = torch.randn(nb * B, Hq, D, generator=gen)
        k = torch.randn(tk, Hkv, D, generator=gen)
        v = torch.randn(tk, Hkv, D, generator=gen)
        lo, hi = dflash_like_intervals(gen, nb, tk)
        m = IntervalMask(B, lo, hi, tk)
        o, l, st = kernel.forward(q, k, v, m, scale)
        dq, dk, dv = kernel.backward(q, k, v, m, scale, torch.randn_like(q), l, (o * o).sum(-1), st)
        assert torch.isfinite(dq).all() and dk.shape == k.shape
        return flex.padded_lengths(nb * B, tk, kernel.q_bucket_steps, kernel.bucket_steps)

    try:
        first = step(50, 1100)
    except (NotImplementedError, RuntimeError) as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"flex under dynamo/aot_eager on CPU failed in this torch build: {e!r}"[:300])
    assert first == (1024, 1536) and counts == {"graphs": 1, "fw": 1, "bw": 1}
    # six more shapes in the same (Tq, Tk) bucket: Tq 784..1024, Tk 1030..1536
    for nb, tk in ((64, 1536), (49, 1030), (55, 1400), (60, 1250), (52, 1500), (58, 1111)):
        assert step(nb, tk) == first
    assert counts == {"graphs": 1, "fw": 1, "bw": 1}, counts
    other = flex.FlexAttentionKernel(compile=True, kernel_options={"fwd_num_stages": 2}, q_bucket_steps=2,
                                     bucket_steps=2)
    assert step(57, 1300, other) == first
    with torch.no_grad():  # the kernel enables grad itself when it keeps the graph
        step(51, 1200)
    assert counts == {"graphs": 1, "fw": 1, "bw": 1}, counts
    # a new query bucket, then a new key bucket: one graph each
    assert step(70, 1200) == (1536, 1536)
    assert counts == {"graphs": 2, "fw": 2, "bw": 2}, counts
    assert step(50, 1600) == (1024, 2048)
    assert counts == {"graphs": 3, "fw": 3, "bw": 3}, counts
    for nb, tk in ((70, 1300), (60, 1700), (64, 2048)):  # back into buckets already compiled
        step(nb, tk)
    assert counts == {"graphs": 3, "fw": 3, "bw": 3}, counts
    # keys one bucket below a compiled one (1024 < 1536) run at the compiled bucket: no new graph
    assert step(55, 1000) == (1024, 1024)
    assert counts == {"graphs": 3, "fw": 3, "bw": 3}, counts
    # ... unless reuse is off
    step(55, 1000, flex.FlexAttentionKernel(compile=True, kernel_options={"fwd_num_stages": 2},
                                            q_bucket_steps=2, bucket_steps=2, reuse_larger_kv_bucket=False))
    assert counts == {"graphs": 4, "fw": 4, "bw": 4}, counts
    torch._dynamo.reset()


def test_cpu_compile_count_union_masks(monkeypatch):
    """Own-block union masks (what the ops pass with k_blk): one graph per (Tq bucket, Tk bucket) as well,
    the key length counting the own keys; fresh union masks of other lengths in the bucket add nothing."""
    counts = _counting_compiled_flex(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    B, Hq, Hkv, D, scale = 16, 4, 2, 16, 0.25
    kern = flex.FlexAttentionKernel(compile=True)

    def step(nb, tk):
        m = union_intervals(gen, nb, tk, B, "dflash")
        q = torch.randn(nb * B, Hq, D, generator=gen)
        k = torch.randn(m.num_keys, Hkv, D, generator=gen)
        v = torch.randn(m.num_keys, Hkv, D, generator=gen)
        o, l, st = kern.forward(q, k, v, m, scale)
        kern.backward(q, k, v, m, scale, torch.randn_like(q), l, (o * o).sum(-1), st)
        return flex.padded_lengths(nb * B, m.num_keys, kern.q_bucket_steps, kern.bucket_steps)

    try:
        first = step(50, 300)
    except (NotImplementedError, RuntimeError) as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"flex under dynamo/aot_eager on CPU failed in this torch build: {e!r}"[:300])
    assert first == (1024, 1536) and counts == {"graphs": 1, "fw": 1, "bw": 1}, (first, counts)
    for nb, tk in ((60, 400), (55, 200), (64, 100)):
        assert step(nb, tk) == first
    assert counts == {"graphs": 1, "fw": 1, "bw": 1}, counts
    torch._dynamo.reset()


def test_kv_bucket_reuse_is_exact():
    """Running at a larger key bucket (what `reuse_larger_kv_bucket` does) changes nothing but padding."""
    gen = torch.Generator().manual_seed(2)
    B, nb, Tk, H, D = 16, 12, 700, 2, 16
    q, k, v = (torch.randn(n, H, D, generator=gen) for n in (nb * B, Tk, Tk))
    lo, hi = random_intervals(gen, nb, Tk)
    m = IntervalMask(B, lo, hi, Tk)
    dout = torch.randn(nb * B, H, D, generator=gen)
    res = []
    for steps in (2, 1):  # keys padded to 768, then to 1024
        kern = flex.FlexAttentionKernel(bucket_steps=steps)
        o, l, st = kern.forward(q, k, v, m, 0.3)
        res.append((o, l) + tuple(kern.backward(q, k, v, m, 0.3, dout, l, (dout * o).sum(-1), st)))
    kern = flex.FlexAttentionKernel()
    assert flex.padded_lengths(nb * B, Tk, 2, 2) == (256, 768) and flex.padded_lengths(nb * B, Tk, 2, 1)[1] == 1024
    bm_big = kern.block_mask(m, 256, 1536)  # a larger key bucket: the tables list no tile past the keys
    assert torch.equal(flex.block_mask_to_dense(bm_big, 256, 1536), dense_rows(lo, hi, B, 256, 1536))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_cpu_compile_guards_scale_and_grad_mode(monkeypatch):
    """What does recompile inside one bucket: a different softmax scale (flex guards the float), and the
    no-grad forward of save_graph=False (a second graph; its backward recompute reuses the grad graph)."""
    counts = _counting_compiled_flex(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    B, H, D = 16, 2, 16
    q = torch.randn(20 * B, H, D, generator=gen)
    k = torch.randn(500, H, D, generator=gen)
    v = torch.randn(500, H, D, generator=gen)
    lo, hi = dflash_like_intervals(gen, 20, 500)
    m = IntervalMask(B, lo, hi, 500)
    kern = flex.FlexAttentionKernel(compile=True)
    try:
        o, l, st = kern.forward(q, k, v, m, 0.25)
    except (NotImplementedError, RuntimeError) as e:  # pragma: no cover
        pytest.skip(f"flex under dynamo/aot_eager on CPU failed in this torch build: {e!r}"[:300])
    kern.backward(q, k, v, m, 0.25, torch.randn_like(q), l, (o * o).sum(-1), st)
    assert counts == {"graphs": 1, "fw": 1, "bw": 1}
    kern.forward(q, k, v, m, 0.25)
    kern.forward(q, k, v, m, 0.3)
    assert counts["graphs"] == 2, counts
    nograd = flex.FlexAttentionKernel(compile=True, save_graph=False)
    o, l, st = nograd.forward(q, k, v, m, 0.25)
    assert counts["graphs"] == 3, counts
    nograd.backward(q, k, v, m, 0.25, torch.randn_like(q), l, (o * o).sum(-1), st)
    assert counts["graphs"] == 3, counts
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- GPU
@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_gpu_compiled_split_exactness(dtype, tol):
    res = check_split_exactness("cuda", dtype, compile=True, n_blocks=40, Hq=8, Hkv=2, D=64,
                                key_parts=(1000, 1700))
    for name, err in res.items():
        assert err < (tol * 10 if name == "lse" else tol), (name, err, res)


@cuda
def test_gpu_no_recompile_within_bucket():
    """Tq and Tk varying inside one (Tq bucket, Tk bucket), fresh masks: no new graph (fwd + bwd)."""
    import torch._dynamo.utils as du

    kern = flex.FlexAttentionKernel()
    gen = torch.Generator().manual_seed(5)
    B, H, D = 16, 4, 64

    def step(nb, tk):
        q = torch.randn(nb * B, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(tk, H, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(tk, H, D, device="cuda", dtype=torch.bfloat16)
        lo, hi = dflash_like_intervals(gen, nb, tk)
        m = IntervalMask(B, lo.cuda(), hi.cuda(), tk)
        o, l, st = kern.forward(q, k, v, m, 0.125)
        kern.backward(q, k, v, m, 0.125, torch.randn_like(q), l, (o * o).sum(-1), st)
        return flex.padded_lengths(nb * B, tk, kern.q_bucket_steps, kern.bucket_steps)

    first = step(50, 1100)  # (1024, 1536) with the default steps
    before = du.counters["stats"]["unique_graphs"]
    for nb, tk in ((64, 1030), (49, 1200), (55, 1536), (60, 1150), (52, 1400), (58, 1111)):
        assert step(nb, tk) == first
    assert du.counters["stats"]["unique_graphs"] == before
