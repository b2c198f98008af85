"""The CP planner's cost model with sliding-window drafter layers (issue 23 item 2): per-rank predicted
costs equal an independent count of visible pairs, and LPT stays no worse than contiguous / zigzag."""

import numpy as np
import pytest

from megatron_splitkv.planning import CostModel, chunk_window_pair_counts, plan_context_parallel

B = 4


def random_anchors(lens, n, seed):
    rng = np.random.default_rng(seed)
    return [np.sort(rng.choice(L - 1, size=min(n, L - 1), replace=False)).astype(np.int64) if L >= 2
            else np.zeros(0, np.int64) for L in lens]


def brute_rank_pairs(plan, lens, anchors, window, block_size):
    """Per CP rank: (query row, context key) pairs a layer with `window` (None = full) serves from the rank's
    context tokens, by the definition of z-lab dflash's `_attention_mask` (query position a + j, keys of the
    same sequence with position < a and, with a window, a + j - position < window), token by token."""
    out = np.zeros(plan.cp_size)
    for r in range(plan.cp_size):
        seq, pos = plan.token_seq_ids(r), plan.token_positions(r)
        for j in range(len(lens)):
            p = pos[seq == j]
            for a in anchors[j]:
                for row in range(block_size):
                    vis = p < a
                    if window is not None:
                        vis &= (a + row) - p < window
                    out[r] += int(vis.sum())
    return out


CASES = [  # (seq_lens, anchors per sequence, cp_size, chunk_size, windows per layer)
    ([300, 41, 157], 12, 3, 32, (3,)),  # W < B: only rows 0, 1 see context
    ([300, 41, 157], 12, 2, 64, (64,)),  # W = the chunk
    ([300, 41, 157], 12, 4, 64, (50,)),  # W < a chunk
    ([513, 2, 90], 20, 3, 128, (1000,)),  # W > every sequence: the full cost
    ([256, 256], 30, 2, 64, (2, 40, None, 7, None)),  # a mix (the Qwen3.6 drafters: sliding + full)
    ([90], 40, 4, None, (16,)),  # anchors closer to the sequence start than W, automatic chunk
]


@pytest.mark.parametrize("strategy", ["lpt", "contiguous", "zigzag"])
@pytest.mark.parametrize("lens,n_anchors,cp,chunk,windows", CASES)
def test_rank_costs_equal_visible_pairs(lens, n_anchors, cp, chunk, windows, strategy):
    anchors = random_anchors(lens, n_anchors, seed=len(lens) + cp)
    cm = CostModel(attn_pair_cost=1.0, token_cost=0.0, layer_windows=windows)
    plan = plan_context_parallel(lens, anchors, block_size=B, cp_size=cp, chunk_size=chunk, strategy=strategy,
                                 cost_model=cm)
    want = sum(brute_rank_pairs(plan, lens, anchors, w, B) for w in windows) / len(windows)
    np.testing.assert_allclose(plan.loads, want, rtol=1e-12, atol=0)
    assert plan.loads.sum() > 0


@pytest.mark.parametrize("lens,n_anchors,cp,chunk,windows", CASES)
def test_rank_costs_equal_the_reference_mask(lens, n_anchors, cp, chunk, windows):
    """The same per-rank loads against `reference.dflash_attention_mask(..., window=W)` (the ops' ground truth,
    dflash's semantics) over each rank's context tokens."""
    import torch

    from megatron_splitkv.reference import dflash_attention_mask

    anchors = random_anchors(lens, n_anchors, seed=len(lens) + cp)
    cm = CostModel(attn_pair_cost=1.0, token_cost=0.0, layer_windows=windows)
    plan = plan_context_parallel(lens, anchors, block_size=B, cp_size=cp, chunk_size=chunk, cost_model=cm)
    q_seq = torch.as_tensor(np.repeat(np.arange(len(lens)), [len(a) for a in anchors]))
    q_anchor = torch.as_tensor(np.concatenate(anchors))
    want = np.zeros(cp)
    for r in range(cp):
        kv_seq, kv_pos = torch.as_tensor(plan.token_seq_ids(r)), torch.as_tensor(plan.token_positions(r))
        for w in windows:
            mask = dflash_attention_mask(q_seq, q_anchor, kv_seq, kv_pos, block_size=B, own_block=False, window=w,
                                         causal=w is not None)
            want[r] += int(mask.sum()) / len(windows)
    np.testing.assert_allclose(plan.loads, want, rtol=1e-12, atol=0)


def test_token_cost_and_coefficients_apply_to_windowed_layers():
    lens, anchors = [200, 77], random_anchors([200, 77], 15, seed=3)
    plain = plan_context_parallel(lens, anchors, block_size=B, cp_size=2, chunk_size=32, strategy="zigzag",
                                  cost_model=CostModel(1.0, 0.0, layer_windows=(9, None)))
    scaled = plan_context_parallel(lens, anchors, block_size=B, cp_size=2, chunk_size=32, strategy="zigzag",
                                   cost_model=CostModel(0.5, 3.0, layer_windows=(9, None)))
    tokens = np.array([len(plain.token_index(r)) for r in range(2)])
    np.testing.assert_allclose(scaled.loads, 0.5 * plain.loads + 3.0 * tokens, rtol=1e-12)


def test_window_pair_counts_match_a_dense_mask_count():
    """`chunk_window_pair_counts` per chunk, against a dense [rows x keys] mask built per anchor."""
    lens = np.array([70, 5, 33])
    anchors = random_anchors(lens, 9, seed=7)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    flat = np.concatenate([a + offsets[j] for j, a in enumerate(anchors)])
    ptr = np.concatenate([[0], np.cumsum([len(a) for a in anchors])])
    cs, cst, cen = [], [], []
    for j, L in enumerate(lens):
        for s in range(0, L, 8):
            cs.append(j), cst.append(offsets[j] + s), cen.append(offsets[j] + min(s + 8, L))
    for window in (1, 2, 5, 8, 100):
        got = chunk_window_pair_counts(flat, ptr, offsets, np.array(cs), np.array(cst), np.array(cen),
                                       block_size=B, window=window)
        for c, (j, s, e) in enumerate(zip(cs, cst, cen)):
            keys = np.arange(s, e) - offsets[j]
            q = (anchors[j][:, None] + np.arange(B)[None, :]).reshape(-1)  # query positions
            a = np.repeat(anchors[j], B)
            mask = (keys[None, :] < a[:, None]) & (q[:, None] - keys[None, :] < window)
            assert got[c] == mask.sum(), (window, j, s, e)


@pytest.mark.parametrize("seed", range(6))
def test_lpt_no_worse_than_contiguous_and_zigzag_with_windows(seed):
    rng = np.random.default_rng(100 + seed)
    lens = rng.integers(2, 3000, size=int(rng.integers(1, 6))).tolist()
    anchors = random_anchors(lens, int(rng.integers(4, 64)), seed=seed)
    cp = int(rng.integers(2, 9))
    windows = tuple(rng.choice([None, 16, 128, 1024], size=int(rng.integers(1, 6))).tolist())
    cm = CostModel(layer_windows=windows)
    kw = dict(block_size=16, cp_size=cp, cost_model=cm)
    lpt = plan_context_parallel(lens, anchors, strategy="lpt", **kw)
    for alt in ("contiguous", "zigzag"):
        other = plan_context_parallel(lens, anchors, strategy=alt, **kw)
        assert lpt.loads.max() <= other.loads.max() * (1 + 1e-12), (alt, windows)
        np.testing.assert_allclose(lpt.loads.sum(), other.loads.sum(), rtol=1e-9)


def test_windows_change_the_plan_where_they_change_the_cost():
    """A long sequence with W << context: the windowed cost is far below the full one, and LPT balances it."""
    lens = [4096]
    anchors = [np.arange(64, 4094, 64, dtype=np.int64)]
    full = plan_context_parallel(lens, anchors, block_size=16, cp_size=4, chunk_size=128,
                                 cost_model=CostModel(1.0, 0.0))
    win = plan_context_parallel(lens, anchors, block_size=16, cp_size=4, chunk_size=128,
                                cost_model=CostModel(1.0, 0.0, layer_windows=(256,) * 4))
    assert win.loads.sum() < 0.2 * full.loads.sum()  # each row sees <= 255 keys, not up to 4093
    assert win.imbalance <= 0.05
    # the full-attention plan's layout, costed with the windows, is worse balanced than the windowed plan
    stale = brute_rank_pairs(full, lens, anchors, 256, 16)
    assert stale.max() >= win.loads.max()


@pytest.mark.parametrize("bad,match", [
    ((), "non-empty"), ([0], r"layer_windows\[0\]"), ([None, -3], r"layer_windows\[1\]"),
    ([2.5], r"layer_windows\[0\]"), ([True], r"layer_windows\[0\]"), ("full", "non-empty"),
])
def test_bad_layer_windows(bad, match):
    with pytest.raises(ValueError, match=match):
        CostModel(layer_windows=bad)


def test_layer_windows_list_is_stored_as_tuple():
    cm = CostModel(layer_windows=[8, None, 8])
    assert cm.layer_windows == (8, None, 8) and cm.window_counts() == {8: 2, None: 1}
    assert hash(cm) == hash(CostModel(layer_windows=(8, None, 8)))
