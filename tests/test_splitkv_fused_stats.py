"""Split-KV's backward gathers dO and the global statistics (delta, lse) in ONE all-gather per chunk
("splitkv.bwd.dout": per rank [dO rows | delta, lse bit-packed] in the inputs' dtype,
`ops.common.pack_dout_stats`).

- transport: unpacking the concatenated per-rank segments (what the all-gather delivers) gives bit for
  bit what the two former gathers delivered (dO padded with zeros, (delta, lse) padded with -inf; NaN /
  inf / subnormal statistics kept), for bf16 / fp16 / fp32 / fp64, a single head, an expanded
  (zero-stride) dO, zero rows; the unpacked dO and statistics are contiguous;
- the op (fused path reached with the two-level all-to-all, SplitKVConfig(cp_ranks_per_node=2) at P = 4; on
  one level only groups larger than one node fuse, `fuse_bwd_gather`): exactly one "splitkv.bwd.dout"
  all-gather per chunk and no "splitkv.bwd.stats", with the
  documented bytes (D + 2 * acc / elem elements per row and head), results equal to the float64
  reference (P = 4, uneven and empty shards, num_chunks 1 and 2, bf16 / fp32 / fp64).
Source: DESIGN.md section 2 (backward step 1), perf-notes (one collective latency per chunk saved).
"""

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import case, check_jobs, job_results, jobs_worker, new_seed
from megatron_splitkv.ops.common import (fuse_bwd_gather, pack_dout_stats, pad_rows,
                                         unpack_dout_stats)

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads", [(7, 3), (5, 1), (0, 2)])
def test_pack_unpack_is_the_two_gathers_bit_for_bit(dtype, rows, heads):
    """P ranks' segments concatenated (what the all-gather delivers) unpack to the two former gathers'
    results: the padded dO and the padded (delta, lse), rank by rank, bit for bit."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(rows * 10 + heads)
    D, nranks = 6, 3
    douts, stats = [], []
    for r in range(nranks):
        T = max(rows - r, 0)  # uneven: padded to `rows` like the op pads to the largest block count
        dout = torch.randn(T, heads, D, generator=g).to(dtype)
        delta = torch.randn(T, heads, generator=g).to(acc)
        lse = torch.randn(T, heads, generator=g).to(acc)
        if T:
            lse[0] = float("-inf")
            delta[0, 0] = float("nan")
            delta[-1] = float("inf")
            lse[-1, -1] = torch.finfo(acc).tiny / 4  # subnormal
        douts.append(pad_rows(dout, rows))
        stats.append(pad_rows(torch.stack([delta, lse], -1), rows, float("-inf")))
    segs = [pack_dout_stats(d, s, dtype) for d, s in zip(douts, stats)]
    assert all(x.dtype == dtype and x.dim() == 1 for x in segs)
    assert segs[0].numel() == rows * heads * (D + 2 * (acc.itemsize // dtype.itemsize))
    d2, s2 = unpack_dout_stats(torch.cat(segs), nranks, heads, D, acc)
    assert d2.is_contiguous() and s2.is_contiguous() and d2.dtype == dtype and s2.dtype == acc
    assert d2.shape == (nranks * rows, heads, D) and s2.shape == (nranks * rows, heads, 2)
    assert torch.equal(_bits(d2), _bits(torch.cat(douts)))
    assert torch.equal(_bits(s2), _bits(torch.cat(stats)))
    # an expanded dO (e.g. the gradient of out.sum()) packs like its materialised copy
    z = torch.ones((), dtype=dtype).expand(rows, heads, D)
    assert torch.equal(_bits(pack_dout_stats(z, stats[0], dtype)),
                       _bits(pack_dout_stats(z.contiguous(), stats[0], dtype)))


def test_pack_rejects_a_wider_transport_dtype():
    with pytest.raises(ValueError, match="cannot pack"):
        pack_dout_stats(torch.zeros(2, 1, 4, dtype=torch.float64), torch.zeros(2, 1, 2, dtype=torch.float32),
                        torch.float64)


P = 4


@pytest.fixture(scope="module")
def fused_run():
    seed = new_seed()
    tk = 13 + 7 + 20
    jobs = []
    for i, dt in enumerate(("bfloat16", "float32", "float64")):
        for k in (1, 2):
            c = case(seed + i, P, dtype=dt, blocks=[3, 0, 4, 2], ctx=[tk - 17, 12, 0, 5], poison=dt == "float64",
                     p_invalid=0.3, num_chunks=k, metadata=k == 2, config=msk.SplitKVConfig(cp_ranks_per_node=2))
            jobs.append(("splitkv", c))
    # one level fuses from P = 9 (`fuse_bwd_gather`); the two-level all-to-all (L = 2 of 4) always does
    return jobs, run_distributed(jobs_worker, P, jobs, timeout=240)


def test_exact_vs_reference(fused_run):
    check_jobs(*fused_run)


def test_one_gather_per_chunk_with_the_documented_bytes(fused_run):
    jobs, results = fused_run
    for j, (op, c) in enumerate(jobs):
        elem = torch.empty((), dtype=getattr(torch, c["dtype"])).element_size()
        acc = 8 if elem == 8 else 4
        k = min(c["num_chunks"], max(c["blocks"]))
        rows_max = max(c["blocks"]) * c["B"]
        for r in job_results(results, j, P):
            ops = [o for o, _ in r["comm_kinds"]]
            assert ops.count("splitkv.bwd.dout") == k and "splitkv.bwd.stats" not in ops, ops
            assert ("splitkv.bwd.dout", "all_gather") in r["comm_kinds"]
            row_bytes = c["Hq"] * (c["D"] * elem + 2 * acc)  # dO in the inputs' dtype + (delta, lse) in acc
            assert r["bytes_by_op"]["splitkv.bwd.dout"] == 2 * (P - 1) * rows_max * row_bytes


def test_fusion_rule():
    """Fused for groups larger than one 8-GPU node or with the two-level all-to-all."""
    assert [fuse_bwd_gather(p, False) for p in (1, 2, 8, 9, 64)] == [False, False, False, True, True]
    assert fuse_bwd_gather(4, True)
