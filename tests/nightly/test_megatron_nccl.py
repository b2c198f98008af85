"""Nightly multi-GPU check of the Megatron DFlash TransformerBlock over NCCL (run via tests/nightly/run.sh).

Under torchrun with an even WORLD_SIZE (2: one GPU per rank), the block from
`get_dflash_layer_spec(cp_impl, use_te=False)` runs in bf16 at (a) TP=1 x CP=2 for splitkv, allgather-kv
and ring-kv and (b) TP=2 x CP=1; output, input/context gradients and every parameter gradient are compared
with the float64 CP=1 functional reference of tests/test_megatron_block.py (relative L2 error < 3e-2; the
errors are printed by rank 0). Both layouts run in one process-group lifetime: parallel_state is
initialised per layout and destroyed after it (the block takes its pg_collection from parallel_state).
NIGHTLY_CPU=1: the same on CPU with gloo, fp32 (NIGHTLY_DTYPE=bf16 forces bf16). Skipped without
torchrun, without CUDA (unless NIGHTLY_CPU=1) and without megatron-core (a per-test skip, not a
module-level one: a module skip makes pytest exit 5, which torchrun reports as a failure).
"""

import datetime
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

CPU = os.environ.get("NIGHTLY_CPU") == "1"

pytestmark = pytest.mark.skipif(
    "WORLD_SIZE" not in os.environ or not (torch.cuda.is_available() or CPU),
    reason="nightly: run under torchrun on GPUs (tests/nightly/run.sh)",
)

_DT = os.environ.get("NIGHTLY_DTYPE", "fp32" if CPU else "bf16")
DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}[_DT]
TOL = 3e-2 if DTYPE == torch.bfloat16 else 2e-4
SHAPE = dict(hidden=128, heads=8, groups=2, kv_channels=16, ffn=128, num_layers=2)
IMPLS = ("splitkv", "allgather-kv", "ring-kv")


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=180)  # a rank that dies must not hang the others for long
    if CPU:
        dev = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timeout)
    else:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        if not dist.is_initialized():
            # lazy NCCL init (no device_id): with an eagerly initialised default group, destroying it
            # after Megatron's many subgroups hung at exit on the H200 pair (2026-11-30; cf.
            # pytorch/pytorch#190396, destroy_process_group hangs after sequential subgroups)
            dist.init_process_group("nccl", timeout=timeout)
    world = dist.get_world_size()
    if world % 2:
        pytest.skip("needs an even number of ranks (TP=2 / CP=2)")
    yield dev, world, dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def mb():
    """tests/test_megatron_block.py (problem, sharding, block run, reference), once megatron-core imports."""
    pytest.importorskip("megatron.core")
    import test_megatron_block

    return test_megatron_block


@pytest.fixture(scope="module")
def problem(mb):
    cfg, state, data = mb.make_problem(**SHAPE)
    out, dh, dctx, grads = mb.functional_block(cfg, state, data)  # float64, CP=1
    return cfg, state, data, (out[:, None], dh[:, None], dctx[:, None], grads)


def _run_layout(mb, group, problem, tp, cp, impls):
    """Every rank's `_run_block` results for each impl at TP=tp x CP=cp (gathered on every rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dev, world, _ = group
    cfg, state, data, _ = problem
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, create_gloo_process_groups=False,
    )
    try:
        local = {impl: mb._run_block(tp, cp, 1, cfg, state, data, impl, "sbhd", DTYPE, dev) for impl in impls}
    finally:
        ps.destroy_model_parallel()
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    return gathered


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _errors(mb, problem, gathered, cp, impl):
    cfg, _, data, (out_r, dh_r, dctx_r, grads_r) = problem
    out, dh, dctx, grads, tp = mb.assemble(gathered, cfg, data, cp, impl)
    for t in (out, dh, dctx):
        assert torch.isfinite(t).all()
    errs = {"out": _rel(out, out_r), "dh": _rel(dh, dh_r), "dctx": _rel(dctx, dctx_r)}
    assert set(grads) == set(grads_r)
    for k, full in grads_r.items():
        assert sorted(grads[k]) == list(range(tp)), k
        for r, g in grads[k].items():
            assert torch.isfinite(g).all(), k
            errs[f"{k}[tp{r}]"] = _rel(g, mb.shard_param(k, full, tp, r))
    return errs


def _check(group, label, errs):
    worst = max(errs, key=errs.get)
    if group[2] == 0:
        print(f"\n[{label} {_DT}] out {errs['out']:.2e} dh {errs['dh']:.2e} dctx {errs['dctx']:.2e} "
              f"params max {errs[worst]:.2e} ({worst}; {len(errs) - 3} param shards), tol {TOL:.0e}")
    bad = {k: f"{v:.2e}" for k, v in errs.items() if not v < TOL}
    assert not bad, f"{label}: {bad}"


def test_tp1_cp2_block_matches_float64_reference(mb, group, problem):
    gathered = _run_layout(mb, group, problem, tp=1, cp=2, impls=IMPLS)
    failures = []
    for impl in IMPLS:
        try:
            _check(group, f"TP=1 x CP=2 {impl}", _errors(mb, problem, gathered, 2, impl))
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, failures


def test_tp2_cp1_block_matches_float64_reference(mb, group, problem):
    gathered = _run_layout(mb, group, problem, tp=2, cp=1, impls=("splitkv",))
    _check(group, "TP=2 x CP=1 splitkv", _errors(mb, problem, gathered, 1, "splitkv"))
