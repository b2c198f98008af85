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
from _splitkv_helpers import GRAD_NAMES, build, case, check, check_no_own, local, loss_of, new_seed, small_inputs
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
    import torch.distributed as dist

    sizes = sorted({c["P"] for c, *_ in jobs})
    groups = {P: dist.new_group(list(range(P))) for P in sizes if P < world_size}
    out = {}
    for j, (c, k, use_meta, own) in enumerate(jobs):
        if rank < c["P"]:
            out[j] = run_chunked(c, rank, groups.get(c["P"]), k, use_meta, own)
    return out


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


def test_num_chunks_must_agree_across_ranks():
    s0, s1 = run_distributed(_disagree_worker, 2, timeout=120)
    assert s0 == s1 and len(s0) == 2
