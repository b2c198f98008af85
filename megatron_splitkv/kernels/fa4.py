"""FlashAttention-4 (CuTe DSL) local kernel for interval masks (issue 6, docs/kernels.md "FA4 kernel").

FlashAttention-4 (`flash-attn-4`, the `flash_attn.cute` package on top of `nvidia-cutlass-dsl`) runs the
FlashAttention-3 style warp-specialised Hopper (sm90) and Blackwell (sm100) kernels with two FlexAttention
extensions: block-sparse iteration over (query tile, key tile) tables and a `mask_mod` evaluated on the
partial tiles. This module calls its forward and backward entry points DIRECTLY (not through
`torch.compile` of `flex_attention(..., kernel_options={"BACKEND": "FLASH"})`), because the Split-KV
backward (DESIGN.md section 2, backward step 2) needs the GLOBAL lse and delta, which the direct backward
takes as inputs:

    forward   out_r, lse_r = FA4(q, k, v; interval mask)           (lse natural log, [1, Hq, Tq] fp32)
    backward  FA4_bwd(q, k, v, out = 0, dout = dO, lse = lse_global, dlse = -delta)
              FA4's preprocess forms D' = rowsum(dout * out) - dlse = delta exactly (fp32), and its
              kernels use P = exp(scale q k^T - lse_global): dV = P^T dO, dS = P (dO V^T - delta), ...

so no rescaled grad_out (FlexAttention's path, kernels/flex.py) and no extra rounding of dO.

Mask: the `IntervalMask` (kernels/base.py) gives every query block one key interval [lo, hi) and
optionally a second (own-block) one. The per-row intervals are int32 "aux tensors" read by a CuTe
`mask_mod` (`_mask_mods`), and the (query tile, key tile) classification is the one FlexAttention's
BlockMask uses (`kernels.flex._block_tables`: partial and full tiles, key-major for the forward,
query-major for the backward), computed once per mask and cached on it.

GQA fold (`fold_gqa`, default off until measured on a GPU: docs/lab/packs_accounting.md): with G = Hq / Hkv > 1 the call runs on the folded problem, where the G query
heads of each kv head are G copies of each query block's rows (`fold_rows`, `fold_gqa_mask`): FA4 sees Hkv heads
and Tq * G rows, so its backward takes the MHA path (one CTA per (key tile, kv head) accumulating dK / dV of
the G heads in registers, written once) instead of its GQA path (one CTA per (key tile, query head), dK / dV
summed through zero-filled fp32 accumulators by reduce-adds and a postprocess), and a 128-row query tile holds
2 blocks of G heads instead of 8 blocks of one. Same pairs, same per-element arithmetic; the accounting and the
predicted gain on packs: docs/lab/packs_accounting.md.

Availability: optional. `pip install flash-attn-4 nvidia-cutlass-dsl` (extra `fa4`); CUDA devices of
compute capability 9.x (Hopper; FA4's Blackwell kernels are not verified with these tables, see
`VERIFIED_MAJORS`); bf16 / fp16; head dim a multiple of 8, at
most 256. Kernels compile on first use per shape class (tens of seconds; FA4 keeps them in memory for the process).

Source: Dao et al., FlashAttention-3 (arXiv 2407.08608) and the FlashAttention-4 CuTe DSL kernels
(github.com/Dao-AILab/flash-attention, flash_attn/cute); block sparsity + mask_mod as in PyTorch's
FlexAttention (Dong et al., arXiv 2412.05496). The Split-KV contract: arXiv 2611.05926, section 3.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch

from .base import IntervalMask, mask_cache, check_call, check_cuda_head_dim, half_precision_cuda_index
from .flex import TILE, _block_tables, _rows_table, rows_per_block

#: attribute of an IntervalMask carrying host-built FlexAttention tables (`ops.packing.FLEX_HOST`)
_FLEX_HOST = "_flex_host_tables"

__all__ = ["FA4AttentionKernel", "fold_gqa_mask", "fold_rows", "unfold_rows", "fa4_available", "fa4_importable",
           "fa4_runs_on", "deterministic_requested", "INSTALL_HINT"]

#: the default of `FA4AttentionKernel(fold_gqa=None)`: off until a GPU run verifies and times the fold
#: (docs/lab/packs_accounting.md); `tools/bench_attention.py --fa4-fold` sets it for its measurement
FOLD_GQA = False

INSTALL_HINT = ("backend='fa4' needs FlashAttention-4 (CuTe DSL): pip install 'megatron-splitkv[fa4]' "
                "(flash-attn-4 and nvidia-cutlass-dsl), on a Hopper (sm90) GPU")


@functools.lru_cache(maxsize=1)
def fa4_available() -> bool:
    """True when `flash_attn.cute` can be found (does not import it; looked up once per process). Never
    raises: finding the subpackage imports the parent `flash_attn` (also flash-attn 2's package, extra
    `flash-attn`), and a parent that fails to import (any exception, e.g. OSError for a missing CUDA
    library) means no FA4 here."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except Exception:  # noqa: BLE001 - a broken flash_attn package is "not available", never an error here
        return False


@functools.lru_cache(maxsize=1)
def fa4_importable() -> bool:
    """True when FA4's entry points import (`_interface`: cutlass, flash_attn.cute's block sparsity and
    interface; once per process). An installed but broken FA4 (import fails with any exception) gives False
    with a warning naming the error, so that "auto" picks another kernel; explicit "fa4" raises the
    ImportError (`_interface`)."""
    try:
        _interface()
        return True
    except ImportError as exc:
        warnings.warn(f"FlashAttention-4 (flash_attn.cute) is installed but does not import, so backend 'auto' "
                      f"does not pick 'fa4' ({exc}); repair the install or pass SplitKVConfig(auto_fa4=False)",
                      RuntimeWarning, stacklevel=2)
        return False


#: compute capabilities (major) where this kernel has run and been measured: Hopper (sm90, the H200). FA4 also
#: has Blackwell (sm100 / sm110) kernels, but there its long-query tiles are 256 rows while these block-sparse
#: tables use 128-row tiles (unverified), so "auto" and `fa4_runs_on` stay on sm90 until it is measured there
VERIFIED_MAJORS = (9,)


def fa4_runs_on(device, dtype, head_dim=None) -> bool:
    """True when FA4 can run q/k/v of `dtype` with head dim `head_dim` on `device`: a CUDA device of a verified
    compute capability (`VERIFIED_MAJORS`: 9.x, Hopper), dtype bf16 / fp16, head dim None or a multiple of 8
    <= 256, flash_attn.cute installed and importable (`fa4_importable`, checked last: the import happens only
    where FA4 would run). Never raises."""
    idx = half_precision_cuda_index(device, dtype, head_dim)
    if idx is None:
        return False
    try:
        major = torch.cuda.get_device_capability(idx)[0]
    except (RuntimeError, AssertionError, AttributeError):
        return False
    return major in VERIFIED_MAJORS and fa4_available() and fa4_importable()


@functools.lru_cache(maxsize=1)
def _interface():
    """(fwd, bwd, BlockSparseTensorsTorch, mask_mod one interval, mask_mod two intervals); imports
    flash_attn.cute (ImportError with the install hint and the cause when it is missing or fails to import
    with any exception: the ops treat an ImportError as "backend missing" on every rank)."""
    try:
        import cutlass  # noqa: PLC0415 - optional: flash_attn.cute / CuTe DSL
        import cutlass.cute as cute  # noqa: PLC0415
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: PLC0415
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001 - a broken install (RuntimeError, OSError, ...) is an ImportError here
        raise ImportError(f"{INSTALL_HINT}; import failed: {type(exc).__name__}: {exc}") from exc

    def _ssa(x):  # a scalar as a 1-element TensorSSA (what the mask_mod compares against)
        vec = cute.make_rmem_tensor(1, cutlass.Int32)
        vec[0] = x
        return vec.load()

    # Called by FA4 per score element of a partial tile with 1-element Int32 TensorSSAs; aux_tensors are
    # the per-row int32 interval bounds (padded query length). Returns the keep mask (bool TensorSSA).
    @cute.jit
    def interval(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        lo, hi = aux_tensors[0], aux_tensors[1]
        row = q_idx[0]
        return (kv_idx >= _ssa(lo[row])) & (kv_idx < _ssa(hi[row]))

    @cute.jit
    def interval_union(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        lo, hi, lo2, hi2 = aux_tensors[0], aux_tensors[1], aux_tensors[2], aux_tensors[3]
        row = q_idx[0]
        first = (kv_idx >= _ssa(lo[row])) & (kv_idx < _ssa(hi[row]))
        second = (kv_idx >= _ssa(lo2[row])) & (kv_idx < _ssa(hi2[row]))
        return first | second

    def bst(*tables, block_size):
        return BlockSparseTensorsTorch(*tables, block_size=block_size)

    return _flash_attn_fwd, _flash_attn_bwd, bst, interval, interval_union


def deterministic_requested() -> bool:
    """True when torch's deterministic algorithms are on without warn_only (Megatron's --deterministic-mode),
    as PyTorch's own FlexAttention FLASH backend reads it. FA4's block-sparse backward has no deterministic
    variant on sm90 (flash-attn-4 4.0.0b36: "Deterministic not implemented for block-sparse backward"; its
    dQ is accumulated with atomics), so the fa4 kernel refuses to run then and "auto" picks flex."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def _fit_prebuilt(prebuilt, nq: int, nk: int, tile: int):
    """Host-built FlexAttention tables (rows [n, QP], the 8 BlockMask tables at padded lengths QP >= nq * tile,
    KP >= nk * tile) cut to FA4's own tile counts: FA4 checks the block-sparse tensors against the call's
    lengths (forward counts [1, 1, ceil(Tq / 128)] and indices with at most ceil(Tk / 128) key tiles;
    backward counts [1, 1, ceil(Tk / 128)], indices with at most ceil(Tq / 128) query tiles; a larger
    table is refused), and flex's bucketed lengths are often several tiles longer. Exact: padded query rows
    and keys beyond Tk are never listed, and the unlisted tail of each index row is in increasing order, so
    the cut tables equal the ones built at FA4's lengths (tests/test_fa4_kernel.py). Index tables that the
    cut makes non-contiguous are copied (small; once per mask, the tables are cached)."""
    rows, (kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx) = prebuilt

    def cut(t, *n):
        v = t[(Ellipsis,) + tuple(slice(0, s) for s in n)]
        return v if v.is_contiguous() else v.contiguous()

    return rows[:, : nq * tile], (cut(kv_num, nq), cut(kv_idx, nq, nk), cut(full_num, nq), cut(full_idx, nq, nk),
                                  cut(q_num, nk), cut(q_idx, nk, nq), cut(full_q_num, nk), cut(full_q_idx, nk, nq))


def fold_gqa_mask(mask: IntervalMask, groups: int) -> IntervalMask:
    """The mask of the GQA-folded call (`fold_rows`): every block repeated `groups` times in a row (block b ->
    blocks b * G .. b * G + G - 1, one per query head of a kv-head group, each with b's intervals and per-row
    bounds), block size,
    key counts and regions unchanged. `groups` 1: `mask` itself. Not validated: repeated own-block intervals
    overlap, which the kernel allows (`IntervalMask.validate` is the ops' layout check, not the kernel's)."""
    if groups == 1:
        return mask

    def rep(t):
        return None if t is None else t.repeat_interleave(groups)

    def rep_rows(t):  # per-row bounds (windowed / causal layers): block b's B rows, G times
        return None if t is None else t.view(-1, 1, mask.block_size).expand(-1, groups, -1).reshape(-1)

    return IntervalMask(mask.block_size, rep(mask.lo), rep(mask.hi), mask.num_keys, rep(mask.lo2), rep(mask.hi2),
                        num_ctx_keys=mask.num_ctx_keys, row_lo=rep_rows(mask.row_lo), row_lo2=rep_rows(mask.row_lo2),
                        row_hi2=rep_rows(mask.row_hi2))


def fold_rows(x: torch.Tensor, block_size: int, groups: int) -> torch.Tensor:
    """x [Tq, Hkv * G, ...] (query rows of blocks of `block_size` rows; G = `groups` query heads per kv head,
    head h in group h // G) -> [Tq * G, Hkv, ...], one copy: row (b G + j) B + t, head g holds x[b B + t,
    g G + j] (the B rows of block b, query head j of each group, as the j-th repeat of block b in
    `fold_gqa_mask`). A [Tq, Hq] x (lse, delta) gives [Tq * G, Hkv]. Undone by `unfold_rows`."""
    tq, hq = x.shape[0], x.shape[1]
    nb, hkv = tq // block_size, hq // groups
    y = x.reshape(nb, block_size, hkv, groups, *x.shape[2:]).transpose(1, 3).transpose(2, 3)  # [nb, G, B, Hkv, ..]
    return y.reshape(tq * groups, hkv, *x.shape[2:])


def unfold_rows(x: torch.Tensor, block_size: int, groups: int) -> torch.Tensor:
    """Inverse of `fold_rows`: x [Tq * G, Hkv, ...] -> [Tq, Hkv * G, ...] (a new contiguous tensor)."""
    tqg, hkv = x.shape[0], x.shape[1]
    nb = tqg // (groups * block_size)
    y = x.reshape(nb, groups, block_size, hkv, *x.shape[2:]).transpose(1, 2).transpose(2, 3)  # [nb, B, Hkv, G, ..]
    return y.reshape(tqg // groups, hkv * groups, *x.shape[2:])


class _Tables:
    """Per-mask FA4 inputs: the padded per-row interval table (aux tensors) and the block-sparse tables
    (forward: key tiles per query tile; backward: query tiles per key tile), partial and full."""

    __slots__ = ("aux", "fwd", "bwd", "union")

    def __init__(self, mask: IntervalMask, q_len: int, kv_len: int, tile: int, bst, prebuilt=None):
        nq, nk = -(-max(q_len, 1) // tile), -(-max(kv_len, 1) // tile)  # FA4's query / key tile counts
        if prebuilt is not None:  # FlexAttention's tables of this mask at padded lengths >= ours (same tile)
            rows, tables = _fit_prebuilt(prebuilt, nq, nk, tile)
        else:
            rows = _rows_table(mask, nq * tile)  # [2 or 4, qp] int32, zeros (empty) on the padding rows
            tables = _block_tables(rows, nq * tile, nk * tile, tile, rows_per_block=rows_per_block(mask),
                                   q_tables=True)
        kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = tables
        self.aux = [rows[i] for i in range(rows.shape[0])]
        self.union = mask.has_union
        self.fwd = bst(kv_num, kv_idx, full_num, full_idx, block_size=(tile, tile))
        self.bwd = bst(q_num, q_idx, full_q_num, full_q_idx, block_size=(tile, tile))


class FA4AttentionKernel:
    """Local context attention with FlashAttention-4 (CuTe DSL) over an `IntervalMask`, global-lse backward.

    Implements the `megatron_splitkv.kernels.base` contract:

    forward(q, k, v, mask, scale, native=False) -> (out, lse, state)
        q [Tq, Hq, D], k/v [Tk, Hkv, D], one dtype (bf16 / fp16) on one CUDA device (sm90, `VERIFIED_MAJORS`);
        Hq % Hkv == 0 (GQA as in the contract); mask.num_blocks * mask.block_size == Tq, mask.num_keys ==
        Tk. Returns out [Tq, Hq, D] (float32 copy; native=True: FA4's result in the input dtype), lse
        [Tq, Hq] float32 natural log (native: a strided view), state None. Rows with no visible key: out 0,
        lse -inf.

    backward(q, k, v, mask, scale, dout, lse, delta, state, native=False) -> (dq, dk, dv)
        dout [Tq, Hq, D] (cast to the input dtype if it is not); lse, delta [Tq, Hq] the GLOBAL merged
        log-sum-exp and rowsum(dO * O_final), any float dtype (used in fp32). Returns dq [Tq, Hq, D], dk /
        dv [Tk, Hkv, D] in float32 (native: the input dtype). No recompute of the forward is needed:
        P comes from q, k and the global lse.

    Args:
        tile: block-sparse tile (query and key), 128 (FlexAttention's default and FA4's sm90 block).
        cache_tables: keep the per-mask tables on the IntervalMask object (`mask._fa4_tables`), like the
            flex kernel's BlockMask cache (the ops share one mask per step across layers).
        fold_gqa: with GQA (G = Hq / Hkv > 1), run FA4 on the folded problem (`fold_rows`, `fold_gqa_mask`):
            the G query heads of a kv head become G copies of each query block's rows, so FA4 sees Hkv heads
            and Tq * G rows. Same visible pairs, same arithmetic per (row, head). Why (docs/lab/packs_accounting.md):
            FA4's GQA backward runs one CTA per (key tile, QUERY head) and sums dK / dV over the G heads through
            fp32 accumulators (zero-filled, reduce-added per CTA, converted by a postprocess), work that scales
            with the keys; folded, one CTA per (key tile, kv head) accumulates dK / dV of all G heads in
            registers and writes them once in the input dtype, and a 128-row query tile holds 2 blocks x G
            heads instead of 8 blocks (fewer partial tiles on packs of short sequences). Costs a query-sized
            copy of q (and dO) into the folded layout and of out / lse (dq) back, and the tables are built on
            the device per mask (host-built flex tables, `_prebuilt`, are for the unfolded rows). False: FA4's
            own GQA, the default: the fold is exact in the CPU emulation (tests/test_fa4_emulated.py) but neither
            verified nor timed on a GPU yet (tests/test_fa4_kernel.py runs both layouts there).

    Raises:
        ImportError: flash_attn.cute missing (the message gives the install command).
        ValueError: shape / dtype mismatch, float32 / float64 inputs, a CPU tensor, a device FA4 does not
            support, torch's deterministic algorithms on (`deterministic_requested`; checked by
            `check_dtype` before the ops' first collective).

    Not bit-stable: the backward accumulates dQ with atomics (run-to-run differences in the last bits,
    within bf16 rounding), unlike the flex kernel.
    """

    name = "fa4"
    #: reads the masks' per-row bounds (`IntervalMask.has_rows`: windowed / causal layers) through its row table
    row_intervals = True
    native_dtype_results = True
    #: False: head slices are copied contiguous (`_b`); reading them in place through FA4's strides was not
    #: measured faster (docs/lab/perf-notes.md item 24) and is not verified on the GPU
    strided_heads = False

    def __init__(self, tile: int = TILE, cache_tables: bool = True, fold_gqa: bool | None = None):
        self._fwd, self._bwd, self._bst, self._mask_one, self._mask_two = _interface()
        self.tile = int(tile)
        self.cache_tables = cache_tables
        self.fold_gqa = FOLD_GQA if fold_gqa is None else bool(fold_gqa)

    # ----------------------------------------------------------------------------------------------
    def check_dtype(self, dtype, device=None, head_dim=None):
        """Raise ValueError when FA4 cannot run `dtype` with head dim `head_dim` (D, None: not checked; a
        multiple of 8 <= 256, `base.check_cuda_head_dim`) on `device` (the ops call it once per call, with
        the call's D, before their first data collective, so every rank raises)."""
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"backend 'fa4' runs bf16 / fp16 only, got {dtype}; use 'flex' or 'math'")
        check_cuda_head_dim(head_dim, "backend 'fa4'")
        if deterministic_requested():
            raise ValueError("backend 'fa4': FlashAttention-4 has no deterministic block-sparse backward (its dQ "
                             "is accumulated with atomics) and torch.use_deterministic_algorithms (Megatron's "
                             "--deterministic-mode) is on; use backend 'flex' (or 'auto', which picks flex then)")
        if device is not None and not fa4_runs_on(device, dtype):
            raise ValueError(f"backend 'fa4' needs a CUDA device of compute capability 9.x (Hopper) with "
                             f"flash_attn.cute, got {device}")

    def tables(self, mask: IntervalMask, q_len: int, kv_len: int, groups: int = 1) -> _Tables:
        """The mask's FA4 tables at (q_len, kv_len) (cached on the mask unless cache_tables=False; the
        cache assumes lo / hi are not modified in place afterwards). A mask that carries FlexAttention
        tables built on the host by the data pipeline (`ops.packing.FLEX_HOST`: the same tile
        classification at FlexAttention's padded lengths, which are >= ours, tile 128) reuses them: no
        device work for the tables in the training step. groups G > 1: the tables of the GQA-folded call
        (`fold_gqa_mask(mask, G)` at q_len * G rows), cached on `mask` too."""
        def build():
            if groups > 1:
                return _Tables(fold_gqa_mask(mask, groups), q_len * groups, kv_len, self.tile, self._bst)
            return _Tables(mask, q_len, kv_len, self.tile, self._bst, self._prebuilt(mask, q_len, kv_len))

        if not self.cache_tables:
            return build()
        return mask_cache(mask, "_fa4_tables", (q_len, kv_len, self.tile) + ((groups,) if groups > 1 else ()), build)

    def _groups(self, q, k) -> int:
        """G of the call's GQA fold: Hq / Hkv with `fold_gqa`, else 1 (no fold)."""
        return q.shape[1] // k.shape[1] if self.fold_gqa else 1

    def _prebuilt(self, mask, q_len, kv_len):
        host = mask.__dict__.get(_FLEX_HOST)
        if not host or self.tile != TILE:
            return None
        n_rows = 4 if mask.has_union else 2  # (lo, hi[, lo2, hi2]): a table of this mask's kind only
        for (qp, kp), (rows, tables) in host.items():
            if qp >= q_len and kp >= kv_len and rows.device == mask.lo.device and rows.shape[0] == n_rows:
                return rows, tables
        return None

    def _check(self, q, k, v, mask):
        check_call(q, k, v, mask)
        if not q.is_cuda:
            raise ValueError("backend 'fa4' runs on CUDA tensors only")
        self.check_dtype(q.dtype, head_dim=q.shape[2])

    def _mask_mod(self, t: _Tables):
        return self._mask_two if t.union else self._mask_one

    @staticmethod
    def _b(x):  # [T, H, D] -> [1, T, H, D] contiguous (FA4's bshd layout; a view for contiguous x)
        return x.contiguous().unsqueeze(0)

    # ----------------------------------------------------------------------------------------------
    def forward(self, q, k, v, mask: IntervalMask, scale: float, native: bool = False):
        self._check(q, k, v, mask)
        Tq, Hq, D = q.shape
        Tk = k.shape[0]
        if Tq == 0 or Tk == 0:
            out = q.new_zeros((Tq, Hq, D), dtype=q.dtype if native else torch.float32)
            return out, torch.full((Tq, Hq), float("-inf"), device=q.device), None
        G, B = self._groups(q, k), mask.block_size
        t = self.tables(mask, Tq, Tk, G)
        out4 = q.new_empty((1, Tq * G, Hq // G, D))
        lse4 = torch.empty((1, Hq // G, Tq * G), dtype=torch.float32, device=q.device)
        qf = fold_rows(q, B, G) if G > 1 else q
        self._fwd(self._b(qf), self._b(k), self._b(v), softmax_scale=float(scale), return_lse=True,
                  mask_mod=self._mask_mod(t), block_sparse_tensors=t.fwd, aux_tensors=t.aux, out=out4, lse=lse4)
        del qf
        out, lse = out4[0], lse4[0].transpose(0, 1)  # [Tq, Hq, D] input dtype, [Tq, Hq] fp32 view
        if G > 1:  # back from the folded rows: one copy each (query-sized)
            out, lse = unfold_rows(out, B, G), unfold_rows(lse, B, G)
        if native:
            return out, lse, None
        return out.float(), lse.contiguous(), None

    def backward(self, q, k, v, mask: IntervalMask, scale: float, dout, lse, delta, state, native: bool = False):
        self._check(q, k, v, mask)
        Tq, Hq, D = q.shape
        Tk, Hkv, _ = k.shape
        rdt = q.dtype if native else torch.float32
        if Tq == 0 or Tk == 0:
            return (q.new_zeros((Tq, Hq, D), dtype=rdt), k.new_zeros((Tk, Hkv, D), dtype=rdt),
                    k.new_zeros((Tk, Hkv, D), dtype=rdt))
        G, B = self._groups(q, k), mask.block_size
        t = self.tables(mask, Tq, Tk, G)

        def rows(x):  # [Tq, Hq, ...] -> the call's query rows (folded: [Tq * G, Hkv, ...])
            return fold_rows(x, B, G) if G > 1 else x

        do4 = self._b(rows(dout.to(q.dtype)))
        # out = 0 and dlse = -delta: FA4's D' = rowsum(dout * out) - dlse = delta (exact, fp32)
        zero4 = torch.zeros_like(do4)
        lse4 = rows(lse.to(torch.float32)).transpose(0, 1).contiguous().unsqueeze(0)  # [1, Hq / G, Tq * G]
        dlse4 = rows(delta.to(torch.float32).neg()).transpose(0, 1).contiguous().unsqueeze(0)
        dq4 = torch.empty_like(do4)
        # FA4's MHA path (folded, or Hq == Hkv) writes dK / dV itself: zero-filled first, so that key tiles no
        # query tile lists (keys no block sees) read 0 whatever FA4 does with their CTAs (its GQA path sums into
        # zero-filled accumulators). flash_bwd_sm90.py of flash-attn-4 4.0.0b36 writes zeros there itself (read,
        # not yet run): the zero-fill goes once tests/test_fa4_kernel.py's NaN-memory test passes without it
        alloc = k.new_zeros if Hq // G == Hkv else k.new_empty
        dk4 = alloc((1, Tk, Hkv, D))
        dv4 = alloc((1, Tk, Hkv, D))
        self._bwd(self._b(rows(q)), self._b(k), self._b(v), zero4, do4, lse4, softmax_scale=float(scale),
                  mask_mod=self._mask_mod(t), aux_tensors=t.aux, block_sparse_tensors=t.bwd, dlse=dlse4,
                  dq=dq4, dk=dk4, dv=dv4)
        del zero4, do4, lse4, dlse4
        dq, dk, dv = dq4[0], dk4[0], dv4[0]
        if G > 1:
            dq = unfold_rows(dq, B, G)
        if native:
            return dq, dk, dv
        return dq.float(), dk.float(), dv.float()
