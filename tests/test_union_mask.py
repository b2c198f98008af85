"""The union mask of the kernel contract (kernels/base.py): context intervals [lo, hi) UNION own-block
second intervals [lo2, hi2) (perf-notes item 1: the own block fused into the local kernel call).

The math kernel and the FlexAttention kernel (CPU: `dense_flex_emulation`, which reads the BlockMask's
tables) against a dense float64 reference of the contract's forward and backward formulas (global lse and
delta given from outside), with GQA, blocks that see only context / only their own keys / nothing, and
NaN/inf in every key that no query sees (padding between the regions, own keys of blocks without a
second interval, context keys outside every interval); `IntervalMask.validate` and the ops' helpers
`with_own_blocks` / `with_own_keys`. Source: DESIGN.md sections 1-2, arXiv 2611.05926.
"""

import math

import pytest
import torch

from _splitkv_helpers import with_random_own_slots

from megatron_splitkv.kernels import MathAttentionKernel
from megatron_splitkv.kernels.base import IntervalMask
from megatron_splitkv.ops.common import OWN_KEY_ALIGN, own_key_start, with_own_blocks, with_own_keys

flex = pytest.importorskip("megatron_splitkv.kernels.flex")


def make_union(gen, n_blocks, num_ctx, B, p_ctx=0.7, p_own=0.7, align=OWN_KEY_ALIGN):
    """Random context intervals (some empty) and own intervals in random disjoint slots."""
    lo = torch.randint(0, num_ctx + 1, (n_blocks,), generator=gen)
    hi = torch.minimum(lo + torch.randint(1, num_ctx + 2, (n_blocks,), generator=gen), torch.tensor(num_ctx))
    hi = torch.where(torch.rand(n_blocks, generator=gen) < p_ctx, hi, lo)
    return with_random_own_slots(gen, lo, hi, num_ctx, B, p_own, align)


def dense_vis(m: IntervalMask):
    rows = torch.arange(m.num_blocks * m.block_size) // m.block_size
    j = torch.arange(m.num_keys)[None]
    vis = (j >= m.lo[rows][:, None]) & (j < m.hi[rows][:, None])
    if m.has_union:
        vis |= (j >= m.lo2[rows][:, None]) & (j < m.hi2[rows][:, None])
    return vis


def dense_reference(q, k, v, vis, scale, dout, lse_g, delta_g):
    """float64 dense forward (out, lse) and the contract's backward with GIVEN global lse / delta."""
    g = q.shape[1] // k.shape[1]
    q, k, v, dout = (x.double() for x in (q, k, v, dout))
    seen = vis.any(0)[:, None, None]
    k = torch.where(seen, k, 0).repeat_interleave(g, 1)
    v = torch.where(seen, v, 0).repeat_interleave(g, 1)
    q = torch.where(vis.any(1)[:, None, None], q, 0)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~vis[None], -math.inf)
    lse = torch.logsumexp(s, -1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.where(vis[None], torch.exp(s - safe[..., None]), 0)
    out = torch.einsum("hqk,khd->qhd", p, v)
    lg = lse_g.double().t()
    pg = torch.where(vis[None] & torch.isfinite(lg)[..., None],
                     torch.exp(s - torch.where(torch.isfinite(lg), lg, 0)[..., None]), 0)
    dv = torch.einsum("hqk,qhd->khd", pg, dout)
    ds = pg * (torch.einsum("qhd,khd->hqk", dout, v) - delta_g.double().t()[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, k) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
    hkv = dv.shape[1] // g
    fold = lambda x: x.view(x.shape[0], hkv, g, -1).sum(2)  # noqa: E731
    return out, lse.t(), dq, fold(dk), fold(dv)


KERNELS = {
    "math": lambda: MathAttentionKernel(),
    "math-small-tiles": lambda: MathAttentionKernel(max_elements=3000),  # many groups, own-only groups
    "flex-emulation": lambda: flex.FlexAttentionKernel(compile=False),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("B,n_blocks,num_ctx,Hq,Hkv", [(4, 12, 50, 4, 2), (16, 9, 300, 6, 3), (3, 10, 0, 2, 1),
                                                      (8, 20, 128, 4, 4)])
def test_union_kernel_matches_dense_reference(kernel, dtype, tol, B, n_blocks, num_ctx, Hq, Hkv):
    gen = torch.Generator().manual_seed(B * 100 + n_blocks + num_ctx)
    kern = KERNELS[kernel]()
    D, scale = 8, 0.37
    m = make_union(gen, n_blocks, num_ctx, B)
    m.lo[0], m.hi[0], m.lo2[0], m.hi2[0] = 0, 0, m.num_ctx_keys, m.num_ctx_keys  # block 0 sees nothing
    if num_ctx:
        m.lo[1], m.hi[1] = 0, 0  # block 1: own block only
    vis = dense_vis(m)
    assert vis[:B].sum() == 0 and (m.num_ctx_keys == 0 or vis[B:2 * B, : m.num_ctx_keys].sum() == 0)
    tq, tk = n_blocks * B, m.num_keys
    q = torch.randn(tq, Hq, D, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(tk, Hkv, D, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(tk, Hkv, D, generator=gen, dtype=torch.float64).to(dtype)
    unseen = ~vis.any(0)
    k[unseen], v[unseen] = float("inf"), float("nan")  # padding, unowned own keys, unseen context keys
    dout = torch.randn(tq, Hq, D, generator=gen, dtype=torch.float64).to(dtype)
    out, lse, st = kern.forward(q, k, v, m, scale)
    # global statistics as from a merge with another rank: lse larger than the local one, random delta
    lse_g = torch.logaddexp(lse.double(), torch.randn(tq, Hq, generator=gen, dtype=torch.float64))
    lse_g[:B] = -math.inf
    delta_g = torch.randn(tq, Hq, generator=gen, dtype=torch.float64)
    ref = dense_reference(q, k, v, vis, scale, dout, lse_g, delta_g)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    got = (out, lse) + tuple(kern.backward(q, k, v, m, scale, dout, lse_g.to(acc), delta_g.to(acc), st))
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert a.dtype == acc, (name, a.dtype)
        if name == "lse":
            fin = torch.isfinite(r)
            assert torch.equal(torch.isfinite(a), fin)
            a, r = a[fin], r[fin]
        else:
            assert torch.isfinite(a).all(), name
        err = ((a.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
        assert err < tol, (kernel, name, err)
    assert (out[:B] == 0).all() and (got[2][:B] == 0).all()
    assert (got[3][unseen] == 0).all() and (got[4][unseen] == 0).all()


def test_validate_rejects_contract_violations():
    lo, hi = torch.tensor([0, 2]), torch.tensor([3, 5])

    def mk(lo2, hi2, c0=128, nk=136, lo_=lo, hi_=hi):
        return IntervalMask(4, lo_, hi_, nk, torch.tensor(lo2), torch.tensor(hi2), num_ctx_keys=c0)

    assert mk([128, 132], [132, 136]).validate().has_union
    assert mk([128, 128], [128, 132]).validate().has_union  # an empty second interval anywhere is fine
    assert not IntervalMask(4, lo, hi, 5).has_union and IntervalMask(4, lo, hi, 5).num_ctx_keys == 5
    with pytest.raises(ValueError, match="length 0 or block_size=4"):
        mk([128, 132], [131, 136]).validate()
    with pytest.raises(ValueError, match="pairwise disjoint"):
        mk([128, 130], [132, 134]).validate()
    with pytest.raises(ValueError, match=r"lie in \[num_ctx_keys, num_keys\)"):
        mk([124, 132], [128, 136]).validate()
    with pytest.raises(ValueError, match=r"lie in \[num_ctx_keys, num_keys\)"):
        mk([128, 136], [132, 140]).validate()
    with pytest.raises(ValueError, match=r"first intervals must lie in \[0, num_ctx_keys\)"):
        mk([128, 132], [132, 136], c0=4, hi_=torch.tensor([3, 5])).validate()
    with pytest.raises(ValueError, match="both be tensors or both be None"):
        IntervalMask(4, lo, hi, 10, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="num_ctx_keys"):
        IntervalMask(4, lo, hi, 10, num_ctx_keys=11)
    with pytest.raises(ValueError, match="int64"):
        mk([128, 132], [132, 136]).__class__(4, lo, hi, 136, torch.tensor([128, 132], dtype=torch.int32),
                                             torch.tensor([132, 136], dtype=torch.int32), 128).validate()


def test_with_own_blocks_and_keys_layout():
    """The ops' layout: [context ; zero padding to a multiple of 128 ; own keys, invalid rows zeroed]."""
    B, tk = 4, 130
    base = IntervalMask(B, torch.tensor([0, 5, 0, 9, 0]), torch.tensor([10, 20, 0, 130, 0]), tk)
    valid = torch.tensor([True, False, True])
    m = with_own_blocks(base, valid, num_own_blocks=4, first_block=2, first_key_block=1)
    c0 = own_key_start(tk)
    assert c0 == 256 and own_key_start(0) == 0 and own_key_start(128) == 128
    assert m.num_ctx_keys == c0 and m.num_keys == c0 + 4 * B and m.lo is base.lo
    assert m.lo2.tolist() == [c0, c0, c0 + B, c0, c0 + 3 * B]
    assert (m.hi2 - m.lo2).tolist() == [0, 0, B, 0, B]
    src = torch.randn(tk, 2, 3)
    order = torch.randperm(tk)
    k_blk = torch.randn(4 * B, 2, 3)
    k_blk[B:2 * B] = float("nan")
    valid_rows = torch.tensor([True, False, True, True]).repeat_interleave(B)
    x = with_own_keys(src, order, k_blk, valid_rows)
    assert x.shape == (c0 + 4 * B, 2, 3)
    assert torch.equal(x[:tk], src[order]) and (x[tk:c0] == 0).all()
    assert torch.equal(x[c0:c0 + B], k_blk[:B]) and (x[c0 + B:c0 + 2 * B] == 0).all()
    assert torch.equal(x[c0 + 2 * B:], k_blk[2 * B:])
    assert with_own_keys(src, None, None, valid_rows) is src  # contiguous, no own block: no copy
    assert torch.equal(with_own_keys(src, order, None, valid_rows), src[order])
