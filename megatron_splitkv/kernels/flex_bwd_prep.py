"""The backward tangents of FlexAttention under a GLOBAL lse: grad_out = c * dO, grad_lse = rowsum(grad_out * O_r) - c * delta.

Source: the global-lse backward of `kernels/flex.py` (module docstring; DESIGN.md section 2, backward
step 2). With this rank's flex forward (O_r, lse_r) and the merged (global) lse and delta,
c = exp(lse_r - lse) (0 where either is not finite), autograd through flex with these two tangents gives
the gradients of the global softmax.

Two implementations of the same arithmetic (fp32 inside, grad_out rounded to the input dtype BEFORE the
row sum, exactly as flex then sees it):

* `grad_tangents_triton`: one fused Triton kernel (CUDA): reads dO and O_r once in the input dtype,
  writes grad_out (input dtype) and grad_lse (fp32); one launch, no fp32 temporary. The torch version below
  needs ~10 launches per row chunk (8 chunks at 8192 rows x 32 heads x 128) plus a [rows, Hq, D] fp32
  temporary; at 16K context on 2 H200s its launches were exposed (the op became launch-bound right after
  the dO all-gather): docs/lab/perf-notes.md, "16K regression".
* `grad_tangents_torch`: torch ops over row chunks of at most `row_chunk_elems` elements (CPU, and CUDA
  without Triton).

Both write rows [0, Tq) of preallocated buffers (the caller zeroes the padding rows).
"""

from __future__ import annotations

import torch

from .._triton import lazy_triton_kernel


#: Row chunk (elements of [rows, Hq, D]) of the torch path: bounds its fp32 temporary (2**22 elements =
#: 16 MiB) instead of three [Tq, Hq, D] fp32 ones.
ROW_CHUNK_ELEMS = 1 << 22


@lazy_triton_kernel
def _triton_kernel(triton, tl):
    """The tangents kernel: `_triton_kernel()` returns it, defined on first use, or None without Triton
    (`lazy_triton_kernel`)."""

    @triton.jit
    def _tangents(do_ptr, o_ptr, lr_ptr, lg_ptr, dl_ptr, go_ptr, gl_ptr, Tq,
                  s_do_t, s_do_h, s_o_t, s_o_h, s_lr_t, s_lr_h, s_lg_t, s_lg_h, s_dl_t, s_dl_h,
                  s_go_t, s_go_h, s_gl_t, s_gl_h,
                  D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < Tq
        d = tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (d < D)[None, :]
        lr = tl.load(lr_ptr + rows * s_lr_t + h * s_lr_h, mask=rmask, other=float("-inf")).to(tl.float32)
        lg = tl.load(lg_ptr + rows * s_lg_t + h * s_lg_h, mask=rmask, other=float("-inf")).to(tl.float32)
        dl = tl.load(dl_ptr + rows * s_dl_t + h * s_dl_h, mask=rmask, other=0.0).to(tl.float32)
        inf = float("inf")
        finite = (lr > -inf) & (lr < inf) & (lg > -inf) & (lg < inf)  # NaN compares False
        c = tl.where(finite, tl.exp(tl.where(finite, lr - lg, 0.0)), 0.0)
        do = tl.load(do_ptr + rows[:, None] * s_do_t + h * s_do_h + d[None, :], mask=m2, other=0.0)
        go = (do.to(tl.float32) * c[:, None]).to(go_ptr.dtype.element_ty)  # RTNE (Triton default)
        tl.store(go_ptr + rows[:, None] * s_go_t + h * s_go_h + d[None, :], go, mask=m2)
        o = tl.load(o_ptr + rows[:, None] * s_o_t + h * s_o_h + d[None, :], mask=m2, other=0.0)
        gl = tl.sum(go.to(tl.float32) * o.to(tl.float32), axis=1) - c * dl
        gl = tl.where(finite, gl, 0.0)
        tl.store(gl_ptr + rows * s_gl_t + h * s_gl_h, gl, mask=rmask)

    return _tangents


def use_triton(dout: torch.Tensor, o_r: torch.Tensor) -> bool:
    """Whether `grad_tangents` takes the Triton path: CUDA tensors, Triton importable, unit stride on D."""
    if not (dout.is_cuda and o_r.is_cuda):
        return False
    if dout.stride(-1) != 1 or o_r.stride(-1) != 1:
        return False
    return _triton_kernel() is not None


def grad_tangents_triton(dout, o_r, lse_r, lse_g, delta_g, g_out, g_lse) -> None:
    """Fused Triton version of `grad_tangents` (same arguments; CUDA, unit stride on D)."""
    kern = _triton_kernel()
    Tq, Hq, D = dout.shape
    if Tq == 0:
        return
    block_d = max(16, 1 << (D - 1).bit_length())
    block_r = max(1, min(32, 4096 // block_d))
    grid = ((Tq + block_r - 1) // block_r, Hq)
    kern[grid](dout, o_r, lse_r, lse_g, delta_g, g_out, g_lse, Tq,
               dout.stride(0), dout.stride(1), o_r.stride(0), o_r.stride(1),
               lse_r.stride(0), lse_r.stride(1), lse_g.stride(0), lse_g.stride(1),
               delta_g.stride(0), delta_g.stride(1), g_out.stride(0), g_out.stride(1),
               g_lse.stride(0), g_lse.stride(1),
               D=D, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)


def grad_tangents_torch(dout, o_r, lse_r, lse_g, delta_g, g_out, g_lse, *, acc=torch.float32,
                        row_chunk_elems: int | None = None) -> None:
    """Torch version of `grad_tangents` over row chunks of at most `row_chunk_elems` elements (per element
    the same fp32 operations as the unchunked expressions; the row sums reduce over D of a contiguous
    fp32 [rows, Hq, D] block). `row_chunk_elems` None: `ROW_CHUNK_ELEMS`."""
    Tq, Hq, D = dout.shape
    row_chunk_elems = ROW_CHUNK_ELEMS if row_chunk_elems is None else row_chunk_elems
    finite = torch.isfinite(lse_r) & torch.isfinite(lse_g)
    c = torch.where(finite, torch.exp(torch.where(finite, lse_r.to(acc) - lse_g.to(acc), torch.zeros_like(lse_r, dtype=acc))),
                    torch.zeros_like(lse_r, dtype=acc))  # [Tq, Hq]
    delta_g = delta_g.to(acc)
    step = max(1, row_chunk_elems // max(1, Hq * D))
    for r0 in range(0, Tq, step):
        r1 = min(Tq, r0 + step)
        t = torch.empty((r1 - r0, Hq, D), dtype=acc, device=dout.device).copy_(dout[r0:r1])
        t.mul_(c[r0:r1, :, None])
        g_out[r0:r1].copy_(t)  # rounded as flex will see it
        t.copy_(g_out[r0:r1])
        t.mul_(o_r[r0:r1])
        g_l = t.sum(-1) - c[r0:r1] * delta_g[r0:r1]
        del t
        g_lse[r0:r1] = torch.where(finite[r0:r1], g_l, torch.zeros_like(g_l))
        del g_l


def grad_tangents(dout, o_r, lse_r, lse_g, delta_g, g_out, g_lse, *, acc=torch.float32) -> None:
    """Write grad_out = c * dO (rounded to g_out's dtype) into g_out[:Tq] and grad_lse = rowsum(grad_out *
    O_r) - c * delta (0 on rows where lse_r or lse is not finite) into g_lse[:Tq], c = exp(lse_r - lse).

    Args:
        dout: [Tq, Hq, D] global dO rows (any float dtype, any strides).
        o_r: [Tq, Hq, D] this rank's flex output O_r (input dtype; a permuted view of flex's [1, Hq, T, D]).
        lse_r: [Tq, Hq] this rank's flex lse (fp32, natural log; -inf on rows without a visible key).
        lse_g, delta_g: [Tq, Hq] the GLOBAL merged lse and delta = rowsum(dO * O_final) (fp32 / fp64).
        g_out: [>= Tq, Hq, D] output buffer in the input dtype; g_lse: [>= Tq, Hq] output buffer, fp32.
        acc: arithmetic dtype of the torch path (float64 for the CPU float64 emulation).

    Raises: nothing of its own (shapes are the caller's, `FlexAttentionKernel.backward`).
    """
    if acc == torch.float32 and use_triton(dout, o_r):
        grad_tangents_triton(dout, o_r, lse_r, lse_g, delta_g, g_out, g_lse)
    else:
        grad_tangents_torch(dout, o_r, lse_r, lse_g, delta_g, g_out, g_lse, acc=acc)
