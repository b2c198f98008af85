"""Split-KV metadata built on the host from the global plan: no process group, no collective, no GPU.

`prepare_splitkv_metadata_from_plan(plan, cp_rank, ...)` returns the unbound `SplitKVMetadata` of CP rank
`cp_rank` (int64 q_seq, q_anchor [nb]; kv_seq, kv_pos, keys [Tk]; block_meta [P * nb, 2]; the chunks'
`IntervalMask`s, each chunk's lo / hi / lo2 / hi2 a tensor of its own), equal, field for field once bound
(`SplitKVMetadata.bind`), to what `prepare_splitkv_metadata` returns on that rank; with `flex_block_masks` also
the FlexAttention block tables of the own-block masks. `pack_recipe` / `from_recipe` turn unbound metadata into
plain Python values plus one packed uint8 region, and back (how the data pipeline ships it).

Errors: ValueError prefixed "prepare_splitkv_metadata_from_plan: " naming the argument and its limit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from .._ints import as_int
from ..comm import CommGroup
from ..config import CHUNK_AXES, FlexOptions, SplitKVConfig, resolve_config
from ..kernels import flex
from ..kernels.base import IntervalMask
from ..reference import check_attention_type
from .common import sort_keys
from .metadata import (
    IMPLS,
    SplitKVMetadata,
    requested_axis,
    requested_chunks,
    requested_head_split,
    resolve_ranks_per_node,
    splitkv_chunk_masks,
    with_requests,
)
from .packing import (
    FLEX_HOST,
    META_MASKS,
    META_MASK_LISTS,
    META_TENSORS,
    apply_split,
    compile_split,
    pack_layout,
    remapped,
    unique_masks,
    unique_tensors,
    uploaded,
)
from .validation import INT32, check_block_size, check_device, check_heads_dtype, host_ints

__all__ = ["pack_recipe", "from_recipe", "prepare_splitkv_metadata_from_plan"]


@dataclass
class _HostBuild:
    """What a host-built `SplitKVMetadata` carries until `SplitKVMetadata.bind`: the plan's CP size and
    this metadata's CP rank (checked against the group) and the packed host buffer of `pin_memory` (buffer: uint8, layout: the byte offset of every
    `unique_tensors` entry)."""

    cp_size: int
    cp_rank: int
    buffer: torch.Tensor = None
    layout: list = None


#: the dataclass fields of `SplitKVMetadata` a `pack_recipe` rebuilds from its views (the rest are values)
_RECIPE_SKIP = frozenset(META_TENSORS + META_MASKS + META_MASK_LISTS + ("host_build",))


def pack_recipe(meta) -> tuple:
    """The layout of unbound host-built metadata as plain Python values (ints, strings, dtypes, a placeholder
    `CommGroup`): what `from_recipe` needs to rebuild it, field for field, on views of ONE packed region (the
    `pack` layout of `unique_tensors(meta)`, 16-byte aligned). Small (a few hundred values; pickled with a
    data-loader item instead of the metadata object and its tensors). Returns (entries [(dtype, shape, byte
    offset)], region bytes, {tensor field: entry index or None}, masks [(block_size, lo, hi, num_keys, lo2,
    hi2, num_ctx_keys, flex tables ((key, rows, tables), ...))] with entry indices, {mask field: mask index,
    list of them, or None}, the other fields' values, (cp_size, cp_rank), the entries' `compile_split` plan)."""
    rec = meta.host_build
    if rec is None:
        raise ValueError("pack_recipe: the metadata is bound (pack the unbound metadata of "
                         "prepare_splitkv_metadata_from_plan)")
    tensors = unique_tensors(meta)
    offs, total = pack_layout(tensors)
    index = {id(t): i for i, t in enumerate(tensors)}
    entries = tuple((t.dtype, tuple(t.shape), o) for t, o in zip(tensors, offs))

    def ti(t):
        return None if t is None else index[id(t)]

    masks = unique_masks(meta)
    mindex = {id(m): i for i, m in enumerate(masks)}
    mspecs = tuple(
        (m.block_size, ti(m.lo), ti(m.hi), m.num_keys, ti(m.lo2), ti(m.hi2), m.num_ctx_keys,
         tuple((key, ti(rows), tuple(ti(x) for x in tables))
               for key, (rows, tables) in sorted(m.__dict__.get(FLEX_HOST, {}).items())),
         (ti(m.row_lo), ti(m.row_lo2), ti(m.row_hi2)))
        for m in masks)
    mfields = {n: (None if getattr(meta, n) is None else mindex[id(getattr(meta, n))]) for n in META_MASKS}
    mfields.update({n: (None if getattr(meta, n) is None else tuple(mindex[id(m)] for m in getattr(meta, n)))
                    for n in META_MASK_LISTS})
    values = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta) if f.name not in _RECIPE_SKIP}
    return (entries, total, {n: ti(getattr(meta, n)) for n in META_TENSORS}, mspecs, mfields, values,
            (rec.cp_size, rec.cp_rank),
            compile_split(entries))


def from_recipe(region: torch.Tensor, recipe: tuple) -> "SplitKVMetadata":
    """The unbound metadata of `recipe` (`pack_recipe`) with every tensor a view of the uint8 `region` (host,
    pinned or device; no copy), the region recorded as its packed buffer (`host_build.buffer`, what `bind`
    uploads or uses as is); `device` is the region's. One pass: the views (`apply_split` with the recipe's
    plan), the masks, one dataclass. Raises ValueError when `region` is shorter than the recipe's region."""
    entries, total, tfields, mspecs, mfields, values, hb, compiled = recipe
    if region.numel() < total:
        raise ValueError(f"region has {region.numel()} bytes, the packed metadata needs {total}")
    v = apply_split(region, compiled)
    masks = []
    for bs, lo, hi, nk, lo2, hi2, nck, flex, row in mspecs:
        row = [None if i is None else v[i] for i in row]
        m = IntervalMask(bs, v[lo], v[hi], nk, None if lo2 is None else v[lo2], None if hi2 is None else v[hi2],
                         num_ctx_keys=nck, row_lo=row[0], row_lo2=row[1], row_hi2=row[2])
        if flex:
            m.__dict__[FLEX_HOST] = {key: (v[rows], tuple(v[x] for x in tables)) for key, rows, tables in flex}
        masks.append(m)
    fields = dict(values)
    fields.update({n: (None if i is None else v[i]) for n, i in tfields.items()})
    for n, i in mfields.items():
        fields[n] = None if i is None else (masks[i] if isinstance(i, int) else [masks[j] for j in i])
    for n in ("n_blocks", "n_ctx", "chunks", "chunk_heads"):  # fresh lists per object, as `remapped` makes them
        if fields.get(n) is not None:
            fields[n] = list(fields[n])
    fields["device"] = region.device
    fields["host_build"] = _HostBuild(cp_size=hb[0], cp_rank=hb[1], buffer=region, layout=[e[2] for e in entries])
    return SplitKVMetadata(**fields)


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
        device = check_device(device)
        cfg = resolve_config(config)
        chunks_req = requested_chunks(num_chunks, cfg)
        ranks_req = resolve_ranks_per_node(cp_ranks_per_node, P, cfg)
        axis_req = requested_axis(chunk_axis, cfg)
        requested_head_split(head_split)
        cfg = with_requests(cfg, num_chunks, chunk_axis, cp_ranks_per_node)
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
            kv_seq_t = host_ints(kv_seq, "kv_seq", n_ctx[rank])
            kv_pos_t = host_ints(kv_pos, "kv_pos", n_ctx[rank])
        q_anchor_all = torch.from_numpy(np.ascontiguousarray(plan.q_anchor, dtype=np.int64))
        valid_all = q_anchor_all >= 0
        q_seq_all = torch.where(valid_all, torch.from_numpy(np.ascontiguousarray(plan.q_seq, dtype=np.int64)), 0)
        if q_seq_all.shape[0] != P * nb or q_anchor_all.shape[0] != P * nb:
            raise ValueError(f"plan must have P * blocks_per_rank = {P * nb} query blocks, got q_seq "
                             f"{tuple(q_seq_all.shape)}, q_anchor {tuple(q_anchor_all.shape)}")
        for n, t in (("q_seq", q_seq_all), ("kv_seq", kv_seq_t), ("kv_pos", kv_pos_t)):
            if t.numel():
                lo, hi = int(t.min()), int(t.max())
                if lo < -INT32 or hi >= INT32:
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
        meta = remapped(meta, uploaded(unique_tensors(meta), device, device.type == "cuda"), device=device)
    return meta


def _host_finish_splitkv(meta: SplitKVMetadata, block_meta: torch.Tensor) -> None:
    """`ops.prepare._finish_splitkv` on the host, with the gathered block metadata given (every rank's (q_seq, anchor),
    [P * nb, 2], equal block counts: no padding rows) and no process group: the same keys and the same
    `splitkv_chunk_masks` on CPU (so the same values, bit for bit; tests/test_metadata_from_plan.py
    compares them), the "already sorted" test read directly (`ops.common.sort_keys`: the sort is skipped
    when sorted), each chunk's lo / hi / lo2 / hi2 a copy of their own (views of one table would pack and
    upload the table once per chunk) and, with `config.debug_checks`, the union contract validated on the host."""
    meta.keys, meta.order = sort_keys(torch.add(meta.kv_pos + INT32, meta.kv_seq, alpha=1 << 32))
    meta.block_meta = block_meta
    whole = splitkv_chunk_masks(meta, meta.keys, int(meta.keys.shape[0]), copies=True)
    if whole is not None:
        whole.validate()


def _host_flex_tables(masks, options=None) -> None:
    """The FlexAttention block tables of `masks` at the padded lengths of `options` (FlexOptions; None: the
    defaults), built on the
    host with the kernel's own functions (`kernels.flex._rows_table` / `_block_tables`, what
    `build_block_mask` runs on the device) and stored on each mask (`FLEX_HOST`; tensors only, so the
    mask stays picklable). Masks without query rows or keys are skipped (the ops never call the kernel)."""
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
        m.__dict__[FLEX_HOST] = {(q_len, kv_len): (rows, tuple(t.contiguous() for t in tables))}
