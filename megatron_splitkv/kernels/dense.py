"""Helpers shared by the local kernels that run DENSE fused attention on pieces of the interval mask
(`kernels/te.py`: Transformer Engine segments; `kernels/staircase.py`: cuDNN rectangles).

Source: DESIGN.md section 2 (backward step 2: the local backward takes the GLOBAL lse and
delta = rowsum(dO * O_final)); docs/kernels.md ("Transformer Engine", "Staircase").

* `fold_heads` / `unfold_heads`: grouped-query attention folded into rows, so a multi-head dense kernel
  serves GQA without repeating K/V: query head h * G + g (G = Hq // Hkv) of row r becomes row r * G + g
  of kv head h. One copy of the tensor.
* `out_for_delta`: fused attention backwards (cuDNN, TE, FlashAttention) take the softmax statistics as
  an input but compute delta = rowsum(dO * O) themselves from an O tensor. The contract's backward gets
  delta, not O (the final merged O lives on the query owner). An O' with rowsum(dO * O') = delta is
  O' = dO * delta / |dO|^2 (rowwise), rounded to the kernel's input dtype: the implied delta then has a
  relative error <= one rounding of that dtype (2**-9 for bf16), since
  rowsum(dO * round(dO * c)) = c |dO|^2 (1 + weighted mean of the roundings). Rows where this is not
  representable are flagged: dO = 0 (or |dO|^2 below the smallest normal of the accumulation dtype) with
  delta != 0 (only possible through a gradient of the returned lse), and rows whose O' overflows the
  input dtype (tiny dO with a large delta, e.g. |dO| ~ 1e-7 in fp16). The caller must serve the flagged
  rows another way (te.py: the math kernel's backward for the whole call; staircase.py: those rows'
  dense part through the math kernel).
"""

from __future__ import annotations

import torch

__all__ = ["fold_heads", "unfold_heads", "out_for_delta", "acc_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation / result dtype of the kernel contract: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fold_heads(x: torch.Tensor, hkv: int, dtype: torch.dtype = None) -> torch.Tensor:
    """[T, Hq, ...] -> [T * G, Hkv, ...] (G = Hq // hkv): query head h * G + g of row r -> row r * G + g,
    head h. One copy (unless G == 1 and no conversion, then x itself); `dtype` (default x's): the copy's
    dtype, converted in the same pass."""
    t, hq = x.shape[:2]
    g = hq // hkv
    dtype = x.dtype if dtype is None else dtype
    if g == 1:
        return x.to(dtype)
    out = torch.empty((t * g, hkv) + tuple(x.shape[2:]), dtype=dtype, device=x.device)
    out.view(t, g, hkv, *x.shape[2:]).copy_(x.unflatten(1, (hkv, g)).transpose(1, 2))
    return out


def unfold_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """Inverse of `fold_heads`: [T * G, Hkv, ...] -> [T, Hq, ...]. A copy (unless G == 1)."""
    tg, hkv = x.shape[:2]
    g = hq // hkv
    if g == 1:
        return x
    return x.reshape(tg // g, g, hkv, *x.shape[2:]).transpose(1, 2).reshape(tg // g, hq, *x.shape[2:])


def out_for_delta(dout: torch.Tensor, delta: torch.Tensor, dtype: torch.dtype):
    """O' in `dtype` with rowsum(dO * O') = delta, and the rows where that is not representable.

    Args:
        dout: [..., D] the upstream gradient as the dense kernel will read it (already in `dtype`).
        delta: [...] float32/float64, the GLOBAL rowsum(dO * O_final) (minus the lse gradient).
        dtype: the dense kernel's input dtype.

    Returns:
        (o_prime [..., D] in `dtype`, bad [...] bool): bad rows are dO = 0 or |dO|^2 subnormal in the
        accumulation dtype with delta != 0, and rows whose O' is not finite in `dtype` (module docstring).
        On bad rows o_prime is arbitrary (possibly inf/NaN): the caller must not use it there.
    """
    acc = acc_dtype(dtype)
    delta = delta.to(acc)
    # |dO|^2 accumulated in `acc` straight from dout (no converted copy), then O' = dO * c computed in acc
    # and rounded to `dtype` in the same pass (out=): the values of (dO.to(acc) * c).to(dtype)
    sq = torch.linalg.vector_norm(dout, dim=-1, dtype=acc).square_()
    c = delta / torch.where(sq > 0, sq, 1.0)  # a scalar 1: no ones_like fill
    o = torch.empty(dout.shape, dtype=dtype, device=dout.device)
    torch.mul(dout, c[..., None], out=o)
    # ~isfinite(o).all(-1) as ~(|o| < inf).all(-1): the same verdict (NaN and +-inf fail) in fewer ops
    bad = ((sq < torch.finfo(acc).tiny) & (delta != 0)) | ~(o.abs() < float("inf")).all(-1)
    return o, bad
