"""The head-dim rule of the CUDA kernels (staircase: cuDNN SDPA; fa4: FlashAttention-4) is part of the check the
ops run BEFORE their first collective (`ops.metadata.resolve_kernel` -> `check_dtype(dtype, device, head_dim)`),
not only of the kernels' forward / backward: a rank without keys never calls the kernel, so a refusal there
fired on the other ranks only, after the Q all-gather, and left the keyless rank waiting in the next
collective. CPU only: the rule is checked without a GPU (it raises before anything touches CUDA).
"""

import pytest
import torch

from megatron_splitkv.kernels import base, fa4
from megatron_splitkv.kernels.staircase import StaircaseAttentionKernel
from megatron_splitkv.ops.metadata import resolve_kernel

BAD = (1, 4, 12, 36, 100, 257, 264, 512)
GOOD = (8, 16, 64, 72, 128, 256)


def test_rule():
    for d in BAD:
        assert not base.cuda_head_dim_ok(d)
        with pytest.raises(ValueError, match=rf"head dim D \(q.shape\[2\]\) that is a multiple of 8 in \[8, 256\].*"
                                             rf"got {d}$"):
            base.check_cuda_head_dim(d, "backend='x'")
    for d in GOOD + (None,):
        assert base.cuda_head_dim_ok(d)
        base.check_cuda_head_dim(d, "backend='x'")
    # "auto" may pick the CUDA kernels only where they take the head dim: the same predicate
    assert base.half_precision_cuda_index("cuda:0", torch.bfloat16, 12) is None


@pytest.mark.parametrize("d", BAD)
def test_staircase_check_dtype_refuses_cuda_head_dims(d):
    kern = StaircaseAttentionKernel()
    with pytest.raises(ValueError, match=rf"staircase.*head dim.*got {d}$"):
        kern.check_dtype(torch.bfloat16, "cuda", head_dim=d)
    kern.check_dtype(torch.bfloat16, "cpu", head_dim=d)  # the CPU flash kernel takes any head dim


def test_pre_collective_resolve_refuses_staircase_head_dim():
    """What the ops call before their first collective (with the agreed D): the refusal the kernel's forward
    would give later, here, prefixed with the op name (so every rank raises the same error)."""
    for d in BAD:
        with pytest.raises(ValueError, match=rf"^splitkv: backend='staircase' \(cuDNN\) needs a head dim.*got {d}$"):
            resolve_kernel("splitkv", "staircase", torch.device("cuda"), torch.bfloat16, d)
    assert isinstance(resolve_kernel("splitkv", "staircase", torch.device("cpu"), torch.bfloat16, 12),
                      StaircaseAttentionKernel)


def test_fa4_check_dtype_refuses_head_dim():
    kern = object.__new__(fa4.FA4AttentionKernel)  # no flash_attn.cute here: the check needs no import
    for d in BAD:
        with pytest.raises(ValueError, match=rf"backend 'fa4' needs a head dim.*got {d}$"):
            kern.check_dtype(torch.bfloat16, None, head_dim=d)
    for d in GOOD:
        kern.check_dtype(torch.bfloat16, None, head_dim=d)


# ------------------------------------------------------------------ the op, 2 gloo ranks, one without keys


def _cuda_rule_worker(rank, world, c):
    """A staircase kernel that applies the CUDA head-dim rule on this CPU rank too (what cuDNN refuses on a GPU
    rank), installed where `get_kernel` finds it; the op then runs with backend='staircase'."""
    import torch.distributed as dist
    from _splitkv_helpers import errors_of_every_op, run_local

    from megatron_splitkv import kernels

    class CudaRuleStaircase(StaircaseAttentionKernel):
        def check_dtype(self, dtype, device=None, head_dim=None):
            base.check_cuda_head_dim(head_dim, "backend='staircase' (cuDNN)")
            super().check_dtype(dtype, device, head_dim=head_dim)

    kernels._CACHE[("staircase", "cpu", torch.float32)] = CudaRuleStaircase()
    seen = errors_of_every_op(c, rank, dist.group.WORLD, ValueError, ({"metadata": False}, {"metadata": True}))
    # still in step: the same case on the math kernel runs
    return seen, run_local("splitkv", {**c, "backend": "math"}, rank, dist.group.WORLD)


def test_head_dim_refusal_reaches_every_rank_before_any_collective():
    """D = 12 with backend='staircase' while rank 1 holds no blocks and no context (its kernel never runs): the
    head-dim refusal came from the kernel's forward on rank 0 only, after the Q all-gather, and rank 1 waited in
    the next collective (a hang until the timeout). The ops' pre-collective check now passes the call's D, so
    every rank raises the same error, for every op, with and without metadata=."""
    from _dist import run_distributed
    from _splitkv_helpers import case, check, new_seed

    c = case(new_seed(), 2, dtype="float32", D=12, blocks=[3, 0], ctx=[40, 0], backend="staircase")
    (s0, ok0), (s1, ok1) = run_distributed(_cuda_rule_worker, 2, c, timeout=120)
    assert s0 == s1 and len(s0) == 6, (s0, s1)
    assert all("backend='staircase' (cuDNN) needs a head dim D (q.shape[2]) that is a multiple of 8" in m
               and m.endswith("got 12") for m in s0), s0
    check("splitkv", c, [ok0, ok1])
