"""Context-parallel planning: which context chunks each CP rank holds (LPT and baselines).

Source: arXiv 2611.05926 (Split-KV), section "LPT load balancing"; DESIGN.md section 3.
See docs/lpt.md for the rules, bounds and benchmark numbers.
"""

import heapq
import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from .._ints import as_int

from .cost import CostModel, _pair_counts_inplace, chunk_window_pair_counts
from .hypergraph import hypergraph_assign

STRATEGIES = ("lpt", "contiguous", "zigzag", "hypergraph")
MIN_CHUNK = 64
MAX_CHUNK = 2048
CHUNK_ALIGN = 64
DEFAULT_TARGET_IMBALANCE = 0.005
CHUNKS_PER_RANK = 8  # granularity the automatic chunk size aims for (see auto_chunk_size)
MAX_TOKENS = 2**31 - 1  # largest batch (sum of seq_lens) the planner accepts: the op's int32 position range


@dataclass
class Plan:
    """A context-parallel layout of one packed batch.

    The packed batch holds sequences back to back: sequence j occupies packed token indices
    ``[seq_offsets[j], seq_offsets[j+1])`` at positions ``0 .. seq_lens[j]-1``.

    Attributes:
        strategy, cp_size, block_size, chunk_size (None for contiguous/zigzag), cost_model.
        seq_lens: [n_seq] int64; seq_offsets: [n_seq + 1] int64 packed offsets.
        chunk_seq, chunk_start, chunk_end: [n_chunks] int64, chunk c is positions
            [chunk_start[c], chunk_end[c]) of sequence chunk_seq[c] (non-empty; ordered by (seq, start)).
        chunk_cost: [n_chunks] float64 realized cost (CostModel units); chunk_rank: [n_chunks] int64.
        assign_order: [n_chunks] int64, chunk ids in the order the planner placed them.
        loads: [cp_size] float64 per-rank cost; imbalance: max/mean - 1 (0.0 when the total is 0).
        q_seq, q_anchor: [n_blocks_padded] int64, all query blocks (the anchors of sequence 0, then
            sequence 1, ...), padded with invalid blocks (q_seq = -1, q_anchor = -1) to a multiple of
            cp_size; rank r owns blocks ``[r * n_local, (r + 1) * n_local)``, n_local = n_padded / cp_size.
    """

    strategy: str
    cp_size: int
    block_size: int
    chunk_size: int | None
    cost_model: CostModel
    seq_lens: np.ndarray
    seq_offsets: np.ndarray
    chunk_seq: np.ndarray
    chunk_start: np.ndarray
    chunk_end: np.ndarray
    chunk_cost: np.ndarray
    chunk_rank: np.ndarray
    assign_order: np.ndarray
    loads: np.ndarray
    imbalance: float
    q_seq: np.ndarray
    q_anchor: np.ndarray
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.seq_offsets[-1])

    @property
    def blocks_per_rank(self) -> int:
        return int(self.q_seq.shape[0]) // self.cp_size

    @property
    def rank_chunks(self):
        """Per rank, the list of (seq, start, end) chunks in the order the planner placed them."""
        if "rank_chunks" not in self._cache:
            out = [[] for _ in range(self.cp_size)]
            for c in self.assign_order.tolist():
                out[int(self.chunk_rank[c])].append(
                    (int(self.chunk_seq[c]), int(self.chunk_start[c]), int(self.chunk_end[c]))
                )
            self._cache["rank_chunks"] = out
        return self._cache["rank_chunks"]

    def _check_rank(self, rank):
        if not 0 <= int(rank) < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.cp_size}), got {rank}")

    def token_index(self, rank) -> np.ndarray:
        """[T_r] int64 packed (global) indices of the context tokens of `rank`, ascending.

        Ascending packed order is (sequence id, position) order, the order the local kernels sort keys
        by. Computed on demand (each rank needs only its own) and cached.
        """
        self._check_rank(rank)
        key = ("idx", int(rank))
        if key not in self._cache:
            sel = np.flatnonzero(self.chunk_rank == rank)  # chunk ids are in (seq, start) order
            g0 = self.seq_offsets[self.chunk_seq[sel]] + self.chunk_start[sel]
            n = self.chunk_end[sel] - self.chunk_start[sel]
            total = int(n.sum())
            excl = np.zeros(sel.shape[0], dtype=np.int64)
            np.cumsum(n[:-1], out=excl[1:])
            idx = np.repeat(g0 - excl, n) + np.arange(total, dtype=np.int64)
            self._cache[key] = idx
        return self._cache[key]

    def token_seq_ids(self, rank) -> np.ndarray:
        """[T_r] int64 sequence id of each of `rank`'s context tokens (aligned with `token_index`)."""
        idx = self.token_index(rank)
        return np.searchsorted(self.seq_offsets, idx, side="right").astype(np.int64) - 1

    def token_positions(self, rank) -> np.ndarray:
        """[T_r] int64 global position (within its sequence) of each of `rank`'s context tokens."""
        idx = self.token_index(rank)
        return idx - self.seq_offsets[self.token_seq_ids(rank)]

    def query_slice(self, rank) -> slice:
        """The slice of the padded global query blocks that `rank` owns (equal counts per rank)."""
        self._check_rank(rank)
        n = self.blocks_per_rank
        return slice(int(rank) * n, (int(rank) + 1) * n)


# ----------------------------------------------------------------------------------------------
# input validation


def _as_int_array(x, name):
    arr = np.asarray(x)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if np.issubdtype(arr.dtype, np.integer):
        if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8 and arr.max() > np.iinfo(np.int64).max:
            i = int(np.argmax(arr))
            raise ValueError(f"{name} must be finite integers within int64, got {name}[{i}] = {int(arr[i])}")
        return arr.astype(np.int64, copy=False)
    if np.issubdtype(arr.dtype, np.floating):
        # reject NaN/inf and fractional values, naming the first bad one (before any cast: casting
        # inf/NaN to int64 gives garbage such as -2**63)
        bad = ~np.isfinite(arr)
        bad |= np.abs(arr) >= 2.0 ** 63  # would overflow int64
        if not bad.any():
            bad = arr != np.round(arr)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name} must hold finite integers, got {name}[{i}] = {arr[i].item()!r}")
        return arr.astype(np.int64)
    raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")


def _int_arg(x, name, minimum, what):
    """A scalar integer argument >= `minimum` (`as_int`: any `__index__` integer, and integral floats
    such as 2.0 as the planner always accepted; bool, None, strings, NaN/inf and fractions rejected with
    a ValueError naming `name`)."""
    return as_int(x, name, minimum=minimum, what=what, integral_float=True)


def _float_arg(x, name):
    """A finite real number >= 0 (NaN, inf, negative, None and strings rejected)."""
    ok = not isinstance(x, (bool, np.bool_)) and isinstance(x, numbers.Real) and math.isfinite(x) and x >= 0
    if not ok:
        raise ValueError(f"{name} must be a finite number >= 0, got {x!r}")
    return float(x)


def _validate(seq_lens, anchors, block_size, cp_size, chunk_size):
    """Check the planner's inputs (vectorised). Returns (lens [n] int64, anchors list of int64 arrays,
    n_anchors [n] int64, anchors concatenated [N] int64, packed offsets [n + 1], anchor_ptr [n + 1],
    query-block anchors q_anchor [N padded to a multiple of cp_size with -1], packed anchors [N] =
    anchors + offset of their sequence, globally sorted; a temporary that the cost computation consumes)."""
    _int_arg(cp_size, "cp_size", 1, "an integer >= 1")
    _int_arg(block_size, "block_size", 1, "an integer > 0")
    if chunk_size is not None:
        _int_arg(chunk_size, "chunk_size", 1, "None or an integer > 0")
    lens = _as_int_array(seq_lens, "seq_lens")
    if lens.size:
        lo, hi = lens.min(), lens.max()
        if lo < 0:
            j = int(np.argmin(lens))
            raise ValueError(f"seq_lens must be >= 0, got seq_lens[{j}] = {int(lens[j])}")
        if hi > MAX_TOKENS or (lens.shape[0] > 1 and int(lens.sum()) > MAX_TOKENS):  # max first: no overflow
            raise ValueError(
                f"the batch is too large: sum(seq_lens) = {int(lens.astype(object).sum())} tokens exceeds the "
                f"planner's limit MAX_TOKENS = 2**31 - 1 (token positions and indices must fit the "
                f"attention op's int32 range)")
    try:
        n_anchor_arrays = len(anchors)
    except TypeError:
        raise ValueError(f"anchors must be a sequence of per-sequence arrays, got {type(anchors).__name__}") from None
    if n_anchor_arrays != lens.shape[0]:
        raise ValueError(
            f"anchors must have one array per sequence: got {n_anchor_arrays} for {lens.shape[0]} sequences"
        )
    anc = []
    for j, a in enumerate(anchors):
        if isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype == np.int64:
            anc.append(a)
        else:
            anc.append(_as_int_array(a if a is not None else [], f"anchors[{j}]"))
    n_seq = lens.shape[0]
    n_anc = np.array([a.shape[0] for a in anc], dtype=np.int64)
    n_blocks = int(n_anc.sum())
    n_pad = -(-n_blocks // int(cp_size)) * int(cp_size) - n_blocks
    # query-block anchors: all anchors in sequence order, padded to a multiple of cp_size with -1
    q_anchor = np.concatenate(anc + [np.full(n_pad, -1, dtype=np.int64)])
    cat = q_anchor[:n_blocks]
    offsets = np.zeros(n_seq + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    ptr = np.zeros(n_seq + 1, dtype=np.int64)
    np.cumsum(n_anc, out=ptr[1:])
    flat = np.repeat(offsets[:-1], n_anc)  # packed anchors: anchor + offset of its sequence
    flat += cat
    if n_blocks:
        # Fast check: every sequence's anchors are sorted and in [0, len - 2] iff each sequence's first
        # anchor is >= 0, its last <= len - 2, and the packed anchors are sorted globally.
        ne = n_anc > 0
        ok = (cat[ptr[:-1][ne]].min() >= 0 and bool(np.all(cat[ptr[1:][ne] - 1] <= lens[ne] - 2))
              and not (flat[1:] < flat[:-1]).any())
        if not ok:
            _anchor_error(lens, anc, n_anc, cat, np.repeat(np.arange(n_seq), n_anc))
    return lens, anc, n_anc, cat, offsets, ptr, q_anchor, flat


def _query_seq(n_anc, n_total):
    """q_seq: the sequence id of every query block (anchor), padded with -1 to n_total."""
    seq_ids = np.arange(n_anc.shape[0] + 1, dtype=np.int64)
    seq_ids[-1] = -1
    return np.repeat(seq_ids, np.append(n_anc, n_total - int(n_anc.sum())))


def _anchor_error(lens, anc, n_anc, cat, owner):
    """Raise the ValueError naming the first bad anchor (slow path, only on invalid input)."""
    hi = np.repeat(lens - 2, n_anc)  # an anchor needs a next token: a <= seq_len - 2
    bad = np.flatnonzero(cat < 0)
    if bad.size:
        j = int(owner[bad[0]])
        raise ValueError(f"anchors[{j}] must be >= 0, got {int(cat[bad[0]])}")
    bad = np.flatnonzero(cat > hi)
    if bad.size:
        j = int(owner[bad[0]])
        raise ValueError(
            f"anchors[{j}] must be < seq_len - 1 = {int(lens[j]) - 1} (seq_lens[{j}] = "
            f"{int(lens[j])}), got {int(cat[bad[0]])}"
        )
    down = np.flatnonzero((cat[1:] < cat[:-1]) & (owner[1:] == owner[:-1]))
    k = int(down[0])
    j = int(owner[k])
    raise ValueError(f"anchors[{j}] must be sorted ascending, got {int(cat[k])} before {int(cat[k + 1])}")


# ----------------------------------------------------------------------------------------------
# chunking


def auto_chunk_size(seq_lens, anchors, *, block_size, cp_size, cost_model=None,
                    target_imbalance=DEFAULT_TARGET_IMBALANCE, min_chunk=MIN_CHUNK):
    """The initial automatic chunk size (tokens) of `plan_context_parallel(chunk_size=None)`.

    Rule ("needed granularity"): the largest multiple of 64 in [64, 2048] that still cuts the batch into
    at least 8 chunks per rank,

        c0 = max{c = 64 k <= 2048 : sum_j ceil(seq_len_j / c) >= 8 * cp_size}   (64 if there is none),

    and 2048 for cp_size = 1. LPT plus the exchange refinement reach well below 0.5% imbalance once
    every rank gets about 8 chunks; with fewer, no small chunks are left to even out the last ranks
    (128-token chunks at cp_size 64 on 32K-token batches, ~4 per rank, give ~2%), while coarser chunks
    plan faster. `plan_context_parallel` (strategy "lpt") then checks the result: while the imbalance
    exceeds `target_imbalance` (default 0.5%) and the chunk is above the floor, it halves the chunk
    (rounded down to a multiple of 64, not below the floor) and plans again, and it returns the best
    plan it made. So with `chunk_size=None`, imbalance <= `target_imbalance` unless even the floor
    chunk misses it.

    The floor is 64, not 128: local keys are sorted by (sequence, position), so all chunks of one
    sequence on one rank merge into one key run and finer chunks cost the kernels little. 2048 caps the
    chunk so that a few long sequences are still cut finely enough at small cp_size. `min_chunk`
    (default 64) changes the floor (then the sizes are multiples of min(64, min_chunk)).
    `cost_model` and `target_imbalance` do not change c0 (they are accepted so that the signature
    matches `plan_context_parallel`'s keywords).

    Returns: int chunk size in tokens. Errors: as `plan_context_parallel`.
    """
    lens = _validate(seq_lens, anchors, block_size, cp_size, None)[0]
    return _auto_chunk(lens, int(cp_size), min_chunk)


def _check_min_chunk(min_chunk):
    min_chunk = _int_arg(min_chunk, "min_chunk", 1, f"an integer in [1, {MAX_CHUNK}]")
    if min_chunk > MAX_CHUNK:
        raise ValueError(f"min_chunk must be an integer in [1, {MAX_CHUNK}], got {min_chunk!r}")
    return min_chunk, min(CHUNK_ALIGN, min_chunk)


def _auto_chunk(lens, cp_size, min_chunk=MIN_CHUNK):
    """c0 of the rule in `auto_chunk_size` (binary search: the chunk count is non-increasing in c)."""
    min_chunk, align = _check_min_chunk(min_chunk)
    if cp_size == 1:
        return MAX_CHUNK
    need = CHUNKS_PER_RANK * cp_size
    lo, hi = -(-min_chunk // align), MAX_CHUNK // align  # candidates c = k * align, k in [lo, hi]
    if int((-(-lens // (lo * align))).sum()) < need:
        return lo * align
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int((-(-lens // (mid * align))).sum()) >= need:
            lo = mid
        else:
            hi = mid - 1
    return lo * align


def _fixed_chunks(lens, chunk_size):
    """Cut every sequence into chunks of `chunk_size` tokens (the last one may be shorter)."""
    counts = -(-lens // chunk_size)  # ceil; 0 for empty sequences
    n = int(counts.sum())
    seq = np.repeat(np.arange(lens.shape[0], dtype=np.int64), counts)
    first = np.zeros(lens.shape[0], dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    k = np.arange(n, dtype=np.int64) - np.repeat(first, counts)
    start = k * chunk_size
    end = np.minimum(start + chunk_size, lens[seq])
    return seq, start, end


# ----------------------------------------------------------------------------------------------
# strategies


def _chunk_costs(chunk_size, lens, offsets, anchors_flat, anchor_ptr, cm, block_size, chunks=None):
    """Cut sequences into `chunk_size` chunks (or take `chunks`) and compute their realized costs.
    Consumes `anchors_flat` (overwritten with prefix sums). Returns (seq, start, end, costs)."""
    seq, start, end = _fixed_chunks(lens, chunk_size) if chunks is None else chunks
    g = offsets[seq]
    tokens = cm.token_cost * (end - start).astype(np.float64)
    if cm.layer_windows is None:  # every layer sees all context before the anchor
        pairs = _pair_counts_inplace(anchors_flat, anchor_ptr, seq, g + start, g + end)
        return seq, start, end, cm.attn_pair_cost * block_size * pairs + tokens
    counts = cm.window_counts()
    pairs = np.zeros(seq.shape[0], dtype=np.float64)
    for w, n in counts.items():  # windows first: the full-attention count consumes `anchors_flat`
        if w is not None:
            pairs += n * chunk_window_pair_counts(anchors_flat, anchor_ptr, offsets, seq, g + start, g + end,
                                                  block_size=block_size, window=w)
    if None in counts:
        pairs += counts[None] * block_size * _pair_counts_inplace(anchors_flat, anchor_ptr, seq, g + start, g + end)
    pairs /= len(cm.layer_windows)  # the mean over the layers (CostModel.layer_windows)
    return seq, start, end, cm.attn_pair_cost * pairs + tokens


def _lpt(costs, cp_size):
    """Graham's LPT: chunks by cost descending (ties: lower chunk id first), each to the least-loaded
    rank (ties: lower rank). Returns (rank per chunk, placement order).

    The heap holds one Python int per rank, ``(load << rbits) | rank``, with loads in integer units
    (costs scaled by 2**(62 - rbits) / total and rounded, so no key exceeds 2**63): integer keys compare
    faster than (load, rank) tuples, sums are exact (the plan does not depend on float summation
    order), and equal loads order by rank. One C `heapreplace` per chunk."""
    n = costs.shape[0]
    order = np.argsort(-costs, kind="stable")  # cost descending, ties: lower chunk id
    rbits = max(int(cp_size - 1).bit_length(), 1)
    total = float(costs.sum())
    if n == 0:
        return np.zeros(0, dtype=np.int64), order
    if total > 0:
        scale = 2.0 ** (62 - rbits) / (total + float(costs.max()))
        steps = (np.rint(costs[order] * scale).astype(np.int64) << rbits).tolist()
    else:
        steps = [0] * n
    heap = list(range(cp_size))  # load 0, rank r: already a valid heap
    replace = heapq.heapreplace
    placed = [replace(heap, heap[0] + w) for w in steps]  # the popped key: rank in the low bits
    ranks = np.empty(n, dtype=np.int64)
    ranks[order] = np.array(placed, dtype=np.int64) & ((1 << rbits) - 1)
    return ranks, order


_EMPTY = 1e300  # cost of an empty table slot: never chosen (see _RankTable)


class _RankTable:
    """Per-rank chunk tables for `_refine`: ``out[r, i]`` / ``ids[r, i]`` are the cost / id of the i-th
    chunk slot of rank r (``out = -_EMPTY``, ``ids = -1`` for an empty slot), ``inn`` the same costs with
    empty slots at ``+_EMPTY`` plus a last column of cost 0 (= receive nothing: a plain move). With
    these sentinels a delta ``out[m, i] - inn[r, j]`` involving an empty slot is hugely negative and is
    never chosen, without NaN handling. Rows have ``slack`` spare slots; the table is rebuilt when a
    row overflows."""

    def __init__(self, costs, ranks, cp_size, slack=4):
        self.costs, self.cp_size, self.slack = costs, cp_size, slack
        self.build(ranks)

    def build(self, ranks):
        n, P = self.costs.shape[0], self.cp_size
        perm = np.argsort(ranks, kind="stable")
        cnt = np.bincount(ranks, minlength=P)
        first = np.zeros(P, dtype=np.int64)
        np.cumsum(cnt[:-1], out=first[1:])
        rp = ranks[perm]
        pos = np.arange(n, dtype=np.int64) - first[rp]
        self.cap = cap = int(cnt.max()) + self.slack
        self.out = np.full((P, cap), -_EMPTY)
        self.inn = np.full((P, cap + 1), _EMPTY)
        self.inn[:, cap] = 0.0
        self.ids = np.full((P, cap + 1), -1, dtype=np.int64)
        self.out[rp, pos] = self.costs[perm]
        self.inn[rp, pos] = self.costs[perm]
        self.ids[rp, pos] = perm
        self.fill = cnt

    def apply(self, ranks, m, a, r, c):
        """Rank m gives its slot-a chunk to rank r; r gives its slot-c chunk back unless c == cap."""
        cm_ = self.ids[m, a]
        ranks[cm_] = r
        if c < self.cap:  # swap
            cr = self.ids[r, c]
            ranks[cr] = m
            self.out[m, a], self.out[r, c] = self.out[r, c], self.out[m, a]
            self.inn[m, a], self.inn[r, c] = self.inn[r, c], self.inn[m, a]
            self.ids[m, a], self.ids[r, c] = cr, cm_
        elif self.fill[r] < self.cap:  # move into r's next free slot
            f = self.fill[r]
            self.out[r, f], self.inn[r, f], self.ids[r, f] = self.out[m, a], self.inn[m, a], cm_
            self.fill[r] = f + 1
            self.out[m, a], self.inn[m, a], self.ids[m, a] = -_EMPTY, _EMPTY, -1
        else:
            self.build(ranks)


def _refine(costs, ranks, cp_size, *, tol, max_iters, partners=8):
    """Pairwise-exchange refinement after LPT (deterministic; never increases the max load).

    An exchange between a rank h and a less loaded rank r moves one chunk h -> r, or swaps a chunk of h
    with a smaller chunk of r, by a cost delta > 0; it is applied only when
    max(L_h - delta, L_r + delta) < L_h, so no load ever rises above the old maximum. Since
    max(L_h - delta, L_r + delta) = (L_h + L_r)/2 + |delta - (L_h - L_r)/2|, the best exchange of a pair is
    an argmin of |out[h, i] - (inn[r, j] + gap / 2)| over the two ranks' chunk slots (`_RankTable`).

    Two kinds of step, until max/mean - 1 <= tol, no exchange helps, or after max_iters steps:
      * batched pass (while >= 4 ranks are above the tolerance and the last pass helped): the k ranks
        above it, most loaded first, are paired with the k least loaded ranks, least loaded first
        (k <= P/2, disjoint pairs), and every pair applies its best exchange at once;
      * single step: the most loaded rank m against each of the `partners` least loaded ranks; the
        best exchange over all of them is applied.
    Each step lowers the largest load or the number of ranks at it, so the LPT bounds still hold.
    Returns (ranks, loads)."""
    loads = np.bincount(ranks, weights=costs, minlength=cp_size).astype(np.float64)
    mean = loads.sum() / cp_size
    if cp_size < 2 or mean <= 0:
        return ranks, loads
    limit = mean * (1.0 + tol)
    if loads.max() <= limit:
        return ranks, loads
    k = min(partners, cp_size - 1)
    tab = _RankTable(costs, ranks, cp_size)
    batched = True
    for _ in range(max_iters):
        order = np.argsort(loads, kind="stable")
        m = int(order[-1])
        lm = float(loads[m])
        if lm <= limit:
            break
        if batched:
            n_over = int(np.count_nonzero(loads > limit))
            batched = n_over >= 4
        if batched:
            q = min(n_over, cp_size // 2)
            hi, lo = order[::-1][:q], order[:q]
            half = (loads[hi] - loads[lo]) * 0.5
            score = tab.out[hi][:, :, None] - (tab.inn[lo] + half[:, None])[:, None, :]  # [q, cap, cap+1]
            np.abs(score, out=score)
            flat = score.reshape(q, -1)
            best = np.argmin(flat, axis=1)
            ok = flat[np.arange(q), best] < half * (1.0 - 1e-12)
            if not ok.any():
                batched = False
                continue
            a, c = np.divmod(best[ok], tab.cap + 1)
            h, r = hi[ok], lo[ok]
            dl = tab.out[h, a] - tab.inn[r, c]
            ranks[tab.ids[h, a]] = r
            sw = c < tab.cap
            ranks[tab.ids[r[sw], c[sw]]] = h[sw]
            loads[h] -= dl
            loads[r] += dl
            tab.build(ranks)
            continue
        part = order[:k]  # the k least loaded ranks (m is not among them: cp_size > k)
        half = (lm - loads[part]) * 0.5
        score = tab.out[m, :, None, None] - (tab.inn[part] + half[:, None])[None, :, :]
        np.abs(score, out=score)
        best = int(np.argmin(score))
        a, rest = divmod(best, k * (tab.cap + 1))
        j, c = divmod(rest, tab.cap + 1)
        if not score[a, j, c] < half[j] * (1.0 - 1e-12):  # new max = lm - half + score < lm
            break
        r = int(part[j])
        dl = float(tab.out[m, a] - tab.inn[r, c])
        tab.apply(ranks, m, a, r, c)
        loads[m] -= dl
        loads[r] += dl
    return ranks, np.bincount(ranks, weights=costs, minlength=cp_size).astype(np.float64)


def _contiguous_chunks(lens, offsets, cp_size):
    """Rank r holds packed tokens [floor(r*T/P), floor((r+1)*T/P)) (plain sequence split)."""
    T = int(offsets[-1])
    cuts = (np.arange(cp_size + 1, dtype=np.int64) * T) // cp_size
    bounds = np.unique(np.concatenate([offsets, cuts]))  # every sequence start and rank cut
    g0, g1 = bounds[:-1], bounds[1:]
    seq = np.searchsorted(offsets, g0, side="right") - 1
    rank = np.minimum(np.searchsorted(cuts, g0, side="right") - 1, cp_size - 1)
    return seq, g0 - offsets[seq], g1 - offsets[seq], rank


def _zigzag_chunks(lens, cp_size):
    """Megatron's load-balanced CP layout per sequence: 2P near-equal pieces, rank r gets pieces r and
    2P-1-r (get_batch_on_this_cp_rank; Megatron pads to a multiple of 2P, we split as evenly as
    possible instead: piece i = [floor(i*L/2P), floor((i+1)*L/2P)))."""
    P2 = 2 * cp_size
    b = (lens[:, None] * np.arange(P2 + 1, dtype=np.int64)[None, :]) // P2  # [n_seq, 2P+1]
    piece = np.arange(P2, dtype=np.int64)
    piece_rank = np.minimum(piece, P2 - 1 - piece)
    keep = b[:, 1:] > b[:, :-1]
    seq = np.broadcast_to(np.arange(lens.shape[0], dtype=np.int64)[:, None], keep.shape)[keep]
    return seq, b[:, :-1][keep], b[:, 1:][keep], np.broadcast_to(piece_rank, keep.shape)[keep]


def _fixed_layout(strategy, lens, offsets, anchors_flat, anchor_ptr, cm, block_size, cp_size):
    """The "contiguous" or "zigzag" layout and its chunk costs (consumes `anchors_flat`). Returns (seq, start,
    end, rank, costs)."""
    chunks = _contiguous_chunks(lens, offsets, cp_size) if strategy == "contiguous" else _zigzag_chunks(lens, cp_size)
    seq, start, end, rank = chunks
    _, _, _, costs = _chunk_costs(None, lens, offsets, anchors_flat, anchor_ptr, cm, block_size,
                                  chunks=(seq, start, end))
    return seq, start, end, rank, costs


def _max_load(rank, costs, cp_size) -> float:
    return float(np.bincount(rank, weights=costs, minlength=cp_size).max()) if costs.size else 0.0


# ----------------------------------------------------------------------------------------------


def plan_context_parallel(seq_lens, anchors, *, block_size, cp_size, chunk_size=None, strategy="lpt",
                          cost_model=None, target_imbalance=DEFAULT_TARGET_IMBALANCE, min_chunk=MIN_CHUNK,
                          refine=True,
                          refine_tol=2e-3, hypergraph_epsilon=0.03, hypergraph_seed=0) -> Plan:
    """Plan which context tokens each CP rank holds (Split-KV's data-sharding hook).

    Args:
        seq_lens: [n_seq] ints >= 0, context length of each packed sequence (tokens).
        anchors: n_seq int arrays; anchors[j] the sorted (ascending) valid anchors of sequence j, each in
            [0, seq_lens[j] - 2] (an anchor needs a next token). Empty arrays are fine.
        block_size: B (> 0), query rows per draft block.
        cp_size: P (>= 1), context-parallel group size.
        chunk_size: tokens per chunk for "lpt"/"hypergraph" (> 0). None (default) picks it
            automatically: c0 = `auto_chunk_size` (the largest multiple of 64 in [64, 2048] giving >= 8
            chunks per rank); for "lpt" the plan is then checked and, while its imbalance exceeds
            `target_imbalance` and c > the floor (`min_chunk`, 64), c is halved (to a multiple of 64)
            and the batch replanned; the best plan is returned, so imbalance <= `target_imbalance`
            unless even the floor misses it (`Plan.chunk_size` is the size used). Ignored by
            "contiguous" and "zigzag", whose layouts are fixed by P.
        strategy:
            "lpt": cut sequences into chunk_size chunks, sort by realized cost descending, give each to
                the least-loaded rank (binary heap), Graham's Longest-Processing-Time rule as used by
                Split-KV (arXiv 2611.05926). O(n log n + n log P).
                Bound (Graham 1969): max load <= (4/3 - 1/(3P)) * optimum, and (list scheduling)
                max load <= mean + (1 - 1/P) * max chunk cost. With `refine` (default) LPT is followed
                by a pairwise-exchange refinement (move/swap chunks between heavily and lightly loaded
                ranks, see `_refine`) until imbalance <= `refine_tol` (default 0.2%) or no exchange
                helps; it never increases the max load, so the bounds hold either way. Finally the
                "contiguous" and "zigzag" layouts of the same batch are costed with the same model and the
                one with the lowest max load is returned (ties: LPT's), so an "lpt" plan is never worse
                than either (e.g. one dense sequence, whose 64-token chunk floor limits LPT); such a plan
                keeps strategy "lpt" with chunk_size None and that layout's chunks.
            "contiguous": rank r holds packed tokens [r*T/P, (r+1)*T/P) (no balancing).
            "zigzag": per sequence 2P pieces, rank r holds pieces r and 2P-1-r (Megatron-Core's
                `get_batch_on_this_cp_rank` layout).
            "hypergraph": DCP-style (Jiang et al., "DCP: Addressing Input Dynamism in Long-Context
                Training via Dynamic Context Parallelism", 2025) min-connectivity partition with KaHyPar
                of the chunk hypergraph (vertex = chunk weighted by cost, hyperedge = query block over
                the chunks it attends to), balance epsilon `hypergraph_epsilon`. Needs the optional extra
                ``pip install megatron-splitkv[hypergraph]`` (kahypar); ImportError naming it otherwise.
        cost_model: `CostModel` (default coefficients documented there; its `layer_windows` make the
            attention term count what each sliding-window layer sees, `cost.chunk_window_pair_counts`).
        target_imbalance, min_chunk: imbalance target (0.5%) and floor (64) of the automatic chunk size.
        refine, refine_tol: LPT's exchange refinement (see "lpt") and its stopping imbalance.
        hypergraph_epsilon, hypergraph_seed: KaHyPar balance constraint and seed ("hypergraph").

    Returns:
        `Plan` (chunks, per-rank loads and imbalance, per-rank index arrays, query-block split).
        Deterministic: same inputs give the same plan (ties broken by chunk id, then rank id).

    Limits: the batch may hold at most ``MAX_TOKENS = 2**31 - 1`` tokens in total (sum(seq_lens)): the
        attention op takes positions and packed indices as int32-range values, and a larger plan would
        not fit in memory anyway (several int64 arrays per token).

    Raises:
        ValueError (naming the argument and the bad value): cp_size, block_size or chunk_size not an
            integer >= 1 (None, strings, bools, fractions, NaN/inf rejected; integral floats such as 2.0
            accepted), min_chunk outside [1, 2048] (with chunk_size=None), target_imbalance or
            refine_tol not a finite number >= 0, seq_lens not 1-D finite integers >= 0 (first bad entry
            reported, e.g. ``seq_lens[0] = inf``), sum(seq_lens) > MAX_TOKENS, anchors count not
            matching seq_lens, anchors not integers, < 0 or >= seq_len - 1, unsorted anchors, unknown
            strategy.
        TypeError: cost_model not a `CostModel` (or None).
        ImportError: strategy "hypergraph" without kahypar.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if cost_model is None:
        cm = CostModel()
    elif isinstance(cost_model, CostModel):
        cm = cost_model
    else:
        raise TypeError(f"cost_model must be a megatron_splitkv.planning.CostModel or None, got "
                        f"{type(cost_model).__name__} {cost_model!r}")
    target_imbalance = _float_arg(target_imbalance, "target_imbalance")
    refine_tol = _float_arg(refine_tol, "refine_tol")
    lens, anc, n_anc, anc_cat, offsets, anchor_ptr, q_anchor, anchors_flat = _validate(
        seq_lens, anchors, block_size, cp_size, chunk_size)
    cp_size = int(cp_size)
    block_size = int(block_size)

    used_chunk = None
    if strategy in ("lpt", "hypergraph"):
        auto = chunk_size is None
        if auto:
            used_chunk = _auto_chunk(lens, cp_size, min_chunk)
            floor, align = _check_min_chunk(min_chunk)
        else:
            used_chunk = int(chunk_size)
        best = None
        while True:
            seq, start, end, costs = _chunk_costs(used_chunk, lens, offsets, anchors_flat, anchor_ptr, cm,
                                                  block_size)
            anchors_flat = None  # consumed
            if strategy == "hypergraph":
                rank = hypergraph_assign(costs, seq, start, anc, cp_size, epsilon=hypergraph_epsilon,
                                         seed=hypergraph_seed)
                order = np.arange(seq.shape[0], dtype=np.int64)
                break
            rank, order = _lpt(costs, cp_size)
            if refine:
                rank, loads = _refine(costs, rank, cp_size, tol=refine_tol, max_iters=2 * cp_size + 8)
            else:
                loads = np.bincount(rank, weights=costs, minlength=cp_size)
            mean = loads.sum() / cp_size
            imb = float(loads.max() / mean - 1.0) if mean > 0 else 0.0
            if best is None or imb < best[0]:
                best = (imb, used_chunk, seq, start, end, costs, rank, order)
            # automatic chunk: halve while the imbalance misses the target, down to the floor
            nxt = max(floor, used_chunk // 2 // align * align) if auto else used_chunk
            if imb <= target_imbalance or nxt >= used_chunk:
                _, used_chunk, seq, start, end, costs, rank, order = best
                break
            used_chunk = nxt
            anchors_flat = np.repeat(offsets[:-1], n_anc)
            anchors_flat += anc_cat
    else:
        seq, start, end, rank, costs = _fixed_layout(strategy, lens, offsets, anchors_flat, anchor_ptr, cm,
                                                     block_size, cp_size)
        order = np.arange(seq.shape[0], dtype=np.int64)
    if strategy == "lpt":  # never worse than the fixed layouts under the same cost model
        for alt in ("contiguous", "zigzag"):
            anchors_flat = np.repeat(offsets[:-1], n_anc)
            anchors_flat += anc_cat
            a_seq, a_start, a_end, a_rank, a_costs = _fixed_layout(alt, lens, offsets, anchors_flat, anchor_ptr, cm,
                                                                   block_size, cp_size)
            if _max_load(a_rank, a_costs, cp_size) < _max_load(rank, costs, cp_size):
                seq, start, end, rank, costs = a_seq, a_start, a_end, a_rank, a_costs
                order, used_chunk = np.arange(seq.shape[0], dtype=np.int64), None

    anchors_flat = None  # free the temporary before allocating q_seq (the allocator can reuse it)
    q_seq = _query_seq(n_anc, q_anchor.shape[0])
    loads = np.bincount(rank, weights=costs, minlength=cp_size).astype(np.float64)
    mean = loads.sum() / cp_size
    imbalance = float(loads.max() / mean - 1.0) if mean > 0 else 0.0

    return Plan(strategy=strategy, cp_size=cp_size, block_size=block_size, chunk_size=used_chunk,
                cost_model=cm, seq_lens=lens, seq_offsets=offsets, chunk_seq=seq, chunk_start=start,
                chunk_end=end, chunk_cost=costs, chunk_rank=rank.astype(np.int64), assign_order=order,
                loads=loads, imbalance=imbalance, q_seq=q_seq, q_anchor=q_anchor)
