"""FlexAttention local kernel (`megatron_splitkv.kernels.flex`): CPU part always, GPU part with CUDA.

CPU: BlockMask construction from intervals against a brute-force tile classification of the dense mask;
the kernel's algebra (padding, -inf rows, global-lse backward over a key split) through the plain-torch
flex emulation, which reads the same block tables. GPU (skipped without CUDA): compiled flex, bf16,
exactness against float64, and no recompilation across key lengths within a bucket.
"""

import math

import pytest
import torch

from megatron_splitkv.kernels.base import IntervalMask

flex = pytest.importorskip("megatron_splitkv.kernels.flex")
if flex.BlockMask is None:  # pragma: no cover
    pytest.skip("torch without FlexAttention", allow_module_level=True)

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


def dense_rows(lo, hi, B, q_len, kv_len):
    rows = torch.arange(q_len)
    blk = rows // B
    valid = blk < lo.shape[0]
    blk = blk.clamp(max=lo.shape[0] - 1)
    j = torch.arange(kv_len)
    m = (j[None] >= lo[blk][:, None]) & (j[None] < hi[blk][:, None])
    return m & valid[:, None]


def brute_force_tiles(dense, tile):
    q_len, kv_len = dense.shape
    t = dense.reshape(q_len // tile, tile, kv_len // tile, tile)
    needed = t.any(dim=(1, 3))
    full = t.all(dim=(1, 3))
    return needed & ~full, full


def tables_to_sets(num, idx):
    num, idx = num[0, 0], idx[0, 0]
    return [sorted(idx[i, : int(num[i])].tolist()) for i in range(num.shape[0])]


def test_bucket_length_properties():
    seen = set()
    for n in list(range(1, 3000, 7)) + [16384, 16385, 65536, 70000, 131072]:
        b = flex.bucket_length(n)
        assert b >= n and b % flex.TILE == 0
        assert b <= max(flex.TILE * flex.DEFAULT_BUCKET_STEPS, 1.25 * n + flex.TILE)
        seen.add(b)
    # monotone and few distinct shapes
    vals = [flex.bucket_length(n) for n in range(1, 200_000, 97)]
    assert vals == sorted(vals)
    assert len(set(vals)) <= 4 * 12 + 4
    assert flex.bucket_length(16384) == 16384 and flex.bucket_length(65536) == 65536


@pytest.mark.parametrize("B,n_blocks,num_keys,kind", [
    (16, 40, 1000, "random"), (16, 64, 4000, "dflash"), (3, 50, 700, "random"), (16, 8, 128, "random"),
    (128, 5, 900, "random"), (16, 32, 5, "random"), (7, 30, 2000, "dflash"),
])
def test_block_tables_match_brute_force(B, n_blocks, num_keys, kind):
    gen = torch.Generator().manual_seed(n_blocks * 1000 + num_keys + B)
    for trial in range(3):
        if kind == "random":
            lo, hi = random_intervals(gen, n_blocks, num_keys)
        else:
            lo, hi = dflash_like_intervals(gen, n_blocks, num_keys)
        mask = IntervalMask(B, lo, hi, num_keys)
        q_len = flex.bucket_length(n_blocks * B)
        kv_len = flex.bucket_length(num_keys)
        lo_row, hi_row = flex._row_intervals(mask, q_len)
        dense = dense_rows(lo, hi, B, q_len, kv_len)
        part_bf, full_bf = brute_force_tiles(dense, flex.TILE)
        nq, nk = part_bf.shape
        kv_num1, kv_idx1, full_num1, full_idx1 = flex.interval_block_tables(lo_row, hi_row, q_len, kv_len)
        kv_num, kv_idx, full_num, full_idx = flex.interval_block_tables(lo_row, hi_row, q_len, kv_len,
                                                                        rows_per_block=B)
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


def test_shape_errors():
    kern = flex.FlexAttentionKernel()
    q = torch.randn(8, 4, 16)
    k = torch.randn(10, 3, 16)
    m = IntervalMask(4, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long), 10)
    with pytest.raises(ValueError):
        kern.forward(q, k, k, m, 1.0)
    with pytest.raises(ValueError):
        kern.forward(q, torch.randn(11, 2, 16), torch.randn(11, 2, 16), m, 1.0)


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
    import torch._dynamo.utils as du

    kern = flex.FlexAttentionKernel()
    gen = torch.Generator().manual_seed(5)
    B, nb, H, D = 16, 16, 4, 64

    def step(tk):
        q = torch.randn(nb * B, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(tk, H, D, device="cuda", dtype=torch.bfloat16)
        lo, hi = dflash_like_intervals(gen, nb, tk)
        m = IntervalMask(B, lo.cuda(), hi.cuda(), tk)
        o, l, st = kern.forward(q, k, k, m, 0.125)
        kern.backward(q, k, k, m, 0.125, torch.randn_like(q), l, (o * o).sum(-1), st)

    step(1100)  # bucket 1280
    before = du.counters["stats"]["unique_graphs"]
    for tk in (1030, 1200, 1280, 1150):
        step(tk)
    assert du.counters["stats"]["unique_graphs"] == before
