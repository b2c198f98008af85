"""Split-KV's chunked merge pipeline (perf-notes item 2) and fused own block (item 1) at CP 1, 2, 4.

`num_chunks` 1, 2, 3 (3: uneven chunks) with and without per-step metadata, math and FlexAttention
(CPU emulation) kernels, against the single-process
float64 reference (output, lse and all five gradients), including empty ranks (no blocks / no context),
invalid blocks with NaN/inf inputs, GQA and k_blk = v_blk = None; bytes per collective name do not depend
on the chunk count (only the number of records: k per data collective); the chunk count is agreed across
ranks (prepare and call), resolved by `resolve_num_chunks` (default, clamping, environment variable).
Source: DESIGN.md section 2, arXiv 2611.05926.
"""

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import (GRAD_NAMES, build, case, check, check_no_own, expect_value_error, local,
                              loss_of, new_seed, run_jobs, run_local, small_inputs)
from megatron_splitkv import comm_stats
from megatron_splitkv.ops.metadata import chunk_bounds, resolve_num_chunks

KEYS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")
DATA_OPS = ("splitkv.fwd.q", "splitkv.fwd.out", "splitkv.bwd.dout",
            "splitkv.bwd.stats", "splitkv.bwd.dq")


def run_chunked(c, rank, group, num_chunks, use_meta, own=True):
    backend = c.get("backend", "math")
    """This rank's results of case c with an explicit chunk count (like _splitkv_helpers.run_local)."""
    t = build(c)
    x, meta, dout, dlse = local(t, c, rank)
    kb, vb = (x["k_blk"], x["v_blk"]) if own else (None, None)
    with comm_stats() as st:
        if use_meta:
            md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                              block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                              head_dim=c["D"], dtype=x["q"].dtype, cp_group=group,
                                              num_chunks=num_chunks)
            k_used = md.num_chunks
        with comm_stats() as call:
            if use_meta:
                out, lse = msk.splitkv_attention(x["q"], x["k_ctx"], x["v_ctx"], kb, vb, metadata=md,
                                                 backend=backend, return_lse=True)
            else:
                out, lse = msk.splitkv_attention(x["q"], x["k_ctx"], x["v_ctx"], kb, vb, meta["q_seq"],
                                                 meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                                 block_size=c["B"], cp_group=group, backend=backend,
                                                 return_lse=True, num_chunks=num_chunks)
                k_used = None
            loss_of(out, lse, dout, dlse).backward()
    res = dict(out=out.detach().double(), lse=lse.detach().double(), k_used=k_used,
               bytes_by_op=call.bytes_by_op, ops=[r.op for r in call.records], total=st.total_bytes)
    for name, key in zip(GRAD_NAMES, KEYS):
        g = x[key].grad
        res[name] = g.double() if g is not None else None
    return res


def _worker(rank, world_size, jobs):
    def one(job, group):
        c, k, use_meta, own = job
        return run_chunked(c, rank, group, k, use_meta, own)

    return run_jobs(rank, world_size, jobs, one, case_index=0)


def _cases(seed):
    tk = 13 + 7 + 20
    return [
        # P=2: uneven blocks (5 and 3), GQA, invalid blocks, anchors at 0
        case(seed, 2, dtype="float64", Hq=6, Hkv=2, blocks=[5, 3]),
        # P=2: a rank with no blocks, a rank with no context
        case(seed + 1, 2, dtype="float64", blocks=[0, 4], ctx=[tk, 0]),
        # P=4: uneven and empty shards, NaN/inf in invalid blocks and unseen keys
        case(seed + 2, 4, dtype="float64", blocks=[3, 0, 6, 2], ctx=[10, 0, 25, 5], poison=True,
             p_invalid=0.3),
        # P=4: float32, B=3
        case(seed + 3, 4, dtype="float32", B=3, Hq=4, Hkv=1, blocks=[4, 4, 4, 4]),
        # P=2: the FlexAttention kernel (CPU emulation reading the union BlockMask tables), uneven blocks
        dict(case(seed + 4, 2, dtype="float32", D=16, blocks=[3, 2], ctx=[25, 15]), backend="flex"),
    ]


@pytest.fixture(scope="module")
def chunk_run():
    seed = new_seed()
    jobs = []
    for c in _cases(seed):
        for k in (1, 2, 3):
            jobs.append((c, k, k != 2, True))  # k = 2 through the call's num_chunks, 1 and 3 via metadata
        jobs.append((c, 3, False, False))  # no own block, chunked
    return jobs, run_distributed(_worker, 4, jobs, timeout=400)


def _per_rank(results, j, P):
    return [results[r][j] for r in range(P)]


def test_chunked_exact_vs_reference(chunk_run):
    jobs, results = chunk_run
    for j, (c, k, use_meta, own) in enumerate(jobs):
        per_rank = _per_rank(results, j, c["P"])
        if own:
            check("splitkv", c, per_rank)
            if use_meta:
                nb_max = max(c["blocks"])
                assert per_rank[0]["k_used"] == min(k, nb_max)


def test_chunked_no_own_block_matches_reference(chunk_run):
    """k_blk = v_blk = None with chunking: the reference without the own-block part."""
    jobs, results = chunk_run
    for j, (c, k, use_meta, own) in enumerate(jobs):
        if not own:
            check_no_own(c, _per_rank(results, j, c["P"]))


def test_chunked_results_agree_across_chunk_counts(chunk_run):
    """Chunking only reorders independent work: results for k = 1, 2, 3 agree to rounding."""
    jobs, results = chunk_run
    by_case = {}
    for j, (c, k, use_meta, own) in enumerate(jobs):
        if own:
            by_case.setdefault(c["seed"], []).append((c, _per_rank(results, j, c["P"])))
    for runs in by_case.values():
        (c, base), others = runs[0], runs[1:]
        tol = {"float64": 1e-12, "float32": 1e-5}[c["dtype"]]
        for _, other in others:
            for r in range(c["P"]):
                for key in ("out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"):
                    a, b = base[r][key], other[r][key]
                    assert torch.allclose(a, b, atol=tol, rtol=tol), (c["seed"], r, key)


def test_chunking_keeps_bytes_per_collective(chunk_run):
    """Bytes per op name are independent of the chunk count; each data collective is issued k times."""
    jobs, results = chunk_run
    by_case = {}
    for j, (c, k, use_meta, own) in enumerate(jobs):
        if not own:
            continue
        for r, res in enumerate(_per_rank(results, j, c["P"])):
            data = {op: b for op, b in res["bytes_by_op"].items() if op in DATA_OPS}
            by_case.setdefault((c["seed"], r), []).append(data)
            k_eff = min(k, max(c["blocks"]))
            for op in DATA_OPS:
                assert res["ops"].count(op) == k_eff, (op, k, res["ops"])
    for key, datas in by_case.items():
        assert all(d == datas[0] for d in datas), (key, datas)
        assert set(datas[0]) == set(DATA_OPS)


# ------------------------------------------------------------------------------- resolution and errors


def test_resolve_num_chunks_and_bounds():
    assert resolve_num_chunks(None, 1, 512) == 1  # CP=1: no communication to hide
    assert resolve_num_chunks(None, 2, 512) == 1 and resolve_num_chunks(None, 8, 3) == 1  # measured best
    assert resolve_num_chunks(None, 2, 0) == 1 and resolve_num_chunks(2, 1, 512) == 2
    assert resolve_num_chunks(8, 2, 5) == 5 and resolve_num_chunks(0, 2, 16) == 1
    assert resolve_num_chunks(4, 2, 3) == 3  # clamped to the largest rank's block count
    two = msk.SplitKVConfig(num_chunks=2)
    assert resolve_num_chunks(None, 1, 512, two) == 2 and resolve_num_chunks(None, 4, 512, two) == 2
    assert resolve_num_chunks(3, 4, 512, two) == 3  # an explicit value wins over the config
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_chunks must be None or a positive int"):
            resolve_num_chunks(bad, 2, 8)
    assert chunk_bounds(3, 5) == [(0, 1), (1, 3), (3, 5)]
    assert chunk_bounds(4, 512) == [(0, 128), (128, 256), (256, 384), (384, 512)]
    assert chunk_bounds(1, 0) == [(0, 0)]


def test_single_process_chunks_and_errors():
    x, m = small_inputs()
    ref = msk.splitkv_attention(*x.values(), *m.values(), block_size=4)
    for k in (1, 2, 3, 4, 9):
        out = msk.splitkv_attention(*x.values(), *m.values(), block_size=4, num_chunks=k)
        assert torch.allclose(out, ref, atol=1e-6, rtol=1e-6), k
    meta = msk.prepare_splitkv_metadata(*m.values(), block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                        dtype=torch.float32, num_chunks=3)
    assert meta.num_chunks == 3 and len(meta.chunk_masks) == 3 and len(meta.chunk_masks_own) == 3
    assert torch.allclose(msk.splitkv_attention(*x.values(), metadata=meta, num_chunks=3), ref, atol=1e-6)
    with pytest.raises(ValueError, match="num_chunks=2 differs from the metadata's num_chunks=3"):
        msk.splitkv_attention(*x.values(), metadata=meta, num_chunks=2)
    with pytest.raises(ValueError, match="num_chunks must be None or a positive int"):
        msk.splitkv_attention(*x.values(), *m.values(), block_size=4, num_chunks=0)
    with pytest.raises(ValueError, match="num_chunks must be None or a positive int"):
        msk.prepare_splitkv_metadata(*m.values(), block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                     dtype=torch.float32, num_chunks="2")
    meta = msk.prepare_splitkv_metadata(*m.values(), block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                        dtype=torch.float32, config=msk.SplitKVConfig(num_chunks=2))
    assert meta.num_chunks == 2 and meta.chunks == [(0, 2), (2, 4)] and meta.config.num_chunks == 2
    # the baselines ignore the chunk count
    assert msk.prepare_splitkv_metadata(*m.values(), block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                        dtype=torch.float32, impl="ring_kv").num_chunks == 1


def _disagree_worker(rank, world_size):
    x, m = small_inputs(rank)
    seen = []
    for what, fn in (
        ("prepare", lambda: msk.prepare_splitkv_metadata(*m.values(), block_size=4, num_heads_q=4,
                                                         num_heads_kv=2, head_dim=8, dtype=torch.float32,
                                                         num_chunks=1 + rank)),
        ("call", lambda: msk.splitkv_attention(*x.values(), *m.values(), block_size=4, num_chunks=2 + rank)),
    ):
        try:
            fn()
        except ValueError as exc:
            assert "num_chunks (requested) must be the same on every CP rank" in str(exc), str(exc)
            seen.append((what, str(exc)))
        else:
            raise AssertionError(f"{what}: no ValueError on rank {rank}")
    # still in step afterwards: an agreed call works
    out = msk.splitkv_attention(*x.values(), *m.values(), block_size=4, num_chunks=2)
    assert torch.isfinite(out).all()
    return seen


def test_num_chunks_must_agree_across_ranks(two_rank_run):
    s0, s1 = [r["disagree"] for r in two_rank_run["ranks"]]
    assert s0 == s1 and len(s0) == 2


def _zero_block_jobs(seed):
    return [case(seed + i, 2, blocks=[0, 0], ctx=ctx, metadata=meta, num_chunks=k)
            for i, (k, meta, ctx) in enumerate([(None, False, "even"), (1, True, "even"), (2, False, [40, 0]),
                                                (3, True, [0, 40])])]


def test_no_query_blocks_on_any_rank_chunked(two_rank_run):
    """All ranks hold zero query blocks (e.g. a micro-batch of padding only): every chunk of the
    all-to-all merge is empty. Used to fail with "cannot reshape tensor of 0 elements" (view(P, rc, -1)
    in the forward merge, view(P, -1, H, D) in the dQ sum); now out/lse/dq are empty and the context
    gradients are zero, as in the reference."""
    jobs, per_rank = two_rank_run["zero_block_jobs"], [r["zero_blocks"] for r in two_rank_run["ranks"]]
    for i, c in enumerate(jobs):
        check("splitkv", c, [per_rank[r][i] for r in range(2)])
    # single process, with and without the own block
    for k in (None, 2):
        q = torch.zeros(0, 2, 8, requires_grad=True)
        kc = torch.randn(5, 1, 8, requires_grad=True)
        empty = torch.zeros(0, dtype=torch.int64)
        for kb in (None, torch.zeros(0, 1, 8)):
            out, lse = msk.splitkv_attention(q, kc, kc, kb, kb, empty, empty, torch.zeros(5, dtype=torch.int64),
                                             torch.arange(5), block_size=4, return_lse=True, num_chunks=k)
            (out.sum() + lse.sum()).backward()
            assert out.shape == (0, 2, 8) and lse.shape == (0, 2) and not kc.grad.any()


# ------------------------------------------------------------------ one head: packing the lse of FlexAttention


def _single_head_jobs(seed):
    return [case(seed + 10 * P + i, P, dtype=dt, Hq=1, Hkv=1, D=16, B=3, blocks=[3] * P, backend="flex",
                 num_chunks=k) for P in (1, 2) for i, (dt, k) in enumerate([("bfloat16", None), ("float16", 2)])]


def test_single_head_flex_bf16_fp16(two_rank_run):
    """Hq = Hkv = 1 with the flex kernel: flex's lse [Tq, 1] keeps a stride != 1 on its size-1 head dim
    through .contiguous(), and pack_partial's dtype view of it (fp32 lse into bf16/fp16) used to raise
    "self.stride(-1) must be 1 to view Float as Half"."""
    jobs, results = two_rank_run["single_head_jobs"], [r["single_head"] for r in two_rank_run["ranks"]]
    for i, c in enumerate(jobs):
        check("splitkv", c, [results[r][i] for r in range(c["P"])])


# ------------------------------------------------------------------ num_chunks values, per rank


def _num_chunks_worker(rank, world):
    c = case(11, world, dtype="float64", blocks=[3, 2])
    t = build(c)
    x, meta, _, _ = local(t, c, rank)
    args = (x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], meta["q_seq"], meta["q_anchor"],
            meta["kv_seq"], meta["kv_pos"])

    def call(k, config=None):
        return msk.splitkv_attention(*args, block_size=c["B"], num_chunks=k, config=config)

    def prepare(k):
        return msk.prepare_splitkv_metadata(*args[5:], block_size=c["B"], num_heads_q=c["Hq"],
                                            num_heads_kv=c["Hkv"], head_dim=c["D"], dtype=torch.float64,
                                            num_chunks=k)

    seen = []
    for name, fn, expect in (
        # an int beyond int64 on ONE rank: used to raise an overflow on that rank only, outside the group
        # verdict, so the other rank hung in the size all-gather
        ("huge vs 2", lambda: call(2**64 if rank == 0 else 2), "num_chunks (requested) must be the same"),
        ("prepare huge vs 2", lambda: prepare(2**70 if rank == 1 else 2), "num_chunks (requested) must be the same"),
        ("0 on one rank", lambda: call(0 if rank == 1 else 2), "num_chunks must be None or a positive int"),
        ("bool on one rank", lambda: call(True if rank == 0 else 1), "num_chunks must be None or a positive int"),
        ("float on one rank", lambda: prepare(2.0 if rank == 0 else 2), "num_chunks must be None or a positive int"),
    ):
        seen.append(expect_value_error(name, fn, expect, rank))
    # the config's num_chunks different on one rank (a malformed one cannot be built: tests/test_config.py)
    for name, k, expect in (("config differs", 3 if rank == 1 else 2, "num_chunks (requested) must be the same"),
                            ("config huge", 10**30 if rank == 0 else 1, "num_chunks (requested) must be the same")):
        try:
            call(None, msk.SplitKVConfig(num_chunks=k))
        except ValueError as exc:
            assert expect in str(exc), (name, str(exc))
            seen.append((name, str(exc)))
        else:
            raise AssertionError(f"{name}: no ValueError on rank {rank}")
    # a huge value on every rank is clamped to the block count (3), with and without metadata
    ref = call(1).detach()
    outs = [call(2**64).detach(), msk.splitkv_attention(*args[:5], metadata=prepare(10**30)).detach()]
    md = prepare(2**64)
    assert md.num_chunks == 3
    # with metadata=, the call may repeat the value given to prepare (it clamps to the same chunking); a
    # bool / float / other count raises (True used to be accepted as 1)
    outs.append(msk.splitkv_attention(*args[:5], metadata=md, num_chunks=2**64).detach())
    outs.append(msk.splitkv_attention(*args[:5], metadata=md, num_chunks=3).detach())
    for bad, expect in ((True, "positive int"), (3.0, "positive int"), (2, "differs from the metadata's")):
        with pytest.raises(ValueError, match=expect):
            msk.splitkv_attention(*args[:5], metadata=md, num_chunks=bad)
    md1 = prepare(1)
    with pytest.raises(ValueError, match="positive int"):
        msk.splitkv_attention(*args[:5], metadata=md1, num_chunks=True)
    return seen, [float((o - ref).abs().max()) for o in outs]


def test_num_chunks_bad_or_huge_on_one_rank_raises_everywhere(two_rank_run):
    (s0, d0), (s1, d1) = [r["num_chunks"] for r in two_rank_run["ranks"]]
    assert [n for n, _ in s0] == [n for n, _ in s1] and len(s0) == 7
    for (n, m0), (_, m1) in zip(s0, s1):
        assert m0 == m1, (n, m0, m1)
    assert max(d0 + d1) < 1e-12


# ------------------------------------------------------------------ the 2-rank tests above: one gloo group


def _two_rank_worker(rank, world, zero_block_jobs, single_head_jobs):
    """The 2-rank tests of this file in one group, each case after the previous one's errors (so a rank left
    behind in a collective would hang the next): zero query blocks everywhere, one head with flex (P = 1 on a
    sub-group), num_chunks bad / huge on one rank, num_chunks differing across ranks."""
    import torch.distributed as dist

    one = dist.new_group([0])
    return dict(zero_blocks=[run_local("splitkv", c, rank, dist.group.WORLD) for c in zero_block_jobs],
                single_head={i: run_local("splitkv", c, rank, one if c["P"] == 1 else dist.group.WORLD)
                             for i, c in enumerate(single_head_jobs) if rank < c["P"]},
                num_chunks=_num_chunks_worker(rank, world), disagree=_disagree_worker(rank, world))


@pytest.fixture(scope="module")
def two_rank_run():
    seed = new_seed()
    zero, single = _zero_block_jobs(seed), _single_head_jobs(seed + 100)
    return dict(zero_block_jobs=zero, single_head_jobs=single,
                ranks=run_distributed(_two_rank_worker, 2, zero, single, timeout=300))
