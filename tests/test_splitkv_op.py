"""Split-KV attention vs the single-process float64 reference: output, lse and all five gradients,
CP sizes 1, 2, 3, 4, 8 (gloo, CPU), uneven and empty shards, GQA, invalid blocks, anchors at 0, packed
sequences, shuffled / pre-sorted context, fp64 / fp32 / bf16 / fp16. Source: DESIGN.md section 2."""

import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import case, check, job_results, jobs_worker, new_seed, run_local


def cp_cases(P, seed):
    """Several layouts per CP size; every case is checked for every op run on it."""
    tk = 13 + 7 + 20
    ctx_uneven = [0] * P
    for i in range(tk):  # skewed split, the last rank holds no context when P > 1
        ctx_uneven[(i * i) % max(P - 1, 1)] += 1
    blocks_uneven = [(3 * r + 1) % 4 for r in range(P)]  # P > 1: rank 1 holds 0 blocks
    cases = [
        case(seed, P, dtype="float64", blocks=blocks_uneven, ctx=ctx_uneven),
        case(seed + 1, P, dtype="float32", Hq=6, Hkv=3, B=3, blocks=[2] * P),
        case(seed + 2, P, dtype="bfloat16", Hq=4, Hkv=1, D=16, seq_lens=[50, 30], blocks=[3] * P,
             p_invalid=0.1, p_zero=0.1),
    ]
    if P == 2:
        cases += [
            case(seed + 3, P, dtype="float16", Hq=2, Hkv=2),
            case(seed + 4, P, dtype="float64", seq_lens=[0]),  # no context anywhere
            case(seed + 5, P, dtype="float64", seq_lens=[9, 11],  # context already sorted on each rank
                 ctx_idx=[list(range(0, 12)), list(range(12, 20))]),
            case(seed + 6, P, dtype="float64", blocks=[1, 3], full=True, p_invalid=0.0, p_zero=0.0),
        ]
    return cases


def test_splitkv_single_process():
    seed = new_seed()
    for c in cp_cases(1, seed) + [case(seed + 9, 1, dtype="float64", Hq=8, Hkv=2, B=1, blocks=[5])]:
        check("splitkv", c, [run_local("splitkv", c, 0)])


def test_splitkv_default_backend_and_no_group():
    """backend="auto" on CPU and cp_group=None without torch.distributed: single process, exact."""
    c = case(new_seed(), 1, dtype="float64")
    import _splitkv_helpers as h

    t = h.build(c)
    x, meta, _, _ = h.local(t, c, 0)
    xr = {k: v.detach().clone().requires_grad_(True) for k, v in x.items()}
    ref, _ = h.dflash_attention_reference(*xr.values(), *meta.values(), block_size=c["B"])
    for op in h.OPS.values():  # out only (no lse gradient), default backend, no process group
        for v in x.values():
            v.grad = None
        out = op(*x.values(), *meta.values(), block_size=c["B"])
        assert torch.allclose(out.detach(), ref.detach(), atol=1e-12, rtol=0)
        out.backward(torch.ones_like(out))
        if xr["q"].grad is None:
            ref.backward(torch.ones_like(ref))
        for k in x:
            assert torch.allclose(x[k].grad, xr[k].grad, atol=1e-12, rtol=0), k


CP_SIZES = [2, 3, 4, 8]


def run_cp_sizes(ops):
    """All CP sizes in ONE 8-rank spawn (smaller sizes on subgroups): {P: (cases, per-job results)}."""
    seed = new_seed()
    cases = {P: cp_cases(P, seed + 100 * P) for P in CP_SIZES}
    jobs = [(op, c) for P in CP_SIZES for op in ops for c in cases[P]]
    results = run_distributed(jobs_worker, max(CP_SIZES), jobs, timeout=400)
    return jobs, results


def check_cp_size(run, P):
    jobs, results = run
    n = 0
    for j, (op, c) in enumerate(jobs):
        if c["P"] == P:
            check(op, c, job_results(results, j, P))
            n += 1
    assert n


@pytest.fixture(scope="module")
def splitkv_run():
    return run_cp_sizes(["splitkv"])


@pytest.mark.parametrize("P", CP_SIZES)
def test_splitkv_cp(splitkv_run, P):
    check_cp_size(splitkv_run, P)


def test_merge_of_empty_partials_is_zero_not_nan():
    """C2 at the helper level: merging states whose lse are all -inf gives O = 0, lse = -inf."""
    from megatron_splitkv.lse import finalize, lse_weights, merge

    ninf = float("-inf")
    o1, o2 = torch.zeros(3, 2, 4), torch.randn(3, 2, 4)
    l1 = torch.tensor([[ninf, ninf], [ninf, 0.5], [1.0, 2.0]])
    l2 = torch.tensor([[ninf, ninf], [ninf, ninf], [0.0, ninf]])
    o2[:2] = 0
    out, lse = merge(o1, l1, o2, l2)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[0] == 0).all() and (lse[0] == ninf).all() and lse[1, 0] == ninf
    assert torch.allclose(lse[2], torch.logaddexp(l1[2], l2[2]))
    m = torch.maximum(l1, l2)
    m_safe, w = lse_weights(l1, m)
    o, lse_f = finalize(o1 * w[..., None], w, m_safe)
    assert not torch.isnan(o).any() and lse_f[0, 0] == ninf


def test_math_kernel_chunked_vs_dense():
    """The math kernel with a tiny tile budget (many groups, out-of-order intervals, empty blocks) vs a
    dense float64 computation of the base.py contract, forward and backward with given lse/delta."""
    from megatron_splitkv.kernels import IntervalMask, get_kernel
    from megatron_splitkv.kernels.math import MathAttentionKernel

    g = torch.Generator().manual_seed(new_seed())
    nb, B, Hq, Hkv, D, Tk = 7, 3, 4, 2, 5, 30
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((nb * B, Hq, D), (Tk, Hkv, D), (Tk, Hkv, D)))
    lo = torch.randint(0, Tk, (nb,), generator=g)
    hi = torch.minimum(lo + torch.randint(0, 12, (nb,), generator=g), torch.tensor(Tk))
    lo[2], hi[2] = 5, 5  # empty
    mask = IntervalMask(B, lo, hi, Tk)
    vis = torch.zeros(nb * B, Tk, dtype=torch.bool)
    for b in range(nb):
        vis[b * B:(b + 1) * B, lo[b]:hi[b]] = True
    kk, vv = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * 0.3
    s = s.masked_fill(~vis[None], float("-inf"))
    lse_ref = torch.logsumexp(s, -1).t()
    out_ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1).nan_to_num(0.0), vv)
    dout = torch.randn(nb * B, Hq, D, generator=g, dtype=torch.float64)
    lse_g = lse_ref + torch.rand(nb * B, Hq, generator=g, dtype=torch.float64)  # a "global" lse >= local
    lse_g[~torch.isfinite(lse_ref)] = float("-inf")
    delta = torch.randn(nb * B, Hq, generator=g, dtype=torch.float64)
    p = torch.exp(s - lse_g.t().nan_to_num(neginf=0.0)[..., None]).masked_fill(~vis[None], 0.0)
    dv_ref = torch.einsum("hqk,qhd->khd", p, dout).view(Tk, Hkv, Hq // Hkv, D).sum(2)
    ds = p * (torch.einsum("qhd,khd->hqk", dout, vv) - delta.t()[..., None])
    dq_ref = torch.einsum("hqk,khd->qhd", ds, kk) * 0.3
    dk_ref = (torch.einsum("hqk,qhd->khd", ds, q) * 0.3).view(Tk, Hkv, Hq // Hkv, D).sum(2)
    for kern in (MathAttentionKernel(max_elements=64), get_kernel("math", "cpu", torch.float64)):
        out, lse, st = kern.forward(q, k, v, mask, 0.3)
        assert torch.allclose(out, out_ref, atol=1e-12) and torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
        assert torch.allclose(lse[torch.isfinite(lse)], lse_ref[torch.isfinite(lse_ref)], atol=1e-12)
        dq, dk, dv = kern.backward(q, k, v, mask, 0.3, dout, lse_g, delta, st)
        for a, b in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
            assert torch.allclose(a, b, atol=1e-12)
    assert isinstance(get_kernel("auto", "cpu", torch.float32), MathAttentionKernel)
    with pytest.raises(ValueError, match="backend must be one of"):
        get_kernel("nope")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="Transformer Engine") as e:
            get_kernel("te", "cpu", torch.bfloat16)
        # the hint is for users of this package: the extra and a doc in this repository, no machine-local path
        assert "megatron-splitkv[te]" in str(e.value) and "docs/kernels.md" in str(e.value), str(e.value)
        assert "/work/" not in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- regressions (tester's defects)

_EXTREME_IDS = [-(2**31), -7, -1, 2**31 - 1]  # sequence index -> id: negative and extreme ids are ids


def _regression_cases(seed):
    """(op, case) jobs: negative / extreme sequence ids (#1), seq id 2**31 - 1 with anchors >= 2**31
    (#4), NaN/inf in keys no query sees and in invalid blocks (#2); with and without metadata=, math
    and flex (CPU emulation) kernels, P = 2 and 3."""
    jobs = []
    for P in (2, 3):
        for meta in (False, True):
            base = dict(seq_ids=_EXTREME_IDS, seq_lens=[5, 9, 6, 8], metadata=meta)
            # sequence index 3 (30 tokens) is seen by no block; two invalid blocks
            poison = dict(base, poison=True, seq_lens=[5, 9, 6, 30], q_seqs=[0, 1, 2] * P,
                          anchors=[3, -1, 6, 5, 9, -1, 2, 4, 0][: 3 * P])
            cs = [
                case(seed, P, dtype="float64", blocks=[2] * P, **base),
                # every block of sequence id 2**31 - 1 (index 3) / -2**31 (index 0) with huge anchors
                case(seed + 1, P, dtype="float64", blocks=[2] * P, **base,
                     q_seqs=[3, 0, 3, 1, 3, 2][: 2 * P], anchors=[2**31, 2**31, 2**62, 3, 2**31 + 5, -1][: 2 * P]),
                case(seed + 2, P, dtype="float64", blocks=[3] * P, **poison),
                case(seed + 3, P, dtype="float32", blocks=[3] * P, backend="flex", **poison),
            ]
            jobs += [(op, c) for c in cs for op in ("splitkv", "allgather_kv", "ring_kv")]
    return jobs


def test_negative_ids_int64_edge_and_masked_nan_all_ops():
    """#1 negative sequence ids (the splitkv padding clamp), #4 no int64 wrap of the interval bound for
    seq id 2**31 - 1 and anchor >= 2**31, #2 a NaN/inf in a context key/value no query sees or in an
    invalid block's q/k/v reaches no output or gradient: all three ops, with and without metadata=,
    vs the float64 reference (itself robust to the poison, see test_reference)."""
    seed = new_seed()
    jobs = _regression_cases(seed)
    res = run_distributed(jobs_worker, 3, jobs, timeout=400)
    for j, (op, c) in enumerate(jobs):
        check(op, c, job_results(res, j, c["P"]))


def test_double_backward_raises():
    """#6: the ops' backward is not differentiable: create_graph=True through them raises instead of
    silently returning wrong second derivatives."""
    from _splitkv_helpers import OPS, build, local

    c = case(new_seed(), 1, dtype="float64")
    t = build(c)
    for op, fn in OPS.items():
        x, m, _, _ = local(t, c, 0)
        out = fn(*x.values(), *m.values(), block_size=c["B"], backend="math")
        (g,) = torch.autograd.grad(out.square().sum(), x["q"], create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable|twice"):
            g.sum().backward()


def test_flex_cpu_float64_keeps_float64_precision():
    """#7: backend="flex" on CPU with float64 inputs computes in float64 (not fp32 lse/out/grads)."""
    from _splitkv_helpers import errors, run_local

    c = case(new_seed(), 1, dtype="float64", backend="flex", Hq=4, Hkv=2, D=8)
    errs = errors(c, [run_local(op, c, 0) for op in ("splitkv",)])
    assert max(errs.values()) < 1e-12, errs
    for op in ("allgather_kv", "ring_kv"):
        errs = errors(c, [run_local(op, c, 0)])
        assert max(errs.values()) < 1e-12, (op, errs)
