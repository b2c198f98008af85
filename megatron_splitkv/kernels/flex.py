"""FlexAttention local kernel for the context part of Split-KV attention (GPU).

Source: PyTorch FlexAttention (`torch.nn.attention.flex_attention`, torch 2.11) serving the local
context attention of Split-KV (arXiv 2611.05926, section 3; DESIGN.md section 2).

The kernel contract is `megatron_splitkv.kernels.base` (read its module docstring). What this module adds:

* The FlexAttention `BlockMask` is built DIRECTLY from the interval metadata (`IntervalMask`: block b
  sees sorted local keys [lo[b], hi[b])), vectorised on the kernel's device: for each 128-row query tile
  and each 128-key tile, the key tile is *needed* if any row of the query tile has an interval that
  intersects it, and *full* if every row of the query tile sees the whole key tile. Needed-but-not-full
  tiles are *partial*: there the `mask_mod` `lo[q // B] <= kv < hi[q // B]` is evaluated. No dense
  Tq x Tk mask is built and `create_block_mask` (which evaluates the mask on every pair) is never called.
  See `interval_block_tables`. The transposed tables (per key tile, the query tiles: what flex's backward
  reads) come from the same classification instead of `BlockMask.from_kv_blocks`' re-derivation from the
  key tables (`_block_tables`; the same values, ~23 device ops per BlockMask instead of ~66: docs/lab/perf-notes.md
  "Prepare cost (item 13)"). Masks with own-block second intervals (`IntervalMask.lo2/hi2`, the union
  contract of `kernels/base.py`) are classified the same way on both intervals; their own-block region
  (from `num_ctx_keys`, a multiple of 128 in the ops) is block-diagonal: only the key tiles a query
  tile's own blocks intersect are listed (partial, B x B blocks inside 128 x 128 tiles), and the
  mask_mod tests both intervals. One call thus covers context and own block (perf-notes item 1).
* `flex_attention` is compiled once at module level (`torch.compile(..., dynamic=False)`). Query and key
  lengths are padded up to bucket sizes (`bucket_length`: multiples of 128 of the form m * 2**e, m in
  [steps, 2 * steps)): both to {2, 3} x 2**e x 128 (`DEFAULT_Q_BUCKET_STEPS`, `DEFAULT_BUCKET_STEPS` = 2,
  <= 1.5x). Padding costs no attention FLOPs (padded tiles are never listed in the block tables, so flex
  skips them), only the padded q/k/v copies and padded output rows, so the buckets are coarse to keep the
  number of compiled graphs small. On top, a compiled key bucket one step larger is reused instead of
  compiling the smaller one (`reuse_larger_kv_bucket`): per-rank key counts of packed batches sit around
  seq_length / CP, i.e. right on a power-of-two bucket boundary, and would otherwise need two graphs. Dynamo
  compiles one graph (forward + backward) per (Tq bucket, Tk bucket, dtype, heads, head dim, scale, GQA,
  kernel_options, grad mode, mask with or without own-block intervals), and NOTHING else triggers a
  recompile (the key length Tk counts the own keys too) (checked on CPU with dynamo's guards:
  the fresh mask_mod closure and its lo/hi tensors, fresh BlockMask tables, lengths inside a bucket and an
  outer no_grad do not; a different `scale` value does, `save_graph=False` adds a no-grad forward graph).
  Padding rows have empty intervals (out 0, lse -inf) and padding keys lie outside every interval; both are
  sliced off. Not `dynamic=True` / `mark_dynamic`: one graph for all lengths, but with symbolic lengths
  inductor cannot prove them multiples of the flex block sizes (the static lengths are, so the template
  drops its bounds checks), and that variant was never timed on the H200; the static graphs were.
* Backward with the GLOBAL lse and delta (the contract's `lse_global`, `delta_global`) is exact through
  FlexAttention's differentiable lse: with this rank's local (O_r, lse_r) from the forward and
  c = exp(lse_r - lse), autograd through flex with
      grad_out = c * dO,   grad_lse = rowsum(grad_out * O_r) - c * delta
  gives dS = P_r * (grad_out V^T - rowsum(grad_out * O_r) + grad_lse) = P_global * (dO V^T - delta),
  since P_r * c = exp(s - lse_r) exp(lse_r - lse) = exp(s - lse). grad_out is rounded to the input dtype
  before grad_lse is formed from it, so flex's internal delta (rowsum(grad_out * O_r) in fp32) cancels
  exactly to c * delta. Rows with lse_r = -inf or lse = -inf get c = 0: zero gradient, never NaN.
  Flex's own backward treats lse = -inf rows as P = 0 as well.

Precision: FlexAttention (Triton backend) accumulates in fp32 but stores `out`, `dq`, `dk`, `dv` in the
input dtype (bf16/fp16); `lse` is fp32. This kernel returns them upcast to fp32 as the contract asks (with
native=True as flex stores them: `native_dtype_results`, what Split-KV uses), so
`out` carries one bf16 rounding (relative 2**-9) before the cross-rank fp32 merge; measured error versus
the float64 reference is in docs/kernels.md. float32 inputs run flex in fp32 (the Triton dots then use
tf32 unless `torch.backends.cuda.matmul.allow_tf32` is off); float64 is not supported by the Triton
kernel and raises on CUDA. On CPU (`dense_flex_emulation`) float64 inputs stay float64 end to end
(out, lse and gradients are float64, as with the math kernel).

Non-finite masked keys: on the GPU, key tiles the BlockMask lists for no query tile are never loaded, so
a NaN/inf there has no effect. In a PARTIAL tile, FlexAttention sets the masked scores to -inf (p = 0)
but still multiplies the whole tile, p @ V (and dS @ K in the backward): a NaN/inf in a value (key) of a
partial tile gives 0 * NaN = NaN in the rows of that query tile even where the key is masked (IEEE; the
Triton kernel has no select there). The GPU path is left as is; keep padding/unused context finite
(the ops pad with zeros). The CPU emulation selects masked keys/queries to 0 instead (no leak), like the
math kernel and the reference.

On CPU (tests), flex runs eagerly: PyTorch then evaluates `mask_mod` densely and ignores the block
tables, so CPU runs check the algebra (global-lse backward, padding, -inf rows) but not the sparsity; the
block tables are checked on CPU separately against a brute-force tile classification
(tests/test_gpu_kernels.py). Compiled flex on CPU supports neither lse nor backward in torch 2.11.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from ..config import FlexOptions
from .base import IntervalMask, check_call, mask_cache
from .flex_bwd_prep import grad_tangents

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch < 2.9: only the deprecated return_lse exists
        AuxRequest = None
    _FLEX_IMPORT_ERROR = None
except ImportError as _e:  # pragma: no cover - depends on the torch build
    BlockMask = flex_attention = AuxRequest = None
    _FLEX_IMPORT_ERROR = _e

#: FlexAttention's sparse tile (query rows x keys); BlockMask granularity.
TILE = 128


#: Bucket steps per octave for padded KEY lengths (`FlexOptions.bucket_steps`):
#: 2 -> {2, 3} x 2**e x 128, at most 50% padded keys, two compiled shapes per octave of Tk.
DEFAULT_BUCKET_STEPS = FlexOptions.bucket_steps
#: Bucket steps per octave for padded QUERY lengths (`FlexOptions.q_bucket_steps`):
#: 2 -> {2, 3} x 2**e x 128 (<= 1.5x rows). Not 1 (powers of two): the gathered query count of a packed
#: 128K-token ShareGPT batch is 0.6M-0.77M rows, where padded q and out (Hq heads, kept for backward)
#: cost GBs per layer; 2 already puts all of them in one bucket (786432).
DEFAULT_Q_BUCKET_STEPS = FlexOptions.q_bucket_steps

_COMPILED = None


def compiled_flex_attention():
    """The module-level compiled `flex_attention` (compiled lazily on first use, once per process)."""
    global _COMPILED
    if _FLEX_IMPORT_ERROR is not None:
        raise RuntimeError(f"FlexAttention is not available in this torch build: {_FLEX_IMPORT_ERROR}")
    if _COMPILED is None:
        # one compiled graph per (bucketed shape, dtype, grad mode): raise dynamo's per-function recompile
        # limit (default 8) so many buckets never fall back to eager flex (dense scores, very slow)
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 64))
        if hasattr(cfg, "accumulated_recompile_limit"):
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 512)
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


#: (graph key, Tq_pad) -> set of Tk_pad run through the compiled flex in this process (see `_pick_kv_bucket`)
_COMPILED_KV_BUCKETS: dict = {}


def _pick_kv_bucket(graph_key, q_pad: int, kv_pad: int, kv_steps: int) -> int:
    """The key bucket to run: `kv_pad`, or the next bucket up if only that one is compiled already.

    Records the choice. Padded keys cost no FLOPs (never listed in the block tables), only the k/v
    copies (Hkv heads), so running one bucket larger is cheaper than a ~5 s compile.
    """
    seen = _COMPILED_KV_BUCKETS.setdefault((graph_key, q_pad), set())
    if kv_pad not in seen:
        up = bucket_length(kv_pad + 1, kv_steps)
        if up in seen:
            return up
        seen.add(kv_pad)
    return kv_pad


def padded_lengths(q_len: int, kv_len: int, q_steps: int = DEFAULT_Q_BUCKET_STEPS,
                   kv_steps: int = DEFAULT_BUCKET_STEPS) -> tuple[int, int]:
    """(Tq_pad, Tk_pad) the kernel runs flex at: one compiled graph per distinct pair (per dtype/heads/...)."""
    return bucket_length(q_len, q_steps), bucket_length(kv_len, kv_steps)


def bucket_length(n: int, steps: int = DEFAULT_BUCKET_STEPS, tile: int = TILE) -> int:
    """Smallest bucket size >= n: a multiple of `tile` of the form m * 2**e with m in [steps, 2*steps).

    Consecutive buckets are at most a factor (steps + 1) / steps apart (steps=1: powers of two, <= 2x;
    steps=2: 2,3 x 2**e, <= 1.5x; steps=4: 4,5,6,7 x 2**e, <= 1.25x), and the number of distinct
    compiled shapes is `steps` per octave of the length range. n <= 0 gives `tile`.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n_tiles = max(1, -(-int(n) // tile))
    if n_tiles <= steps:
        return n_tiles * tile
    e = (n_tiles - 1).bit_length() - steps.bit_length()
    e = max(e, 0)
    while True:
        unit = 1 << e
        m = -(-n_tiles // unit)
        if m < 2 * steps:
            return max(m, steps) * unit * tile
        e += 1


def _row_intervals(mask: IntervalMask, n_rows_padded: int):
    """Per-row (lo, hi, lo2, hi2) int32 for the padded query length; padding rows get [0, 0).

    lo2/hi2 are None when the mask has no second (own-block) intervals. The four are rows of one
    [4, n_rows_padded] (or [2, ...]) tensor (`_rows_table`)."""
    rows = _rows_table(mask, n_rows_padded)
    return (rows[0], rows[1]) + ((rows[2], rows[3]) if mask.has_union else (None, None))


def rows_per_block(mask: IntervalMask) -> int:
    """The `rows_per_block` of `_block_tables` for `mask`: B (one row per block examined) when every row of a
    block has the block's intervals, 1 (every row) when the mask has per-row bounds (`IntervalMask.has_rows`:
    a windowed / causal layer)."""
    return 1 if mask.has_rows else mask.block_size


def _rows_table(mask: IntervalMask, n_rows_padded: int) -> torch.Tensor:
    """[n, n_rows_padded] int32, n = 4 (lo, hi, lo2, hi2) or 2 (lo, hi): every block's intervals
    repeated over its B rows (or the mask's per-row bounds, `IntervalMask.row_bounds`), zeros for the
    padding rows. Two or three launches (stack, the cast and repeat in one broadcast copy, the padding's
    zeros) instead of three to four per interval row."""
    B = mask.block_size
    pad = n_rows_padded - mask.num_blocks * B
    if pad < 0:
        raise ValueError("padded query length shorter than the mask")
    if mask.has_rows:
        per_row = mask.row_bounds()
        rows = torch.zeros(per_row.shape[0], n_rows_padded, dtype=torch.int32, device=per_row.device)
        rows[:, : per_row.shape[1]].copy_(per_row)
        return rows
    blocks = torch.stack([mask.lo, mask.hi] + ([mask.lo2, mask.hi2] if mask.has_union else []))
    n, nb = blocks.shape
    rows = torch.empty(n, n_rows_padded, dtype=torch.int32, device=blocks.device)
    rows[:, : nb * B].view(n, nb, B).copy_(blocks[:, :, None].expand(n, nb, B))  # cast + repeat_interleave
    if pad:
        rows[:, nb * B:].zero_()
    return rows


def interval_block_tables(lo_row: torch.Tensor, hi_row: torch.Tensor, q_len: int, kv_len: int,
                          tile: int = TILE, rows_per_block: int = 1, lo2_row: torch.Tensor | None = None,
                          hi2_row: torch.Tensor | None = None):
    """Classify (query tile, key tile) pairs of an interval mask; vectorised, on lo_row's device, no sync.

    Args:
        lo_row, hi_row: [q_len] integer, row i sees keys [lo_row[i], hi_row[i]) (empty if lo >= hi).
        q_len, kv_len: padded lengths, multiples of `tile`.
        rows_per_block: rows come in runs of this many identical intervals starting at row 0 (the query
            block size B); when it divides `tile`, one row per block is examined (tile / B per tile).
        lo2_row, hi2_row: optional [q_len] second intervals (the own block, `IntervalMask.lo2/hi2`):
            row i sees the UNION of both. A tile is full when one of the two intervals covers it for
            every row; exact (equal to a brute-force classification of the union) when no key tile
            straddles both intervals of a row, which the ops guarantee by starting region 2 on a
            multiple of `tile` (`IntervalMask.num_ctx_keys`); otherwise a tile covered only by the
            union is listed as partial (still correct: the mask_mod decides there).

    Returns:
        (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) shaped [1, 1, nq] and
        [1, 1, nq, nk] int32, as `BlockMask.from_kv_blocks` takes them: per query tile, the partial key
        tiles (some row sees some key of the tile, but not every row sees every key) and the full key
        tiles (every row of the query tile sees every key of the tile), each listed in increasing order
        first, the rest of the row holding the remaining tile indices. Memory O(nq * r * nk) bools with
        r = tile / B rows examined per query tile (r = tile when B does not divide tile). With second
        intervals the own-block region is block-diagonal: a query tile lists only the key tiles its
        rows' own blocks intersect.
    """
    rows = [lo_row, hi_row] + ([lo2_row, hi2_row] if lo2_row is not None else [])
    return _block_tables(torch.stack(rows).to(torch.int32), q_len, kv_len, tile, rows_per_block)[:4]


def _block_tables(rows: torch.Tensor, q_len: int, kv_len: int, tile: int = TILE, rows_per_block: int = 1,
                  q_tables: bool = False):
    """`interval_block_tables` of a [2 or 4, q_len] int32 row table (lo, hi[, lo2, hi2]: `_rows_table`),
    both intervals classified in the same launches. With `q_tables`, also the transposed tables
    `BlockMask.from_kv_blocks` would derive (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices:
    per key tile the query tiles, [1, 1, nk] and [1, 1, nk, nq] int32, ordered like flex's
    `_dense_to_ordered`) straight from the same tile classification. ~20 launches for all eight tables."""
    if q_len % tile or kv_len % tile:
        raise ValueError(f"q_len={q_len} and kv_len={kv_len} must be multiples of {tile}")
    nq, nk = q_len // tile, kv_len // tile
    kstart = torch.arange(0, kv_len, tile, device=rows.device, dtype=torch.int32)  # [nk]
    kend = kstart + tile
    x = rows.view(rows.shape[0], nq, tile)
    if rows_per_block > 1 and tile % rows_per_block == 0:
        x = x[:, :, ::rows_per_block]
    x = x[..., None]  # [2 or 4, nq, r, 1]
    lo3, hi3 = x[0::2], x[1::2]  # [1 or 2 intervals, nq, r, 1]
    touches = (hi3 > lo3) & (lo3 < kend) & (hi3 > kstart)  # [i, nq, r, nk]
    covers = (lo3 <= kstart) & (hi3 >= kend)  # an empty row (lo >= hi) never covers a tile
    needed = touches.any(dim=(0, 2))  # some row, through either interval, sees some key of the tile
    full = (covers.any(0) if covers.shape[0] > 1 else covers[0]).all(1)  # every row, through one of them
    sel = torch.stack([needed > full, full])  # [2, nq, nk]: partial (needed and not full), full
    # listed tiles first, in increasing order, then the others: a stable descending sort of 0/1 (bool
    # viewed as int8, no copy), the order of the former stable ascending sort of ~sel
    num = sel.sum(-1, dtype=torch.int32)
    idx = torch.sort(sel.view(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
    out = (num[0][None, None], idx[0][None, None], num[1][None, None], idx[1][None, None])
    if q_tables:
        q_num = sel.sum(-2, dtype=torch.int32)  # [2, nk]
        q_idx = torch.sort(sel.view(torch.int8).transpose(-1, -2), dim=-1, descending=True, stable=True).indices
        q_idx = q_idx.to(torch.int32, memory_format=torch.contiguous_format)  # [2, nk, nq]
        out += (q_num[0][None, None], q_idx[0][None, None], q_num[1][None, None], q_idx[1][None, None])
    return out


def _interval_mask_mod(lo_row: torch.Tensor, hi_row: torch.Tensor, lo2_row=None, hi2_row=None):
    if lo2_row is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx >= lo_row[q_idx]) & (kv_idx < hi_row[q_idx])
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (((kv_idx >= lo_row[q_idx]) & (kv_idx < hi_row[q_idx]))
                    | ((kv_idx >= lo2_row[q_idx]) & (kv_idx < hi2_row[q_idx])))

    return mask_mod


def build_block_mask(mask: IntervalMask, q_len: int, kv_len: int, tile: int = TILE):
    """FlexAttention `BlockMask` for an `IntervalMask` at padded lengths (q_len, kv_len).

    Built from `interval_block_tables` with `BlockMask.from_kv_blocks`; the mask_mod reads per-row lo/hi
    (and lo2/hi2 for a mask with own-block intervals: the union) tensors on the mask's device: the block's
    intervals repeated, or the mask's per-row bounds (windowed / causal layers, every row classified). Raises
    RuntimeError when FlexAttention is unavailable.
    """
    if BlockMask is None:
        raise RuntimeError(f"FlexAttention is not available in this torch build: {_FLEX_IMPORT_ERROR}")
    rows = _rows_table(mask, q_len)
    tables = _block_tables(rows, q_len, kv_len, tile, rows_per_block=rows_per_block(mask), q_tables=True)
    kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = tables
    lo_row, hi_row, lo2_row, hi2_row = (rows[0], rows[1]) + ((rows[2], rows[3]) if mask.has_union else (None, None))
    # the BlockMask `from_kv_blocks` builds, with the q tables from the tile classification instead of
    # its `_transpose_ordered` (dense tables re-derived from the kv tables, ~30 more launches): the same
    # values (tests/test_prepare_cost.py)
    return BlockMask(
        seq_lengths=(q_len, kv_len), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num,
        full_kv_indices=full_idx, q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx, BLOCK_SIZE=(tile, tile),
        mask_mod=_interval_mask_mod(lo_row, hi_row, lo2_row, hi2_row),
    )


class FlexAttentionKernel:
    """Local context attention with PyTorch FlexAttention, interval-mask BlockMask, global-lse backward.

    Implements the `megatron_splitkv.kernels.base` contract:

    forward(q, k, v, mask, scale) -> (out, lse, state)
        q [Tq, Hq, D], k/v [Tk, Hkv, D], one dtype (bf16/fp16/fp32) on one device; Hq % Hkv == 0 (query
        head h uses kv head h // (Hq // Hkv), flex's `enable_gqa`). mask: `IntervalMask` with
        n_blocks * block_size == Tq, num_keys == Tk and intervals within [0, Tk] (optionally with
        own-block second intervals: the union is attended). Returns out [Tq, Hq, D] float32 (flex
        output rounded to the input dtype, then upcast), lse [Tq, Hq] float32 natural log (rows with no
        visible key: out 0, lse -inf), and `state` (flex's autograd graph when `save_graph`, else None).

    backward(q, k, v, mask, scale, dout, lse, delta, state) -> (dq, dk, dv)
        dout [Tq, Hq, D]; lse, delta [Tq, Hq] GLOBAL (merged) log-sum-exp and rowsum(dO * O_final).
        Returns float32 dq [Tq, Hq, D], dk/dv [Tk, Hkv, D] (flex gradients in the input dtype, upcast).
        If `state` is None the forward is recomputed. A `state` is consumed (its graph is freed).

    Args:
        save_graph: keep flex's autograd graph from forward to backward (no recompute; holds the padded
            q/k/v, out and lse until backward). False: forward runs without graph, backward recomputes.
        compile: use the module-level compiled flex (default on CUDA). Off on CPU: `dense_flex_emulation`
            (tests only; CPU flex has no backward in torch 2.11).
        options: `FlexOptions` (None: the defaults); the keyword arguments below override its fields:
        bucket_steps: bucket granularity of padded KEY lengths (see `bucket_length`; default
            `DEFAULT_BUCKET_STEPS`).
        q_bucket_steps: bucket granularity of padded QUERY lengths (default `DEFAULT_Q_BUCKET_STEPS`).
        reuse_larger_kv_bucket: with the compiled flex, run at the next key bucket up when that one has
            been compiled in this process and the own one has not (no new graph; default on).
        kernel_options: FlexAttention `kernel_options` (e.g. {"fwd_num_stages": 2}); default: flex's own.
        cache_block_mask: keep the BlockMask on the IntervalMask object (see `block_mask`).

    Raises:
        ValueError on shape/dtype mismatch or float64 inputs on CUDA; RuntimeError without FlexAttention.
    """

    name = "flex"
    #: reads the masks' per-row bounds (`IntervalMask.has_rows`: windowed / causal layers) through its row table
    row_intervals = True
    #: forward / backward take native=True: out, dq, dk, dv in the input dtype (what flex stores; the default
    #: results are their exact fp32 upcast), lse as a view (kernels/base.py, "native_dtype_results")
    native_dtype_results = True

    def __init__(self, save_graph: bool = True, bucket_steps: int | None = None,
                 compile: bool | None = None, kernel_options: dict | None = None, cache_block_mask: bool | None = None,
                 q_bucket_steps: int | None = None, reuse_larger_kv_bucket: bool | None = None,
                 options: FlexOptions | None = None):
        if _FLEX_IMPORT_ERROR is not None:
            raise RuntimeError(f"FlexAttention is not available in this torch build: {_FLEX_IMPORT_ERROR}")
        options = FlexOptions() if options is None else options
        if not isinstance(options, FlexOptions):
            raise ValueError(f"options must be None or a FlexOptions, got {type(options).__name__}")
        overrides = dict(bucket_steps=bucket_steps, q_bucket_steps=q_bucket_steps, kernel_options=kernel_options,
                         reuse_larger_kv_bucket=reuse_larger_kv_bucket, cache_block_mask=cache_block_mask)
        overrides = {k: v for k, v in overrides.items() if v is not None}
        self.options = dataclasses.replace(options, **overrides) if overrides else options
        self.save_graph = save_graph
        self.bucket_steps = self.options.bucket_steps
        self.q_bucket_steps = self.options.q_bucket_steps
        self.reuse_larger_kv_bucket = self.options.reuse_larger_kv_bucket
        self.compile = compile
        self.kernel_options = self.options.kernel_options_dict()
        self.cache_block_mask = self.options.cache_block_mask

    def block_mask(self, mask: IntervalMask, q_len: int, kv_len: int):
        """BlockMask for `mask` at padded lengths; cached on the mask object (`mask._flex_block_masks`).

        The cache assumes lo/hi are not modified in place after the first call. The ops take their
        IntervalMask from the step's `SplitKVMetadata` (`megatron_splitkv.ops.prepare_splitkv_metadata`):
        with `metadata=` passed to every layer, the first layer's call builds the BlockMask (~2 ms on an
        H200) and the other layers, forward and backward, reuse it; without it each call builds a fresh
        IntervalMask and hence a fresh BlockMask.
        """
        if not self.cache_block_mask:
            return build_block_mask(mask, q_len, kv_len)
        return mask_cache(mask, "_flex_block_masks", (q_len, kv_len), lambda: build_block_mask(mask, q_len, kv_len))

    def check_dtype(self, dtype, device=None, head_dim=None):  # noqa: ARG002 - the kernels' protocol (base)
        """Raise ValueError when flex cannot run `dtype` on `device` (float64 on CUDA; `head_dim` is not
        restricted here); the ops call it once per call, before their first data collective, so that every
        rank raises (a rank without keys never calls the kernel)."""
        if dtype == torch.float64 and device is not None and torch.device(device).type == "cuda":
            raise ValueError("FlexAttention (Triton) does not support float64; use the math kernel")

    # ----------------------------------------------------------------------------------------------
    def _check(self, q, k, v, mask):
        check_call(q, k, v, mask)
        if q.is_cuda and q.dtype == torch.float64:
            raise ValueError("FlexAttention (Triton) does not support float64; use the math kernel")

    def _fn(self, device):
        use_compile = self.compile if self.compile is not None else device.type == "cuda"
        if use_compile:
            return compiled_flex_attention()
        return flex_attention if device.type == "cuda" else dense_flex_emulation

    def _run(self, q, k, v, mask, scale, grad: bool):
        """Pad to buckets, run flex; returns padded leaves, (out_p [1,Hq,Tqp,D], lse_p [1,Hq,Tqp])."""
        Tq, Hq, D = q.shape
        Tk, Hkv, _ = k.shape
        Tqp, Tkp = padded_lengths(Tq, Tk, self.q_bucket_steps, self.bucket_steps)
        fn = self._fn(q.device)
        if self.reuse_larger_kv_bucket and fn is _COMPILED:
            # everything dynamo guards on besides the lengths (see the module docstring)
            graph_key = (q.device, q.dtype, Hq, Hkv, D, float(scale), bool(grad), mask.has_union,
                         json.dumps(self.kernel_options, sort_keys=True, default=str))
            Tkp = _pick_kv_bucket(graph_key, Tqp, Tkp, self.bucket_steps)
        bm = self.block_mask(mask, Tqp, Tkp)

        def padded(x, n):
            # x is a fresh detached alias: at a bucket length (e.g. a gathered Lq of 8192) it becomes the
            # leaf itself, so the graph keeps no second copy of q/k/v. Same sizes and strides as a padded
            # buffer (contiguous only), so dynamo sees the same graph input either way.
            if x.shape[0] == n and x.is_contiguous():
                return x.requires_grad_(grad)
            buf = x.new_empty((n,) + tuple(x.shape[1:]))
            buf[: x.shape[0]].copy_(x)
            buf[x.shape[0]:].zero_()
            return buf.requires_grad_(grad)

        qp, kp, vp = padded(q.detach(), Tqp), padded(k.detach(), Tkp), padded(v.detach(), Tkp)
        with torch.set_grad_enabled(grad):
            qh, kh, vh = (x.permute(1, 0, 2).unsqueeze(0) for x in (qp, kp, vp))  # [1, H, T, D] views
            kwargs = dict(block_mask=bm, scale=float(scale), enable_gqa=Hq != Hkv)
            if self.kernel_options and fn is not dense_flex_emulation:
                kwargs["kernel_options"] = dict(self.kernel_options)
            if AuxRequest is not None:
                out_p, aux = fn(qh, kh, vh, return_aux=AuxRequest(lse=True), **kwargs)
                lse_p = aux.lse
            else:  # pragma: no cover - older torch
                out_p, lse_p = fn(qh, kh, vh, return_lse=True, **kwargs)
        return (qp, kp, vp), out_p, lse_p

    def forward(self, q, k, v, mask: IntervalMask, scale: float, native: bool = False):
        """The contract's forward; native=True: out [Tq, Hq, D] in the input dtype and lse [Tq, Hq] (acc
        dtype) as strided views of flex's results (no copies; the default returns their fp32 / contiguous
        copies, the same values)."""
        self._check(q, k, v, mask)
        Tq = q.shape[0]
        leaves, out_p, lse_p = self._run(q, k, v, mask, scale, grad=self.save_graph)
        acc = _acc(q.dtype)  # float64 only on CPU (the emulation): _check rejects float64 on CUDA
        out_local = out_p.detach()[0, :, :Tq].permute(1, 0, 2)  # [Tq, Hq, D], input dtype
        lse_local = lse_p.detach()[0, :, :Tq].transpose(0, 1)  # natural log (flex scales)
        state = {"leaves": leaves, "out_p": out_p, "lse_p": lse_p} if self.save_graph else None
        if native and lse_local.dtype == acc:
            return out_local, lse_local, state
        lse = lse_local.to(acc).contiguous()
        out = _contiguous_as(out_local, acc)  # one copy, not two (.to(acc).contiguous() of a permuted view)
        return out, lse, state

    def backward(self, q, k, v, mask: IntervalMask, scale: float, dout, lse, delta, state, native: bool = False):
        """The contract's backward; native=True: dq, dk, dv in the input dtype (row slices of flex's gradients,
        no copies; the default returns their fp32 copies, the same values)."""
        self._check(q, k, v, mask)
        Tq, Tk = q.shape[0], k.shape[0]
        if state is None:
            leaves, out_p, lse_p = self._run(q, k, v, mask, scale, grad=True)
        else:
            leaves, out_p, lse_p = state["leaves"], state["out_p"], state["lse_p"]
            state.clear()  # the graph is consumed below; a second backward would need a recompute
        leaves = list(leaves)
        Tqp, Hq, D = out_p.shape[2], out_p.shape[1], out_p.shape[3]
        # local stats as flex saw them, real rows only: [Tq, Hq] fp32 natural log, O_r in the input dtype.
        # The padding rows (Tq..Tqp) get grad_out = 0 and grad_lse = 0 (c = 0 there: lse_global = -inf);
        # they are written as zeros into the padded gradient buffers, so no temporary is Tqp long.
        acc = _acc(q.dtype)
        lse_r = lse_p.detach()[0, :, :Tq].transpose(0, 1)
        o_r = out_p.detach()[0, :, :Tq].permute(1, 0, 2)
        # same layouts as before the real-rows-only rewrite ([Tqp, Hq, D] / [Tqp, Hq] buffers, permuted
        # views), so the compiled backward sees the tangent strides it was traced with
        g_out = o_r.new_empty((Tqp, Hq, D))
        g_lse = lse_p.new_empty((Tqp, Hq))  # rows [0, Tq) written by grad_tangents
        if Tqp > Tq:
            g_out[Tq:].zero_()
            g_lse[Tq:].zero_()
        # grad_out = c * dO rounded to the input dtype (as flex sees it), written straight into g_out, and
        # grad_lse = rowsum(grad_out * O_r) - c * delta in fp32: one fused Triton kernel on CUDA, torch
        # ops over bounded row chunks otherwise (`kernels.flex_bwd_prep`). Outside the compiled graph.
        grad_tangents(dout, o_r, lse_r, lse, delta, g_out, g_lse, acc=acc)
        del o_r, lse_r
        grads = list(torch.autograd.grad(
            (out_p, lse_p),
            leaves,
            (g_out.permute(1, 0, 2).unsqueeze(0), g_lse.transpose(0, 1).unsqueeze(0)),
            allow_unused=True,
        ))
        # the graph is freed: drop the padded leaves, flex's out/lse and the tangents before upcasting
        shapes = [(n,) + tuple(x.shape[1:]) for x, n in zip(leaves, (Tq, Tk, Tk))]
        dev = out_p.device
        del leaves, out_p, lse_p, g_out, g_lse
        res = []
        for i, shape in enumerate(shapes):  # one at a time: each input-dtype gradient dies after its upcast
            g, grads[i] = grads[i], None
            if g is None:
                res.append(torch.zeros(shape, dtype=q.dtype if native else acc, device=dev))
            else:
                res.append(g[: shape[0]] if native else _contiguous_as(g[: shape[0]], acc))
            del g
        dq, dk, dv = res
        return dq, dk, dv


def _contiguous_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype).contiguous() with at most one copy (a strided x converted straight into a contiguous
    buffer; the same values: a cast is elementwise)."""
    if x.dtype == dtype:
        return x.contiguous()
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic/result dtype: float64 for float64 inputs (CPU emulation only), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_mask_to_dense(block_mask, q_len: int, kv_len: int) -> torch.Tensor:
    """Dense [q_len, kv_len] bool visibility that a FlexAttention kernel computes from `block_mask`.

    Key tiles listed as full are visible everywhere, tiles listed as partial are visible where
    `mask_mod` is true, unlisted tiles are masked. Materialises the dense mask: for tests and CPU only.
    """
    tq, tk = block_mask.BLOCK_SIZE
    nq, nk = -(-q_len // tq), -(-kv_len // tk)
    dev = block_mask.kv_indices.device

    def tiles(num, idx):
        sel = torch.zeros(nq, nk, dtype=torch.bool, device=dev)
        if num is None:
            return sel
        num, idx = num[0, 0], idx[0, 0].long()
        valid = torch.arange(idx.shape[-1], device=dev)[None, :] < num[:, None].long()
        rows = torch.arange(nq, device=dev)[:, None].expand_as(idx)
        sel[rows[valid], idx[valid]] = True
        return sel

    part = tiles(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    qi = torch.arange(q_len, device=dev)
    ki = torch.arange(kv_len, device=dev)
    mm = block_mask.mask_mod(torch.zeros((), dtype=torch.int64, device=dev), torch.zeros((), dtype=torch.int64, device=dev),
                             qi[:, None], ki[None, :])
    part_d = part.repeat_interleave(tq, 0).repeat_interleave(tk, 1)[:q_len, :kv_len]
    full_d = full.repeat_interleave(tq, 0).repeat_interleave(tk, 1)[:q_len, :kv_len]
    return full_d | (part_d & mm)


def dense_flex_emulation(query, key, value, *, block_mask, scale, enable_gqa=False, return_aux=None,
                         return_lse=False, kernel_options=None):
    """Plain-torch stand-in for `flex_attention` on CPU (which has no backward there in torch 2.11).

    Same signature subset and semantics as flex: [1, H, L, D] inputs, visibility from the BlockMask's
    tables (full / partial + mask_mod / skipped, via `block_mask_to_dense`, so the tables are exercised),
    out in the input dtype, lse fp32 natural log (-inf and out 0 on rows with no visible key), lse
    differentiable. `kernel_options` is accepted and ignored. Dense Lq x Lk: tests only.
    """
    Hq, Hkv = query.shape[1], key.shape[1]
    if enable_gqa and Hq != Hkv:
        key = key.repeat_interleave(Hq // Hkv, dim=1)
        value = value.repeat_interleave(Hq // Hkv, dim=1)
    vis = block_mask_to_dense(block_mask, query.shape[2], key.shape[2])
    acc = _acc(query.dtype)
    # keys no query sees / queries that see no key (padding) are SELECTED to 0, never multiplied by a 0
    # weight, so a NaN/inf there reaches no output or gradient (unlike flex on GPU, see the module doc)
    seen_k, sees_q = vis.any(0)[:, None], vis.any(1)[:, None]
    key = torch.where(seen_k, key.to(acc), 0)
    s = torch.einsum("bhqd,bhkd->bhqk", torch.where(sees_q, query.to(acc), 0), key) * scale
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.where(vis, torch.exp(s - lse_safe[..., None]), 0)
    out = torch.einsum("bhqk,bhkd->bhqd", p, torch.where(seen_k, value.to(acc), 0)).to(query.dtype)
    lse = lse.to(torch.float32) if acc == torch.float32 else lse
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=lse)
    return (out, lse) if return_lse else out
