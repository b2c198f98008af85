"""A NaN / +inf gradient reaching the returned lse must not be silently zeroed.

`_SplitKV.backward` turns the gathered statistics into `delta_all = torch.nan_to_num(stats[..., 0],
neginf=0.0)` (meant for the -inf padding rows). nan_to_num also maps NaN -> 0 and +inf -> float max, and
delta = rowsum(dO * O) - dlse, so a NaN in dlse (on a row with finite lse) becomes delta = 0 and +inf
becomes delta = -inf -> 0: the gradients come out FINITE (and wrong: that row contributes nothing), on
the separate and on the fused backward gather alike. Megatron's NaN check on the gradients (and any loss
scaler) then never sees the fault. The float64 reference, `allgather_kv_attention` and
`ring_kv_attention` all propagate it (non-finite dq on that row).

Correct behaviour: the row's dq (and the dk of the keys it sees) are not finite, as in the reference.
"""

import functools

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import build, case, local


def _case(P):
    # every block valid and seeing its whole sequence: every lse row finite
    return case(3, P, dtype="float64", blocks=[3] * P, p_invalid=0.0, p_zero=0.0, full=True)


def _grads(op, c, rank, val, cp_group=None):
    t = build(c)
    x, meta, _, _ = local(t, c, rank)
    out, lse = op(*x.values(), *meta.values(), block_size=c["B"], backend="math", return_lse=True,
                  cp_group=cp_group)
    assert torch.isfinite(lse).all()
    dl = torch.zeros_like(lse)
    if rank == 0:
        dl[0, 0] = val
    (out.sum() * 0 + (lse * dl).sum()).backward()
    return x["q"].grad.clone(), x["k_ctx"].grad.clone()


@pytest.mark.parametrize("val", [float("nan"), float("inf")])
def test_reference_and_baselines_propagate(val):
    """The premise: the float64 reference and both baselines give a non-finite dq on that row."""
    c = _case(1)
    t = build(c)
    x = {k: t[k].double().clone().requires_grad_(True) for k in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")}
    out, lse = msk.dflash_attention_reference(*x.values(), t["q_seq"], t["q_anchor"], t["kv_seq"], t["kv_pos"],
                                              block_size=c["B"])
    dl = torch.zeros_like(lse)
    dl[0, 0] = val
    (lse * dl).sum().backward()
    assert not torch.isfinite(x["q"].grad[0]).all()
    for op in (msk.allgather_kv_attention, msk.ring_kv_attention):
        dq, _ = _grads(op, c, 0, val)
        assert not torch.isfinite(dq[0]).all(), op.__name__


@pytest.mark.parametrize("val", [float("nan"), float("inf")])
def test_splitkv_single_process_propagates(val):
    dq, dk = _grads(msk.splitkv_attention, _case(1), 0, val)
    assert not torch.isfinite(dq[0]).all(), "non-finite lse gradient swallowed: dq row 0 is finite"
    assert not torch.isfinite(dk).all(), "non-finite lse gradient swallowed: dk all finite"


def _worker(rank, world, val, fused):
    # the fused backward gather runs with the two-level all-to-all (L = 2 of P = 4, `fuse_bwd_gather`)
    op = functools.partial(msk.splitkv_attention, cp_ranks_per_node=2) if fused else msk.splitkv_attention
    dq, dk = _grads(op, _case(world), rank, val)
    return bool(torch.isfinite(dq[:4]).all()), bool(torch.isfinite(dk).all())


@pytest.mark.parametrize("fused", [False, True])
def test_splitkv_two_ranks_propagates(fused):
    res = run_distributed(_worker, 4 if fused else 2, float("nan"), fused, timeout=120)
    assert res[0][0] is False, f"rank 0's dq row 0 is finite (fused={fused}): NaN in dlse swallowed"
    assert not all(r[1] for r in res), f"every dk finite (fused={fused}): NaN in dlse swallowed"
