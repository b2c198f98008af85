"""How Split-KV cuts one call into k pipelined chunks: by query rows or by heads (one interface).

Every chunk c is, on every rank, a segment of `segment(c)` = (rows, q heads) of that rank's padded query
rows ([rows_max, Hq, D], rows_max = max(n_blocks) * B): its Q, dO and statistics travel in one all-gather
per chunk, its [O | lse] and dQ partials in one all-to-all per chunk, each overlapping the next chunk's
kernel. The bytes per collective name do not depend on k or on the axis (only the record count).

- `RowChunks`: chunk c = the blocks [b0, b1) of every rank's padded segment, all heads.
- `HeadChunks`: chunk c = the kv heads [g0, g1) and q heads [g0 * G, g1 * G) (G = Hq / Hkv, GQA groups
  whole) of all rows; dK / dV of a chunk are final (written into its kv heads), not summed over chunks.

Built once per metadata (`chunking_for`, cached) or from sizes (`make_chunking`, for the schedule).
Source: DESIGN.md section 2; docs/lab/splitkv_notes.md (why heads).
"""

from __future__ import annotations

import weakref

import torch

from .common import pad_rows, with_own_keys, zero_invalid_rows, zero_scalar


def chunk_bounds(num_chunks: int, size: int) -> list:
    """[(a0, a1)] per chunk: chunk c covers [c * size // k, (c + 1) * size // k) of `size` blocks (or kv heads);
    sizes differ by at most one, equal when k divides size."""
    return [(c * size // num_chunks, (c + 1) * size // num_chunks) for c in range(num_chunks)]


class RowChunks:
    """Chunk c = the blocks `bounds[c]` = [b0, b1) of every rank's padded segment, every head.

    Args: bounds: [(b0, b1)] per chunk (`SplitKVMetadata.chunks`); block_size: B; num_heads_q / num_heads_kv:
    Hq / Hkv."""

    axis = "rows"

    def __init__(self, bounds, block_size: int, num_heads_q: int, num_heads_kv: int):
        self.bounds, self.block_size = list(bounds), block_size
        self.num_heads_q, self.num_heads_kv = num_heads_q, num_heads_kv

    def __len__(self) -> int:
        return len(self.bounds)

    def rows(self, c: int):
        """(r0, r1): chunk c's rows of each rank's padded segment."""
        b0, b1 = self.bounds[c]
        return b0 * self.block_size, b1 * self.block_size

    def heads(self, c: int):
        """(h0, h1): chunk c's q heads."""
        return 0, self.num_heads_q

    def kv_heads(self, c: int):
        """(g0, g1): chunk c's kv heads."""
        return 0, self.num_heads_kv

    def segment(self, c: int):
        """(rows, q heads) of chunk c on each rank: the leading shape of its messages."""
        r0, r1 = self.rows(c)
        h0, h1 = self.heads(c)
        return r1 - r0, h1 - h0

    @property
    def merges_into_one(self) -> bool:
        """Whether the owner must merge every chunk into one output even without the in-place merge
        (`fused_merge.merges_in_place`): False, the row chunks' results concatenate."""
        return False

    def sends(self, x, rows_max: int, fill=0, valid_rows=None) -> list:
        """Per chunk, this rank's part of x [rows, Hq, ...] padded to rows_max rows of `fill` (valid_rows [rows]
        bool given: invalid blocks' rows zeroed, padding 0): slices of ONE padded copy, each contiguous."""
        if valid_rows is None:
            x_pad = pad_rows(x, rows_max, fill)
        else:
            x_pad = zero_invalid_rows(x, valid_rows, rows_max)
        return [x_pad[r0:r1] for r0, r1 in map(self.rows, range(len(self)))]

    def local_keys(self, x_ctx, order, x_blk, valid_rows, strided_heads: bool):
        """(per chunk the local keys or values of its kernel call, the tensors to save for backward): the
        one call's keys (`with_own_keys`: sorted context [+ padding + own block]) for every chunk."""
        x = with_own_keys(x_ctx, order, x_blk, valid_rows)
        return [x] * len(self), [x]

    def saved_keys(self, saved) -> list:
        """Per chunk its local keys from what `local_keys` saved."""
        return [saved[0]] * len(self)

    def kv_grads(self, meta, dtype, acc):
        """An accumulator of the chunks' dK / dV: k > 1 summed in `acc` from the first chunk's exact upcast,
        k = 1 the chunk's result itself."""
        return _SummedGrads(len(self), acc, meta.order)


class HeadChunks(RowChunks):
    """Chunk c = the q heads `heads[c]` (GQA groups whole) of every row of each rank's padded segment.

    Args: heads: [(h0, h1)] per chunk (`SplitKVMetadata.chunk_heads`); max_blocks: max(n_blocks); block_size,
    num_heads_q, num_heads_kv as `RowChunks`."""

    axis = "heads"

    def __init__(self, heads, max_blocks: int, block_size: int, num_heads_q: int, num_heads_kv: int):
        super().__init__([(0, max_blocks)] * len(heads), block_size, num_heads_q, num_heads_kv)
        self.head_bounds = list(heads)

    def heads(self, c: int):
        return self.head_bounds[c]

    def kv_heads(self, c: int):
        grp = self.num_heads_q // self.num_heads_kv
        h0, h1 = self.head_bounds[c]
        return h0 // grp, h1 // grp

    @property
    def merges_into_one(self) -> bool:
        """True: each chunk's merge writes its heads of the one output."""
        return True

    def sends(self, x, rows_max: int, fill=0, valid_rows=None) -> list:
        """Per chunk, its q heads of every row of x [rows, Hq, ...] as ONE contiguous [rows_max, Hc, ...]
        tensor, rows >= rows filled with `fill` (valid_rows given: invalid blocks' rows zeroed). Chunks of
        equal width: views of one chunk-major [k, rows_max, Hc, ...] buffer written by one copy (select) and
        one fill; unequal ones one copy and fill per chunk. The same values either way."""
        heads, rows = self.head_bounds, x.shape[0]
        widths = {h1 - h0 for h0, h1 in heads}
        if len(widths) > 1:
            if valid_rows is not None:
                return [zero_invalid_rows(x[:, h0:h1], valid_rows, rows_max) for h0, h1 in heads]
            return [pad_rows(x[:, h0:h1], rows_max, fill) for h0, h1 in heads]
        k, hc = len(heads), widths.pop()
        buf = x.new_empty((k, rows_max, hc) + tuple(x.shape[2:]))
        src = x.unflatten(1, (k, hc)).transpose(0, 1)  # [k, rows, Hc, ...] view
        if valid_rows is None:
            buf[:, :rows].copy_(src)
        else:
            torch.where(valid_rows[:, None, None], src, zero_scalar(x.dtype, x.device), out=buf[:, :rows])
        if rows_max > rows:
            buf[:, rows:].fill_(fill)
        return list(buf.unbind(0))

    def local_keys(self, x_ctx, order, x_blk, valid_rows, strided_heads: bool):
        """A kernel taking strided heads (`strided_heads`, kernels/base.py): kv-head views [:, g0:g1] of the
        one call's keys (saved: that tensor); else one `with_own_keys` per chunk from its kv heads (the same
        gathering copy, split by heads; saved: every chunk's)."""
        if strided_heads:
            x = with_own_keys(x_ctx, order, x_blk, valid_rows)
            return self.saved_keys([x]), [x]
        xs = [with_own_keys(x_ctx[:, g0:g1], order, None if x_blk is None else x_blk[:, g0:g1], valid_rows)
              for g0, g1 in map(self.kv_heads, range(len(self)))]
        return xs, xs

    def saved_keys(self, saved) -> list:
        if len(saved) == 1:
            return [saved[0][:, g0:g1] for g0, g1 in map(self.kv_heads, range(len(self)))]
        return list(saved)

    def kv_grads(self, meta, dtype, acc):
        """An accumulator writing each chunk's dK / dV into its kv heads of one `dtype` result."""
        return _HeadGrads(self, meta, dtype)


class _SummedGrads:
    """Row chunks' dK / dV: summed over chunks in `acc` (fp32 += the inputs' dtype: the same additions as
    adding the upcast); one chunk: its result as it came."""

    def __init__(self, n: int, acc, order):
        self.n, self.acc, self.order, self.dk, self.dv = n, acc, order, None, None

    def add(self, c: int, dk, dv) -> None:
        if self.dk is None:
            self.dk, self.dv = (dk, dv) if self.n == 1 else (dk.to(self.acc), dv.to(self.acc))
        else:
            self.dk += dk
            self.dv += dv

    def result(self):
        """(dk, dv, order): the gradients over the sorted local keys and the order that unsorts them."""
        return self.dk, self.dv, self.order


class _HeadGrads:
    """Head chunks' dK / dV: final per chunk, written in the inputs' dtype into its kv heads. A kernel
    returning that dtype: in context order (`grad_rows`: the unsort folded into the one `index_copy_`); an
    fp32 result for bf16 / fp16 inputs: cast by a copy in sorted order, unsorted once after the chunks."""

    def __init__(self, chunking, meta, dtype):
        self.chunking, self.meta, self.dtype = chunking, meta, dtype
        self.dk = self.dv = self.rows = None

    def add(self, c: int, dk, dv) -> None:
        if self.dk is None:
            self.dk = dk.new_empty((dk.shape[0], self.chunking.num_heads_kv, dk.shape[2]), dtype=self.dtype)
            self.dv = dv.new_empty((dv.shape[0], self.chunking.num_heads_kv, dv.shape[2]), dtype=self.dtype)
            if dk.dtype == self.dtype:
                self.rows = grad_rows(self.meta, dk.shape[0], dk.device)
        g0, g1 = self.chunking.kv_heads(c)
        for dst, src in ((self.dk, dk), (self.dv, dv)):
            if self.rows is None:
                dst[:, g0:g1].copy_(src)
            else:
                dst[:, g0:g1].index_copy_(0, self.rows, src)

    def result(self):
        return self.dk, self.dv, self.meta.order if self.rows is None else None


#: per metadata (weakly held), per local key count: `grad_rows`' index
_GRAD_ROWS = weakref.WeakKeyDictionary()


def grad_rows(meta, num_keys: int, device):
    """Where a head chunk's dK / dV rows go: None when the local context is already sorted (`meta.order`
    None), else an int64 index [num_keys] for `index_copy_`: sorted context row i -> context token
    `meta.order[i]`, every later row (own-key padding and own keys, `with_own_keys`) to itself. Built once
    per metadata and key count."""
    order = meta.order
    if order is None:
        return None
    cache = _GRAD_ROWS.setdefault(meta, {})
    idx = cache.get(num_keys)
    if idx is None:
        n = order.shape[0]
        idx = cache[num_keys] = torch.cat([order, torch.arange(n, num_keys, dtype=order.dtype, device=device)])
    return idx


def make_chunking(axis: str, num_chunks: int, max_blocks: int, block_size: int, num_heads_q: int,
                  num_heads_kv: int):
    """The chunking of `num_chunks` (already resolved: `ops.metadata.resolve_num_chunks`) chunks along `axis`
    ("rows": `chunk_bounds(k, max_blocks)` blocks; "heads": `chunk_bounds(k, Hkv)` kv heads, all rows).
    ValueError for another axis."""
    if axis == "rows":
        return RowChunks(chunk_bounds(num_chunks, max_blocks), block_size, num_heads_q, num_heads_kv)
    if axis == "heads":
        grp = num_heads_q // num_heads_kv
        heads = [(g0 * grp, g1 * grp) for g0, g1 in chunk_bounds(num_chunks, num_heads_kv)]
        return HeadChunks(heads, max_blocks, block_size, num_heads_q, num_heads_kv)
    raise ValueError(f"chunk_axis must be 'rows' or 'heads', got {axis!r}")


_CHUNKINGS = weakref.WeakKeyDictionary()


def chunking_for(meta):
    """The chunking of a splitkv `SplitKVMetadata` (its `chunks`, `chunk_heads`, `chunk_axis`), built once
    per metadata: `HeadChunks` for chunk_axis "heads" with k > 1, else `RowChunks`."""
    ch = _CHUNKINGS.get(meta)
    if ch is None:
        hq, hkv, bsz = meta.num_heads_q, meta.num_heads_kv, meta.block_size
        if meta.chunk_axis == "heads" and meta.num_chunks > 1:
            ch = HeadChunks(meta.chunk_heads, max(meta.n_blocks), bsz, hq, hkv)
        else:
            ch = RowChunks(meta.chunks, bsz, hq, hkv)
        _CHUNKINGS[meta] = ch
    return ch
