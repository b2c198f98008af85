"""Bounded dense shapes of the staircase kernel (kernels/staircase.py; docs/kernels.md "Bounded dense
shapes") and the "auto" backend rule that may pick it (kernels/__init__.py `resolve_auto_backend`).

Checked on CPU, nothing needs a GPU:
  * the bucket lengths (k per octave, grain, limit) and the optimal piece split (brute force on small
    sets; sum <= length, non-increasing pieces, S(length) never decreasing);
  * the plan with bucketed rounding covers every visible (block, key) pair exactly once, for the
    query-major and the key-major rectangle sets, one and two levels, tiles and pieces; the key-major
    fallback for runs whose rectangle ends are not chained;
  * exactness of the kernel (CPU flash dense calls + math remainder) against the float64 reference with
    the new rounding, forward and backward with global stats;
  * the distinct dense shapes over random simulated training steps (tools/staircase_shapes.py's
    sampler, CP 1/2/8, the real defaults) stay inside `shape_bound` (35 (rows, keys) for the drafter:
    70 cuDNN graphs, the documented number);
  * options (key_buckets >= 1: the legacy rounding key_buckets=0 is no option) and the auto rule
    (SplitKVConfig.staircase_auto_min_keys semantics, group-wide keys, fallbacks).
Expected values never come from the code under test.
"""

import itertools
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_splitkv import SplitKVConfig, StaircaseOptions, kernels
from megatron_splitkv.kernels.base import IntervalMask
from megatron_splitkv.kernels.staircase import (
    StaircaseAttentionKernel,
    _key_major,
    dense_call_shapes,
    key_bucket_lengths,
    split_keys,
    staircase_plan,
)
from test_staircase_kernel import dflash_mask, make_inputs, run_and_check, seed_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import staircase_shapes as tool  # noqa: E402

#: the documented bound of the defaults for the drafter (B 16, Hq 32, Hkv 8): (rows, keys) shapes
DRAFTER_SHAPE_BOUND = 103


# ------------------------------------------------------------------------------------------ buckets
def test_bucket_lengths_by_hand():
    assert key_bucket_lengths(1, 512, 256, 16384) == (512, 1024, 2048, 4096, 8192, 16384)
    assert key_bucket_lengths(2, 512, 256, 16384) == (512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288,
                                                      16384)
    # 4 per octave: 640 and 896 round down to the grain (512, 768): merged in the lowest octave
    assert key_bucket_lengths(4, 512, 256, 2048) == (512, 768, 1024, 1280, 1536, 1792, 2048)
    assert key_bucket_lengths(2, 1, 1, 12) == (1, 2, 3, 4, 6, 8, 12)  # 1 and m * 2**e with 2 <= m < 4
    assert key_bucket_lengths(4, 1, 1, 20) == (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20)
    assert key_bucket_lengths(1, 600, 1, 5000) == (1024, 2048, 4096)  # min_keys is a floor
    assert key_bucket_lengths(2, 512, 256, 100) == ()
    with pytest.raises(ValueError):
        key_bucket_lengths(0, 512, 256, 4096)


def _brute(length, buckets, n):
    best = 0
    for r in range(n + 1):
        for combo in itertools.combinations_with_replacement(buckets, r):
            if sum(combo) <= length:
                best = max(best, sum(combo))
    return best


@pytest.mark.parametrize("buckets,n", [((3, 5, 7), 2), ((2, 3, 4, 6, 8, 12), 3), ((5, 6), 1), ((4, 6, 9), 3),
                                       ((1, 2, 3, 4, 6, 8, 12), 2)])
def test_split_keys_is_optimal_and_monotone(buckets, n):
    prev = 0
    for length in range(0, 60):
        got = split_keys(length, buckets, n)
        assert sum(got) == _brute(length, buckets, n), (length, got)
        assert len(got) <= n and all(b in buckets for b in got) and got == sorted(got, reverse=True)
        assert sum(got) >= prev  # S(length) never decreases: rectangle ends stay chained
        prev = sum(got)


def test_split_keys_tiles_then_pieces():
    b = key_bucket_lengths(2, 512, 256, 16384)
    assert split_keys(16384 * 3 + 1800, b, 2, 16384) == [16384] * 3 + [1024, 768]  # 1792 beats 1536
    assert split_keys(1600, b, 2, 16384) == [1536]  # = 1024 + 512: fewer pieces win the tie
    assert split_keys(16384 * 2 + 300, b, 2, 16384) == [16384] * 2
    assert split_keys(20000, b, 1, 16384) == [16384, 3072]
    assert split_keys(500, b, 2, 16384) == []


# ------------------------------------------------------------------------------------------ plans
def _coverage(mask, plan, rects):
    keys = torch.arange(mask.num_keys)
    cover = torch.zeros(mask.num_blocks, mask.num_keys, dtype=torch.long)
    blocks = plan.blocks.tolist()
    for p0, p1, k0, k1 in rects:
        for b in blocks[p0:p1]:
            cover[b, k0:k1] += 1
    if plan.rem is not None:
        cover += ((keys >= plan.rem.lo[:, None]) & (keys < plan.rem.hi[:, None])).long()
    return cover


BUCKETED = [  # (group_blocks, sub, min_group, key_buckets, key_pieces, max_tile_keys, min_keys)
    (4, 0, 1, 1, 1, 0, 1), (4, 0, 1, 2, 2, 8, 2), (4, 2, 1, 2, 2, 8, 2), (8, 2, 1, 1, 3, 16, 1),
    (6, 3, 2, 4, 2, 0, 3), (8, 4, 1, 2, 1, 4, 2), (16, 4, 1, 2, 2, 12, 4),
]


@pytest.mark.parametrize("gb,sub,mg,kb,kp,tile,mk", BUCKETED)
def test_bucketed_plan_covers_every_visible_pair_once(gb, sub, mg, kb, kp, tile, mk):
    """With bucketed rounding, every dense call's key count is a bucket length (<= the tile), the pieces
    of a group are contiguous from its base, and rectangles (query-major and key-major separately) plus
    the remainder cover every visible (block, key) pair exactly once."""
    gen = torch.Generator().manual_seed(seed_of("bcover", gb, sub, kb, kp, tile))
    mask = dflash_mask(gen, 60, 2, [90, 41, 7, 120], p_empty=0.1)
    plan = staircase_plan(mask, gb, mg, 1, mk, 1, sub, key_buckets=kb, key_pieces=kp, max_tile_keys=tile)
    limit = tile if tile else 1 << 12
    lengths = set(key_bucket_lengths(kb, mk, 1, limit))
    assert plan.groups, "no rectangle: the case does not test anything"
    for p0, p1, k0, k1 in plan.groups:
        assert k1 - k0 in lengths and (not tile or k1 - k0 <= tile)
    want = ((torch.arange(mask.num_keys) >= mask.lo[:, None]) & (torch.arange(mask.num_keys) < mask.hi[:, None]))
    for rects in (plan.groups, plan.key_major):
        assert torch.equal(_coverage(mask, plan, rects), want.long())
    assert plan.pairs_dense == sum(2 * (k1 - k0) * (p1 - p0) for p0, p1, k0, k1 in plan.groups)


@pytest.mark.parametrize("min_pairs,piece_min_pairs", [(40, 0), (60, 16), (1, 30)])
def test_piece_min_pairs_covers_exactly(min_pairs, piece_min_pairs):
    """piece_min_pairs below min_pairs: every piece has rows x keys >= piece_min_pairs, every group's
    pieces together >= min_pairs; coverage exact for both rectangle sets."""
    gen = torch.Generator().manual_seed(seed_of("pmp", min_pairs, piece_min_pairs))
    mask = dflash_mask(gen, 60, 2, [90, 41, 7, 120], p_empty=0.1)
    plan = staircase_plan(mask, 8, 1, 1, 2, min_pairs, 2, key_buckets=2, key_pieces=3, max_tile_keys=16,
                          piece_min_pairs=piece_min_pairs)
    assert plan.groups
    totals = {}
    for p0, p1, k0, k1 in plan.groups:
        assert (p1 - p0) * 2 * (k1 - k0) >= piece_min_pairs
        totals[(p0, p1)] = totals.get((p0, p1), 0) + (p1 - p0) * 2 * (k1 - k0)
    assert min(totals.values()) >= min_pairs
    want = ((torch.arange(mask.num_keys) >= mask.lo[:, None]) & (torch.arange(mask.num_keys) < mask.hi[:, None]))
    for rects in (plan.groups, plan.key_major):
        assert torch.equal(_coverage(mask, plan, rects), want.long())


def test_piece_min_pairs_defaults_to_min_pairs():
    assert StaircaseAttentionKernel(min_pairs=77).piece_min_pairs == 77
    assert StaircaseAttentionKernel(min_pairs=77, piece_min_pairs=5).piece_min_pairs == 5
    assert StaircaseAttentionKernel(StaircaseOptions(piece_min_pairs=9), min_pairs=77).piece_min_pairs == 9


def test_bucketed_pieces_by_hand():
    """One run of 8 blocks, one level, groups of 4, buckets 1 per octave (1, 2, 4, 8, 16), 2 pieces below
    the tile 16: the group with smallest hi 23 gets the tile [0, 16) then 4 + 2 (22 of 23 keys: two pieces
    at most), the one with smallest hi 45 two tiles then 8 + 4 (44); the remainder starts where each
    block's pieces end; key-major chunks [0, 22) and [22, 44)."""
    lo = torch.zeros(8, dtype=torch.long)
    hi = torch.tensor([23, 24, 30, 31, 45, 50, 60, 64])
    mask = IntervalMask(1, lo, hi, 64)
    p = staircase_plan(mask, 4, 1, 1, 1, 1, 0, key_buckets=1, key_pieces=2, max_tile_keys=16)
    assert [(p1 - p0, k0, k1) for p0, p1, k0, k1 in p.groups] == [(4, 0, 16), (4, 16, 20), (4, 20, 22), (4, 0, 16),
                                                                 (4, 16, 32), (4, 32, 40), (4, 40, 44)]
    assert p.rem.lo.tolist() == [22] * 4 + [44] * 4
    assert p.key_major == [(0, 8, 0, 22), (4, 8, 22, 44)]  # chained: chunks against the suffix


def test_key_major_falls_back_when_not_chained():
    """A run whose level-0 rectangle ends decrease (not produced by the optimal split, but the key-major
    builder must not rely on it): that run keeps its query-major rectangles."""
    groups = [(0, 2, 0, 8), (2, 4, 0, 4), (4, 6, 10, 14)]
    firsts = [(0, [0, 1], 0, 8), (0, [2, 3], 0, 4), (1, [4, 5], 10, 14)]
    pos_of = {b: b for b in range(6)}
    got = _key_major(firsts, groups, [0, 0, 0], pos_of)
    assert got == [(0, 2, 0, 8), (2, 4, 0, 4), (4, 6, 10, 14)]
    firsts[1] = (0, [2, 3], 0, 9)  # chained now: chunk [0, 8) to blocks 0..3, [8, 9) to 2..3
    got = _key_major(firsts, [(0, 2, 0, 8), (2, 4, 0, 9), groups[2]], [0, 0, 0], pos_of)
    assert got == [(0, 4, 0, 8), (2, 4, 8, 9), (4, 6, 10, 14)]


@pytest.mark.parametrize("name,val", [("key_buckets", -1), ("key_buckets", 0), ("key_pieces", 0), ("max_tile_keys", -5),
                                      ("key_buckets", 1.5), ("key_pieces", "x")])
def test_bucket_options_validated(name, val):
    with pytest.raises(ValueError, match=name):
        StaircaseAttentionKernel(**{name: val})
    with pytest.raises(ValueError, match=f"StaircaseOptions.{name}"):
        StaircaseOptions(**{name: val})


def test_tile_below_min_keys_means_no_dense_call():
    """max_tile_keys below min_keys: no bucket length fits, every block goes to the inner kernel (like a
    min_keys above every prefix), and the bound is empty."""
    kern = StaircaseAttentionKernel(max_tile_keys=256, min_keys=512)
    assert kern.shape_bound(16, 32, 8) == set()
    mask = IntervalMask(16, torch.zeros(4, dtype=torch.long), torch.full((4,), 5000), 5000)
    plan = kern.plan(mask)
    assert plan.groups == [] and plan.rem is not None and plan.rem.lo.tolist() == [0] * 4


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("kb,kp,tile", [(1, 1, 0), (2, 2, 8), (1, 3, 16), (4, 2, 0)])
@pytest.mark.parametrize("levels", ["one", "two"])
@pytest.mark.parametrize("bwd_mode", ["query", "key"])
def test_bucketed_kernel_matches_float64_reference(kb, kp, tile, levels, bwd_mode):
    """The kernel with bucketed rounding (several pieces per rectangle, tiles, pieces at both levels)
    against the float64 reference: out, lse and the three gradients with global stats, own block on."""
    gen = torch.Generator().manual_seed(seed_of("bexact", kb, kp, tile, levels, bwd_mode))
    mask = dflash_mask(gen, 36, 2, [70, 9, 55], p_empty=0.1, own=True)
    q, k, v, dout = make_inputs(gen, mask, 4, 2, 8, torch.float64)
    opts = dict(group_blocks=8 if levels == "two" else 4, sub_group_blocks=2 if levels == "two" else 0,
                min_group_blocks=1, key_grain=1, min_keys=2, min_pairs=1)
    kern = StaircaseAttentionKernel(key_buckets=kb, key_pieces=kp, max_tile_keys=tile, bwd_mode=bwd_mode, **opts)
    run_and_check(kern, mask, q, k, v, dout, 0.35, gen, 1e-10)
    plan = kern.plan(mask)
    assert kern.counts["dense_fwd"] == len(plan.groups) > 0
    spans = {(p0, p1) for p0, p1, _, _ in plan.groups}
    assert len(spans) < len(plan.groups) or kp == 1 and not tile  # several pieces per group ran


def test_bucketed_low_precision_within_tolerance():
    gen = torch.Generator().manual_seed(seed_of("blp"))
    mask = dflash_mask(gen, 16, 4, [64, 48])
    q, k, v, dout = make_inputs(gen, mask, 8, 2, 16, torch.float32)
    kern = StaircaseAttentionKernel(group_blocks=2, min_group_blocks=1, key_grain=1, min_keys=2, min_pairs=1,
                                    sub_group_blocks=0, key_buckets=2, key_pieces=2, max_tile_keys=16)
    run_and_check(kern, mask, q, k, v, dout, 0.25, gen, 1e-5)
    assert kern.counts["dense_fwd"] > 0


# ------------------------------------------------------------------------------------------ shape counts
def test_dense_call_shapes_by_hand():
    lo = torch.zeros(8, dtype=torch.long)
    hi = torch.tensor([23, 24, 30, 31, 45, 50, 60, 64])
    plan = staircase_plan(IntervalMask(1, lo, hi, 64), 4, 1, 1, 1, 1, 0, key_buckets=1, key_pieces=2,
                          max_tile_keys=16)
    fold = dense_call_shapes(plan, 1, 8, 2, 64, torch.bfloat16)
    assert [(s.direction, s.heads, s.rows, s.keys) for s in fold[:3]] == [("fwd", 2, 16, 16), ("fwd", 2, 16, 4),
                                                                          ("fwd", 2, 16, 2)]
    assert len(fold) == 2 * len(plan.groups) and fold[0].dtype == "bfloat16"
    native = dense_call_shapes(plan, 1, 8, 2, 64, torch.float16, gqa="native", bwd_mode="key")
    assert {(s.heads, s.rows) for s in native if s.direction == "fwd"} == {(8, 4)}
    assert [s.keys for s in native if s.direction == "bwd"] == [22, 22]  # the key-major chunks
    with pytest.raises(ValueError):
        dense_call_shapes(plan, 1, 8, 2, 64, bwd_mode="auto")


def test_shape_bound_of_the_defaults_is_the_documented_number():
    kern = StaircaseAttentionKernel()
    bound = kern.shape_bound(16, 32, 8)
    assert len(bound) == DRAFTER_SHAPE_BOUND
    assert {r for r, _ in bound} == {n * 64 for n in (8, 16, 32, 64, 128)}
    assert max(k for _, k in bound) == kern.max_tile_keys == 65536
    assert all(r // 4 * k >= kern.min_pairs for r, k in bound)  # unfolded rows x keys >= min_pairs


def _args(**kw):
    a = dict(dist="loguniform", min_len=4096, max_len=131072, max_tokens=131072, max_seqs=0, anchors=512,
             anchors_per="seq")
    a.update(kw)
    return SimpleNamespace(**a)


@pytest.mark.parametrize("dist,anchors_per", [("loguniform", "seq"), ("uniform", "batch")])
def test_shapes_over_random_steps_stay_bounded(dist, anchors_per):
    """Simulated training steps (random packed batches of 4K-128K sequences, 512 anchors, LPT at CP 1, 2
    and 8, Split-KV's calls on every rank): the default kernel's dense shapes (forward and backward) lie
    in `shape_bound` (<= 2 x 103 cuDNN graphs)."""
    from tools import benchlib as bench

    seed = seed_of("steps", dist, anchors_per)
    rng = np.random.default_rng(seed)
    new = StaircaseAttentionKernel(inner="math")
    bound = new.shape_bound(16, 32, 8)
    seen_new = set()
    args = _args(dist=dist, anchors_per=anchors_per)
    for _ in range(8):
        lens, anchors = tool.sample_batch(rng, args)
        for P in (1, 2, 8):
            plan = bench.place(lens, anchors, cp_size=P, block_size=16)
            for rank in range(P):
                for mask, _ in tool.call_masks(plan, rank, "splitkv"):
                    seen_new.update(new.call_shapes(mask, 32, 8, 128))
    assert {(s.rows, s.keys) for s in seen_new} <= bound, seed
    assert len(seen_new) <= 2 * DRAFTER_SHAPE_BOUND
    assert {s.direction for s in seen_new} == {"fwd", "bwd"}


def test_tool_runs_and_reports(tmp_path):
    out = tmp_path / "s.md"
    rc = tool.main(["--steps", "1,2", "--cp", "1,2", "--sizes", "8192,32768", "--max-tokens", "40000",
                    "--max-len", "40000", "--quiet", "--out", str(out), "--json", str(tmp_path / "s.json")])
    assert rc == 0
    text = out.read_text()
    assert "| 2 | default |" in text and "| 2 | fewer |" in text and "| 32768 |" in text


@pytest.mark.parametrize("argv", [["--variants", "x:nosuch=1"], ["--variants", "x:streams=2"], ["--cp", "0"],
                                  ["--variants", "a;a"], ["--variants", "x:key_buckets=-1"], ["--min-len", "1"]])
def test_tool_flag_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(argv)
    assert e.value.code == 2


# ------------------------------------------------------------------------------------------ auto
@pytest.fixture
def cuda_like(monkeypatch):
    """Pretend flex imports and cuDNN SDPA can run (no GPU needed: only the decision is tested)."""
    monkeypatch.setattr(kernels, "_flex_importable", lambda: True)
    monkeypatch.setattr(kernels, "staircase_runs_on", lambda d, dt, hd=None: dt in (torch.bfloat16, torch.float16))


def test_auto_picks_staircase_from_the_threshold(cuda_like):
    r = kernels.resolve_auto_backend
    assert r(32768, "cuda", torch.bfloat16, 128) == "staircase"
    assert r(32767, "cuda", torch.bfloat16, 128) == "flex"
    assert r(None, "cuda", torch.bfloat16, 128) == "flex"  # keys unknown: never staircase
    assert r(10 ** 6, "cuda", torch.float32, 128) == "flex"  # cuDNN cannot run it
    assert r(10 ** 6, "cuda", torch.float64, 128) == "math"
    assert r(10 ** 6, "cpu", torch.bfloat16, 128) == "math"
    assert r(10 ** 6, "cuda", torch.bfloat16, 8) == "math"
    def keys(n):
        return SplitKVConfig(staircase_auto_min_keys=n)

    assert r(10 ** 6, "cuda", torch.bfloat16, 128, keys(0)) == "flex"  # 0: never staircase
    assert r(1, "cuda", torch.bfloat16, 128, keys(1)) == "staircase"
    assert r(65535, "cuda", torch.bfloat16, 128, keys(65536)) == "flex"
    assert r(65536, "cuda", torch.bfloat16, 128, keys(65536)) == "staircase"


def test_get_kernel_auto_with_keys(cuda_like, monkeypatch):
    monkeypatch.setattr(kernels, "_CACHE", {})
    k = kernels.get_kernel("auto", "cuda", torch.bfloat16, head_dim=128, keys_per_call=40000)
    assert isinstance(k, StaircaseAttentionKernel)
    assert kernels.get_kernel("staircase", "cuda", torch.bfloat16) is k  # one cached instance
    assert type(kernels.get_kernel("auto", "cpu", torch.float64, keys_per_call=10 ** 6)).__name__ == \
        "MathAttentionKernel"


def test_auto_keys_per_call_is_group_wide():
    n_ctx = [30000, 41000, 0, 12000]
    assert kernels.auto_keys_per_call("splitkv", n_ctx) == 41000
    assert kernels.auto_keys_per_call("ring_kv", n_ctx) == kernels.auto_keys_per_call("ring-kv", n_ctx) == 41000
    assert kernels.auto_keys_per_call("allgather_kv", n_ctx) == 83000
    with pytest.raises(ValueError):
        kernels.auto_keys_per_call("nope", n_ctx)


def test_staircase_runs_on_without_a_gpu():
    """The real check on this host: never staircase for CPU / unsupported dtypes / head dims, and no
    exception where CUDA is missing."""
    assert not kernels.staircase_runs_on("cpu", torch.bfloat16, 128)
    assert not kernels.staircase_runs_on("cuda", torch.float32, 128)
    assert not kernels.staircase_runs_on("cuda", torch.bfloat16, 100)
    assert not kernels.staircase_runs_on("cuda", None, 128)
    if not torch.cuda.is_available():
        assert not kernels.staircase_runs_on("cuda", torch.bfloat16, 128)
        assert kernels.resolve_auto_backend(10 ** 6, "cuda", torch.bfloat16, 128) in ("flex", "math")
