"""Ranks disagreeing on the Split-KV environment with host-built metadata (adversarial finding, session 8).

`prepare_splitkv_metadata` and the op without `metadata=` agree on MEGATRON_SPLITKV_NUM_CHUNKS /
_RANKS_PER_NODE / _FUSED_BWD_GATHER_MIN_P in their agreement row. Host-built metadata
(`prepare_splitkv_metadata_from_plan` + `bind`, the data pipeline's default in examples/pretrain_dflash.py)
read them per process with no collective: with MEGATRON_SPLITKV_NUM_CHUNKS or
MEGATRON_SPLITKV_RANKS_PER_NODE differing (P = 4), the ranks issued different collectives in the
op and gloo aborted the processes (SIGABRT; NCCL would hang or mix data). Now
`ops.check_environment_agreement(cp_group)` (collective, once per process; pretrain_dflash calls it at its
first micro-batch) raises the same ValueError on every rank, naming the variable and the values by rank.

CPU, gloo: the library check at P = 4 (each variable differing, a malformed value on one rank, all equal),
then the host path it guards (the op after the check passes equals the float64 reference); pretrain_dflash's
forward_step at CP = 2 with the chunk count differing across ranks.
"""

import os
import sys

import numpy as np
import pytest
import torch

from _dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_VARS = ("MEGATRON_SPLITKV_NUM_CHUNKS", "MEGATRON_SPLITKV_RANKS_PER_NODE", "MEGATRON_SPLITKV_FUSED_BWD_GATHER_MIN_P")

# (variable, value on rank 0, value on the other ranks, what the message must say); None = unset
CASES = [
    ("MEGATRON_SPLITKV_NUM_CHUNKS", None, "2", "got [0, 2, 2, 2] (by rank)"),
    ("MEGATRON_SPLITKV_NUM_CHUNKS", "2", "1", "MEGATRON_SPLITKV_NUM_CHUNKS (requested num_chunks"),
    ("MEGATRON_SPLITKV_RANKS_PER_NODE", "2", "4", "MEGATRON_SPLITKV_RANKS_PER_NODE (cp_ranks_per_node)"),
    ("MEGATRON_SPLITKV_FUSED_BWD_GATHER_MIN_P", "2", None, "MEGATRON_SPLITKV_FUSED_BWD_GATHER_MIN_P must be"),
    ("MEGATRON_SPLITKV_NUM_CHUNKS", "x", "2", "rank 0: MEGATRON_SPLITKV_NUM_CHUNKS must be a positive int"),
]


def _set(var, value):
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value


def _plan():
    from megatron_splitkv.planning import plan_context_parallel

    return plan_context_parallel([40, 24, 30], [np.array([3, 9, 20, 30]), np.array([5, 11]),
                                                np.array([1, 2, 7, 9, 12, 20])], block_size=4, cp_size=4, chunk_size=4)


def _check_worker(rank, world):
    from megatron_splitkv.ops import check_environment_agreement

    out = []
    for var, v0, v1, _ in CASES:
        for v in _VARS:
            os.environ.pop(v, None)
        _set(var, v0 if rank == 0 else v1)
        try:
            check_environment_agreement()
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    # all equal (some set, identically): passes; then the host path it guards runs and is exact
    for v in _VARS:
        os.environ.pop(v, None)
    os.environ["MEGATRON_SPLITKV_NUM_CHUNKS"] = "3"
    os.environ["MEGATRON_SPLITKV_RANKS_PER_NODE"] = "2"
    check_environment_agreement()
    from megatron_splitkv import dflash_attention_reference, splitkv_attention
    from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan

    plan = _plan()
    host = prepare_splitkv_metadata_from_plan(plan, rank, block_size=4, num_heads_q=2, num_heads_kv=1, head_dim=8,
                                              dtype=torch.float64)
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
    for j, (var, v0, v1, want) in enumerate(CASES):
        msgs = {r[0][j] for r in res}
        assert len(msgs) == 1, (var, msgs)  # the same on every rank
        msg = msgs.pop()
        assert msg is not None and msg.startswith("check_environment_agreement: ") and want in msg, (var, msg)
    for out, chunks, err in res:
        assert chunks == 3 and err < 1e-12, (chunks, err)


def _pretrain_worker(rank, world):
    """examples/pretrain_dflash.py's forward_step (CP = 2, host-built metadata, as tests/test_rerun_checkpoint.py
    drives it) with MEGATRON_SPLITKV_NUM_CHUNKS 1 on rank 0 and 2 on rank 1."""
    from test_data_pipeline import _Model, pretrain_in_worker

    os.environ["MEGATRON_SPLITKV_NUM_CHUNKS"] = str(1 + rank)
    mod = pretrain_in_worker("pretrain_dflash_env", rank, world)
    it = None
    try:  # raised when the data pipeline is created (before any metadata is built)
        it, _, _ = mod.train_valid_test_datasets_provider(None)
        mod.forward_step(it, _Model())
        return None
    except ValueError as exc:
        return str(exc)
    finally:
        if it is not None:
            it.close()


def test_pretrain_dflash_ranks_with_different_chunk_env_raise_on_every_rank():
    pytest.importorskip("megatron.core")
    msgs = run_distributed(_pretrain_worker, 2, timeout=300)
    assert len(set(msgs)) == 1 and msgs[0] is not None, msgs
    assert "MEGATRON_SPLITKV_NUM_CHUNKS (requested num_chunks, 0 = unset) must be the same on every CP rank; " \
           "got [1, 2] (by rank)" in msgs[0], msgs[0]


def _pretrain_malformed_worker(rank, world):
    """examples/pretrain_dflash.py (CP = 2, host-built metadata, 0 data workers): first with head chunks on both
    ranks (MEGATRON_SPLITKV_CHUNK_AXIS heads, NUM_CHUNKS 2), then with a Split-KV variable malformed on rank 1 only:
    MEGATRON_SPLITKV_CHUNK_AXIS 'Heads' (rank 0: 'heads'), MEGATRON_SPLITKV_NUM_CHUNKS '+2' (rank 0: '2'). Returns
    per scenario the bound metadata's (chunk_axis, num_chunks, chunk_heads) or the ValueError message."""
    from test_data_pipeline import _Model, pretrain_in_worker

    out = []
    for i, env in enumerate(({"MEGATRON_SPLITKV_CHUNK_AXIS": "heads", "MEGATRON_SPLITKV_NUM_CHUNKS": "2"},
                             {"MEGATRON_SPLITKV_CHUNK_AXIS": "Heads" if rank == 1 else "heads"},
                             {"MEGATRON_SPLITKV_NUM_CHUNKS": "+2" if rank == 1 else "2"})):
        for v in _VARS + ("MEGATRON_SPLITKV_CHUNK_AXIS",):
            os.environ.pop(v, None)
        os.environ.update(env)
        it = None
        try:
            mod = pretrain_in_worker(f"pretrain_dflash_malformed{i}", rank, world)
            it, _, _ = mod.train_valid_test_datasets_provider(None)
            model = _Model()
            mod.forward_step(it, model)
            m = model.metadata[-1]  # the bound metadata the drafter got
            out.append((m.chunk_axis, m.num_chunks, m.chunk_heads))
        except ValueError as exc:
            out.append(str(exc))
        finally:
            if it is not None:
                it.close()
    return out


def test_pretrain_dflash_variable_malformed_on_one_rank_raises_on_every_rank():
    """A Split-KV variable malformed on ONE rank (adversarial finding, session 9): the data pipeline built the
    host metadata before `check_environment_agreement` ran, so that rank raised alone (in the metadata build)
    and the other rank waited in the agreement's all-gather forever. Now the check runs when the pipeline is
    created (train_valid_test_datasets_provider, before any metadata is built): the same ValueError on every
    rank, naming the rank and the variable."""
    pytest.importorskip("megatron.core")
    res = run_distributed(_pretrain_malformed_worker, 2, timeout=240)
    # both ranks heads, 2 chunks: the metadata built in the pipeline splits the drafter's 2 kv heads (4 q heads)
    assert [r[0] for r in res] == [("heads", 2, [(0, 2), (2, 4)])] * 2, res
    for j, (var, bad) in enumerate((("MEGATRON_SPLITKV_CHUNK_AXIS", "'Heads'"),
                                    ("MEGATRON_SPLITKV_NUM_CHUNKS", "'+2'")), start=1):
        msgs = {r[j] for r in res}
        assert len(msgs) == 1, (var, msgs)  # the same on every rank
        msg = msgs.pop()
        assert msg is not None and msg.startswith("check_environment_agreement: ") and "rank 1" in msg \
            and var in msg and bad in msg, (var, msg)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
