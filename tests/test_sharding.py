"""Tests of the CP data-sharding hook (megatron_splitkv.data.sharding): C8, round trip, q metadata."""

import numpy as np
import pytest
import torch

from megatron_splitkv.data import shard_batch, unshard
from megatron_splitkv.planning import STRATEGIES, plan_context_parallel
from megatron_splitkv.reference import dflash_attention_mask

B = 4


def rope(x, pos, base=10000.0):
    """Simple rotary embedding (float64), x [T, H, D] (D even), pos [T] int: rotate pairs (i, i + D/2)."""
    D = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, D // 2, dtype=torch.float64) * 2 / D)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def make_batch(lens, n_anchors, seed=0, H=6, torch_tensors=False):
    rng = np.random.default_rng(seed)
    T = int(sum(lens))
    mask = rng.random(T) < 0.7
    anchors = []
    o = 0
    for L in lens:
        m = mask[o:o + L]
        cand = np.flatnonzero(m[:-1] & m[1:]) if L >= 2 else np.zeros(0, np.int64)
        anchors.append(np.sort(rng.choice(cand, size=min(n_anchors, cand.size), replace=False)).astype(np.int64))
        o += L
    batch = {
        "input_ids": rng.integers(0, 1000, size=T).astype(np.int64),
        "loss_mask": mask,
        "hidden_states": rng.standard_normal((T, H)).astype(np.float32),
        "positions": np.concatenate([np.arange(L) for L in lens]).astype(np.int64) if T else np.zeros(0, np.int64),
        "seq_ids": np.repeat(np.arange(len(lens)), lens).astype(np.int64),
    }
    if torch_tensors:
        batch = {k: torch.from_numpy(v) for k, v in batch.items()}
    batch["anchors"] = anchors
    return batch


def test_c8_rope_with_out_of_order_chunks():
    lens = [37, 91]
    # seed 2: a batch where LPT's chunks beat the zigzag layout (with seed 1 the planner now returns zigzag,
    # whose ranks hold their pieces in order)
    batch = make_batch(lens, 6, seed=2, torch_tensors=True)
    P = 2
    plan = plan_context_parallel(lens, batch["anchors"], block_size=B, cp_size=P, chunk_size=16)
    # the planner placed chunks out of order: some rank holds non-adjacent chunks, and the placement
    # order is not the sequence order
    offs = [0, 37]
    starts = [[offs[j] + s for (j, s, e) in ch] for ch in plan.rank_chunks]
    assert any(st != sorted(st) for st in starts)
    assert any(np.any(np.diff(plan.token_index(r)) > 1) for r in range(P))

    T, H, D = sum(lens), 2, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(T, 1, D, generator=g, dtype=torch.float64)
    q_ref, k_ref = rope(q, batch["positions"]), rope(k, batch["positions"])
    local_ok = []
    for r in range(P):
        sh = shard_batch(batch, plan, r)
        idx = sh["token_index"]
        q_loc = rope(q[idx], sh["kv_pos"])
        k_loc = rope(k[idx], sh["positions"])
        torch.testing.assert_close(q_loc, q_ref[idx], rtol=0, atol=1e-12)
        torch.testing.assert_close(k_loc, k_ref[idx], rtol=0, atol=1e-12)
        # the fault C8 targets: shard-local positions (0..T_r-1) give different embeddings
        local_ok.append(torch.allclose(rope(q[idx], torch.arange(idx.shape[0])), q_ref[idx]))
    assert not all(local_ok)
    # the positions of each shard are the positions within the sequence
    sh1 = shard_batch(batch, plan, 1)
    torch.testing.assert_close(sh1["kv_pos"], batch["positions"][sh1["token_index"]])


@pytest.mark.parametrize("strategy", ["lpt", "contiguous", "zigzag"])
@pytest.mark.parametrize("use_torch", [False, True])
@pytest.mark.parametrize("lens, P", [([37, 91], 2), ([0, 300, 5, 1, 700], 4), ([3], 4), ([], 2)])
def test_round_trip(strategy, use_torch, lens, P):
    batch = make_batch(lens, 20, seed=2, torch_tensors=use_torch)
    plan = plan_context_parallel(lens, batch["anchors"], block_size=B, cp_size=P, strategy=strategy,
                                 chunk_size=32)
    shards = [shard_batch(batch, plan, r) for r in range(P)]
    back = unshard(shards, plan)
    for key in ("input_ids", "loss_mask", "hidden_states", "positions", "seq_ids"):
        if use_torch:
            assert back[key].dtype == batch[key].dtype
            assert torch.equal(back[key], batch[key])
        else:
            np.testing.assert_array_equal(back[key], batch[key])
    for key in ("kv_pos", "positions"):  # global positions on every shard
        for sh in shards:
            a = sh[key].numpy() if use_torch else sh[key]
            i = sh["token_index"].numpy() if use_torch else sh["token_index"]
            np.testing.assert_array_equal(a, np.asarray(batch["positions"])[i])
    np.testing.assert_array_equal(np.asarray(back["kv_seq"]), np.asarray(batch["seq_ids"]))
    # equal block counts per rank, multiple of P, anchors in order then padding
    n_local = {int(sh["q_seq"].shape[0]) for sh in shards}
    assert len(n_local) == 1
    q_anchor = np.asarray(back["q_anchor"])
    q_seq = np.asarray(back["q_seq"])
    n = sum(len(a) for a in batch["anchors"])
    assert q_anchor.shape[0] % P == 0 and q_anchor.shape[0] - n < P
    np.testing.assert_array_equal(q_anchor[:n], np.concatenate(batch["anchors"]) if n else [])
    np.testing.assert_array_equal(q_seq[:n], np.repeat(np.arange(len(lens)), [len(a) for a in batch["anchors"]]))
    assert np.all(q_anchor[n:] == -1) and np.all(q_seq[n:] == -1)
    np.testing.assert_array_equal(np.asarray(back["q_keep"]), q_anchor >= 0)
    np.testing.assert_array_equal(np.asarray(back["q_block_index"]), np.arange(q_anchor.shape[0]))


def test_query_labels_and_dtypes():
    lens = [40, 9, 60]
    batch = make_batch(lens, 10, seed=3)
    plan = plan_context_parallel(lens, batch["anchors"], block_size=B, cp_size=3)
    offs = np.concatenate([[0], np.cumsum(lens)])
    for r in range(3):
        sh = shard_batch(batch, plan, r)
        for key in ("q_seq", "q_anchor", "kv_seq", "kv_pos", "token_index", "q_labels"):
            assert sh[key].dtype == np.int64
        assert sh["q_label_mask"].dtype == bool and sh["q_labels"].shape == (sh["q_seq"].shape[0], B)
        for b in range(sh["q_seq"].shape[0]):
            j, a = sh["q_seq"][b], sh["q_anchor"][b]
            for kk in range(B):
                if a < 0:
                    assert sh["q_labels"][b, kk] == 0 and not sh["q_label_mask"][b, kk]
                    continue
                inside = a + kk < lens[j]
                want = batch["input_ids"][offs[j] + a + kk] if inside else 0
                assert sh["q_labels"][b, kk] == want
                assert sh["q_label_mask"][b, kk] == (inside and kk >= 1 and bool(batch["loss_mask"][offs[j] + a + kk]))
            if a >= 0:
                assert sh["q_anchor_token"][b] == batch["input_ids"][offs[j] + a]


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "hypergraph"])
def test_shards_reproduce_dflash_mask(strategy):
    """Shard-local mask metadata reproduces the global DFlash mask: the union over ranks of each rank's
    (all queries x local keys) visibility equals the single-process mask."""
    lens = [50, 70]
    batch = make_batch(lens, 7, seed=4)
    P = 3
    plan = plan_context_parallel(lens, batch["anchors"], block_size=B, cp_size=P, strategy=strategy,
                                 chunk_size=16)
    shards = [shard_batch(batch, plan, r) for r in range(P)]
    q_seq = torch.from_numpy(np.concatenate([s["q_seq"] for s in shards]))
    q_anchor = torch.from_numpy(np.concatenate([s["q_anchor"] for s in shards]))
    kv_seq = torch.from_numpy(batch["seq_ids"])
    kv_pos = torch.from_numpy(batch["positions"])
    T = sum(lens)
    ref = dflash_attention_mask(q_seq, q_anchor, kv_seq, kv_pos, block_size=B)[:, :T]
    got = torch.zeros_like(ref)
    for s in shards:
        m = dflash_attention_mask(q_seq, q_anchor, torch.from_numpy(s["kv_seq"]), torch.from_numpy(s["kv_pos"]),
                                  block_size=B)[:, : s["kv_seq"].shape[0]]
        got[:, torch.from_numpy(s["token_index"])] |= m
    assert torch.equal(got, ref)


def test_shard_errors():
    batch = make_batch([10, 20], 3)
    plan = plan_context_parallel([10, 20], batch["anchors"], block_size=B, cp_size=2)
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, 2\)"):
        shard_batch(batch, plan, 2)
    bad = dict(batch, hidden_states=np.zeros((29, 3)))
    with pytest.raises(ValueError, match=r"batch\['hidden_states'\] must be per-token"):
        shard_batch(bad, plan, 0)
    with pytest.raises(ValueError, match="input_ids"):
        shard_batch({"loss_mask": batch["loss_mask"]}, plan, 0)
    shards = [shard_batch(batch, plan, r) for r in range(2)]
    with pytest.raises(ValueError, match="need 2 shards"):
        unshard(shards[:1], plan)
