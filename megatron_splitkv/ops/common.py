"""Pieces shared by Split-KV attention and its two baselines (one copy of each, used by all three ops).

- context sorting by (sequence id, position) and per-block key intervals (`IntervalMask`).
- the own block fused into the local kernel (perf-notes item 1): the blocks' own keys are appended after
  the sorted context keys, padded to a multiple of `OWN_KEY_ALIGN` (`with_own_keys`), and the blocks get
  second intervals over them (`with_own_blocks`, the union contract of `kernels/base.py`), so ONE kernel
  call computes context + own-block attention and its gradients (dk/dv of the appended rows are
  dk_blk/dv_blk). Absent when the call passes k_blk = v_blk = None (plain cross-attention: rows attend
  only the context).
- the lse merge (`lse_weights`, `finalize`, `merge`): fp32 accumulation, rows whose partial lse are all
  -inf give O = 0 and lse = -inf, never NaN.
- empty-input guards around the local kernel; invalid blocks' query rows zeroed before any kernel
  (`zero_invalid_rows`), like their own keys (`with_own_keys`).

Validation, the size all-gather and the per-step metadata (sort order, intervals) live in
`ops/metadata.py` (`prepare_splitkv_metadata`, `SplitKVMetadata`, `run_op`).

Source: arXiv 2611.05926 (Split-KV), DESIGN.md sections 1 (mask) and 2 (algorithm).
"""

from __future__ import annotations

import torch

from ..config import FUSED_BWD_GATHER_MIN_P
from ..kernels.base import IntervalMask
from ..lse import finalize, lse_weights

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INT32 = 1 << 31  # sequence ids and positions must lie in [-2**31, 2**31)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- sorting and intervals


def context_keys(kv_seq: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
    """One int64 key per context token, ordered like (seq, pos): seq * 2**32 + (pos + 2**31)."""
    return kv_seq * (1 << 32) + (kv_pos + _INT32)


def sort_keys(keys: torch.Tensor):
    """Return (sorted keys, order) with keys_sorted = keys[order]; order is None when already sorted
    (no copy). The already-sorted test is one host sync: called once per step, at metadata time."""
    if keys.numel() <= 1 or bool((keys[1:] >= keys[:-1]).all()):
        return keys, None
    return torch.sort(keys, stable=True)


def unsort(x_sorted: torch.Tensor, order):
    """Inverse of `x[order]` along dim 0 (identity when order is None)."""
    if order is None:
        return x_sorted
    return torch.empty_like(x_sorted).index_copy_(0, order, x_sorted)


def intervals(keys_sorted, block_seq, block_anchor, block_size, window=None) -> IntervalMask:
    """IntervalMask of blocks against sorted context keys: block b sees keys of sequence block_seq[b]
    with position < block_anchor[b] (strictly); blocks with anchor < 0 see nothing. window (None or the
    sliding window W >= 1, `reference.check_attention_type`): row j of block b sees only positions
    > anchor + j - W (`window_rows`: per-row bounds, the block interval their union)."""
    base = block_seq * (1 << 32)
    lo = torch.searchsorted(keys_sorted, base)
    # keys with pos < anchor  <=>  key <= base + (anchor - 1) + 2**31 (searchsorted right). The anchor is
    # clamped to [0, 2**31] (positions lie in [-2**31, 2**31): anchor 2**31 already sees every position),
    # so the bound is at most (2**31 - 1) * 2**32 + 2**32 - 1 = 2**63 - 1 and never wraps in int64.
    # Anchors < 0 (invalid blocks) get the empty interval [lo, lo).
    hi = torch.searchsorted(keys_sorted, base + (block_anchor.clamp(0, _INT32) + (_INT32 - 1)), right=True)
    hi = torch.where(block_anchor >= 0, hi, lo)
    if window is None:
        return IntervalMask(block_size, lo, hi, int(keys_sorted.shape[0]))
    row_lo = window_rows(keys_sorted, base, block_anchor, lo, hi, block_size, window)
    return IntervalMask(block_size, row_lo[:, 0].contiguous(), hi, int(keys_sorted.shape[0]),
                        row_lo=row_lo.reshape(-1))


#: windows at least this large see what an unbounded window sees (positions span 2**32, blocks are smaller)
_WINDOW_CAP = 1 << 40


def window_rows(keys_sorted, base, anchor, lo, hi, block_size, window) -> torch.Tensor:
    """[n_blocks, B] int64: per row j of block b (sequence base[b] = seq * 2**32, anchor[b], block interval
    [lo[b], hi[b]) of the positions < anchor) the first sorted key with position > anchor + j - W, clamped
    to [lo[b], hi[b]]: row j sees [row_lo, hi[b]). Exact for every int64-safe input: the bound is formed
    as `key <= base + pos - 1 + 2**31` (searchsorted right) with pos clamped to [1 - 2**31, 2**31], and
    rows whose bound lies at or below -2**31 take the sequence's first key (lo[b])."""
    w = min(int(window), _WINDOW_CAP)
    j = torch.arange(block_size, dtype=torch.int64, device=anchor.device)
    pos = anchor.clamp(0, _INT32)[:, None] + (j - (w - 1))[None, :]  # first visible position of row j
    bound = base[:, None] + (pos.clamp(1 - _INT32, _INT32) + (_INT32 - 1))
    first = torch.searchsorted(keys_sorted, bound, right=True)
    first = torch.where(pos > -_INT32, first, lo[:, None])
    return torch.minimum(torch.maximum(first, lo[:, None]), hi[:, None])


def own_rows(lo2, hi2, block_size, window=None, causal=False):
    """Per-row bounds of the own-block region (`IntervalMask.row_lo2 / row_hi2`, [n_blocks * B] int64) for
    a windowed or causal layer: row j of a block with own keys [lo2, lo2 + B) sees own keys
    lo2 + [max(0, j - W + 1), j + 1 if causal else min(B, j + W)) (`reference.own_block_pattern`); blocks
    without own keys get [lo2, lo2). (None, None) when window is None and not causal (the whole block)."""
    if window is None and not causal:
        return None, None
    j = torch.arange(block_size, dtype=torch.int64, device=lo2.device)
    w = block_size if window is None else min(int(window), block_size)
    first = (j - (w - 1)).clamp(min=0)
    end = j + 1 if causal else (j + w).clamp(max=block_size)
    has = (hi2 > lo2)[:, None]
    row_lo2 = torch.where(has, lo2[:, None] + first[None, :], lo2[:, None]).reshape(-1)
    row_hi2 = torch.where(has, lo2[:, None] + end[None, :], lo2[:, None]).reshape(-1)
    return row_lo2, row_hi2


def pad_rows(x: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    """x [T, ...] padded along dim 0 to `rows` (>= T) rows of `value`: x itself when it already has `rows`
    rows and is contiguous, else ONE new contiguous tensor written by a copy and a fill (the copy that pads
    also makes a strided x contiguous, e.g. a head chunk's heads of every row: a collective's send buffer)."""
    if x.shape[0] == rows and x.is_contiguous():
        return x
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    out[: x.shape[0]].copy_(x)
    if rows > x.shape[0]:
        out[x.shape[0]:].fill_(value)
    return out


# ----------------------------------------------------------------------------- merge by lse


def _bits_per(src: torch.dtype, dtype: torch.dtype) -> int:
    """How many `dtype` elements hold one `src` element bit-exact (src.itemsize / dtype.itemsize >= 1).
    Raises ValueError when `src` does not split into whole `dtype` elements."""
    a, b = torch.empty((), dtype=src).element_size(), torch.empty((), dtype=dtype).element_size()
    if a < b or a % b:
        raise ValueError(f"cannot pack a {src} tensor into {dtype}")
    return a // b


def packed_width(head_dim: int, stat_dtype: torch.dtype, dtype: torch.dtype, stats: int = 1) -> int:
    """Elements of `dtype` per head of D values with `stats` `stat_dtype` values bit-packed beside them:
    D + stats * r (`pack_partial`: stats 1, lse; `pack_dout_stats`: stats 2, delta and lse)."""
    return head_dim + stats * _bits_per(stat_dtype, dtype)


def _as_bits(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., k] (float32/64) reinterpreted as [..., k * r] `dtype` elements (bit-exact, no arithmetic).
    A view of x (no copy, any strides on the other dims, e.g. FlexAttention's transposed lse) when x's last
    dim has stride 1, else of a contiguous copy."""
    r = _bits_per(x.dtype, dtype)
    if x.dim() and x.stride(-1) == 1:
        return x.view(dtype)  # the last dim scales by r, the other strides by r: the same bytes
    # flattened first: .contiguous() keeps any stride on a size-1 dim (e.g. [T, 1] for one head, as
    # FlexAttention returns it), and a dtype view needs stride 1 in the last dim
    return x.contiguous().reshape(-1).view(dtype).view(*x.shape[:-1], x.shape[-1] * r)


def pack_partial(o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None):
    """One transport tensor for a partial attention state: o [T, H, D] cast to `dtype` (the inputs'
    dtype: the precision FlexAttention/TE already store O in) and lse [T, H] (float32/64) appended
    BIT-EXACT as lse.itemsize / dtype.itemsize extra elements per head -> [T, H, D + r] in `dtype`.
    Undone by `unpack_partial`; used by Split-KV's all-to-all merge (no arithmetic in transit). o and lse
    may have more leading dims ([..., H, D] / [..., H]).

    out: optional destination of shape [..., H, D + r] in `dtype`, e.g. a permuted view of a send buffer
    (Split-KV's two-level all-to-all writes the rows in node-major order this way, in the same single
    copy); returned. Raises ValueError when lse's dtype does not split into whole `dtype` elements."""
    packed = _as_bits(lse[..., None], dtype)
    d, r = o.shape[-1], packed.shape[-1]
    if out is None and o.dtype == dtype:  # O already in the transport dtype (a kernel's native result)
        return torch.cat([o, packed], -1)  # both copies in one launch
    if out is None:
        out = torch.empty(tuple(o.shape[:-1]) + (d + r,), dtype=dtype, device=o.device)
    out[..., :d].copy_(o)  # the cast of o.to(dtype), written in place (no [T, H, D] temporary)
    out[..., d:].copy_(packed)
    return out


def local_index_major(x: torch.Tensor, nodes: int, per_node: int, dtype: torch.dtype | None = None):
    """Rows of x [P * T, ...] in owner order (P = nodes * per_node owners of T rows each, owner
    s = n * per_node + j: node n, local index j) reordered local-index-major, in ONE copy (cast to `dtype`,
    default x's): block j of the result ([nodes * T, ...], node order) holds the rows of the owners
    (0, j), ..., (nodes - 1, j), i.e. what stage 1 of Split-KV's two-level all-to-all sends to local peer
    j. Returns a new contiguous [P * T, ...] tensor."""
    t = x.shape[0] // (nodes * per_node)
    out = torch.empty(x.shape, dtype=x.dtype if dtype is None else dtype, device=x.device)
    out.view(per_node, nodes, t, *x.shape[1:]).transpose(0, 1).copy_(x.reshape(nodes, per_node, t, *x.shape[1:]))
    return out


def pack_partial_local_major(o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, nodes: int, per_node: int):
    """`pack_partial(o, lse, dtype)` with the rows reordered as `local_index_major(., nodes, per_node)`, in
    the same single packing copy: o [P * T, H, D], lse [P * T, H] (owner order) -> [P * T, H, D + r] in
    `dtype`, the send buffer of stage 1 of Split-KV's two-level forward all-to-all."""
    t, (h, d) = o.shape[0] // (nodes * per_node), o.shape[1:]
    r = _bits_per(lse.dtype, dtype)
    out = torch.empty((o.shape[0], h, d + r), dtype=dtype, device=o.device)
    o4, l4 = o.reshape(nodes, per_node, t, h, d), lse.reshape(nodes, per_node, t, h)
    pack_partial(o4, l4, dtype, out=out.view(per_node, nodes, t, h, d + r).transpose(0, 1))
    return out


def unpack_partial(x: torch.Tensor, head_dim: int, acc: torch.dtype):
    """Inverse of `pack_partial`: x [T, H, D + r] -> (o [T, H, D] in `acc`, lse [T, H] in `acc`, bit-exact
    as packed)."""
    o = x[..., :head_dim].to(acc)
    lse = x[..., head_dim:].contiguous().view(acc)[..., 0]
    return o, lse


_RELAY_STREAMS: dict = {}  # device index -> the relay stream, created once per process


class RelayStream:
    """The relay of Split-KV's two-level all-to-all (docs/lab/perf-notes.md item 18; `ops.transport._TwoStage`):
    a CUDA side stream (one per device and process) on which the op waits for a chunk's stage 1, runs the
    node merge / node sum of the L received partials (fp32) and issues stage 2, so that the caller's
    ("main") stream never waits for stage 1: the next chunk's kernel, the op's own epilogue and (backward)
    the caller's k/v projection backward run while stage 1, the node merge and stage 2 proceed. Only the
    consumer of stage 2's result (the owner's merge or dQ sum, on main) waits, for stage 2, whose NCCL
    stream waited for the relay when it was issued.

    Protocol (the op, per chunk): `mark()` on main right after issuing stage 1 (an event: everything main
    issued before, i.e. the stage-1 inputs, happens before the relay's work); `run(pending, fn)` waits the
    mark on the relay, marks the stage-1 receive buffer (allocated on main) as used by the relay, and calls
    fn() inside the relay stream's context; `taken(t)` marks a relay-allocated result (stage 2's receive
    buffer) as used by the stream consuming it. Memory safety: record_stream on every
    buffer crossing streams, so the caching allocator never hands out memory still read by another stream.
    `RelayStream.get(device)` is None off CUDA: the op then runs everything on main, in the same host order. Same kernels, same inputs,
    same order of every reduction: results are bit-identical with or without the relay."""

    __slots__ = ("stream",)

    def __init__(self, stream):
        self.stream = stream

    @classmethod
    def get(cls, device):
        """The relay for `device` (a CUDA device), else None."""
        dev = torch.device(device)
        if dev.type != "cuda":
            return None
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        s = _RELAY_STREAMS.get(idx)
        if s is None:
            s = _RELAY_STREAMS[idx] = torch.cuda.Stream(device=idx)
        return cls(s)

    def mark(self):
        """An event recorded on the current (main) stream now."""
        return torch.cuda.current_stream(self.stream.device).record_event()

    def run(self, mark, pending, fn):
        """fn() on the relay stream after `mark`; `pending` (a `comm.Pending`, stage 1) has its result
        marked as used by the relay (fn waits for it there: `Pending.wait` makes the current stream wait)."""
        self.stream.wait_event(mark)
        res = getattr(pending, "result", None)
        if isinstance(res, torch.Tensor) and res.is_cuda:
            res.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            return fn()

    @staticmethod
    def taken(t):
        """A relay-allocated tensor about to be consumed on the current stream: marked used there."""
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
        return t


def fuse_bwd_gather(cp_size: int, two_level: bool) -> bool:
    """Whether Split-KV's backward sends dO and (delta, lse) in ONE all-gather per chunk
    (`pack_dout_stats`, name "splitkv.bwd.dout") instead of two ("splitkv.bwd.dout" + "splitkv.bwd.stats").

    Fused when the two-level all-to-all is on (`two_level`: a multi-node group) or when cp_size >=
    `FUSED_BWD_GATHER_MIN_P` = 9, larger than one 8-GPU node (a constant, not an option: docs/tuning.md; the
    measurements behind it: docs/lab/splitkv_notes.md). Same results either way (bit for bit)."""
    return bool(two_level) or cp_size >= FUSED_BWD_GATHER_MIN_P


def pack_dout_stats(dout: torch.Tensor, stats: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One rank's segment of Split-KV's backward all-gather of a chunk: dO and the global statistics in
    ONE flat transport tensor (one collective instead of two).

    dout [T, Hq, D] (cast to `dtype`, the inputs' dtype: what the separate dO gather sent) and stats
    [T, Hq, k] in the accumulation dtype (float32 / float64; k = 2: delta, lse) reinterpreted BIT-EXACT
    as k * r elements of `dtype` per head (r = stats.itemsize / dtype.itemsize, as `pack_partial` packs
    lse) -> 1-D [T * Hq * D + T * Hq * k * r] in `dtype`: all of dO's rows, then all the statistics (a
    per-rank block layout, not per row: packing and `unpack_dout_stats` then copy long contiguous runs,
    about 2.5x faster on an H200 than a per-row layout's strided copies). One concatenation kernel.
    The caller pads the rows (dO with 0, statistics with -inf, as the separate gathers did).

    Raises ValueError when the stats dtype does not split into whole `dtype` elements."""
    return torch.cat([dout.to(dtype).reshape(-1), _as_bits(stats, dtype).reshape(-1)])


def unpack_dout_stats(x: torch.Tensor, parts: int, heads: int, head_dim: int, acc: torch.dtype, k: int = 2):
    """Inverse of `pack_dout_stats` after an all-gather of `parts` equal segments: x 1-D [parts * seg] in
    the inputs' dtype -> (dout [parts * T, Hq, D] contiguous in x's dtype, stats [parts * T, Hq, k]
    contiguous in `acc`), rank r's rows at [r * T, (r + 1) * T): exactly the two former gathers' results,
    bit for bit (the caller can release x; the local kernel gets a contiguous dO). Each is ONE batched
    concatenation of `parts` contiguous runs (on an H200 at memcpy speed, where a 2-D strided copy_ ran
    2.2x slower)."""
    r = _bits_per(acc, x.dtype)
    row = heads * (head_dim + k * r)
    t = x.numel() // max(parts * row, 1)
    n_do = t * heads * head_dim
    segs = x.view(parts, t * row)
    dout = torch.empty((parts * t, heads, head_dim), dtype=x.dtype, device=x.device)
    torch.cat(segs[:, :n_do].unbind(0), out=dout.view(-1))
    stats = torch.empty((parts * t, heads, k * r), dtype=x.dtype, device=x.device)
    torch.cat(segs[:, n_do:].unbind(0), out=stats.view(-1))
    return dout, stats.view(acc)


def merge_partials(o: torch.Tensor, lse: torch.Tensor):
    """Exact merge of P partial states of the same rows: o [P, T, H, D], lse [P, T, H] (acc dtype) ->
    (out [T, H, D], lse [T, H]); rows with every partial lse = -inf give out 0 and lse -inf, never NaN.
    The fused lse merge of Split-KV's owner (DESIGN.md section 2, forward step 3, done after an
    all-to-all instead of an all-reduce MAX + reduce-scatter)."""
    m_safe, w = lse_weights(lse, lse.max(0).values)
    return finalize(torch.einsum("pthd,pth->thd", o, w), w.sum(0), m_safe, inplace=True)


# ----------------------------------------------------------------------------- own block in the kernel

#: Region 2 (own-block keys) starts at a multiple of this (FlexAttention's key tile, `kernels.flex.TILE`),
#: so no 128-key tile mixes context and own keys and the block tables stay exact (kernels/base.py).
OWN_KEY_ALIGN = 128


def own_key_start(num_ctx: int) -> int:
    """First key row of the own-block region after `num_ctx` context keys: num_ctx rounded up to a
    multiple of OWN_KEY_ALIGN (0 stays 0)."""
    return -(-int(num_ctx) // OWN_KEY_ALIGN) * OWN_KEY_ALIGN


def with_own_blocks(mask: IntervalMask, valid: torch.Tensor, num_own_blocks: int, *, first_block: int = 0,
                    first_key_block: int = 0, debug: bool = False, window=None, causal=False) -> IntervalMask:
    """`mask` (context intervals over mask.num_keys sorted keys) extended by own-block second intervals.

    Keys of the result: [context (mask.num_keys) ; zeros up to C = own_key_start(mask.num_keys) ; own keys
    of `num_own_blocks` blocks (B each)] (what `with_own_keys` builds). Block first_block + i, for
    i < len(valid), sees own keys [C + (first_key_block + i) * B, + B) when valid[i] (bool); every other
    block gets an empty second interval. window / causal (the layer's attention type): per-row bounds of
    the own block (`own_rows`); the per-row context bounds of `mask` are kept. With `debug`
    (`SplitKVConfig.debug_checks`), validated against the union contract
    (one host sync: call at metadata time; ValueError when it is violated: a bug of the caller's layout);
    off (the default) the result is correct by construction for any first_block / valid in range.
    """
    bsz, dev = mask.block_size, mask.lo.device
    c0 = own_key_start(mask.num_keys)
    n = int(valid.shape[0])
    start = c0 + (first_key_block + torch.arange(n, dtype=torch.int64, device=dev)) * bsz
    lo2 = torch.full((mask.num_blocks,), c0, dtype=torch.int64, device=dev)
    hi2 = lo2.clone()
    lo2[first_block:first_block + n] = torch.where(valid, start, c0)
    hi2[first_block:first_block + n] = torch.where(valid, start + bsz, c0)
    row_lo2, row_hi2 = own_rows(lo2, hi2, bsz, window, causal)
    out = IntervalMask(bsz, mask.lo, mask.hi, c0 + num_own_blocks * bsz, lo2, hi2, num_ctx_keys=c0,
                       row_lo=mask.row_lo, row_lo2=row_lo2, row_hi2=row_hi2)
    return out.validate() if debug else out


_ZEROS: dict = {}  # (dtype, device) -> a 0-dim zero, made once per process (read-only)


def zero_scalar(dtype: torch.dtype, device) -> torch.Tensor:
    """A cached 0-dim zero of `dtype` on `device`, the `other` of the ops' `torch.where(valid, x, 0, out=)`
    selects (torch.where's out= variant takes no Python scalar): made once, not one fill per call."""
    key = (dtype, torch.device(device))
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros((), dtype=dtype, device=device)
    return z


def with_own_keys(src: torch.Tensor, index, k_blk, valid_rows: torch.Tensor) -> torch.Tensor:
    """The local keys (or values) of one kernel call as ONE new tensor.

    Rows [0, n): src[index] (src when index is None; n = len(index) or len(src)); with k_blk given,
    then zeros up to own_key_start(n) and k_blk [Tq, H, D] with the rows of invalid blocks
    (valid_rows [Tq] bool False) zeroed, so that no NaN/inf of an invalid block's keys can reach a
    kernel tile (FlexAttention multiplies whole partial tiles on the GPU). k_blk None: src[index]
    (src.contiguous() without a copy when index is None too). No host sync.
    """
    if k_blk is None:
        return src.contiguous() if index is None else src.index_select(0, index)
    n = src.shape[0] if index is None else index.shape[0]
    c0 = own_key_start(n)
    out = src.new_empty((c0 + k_blk.shape[0],) + tuple(src.shape[1:]))
    if index is None:
        out[:n].copy_(src)
    else:
        torch.index_select(src, 0, index, out=out[:n])
    if c0 > n:
        out[n:c0].zero_()
    torch.where(valid_rows[:, None, None], k_blk, zero_scalar(k_blk.dtype, k_blk.device), out=out[c0:])
    return out


def zero_invalid_rows(x: torch.Tensor, valid_rows: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """x [T, H, D] with the rows of invalid blocks (valid_rows [T] bool False) zeroed, padded with zero
    rows to `rows` (default T): one new tensor, no host sync. The ops pass queries through it so that a
    NaN/inf in an invalid block's q never reaches a kernel tile (on the GPU, FlexAttention's backward
    computes dK = dS^T Q over whole tiles: 0 * NaN would reach the keys other rows of the tile see)."""
    rows = x.shape[0] if rows is None else rows
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    torch.where(valid_rows[:, None, None], x, zero_scalar(x.dtype, x.device), out=out[: x.shape[0]])
    if rows > x.shape[0]:
        out[x.shape[0]:].zero_()
    return out


def split_own_grad(d_x: torch.Tensor, n_ctx: int, has_own: bool):
    """(context part [n_ctx], own part or None) of a kernel's dk/dv over `with_own_keys` rows."""
    if not has_own:
        return d_x, None
    return d_x[:n_ctx], d_x[own_key_start(n_ctx):]


def cast(t, dtype):
    """t.to(dtype), None passing through (the gradients of k_blk = v_blk = None)."""
    return None if t is None else t.to(dtype)


# ----------------------------------------------------------------------------- kernel guards


def native_results(plan) -> bool:
    """Whether the call's kernel can return its results in the input dtype (`native=True` of its forward /
    backward, the optional capability `native_dtype_results` of kernels/base.py): FlexAttention stores out,
    dq, dk, dv in the input dtype anyway, so the contract's fp32 upcast followed by the op's cast back to
    the transport dtype is a round trip of identical values (two copies per tensor, skipped)."""
    return bool(getattr(plan.kernel, "native_dtype_results", False))


def kernel_forward(plan, q, k, v, mask: IntervalMask, native: bool = False):
    """Local kernel forward; empty queries or keys short-circuit to (0, -inf, None). native: `out` may come
    in the input dtype and with any strides (`native_results`), lse in acc with any strides; the values are
    those the fp32 path would return (the fp32 out is their exact upcast)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=plan.acc, device=q.device)
        return out, torch.full(q.shape[:2], float("-inf"), dtype=plan.acc, device=q.device), None
    if native and native_results(plan):
        return plan.kernel.forward(q, k, v, mask, plan.scale, native=True)
    out, lse, state = plan.kernel.forward(q, k, v, mask, plan.scale)
    return out.to(plan.acc), lse.to(plan.acc), state


def kernel_backward(plan, q, k, v, mask, dout, lse, delta, state, native: bool = False):
    """Local kernel backward with the global lse/delta; empty inputs give zero gradients (acc dtype).
    native: the gradients may come in the input dtype (`native_results`: the values whose exact upcast the
    fp32 path returns)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        z = lambda t: torch.zeros(t.shape, dtype=plan.acc, device=q.device)  # noqa: E731
        return z(q), z(k), z(v)
    if native and native_results(plan):
        return plan.kernel.backward(q, k, v, mask, plan.scale, dout, lse, delta, state, native=True)
    dq, dk, dv = plan.kernel.backward(q, k, v, mask, plan.scale, dout, lse, delta, state)
    return dq.to(plan.acc), dk.to(plan.acc), dv.to(plan.acc)


def delta_and_dout(plan, dout, dlse, out, lse, like):
    """delta = rowsum(dO * O_final) - dlse (acc dtype; dlse folds the gradient of a returned lse into
    the same formula: d lse / d s = P). Returns (dout as a tensor shaped like `like`, delta)."""
    if dout is None:
        dout = torch.zeros_like(like)
    # dO (input dtype) * O (acc): computed in acc from dO's exact upcast, as (dO.to(acc) * O) is, without
    # the [T, H, D] acc copy of dO (out is acc: the product's dtype is acc)
    delta = (dout * out.to(plan.acc)).sum(-1)
    if dlse is not None:
        # |lse| < inf is isfinite(lse) (False for +-inf and NaN), in two ops instead of four; the scalar 0
        # needs no zeros_like
        delta = delta - torch.where(lse.abs() < float("inf"), dlse.to(plan.acc), 0.0)
    return dout, delta


def save_baseline_forward(ctx, plan, q, k_x, v_x, aux, out, lse):
    """End of a baseline op's forward (`allgather_kv`, `ring_kv`): ctx.plan = plan and (q, k_x, v_x, aux, out,
    lse) saved for `baseline_backward_inputs` (aux: the op's key index or sorted keys). Returns the op's
    outputs (out in q's dtype, lse)."""
    ctx.plan = plan
    ctx.save_for_backward(q, k_x, v_x, aux, out, lse)
    return out.to(q.dtype), lse


def baseline_backward_inputs(ctx, dout, dlse):
    """The inputs of a baseline op's backward, as `save_baseline_forward` saved them: (plan, q, k_x, v_x, aux,
    lse, dout, delta) with dout and delta from `delta_and_dout` (dout shaped like q where None)."""
    q, k_x, v_x, aux, out, lse = ctx.saved_tensors
    dout, delta = delta_and_dout(ctx.plan, dout, dlse, out, lse, q)
    return ctx.plan, q, k_x, v_x, aux, lse, dout, delta
