"""Adversarial (s4), CPU emulation of the CUDA path of backend="auto" (see test_auto_kernel_env_gpu.py).

On CUDA, `resolve_auto_backend(keys_per_call, ...)` reads MEGATRON_SPLITKV_STAIRCASE_AUTO_MIN_KEYS whenever
keys_per_call is not None, and the ops call it with keys only in `_call_plan`, i.e. AFTER the group-wide
verdict of the call (`_prepare_from_tensors` / `check_call` resolve the kernel inside their try blocks
WITHOUT keys_per_call). A malformed value on one rank then raises there only and the other ranks block in
the query all-gather. On the CPU "auto" is math and never reads the variable, so this test makes the CPU
read it exactly where the CUDA path does (a wrapper that calls `staircase_auto_min_keys()` when
keys_per_call is given, then defers to the real rule) and checks the group behaviour.

Correct behaviour: the same ValueError naming the variable on every rank (no hang), with and without
`metadata=` (group_check metadata: its documented promise is that every rank raises).
"""

import os

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from megatron_splitkv import kernels


def _emulate_cuda_env_read():
    real = kernels.resolve_auto_backend

    def resolve(keys_per_call, device, dtype=None, head_dim=None):
        if keys_per_call is not None:  # what the CUDA branch does before comparing against the threshold
            kernels.staircase_auto_min_keys()
        return real(keys_per_call, device, dtype, head_dim)

    kernels.resolve_auto_backend = resolve


def _worker(rank, world, bad_rank, use_meta, var=kernels.AUTO_MIN_KEYS_ENV, value="lots"):
    _emulate_cuda_env_read()
    if rank == bad_rank:
        os.environ[var] = value
    else:
        os.environ.pop(var, None)
    g = torch.Generator().manual_seed(rank)
    nb, B, tk = 2, 4, 9
    x = {k: torch.randn(n, h, 8, generator=g).requires_grad_()
         for k, n, h in (("q", nb * B, 4), ("k_ctx", tk, 2), ("v_ctx", tk, 2), ("k_blk", nb * B, 2),
                         ("v_blk", nb * B, 2))}
    m = dict(q_seq=torch.zeros(nb, dtype=torch.int64), q_anchor=torch.tensor([3, 9]),
             kv_seq=torch.zeros(tk, dtype=torch.int64), kv_pos=torch.arange(tk))
    try:
        if use_meta:
            md = msk.prepare_splitkv_metadata(*m.values(), block_size=B, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                              dtype=torch.float32, group_check=True)
            out = msk.splitkv_attention(*x.values(), metadata=md, backend="auto")
        else:
            out = msk.splitkv_attention(*x.values(), *m.values(), block_size=B, backend="auto")
        out.sum().backward()
    except Exception as exc:  # noqa: BLE001
        return (type(exc).__name__, str(exc))
    return ("ok", "")


@pytest.mark.parametrize("use_meta", [False, True])
def test_malformed_auto_min_keys_on_one_rank_raises_everywhere(use_meta):
    res = run_distributed(_worker, 2, 1, use_meta, timeout=120)
    for r, (kind, msg) in enumerate(res):
        assert kind == "ValueError" and "AUTO_MIN_KEYS" in msg, (r, kind, msg)
