"""Ranks disagreeing on the Split-KV config with host-built metadata (adversarial finding, session 8).

`prepare_splitkv_metadata` and the op without `metadata=` agree on the config's requests in their agreement
row; host-built metadata (`prepare_splitkv_metadata_from_plan` in a data worker, `bind` in the step) is built
per process with no collective: with num_chunks or cp_ranks_per_node differing (P = 4), the ranks would issue
different collectives. `ops.check_environment_agreement(cp_group, config=)` (collective, once per process;
pretrain_dflash calls it when its data pipeline is created) raises the same ValueError on every rank, naming
the field and the values by rank.
"""

import os
import sys

import numpy as np
import pytest
import torch

from _dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (config fields on rank 0, on the other ranks, what the message must say)
CASES = [
    (dict(), dict(num_chunks=2), "got [0, 2, 2, 2] (by rank)"),
    (dict(num_chunks=2), dict(num_chunks=1), "SplitKVConfig.num_chunks (requested num_chunks"),
    (dict(cp_ranks_per_node=2), dict(cp_ranks_per_node=4), "SplitKVConfig.cp_ranks_per_node (cp_ranks_per_node)"),
]


def _plan():
    from megatron_splitkv.planning import plan_context_parallel

    return plan_context_parallel([40, 24, 30], [np.array([3, 9, 20, 30]), np.array([5, 11]),
                                                np.array([1, 2, 7, 9, 12, 20])], block_size=4, cp_size=4, chunk_size=4)


def _check_worker(rank, world):
    from megatron_splitkv import SplitKVConfig
    from megatron_splitkv.ops import check_environment_agreement

    out = []
    for f0, f1, _ in CASES:
        try:
            check_environment_agreement(config=SplitKVConfig(**(f0 if rank == 0 else f1)))
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    # all equal: passes; then the host path it guards runs and is exact
    config = SplitKVConfig(num_chunks=3, cp_ranks_per_node=2)
    check_environment_agreement(config=config)
    from megatron_splitkv import dflash_attention_reference, splitkv_attention
    from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan

    plan = _plan()
    host = prepare_splitkv_metadata_from_plan(plan, rank, block_size=4, num_heads_q=2, num_heads_kv=1, head_dim=8,
                                              dtype=torch.float64, config=config)
    meta = host.bind(None, "cpu")
    gen = torch.Generator().manual_seed(11)
    nq, nk = plan.q_seq.shape[0] * 4, int(sum(plan.seq_lens))
    q_all, kb_all, vb_all = (torch.randn(nq, h, 8, generator=gen, dtype=torch.float64) for h in (2, 1, 1))
    k_all, v_all = (torch.randn(nk, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    starts = np.concatenate([[0], np.cumsum(plan.seq_lens)[:-1]])
    kv_seq_all = np.concatenate([np.full(n, i) for i, n in enumerate(plan.seq_lens)])
    kv_pos_all = np.concatenate([np.arange(n) for n in plan.seq_lens])
    ref, _ = dflash_attention_reference(q_all, k_all, v_all, kb_all, vb_all, torch.from_numpy(plan.q_seq),
                                     torch.from_numpy(plan.q_anchor), torch.from_numpy(kv_seq_all),
                                     torch.from_numpy(kv_pos_all), block_size=4)
    sl = plan.query_slice(rank)
    rows = slice(sl.start * 4, sl.stop * 4)
    idx = torch.from_numpy(starts[meta.kv_seq.numpy()] + meta.kv_pos.numpy())
    got = splitkv_attention(q_all[rows], k_all[idx], v_all[idx], kb_all[rows], vb_all[rows], metadata=meta,
                            backend="math")
    return out, meta.num_chunks_requested, float((got - ref[rows]).abs().max())


def test_environment_agreement_raises_the_same_error_on_every_rank():
    res = run_distributed(_check_worker, 4, timeout=300)
    for j, (f0, f1, want) in enumerate(CASES):
        msgs = {r[0][j] for r in res}
        assert len(msgs) == 1, (f0, f1, msgs)  # the same on every rank
        msg = msgs.pop()
        assert msg is not None and msg.startswith("check_environment_agreement: ") and want in msg, (f0, msg)
    for out, chunks, err in res:
        assert chunks == 3 and err < 1e-12, (chunks, err)


def _pretrain_worker(rank, world, fields):
    """examples/pretrain_dflash.py (CP = 2, host-built metadata, 0 data workers; tests/test_data_pipeline.py
    drives it) with the job's SplitKVConfig `fields` (args.splitkv_config, what validate_splitkv_args builds from
    the flags): fields[rank] on each rank. Returns the bound metadata's (chunk_axis, num_chunks, chunk_heads) or the
    ValueError message."""
    from megatron_splitkv import SplitKVConfig
    from test_data_pipeline import _Model, pretrain_in_worker

    mod = pretrain_in_worker("pretrain_dflash_config", rank, world)
    mod.get_args().splitkv_config = SplitKVConfig(**fields[rank])
    it = None
    try:  # raised when the data pipeline is created (before any metadata is built)
        it, _, _ = mod.train_valid_test_datasets_provider(None)
        model = _Model()
        mod.forward_step(it, model)
        m = model.metadata[-1]  # the bound metadata the drafter got
        return (m.chunk_axis, m.num_chunks, m.chunk_heads)
    except ValueError as exc:
        return str(exc)
    finally:
        if it is not None:
            it.close()


def test_pretrain_dflash_config_reaches_the_host_metadata():
    """Head chunks on both ranks: the metadata built in the pipeline splits the drafter's 2 kv heads (4 q heads)."""
    pytest.importorskip("megatron.core")
    fields = [dict(chunk_axis="heads", num_chunks=2)] * 2
    res = run_distributed(_pretrain_worker, 2, fields, timeout=240)
    assert res == [("heads", 2, [(0, 2), (2, 4)])] * 2, res


def test_pretrain_dflash_ranks_with_different_configs_raise_on_every_rank():
    """Ranks whose configs differ (num_chunks 1 on rank 0, 2 on rank 1): the check runs when the pipeline is created
    (train_valid_test_datasets_provider, before any metadata is built): the same ValueError on every rank."""
    pytest.importorskip("megatron.core")
    msgs = run_distributed(_pretrain_worker, 2, [dict(num_chunks=1), dict(num_chunks=2)], timeout=300)
    assert len(set(msgs)) == 1 and isinstance(msgs[0], str), msgs
    assert "SplitKVConfig.num_chunks (requested num_chunks, 0 = None) must be the same on every CP rank; " \
           "got [1, 2] (by rank)" in msgs[0], msgs[0]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
