"""FlashAttention-4 local kernel (`megatron_splitkv.kernels.fa4`, docs/kernels.md "FA4 kernel").

CPU (always): the optional dependency's failure modes (ImportError naming the extra, `fa4_runs_on` False
off CUDA, the backend listed in the registry and the Megatron flag) and the per-mask tables (padded rows,
forward = key tiles per query tile, backward = query tiles per key tile) against a brute-force tile
classification of the dense mask.
GPU (skipped without CUDA or without flash_attn.cute): bf16 / fp16 exactness against the float64
reference (forward, lse, dq, dk, dv) over odd shapes (rows and keys not multiples of 128, fewer than 128
keys, GQA 1 / 4 / 8, head dims 64 / 128, own-block second intervals, empty rows), with the GQA fold (the
default) and without it (FA4's own GQA), the global-lse backward
over a key split (the Split-KV path), native vs upcast results, empty inputs, and the Split-KV op at
CP = 1 with backend "fa4" against the single-process float64 reference.
"""

import collections

import pytest
import torch

from _splitkv_helpers import case, check, new_seed, run_local, with_random_own_slots

from tools import benchlib as mb
from megatron_splitkv import kernels
from megatron_splitkv.kernels import fa4
from megatron_splitkv.kernels.base import IntervalMask
from megatron_splitkv.ops.common import context_keys, intervals, with_own_blocks
from megatron_splitkv.ops.host_metadata import _host_flex_tables
from megatron_splitkv.ops.packing import FLEX_HOST

_BST = collections.namedtuple("_BST", "cnt idx full_cnt full_idx block_size")


def _bst(cnt, idx, full_cnt, full_idx, block_size):
    return _BST(cnt, idx, full_cnt, full_idx, block_size)


def _dense(mask, q_len, kv_len):
    rows = torch.arange(q_len)
    blk = (rows // mask.block_size).clamp(max=mask.num_blocks - 1)
    valid = rows < mask.num_blocks * mask.block_size
    j = torch.arange(kv_len)
    m = (j[None] >= mask.lo[blk][:, None]) & (j[None] < mask.hi[blk][:, None])
    if mask.has_union:
        m |= (j[None] >= mask.lo2[blk][:, None]) & (j[None] < mask.hi2[blk][:, None])
    return m & valid[:, None]


def _sets(num, idx):
    num, idx = num[0, 0], idx[0, 0]
    return [sorted(idx[i, : int(num[i])].tolist()) for i in range(num.shape[0])]


# ---------------------------------------------------------------------------------------------- CPU
def test_missing_dependency_names_the_extra():
    if fa4.fa4_available():
        pytest.skip("flash_attn.cute is installed here")
    with pytest.raises(ImportError, match=r"megatron-splitkv\[fa4\]"):
        kernels.get_kernel("fa4", "cpu", torch.bfloat16, 128)
    assert not fa4.fa4_runs_on("cpu", torch.bfloat16, 128)
    assert not fa4.fa4_runs_on("cuda", torch.float32, 128)


def test_backend_listed_everywhere():
    pytest.importorskip("megatron.core")
    from megatron_splitkv.megatron.arguments import KERNEL_BACKENDS

    assert "fa4" in kernels.BACKENDS and "fa4" in KERNEL_BACKENDS
    assert set(KERNEL_BACKENDS) == set(kernels.BACKENDS)


@pytest.mark.parametrize("n_blocks,B,tk,union", [(5, 16, 1000, False), (24, 16, 300, True), (9, 4, 130, True),
                                                 (8, 16, 50, False)])
def test_tables_match_brute_force(n_blocks, B, tk, union):
    gen = torch.Generator().manual_seed(n_blocks * 7 + tk)
    lo = torch.randint(0, tk + 1, (n_blocks,), generator=gen)
    hi = torch.minimum(lo + torch.randint(0, tk + 1, (n_blocks,), generator=gen), torch.tensor(tk))
    hi[1] = lo[1]  # an empty block
    if union:
        mask = with_random_own_slots(gen, lo, hi, tk, B, 0.7, 128)
    else:
        mask = IntervalMask(B, lo, hi, tk)
    Tq, Tk = n_blocks * B, mask.num_keys
    t = fa4._Tables(mask, Tq, Tk, 128, _bst)
    qp, kp = -(-Tq // 128) * 128, -(-Tk // 128) * 128
    assert all(a.shape == (qp,) and a.dtype == torch.int32 for a in t.aux)
    assert len(t.aux) == (4 if union else 2) and t.union == union
    assert (t.aux[0][Tq:] == 0).all() and (t.aux[1][Tq:] == 0).all()  # padding rows see nothing
    d = _dense(mask, qp, kp).reshape(qp // 128, 128, kp // 128, 128)
    needed, full = d.any(dim=(1, 3)), d.all(dim=(1, 3))
    part = needed & ~full
    assert _sets(t.fwd.cnt, t.fwd.idx) == [sorted(torch.nonzero(r).flatten().tolist()) for r in part]
    assert _sets(t.fwd.full_cnt, t.fwd.full_idx) == [sorted(torch.nonzero(r).flatten().tolist()) for r in full]
    assert _sets(t.bwd.cnt, t.bwd.idx) == [sorted(torch.nonzero(c).flatten().tolist()) for c in part.T]
    assert _sets(t.bwd.full_cnt, t.bwd.full_idx) == [sorted(torch.nonzero(c).flatten().tolist()) for c in full.T]
    assert t.fwd.block_size == t.bwd.block_size == (128, 128)


def test_auto_picks_fa4_where_it_runs(monkeypatch):
    """"auto" -> "fa4" when FA4 runs there (dtype known), unless SplitKVConfig(auto_fa4=False); float64 /
    unknown dtype / CPU never pick it."""
    from megatron_splitkv import SplitKVConfig

    monkeypatch.setattr(fa4, "fa4_runs_on", lambda device, dtype, head_dim=None: dtype == torch.bfloat16)
    assert kernels.resolve_auto_backend(None, "cuda", torch.bfloat16, 128) == "fa4"
    assert kernels.resolve_auto_backend(1 << 20, "cuda", torch.bfloat16, 128) == "fa4"  # over staircase too
    assert kernels.resolve_auto_backend(None, "cuda", None, 128) == "flex"
    assert kernels.resolve_auto_backend(None, "cuda", torch.float64, 128) == "math"
    assert kernels.resolve_auto_backend(None, "cpu", torch.bfloat16, 128) == "math"
    assert kernels.resolve_auto_backend(None, "cuda", torch.bfloat16, 128, SplitKVConfig(auto_fa4=False)) == "flex"
    # windowed / causal layers (per-row bounds): flex, neither fa4 (not verified on a GPU) nor staircase
    assert kernels.resolve_auto_backend(1 << 20, "cuda", torch.bfloat16, 128, row_intervals=True) == "flex"
    assert kernels.get_kernel("auto", "cuda", torch.bfloat16, 128, row_intervals=True).name == "flex"


def test_auto_avoids_fa4_in_deterministic_mode(monkeypatch):
    monkeypatch.setattr(fa4, "fa4_runs_on", lambda device, dtype, head_dim=None: True)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert kernels.resolve_auto_backend(None, "cuda", torch.bfloat16, 128) == "flex"
        kern = object.__new__(fa4.FA4AttentionKernel)
        with pytest.raises(ValueError, match="deterministic"):
            kern.check_dtype(torch.bfloat16)
    finally:
        torch.use_deterministic_algorithms(prev)
    assert kernels.resolve_auto_backend(None, "cuda", torch.bfloat16, 128) == "fa4"


def test_tables_reuse_the_pipelines_host_built_flex_tables():
    """A mask carrying FlexAttention tables built on the host (the data pipeline's `_host_flex_tables`,
    at flex's bucketed lengths) gives FA4 those tensors (no device work) with the same tile sets on the
    rows and key tiles FA4 reads."""
    gen = torch.Generator().manual_seed(5)
    mask = _mask(gen, 20, 16, 1500, True)
    _host_flex_tables([mask])
    (key, (rows, tables)), = mask.__dict__[FLEX_HOST].items()
    Tq, Tk = 320, mask.num_keys
    assert key[0] > 384 or key[1] > -(-Tk // 128) * 128  # padded beyond FA4's own lengths: a real test
    t = fa4._Tables(mask, Tq, Tk, 128, _bst, (rows, tables))
    assert t.aux[0] is not None and t.aux[0].data_ptr() == rows[0].data_ptr()
    fresh = fa4._Tables(mask, Tq, Tk, 128, _bst)
    nq, nk = -(-Tq // 128), -(-Tk // 128)
    for a, b in ((t.fwd, fresh.fwd), (t.bwd, fresh.bwd)):
        n = nq if a is t.fwd else nk
        assert _sets(a.cnt, a.idx)[:n] == _sets(b.cnt, b.idx)
        assert _sets(a.full_cnt, a.full_idx)[:n] == _sets(b.full_cnt, b.full_idx)
    kern = object.__new__(fa4.FA4AttentionKernel)
    kern.tile = 128
    assert kern._prebuilt(mask, Tq, Tk) is not None  # same device as the mask, large enough
    assert kern._prebuilt(mask, key[0] + 128, Tk) is None


def _fa4_shape_check(t, Tq, Tk, tile=128):
    """The block-sparse shapes FA4 accepts for a call of Tq rows and Tk keys (flash_attn.cute.block_sparsity:
    `infer_block_sparse_expected_shapes` / `normalize_block_sparse_tensors`, forward, and
    `get_block_sparse_expected_shapes_bwd`, backward): counts exactly one per query tile (forward) / key tile
    (backward), index rows at most that many tiles of the other side."""
    nq, nk = -(-Tq // tile), -(-Tk // tile)
    for tabs, n, m, what in ((t.fwd, nq, nk, "forward"), (t.bwd, nk, nq, "backward")):
        for cnt, idx in ((tabs.cnt, tabs.idx), (tabs.full_cnt, tabs.full_idx)):
            assert tuple(cnt.shape) == (1, 1, n), (what, tuple(cnt.shape), n)
            assert idx.shape[:3] == (1, 1, n) and idx.shape[3] <= m, (what, tuple(idx.shape), n, m)
    assert all(a.shape[0] >= nq * tile for a in t.aux)


@pytest.mark.parametrize("n_blocks,B,tk,union", [(160, 16, 20000, False), (513, 16, 300, True), (20, 16, 1500, True),
                                                 (7, 4, 129, False)])
def test_host_built_tables_have_the_shapes_fa4_takes(n_blocks, B, tk, union):
    """The pipeline's host-built flex tables are padded to flex's BUCKETED lengths (e.g. 2560 rows -> 3072,
    20000 keys -> 24576: 24 x 192 tiles where FA4 expects 20 x 157, and FA4 refuses larger tables); the
    tables FA4 gets from them have FA4's shapes and equal the ones built at its own lengths, value for value."""
    gen = torch.Generator().manual_seed(n_blocks + tk)
    mask = _mask(gen, n_blocks, B, tk, union, dflash=not union)
    _host_flex_tables([mask])
    (key, pre), = mask.__dict__[FLEX_HOST].items()
    Tq, Tk = n_blocks * B, mask.num_keys
    fresh = fa4._Tables(mask, Tq, Tk, 128, _bst)
    _fa4_shape_check(fresh, Tq, Tk)
    kern = object.__new__(fa4.FA4AttentionKernel)
    kern.tile = 128
    got = fa4._Tables(mask, Tq, Tk, 128, _bst, kern._prebuilt(mask, Tq, Tk))
    _fa4_shape_check(got, Tq, Tk)
    for a, b in ((got.fwd, fresh.fwd), (got.bwd, fresh.bwd)):
        for x, y in zip(a[:4], b[:4]):
            assert x.shape == y.shape and torch.equal(x, y)
    qp = -(-Tq // 128) * 128
    assert len(got.aux) == len(fresh.aux) and all(torch.equal(x[:qp], y) for x, y in zip(got.aux, fresh.aux))
    assert got.aux[0].data_ptr() == pre[0].data_ptr()  # views of the host-built rows: no copy
    if union:  # a host table of the other mask kind (the union's 4 rows for a one-interval mask) is not taken
        other = IntervalMask(B, mask.lo, mask.hi, mask.num_keys)
        other.__dict__[FLEX_HOST] = mask.__dict__[FLEX_HOST]
        assert kern._prebuilt(other, Tq, Tk) is None


_BROKEN_PROBE = r"""
import json, sys, warnings
import torch
from megatron_splitkv import kernels
from megatron_splitkv.kernels import fa4
# a Hopper GPU as far as the checks before the import go (CPU-only torch here)
fa4.half_precision_cuda_index = lambda device, dtype, head_dim=None: 0 if dtype == torch.bfloat16 else None
torch.cuda.get_device_capability = lambda idx=None: (9, 0)
out = {}
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    for name, fn in (("runs_on", lambda: fa4.fa4_runs_on("cuda", torch.bfloat16, 128)),
                     ("auto", lambda: kernels.resolve_auto_backend(None, "cuda", torch.bfloat16, 128)),
                     ("auto_again", lambda: kernels.resolve_auto_backend(None, "cuda", torch.bfloat16, 128)),
                     ("explicit", lambda: type(kernels.get_kernel("fa4", "cuda", torch.bfloat16, 128)).__name__)):
        try:
            out[name] = fn()
        except Exception as exc:
            out[name] = "raised " + type(exc).__name__ + ": " + str(exc)
out["warnings"] = [str(x.message) for x in w if "FlashAttention-4" in str(x.message)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("broken", ["parent_oserror", "cute_runtimeerror", "no_interface"])
def test_broken_fa4_install_auto_falls_back_explicit_names_the_cause(tmp_path, broken):
    """A `flash_attn` package that is found but does not import (simulated on sys.path): the parent raising
    (e.g. flash-attn 2 with a missing CUDA library), flash_attn.cute raising a non-ImportError, or an FA4
    without its `interface` module. `fa4_runs_on` never raises and is False, "auto" picks flex (with one
    warning naming the cause when FA4 is found but broken), explicit "fa4" raises ImportError naming the
    extra and the cause (an ImportError: what the ops treat as "backend missing" on every rank)."""
    import json
    import os
    import subprocess
    import sys

    fa = tmp_path / "flash_attn"
    (fa / "cute").mkdir(parents=True)
    for pkg in ("cutlass", "cutlass/cute"):  # CuTe DSL importable (empty stand-ins)
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (fa / "__init__.py").write_text('raise OSError("libcudart.so.12: cannot open shared object file")\n'
                                    if broken == "parent_oserror" else "")
    (fa / "cute" / "__init__.py").write_text('raise RuntimeError("CUDA driver too old")\n'
                                             if broken == "cute_runtimeerror" else "")
    (fa / "cute" / "block_sparsity.py").write_text("BlockSparseTensorsTorch = tuple\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root]))
    r = subprocess.run([sys.executable, "-c", _BROKEN_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["runs_on"] is False and out["auto"] == "flex" and out["auto_again"] == "flex", out
    cause = {"parent_oserror": "OSError: libcudart", "cute_runtimeerror": "RuntimeError: CUDA driver too old",
             "no_interface": "flash_attn.cute.interface"}[broken]
    assert out["explicit"].startswith("raised ImportError: ") and "megatron-splitkv[fa4]" in out["explicit"], out
    assert cause in out["explicit"], out
    # found but broken: one warning (the import is tried once per process) naming the cause and the switch
    assert len(out["warnings"]) == (0 if broken == "parent_oserror" else 1), out
    assert all(cause in m and "SplitKVConfig(auto_fa4=False)" in m for m in out["warnings"]), out


# ---------------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and fa4.fa4_runs_on("cuda", torch.bfloat16, 128)),
                         reason="needs a Hopper/Blackwell GPU with flash_attn.cute (extra 'fa4')")
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _mask(gen, n_blocks, B, tk, union, p_empty=0.2, dflash=False):
    if dflash:
        lo = torch.zeros(n_blocks, dtype=torch.long)
        hi = torch.sort(torch.randint(0, tk + 1, (n_blocks,), generator=gen)).values
    else:
        lo = torch.randint(0, tk + 1, (n_blocks,), generator=gen)
        hi = torch.minimum(lo + torch.randint(0, tk + 1, (n_blocks,), generator=gen), torch.tensor(tk))
    empty = torch.rand(n_blocks, generator=gen) < p_empty
    hi = torch.where(empty, lo, hi)
    hi[0] = lo[0]  # at least one block that sees nothing
    if union:
        m = with_random_own_slots(gen, lo, hi, tk, B, 0.7, 128)
        m.hi2[0] = m.lo2[0]  # ... not even an own block
    else:
        m = IntervalMask(B, lo, hi, tk)
    return m


def _to(m, dev):
    kw = dict(lo2=m.lo2.to(dev), hi2=m.hi2.to(dev), num_ctx_keys=m.num_ctx_keys) if m.has_union else {}
    kw.update({n: getattr(m, n).to(dev) for n in ("row_lo", "row_lo2", "row_hi2") if getattr(m, n) is not None})
    return IntervalMask(m.block_size, m.lo.to(dev), m.hi.to(dev), m.num_keys, **kw)


def _windowed(gen, n_blocks, B, tk, window, causal):
    """A DFlash mask of one sequence of tk keys (sorted positions 0..tk-1) with a sliding window / causal own
    blocks, built by the ops' own functions (`ops.common.intervals`, `with_own_blocks`: per-row bounds)."""
    anchor = torch.randint(0, tk + 1, (n_blocks,), generator=gen)
    anchor[0] = -1  # a block that sees nothing
    keys = context_keys(torch.zeros(tk, dtype=torch.long), torch.arange(tk))
    m = intervals(keys, torch.zeros(n_blocks, dtype=torch.long), anchor, B, window)
    return with_own_blocks(m, anchor >= 0, n_blocks, window=window, causal=causal)


def _inputs(gen, Tq, Tk, Hq, Hkv, D, dtype):
    mk = lambda *s: torch.randn(*s, generator=gen).to("cuda", dtype)  # noqa: E731
    return mk(Tq, Hq, D), mk(Tk, Hkv, D), mk(Tk, Hkv, D), mk(Tq, Hq, D)


@gpu
@pytest.mark.parametrize("n_blocks,B,tk,Hq,Hkv,D,union,dflash", [
    (5, 16, 1000, 8, 2, 64, False, False),    # 80 rows, keys not a multiple of 128
    (40, 16, 1700, 32, 8, 128, True, True),   # drafter heads, own-block intervals, DFlash staircase
    (24, 16, 50, 4, 4, 64, False, True),      # MHA, fewer keys than one tile
    (33, 8, 777, 16, 2, 128, True, False),    # GQA 8, B = 8
    (64, 16, 4096, 32, 8, 128, False, True),  # several full tiles
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fold", [True, False])  # the GQA fold (default) and FA4's own GQA
def test_gpu_exact_vs_float64(n_blocks, B, tk, Hq, Hkv, D, union, dflash, dtype, fold):
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    mask = _to(_mask(gen, n_blocks, B, tk, union, dflash=dflash), "cuda")
    Tq, Tk = n_blocks * B, mask.num_keys
    q, k, v, do = _inputs(gen, Tq, Tk, Hq, Hkv, D, dtype)
    kern = fa4.FA4AttentionKernel(fold_gqa=fold)
    scale = D ** -0.5
    out, lse, st = kern.forward(q, k, v, mask, scale)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:2]
    delta = (do.float() * out).sum(-1)
    dq, dk, dv = kern.backward(q, k, v, mask, scale, do, lse, delta, st)
    ref = mb.interval_attention_reference(q, k, v, mask, scale, do)
    err = mb.kernel_errors(out, lse, (dq, dk, dv), ref)
    tol = TOL[dtype]
    assert err["nonfinite"] == 0, (seed, err)
    assert err["lse"] < tol, (seed, err)
    for name in ("out", "dq", "dk", "dv"):
        assert err[name] < tol, (name, seed, err)
    dead = ~torch.isfinite(ref["lse"])
    assert dead.any()  # the case has rows that see nothing: out 0, lse -inf, dq 0 there
    assert (out[dead] == 0).all() and torch.isneginf(lse[dead]).all() and (dq[dead] == 0).all()


@gpu
@pytest.mark.parametrize("window,causal", [(64, True), (300, False), (None, True), (2048, True)])
@pytest.mark.parametrize("fold", [True, False])
def test_gpu_sliding_window_vs_float64(window, causal, fold):
    """Per-row bounds (sliding-window / causal drafter layers) through FA4's aux rows and block tables, bf16,
    against the float64 interval reference (which reads the same per-row bounds)."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    mask = _to(_windowed(gen, 40, 16, 3000, window, causal), "cuda")
    Tq, Tk, Hq, Hkv, D = mask.num_blocks * 16, mask.num_keys, 32, 8, 128
    q, k, v, do = _inputs(gen, Tq, Tk, Hq, Hkv, D, torch.bfloat16)
    kern = fa4.FA4AttentionKernel(fold_gqa=fold)
    scale = D ** -0.5
    out, lse, st = kern.forward(q, k, v, mask, scale)
    dq, dk, dv = kern.backward(q, k, v, mask, scale, do, lse, (do.float() * out).sum(-1), st)
    err = mb.kernel_errors(out, lse, (dq, dk, dv), mb.interval_attention_reference(q, k, v, mask, scale, do))
    assert err["nonfinite"] == 0 and all(err[n] < TOL[torch.bfloat16] for n in ("lse", "out", "dq", "dk", "dv")), \
        (seed, window, causal, fold, err)


@gpu
@pytest.mark.parametrize("Hq,Hkv,fold", [(32, 8, True), (32, 8, False), (8, 8, True)])
def test_gpu_key_tiles_no_query_sees_get_zero_gradients(Hq, Hkv, fold):
    """Packs leave whole key tiles that no block sees (the keys after a conversation's last anchor): their dK /
    dV must be exact zeros, on memory the caching allocator hands back full of NaN (freed just before the
    backward), folded (FA4's MHA path: it writes dK / dV itself), with FA4's own GQA and for MHA; the rest
    matches the float64 reference."""
    gen = torch.Generator().manual_seed(new_seed())
    B, nb, tk, D = 16, 24, 1000, 128
    lo = torch.where(torch.arange(nb) < nb // 2, 0, 512)  # key tiles 2 and 3 ([256, 512)): no block
    hi = lo + torch.randint(1, 257, (nb,), generator=gen)
    mask = _to(IntervalMask(B, lo, hi, tk), "cuda")
    q, k, v, do = _inputs(gen, nb * B, tk, Hq, Hkv, D, torch.bfloat16)
    kern = fa4.FA4AttentionKernel(fold_gqa=fold)
    out, lse, st = kern.forward(q, k, v, mask, D ** -0.5, native=True)
    delta = (do.float() * out.float()).sum(-1)
    for _ in range(4):  # NaN-filled blocks of dK / dV's size back in the allocator's cache
        torch.full((1, tk, Hkv, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    dq, dk, dv = kern.backward(q, k, v, mask, D ** -0.5, do, lse, delta, st, native=True)
    assert (dk[256:512] == 0).all() and (dv[256:512] == 0).all()
    ref = mb.interval_attention_reference(q, k, v, mask, D ** -0.5, do)
    err = mb.kernel_errors(out.float(), lse, (dq.float(), dk.float(), dv.float()), ref)
    assert err["nonfinite"] == 0 and all(err[n] < TOL[torch.bfloat16] for n in ("out", "dq", "dk", "dv")), err


@gpu
def test_gpu_global_lse_backward_over_a_key_split():
    """The Split-KV path: forward per key part, lse merge, each part's backward with the GLOBAL lse and
    delta; the summed dq and the concatenated dk / dv equal the float64 reference of the whole."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    B, nb, Hq, Hkv, D, dt = 16, 40, 32, 8, 128, torch.bfloat16
    parts = (1000, 1700)
    whole = _to(_mask(gen, nb, B, sum(parts), False, dflash=True), "cuda")
    q, k, v, do = _inputs(gen, nb * B, sum(parts), Hq, Hkv, D, dt)
    masks, a = [], 0
    for n in parts:  # the whole mask's intervals clipped to each part, shifted to its local keys
        lo = (whole.lo.clamp(a, a + n) - a)
        hi = (whole.hi.clamp(a, a + n) - a)
        masks.append(IntervalMask(B, lo, torch.maximum(lo, hi), n))
        a += n
    kern = fa4.FA4AttentionKernel()
    scale = D ** -0.5
    ks, vs = k.split(parts), v.split(parts)
    res = [kern.forward(q, kk, vv, m, scale) for kk, vv, m in zip(ks, vs, masks)]
    lse = torch.logsumexp(torch.stack([r[1] for r in res]), 0)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = sum(torch.exp(r[1] - safe)[..., None] * r[0] for r in res)
    delta = (do.float() * out).sum(-1)
    grads = [kern.backward(q, kk, vv, m, scale, do, lse, delta, r[2]) for kk, vv, m, r in zip(ks, vs, masks, res)]
    dq = sum(g[0] for g in grads)
    dk, dv = torch.cat([g[1] for g in grads]), torch.cat([g[2] for g in grads])
    ref = mb.interval_attention_reference(q, k, v, whole, scale, do)
    err = mb.kernel_errors(out, lse, (dq, dk, dv), ref)
    assert err["nonfinite"] == 0 and err["lse"] < 2e-2, (seed, err)
    for name in ("out", "dq", "dk", "dv"):
        assert err[name] < 2e-2, (name, seed, err)


@gpu
def test_gpu_native_results_are_the_upcast_values_and_tables_are_cached():
    gen = torch.Generator().manual_seed(new_seed())
    mask = _to(_mask(gen, 20, 16, 900, True), "cuda")
    q, k, v, do = _inputs(gen, 320, mask.num_keys, 8, 2, 64, torch.bfloat16)
    kern = fa4.FA4AttentionKernel()
    o32, l32, _ = kern.forward(q, k, v, mask, 0.125)
    on, ln, _ = kern.forward(q, k, v, mask, 0.125, native=True)
    assert on.dtype == torch.bfloat16 and torch.equal(on.float(), o32) and torch.equal(ln, l32)
    assert len(mask._fa4_tables) == 1  # built once, reused by the second forward
    delta = (do.float() * o32).sum(-1)
    g32 = kern.backward(q, k, v, mask, 0.125, do, l32, delta, None)
    gn = kern.backward(q, k, v, mask, 0.125, do, l32, delta, None, native=True)
    for a, b in zip(g32, gn):  # two backward runs: FA4's dQ atomics are not bit-stable, dK / dV are
        assert b.dtype == torch.bfloat16 and a.dtype == torch.float32
        assert mb.rel_err(b.float(), a) < 1e-2


@gpu
def test_gpu_empty_inputs_and_errors():
    kern = fa4.FA4AttentionKernel()
    q = torch.randn(32, 4, 64, device="cuda", dtype=torch.bfloat16)
    k0 = q.new_empty((0, 2, 64))
    m = IntervalMask(16, torch.zeros(2, dtype=torch.long, device="cuda"), torch.zeros(2, dtype=torch.long,
                     device="cuda"), 0)
    out, lse, _ = kern.forward(q, k0, k0, m, 0.1)
    assert (out == 0).all() and torch.isneginf(lse).all()
    dq, dk, dv = kern.backward(q, k0, k0, m, 0.1, q, lse, torch.zeros_like(lse), None)
    assert (dq == 0).all() and dk.shape == (0, 2, 64)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        kern.forward(q.float(), k0.float(), k0.float(), m, 0.1)


@gpu
@pytest.mark.parametrize("k_chunks", [1, 2])
def test_gpu_splitkv_op_with_fa4(k_chunks):
    """The op at CP = 1 with backend fa4 (packed sequences, invalid / zero anchors, own block fused)
    against the single-process float64 reference, forward and all five gradients."""
    c = case(new_seed(), 1, B=16, Hq=8, Hkv=2, D=64, dtype="bfloat16", seq_lens=[700, 333], blocks=[24],
             num_chunks=k_chunks, device="cuda", backend="fa4")
    res = run_local("splitkv", c, 0)
    torch.cuda.synchronize()
    check("splitkv", c, [res])


@gpu
def test_gpu_deterministic_mode_is_refused_before_any_work():
    """FA4 has no deterministic block-sparse backward on sm90: with torch's deterministic algorithms on,
    check_dtype (what the ops call before their first collective) raises naming the alternative."""
    kern = fa4.FA4AttentionKernel()
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(ValueError, match="deterministic.*'flex'"):
            kern.check_dtype(torch.bfloat16, "cuda")
    finally:
        torch.use_deterministic_algorithms(prev)
    kern.check_dtype(torch.bfloat16, "cuda")


def test_runs_on_only_the_verified_architecture(monkeypatch):
    """Hopper (sm90) only: FA4's Blackwell kernels take 256-row query tiles where these tables have 128 rows,
    and nothing was measured there, so neither "auto" nor fa4_runs_on choose it on sm100 / sm110."""
    monkeypatch.setattr(fa4, "half_precision_cuda_index", lambda device, dtype, head_dim=None: 0)
    monkeypatch.setattr(fa4, "fa4_available", lambda: True)
    monkeypatch.setattr(fa4, "fa4_importable", lambda: True)
    for cap, ok in (((9, 0), True), ((10, 0), False), ((11, 0), False), ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None, c=cap: c)
        assert fa4.fa4_runs_on("cuda", torch.bfloat16, 128) is ok, cap
