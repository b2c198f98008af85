"""The planner-driven `get_batch_on_this_cp_rank` replacement for drafter batches (single process)."""

import argparse

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_splitkv.megatron.sharding import (  # noqa: E402
    get_batch_on_this_cp_rank_splitkv,
    planner_kwargs_from_args,
)


def _batch():
    lens = [300, 40, 500]
    T = sum(lens)
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 1000, (T,), generator=g),
        "loss_mask": torch.ones(T, dtype=torch.bool),
        "hidden_states": torch.randn(T, 6, generator=g),
    }
    rng = np.random.default_rng(0)
    anchors = [np.sort(rng.choice(n - 1, size=min(8, n - 1), replace=False)) for n in lens]
    return batch, lens, anchors


@pytest.mark.parametrize("strategy", ["lpt", "zigzag", "contiguous"])
def test_shards_cover_the_batch_with_global_positions(strategy):
    batch, lens, anchors = _batch()
    cp = 4
    offsets = np.concatenate([[0], np.cumsum(lens)])
    seen = []
    n_blocks = None
    for r in range(cp):
        local, params, plan = get_batch_on_this_cp_rank_splitkv(
            batch, seq_lens=lens, anchors=anchors, block_size=4, chunk_size=128 if strategy == "lpt" else None,
            strategy=strategy, cp_rank=r, cp_size=cp,
        )
        params.validate()
        idx = torch.as_tensor(local["token_index"])
        seen.append(idx)
        # metadata = global sequence ids / positions of exactly the tokens this rank holds
        seq = torch.as_tensor(np.searchsorted(offsets, idx.numpy(), side="right") - 1)
        assert torch.equal(params.kv_seq, seq)
        assert torch.equal(params.kv_pos, idx - torch.as_tensor(offsets)[seq])
        assert torch.equal(local["hidden_states"], batch["hidden_states"][idx])
        assert params.block_size == 4 and params.kv_seq.dtype == torch.int64
        n_blocks = params.num_blocks if n_blocks is None else n_blocks
        assert params.num_blocks == n_blocks  # equal query blocks per rank
    allidx = torch.cat(seen).sort().values
    assert torch.equal(allidx, torch.arange(sum(lens)))


def test_planner_kwargs_from_args():
    a = argparse.Namespace(cp_chunk_size=256, cp_balance="zigzag", dflash_block_size=8)
    assert planner_kwargs_from_args(a) == {"chunk_size": 256, "strategy": "zigzag", "block_size": 8, "cost_model": None}


def test_plan_size_mismatch_is_an_error():
    batch, lens, anchors = _batch()
    _, _, plan = get_batch_on_this_cp_rank_splitkv(batch, seq_lens=lens, anchors=anchors, block_size=4,
                                                   cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match="cp_size"):
        get_batch_on_this_cp_rank_splitkv(batch, seq_lens=lens, anchors=anchors, block_size=4, plan=plan,
                                          cp_rank=0, cp_size=4)
