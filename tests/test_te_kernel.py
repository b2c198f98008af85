"""The Transformer Engine kernel's exact decomposition (kernels/te.py), checked on CPU through an emulator
of TE's thd fused attention that reproduces its overwrite semantics (tests/te_emulator.py), against a dense
float64 reference on fresh random DFlash interval masks (context prefixes per sequence, empty and invalid
blocks, GQA, own-block second intervals); through the three ops (gloo ranks): exact, its dtype limits and a
missing TE raised on every rank before any data collective, Split-KV's chunked merge with many packed sequences,
shared anchors, anchors beyond every end, B = 1 and 129, all blocks invalid. The real TE runs in
tests/test_gpu_kernels.py on the GPU."""

import math

import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import case, check, errors_of_every_op, job_results, new_seed, prefix_intervals, run_local
from megatron_splitkv.kernels.base import IntervalMask
from megatron_splitkv.kernels.te import TEAttentionKernel, te_plan
from te_emulator import EmulatedFusedAttn


def random_mask(gen, n_blocks, block_size, seq_lens, p_empty=0.2, own=True):
    """DFlash-like mask: sorted context keys of len(seq_lens) sequences; every block a prefix of one
    sequence (some empty); own blocks (second intervals) appended after the context for a random subset."""
    lo, hi, n_ctx = prefix_intervals(gen, n_blocks, seq_lens, p_empty)
    mask = IntervalMask(block_size, lo, hi, n_ctx)
    if own:
        owned = [b for b in range(n_blocks) if float(torch.rand((), generator=gen)) < 0.6]
        lo2 = torch.full((n_blocks,), n_ctx, dtype=torch.long)
        for i, b in enumerate(owned):
            lo2[b] = n_ctx + i * block_size
        hi2 = lo2.clone()
        hi2[owned] += block_size
        mask.lo2, mask.hi2 = lo2, hi2
        mask.num_keys = n_ctx + len(owned) * block_size
    return mask


def dense_visibility(mask):
    nb, bsz = mask.num_blocks, mask.block_size
    keys = torch.arange(mask.num_keys)
    vis = (keys >= mask.lo[:, None]) & (keys < mask.hi[:, None])
    if getattr(mask, "lo2", None) is not None:
        vis |= (keys >= mask.lo2[:, None]) & (keys < mask.hi2[:, None])
    return vis.repeat_interleave(bsz, 0)  # [Tq, Tk]


def reference(q, k, v, mask, scale, dout, lse_g, delta_g):
    """float64 dense forward (out, lse) and backward with the given global lse/delta."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    vis = dense_visibility(mask)[:, None, :]  # [Tq, 1, Tk]
    s = torch.einsum("ihd,jhd->ihj", q, kk) * scale
    s = torch.where(vis, s, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]))
    out = torch.einsum("ihj,jhd->ihd", p, vv)
    lg = lse_g.double()
    pg = torch.where(vis & torch.isfinite(lg)[..., None], torch.exp(s - lg[..., None]), 0.0)
    ds = pg * (torch.einsum("ihd,jhd->ihj", dout, vv) - delta_g.double()[..., None])
    dq = torch.einsum("ihj,jhd->ihd", ds, kk) * scale
    dk = (torch.einsum("ihj,ihd->jhd", ds, q) * scale).view(k.shape[0], k.shape[1], g, -1).sum(2)
    dv = torch.einsum("ihj,ihd->jhd", pg, dout).view(k.shape[0], k.shape[1], g, -1).sum(2)
    return out, lse, dq, dk, dv


def inputs(gen, mask, hq, hkv, d, dtype):
    tq, tk = mask.num_blocks * mask.block_size, mask.num_keys
    q = torch.randn(tq, hq, d, generator=gen).to(dtype)
    k = torch.randn(tk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(tk, hkv, d, generator=gen).to(dtype)
    dout = torch.randn(tq, hq, d, generator=gen).to(dtype)
    return q, k, v, dout


def global_stats(gen, lse_local, dout, out_local):
    """A global lse >= the local one (other ranks' keys add mass) and a delta as the ops form it."""
    extra = torch.rand(lse_local.shape, generator=gen, dtype=torch.float64) * 2
    has_other = torch.rand(lse_local.shape, generator=gen) < 0.3  # rows seeing keys only elsewhere
    lse_g = torch.where(torch.isfinite(lse_local), lse_local + extra,
                        torch.where(has_other, extra, float("-inf")))
    delta = (dout.double() * out_local.double()).sum(-1) * torch.exp(
        torch.where(torch.isfinite(lse_local), lse_local - lse_g, float("-inf"))).nan_to_num()
    return lse_g, delta + torch.randn(lse_local.shape, generator=gen, dtype=torch.float64) * 0.1


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("seed,hq,hkv,bsz,seq_lens", [
    (0, 4, 2, 4, [37, 5, 20]),
    (1, 4, 4, 2, [64]),
    (2, 6, 2, 3, [1, 9, 0, 50]),
    (3, 8, 2, 4, [17, 33]),
])
def test_te_decomposition_matches_float64_reference(seed, hq, hkv, bsz, seq_lens):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, 9, bsz, seq_lens)
    q, k, v, dout = inputs(gen, mask, hq, hkv, 8, torch.float64)
    scale = 1 / math.sqrt(8)
    kern = TEAttentionKernel(EmulatedFusedAttn())
    out, lse, state = kern.forward(q, k, v, mask, scale)
    lse_g, delta = global_stats(gen, lse, dout, out)
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, mask, scale, dout, lse_g, delta)
    assert out.dtype == lse.dtype == torch.float64
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    fin = torch.isfinite(r_lse)
    assert torch.allclose(lse[fin], r_lse[fin], atol=1e-10)
    assert torch.allclose(out, r_out, atol=1e-10)
    assert not torch.isnan(out).any()
    dq, dk, dv = kern.backward(q, k, v, mask, scale, dout, lse_g, delta, state)
    for got, want in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert torch.allclose(got, want, atol=1e-9), rel(got, want)
    plan = kern.plan(mask, hq // hkv)
    kinds = [c[0] for c in kern.te.calls]
    n_calls = len(plan.qmaj) + (plan.own is not None)
    assert kinds.count("fwd") == n_calls and kinds.count("bwd") == n_calls + 1  # + key-major dK/dV


def test_emulator_overwrites_like_te():
    """The emulator must reproduce the TE fault the decomposition avoids: one query-major backward over
    segments sharing key prefixes gives wrong dK (so the test above could fail)."""
    gen = torch.Generator().manual_seed(5)
    mask = IntervalMask(2, torch.zeros(8, dtype=torch.long), torch.tensor([3, 7, 12, 20, 21, 30, 33, 40]), 40)
    q, k, v, dout = inputs(gen, mask, 2, 2, 8, torch.float64)
    kern = TEAttentionKernel(EmulatedFusedAttn())
    out, lse, state = kern.forward(q, k, v, mask, 0.3)
    plan = te_plan(mask, 1, pair_blocks=False)
    assert torch.equal(plan.perm, torch.arange(8)) and len(plan.qmaj) == 1
    seg = plan.qmaj[0][0]
    o = out.to(q.dtype)
    _, dk_naive, _ = kern.te.bwd(seg.max_q, seg.max_kv, seg.cu_q, seg.cu_kv, q, k, v, o, dout, q.dtype,
                                 [lse[..., None], state], None, cu_seqlens_q_padded=seg.off_q,
                                 cu_seqlens_kv_padded=seg.off_kv, attn_scale=0.3, qkv_layout="thd_thd_thd",
                                 o_format="thd", do_format="thd", dqkv_layout="thd_thd_thd",
                                 attn_mask_type="padding")
    delta = (dout * out).sum(-1)
    _, _, _, r_dk, _ = reference(q, k, v, mask, 0.3, dout, lse, delta)
    assert rel(dk_naive, r_dk) > 0.05
    _, dk, _ = kern.backward(q, k, v, mask, 0.3, dout, lse, delta, state)
    assert rel(dk, r_dk) < 1e-10


@pytest.mark.parametrize("pair_blocks", [False, True])
def test_unpaired_and_paired_plans_agree(pair_blocks):
    gen = torch.Generator().manual_seed(9)
    mask = random_mask(gen, 11, 2, [40, 13])
    q, k, v, dout = inputs(gen, mask, 4, 2, 8, torch.float64)
    kern = TEAttentionKernel(EmulatedFusedAttn())
    mask.__dict__["_te_plans"] = {2: te_plan(mask, 2, pair_blocks=pair_blocks)}
    out, lse, state = kern.forward(q, k, v, mask, 0.4)
    lse_g, delta = global_stats(gen, lse, dout, out)
    r = reference(q, k, v, mask, 0.4, dout, lse_g, delta)
    assert torch.allclose(out, r[0], atol=1e-10)
    for got, want in zip(kern.backward(q, k, v, mask, 0.4, dout, lse_g, delta, state), r[2:]):
        assert torch.allclose(got, want, atol=1e-9)


def test_te_kernel_bf16_within_tolerance():
    gen = torch.Generator().manual_seed(7)
    mask = random_mask(gen, 12, 4, [64, 48])
    q, k, v, dout = inputs(gen, mask, 8, 2, 16, torch.bfloat16)
    kern = TEAttentionKernel(EmulatedFusedAttn())
    out, lse, state = kern.forward(q, k, v, mask, 0.25)
    assert out.dtype == lse.dtype == torch.float32
    lse_g, delta = global_stats(gen, lse, dout, out)
    r = reference(q, k, v, mask, 0.25, dout, lse_g, delta)
    assert rel(out, r[0]) < 1e-2
    for got, want in zip(kern.backward(q, k, v, mask, 0.25, dout, lse_g.float(), delta.float(), state), r[2:]):
        assert rel(got, want) < 2e-2


def test_zero_dout_with_lse_gradient_falls_back_exactly():
    """delta != 0 on a row with dO = 0 (a gradient through the returned lse only) cannot be passed to TE
    as rowsum(dO * O'): the kernel must fall back (math backward) and stay exact."""
    gen = torch.Generator().manual_seed(11)
    mask = random_mask(gen, 6, 2, [30], p_empty=0.0)
    q, k, v, dout = inputs(gen, mask, 4, 2, 8, torch.float64)
    kern = TEAttentionKernel(EmulatedFusedAttn())
    out, lse, state = kern.forward(q, k, v, mask, 0.35)
    dout[3] = 0.0
    delta = (dout * out).sum(-1)
    delta[3] = -0.7  # - dlse
    r = reference(q, k, v, mask, 0.35, dout, lse, delta)
    n_calls = len(kern.te.calls)
    got = kern.backward(q, k, v, mask, 0.35, dout, lse, delta, state)
    assert len(kern.te.calls) == n_calls  # no TE backward ran: the math fallback did
    for g_, w in zip(got, r[2:]):
        assert torch.allclose(g_, w, atol=1e-10)


def test_all_blocks_empty_and_rows_without_keys():
    mask = IntervalMask(2, torch.tensor([0, 3]), torch.tensor([0, 3]), 5)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = inputs(gen, mask, 2, 1, 4, torch.float64)
    kern = TEAttentionKernel(EmulatedFusedAttn())
    out, lse, state = kern.forward(q, k, v, mask, 0.5)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()
    dq, dk, dv = kern.backward(q, k, v, mask, 0.5, dout, lse, torch.zeros_like(lse), state)
    assert not dq.any() and not dk.any() and not dv.any()
    assert kern.te.calls == []


def test_te_rejects_unsupported_dtype_and_overlapping_groups():
    kern = TEAttentionKernel(EmulatedFusedAttn(dtypes=(torch.bfloat16, torch.float16)))
    mask = IntervalMask(1, torch.tensor([0, 0]), torch.tensor([2, 3]), 4)
    x = torch.randn(2, 1, 4)
    with pytest.raises(ValueError, match="backend='te' supports"):
        kern.forward(x, torch.randn(4, 1, 4), torch.randn(4, 1, 4), mask, 1.0)
    bad = IntervalMask(1, torch.tensor([0, 1]), torch.tensor([3, 4]), 4)  # second group starts inside first
    with pytest.raises(ValueError, match="disjoint key ranges"):
        te_plan(bad, 1)


def test_segments_cover_each_visible_pair_once():
    """Query-major calls (A + B) and the key-major call each cover every visible (block, key) pair of the
    context exactly once; the own-block call covers the second intervals."""
    gen = torch.Generator().manual_seed(3)
    mask = random_mask(gen, 20, 2, [50, 30, 7])
    plan = te_plan(mask, 3)
    rows = 2 * 3
    order = plan.perm.tolist()

    def coverage(segs):
        vis = torch.zeros(20, mask.num_keys, dtype=torch.long)
        for seg in segs:
            cu_q, cu_kv, oq, ok = (t.tolist() for t in (seg.cu_q, seg.cu_kv, seg.off_q, seg.off_kv))
            for i in range(seg.n):
                for pos in range(oq[i] // rows, (oq[i] + cu_q[i + 1] - cu_q[i]) // rows):
                    vis[order[pos], ok[i]: ok[i] + cu_kv[i + 1] - cu_kv[i]] += 1
        return vis

    keys = torch.arange(mask.num_keys)
    ctx = ((keys >= mask.lo[:, None]) & (keys < mask.hi[:, None])).long()
    own = ((keys >= mask.lo2[:, None]) & (keys < mask.hi2[:, None])).long()
    assert torch.equal(coverage([s for s, _ in plan.qmaj]), ctx)
    assert torch.equal(coverage([plan.kmaj]), ctx)
    assert torch.equal(coverage([plan.own[0]]), own)
    assert sorted(order) == list(range(20))


def _op_worker(rank, world, cases):
    """Run the ops with backend='te' served by the emulated TE kernel on this gloo rank."""
    import torch.distributed as dist

    from megatron_splitkv import kernels
    import _splitkv_helpers as H

    for dt in (torch.float64, torch.float32):
        kernels._CACHE[("te", "cpu", dt)] = TEAttentionKernel(EmulatedFusedAttn())
    return [H.run_local(op, c, rank, dist.group.WORLD) for op, c in cases]


@pytest.mark.parametrize("P", [1, 2, 3])
def test_ops_with_te_kernel_match_reference(P):
    """splitkv / allgather-kv / ring-kv with backend='te' (emulated TE: same segment tables, overwrite
    semantics) equal the float64 reference in output, lse and all five gradients, uneven and empty shards,
    invalid blocks, anchors at 0, GQA, a gradient through lse."""
    import _splitkv_helpers as H

    seed = H.new_seed()
    blocks = {1: [5], 2: [4, 0], 3: [3, 1, 4]}[P]
    ctx = {1: "even", 2: [30, 10], 3: [0, 25, 15]}[P]
    cases = [(op, H.case(seed + i, P, blocks=blocks, ctx=ctx, backend="te", Hq=4, Hkv=2))
             for i, op in enumerate(("splitkv", "allgather_kv", "ring_kv"))]
    per_rank = run_distributed(_op_worker, P, cases, timeout=300)
    for i, (op, c) in enumerate(cases):
        errs = H.errors(c, [per_rank[r][i] for r in range(P)])
        bad = {k: v for k, v in errs.items() if not v < H.TOL["float64"]}
        assert not bad, (op, P, c["seed"], bad)


def _te_available():
    if not torch.cuda.is_available():
        return False
    try:
        from megatron_splitkv.kernels.te import load_fused_attn

        load_fused_attn()
        return True
    except ImportError:
        return False


gpu_te = pytest.mark.skipif(not _te_available(), reason="needs CUDA and Transformer Engine")


@gpu_te
@pytest.mark.parametrize("own", [False, True])
def test_gpu_te_kernel_matches_float64(own):
    """Real TE on the GPU: bf16 forward and the three-pass backward against the float64 reference."""
    gen = torch.Generator().manual_seed(21)
    mask = random_mask(gen, 48, 16, [3000, 700, 1300], own=own)
    q, k, v, dout = inputs(gen, mask, 8, 2, 128, torch.bfloat16)
    dev = torch.device("cuda")
    mask_d = IntervalMask(mask.block_size, mask.lo.to(dev), mask.hi.to(dev), mask.num_keys)
    if own:
        mask_d.lo2, mask_d.hi2 = mask.lo2.to(dev), mask.hi2.to(dev)
    kern = TEAttentionKernel()
    scale = 1 / math.sqrt(128)
    out, lse, state = kern.forward(q.to(dev), k.to(dev), v.to(dev), mask_d, scale)
    lse_g, delta = global_stats(gen, lse.cpu().double(), dout, out.cpu())
    r = reference(q, k, v, mask, scale, dout, lse_g, delta)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(r[1]))
    assert rel(out.cpu(), r[0]) < 1e-2
    grads = kern.backward(q.to(dev), k.to(dev), v.to(dev), mask_d, scale, dout.to(dev), lse_g.float().to(dev),
                          delta.float().to(dev), state)
    for got, want in zip(grads, r[2:]):
        assert rel(got.cpu(), want) < 2e-2

# ------------------------------------------------------------------ through the ops: errors on every rank, the chunked merge


def _te_dtype_worker(rank, world, c):
    import torch.distributed as dist

    from megatron_splitkv import kernels

    # like the real TE: bf16/fp16 only
    kernels._CACHE[("te", "cpu", torch.float32)] = TEAttentionKernel(
        EmulatedFusedAttn(dtypes=(torch.bfloat16, torch.float16)))
    seen = []
    for meta in (False, True):
        try:
            run_local("splitkv", {**c, "metadata": meta}, rank, dist.group.WORLD)
        except ValueError as exc:
            seen.append(str(exc))
        else:
            raise AssertionError("no ValueError")
    # still in step: the same case on the math kernel is exact
    return seen, run_local("splitkv", {**c, "backend": "math"}, rank, dist.group.WORLD)


def test_te_unsupported_dtype_raises_on_every_rank():
    """float32 with backend='te' while rank 1 holds no blocks and no context (its kernel never runs):
    the dtype error used to come from inside the kernel on rank 0 only, after the Q all-gather, and
    rank 1 hung in the all-to-all. Now every rank raises before any data collective."""
    c = case(new_seed(), 2, dtype="float32", blocks=[3, 0], ctx=[40, 0], backend="te", num_chunks=2)
    (s0, ok0), (s1, ok1) = run_distributed(_te_dtype_worker, 2, c, timeout=120)
    assert s0 == s1 and len(s0) == 2
    assert all("backend='te' supports" in m and m.startswith("splitkv: ") for m in s0), s0
    check("splitkv", c, [ok0, ok1])


def _te_missing_worker(rank, world):
    import torch.distributed as dist

    from megatron_splitkv import kernels

    for key in [k for k in kernels._CACHE if k[0] == "te"]:
        del kernels._CACHE[key]
    c = case(5, world, dtype="bfloat16", blocks=[2, 0], ctx=[30, 10], backend="te")
    seen = [m.split("; import failed")[0] for m in errors_of_every_op(
        c, rank, dist.group.WORLD, ImportError, ({"metadata": False}, {"metadata": True}))]
    return seen, run_local("splitkv", {**c, "backend": "math"}, rank, dist.group.WORLD)


def _te_installed():
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_te_installed(), reason="Transformer Engine is installed")
def test_te_missing_raises_import_error_on_every_rank():
    c = case(5, 2, dtype="bfloat16", blocks=[2, 0], ctx=[30, 10])
    (s0, ok0), (s1, ok1) = run_distributed(_te_missing_worker, 2, timeout=120)
    assert s0 == s1 and len(s0) == 6
    assert all("pip install 'megatron-splitkv[te]'" in m for m in s0), s0
    check("splitkv", c, [ok0, ok1])


@pytest.mark.parametrize("dtype,tiny", [(torch.float16, 1e-7), (torch.bfloat16, 1e-21), (torch.float32, 1e-21)])
def test_te_backward_tiny_dout_with_lse_gradient(dtype, tiny):
    """A row with a tiny (not zero) dO and delta != 0 (a gradient through the returned lse): O' =
    dO * delta / |dO|^2 overflowed the input dtype (fp16) or |dO|^2 was subnormal in fp32 (ratio inf),
    and the TE backward returned NaN dQ/dK. The kernel must fall back to the exact math backward."""
    from megatron_splitkv.kernels.te import TEAttentionKernel
    from te_emulator import EmulatedFusedAttn
    from test_te_kernel import inputs, random_mask, reference, rel

    gen = torch.Generator().manual_seed(new_seed())
    mask = random_mask(gen, 6, 2, [30], p_empty=0.0)
    q, k, v, dout = inputs(gen, mask, 4, 2, 16, dtype)
    kern = TEAttentionKernel(EmulatedFusedAttn())
    out, lse, state = kern.forward(q, k, v, mask, 0.35)
    dout[3] = tiny
    delta = (dout.double() * out.double()).sum(-1)
    delta[3] -= 0.7  # - dlse
    r = reference(q, k, v, mask, 0.35, dout, lse, delta)
    got = kern.backward(q, k, v, mask, 0.35, dout, lse.float(), delta.float(), state)
    for g_, w in zip(got, r[2:]):
        assert torch.isfinite(g_).all()
        assert rel(g_, w) < 1e-5


def _te_ops_worker(rank, world, jobs):
    import torch.distributed as dist

    from megatron_splitkv import kernels

    for dt in (torch.float64, torch.float32, torch.bfloat16):
        kernels._CACHE[("te", "cpu", dt)] = TEAttentionKernel(EmulatedFusedAttn())
    groups = {P: dist.new_group(list(range(P))) for P in sorted({c["P"] for c in jobs}) if P < world}
    return {j: run_local("splitkv", c, rank, groups.get(c["P"])) for j, c in enumerate(jobs) if rank < c["P"]}


def test_te_kernel_through_chunked_splitkv():
    """backend='te' (emulated, overwrite semantics) under the chunked merge: many packed sequences,
    blocks sharing anchors, anchors beyond the sequence end, B = 1 and 129, all blocks invalid, float32,
    GQA 8, ranks without context or blocks, a gradient through lse; against the float64 reference."""
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    lens = [9, 1, 30, 4, 17, 2, 25, 12]
    tk = sum(lens)

    def draws(nb, pool):
        return [pool[i] for i in torch.randint(len(pool), (nb,), generator=g).tolist()]

    jobs = []
    for i, (P, B, blocks, ctx, dt, hq, hkv, k) in enumerate([
        (3, 4, [4, 1, 3], [50, 0, 50], "float64", 8, 1, 3),
        (2, 1, [6, 5], [0, tk], "float32", 4, 2, 2),
        (2, 129, [1, 2], [60, 40], "float64", 2, 2, 2),
        (3, 2, [2, 0, 3], "even", "bfloat16", 4, 1, 3),
    ]):
        nb = sum(blocks)
        anchors = draws(nb, [0, 3, 3, 5, 40, 2**31 - 1, -1])  # shared values, beyond every end, invalid
        jobs.append(case(seed + i, P, dtype=dt, B=B, Hq=hq, Hkv=hkv, D=16, seq_lens=lens, blocks=blocks,
                         ctx=ctx, anchors=anchors, q_seqs=draws(nb, list(range(len(lens)))), backend="te",
                         num_chunks=k, metadata=bool(i % 2)))
    # every block invalid
    jobs.append(case(seed + 9, 2, dtype="float64", seq_lens=lens, blocks=[2, 3], p_invalid=1.0, backend="te",
                     num_chunks=2))
    per_rank = run_distributed(_te_ops_worker, 3, jobs, timeout=300)
    for j, c in enumerate(jobs):
        errs = check("splitkv", c, job_results(per_rank, j, c["P"]))
        assert all(math.isfinite(e) for e in errs.values())


def _te_on_one_rank_worker(rank, world):
    """Rank 0 has a (CPU-emulated) Transformer Engine, rank 1 has none: a plain call, and a `metadata=`
    call prepared with group_check=True, with backend='te' must raise the same ImportError on BOTH ranks
    (before any data collective), never hang rank 0."""
    import torch.distributed as dist

    from megatron_splitkv import kernels

    for key in [k for k in kernels._CACHE if k[0] == "te"]:
        del kernels._CACHE[key]
    if rank == 0:
        kernels._CACHE[("te", "cpu", torch.bfloat16)] = TEAttentionKernel(EmulatedFusedAttn())
    else:
        def missing(backend, _load=kernels._load):
            if backend == "te":
                raise ImportError("backend='te' needs Transformer Engine 2.x (pip install 'megatron-splitkv[te]'); "
                                  "import failed: simulated")
            return _load(backend)
        kernels._load = missing
    c = case(7, world, dtype="bfloat16", blocks=[2, 1], ctx=[30, 10], backend="te")
    seen = errors_of_every_op(c, rank, dist.group.WORLD, ImportError, ({}, {"metadata": True, "group_check": True}))
    # the group is still usable afterwards
    return seen, run_local("splitkv", {**c, "backend": "math"}, rank, dist.group.WORLD)


def test_te_on_some_ranks_only_raises_everywhere():
    c = case(7, 2, dtype="bfloat16", blocks=[2, 1], ctx=[30, 10])
    (s0, ok0), (s1, ok1) = run_distributed(_te_on_one_rank_worker, 2, timeout=120)
    assert s0 == s1 and len(s0) == 6
    assert all("rank 1: ImportError" in m and "pip install 'megatron-splitkv[te]'" in m for m in s0), s0
    check("splitkv", c, [ok0, ok1])
