"""Per-step mask metadata of the CP attention ops (`SplitKVMetadata`), one op call (`Plan`), and what the
ops' chunking arguments resolve to.

Everything the three ops (`splitkv_attention`, `allgather_kv_attention`, `ring_kv_attention`) do besides
moving activations depends only on the mask metadata (q_seq, q_anchor, kv_seq, kv_pos, block_size, the CP
group). It is the same for every drafter layer of a training step, so a model builds it once per step
(`prepare_splitkv_metadata`, collective, in `ops.prepare`; or `prepare_splitkv_metadata_from_plan` on the host,
in `ops.host_metadata`, then `SplitKVMetadata.bind`) and passes it to each layer's call as `metadata=`:

    meta = prepare_splitkv_metadata(q_seq, q_anchor, kv_seq, kv_pos, block_size=B,
                                    num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.bfloat16,
                                    cp_group=cp_group, impl="splitkv")
    for layer in drafter_layers:              # q/k/v differ per layer, the metadata does not
        q, k_ctx, v_ctx, k_blk, v_blk = layer.qkv(...)
        out = splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, None, None, None, None, metadata=meta)

In Megatron-Core the carrier is the per-micro-batch `DFlashPackedSeqParams` that reaches every layer's core
attention (`megatron_splitkv/megatron/attention.py`).

Holds:
- resolution of the ops' arguments against `SplitKVConfig`: `IMPLS` (the accepted impl spellings),
  `resolve_num_chunks` (Split-KV's query chunk count k, clamped to [1, max(nb_max, 1)]; `chunk_bounds`: chunk c =
  blocks [c * nb_max // k, (c + 1) * nb_max // k) of every rank's padded block segment), `resolve_chunk_axis`
  ("rows" or "heads": every chunk all rows and Hkv / k kv heads, k clamped to [1, Hkv]), `resolve_ranks_per_node`
  (L of the two-level all-to-all: 1 <= L <= P, P % L == 0) and the `requested_*` forms the agreement rows carry;
  ValueError naming the argument or config field and its limit;
- `SplitKVMetadata`: one rank's int64 index tensors, the per-rank size table, the sorted context keys and the
  `IntervalMask`s, with `bind`, `pin_memory` and `with_attention_type`; `splitkv_chunk_masks`, the intervals of
  every gathered block as one [4, P * nb_max] table and each chunk's masks as its columns;
- `Plan`: one op call (metadata, resolved softmax scale, kernel, accumulation dtype), made by `call_plan`
  (`resolve_kernel`: the kernel checked for the dtype, head dim and layer type before any collective).

Source: arXiv 2611.05926 (Split-KV), DESIGN.md sections 1 (mask) and 2 (algorithm).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .._ints import _shown, as_int
from ..comm import CommGroup, node_groups, resolve_group
from ..config import CHUNK_AXES, DEFAULT_NUM_CHUNKS, SplitKVConfig, resolve_config
from ..kernels import auto_keys_per_call, get_kernel, warn_ignored_options
from ..kernels.base import IntervalMask
from ..reference import check_attention_type
from .chunking import chunk_bounds, make_chunking
from .common import acc_dtype, intervals, own_key_start, own_rows, window_rows, with_own_blocks
from .packing import pack, remapped, unique_tensors, unpacked, uploaded
from .validation import INT32, check_device, comm_device, resolve_check_group

__all__ = ["SplitKVMetadata", "Plan", "IMPLS", "resolve_num_chunks", "chunk_bounds", "resolve_ranks_per_node",
           "resolve_chunk_axis", "requested_chunks", "requested_axis", "requested_head_split", "with_requests",
           "resolved_scale", "MAX_REQUESTED_CHUNKS", "splitkv_chunk_masks", "resolve_kernel", "call_plan",
           "UNBOUND_MSG"]


#: accepted `impl` spellings -> canonical op name (the Megatron spellings use dashes).
IMPLS = {
    "splitkv": "splitkv",
    "allgather_kv": "allgather_kv",
    "allgather-kv": "allgather_kv",
    "ring_kv": "ring_kv",
    "ring-kv": "ring_kv",
    "ring": "ring_kv",
}


def resolved_scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


#: requested chunk counts are saturated at this value (far above any block count): the agreement rows'
#: column 10 holds it in its low 23 bits, the chunk axis in bit 23,
#: cp_ranks_per_node - 1 from bit 32 and the layer type (window / causal) in bits 24-30 and 48-62 (`request_code`)
MAX_REQUESTED_CHUNKS = (1 << 23) - 1


def requested_axis(chunk_axis, config: SplitKVConfig | None = None) -> int:
    """The chunk axis as its code for the agreement rows (0 = "rows", 1 = "heads"): chunk_axis, else
    `config.chunk_axis` (None: "rows"). Raises ValueError naming the argument and the allowed values."""
    if chunk_axis is None:
        return CHUNK_AXES.index(resolve_config(config).chunk_axis)
    if not isinstance(chunk_axis, str) or chunk_axis not in CHUNK_AXES:
        raise ValueError(f"chunk_axis must be None, 'rows' or 'heads', got {chunk_axis!r}")
    return CHUNK_AXES.index(chunk_axis)


def requested_head_split(head_split) -> None:
    """None: uneven head splits are deleted (docs/tuning.md: no measured gain); a `head_split` other than None
    raises ValueError naming the argument and its replacement."""
    if head_split is not None:
        raise ValueError(f"head_split={_shown(head_split)}: uneven head splits were removed (no measured gain, "
                         "docs/tuning.md); use chunk_axis='heads' with num_chunks=k for k even head chunks")


def with_requests(config: SplitKVConfig, num_chunks, chunk_axis, cp_ranks_per_node) -> SplitKVConfig:
    """`config` with the op's keyword arguments that were given (validated before) applied: what the
    metadata carries."""
    return config.replace(num_chunks=num_chunks, chunk_axis=chunk_axis, cp_ranks_per_node=cp_ranks_per_node)


def resolve_chunk_axis(chunk_axis=None, config: SplitKVConfig | None = None) -> str:
    """Split-KV's chunk axis (ops/splitkv.py item 3, "Head chunks"): chunk_axis ("rows" | "heads"), else
    `config.chunk_axis` (None: "rows"). Raises ValueError (naming the argument and the allowed values) for
    anything else."""
    return CHUNK_AXES[requested_axis(chunk_axis, config)]


def requested_chunks(num_chunks, config: SplitKVConfig | None = None) -> int:
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
    return min(num_chunks, MAX_REQUESTED_CHUNKS)


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
    try:  # 0 (any integer type): automatic; everything else is checked by requested_chunks
        zero = num_chunks is not None and as_int(num_chunks, "num_chunks", minimum=0) == 0
    except ValueError:
        zero = False
    req = 0 if zero else requested_chunks(num_chunks, config)
    if req == 0:
        req = DEFAULT_NUM_CHUNKS
    return max(1, min(req, max_blocks))


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
    #: `prepare_splitkv_metadata_from_plan` only: the host-side build record (`ops.host_metadata._HostBuild`: CP size and
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
        tensors = unique_tensors(self)
        buf, offs = pack(tensors, pin=True)
        new = {id(t): unpacked(buf, o, t) for t, o in zip(tensors, offs)}
        return remapped(self, new, host_build=dataclasses.replace(rec, buffer=buf, layout=offs))

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
            new.host_build = dataclasses.replace(self.host_build, buffer=None, layout=None)
        if self.impl == "splitkv":
            whole = splitkv_chunk_masks(new, self.keys, int(self.keys.shape[0]), copies=self.host_build is not None)
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
            device = check_device(comm_device(group, None) if device is None else device)
            if comm_device(group, device).type != device.type:
                raise ValueError(f"device must be the activations' CUDA device with an NCCL group, got {device}")
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        tensors = unique_tensors(self)
        if all(t.device == device for t in tensors) or (
                device.type == "cpu" and all(t.device.type == "cpu" for t in tensors)):
            new = {id(t): t for t in tensors}  # already there (e.g. `PlannedBatch.to(device)`): no copy, no view
        else:
            new = uploaded(tensors, device, non_blocking, rec.buffer, rec.layout)
        ngroups = None
        if 1 < self.cp_ranks_per_node < group.size:  # the two-level all-to-all's sub-groups (cached)
            ngroups = node_groups(group, self.cp_ranks_per_node, comm_device(group, device))
        return remapped(self, new, block_masks=True, group=group, device=device, node_groups=ngroups,
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


def splitkv_chunk_masks(meta: SplitKVMetadata, sorted_keys: torch.Tensor, n_keys: int, copies: bool):
    """The chunks and their interval masks from the sorted context keys and the gathered block metadata
    (`meta.block_meta`, [P * nb_max, 2]), on their device: sets meta.num_chunks, chunks, chunk_masks and
    chunk_masks_own. Shared by `ops.prepare` (device) and `ops.host_metadata` (host).

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
    chunking = make_chunking("heads" if heads else "rows", meta.num_chunks, nb_max, bsz, meta.num_heads_q,
                             meta.num_heads_kv)
    meta.chunks = list(chunking.bounds)
    meta.chunk_heads = [chunking.heads(c) for c in range(len(chunking))]
    dev = meta.q_seq.device
    table = torch.empty(4, P * nb_max, dtype=torch.int64, device=dev)
    # first intervals (`ops.common.intervals`): block b sees the keys of sequence seq[b] with position <
    # anchor[b]; anchor < 0 (invalid, padding rows) the empty [lo, lo). Sequence ids may be negative
    # (padding rows carry anchor -1, so they get an empty interval whatever their sequence id)
    seq, anchor = meta.block_meta[:, 0], meta.block_meta[:, 1]
    base = seq * (1 << 32)
    torch.searchsorted(sorted_keys, base, out=table[0])
    hi = torch.searchsorted(sorted_keys, base + (anchor.clamp(0, INT32) + (INT32 - 1)), right=True)
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


def resolve_kernel(name, backend, device, dtype, head_dim, keys_per_call=None, config: SplitKVConfig | None = None,
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


def call_plan(meta: SplitKVMetadata, name, softmax_scale, backend) -> Plan:
    d = meta.head_dim
    scale = resolved_scale(softmax_scale, d)
    keys = meta.__dict__.get("_auto_keys")  # derived from the agreed size table only: once per metadata
    if keys is None:
        keys = meta.__dict__["_auto_keys"] = auto_keys_per_call(meta.impl, meta.n_ctx)
    kernel = resolve_kernel(name, backend, meta.device, meta.dtype, d, keys_per_call=keys, config=meta.config,
                             window=getattr(meta, "window", None), causal=getattr(meta, "causal", False))
    return Plan(name=name, meta=meta, scale=scale, kernel=kernel, acc=acc_dtype(meta.dtype))


UNBOUND_MSG = ("metadata from prepare_splitkv_metadata_from_plan is not bound to a CP group yet: pass "
                "meta.bind(cp_group, device) (a new, bound SplitKVMetadata) as metadata=")
