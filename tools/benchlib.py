"""Shared pieces of the benchmark and simulation tools (issue 6): workloads, placement, timing, FLOP and
byte accounting, and the alpha-beta communication model.

Used by `tools/bench_attention.py` and `tools/simulate_scaling.py` (and available to `tools/gpu_check.py`).
Nothing here runs at import time; torch.distributed is only touched by the functions that take a group.

Contents
--------
Workload (DESIGN.md section 1): `make_workload` samples DFlash anchors as in training (uniform without
replacement among valid positions, `data.anchors.sample_anchors` on an all-ones loss mask) and
`place` runs the planner (`planning.plan_context_parallel`, "lpt" or "zigzag", ...).
`rank_inputs` builds one CP rank's op inputs (random bf16 q/k/v, never zeros) from a plan.

Local-kernel problems: `kernel_calls(method, plan, rank)` lists the (query blocks, key set) pairs the
local kernel of `method` runs on `rank` ("splitkv": all queries vs the rank's keys, one call per chunk of
its merge pipeline; "allgather-kv": the rank's queries vs all keys; "ring-kv": the rank's queries vs each
rank's shard, one call per ring step; the own block fused in as the ops do it), with their visible-pair
counts; `time_kernel_calls` times them (forward + backward through the kernel API).

Kernel checks (tools/gpu_check.py compare, tools/tune_flex.py): `dflash_interval_mask` (one sequence's
DFlash mask), `interval_attention_reference` (float64, per head and row chunk, no dense Hq x Tq x Tk
tensor), `check_kernel` / `kernel_errors`, `time_kernel_api`; `time_fns_interleaved` times variants
round-robin (A/B runs) and `adaptive_reps` sizes timing loops.

FLOP convention (`FWD_BWD_FACTOR`): useful forward FLOPs = 4 * visible (query row, key) pairs * Hq * D
(two matmuls, masked pairs not counted); forward + backward = 3.5 x forward (flash-attn's convention:
backward = 2.5 x forward = 5 matmuls with the recompute of S). `tools/gpu_check.py` and the older tables in
docs/benchmarks.md use 2.5 x for forward + backward; multiply their TF/s by 1.4 to compare.

Communication volumes: `predicted_records(method, ...)` returns, collective by collective, the records
(op name, kind, bytes under `megatron_splitkv.comm`'s per-rank convention, message bytes) that the ops
issue; tests/test_simulate_scaling.py checks them against `comm_stats()` of the real ops on gloo.
`AlphaBeta` turns a record into seconds (flat ring of P ranks); `LinkModel` times it under a topology
("flat": that ring; "node": P ranks on nodes of `gpus_per_node` GPUs, NVLink inside and one NIC per GPU
between, NCCL's ring and all-to-all structure: formulas in its docstring); `fit_alpha_beta` fits
`AlphaBeta` to measured collectives (`measure_collectives`).

Source: DESIGN.md sections 1-3 and 5, /work/.library/device/METHOD.md (timing method), arXiv 2611.05926.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_splitkv._ints import as_int, int_arg, parse_int
from megatron_splitkv.ops.common import acc_dtype, own_key_start, own_rows, window_rows
from megatron_splitkv.ops.metadata import resolve_num_chunks
from megatron_splitkv.ops.schedule import describe_splitkv

__all__ = [
    "FWD_BWD_FACTOR", "METHODS", "QWEN3_8B_DRAFTER", "make_workload", "place", "rank_inputs", "op_fn",
    "kernel_calls", "time_kernel_calls", "kernel_calls_timing", "KernelCallsTiming",
    "time_kernel_calls_rounds", "time_fn", "fwd_flops", "dense_sdpa_rate", "predicted_records",
    "prepare_records", "prepare_meta", "run_op",
    "predicted_bytes", "AlphaBeta", "LinkModel", "fit_alpha_beta", "measure_collectives",
    "list_items", "MAX_HOST_RANKS", "unique_list", "int_list_arg", "choices_arg", "op_option", "time_fns_interleaved", "dflash_interval_mask",
    "interval_attention_reference", "rel_err", "lse_err", "adaptive_reps", "resolve_chunks", "chunk_bounds", "op_accepts",
    "META_INTS", "kernel_errors", "check_kernel", "time_kernel_api", "NA_CPU", "gpu_cell", "finite",
]

#: forward + backward FLOPs over forward FLOPs (flash-attn convention; see module docstring).
FWD_BWD_FACTOR = 3.5
#: method name -> public op attribute of `megatron_splitkv`.
METHODS = {"splitkv": "splitkv_attention", "allgather-kv": "allgather_kv_attention",
           "ring-kv": "ring_kv_attention"}
#: DFlash Qwen3-8B drafter attention shapes (DESIGN.md section 5).
QWEN3_8B_DRAFTER = dict(Hq=32, Hkv=8, D=128, B=16, n_anchors=512, dtype=torch.bfloat16)

_INT32 = 1 << 31


# ------------------------------------------------------------------------------------------ workload
def loss_mask_for(L: int, kind: str = "all", doc_frac: float = 0.75) -> np.ndarray:
    """[L] bool loss mask of one synthetic sequence: "all" = every token supervised; "doc" = a
    document prefix of doc_frac * L unsupervised tokens (long-context QA: the anchors all fall in the
    answer tail, which makes the realized cost far from uniform along the sequence)."""
    m = np.ones(int(L), dtype=bool)
    if kind == "doc":
        m[: int(doc_frac * L)] = False
    elif kind != "all":
        raise ValueError(f"loss mask kind must be 'all' or 'doc', got {kind!r}")
    return m


def make_workload(total_context: int, n_anchors: int = 512, *, n_seqs: int = 1, seed: int = 0,
                  mask: str = "all", doc_frac: float = 0.75):
    """A packed DFlash batch: `n_seqs` equal sequences summing to `total_context` tokens and their anchors.

    Anchors: per sequence `n_anchors // n_seqs` (the query budget split evenly), drawn uniformly without
    replacement among the valid positions a (loss_mask[a] = loss_mask[a+1] = 1; loss mask from
    `loss_mask_for(L, mask, doc_frac)`, default all ones: any a in [0, L-2]), sorted; exactly
    `data.anchors.sample_anchors`.

    Returns (seq_lens [n_seqs] int64 numpy, anchors: list of n_seqs sorted int64 arrays).
    Raises ValueError when n_seqs > total_context (a sequence of no token).
    """
    from megatron_splitkv.data.anchors import sample_anchors

    if n_seqs > total_context:
        raise ValueError(f"{n_seqs} sequences do not fit {total_context} context tokens (at least 1 token each)")
    lens = np.full(n_seqs, total_context // n_seqs, dtype=np.int64)
    lens[: total_context % n_seqs] += 1
    rng = np.random.default_rng(seed)
    per = [n_anchors // n_seqs + (1 if j < n_anchors % n_seqs else 0) for j in range(n_seqs)]
    anchors = [sample_anchors(loss_mask_for(int(L), mask, doc_frac), n, rng=rng) for L, n in zip(lens, per)]
    return lens, anchors


def place(seq_lens, anchors, *, cp_size: int, strategy: str = "lpt", block_size: int = 16, **kw):
    """`planning.plan_context_parallel` (the planner's placement: "lpt", "zigzag", "contiguous", ...)."""
    from megatron_splitkv.planning import plan_context_parallel

    return plan_context_parallel(seq_lens, anchors, block_size=block_size, cp_size=cp_size,
                                 strategy=strategy, **kw)


def _rand(shape, gen, device, dtype):
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def rank_inputs(plan, rank: int, *, Hq: int, Hkv: int, D: int, dtype=torch.bfloat16, device="cpu",
                seed: int = 0, requires_grad: bool = True):
    """One CP rank's inputs of the ops under `plan` (random normal data, never zeros).

    Returns dict: q [n_local*B, Hq, D], k_ctx/v_ctx [T_r, Hkv, D], k_blk/v_blk [n_local*B, Hkv, D] in
    `dtype` on `device` (leaves with requires_grad), q_seq/q_anchor [n_local] int64 (padding blocks:
    anchor -1), kv_seq/kv_pos [T_r] int64 (global positions), plus "dout" [n_local*B, Hq, D] in dtype.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed * 1000003 + rank)
    B = plan.block_size
    sl = plan.query_slice(rank)
    nq = (sl.stop - sl.start) * B
    tk = int(plan.token_index(rank).shape[0])
    out = {"q": _rand((nq, Hq, D), gen, device, dtype), "k_ctx": _rand((tk, Hkv, D), gen, device, dtype),
           "v_ctx": _rand((tk, Hkv, D), gen, device, dtype), "k_blk": _rand((nq, Hkv, D), gen, device, dtype),
           "v_blk": _rand((nq, Hkv, D), gen, device, dtype)}
    if requires_grad:
        for t in out.values():
            t.requires_grad_()
    q_seq = np.maximum(plan.q_seq[sl], 0)
    out.update(q_seq=torch.as_tensor(q_seq, device=device), q_anchor=torch.as_tensor(plan.q_anchor[sl].copy(), device=device),
               kv_seq=torch.as_tensor(plan.token_seq_ids(rank), device=device),
               kv_pos=torch.as_tensor(plan.token_positions(rank), device=device),
               dout=_rand((nq, Hq, D), gen, device, dtype))
    return out


def op_fn(method: str):
    """The public op of `method` ("splitkv" | "allgather-kv" | "ring-kv")."""
    import megatron_splitkv as msk

    return getattr(msk, METHODS[method])


def prepare_meta(method, x, *, block_size, cp_group, Hq, Hkv, D, dtype=torch.bfloat16, **options):
    """`ops.prepare_splitkv_metadata` for `method` on inputs from `rank_inputs` (collective: every rank of
    the group calls it). The training configuration: prepared once per step, reused by every layer.
    `options`: extra keywords of prepare_splitkv_metadata (e.g. num_chunks, where it takes them: see
    `op_option`). group_check defaults to False here: the benchmark times and predicts the op's data
    collectives; the per-call verdict row of the library's default is measured in docs/usage.md."""
    from megatron_splitkv.ops import prepare_splitkv_metadata

    options.setdefault("group_check", False)
    return prepare_splitkv_metadata(x["q_seq"], x["q_anchor"], x["kv_seq"], x["kv_pos"], block_size=block_size,
                                    num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=dtype, cp_group=cp_group,
                                    impl=method, device=x["q"].device, **options)


def op_option(name: str, method: str = "splitkv"):
    """Where the op of `method` takes the keyword `name` (e.g. "num_chunks"): "prepare" when
    `ops.prepare_splitkv_metadata` accepts it, "call" when only the op itself does, None when neither
    (this tree's op has no such option). Signature inspection only; nothing runs."""
    import inspect

    from megatron_splitkv.ops import prepare_splitkv_metadata

    try:
        if name in inspect.signature(prepare_splitkv_metadata).parameters:
            return "prepare"
        if name in inspect.signature(op_fn(method)).parameters:
            return "call"
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        pass
    return None


def op_accepts(name: str, where: str, method: str = "splitkv") -> bool:
    """True when `ops.prepare_splitkv_metadata` (where="prepare") or the op of `method` (where="call")
    has a keyword `name` in this tree. Signature inspection only."""
    import inspect

    from megatron_splitkv.ops import prepare_splitkv_metadata

    fn = prepare_splitkv_metadata if where == "prepare" else op_fn(method)
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def run_op(method, x, *, block_size, cp_group, backend, backward=True, meta=None, op_kwargs=None):
    """One forward (+ backward with x["dout"]) of `method` on inputs from `rank_inputs`; returns out.
    With `meta` (from `prepare_meta`) the call reuses the per-step metadata (no size/metadata
    collectives, no sort, cached BlockMask), as every drafter layer does in training. `op_kwargs`: extra
    keywords of the op call (e.g. {"num_chunks": 2} where the op takes it at the call)."""
    for k in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk"):
        x[k].grad = None
    fn = op_fn(method)
    kw = dict(op_kwargs or {})
    if meta is not None:
        out = fn(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], None, None, None, None, metadata=meta,
                 backend=backend, **kw)
    else:
        out = fn(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], x["q_seq"], x["q_anchor"],
                 x["kv_seq"], x["kv_pos"], block_size=block_size, cp_group=cp_group, backend=backend, **kw)
    if backward:
        out.backward(x["dout"])
    return out


# ------------------------------------------------------------------------------------------ pairs, FLOPs
def _keys_np(seq, pos):
    return np.asarray(seq, np.int64) * (1 << 32) + (np.asarray(pos, np.int64) + _INT32)


def _intervals_np(keys_sorted, q_seq, q_anchor):
    """numpy twin of `ops.common.intervals`: (lo, hi) per block over sorted keys."""
    q_anchor = np.asarray(q_anchor, np.int64)
    q_seq = np.where(q_anchor >= 0, np.asarray(q_seq, np.int64), 0)  # negative ids are valid ids
    base = q_seq * (1 << 32)
    lo = np.searchsorted(keys_sorted, base, side="left")
    hi = np.searchsorted(keys_sorted, base + np.clip(q_anchor, 0, _INT32) + (_INT32 - 1), side="right")
    hi = np.where(q_anchor >= 0, hi, lo)
    return lo, hi


#: int64 entries per rank of the ops' size / validation all-gather "<op>.meta" (ops/agreement.py: the
#: [1, 12] row: sizes, head counts, dtype, impl, call mode / group_check, requested chunk count, what
#: backend "auto" resolves to, error)
META_INTS = 12
def _own_key_start(n: int) -> int:
    return int(own_key_start(n))


def resolve_chunks(num_chunks, P: int, max_blocks: int) -> int:
    """The chunk count Split-KV uses for `num_chunks` (None: its default,
    SplitKVConfig.num_chunks) at CP size P with `max_blocks` blocks per rank: the op's own
    `ops.metadata.resolve_num_chunks`."""
    return int(resolve_num_chunks(num_chunks, P, max(int(max_blocks), 1)))


def chunk_bounds(num_chunks: int, max_blocks: int) -> list:
    """[(b0, b1)] per chunk: blocks [c * nb // k, (c + 1) * nb // k) of every rank's padded segment
    (ops.metadata.chunk_bounds)."""
    return [(c * max_blocks // num_chunks, (c + 1) * max_blocks // num_chunks) for c in range(num_chunks)]


@dataclass
class KernelCall:
    """One local-kernel call: query blocks (q_seq, q_anchor) vs sorted keys; `pairs` = visible
    (query row, key) pairs = B * sum(hi - lo) (+ B * B per own block); `tile_pairs` = pairs of the
    128 x 128 tiles FlexAttention touches (union of the intervals of each 128-row query tile, partial
    tiles counted whole).

    Own block fused in the call (the ops since perf-notes item 1): `own_lo` / `own_hi` [n_blocks] are the
    second intervals (absolute key rows, empty = equal) over `own_keys` keys appended after the context
    keys, which are padded to `ctx_keys_padded` (a multiple of 128); None: no own block in this call."""

    q_seq: np.ndarray
    q_anchor: np.ndarray
    keys: np.ndarray  # sorted int64 keys (seq * 2**32 + pos + 2**31)
    lo: np.ndarray
    hi: np.ndarray
    block_size: int
    pairs: float = 0.0
    tile_pairs: float = 0.0
    own_lo: np.ndarray = None
    own_hi: np.ndarray = None
    own_keys: int = 0
    ctx_keys_padded: int = None
    #: head chunks (the op's `chunk_axis="heads"`): the call's kv-head range [g0, g1) of Hkv (its q heads G
    #: times them); `pairs` / `tile_pairs` are then that share of the all-rows call's (so that their sum over
    #: the calls is the all-heads count the FLOP convention multiplies by Hq). None: every head.
    kv_heads: tuple = None
    num_heads_kv: int = None
    #: a windowed / causal layer (`_with_layer_type`): per-row bounds [rows] of the call's mask
    #: (`IntervalMask.row_lo / row_lo2 / row_hi2`), lo the union of each block's rows; None: whole blocks
    row_lo: np.ndarray = None
    row_lo2: np.ndarray = None
    row_hi2: np.ndarray = None

    @property
    def rows(self) -> int:
        return int(self.q_seq.shape[0]) * self.block_size

    @property
    def num_ctx(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_keys(self) -> int:
        """Keys the kernel gets: context, plus padding and own-block keys when the call has them."""
        if self.own_lo is None:
            return self.num_ctx
        return int(self.ctx_keys_padded) + int(self.own_keys)


def _tile_pairs(lo, hi, B, tile=128):
    """Tile pairs of per-block intervals: rows grouped by 128 (B divides 128 for B in {1,2,...,128}); the
    union of a row tile's intervals approximated by [min lo, max hi)."""
    per = max(1, tile // B)
    n = lo.shape[0]
    tp = 0.0
    for s in range(0, n, per):
        l_, h_ = lo[s:s + per], hi[s:s + per]
        live = h_ > l_
        if live.any():
            k0 = int(l_[live].min()) // tile
            k1 = -(-int(h_[live].max()) // tile)
            tp += (k1 - k0) * tile * tile
    return tp


def _make_call(q_seq, q_anchor, keys_sorted, B, tile=128, own=None, window=None, causal=False):
    """KernelCall of blocks vs sorted keys; `own` = (valid [m] bool, first_block, first_key_block,
    n_own_blocks): the call's blocks first_block .. first_block + m - 1 also see their own B keys
    (as `ops.common.with_own_blocks` builds them). window / causal: a sliding-window / causal layer
    (`_with_layer_type`)."""
    lo, hi = _intervals_np(keys_sorted, q_seq, q_anchor)
    pairs = float(B * np.maximum(hi - lo, 0).sum())
    tp = _tile_pairs(lo, hi, B, tile)
    call = KernelCall(np.asarray(q_seq), np.asarray(q_anchor), keys_sorted, lo, hi, B, pairs, tp)
    if own is not None:
        valid, first_block, first_key_block, n_own = own
        c0 = _own_key_start(keys_sorted.shape[0])
        nb = lo.shape[0]
        lo2 = np.full(nb, c0, dtype=np.int64)
        hi2 = lo2.copy()
        m = int(valid.shape[0])
        start = c0 + (first_key_block + np.arange(m, dtype=np.int64)) * B
        lo2[first_block:first_block + m] = np.where(valid, start, c0)
        hi2[first_block:first_block + m] = np.where(valid, start + B, c0)
        call.own_lo, call.own_hi, call.own_keys, call.ctx_keys_padded = lo2, hi2, int(n_own) * B, c0
        call.pairs += float(B * (hi2 - lo2).sum())
        call.tile_pairs += _tile_pairs(lo2, hi2, B, tile)
    if window is not None or causal:
        _with_layer_type(call, window, causal, tile)
    return call


def _with_layer_type(call, window, causal, tile=128):
    """`call` (a KernelCall) for a sliding-window (window W) / causal layer: the op's own per-row bounds
    (`ops.common.window_rows`, `own_rows`: row j of block b sees context positions > anchor + j - W and its own
    block's keys by the dflash rule), the block lo their union, pairs and tile pairs recounted."""
    B = call.block_size
    keys = torch.from_numpy(np.ascontiguousarray(call.keys))
    anchor = torch.from_numpy(np.asarray(call.q_anchor, np.int64))
    seq = torch.where(anchor >= 0, torch.from_numpy(np.asarray(call.q_seq, np.int64)), 0)
    lo, hi = torch.from_numpy(np.asarray(call.lo, np.int64)), torch.from_numpy(np.asarray(call.hi, np.int64))
    pairs = 0.0
    if window is not None:
        rows = window_rows(keys, seq * (1 << 32), anchor, lo, hi, B, window)
        call.row_lo, call.lo = rows.reshape(-1).numpy(), rows[:, 0].numpy().copy()
        pairs += float((hi[:, None] - rows).sum())
    else:
        pairs += float(B * (hi - lo).sum())
    call.tile_pairs = _tile_pairs(call.lo, call.hi, B, tile)
    if call.own_lo is not None:
        lo2, hi2 = torch.from_numpy(call.own_lo), torch.from_numpy(call.own_hi)
        r_lo2, r_hi2 = own_rows(lo2, hi2, B, window, causal)
        call.row_lo2, call.row_hi2 = r_lo2.numpy(), r_hi2.numpy()
        pairs += float((r_hi2 - r_lo2).sum())
        call.tile_pairs += _tile_pairs(call.own_lo, call.own_hi, B, tile)
    call.pairs = pairs


def context_pairs(anchors, block_size: int, window=None) -> float:
    """Visible (query row, context key) pairs of one-sequence workloads (`make_workload`'s anchors per
    sequence): row j of the block at anchor a sees min(a, W - 1 - j) context tokens (at least 0; all a
    without a window): a * B per block without a window."""
    total = 0.0
    for a in anchors:
        a = np.asarray(a, np.int64)
        if window is None:
            total += float(block_size * a.sum())
        else:
            j = np.arange(block_size, dtype=np.int64)
            total += float(np.clip(np.minimum(a[:, None], window - 1 - j[None, :]), 0, None).sum())
    return total


def kernel_calls(method: str, plan, rank: int, *, num_chunks=None, own_block: bool = True, chunk_axis="rows",
                 num_heads_kv=None, window=None, causal=False):
    """The local-kernel calls `method` makes on `rank` under `plan`. Mirrors ops/*.py:

    - "splitkv": k calls (k = the op's chunk count for `num_chunks`, `resolve_chunks`; 1 in a tree
      without the chunked pipeline): chunk c = the blocks [b0_c, b1_c) of EVERY rank's (padded) segment,
      rank by rank, vs this rank's sorted keys; this rank's own blocks of the chunk also see their own
      keys (appended after the context keys). chunk_axis "heads" (the op's head chunks, ops/splitkv.py
      item 3; needs `num_heads_kv` = Hkv): k clamped to [1, Hkv], every call the all-rows call (one mask)
      with `kv_heads` = `chunk_bounds(k, Hkv)[c]`, its pairs that share.
    - "allgather-kv": one call, this rank's query blocks vs all context keys (+ own block).
    - "ring-kv": P calls, step s: this rank's blocks vs the shard of rank (rank - s) mod P; step 0 (its
      own shard) with the own block.

    own_block=False leaves the own block out (the context part only; also what a tree without the
    fused own block runs in the kernel). window / causal: a sliding-window / causal layer (the calls carry
    the op's per-row bounds, `_with_layer_type`). Returns a list of `KernelCall`.
    """
    layer = dict(window=window, causal=causal)
    P, B = plan.cp_size, plan.block_size
    sl = plan.query_slice(rank)
    nb = plan.blocks_per_rank
    valid_local = np.asarray(plan.q_anchor[sl]) >= 0
    fused = own_block

    def keys_of(r):
        return np.sort(_keys_np(plan.token_seq_ids(r), plan.token_positions(r)))

    if method == "splitkv":
        if chunk_axis not in ("rows", "heads"):
            raise ValueError(f"chunk_axis must be 'rows' or 'heads', got {chunk_axis!r}")
        if chunk_axis == "heads":
            if not isinstance(num_heads_kv, int) or num_heads_kv < 1:
                raise ValueError(f"chunk_axis='heads' needs num_heads_kv (a positive int), got {num_heads_kv!r}")
            bounds = chunk_bounds(resolve_chunks(num_chunks, P, num_heads_kv), num_heads_kv)
            one = kernel_calls(method, plan, rank, num_chunks=1, own_block=own_block, **layer)[0]
            calls = []
            for g0, g1 in bounds:
                c = KernelCall(**{f: getattr(one, f) for f in one.__dataclass_fields__})
                share = (g1 - g0) / num_heads_kv
                c.pairs, c.tile_pairs = one.pairs * share, one.tile_pairs * share
                c.kv_heads, c.num_heads_kv = (g0, g1), num_heads_kv
                calls.append(c)
            return calls
        k = resolve_chunks(num_chunks, P, nb)
        mine = keys_of(rank)
        calls = []
        for b0, b1 in chunk_bounds(k, nb):
            idx = np.concatenate([np.arange(r * nb + b0, r * nb + b1) for r in range(P)])
            own = (valid_local[b0:b1], rank * (b1 - b0), b0, nb) if fused else None
            calls.append(_make_call(plan.q_seq[idx], plan.q_anchor[idx], mine, B, own=own, **layer))
        return calls
    own = (valid_local, 0, 0, nb) if fused else None
    if method == "allgather-kv":
        allk = np.sort(np.concatenate([keys_of(r) for r in range(P)]))
        return [_make_call(plan.q_seq[sl], plan.q_anchor[sl], allk, B, own=own, **layer)]
    if method == "ring-kv":
        return [_make_call(plan.q_seq[sl], plan.q_anchor[sl], keys_of((rank - s) % P), B,
                           own=own if s == 0 else None, **layer) for s in range(P)]
    raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")


def fwd_flops(pairs: float, Hq: int, D: int) -> float:
    """Useful forward FLOPs of attention over `pairs` visible (row, key) pairs: 4 * pairs * Hq * D."""
    return 4.0 * pairs * Hq * D


# ------------------------------------------------------------------------------------------ timing
def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device, *, reps: int = 10, warmup: int = 3, group=None):
    """Median and min milliseconds of fn() (CUDA events on GPU, perf_counter on CPU), after `warmup`
    untimed calls. With a process group of size > 1 the medians are MAX-reduced over its ranks (the
    step is as slow as its slowest rank). Returns (median_ms, min_ms, all times list); the one-variant
    case of `time_fns_interleaved`."""
    return time_fns_interleaved([fn], device, reps=reps, warmup=warmup, group=group)[0]


def time_fns_interleaved(fns, device, *, reps: int = 10, warmup: int = 2, group=None):
    """Time several variants side by side: `warmup` untimed calls of each, then `reps` rounds that call
    every fn once in turn (A B C A B C ...), so drift (clocks, other work) hits all variants alike. CUDA
    events on GPU, perf_counter on CPU. With a process group of size > 1, the medians and minima are
    MAX-reduced over its ranks (every rank must call this with the same fns count, reps and warmup).
    Returns a list of (median_ms, min_ms, times) per fn."""
    device = torch.device(device)
    for fn in fns:
        for _ in range(warmup):
            fn()
    _sync(device)
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times[i].append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times[i].append((time.perf_counter() - t0) * 1e3)
    meds = [statistics.median(t) if t else float("nan") for t in times]
    mins = [min(t) if t else float("nan") for t in times]
    if group is not None:
        import torch.distributed as dist

        if dist.get_world_size(group) > 1:
            dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
            t = torch.tensor(meds + mins, dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            vals = t.tolist()
            meds, mins = vals[:len(fns)], vals[len(fns):]
    return [(m, n, t) for m, n, t in zip(meds, mins, times)]


def adaptive_reps(max_reps: int, est_s: float, target_s: float, min_reps: int = 3) -> int:
    """Repeats for a timing loop of calls that take about `est_s` seconds each: enough for `target_s`
    seconds, clipped to [min(min_reps, max_reps), max_reps]; target_s <= 0 (or no estimate) keeps
    max_reps. Deterministic in its inputs, so ranks that share `est_s` (MAX-reduced) agree."""
    if target_s <= 0 or not est_s > 0 or not math.isfinite(est_s):
        return max_reps
    return int(max(min(min_reps, max_reps), min(max_reps, int(target_s / est_s))))


def chunk_loop(kern, parts, k, v, scale, *, backward: bool = True):
    """Split-KV's chunk loop of local-kernel calls as the op issues them (`ops.splitkv._SplitKV`): parts =
    [(q, dout, mask)] per chunk against the same k / v; every chunk's forward, then every chunk's backward
    with delta = rowsum(dO * O) and its dK / dV summed in fp32 in chunk order, all on the caller's stream. Returns the summed
    (dk, dv) (None without backward or without parts).

    Head chunks (the op's `chunk_axis="heads"`): k and v are lists, chunk c's keys / values [Tk, Hkv_c, D] (its
    kv heads; every part all rows with its q heads, the same mask); a chunk's dK / dV are final: written into
    their heads of one [Tk, Hkv, D] result each (no fp32 sums), which is returned."""
    if not parts:
        return None
    heads = isinstance(k, (list, tuple))
    kv_of = (lambda i: (k[i], v[i])) if heads else (lambda i: (k, v))

    def loop(fn, consume):
        for i in range(len(parts)):
            consume(fn(i))

    def fwd(i):
        return kern.forward(parts[i][0], *kv_of(i), parts[i][2], scale)

    states = []
    loop(fwd, states.append)
    if not backward:
        return None

    def bwd(i):
        q, do, m = parts[i]
        o, lse, st = states[i]
        delta = (do.float() * o).sum(-1)
        return kern.backward(q, *kv_of(i), m, scale, do, lse, delta, st)

    acc = []
    if heads:  # the op's result buffers and each chunk's kv-head offset
        hkv = sum(x.shape[1] for x in k)
        acc.extend(x.new_empty((x.shape[0], hkv, x.shape[2])) for x in (k[0], v[0]))
        offs = [sum(x.shape[1] for x in k[:i]) for i in range(len(k))]
    done = [0]

    def add(grads):  # as the op: dK / dV summed on the caller's stream right after each chunk's wait
        if heads:  # a head chunk's grads written into its heads (cast to the inputs' dtype)
            i, g0 = done[0], offs[done[0]]
            acc[0][:, g0:g0 + k[i].shape[1]].copy_(grads[1])
            acc[1][:, g0:g0 + v[i].shape[1]].copy_(grads[2])
        elif not acc:
            acc.extend(grads[1:])
        else:
            acc[0] += grads[1]
            acc[1] += grads[2]
        done[0] += 1

    loop(bwd, add)
    return tuple(acc)


def chunk_inputs(calls, *, Hq, Hkv, D, dtype, device, gen, mask=None):
    """Random inputs of `bench.chunk_loop` for the live calls of one Split-KV pass (from `kernel_calls`, all
    with the same keys): (parts [(q, dout, mask)], k, v). Row chunks: q / dout [rows, Hq, D], one k / v
    [Tk, Hkv, D]; head chunks (calls with `kv_heads`): q / dout [rows, Hq_c, D] of each call's q heads, k / v
    lists of [Tk, Hkv_c, D], and the calls' ONE mask (they share it, as the op's head chunks do). mask: a
    function call -> IntervalMask (default `call_mask`)."""
    mask = call_mask if mask is None else mask
    live = [c for c in calls if c.rows and c.num_keys]
    if not live:
        return [], None, None
    if live[0].kv_heads is None:
        parts = [(_rand((c.rows, Hq, D), gen, device, dtype), _rand((c.rows, Hq, D), gen, device, dtype),
                  mask(c, device)) for c in live]
        nk = live[0].num_keys
        return parts, _rand((nk, Hkv, D), gen, device, dtype), _rand((nk, Hkv, D), gen, device, dtype)
    grp, m = Hq // Hkv, mask(live[0], device)
    parts, ks, vs = [], [], []
    for c in live:
        hk = c.kv_heads[1] - c.kv_heads[0]
        parts.append((_rand((c.rows, hk * grp, D), gen, device, dtype), _rand((c.rows, hk * grp, D), gen, device,
                                                                              dtype), m))
        ks.append(_rand((c.num_keys, hk, D), gen, device, dtype))
        vs.append(_rand((c.num_keys, hk, D), gen, device, dtype))
    return parts, ks, vs


def _row_tensors(call, device) -> dict:
    """The per-row bounds of a `KernelCall` (windowed / causal layers) as `IntervalMask` keyword tensors on
    `device` (None where the call has none)."""
    return {n: (None if getattr(call, n, None) is None else torch.as_tensor(getattr(call, n), device=device))
            for n in ("row_lo", "row_lo2", "row_hi2")}


def call_mask(call, device):
    """The `IntervalMask` of a `KernelCall` on `device` (with the own-block second intervals when it has them)."""
    from megatron_splitkv.kernels.base import IntervalMask

    lo, hi = torch.as_tensor(call.lo, device=device), torch.as_tensor(call.hi, device=device)
    rows = _row_tensors(call, device)
    if call.own_lo is None:
        return IntervalMask(call.block_size, lo, hi, call.num_keys, row_lo=rows["row_lo"])
    return IntervalMask(call.block_size, lo, hi, call.num_keys, torch.as_tensor(call.own_lo, device=device),
                        torch.as_tensor(call.own_hi, device=device), num_ctx_keys=call.ctx_keys_padded, **rows)


@dataclass
class KernelCallsTiming:
    """What `kernel_calls_timing` builds for timing the local kernel over `calls`: `steps`, zero-argument
    builders, each returning one timed step (a callable: forward + backward of its calls, inputs and masks made
    when the builder runs, reused by every call of the step), one per live call (calls without rows or keys take
    no step). `result(step_ms)` turns the steps' medians (ms, in `steps` order) into `time_kernel_calls`' result
    dict: ms = their sum, per_call_ms = each call's median (0.0 for an empty call)."""

    calls: list
    steps: list
    Hq: int
    D: int
    backward: bool

    def result(self, step_ms) -> dict:
        step_ms = [float(x) for x in step_ms]
        if len(step_ms) != len(self.steps):
            raise ValueError(f"KernelCallsTiming.result: {len(step_ms)} step times for {len(self.steps)} steps")
        it = iter(step_ms)
        per_call = [next(it) if (c.rows and c.num_keys) else 0.0 for c in self.calls]
        return _calls_result(self.calls, per_call, float(sum(per_call)), self.Hq, self.D, self.backward)


def kernel_calls_timing(calls, *, Hq, Hkv, D, dtype=torch.bfloat16, device="cuda", backend="auto", seed: int = 0,
                        backward: bool = True, fresh_mask: bool = False) -> KernelCallsTiming:
    """The timed steps of the local kernel over `calls` (from `kernel_calls`) and how their medians become per-call
    ms (`KernelCallsTiming`); `time_kernel_calls` times them one after the other, `time_kernel_calls_rounds` in
    interleaved rounds. Random inputs (never zeros) from one generator seeded `seed`, drawn in the calls' order
    when the step builders run in order. The arguments as in `time_kernel_calls`."""
    from megatron_splitkv.kernels import get_kernel
    from megatron_splitkv.kernels.base import IntervalMask

    device = torch.device(device)
    # a windowed / causal layer's masks have per-row bounds: "auto" picks a kernel that reads them
    kern = get_kernel(backend, device, dtype, head_dim=D,
                      row_intervals=any(getattr(c, "row_lo", None) is not None or getattr(c, "row_lo2", None)
                                        is not None for c in calls))
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = D ** -0.5
    live = [c for c in calls if c.rows and c.num_keys]

    def build_one(c):
        hkv = Hkv if c.kv_heads is None else c.kv_heads[1] - c.kv_heads[0]  # a head chunk: its heads
        hq = hkv * (Hq // Hkv)
        q = _rand((c.rows, hq, D), gen, device, dtype)
        k = _rand((c.num_keys, hkv, D), gen, device, dtype)
        v = _rand((c.num_keys, hkv, D), gen, device, dtype)
        do = _rand((c.rows, hq, D), gen, device, dtype)
        lo = torch.as_tensor(c.lo, device=device)
        hi = torch.as_tensor(c.hi, device=device)
        rows = _row_tensors(c, device)
        if c.own_lo is not None:
            lo2 = torch.as_tensor(c.own_lo, device=device)
            hi2 = torch.as_tensor(c.own_hi, device=device)

            def mk():
                return IntervalMask(c.block_size, lo, hi, c.num_keys, lo2, hi2, num_ctx_keys=c.ctx_keys_padded,
                                    **rows)
        else:
            def mk():
                return IntervalMask(c.block_size, lo, hi, c.num_keys, row_lo=rows["row_lo"])
        m0 = mk()

        def step():
            m = mk() if fresh_mask else m0
            o, lse, st = kern.forward(q, k, v, m, scale)
            if backward:
                delta = (do.float() * o).sum(-1)
                kern.backward(q, k, v, m, scale, do, lse, delta, st)
        return step

    return KernelCallsTiming(list(calls), [lambda c=c: build_one(c) for c in live], Hq, D, backward)


def time_kernel_calls(calls, *, Hq, Hkv, D, dtype=torch.bfloat16, device="cuda", backend="auto",
                      reps: int = 5, warmup: int = 2, seed: int = 0, backward: bool = True,
                      fresh_mask: bool = False):
    """Time the local kernel over `calls` (from `kernel_calls`): forward (+ backward with the global
    lse/delta taken from the forward, as in the op) through the kernel API. Random inputs (never zeros).
    fresh_mask=False (default): one IntervalMask per call reused across repeats, so the FlexAttention
    BlockMask is cached, as with per-step metadata (`metadata=`, every layer after the first);
    True: a new IntervalMask per repeat (BlockMask rebuilt, the path without metadata).

    Each call is timed alone. Head chunks (calls of `kernel_calls(..., chunk_axis="heads")`, with `kv_heads`): each call gets its heads
    (Hq_c = G * Hkv_c query heads, Hkv_c kv heads, all rows), the calls share one mask.

    The steps come from `kernel_calls_timing`; each is built, timed (`time_fn`, median of `reps` after `warmup`)
    and dropped before the next is built.

    Returns dict: ms (median of the sum over calls), per_call_ms (median each), pairs, tile_pairs, fwd_flops
    (useful), tflops (useful, FWD_BWD_FACTOR convention when backward).
    """
    spec = kernel_calls_timing(calls, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, device=device, backend=backend, seed=seed,
                               backward=backward, fresh_mask=fresh_mask)
    meds = []
    for build in spec.steps:
        step = build()
        meds.append(time_fn(step, torch.device(device), reps=reps, warmup=warmup)[0])
        del step
    return spec.result(meds)


def time_kernel_calls_rounds(specs, *, device, rounds: int, reps: int = 5, warmup: int = 1, warmup_rounds: int = 1):
    """Time several `KernelCallsTiming` (tasks) in `rounds` interleaved rounds: every task's steps are built ONCE
    (inputs and masks reused by every round); round i times every task once (each step a `time_fn` median of
    `reps` after `warmup` untimed calls), the tasks in their order rotated by i (round 0: 0, 1, ..., round 1: 1,
    ..., n-1, 0), so that drift (clocks, host) between rounds hits every task alike and the tasks' values of one
    round are comparable. `warmup_rounds` untimed passes over every task's steps come first (after building all of
    them: the first timed round otherwise meets the allocations and clocks of the build; seen on the H200 as a first
    round 5-15% off the others). Returns, per task, the list of its `KernelCallsTiming.result` dicts, one per timed
    round. rounds and reps: ints >= 1, warmup and warmup_rounds: ints >= 0 (`_ints.as_int`: ValueError naming the
    argument, before anything is built)."""
    rounds = as_int(rounds, "rounds", minimum=1, what=">= 1 (an int)")  # the package's int check: no 2.7, True, "3"
    reps = as_int(reps, "reps", minimum=1, what=">= 1 (an int; 0 reps: NaN medians)")
    warmup = as_int(warmup, "warmup", minimum=0)
    warmup_rounds = as_int(warmup_rounds, "warmup_rounds", minimum=0)
    device = torch.device(device)
    steps = [[build() for build in s.steps] for s in specs]
    for _ in range(warmup_rounds):
        for task in steps:
            for st in task:
                st()
    _sync(device)
    out = [[] for _ in specs]
    n = len(specs)
    for i in range(rounds):
        for t in [(i + x) % n for x in range(n)]:
            meds = [time_fn(st, device, reps=reps, warmup=warmup)[0] for st in steps[t]]
            out[t].append(specs[t].result(meds))
    return out


def _calls_result(calls, per_call, ms, Hq, D, backward):
    """`time_kernel_calls`' result dict from the measured per-call and total ms."""
    pairs = sum(c.pairs for c in calls)
    f = fwd_flops(pairs, Hq, D)
    fac = FWD_BWD_FACTOR if backward else 1.0
    return dict(ms=ms, per_call_ms=per_call, pairs=pairs, tile_pairs=sum(c.tile_pairs for c in calls),
                fwd_flops=f, tflops=(fac * f / ms / 1e9) if ms > 0 else float("nan"))


def dense_sdpa_rate(Lq: int, pairs: float, *, Hq: int, D: int, dtype=torch.bfloat16, device="cuda",
                    reps: int = 5, warmup: int = 2):
    """Dense `scaled_dot_product_attention` (no mask, K/V with Hq heads) doing about the same useful
    FLOPs as `pairs` visible pairs at Lq query rows: Lk_dense = pairs / Lq rounded to 128 (>= 128).

    Returns dict: lk, fwd_ms, fwdbwd_ms, fwd_tflops, fwdbwd_tflops (FWD_BWD_FACTOR convention)."""
    import torch.nn.functional as F

    device = torch.device(device)
    lk = max(128, int(round(pairs / max(Lq, 1) / 128)) * 128)
    g = torch.Generator(device=device).manual_seed(1)
    q = _rand((1, Hq, Lq, D), g, device, dtype).requires_grad_()
    k = _rand((1, Hq, lk, D), g, device, dtype).requires_grad_()
    v = _rand((1, Hq, lk, D), g, device, dtype).requires_grad_()
    go = _rand((1, Hq, Lq, D), g, device, dtype)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)

    def fwdbwd():
        o = F.scaled_dot_product_attention(q, k, v)
        torch.autograd.grad(o, (q, k, v), go)

    f = 4.0 * Lq * lk * Hq * D
    fm, _, _ = time_fn(fwd, device, reps=reps, warmup=warmup)
    bm, _, _ = time_fn(fwdbwd, device, reps=reps, warmup=warmup)
    return dict(lk=lk, fwd_ms=fm, fwdbwd_ms=bm, fwd_tflops=f / fm / 1e9,
                fwdbwd_tflops=FWD_BWD_FACTOR * f / bm / 1e9)


# ------------------------------------------------------------------------------------------ kernel checks
def dflash_interval_mask(n_anchors: int, num_keys: int, *, block_size: int = 16, seed: int = 0, device="cpu"):
    """`IntervalMask` of the DFlash context rule for ONE sequence of `num_keys` sorted context tokens:
    `n_anchors` anchors drawn uniformly without replacement from [1, num_keys], sorted; block b sees keys
    [0, a_b) (positions strictly before its anchor). Visible (row, key) pairs = block_size * sum(a_b).
    The same construction as tools/gpu_check.py's kernel mode (docs/benchmarks.md)."""
    from megatron_splitkv.kernels.base import IntervalMask

    gen = torch.Generator().manual_seed(seed)
    n = min(int(n_anchors), int(num_keys))
    a = torch.sort(torch.randperm(int(num_keys), generator=gen)[:n] + 1).values
    dev = torch.device(device)
    return IntervalMask(block_size, torch.zeros_like(a).to(dev), a.to(dev), int(num_keys))


def _mask_rows(mask, rows: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[len(rows), num_keys] bool visibility of query `rows` under an IntervalMask (its first interval
    lo/hi and, when the mask has them, second intervals lo2/hi2; a windowed / causal layer's per-row bounds
    row_lo / row_lo2 / row_hi2 where the mask has them)."""
    blk = rows // mask.block_size
    j = torch.arange(num_keys, device=rows.device)
    row_lo = getattr(mask, "row_lo", None)
    lo = mask.lo[blk] if row_lo is None else row_lo[rows]
    vis = (j[None] >= lo[:, None]) & (j[None] < mask.hi[blk][:, None])
    lo2, hi2 = getattr(mask, "lo2", None), getattr(mask, "hi2", None)
    if getattr(mask, "row_lo2", None) is not None:
        lo2, hi2, blk = mask.row_lo2, mask.row_hi2, rows
    if lo2 is not None and hi2 is not None:
        vis |= (j[None] >= lo2[blk][:, None]) & (j[None] < hi2[blk][:, None])
    return vis


def interval_attention_reference(q, k, v, mask, scale: float, dout=None, *, row_chunk: int = 2048):
    """float64 reference of interval-mask attention (the kernel contract of `kernels/base.py`) on q's
    device, without autograd and without a dense Hq x Tq x Tk tensor: one query head and `row_chunk`
    query rows at a time (memory ~ 5 x row_chunk x Tk x 8 bytes).

    q [Tq, Hq, D], k/v [Tk, Hkv, D] (any float dtype, upcast to float64); grouped-query attention: q head
    h uses kv head h // (Hq // Hkv). Rows that see no key: out 0, lse -inf, zero gradients.
    Returns dict out [Tq, Hq, D], lse [Tq, Hq] and, with `dout` [Tq, Hq, D], dq, dk [Tk, Hkv, D], dv
    (all float64), computed as P = exp(s - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
    dQ = scale dS K, dK = scale dS^T Q.
    """
    f64 = torch.float64
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    G = Hq // Hkv
    dev = q.device
    out = torch.zeros(Tq, Hq, v.shape[2], dtype=f64, device=dev)
    lse = torch.full((Tq, Hq), float("-inf"), dtype=f64, device=dev)
    grads = dout is not None
    if grads:
        dq = torch.zeros(Tq, Hq, D, dtype=f64, device=dev)
        dk = torch.zeros(Tk, Hkv, D, dtype=f64, device=dev)
        dv = torch.zeros(Tk, Hkv, v.shape[2], dtype=f64, device=dev)
    for r0 in range(0, Tq, row_chunk):
        rows = torch.arange(r0, min(r0 + row_chunk, Tq), device=dev)
        vis = _mask_rows(mask, rows, Tk)
        for h in range(Hq):
            kh, vh = k[:, h // G].to(f64), v[:, h // G].to(f64)
            qh = q[rows, h].to(f64)
            s = (qh @ kh.T) * scale
            s = s.masked_fill(~vis, float("-inf"))
            l = torch.logsumexp(s, -1)
            ls = torch.where(torch.isfinite(l), l, torch.zeros_like(l))
            p = torch.where(vis, torch.exp(s - ls[:, None]), torch.zeros_like(s))
            o = p @ vh
            out[rows, h] = o
            lse[rows, h] = l
            if grads:
                do = dout[rows, h].to(f64)
                delta = (do * o).sum(-1)
                ds = p * (do @ vh.T - delta[:, None])
                dq[rows, h] = (ds @ kh) * scale
                dk[:, h // G] += (ds.T @ qh) * scale
                dv[:, h // G] += p.T @ do
            del s, p
    res = dict(out=out, lse=lse)
    if grads:
        res.update(dq=dq, dk=dk, dv=dv)
    return res


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64 (b the reference; 0/0 -> 0, NaN in a -> NaN)."""
    b = b.detach().to(torch.float64)
    a = a.detach().to(b.device, torch.float64)
    den = float(b.norm())
    num = float((a - b).norm())
    if den == 0.0:
        return num
    return num / den


def lse_err(a, b) -> float:
    """Max abs difference of two lse tensors on the rows where the reference b is finite; inf when
    the finite / -inf patterns differ (a row that should see keys says it sees none, or vice versa)."""
    b = b.detach().to(torch.float64)
    a = a.detach().to(b.device, torch.float64)
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return float("inf")
    if not bool(fin.any()):
        return 0.0
    return float((a[fin] - b[fin]).abs().max())


def kernel_errors(out, lse, grads, ref) -> dict:
    """Errors of a kernel's (out, lse, (dq, dk, dv)) against `interval_attention_reference`'s dict:
    relative norms (`rel_err`), lse max abs (`lse_err`), and the count of non-finite values."""
    e = dict(out=rel_err(out, ref["out"]), lse=lse_err(lse, ref["lse"]))
    if grads is not None:
        for name, g in zip(("dq", "dk", "dv"), grads):
            e[name] = rel_err(g, ref[name])
    e["nonfinite"] = int(sum(int((~torch.isfinite(t)).sum()) for t in [out] + list(grads or [])))
    return e


def check_kernel(kern, q, k, v, mask, scale, dout, ref) -> dict:
    """One forward + backward of a local kernel (backward with this forward's lse and
    delta = rowsum(dO * O): the single-call case of the global statistics) vs the float64 reference."""
    o, l, st = kern.forward(q, k, v, mask, scale)
    delta = (dout.float() * o).sum(-1)
    g = kern.backward(q, k, v, mask, scale, dout, l, delta, st)
    return kernel_errors(o, l, g, ref)


def time_kernel_api(kern, q, k, v, mask, scale, dout, device, *, reps: int = 10, warmup: int = 2):
    """(forward ms, forward + backward ms) of one local kernel through its API, the mask object reused
    (cached BlockMask / TE plan, as with per-step metadata). The backward gets this forward's lse and a
    fixed delta (the op computes delta once, on the owner). Medians of `reps` (`time_fn`)."""
    o, _, st = kern.forward(q, k, v, mask, scale)
    delta = (dout.float() * o).sum(-1)
    del o, st

    def fwd():
        kern.forward(q, k, v, mask, scale)

    def fwdbwd():
        o_, l_, st_ = kern.forward(q, k, v, mask, scale)
        kern.backward(q, k, v, mask, scale, dout, l_, delta, st_)

    f_ms, _, _ = time_fn(fwd, device, reps=reps, warmup=warmup)
    fb_ms, _, _ = time_fn(fwdbwd, device, reps=reps, warmup=warmup)
    return f_ms, fb_ms


# ------------------------------------------------------------------------------------------ comm volumes
@dataclass(frozen=True)
class PredRecord:
    """A predicted collective: `op` name as in comm_stats, `kind`, `bytes` (comm.py's per-rank
    convention), `msg` (message bytes: the per-rank contribution n of an all_gather, the per-rank result
    n of a reduce_scatter, the whole buffer of an all_reduce, the message of a send/recv), `step`
    (ring step, -1 otherwise)."""

    op: str
    kind: str
    bytes: int
    msg: int
    step: int = -1


def _ring_bytes(kind, P, n):
    if P == 1:
        return 0
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return 2 * (P - 1) * n
    if kind == "all_reduce":
        return 4 * (P - 1) * n // P
    return n  # send / recv


_OPNAME = {"splitkv": "splitkv", "allgather-kv": "allgather_kv", "ring-kv": "ring_kv"}
_DTYPE_OF_BYTES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def prepare_records(method: str, *, P: int, n_blocks, n_ctx):
    """The collectives of `ops.prepare_splitkv_metadata(impl=method)` (once per step): the [1, META_INTS] int64
    size all-gather "<impl>.meta", then "splitkv.fwd.block_meta" (2 int64 per block), or
    "allgather_kv.fwd.kv_meta" / "ring_kv.ctx_meta" (one int64 per context token, padded)."""
    name = _OPNAME[method]
    recs = [PredRecord(f"{name}.meta", "all_gather", _ring_bytes("all_gather", P, META_INTS * 8), META_INTS * 8)]
    extra = {"splitkv": ("fwd.block_meta", max(n_blocks) * 2 * 8), "allgather-kv": ("fwd.kv_meta", max(n_ctx) * 8),
             "ring-kv": ("ctx_meta", max(n_ctx) * 8)}[method]
    recs.append(PredRecord(f"{name}.{extra[0]}", "all_gather", _ring_bytes("all_gather", P, extra[1]), extra[1]))
    return recs


def predicted_records(method: str, *, P: int, rank: int, n_blocks, n_ctx, B: int, Hq: int, Hkv: int,
                      D: int, elem: int = 2, acc: int = 4, backward: bool = True, metadata: bool = False,
                      num_chunks=None, cp_ranks_per_node=None, chunk_axis: str = "rows"):
    """The collectives `method` issues on `rank` in one call (forward, then backward), with byte counts.

    Args: n_blocks, n_ctx: per-rank query block counts and context token counts (lists of P ints);
        elem: bytes per element of q/k/v (2: bf16, 4: fp32, 8: fp64); acc: bytes of the accumulation dtype
            (fp32: 4; fp64 inputs: 8);
        metadata: the call passes per-step metadata (`metadata=`): no size / block / key all-gathers in
            the call (they are in `prepare_records`, once per step) and ring-kv rotates K/V without keys.
            False: the self-contained call (validation all-gather [1, META_INTS] int64 "<op>.meta", the
            block or key all-gather, ring keys travelling with K/V).
        num_chunks, cp_ranks_per_node, chunk_axis: splitkv's options (None: the op's defaults). Its records
            are the op's own description of its schedule, `ops.schedule.describe_splitkv` (record `step` = the
            chunk index, message = the chunk's share; the bytes per op name do not depend on the chunking).
    The baselines mirror ops/allgather_kv.py and ops/ring_kv.py. Returns a list of `PredRecord`;
    `sum(r.bytes)` equals `comm_stats().total_bytes` of one forward + backward (tests/test_simulate_scaling.py).
    Raises ValueError for an unknown method, or for splitkv an elem / acc pair no input dtype has.
    """
    name = _OPNAME[method]
    recs = []

    def add(op, kind, msg, step=-1, size=P):
        recs.append(PredRecord(f"{name}.{op}", kind, _ring_bytes(kind, size, msg), msg, step))

    if not metadata:
        add("meta", "all_gather", META_INTS * 8)
    tk_max = max(n_ctx)
    if method == "splitkv":
        nb_max = max(n_blocks)
        dtype = _DTYPE_OF_BYTES.get(elem)
        if dtype is None or _DTYPE_OF_BYTES.get(acc) != acc_dtype(dtype):
            raise ValueError(f"predicted_records: no input dtype has elem={elem} bytes and acc={acc} bytes "
                             "(2 / 4, 4 / 4 or 8 / 8)")
        if not metadata:
            add("fwd.block_meta", "all_gather", nb_max * 2 * 8)
        recs += [PredRecord(c.name, c.kind, c.bytes, c.message, c.step) for c in describe_splitkv(
            cp_size=P, max_blocks=nb_max, block_size=B, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=dtype,
            num_chunks=num_chunks, chunk_axis=chunk_axis, cp_ranks_per_node=cp_ranks_per_node, backward=backward)]
    elif method == "allgather-kv":
        add("fwd.kv", "all_gather", tk_max * 2 * Hkv * D * elem)
        if not metadata:
            add("fwd.kv_meta", "all_gather", tk_max * 8)
        if backward:
            add("bwd.dkv", "reduce_scatter", tk_max * 2 * Hkv * D * acc)
    elif method == "ring-kv":
        if P > 1:
            def shard(s):  # the shard rank holds at step s
                return n_ctx[(rank - s) % P]

            def p2p(op, s, sizes_send, sizes_recv):
                for n in sizes_send:
                    if n:
                        recs.append(PredRecord(f"{name}.{op}", "send", n, n, s))
                for n in sizes_recv:
                    if n:
                        recs.append(PredRecord(f"{name}.{op}", "recv", n, n, s))

            def kv_sizes(n):  # K, V (and the sorted keys when no per-step metadata precomputed the masks)
                return [n * Hkv * D * elem, n * Hkv * D * elem] + ([] if metadata else [n * 8])

            passes = ("fwd", "bwd") if backward else ("fwd",)
            for ph in passes:
                for s in range(P - 1):
                    p2p(f"{ph}.kv", s, kv_sizes(shard(s)), kv_sizes(shard(s + 1)))
                if ph == "bwd":
                    # dK/dV accumulators (acc dtype) after every step's compute, including the last
                    for s in range(P):
                        g = [shard(s) * Hkv * D * acc] * 2
                        gr = [shard(s + 1) * Hkv * D * acc] * 2
                        p2p("bwd.dkv", s, g, gr)
    else:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    return recs


def predicted_bytes(method: str, **kw) -> int:
    """Total comm_stats bytes of `predicted_records(method, **kw)` (per rank, forward + backward)."""
    return sum(r.bytes for r in predicted_records(method, **kw))


# ------------------------------------------------------------------------------------------ alpha-beta
@dataclass
class AlphaBeta:
    """Latency/bandwidth of one collective kind on one link class: t = steps * alpha + wire_bytes / bw.

    alpha_s: seconds per algorithm step (per ring hop); bw: bytes/s per GPU per direction (NCCL's "bus
    bandwidth"). For a group of P ranks and message n (see `PredRecord.msg`), ring algorithms:
        all_gather / reduce_scatter / all_to_all (n = one block): steps P-1, wire (P-1) * n
        all_reduce:                  steps 2(P-1), wire 2(P-1)/P * n
        send / recv (one exchange):  steps 1, wire n (send and receive overlap: full duplex)
    """

    alpha_s: float
    bw: float

    @staticmethod
    def steps_and_wire(kind: str, P: int, n: float):
        if P <= 1:
            return 0, 0.0
        if kind in ("all_gather", "reduce_scatter", "all_to_all"):
            return P - 1, (P - 1) * n
        if kind == "all_reduce":
            return 2 * (P - 1), 2.0 * (P - 1) / P * n
        if kind in ("send", "recv", "p2p"):
            return 1, float(n)
        raise ValueError(f"unknown collective kind {kind!r}")

    def time(self, kind: str, P: int, n: float) -> float:
        """Seconds for one collective of `kind` over P ranks with message n bytes."""
        steps, wire = self.steps_and_wire(kind, P, n)
        return steps * self.alpha_s + wire / self.bw if steps else 0.0


@dataclass
class LinkModel:
    """Time of one collective over P ranks: per-kind `AlphaBeta` for the intra-node link (NVLink) and the
    inter-node link (one NIC per GPU), under one of two topologies.

    topology="flat" (the first model, kept for comparison): every collective is a flat ring of P ranks,
    timed by `AlphaBeta.time` with `intra` when P <= gpus_per_node, else with `inter` for EVERY hop (as
    if all P ranks sat on separate nodes, one NIC each, and an all-to-all were a reduce-scatter).

    topology="node": P ranks on N = ceil(P / G) nodes of G = gpus_per_node GPUs, ranks node by node (as
    Megatron lays out a CP group inside a data-parallel replica); L = min(G, P) ranks per node. Per kind,
    intra (alpha, B) is the one-step collective measured at P = 2 (fitted on the 2-GPU machine, or the
    stated defaults), split into a per-collective base a0 = s2 * (alpha - h) and a per-hop NVLink latency
    h = min(intra_hop_s, alpha) (s2: steps at P = 2, 2 for all_reduce, 1 otherwise; NCCL's tuning model,
    src/graph/tuning.cc of NVIDIA/nccl, also writes a latency as base + per-hop terms); inter (h_net, B_nic)
    is the per-hop network latency and the per-GPU NIC bandwidth. Then (n = `PredRecord.msg`):

    ring all_gather / reduce_scatter (NCCL ring; the ring visits the L ranks of a node over NVLink and
    crosses each node boundary once, so it has N network hops and P - N NVLink hops):
        t = a0 + (P - N) h + (N - 1) h_net + (P - 1) n / min(B, L * B_nic)      [B_nic term only if N > 1]
      Latency: the last block travels P - 1 hops, N - 1 of them between nodes (NCCL's ring latency is
      baseLat + (nsteps - nInterSteps) intraLat + nInterSteps interLat with nInterSteps = nNodes - 1,
      tuning.cc). Bandwidth: every ring link carries (P - 1) n bytes (each rank's result is P - 1 foreign
      blocks that all arrive over its in-link), so each GPU moves (P - 1) n over NVLink (bus bandwidth B)
      and each node boundary carries (P - 1) n in and out; NCCL runs several rings (channels) whose
      boundary crossings use different GPUs' NICs, so a node's L NICs share it: (P - 1) n / (L B_nic)
      (NCCL's ring busBw is nChannels x the per-channel inter speed, tuning.cc; with a NIC per GPU the
      ring bus bandwidth across nodes is the node's aggregate NIC bandwidth, not one NIC's). The slower
      of the two pipelined stages bounds the time. With G = 8 and 50 GB/s NICs, L B_nic = 400 GB/s >
      the NVLink figures fitted on 2 GPUs (~240 GB/s), so rings stay NVLink-bound across nodes.
    all_reduce (ring, twice the steps): t = a0 + 2 (P - N) h + 2 (N - 1) h_net + 2 (P - 1) / P n / min(...)
    all_to_all (`all_to_all_single`: NCCL groups one send and one recv per peer, ncclGroupStart/End, NCCL
    user guide "Point-to-point communication"; they progress concurrently, so the latency is one path,
    not P - 1 steps): every rank sends n bytes to each of its P - 1 peers,
        t = a0 + h_path + (P - 2) c_peer + max(T_nvl, T_net)
        T_nvl = [(L - 1) n + pxn (P - L) n (L - 1) / L] / B         (on-node peers; PXN relays)
        T_net = (P - L) n / B_nic                                    (off-node peers, over this GPU's NIC)
      h_path = h_net when N > 1 else h; c_peer = a2a_peer_s, a stated per-peer issue cost (grouped p2p
      work is spread over a bounded number of channels, so peers are processed partly in series; not an
      NCCL figure: an assumption, small next to the bandwidth terms). With PXN (NCCL >= 2.12, default)
      data for an off-node peer first moves over NVLink to the GPU on the destination's rail, whose NIC
      sends it (NVIDIA blog "Doubling all2all performance with NCCL 2.12"): (L - 1) / L of the off-node
      bytes add to NVLink; the NIC load per GPU is the same on average.
    send / recv (one ring exchange, full duplex): t = a0 + h + n / B if N = 1, else a0 + h_net + n / B_nic
      (the node-boundary pair of a synchronous ring step sets the step time).
    Sub-groups (`per_node`, for the two-level all-to-all of tools/simulate_scaling.py): the same formulas
    with the group's own (N, L) = (ceil(P / per_node), per_node): L consecutive CP ranks of one node give
    N = 1 (NVLink only: a0 + h + (L - 2) c_peer + (L - 1) n / B); the N ranks with one local index, one per
    node, give L = 1 (NIC only, no PXN relay: a0 + h_net + (N - 2) c_peer + (N - 1) n / B_nic). The flat
    model takes the inter figures for a sub-group that spans more than one node.

    Properties (tests/test_simulate_scaling.py): at P = 2 both topologies give alpha + n / B (what was
    fitted); for P <= G the node model uses no inter-node figure; P = 1 costs nothing.
    Defaults (stated, not measured): intra: 8 us per hop, 225 GB/s (DESIGN.md section 5: NVLink
    all-gather bus bandwidth between two H200s); inter: 15 us per hop, 50 GB/s per GPU (400 Gb/s NIC per
    GPU, DESIGN.md section 5); intra_hop_s 3.4 us (NCCL's NVLink ring Simple hwLat, tuning.cc);
    a2a_peer_s 1 us; pxn True. Not modelled: NCCL's tree / NVLS / PAT algorithms (it may pick them for
    small messages), congestion in the network, collectives of different streams sharing links."""

    intra: dict = field(default_factory=lambda: {k: AlphaBeta(8e-6, 225e9) for k in
                                                 ("all_gather", "reduce_scatter", "all_reduce", "p2p")})
    inter: dict = field(default_factory=lambda: {k: AlphaBeta(15e-6, 50e9) for k in
                                                 ("all_gather", "reduce_scatter", "all_reduce", "p2p")})
    gpus_per_node: int = 8
    topology: str = "flat"
    intra_hop_s: float = 3.4e-6
    a2a_peer_s: float = 1e-6
    pxn: bool = True

    @staticmethod
    def _key(table: dict, kind: str) -> str:
        if kind in ("send", "recv", "p2p"):
            return "p2p"
        if kind == "all_to_all":  # timed with its own fit when there is one, else the reduce-scatter's
            return "all_to_all" if "all_to_all" in table else "reduce_scatter"
        return kind

    def ab(self, kind: str, P: int, per_node=None) -> AlphaBeta:
        """The flat model's `AlphaBeta` of `kind` at P ranks (intra when the group fits in one node: P <=
        gpus_per_node, or, for a sub-group with `per_node` ranks per node, when it spans one node)."""
        one_node = P <= self.gpus_per_node if per_node is None else self.nodes(P, per_node)[0] <= 1
        table = self.intra if one_node else self.inter
        return table[self._key(table, kind)]

    def nodes(self, P: int, per_node=None):
        """(N nodes, L ranks per node) of a group of P ranks in the node topology: a CP group lies node by
        node (L = min(gpus_per_node, P)); a sub-group has `per_node` of its ranks on each node (clamped to
        [1, min(gpus_per_node, P)]), e.g. 1 for the ranks with the same local index on every node."""
        G = max(int(self.gpus_per_node), 1)
        L = min(G, int(P)) if per_node is None else max(1, min(int(per_node), G, int(P)))
        return -(-int(P) // L), L

    def parts(self, kind: str, P: int, n: float, per_node=None) -> dict:
        """The node model's pieces of one collective, in seconds: latency, nvlink (NVLink bandwidth
        time), network (NIC bandwidth time), and combine ("max": the two overlap, time = latency +
        max(nvlink, network)). See the class docstring for the formulas. per_node: ranks of this group
        per node when it is a sub-group of the CP group (`nodes`); None: the CP group's own layout."""
        z = dict(latency=0.0, nvlink=0.0, network=0.0)
        if P <= 1:
            return z
        N, L = self.nodes(P, per_node)
        ia = self.intra[self._key(self.intra, kind)]
        na = self.inter[self._key(self.inter, kind)]
        h = min(self.intra_hop_s, ia.alpha_s)
        s2 = 2 if kind == "all_reduce" else 1
        a0 = s2 * (ia.alpha_s - h)
        if kind in ("all_gather", "reduce_scatter", "all_reduce"):
            m = 2 if kind == "all_reduce" else 1
            wire = (P - 1) * n if m == 1 else 2.0 * (P - 1) / P * n
            z["latency"] = a0 + m * ((P - N) * h + (N - 1) * na.alpha_s)
            z["nvlink"] = wire / ia.bw
            z["network"] = wire / (L * na.bw) if N > 1 else 0.0
        elif kind == "all_to_all":
            z["latency"] = a0 + (na.alpha_s if N > 1 else h) + (P - 2) * self.a2a_peer_s
            off = (P - L) * n
            z["nvlink"] = ((L - 1) * n + (off * (L - 1) / L if self.pxn else 0.0)) / ia.bw
            z["network"] = off / na.bw
        elif kind in ("send", "recv", "p2p"):
            if N > 1:
                z["latency"], z["network"] = a0 + na.alpha_s, n / na.bw
            else:
                z["latency"], z["nvlink"] = a0 + h, n / ia.bw
        else:
            raise ValueError(f"unknown collective kind {kind!r}")
        return z

    def time(self, kind: str, P: int, n: float, per_node=None) -> float:
        """Seconds for one collective of `kind` over P ranks with message n bytes (`PredRecord.msg`);
        per_node: ranks of the group per node for a sub-group of the CP group (`nodes`), None for the CP
        group itself (the default: every caller before the two-level all-to-all)."""
        if self.topology == "flat":
            return self.ab(kind, P, per_node).time(kind, P, n)
        if self.topology != "node":
            raise ValueError(f"topology must be 'flat' or 'node', got {self.topology!r}")
        z = self.parts(kind, P, n, per_node)
        return z["latency"] + max(z["nvlink"], z["network"])

    def to_dict(self):
        f = lambda t: {k: dict(alpha_us=v.alpha_s * 1e6, bw_GBs=v.bw / 1e9) for k, v in t.items()}  # noqa: E731
        return dict(intra=f(self.intra), inter=f(self.inter), gpus_per_node=self.gpus_per_node,
                    topology=self.topology, intra_hop_us=self.intra_hop_s * 1e6,
                    a2a_peer_us=self.a2a_peer_s * 1e6, pxn=self.pxn)


def fit_alpha_beta(kind: str, P: int, msg_bytes, seconds) -> AlphaBeta:
    """Fit `AlphaBeta` to measured times of one collective kind at group size P.

    Model t = steps * alpha + wire / bw (`AlphaBeta.steps_and_wire`); least squares of the relative error
    (weights 1/t, so small and large messages both count) over (msg_bytes, seconds) pairs. alpha is
    clamped at >= 0 and bw at > 0. Returns AlphaBeta(alpha_s, bw bytes/s).
    """
    n = np.asarray(msg_bytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if n.shape != t.shape or n.size < 2:
        raise ValueError("need at least two (size, time) points of equal length")
    steps, _ = AlphaBeta.steps_and_wire(kind, P, 1.0)
    wire = np.array([AlphaBeta.steps_and_wire(kind, P, x)[1] for x in n])
    A = np.stack([np.full_like(wire, float(steps)), wire], 1) / t[:, None]
    y = np.ones_like(t)
    (alpha, inv_bw), *_ = np.linalg.lstsq(A, y, rcond=None)
    if inv_bw <= 0:  # latency-only data: fall back to the largest message's bandwidth
        inv_bw = max(t.max() - steps * max(alpha, 0), 1e-12) / max(wire.max(), 1.0)
    if alpha < 0:  # refit the slope alone
        alpha = 0.0
        inv_bw = float(np.sum(wire * t / t**2) / np.sum(wire**2 / t**2))
    return AlphaBeta(float(alpha), float(1.0 / inv_bw))


def measure_collectives(group, device, sizes=None, *, reps: int = 10, warmup: int = 3):
    """Time all_gather / reduce_scatter / all_reduce / ring send-recv on `group` (all ranks call it).

    sizes: message bytes n (per-rank contribution for all_gather, per-rank result for reduce_scatter,
    buffer for all_reduce, message for p2p); default 4 KiB .. 256 MiB (x4 steps) on CUDA, 4 KiB .. 4 MiB
    on CPU. Data: random bf16. Each time is the median over reps, MAX over ranks. Returns dict kind ->
    list of (n_bytes, seconds); on rank 0 and every other rank alike.
    """
    import torch.distributed as dist

    device = torch.device(device)
    P = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if sizes is None:
        hi = 28 if device.type == "cuda" else 22
        sizes = [1 << e for e in range(12, hi + 1, 2)]
    out = {k: [] for k in ("all_gather", "reduce_scatter", "all_reduce", "p2p")}
    nxt = dist.get_global_rank(group, (rank + 1) % P) if group is not None else (rank + 1) % P
    prv = dist.get_global_rank(group, (rank - 1) % P) if group is not None else (rank - 1) % P
    for n in sizes:
        el = max(1, n // 2)
        x = torch.randn(el, device=device).to(torch.bfloat16)
        big = torch.randn(el * P, device=device).to(torch.bfloat16)
        ag_out = torch.empty(el * P, device=device, dtype=torch.bfloat16)
        rs_out = torch.empty(el, device=device, dtype=torch.bfloat16)
        rbuf = torch.empty_like(x)
        fns = {
            "all_gather": lambda: dist.all_gather_into_tensor(ag_out, x, group=group),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(rs_out, big, group=group),
            "all_reduce": lambda: dist.all_reduce(x, group=group),
        }

        def p2p():
            ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, rbuf, prv, group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        fns["p2p"] = p2p
        for kind, fn in fns.items():
            dist.barrier(group=group)
            med, _, _ = time_fn(fn, device, reps=reps, warmup=warmup, group=group)
            out[kind].append((int(el * 2), med / 1e3))
        del x, big, ag_out, rs_out, rbuf
    return out


def fit_link(measured: dict, P: int) -> dict:
    """`fit_alpha_beta` for every kind in a `measure_collectives` result -> dict kind -> AlphaBeta."""
    return {k: fit_alpha_beta(k if k != "p2p" else "send", P, [a for a, _ in v], [b for _, b in v])
            for k, v in measured.items() if len(v) >= 2}


def fmt_bytes(n: float) -> str:
    """Human bytes (decimal MB/GB)."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    if n >= 1e3:
        return f"{n / 1e3:.1f} kB"
    return f"{int(n)} B"


def md_table(header, rows) -> str:
    """Markdown table from a header list and rows of cells (str() of each)."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def finite(x, fmt="{:.2f}", nan="-"):
    """Format a number, '-' for None/NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return nan
    return fmt.format(x)


#: table cell of a GPU-only measure (TF/s, GPU busy time, peak GPU memory) in a CPU run of a tool: printed
#: instead of numbers that would look measured (0 TF/s, nan GiB)
NA_CPU = "n/a (CPU)"


def gpu_cell(cpu: bool, value, fmt="{:.2f}") -> str:
    """A GPU-only measure as a table cell: `NA_CPU` in a CPU run, else `finite(value, fmt)` ('-' for None / NaN)."""
    return NA_CPU if cpu else finite(value, fmt)


# ------------------------------------------------------------------------------------------ CLI flags


def add_workload_args(ap, *, reps: int) -> None:
    """The workload flags shared by tools/bench_attention.py and tools/simulate_scaling.py (the batch that
    `make_workload` builds): --anchors, --n-seqs, --loss-mask, --seed, --reps."""
    ap.add_argument("--anchors", type=int_arg(1), default=512, help="query budget N (anchors per batch)")
    ap.add_argument("--n-seqs", type=int_arg(1), default=1, help="sequences in the batch (context split evenly)")
    ap.add_argument("--loss-mask", default="all", choices=["all", "doc"],
                    help="all: anchors uniform over the sequence; doc: only in the last 25%% (long-document QA)")
    ap.add_argument("--seed", type=int_arg(0), default=0)
    ap.add_argument("--reps", type=int_arg(1), default=reps)


def add_attention_shape_args(ap) -> None:
    """The attention shape flags of the layer-level tools (tools/bench_layer_overlap.py,
    tools/memory_breakdown.py), defaults the Qwen3-8B drafter's (`QWEN3_8B_DRAFTER`): --anchors (query blocks),
    --block-size, --hq, --hkv, --d (ints >= 1)."""
    s = QWEN3_8B_DRAFTER
    ap.add_argument("--anchors", type=int_arg(1), default=s["n_anchors"])
    ap.add_argument("--block-size", type=int_arg(1), default=s["B"])
    ap.add_argument("--hq", type=int_arg(1), default=s["Hq"])
    ap.add_argument("--hkv", type=int_arg(1), default=s["Hkv"])
    ap.add_argument("--d", type=int_arg(1), default=s["D"])


#: the most gloo processes a tool starts on this host per CP size (--cp / --cp-sweep / --nproc of the CPU tools
#: that run one process per rank): the largest CP size the docs use (64); more is a typo, not a run
MAX_HOST_RANKS = 64


def list_items(ap, flag: str, value: str) -> list:
    """A comma-list flag's items, stripped; `ap.error` (exit 2) naming `flag` when one is empty ("2,,4", "2,4,",
    ",2": a value lost between commas is a typo, not a shorter list)."""
    items = [x.strip() for x in value.split(",")]
    if any(not x for x in items) and any(items):
        ap.error(f"{flag} has an empty item in {value!r}: a comma list of values, one between each two commas")
    return [x for x in items if x]


def unique_list(ap, flag: str, items: list, value: str) -> list:
    """`items` (a comma-list flag's parsed values) unchanged when no value repeats; otherwise `ap.error` (exit 2)
    naming `flag` and the repeated values (a repeat would run the same row twice)."""
    twice = [x for x in dict.fromkeys(items) if items.count(x) > 1]  # in first-seen order; lists of a few items
    if twice:
        ap.error(f"{flag} names {', '.join('none' if x is None else str(x) for x in twice)} more than once in "
                 f"{value!r}: each value once")
    return items


def int_list_arg(ap, flag: str, value: str, minimum: int, maximum: int | None = None) -> list:
    """Comma list of distinct integers in [`minimum`, `maximum`] (None: no upper limit; plain decimal,
    `_ints.parse_int`); otherwise `ap.error` (exit 2) naming `flag` (`list_items` for an empty item,
    `unique_list` for a repeated value)."""
    try:
        out = [parse_int(c, flag) for c in list_items(ap, flag, value)]
    except ValueError:
        out = None
    if not out or min(out) < minimum or (maximum is not None and max(out) > maximum):
        limit = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        ap.error(f"{flag} must be a comma list of integers {limit}, got {value!r}")
    return unique_list(ap, flag, out, value)


def choices_arg(ap, flag: str, value: str, valid, what: str) -> list:
    """Non-empty comma list of distinct items, all in `valid`; otherwise `ap.error` naming `flag` (`unique_list`
    for a repeated item, `list_items` for an empty one)."""
    items = list_items(ap, flag, value)
    bad = [m for m in items if m not in valid]
    if bad or not items:
        ap.error(f"{flag}: unknown {what}(s) {bad or '(empty)'}; valid: {', '.join(valid)}")
    return unique_list(ap, flag, items, value)
