"""Per-step mask metadata of the CP attention ops, prepared once and reused by every layer of a step.

Everything the three ops (`splitkv_attention`, `allgather_kv_attention`, `ring_kv_attention`) do besides
moving activations depends only on the mask metadata (q_seq, q_anchor, kv_seq, kv_pos, block_size, the CP
group): input validation (host syncs), the tiny all-gather of per-rank sizes, the all-gather of block or
context metadata, the sort of the context keys, the key intervals (`IntervalMask`) and, on the GPU, the
FlexAttention `BlockMask` built from them (~2 ms on an H200, cached on the `IntervalMask` object). That
metadata is identical for every drafter layer of a training step, so a model prepares it ONCE per step
with `prepare_splitkv_metadata` and passes the result to each layer's call as `metadata=`:

    meta = prepare_splitkv_metadata(q_seq, q_anchor, kv_seq, kv_pos, block_size=B,
                                    num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.bfloat16,
                                    cp_group=cp_group, impl="splitkv")
    for layer in drafter_layers:              # q/k/v differ per layer, the metadata does not
        q, k_ctx, v_ctx, k_blk, v_blk = layer.qkv(...)
        out = splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, None, None, None, None, metadata=meta)

In Megatron-Core the natural carrier is the per-micro-batch `DFlashPackedSeqParams` that already reaches
every layer's core attention (`megatron_splitkv/megatron/attention.py`): build `meta` where the params
are built and let the core attention pass it on.

Split-KV pipelining (perf-notes item 2): the splitkv metadata also fixes `num_chunks`, the number of query
chunks the op pipelines its merge over (chunk c = blocks [c * nb_max // k, (c + 1) * nb_max // k) of every
rank's padded block segment, nb_max = max(n_blocks)), with one precomputed `IntervalMask` per chunk
(context only, and with the own-block intervals). Default (`num_chunks=None`): `SplitKVConfig.num_chunks`
when set, else 1 (measured best over NVLink; 2 is best over a slow link,
see DEFAULT_NUM_CHUNKS); an explicit value is clamped to [1, max(nb_max, 1)]. It must be the same on every rank (checked group-wide).
With `chunk_axis="heads"` (or `SplitKVConfig(chunk_axis="heads")`; `resolve_chunk_axis`, agreed group-wide in bit
23 of the request code) the chunks split the heads of all rows instead (ops/splitkv.py item 3 "Head chunks"):
k clamped to [1, Hkv], `chunk_heads` per chunk, chunks = [(0, nb_max)] * k and the k = 1 masks repeated.

Split-KV's two-level all-to-all (ops/splitkv.py item 5): the splitkv metadata also fixes
`cp_ranks_per_node` (L, `resolve_ranks_per_node`: the argument, else `SplitKVConfig.cp_ranks_per_node`
clamped to P, else 1; it must divide P and be the same on every rank,
checked group-wide like num_chunks) and, for 1 < L < P, holds the two cached sub-groups
(`SplitKVMetadata.node_groups`, `comm.node_groups`). The agreement rows carry it in column 10 next to the
requested chunk count (`_request_code`: L = 1 leaves the rows exactly as before).

Cost of a prepare (docs/perf-notes.md "Prepare cost (item 13)", `tools/prepare_cost.py`): Split-KV's
metadata takes ~50 small device ops whatever num_chunks (the intervals of every chunk at once, the mask
contract checked once) and one host sync in a size-1 group.

Calls with `metadata=` check Python-level tensor shapes, dtypes and devices against the metadata (see
`check_call`); with `group_check=True` (the default) they add one [1, 12] int64 verdict all-gather and its
host read before their first data collective (its cost: docs/lab/agreement_cost.md), with `group_check=False`
no host sync and no collective besides the op's own data movement. Calls without `metadata=` build one internally (validating the tensors group-wide as
before) and give bit-identical results.

Source: arXiv 2611.05926 (Split-KV), DESIGN.md sections 1 (mask) and 2 (algorithm).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from dataclasses import dataclass, field

import torch

from .._ints import _shown, as_int
from ..comm import CommGroup, all_gather, node_groups, resolve_group
from ..config import CHUNK_AXES, DEFAULT_NUM_CHUNKS, FlexOptions, SplitKVConfig, resolve_config
from ..kernels import (
    BACKENDS,
    auto_backend_code,
    auto_backend_text,
    auto_keys_per_call,
    get_kernel,
    warn_ignored_options,
)
from ..kernels.base import IntervalMask
from .common import (
    SUPPORTED_DTYPES,
    acc_dtype,
    context_keys,
    intervals,
    own_key_start,
    own_rows,
    pad_rows,
    sort_keys,
    window_rows,
    with_own_blocks,
)
from ..reference import check_attention_type

__all__ = ["SplitKVMetadata", "prepare_splitkv_metadata", "IMPLS", "resolve_num_chunks", "chunk_bounds",
           "check_query_gather_start", "resolve_ranks_per_node", "prepare_splitkv_metadata_from_plan",
           "check_environment_agreement", "CHUNK_AXES", "resolve_chunk_axis", "env_request_row",
           "check_prepared_config"]

#: accepted `impl` spellings -> canonical op name (the Megatron spellings use dashes).
IMPLS = {
    "splitkv": "splitkv",
    "allgather_kv": "allgather_kv",
    "allgather-kv": "allgather_kv",
    "ring_kv": "ring_kv",
    "ring-kv": "ring_kv",
    "ring": "ring_kv",
}
_IMPL_CODE = {"splitkv": 0, "allgather_kv": 1, "ring_kv": 2}
_DTYPE_CODE = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}
_INT32 = 1 << 31
_UINT64 = getattr(torch, "uint64", None)
_MAX_MSG = 1000
#: how an op call was made, exchanged in the op's agreement row (no `metadata=` / `metadata=` with
#: group_check / `metadata=` and `query_gather=` / `splitkv_start_query_gather` with group_check): a group
#: mixing them raises the same ValueError on every rank instead of hanging.
_MODE_PLAIN, _MODE_METADATA, _MODE_QUERY_GATHER, _MODE_GATHER_START = 0, 1, 2, 3
_MODE_NAMES = {_MODE_PLAIN: "without metadata=", _MODE_METADATA: "with metadata=",
               _MODE_QUERY_GATHER: "with metadata= and query_gather=",
               _MODE_GATHER_START: "splitkv_start_query_gather"}


def _scale_bits(scale: float) -> int:
    """The float64 bit pattern of a (resolved) softmax scale as an int64, for the agreement rows."""
    return struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def _resolved_scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)




#: requested chunk counts are saturated at this value (far above any block count): the agreement rows'
#: column 10 holds it in its low 23 bits, the chunk axis in bit 23,
#: cp_ranks_per_node - 1 from bit 32 and the layer type (window / causal) in bits 24-30 and 48-62 (`_request_code`)
_MAX_REQUESTED_CHUNKS = (1 << 23) - 1

def _requested_axis(chunk_axis, config: SplitKVConfig | None = None) -> int:
    """The chunk axis as its code for the agreement rows (0 = "rows", 1 = "heads"): chunk_axis, else
    `config.chunk_axis` (None: "rows"). Raises ValueError naming the argument and the allowed values."""
    if chunk_axis is None:
        return CHUNK_AXES.index(resolve_config(config).chunk_axis)
    if not isinstance(chunk_axis, str) or chunk_axis not in CHUNK_AXES:
        raise ValueError(f"chunk_axis must be None, 'rows' or 'heads', got {chunk_axis!r}")
    return CHUNK_AXES.index(chunk_axis)


def _requested_head_split(head_split) -> None:
    """None: uneven head splits are deleted (docs/tuning.md: no measured gain); a `head_split` other than None
    raises ValueError naming the argument and its replacement."""
    if head_split is not None:
        raise ValueError(f"head_split={_shown(head_split)}: uneven head splits were removed (no measured gain, "
                         "docs/tuning.md); use chunk_axis='heads' with num_chunks=k for k even head chunks")


def resolve_chunk_axis(chunk_axis=None, config: SplitKVConfig | None = None) -> str:
    """Split-KV's chunk axis (ops/splitkv.py item 3, "Head chunks"): chunk_axis ("rows" | "heads"), else
    `config.chunk_axis` (None: "rows"). Raises ValueError (naming the argument and the allowed values) for
    anything else."""
    return CHUNK_AXES[_requested_axis(chunk_axis, config)]


def _requested_chunks(num_chunks, config: SplitKVConfig | None = None) -> int:
    """The requested chunk count as an int for the agreement rows: num_chunks, else `config.num_chunks`,
    else 0 (automatic); saturated at 2**23 - 1 (a larger request clamps to the block count anyway). Raises
    ValueError for a non-positive / non-int value."""
    if num_chunks is None:
        num_chunks = resolve_config(config).num_chunks
        if num_chunks is None:
            return 0
    num_chunks = as_int(num_chunks, "num_chunks", minimum=1, what="None or a positive int")
    # saturated so that it fits the agreement row's column (a larger value is clamped to the block count
    # anyway); an int beyond int64 would otherwise fail on its own rank only, outside the group verdict
    return min(num_chunks, _MAX_REQUESTED_CHUNKS)


def resolve_ranks_per_node(cp_ranks_per_node, cp_size: int, config: SplitKVConfig | None = None) -> int:
    """L, the CP ranks per node of Split-KV's two-level all-to-all (the forward merge and the dQ
    exchange; see `ops.splitkv`), for a CP group of size P = cp_size.

    Args:
        cp_ranks_per_node: None (`config.cp_ranks_per_node` when set, a positive int describing the
            machine: clamped to P, so a CP group that fits in one node gets the single all-to-all; else
            1) or a positive int that divides P. L = 1 or L = P: the single
            all-to-all over the whole CP group (today's path, bit-identical); 1 < L < P: two stages.
        cp_size: P.
        config: `SplitKVConfig` (None: the defaults).

    Returns: L, 1 <= L <= P with P % L == 0.

    Raises:
        ValueError: cp_ranks_per_node not a positive int, or L not dividing P (the message names the
            argument or the config field, and P).
    """
    if cp_ranks_per_node is None:
        given = resolve_config(config).cp_ranks_per_node
        if given is None:
            return 1
        value = min(given, cp_size)
        if cp_size % value:
            raise ValueError(f"SplitKVConfig.cp_ranks_per_node={given} must divide the CP group size P={cp_size} "
                             "(CP ranks per node: the CP group must cover whole nodes)")
        return value
    cp_ranks_per_node = as_int(cp_ranks_per_node, "cp_ranks_per_node", minimum=1,
                               what="None or a positive int")
    if cp_size % cp_ranks_per_node:
        raise ValueError(f"cp_ranks_per_node={cp_ranks_per_node} must divide the CP group size P={cp_size} "
                         "(limit: a divisor of P, at most P)")
    return cp_ranks_per_node


#: the layer type's code (`_kind_code`): the window field holds W exactly below this, a hash of W from it on
_EXACT_WINDOWS = 1 << 20


def _kind_code(window=None, causal=False) -> int:
    """The layer type (window, causal; checked, `reference.check_attention_type`) as a 22-bit code for the agreement
    rows (`_request_code`): bit 0 = causal, bits 1-21 the window field: 0 = None, W itself for 1 <= W < 2**20
    (exact), 2**20 + a 20-bit blake2b hash of W for W >= 2**20 (two ranks passing different windows of >= 2**20
    tokens each agree by chance with probability 2**-20, about 1e-6; windows longer than every sequence give the
    same mask anyway)."""
    if window is None:
        field_ = 0
    elif window < _EXACT_WINDOWS:
        field_ = window
    else:
        digest = hashlib.blake2b(str(window).encode(), digest_size=4).digest()
        field_ = _EXACT_WINDOWS + int.from_bytes(digest, "little") % _EXACT_WINDOWS
    return int(causal) + (field_ << 1)


def _kind_text(code: int) -> str:
    """A `_kind_code` as the error shows it: "window=W, causal=C" (a hashed window: "window>=2**20 (hash h)")."""
    field_, causal = code >> 1, bool(code & 1)
    if field_ >= _EXACT_WINDOWS:
        return f"window>=2**20 (hash {field_ - _EXACT_WINDOWS:#x}), causal={causal}"
    return f"window={field_ or None}, causal={causal}"


def _request_code(chunks_req: int, ranks_per_node: int, axis: int = 0, window=None, causal=False) -> int:
    """Column 10 of the agreement rows (a non-negative int64): the requested chunk count in the low 23 bits, the
    chunk axis code (`_requested_axis`: 0 = rows, 1 = heads) in bit 23, L - 1 in bits 32-47, and the layer type's
    22-bit `_kind_code(window, causal)` with its low 15 bits in bits 48-62 and its high 7 bits in bits 24-30
    (0 for window None, causal False). Rows (axis 0) leaves the code as before."""
    kind = _kind_code(window, causal)
    return (chunks_req + (axis << 23) + ((ranks_per_node - 1) << 32) + ((kind & 0x7FFF) << 48)
            + ((kind >> 15) << 24))


def _decoded(table):
    """The agreement table with four derived columns inserted after column 10 of every row: 11 = requested
    num_chunks, 12 = cp_ranks_per_node, 13 = the layer type's `_kind_code` (window / causal), 14 = the chunk
    axis code (decoded from column 10; not sent); the sent columns after 10 follow from 15 (15: `_AUTO_COL`)."""
    return [list(row[:11]) + [row[10] & _MAX_REQUESTED_CHUNKS,
                         ((row[10] >> 32) & 0xFFFF) + 1, ((row[10] >> 48) & 0x7FFF) + (((row[10] >> 24) & 0x7F) << 15),
                         (row[10] >> 23) & 1] + list(row[11:])
            for row in table]


#: the decoded agreement rows' column of `kernels.auto_backend_code` (what backend "auto" resolves to on the
#: rank), sent by `prepare_splitkv_metadata` and the call without `metadata=`
_AUTO_COL = 15
#: that column's entry of a rank whose call passes an explicit backend (the call without `metadata=`): not in
#: "auto"'s agreement
_NO_AUTO = -1


def _auto_entry(backend, device, dtype, head_dim, config: SplitKVConfig | None = None) -> int:
    """This rank's entry of the agreement rows' "auto" column (`_check_auto_agree`): `kernels.auto_backend_code`
    for (device, dtype, head_dim) when its calls pass backend "auto" (and dtype is known), else `_NO_AUTO` (an
    explicit kernel takes no part in the check). ValueError naming backend unless it is "auto" or a name of
    `kernels.BACKENDS`."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    return auto_backend_code(device, dtype, head_dim, config) if backend == "auto" and dtype is not None else _NO_AUTO


def _check_auto_agree(name, table, col=_AUTO_COL):
    """Raise the same ValueError on every rank when backend "auto" resolves to different kernels across the
    group (table column `col`: `kernels.auto_backend_code` of each rank; a negative entry, `_NO_AUTO`: that
    rank does not call with "auto" and is left out), naming the kernels and the ranks: each rank would
    otherwise run its own kernel (FA4 where installed on a Hopper GPU, flex elsewhere) or raise alone. Decided
    from the gathered table only, so every rank decides the same whatever its own backend."""
    by_kernel: dict = {}
    for r, row in enumerate(table):
        if row[col] >= 0:
            by_kernel.setdefault(auto_backend_text(row[col]), []).append(r)
    if len(by_kernel) > 1:
        got = "; ".join(f"{k!r} on CP rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}"
                        for k, rs in by_kernel.items())
        raise ValueError(
            f"{name}: kernel backend 'auto' must resolve to the same kernel on every CP rank (same dtype and head dim); "
            f"it resolves to {got}. Make the same kernels available on every rank (FlashAttention-4 on a Hopper "
            "GPU, cuDNN), or pass SplitKVConfig(auto_fa4=False) (no fa4) and staircase_auto_min_keys=0 "
            "(no staircase) on every rank")


def resolve_num_chunks(num_chunks, cp_size: int, max_blocks: int, config: SplitKVConfig | None = None) -> int:
    """The number of query chunks Split-KV pipelines over (perf-notes item 2).

    Args:
        num_chunks: None (automatic: `config.num_chunks` when set, else DEFAULT_NUM_CHUNKS = 1), 0
            (automatic without looking at the config), or a positive int (clamped to [1, max(max_blocks, 1)] so every chunk holds at
            least one block of the largest rank). Any `__index__` integer (np.int64 too); bool and
            float are rejected.
        cp_size: P. max_blocks: max(n_blocks), the per-rank padded block count (head chunks: Hkv, the
            limit of `chunk_axis="heads"`). config: `SplitKVConfig` (None: the defaults).

    Raises:
        ValueError: num_chunks not a positive int.
    """
    try:  # 0 (any integer type): automatic; everything else is checked by _requested_chunks
        zero = num_chunks is not None and as_int(num_chunks, "num_chunks", minimum=0) == 0
    except ValueError:
        zero = False
    req = 0 if zero else _requested_chunks(num_chunks, config)
    if req == 0:
        req = DEFAULT_NUM_CHUNKS
    return max(1, min(req, max_blocks))


def chunk_bounds(num_chunks: int, max_blocks: int) -> list:
    """[(b0, b1)] per chunk: chunk c covers blocks [c * max_blocks // k, (c + 1) * max_blocks // k) of
    every rank's padded segment (sizes differ by at most one block; equal when k divides max_blocks)."""
    return [(c * max_blocks // num_chunks, (c + 1) * max_blocks // num_chunks) for c in range(num_chunks)]


@dataclass(eq=False)
class SplitKVMetadata:
    """Mask metadata of one CP rank for one training step, shared by every layer's op call.

    Build it with `prepare_splitkv_metadata` (public) or let an op build one internally. Treat it as
    read-only; it holds no activations. Tensors live on `device`.

    Attributes:
        impl: canonical op name it was prepared for: "splitkv", "allgather_kv" or "ring_kv".
        group: the resolved CP group (`comm.CommGroup`).
        block_size: B.
        num_heads_q, num_heads_kv, head_dim, dtype, device: what every call's tensors must have
            (agreed across the group at prepare time; dtype/device per rank: device may differ by rank).
        n_blocks, n_ctx: per-rank query block counts and context token counts (lists of P ints, the size
            table of the one tiny all-gather; identical on every rank).
        q_seq, q_anchor: [n_blocks_local] int64 (q_seq is 0 on invalid blocks, anchor < 0 = invalid).
        kv_seq, kv_pos: [Tk_local] int64.
        valid: [n_blocks_local] bool, q_anchor >= 0.
        keys: sorted (sequence, position) keys, int64: this rank's context (splitkv, ring_kv) or the whole
            gathered context (allgather_kv).
        order: splitkv / ring_kv: [Tk_local] int64 permutation with keys = keys_unsorted[order], or None
            when the local context is already sorted (no copy is made then).
        block_meta: splitkv: [P * max(n_blocks), 2] int64 gathered (sequence id, anchor) of every block,
            padded per rank with (-1, -1) (invalid).
        gather_index: allgather_kv: [sum(n_ctx)] int64, sorted position -> row of the padded all-gathered
            context (rank r's token i is row r * max(n_ctx) + i).
        valid_rows: [Tq_local] bool, `valid` per query row (zeroes invalid blocks' own keys).
        num_chunks, chunks: splitkv: the resolved chunk count k (see `resolve_num_chunks`) and the
            per-rank block range (b0, b1) of each chunk (`chunk_bounds`; other impls: 1 and None).
        chunk_masks, chunk_masks_own: splitkv: lists of k `IntervalMask` (their lo / hi / lo2 / hi2 are
            rows of one table, views of it at P = 1), chunk c = the blocks
            [b0, b1) of every rank's gathered segment (P * (b1 - b0) blocks, rank order) against this
            rank's sorted keys; `_own` adds this rank's own blocks as second intervals over the keys
            [sorted context ; padding ; k_blk] (`ops.common.with_own_blocks`; used when k_blk is given).
        mask, mask_own: allgather_kv: this rank's blocks against all sorted keys (and + own block);
            ring_kv: against this rank's own shard (step 0 of the ring; + own block); splitkv: None.
        step_masks: ring_kv: list of P `IntervalMask`, step s = the shard of group rank (rank - s) mod P
            against this rank's blocks (step 0 is `mask`; None when built internally by a call without
            `metadata=`: the keys then travel around the ring with K/V, as before).
        num_chunks_requested: the requested chunk count (0 = automatic), agreed across the group.
        chunk_axis: splitkv: "rows" (chunk c = query blocks [b0, b1) of every rank, all heads) or "heads"
            (chunk c = the q heads `chunk_heads[c]` of ALL rows: `chunks` = [(0, nb_max)] * k, k clamped to
            [1, Hkv], the k = 1 masks repeated, the same `IntervalMask` objects), agreed across the group
            (`resolve_chunk_axis`; ops/splitkv.py item 3, "Head chunks"). Other impls: "rows".
        chunk_heads: splitkv: per chunk the q-head range (h0, h1): rows: (0, Hq) each; heads: kv heads
            [g0, g1) = `chunk_bounds(k, Hkv)`[c] and q heads [g0 * G, g1 * G), G = Hq // Hkv (GQA groups
            whole). Other impls: None.
        cp_ranks_per_node: splitkv: L, the CP ranks per node of the two-level all-to-all
            (`resolve_ranks_per_node`, agreed across the group; other impls: 1).
        node_groups: splitkv with 1 < L < P: (intra, inter) `comm.CommGroup`s, this rank's node (the L
            CP ranks [n * L, (n + 1) * L), rank j = rank % L) and the N = P / L ranks with its local
            index j (rank n); built once per (CP group, L) by `comm.node_groups`. None: the single
            all-to-all over the CP group.
        group_check: when True (the default of the builders) every call with this metadata exchanges its
            verdict row (one [1, 12] int64 all-gather and a host sync: `check_call`) so that a mismatched
            tensor, call mode, softmax_scale or metadata on one rank raises on EVERY rank.
        check_group: None (the verdict rows go over `group`, on its device), or the `comm.CommGroup` of a
            gloo process group with the CP group's ranks in its order (`prepare_splitkv_metadata(...,
            check_group=)` / `bind(..., check_group=)`): every verdict row of the calls is then exchanged
            over it as a CPU tensor (no device tensor, no CUDA stream, no device sync).
        config: the `SplitKVConfig` of the calls (with the keyword arguments of the prepare applied): the
            kernels' options and the "auto" rule's inputs come from it.
        window, causal: the layer type the masks are built for (`reference.check_attention_type`: None /
            False = the full DFlash mask; a sliding window W and / or causal own blocks): every mask then
            carries per-row bounds (`IntervalMask.has_rows`). A model mixing layer types prepares one
            metadata per distinct (window, causal) per step (`with_attention_type` derives one from another
            without a collective).

    The FlexAttention kernel caches its `BlockMask` on the masks (attribute
    `_flex_block_masks`), the math kernel its tile groups (`_math_groups`): built by the first layer's
    call, reused by the next ones.
    """

    impl: str
    group: CommGroup
    block_size: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    n_blocks: list
    n_ctx: list
    q_seq: torch.Tensor
    q_anchor: torch.Tensor
    kv_seq: torch.Tensor
    kv_pos: torch.Tensor
    valid: torch.Tensor = None
    keys: torch.Tensor = None
    order: torch.Tensor = None
    block_meta: torch.Tensor = None
    gather_index: torch.Tensor = None
    mask: IntervalMask = None
    mask_own: IntervalMask = None
    step_masks: list = None
    valid_rows: torch.Tensor = None
    num_chunks: int = 1
    chunks: list = None
    chunk_masks: list = None
    chunk_masks_own: list = None
    num_chunks_requested: int = 0
    chunk_axis: str = "rows"
    chunk_heads: list = None
    cp_ranks_per_node: int = 1
    node_groups: tuple = None
    group_check: bool = False
    check_group: CommGroup = None
    config: SplitKVConfig = field(default_factory=SplitKVConfig, repr=False)
    window: int = None
    causal: bool = False
    sources: tuple = field(default=(), repr=False)  # the caller's metadata tensors (identity checks)
    #: `prepare_splitkv_metadata_from_plan` only: the host-side build record (`_HostBuild`: CP size and
    #: rank of the plan, packed pinned buffer) until `bind` attaches the CP
    #: group; None for bound metadata (every metadata from `prepare_splitkv_metadata`).
    host_build: object = field(default=None, repr=False)

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __reduce_ex__(self, protocol):
        """Pickling: unbound metadata (`prepare_splitkv_metadata_from_plan`, the data pipeline's) and metadata
        of a single process pickle as before; metadata bound to a torch.distributed ProcessGroup (its CP group
        or the node sub-groups) raises TypeError saying so (a ProcessGroup cannot be pickled, and a group
        belongs to the process that made it): pickle the unbound metadata and `bind` it where it is loaded."""
        if self.host_build is None and (getattr(self.group, "pg", None) is not None or self.node_groups is not None
                                        or self.check_group is not None):
            raise TypeError("SplitKVMetadata bound to a CP process group cannot be pickled (it holds the "
                            "torch.distributed ProcessGroup): pickle the unbound metadata of "
                            "prepare_splitkv_metadata_from_plan (e.g. the data pipeline's PlannedBatch) and bind it "
                            "to the CP group in the process that loads it")
        return super().__reduce_ex__(protocol)

    @property
    def bound(self) -> bool:
        """False for the host-built metadata of `prepare_splitkv_metadata_from_plan` before `bind`: the ops
        refuse it (its `group` is a placeholder of the plan's CP size and rank)."""
        return self.host_build is None

    def pin_memory(self) -> "SplitKVMetadata":
        """Unbound metadata: a copy whose tensors are views of ONE pinned host buffer (packed, 16-byte
        aligned), so that `bind` uploads everything with a single non-blocking copy. The DataLoader's
        pin-memory thread calls it (`torch.utils.data` pins any object with a `pin_memory()` method), off
        the step's critical path. Bound metadata and already pinned metadata are returned as they are.
        Needs CUDA (torch pins through the CUDA host allocator)."""
        rec = self.host_build
        if rec is None or (rec.buffer is not None and rec.buffer.is_pinned()):
            return self
        tensors = _unique_tensors(self)
        buf, offs = _pack(tensors, pin=True)
        new = {id(t): _unpacked(buf, o, t) for t, o in zip(tensors, offs)}
        return _remapped(self, new, host_build=_replace(rec, buffer=buf, layout=offs))

    def with_attention_type(self, window=None, causal=False) -> "SplitKVMetadata":
        """This step's metadata for another layer type (a model mixing `sliding_attention` and `full_attention`
        drafter layers): a new `SplitKVMetadata` with the given window / causal and its masks rebuilt from the
        sorted keys and block metadata this one holds, with no collective and no host sync; equal, field for
        field, to what `prepare_splitkv_metadata(..., window=, causal=)` (or `prepare_splitkv_metadata_from_plan`)
        returns. Self when the type is already this one. Impls "splitkv" and "allgather_kv" (bound or not; an
        unbound one is re-packed by `bind`).

        Raises:
            ValueError: a bad window / causal (`reference.check_attention_type`); impl "ring_kv" (its per-step
                masks need the other ranks' keys: prepare ring_kv metadata per layer type)."""
        window, causal = check_attention_type(window, causal)
        if (window, causal) == (self.window, self.causal):
            return self
        if self.impl == "ring_kv":
            raise ValueError("SplitKVMetadata.with_attention_type: ring_kv metadata cannot be derived (its per-step "
                             "masks need the other ranks' keys); call prepare_splitkv_metadata(..., impl='ring_kv', "
                             "window=, causal=) per layer type")
        new = self.__copy__()
        new.window, new.causal = window, causal
        for n in [n for n in new.__dict__ if n.startswith("_")]:  # values cached from this one (verdict row, ...)
            del new.__dict__[n]
        if self.host_build is not None:  # a fresh pack on bind (the old buffer holds the old masks)
            new.host_build = _replace(self.host_build, buffer=None, layout=None)
        if self.impl == "splitkv":
            whole = _splitkv_chunk_masks(new, self.keys, int(self.keys.shape[0]), copies=self.host_build is not None)
            if whole is not None:
                whole.validate()
        else:
            nb_local = self.n_blocks[self.group.rank]
            new.mask = intervals(self.keys, self.q_seq, self.q_anchor, self.block_size, window)
            new.mask_own = with_own_blocks(new.mask, self.valid, nb_local, debug=self.config.debug_checks,
                                           window=window, causal=causal)
        return new

    def bind(self, cp_group=None, device=None, non_blocking: bool = True, check_group=None) -> "SplitKVMetadata":
        """Attach the CP group to host-built metadata (`prepare_splitkv_metadata_from_plan`) and move it to
        the device: returns a new, bound `SplitKVMetadata` for the op calls' `metadata=` (this one stays
        unbound and can be bound again). No collective except the first creation of the node sub-groups
        (cp_ranks_per_node L with 1 < L < P: `comm.node_groups`, once per (CP group, L), like prepare).

        Args:
            cp_group: the CP ProcessGroup (None = the default group when initialised, else one process).
                Its size must equal the plan's cp_size and this process's rank in it the `cp_rank` the
                metadata was built for.
            device: the activations' device; None = the group's default (the current CUDA device with an
                NCCL group, else CPU). With NCCL it must be a CUDA device.
            non_blocking: upload asynchronously (the default; from pinned memory, see `pin_memory`, or
                through a pinned staging buffer made here), so the host does not wait for the GPU.
            check_group: None, or a gloo process group with cp_group's ranks in cp_group's order: the calls'
                verdict rows go over it on the host (`prepare_splitkv_metadata`'s `check_group`).

        Device work: one host-to-device copy of the packed buffer on the current stream (every tensor,
        int64 / int32 / bool, is a 16-byte aligned view of it) and nothing else: no compute op, no host
        sync (from pinned memory). With `flex_block_masks` at build time the FlexAttention BlockMasks are
        assembled from the uploaded tables (Python objects, no device op) and cached on the bound masks.
        A CPU target keeps the host tensors (no copy).

        The options are the metadata's `config` (fixed at build time). Whether the configs agree ACROSS
        ranks is not checked here (no collective): `check_environment_agreement` once per process, or
        `group_check=True` at build time.

        Raises:
            ValueError("SplitKVMetadata.bind: ..."), on this rank only (no collective): already bound; a
            cp_group that is not a ProcessGroup (or None); the group's size or this rank's rank in it differ from the plan's cp_size / cp_rank; a device that
            is not usable here or not CUDA with NCCL; a check_group that is not a gloo group of cp_group's ranks.
        """
        name = "SplitKVMetadata.bind"
        rec = self.host_build
        if rec is None:
            raise ValueError(f"{name}: this metadata is already bound to a CP group (bind the unbound metadata "
                             "of prepare_splitkv_metadata_from_plan)")
        try:
            try:
                group = resolve_group(cp_group)
            except (AttributeError, TypeError) as exc:  # torch.distributed's error for a non-group object
                raise ValueError(f"cp_group must be a torch.distributed ProcessGroup or None, got "
                                 f"{type(cp_group).__name__} ({exc})") from exc
            if group.size != rec.cp_size:
                raise ValueError(f"cp_group has size {group.size} but the metadata was built for a plan with "
                                 f"cp_size={rec.cp_size}")
            if group.rank != rec.cp_rank:
                raise ValueError(f"this process is rank {group.rank} of cp_group but the metadata was built for "
                                 f"cp_rank={rec.cp_rank}")
            check = resolve_check_group(check_group, group)
            device = _check_device(_comm_device(group, None) if device is None else device)
            if _comm_device(group, device).type != device.type:
                raise ValueError(f"device must be the activations' CUDA device with an NCCL group, got {device}")
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        tensors = _unique_tensors(self)
        if all(t.device == device for t in tensors) or (
                device.type == "cpu" and all(t.device.type == "cpu" for t in tensors)):
            new = {id(t): t for t in tensors}  # already there (e.g. `PlannedBatch.to(device)`): no copy, no view
        else:
            new = _uploaded(tensors, device, non_blocking, rec.buffer, rec.layout)
        ngroups = None
        if 1 < self.cp_ranks_per_node < group.size:  # the two-level all-to-all's sub-groups (cached)
            ngroups = node_groups(group, self.cp_ranks_per_node, _comm_device(group, device))
        return _remapped(self, new, block_masks=True, group=group, device=device, node_groups=ngroups,
                         check_group=check, host_build=None)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def hkv(self) -> int:
        return self.num_heads_kv

    @property
    def tq_local(self) -> int:
        """Tq_local = n_blocks[rank] * block_size, the query rows this rank must pass."""
        return self.n_blocks[self.group.rank] * self.block_size

    @property
    def tk_local(self) -> int:
        """Tk_local = n_ctx[rank], the context tokens this rank must pass."""
        return self.n_ctx[self.group.rank]


@dataclass
class Plan:
    """One op call: the step's metadata plus what may change per call (scale, kernel)."""

    name: str
    meta: SplitKVMetadata
    scale: float
    kernel: object
    acc: torch.dtype

    group = property(lambda self: self.meta.group)
    rank = property(lambda self: self.meta.group.rank)
    block_size = property(lambda self: self.meta.block_size)
    n_blocks = property(lambda self: self.meta.n_blocks)
    n_ctx = property(lambda self: self.meta.n_ctx)
    hkv = property(lambda self: self.meta.num_heads_kv)
    valid = property(lambda self: self.meta.valid)
    valid_rows = property(lambda self: self.meta.valid_rows)
    q_seq = property(lambda self: self.meta.q_seq)
    q_anchor = property(lambda self: self.meta.q_anchor)


# ----------------------------------------------------------------------------- group-wide verdicts


def _comm_device(group: CommGroup, device) -> torch.device:
    import torch.distributed as dist

    device = torch.device(device) if device is not None else torch.device("cpu")
    if group.size > 1 and dist.get_backend(group.pg) == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_device(device, what: str = "device") -> torch.device:
    """`device` as a torch.device this rank can allocate on, a CUDA device without an index ("cuda") made the
    current one ("cuda:<torch.cuda.current_device()>", the device tensors created with "cuda" land on, so that
    the per-call device check compares equal); ValueError naming `what` otherwise (not a device, the meta
    device, CUDA missing or an index beyond this rank's GPUs). Host-side only."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{what} must be a torch.device or a device string, got {device!r}") from exc
    if not _usable_device(dev):
        raise ValueError(f"{what}={dev} cannot hold the metadata on this rank (" + (
            "the meta device has no data" if dev.type == "meta" else
            f"{torch.cuda.device_count()} CUDA device(s) available") + ")")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _usable_device(dev: torch.device) -> bool:
    if dev.type == "meta":
        return False
    if dev.type == "cuda":
        return torch.cuda.is_available() and (dev.index is None or 0 <= dev.index < torch.cuda.device_count())
    return True


def _verdict_device(group: CommGroup, device, err: str) -> torch.device:
    """The device of a group verdict's all-gather (`_raise_if_any`): `_comm_device(group, device)`, except
    on a rank that failed locally with a device it cannot use for the exchange (not a device, meta, CUDA
    missing): there the group's default (CPU with gloo, the current CUDA device with NCCL), so that its
    error reaches every rank instead of failing in the exchange on that rank alone (the others would hang)."""
    try:
        dev = _comm_device(group, device)
    except (RuntimeError, TypeError, ValueError):
        return _comm_device(group, None)
    return _comm_device(group, None) if err and not _usable_device(dev) else dev


def resolve_check_group(check_group, group: CommGroup) -> CommGroup | None:
    """The group of the verdict rows besides the CP group `group`: None for None (the rows go over `group`),
    else `check_group` as a `comm.CommGroup` after checking that it is a torch.distributed ProcessGroup with a
    gloo (CPU) backend whose global ranks are the CP group's, in the CP group's rank order (so that row r of
    an all-gather over it is CP rank r's). Local check (no collective): a bad check_group raises on every
    rank where it is bad, so pass it on every rank of the CP group or on none (like cp_group).

    Raises:
        ValueError naming check_group and what differs (not a ProcessGroup; backend without gloo; its ranks)."""
    if check_group is None:
        return None
    import torch.distributed as dist

    if not isinstance(check_group, dist.ProcessGroup) and check_group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"check_group must hold the CP group's global ranks; this rank ({dist.get_rank()}) is not "
                         "in it (torch.distributed.new_group's non-member placeholder)")
    if not isinstance(check_group, dist.ProcessGroup):
        raise ValueError(f"check_group must be None or a torch.distributed ProcessGroup (gloo), got "
                         f"{type(check_group).__name__}")
    backend = str(dist.get_backend(check_group))
    if "gloo" not in backend.lower():
        raise ValueError(f"check_group must be a gloo process group (its rows are CPU tensors), got backend "
                         f"{backend!r}: create it with torch.distributed.new_group(ranks, backend='gloo')")
    ranks = dist.get_process_group_ranks(check_group)
    want = [group.global_rank(r) for r in range(group.size)]
    if list(ranks) != want:
        raise ValueError(f"check_group must hold the CP group's global ranks in its rank order, {want}; got "
                         f"{list(ranks)}")
    return CommGroup(check_group, len(want), group.rank)


def _verdict_route(group: CommGroup, check: CommGroup | None, device) -> tuple:
    """(group, device) of a verdict row's exchange (`_raise_if_any`): the check group on the CPU when there is
    one (no device tensor, no stream, no device sync), else the CP group on `device`."""
    return (group, device) if check is None else (check, torch.device("cpu"))


def _raise_if_any(name: str, group: CommGroup, err: str, row: list, dev, tag: str):
    """All-gather [len(err) or -1] + row (int64) over the group; if any rank reported an error, gather
    the messages and raise the same ValueError on every rank (ImportError when every reported error is
    an ImportError: a kernel backend missing there). Returns the table (list of P rows)."""
    msg = err.encode()[:_MAX_MSG]
    head = [len(msg) if err else -1] + list(row)
    if group.size == 1:
        # a single rank's table is its own row: no device tensor, no host sync (comm_stats still records
        # the collective, of nothing: a meta tensor has no data)
        all_gather(torch.empty(1, len(head), dtype=torch.int64, device="meta"), group, tag)
        table = [head]
    else:
        table = all_gather(_device_row(head, dev)[None], group, tag).tolist()
    bad = [r for r in range(group.size) if table[r][0] >= 0]
    if bad:
        width = max(max(table[r][0] for r in bad), 1)
        buf = torch.zeros(1, width, dtype=torch.uint8, device=dev)
        if msg:
            buf[0, : len(msg)] = torch.tensor(list(msg), dtype=torch.uint8)
        texts = all_gather(buf, group, tag).cpu().tolist()
        by_msg: dict = {}
        for r in bad:
            by_msg.setdefault(bytes(texts[r][: table[r][0]]).decode(errors="replace"), []).append(r)
        parts = [f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {m}" for m, rs in by_msg.items()]
        # a backend missing on some rank(s) stays an ImportError (on every rank), anything else ValueError
        cls = ImportError if all(m.startswith("ImportError: ") for m in by_msg) else ValueError
        raise cls(f"{name}: invalid input on CP rank(s) {bad}: " + "; ".join(parts))
    return table


def _device_row(values: list, dev) -> torch.Tensor:
    """An int64 row of host ints on `dev`. On CUDA through pinned memory with a non-blocking copy: a copy
    from pageable memory would synchronise the host with the GPU (PyTorch waits for the stream)."""
    dev = torch.device(dev)
    if dev.type == "cuda":
        return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(dev, non_blocking=True)
    return torch.tensor(values, dtype=torch.int64, device=dev)


class _HostReads:
    """Device values the host needs at the end of a prepare (the deferred range check, the "already
    sorted" test, the mask contract), read with ONE `.tolist()`, i.e. one host sync instead of one each.

    `add(tensors, use)`: 0-dim or 1-D tensors (bool or integer) and a callable that gets their values
    (a flat list of ints) and raises when they say so; `read()` runs the callables in the order added."""

    def __init__(self):
        self._parts, self._uses = [], []

    def add(self, tensors, use):
        tensors = [t.reshape(-1) for t in tensors]
        self._parts += tensors
        self._uses.append((sum(int(t.numel()) for t in tensors), use))

    def read(self):
        if not self._parts:
            return
        values = torch.cat(self._parts).tolist()  # bools promote to int64: one tensor, one sync
        self._parts = []
        at = 0
        for n, use in self._uses:
            use(values[at:at + n])
            at += n
        self._uses = []


class _RangeCheck:
    """The int32 range check of the metadata tensors (sequence ids and positions in [-2**31, 2**31)):
    min and max of each non-empty tensor computed on its device, checked on the host by `check` (one
    host sync) or later with other values through `_HostReads` (`defer`)."""

    def __init__(self, named):
        self.names = [n for n, _ in named]
        self.parts = [b for _, t in named for b in torch.aminmax(t)]  # min, max per tensor (0-dim)

    def check(self):
        if self.parts:
            self.raise_if_bad(torch.stack(self.parts).tolist())

    def raise_if_bad(self, values, prefix=""):
        for i, n in enumerate(self.names):
            lo, hi = values[2 * i], values[2 * i + 1]
            if lo < -_INT32 or hi >= _INT32:
                raise ValueError(f"{prefix}{n} values must lie in [-2**31, 2**31), got range [{lo}, {hi}]")

    def defer(self, reads: _HostReads, name: str):
        """Read the bounds with the other host values of the prepare (`reads`); a violation then raises
        ValueError("<name>: ..."), as the immediate check does in a size-1 group."""
        if self.parts:
            reads.add(self.parts, lambda v: self.raise_if_bad(v, f"{name}: "))

    def raise_first(self, name: str):
        """On another local error of a size-1 group: the range check comes first (as when it was not
        deferred), so raise its ValueError("<name>: ...") if it fails."""
        try:
            self.check()
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc


def _local_error(exc: Exception) -> str:
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def _check_agree(name, table, cols):
    """cols: (column index, description); raise when a column differs across ranks."""
    for col, what in cols:
        vals = [row[col] for row in table]
        if len(set(vals)) > 1:
            odd = [r for r, v in enumerate(vals) if v != vals[0]]
            ranks = (f"; CP rank{'s' * (len(odd) > 1)} {', '.join(map(str, odd))} "
                     f"differ{'s' * (len(odd) == 1)} from rank 0")
            if what == "dtype":
                vals = [str(SUPPORTED_DTYPES[v]) for v in vals]
            if what == "impl":
                inv = {v: k for k, v in _IMPL_CODE.items()}
                vals = [inv.get(v, v) for v in vals]
            if what.startswith("softmax_scale"):
                vals = [struct.unpack("<d", struct.pack("<q", v))[0] for v in vals]
            if what == "group_check":
                vals = [bool(v) for v in vals]
            if what == "window / causal":
                vals = [_kind_text(v) for v in vals]
            if what.startswith(("chunk_axis", "SplitKVConfig.chunk_axis")):
                vals = [CHUNK_AXES[v] if 0 <= v < len(CHUNK_AXES) else v for v in vals]
            if what.startswith("metadata="):
                modes = set(vals)
                vals = [_MODE_NAMES.get(v, str(v)) for v in vals]
                if modes <= {_MODE_PLAIN, _MODE_METADATA}:
                    raise ValueError(
                        f"{name}: every rank of the CP group must call the op the same way, all with "
                        f"metadata= or all without; got {vals} (by rank){ranks}")
                raise ValueError(
                    f"{name}: every rank of the CP group must call the op the same way: all with "
                    "splitkv_start_query_gather + splitkv_attention(..., query_gather=) or all without "
                    f"(and all with metadata= or all without); got {vals} (by rank){ranks}")
            raise ValueError(f"{name}: {what} must be the same on every CP rank; got {vals} (by rank){ranks}"
                             + (_AUTO_PIPELINE_HINT if any(w in what for w in _PIPELINE_WORDS) else ""))


#: the agreement names the Megatron integration may have set automatically (megatron.arguments.auto_pipeline /
#: auto_cp_ranks_per_node), and what to check then
_PIPELINE_WORDS = ("num_chunks", "chunk_axis", "cp_ranks_per_node")
_AUTO_PIPELINE_HINT = (" (under Megatron, unset ones are chosen from the launcher's processes per node: check that "
                       "LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE are the same on every node, or set "
                       "--splitkv-num-chunks / --splitkv-chunk-axis / --splitkv-cp-ranks-per-node)")


# ----------------------------------------------------------------------------- local checks


def check_block_size(block_size) -> int:
    """block_size (B, tokens per draft block) as an int >= 1: any `__index__` integer (np.int64(16) too).

    Raises:
        ValueError: a bool, float, string or other non-integer, or a value < 1 ("block_size must be a
            positive int, got ...")."""
    return as_int(block_size, "block_size", minimum=1)


def check_heads_dtype(num_heads_q, num_heads_kv, head_dim, dtype):
    """The metadata's head counts Hq, Hkv and head_dim D (each an `__index__` integer >= 1, bool and
    float rejected; Hq % Hkv == 0) and dtype (bf16/fp16/fp32/fp64).

    Returns:
        (num_heads_q, num_heads_kv, head_dim) as Python ints.

    Raises:
        ValueError: naming the argument and its limit."""
    num_heads_q, num_heads_kv, head_dim = (as_int(v, n, minimum=1) for n, v in (
        ("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv), ("head_dim", head_dim)))
    if num_heads_q % num_heads_kv:
        raise ValueError(f"Hq % Hkv != 0: num_heads_q={num_heads_q}, num_heads_kv={num_heads_kv}; "
                         "Hq must be a multiple of Hkv")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of bf16/fp16/fp32/fp64, got {dtype!r}")
    return num_heads_q, num_heads_kv, head_dim


def check_scale_backend(softmax_scale, backend):
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be None or a positive finite number, got {softmax_scale!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_metadata_tensors(q_seq, q_anchor, kv_seq, kv_pos, nb, tk, device):
    """Metadata tensors: 1-D integer of lengths nb, nb, tk, tk (nb/tk None: taken from q_seq/kv_seq);
    returns them as int64 on `device` (q_seq zeroed on invalid blocks). Includes the int32 range check
    (one host sync)."""
    q_seq, q_anchor, kv_seq, kv_pos, _, rng = _metadata_ints(q_seq, q_anchor, kv_seq, kv_pos, nb, tk, device)
    rng.check()
    return q_seq, q_anchor, kv_seq, kv_pos


def _metadata_ints(q_seq, q_anchor, kv_seq, kv_pos, nb, tk, device):
    """`check_metadata_tensors` without the host sync: (q_seq, q_anchor, kv_seq, kv_pos, valid, range
    check), valid = q_anchor >= 0, the `_RangeCheck` not yet read (its `check` or `defer`)."""
    def length_of(t):
        return int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() == 1 else -1

    nb = length_of(q_seq) if nb is None else nb
    tk = length_of(kv_seq) if tk is None else tk
    meta = []
    for n, t, length in (("q_seq", q_seq, nb), ("q_anchor", q_anchor, nb), ("kv_seq", kv_seq, tk),
                         ("kv_pos", kv_pos, tk)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != length:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            need = f" of length {length}" if length >= 0 else ""
            raise ValueError(f"{n} must be a 1-D integer tensor{need}, got {shape}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{n} must have an integer dtype (int64), got {t.dtype}")
        if t.dtype == _UINT64:  # values >= 2**63 would wrap to negative int64 and pass the range check
            raise ValueError(f"{n} must have a signed integer dtype (int64), got {t.dtype}")
        if t.device.type == "meta":
            raise ValueError(f"{n} must hold data, got a tensor on the meta device")
        meta.append(t.to(device=device, dtype=torch.int64))
    q_seq, q_anchor, kv_seq, kv_pos = meta
    valid = q_anchor >= 0
    q_seq = torch.where(valid, q_seq, 0)
    rng = _RangeCheck([(n, t) for n, t in (("q_seq", q_seq), ("kv_seq", kv_seq), ("kv_pos", kv_pos)) if t.numel()])
    return q_seq, q_anchor, kv_seq, kv_pos, valid, rng


def check_own_block(k_blk, v_blk):
    """k_blk and v_blk are both given or both None (no own-block part). Returns True when given."""
    if (k_blk is None) != (v_blk is None):
        raise ValueError("k_blk and v_blk must both be tensors or both be None (no own-block part), got "
                         f"k_blk {type(k_blk).__name__}, v_blk {type(v_blk).__name__}")
    return k_blk is not None


def _check_tensors(q, k_ctx, v_ctx, k_blk, v_blk, block_size):
    """Shapes/dtypes/devices of the five activations (no metadata given; k_blk = v_blk = None allowed).
    Returns (nb, tk, hq, hkv, d, block_size), block_size as a Python int (`check_block_size`)."""
    names = ("q", "k_ctx", "v_ctx") + (("k_blk", "v_blk") if check_own_block(k_blk, v_blk) else ())
    tensors = (q, k_ctx, v_ctx, k_blk, v_blk)[: len(names)]
    for n, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{n} must be a 3-D tensor [tokens, heads, head_dim], got {shape}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype must be one of bf16/fp16/fp32/fp64, got {q.dtype}")
    if q.device.type == "meta":
        raise ValueError("q.device must hold data, got the meta device")
    for n, t in zip(names[1:], tensors[1:]):
        if t.dtype != q.dtype:
            raise ValueError(f"{n}.dtype ({t.dtype}) must equal q.dtype ({q.dtype})")
        if t.device != q.device:
            raise ValueError(f"{n}.device ({t.device}) must equal q.device ({q.device})")
    tq, hq, d = q.shape
    tk, hkv, dk = k_ctx.shape
    if hkv < 1 or dk != d:
        raise ValueError(f"k_ctx.shape {tuple(k_ctx.shape)} must be [Tk_local, Hkv >= 1, D={d}]")
    if tuple(v_ctx.shape) != tuple(k_ctx.shape):
        raise ValueError(f"v_ctx.shape {tuple(v_ctx.shape)} must equal k_ctx.shape {tuple(k_ctx.shape)}")
    for n, t in zip(names[3:], tensors[3:]):
        if tuple(t.shape) != (tq, hkv, d):
            raise ValueError(f"{n}.shape {tuple(t.shape)} must be [Tq_local={tq}, Hkv={hkv}, D={d}]")
    if hq % hkv:
        raise ValueError(
            f"Hq % Hkv != 0: q has Hq={hq} heads and k_ctx Hkv={hkv}; Hq must be a multiple of Hkv"
        )
    block_size = check_block_size(block_size)
    if tq % block_size:
        raise ValueError(f"block_size={block_size} must divide q.shape[0] (Tq_local={tq})")
    return tq // block_size, tk, hq, hkv, d, block_size


# ----------------------------------------------------------------------------- building


def _finish(meta: SplitKVMetadata, gather_ctx: bool, reads: _HostReads | None = None) -> SplitKVMetadata:
    """Collectives and derived tensors of the metadata (sizes already agreed group-wide). Validates the
    own-block masks against the union contract (`IntervalMask.validate`, at metadata time). splitkv: the
    host reads its values with one `.tolist()` at the end (`_HostReads`: `reads` from the caller, e.g.
    a deferred range check, first), the baselines keep one host sync per read."""
    g, bsz, name = meta.group, meta.block_size, meta.impl
    if meta.valid is None:
        meta.valid = meta.q_anchor >= 0
    meta.valid_rows = meta.valid.repeat_interleave(bsz)
    nb_local = meta.n_blocks[g.rank]
    if name == "splitkv":
        _finish_splitkv(meta, reads if reads is not None else _HostReads())
    elif name == "allgather_kv":
        tk_max = max(meta.n_ctx)
        keys_all = all_gather(pad_rows(context_keys(meta.kv_seq, meta.kv_pos), tk_max), g,
                              "allgather_kv.fwd.kv_meta")
        dev = meta.kv_seq.device
        real = torch.cat([torch.arange(n, device=dev) + r * tk_max for r, n in enumerate(meta.n_ctx)])
        meta.keys, order = sort_keys(keys_all[real])
        meta.gather_index = real if order is None else real[order]
        meta.mask = intervals(meta.keys, meta.q_seq, meta.q_anchor, bsz, meta.window)
        meta.mask_own = with_own_blocks(meta.mask, meta.valid, nb_local, debug=meta.config.debug_checks,
                                        window=meta.window, causal=meta.causal)
    else:  # ring_kv
        meta.keys, meta.order = sort_keys(context_keys(meta.kv_seq, meta.kv_pos))
        meta.mask = intervals(meta.keys, meta.q_seq, meta.q_anchor, bsz, meta.window)  # step 0: the own shard
        meta.mask_own = with_own_blocks(meta.mask, meta.valid, nb_local, debug=meta.config.debug_checks,
                                        window=meta.window, causal=meta.causal)
        if gather_ctx:
            tk_max = max(meta.n_ctx)
            keys_all = all_gather(pad_rows(meta.keys, tk_max), g, "ring_kv.ctx_meta")
            masks = [meta.mask]
            for step in range(1, g.size):
                src = (g.rank - step) % g.size
                keys = keys_all[src * tk_max: src * tk_max + meta.n_ctx[src]]
                masks.append(intervals(keys, meta.q_seq, meta.q_anchor, bsz, meta.window))
            meta.step_masks = masks
    return meta


def _finish_splitkv(meta: SplitKVMetadata, reads: _HostReads) -> None:
    """Split-KV's part of `_finish`: context keys and their sort, the gathered block metadata and the
    chunks' interval masks (`_splitkv_chunk_masks`: the same values as the per-chunk `ops.common.intervals`
    and `with_own_blocks`, tests/test_prepare_cost.py), with ONE host sync (`reads`). With `config.debug_checks`
    (tests; off by default: the masks are correct by construction) the union contract is checked once on
    the whole table (`IntervalMask.validate_flags`: a chunk's blocks are a subset, so every chunk passes
    when the table does); only if the table fails are the chunks validated one by one, raising as before."""
    g = meta.group
    # context keys (seq, pos) -> seq * 2**32 + pos + 2**31 (`ops.common.context_keys`), sorted
    # unconditionally: whether they already were is read with the other values at the end
    keys = torch.add(meta.kv_pos + _INT32, meta.kv_seq, alpha=1 << 32)
    n_keys = int(keys.shape[0])
    if n_keys > 1:
        in_order = (keys[1:] >= keys[:-1]).all()
        sorted_keys, order = torch.sort(keys, stable=True)

        def use_order(v):  # `ops.common.sort_keys`: the keys themselves and no order when sorted
            meta.keys, meta.order = (keys, None) if v[0] else (sorted_keys, order)

        reads.add([in_order], use_order)
    else:
        sorted_keys = meta.keys = keys
    nb_max = max(meta.n_blocks)
    bmeta = torch.stack([meta.q_seq, meta.q_anchor], 1)
    meta.block_meta = all_gather(pad_rows(bmeta, nb_max, -1), g, "splitkv.fwd.block_meta")
    if 1 < meta.cp_ranks_per_node < g.size:  # the two-level all-to-all's sub-groups (cached)
        meta.node_groups = node_groups(g, meta.cp_ranks_per_node, _comm_device(g, meta.device))
    whole = _splitkv_chunk_masks(meta, sorted_keys, n_keys, copies=False)

    def check_masks(v):
        if any(v):  # some chunk may violate the contract: validate them in order, raising as before
            for m in meta.chunk_masks_own:
                m.validate()

    if whole is not None:  # config.debug_checks: the masks are correct by construction; re-checked (and by the tests)
        reads.add(whole.validate_flags(), check_masks)
    reads.read()


def _splitkv_chunk_masks(meta: SplitKVMetadata, sorted_keys: torch.Tensor, n_keys: int, copies: bool):
    """The chunks and their interval masks from the sorted context keys and the gathered block metadata
    (`meta.block_meta`, [P * nb_max, 2]), on their device: sets meta.num_chunks, chunks, chunk_masks and
    chunk_masks_own. Shared by `_finish_splitkv` (device) and `_host_finish_splitkv` (host).

    The intervals of every gathered block are computed at once into a [4, P, nb_max] table (rows lo, hi,
    lo2, hi2; block j of rank r in column (r, j)); chunk c's masks are its columns [b0, b1) of every rank
    (a view of the table where the columns are contiguous, else one copy; `copies`: always a copy of their
    own). Returns the whole table as one own-block IntervalMask when `config.debug_checks` (for the union
    contract check), else None."""
    g, bsz = meta.group, meta.block_size
    P, nb_local, nb_max = g.size, meta.n_blocks[g.rank], max(meta.n_blocks)
    heads = meta.chunk_axis == "heads"
    # head chunks: k clamped to [1, Hkv], every chunk all rows (the k = 1 chunk), its heads GQA groups whole
    meta.num_chunks = resolve_num_chunks(meta.num_chunks_requested, P, meta.num_heads_kv if heads else nb_max)
    hq, grp = meta.num_heads_q, meta.num_heads_q // meta.num_heads_kv
    if heads:
        meta.chunks = [(0, nb_max)] * meta.num_chunks
        meta.chunk_heads = [(g0 * grp, g1 * grp) for g0, g1 in chunk_bounds(meta.num_chunks, meta.num_heads_kv)]
    else:
        meta.chunks = chunk_bounds(meta.num_chunks, nb_max)
        meta.chunk_heads = [(0, hq)] * meta.num_chunks
    dev = meta.q_seq.device
    table = torch.empty(4, P * nb_max, dtype=torch.int64, device=dev)
    # first intervals (`ops.common.intervals`): block b sees the keys of sequence seq[b] with position <
    # anchor[b]; anchor < 0 (invalid, padding rows) the empty [lo, lo). Sequence ids may be negative
    # (padding rows carry anchor -1, so they get an empty interval whatever their sequence id)
    seq, anchor = meta.block_meta[:, 0], meta.block_meta[:, 1]
    base = seq * (1 << 32)
    torch.searchsorted(sorted_keys, base, out=table[0])
    hi = torch.searchsorted(sorted_keys, base + (anchor.clamp(0, _INT32) + (_INT32 - 1)), right=True)
    torch.where(anchor >= 0, hi, table[0], out=table[1])
    # second intervals (`ops.common.with_own_blocks`): this rank's block i sees own keys [c0 + i B,
    # c0 + (i + 1) B) when valid, every other block (other ranks', padding, invalid) the empty [c0, c0)
    c0 = own_key_start(n_keys)
    if P > 1 or nb_local < nb_max:
        table[2:].fill_(c0)
    if nb_local:
        own = table[2:].view(2, P, nb_max)[:, g.rank, :nb_local]
        edges = torch.arange(0, (nb_local + 1) * bsz, bsz, dtype=torch.int64, device=dev)  # i B, i <= nb_local
        torch.mul(edges.unfold(0, nb_local, 1), meta.valid, out=own)  # valid * i B ; valid * (i + 1) B
        own.add_(c0)
    num_keys_own = c0 + nb_local * bsz
    # windowed / causal layers: per-row bounds [3, P * nb_max, B] (row_lo, row_lo2, row_hi2; rows of absent
    # kinds stay unused), the block lo the union of its rows (`ops.common.window_rows`, `own_rows`)
    win, causal = getattr(meta, "window", None), getattr(meta, "causal", False)
    rows_t = None
    if win is not None or causal:
        rows_t = torch.empty(3, P * nb_max, bsz, dtype=torch.int64, device=dev)
        if win is not None:
            rows_t[0] = window_rows(sorted_keys, base, anchor, table[0], table[1], bsz, win)
            table[0].copy_(rows_t[0, :, 0])
        own_lo, own_hi = own_rows(table[2], table[3], bsz, win, causal)
        rows_t[1], rows_t[2] = own_lo.view(-1, bsz), own_hi.view(-1, bsz)
    meta.chunk_masks, meta.chunk_masks_own = [], []
    by_rank = table.view(4, P, nb_max)
    for b0, b1 in meta.chunks[:1] if heads else meta.chunks:
        cols = by_rank[:, :, b0:b1].reshape(4, -1)
        lo, hi, lo2, hi2 = cols.clone() if copies else cols
        row_lo = row_lo2 = row_hi2 = None
        if rows_t is not None:
            rcols = rows_t.view(3, P, nb_max, bsz)[:, :, b0:b1].reshape(3, -1)
            rcols = rcols.clone() if copies else rcols
            row_lo = rcols[0] if win is not None else None
            row_lo2, row_hi2 = rcols[1], rcols[2]
        meta.chunk_masks.append(IntervalMask(bsz, lo, hi, n_keys, row_lo=row_lo))
        meta.chunk_masks_own.append(IntervalMask(bsz, lo, hi, num_keys_own, lo2, hi2, num_ctx_keys=c0,
                                                 row_lo=row_lo, row_lo2=row_lo2, row_hi2=row_hi2))
    if heads:  # the one-call masks, the SAME objects for every head chunk (a kernel's cached tables built once)
        meta.chunk_masks *= meta.num_chunks
        meta.chunk_masks_own *= meta.num_chunks
    if not meta.config.debug_checks:
        return None
    return IntervalMask(bsz, table[0], table[1], num_keys_own, table[2], table[3], num_ctx_keys=c0)



def _checked_requests(impl, num_chunks, cp_ranks_per_node, cp_size, chunk_axis=None,
                      config: SplitKVConfig | None = None) -> tuple:
    """(chunks, ranks per node, chunk-axis code) requested for the agreement row of `impl`.

    Checked for every impl: a malformed num_chunks / cp_ranks_per_node / chunk_axis is a ValueError
    naming it and the limit whatever the impl. Used by splitkv only: the baselines get (0, 1,
    0) (one chunk, L = 1, rows); "must divide P" is about the
    two-level exchange they do not run, so they check cp_ranks_per_node's form only."""
    config = resolve_config(config)
    chunks_req = _requested_chunks(num_chunks, config)
    axis_req = _requested_axis(chunk_axis, config)
    if impl == "splitkv":
        return chunks_req, resolve_ranks_per_node(cp_ranks_per_node, cp_size, config), axis_req
    as_int(cp_ranks_per_node, "cp_ranks_per_node", minimum=1, allow_none=True)
    return 0, 1, 0


def prepare_splitkv_metadata(q_seq, q_anchor, kv_seq, kv_pos, *, block_size, num_heads_q, num_heads_kv,
                             head_dim, dtype, cp_group=None, impl="splitkv", device=None,
                             group_check=True, num_chunks=None, cp_ranks_per_node=None,
                             chunk_axis=None, head_split=None,
                             backend="auto", config: SplitKVConfig | None = None,
                             check_group=None, window=None, causal=False) -> SplitKVMetadata:
    """Prepare the mask metadata of one training step once, for every layer's op call (`metadata=`).

    Call it on every rank of the CP group (it is collective), once per step / micro-batch, after the
    data sharding and before the first drafter layer; pass the result as `metadata=` to
    `splitkv_attention` / `allgather_kv_attention` / `ring_kv_attention` (the one named by `impl`) in
    every layer. Every rank must then call each layer's op the same way: all ranks with `metadata=` or
    all without, with the same softmax_scale. With `group_check=True` (the default) a violation on one rank
    (a tensor that does not fit the metadata, some ranks without `metadata=`, a different softmax_scale,
    metadata of another step) raises the same ValueError on every rank, naming the rank and the field;
    with `group_check=False` the call has no verdict exchange and such a violation fails on one rank while
    the others hang or abort in the data collectives. Example (5 drafter layers, one step):

        meta = prepare_splitkv_metadata(q_seq, q_anchor, kv_seq, kv_pos, block_size=16,
                                        num_heads_q=32, num_heads_kv=8, head_dim=128,
                                        dtype=torch.bfloat16, cp_group=cp_group, impl="splitkv")
        for layer in layers:
            out = splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, None, None, None, None,
                                    metadata=meta)   # softmax_scale=, backend=, return_lse= as usual

    Args:
        q_seq, q_anchor: [n_blocks_local] integer (int64) sequence id and anchor per local query block
            (anchor < 0: invalid padding block). Same meaning as in `splitkv_attention`.
        kv_seq, kv_pos: [Tk_local] integer (int64) sequence id and global position per local context
            token, in the order the context K/V rows will be passed. Values in [-2**31, 2**31).
        block_size: B (query rows per block); every call passes Tq_local = n_blocks_local * B rows.
        num_heads_q, num_heads_kv, head_dim: Hq, Hkv, D of every call's tensors (Hq % Hkv == 0).
        dtype: dtype of every call's five tensors (bf16, fp16, fp32, fp64).
        cp_group: the CP ProcessGroup (None = default group if initialised, else single process).
        impl: which op will use it: "splitkv", "allgather_kv" / "allgather-kv", "ring_kv" / "ring-kv".
        device: device of the calls' tensors; default q_seq's device. The metadata is moved there.
        group_check: make every call exchange its verdict row group-wide (one [1, 12] int64 all-gather
            and a host sync per call, docs/usage.md "One wrong rank") so that a mismatch on one rank
            raises on all ranks; default True. False: no per-call exchange, a mismatch on one rank hangs
            the others.
        num_chunks: used by impl "splitkv" only (the baselines check it, then ignore it): how many query
            chunks the op pipelines its merge over (perf-notes item 2; see `resolve_num_chunks`): None =
            `config.num_chunks`, else 1 (2 pays off on slow
            inter-node links: docs/perf-notes.md); a positive int is clamped to [1, max(max(n_blocks), 1)].
            Must be the same on every rank. One `IntervalMask` (and FlexAttention BlockMask) per chunk.
        cp_ranks_per_node: used by impl "splitkv" only (the baselines check that it is None or a positive
            int, then ignore it): L, the CP ranks per node of the two-level
            all-to-all of the forward merge and the dQ exchange (`resolve_ranks_per_node`): None =
            `config.cp_ranks_per_node` (clamped to P), else 1; a positive int
            dividing P. 1 or P: the single all-to-all (bit-identical to before the option);
            1 < L < P: node n = CP ranks [n * L, (n + 1) * L) (L consecutive CP ranks must share a node);
            its two sub-groups are created here on first use (`comm.node_groups`, cached per (CP group,
            L); a collective over the CP group). Must be the same on every rank.
        chunk_axis: impl "splitkv" only: what the `num_chunks` chunks split (ops/splitkv.py item 3, "Head
            chunks"; docs/perf-notes.md item 21): "rows" (query blocks of every rank, all heads) or "heads"
            (every chunk ALL rows with Hq / k query heads and Hkv / k kv heads, GQA groups whole; k clamped to
            [1, Hkv], uneven splits allowed: Hkv 8, k 3 -> 2 / 3 / 3 kv heads); None = `config.chunk_axis`
            (default "rows"). Must be the same on every
            rank (agreed like num_chunks). Same results up to fp rounding, same bytes per collective name.
        head_split: must be None (uneven head splits are deleted: a ValueError naming chunk_axis="heads" with
            num_chunks=k, the even head chunks).
        backend: the kernel the calls will pass ("auto", the default, or a name of `kernels.BACKENDS`). With
            "auto" this rank's resolution (`kernels.auto_backend_code`) is compared with the other "auto"
            ranks' (mixed hardware: FA4 on some ranks only raises the same ValueError everywhere); an explicit
            kernel takes no part in that check. The metadata does not depend on it.
        config: `SplitKVConfig` (None: `SplitKVConfig()`): the options of the op and its kernels; the keyword
            arguments above override its fields. The metadata carries the result (`SplitKVMetadata.config`).
        check_group: None, or a gloo ProcessGroup with the CP group's ranks in its order (e.g.
            `torch.distributed.new_group(cp_ranks, backend="gloo")`, created on every rank):
            this prepare's first exchange ("<impl>.meta") and every verdict row of the calls with this
            metadata ("<impl>.check") then go over it as CPU tensors: no device tensor, no CUDA stream, no
            wait for the GPU (docs/lab/agreement_cost.md). Give it on every rank or on none, and to the
            calls without `metadata=` of the same layers (their first exchange must meet this one).
            ValueError naming check_group (`resolve_check_group`), raised where it is bad.
        window, causal: the layer type of the calls (`reference.dflash_attention_mask`; z-lab's dflash
            semantics): None / False = the full DFlash mask; window W >= 1: row j of block b sees context
            positions > anchor + j - W only, and own-block keys i with j - i < W (and i - j < W unless
            causal); causal: own-block keys i <= j only. The masks carry per-row bounds then. Must be the
            same on every rank (ValueError naming window on every rank for a bad value, "window / causal"
            with each rank's values when they differ; compared again by `group_check` calls).

    Returns:
        `SplitKVMetadata` (see there): validated int64 metadata, the per-rank size table, the gathered
        block metadata (splitkv) or gathered context keys (allgather_kv, ring_kv), the sort order and the
        `IntervalMask`(s) whose FlexAttention BlockMask is cached on first use.

    Collectives (recorded by `comm_stats`): "<impl>.meta" (a [1, 12] int64 all-gather of sizes, the
    requested chunk count and cp_ranks_per_node, and the error flag), then "splitkv.fwd.block_meta" (2 int64 per block),
    "allgather_kv.fwd.kv_meta" or "ring_kv.ctx_meta" (one int64 per context token). Host syncs, impl
    "splitkv": ONE in a size-1 group (the range check, the "already sorted" test and the own-block masks'
    contract are read together at the end; the size table of one rank needs no device tensor), three
    at P > 1 (the range check before the size table's all-gather, so that a bad value raises on every
    rank; the size table; the rest at the end); the baselines: the range check, the size table (P > 1),
    the "already sorted" test and the own-block mask validation (docs/perf-notes.md "Prepare cost (item
    13)").

    Raises:
        ValueError, with the same message on every rank of the group: window not None or an int >= 1 or causal
        not a bool on any rank ("window must be None or a positive int (the sliding window W >= 1), got 0"),
        bad metadata tensors on any rank
        (not 1-D integer, uint64, on the meta device, lengths of q_seq/q_anchor or kv_seq/kv_pos differing,
        values out of range), a `device` that is not a device or cannot be used on that rank (meta, CUDA
        missing or an index beyond its GPUs),
        bad block_size / head counts / head_dim / dtype / impl, config not a SplitKVConfig, Hq % Hkv != 0,
        num_chunks not a positive int, cp_ranks_per_node (or the config's) not a positive int or (splitkv) not
        dividing the CP group size P ("cp_ranks_per_node=3 must divide the CP group size P=4 ..."),
        chunk_axis not "rows" / "heads" (these for every impl:
        the baselines ignore valid values only), or block_size, Hq, Hkv, D, dtype, impl, group_check, the
        requested num_chunks, chunk_axis, cp_ranks_per_node or window / causal differing across ranks; kernel
        backend "auto" resolving to different kernels across ranks (`kernels.auto_backend_code`: e.g. FA4 on a
        Hopper GPU on some ranks only; checked on the ranks that pass backend="auto", the default: a rank
        whose calls use an explicit backend passes it and sends no "auto" code); backend not a known kernel
        name (`kernels.BACKENDS`); and
        when the node sub-groups cannot be created consistently (see `comm.node_groups`).

    Source: arXiv 2611.05926 (Split-KV), DESIGN.md section 2.
    """
    group = resolve_group(cp_group)
    canon = IMPLS.get(impl) if isinstance(impl, str) else None
    name = "prepare_splitkv_metadata"  # the same on every rank, even if impl differs
    try:
        check = resolve_check_group(check_group, group)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    if device is None:
        device = q_seq.device if isinstance(q_seq, torch.Tensor) else torch.device("cpu")
    err, row, ints, rng, reads, cfg = "", [-1] * 11, None, None, _HostReads(), None
    try:
        cfg = resolve_config(config)
        device = _check_device(device)  # a bad device on one rank raises on every rank (not only there)
        if canon is None:
            raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
        block_size = check_block_size(block_size)
        window, causal = check_attention_type(window, causal)
        num_heads_q, num_heads_kv, head_dim = check_heads_dtype(num_heads_q, num_heads_kv, head_dim, dtype)
        if _comm_device(group, device).type != device.type:
            raise ValueError(f"device must be the activations' CUDA device with an NCCL group, got {device}")
        *ints, rng = _metadata_ints(q_seq, q_anchor, kv_seq, kv_pos, None, None, device)
        if group.size == 1 and canon == "splitkv":
            rng.defer(reads, name)  # read with the metadata's other host values: one sync per prepare
        else:
            rng.check()
        nb, tk = int(ints[0].shape[0]), int(ints[2].shape[0])
        chunks_req, ranks_req, axis_req = _checked_requests(
            canon, num_chunks, cp_ranks_per_node, group.size, chunk_axis, config=cfg)
        _requested_head_split(head_split)
        cfg = _with_requests(cfg, num_chunks, chunk_axis, cp_ranks_per_node)
        row = [nb, tk, block_size, num_heads_q, num_heads_kv, head_dim, _DTYPE_CODE[dtype], _IMPL_CODE[canon],
               int(bool(group_check)), _request_code(chunks_req, ranks_req, axis_req, window, causal),
               _auto_entry(backend, device, dtype, head_dim, cfg)]
    except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank, never hang
        if group.size == 1:
            if rng is not None:  # a deferred range check still comes first
                rng.raise_first(name)
            raise ValueError(f"{name}: {_local_error(exc)}") from exc
        err = _local_error(exc)
    tag = f"{canon or 'splitkv'}.meta"
    via, dev = _verdict_route(group, check, _verdict_device(group, device, err))
    table = _decoded(_raise_if_any(name, via, err, row, dev, tag))
    _check_agree(name, table, ((3, "block_size"), (4, "Hq (num_heads_q)"), (5, "Hkv (num_heads_kv)"),
                               (6, "head dim D (head_dim)"), (7, "dtype"), (8, "impl"), (9, "group_check"),
                               (11, "num_chunks (requested)"), (14, "chunk_axis"),
                               (12, "cp_ranks_per_node"), (13, "window / causal")))
    _check_auto_agree(name, table)
    meta = SplitKVMetadata(
        impl=canon, group=group, block_size=block_size, num_heads_q=num_heads_q, num_heads_kv=num_heads_kv,
        head_dim=head_dim, dtype=dtype, device=device, n_blocks=[r[1] for r in table],
        n_ctx=[r[2] for r in table], q_seq=ints[0], q_anchor=ints[1], kv_seq=ints[2], kv_pos=ints[3],
        valid=ints[4], group_check=bool(group_check), check_group=check,
        sources=(q_seq, q_anchor, kv_seq, kv_pos),
        num_chunks_requested=table[0][11], cp_ranks_per_node=table[0][12],
        chunk_axis=CHUNK_AXES[table[0][14]], config=cfg, window=window, causal=causal,
    )
    return _finish(meta, gather_ctx=True, reads=reads)


def _with_requests(config: SplitKVConfig, num_chunks, chunk_axis, cp_ranks_per_node) -> SplitKVConfig:
    """`config` with the op's keyword arguments that were given (validated before) applied: what the
    metadata carries."""
    return config.replace(num_chunks=num_chunks, chunk_axis=chunk_axis, cp_ranks_per_node=cp_ranks_per_node)


# ----------------------------------------------------------------------------- per call


def _resolve_kernel(name, backend, device, dtype, head_dim, keys_per_call=None, config: SplitKVConfig | None = None,
                    window=None, causal=False):
    """The local kernel for this call, its dtype and head dim checked (`check_dtype`, when the kernel has
    one: the same rule as the kernel's forward / backward, so a refusal happens here, on every rank).
    keys_per_call: the group-wide context-key count that lets backend "auto" pick the staircase kernel
    (`kernels.auto_keys_per_call` of the agreed size table; None: "auto" = flex / math as before).

    window / causal: the layer type; a windowed or causal layer needs a kernel with per-row bounds
    (`row_intervals`: math, flex, fa4): "auto" picks among those, an explicit other backend raises.

    Raises:
        ImportError: the backend is not installed on this rank. ValueError: the kernel does not take
            this dtype / head dim on this device, or (window / causal) per-row bounds."""
    rows = window is not None or causal
    kernel = get_kernel(backend, device, dtype, head_dim=head_dim, keys_per_call=keys_per_call, config=config,
                        row_intervals=rows)
    if rows and not getattr(kernel, "row_intervals", False):
        raise ValueError(f"{name}: backend {backend!r} does not support sliding-window / causal layers "
                         f"(window={window!r}, causal={causal!r}); use 'auto', 'math', 'flex' or 'fa4'")
    warn_ignored_options(kernel, backend, device, dtype, head_dim, config)
    check_dtype = getattr(kernel, "check_dtype", None)
    if check_dtype is not None:  # before any data collective: the dtype is agreed, so every rank raises
        try:
            check_dtype(dtype, device, head_dim=head_dim)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
    return kernel


def _call_plan(meta: SplitKVMetadata, name, softmax_scale, backend) -> Plan:
    d = meta.head_dim
    scale = _resolved_scale(softmax_scale, d)
    keys = meta.__dict__.get("_auto_keys")  # derived from the agreed size table only: once per metadata
    if keys is None:
        keys = meta.__dict__["_auto_keys"] = auto_keys_per_call(meta.impl, meta.n_ctx)
    kernel = _resolve_kernel(name, backend, meta.device, meta.dtype, d, keys_per_call=keys, config=meta.config,
                             window=getattr(meta, "window", None), causal=getattr(meta, "causal", False))
    return Plan(name=name, meta=meta, scale=scale, kernel=kernel, acc=acc_dtype(meta.dtype))


def _prepare_from_tensors(name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos, *,
                          block_size, cp_group, softmax_scale, backend, num_chunks=None,
                          cp_ranks_per_node=None, chunk_axis=None, config: SplitKVConfig | None = None,
                          check_group=None, window=None, causal=False) -> Plan:
    """No `metadata=`: validate tensors and metadata on this rank, all-gather (error flag, sizes) once
    (op name "<op>.meta", [1, 12] int64: sizes, resolved softmax_scale, call mode, requested chunk
    count, cp_ranks_per_node and the layer type window / causal; over `check_group` on the CPU when given,
    `resolve_check_group`), raise the same ValueError on every rank when any rank is invalid or block_size /
    Hq / Hkv / D / dtype / softmax_scale / num_chunks / cp_ranks_per_node / window / causal differ, then build
    the metadata internally."""
    group = resolve_group(cp_group)
    try:
        check = resolve_check_group(check_group, group)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    err, row, ints, rng, reads, cfg = "", [-1] * 8 + [_MODE_PLAIN, -1, -1], None, None, _HostReads(), None
    try:
        cfg = resolve_config(config)
        nb, tk, hq, hkv, d, block_size = _check_tensors(q, k_ctx, v_ctx, k_blk, v_blk, block_size)
        window, causal = check_attention_type(window, causal)
        check_scale_backend(softmax_scale, backend)
        *ints, rng = _metadata_ints(q_seq, q_anchor, kv_seq, kv_pos, nb, tk, q.device)
        if group.size == 1 and name == "splitkv":
            rng.defer(reads, name)  # read with the metadata's other host values: one sync
        else:
            rng.check()
        chunks_req, ranks_req, axis_req = _checked_requests(
            name, num_chunks, cp_ranks_per_node, group.size, chunk_axis, config=cfg)
        cfg = _with_requests(cfg, num_chunks, chunk_axis, cp_ranks_per_node)
        row = [nb, tk, block_size, hq, hkv, d, _DTYPE_CODE[q.dtype], _scale_bits(_resolved_scale(softmax_scale, d)),
               _MODE_PLAIN, _request_code(chunks_req, ranks_req, axis_req, window, causal),
               # only where this rank uses "auto": the check below runs on EVERY rank (from the table), so a
               # group mixing "auto" and explicit backends raises everywhere or nowhere, never on some only
               _auto_entry(backend, q.device, q.dtype, d, cfg)]
        # the kernel too, before the first collective: a backend missing (or refusing the dtype) on SOME
        # ranks must raise on every rank, not leave the others waiting in the data collectives
        _resolve_kernel(name, backend, q.device, q.dtype, d, config=cfg, window=window, causal=causal)
    except ImportError as exc:  # kept an ImportError on every rank (`_raise_if_any`)
        if group.size == 1:
            if rng is not None:  # a deferred range check still comes first
                rng.raise_first(name)
            raise
        err = _local_error(exc)
    except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank, never hang
        if group.size == 1:
            if rng is not None:
                rng.raise_first(name)
            raise ValueError(f"{name}: {_local_error(exc)}") from exc
        err = _local_error(exc)
    via, dev = _verdict_route(group, check, _verdict_device(group, q.device if isinstance(q, torch.Tensor) else None,
                                                            err))
    table = _decoded(_raise_if_any(name, via, err, row, dev, f"{name}.meta"))
    _check_agree(name, table, _CALL_AGREE)
    _check_auto_agree(name, table)  # over the ranks that call with "auto" (the others sent _NO_AUTO)
    meta = SplitKVMetadata(
        impl=name, group=group, block_size=row[2], num_heads_q=row[3], num_heads_kv=row[4],
        head_dim=row[5], dtype=q.dtype, device=q.device, n_blocks=[r[1] for r in table],
        n_ctx=[r[2] for r in table], q_seq=ints[0], q_anchor=ints[1], kv_seq=ints[2], kv_pos=ints[3],
        valid=ints[4], num_chunks_requested=table[0][11], cp_ranks_per_node=table[0][12],
        chunk_axis=CHUNK_AXES[table[0][14]], config=cfg, window=window, causal=causal,
    )
    return _call_plan(_finish(meta, gather_ctx=False, reads=reads), name, softmax_scale, backend)


#: columns of the per-call agreement row (no `metadata=`, or `metadata=` with group_check): both paths
#: all-gather the same [1, 12] int64 row (as their first collective), so a group mixing them is detected.
#: 11-14 are decoded from column 10 (`_decoded`; 13: the layer type, `_kind_code`).
_CALL_AGREE = ((9, "metadata= use"), (3, "block_size"), (4, "Hq (q.shape[1])"), (5, "Hkv (k_ctx.shape[1])"),
               (6, "head dim D (q.shape[2])"), (7, "dtype"), (8, "softmax_scale (resolved)"),
               (11, "num_chunks (requested)"), (14, "chunk_axis"), (12, "cp_ranks_per_node"),
               (13, "window / causal"))


#: what the digest column of a `metadata=` call's verdict row covers (named when it differs across ranks)
_DIGEST_FIELD = ("metadata (its impl, per-rank size table n_blocks / n_ctx, config digest and layer type window / "
                 "causal: metadata of another step, micro-batch, layer type or CP group?)")


def metadata_digest(meta: SplitKVMetadata) -> int:
    """A 56-bit digest (a non-negative int) of what a `metadata=` call's collectives depend on beyond the
    verdict row's own columns: the impl and the per-rank size table (n_blocks, n_ctx). Equal on every rank
    of a group whose ranks hold metadata of the same prepare; compared by `check_call` so that metadata of
    a different step on one rank raises on every rank instead of mismatching the collectives' sizes. Metadata
    that carries a configuration object (a `config` attribute with `digest()`, e.g. `SplitKVConfig`) adds its
    digest: the one place where the call's agreement takes in the configuration as data. A windowed or causal
    layer type (`SplitKVMetadata.window` / `causal`) is part of it too."""
    config = getattr(meta, "config", None)
    kind = (getattr(meta, "window", None), getattr(meta, "causal", False))
    text = repr((meta.impl, tuple(int(n) for n in meta.n_blocks), tuple(int(n) for n in meta.n_ctx),
                 None if config is None else config.digest()) + ((kind,) if kind != (None, False) else ()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _metadata_row(meta: SplitKVMetadata, scale_bits: int, mode: int) -> list:
    """The verdict row of a `metadata=` call (or `splitkv_start_query_gather`) on a rank without a local error:
    this rank's sizes, B, Hq, Hkv, D, dtype, `scale_bits`, `mode`, the chunking requests with the layer type
    (`_request_code`) and `metadata_digest`
    (in the column where the other rows hold the "auto" kernel: "auto" was agreed at prepare). Everything but
    `scale_bits` and `mode` depends on the metadata alone (fixed once prepared): computed on its first call and
    kept on it (the digest alone took ~0.5 ms per call on a loaded 2-core CPU; docs/lab/agreement_cost.md)."""
    fixed = meta.__dict__.get("_verdict_fixed")
    if fixed is None:
        fixed = meta.__dict__["_verdict_fixed"] = (
            [meta.tq_local // meta.block_size, meta.tk_local, meta.block_size, meta.num_heads_q, meta.num_heads_kv,
             meta.head_dim, _DTYPE_CODE[meta.dtype]],
            [_request_code(meta.num_chunks_requested, meta.cp_ranks_per_node, CHUNK_AXES.index(meta.chunk_axis),
                           getattr(meta, "window", None),
                           getattr(meta, "causal", False)),
             metadata_digest(meta)])
    return fixed[0] + [scale_bits, mode] + fixed[1]


def _check_call_local(meta, name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                      block_size, cp_group, softmax_scale, backend, num_chunks=None, query_gather=None,
                      cp_ranks_per_node=None, chunk_axis=None, config=None, check_group=None, window=None,
                      causal=False):
    if query_gather is not None:  # splitkv only; the handle checks q, the metadata and its own state
        check = getattr(query_gather, "_check_consume", None)
        if check is None:
            raise ValueError("query_gather must be the SplitKVQueryGather returned by "
                             f"splitkv_start_query_gather, got {type(query_gather).__name__}")
        check(meta, q)
    if not isinstance(meta, SplitKVMetadata):
        raise ValueError(f"metadata must be a SplitKVMetadata from prepare_splitkv_metadata, got "
                         f"{type(meta).__name__}")
    if not meta.bound:
        raise ValueError(_UNBOUND_MSG)
    if meta.impl != name:
        raise ValueError(f"metadata was prepared for impl={meta.impl!r} but passed to {name}_attention; "
                         f"prepare it with impl={name!r}")
    for n, t, src in zip(("q_seq", "q_anchor", "kv_seq", "kv_pos"), (q_seq, q_anchor, kv_seq, kv_pos),
                         meta.sources or (None,) * 4):
        if t is not None and t is not src:
            raise ValueError(f"with metadata=, {n} must be None or the very tensor given to "
                             "prepare_splitkv_metadata (values are not re-checked per call)")
    if block_size is not None and check_block_size(block_size) != meta.block_size:
        raise ValueError(f"block_size={block_size!r} differs from the metadata's block_size={meta.block_size}")
    if cp_group is not None and cp_group is not meta.group.pg:
        raise ValueError("cp_group differs from the group the metadata was prepared with (pass None)")
    if check_group is not None and check_group is not getattr(meta.check_group, "pg", None):
        raise ValueError("check_group differs from the metadata's (given to prepare_splitkv_metadata / bind; "
                         "pass None)")
    kind = check_attention_type(window, causal)
    if kind != (getattr(meta, "window", None), getattr(meta, "causal", False)):
        raise ValueError(f"window={kind[0]!r}, causal={kind[1]!r} differ from the metadata's window="
                         f"{getattr(meta, 'window', None)!r}, causal={getattr(meta, 'causal', False)!r} (the mask "
                         "is fixed at prepare time: prepare one metadata per layer type)")
    # num_chunks: a positive int (bool, float, 0, ... raise) that resolves, i.e. clamps, to the metadata's
    # chunk count: the metadata's num_chunks or the value given to prepare_splitkv_metadata
    # (the limit: the largest block count, or Hkv for head chunks)
    limit = meta.num_heads_kv if meta.chunk_axis == "heads" else max(meta.n_blocks)
    if num_chunks is not None and max(1, min(_requested_chunks(num_chunks), limit)) != meta.num_chunks:
        raise ValueError(f"num_chunks={num_chunks!r} differs from the metadata's num_chunks={meta.num_chunks} "
                         "(the chunking is fixed at prepare time: pass num_chunks to prepare_splitkv_metadata)")
    if chunk_axis is not None and resolve_chunk_axis(chunk_axis) != meta.chunk_axis:
        raise ValueError(f"chunk_axis={chunk_axis!r} differs from the metadata's chunk_axis={meta.chunk_axis!r} "
                         "(fixed at prepare time: pass chunk_axis to prepare_splitkv_metadata)")
    # cp_ranks_per_node: None, or a valid value (raises otherwise) equal to the metadata's
    if cp_ranks_per_node is not None and \
            resolve_ranks_per_node(cp_ranks_per_node, meta.group.size) != meta.cp_ranks_per_node:
        raise ValueError(f"cp_ranks_per_node={cp_ranks_per_node!r} differs from the metadata's cp_ranks_per_node="
                         f"{meta.cp_ranks_per_node} (fixed at prepare time: pass cp_ranks_per_node to "
                         "prepare_splitkv_metadata)")
    check_prepared_config(config, meta.config)
    check_scale_backend(softmax_scale, backend)
    tq, tk, hq, hkv, d = meta.tq_local, meta.tk_local, meta.num_heads_q, meta.num_heads_kv, meta.head_dim
    expect = (("q", q, (tq, hq, d)), ("k_ctx", k_ctx, (tk, hkv, d)), ("v_ctx", v_ctx, (tk, hkv, d)))
    if check_own_block(k_blk, v_blk):
        expect += (("k_blk", k_blk, (tq, hkv, d)), ("v_blk", v_blk, (tq, hkv, d)))
    for n, t, shape in expect:
        _check_tensor_against(meta, n, t, shape)


#: the config fields a prepare's keyword arguments may have set: None in a call's config matches any value
_REQUEST_FIELDS = ("num_chunks", "chunk_axis", "cp_ranks_per_node")


def check_prepared_config(config, prepared: SplitKVConfig) -> None:
    """ValueError unless a call's `config` (with metadata=) is None or equals the metadata's `prepared` config
    (fields the prepare's keyword arguments set may be None in `config`), naming the first field that differs."""
    if config is None:
        return
    if not isinstance(config, SplitKVConfig):
        raise ValueError(f"config must be None or a SplitKVConfig, got {type(config).__name__}")
    for f in dataclasses.fields(SplitKVConfig):
        given, have = getattr(config, f.name), getattr(prepared, f.name)
        if given != have and not (f.name in _REQUEST_FIELDS and given is None):
            raise ValueError(f"config.{f.name}={given!r} differs from the metadata's {have!r} (the config is "
                             "fixed at prepare time: pass config=None or the config given to the prepare)")


def _check_tensor_against(meta, n, t, shape):
    """ValueError unless `t` (named `n`) is a tensor of `shape` with the metadata's dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{n} must be a tensor of shape {list(shape)}, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(
            f"{n}.shape {tuple(t.shape)} does not match the metadata: expected {list(shape)} on CP rank "
            f"{meta.rank} (Tq_local = n_blocks {meta.n_blocks[meta.rank]} x B {meta.block_size}, "
            f"Tk_local = {meta.tk_local}, Hq = {meta.num_heads_q}, Hkv = {meta.num_heads_kv}, D = {meta.head_dim})")
    if t.dtype != meta.dtype:
        raise ValueError(f"{n}.dtype {t.dtype} does not match the metadata's dtype {meta.dtype}")
    if t.device != meta.device:
        raise ValueError(f"{n}.device {t.device} does not match the metadata's device {meta.device}")


def check_call(meta, name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos, *, block_size,
               cp_group, softmax_scale, backend, num_chunks=None, query_gather=None,
               cp_ranks_per_node=None, chunk_axis=None, config: SplitKVConfig | None = None,
               check_group=None, window=None, causal=False) -> Plan:
    """Per-call validation with `metadata=`: Python comparisons of the tensors' shapes, dtypes and
    devices against the metadata, then (group_check, the default, at P > 1) the verdict row's all-gather,
    before any data collective of the call.

    Expected on CP rank r: q [n_blocks[r] * B, Hq, D]; k_ctx, v_ctx [n_ctx[r], Hkv, D]; k_blk, v_blk
    [n_blocks[r] * B, Hkv, D] or both None (no own-block part; the metadata does not depend on it);
    dtype and device as prepared; num_chunks None or a positive int that clamps to the metadata's
    (e.g. the value given to prepare); cp_ranks_per_node None or the metadata's; config None or the
    metadata's (`_check_config`: the metadata's config applies). Every rank checks against the same agreed
    size table. With `group_check=True` (the default) the verdict row (this rank's error, sizes, B, Hq, Hkv,
    D, dtype, resolved softmax_scale, call mode, the chunking requests, the layer type window / causal
    (`_request_code`) and `metadata_digest`; the same
    [1, 12] int64 shape as the first collective of a call without `metadata=`, of `prepare_splitkv_metadata`
    and of `raise_on_every_rank`) is all-gathered and every rank raises the same ValueError naming the rank
    and the field (ImportError when a kernel backend is missing there); over the metadata's `check_group`
    on the CPU when it has one, else over the CP group on its device. Without it the ValueError is raised
    on that rank only, and the other ranks block in the call's first data collective (until the process
    group's timeout).

    `query_gather` (splitkv only): the `SplitKVQueryGather` of `splitkv_start_query_gather`; q must be
    the very tensor given to it, unmodified, with the same metadata, and the gather not consumed yet
    (see `SplitKVQueryGather._check_consume`). With group_check its use is part of the exchanged row
    (call mode), so a group where only some ranks pass it raises on every rank.
    """
    err, plan = "", None
    grouped = isinstance(meta, SplitKVMetadata) and meta.bound and meta.group_check and meta.group.size > 1
    try:
        _check_call_local(meta, name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                          block_size, cp_group, softmax_scale, backend, num_chunks, query_gather,
                          cp_ranks_per_node, chunk_axis, config, check_group, window, causal)
        if grouped:  # the call's kernel: a backend missing on some ranks raises (ImportError) on every rank too
            plan = _call_plan(meta, name, softmax_scale, backend)
    except ImportError as exc:
        err = _local_error(exc)
    except ValueError as exc:
        if not grouped:
            raise ValueError(f"{name}: {exc}") from exc
        err = str(exc)
    if meta.group_check and meta.group.size > 1:
        # the same [1, 12] row layout as a call without metadata= ("<op>.meta"), so that a group
        # where some ranks pass metadata= (with group_check) and others do not raises everywhere
        mode = _MODE_METADATA if query_gather is None else _MODE_QUERY_GATHER
        row = [-1] * 8 + [mode, -1, -1] if err else \
            _metadata_row(meta, _scale_bits(_resolved_scale(softmax_scale, meta.head_dim)), mode)
        table = _metadata_verdict(name, meta, err, row, f"{name}.check")
        _check_rows_agree(name, table)
        return plan
    return _call_plan(meta, name, softmax_scale, backend)


def _metadata_verdict(name, meta, err, row, tag):
    """`_raise_if_any` of a call with `metadata=`: over its check group on the CPU when it has one, else over
    its CP group on the metadata's device."""
    if meta.check_group is not None:
        return _raise_if_any(name, meta.check_group, err, row, torch.device("cpu"), tag)
    return _raise_if_any(name, meta.group, err, row, _comm_device(meta.group, meta.device), tag)


def _check_rows_agree(name, table):
    """`_check_agree` of a `metadata=` call's verdict table (`_CALL_AGREE` and the metadata digest). Its
    columns from 3 on hold only what must agree (0: error, 1 and 2: the rank's sizes): equal ones agree."""
    if any(row[3:] != table[0][3:] for row in table[1:]):
        _check_agree(name, _decoded(table), _CALL_AGREE + ((_AUTO_COL, _DIGEST_FIELD),))


def check_query_gather_start(meta, q, name="splitkv_start_query_gather"):
    """Validation of `splitkv_start_query_gather(q, metadata=meta)` before its collectives: meta is a
    splitkv `SplitKVMetadata`, q a tensor of shape [Tq_local, Hq, D] with the metadata's dtype and device.
    Local ValueError (this rank only) unless the metadata has group_check, in which case the verdict
    and the call mode are all-gathered ("splitkv.check", the [1, 12] row of the op's checks) and every
    rank raises the same ValueError: also when other ranks make a different call at that point (e.g.
    the op without query_gather=)."""
    err = ""
    grouped = isinstance(meta, SplitKVMetadata) and meta.bound and meta.group_check and meta.group.size > 1
    try:
        if not isinstance(meta, SplitKVMetadata):
            raise ValueError(f"metadata must be a SplitKVMetadata from prepare_splitkv_metadata(..., "
                             f"impl='splitkv'), got {type(meta).__name__}")
        if not meta.bound:
            raise ValueError(_UNBOUND_MSG)
        if meta.impl != "splitkv":
            raise ValueError(f"metadata was prepared for impl={meta.impl!r}; the query gather is Split-KV's "
                             "(prepare it with impl='splitkv')")
        _check_tensor_against(meta, "q", q, (meta.tq_local, meta.num_heads_q, meta.head_dim))
    except ValueError as exc:
        if not grouped:
            raise ValueError(f"{name}: {exc}") from exc
        err = str(exc)
    if grouped:
        # softmax_scale is not known yet: 0 on every starting rank
        row = [-1] * 8 + [_MODE_GATHER_START, -1, -1] if err else _metadata_row(meta, 0, _MODE_GATHER_START)
        table = _metadata_verdict(name, meta, err, row, "splitkv.check")
        _check_rows_agree(name, table)


def raise_on_every_rank(name: str, cp_group, exc: Exception, device=None, check_group=None):
    """Raise `exc`, found on this rank before an op call, on EVERY rank of the CP group instead of this rank
    alone: join the other ranks' first collective of the call (every calling mode's first collective is the
    same [1, 12] int64 verdict row: "<op>.meta" of a call without `metadata=` or of `prepare_splitkv_metadata`,
    "<op>.check" of a `metadata=` call or of `splitkv_start_query_gather`) with this error, so every rank raises
    ValueError("<name>: invalid input on CP rank(s) [r]: rank r: <message>") (ImportError for an ImportError).
    `check_group`: the other ranks' verdict group (`prepare_splitkv_metadata`'s; the row goes over it on the
    CPU). One process: `exc` itself. Never returns."""
    group = resolve_group(cp_group)
    if group.size == 1:
        raise exc
    err = _local_error(exc)
    via, dev = _verdict_route(group, resolve_check_group(check_group, group), _verdict_device(group, device, err))
    _raise_if_any(name, via, err, [-1] * 11, dev, f"{name}.check")
    raise AssertionError("unreachable: the verdict row carried an error")


def run_op(fn_cls, name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos, *, block_size,
           cp_group, softmax_scale, backend, return_lse, metadata=None, num_chunks=None, query_gather=None,
           cp_ranks_per_node=None, chunk_axis=None, config: SplitKVConfig | None = None, check_group=None,
           window=None, causal=False):
    """Shared entry point of the three public ops: validate (or check against `metadata`), apply the
    autograd Function. `num_chunks`, `cp_ranks_per_node`, `chunk_axis`: splitkv only (the baselines pass None).
    `config`: the `SplitKVConfig` (None: the defaults; with metadata=, None or the metadata's).
    `check_group`: the gloo group of the verdict rows (`prepare_splitkv_metadata`; with metadata=, None or the
    metadata's).
    `window`, `causal`: the layer type (`reference.check_attention_type`; with metadata=, the metadata's).
    `query_gather`: splitkv only, needs `metadata`; the Function is then applied to the gathered query
    chunks of the handle (`ops.splitkv.SplitKVQueryGather`) instead of q."""
    if query_gather is not None and metadata is None:
        raise ValueError(f"{name}: query_gather= needs metadata= (the metadata given to "
                         "splitkv_start_query_gather; the chunking is fixed there)")
    if metadata is None:
        plan = _prepare_from_tensors(name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                                     block_size=block_size, cp_group=cp_group, softmax_scale=softmax_scale,
                                     backend=backend, num_chunks=num_chunks, cp_ranks_per_node=cp_ranks_per_node,
                                     chunk_axis=chunk_axis, config=config, check_group=check_group,
                                     window=window, causal=causal)
    else:
        plan = check_call(metadata, name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                          block_size=block_size, cp_group=cp_group, softmax_scale=softmax_scale,
                          backend=backend, num_chunks=num_chunks, query_gather=query_gather,
                          cp_ranks_per_node=cp_ranks_per_node, chunk_axis=chunk_axis, config=config,
                          check_group=check_group, window=window, causal=causal)
    if query_gather is None:
        out, lse = fn_cls.apply(plan, q, k_ctx, v_ctx, k_blk, v_blk)
    else:  # q itself is not an input: its gradient flows through the gather's own Function
        shared, gathered = query_gather._consume()
        out, lse = fn_cls.apply(plan, None, k_ctx, v_ctx, k_blk, v_blk, shared, *gathered)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- from the plan, on the host

_UNBOUND_MSG = ("metadata from prepare_splitkv_metadata_from_plan is not bound to a CP group yet: pass "
                "meta.bind(cp_group, device) (a new, bound SplitKVMetadata) as metadata=")


@dataclass
class _HostBuild:
    """What a host-built `SplitKVMetadata` carries until `SplitKVMetadata.bind`: the plan's CP size and
    this metadata's CP rank (checked against the group) and the packed host buffer of `pin_memory` (buffer: uint8, layout: the byte offset of every
    `_unique_tensors` entry)."""

    cp_size: int
    cp_rank: int
    buffer: torch.Tensor = None
    layout: list = None


def _replace(obj, **changes):
    import dataclasses  # noqa: PLC0415

    return dataclasses.replace(obj, **changes)


_META_TENSORS = ("q_seq", "q_anchor", "kv_seq", "kv_pos", "valid", "keys", "order", "block_meta", "gather_index",
                 "valid_rows")
_META_MASKS = ("mask", "mask_own")
_META_MASK_LISTS = ("step_masks", "chunk_masks", "chunk_masks_own")
_MASK_TENSORS = ("lo", "hi", "lo2", "hi2", "row_lo", "row_lo2", "row_hi2")


def _unique_masks(meta) -> list:
    seen = {}
    for n in _META_MASKS:
        m = getattr(meta, n)
        if m is not None:
            seen.setdefault(id(m), m)
    for n in _META_MASK_LISTS:
        for m in getattr(meta, n) or ():
            seen.setdefault(id(m), m)
    return list(seen.values())


def _unique_tensors(meta) -> list:
    """Every tensor of the metadata (its fields and its masks' lo / hi / lo2 / hi2), each object once, in
    a fixed order (the layout of `_pack`; shared objects, e.g. a chunk's lo in both of its masks, stay
    shared)."""
    seen = {}
    for n in _META_TENSORS:
        t = getattr(meta, n)
        if t is not None:
            seen.setdefault(id(t), t)
    for m in _unique_masks(meta):
        for a in _MASK_TENSORS:
            t = getattr(m, a)
            if t is not None:
                seen.setdefault(id(t), t)
        for key in sorted(m.__dict__.get(_FLEX_HOST, {})):
            rows, tables = m.__dict__[_FLEX_HOST][key]
            for t in (rows,) + tuple(tables):
                seen.setdefault(id(t), t)
    return list(seen.values())


#: byte alignment of every tensor in the packed upload buffer (inductor's assumed input alignment)
_PACK_ALIGN = 16


def _pack_layout(tensors):
    """(offsets, total bytes) of `_pack`'s buffer: each tensor's bytes at a 16-byte aligned offset."""
    offs, at = [], 0
    for t in tensors:
        offs.append(at)
        at += -(-t.numel() * t.element_size() // _PACK_ALIGN) * _PACK_ALIGN
    return offs, at


def _pack(tensors, pin: bool):
    """(buffer, offsets): the tensors' bytes in one uint8 buffer (pinned when `pin`), each at a 16-byte
    aligned offset (any dtype can be viewed there, and compiled kernels, e.g. inductor's flex graphs, see
    aligned inputs: a misaligned one would be copied per call), so that `_unpacked` views them back with
    their dtype and shape."""
    offs, at = _pack_layout(tensors)
    buf = torch.empty(at, dtype=torch.uint8, pin_memory=pin)
    for t, o in zip(tensors, offs):
        _unpacked(buf, o, t).copy_(t)
    return buf, offs


def _unpacked(buf, off, like):
    """The view of `buf` at byte offset `off` with like's dtype and shape (contiguous)."""
    n = like.numel() * like.element_size()
    return buf[off: off + n].view(like.dtype).view(like.shape)


def _uploaded(tensors, device, non_blocking: bool, buf=None, offs=None) -> dict:
    """{id(t): t's view on `device`} after ONE copy of the packed buffer: `buf` / `offs` when already packed
    (`pin_memory`), else packed here (pinned for a non-blocking CUDA copy)."""
    if buf is None:
        buf, offs = _pack(tensors, pin=non_blocking and device.type == "cuda")
    dev_buf = buf.to(device, non_blocking=non_blocking)
    return {id(t): _unpacked(dev_buf, o, t) for t, o in zip(tensors, offs)}


def _remapped(meta, new: dict, block_masks: bool = False, **changes):
    """A copy of `meta` whose tensors are new[id(old tensor)] (masks rebuilt around them, shared masks
    kept shared; caches on the old masks, e.g. a FlexAttention BlockMask, are not carried) with `changes`.
    Host-built FlexAttention tables (`_FLEX_HOST`) are carried, remapped; with `block_masks` they also
    become the new masks' cached BlockMasks (`kernels.flex.FlexAttentionKernel.block_mask`)."""
    masks = {}

    def mask(m):
        if m is None:
            return None
        if id(m) not in masks:
            t = {a: (None if getattr(m, a) is None else new[id(getattr(m, a))]) for a in _MASK_TENSORS}
            nm = IntervalMask(m.block_size, t["lo"], t["hi"], m.num_keys, t["lo2"], t["hi2"],
                              num_ctx_keys=m.num_ctx_keys, row_lo=t["row_lo"], row_lo2=t["row_lo2"],
                              row_hi2=t["row_hi2"])
            host = m.__dict__.get(_FLEX_HOST)
            if host:
                nm.__dict__[_FLEX_HOST] = {key: (new[id(rows)], tuple(new[id(x)] for x in tables))
                                           for key, (rows, tables) in host.items()}
                if block_masks:
                    nm.__dict__["_flex_block_masks"] = {key: _flex_block_mask(nm, key, *v)
                                                        for key, v in nm.__dict__[_FLEX_HOST].items()}
            masks[id(m)] = nm
        return masks[id(m)]

    fields = {n: (None if getattr(meta, n) is None else new[id(getattr(meta, n))]) for n in _META_TENSORS}
    fields.update({n: mask(getattr(meta, n)) for n in _META_MASKS})
    fields.update({n: (None if getattr(meta, n) is None else [mask(m) for m in getattr(meta, n)])
                   for n in _META_MASK_LISTS})
    fields["chunks"] = None if meta.chunks is None else list(meta.chunks)
    fields["chunk_heads"] = None if meta.chunk_heads is None else list(meta.chunk_heads)
    fields["n_blocks"], fields["n_ctx"] = list(meta.n_blocks), list(meta.n_ctx)
    fields.update(changes)
    return _replace(meta, **fields)


def _compile_split(entries) -> tuple:
    """The plan of `_apply_split` for `entries` = [(dtype, shape, byte offset)], each offset a multiple of its
    dtype's size, the entries not overlapping: per dtype (dtype, element sizes of the pieces between and at the
    entries, (entry index, piece index, shape or None when 1-D) per entry). Plain Python values (picklable,
    computed once per layout). Raises ValueError for a misaligned or overlapping entry."""
    groups: dict = {}
    for i, (dt, shape, off) in enumerate(entries):
        groups.setdefault(dt, []).append((int(off), i, tuple(int(d) for d in shape)))
    plan = []
    for dt, items in groups.items():
        size = dt.itemsize
        items.sort()
        sizes, picks, at = [], [], 0
        for off, i, shape in items:
            if off % size:
                raise ValueError(f"packed tensor at byte offset {off} is not aligned to its {dt} ({size} bytes)")
            start, n = off // size, math.prod(shape)
            if start < at:
                raise ValueError(f"packed {dt} tensors overlap at byte offset {off}")
            sizes += [start - at, n]
            picks.append((i, len(sizes) - 1, None if len(shape) == 1 else shape))
            at = start + n
        plan.append((dt, tuple(sizes), tuple(picks), at * size))
    return tuple(plan), len(entries)


def _apply_split(buf: torch.Tensor, compiled: tuple) -> list:
    """Views of the flat uint8 tensor `buf` (any device, no copy) by a `_compile_split` plan, in its entries'
    order: one `view(dtype)` + `split_with_sizes` per dtype (C calls), a reshape only for entries that are not
    1-D. Raises ValueError when `buf` is too short for the plan."""
    plan, n = compiled
    out = [None] * n
    nbytes = int(buf.numel())
    for dt, sizes, picks, end in plan:
        if end > nbytes:
            raise ValueError(f"packed {dt} tensors end at byte {end}, past the {nbytes}-byte buffer")
        parts = buf[:end].view(dt).split_with_sizes(sizes)
        for i, j, shape in picks:
            out[i] = parts[j] if shape is None else parts[j].view(shape)
    return out


def _split_views(buf: torch.Tensor, entries) -> list:
    """Views of the flat uint8 tensor `buf` (any device) at `entries` = [(dtype, shape, byte offset)]
    (`_compile_split` then `_apply_split`), in the entries' order. Raises ValueError when an entry is
    misaligned, overlaps another one or lies outside `buf`."""
    return _apply_split(buf, _compile_split(entries))


#: the dataclass fields of `SplitKVMetadata` a `_pack_recipe` rebuilds from its views (the rest are values)
_RECIPE_SKIP = frozenset(_META_TENSORS + _META_MASKS + _META_MASK_LISTS + ("host_build",))


def _pack_recipe(meta) -> tuple:
    """The layout of unbound host-built metadata as plain Python values (ints, strings, dtypes, a placeholder
    `CommGroup`): what `_from_recipe` needs to rebuild it, field for field, on views of ONE packed region (the
    `_pack` layout of `_unique_tensors(meta)`, 16-byte aligned). Small (a few hundred values; pickled with a
    data-loader item instead of the metadata object and its tensors). Returns (entries [(dtype, shape, byte
    offset)], region bytes, {tensor field: entry index or None}, masks [(block_size, lo, hi, num_keys, lo2,
    hi2, num_ctx_keys, flex tables ((key, rows, tables), ...))] with entry indices, {mask field: mask index,
    list of them, or None}, the other fields' values, (cp_size, cp_rank), the entries' `_compile_split` plan)."""
    import dataclasses  # noqa: PLC0415

    rec = meta.host_build
    if rec is None:
        raise ValueError("_pack_recipe: the metadata is bound (pack the unbound metadata of "
                         "prepare_splitkv_metadata_from_plan)")
    tensors = _unique_tensors(meta)
    offs, total = _pack_layout(tensors)
    index = {id(t): i for i, t in enumerate(tensors)}
    entries = tuple((t.dtype, tuple(t.shape), o) for t, o in zip(tensors, offs))

    def ti(t):
        return None if t is None else index[id(t)]

    masks = _unique_masks(meta)
    mindex = {id(m): i for i, m in enumerate(masks)}
    mspecs = tuple(
        (m.block_size, ti(m.lo), ti(m.hi), m.num_keys, ti(m.lo2), ti(m.hi2), m.num_ctx_keys,
         tuple((key, ti(rows), tuple(ti(x) for x in tables))
               for key, (rows, tables) in sorted(m.__dict__.get(_FLEX_HOST, {}).items())),
         (ti(m.row_lo), ti(m.row_lo2), ti(m.row_hi2)))
        for m in masks)
    mfields = {n: (None if getattr(meta, n) is None else mindex[id(getattr(meta, n))]) for n in _META_MASKS}
    mfields.update({n: (None if getattr(meta, n) is None else tuple(mindex[id(m)] for m in getattr(meta, n)))
                    for n in _META_MASK_LISTS})
    values = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta) if f.name not in _RECIPE_SKIP}
    return (entries, total, {n: ti(getattr(meta, n)) for n in _META_TENSORS}, mspecs, mfields, values,
            (rec.cp_size, rec.cp_rank),
            _compile_split(entries))


def _from_recipe(region: torch.Tensor, recipe: tuple) -> "SplitKVMetadata":
    """The unbound metadata of `recipe` (`_pack_recipe`) with every tensor a view of the uint8 `region` (host,
    pinned or device; no copy), the region recorded as its packed buffer (`host_build.buffer`, what `bind`
    uploads or uses as is); `device` is the region's. One pass: the views (`_apply_split` with the recipe's
    plan), the masks, one dataclass. Raises ValueError when `region` is shorter than the recipe's region."""
    entries, total, tfields, mspecs, mfields, values, hb, compiled = recipe
    if region.numel() < total:
        raise ValueError(f"region has {region.numel()} bytes, the packed metadata needs {total}")
    v = _apply_split(region, compiled)
    masks = []
    for bs, lo, hi, nk, lo2, hi2, nck, flex, row in mspecs:
        row = [None if i is None else v[i] for i in row]
        m = IntervalMask(bs, v[lo], v[hi], nk, None if lo2 is None else v[lo2], None if hi2 is None else v[hi2],
                         num_ctx_keys=nck, row_lo=row[0], row_lo2=row[1], row_hi2=row[2])
        if flex:
            m.__dict__[_FLEX_HOST] = {key: (v[rows], tuple(v[x] for x in tables)) for key, rows, tables in flex}
        masks.append(m)
    fields = dict(values)
    fields.update({n: (None if i is None else v[i]) for n, i in tfields.items()})
    for n, i in mfields.items():
        fields[n] = None if i is None else (masks[i] if isinstance(i, int) else [masks[j] for j in i])
    for n in ("n_blocks", "n_ctx", "chunks", "chunk_heads"):  # fresh lists per object, as `_remapped` makes them
        if fields.get(n) is not None:
            fields[n] = list(fields[n])
    fields["device"] = region.device
    fields["host_build"] = _HostBuild(cp_size=hb[0], cp_rank=hb[1], buffer=region, layout=[e[2] for e in entries])
    return SplitKVMetadata(**fields)


def _host_ints(x, name: str, length: int) -> torch.Tensor:
    """A 1-D integer numpy array / tensor of `length` as an int64 CPU tensor; ValueError naming `name`."""
    import numpy as np  # noqa: PLC0415

    if isinstance(x, np.ndarray):
        if x.ndim != 1 or not np.issubdtype(x.dtype, np.integer) or x.dtype == np.uint64:
            raise ValueError(f"{name} must be a 1-D signed integer array of length {length}, got shape "
                             f"{x.shape} dtype {x.dtype}")
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 1-D integer tensor of length {length}, got {shape}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool or x.dtype == _UINT64:
        raise ValueError(f"{name} must have a signed integer dtype (int64), got {x.dtype}")
    if x.device.type == "meta":
        raise ValueError(f"{name} must hold data, got a tensor on the meta device")
    if x.shape[0] != length:
        raise ValueError(f"{name} must have length {length} (this rank's context tokens under the plan), got "
                         f"{x.shape[0]}")
    return x.to(device="cpu", dtype=torch.int64)


def env_request_row(cp_size: int, config: SplitKVConfig | None = None) -> list:
    """The op's requests of `config` (None: the defaults) as THIS process resolves them, one int each (what
    `check_environment_agreement` compares across ranks): num_chunks (0 = None), cp_ranks_per_node (resolved
    for `cp_size`) and chunk_axis (code: 0 rows, 1 heads). Raises ValueError naming a field that does not fit
    `cp_size`."""
    config = resolve_config(config)
    return [_requested_chunks(None, config), resolve_ranks_per_node(None, cp_size, config),
            _requested_axis(None, config)]


def check_environment_agreement(cp_group=None, device=None, *, dtype=None, head_dim=None, backend="auto",
                                config: SplitKVConfig | None = None) -> None:
    """Collective over the CP group: check that the `SplitKVConfig` fields which shape Split-KV's collectives
    resolve to the same values on every rank, and raise the same ValueError on every rank when they do not
    (or when one does not fit the group on some rank). It compares config only (the library reads no
    environment variable; the name is kept for its callers).

    `prepare_splitkv_metadata` and the call without `metadata=` agree on these values in their agreement
    row. Host-built metadata (`prepare_splitkv_metadata_from_plan` in a data worker, `bind` in the step)
    resolves them in each process without a collective (`bind` only checks that the training process resolves
    them as the building process did): ranks started with different values would issue different numbers
    or sizes of collectives in the op (gloo aborts, NCCL hangs or mixes data). Call this once per process
    after the CP group exists and before the first op call with host-built metadata (examples/pretrain_dflash.py
    does, at its first micro-batch), on every rank of the group; or build the metadata with
    `group_check=True` (a verdict exchange per call).

    Checked (`config`, None: the defaults): num_chunks, cp_ranks_per_node (as resolved for this group's
    size), chunk_axis and, with `dtype`,
    what kernel backend "auto" resolves to for calls of that dtype and head dim on `device`
    (`kernels.auto_backend_code`: FlashAttention-4, flex, staircase, math; as `prepare_splitkv_metadata` agrees
    it).

    Args:
        cp_group: the CP ProcessGroup (None: the default group when initialised, else one process).
        device: the device of the tiny all-gather (default: CPU, or the current CUDA device with NCCL), and
            the device of the op calls for the "auto" check.
        dtype, head_dim: the op calls' q/k/v dtype and head dim (dtype None: "auto" not checked on this rank).
            The "auto" resolution is computed for `device` (the op's device, also with a gloo group), else for
            the group's communication device.
        backend: the kernel the op calls pass (as `prepare_splitkv_metadata`'s): only "auto" takes part in the
            check of its resolution.

    Raises:
        ValueError("check_environment_agreement: ..."), the same on every rank: a field that does not fit the
            group on some rank (naming the rank(s) and the field), or resolving differently across ranks
            (naming the field and the values by rank).
    """
    name = "check_environment_agreement"
    group = resolve_group(cp_group)
    err, row = "", [-1] * 4
    try:
        requests = env_request_row(group.size, config)
        op_device = _comm_device(group, None) if device is None else torch.device(device)
        row = requests + [_auto_entry(backend, op_device, dtype, head_dim, config)]
    except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank, never hang
        err = _local_error(exc)
    table = _raise_if_any(name, group, err, row, _comm_device(group, device), "splitkv.check")
    # columns: 0 = the error length, then the row
    _check_agree(name, table, ((1, "SplitKVConfig.num_chunks (requested num_chunks, 0 = None)"),
                               (2, "SplitKVConfig.cp_ranks_per_node (cp_ranks_per_node)"),
                               (3, "SplitKVConfig.chunk_axis (chunk_axis)")))
    _check_auto_agree(name, table, col=4)


def prepare_splitkv_metadata_from_plan(plan, cp_rank, *, block_size, num_heads_q, num_heads_kv, head_dim, dtype,
                                       impl="splitkv", num_chunks=None, cp_ranks_per_node=None, kv_seq=None,
                                       kv_pos=None, group_check=True, device="cpu",
                                       flex_block_masks=False,
                                       chunk_axis=None, head_split=None,
                                       config: SplitKVConfig | None = None, window=None,
                                       causal=False) -> SplitKVMetadata:
    """The per-step Split-KV metadata of CP rank `cp_rank`, built on the host from the global `plan`:
    no process group, no collective, no GPU (usable in a data-loader worker process). Returns an UNBOUND
    `SplitKVMetadata`; at step time `meta.bind(cp_group, device)` attaches the CP group and uploads it
    (one non-blocking copy), and the bound result equals, tensor for tensor and field for field, what
    `prepare_splitkv_metadata` returns on that rank for the same shard (tests/test_metadata_from_plan.py).

    Every CP rank computes the same plan from the batch, so what prepare all-gathers is known here: the
    size table (n_blocks = plan.blocks_per_rank on every rank, n_ctx[r] = the context tokens the plan gives
    rank r) and the gathered block metadata (plan.q_seq / plan.q_anchor of every rank, q_seq zeroed on
    invalid blocks). This rank's query blocks are plan.q_seq/q_anchor[plan.query_slice(cp_rank)], its
    context (kv_seq, kv_pos) `plan.token_seq_ids(cp_rank)` / `plan.token_positions(cp_rank)`, the order
    `data.shard_batch` gives the context K/V rows, unless kv_seq / kv_pos are passed.

    Pipeline (e.g. in the worker that runs the planner and `shard_batch`, then in the training step):

        meta = prepare_splitkv_metadata_from_plan(plan, r, block_size=16, num_heads_q=32, num_heads_kv=8,
                                                  head_dim=128, dtype=torch.bfloat16)   # worker, CPU
        meta = meta.pin_memory()          # the DataLoader's pin-memory thread does this itself
        bound = meta.bind(cp_group, torch.device("cuda", local_rank))      # step: one H2D copy
        out = splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, None, None, None, None, metadata=bound)

    Args:
        plan: the batch's `planning.Plan` (the same object on every CP rank: same batch, same planner call).
        cp_rank: this rank's index in the CP group, an int in [0, plan.cp_size).
        block_size: B, must equal plan.block_size.
        num_heads_q, num_heads_kv, head_dim, dtype: as `prepare_splitkv_metadata` (Hq % Hkv == 0; dtype
            bf16 / fp16 / fp32 / fp64).
        impl: "splitkv" only (the baselines' metadata needs the other ranks' context order: use
            `prepare_splitkv_metadata`).
        num_chunks, cp_ranks_per_node, chunk_axis, head_split, config: as `prepare_splitkv_metadata`
            (None: the config's fields); the metadata carries the config to `bind` and the calls.
        window, causal: the layer type, as `prepare_splitkv_metadata` (ValueError naming window).
        kv_seq, kv_pos: optional [n_ctx[cp_rank]] integer arrays / tensors: this rank's context in another
            order than the plan's (its values are not compared with the plan; only the length is).
        group_check: as `prepare_splitkv_metadata` (per-call group-wide shape verdicts).
        device: where the unbound tensors are built (default CPU; another device gets the host-built
            tensors uploaded once, as `bind` does).
        flex_block_masks: also build the FlexAttention block tables of every chunk's own-block mask
            (`chunk_masks_own`, the masks of calls WITH k_blk / v_blk) on the host, at the padded lengths
            the flex kernel runs them (`kernels.flex.padded_lengths` with the config's flex bucket steps);
            `bind` uploads them with the rest and caches the BlockMasks on the
            bound masks, so the first layer's flex call does not build them (~23 device ops per mask,
            0.5-1 ms on the H200). Bit-identical to the device-built tables (the same integer ops). A call
            at other lengths (the kernel reusing a compiled key bucket one step larger, custom bucket steps)
            or without own block builds its BlockMask on the device as before. Default False.

    Returns: an unbound `SplitKVMetadata` (`bound` False; `group` is a placeholder of size plan.cp_size and
        rank cp_rank, `device` the build device, `node_groups` None). Tensors int64 (bool: valid,
        valid_rows): q_seq, q_anchor, valid [nb]; kv_seq, kv_pos, keys [Tk]; order [Tk] or None (the
        plan's order is sorted: None); block_meta [P * nb, 2]; valid_rows [nb * B]; chunk_masks(_own): k
        `IntervalMask`s with [P * (b1 - b0)] lo / hi (/ lo2 / hi2). The ops refuse it until bound.

    Checks (host, from the plan and the arguments; ValueError naming the argument, prefixed
    "prepare_splitkv_metadata_from_plan: "): plan not a Plan; cp_rank not an int in [0, cp_size); block_size
    not a positive int or != plan.block_size; head counts / head_dim not positive ints, Hq % Hkv != 0;
    dtype; impl; num_chunks / cp_ranks_per_node / chunk_axis (and their variables) as prepare; kv_seq / kv_pos not 1-D
    signed integer of this rank's context length, only one of them given; values outside [-2**31, 2**31)
    (q_seq, kv_seq, kv_pos: prepare's range check); a bad device; config not a SplitKVConfig.
    Every rank validates the same plan with the same arguments, so a bad plan or argument raises the same
    ValueError on every rank, without communicating.

    NOT checked group-wide, unlike prepare (there is no collective): that every rank passes the same plan,
    block_size, Hq, Hkv, D, dtype, impl, group_check, num_chunks, chunk_axis, cp_ranks_per_node and config; that each rank's cp_rank is its rank in the group (checked
    locally by `bind`); that kv_seq / kv_pos hold the tokens the plan gives this rank. A rank that differs
    makes the ops' collectives mismatch (wrong results, an error or a hang), as a rank passing different
    tensors to prepare would for the values prepare does not gather. `group_check=True` (one tiny
    all-gather per call) exchanges the sizes, shapes, dtype and requests per call and raises on every rank.

    Source: arXiv 2611.05926 (Split-KV), DESIGN.md sections 2-3.
    """
    import numpy as np  # noqa: PLC0415

    name = "prepare_splitkv_metadata_from_plan"
    try:
        for attr in ("cp_size", "block_size", "q_seq", "q_anchor", "chunk_rank", "chunk_start", "chunk_end",
                     "token_seq_ids", "token_positions", "query_slice", "blocks_per_rank"):
            if not hasattr(plan, attr):
                raise ValueError(f"plan must be a megatron_splitkv.planning.Plan, got {type(plan).__name__}")
        P = int(plan.cp_size)
        rank = as_int(cp_rank, "cp_rank", minimum=0, maximum=P - 1,
                      what=f"an int in [0, {P}) (plan.cp_size = {P})")
        canon = IMPLS.get(impl) if isinstance(impl, str) else None
        if canon is None:
            raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
        if canon != "splitkv":
            raise ValueError(f"impl={impl!r}: only 'splitkv' metadata is built from the plan (the baselines' "
                             "metadata depends on the other ranks' context order: use prepare_splitkv_metadata)")
        block_size = check_block_size(block_size)
        window, causal = check_attention_type(window, causal)
        if block_size != plan.block_size:
            raise ValueError(f"block_size={block_size} differs from the plan's block_size={plan.block_size}")
        num_heads_q, num_heads_kv, head_dim = check_heads_dtype(num_heads_q, num_heads_kv, head_dim, dtype)
        device = _check_device(device)
        cfg = resolve_config(config)
        chunks_req = _requested_chunks(num_chunks, cfg)
        ranks_req = resolve_ranks_per_node(cp_ranks_per_node, P, cfg)
        axis_req = _requested_axis(chunk_axis, cfg)
        _requested_head_split(head_split)
        cfg = _with_requests(cfg, num_chunks, chunk_axis, cp_ranks_per_node)
        # the size table every rank would all-gather: equal block counts, the plan's context counts
        nb = int(plan.blocks_per_rank)
        n_ctx = np.zeros(P, dtype=np.int64)
        np.add.at(n_ctx, np.asarray(plan.chunk_rank, dtype=np.int64),
                  np.asarray(plan.chunk_end, dtype=np.int64) - np.asarray(plan.chunk_start, dtype=np.int64))
        n_ctx = [int(v) for v in n_ctx]
        if (kv_seq is None) != (kv_pos is None):
            raise ValueError("kv_seq and kv_pos must both be given or both be None (the plan's context order)")
        if kv_seq is None:
            kv_seq_t = torch.from_numpy(np.ascontiguousarray(plan.token_seq_ids(rank), dtype=np.int64))
            kv_pos_t = torch.from_numpy(np.ascontiguousarray(plan.token_positions(rank), dtype=np.int64))
        else:
            kv_seq_t = _host_ints(kv_seq, "kv_seq", n_ctx[rank])
            kv_pos_t = _host_ints(kv_pos, "kv_pos", n_ctx[rank])
        q_anchor_all = torch.from_numpy(np.ascontiguousarray(plan.q_anchor, dtype=np.int64))
        valid_all = q_anchor_all >= 0
        q_seq_all = torch.where(valid_all, torch.from_numpy(np.ascontiguousarray(plan.q_seq, dtype=np.int64)), 0)
        if q_seq_all.shape[0] != P * nb or q_anchor_all.shape[0] != P * nb:
            raise ValueError(f"plan must have P * blocks_per_rank = {P * nb} query blocks, got q_seq "
                             f"{tuple(q_seq_all.shape)}, q_anchor {tuple(q_anchor_all.shape)}")
        for n, t in (("q_seq", q_seq_all), ("kv_seq", kv_seq_t), ("kv_pos", kv_pos_t)):
            if t.numel():
                lo, hi = int(t.min()), int(t.max())
                if lo < -_INT32 or hi >= _INT32:
                    raise ValueError(f"{n} values must lie in [-2**31, 2**31), got range [{lo}, {hi}]")
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    sl = slice(rank * nb, (rank + 1) * nb)
    # clones: the local slices must not keep the whole plan's block arrays alive / shared
    q_seq_t, q_anchor_t, valid = q_seq_all[sl].clone(), q_anchor_all[sl].clone(), valid_all[sl].clone()
    meta = SplitKVMetadata(
        impl=canon, group=CommGroup(None, P, rank), block_size=block_size, num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv, head_dim=head_dim, dtype=dtype, device=torch.device("cpu"), n_blocks=[nb] * P,
        n_ctx=n_ctx, q_seq=q_seq_t, q_anchor=q_anchor_t, kv_seq=kv_seq_t, kv_pos=kv_pos_t, valid=valid,
        group_check=bool(group_check),
        num_chunks_requested=chunks_req, cp_ranks_per_node=ranks_req, chunk_axis=CHUNK_AXES[axis_req],
        config=cfg, host_build=_HostBuild(cp_size=P, cp_rank=rank), window=window,
        causal=causal,
    )
    meta.valid_rows = valid.repeat_interleave(block_size)
    _host_finish_splitkv(meta, torch.stack([q_seq_all, q_anchor_all], 1))
    if flex_block_masks:
        _host_flex_tables(meta.chunk_masks_own, cfg.flex)
    if device.type != "cpu":
        meta = _remapped(meta, _uploaded(_unique_tensors(meta), device, device.type == "cuda"), device=device)
    return meta


def _host_finish_splitkv(meta: SplitKVMetadata, block_meta: torch.Tensor) -> None:
    """`_finish_splitkv` on the host, with the gathered block metadata given (every rank's (q_seq, anchor),
    [P * nb, 2], equal block counts: no padding rows) and no process group: the same keys and the same
    `_splitkv_chunk_masks` on CPU (so the same values, bit for bit; tests/test_metadata_from_plan.py
    compares them), the "already sorted" test read directly (`ops.common.sort_keys`: the sort is skipped
    when sorted), each chunk's lo / hi / lo2 / hi2 a copy of their own (views of one table would pack and
    upload the table once per chunk) and, with `config.debug_checks`, the union contract validated on the host."""
    meta.keys, meta.order = sort_keys(torch.add(meta.kv_pos + _INT32, meta.kv_seq, alpha=1 << 32))
    meta.block_meta = block_meta
    whole = _splitkv_chunk_masks(meta, meta.keys, int(meta.keys.shape[0]), copies=True)
    if whole is not None:
        whole.validate()


#: attribute of a host-built IntervalMask: {(q_len, kv_len): (rows [n, q_len] int32, the 8 BlockMask tables)}
_FLEX_HOST = "_flex_host_tables"


def _host_flex_tables(masks, options=None) -> None:
    """The FlexAttention block tables of `masks` at the padded lengths of `options` (FlexOptions; None: the
    defaults), built on the
    host with the kernel's own functions (`kernels.flex._rows_table` / `_block_tables`, what
    `build_block_mask` runs on the device) and stored on each mask (`_FLEX_HOST`; tensors only, so the
    mask stays picklable). Masks without query rows or keys are skipped (the ops never call the kernel)."""
    from ..kernels import flex  # noqa: PLC0415 - FlexAttention is optional

    if flex.BlockMask is None:
        raise RuntimeError(f"FlexAttention is not available in this torch build: {flex._FLEX_IMPORT_ERROR}")
    options = FlexOptions() if options is None else options
    for m in masks:
        rows_n = m.num_blocks * m.block_size
        if rows_n == 0 or m.num_keys == 0:
            continue
        q_len, kv_len = flex.padded_lengths(rows_n, m.num_keys, options.q_bucket_steps, options.bucket_steps)
        rows = flex._rows_table(m, q_len)
        tables = flex._block_tables(rows, q_len, kv_len, flex.TILE, rows_per_block=flex.rows_per_block(m),
                                    q_tables=True)
        m.__dict__[_FLEX_HOST] = {(q_len, kv_len): (rows, tuple(t.contiguous() for t in tables))}


def _flex_block_mask(mask, key, rows, tables):
    """The BlockMask `kernels.flex.build_block_mask(mask, *key)` builds, from host-built tables (moved)."""
    from ..kernels import flex  # noqa: PLC0415

    kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = tables
    lo2, hi2 = (rows[2], rows[3]) if mask.has_union else (None, None)
    return flex.BlockMask(
        seq_lengths=tuple(key), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num,
        full_kv_indices=full_idx, q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx, BLOCK_SIZE=(flex.TILE, flex.TILE),
        mask_mod=flex._interval_mask_mod(rows[0], rows[1], lo2, hi2),
    )
