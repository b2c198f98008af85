"""Sliding-window edge shapes of the three CP ops against the float64 reference (out, lse and all five
gradients; gloo, CPU, math and flex): W = 1 (each row sees only itself: no context key anywhere, every rank's
context partial is empty), W = the block size, W beyond every sequence, combined with a rank that holds
neither query blocks nor context keys, every block on one rank, the poison case (NaN / inf where no query
looks), and anchors at position 0."""

import pytest
from _dist import run_distributed
from _splitkv_helpers import case, check, jobs_worker, new_seed, run_local
from test_splitkv_op import check_cp_size

OPS = ("splitkv", "allgather_kv", "ring_kv")


def _cases(P, seed):
    """Edge windows for CP size P (B = 4, sequences 13, 7, 20 tokens: 40 context keys)."""
    tk = 40
    empty_last = [tk // (P - 1) + (r < tk % (P - 1)) for r in range(P - 1)] + [0] if P > 1 else [tk]
    blocks_empty_last = [2] * (P - 1) + [0] if P > 1 else [2]  # the last rank: no block and no key
    one_rank = [3 * P] + [0] * (P - 1)  # every query block on rank 0
    cases = []
    for causal in (True, False):
        cases += [
            case(seed, P, window=1, causal=causal, ctx=empty_last, blocks=blocks_empty_last),
            case(seed + 1, P, window=1, causal=causal, blocks=one_rank, backend="flex", metadata=True),
            case(seed + 2, P, window=4, causal=causal, ctx=empty_last, blocks=blocks_empty_last, metadata=True),
            case(seed + 3, P, window=4, causal=causal, anchors=[0] * (2 * P), p_invalid=0.0),
            case(seed + 4, P, window=21, causal=causal, blocks=one_rank, ctx=empty_last, backend="flex"),
            case(seed + 5, P, window=1 << 40, causal=causal, ctx=empty_last, blocks=blocks_empty_last,
                 metadata=True),
            case(seed + 6, P, window=1, causal=causal, poison=True, dtype="float32"),
        ]
        seed += 10
    return cases


def test_edges_single_process():
    seed = new_seed()
    for op in OPS:
        for c in _cases(1, seed):
            check(op, c, [run_local(op, c, 0)])


CP_SIZES = [2, 3]


@pytest.fixture(scope="module")
def cp_run():
    seed = new_seed()
    jobs = [(op, c) for P in CP_SIZES for op in OPS for c in _cases(P, seed + 100 * P)]
    return jobs, run_distributed(jobs_worker, max(CP_SIZES), jobs, timeout=300)


@pytest.mark.parametrize("P", CP_SIZES)
def test_edges_cp(cp_run, P):
    check_cp_size(cp_run, P)
