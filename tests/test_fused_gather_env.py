"""Adversarial (s4): MEGATRON_SPLITKV_FUSED_BWD_GATHER_MIN_P must not split a CP group.

`ops.common.fuse_bwd_gather` reads the environment variable INSIDE `_SplitKV.backward`, on each rank on
its own, after the forward's collectives already ran; the result decides whether the backward issues one
all-gather ("splitkv.bwd.dout", packed) or two ("splitkv.bwd.dout" + "splitkv.bwd.stats"). Nothing
agrees it across the group (unlike num_chunks / cp_ranks_per_node, which travel in the agreement row), so:

- a malformed value on ONE rank raises ValueError there only, in backward; the other ranks block in the
  dO all-gather (NCCL: until the process-group timeout; gloo: until the failing process exits and the
  socket resets, then a RuntimeError that says nothing about the variable);
- valid but DIFFERENT values (e.g. "1" on rank 0, unset on rank 1, P = 2) give mismatched collectives:
  gloo aborts the process ("Received data size doesn't match expected size"), NCCL hangs or mixes bytes.

Correct behaviour (what the tests ask): every rank raises the same ValueError naming the variable (no
hang, no crash), or the call completes with exact results; and a malformed value is reported before the
backward's collectives (at the latest by the forward call, like MEGATRON_SPLITKV_NUM_CHUNKS).
"""

import os

import torch

import megatron_splitkv as msk
from _dist import run_distributed
from megatron_splitkv.ops.common import FUSED_BWD_GATHER_MIN_P_ENV


def _small(rank):
    g = torch.Generator().manual_seed(rank)
    nb, B, tk = 4, 4, 9
    x = {k: torch.randn(n, h, 8, generator=g, dtype=torch.float64).requires_grad_()
         for k, n, h in (("q", nb * B, 4), ("k_ctx", tk, 2), ("v_ctx", tk, 2), ("k_blk", nb * B, 2),
                         ("v_blk", nb * B, 2))}
    m = dict(q_seq=torch.zeros(nb, dtype=torch.int64), q_anchor=torch.tensor([0, 3, -1, 9]),
             kv_seq=torch.zeros(tk, dtype=torch.int64), kv_pos=torch.arange(tk))
    return x, m


def _worker(rank, world, envs):
    """envs[rank]: the variable's value on this rank (None: unset). Returns (where, exception type,
    message) of the first exception of forward / backward, or ("ok", grad checksum)."""
    v = envs[rank]
    if v is None:
        os.environ.pop(FUSED_BWD_GATHER_MIN_P_ENV, None)
    else:
        os.environ[FUSED_BWD_GATHER_MIN_P_ENV] = v
    x, m = _small(rank)
    try:
        out = msk.splitkv_attention(*x.values(), *m.values(), block_size=4, backend="math")
    except Exception as exc:  # noqa: BLE001
        return ("forward", type(exc).__name__, str(exc))
    try:
        out.sum().backward()
    except Exception as exc:  # noqa: BLE001
        return ("backward", type(exc).__name__, str(exc))
    return ("ok", float(x["q"].grad.abs().sum()))


def test_malformed_value_on_one_rank_raises_the_same_valueerror_on_every_rank():
    res = run_distributed(_worker, 2, ["x", None], timeout=120)
    for r, got in enumerate(res):
        assert got[0] != "ok" and got[1] == "ValueError" and FUSED_BWD_GATHER_MIN_P_ENV in got[2], (r, got)
    assert res[0][2] == res[1][2], res


def test_different_valid_values_do_not_split_the_collectives():
    """P = 2: "1" on rank 0 (fused), unset on rank 1 (default 9: separate gathers)."""
    res = run_distributed(_worker, 2, ["1", None], timeout=60)
    if all(r[0] == "ok" for r in res):
        ref = run_distributed(_worker, 2, [None, None], timeout=60)
        assert [r[1] for r in res] == [r[1] for r in ref]
    else:
        for r, got in enumerate(res):
            assert got[1] == "ValueError" and FUSED_BWD_GATHER_MIN_P_ENV in got[2], (r, got)


def test_malformed_value_is_reported_by_the_forward_call():
    """Same bad value everywhere: before the fix the error surfaced only in backward, after a whole
    forward (and, in a model, after every layer's forward) ran; it should be rejected up front."""
    res = run_distributed(_worker, 2, ["0", "0"], timeout=120)
    for r, got in enumerate(res):
        assert got[:2] == ("forward", "ValueError") and FUSED_BWD_GATHER_MIN_P_ENV in got[2], (r, got)
