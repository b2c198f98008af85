"""Fused merges of Split-KV's partial states on the receiving rank (the owner, or a node in the two-level
all-to-all): the lse merge of P packed [O | lse] partials and the fp32 sum of P dQ partials.

Source: DESIGN.md section 2 (forward step 3: lse = logsumexp_r lse_r, O = sum_r exp(lse_r - lse) O_r in
fp32; backward step 3: dQ = sum_r dQ_r in fp32), issue 6 deliverable 3 ("fuse the lse merge"),
docs/lab/perf-notes.md item 11.

`merge_packed` reads the all-to-all's receive buffer once: on CUDA with fp32 accumulation, ONE Triton kernel
per call (per row tile and head: the max of the P partial lse, then the weighted sum of the P partial O rows in
fp32, the division and the merged lse), instead of the torch path's unpack to an fp32 copy of all P partials,
max, exp, an einsum, a sum, a division and a log (~8 launches and a [P, rows, H, D] fp32 temporary). Elsewhere
(CPU, float64, no Triton) the torch path. `sum_partials` sums P partials in ONE reduction (fp32 accumulator),
instead of P in-place additions (P launches: ~0.3-0.6 ms of launch latency at P = 64).

Both are exact to fp32 rounding against the float64 reference; the order of the P terms may differ from
the torch path's (reassociation only).
"""

from __future__ import annotations

import warnings

import torch

from .._triton import lazy_triton_kernel
from ..lse import finalize, lse_weights
from .common import unpack_partial

_TRITON_FAILED = False  # set when the kernel failed to compile / launch: the torch path from then on


@lazy_triton_kernel
def _triton_kernel(triton, tl):
    """The merge kernel: `_triton_kernel()` returns it, defined on first use, or None without Triton
    (`lazy_triton_kernel`)."""

    @triton.jit
    def _merge(x_ptr, l_ptr, o_ptr, lo_ptr, rows, H, s_xp, s_xt, s_xh, s_lp, s_lt, s_lh, l_off,
               s_ot, s_oh, s_lot, s_loh,
               P: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        # P is a compile-time constant: one compiled variant per partial count (the CP size or the
        # ranks per node: a handful per job), the loops over partials unrolled
        pid = tl.program_id(0)
        h = tl.program_id(1)
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < rows
        d = tl.arange(0, BLOCK_D)
        m2 = tm[:, None] & (d < D)[None, :]
        ninf = float("-inf")
        m = tl.full([BLOCK_T], ninf, tl.float32)
        for p in range(P):
            lp = tl.load(l_ptr + p * s_lp + t * s_lt + h * s_lh + l_off, mask=tm, other=ninf)
            m = tl.maximum(m, lp)
        m_safe = tl.where(m > ninf, m, 0.0)  # every partial -inf: weights exp(-inf) = 0
        num = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        den = tl.zeros([BLOCK_T], tl.float32)
        for p in range(P):
            lp = tl.load(l_ptr + p * s_lp + t * s_lt + h * s_lh + l_off, mask=tm, other=ninf)
            w = tl.exp(lp - m_safe)
            o = tl.load(x_ptr + p * s_xp + t[:, None] * s_xt + h * s_xh + d[None, :], mask=m2, other=0.0)
            num += w[:, None] * o.to(tl.float32)
            den += w
        den_safe = tl.where(den > 0, den, 1.0)
        tl.store(o_ptr + t[:, None] * s_ot + h * s_oh + d[None, :], num / den_safe[:, None], mask=m2)
        tl.store(lo_ptr + t * s_lot + h * s_loh, m_safe + tl.log(den), mask=tm)

    return _merge


def use_triton(x: torch.Tensor, acc: torch.dtype) -> bool:
    """Whether `merge_packed` runs the Triton kernel: fp32 accumulation, Triton importable, and `x` on CUDA or
    the kernel run by Triton's CPU interpreter (Triton's own switch, which `triton.jit` reads when it defines
    the kernel; this module reads no environment variable)."""
    if acc != torch.float32:
        return False
    if x.is_cuda:
        return _triton_kernel() is not None
    kernel = _triton_kernel()
    return kernel is not None and _interpreted(kernel)


def _interpreted(kernel) -> bool:
    """Whether `kernel` (a `triton.jit` function) runs in Triton's CPU interpreter."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter
        return False
    return isinstance(kernel, InterpretedFunction)


def merge_packed_torch(x: torch.Tensor, num_partials: int, rows: int, head_dim: int, acc: torch.dtype):
    """The torch path of `merge_packed` (unpack to `acc`, max, weights, weighted sum, finalize)."""
    o, lse = unpack_partial(x, head_dim, acc)
    o = o.view(num_partials, rows, *o.shape[1:])  # rows may be 0: no -1
    lse = lse.view(num_partials, rows, *lse.shape[1:])
    m_safe, w = lse_weights(lse, lse.max(0).values)
    num = torch.einsum("pthd,pth->thd", o, w)
    del o
    return finalize(num, w.sum(0), m_safe, inplace=True)


def merges_in_place(device, dtype: torch.dtype, head_dim: int, acc: torch.dtype) -> bool:
    """Whether `merge_packed` of a received buffer of `dtype` on `device` runs the Triton kernel, which writes
    its results straight into an `out=` destination (Split-KV's chunked forward then merges every chunk into
    one preallocated output instead of concatenating the chunks' results: one [rows, H, D] fp32 copy and two
    launches less per call). Host-side only."""
    esz = torch.empty((), dtype=dtype, device="meta").element_size()
    return (not _TRITON_FAILED and esz in (2, 4) and (head_dim * esz) % 4 == 0
            and use_triton(_DeviceOnly(torch.device(device)), acc))


class _DeviceOnly:
    """What `use_triton` reads of a tensor (is_cuda), for `merges_in_place` before the buffer exists."""

    def __init__(self, device):
        self.is_cuda = device.type == "cuda"


def merge_packed_triton(x: torch.Tensor, num_partials: int, rows: int, head_dim: int, out=None):
    """The Triton path of `merge_packed` (fp32 accumulation; x contiguous [P * rows, H, D + r]). out:
    optional (o [rows, H, D], lse [rows, H]) fp32 destinations (unit stride on D), written and returned."""
    H = x.shape[1]
    if out is not None:
        out, lse = out
    else:
        out = torch.empty((rows, H, head_dim), dtype=torch.float32, device=x.device)
        lse = torch.empty((rows, H), dtype=torch.float32, device=x.device)
    if rows == 0 or H == 0:
        return out, lse
    x = x.contiguous()
    w = x.shape[2]  # D + r elements of x's dtype per (row, head)
    esz = x.element_size()
    # the packed lse as fp32: the same storage viewed as 4-byte words (row pitch w * esz bytes, a multiple
    # of 4: D + r elements of 2 or 4 bytes with r = 4 / esz), lse at element D of each (row, head)
    lw = x.view(-1).view(torch.float32)
    words = w * esz // 4
    l_off = head_dim * esz // 4
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    block_t = max(1, min(32, 4096 // block_d))
    grid = ((rows + block_t - 1) // block_t, H)
    _triton_kernel()[grid](x, lw, out, lse, rows, H,
                           rows * H * w, H * w, w, rows * H * words, H * words, words, l_off,
                           out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
                           P=num_partials, D=head_dim, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    return out, lse


def merge_packed(x: torch.Tensor, num_partials: int, rows: int, head_dim: int, acc: torch.dtype, out=None):
    """Exact lse merge of P packed partial states of the same rows.

    Args:
        x: [P * rows, H, D + r] in the transport dtype (bf16 / fp16 / fp32 / fp64): partial p's rows at
            [p * rows, (p + 1) * rows), each (row, head) = O_p (D elements) then lse_p bit-packed in r
            elements (`ops.common.pack_partial`; lse float32, or float64 for float64).
        num_partials: P (>= 1). rows: rows per partial (>= 0). head_dim: D. acc: float32 or float64.
        out: optional (o [rows, H, D], lse [rows, H]) destinations in `acc` (unit stride on D): the results
            are written there (by the Triton kernel itself; the torch path copies them) and returned.

    Returns:
        (out [rows, H, D], lse [rows, H]) in `acc`: lse = logsumexp_p lse_p, out = sum_p exp(lse_p - lse) O_p;
        rows whose every partial has lse = -inf give out 0 and lse -inf (never NaN).

    Raises: nothing of its own (the caller's shapes). The Triton kernel (new in session 4, checked in
    Triton's interpreter and by tests/test_fused_merge.py on CUDA) falls back to the torch path with a
    RuntimeWarning if it ever fails to compile or launch."""
    global _TRITON_FAILED
    if not _TRITON_FAILED and use_triton(x, acc) and x.element_size() in (2, 4) \
            and (head_dim * x.element_size()) % 4 == 0:
        try:
            return merge_packed_triton(x, num_partials, rows, head_dim, out=out)
        except Exception as exc:  # noqa: BLE001 - a compile / launch failure: the torch path, once warned
            _TRITON_FAILED = True
            warnings.warn(f"megatron_splitkv: the Triton merge kernel failed ({type(exc).__name__}: {exc}); "
                          "using the torch merge from now on",
                          RuntimeWarning, stacklevel=2)
    o, lse = merge_packed_torch(x, num_partials, rows, head_dim, acc)
    if out is None:
        return o, lse
    out[0].copy_(o)
    out[1].copy_(lse)
    return out


def sum_partials(parts: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """parts [P, rows, ...] (any float dtype) -> their sum over P in `acc` (float32 / float64), in ONE
    reduction with an `acc` accumulator (no [P, rows, ...] `acc` copy, no per-partial launches)."""
    if parts.shape[0] == 1:
        return parts[0].to(acc)
    return torch.sum(parts, 0, dtype=acc)


def merge_received_partials(pending, num_partials: int, rows: int, head_dim: int, acc: torch.dtype, out=None):
    """`merge_packed` of an all-to-all's result of packed partials (`common.pack_partial`), [P * rows, H, D + r]
    in a `comm.Pending`, released once merged. Returns (out [rows, H, D], lse [rows, H]) in `acc` (written into
    `out`, a pair of destinations, when given: `merges_in_place`)."""
    return merge_packed(pending.take(), num_partials, rows, head_dim, acc, out=out)
