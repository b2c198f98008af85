"""MEGATRON_SPLITKV_DEBUG_CHECKS (`ops.common.debug_checks`): the ops' re-check of the interval masks they
build themselves (union contract, `IntervalMask.validate`) runs only in debug mode (the test suite's
setting, tests/conftest.py); production skips it (docs/perf-notes.md item 13). Here:

- off and on give bit-identical results for the three ops (gloo, P = 2 and 3, with and without per-step
  metadata, num_chunks 1 and 2, uneven and empty shards), and both equal the float64 reference;
- off, no mask validation runs at all (validate / validate_flags replaced by functions that fail);
- a malformed value raises a ValueError naming the variable.
"""

import os

import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import case, check, new_seed, run_local


def _worker(rank, world, cases, mode):
    from megatron_splitkv.kernels.base import IntervalMask

    os.environ["MEGATRON_SPLITKV_DEBUG_CHECKS"] = mode
    if mode == "0":
        def boom(self, *a, **k):
            raise AssertionError("IntervalMask validation ran with MEGATRON_SPLITKV_DEBUG_CHECKS=0")

        IntervalMask.validate = boom
        IntervalMask.validate_flags = boom
    out = []
    for op, c in cases:
        out.append(run_local(op, c, rank) if rank < c["P"] else None)
    return out


@pytest.mark.parametrize("P", [2, 3])
def test_debug_checks_off_is_bit_identical(P):
    seed = new_seed()
    cases = []
    for op in ("splitkv", "allgather_kv", "ring_kv"):
        for meta in (False, True):
            for k in ((1, 2) if op == "splitkv" else (None,)):
                cases.append((op, case(seed + len(cases), P, dtype="float64", metadata=meta, num_chunks=k,
                                       blocks=[3, 0, 2][:P], ctx=None if P == 2 else [20, 0, 20])))
    for op, c in cases:
        if c["ctx"] is None:
            c["ctx"] = "even"
    on = run_distributed(_worker, P, cases, "1", timeout=300)
    off = run_distributed(_worker, P, cases, "0", timeout=300)
    for j, (op, c) in enumerate(cases):
        per_on = [on[r][j] for r in range(P)]
        per_off = [off[r][j] for r in range(P)]
        check(op, c, per_off)
        for r in range(P):
            for key in per_on[r]:
                assert torch.equal(per_on[r][key], per_off[r][key]), (op, c, r, key)


def test_debug_checks_values(monkeypatch):
    from megatron_splitkv.kernels import validate_kernel_env
    from megatron_splitkv.ops.common import DEBUG_CHECKS_ENV, debug_checks

    for v, want in (("", False), ("0", False), ("1", True), (" 1 ", True)):
        monkeypatch.setenv(DEBUG_CHECKS_ENV, v)
        assert debug_checks() is want
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "yes")
    with pytest.raises(ValueError, match=DEBUG_CHECKS_ENV):
        debug_checks()
    with pytest.raises(ValueError, match=DEBUG_CHECKS_ENV):
        validate_kernel_env()  # parsed with the kernel variables, before any data collective
