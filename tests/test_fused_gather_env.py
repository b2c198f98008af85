"""SplitKVConfig.fused_bwd_gather_min_p must not split a CP group.

The threshold decides whether the backward issues one all-gather ("splitkv.bwd.dout", packed) or two
("splitkv.bwd.dout" + "splitkv.bwd.stats"); ranks with different values would issue mismatched collectives
(gloo aborts, NCCL hangs or mixes bytes). It is agreed group-wide by the forward call: every rank raises the
same ValueError naming the field, before any backward collective; equal values complete with exact results.
(A malformed value cannot be built: tests/test_config.py.)
"""


import torch

import megatron_splitkv as msk
from _dist import run_distributed


def _small(rank):
    g = torch.Generator().manual_seed(rank)
    nb, B, tk = 4, 4, 9
    x = {k: torch.randn(n, h, 8, generator=g, dtype=torch.float64).requires_grad_()
         for k, n, h in (("q", nb * B, 4), ("k_ctx", tk, 2), ("v_ctx", tk, 2), ("k_blk", nb * B, 2),
                         ("v_blk", nb * B, 2))}
    m = dict(q_seq=torch.zeros(nb, dtype=torch.int64), q_anchor=torch.tensor([0, 3, -1, 9]),
             kv_seq=torch.zeros(tk, dtype=torch.int64), kv_pos=torch.arange(tk))
    return x, m


def _worker(rank, world, values):
    """values[rank]: this rank's `SplitKVConfig.fused_bwd_gather_min_p` (None: the default). Returns (where,
    exception type, message) of the first exception of forward / backward, or ("ok", grad checksum)."""
    v = values[rank]
    config = None if v is None else msk.SplitKVConfig(fused_bwd_gather_min_p=v)
    x, m = _small(rank)
    try:
        out = msk.splitkv_attention(*x.values(), *m.values(), block_size=4, backend="math", config=config)
    except Exception as exc:  # noqa: BLE001
        return ("forward", type(exc).__name__, str(exc))
    try:
        out.sum().backward()
    except Exception as exc:  # noqa: BLE001
        return ("backward", type(exc).__name__, str(exc))
    return ("ok", float(x["q"].grad.abs().sum()))


def test_different_values_do_not_split_the_collectives():
    """P = 2: 1 on rank 0 (fused), the default on rank 1 (9: separate gathers): the same ValueError naming
    the field on every rank, raised by the forward call (before any backward collective)."""
    res = run_distributed(_worker, 2, [1, None], timeout=60)
    for r, got in enumerate(res):
        assert got[:2] == ("forward", "ValueError") and "fused_bwd_gather_min_p" in got[2], (r, got)
    assert res[0][2] == res[1][2], res
    same = run_distributed(_worker, 2, [1, 1], timeout=60)
    ref = run_distributed(_worker, 2, [None, None], timeout=60)
    assert all(r[0] == "ok" for r in same + ref) and [r[1] for r in same] == [r[1] for r in ref]
