"""The collective metadata builder and the shared entry point of the three CP attention ops.

`prepare_splitkv_metadata` (collective over the CP group, once per step) validates the metadata tensors,
exchanges one [1, 12] int64 verdict row (sizes, B, Hq, Hkv, D, dtype, impl, requests; `ops.agreement`), then
all-gathers the block metadata ("splitkv.fwd.block_meta", [P * nb_max, 2] int64) or the context keys
("allgather_kv.fwd.kv_meta", "ring_kv.ctx_meta"), sorts the keys and builds the `IntervalMask`s; impl "splitkv"
reads its host values with one host sync at P = 1.

`run_op` is the entry of `splitkv_attention`, `allgather_kv_attention` and `ring_kv_attention`: with
`metadata=` it checks the call against it (`agreement.check_call`); without, it validates the tensors
group-wide and builds the metadata internally (bit-identical results); then it applies the op's autograd
Function. Errors: ValueError with the same message on every rank (see `prepare_splitkv_metadata`).
"""

from __future__ import annotations

import torch

from .._ints import as_int
from ..comm import all_gather, node_groups, resolve_group
from ..config import CHUNK_AXES, SplitKVConfig, resolve_config
from ..reference import check_attention_type
from .agreement import (
    CALL_AGREE,
    DTYPE_CODE,
    IMPL_CODE,
    MODE_PLAIN,
    auto_entry,
    check_agree,
    check_auto_agree,
    check_call,
    decoded,
    local_error,
    raise_if_any,
    request_code,
    scale_bits,
    verdict_device,
    verdict_route,
)
from .common import context_keys, intervals, pad_rows, sort_keys, with_own_blocks
from .metadata import (
    IMPLS,
    Plan,
    SplitKVMetadata,
    call_plan,
    requested_axis,
    requested_chunks,
    requested_head_split,
    resolve_kernel,
    resolve_ranks_per_node,
    resolved_scale,
    splitkv_chunk_masks,
    with_requests,
)
from .validation import (
    HostReads,
    INT32,
    check_block_size,
    check_device,
    check_heads_dtype,
    check_scale_backend,
    check_tensors,
    comm_device,
    metadata_ints,
    resolve_check_group,
)

__all__ = ["prepare_splitkv_metadata", "run_op"]


def _finish(meta: SplitKVMetadata, gather_ctx: bool, reads: HostReads | None = None) -> SplitKVMetadata:
    """Collectives and derived tensors of the metadata (sizes already agreed group-wide). Validates the
    own-block masks against the union contract (`IntervalMask.validate`, at metadata time). splitkv: the
    host reads its values with one `.tolist()` at the end (`HostReads`: `reads` from the caller, e.g.
    a deferred range check, first), the baselines keep one host sync per read."""
    g, bsz, name = meta.group, meta.block_size, meta.impl
    if meta.valid is None:
        meta.valid = meta.q_anchor >= 0
    meta.valid_rows = meta.valid.repeat_interleave(bsz)
    nb_local = meta.n_blocks[g.rank]
    if name == "splitkv":
        _finish_splitkv(meta, reads if reads is not None else HostReads())
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


def _finish_splitkv(meta: SplitKVMetadata, reads: HostReads) -> None:
    """Split-KV's part of `_finish`: context keys and their sort, the gathered block metadata and the
    chunks' interval masks (`splitkv_chunk_masks`: the same values as the per-chunk `ops.common.intervals`
    and `with_own_blocks`, tests/test_prepare_cost.py), with ONE host sync (`reads`). With `config.debug_checks`
    (tests; off by default: the masks are correct by construction) the union contract is checked once on
    the whole table (`IntervalMask.validate_flags`: a chunk's blocks are a subset, so every chunk passes
    when the table does); only if the table fails are the chunks validated one by one, raising as before."""
    g = meta.group
    # context keys (seq, pos) -> seq * 2**32 + pos + 2**31 (`ops.common.context_keys`), sorted
    # unconditionally: whether they already were is read with the other values at the end
    keys = torch.add(meta.kv_pos + INT32, meta.kv_seq, alpha=1 << 32)
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
        meta.node_groups = node_groups(g, meta.cp_ranks_per_node, comm_device(g, meta.device))
    whole = splitkv_chunk_masks(meta, sorted_keys, n_keys, copies=False)

    def check_masks(v):
        if any(v):  # some chunk may violate the contract: validate them in order, raising as before
            for m in meta.chunk_masks_own:
                m.validate()

    if whole is not None:  # config.debug_checks: the masks are correct by construction; re-checked (and by the tests)
        reads.add(whole.validate_flags(), check_masks)
    reads.read()


def _checked_requests(impl, num_chunks, cp_ranks_per_node, cp_size, chunk_axis=None,
                      config: SplitKVConfig | None = None) -> tuple:
    """(chunks, ranks per node, chunk-axis code) requested for the agreement row of `impl`.

    Checked for every impl: a malformed num_chunks / cp_ranks_per_node / chunk_axis is a ValueError
    naming it and the limit whatever the impl. Used by splitkv only: the baselines get (0, 1,
    0) (one chunk, L = 1, rows); "must divide P" is about the
    two-level exchange they do not run, so they check cp_ranks_per_node's form only."""
    config = resolve_config(config)
    chunks_req = requested_chunks(num_chunks, config)
    axis_req = requested_axis(chunk_axis, config)
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
            inter-node links: docs/lab/perf-notes.md); a positive int is clamped to [1, max(max(n_blocks), 1)].
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
            chunks"; docs/lab/perf-notes.md item 21): "rows" (query blocks of every rank, all heads) or "heads"
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
    the "already sorted" test and the own-block mask validation (docs/lab/perf-notes.md "Prepare cost (item
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
    err, row, ints, rng, reads, cfg = "", [-1] * 11, None, None, HostReads(), None
    try:
        cfg = resolve_config(config)
        device = check_device(device)  # a bad device on one rank raises on every rank (not only there)
        if canon is None:
            raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
        block_size = check_block_size(block_size)
        window, causal = check_attention_type(window, causal)
        num_heads_q, num_heads_kv, head_dim = check_heads_dtype(num_heads_q, num_heads_kv, head_dim, dtype)
        if comm_device(group, device).type != device.type:
            raise ValueError(f"device must be the activations' CUDA device with an NCCL group, got {device}")
        *ints, rng = metadata_ints(q_seq, q_anchor, kv_seq, kv_pos, None, None, device)
        if group.size == 1 and canon == "splitkv":
            rng.defer(reads, name)  # read with the metadata's other host values: one sync per prepare
        else:
            rng.check()
        nb, tk = int(ints[0].shape[0]), int(ints[2].shape[0])
        chunks_req, ranks_req, axis_req = _checked_requests(
            canon, num_chunks, cp_ranks_per_node, group.size, chunk_axis, config=cfg)
        requested_head_split(head_split)
        cfg = with_requests(cfg, num_chunks, chunk_axis, cp_ranks_per_node)
        row = [nb, tk, block_size, num_heads_q, num_heads_kv, head_dim, DTYPE_CODE[dtype], IMPL_CODE[canon],
               int(bool(group_check)), request_code(chunks_req, ranks_req, axis_req, window, causal),
               auto_entry(backend, device, dtype, head_dim, cfg)]
    except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank, never hang
        if group.size == 1:
            if rng is not None:  # a deferred range check still comes first
                rng.raise_first(name)
            raise ValueError(f"{name}: {local_error(exc)}") from exc
        err = local_error(exc)
    tag = f"{canon or 'splitkv'}.meta"
    via, dev = verdict_route(group, check, verdict_device(group, device, err))
    table = decoded(raise_if_any(name, via, err, row, dev, tag))
    check_agree(name, table, ((3, "block_size"), (4, "Hq (num_heads_q)"), (5, "Hkv (num_heads_kv)"),
                               (6, "head dim D (head_dim)"), (7, "dtype"), (8, "impl"), (9, "group_check"),
                               (11, "num_chunks (requested)"), (14, "chunk_axis"),
                               (12, "cp_ranks_per_node"), (13, "window / causal")))
    check_auto_agree(name, table)
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
    err, row, ints, rng, reads, cfg = "", [-1] * 8 + [MODE_PLAIN, -1, -1], None, None, HostReads(), None
    try:
        cfg = resolve_config(config)
        nb, tk, hq, hkv, d, block_size = check_tensors(q, k_ctx, v_ctx, k_blk, v_blk, block_size)
        window, causal = check_attention_type(window, causal)
        check_scale_backend(softmax_scale, backend)
        *ints, rng = metadata_ints(q_seq, q_anchor, kv_seq, kv_pos, nb, tk, q.device)
        if group.size == 1 and name == "splitkv":
            rng.defer(reads, name)  # read with the metadata's other host values: one sync
        else:
            rng.check()
        chunks_req, ranks_req, axis_req = _checked_requests(
            name, num_chunks, cp_ranks_per_node, group.size, chunk_axis, config=cfg)
        cfg = with_requests(cfg, num_chunks, chunk_axis, cp_ranks_per_node)
        row = [nb, tk, block_size, hq, hkv, d, DTYPE_CODE[q.dtype], scale_bits(resolved_scale(softmax_scale, d)),
               MODE_PLAIN, request_code(chunks_req, ranks_req, axis_req, window, causal),
               # only where this rank uses "auto": the check below runs on EVERY rank (from the table), so a
               # group mixing "auto" and explicit backends raises everywhere or nowhere, never on some only
               auto_entry(backend, q.device, q.dtype, d, cfg)]
        # the kernel too, before the first collective: a backend missing (or refusing the dtype) on SOME
        # ranks must raise on every rank, not leave the others waiting in the data collectives
        resolve_kernel(name, backend, q.device, q.dtype, d, config=cfg, window=window, causal=causal)
    except ImportError as exc:  # kept an ImportError on every rank (`raise_if_any`)
        if group.size == 1:
            if rng is not None:  # a deferred range check still comes first
                rng.raise_first(name)
            raise
        err = local_error(exc)
    except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank, never hang
        if group.size == 1:
            if rng is not None:
                rng.raise_first(name)
            raise ValueError(f"{name}: {local_error(exc)}") from exc
        err = local_error(exc)
    via, dev = verdict_route(group, check, verdict_device(group, q.device if isinstance(q, torch.Tensor) else None,
                                                            err))
    table = decoded(raise_if_any(name, via, err, row, dev, f"{name}.meta"))
    check_agree(name, table, CALL_AGREE)
    check_auto_agree(name, table)  # over the ranks that call with "auto" (the others sent no "auto" code)
    meta = SplitKVMetadata(
        impl=name, group=group, block_size=row[2], num_heads_q=row[3], num_heads_kv=row[4],
        head_dim=row[5], dtype=q.dtype, device=q.device, n_blocks=[r[1] for r in table],
        n_ctx=[r[2] for r in table], q_seq=ints[0], q_anchor=ints[1], kv_seq=ints[2], kv_pos=ints[3],
        valid=ints[4], num_chunks_requested=table[0][11], cp_ranks_per_node=table[0][12],
        chunk_axis=CHUNK_AXES[table[0][14]], config=cfg, window=window, causal=causal,
    )
    return call_plan(_finish(meta, gather_ctx=False, reads=reads), name, softmax_scale, backend)


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
