"""Nightly multi-GPU check of the Split-KV op and its baselines over NCCL (run via tests/nightly/run.sh).

Under torchrun (WORLD_SIZE set, CUDA present) every rank runs the same tests: op exactness at CP =
WORLD_SIZE for splitkv / allgather-kv / ring-kv (bf16 vs the float64 single-process reference; output and
all five gradients, relative L2 error < 2e-2, no non-finite values), with the FlexAttention local kernel,
the math kernel and (when Transformer Engine imports) the TE kernel. Skipped in a plain `pytest tests` run (no torchrun environment) and without CUDA.
Shared code: `tools/gpu_check.py` (op_exactness, op_timing).
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

CPU = os.environ.get("NIGHTLY_CPU") == "1"  # dry run of this file on CPU with gloo and tiny shapes

pytestmark = pytest.mark.skipif(
    "WORLD_SIZE" not in os.environ or not (torch.cuda.is_available() or CPU),
    reason="nightly: run under torchrun on GPUs (tests/nightly/run.sh)",
)


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if CPU:
        dev = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=dev)
    yield dev, dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["flex", "math", "te"])
def test_ops_exact_at_cp(group, backend):
    import gpu_check

    dev, world, rank, g = group
    if backend == "te":
        if CPU:
            pytest.skip("Transformer Engine runs on CUDA only")
        pytest.importorskip("transformer_engine.pytorch", reason="backend='te' needs Transformer Engine")
    res = {}
    rows = gpu_check.op_exactness(dev, CPU, world, rank, g, res, backend)
    assert rows, "ops not importable"
    for r in rows:
        assert r["ok"], r


def test_comm_is_query_sized(group):
    """Split-KV's bytes per rank do not grow with the context; all-gather KV's do."""
    import gpu_check

    dev, world, rank, g = group
    if world < 2:
        pytest.skip("needs CP >= 2")
    res = {}
    ctx = [1024, 4096] if CPU else [8192, 32768]
    rows = gpu_check.op_timing(dev, CPU, world, rank, g, res, "flex", ctx, reps=1, n_anchors=16 if CPU else 64)
    by = {(r["op"], r["ctx"]): r for r in rows}
    for r in rows:
        assert "error" not in r, r
    small, big = ctx
    s_small, s_big = by[("splitkv", small)]["total_mb"], by[("splitkv", big)]["total_mb"]
    assert s_big <= s_small * 1.01 + 0.01
    if ("allgather-kv", small) in by:
        assert by[("allgather-kv", big)]["total_mb"] > 2 * by[("allgather-kv", small)]["total_mb"]
