"""The tensors of a `SplitKVMetadata` in one uint8 buffer, for one host-to-device copy.

`unique_tensors(meta)` lists every tensor of a metadata (its fields `META_TENSORS`, its masks' lo / hi / lo2 /
hi2 and per-row bounds, host-built FlexAttention tables; each object once, in a fixed order); `pack` lays them
out in one uint8 buffer (pinned on request), each at a 16-byte aligned offset; `unpacked` views one back with
its dtype and shape; `uploaded` moves the buffer to a device in one copy; `remapped` rebuilds a metadata
around moved tensors (shared masks stay shared). `compile_split` / `apply_split` / `split_views` view a flat
uint8 buffer by a list of (dtype, shape, byte offset) entries with one `split_with_sizes` per dtype (the data
pipeline's items). `FLEX_HOST` is the attribute of an `IntervalMask` holding FlexAttention block tables built
on the host ({(q_len, kv_len): (rows [n, q_len] int32, the 8 BlockMask tables)}).

Works on any object with the metadata's fields (duck-typed). ValueError for an entry that is misaligned,
overlaps another or lies outside the buffer.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..kernels import flex
from ..kernels.base import IntervalMask

__all__ = ["META_TENSORS", "META_MASKS", "META_MASK_LISTS", "unique_masks", "unique_tensors", "pack_layout", "pack",
           "unpacked", "uploaded", "remapped", "compile_split", "apply_split", "split_views", "FLEX_HOST"]


META_TENSORS = ("q_seq", "q_anchor", "kv_seq", "kv_pos", "valid", "keys", "order", "block_meta", "gather_index",
                 "valid_rows")


META_MASKS = ("mask", "mask_own")


META_MASK_LISTS = ("step_masks", "chunk_masks", "chunk_masks_own")


_MASK_TENSORS = ("lo", "hi", "lo2", "hi2", "row_lo", "row_lo2", "row_hi2")


def unique_masks(meta) -> list:
    seen = {}
    for n in META_MASKS:
        m = getattr(meta, n)
        if m is not None:
            seen.setdefault(id(m), m)
    for n in META_MASK_LISTS:
        for m in getattr(meta, n) or ():
            seen.setdefault(id(m), m)
    return list(seen.values())


def unique_tensors(meta) -> list:
    """Every tensor of the metadata (its fields and its masks' lo / hi / lo2 / hi2), each object once, in
    a fixed order (the layout of `pack`; shared objects, e.g. a chunk's lo in both of its masks, stay
    shared)."""
    seen = {}
    for n in META_TENSORS:
        t = getattr(meta, n)
        if t is not None:
            seen.setdefault(id(t), t)
    for m in unique_masks(meta):
        for a in _MASK_TENSORS:
            t = getattr(m, a)
            if t is not None:
                seen.setdefault(id(t), t)
        for key in sorted(m.__dict__.get(FLEX_HOST, {})):
            rows, tables = m.__dict__[FLEX_HOST][key]
            for t in (rows,) + tuple(tables):
                seen.setdefault(id(t), t)
    return list(seen.values())


#: byte alignment of every tensor in the packed upload buffer (inductor's assumed input alignment)
_PACK_ALIGN = 16


def pack_layout(tensors):
    """(offsets, total bytes) of `pack`'s buffer: each tensor's bytes at a 16-byte aligned offset."""
    offs, at = [], 0
    for t in tensors:
        offs.append(at)
        at += -(-t.numel() * t.element_size() // _PACK_ALIGN) * _PACK_ALIGN
    return offs, at


def pack(tensors, pin: bool):
    """(buffer, offsets): the tensors' bytes in one uint8 buffer (pinned when `pin`), each at a 16-byte
    aligned offset (any dtype can be viewed there, and compiled kernels, e.g. inductor's flex graphs, see
    aligned inputs: a misaligned one would be copied per call), so that `unpacked` views them back with
    their dtype and shape."""
    offs, at = pack_layout(tensors)
    buf = torch.empty(at, dtype=torch.uint8, pin_memory=pin)
    for t, o in zip(tensors, offs):
        unpacked(buf, o, t).copy_(t)
    return buf, offs


def unpacked(buf, off, like):
    """The view of `buf` at byte offset `off` with like's dtype and shape (contiguous)."""
    n = like.numel() * like.element_size()
    return buf[off: off + n].view(like.dtype).view(like.shape)


def uploaded(tensors, device, non_blocking: bool, buf=None, offs=None) -> dict:
    """{id(t): t's view on `device`} after ONE copy of the packed buffer: `buf` / `offs` when already packed
    (`pin_memory`), else packed here (pinned for a non-blocking CUDA copy)."""
    if buf is None:
        buf, offs = pack(tensors, pin=non_blocking and device.type == "cuda")
    dev_buf = buf.to(device, non_blocking=non_blocking)
    return {id(t): unpacked(dev_buf, o, t) for t, o in zip(tensors, offs)}


def remapped(meta, new: dict, block_masks: bool = False, **changes):
    """A copy of `meta` whose tensors are new[id(old tensor)] (masks rebuilt around them, shared masks
    kept shared; caches on the old masks, e.g. a FlexAttention BlockMask, are not carried) with `changes`.
    Host-built FlexAttention tables (`FLEX_HOST`) are carried, remapped; with `block_masks` they also
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
            host = m.__dict__.get(FLEX_HOST)
            if host:
                nm.__dict__[FLEX_HOST] = {key: (new[id(rows)], tuple(new[id(x)] for x in tables))
                                           for key, (rows, tables) in host.items()}
                if block_masks:
                    nm.__dict__["_flex_block_masks"] = {key: _flex_block_mask(nm, key, *v)
                                                        for key, v in nm.__dict__[FLEX_HOST].items()}
            masks[id(m)] = nm
        return masks[id(m)]

    fields = {n: (None if getattr(meta, n) is None else new[id(getattr(meta, n))]) for n in META_TENSORS}
    fields.update({n: mask(getattr(meta, n)) for n in META_MASKS})
    fields.update({n: (None if getattr(meta, n) is None else [mask(m) for m in getattr(meta, n)])
                   for n in META_MASK_LISTS})
    fields["chunks"] = None if meta.chunks is None else list(meta.chunks)
    fields["chunk_heads"] = None if meta.chunk_heads is None else list(meta.chunk_heads)
    fields["n_blocks"], fields["n_ctx"] = list(meta.n_blocks), list(meta.n_ctx)
    fields.update(changes)
    return dataclasses.replace(meta, **fields)


def compile_split(entries) -> tuple:
    """The plan of `apply_split` for `entries` = [(dtype, shape, byte offset)], each offset a multiple of its
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


def apply_split(buf: torch.Tensor, compiled: tuple) -> list:
    """Views of the flat uint8 tensor `buf` (any device, no copy) by a `compile_split` plan, in its entries'
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


def split_views(buf: torch.Tensor, entries) -> list:
    """Views of the flat uint8 tensor `buf` (any device) at `entries` = [(dtype, shape, byte offset)]
    (`compile_split` then `apply_split`), in the entries' order. Raises ValueError when an entry is
    misaligned, overlaps another one or lies outside `buf`."""
    return apply_split(buf, compile_split(entries))


#: attribute of a host-built IntervalMask: {(q_len, kv_len): (rows [n, q_len] int32, the 8 BlockMask tables)}
FLEX_HOST = "_flex_host_tables"


def _flex_block_mask(mask, key, rows, tables):
    """The BlockMask `kernels.flex.build_block_mask(mask, *key)` builds, from host-built tables (moved)."""
    kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = tables
    lo2, hi2 = (rows[2], rows[3]) if mask.has_union else (None, None)
    return flex.BlockMask(
        seq_lengths=tuple(key), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num,
        full_kv_indices=full_idx, q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx, BLOCK_SIZE=(flex.TILE, flex.TILE),
        mask_mod=flex._interval_mask_mod(rows[0], rows[1], lo2, hi2),
    )
