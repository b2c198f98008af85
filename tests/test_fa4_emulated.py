"""The fa4 kernel's Python side on CPU: `kernels/fa4.py` driving a float64 stand-in for FlashAttention-4's two
entry points, through the ops, on the shared reproduction cases (/work/shared/cases/README.md C1, C2, C3, C5,
C6, C10) and on host-built metadata (the data pipeline's tables, `_prebuilt`).

FA4 itself needs a Hopper / Blackwell GPU (tests/test_fa4_kernel.py runs it there). What runs here is all of
the wrapper: the per-mask tables (`_Tables`: aux rows, forward key tiles per query tile, backward query tiles
per key tile, the cut of host-built flex tables), the mask_mod choice (one interval or the union), the layouts
([T, H, D] <-> FA4's [1, T, H, D], lse [1, Hq, Tq]), native results, empty inputs, and the global-lse backward
through `out = 0, dlse = -delta`. The stand-in (`_fwd` / `_bwd`) does what FA4 documents, in float64:
  - it checks the block-sparse tensors as FA4 does (counts exactly ceil(T / 128) tiles, index rows at most
    that many of the other side; a larger table is refused) and never lists a tile twice;
  - forward: attends only the listed tiles, applies the interval rows (`aux_tensors`) on partial tiles and
    nothing on full ones (so a wrong "full" tile would show), lse natural log, rows without keys out 0 /
    lse -inf;
  - backward: D' = rowsum(dout * out) - dlse, P = exp(scale q k^T - lse) on the listed tiles, dV = P^T dO,
    dS = P (dO V^T - D'), dQ = scale dS K, dK = scale dS^T Q (GQA: kv head h // (Hq / Hkv)).
The wrapper's dtype / device checks are relaxed for CPU and fp32 (they are tested on their own in
tests/test_fa4_kernel.py; the float64 cases run in fp32, as FA4's lse is fp32 whatever the inputs);
everything else is the code that runs on the GPU. Expected values: the single-process float64 reference
(`_splitkv_helpers.check`)."""

import collections

import numpy as np
import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import check, job_results, jobs_worker, new_seed
from test_cases_op import _c1, _c2, _c3, _c5, _c6, _c10

TILE = 128
_BST = collections.namedtuple("_BST", "cnt idx full_cnt full_idx block_size")
_ONE, _TWO = "interval", "interval_union"  # stand-ins for the two CuTe mask_mods


def _bst(cnt, idx, full_cnt, full_idx, block_size):
    return _BST(cnt, idx, full_cnt, full_idx, block_size)


def _allowed(tabs, n_outer, n_inner, rows_lohi, Tq, Tk, query_major):
    """[Tq, Tk] bool: what FA4 attends with these tables (query_major: forward tables, outer = query tile)."""
    assert tabs.block_size == (TILE, TILE)
    for cnt, idx in ((tabs.cnt, tabs.idx), (tabs.full_cnt, tabs.full_idx)):
        assert cnt.dtype == idx.dtype == torch.int32
        assert tuple(cnt.shape) == (1, 1, n_outer), (tuple(cnt.shape), n_outer)  # FA4 refuses anything else
        assert idx.shape[:3] == (1, 1, n_outer) and idx.shape[3] <= n_inner, (tuple(idx.shape), n_inner)
    c = torch.arange(Tk)[None]
    lo, hi = rows_lohi[0][:Tq, None].long(), rows_lohi[1][:Tq, None].long()
    inside = (c >= lo) & (c < hi)
    if len(rows_lohi) == 4:
        inside |= (c >= rows_lohi[2][:Tq, None].long()) & (c < rows_lohi[3][:Tq, None].long())
    out = torch.zeros(Tq, Tk, dtype=torch.bool)
    seen = set()
    for full, (cnt, idx) in enumerate(((tabs.cnt, tabs.idx), (tabs.full_cnt, tabs.full_idx))):
        for o in range(n_outer):
            for t in idx[0, 0, o, : int(cnt[0, 0, o])].tolist():
                assert 0 <= t < n_inner and (o, t) not in seen, (o, t)
                seen.add((o, t))
                qt, kt = (o, t) if query_major else (t, o)
                rs, cs = slice(qt * TILE, min((qt + 1) * TILE, Tq)), slice(kt * TILE, min((kt + 1) * TILE, Tk))
                out[rs, cs] = True if full else inside[rs, cs]
    return out


def _scores(q, k, scale):
    """[Hq, Tq, Tk] float64 scores with GQA (query head h -> kv head h // (Hq / Hkv))."""
    Hq, Hkv = q.shape[2], k.shape[2]
    kk = k[0].double().repeat_interleave(Hq // Hkv, dim=1)
    return scale * torch.einsum("qhd,khd->hqk", q[0].double(), kk)


def _fwd(q, k, v, *, softmax_scale, return_lse, mask_mod, block_sparse_tensors, aux_tensors, out, lse):
    assert return_lse and mask_mod == (_TWO if len(aux_tensors) == 4 else _ONE)
    Tq, Hq, D = q.shape[1:]
    Tk, Hkv = k.shape[1:3]
    nq, nk = -(-Tq // TILE), -(-Tk // TILE)
    ok = _allowed(block_sparse_tensors, nq, nk, aux_tensors, Tq, Tk, True)
    s = _scores(q, k, softmax_scale).masked_fill(~ok[None], float("-inf"))
    m = torch.logsumexp(s, -1)  # [Hq, Tq]
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m))[..., None])
    vv = v[0].double().repeat_interleave(Hq // Hkv, dim=1)
    o = torch.einsum("hqk,khd->qhd", p, vv)
    out.copy_(o[None].to(out.dtype))
    lse.copy_(m[None].to(lse.dtype))


def _bwd(q, k, v, out, dout, lse, *, softmax_scale, mask_mod, aux_tensors, block_sparse_tensors, dlse, dq, dk, dv):
    assert mask_mod == (_TWO if len(aux_tensors) == 4 else _ONE)
    Tq, Hq, D = q.shape[1:]
    Tk, Hkv = k.shape[1:3]
    g = Hq // Hkv
    nq, nk = -(-Tq // TILE), -(-Tk // TILE)
    ok = _allowed(block_sparse_tensors, nk, nq, aux_tensors, Tq, Tk, False)
    dd = (dout[0].double() * out[0].double()).sum(-1).t() - dlse[0].double()  # D' [Hq, Tq]
    lse_ = lse[0].double()
    s = _scores(q, k, softmax_scale)
    live = ok[None] & torch.isfinite(lse_)[..., None]
    p = torch.where(live, torch.exp(s - lse_.nan_to_num(0.0, 0.0, 0.0)[..., None]), torch.zeros_like(s))
    do = dout[0].double()  # [Tq, Hq, D]
    vv = v[0].double().repeat_interleave(g, dim=1)
    kk = k[0].double().repeat_interleave(g, dim=1)
    dv_h = torch.einsum("hqk,qhd->khd", p, do)
    dp = torch.einsum("qhd,khd->hqk", do, vv)
    ds = p * (dp - dd[..., None])
    dq_ = softmax_scale * torch.einsum("hqk,khd->qhd", ds, kk)
    dk_h = softmax_scale * torch.einsum("hqk,qhd->khd", ds, q[0].double())
    dq.copy_(dq_[None].to(dq.dtype))
    dk.copy_(dk_h.view(Tk, Hkv, g, D).sum(2)[None].to(dk.dtype))
    dv.copy_(dv_h.view(Tk, Hkv, g, D).sum(2)[None].to(dv.dtype))


def install_emulator():
    """Make backend 'fa4' run the stand-in on this process (CPU, fp32 allowed)."""
    from megatron_splitkv import kernels
    from megatron_splitkv.kernels import fa4

    fa4._interface = lambda: (_fwd, _bwd, _bst, _ONE, _TWO)
    fa4.FA4AttentionKernel.check_dtype = lambda self, dtype, device=None, head_dim=None: None
    base_check = fa4.check_call
    fa4.FA4AttentionKernel._check = lambda self, q, k, v, mask: base_check(q, k, v, mask)
    for key in [k for k in kernels._CACHE if k[0] == "fa4"]:
        del kernels._CACHE[key]


def _emulated_jobs_worker(rank, world_size, jobs):
    install_emulator()
    return jobs_worker(rank, world_size, jobs)


@pytest.fixture(scope="module")
def cases_fa4():
    seed = new_seed()
    named = [("C1", _c1(seed)), ("C2", _c2(seed)), ("C3", _c3(seed))]
    named += [("C5", c) for c in _c5(seed)] + [("C6", c) for c in _c6(seed)] + [("C10", c) for c in _c10(seed)]
    jobs, names = [], []
    for name, c in named:
        for op in (["splitkv", "allgather_kv", "ring_kv"] if name != "C10" else ["splitkv"]):
            # splitkv: also row chunks and head chunks (clamped to one call where Hkv = 1)
            for extra in ({}, *(({"metadata": True, "num_chunks": 2},
                                 {"metadata": True, "num_chunks": 2, "chunk_axis": "heads"}) if op == "splitkv" else ())):
                # FA4's lse is fp32 whatever the inputs: the float64 cases run in float32 (fp32 tolerance)
                dt = {"float64": "float32"}.get(c["dtype"], c["dtype"])
                jobs.append((op, dict(c, backend="fa4", dtype=dt, **extra)))
                names.append(name)
    return jobs, names, run_distributed(_emulated_jobs_worker, 8, jobs, timeout=900)


@pytest.mark.parametrize("name", ["C1", "C2", "C3", "C5", "C6", "C10"])
def test_shared_cases_through_the_fa4_wrapper(cases_fa4, name):
    jobs, names, results = cases_fa4
    ran = 0
    for j, (op, c) in enumerate(jobs):
        if names[j] != name:
            continue
        per = job_results(results, j, c["P"])
        check(op, c, per)
        for r in per:  # C2: no NaN anywhere, the empty rows' gradients 0 (check covers values and -inf)
            assert all(not torch.isnan(r[k]).any() for k in ("out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"))
        ran += 1
    assert ran


# ---------------------------------------------------------------------------------- host-built metadata


def _host_worker(rank, world_size, seed, folds):
    """The pipeline's path with backend fa4: prepare_splitkv_metadata_from_plan(..., flex_block_masks=True)
    (the host-built flex tables, padded to flex's bucketed lengths, on every mask), pickled as from a data
    worker, bound, the op forward + backward vs the float64 reference; and which tables FA4 got. For each
    fold in `folds`, the kernel's `fold_gqa` (True, the default: the GQA-folded call builds its own tables,
    the host-built ones are for the unfolded rows), num_chunks 1 and 2 on fresh metadata; the reference (the
    same inputs for every fold and num_chunks) is computed once. Returns {fold: ([(k, errs)], got_prebuilt)}."""
    import pickle

    from megatron_splitkv import dflash_attention_reference, splitkv_attention
    from megatron_splitkv.kernels import fa4
    from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan
    from megatron_splitkv.planning import plan_context_parallel

    install_emulator()
    from megatron_splitkv import kernels

    got_prebuilt = []
    orig = fa4.FA4AttentionKernel._prebuilt

    def spy(self, mask, q_len, kv_len):
        res = orig(self, mask, q_len, kv_len)
        got_prebuilt.append(res is not None)
        return res

    fa4.FA4AttentionKernel._prebuilt = spy
    rng = np.random.default_rng(seed)
    lens = [3000, 1700, 0, 900]  # keys per rank well past one tile: flex pads them to its buckets
    # anchors a with 1 <= a < seq_len - 1 (the planner's rule: a + 1 must be a token of the sequence)
    anchors = [np.sort(rng.choice(np.arange(1, n - 1), size=min(n - 2, 40), replace=False)) if n > 2 else
               np.zeros(0, np.int64) for n in lens]
    B, Hq, Hkv, D = 16, 4, 2, 16
    plan = plan_context_parallel(lens, anchors, block_size=B, cp_size=world_size, chunk_size=256)
    g = torch.Generator().manual_seed(seed)
    nq, nk = plan.q_seq.shape[0] * B, int(sum(lens))
    x = {n: torch.randn(nq if n in ("q", "kb", "vb", "do") else nk, Hq if n in ("q", "do") else Hkv, D,
                        generator=g, dtype=torch.float64) for n in ("q", "k", "v", "kb", "vb", "do")}
    x = {n: t.float() for n, t in x.items()}  # inputs in fp32 (FA4's lse is fp32), the reference in float64
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    kv_seq_all = torch.from_numpy(np.concatenate([np.full(n, i) for i, n in enumerate(lens)]))
    kv_pos_all = torch.from_numpy(np.concatenate([np.arange(n) for n in lens]))
    ref_in = {n: x[n].double().requires_grad_(True) for n in ("q", "k", "v", "kb", "vb")}
    ref, _ = dflash_attention_reference(ref_in["q"], ref_in["k"], ref_in["v"], ref_in["kb"], ref_in["vb"],
                                        torch.from_numpy(plan.q_seq), torch.from_numpy(plan.q_anchor),
                                        kv_seq_all, kv_pos_all, block_size=B)
    (ref * x["do"].double()).sum().backward()
    sl = plan.query_slice(rank)
    rows = slice(sl.start * B, sl.stop * B)

    def rel(a, b):
        return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))

    res = {}
    for fold in folds:
        kernels._CACHE[("fa4", "cpu", torch.float32)] = fa4.FA4AttentionKernel(fold_gqa=fold)
        got_prebuilt.clear()
        out = []
        for k in (1, 2):
            host = prepare_splitkv_metadata_from_plan(plan, rank, block_size=B, num_heads_q=Hq, num_heads_kv=Hkv,
                                                      head_dim=D, dtype=torch.float32, num_chunks=k,
                                                      flex_block_masks=True)
            meta = pickle.loads(pickle.dumps(host)).bind(None, "cpu")
            idx = torch.from_numpy(starts[meta.kv_seq.numpy()] + meta.kv_pos.numpy())
            mine = {"q": x["q"][rows], "k": x["k"][idx], "v": x["v"][idx], "kb": x["kb"][rows], "vb": x["vb"][rows]}
            mine = {n: t.clone().requires_grad_(True) for n, t in mine.items()}
            o = splitkv_attention(mine["q"], mine["k"], mine["v"], mine["kb"], mine["vb"], metadata=meta,
                                  backend="fa4")
            (o * x["do"][rows]).sum().backward()
            errs = {"out": rel(o, ref[rows]), "dq": rel(mine["q"].grad, ref_in["q"].grad[rows]),
                    "dk": rel(mine["k"].grad, ref_in["k"].grad[idx]), "dv": rel(mine["v"].grad, ref_in["v"].grad[idx]),
                    "dkb": rel(mine["kb"].grad, ref_in["kb"].grad[rows])}
            out.append((k, errs))
        res[fold] = (out, list(got_prebuilt))
    return res


def test_host_built_tables_through_the_fa4_wrapper():
    """The data pipeline's metadata (flex tables built on the host at flex's bucketed lengths) with backend
    fa4: the kernel reuses those tables (cut to FA4's tile counts; before, the longer tables were handed to
    FA4, which refuses them) and the op equals the float64 reference, num_chunks 1 and 2, P = 2."""
    folds = (False, True)
    res = run_distributed(_host_worker, 2, new_seed(), folds, timeout=600)
    for per_rank in res:
        assert sorted(per_rank) == sorted(folds)
        for fold, (out, prebuilt) in per_rank.items():
            # unfolded, every kernel call found the host-built tables; folded (Hq 4 / Hkv 2), none: its own
            assert (not any(prebuilt)) if fold else (prebuilt and all(prebuilt)), (fold, prebuilt)
            assert [k for k, _ in out] == [1, 2], (fold, out)
            for k, errs in out:
                assert all(e < 1e-5 for e in errs.values()), (fold, k, errs)


# ---------------------------------------------------------------------------------- GQA fold


def test_gqa_fold_layout_and_equal_results(monkeypatch):
    """`fold_rows` puts query head j of every kv-head group of block b at the j-th repeat of b
    (`fold_gqa_mask`), `unfold_rows` undoes it; the folded call (FA4 sees Hkv heads, Tq * G rows, its own
    tables) returns what the unfolded one (FA4's own GQA) returns, out / lse / dq / dk / dv, on a union mask
    with invalid blocks and empty intervals, and caches its tables under their own key."""
    from megatron_splitkv.kernels import fa4
    from megatron_splitkv.kernels.base import IntervalMask

    # the stand-in in this process for this test only (install_emulator patches for good: worker processes)
    monkeypatch.setattr(fa4, "_interface", lambda: (_fwd, _bwd, _bst, _ONE, _TWO))
    monkeypatch.setattr(fa4.FA4AttentionKernel, "_check", lambda self, q, k, v, mask: fa4.check_call(q, k, v, mask))
    nb, B, Hkv, G, D = 5, 4, 2, 3, 8
    x = torch.randn(nb * B, Hkv * G, D)
    y = fa4.fold_rows(x, B, G)
    for b, j, t, g in ((0, 0, 0, 0), (1, 2, 3, 1), (4, 1, 2, 0), (3, 2, 0, 1)):
        assert torch.equal(y[(b * G + j) * B + t, g], x[b * B + t, g * G + j])
    assert torch.equal(fa4.unfold_rows(y, B, G), x)
    lse = torch.randn(nb * B, Hkv * G)
    assert torch.equal(fa4.unfold_rows(fa4.fold_rows(lse, B, G), B, G), lse)

    g = torch.Generator().manual_seed(new_seed())
    B, nb, Hq, Hkv, D = 16, 20, 8, 2, 16
    tq, nctx, c0 = nb * B, 700, 768
    lo = torch.randint(0, 300, (nb,), generator=g)
    hi = (lo + torch.randint(0, 400, (nb,), generator=g)).clamp(max=nctx)
    hi[3] = lo[3]  # block 3 sees no key at all: no context, and invalid (no own block)
    valid = torch.rand(nb, generator=g) > 0.2
    valid[3] = False
    start = c0 + torch.arange(nb) * B
    lo2, hi2 = torch.where(valid, start, c0), torch.where(valid, start + B, c0)
    q, dout = torch.randn(tq, Hq, D, generator=g), torch.randn(tq, Hq, D, generator=g)
    k, v = torch.randn(c0 + tq, Hkv, D, generator=g), torch.randn(c0 + tq, Hkv, D, generator=g)
    k[nctx:c0], v[nctx:c0] = 0, 0
    res = {}
    for fold in (False, True):
        kern = fa4.FA4AttentionKernel(fold_gqa=fold)
        mask = IntervalMask(B, lo, hi, c0 + tq, lo2, hi2, num_ctx_keys=c0)
        out, lse, st = kern.forward(q, k, v, mask, 0.25)
        dq, dk, dv = kern.backward(q, k, v, mask, 0.25, dout, lse, (dout * out).sum(-1), st)
        res[fold] = (out, lse, dq, dk, dv)
        assert list(mask.__dict__["_fa4_tables"]) == [(tq, c0 + tq, TILE) + ((Hq // Hkv,) if fold else ())]
    assert torch.isinf(res[True][1][3 * B:4 * B]).all()  # block 3's rows: lse -inf (out 0) both ways
    for a, b in zip(res[False], res[True]):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        torch.testing.assert_close(a[torch.isfinite(a)], b[torch.isfinite(b)], rtol=1e-5, atol=1e-5)
