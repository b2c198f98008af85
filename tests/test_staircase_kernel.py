"""The staircase kernel (kernels/staircase.py): dense rectangles (the CPU flash kernel here, cuDNN on the
GPU) + the remainder through the math kernel, merged by lse; backward with the GLOBAL lse/delta.

Checked on CPU against a dense float64 reference of the contract's formulas (kernels/base.py) on fresh
random DFlash interval masks (packed sequences sharing lo, empty intervals, lo == hi, GQA, own-block
second intervals, NaN/inf in keys nobody sees), for both backward rectangle sets, both GQA paths, groups
of size 1, everything in the remainder, everything dense, zero blocks / zero keys, rows whose O' is not
representable (zero dO with a delta), the plan's coverage and caching, and the three CP ops at CP 1-3
over gloo. Expected values never come from the kernel. Source: DESIGN.md section 2, docs/kernels.md.
"""

import math
import os
import zlib

import pytest
import torch

from _splitkv_helpers import prefix_intervals

from megatron_splitkv.kernels import get_kernel
from megatron_splitkv.kernels import staircase as sc
from megatron_splitkv.kernels.base import IntervalMask
from megatron_splitkv.kernels.staircase import StaircaseAttentionKernel, staircase_plan

#: every rectangle is worth a dense call: small test shapes still exercise the dense path
TINY = dict(group_blocks=2, min_group_blocks=1, key_grain=1, min_keys=1, min_pairs=1, sub_group_blocks=0)
#: two levels: groups of 4 blocks, their ragged parts cut again into sub-groups of 2 (rows in 2 rectangles)
HIER = dict(group_blocks=4, sub_group_blocks=2, min_group_blocks=1, key_grain=1, min_keys=1, min_pairs=1)


def seed_of(*xs):
    env = os.environ.get("SPLITKV_TEST_SEED")
    return (int(env) if env else 0) * 1000 + zlib.crc32(repr(xs).encode()) % 1000  # not hash(): per-process salt


def dflash_mask(gen, n_blocks, bsz, seq_lens, p_empty=0.2, own=True, align=8):
    """Packed DFlash-like mask: block b belongs to a random sequence s and sees a random prefix of its
    sorted local keys [start_s, start_s + n) (n = 0 for a fraction p_empty: anchor at 0, invalid block);
    own keys (second intervals) for a random subset, after the context padded to a multiple of `align`."""
    lo, hi, n_ctx = prefix_intervals(gen, n_blocks, seq_lens, p_empty)
    if not own:
        return IntervalMask(bsz, lo, hi, n_ctx)
    c0 = -(-n_ctx // align) * align
    owned = (torch.rand(n_blocks, generator=gen) < 0.6).nonzero().flatten().tolist()
    lo2 = torch.full((n_blocks,), c0, dtype=torch.long)
    for i, b in enumerate(owned):
        lo2[b] = c0 + i * bsz
    hi2 = lo2.clone()
    hi2[owned] += bsz
    return IntervalMask(bsz, lo, hi, c0 + len(owned) * bsz, lo2, hi2, num_ctx_keys=c0).validate()


def visibility(mask):
    """Dense [Tq, Tk] bool visibility of the mask (both intervals), on the mask's device."""
    dev = mask.lo.device
    rows = torch.arange(mask.num_blocks * mask.block_size, device=dev) // mask.block_size
    j = torch.arange(mask.num_keys, device=dev)[None]
    vis = (j >= mask.lo[rows][:, None]) & (j < mask.hi[rows][:, None])
    if mask.has_union:
        vis |= (j >= mask.lo2[rows][:, None]) & (j < mask.hi2[rows][:, None])
    return vis


def reference(q, k, v, mask, scale, dout, lse_g, delta_g):
    """float64 dense (out, lse) of the mask and the contract's backward with the GIVEN global stats (on
    q's device; tools/gpu_check.py runs it on the GPU)."""
    vis = visibility(mask).to(q.device)
    g = q.shape[1] // k.shape[1]
    q, k, v, dout = (x.double() for x in (q, k, v, dout))
    seen = vis.any(0)[:, None, None]
    k = torch.where(seen, k, 0).repeat_interleave(g, 1)
    v = torch.where(seen, v, 0).repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~vis[None], -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.where(vis[None], torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None]), 0)
    out = torch.einsum("hqk,khd->qhd", p, v)
    lg = lse_g.double().to(q.device).t()
    pg = torch.where(vis[None] & torch.isfinite(lg)[..., None],
                     torch.exp(s - torch.where(torch.isfinite(lg), lg, 0)[..., None]), 0)
    dv = torch.einsum("hqk,qhd->khd", pg, dout)
    ds = pg * (torch.einsum("qhd,khd->hqk", dout, v) - delta_g.double().to(q.device).t()[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, k) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
    hkv = dv.shape[1] // g
    fold = lambda x: x.view(x.shape[0], hkv, g, -1).sum(2)  # noqa: E731
    return out, lse.t(), dq, fold(dk), fold(dv)


def make_inputs(gen, mask, hq, hkv, d, dtype, poison=True):
    tq, tk = mask.num_blocks * mask.block_size, mask.num_keys
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v, dout = r(tq, hq, d), r(tk, hkv, d), r(tk, hkv, d), r(tq, hq, d)
    if poison and tk:  # keys nobody sees (padding, unowned own slots, beyond every prefix): never read
        unseen = ~visibility(mask).any(0)
        k[unseen], v[unseen] = float("inf"), float("nan")
    return q, k, v, dout


def global_stats(gen, lse_local, dout, out_local):
    """A global lse >= the local one (other ranks' keys add mass; some rows see keys only elsewhere) and
    a delta as the op forms it (rowsum(dO * O_final) minus an lse gradient)."""
    extra = torch.rand(lse_local.shape, generator=gen, dtype=torch.float64) * 2
    elsewhere = torch.rand(lse_local.shape, generator=gen) < 0.3
    lse_l = lse_local.double()
    lse_g = torch.where(torch.isfinite(lse_l), lse_l + extra, torch.where(elsewhere, extra, -math.inf))
    w = torch.exp(torch.where(torch.isfinite(lse_l), lse_l - lse_g, -math.inf)).nan_to_num()
    delta = (dout.double() * out_local.double()).sum(-1) * w
    return lse_g, delta + torch.randn(lse_local.shape, generator=gen, dtype=torch.float64) * 0.1


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_and_check(kern, mask, q, k, v, dout, scale, gen, tol, lse_g=None, delta=None):
    """Forward vs reference, then backward with global stats vs reference; returns the reference."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, lse, st = kern.forward(q, k, v, mask, scale)
    assert out.dtype == lse.dtype == acc and out.shape == q.shape[:2] + (v.shape[2],) and lse.shape == q.shape[:2]
    if lse_g is None:
        lse_g, delta = global_stats(gen, lse, dout, out)
    ref = reference(q, k, v, mask, scale, dout, lse_g, delta)
    fin = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), fin), "the -inf rows differ from the reference"
    assert (lse[~fin] == -math.inf).all() and (out[~fin.all(1)] == 0).all()
    assert torch.isfinite(out).all()
    assert rel(out, ref[0]) < tol
    assert not fin.any() or (lse[fin].double() - ref[1][fin]).abs().max() < tol * 10
    grads = kern.backward(q, k, v, mask, scale, dout, lse_g.to(acc), delta.to(acc), st)
    for name, g, want in zip(("dq", "dk", "dv"), grads, ref[2:]):
        assert g.dtype == acc and g.shape == want.shape, name
        assert torch.isfinite(g).all(), name
        assert rel(g, want) < tol, (name, rel(g, want))
    return ref, grads


CASES = [  # seed, Hq, Hkv, B, seq_lens, n_blocks
    (0, 4, 2, 4, [37, 5, 20], 14),
    (1, 4, 4, 2, [64], 12),
    (2, 6, 2, 3, [1, 9, 0, 50], 16),
    (3, 8, 2, 4, [17, 33], 10),
]


@pytest.mark.parametrize("seed,hq,hkv,bsz,seq_lens,n_blocks", CASES)
@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("bwd_mode", ["query", "key"])
@pytest.mark.parametrize("gqa", ["fold", "native"])
@pytest.mark.parametrize("levels", ["one", "two"])
def test_matches_float64_reference(seed, hq, hkv, bsz, seq_lens, n_blocks, own, bwd_mode, gqa, levels):
    gen = torch.Generator().manual_seed(seed_of(seed, own, bwd_mode, gqa, levels))
    mask = dflash_mask(gen, n_blocks, bsz, seq_lens, own=own)
    q, k, v, dout = make_inputs(gen, mask, hq, hkv, 8, torch.float64)
    kern = StaircaseAttentionKernel(bwd_mode=bwd_mode, gqa=gqa, **(TINY if levels == "one" else HIER))
    run_and_check(kern, mask, q, k, v, dout, 0.35, gen, 1e-10)
    plan = kern.plan(mask)
    assert kern.counts["dense_fwd"] == len(plan.groups) > 0  # the dense path ran (not all remainder)
    assert levels == "two" or max(plan.levels) == 0  # one level: no sub-group rectangles
    assert kern.counts["dense_bwd"] == len(plan.groups if bwd_mode == "query" else plan.key_major)
    assert kern.paths["bwd"] == bwd_mode and kern.paths["gqa"] == gqa and kern.paths["dense"] == "cpu-flash"


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("bwd_mode", ["query", "key"])
@pytest.mark.parametrize("gqa", ["fold", "native"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_two_levels_match_float64_reference(own, bwd_mode, gqa, dtype):
    """Rows in two rectangles (a group's [lo, m_g) and its sub-group's [m_g, m_s)) plus the remainder:
    forward merge of three partials and backward accumulation of two dense dQ contributions per row, on
    packed sequences (gathered, non-contiguous block sets) and on one sequence in block order (row slices)."""
    for case, (seq_lens, p_empty) in enumerate([([70, 9, 55], 0.1), ([120], 0.0)]):
        gen = torch.Generator().manual_seed(seed_of("two", own, bwd_mode, gqa, str(dtype), case))
        mask = dflash_mask(gen, 36, 2, seq_lens, p_empty=p_empty, own=own)
        if case == 1:  # blocks in hi order: contiguous ranges
            order = torch.argsort(mask.hi, stable=True)
            mask = IntervalMask(2, mask.lo[order], mask.hi[order], mask.num_keys, mask.lo2, mask.hi2,
                                num_ctx_keys=mask.num_ctx_keys)
        q, k, v, dout = make_inputs(gen, mask, 4, 2, 8, dtype)
        kern = StaircaseAttentionKernel(bwd_mode=bwd_mode, gqa=gqa, **dict(HIER, group_blocks=8))
        run_and_check(kern, mask, q, k, v, dout, 0.35, gen, 1e-10 if dtype == torch.float64 else 1e-5)
        plan = kern.plan(mask)
        assert plan.levels.count(1) >= 2 and plan.levels.count(0) >= 2
        assert (plan.block_range is not None) == (case == 1)
        assert kern.counts["dense_bwd"] == len(plan.groups if bwd_mode == "query" else plan.key_major)


@pytest.mark.parametrize("group_blocks,min_group,grain,min_keys", [(1, 1, 1, 1), (3, 1, 4, 1), (4, 2, 1, 9),
                                                                    (8, 8, 2, 1), (2, 1, 16, 16)])
def test_plan_covers_every_visible_pair_once(group_blocks, min_group, grain, min_keys):
    """Rectangles (query-major and key-major, separately) + the remainder mask = the mask, each visible
    (block, key) pair exactly once; rectangles lie inside what their blocks see; key counts multiples of
    the grain; the remainder keeps the own-block intervals."""
    gen = torch.Generator().manual_seed(seed_of("cover", group_blocks, grain))
    mask = dflash_mask(gen, 40, 2, [50, 30, 7, 64], p_empty=0.15)
    plan = staircase_plan(mask, group_blocks, min_group, grain, min_keys, 1)
    keys = torch.arange(mask.num_keys)
    want = ((keys >= mask.lo[:, None]) & (keys < mask.hi[:, None])).long()
    blocks = plan.blocks.tolist()
    for rects in (plan.groups, plan.key_major):
        cover = torch.zeros_like(want)
        for p0, p1, k0, k1 in rects:
            assert (k1 - k0) % grain == 0 and k1 > k0
            for b in blocks[p0:p1]:
                cover[b, k0:k1] += 1
        for p0, p1, k0, k1 in plan.groups:
            assert k1 - k0 >= min_keys
        rem = plan.rem
        if rem is not None:
            cover += ((keys >= rem.lo[:, None]) & (keys < rem.hi[:, None])).long()
            assert rem.lo2 is mask.lo2 and rem.num_ctx_keys == mask.num_ctx_keys
        assert torch.equal(cover, want)
    assert len(set(blocks)) == len(blocks)
    assert plan.pairs_dense == sum(2 * (k1 - k0) * (p1 - p0) for p0, p1, k0, k1 in plan.groups)
    assert 0 < plan.dense_fraction < 1


@pytest.mark.parametrize("group_blocks,sub,min_group,grain,min_keys", [(4, 2, 1, 1, 1), (8, 2, 1, 3, 1),
                                                                        (6, 3, 2, 1, 5), (8, 4, 4, 4, 8),
                                                                        (16, 4, 1, 2, 30)])
def test_two_level_plan_covers_every_visible_pair_once(group_blocks, sub, min_group, grain, min_keys):
    """Sub-group rectangles: for the query-major and the key-major sets (separately) + the remainder, every
    visible (block, key) pair is covered exactly once, checked pair by pair; a block's rectangles have
    disjoint key ranges inside what it sees; sub-rectangles lie within their level-1 group's blocks; key
    counts multiples of the grain and >= min_keys; counts and sums consistent."""
    gen = torch.Generator().manual_seed(seed_of("cover2", group_blocks, sub, grain))
    mask = dflash_mask(gen, 60, 2, [90, 41, 7, 120], p_empty=0.1)
    plan = staircase_plan(mask, group_blocks, min_group, grain, min_keys, 1, sub)
    keys = torch.arange(mask.num_keys)
    want = ((keys >= mask.lo[:, None]) & (keys < mask.hi[:, None])).long()
    blocks = plan.blocks.tolist()
    assert len(set(blocks)) == len(blocks) and len(plan.levels) == len(plan.groups)
    assert 1 in plan.levels  # the second level made rectangles
    for rects in (plan.groups, plan.key_major):
        cover = torch.zeros_like(want)
        for p0, p1, k0, k1 in rects:
            # query-major rectangles have >= min_keys keys; key-major chunks [m_{c-1}, m_c) are differences of
            # those ends (multiples of the grain, any width > 0)
            assert (k1 - k0) % grain == 0 and k1 > k0 and p1 > p0
            if rects is plan.groups:
                assert k1 - k0 >= min_keys
            for b in blocks[p0:p1]:
                cover[b, k0:k1] += 1
        rem = plan.rem
        cover += ((keys >= rem.lo[:, None]) & (keys < rem.hi[:, None])).long()
        assert torch.equal(cover, want), "a visible pair is covered 0 or 2+ times, or an invisible one covered"
    for (p0, p1, _, _), lv in zip(plan.groups, plan.levels):
        if lv == 1:
            assert p1 - p0 <= sub
        else:
            assert p1 - p0 <= group_blocks
    for rect, rng in plan.ranges.items():  # row slices only where the blocks really are a.. b-1
        if rng is not None:
            assert blocks[rect[0]:rect[1]] == list(range(*rng))
    assert plan.pairs_dense == sum(2 * (k1 - k0) * (p1 - p0) for p0, p1, k0, k1 in plan.groups)
    assert plan.qmajor_keys == sum(k1 - k0 for *_, k0, k1 in plan.groups)
    assert plan.kmajor_blocks == sum(p1 - p0 for p0, p1, *_ in plan.key_major)
    one = staircase_plan(mask, group_blocks, min_group, grain, min_keys, 1, 0)
    assert one.pairs_dense < plan.pairs_dense and set(one.levels) <= {0}  # the second level adds dense pairs


def test_two_level_policy_by_hand():
    """One run of 8 blocks, groups of 4 then sub-groups of 2: level-1 rectangles [0, m_g), then each
    group's ragged part cut at the sub-groups' smallest hi; a level-1 group too short for a call still gets
    its sub-rectangles from lo; the remainder starts where each block's last rectangle ends."""
    lo = torch.zeros(8, dtype=torch.long)
    hi = torch.tensor([3, 5, 8, 9, 40, 44, 50, 61])
    mask = IntervalMask(1, lo, hi, 64)
    p = staircase_plan(mask, 4, 1, 1, 1, 1, 2)
    got = [(p1 - p0, k0, k1, lv) for (p0, p1, k0, k1), lv in zip(p.groups, p.levels)]
    assert got == [(4, 0, 3, 0), (2, 3, 8, 1), (4, 0, 40, 0), (2, 40, 50, 1)]
    assert p.rem.lo.tolist() == [3, 3, 8, 8, 40, 40, 50, 50]
    assert p.key_major[:2] == [(0, 8, 0, 3), (4, 8, 3, 40)]
    p = staircase_plan(mask, 4, 1, 1, 4, 1, 2)  # min_keys 4: [0, 3) too short, its sub-groups start at lo
    got = [(p1 - p0, k0, k1, lv) for (p0, p1, k0, k1), lv in zip(p.groups, p.levels)]
    assert got == [(2, 0, 8, 1), (4, 0, 40, 0), (2, 40, 50, 1)]
    assert p.rem.lo.tolist() == [0, 0, 8, 8, 40, 40, 50, 50]
    assert p.key_major == [(2, 6, 0, 40), (0, 2, 0, 8), (4, 6, 40, 50)]


def test_grouping_policy_sizes_and_thresholds():
    """A run of 11 blocks with n = 4: the 3 smallest-prefix blocks are left over (-> n/2 = 2 and 1 with
    min_group 1; remainder with min_group 2), then two groups of 4 at the top; min_keys/min_pairs drop
    small rectangles to the remainder; another sequence's run is grouped on its own."""
    lo = torch.tensor([0] * 11 + [100] * 4)
    hi = torch.tensor([5, 9, 13, 20, 26, 31, 40, 41, 60, 70, 99, 110, 120, 130, 140])
    mask = IntervalMask(1, lo, hi, 140)
    p = staircase_plan(mask, 4, 1, 1, 1, 1)
    sizes = [p1 - p0 for p0, p1, _, _ in p.groups]
    assert sizes == [1, 2, 4, 4, 4] and p.rem is not None
    assert [g[3] for g in p.groups] == [5, 9, 20, 41, 110]
    assert p.block_range == (0, 15)
    p = staircase_plan(mask, 4, 2, 1, 1, 1)
    assert [p1 - p0 for p0, p1, _, _ in p.groups] == [2, 4, 4, 4]
    p = staircase_plan(mask, 4, 1, 8, 1, 1)  # grain 8: m rounded down to lo + a multiple of 8 (5 -> 0: dropped)
    assert [g[3] for g in p.groups] == [8, 16, 40, 108]
    p = staircase_plan(mask, 4, 1, 1, 25, 1)  # min_keys 25: only the group [0, 41) stays dense
    assert [(g[2], g[3]) for g in p.groups] == [(0, 41)] and p.block_range == (7, 11)
    assert p.rem.lo.tolist() == [0] * 7 + [41] * 4 + [100] * 4
    p = staircase_plan(mask, 4, 1, 1, 1, 4 * 40)  # min_pairs: only rectangles of >= 160 pairs
    assert [(p1 - p0) * (k1 - k0) for p0, p1, k0, k1 in p.groups] == [164]
    assert staircase_plan(mask, 4, 1, 1, 10 ** 6, 1).groups == []


def test_groups_of_one_block_and_single_run():
    gen = torch.Generator().manual_seed(seed_of("ones"))
    mask = dflash_mask(gen, 9, 3, [40], p_empty=0.0, own=True)
    q, k, v, dout = make_inputs(gen, mask, 4, 2, 8, torch.float64)
    kern = StaircaseAttentionKernel(group_blocks=1, min_group_blocks=1, key_grain=1, min_keys=1, min_pairs=1)
    run_and_check(kern, mask, q, k, v, dout, 0.4, gen, 1e-10)
    plan = kern.plan(mask)
    assert all(p1 - p0 == 1 for p0, p1, _, _ in plan.groups) and len(plan.groups) >= 8


def test_everything_in_the_remainder_is_the_inner_kernel():
    """No rectangle worth a dense call: the inner kernel serves the original mask (no merge, no dense
    call), results exact."""
    gen = torch.Generator().manual_seed(seed_of("rem"))
    mask = dflash_mask(gen, 10, 2, [30, 20])
    q, k, v, dout = make_inputs(gen, mask, 4, 2, 8, torch.float64)
    kern = StaircaseAttentionKernel(group_blocks=2, min_group_blocks=1, key_grain=1, min_keys=10 ** 6,
                                    min_pairs=1)
    run_and_check(kern, mask, q, k, v, dout, 0.3, gen, 1e-10)
    assert kern.counts == dict(dense_fwd=0, dense_bwd=0, inner_fwd=1, inner_bwd=1, fixup=0)


def test_inner_auto_is_resolved_with_the_head_dim(monkeypatch):
    """inner="auto" (the default) is a backend choice that depends on D ("math" below 16 on CUDA): the dtype
    check resolves it with the call's head dim, the same kernel the call runs (it used None)."""
    import megatron_splitkv.kernels as kernels_mod

    seen = []
    real = kernels_mod.get_kernel

    def recording(backend="auto", device=None, dtype=None, head_dim=None, keys_per_call=None, config=None):
        seen.append((backend, head_dim))
        return real(backend, device, dtype, head_dim=head_dim, keys_per_call=keys_per_call, config=config)

    monkeypatch.setattr(kernels_mod, "get_kernel", recording)
    kern = StaircaseAttentionKernel(inner="auto")
    kern.check_dtype(torch.float64, "cpu", head_dim=8)
    assert seen == [("auto", 8)]
    seen.clear()
    gen = torch.Generator().manual_seed(seed_of("inner-hd"))
    mask = dflash_mask(gen, 10, 2, [30, 20])
    q, k, v, dout = make_inputs(gen, mask, 4, 2, 8, torch.float64)
    run_and_check(kern, mask, q, k, v, dout, 0.3, gen, 1e-10)
    assert seen and all(call == ("auto", 8) for call in seen), seen


@pytest.mark.parametrize("bwd_mode", ["query", "key"])
def test_everything_dense_no_remainder(bwd_mode):
    """Blocks in pairs with equal ends (multiples of the grain), no own keys: the remainder is empty, no
    inner call; two sequences and an empty block."""
    lo = torch.tensor([0, 0, 0, 0, 24, 24, 0])
    hi = torch.tensor([8, 8, 16, 16, 40, 40, 0])
    mask = IntervalMask(3, lo, hi, 40)
    gen = torch.Generator().manual_seed(seed_of("dense", bwd_mode))
    q, k, v, dout = make_inputs(gen, mask, 4, 1, 8, torch.float64)
    kern = StaircaseAttentionKernel(group_blocks=2, min_group_blocks=2, key_grain=8, min_keys=1, min_pairs=1,
                                    bwd_mode=bwd_mode)
    run_and_check(kern, mask, q, k, v, dout, 0.3, gen, 1e-10)
    plan = kern.plan(mask)
    assert plan.rem is None and plan.dense_fraction == 1.0
    assert kern.counts["inner_fwd"] == kern.counts["inner_bwd"] == 0 and kern.counts["dense_fwd"] == 3


@pytest.mark.parametrize("nb,tk", [(0, 12), (3, 0), (0, 0)])
def test_zero_blocks_or_zero_keys(nb, tk):
    bsz, hq, hkv, d = 2, 4, 2, 8
    mask = IntervalMask(bsz, torch.zeros(nb, dtype=torch.long), torch.zeros(nb, dtype=torch.long), tk)
    q = torch.randn(nb * bsz, hq, d, dtype=torch.float64)
    k, v = torch.randn(tk, hkv, d, dtype=torch.float64), torch.randn(tk, hkv, d, dtype=torch.float64)
    kern = StaircaseAttentionKernel(**TINY)
    out, lse, st = kern.forward(q, k, v, mask, 0.5)
    assert out.shape == (nb * bsz, hq, d) and not out.any() and (lse == -math.inf).all()
    lse_z = torch.full((nb * bsz, hq), -math.inf, dtype=torch.float64)
    dq, dk, dv = kern.backward(q, k, v, mask, 0.5, torch.randn_like(q), lse_z, torch.zeros_like(lse_z), st)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not dq.any() and not dk.any() and not dv.any()


@pytest.mark.parametrize("gqa", ["fold", "native"])
def test_zero_dout_rows_with_a_delta_use_the_math_fixup(gqa):
    """Entries with dO = 0 but delta != 0 (a gradient through the returned lse only), and a tiny dO whose
    O' overflows float16 in a dense block: O' cannot carry delta, the kernel must fall back for exactly
    those entries (math fix-up) and stay exact."""
    gen = torch.Generator().manual_seed(seed_of("fixup", gqa))
    lo, hi = torch.zeros(6, dtype=torch.long), torch.tensor([14, 10, 24, 20, 31, 30])  # not in hi order
    mask = IntervalMask(2, lo, hi, 32)
    q, k, v, dout = make_inputs(gen, mask, 4, 2, 8, torch.float64)
    kern = StaircaseAttentionKernel(gqa=gqa, **TINY)
    out, lse, st = kern.forward(q, k, v, mask, 0.35)
    lse_g, delta = global_stats(gen, lse, dout, out)
    dout[5] = 0.0  # a row of block 2 (all heads) and one head of a row of block 4, both in rectangles
    dout[9, 1] = 0.0
    delta[5], delta[9, 1] = -0.7, 0.3
    ref = reference(q, k, v, mask, 0.35, dout, lse_g, delta)
    grads = kern.backward(q, k, v, mask, 0.35, dout, lse_g, delta, st)
    assert kern.counts["fixup"] == 1 and kern.plan(mask).block_range is None  # the gather/scatter path
    for g, want in zip(grads, ref[2:]):
        assert rel(g, want) < 1e-10
    # the flag itself: fp16 O' overflows for |dO| ~ 1e-6 with delta ~ 1
    from megatron_splitkv.kernels.dense import out_for_delta

    d16 = torch.full((2, 8), 1e-6).half()
    _, bad = out_for_delta(d16, torch.tensor([1.0, 0.0]), torch.float16)
    assert bad.tolist() == [True, False]


def test_float16_overflowing_o_prime_and_minus_inf_rows():
    """float16: a dense-block row with a tiny dO and a large delta (O' overflows float16: math fix-up) and a
    dense-block row whose GLOBAL lse is -inf with such a dO (P = 0: no contribution, and no 0 * inf = NaN
    from an overflowing O' in the dense pass)."""
    gen = torch.Generator().manual_seed(seed_of("fp16"))
    lo, hi = torch.zeros(6, dtype=torch.long), torch.tensor([10, 14, 20, 24, 30, 31])
    mask = IntervalMask(2, lo, hi, 32)
    q, k, v, dout = make_inputs(gen, mask, 4, 2, 8, torch.float16)
    kern = StaircaseAttentionKernel(**TINY)
    out, lse, st = kern.forward(q, k, v, mask, 0.35)
    lse_g, delta = global_stats(gen, lse, dout, out)
    dout[3] = 1e-6  # a row of block 1 (dense [0, 10)): O' = dO * delta / |dO|^2 ~ 1e5 overflows fp16
    delta[3] = 2.0
    dout[6], delta[6], lse_g[6] = 1e-6, 5.0, -math.inf  # block 3: the row sees nothing globally
    ref = reference(q, k, v, mask, 0.35, dout, lse_g, delta)
    grads = kern.backward(q, k, v, mask, 0.35, dout, lse_g.float(), delta.float(), st)
    assert kern.counts["fixup"] == 1
    for name, g, want in zip(("dq", "dk", "dv"), grads, ref[2:]):
        assert torch.isfinite(g).all(), name
        assert rel(g, want) < 5e-3, (name, rel(g, want))
    assert not grads[0][6].any()


def test_a_wrong_delta_is_detected():
    """Negative control: the comparison is sensitive to the delta the dense backward sees (a kernel that
    passed its local O instead of O' would be caught): with O' built from delta = 0 the error is large."""
    gen = torch.Generator().manual_seed(seed_of("neg"))
    mask = dflash_mask(gen, 12, 2, [40, 30], p_empty=0.0, own=False)
    q, k, v, dout = make_inputs(gen, mask, 4, 2, 8, torch.float64)
    kern = StaircaseAttentionKernel(**TINY)
    out, lse, st = kern.forward(q, k, v, mask, 0.3)
    lse_g, delta = global_stats(gen, lse, dout, out)
    ref = reference(q, k, v, mask, 0.3, dout, lse_g, delta)
    real = sc.out_for_delta
    try:
        sc.out_for_delta = lambda do, dl, dt: real(do, torch.zeros_like(dl), dt)
        bad = kern.backward(q, k, v, mask, 0.3, dout, lse_g, delta, st)
    finally:
        sc.out_for_delta = real
    assert rel(bad[0], ref[2]) > 1e-3 and rel(bad[1], ref[3]) > 1e-3
    good = kern.backward(q, k, v, mask, 0.3, dout, lse_g, delta, st)
    assert rel(good[0], ref[2]) < 1e-10


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_within_tolerance(dtype, tol):
    gen = torch.Generator().manual_seed(seed_of("lp", str(dtype)))
    mask = dflash_mask(gen, 16, 4, [64, 48])
    q, k, v, dout = make_inputs(gen, mask, 8, 2, 16, dtype)
    kern = StaircaseAttentionKernel(**TINY)
    run_and_check(kern, mask, q, k, v, dout, 0.25, gen, tol)
    assert kern.counts["dense_fwd"] > 0


def test_plan_is_cached_on_the_mask(monkeypatch):
    """One plan (one host sync) per IntervalMask object, reused by later calls (every layer of a step);
    a different policy gets its own entry."""
    calls = []
    real = sc.staircase_plan
    monkeypatch.setattr(sc, "staircase_plan", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(seed_of("cache"))
    mask = dflash_mask(gen, 8, 2, [30])
    q, k, v, dout = make_inputs(gen, mask, 2, 1, 8, torch.float64)
    kern = StaircaseAttentionKernel(**TINY)
    for _ in range(3):
        o, l, st = kern.forward(q, k, v, mask, 0.3)
        kern.backward(q, k, v, mask, 0.3, dout, l, (dout * o).sum(-1), st)
    assert len(calls) == 1 and len(mask._staircase_plans) == 1
    StaircaseAttentionKernel(**dict(TINY, group_blocks=3)).forward(q, k, v, mask, 0.3)
    assert len(calls) == 2 and len(mask._staircase_plans) == 2


def test_options_dtypes_and_registry():
    from megatron_splitkv.config import StaircaseOptions

    kern = StaircaseAttentionKernel(StaircaseOptions(group_blocks=48, bwd_mode="key"), key_grain=64)
    assert kern.group_blocks == 48 and kern.bwd_mode == "key" and kern.key_grain == 64
    assert kern.options()["group_blocks"] == 48
    with pytest.raises(ValueError, match="bwd_mode"):
        StaircaseAttentionKernel(bwd_mode="sideways")
    with pytest.raises(ValueError, match="group_blocks"):
        StaircaseAttentionKernel(group_blocks=0)
    kern = StaircaseAttentionKernel()
    for dt in (torch.float32, torch.float64):
        with pytest.raises(ValueError, match="staircase"):
            kern.check_dtype(dt, "cuda")
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        kern.check_dtype(dt, "cpu")
    with pytest.raises(ValueError, match="dtypes differ"):
        m = IntervalMask(1, torch.tensor([0]), torch.tensor([1]), 2)
        kern.forward(torch.randn(1, 1, 8), torch.randn(2, 1, 8).double(), torch.randn(2, 1, 8), m, 1.0)
    from megatron_splitkv.kernels import BACKENDS, _load

    assert "staircase" in BACKENDS and _load("staircase") is StaircaseAttentionKernel
    assert type(get_kernel("auto", "cpu", torch.float64)).__name__ == "MathAttentionKernel"  # never "auto"


# ------------------------------------------------------------------------------------------ the CP ops
def _op_worker(rank, world, cases, opts=None):
    """Run the ops with backend='staircase' (tiny thresholds: the dense path runs on these small shapes)
    on this gloo rank; returns the results and the kernel's call counts."""
    import torch.distributed as dist

    from megatron_splitkv import kernels
    import _splitkv_helpers as H

    kern = StaircaseAttentionKernel(**(opts or TINY))
    for dt in (torch.float64, torch.float32):
        kernels._CACHE[("staircase", "cpu", dt)] = kern
    res = [H.run_local(op, c, rank, dist.group.WORLD) for op, c in cases]
    return res, dict(kern.counts)


@pytest.mark.parametrize("P,levels", [(1, "one"), (2, "one"), (3, "one"), (2, "two"), (3, "two")])
def test_ops_with_staircase_kernel_match_reference(P, levels):
    """splitkv / allgather-kv / ring-kv with backend='staircase' equal the float64 reference in output,
    lse and all five gradients: packed sequences, uneven and empty shards, invalid blocks, anchors at 0,
    GQA, a gradient through lse, the per-step metadata path; the dense path ran."""
    from _dist import run_distributed
    import _splitkv_helpers as H

    seed = H.new_seed()
    blocks = {1: [9], 2: [6, 0], 3: [4, 2, 5]}[P]
    ctx = {1: "even", 2: [30, 10], 3: [0, 25, 15]}[P]
    cases = [(op, H.case(seed + i, P, blocks=blocks, ctx=ctx, backend="staircase", Hq=4, Hkv=2,
                         metadata=(i == 0)))
             for i, op in enumerate(("splitkv", "allgather_kv", "ring_kv"))]
    per_rank = run_distributed(_op_worker, P, cases, TINY if levels == "one" else HIER, timeout=300)
    for i, (op, c) in enumerate(cases):
        errs = H.errors(c, [per_rank[r][0][i] for r in range(P)])
        bad = {k: v for k, v in errs.items() if not v < H.TOL["float64"]}
        assert not bad, (op, P, c["seed"], bad)
    assert sum(per_rank[r][1]["dense_fwd"] for r in range(P)) > 0
    assert sum(per_rank[r][1]["dense_bwd"] for r in range(P)) > 0


# ------------------------------------------------------------------------------------------ GPU (cuDNN)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN attention)")


@gpu
@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("bwd_mode", ["query", "key"])
def test_gpu_staircase_matches_float64(own, bwd_mode):
    """cuDNN rectangles + flex remainder on the GPU, bf16, against the float64 reference with global
    stats (tools/gpu_check.py kernel runs the larger version with every option variant)."""
    gen = torch.Generator().manual_seed(seed_of("gpu", own, bwd_mode))
    mask = dflash_mask(gen, 64, 16, [3000, 700, 1300], p_empty=0.1, own=own, align=128)
    q, k, v, dout = make_inputs(gen, mask, 8, 2, 128, torch.bfloat16, poison=False)
    dev = torch.device("cuda")
    md = IntervalMask(16, mask.lo.to(dev), mask.hi.to(dev), mask.num_keys,
                      mask.lo2.to(dev) if own else None, mask.hi2.to(dev) if own else None,
                      num_ctx_keys=mask.num_ctx_keys)
    kern = StaircaseAttentionKernel(group_blocks=8, min_group_blocks=2, key_grain=128, min_keys=128, min_pairs=0,
                                    bwd_mode=bwd_mode)
    scale = 128 ** -0.5
    out, lse, st = kern.forward(q.to(dev), k.to(dev), v.to(dev), md, scale)
    lse_g, delta = global_stats(gen, lse.cpu(), dout, out.cpu())
    ref = reference(q, k, v, mask, scale, dout, lse_g, delta)
    assert torch.equal(torch.isfinite(lse.cpu()), torch.isfinite(ref[1]))
    assert rel(out.cpu(), ref[0]) < 1e-2
    grads = kern.backward(q.to(dev), k.to(dev), v.to(dev), md, scale, dout.to(dev), lse_g.float().to(dev),
                          delta.float().to(dev), st)
    for g, want in zip(grads, ref[2:]):
        assert torch.isfinite(g).all() and rel(g.cpu(), want) < 2e-2
    assert kern.counts["dense_fwd"] > 0 and kern.paths["dense"] == "cudnn" and kern.paths["bwd"] == bwd_mode
