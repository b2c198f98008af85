"""The two baselines (all-gather KV, ring KV) vs the single-process float64 reference, with the same
shared cases as Split-KV (tests/_splitkv_helpers.py): CP sizes 1, 2, 3, 4, 8, uneven and empty shards,
GQA, invalid blocks, anchors at 0, packed sequences, shuffled context, fp64 / fp32 / bf16 / fp16."""

import pytest

from _splitkv_helpers import check, new_seed, run_local
from test_splitkv_op import CP_SIZES, check_cp_size, cp_cases, run_cp_sizes

BASELINES = ["allgather_kv", "ring_kv"]


def test_baselines_single_process():
    for c in cp_cases(1, new_seed()):
        for op in BASELINES:
            check(op, c, [run_local(op, c, 0)])


@pytest.fixture(scope="module")
def baselines_run():
    return run_cp_sizes(BASELINES)


@pytest.mark.parametrize("P", CP_SIZES)
def test_baselines_cp(baselines_run, P):
    check_cp_size(baselines_run, P)
