"""Fused merges of Split-KV's partial states (`megatron_splitkv.ops.fused_merge`, docs/lab/perf-notes.md item 11).

- `merge_packed` (torch path) against the float64 merge formula (DESIGN.md section 2, forward step 3) on
  packed bf16 / fp16 / fp32 partials with partly and wholly empty (-inf) rows: exact to fp32 rounding,
  rows with every partial empty give out 0 and lse -inf, never NaN;
- its Triton kernel, run by Triton's interpreter on the CPU (a subprocess with TRITON_INTERPRET=1), and on
  CUDA when there is a GPU, against the torch path;
- the fused flex backward tangents' Triton kernel (`kernels.flex_bwd_prep`) likewise in the interpreter
  (fp32: the interpreter's bf16 rounding is not the GPU's);
- `sum_partials` against a float64 sum.
"""

import os
import textwrap

import pytest
import torch

from _splitkv_helpers import run_in_triton_interpreter

from megatron_splitkv.ops import fused_merge as fm
from megatron_splitkv.ops.common import pack_partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _partials(g, P, rows, H, D, dt):
    """Packed partials [P * rows, H, D + r] in dt, and the float64 (o, lse) they hold."""
    o = torch.randn(P, rows, H, D, generator=g).to(dt)
    lse = torch.randn(P, rows, H, generator=g) * 3
    if rows:
        lse[:, 0] = float("-inf")  # every partial empty
        lse[0, 1:3] = float("-inf")  # one partial empty
    x = pack_partial(o, lse, dt)
    return x.reshape(P * rows, H, x.shape[-1]), o.double(), lse.double()


def _reference(o, lse):
    m = lse.max(0).values
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)
    den = w.sum(0)
    out = (w[..., None] * o).sum(0) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return out, m_safe + torch.log(den)


CASES = [(3, 37, 2, 16), (1, 5, 3, 8), (4, 0, 2, 16), (2, 19, 1, 80), (8, 9, 2, 128)]


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("P,rows,H,D", CASES)
def test_merge_packed_torch_matches_float64(dt, P, rows, H, D):
    g = torch.Generator().manual_seed(P * 100 + rows)
    x, o, lse = _partials(g, P, rows, H, D, dt)
    out, l = fm.merge_packed(x, P, rows, D, torch.float32)
    assert out.dtype == l.dtype == torch.float32 and out.shape == (rows, H, D) and l.shape == (rows, H)
    ref_o, ref_l = _reference(o, lse)
    torch.testing.assert_close(out.double(), ref_o, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.isinf(l), torch.isinf(ref_l))
    torch.testing.assert_close(l.double().nan_to_num(0.0, neginf=0.0), ref_l.nan_to_num(0.0, neginf=0.0),
                               rtol=1e-6, atol=1e-6)
    assert torch.isfinite(out).all()
    if rows:
        assert (out[0] == 0).all() and (l[0] == float("-inf")).all()


def test_sum_partials_matches_float64():
    g = torch.Generator().manual_seed(5)
    for P in (1, 2, 7):
        parts = torch.randn(P, 11, 3, 8, generator=g).to(torch.bfloat16)
        s = fm.sum_partials(parts, torch.float32)
        assert s.dtype == torch.float32 and s.shape == (11, 3, 8)
        torch.testing.assert_close(s.double(), parts.double().sum(0), rtol=1e-6, atol=1e-6)


_INTERP = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_fused_merge import CASES, _partials
    from megatron_splitkv.ops import fused_merge as fm
    from megatron_splitkv.kernels import flex_bwd_prep as fp
    assert fm.use_triton(torch.zeros(1), torch.float32)  # the interpreter counts as a Triton device
    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float32):
        for P, rows, H, D in CASES:
            x, _, _ = _partials(g, P, rows, H, D, dt)
            a = fm.merge_packed_torch(x, P, rows, D, torch.float32)
            b = fm.merge_packed_triton(x, P, rows, D)
            torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)
            assert torch.equal(torch.isinf(a[1]), torch.isinf(b[1]))
            torch.testing.assert_close(b[1].nan_to_num(0.0, neginf=0.0), a[1].nan_to_num(0.0, neginf=0.0),
                                       rtol=1e-6, atol=1e-6)
    # flex backward tangents, fp32 (the interpreter rounds fp32 -> bf16 differently from the GPU)
    Tq, Hq, D = 45, 3, 80
    dout = torch.randn(Tq, Hq, D, generator=g)
    o_r = torch.randn(1, Hq, Tq + 5, D, generator=g)[0, :, :Tq].permute(1, 0, 2)
    lse_r = torch.randn(Tq, Hq, generator=g)
    lse_r[::7] = float("-inf")
    lse_g = lse_r.nan_to_num(neginf=0.0) + torch.rand(Tq, Hq, generator=g)
    lse_g[3::11] = float("-inf")
    delta = torch.randn(Tq, Hq, generator=g)
    outs = []
    for fn in (fp.grad_tangents_torch, fp.grad_tangents_triton):
        go, gl = torch.zeros(Tq + 2, Hq, D), torch.zeros(Tq + 2, Hq)
        fn(dout, o_r, lse_r, lse_g, delta, go, gl)
        outs.append((go, gl))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)
    print("interpreter ok")
""")


def test_triton_kernels_in_the_interpreter():
    """The Triton merge and tangents kernels, run by Triton's CPU interpreter, equal the torch paths."""
    pytest.importorskip("triton")
    run_in_triton_interpreter(_INTERP.format(tests=os.path.join(ROOT, "tests")), "interpreter ok", 600)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_merge_packed_triton_on_cuda(dt):
    g = torch.Generator().manual_seed(9)
    for P, rows, H, D in CASES + [(64, 128, 32, 128), (8, 1024, 32, 128)]:
        x, o, lse = _partials(g, P, rows, H, D, dt)
        x = x.cuda()
        assert fm.use_triton(x, torch.float32)
        a = fm.merge_packed_torch(x, P, rows, D, torch.float32)
        b = fm.merge_packed(x, P, rows, D, torch.float32)
        torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(torch.isinf(a[1]), torch.isinf(b[1]))
        ref_o, _ = _reference(o, lse)
        torch.testing.assert_close(b[0].double().cpu(), ref_o, rtol=1e-5, atol=1e-6)


def test_triton_failure_falls_back_to_torch_with_a_warning(monkeypatch):
    """A Triton merge that fails to compile / launch warns once and the torch path serves (same result)."""
    g = torch.Generator().manual_seed(11)
    x, o, lse = _partials(g, 3, 10, 2, 16, torch.bfloat16)
    monkeypatch.setattr(fm, "use_triton", lambda *_: True)
    monkeypatch.setattr(fm, "_TRITON_FAILED", False)

    def boom(*_a, **_k):
        raise RuntimeError("no GPU for this kernel")

    monkeypatch.setattr(fm, "merge_packed_triton", boom)
    with pytest.warns(RuntimeWarning, match="Triton merge kernel failed"):
        out, l = fm.merge_packed(x, 3, 10, 16, torch.float32)
    ref = fm.merge_packed_torch(x, 3, 10, 16, torch.float32)
    assert torch.equal(out, ref[0]) and torch.equal(l, ref[1])
    assert fm._TRITON_FAILED
    out2, _ = fm.merge_packed(x, 3, 10, 16, torch.float32)  # no second warning, torch path
    assert torch.equal(out2, ref[0])
