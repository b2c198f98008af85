"""`SplitKVConfig.debug_checks`: the ops' re-check of the interval masks they build themselves (union
contract, `IntervalMask.validate`) runs only in debug mode; production skips it (docs/lab/perf-notes.md item
13). Here:

- off and on give bit-identical results for the three ops (gloo, P = 2 and 3, with and without per-step
  metadata, num_chunks 1 and 2, uneven and empty shards), and both equal the float64 reference;
- off, no mask validation runs at all (validate / validate_flags replaced by functions that fail);
- on, it runs (a malformed value cannot be built: tests/test_config.py).
"""

import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import case, check, new_seed, run_local


def _worker(rank, world, cases, mode):
    from megatron_splitkv import SplitKVConfig
    from megatron_splitkv.kernels.base import IntervalMask

    runs = []

    def counted(real):
        def run(self, *a, **k):
            runs.append(1)
            return real(self, *a, **k)
        return run

    def boom(self, *a, **k):
        raise AssertionError("IntervalMask validation ran with SplitKVConfig.debug_checks=False")

    for name in ("validate", "validate_flags"):
        setattr(IntervalMask, name, counted(getattr(IntervalMask, name)) if mode == "1" else boom)
    config = SplitKVConfig(debug_checks=mode == "1")
    out = []
    for op, c in cases:
        out.append(run_local(op, dict(c, config=config), rank) if rank < c["P"] else None)
    return out, len(runs)


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
    assert all(n > 0 for _, n in on), [n for _, n in on]  # on: the masks were validated
    on, off = [r for r, _ in on], [r for r, _ in off]
    for j, (op, c) in enumerate(cases):
        per_on = [on[r][j] for r in range(P)]
        per_off = [off[r][j] for r in range(P)]
        check(op, c, per_off)
        for r in range(P):
            for key in per_on[r]:
                assert torch.equal(per_on[r][key], per_off[r][key]), (op, c, r, key)
