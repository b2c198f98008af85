"""The rewritten per-step metadata pieces (docs/lab/perf-notes.md "Prepare cost (item 13)") against the
formulas they replace, on random inputs: bit-identical results, the same errors.

- `ops.prepare._finish` for splitkv (one [4, P, nb_max] interval table for all chunks, the context sort
  decided after the fact, one host read) vs the former per-chunk `intervals` + `with_own_blocks` +
  `sort_keys` (copied below as the reference), at P = 1 and, with the block-metadata all-gather replaced
  by the other ranks' blocks, at P > 1 (uneven block counts, any rank).
- `IntervalMask.validate` / `validate_flags` vs the former `validate` (same verdict, same message).
- `kernels.flex.build_block_mask` (tables and the transposed q tables from one tile classification) vs the
  former `_row_intervals` + `interval_block_tables` + `BlockMask.from_kv_blocks`; `interval_block_tables`.
- the range check read at the end of a size-1 prepare still raises first, with the same message.
- tools/prepare_cost.py runs (no thresholds: the counts are reported, not tested).

The references live here, not in the library.
"""

import os
import subprocess
import sys

import pytest
import torch

from _splitkv_helpers import new_seed, small_inputs, with_random_own_slots

from megatron_splitkv.config import SplitKVConfig  # noqa: E402
from megatron_splitkv import prepare_splitkv_metadata, splitkv_attention
from megatron_splitkv.comm import CommGroup
from megatron_splitkv.kernels.base import IntervalMask
from megatron_splitkv.ops import metadata as md
from megatron_splitkv.ops import prepare
from megatron_splitkv.ops.validation import HostReads

flex = pytest.importorskip("megatron_splitkv.kernels.flex")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INT32 = 1 << 31


# ----------------------------------------------------------------------------- the former formulas


def ref_context_keys(kv_seq, kv_pos):
    return kv_seq * (1 << 32) + (kv_pos + _INT32)


def ref_sort_keys(keys):
    if keys.numel() <= 1 or bool((keys[1:] >= keys[:-1]).all()):
        return keys, None
    return torch.sort(keys, stable=True)


def ref_intervals(keys_sorted, block_seq, block_anchor, block_size):
    base = block_seq * (1 << 32)
    lo = torch.searchsorted(keys_sorted, base)
    hi = torch.searchsorted(keys_sorted, base + (block_anchor.clamp(0, _INT32) + (_INT32 - 1)), right=True)
    hi = torch.where(block_anchor >= 0, hi, lo)
    return IntervalMask(block_size, lo, hi, int(keys_sorted.shape[0]))


def ref_validate(m):
    """The former `IntervalMask.validate`."""
    n = m.num_blocks
    if n == 0:
        return m
    live = m.hi > m.lo
    zero = torch.zeros((), dtype=torch.bool)
    checks = [(live & ((m.lo < 0) | (m.hi > m.num_ctx_keys))).any()]
    if m.has_union:
        length = m.hi2 - m.lo2
        own = length > 0
        checks.append(((length != 0) & (length != m.block_size)).any())
        checks.append((own & ((m.lo2 < m.num_ctx_keys) | (m.hi2 > m.num_keys))).any())
        starts = torch.sort(torch.where(own, m.lo2, torch.full_like(m.lo2, -1))).values
        gaps = starts[1:] - starts[:-1]
        checks.append(((starts[1:] >= 0) & (starts[:-1] >= 0) & (gaps < m.block_size)).any() if n > 1 else zero)
    names = ["first intervals must lie in [0, num_ctx_keys)",
             f"second intervals must have length 0 or block_size={m.block_size}",
             "second intervals must lie in [num_ctx_keys, num_keys)",
             "second intervals must be pairwise disjoint"]
    for flag, what in zip(torch.stack(checks).tolist(), names):
        if flag:
            raise ValueError(f"IntervalMask: {what} (num_ctx_keys={m.num_ctx_keys}, num_keys={m.num_keys})")
    return m


def ref_with_own_blocks(mask, valid, num_own_blocks, first_block=0, first_key_block=0):
    bsz = mask.block_size
    c0 = -(-int(mask.num_keys) // 128) * 128
    n = int(valid.shape[0])
    start = c0 + (first_key_block + torch.arange(n, dtype=torch.int64)) * bsz
    lo2 = torch.full((mask.num_blocks,), c0, dtype=torch.int64)
    hi2 = lo2.clone()
    lo2[first_block:first_block + n] = torch.where(valid, start, c0)
    hi2[first_block:first_block + n] = torch.where(valid, start + bsz, c0)
    return ref_validate(IntervalMask(bsz, mask.lo, mask.hi, c0 + num_own_blocks * bsz, lo2, hi2, num_ctx_keys=c0))


def ref_finish_splitkv(q_seq, q_anchor, kv_seq, kv_pos, block_meta, n_blocks, rank, bsz, num_chunks):
    """The former `_finish` for splitkv (block_meta: the gathered [P * nb_max, 2] rows)."""
    P, nb_max, nb_local = len(n_blocks), max(n_blocks), n_blocks[rank]
    valid = q_anchor >= 0
    keys, order = ref_sort_keys(ref_context_keys(kv_seq, kv_pos))
    chunks = md.chunk_bounds(num_chunks, nb_max)
    by_rank = block_meta.view(P, nb_max, 2)
    masks, masks_own = [], []
    for b0, b1 in chunks:
        blocks = by_rank[:, b0:b1].reshape(-1, 2)
        m = ref_intervals(keys, blocks[:, 0], blocks[:, 1], bsz)
        own = valid[b0:max(b0, min(b1, nb_local))]
        masks.append(m)
        masks_own.append(ref_with_own_blocks(m, own, nb_local, first_block=rank * (b1 - b0), first_key_block=b0))
    return dict(valid=valid, valid_rows=valid.repeat_interleave(bsz), keys=keys, order=order, chunks=chunks,
                masks=masks, masks_own=masks_own)


def ref_row_intervals(mask, n_rows_padded):
    B = mask.block_size
    pad = n_rows_padded - mask.num_blocks * B

    def rows(x):
        if x is None:
            return None
        r = x.to(torch.int32).repeat_interleave(B)
        return torch.cat([r, torch.zeros(pad, dtype=torch.int32)]) if pad else r

    return rows(mask.lo), rows(mask.hi), rows(mask.lo2), rows(mask.hi2)


def ref_interval_block_tables(lo_row, hi_row, q_len, kv_len, tile=128, rows_per_block=1, lo2_row=None, hi2_row=None):
    nq, nk = q_len // tile, kv_len // tile
    kstart = torch.arange(0, kv_len, tile, dtype=torch.int32)
    kend = kstart + tile

    def per_tile(x):
        x = x.to(torch.int32).reshape(nq, tile)
        if rows_per_block > 1 and tile % rows_per_block == 0:
            x = x[:, ::rows_per_block]
        return x[:, :, None]

    def touch_cover(lo_r, hi_r):
        lo3, hi3 = per_tile(lo_r), per_tile(hi_r)
        return (hi3 > lo3) & (lo3 < kend) & (hi3 > kstart), (lo3 <= kstart) & (hi3 >= kend)

    touches, covers = touch_cover(lo_row, hi_row)
    if lo2_row is not None:
        t2, c2 = touch_cover(lo2_row, hi2_row)
        touches, covers = touches | t2, covers | c2
    needed, full = touches.any(1), covers.all(1)
    sel = torch.stack([needed & ~full, full])
    num = sel.sum(-1, dtype=torch.int32)
    idx = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num[0][None, None], idx[0][None, None], num[1][None, None], idx[1][None, None]


def ref_block_mask(mask, q_len, kv_len, tile=128):
    lo_row, hi_row, lo2_row, hi2_row = ref_row_intervals(mask, q_len)
    tables = ref_interval_block_tables(lo_row, hi_row, q_len, kv_len, tile, rows_per_block=mask.block_size,
                                       lo2_row=lo2_row, hi2_row=hi2_row)
    bm = flex.BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=(tile, tile), seq_lengths=(q_len, kv_len))
    return bm, (lo_row, hi_row, lo2_row, hi2_row)


# ----------------------------------------------------------------------------- helpers


def same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), what


def same_mask(a, b, what):
    assert (a.block_size, a.num_keys, a.num_ctx_keys, a.has_union) == (b.block_size, b.num_keys, b.num_ctx_keys,
                                                                      b.has_union), what
    for f in ("lo", "hi", "lo2", "hi2"):
        same(getattr(a, f), getattr(b, f), f"{what}.{f}")


def random_metadata(gen, nb, tk, n_seqs, sorted_ctx, p_invalid=0.2, pos_span=5000, neg_seq=False):
    """q_seq / q_anchor [nb] (some invalid: anchor -1), kv_seq / kv_pos [tk] (sorted or shuffled; with
    duplicates and, with neg_seq, negative sequence ids)."""
    lo_seq = -3 if neg_seq else 0
    kv_seq = torch.randint(lo_seq, lo_seq + n_seqs, (tk,), generator=gen)
    kv_pos = torch.randint(-5, pos_span, (tk,), generator=gen)
    if sorted_ctx:
        keys = ref_context_keys(kv_seq, kv_pos)
        o = torch.argsort(keys, stable=True)
        kv_seq, kv_pos = kv_seq[o], kv_pos[o]
    q_seq = torch.randint(lo_seq, lo_seq + n_seqs + 1, (nb,), generator=gen)
    q_anchor = torch.randint(-2, pos_span + 10, (nb,), generator=gen)
    q_anchor = torch.where(torch.rand(nb, generator=gen) < p_invalid, torch.full_like(q_anchor, -1), q_anchor)
    if nb:
        q_anchor[0] = 1 << 40  # beyond 2**31: sees every position of its sequence (clamped)
    q_seq = torch.where(q_anchor >= 0, q_seq, torch.zeros_like(q_seq))
    return q_seq, q_anchor, kv_seq, kv_pos


# ----------------------------------------------------------------------------- _finish (splitkv)


_FINISH_CASES = [  # (n_blocks per rank, rank, tk, n_seqs, num_chunks, sorted context)
    ([40], 0, 700, 3, 1, True), ([40], 0, 700, 3, 2, False), ([33], 0, 5000, 1, 3, True),
    ([7], 0, 0, 2, 2, True), ([5], 0, 1, 1, 1, True), ([0], 0, 50, 1, 1, False), ([64], 0, 2000, 4, 4, False),
    ([10, 13], 0, 300, 2, 1, True), ([10, 13], 1, 300, 2, 2, False), ([13, 10, 0], 2, 400, 3, 3, True),
    ([8, 8, 8, 8], 3, 200, 2, 2, False), ([5, 9, 2], 1, 0, 2, 4, True), ([17, 3], 1, 900, 5, 5, False),
]


@pytest.mark.parametrize("case", range(len(_FINISH_CASES)))
def test_finish_splitkv_matches_former_formulas(case, monkeypatch):
    n_blocks, rank, tk, n_seqs, k, sorted_ctx = _FINISH_CASES[case]
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed + case)
    P, nb_max, B = len(n_blocks), max(n_blocks), 16
    ranks = [random_metadata(gen, n, tk if r == rank else 0, n_seqs, sorted_ctx, neg_seq=case % 2 == 1)
             for r, n in enumerate(n_blocks)]
    q_seq, q_anchor, kv_seq, kv_pos = ranks[rank]
    gathered = torch.cat([torch.cat([torch.stack([qs, qa], 1), torch.full((nb_max - len(qs), 2), -1)])
                          for qs, qa, _, _ in ranks])
    calls = []

    def fake_all_gather(x, group, op, async_op=False):  # the other ranks' block rows (P > 1)
        calls.append(op)
        assert op == "splitkv.fwd.block_meta" and torch.equal(x, gathered.view(P, nb_max, 2)[rank])
        return gathered.clone()

    monkeypatch.setattr(prepare, "all_gather", fake_all_gather)
    meta = md.SplitKVMetadata(
        impl="splitkv", group=CommGroup(None, P, rank), block_size=B, num_heads_q=4, num_heads_kv=2, head_dim=8,
        dtype=torch.float32, device=torch.device("cpu"), n_blocks=n_blocks, n_ctx=[tk] * P, q_seq=q_seq,
        q_anchor=q_anchor, kv_seq=kv_seq, kv_pos=kv_pos, num_chunks_requested=k)
    prepare._finish(meta, gather_ctx=True)
    ref = ref_finish_splitkv(q_seq, q_anchor, kv_seq, kv_pos, gathered, n_blocks, rank, B, meta.num_chunks)
    msg = f"seed {seed}, case {case}"
    assert calls == ["splitkv.fwd.block_meta"], msg
    for f in ("valid", "valid_rows", "keys", "order"):
        same(getattr(meta, f), ref[f], f"{msg}: {f}")
    if ref["order"] is None:
        assert meta.keys is not None and meta.order is None
    same(meta.block_meta, gathered, f"{msg}: block_meta")
    assert meta.chunks == ref["chunks"], msg
    assert len(meta.chunk_masks) == len(meta.chunk_masks_own) == meta.num_chunks
    for c in range(meta.num_chunks):
        same_mask(meta.chunk_masks[c], ref["masks"][c], f"{msg}: chunk {c}")
        same_mask(meta.chunk_masks_own[c], ref["masks_own"][c], f"{msg}: chunk {c} own")


def test_prepare_size_one_group_matches_former_formulas():
    """The public prepare at P = 1 (no process group): the same metadata as the former formulas."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    for k, sorted_ctx in ((1, True), (2, False), (3, True)):
        q_seq, q_anchor, kv_seq, kv_pos = random_metadata(gen, 37, 1500, 3, sorted_ctx)
        meta = prepare_splitkv_metadata(q_seq.int(), q_anchor, kv_seq, kv_pos, block_size=8, num_heads_q=4,
                                        num_heads_kv=2, head_dim=8, dtype=torch.float32, num_chunks=k)
        ref = ref_finish_splitkv(q_seq, q_anchor, kv_seq, kv_pos, torch.stack([q_seq, q_anchor], 1), [37], 0, 8,
                                 meta.num_chunks)
        same(meta.q_seq, q_seq, f"seed {seed}: q_seq")
        for f in ("valid", "valid_rows", "keys", "order"):
            same(getattr(meta, f), ref[f], f"seed {seed}: {f}")
        for c in range(meta.num_chunks):
            same_mask(meta.chunk_masks_own[c], ref["masks_own"][c], f"seed {seed}: chunk {c}")


def test_failing_table_validates_chunks_in_order(monkeypatch):
    """When the whole table's contract check fails, the chunks are validated one by one (raising the
    first chunk's first violation, as before); a violation no chunk has (two blocks of different chunks
    overlapping) raises nothing."""
    q_seq, q_anchor = torch.zeros(8, dtype=torch.int64), torch.arange(8) * 10
    kv_seq, kv_pos = torch.zeros(100, dtype=torch.int64), torch.arange(100)
    meta = prepare_splitkv_metadata(q_seq, q_anchor, kv_seq, kv_pos, block_size=4, num_heads_q=2, num_heads_kv=1,
                                    head_dim=4, dtype=torch.float32, num_chunks=2)
    m0, m1 = meta.chunk_masks_own
    ref_validate(m0), ref_validate(m1)
    # the fallback: every check of the table failing, the chunks fine -> no error; chunk 1 broken -> its error
    validated = []
    monkeypatch.setattr(IntervalMask, "validate", lambda self: validated.append(self) or ref_validate(self))
    check = _captured_check(meta)
    check([0, 0, 0, 0])
    assert validated == []  # the table passed: nothing more to read
    check([1, 1, 1, 1])
    assert validated == [m0, m1]
    m1.hi2[0] = m1.lo2[0] + 1  # length 1 != B
    with pytest.raises(ValueError, match="second intervals must have length 0 or block_size=4"):
        check([0, 1, 0, 0])


def _captured_check(meta):
    """The mask check `_finish_splitkv` registers (rebuilt on a fresh metadata with its reads captured)."""
    captured = []

    class Reads(HostReads):
        def add(self, tensors, use):
            captured.append(use)

        def read(self):
            pass

    fresh = md.SplitKVMetadata(
        impl="splitkv", group=meta.group, block_size=meta.block_size, num_heads_q=2, num_heads_kv=1, head_dim=4,
        dtype=torch.float32, device=meta.device, n_blocks=meta.n_blocks, n_ctx=meta.n_ctx, q_seq=meta.q_seq,
        q_anchor=meta.q_anchor, kv_seq=meta.kv_seq, kv_pos=meta.kv_pos, num_chunks_requested=2,
        config=SplitKVConfig(debug_checks=True))  # the check is registered only with debug checks on
    prepare._finish(fresh, gather_ctx=True, reads=Reads())
    check = captured[-1]
    fresh.chunk_masks_own[:] = meta.chunk_masks_own
    return check


# ----------------------------------------------------------------------------- validate


def _validate_case(gen, trial):
    """A valid mask (with or without second intervals), then, half of the time, one or two random
    corruptions of its values (each property of the contract, and overlaps of the second intervals)."""
    n = int(torch.randint(1, 12, (), generator=gen))
    B = int(torch.randint(1, 5, (), generator=gen))
    c0 = int(torch.randint(0, 40, (), generator=gen))
    lo = torch.randint(0, c0 + 1, (n,), generator=gen)
    hi = torch.minimum(lo + torch.randint(0, 8, (n,), generator=gen), torch.tensor(c0))
    if trial % 4 == 0:
        m = IntervalMask(B, lo, hi, c0 + 5, num_ctx_keys=c0)
    else:
        m = with_random_own_slots(gen, lo, hi, c0, B, 0.7, 1)
    for _ in range(int(torch.randint(0, 3, (), generator=gen)) if trial % 2 else 0):
        i, j = (int(v) for v in torch.randint(0, n, (2,), generator=gen))
        kind = int(torch.randint(0, 7, (), generator=gen))
        if kind == 0:
            m.lo[i], m.hi[i] = -1, max(int(m.hi[i]), 1)
        elif kind == 1:
            m.hi[i] = c0 + 1 + int(torch.randint(0, 3, (), generator=gen))
        elif kind == 2:
            m.hi[i] = m.lo[i] - 1  # an empty interval anywhere is fine
        elif m.has_union and kind == 3:
            m.hi2[i] = m.lo2[i] + int(torch.randint(1, B + 2, (), generator=gen))
        elif m.has_union and kind == 4:
            m.lo2[i] = m.hi2[i] = c0 - 1 - int(torch.randint(0, 2, (), generator=gen))
            m.hi2[i] += B
        elif m.has_union and kind == 5:
            m.lo2[i] = m.num_keys - B + 1
            m.hi2[i] = m.lo2[i] + B
        elif m.has_union and kind == 6 and i != j:
            m.lo2[i] = m.lo2[j] + int(torch.randint(-B + 1, B, (), generator=gen))
            m.hi2[i] = m.lo2[i] + B
    return m


def test_validate_matches_former_validate():
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    n_bad = 0
    for trial in range(400):
        m = _validate_case(gen, trial)
        try:
            ref_validate(m)
            want = None
        except ValueError as e:
            want = str(e)
            n_bad += 1
        if want is None:
            assert m.validate() is m, (seed, trial)
        else:
            with pytest.raises(ValueError) as exc:
                m.validate()
            assert str(exc.value) == want, (seed, trial)
        flags = m.validate_flags()
        assert (want is not None) == any(bool(f) for f in flags), (seed, trial)
    assert 20 < n_bad < 200, (seed, n_bad)  # both kinds were drawn
    # shape errors stay immediate (no flags)
    with pytest.raises(ValueError, match=r"IntervalMask.lo must be \[2\] int64"):
        IntervalMask(4, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 8).validate_flags()
    assert IntervalMask(4, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 8).validate_flags() == []


# ----------------------------------------------------------------------------- BlockMask


def _random_masks(gen):
    for B, n_blocks, num_ctx in [(16, 40, 1000), (16, 64, 4000), (3, 50, 700), (16, 8, 128), (128, 5, 900),
                                 (16, 32, 5), (7, 30, 2000), (16, 24, 0), (16, 256, 4096), (64, 3, 300)]:
        lo = torch.randint(0, num_ctx + 1, (n_blocks,), generator=gen)
        hi = torch.minimum(lo + torch.randint(0, num_ctx + 1, (n_blocks,), generator=gen), torch.tensor(num_ctx))
        hi = torch.where(torch.rand(n_blocks, generator=gen) < 0.2, lo, hi)
        if num_ctx:
            yield IntervalMask(B, lo, hi, num_ctx)
        yield with_random_own_slots(gen, lo, hi, num_ctx, B, 0.7, flex.TILE)
        yield with_random_own_slots(gen, lo, hi, num_ctx, B, 1.0, 1)  # region 2 not tile-aligned


def test_build_block_mask_matches_from_kv_blocks():
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
              "full_q_num_blocks", "full_q_indices")
    n = 0
    for mask in _random_masks(gen):
        rows = mask.num_blocks * mask.block_size
        for q_len, kv_len in {flex.padded_lengths(rows, mask.num_keys), flex.padded_lengths(rows + 300, mask.num_keys + 129, 1, 1)}:
            bm = flex.build_block_mask(mask, q_len, kv_len)
            ref, ref_rows = ref_block_mask(mask, q_len, kv_len)
            what = f"seed {seed}, B {mask.block_size}, blocks {mask.num_blocks}, union {mask.has_union}, {q_len}x{kv_len}"
            for f in fields:
                same(getattr(bm, f), getattr(ref, f), f"{what}: {f}")
            assert bm.seq_lengths == ref.seq_lengths and bm.BLOCK_SIZE == ref.BLOCK_SIZE, what
            for got, want in zip(flex._row_intervals(mask, q_len), ref_rows):
                same(got, want, f"{what}: rows")
            # the mask_mod reads the same per-row intervals
            q = torch.arange(q_len)[:, None]
            kv = torch.arange(kv_len)[None, :]
            z = torch.zeros((), dtype=torch.int64)
            assert torch.equal(bm.mask_mod(z, z, q, kv), flex._interval_mask_mod(*ref_rows)(z, z, q, kv)), what
            # the public table function
            for got, want in zip(flex.interval_block_tables(*ref_rows[:2], q_len, kv_len,
                                                            rows_per_block=mask.block_size, lo2_row=ref_rows[2],
                                                            hi2_row=ref_rows[3]),
                                 ref_interval_block_tables(*ref_rows[:2], q_len, kv_len,
                                                           rows_per_block=mask.block_size, lo2_row=ref_rows[2],
                                                           hi2_row=ref_rows[3])):
                same(got, want, f"{what}: interval_block_tables")
            n += 1
    assert n >= 40


# ----------------------------------------------------------------------------- errors of a size-1 prepare


def test_deferred_range_check_raises_first_with_the_same_message():
    x, m = small_inputs()
    kw = dict(block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8, dtype=torch.float32)
    bad = dict(m, kv_pos=m["kv_pos"] + (1 << 31))
    lo, hi = int(bad["kv_pos"].min()), int(bad["kv_pos"].max())
    want = rf"^prepare_splitkv_metadata: kv_pos values must lie in \[-2\*\*31, 2\*\*31\), got range \[{lo}, {hi}\]$"
    with pytest.raises(ValueError, match=want):
        prepare_splitkv_metadata(**bad, **kw)
    # before any other local error (num_chunks, cp_ranks_per_node), as when it was read at once
    with pytest.raises(ValueError, match=want):
        prepare_splitkv_metadata(**bad, **kw, num_chunks=0)
    with pytest.raises(ValueError, match=want):
        prepare_splitkv_metadata(**bad, **kw, cp_ranks_per_node=2)
    with pytest.raises(ValueError, match=r"^prepare_splitkv_metadata: num_chunks must be None or a positive int"):
        prepare_splitkv_metadata(**m, **kw, num_chunks=0)
    bad_q = dict(m, q_seq=torch.tensor([0, -(1 << 31) - 1, 0, 0]))
    with pytest.raises(ValueError, match=r"^prepare_splitkv_metadata: q_seq values must lie in .*got range "
                                         r"\[-2147483649, 0\]$"):
        prepare_splitkv_metadata(**bad_q, **kw, impl="splitkv")
    # the op without metadata= (same deferral): the range error before a bad num_chunks, as before
    args = (x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], bad["q_seq"], bad["q_anchor"], bad["kv_seq"],
            bad["kv_pos"])
    want_op = want.replace("prepare_splitkv_metadata", "splitkv")
    with pytest.raises(ValueError, match=want_op):
        splitkv_attention(*args, block_size=4)
    with pytest.raises(ValueError, match=want_op):
        splitkv_attention(*args, block_size=4, num_chunks=0)
    with pytest.raises(ValueError, match="^splitkv: backend must be one of"):  # checked before the metadata
        splitkv_attention(*args, block_size=4, backend="nope")
    # the baselines read it at once, as before
    with pytest.raises(ValueError, match=want.replace("$", "").replace("^", "")):
        prepare_splitkv_metadata(**bad, **kw, impl="ring-kv")


def test_host_reads_order_and_promotion():
    seen = []
    reads = HostReads()
    reads.add([torch.tensor(True), torch.tensor([5, -7])], lambda v: seen.append(("a", v)))
    reads.add([], lambda v: seen.append(("b", v)))
    reads.add([torch.tensor([(1 << 40) + 3])], lambda v: seen.append(("c", v)))
    reads.read()
    assert seen == [("a", [1, 5, -7]), ("b", []), ("c", [(1 << 40) + 3])]
    HostReads().read()  # nothing to read: no error


# ----------------------------------------------------------------------------- the tool


def test_prepare_cost_tool_runs(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "prepare_cost.py"), "--contexts", "2048",
                        "--num-chunks", "1,2", "--reps", "1", "--device", "cpu", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| context | k |" in r.stdout and out.exists()
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [row["num_chunks"] for row in rows] == [1, 2]
    assert all(row["prep_ops"] > 0 and row["mask_ops"] > 0 for row in rows)
