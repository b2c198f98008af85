"""Split-KV's glue per head chunk (ops/chunking.py `HeadChunks.sends`, `grad_rows`, `HeadChunks.local_keys`; docs/lab/perf-notes.md item
24): the chunk-major send buffers of q / dO / statistics for equal head chunks, the dK / dV of each head chunk
written (unsorted, in the result dtype) straight into its kv heads of the gradient, and the local keys as head
views for kernels with `strided_heads`.

CPU, gloo, one spawn of 3 ranks (P = 1, 2, 3 on sub-groups), math kernel: for head chunks k = 2, 3 on Hkv = 8
(even 4 / 4, uneven 2 / 3 / 3), k = 3 on Hkv = 4 (1 / 1 / 2), with and without the
own block, uneven and empty shards (a rank without blocks, a rank without context), shuffled context (so the
unsort runs), the local keys as views of one tensor (`strided_heads`, the math kernel's) or one copy per chunk (the
attribute off, as for flex / te / staircase), float64 and bfloat16: output, lse and every gradient are BIT-IDENTICAL to the one call (k = 1) on the
same inputs (head chunks split heads only: every row / head sees the same kernel arithmetic, merge and dQ sum),
and the float64 runs equal the float64 reference within its tolerance.
"""


import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import GRAD_NAMES, build, case, check, check_no_own, local, loss_of, new_seed
from megatron_splitkv.kernels.math import MathAttentionKernel

KEYS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")


def _run(c, rank, group, job, chunking):
    t = build(c)
    x, meta, dout, dlse = local(t, c, rank)
    own = job.get("own", True)
    md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                      block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"], head_dim=c["D"],
                                      dtype=x["q"].dtype, cp_group=group, **chunking)
    if job.get("copies"):  # a kernel without `strided_heads` (flex, te, staircase): one key copy per head chunk
        MathAttentionKernel.strided_heads = False
    try:
        out, lse = msk.splitkv_attention(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"] if own else None,
                                         x["v_blk"] if own else None, metadata=md, backend="math", return_lse=True)
        loss_of(out, lse, dout, dlse).backward()
    finally:
        MathAttentionKernel.strided_heads = True
    res = dict(out=out.detach(), lse=lse.detach(), sorted=md.order is None, k=md.num_chunks,
               chunk_heads=list(md.chunk_heads or []))
    for name, key in zip(GRAD_NAMES, KEYS):
        res[name] = x[key].grad
    return res


def _bits(t):
    """t's bits as integers (bit-identity: -0 / +0 and NaN payloads included)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _worker(rank, world, jobs):
    import torch.distributed as dist

    groups = {P: dist.new_group(list(range(P))) for P in sorted({c["P"] for c, _ in jobs}) if P < world}
    out = {}
    for j, (c, job) in enumerate(jobs):
        if rank < c["P"]:
            g = groups.get(c["P"])
            heads = dict(chunk_axis="heads", num_chunks=job["k"])
            out[j] = {"heads": _run(c, rank, g, job, heads), "one": _run(c, rank, g, job, dict(num_chunks=1))}
    return out


def _jobs(seed):
    h8, h4 = dict(Hq=16, Hkv=8), dict(Hq=8, Hkv=4)
    tk = 13 + 7 + 20
    jobs = []
    for dtype in ("float64", "bfloat16"):
        c1 = case(seed, 1, blocks=[5], dtype=dtype, **h8)
        c2e = case(seed + 1, 2, blocks=[0, 4], ctx=[tk, 0], dtype=dtype, **h8)  # no blocks / no context
        c3 = case(seed + 2, 3, blocks=[2, 0, 3], ctx=[10, 25, 5], poison=True, p_invalid=0.3, dtype=dtype, **h8)
        c3h4 = case(seed + 3, 3, blocks=[3, 1, 2], ctx=[12, 8, 20], dtype=dtype, **h4)
        jobs += [
            (c1, dict(k=2)), (c1, dict(k=3, own=False)),
            (c1, dict(k=2, copies=True)), (c2e, dict(k=2)), (c2e, dict(k=3)),
            (c3, dict(k=2)), (c3, dict(k=3)), (c3, dict(k=2, own=False)),
            (c3, dict(k=3, copies=True)), (c3, dict(k=2, copies=True, own=False)),
            (c3h4, dict(k=3)), (c3h4, dict(k=2, own=False)),
        ]
    return jobs


@pytest.fixture(scope="module")
def glue_run():
    jobs = _jobs(new_seed())
    return jobs, run_distributed(_worker, 3, jobs, timeout=600)


def test_head_chunks_bit_identical_to_one_call(glue_run):
    jobs, results = glue_run
    unsorted = 0
    for j, (c, job) in enumerate(jobs):
        for r in range(c["P"]):
            res, one = results[r][j]["heads"], results[r][j]["one"]
            assert res["k"] == min(job["k"], c["Hkv"]) > 1, job
            unsorted += not res["sorted"]
            for name in ("out", "lse") + GRAD_NAMES:
                a, b = res[name], one[name]
                assert (a is None) == (b is None), (c["seed"], job, r, name)
                if a is not None:
                    assert a.dtype == b.dtype and a.shape == b.shape, (c["seed"], job, r, name)
                    assert torch.equal(_bits(a), _bits(b)), (c["seed"], job, r, name)
    assert unsorted, "no rank with a shuffled context: the unsort of dK / dV was not exercised"


def test_head_chunks_float64_vs_reference(glue_run):
    jobs, results = glue_run
    for j, (c, job) in enumerate(jobs):
        if c["dtype"] != "float64":
            continue
        per_rank = [{n: (v.double() if torch.is_tensor(v) else v) for n, v in results[r][j]["heads"].items()}
                    for r in range(c["P"])]
        if job.get("own", True):
            check("splitkv", c, per_rank)
        else:
            check_no_own(c, per_rank)


def test_equal_head_chunks_send_one_chunk_major_buffer():
    """`HeadChunks.sends`: equal chunks are views of ONE chunk-major buffer (each contiguous), uneven ones separate
    tensors; the values are the head slices, padded with the fill, invalid rows zeroed when asked."""
    from megatron_splitkv.ops.chunking import HeadChunks

    x = torch.randn(6, 8, 3, dtype=torch.float64)
    x[1] = float("nan")
    valid = torch.tensor([True, False, True, True, True, True])
    for heads in ([(0, 4), (4, 8)], [(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 6), (6, 8)], [(0, 2), (2, 8)]):
        chunking = HeadChunks(heads, 2, 3, 8, 8)
        for kw, fill in (({"fill": float("-inf")}, float("-inf")), ({"valid_rows": valid}, 0.0)):
            sends = chunking.sends(x, 9, **kw)
            even = len({h1 - h0 for h0, h1 in heads}) == 1
            assert len({s.untyped_storage().data_ptr() for s in sends}) == (1 if even else len(heads))
            for (h0, h1), s in zip(heads, sends):
                want = x[:, h0:h1].clone()
                if "valid_rows" in kw:
                    want[~valid] = 0
                assert s.is_contiguous() and s.shape == (9, h1 - h0, 3)
                assert torch.equal(_bits(s[:6]), _bits(want)) and bool((s[6:] == fill).all())
