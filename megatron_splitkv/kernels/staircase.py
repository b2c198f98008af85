"""Staircase local kernel: most of the DFlash interval mask as DENSE attention rectangles (cuDNN on the
GPU), the rest through the FlexAttention (or math) kernel, merged by lse.

Source: DESIGN.md section 2 (local context attention of Split-KV, arXiv 2611.05926, with the GLOBAL lse
and delta in the backward) and section 5 (FlexAttention reaches ~60% of dense attention per useful
FLOP on the H200, dense cuDNN attention ~575-600 TF/s forward + backward); the decomposition and its
cost model are in docs/kernels.md, section "Staircase kernel". The kernel contract is
`megatron_splitkv.kernels.base` (read its module docstring).

The decomposition
-----------------
After the local context keys are sorted, query block b sees the key interval [lo[b], hi[b]) (plus,
optionally, its own B keys [lo2[b], hi2[b]) after the context: the union contract of `kernels/base.py`).
All blocks of one sequence share lo (the sequence's first local key); sorted by hi they form a staircase.
Cut the staircase into GROUPS of consecutive blocks (in hi order). Group g, with m_g <= the smallest hi
of its blocks, sees [lo, m_g) FULLY: a dense rectangle of n_g * B query rows x (m_g - lo) keys. So

    forward:  one dense call per group over keys [lo, m_g)                   -> (O_g, lse_g)
              one call of the inner kernel (flex on CUDA, math on CPU) with the REMAINDER mask:
              [m_g, hi[b]) for grouped blocks, [lo, hi) for the others, second intervals unchanged
                                                                           -> (O_rem, lse_rem)
              merged per row by lse in fp32 (rows with -inf in both: out 0, lse -inf, never NaN): the final
              lse L first (small tensors), then out_rem *= exp(lse_rem - L) and one fused
              out += exp(lse_g - L) * O_g per rectangle, reading the dense result (input dtype, folded
              layout) through a view: no fp32 copy of O_g, no unfold, no scatter.
    backward: the inner kernel's backward on the remainder mask with the global (lse, delta), plus the
              dense backward of every rectangle with the global statistics; dQ, dK, dV accumulated in
              fp32 (float64 for float64 inputs).

Every visible (row, key) pair belongs to exactly one of: one rectangle, the remainder. The dense
backward is exact for a key subset given the GLOBAL (O, lse) (measured on the H200 for cuDNN and
FlashAttention: dQ of key halves sums to the full dQ, dK/dV concatenate). Since the contract passes
delta = rowsum(dO * O_final) and not O, the dense backward gets O' = dO * delta / |dO|^2
(`kernels.dense.out_for_delta`, as kernels/te.py does): rowsum(dO * O') = delta up to one rounding of
the input dtype. Entries (row, head) where O' is not representable (dO = 0 with delta != 0: a gradient
through the returned lse only; |dO|^2 subnormal; O' overflowing the dtype) are zeroed in the dense pass
(dO' = O' = 0 contributes nothing) and their dense part is computed by the math kernel's backward on a
mask restricted to those blocks' rectangles (one host sync per backward decides whether that is needed).

Two equivalent rectangle sets serve the backward (`bwd_mode`):
  * "query": the forward's groups. dQ rows are disjoint across groups; dK/dV of the prefixes [lo, m_g)
    overlap and are accumulated in fp32: sum_g (m_g - lo) x Hkv x D x 2 elements, ~10 bytes each
    (read the dense kernel's bf16 result, read + write the fp32 sum).
  * "key": one rectangle per key chunk [m_{c-1}, m_c) (m_0 = lo) against every block of groups c..last
    (they all see the chunk whole): dK/dV rows disjoint, dQ accumulated instead:
    sum_c rows_c x Hq x D elements. Cheaper when Tk >> Tq (DFlash: Lq = 8192, Lk up to 128K), but each
    chunk is only (m_c - m_{c-1}) keys wide: few key tiles for the dense backward to parallelise over.
  * "auto": "key" when its accumulation is smaller AND its chunks are at least
    `kmajor_min_keys` wide on average, else "query".

Two levels (`sub_group_blocks` = s > 0, default): each group's ragged part [m_g, hi[b]) is itself a
staircase with base m_g; it is cut the same way into sub-groups of s blocks, each with a rectangle
[m_g, m_s) (m_s <= the sub-group's smallest hi, cut into pieces like the first level), and only
[m_s, hi) goes to the remainder. A block then lies in up to two rectangles (each one or more dense
pieces) with disjoint key ranges; a
group whose own rectangle is too small still gets sub-rectangles from lo. The remainder shrinks from
~n/512 to ~s/512 of the pairs (uniform anchors) while the big first-level calls stay big. dQ of every
rectangle is added into the remainder's fp32 dQ straight from the dense result (a view of its folded
layout), dK/dV into the fp32 dK/dV.

Grouping policy (host ints, `staircase_plan`): blocks that see context are sorted by (lo, hi); a run of
equal lo (one sequence) of N blocks is cut into N // n groups of exactly n = `group_blocks` blocks at the
high end (largest prefixes), the rest into groups of n/2, n/4, ... >= `min_group_blocks`, and what is
still left (the blocks with the smallest prefixes) goes to the remainder whole. A group's fully visible
range [base, m) is cut into dense PIECES (next section); a piece has >= `min_keys` keys and rows x keys
>= `piece_min_pairs` (default: `min_pairs`), and a group's pieces together >= `min_pairs` (a dense call
has a fixed cost, measured ~0.2 ms forward + backward with its merge and accumulation, and the query-major
backward an fp32 accumulation proportional to its keys); keys no piece takes go to the next level or to
the remainder. Sequences with few blocks or short prefixes thus run entirely in the inner kernel, and a
mask without any rectangle is handed to the inner kernel unchanged (no merge, no extra pass).

Dense shapes (bounded; our design, docs/kernels.md "Bounded dense shapes"): torch builds and caches one
cuDNN graph per dense call shape and direction (~20-60 ms per build on the H200, measured), and training
data changes the rectangles every step. With `key_buckets` = k > 0 (default 4) the key counts come from a
fixed set, `key_bucket_lengths`: {1..k-1} and {m * 2**e : k <= m < 2k}, rounded down to `key_grain`,
>= min_keys, <= the tile `max_tile_keys` (default 65536). A range of L keys becomes floor(L / tile) tile
pieces plus at most `key_pieces` (default 1) bucket pieces with the largest sum <= the rest (`split_keys`;
that sum never decreases with L, so a run's rectangle ends stay ordered for the key-major backward); each
piece is one dense call. Row counts are group sizes x B (x G folded), a fixed set too, so whatever the data
a run meets at most `shape_bound(...)` shapes (103 (rows, keys) for the drafter, B 16, Hq 32 / Hkv 8: 206
graphs forward + backward with bwd_mode "query"; tools/staircase_shapes.py counts 112 per rank over 1000
simulated steps at CP 1, vs 958 and still growing with the legacy rounding). Cost (H200): ~1% of the
visible pairs move from the dense part to flex and 1-4 more dense calls: +1.5% / +3.8% / +6.1% kernel time
at 32K / 64K / 128K keys. The kernel's options take key_buckets >= 1; `staircase_plan(key_buckets=0)`
(the planner function alone) rounds each rectangle's key count DOWN to a multiple of `key_grain`. The backward "key" mode makes chunks [m_{c-1}, m_c) that are differences of
bucketed ends: not in the bounded set.

The plan (block order, groups, rectangles, remainder `IntervalMask`) needs host ints; it is computed
ONCE per `IntervalMask` object and cached on it (`mask._staircase_plans`, one host sync), like the
FlexAttention BlockMask (`kernels/flex.py`) and the math kernel's grouping. With per-step metadata
(`ops.prepare_splitkv_metadata`) every layer of a step reuses the same mask object, so layers 2..L pay
no sync. The remainder mask is a new object per plan; the inner flex kernel caches its BlockMask on it.

Grouped-query attention (`gqa`): "fold" (default) folds the G = Hq // Hkv query heads of a kv head into
rows (`kernels.dense.fold_heads`: one copy of the gathered query rows per call, incl. the block order),
so the dense kernel runs multi-head attention over Hkv heads; "native" passes q with Hq heads and K/V
with Hkv heads (no copy when the dense blocks are a contiguous block range), for dense kernels that
support GQA (the CPU flash kernel does; whether cuDNN through
`aten._scaled_dot_product_cudnn_attention` does is checked by tools/gpu_check.py, which reports the path
that ran). K/V go to the dense kernel as strided [1, Hkv, L, D] views of the [Tk, Hkv, D] tensors
(`kv_layout="view"`) or as one [1, Hkv, Tk, D] contiguous copy per call ("copy"); "auto" (default) uses
views when a one-time probe (`probe_kv_views`: a small forward + backward with views and with copies,
per device, dtype and heads) shows that cuDNN takes them and gives the same result, else copies.

Dense calls (`DenseOps`): CUDA, bf16/fp16: `aten._scaled_dot_product_cudnn_attention` and its backward
(lse [1, H, L, 1] fp32, natural log). CPU, fp16/bf16/fp32/fp64: `aten._scaled_dot_product_flash_attention
_for_cpu` and its backward (same global-(O, lse) property, float64 end to end for float64 inputs). Rows
with a global lse of -inf get +1e30 as the backward's statistics (P = 0) and dO' = O' = 0. Optional side CUDA streams
(`streams` > 1) run the dense calls round-robin concurrently with each other and with the inner kernel
(the fp32 accumulations stay on the caller's stream, after an event per call).

Dtypes and results: out [Tq, Hq, D] and lse [Tq, Hq] float32 (float64 for float64 inputs), dq, dk, dv
float32 (float64 for float64). Dense results carry one rounding to the input dtype (bf16: relative
2**-9) before the fp32 merge, like flex's.

Errors: ValueError for shape/dtype mismatches, dtypes the dense backend cannot run (CUDA: bf16/fp16
only; `check_dtype` says so before the ops' first collective), head dims cuDNN rejects on CUDA
(D % 8 != 0 or D > 256), unknown options; RuntimeError from the dense backend if it rejects a call.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch

from .._ints import parse_int
from ..config import _STAIRCASE_CHOICES, _STAIRCASE_ZERO_OK as _ZERO_OK, STAIRCASE_INNER_CHOICES, SplitKVConfig, \
    StaircaseOptions
from .base import IntervalMask, check_call, check_cuda_head_dim, mask_cache
from .dense import acc_dtype, fold_heads, out_for_delta, unfold_heads
from .math import MathAttentionKernel

#: the kernel registry's lookup `resolve(backend, device, dtype, head_dim=, config=)` of the remainder kernels named
#: by `inner`, set by `megatron_splitkv.kernels` when it loads (the registry builds this kernel, so this module
#: cannot import it)
resolve_inner = None

__all__ = ["StaircaseAttentionKernel", "StaircasePlan", "staircase_plan", "DenseOps", "probe_kv_views", "StaircaseOptions",
           "DenseShape", "dense_call_shapes", "key_bucket_lengths", "split_keys", "option_from_text"]

A = torch.ops.aten
_BIG = 1.0e30  # backward statistics for rows whose global lse is -inf: exp(s - 1e30) = 0

#: bounded dense shapes (module docstring, "Dense shapes"): key lengths per octave, bucket pieces per
#: rectangle below the tile, longest dense key range
KEY_BUCKETS, KEY_PIECES, MAX_TILE_KEYS = 4, 1, 65536
#: options that may be 0
_ZERO_OK = ("min_pairs", "sub_group_blocks", "max_tile_keys", "piece_min_pairs")

#: the options and their defaults (`config.StaircaseOptions`), the choice options' values, the remainder kernels
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(StaircaseOptions)}
_CHOICES = {k: v for k, v in _STAIRCASE_CHOICES.items() if k != "inner"}
_INNER_CHOICES = STAIRCASE_INNER_CHOICES


def option_from_text(name: str, text: str, where: str | None = None):
    """The value of staircase option `name` written as text (a tool's `name=value`): an int for the integer
    options (a plain decimal integer, `_ints.parse_int`: "64", not "+64" or "64.0"), the text itself for
    the choice options (bwd_mode, gqa, kv_layout, inner; the constructor checks the choice). Raises
    ValueError naming `where` (default "staircase <name>") for an integer option's malformed text, or
    for an unknown option name."""
    where = where or f"staircase {name}"
    if name not in _DEFAULTS:
        raise ValueError(f"{where}: unknown staircase option {name!r} (one of {', '.join(_DEFAULTS)})")
    if name in _CHOICES or name == "inner":
        return text.strip()
    minimum = 0 if name in _ZERO_OK else 1
    return parse_int(text, where, minimum=minimum, what="a non-negative int" if minimum == 0 else "a positive int")


# ------------------------------------------------------------------------------------------ the plan
@dataclass
class StaircasePlan:
    """The staircase decomposition of one `IntervalMask` (see the module docstring).

    Attributes:
        blocks: [nd] int64 on the mask's device, the blocks served densely, in dense order (runs of equal
            lo, each sorted by hi); positions below index into it.
        block_range: (a, b) when blocks == arange(a, b) (row slices instead of gathers), else None.
        groups: [(p0, p1, klo, khi)] query-major rectangles, one per dense call: blocks[p0:p1] x keys
            [klo, khi) (the forward, and the backward in "query" mode). A group's pieces are consecutive
            entries with the same (p0, p1) and adjacent key ranges; with sub-groups a block lies in the
            pieces of up to two groups (disjoint key ranges [lo, m_g) and [m_g, m_s)).
        key_major: [(p0, p1, klo, khi)] rectangles with the same coverage for the backward "key" mode: the
            first level as key chunks against all blocks that see them, sub-group rectangles unchanged.
        rem: the remainder `IntervalMask` for the inner kernel (first intervals [m_b, hi) of dense blocks,
            m_b the end of the block's last rectangle,
            [lo, hi) of the others, second intervals unchanged), or None when nothing remains.
        lo_rem: [nb] int64, the remainder's first-interval starts (m_g on dense blocks, lo elsewhere).
        pairs_total, pairs_dense: visible (query row, key) pairs of the whole mask (both intervals) and of
            the rectangles (query rows unfolded: B per block).
        qmajor_keys, qmajor_blocks: sums over `groups` of khi - klo and p1 - p0 (the dK/dV key rows and dQ
            block rows the query-major backward adds into the fp32 results).
        kmajor_keys, kmajor_blocks: the same sums over `key_major`.
        levels: [len(groups)] the level of each entry (0: a piece of [lo, m_g); 1: of a sub-group's [m_g, m_s)).
        ranges: {rectangle: (a, b) when its blocks are the original blocks a..b-1 in order (row slices,
            no gather), else None}.
    """

    blocks: torch.Tensor
    block_range: tuple | None
    groups: list
    key_major: list
    rem: IntervalMask | None
    lo_rem: torch.Tensor
    pairs_total: int
    pairs_dense: int
    qmajor_keys: int
    kmajor_blocks: int
    levels: list = None
    qmajor_blocks: int = 0
    kmajor_keys: int = 0
    ranges: dict = None

    @property
    def num_dense_blocks(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def dense_fraction(self) -> float:
        """Share of the visible pairs served by the dense rectangles."""
        return self.pairs_dense / self.pairs_total if self.pairs_total else 0.0

    def kmajor_mean_keys(self) -> float:
        if not self.key_major:
            return 0.0
        return sum(k1 - k0 for _, _, k0, k1 in self.key_major) / len(self.key_major)


def _run_sizes(n_blocks: int, group_blocks: int, min_group_blocks: int):
    """(left over, [group sizes]) for a run of n_blocks (sorted by hi): the left-over blocks (smallest
    prefixes) go to the remainder, then groups of n/2, n/4, ... (>= min_group_blocks, ascending), then
    n_blocks // n groups of exactly n at the high end."""
    full, rest = divmod(n_blocks, group_blocks)
    subs, s = [], group_blocks // 2
    while s >= max(1, min_group_blocks):
        if rest >= s:
            subs.append(s)
            rest -= s
        s //= 2
    return rest, subs[::-1] + [group_blocks] * full


@functools.lru_cache(maxsize=256)
def key_bucket_lengths(key_buckets: int, min_keys: int, key_grain: int, limit: int) -> tuple:
    """The key lengths a dense call may have under bucketed rounding (`key_buckets` = k >= 1).

    The set is {1, ..., k - 1} and {m * 2**e : k <= m < 2k, e >= 0}, each rounded DOWN to a multiple of
    key_grain, restricted to [max(min_keys, key_grain), limit]: k lengths per octave (k = 1: powers of
    two; k = 2: 2**e and 1.5 * 2**e; k = 4: 1, 1.25, 1.5, 1.75 x 2**e; for a power of two k: the
    integers with at most log2(k) + 1 significant bits), fewer in low octaves where the grain merges them.
    Source: our design (docs/kernels.md, "Staircase kernel", "Bounded dense shapes").

    Args: key_buckets k >= 1; min_keys, key_grain >= 1 (keys); limit: the largest length wanted (keys).
    Returns: sorted tuple of distinct positive ints (keys); empty when no length fits.
    Raises: ValueError when key_buckets < 1.
    """
    k, grain, floor = int(key_buckets), max(1, int(key_grain)), max(1, int(min_keys), int(key_grain))
    if k < 1:
        raise ValueError(f"key_buckets must be >= 1 for bucketed rounding, got {key_buckets!r}")
    out, e = {m // grain * grain for m in range(1, min(k, limit + 1))}, 0
    out = {v for v in out if v >= floor}
    while (k << e) <= limit:
        for m in range(k, 2 * k):
            x = m << e
            if x > limit:
                break
            v = x // grain * grain
            if v >= floor:
                out.add(v)
        e += 1
    return tuple(sorted(out))


def split_keys(length: int, buckets: tuple, key_pieces: int, tile: int = 0) -> list:
    """Cut a fully visible key range of `length` keys into dense pieces: as many `tile`-key pieces as fit
    (tile 0: none), then at most `key_pieces` pieces with lengths from `buckets` (repeats allowed) whose
    sum is the LARGEST possible <= what is left (ties: fewer pieces, then the longer first piece). Pieces
    are non-increasing; their sum S(length) <= length never decreases as length grows (so a run's groups,
    sorted by hi, keep non-decreasing rectangle ends); the keys left over go to the remainder.

    Args: length (keys, >= 0); buckets: sorted ascending tuple of lengths (`key_bucket_lengths`, possibly
        filtered); key_pieces >= 0; tile: 0 or a member of buckets. Returns: list of ints (keys)."""
    out = []
    if tile > 0:
        n = length // tile
        out += [tile] * n
        length -= n * tile
    return out + list(_best_pieces(length, buckets, key_pieces))


@functools.lru_cache(maxsize=1 << 16)
def _best_pieces(length: int, buckets: tuple, n: int) -> tuple:
    """Non-increasing tuple of <= n members of buckets with the largest sum <= length (see split_keys)."""
    top = bisect.bisect_right(buckets, length)
    if n <= 0 or top == 0:
        return ()
    if n == 1:
        return (buckets[top - 1],)
    best, best_sum = (), 0
    for i in range(top - 1, -1, -1):
        b = buckets[i]
        if b * n < best_sum:  # no later (smaller) first piece can beat it
            break
        rest = _best_pieces(length - b, buckets[:i + 1], n - 1)
        total = b + sum(rest)
        if total > best_sum or (total == best_sum and 1 + len(rest) < len(best)):
            best, best_sum = (b,) + rest, total
        if best_sum == length:
            break
    return best


def staircase_plan(mask: IntervalMask, group_blocks: int = 32, min_group_blocks: int = 8, key_grain: int = 256,
                   min_keys: int = 512, min_pairs: int = 1 << 20, sub_group_blocks: int = 0, key_buckets: int = 0,
                   key_pieces: int = 1, max_tile_keys: int = 0, piece_min_pairs: int = None) -> StaircasePlan:
    """Build the staircase decomposition of `mask` (host side: one host sync reading the intervals). A
    pure function of the intervals and the options: no attention runs, any device (CPU included), so
    tools can count the dense shapes a training run would request (tools/staircase_shapes.py).

    Args: see `StaircaseAttentionKernel` (the grouping policy of the module docstring). sub_group_blocks:
        0 (or >= group_blocks): one level of rectangles; else every group's ragged part [m_g, hi) is cut
        again into sub-groups of that many blocks (second-level rectangles [m_g, m_s)).
        key_buckets: 0 (this function's default, the legacy rounding): a rectangle's key count is
        rounded DOWN to a multiple of key_grain (one dense call per rectangle; key_pieces and
        max_tile_keys are ignored); k >= 1: the rectangle is cut by `split_keys` into dense pieces whose
        key counts lie in `key_bucket_lengths(k, min_keys, key_grain, ...)` (k per octave), at most
        max_tile_keys each (0: no cap) and at most key_pieces pieces below the cap. Each piece is its own
        dense call (an entry of `groups`), the keys left over go to the remainder.
    Returns: a `StaircasePlan`; device tensors live on mask.lo's device.
    """
    dev = mask.lo.device
    nb, bsz = mask.num_blocks, mask.block_size
    rows = [mask.lo, mask.hi] + ([mask.lo2, mask.hi2] if mask.has_union else [])
    vals = torch.stack(rows).tolist() if nb else [[] for _ in rows]
    lo, hi = vals[0], vals[1]
    own = [b > a for a, b in zip(vals[2], vals[3])] if mask.has_union else [False] * nb
    live = sorted((b for b in range(nb) if hi[b] > lo[b]), key=lambda b: (lo[b], hi[b], b))
    grain, min_keys = max(1, key_grain), max(1, min_keys)
    buckets, tile = (), 0
    if key_buckets:
        longest = max((hi[b] - lo[b] for b in live), default=0)
        limit = max_tile_keys if max_tile_keys > 0 else 1 << max(longest, 1).bit_length()
        buckets = key_bucket_lengths(key_buckets, min_keys, grain, limit)
        tile = buckets[-1] if (max_tile_keys > 0 and buckets) else 0
    sizes_by_level = [group_blocks]
    if 0 < sub_group_blocks < group_blocks:
        sizes_by_level.append(sub_group_blocks)
    piece_min_pairs = min_pairs if piece_min_pairs is None else piece_min_pairs
    fits = {}  # group size -> bucket lengths passing piece_min_pairs
    lo_rem = list(lo)
    rects = []  # (level, [blocks], klo, khi) in the order made
    firsts = []  # (run index, [blocks], lo, m_g): the level-0 groups with dense pieces (key-major chunks)
    pairs_dense = 0

    def pieces(length, size):
        """Dense key counts for `size` blocks that all see `length` keys from the base: the rounding
        policy, then min_keys / min_pairs per piece (pieces are non-increasing: stop at the first miss)."""
        if not key_buckets:
            kd = length // grain * grain
            return [kd] if kd >= min_keys and size * bsz * kd >= min_pairs else []
        if size not in fits:  # the bucket lengths a call of `size` blocks may have (piece_min_pairs)
            fits[size] = tuple(b for b in buckets if size * bsz * b >= piece_min_pairs)
        ok = fits[size]
        cand = split_keys(length, ok, key_pieces, tile if ok and ok[-1] == tile else 0)
        return cand if size * bsz * sum(cand) >= min_pairs else []

    def split(run, base, level, run_id):
        """Cut `run` (blocks sorted by hi, all seeing [base, hi) whole) into groups of this level; each
        group's dense pieces [base, m_g) (if worth a call), then its ragged part one level down."""
        nonlocal pairs_dense
        left, sizes = _run_sizes(len(run), sizes_by_level[level], min(min_group_blocks, sizes_by_level[level]))
        pos = left
        for size in sizes:
            grp = run[pos:pos + size]
            pos += size
            top = base
            for kd in pieces(hi[grp[0]] - base, size):
                rects.append((level, grp, top, top + kd))
                pairs_dense += size * bsz * kd
                top += kd
            if top > base:
                for b in grp:
                    lo_rem[b] = top
                if level == 0:
                    firsts.append((run_id, grp, base, top))
            if level + 1 < len(sizes_by_level):
                split(grp, top, level + 1, run_id)

    i = run_id = 0
    while i < len(live):
        j = i
        while j < len(live) and lo[live[j]] == lo[live[i]]:
            j += 1
        split(live[i:j], lo[live[i]], 0, run_id)
        i, run_id = j, run_id + 1
    # dense blocks in sorted order; every rectangle's blocks are a contiguous range of this order (nested
    # groups of consecutive blocks of one run)
    in_rect = set(b for _, grp, _, _ in rects for b in grp)
    blocks = [b for b in live if b in in_rect]
    pos_of = {b: p for p, b in enumerate(blocks)}
    groups, levels = [], []
    for level, grp, k0, k1 in rects:
        groups.append((pos_of[grp[0]], pos_of[grp[-1]] + 1, k0, k1))
        levels.append(level)
    key_major = _key_major(firsts, groups, levels, pos_of)
    pairs_total = bsz * sum(h - l for l, h in zip(lo, hi) if h > l) + bsz * bsz * sum(own)
    rem_live = any(hi[b] > lo_rem[b] for b in range(nb)) or any(own)
    lo_rem_t = torch.tensor(lo_rem, dtype=torch.int64, device=dev) if nb else mask.lo.clone()
    rem = None
    if rem_live:
        rem = IntervalMask(bsz, lo_rem_t, mask.hi, mask.num_keys, mask.lo2, mask.hi2,
                           num_ctx_keys=mask.num_ctx_keys)

    def brange(p0, p1):  # original block range of blocks[p0:p1] when contiguous ascending, else None
        a = blocks[p0]
        return (a, a + p1 - p0) if blocks[p0:p1] == list(range(a, a + p1 - p0)) else None

    block_range = brange(0, len(blocks)) if blocks else None
    return StaircasePlan(blocks=torch.tensor(blocks, dtype=torch.int64, device=dev), block_range=block_range,
                         groups=groups, key_major=key_major, rem=rem, lo_rem=lo_rem_t, pairs_total=pairs_total,
                         pairs_dense=pairs_dense, qmajor_keys=sum(k1 - k0 for _, _, k0, k1 in groups),
                         kmajor_blocks=sum(p1 - p0 for p0, p1, _, _ in key_major), levels=levels,
                         qmajor_blocks=sum(p1 - p0 for p0, p1, _, _ in groups),
                         kmajor_keys=sum(k1 - k0 for _, _, k0, k1 in key_major),
                         ranges={r: brange(r[0], r[1]) for r in set(groups) | set(key_major)})


def _key_major(firsts, groups, levels, pos_of) -> list:
    """The backward's key-major rectangle set (same coverage as `groups`). Per run, the level-0 groups
    with dense pieces, (p0, p1, lo, m_g) in run order: when they tile a contiguous position range and m_g
    never decreases (always so for the legacy rounding; checked, since bucketed pieces need not round
    monotonically), key chunk [m_{c-1}, m_c) (m_0 = lo) against the blocks of groups c..last; otherwise
    that run keeps its query-major level-0 pieces. Deeper levels stay as they are."""
    spans_by_run: dict = {}
    for run_id, grp, k0, k1 in firsts:
        spans_by_run.setdefault(run_id, []).append((pos_of[grp[0]], pos_of[grp[-1]] + 1, k0, k1))
    out = []
    for spans in spans_by_run.values():
        chained = all(a[1] == b[0] and a[3] <= b[3] for a, b in zip(spans, spans[1:]))
        if not chained:
            bounds = {(p0, p1) for p0, p1, _, _ in spans}
            out += [g for g, lv in zip(groups, levels) if lv == 0 and (g[0], g[1]) in bounds]
            continue
        run_end, edge = spans[-1][1], spans[0][2]
        for p0, _, _, khi in spans:
            if khi > edge:
                out.append((p0, run_end, edge, khi))
                edge = khi
    return out + [g for g, lv in zip(groups, levels) if lv > 0]


#: one dense attention call as the cuDNN graph cache sees it (torch keys its fwd and bwd graph caches on
#: batch, heads, query rows, key rows, head dims, dtype, and the tensors' sizes and strides: the strides
#: of the kernel's views depend only on heads and D, see `dense_call_shapes`)
DenseShape = collections.namedtuple("DenseShape", "direction heads rows heads_kv keys head_dim dtype")


def dense_call_shapes(plan: StaircasePlan, block_size: int, heads_q: int, heads_kv: int, head_dim: int,
                      dtype=torch.bfloat16, gqa: str = "fold", bwd_mode: str = "query") -> list:
    """The dense calls the staircase kernel makes for `plan`, one `DenseShape` per call: forward over
    `plan.groups`, backward over `plan.groups` (bwd_mode "query") or `plan.key_major` ("key"). Pure host
    code: no attention runs (tools/staircase_shapes.py counts the distinct shapes of a training run).

    Shapes: batch 1; gqa "fold": heads = heads_kv and rows = blocks x block_size x (Hq // Hkv); "native":
    heads = heads_q, rows = blocks x block_size; keys = the call's key count; dtype as a string. The
    kernel passes q/dO/O' as [1, H', rows, D] views of [rows, H', D] buffers and K/V as views of the
    [Tk, Hkv, D] inputs (or contiguous copies), so their strides are fixed by (H', Hkv, D) and by the
    shape: a (direction, shape) pair is one cuDNN graph (built once per process; forward and backward
    graphs are cached separately).

    Raises: ValueError on an unknown gqa / bwd_mode ("auto" must be resolved by the kernel first:
        `StaircaseAttentionKernel.call_shapes`).
    """
    if gqa not in ("fold", "native") or bwd_mode not in ("query", "key"):
        raise ValueError(f"gqa must be fold|native and bwd_mode query|key, got {gqa!r}, {bwd_mode!r}")
    fold = gqa == "fold"
    g = heads_q // heads_kv
    rpb = block_size * (g if fold else 1)
    h = heads_kv if fold else heads_q
    dt = str(dtype).replace("torch.", "")
    bwd = plan.groups if bwd_mode == "query" else plan.key_major
    return ([DenseShape("fwd", h, (p1 - p0) * rpb, heads_kv, k1 - k0, head_dim, dt) for p0, p1, k0, k1 in plan.groups]
            + [DenseShape("bwd", h, (p1 - p0) * rpb, heads_kv, k1 - k0, head_dim, dt) for p0, p1, k0, k1 in bwd])


# ------------------------------------------------------------------------------------------ dense calls
class DenseOps:
    """One dense attention call and its backward on [1, H, L, D] views (any strides with a unit last
    stride), scale given, no mask, no dropout.

    fwd(q4, k4, v4, scale) -> (o4 [1, Hq, Lq, D] in the input dtype, lse [Hq, Lq] fp32 (float64 on CPU
        for float64), natural log).
    bwd(do4, q4, k4, v4, o4, lse [Hq, Lq], scale) -> (dq4, dk4, dv4) in the input dtype; the backward
        recomputes P = exp(s - lse) with the GIVEN lse and delta = rowsum(do4 * o4).
    K/V may have fewer heads than q (grouped-query attention) where the backend supports it.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.kind = "cudnn" if self.device.type == "cuda" else "cpu-flash"
        self._lse_dim = None  # cuDNN's lse layout as its forward returned it ([1, H, L, 1] or [1, H, L])
        self._rng = None

    def fwd(self, q4, k4, v4, scale):
        if self.kind == "cudnn":
            r = A._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, False, False, scale=scale)
            o4, lse = r[0], r[1]
            if self._lse_dim is None:
                self._lse_dim = lse.dim()
                self._rng = (r[6], r[7])
        else:
            o4, lse = A._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, False, scale=scale)
        return o4, lse.reshape(lse.shape[1], lse.shape[2])

    def bwd(self, do4, q4, k4, v4, o4, lse, scale):
        h, n = lse.shape
        if self.kind == "cudnn":
            stats = lse.contiguous().view(1, h, n, 1) if self._lse_dim in (None, 4) else lse.contiguous().view(1, h, n)
            if self._rng is None:  # the forward's dropout seed/offset (unused at p = 0): zeros like torch's
                z = torch.zeros(1, dtype=torch.int64, device=q4.device)
                self._rng = (z, z.clone())
            seed, offset = self._rng
            return A._scaled_dot_product_cudnn_attention_backward(
                do4, q4, k4, v4, o4, stats, seed, offset, None, None, None, q4.shape[2], k4.shape[2], 0.0, False,
                scale=scale)
        return A._scaled_dot_product_flash_attention_for_cpu_backward(do4, q4, k4, v4, o4, lse.unsqueeze(0), 0.0,
                                                                     False, scale=scale)


#: (device, dtype, head dim, Hq', Hkv) -> ("view" | "copy", why): whether the dense backend takes K/V as
#: strided views of [L, Hkv, D] rows (kv_layout="auto"; probed once per process on a small problem)
_KV_PROBE: dict = {}


def probe_kv_views(dense: "DenseOps", dtype, d: int, heads_q: int, heads_kv: int):
    """("view", None) when `dense` runs forward + backward on K/V given as strided [1, Hkv, L, D] views
    of [L, Hkv, D] rows and matches the same call on contiguous copies; else ("copy", reason). Cached per
    (device, dtype, D, heads). CPU: always "view" (the CPU flash kernel takes any strides)."""
    key = (str(dense.device), dtype, d, heads_q, heads_kv)
    if dense.kind != "cudnn":
        return "view", None
    if key not in _KV_PROBE:
        dev = dense.device
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(256, heads_q, d, device=dev, generator=gen).to(dtype)
        kt = torch.randn(384, heads_kv, d, device=dev, generator=gen).to(dtype)
        vt = torch.randn(384, heads_kv, d, device=dev, generator=gen).to(dtype)
        scale = d ** -0.5
        try:
            got = []
            for k4, v4 in ((_as4(kt), _as4(vt)), (_as4(kt).contiguous(), _as4(vt).contiguous())):
                o4, lse = dense.fwd(_as4(q), k4, v4, scale)
                do4 = torch.ones_like(o4)
                got.append((o4,) + tuple(dense.bwd(do4, _as4(q), k4, v4, o4, lse, scale)))
            errs = [float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)) for a, b in zip(*got)]
            _KV_PROBE[key] = ("view", None) if max(errs) < 1e-2 else ("copy", f"views differ from copies: {errs}")
        except RuntimeError as exc:  # e.g. a cuDNN graph that rejects the strides
            _KV_PROBE[key] = ("copy", f"{type(exc).__name__}: {str(exc).strip()[:300]}")
    return _KV_PROBE[key]


def _split_heads(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[R, Hq, ...] -> the [R, Hkv, G, ...] view (x.unflatten(1, (hkv, -1)) without its Python layer)."""
    return x.view(x.shape[0], hkv, x.shape[1] // hkv, *x.shape[2:])


def _by_block(x: torch.Tensor, bsz: int) -> torch.Tensor:
    """[nb * B, ...] -> the [nb, B, ...] view (x.unflatten(0, (-1, bsz)))."""
    return x.view(x.shape[0] // bsz, bsz, *x.shape[1:])


def _as4(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] rows -> the [1, H, L, D] view dense kernels take (no copy)."""
    return x.permute(1, 0, 2).unsqueeze(0)


def _from4(x4: torch.Tensor) -> torch.Tensor:
    """[1, H, L, D] -> a [L, H, D] view."""
    return x4[0].transpose(0, 1)


class _Lanes:
    """Round-robin side CUDA streams for the independent dense calls (`streams` > 1), else the current
    stream. Side streams start after everything queued so far on the current stream."""

    def __init__(self, side: list, device):
        self.side = side
        self.main = torch.cuda.current_stream(device) if side else None
        if side:
            ready = self.main.record_event()
            for s in side:
                s.wait_event(ready)

    def lane(self, i):
        return torch.cuda.stream(self.side[i % len(self.side)]) if self.side else contextlib.nullcontext()

    def done(self, i):
        """Event after the work queued so far on lane i (None without side streams)."""
        return self.side[i % len(self.side)].record_event() if self.side else None

    def join(self):
        for s in self.side:
            self.main.wait_stream(s)


# ------------------------------------------------------------------------------------------ the kernel
class StaircaseAttentionKernel:
    """Dense rectangles (cuDNN on CUDA) + remainder (flex on CUDA, math on CPU), merged by lse; see the
    module docstring. Implements the `kernels/base.py` contract:

    forward(q, k, v, mask, scale) -> (out [Tq, Hq, D], lse [Tq, Hq], state)
        q [Tq, Hq, D], k/v [Tk, Hkv, D], one dtype (CUDA: bf16/fp16; CPU: fp16/bf16/fp32/fp64), Hq % Hkv
        == 0; mask: `IntervalMask` with num_blocks * block_size == Tq, num_keys == Tk (optionally with
        own-block second intervals). out/lse float32 (float64 for float64 inputs); rows with no visible
        key: out 0, lse -inf. state: {"inner": the inner kernel's state of the remainder call}.
    backward(q, k, v, mask, scale, dout, lse, delta, state) -> (dq [Tq, Hq, D], dk, dv [Tk, Hkv, D])
        with the GLOBAL lse and delta [Tq, Hq]; float32 (float64 for float64). One host sync (whether any
        entry needs the math fix-up, see the module docstring).

    Options (`StaircaseOptions` fields, or keyword overrides of the constructor; the default in brackets):
        group_blocks: n, blocks per group [128] (dense rows per call: n * B, x G when folded).
        sub_group_blocks: s, blocks per second-level group [32]; 0 or >= group_blocks: one level only.
            Each group's ragged part [m_g, hi) is cut into sub-groups of s blocks, each with its own
            rectangle [m_g, m_s) (module docstring, "Two levels").
        min_group_blocks: smallest group made of a run's left-over blocks [8].
        key_grain: dense key counts are multiples of this [256].
        min_keys: smallest dense key count of a call [512].
        key_buckets: k > 0: key counts from the bucket set, k per octave (`key_bucket_lengths`), ranges cut
            into tiles + bucket pieces (`split_keys`): a bounded set of shapes (`shape_bound`) [4].
        key_pieces: bucket pieces per rectangle below the tile (key_buckets > 0) [1].
        max_tile_keys: longest dense call in keys, rounded down to a bucket length; 0 = no tile (lengths
            then grow with the context); below min_keys: no dense call at all [65536].
        piece_min_pairs: key_buckets > 0: smallest piece, rows (unfolded) x keys; min_pairs then applies to
            a rectangle's pieces together [None: = min_pairs].
        min_pairs: smallest rectangle, query rows (unfolded) x keys [2**20].
        bwd_mode: "auto" | "query" | "key" [query: measured best with 128-block groups, H200].
        kmajor_min_keys: "auto" takes "key" only if its chunks are this wide on average [2048].
        gqa: "fold" | "native" [fold].
        kv_layout: "auto" | "view" | "copy" [auto: views if a one-time probe shows the dense backend takes
            them (`probe_kv_views`), else copies].
        streams: side CUDA streams for the dense calls, 1 = none [2].
        inner: the remainder kernel: a backend name for `kernels.get_kernel` or a kernel instance [auto:
            flex on CUDA, math on CPU / float64].

    Attributes:
        paths: what ran last (dense backend, gqa, kv_layout, bwd mode, inner kernel) - tools report it.
        counts: calls made (dense_fwd, dense_bwd, inner_fwd, inner_bwd, fixup) - tests check the paths.

    Raises:
        ValueError: bad options, shapes, dtypes (see the module docstring).
    """

    name = "staircase"

    def __init__(self, options: StaircaseOptions | None = None, config: SplitKVConfig | None = None, **overrides):
        """options: `StaircaseOptions` (None: the defaults), with `overrides` (option names, e.g.
        group_blocks=64) applied; config: the `SplitKVConfig` whose "auto" rule and flex options pick the
        remainder kernel (inner="auto"; None: the defaults). Raises ValueError naming an unknown or invalid
        option (`StaircaseOptions.<name>`)."""
        options = StaircaseOptions() if options is None else options
        if not isinstance(options, StaircaseOptions):
            raise ValueError(f"options must be None or a StaircaseOptions, got {type(options).__name__}")
        unknown = sorted(set(overrides) - set(_DEFAULTS))
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a staircase kernel option (one of {', '.join(_DEFAULTS)})")
        overrides = {k: v for k, v in overrides.items() if v is not None}
        options = dataclasses.replace(options, **overrides) if overrides else options
        self.config = SplitKVConfig() if config is None else config
        for name in _DEFAULTS:
            setattr(self, name, getattr(options, name))
        self.min_group_blocks = min(self.min_group_blocks, self.group_blocks)
        if self.piece_min_pairs is None:
            self.piece_min_pairs = self.min_pairs
        self.paths: dict = {}
        self.counts = dict(dense_fwd=0, dense_bwd=0, inner_fwd=0, inner_bwd=0, fixup=0)
        self._dense: dict = {}
        self._side: dict = {}

    def options(self) -> dict:
        """The resolved options (for logs and JSON reports)."""
        return {k: getattr(self, k) if k != "inner" else (self.inner if isinstance(self.inner, str)
                                                          else type(self.inner).__name__)
                for k in _DEFAULTS}

    # ------------------------------------------------------------------ plumbing
    def plan(self, mask: IntervalMask) -> StaircasePlan:
        """The decomposition of `mask`, cached on the mask object (`mask._staircase_plans`); the cache
        assumes lo/hi (lo2/hi2) are not modified in place afterwards."""
        key = (self.group_blocks, self.min_group_blocks, self.key_grain, self.min_keys, self.min_pairs,
               self.sub_group_blocks, self.key_buckets, self.key_pieces, self.max_tile_keys, self.piece_min_pairs)
        return mask_cache(mask, "_staircase_plans", key, lambda: staircase_plan(mask, *key))

    def call_shapes(self, mask: IntervalMask, heads_q: int, heads_kv: int, head_dim: int,
                    dtype=torch.bfloat16) -> list:
        """The dense calls forward + backward would make on `mask` with these options, as `DenseShape`s
        (`dense_call_shapes`, bwd_mode "auto" resolved as the backward does), without running anything
        (the plan is built, or taken from the mask's cache, on the mask's device: CPU works)."""
        plan = self.plan(mask)
        mode = self._bwd_mode(plan, mask.block_size, heads_q, heads_kv)
        return dense_call_shapes(plan, mask.block_size, heads_q, heads_kv, head_dim, dtype, self.gqa, mode)

    def group_sizes(self) -> list:
        """Every block count a rectangle can have: group_blocks, then halves down to min_group_blocks
        (level 0), and the same from sub_group_blocks (level 1, when two levels are on); `_run_sizes`."""
        out, levels = set(), [(self.group_blocks, self.min_group_blocks)]
        if 0 < self.sub_group_blocks < self.group_blocks:
            levels.append((self.sub_group_blocks, min(self.min_group_blocks, self.sub_group_blocks)))
        for n, m in levels:
            out.add(n)
            s = n // 2
            while s >= max(1, m):
                out.add(s)
                s //= 2
        return sorted(out)

    def shape_bound(self, block_size: int, heads_q: int, heads_kv: int) -> set:
        """Every (rows, keys) a dense call can have under these options, whatever the data, for the
        forward and the query-major backward (bwd_mode "query"; "key" makes other backward shapes): rows
        = blocks x block_size (x Hq // Hkv when gqa="fold") for a block count of `group_sizes`, keys a
        bucket length <= the tile (`key_bucket_lengths`) with blocks x block_size x keys >= min_pairs.
        The cuDNN graphs of a run are at most 2 x len(bound) (forward and backward), per (heads, D, dtype).

        Returns: set of (rows, keys) int pairs. Raises: ValueError when the set is unbounded (max_tile_keys
            = 0: lengths grow with the context)."""
        if not self.key_buckets or not self.max_tile_keys:
            raise ValueError("the dense shapes are bounded only with key_buckets > 0 and max_tile_keys > 0, got "
                             f"key_buckets={self.key_buckets}, max_tile_keys={self.max_tile_keys}")
        lengths = key_bucket_lengths(self.key_buckets, self.min_keys, self.key_grain, self.max_tile_keys)
        rpb = block_size * (heads_q // heads_kv if self.gqa == "fold" else 1)
        return {(n * rpb, k) for n in self.group_sizes() for k in lengths
                if n * block_size * k >= self.piece_min_pairs}

    def inner_kernel(self, device, dtype, head_dim):
        """The remainder kernel: `inner` itself when it is a kernel instance, else the registry's kernel of that
        backend name (`kernels.get_kernel`, set as `resolve_inner` when the registry loads)."""
        if not isinstance(self.inner, str):
            return self.inner
        return resolve_inner(self.inner, device, dtype, head_dim=head_dim, config=self.config)

    def _dense_ops(self, device) -> DenseOps:
        key = (device.type, device.index)
        if key not in self._dense:
            self._dense[key] = DenseOps(device)
        return self._dense[key]

    def _side_streams(self, device) -> list:
        if self.streams <= 1 or device.type != "cuda":
            return []
        key = device.index
        if key not in self._side:
            self._side[key] = [torch.cuda.Stream(device=device) for _ in range(self.streams)]
        return self._side[key]

    def check_dtype(self, dtype, device=None, head_dim=None):
        """Raise ValueError when this backend cannot run `dtype` with head dim `head_dim` on `device` (CUDA:
        cuDNN, bf16/fp16 only, D a multiple of 8 <= 256 (`base.check_cuda_head_dim`); CPU: the CPU flash
        kernel, fp16/bf16/fp32/fp64, any D), or its inner kernel cannot. The ops call it once per call, with
        the call's D, before their first data collective, so every rank raises (forward / backward run the
        same check). `head_dim`: D when known (None: not checked); it also resolves inner="auto" to the
        kernel the call will run (D < 16 is "math"; None: the choice for an unknown D, which may be another
        kernel)."""
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            ok = (torch.bfloat16, torch.float16)
        elif dev.type == "cpu":
            ok = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
        else:
            raise ValueError(f"backend='staircase' runs on CUDA (cuDNN) or CPU, not {dev.type}")
        if dtype not in ok:
            raise ValueError(f"backend='staircase' supports q/k/v dtypes {ok} on {dev.type} (cuDNN attention on "
                             f"CUDA), got {dtype}; use backend='flex' or 'math'")
        if dev.type == "cuda":
            check_cuda_head_dim(head_dim, "backend='staircase' (cuDNN)")
        inner = self.inner_kernel(dev, dtype, head_dim)
        if hasattr(inner, "check_dtype"):
            inner.check_dtype(dtype, dev, head_dim=head_dim)

    def _check(self, q, k, v, mask):
        check_call(q, k, v, mask)
        self.check_dtype(q.dtype, q.device, head_dim=q.shape[2])  # the ops' pre-collective check, head dim too

    def _dense_rows(self, x, plan: StaircasePlan, bsz: int, hkv: int, fold: bool, dtype=None):
        """Rows of the dense blocks in plan order, [nd * B (* G), H', ...], in `dtype` (default x's): a view
        for a contiguous block range without folding or conversion, else ONE copy (fold and dtype
        conversion in the same pass; a gather before it when the blocks are not a contiguous range)."""
        if plan.block_range is not None:
            a, b = plan.block_range
            rows = x[a * bsz:b * bsz]
        else:
            rows = _by_block(x, bsz).index_select(0, plan.blocks).flatten(0, 1)
        if fold:
            rows = fold_heads(rows, hkv, dtype)
        elif dtype is not None:
            rows = rows.to(dtype)
        return rows if rows.dim() < 3 or rows.stride(-1) == 1 else rows.contiguous()

    @staticmethod
    def _scatter(dst, src, plan: StaircasePlan, bsz: int, add: bool):
        """dst[rows of the dense blocks] (+)= src ([nd * B, ...], plan order)."""
        if plan.block_range is not None:
            a, b = plan.block_range
            view = dst[a * bsz:b * bsz]
            view.add_(src) if add else view.copy_(src)
            return
        d3, s3 = dst.unflatten(0, (-1, bsz)), src.unflatten(0, (-1, bsz))
        d3.index_add_(0, plan.blocks, s3) if add else d3.index_copy_(0, plan.blocks, s3.contiguous())

    @staticmethod
    def _on_rows(xs, rng, idx, bsz: int, hkv: int, fn, write: int = 1):
        """fn(*views) on the rows of some blocks of the [Tq, Hq(, D)] tensors xs, each view [R, Hkv, G(, D)]
        (query head h * G + g of kv head h). rng = (a, b): the blocks a..b-1, views are slices (fn writes in
        place); else the blocks `idx`: gathered copies, the first `write` of them copied back after fn.
        (Plain views with explicit sizes, not Tensor.unflatten: the same views without its Python layer.)"""
        if rng is not None:
            r0, r1 = rng[0] * bsz, rng[1] * bsz
            fn(*[_split_heads(x[r0:r1], hkv) for x in xs])
            return
        parts = [_by_block(x, bsz).index_select(0, idx) for x in xs]
        fn(*[_split_heads(p.flatten(0, 1), hkv) for p in parts])
        for x, p in zip(xs[:write], parts[:write]):
            _by_block(x, bsz).index_copy_(0, idx, p)

    @staticmethod
    def _unfold_view(x, fold: bool, hkv: int, g: int):
        """A dense call's result as a [R, Hkv, G(, D)] view (no copy): x [1, H', L', D] (o, dq) or
        [H', L'] (lse); folded: H' = Hkv, L' = R * G (row r * G + g); native: H' = Hq, L' = R."""
        if x.dim() == 4:
            x = x[0]
        if fold:
            return x.view(x.shape[0], x.shape[1] // g, g, *x.shape[2:]).transpose(0, 1)
        return _split_heads(x.transpose(0, 1), hkv)

    def _rect_rows(self, plan: StaircasePlan, rect):
        """(block range or None, block indices) of a rectangle's blocks, made once per plan (the plan is cached
        on its mask, so every layer of a step reuses them)."""
        cache = plan.__dict__.get("_rect_rows")
        if cache is None:
            cache = plan.__dict__["_rect_rows"] = {}
        hit = cache.get(rect)
        if hit is None:
            p0, p1 = rect[0], rect[1]
            rng = plan.ranges.get(tuple(rect)) if plan.ranges else None
            hit = cache[rect] = (rng, None if rng is not None else plan.blocks[p0:p1])
        return hit

    def _kv_layout(self, dense: DenseOps, dtype, d, heads_q, heads_kv) -> str:
        """"view" or "copy" (`kv_layout`; "auto": `probe_kv_views`, its reason in paths["kv_probe"])."""
        if self.kv_layout != "auto":
            return self.kv_layout
        layout, why = probe_kv_views(dense, dtype, d, heads_q, heads_kv)
        if why:
            self.paths["kv_probe"] = why
        return layout

    @staticmethod
    def _kv4(x, layout):
        x4 = _as4(x)
        return x4.contiguous() if layout == "copy" else x4

    def _bwd_mode(self, plan: StaircasePlan, bsz: int, hq: int, hkv: int) -> str:
        """"query" or "key" for this plan (`bwd_mode`; "auto": the smaller fp32 accumulation, per head-dim
        column: every dense result is added into the fp32 gradients, dQ rows x Hq + dK/dV rows x Hkv x 2,
        summed over the query-major vs the key-major rectangles, provided the key-major chunks are at least
        `kmajor_min_keys` wide on average)."""
        if self.bwd_mode != "auto":
            return self.bwd_mode
        q_cost = plan.qmajor_keys * hkv * 2 + plan.qmajor_blocks * bsz * hq
        k_cost = plan.kmajor_keys * hkv * 2 + plan.kmajor_blocks * bsz * hq
        wide = plan.kmajor_mean_keys() >= self.kmajor_min_keys
        return "key" if k_cost < q_cost and wide else "query"

    # ------------------------------------------------------------------ contract
    def _prologue(self, q, k, v, mask):
        """Checks, then (acc dtype, q.shape, Hkv, inner kernel, cached plan) for forward/backward."""
        self._check(q, k, v, mask)
        return acc_dtype(q.dtype), tuple(q.shape), k.shape[1], self.inner_kernel(q.device, q.dtype, q.shape[2]), \
            self.plan(mask)

    def forward(self, q, k, v, mask: IntervalMask, scale: float):
        acc, (tq, hq, d), hkv, inner, plan = self._prologue(q, k, v, mask)
        self.paths = dict(inner=getattr(inner, "name", type(inner).__name__), dense_fraction=plan.dense_fraction,
                          groups=len(plan.groups))
        if not plan.groups:  # nothing dense: the inner kernel serves the whole mask
            self.counts["inner_fwd"] += 1
            out, lse, st = inner.forward(q, k, v, mask, scale)
            return out.to(acc), lse.to(acc), {"inner": st}
        bsz = mask.block_size
        fold = self.gqa == "fold"
        g = hq // hkv
        dense = self._dense_ops(q.device)
        rpb = bsz * (g if fold else 1)  # dense rows per block
        with torch.no_grad():
            layout = self._kv_layout(dense, q.dtype, d, hkv if fold else hq, hkv)
            self.paths.update(dense=dense.kind, gqa=self.gqa, kv_layout=layout, streams=self.streams)
            # the [1, H', L, D] view once, each rectangle's rows sliced from it (one view op per call, not
            # three; the same sizes and strides as _as4 of the row slice, so the same dense graphs)
            qd4 = _as4(self._dense_rows(q, plan, bsz, hkv, fold))
            k4, v4 = self._kv4(k, layout), self._kv4(v, layout)
            lanes = _Lanes(self._side_streams(q.device), q.device)
            parts = []  # (rect, o4 in the input dtype, lse [H', L'] fp32): merged straight from these
            for i, rect in enumerate(plan.groups):
                p0, p1, klo, khi = rect
                with lanes.lane(i):
                    o4, l_g = dense.fwd(qd4[:, :, p0 * rpb:p1 * rpb], k4[:, :, klo:khi], v4[:, :, klo:khi], scale)
                if lanes.side:  # used on the caller's stream after the join
                    o4.record_stream(lanes.main)
                    l_g.record_stream(lanes.main)
                parts.append((rect, o4, l_g))
                self.counts["dense_fwd"] += 1
        st = None
        if plan.rem is not None:  # on the current stream, concurrent with side-stream dense calls
            self.counts["inner_fwd"] += 1
            out, lse, st = inner.forward(q, k, v, plan.rem, scale)
            out, lse = out.to(acc), lse.to(acc)
        else:
            out = torch.zeros(tq, hq, v.shape[2], dtype=acc, device=q.device)
            lse = torch.full((tq, hq), float("-inf"), dtype=acc, device=q.device)
        with torch.no_grad():
            lanes.join()
            out, lse = self._merge(out, lse, parts, plan, bsz, hkv, g, fold)
        return out, lse, {"inner": st}

    def _merge(self, out, lse, parts, plan: StaircasePlan, bsz, hkv, g, fold):
        """out/lse (the remainder's, fp32, modified in place) merged with the dense partials, per row:
        L = logsumexp of all partial lse, out = sum_i exp(lse_i - L) O_i: one scaling pass over the dense
        rows and one fused multiply-add per partial that reads the dense result (input dtype, folded layout)
        through a view: no fp32 copy, no unfold, no scatter. Rows where every partial is -inf: weights 0,
        out 0, lse -inf."""
        lse_fin = lse.clone()
        lgs = []  # each partial's lse view, made once for both passes
        for rect, _, l_g in parts:
            lg = self._unfold_view(l_g, fold, hkv, g)
            lgs.append(lg)
            self._on_rows([lse_fin], *self._rect_rows(plan, rect), bsz, hkv,
                          lambda t, lg=lg: torch.logaddexp(t, lg, out=t))
        m = torch.nan_to_num(lse_fin, nan=0.0, posinf=0.0, neginf=0.0)  # where(isfinite, ., 0), in one op
        self._on_rows([out, lse, m], plan.block_range, plan.blocks, bsz, hkv,
                      lambda o, l, mm: o.mul_(torch.exp(l - mm)[..., None]))
        for (rect, o4, _), lg in zip(parts, lgs):
            o_v = self._unfold_view(o4, fold, hkv, g)
            self._on_rows([out, m], *self._rect_rows(plan, rect), bsz, hkv,
                          lambda o, mm, o_v=o_v, lg=lg: o.addcmul_(o_v, torch.exp(lg - mm)[..., None]))
        return out, lse_fin

    def backward(self, q, k, v, mask: IntervalMask, scale: float, dout, lse, delta, state):
        acc, (tq, hq, d), hkv, inner, plan = self._prologue(q, k, v, mask)
        st = state.get("inner") if isinstance(state, dict) else None

        def remainder(m):
            self.counts["inner_bwd"] += 1
            g = inner.backward(q, k, v, m, scale, dout, lse, delta, st)
            return tuple(x.to(acc) for x in g)

        if not plan.groups:
            return remainder(mask)
        bsz = mask.block_size
        fold = self.gqa == "fold"
        g = hq // hkv
        dense = self._dense_ops(q.device)
        mode = self._bwd_mode(plan, bsz, hq, hkv)
        rpb = bsz * (g if fold else 1)
        with torch.no_grad():
            layout = self._kv_layout(dense, q.dtype, d, hkv if fold else hq, hkv)
            self.paths.update(dense=dense.kind, gqa=self.gqa, kv_layout=layout, bwd=mode, streams=self.streams)
            qd = self._dense_rows(q, plan, bsz, hkv, fold)
            dod = self._dense_rows(dout, plan, bsz, hkv, fold, q.dtype)
            lsed = self._dense_rows(lse.to(acc), plan, bsz, hkv, fold)
            od, bad = out_for_delta(dod, self._dense_rows(delta.to(acc), plan, bsz, hkv, fold), q.dtype)
            # entries the dense pass must not see: O' not representable (recomputed by the math fix-up) and
            # rows whose global lse is -inf (P = 0 there, but an overflowing O' would give 0 * NaN)
            finite = lsed.abs() < float("inf")  # isfinite (False for +-inf and NaN) in two ops, not four
            zero = bad | ~finite
            bad &= finite
            any_zero, any_bad = torch.stack([zero.any(), bad.any()]).tolist()  # the one host sync
            if any_zero:  # the same values as where(zero, zeros_like(x), x), without the zero tensors
                od = od.masked_fill(zero[..., None], 0)
                dod = dod.masked_fill(zero[..., None], 0)
            stats = torch.where(finite, lsed, _BIG)  # a scalar: no full_like fill
            k4, v4 = self._kv4(k, layout), self._kv4(v, layout)
            rects = plan.groups if mode == "query" else plan.key_major
            lanes = _Lanes(self._side_streams(q.device), q.device)
            # the dense calls' operands as [1, H', L, D] / [H', L] views once, sliced per rectangle (the same
            # sizes and strides as _as4 / .t() of each row slice: the same dense graphs, fewer view ops)
            dod4, qd4, od4, stats_t = _as4(dod), _as4(qd), _as4(od), stats.t()

            def call(p0, p1, klo, khi):
                r0, r1 = p0 * rpb, p1 * rpb
                self.counts["dense_bwd"] += 1
                return dense.bwd(dod4[:, :, r0:r1], qd4[:, :, r0:r1], k4[:, :, klo:khi], v4[:, :, klo:khi],
                                 od4[:, :, r0:r1], stats_t[:, r0:r1], scale)

            def accumulate(rect, grads, dq, dk, dv):
                """The dense input-dtype results added straight into the fp32 gradients (views: the
                folded dQ read in place, no fp32 buffer, no unfold, no scatter)."""
                _, _, klo, khi = rect
                dq4, dk4, dv4 = grads
                dq_v = self._unfold_view(dq4, fold, hkv, g)
                self._on_rows([dq], *self._rect_rows(plan, rect), bsz, hkv, lambda t: t.add_(dq_v))
                dk[klo:khi].add_(_from4(dk4))
                dv[klo:khi].add_(_from4(dv4))

            pending = []
            if lanes.side:  # dense calls first on the side streams, the remainder concurrently below
                for i, rect in enumerate(rects):
                    with lanes.lane(i):
                        grads = call(*rect)
                    pending.append((rect, grads, lanes.done(i)))
        if plan.rem is not None:
            dq, dk, dv = remainder(plan.rem)
        else:
            dq = torch.zeros(q.shape, dtype=acc, device=q.device)
            dk = torch.zeros(k.shape, dtype=acc, device=q.device)
            dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        with torch.no_grad():
            if lanes.side:
                for rect, grads, ev in pending:
                    lanes.main.wait_event(ev)
                    for t in grads:
                        t.record_stream(lanes.main)
                    accumulate(rect, grads, dq, dk, dv)
                pending.clear()
                lanes.join()
            else:
                for rect in rects:
                    accumulate(rect, call(*rect), dq, dk, dv)
            if any_bad:
                self._fixup(q, k, v, mask, scale, dout, lse, delta, plan, bad, fold, dq, dk, dv)
        return dq, dk, dv

    def _fixup(self, q, k, v, mask, scale, dout, lse, delta, plan, bad, fold, dq, dk, dv):
        """Dense part of the (row, head) entries whose O' was not representable: the math kernel's
        backward over [lo, m_g) of their blocks, with dO and delta zeroed on every other entry."""
        tq, hq, _ = q.shape
        bsz = mask.block_size
        self.counts["fixup"] += 1
        bad_full = torch.zeros((tq, hq), dtype=torch.bool, device=q.device)
        self._scatter(bad_full, unfold_heads(bad, hq) if fold else bad, plan, bsz, add=False)
        blk = bad_full.unflatten(0, (-1, bsz)).flatten(1).any(1)
        fix = IntervalMask(bsz, mask.lo, torch.where(blk, plan.lo_rem, mask.lo), mask.num_keys)
        zero = torch.zeros((), dtype=dout.dtype, device=dout.device)
        g = MathAttentionKernel().backward(q, k, v, fix, scale, torch.where(bad_full[..., None], dout, zero), lse,
                                           torch.where(bad_full, delta, torch.zeros((), dtype=delta.dtype,
                                                                                   device=delta.device)), None)
        for acc_t, x in zip((dq, dk, dv), g):
            acc_t += x.to(acc_t.dtype)
