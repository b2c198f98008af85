"""Adversarial (s4), 2 CUDA GPUs: backend="auto" must decide (and fail) group-wide before any data collective.

With per-call keys (`_call_plan` -> `get_kernel(..., keys_per_call=auto_keys_per_call(...))`) "auto" reads
MEGATRON_SPLITKV_STAIRCASE_AUTO_MIN_KEYS on CUDA, but only AFTER the group-wide verdict of the call
(`_prepare_from_tensors` resolves the kernel inside its try block WITHOUT keys_per_call, so the variable is
not read there). A malformed value on one rank therefore raises ValueError on that rank only, while the
other ranks enter the query all-gather and wait for it (NCCL: until the process-group timeout). The same
holds for the staircase kernel's own MEGATRON_SPLITKV_STAIRCASE_* options, which are first parsed when
"auto" first picks staircase (a step with >= the threshold keys per rank).

Correct behaviour: the same ValueError (naming the variable) on every rank, no hang. Skipped without two
CUDA devices (the CPU never reads the variable: "auto" is math there).
"""

import os

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from megatron_splitkv import kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA devices (NCCL)")


def _run(rank, world, envs, *, tk, D, backend):
    """splitkv_attention forward + backward on CUDA over NCCL with this rank's environment `envs[rank]`:
    ("ok", x) with the inputs x (their .grad set), or (exception name, message)."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    for k, v in envs[rank].items():
        os.environ[k] = v
    group = dist.new_group(list(range(world)), backend="nccl")
    dev = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(rank)
    nb, B = 2, 16
    x = {k: torch.randn(n, h, D, generator=g).to(dev, torch.bfloat16).requires_grad_()
         for k, n, h in (("q", nb * B, 4), ("k_ctx", tk, 2), ("v_ctx", tk, 2), ("k_blk", nb * B, 2),
                         ("v_blk", nb * B, 2))}
    m = [torch.zeros(nb, dtype=torch.int64, device=dev), torch.tensor([5, 200], device=dev),
         torch.zeros(tk, dtype=torch.int64, device=dev), torch.arange(tk, device=dev) + rank * tk]
    try:
        out = msk.splitkv_attention(*x.values(), *m, block_size=B, cp_group=group, backend=backend)
        out.float().sum().backward()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        return (type(exc).__name__, str(exc))
    return ("ok", x)


def _worker(rank, world, envs):
    kind, x = _run(rank, world, envs, tk=256, D=64, backend="auto")
    return (kind, "" if kind == "ok" else x)


def test_malformed_auto_min_keys_on_one_rank_raises_everywhere():
    bad = {kernels.AUTO_MIN_KEYS_ENV: "lots"}
    res = run_distributed(_worker, 2, [{}, bad], timeout=150)
    for r, (kind, msg) in enumerate(res):
        assert kind == "ValueError" and "AUTO_MIN_KEYS" in msg, (r, kind, msg)


def test_malformed_staircase_option_on_one_rank_raises_everywhere():
    """Threshold 1 key: "auto" picks staircase for this call on both ranks; rank 1's staircase option
    is malformed (the kernel's constructor rejects it)."""
    ok = {kernels.AUTO_MIN_KEYS_ENV: "1"}
    bad = dict(ok, MEGATRON_SPLITKV_STAIRCASE_KEY_BUCKETS="x")
    res = run_distributed(_worker, 2, [ok, bad], timeout=150)
    for r, (kind, msg) in enumerate(res):
        assert kind == "ValueError" and "KEY_BUCKETS" in msg, (r, kind, msg)


def _fused_worker(rank, world, envs):
    """Backend "math" on CUDA over NCCL (no compile): forward + backward, dq checksum or the exception."""
    kind, x = _run(rank, world, envs, tk=64, D=32, backend="math")
    if kind != "ok":
        return (kind, x)
    return ("ok", x["q"].grad.float().cpu(), x["k_ctx"].grad.float().cpu())


def test_fused_gather_threshold_differing_across_ranks_nccl():
    """MEGATRON_SPLITKV_FUSED_BWD_GATHER_MIN_P = 1 on rank 0 only (P = 2): rank 0 fuses its backward
    gathers, rank 1 does not. Either the same ValueError everywhere, or the results of a consistent run."""
    from megatron_splitkv.ops.common import FUSED_BWD_GATHER_MIN_P_ENV

    res = run_distributed(_fused_worker, 2, [{FUSED_BWD_GATHER_MIN_P_ENV: "1"}, {}], timeout=120)
    if all(r[0] == "ok" for r in res):
        ref = run_distributed(_fused_worker, 2, [{}, {}], timeout=120)
        for r in range(2):
            assert torch.equal(res[r][1], ref[r][1]) and torch.equal(res[r][2], ref[r][2]), f"rank {r}: wrong grads"
    else:
        for r, got in enumerate(res):
            assert got[0] == "ValueError" and FUSED_BWD_GATHER_MIN_P_ENV in got[1], (r, got)
