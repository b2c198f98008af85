"""Split-KV's head-chunked merge pipeline (`chunk_axis="heads"`; ops/splitkv.py item 3 "Head chunks",
docs/lab/perf-notes.md item 21).

Chunk c = kv heads `chunk_bounds(k, Hkv)[c]` (q heads G times them, GQA groups whole) of ALL rows; k clamped to
[1, Hkv], uneven splits allowed. CPU, gloo, one spawn of 4 ranks (P = 1, 2, 3 on sub-groups):

- exactness: output, lse and all five gradients against the single-process float64 reference on fresh random
  inputs, P = 1, 2, 3, 4, uneven and empty shards (a rank with 0 blocks, a rank with 0 context tokens, NaN /
  inf in invalid blocks and unseen keys), k = 2, 3, 4 with Hkv 8 (uneven 2 / 3 / 3) and Hkv 2 (clamped),
  k_blk = v_blk = None, the two-level all-to-all (P = 4, L = 2),
  the early query gather (flat and two-level), `metadata=` reused by two calls, `group_check`, the chunk axis
  from the config;
- head chunks equal row chunks within float64 rounding, and comm_stats bytes per collective name are equal
  (exactly); each data collective is issued k times;
- the metadata: chunks, chunk_heads, the one-call masks repeated (the same objects), clamping, copy / pickle;
- errors: a bad chunk_axis / SplitKVConfig.chunk_axis (ValueError naming it and the allowed values), a call
  whose chunk_axis differs from its metadata's, and ranks disagreeing (argument or config: prepare, the
  call without metadata=, `check_environment_agreement`) raise the same ValueError on every rank; host-built
  metadata carries the axis to `bind`.

The host-built metadata (`prepare_splitkv_metadata_from_plan(..., chunk_axis="heads")`, pickled, bound) is
compared with prepare's field for field and run against the reference in tests/test_metadata_from_plan.py.
Source: DESIGN.md section 2, arXiv 2611.05926.
"""

import copy
import os
import pickle

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import (GRAD_NAMES, aggregate_records, build, case, check, check_no_own, local, loss_of,
                              new_seed, prepare_small, run_jobs, small_inputs)
from megatron_splitkv import comm_stats
from megatron_splitkv.ops.metadata import chunk_bounds, resolve_chunk_axis

KEYS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")


def _run(c, rank, group, axis, job):
    """This rank's results of case c with chunk axis `axis` and the job's options: k (num_chunks), mode ("call":
    no metadata=; "meta": prepare + metadata=, called twice; "early": + splitkv_start_query_gather; "env": the
    axis from the config, SplitKVConfig.chunk_axis), own (k_blk / v_blk given), L (cp_ranks_per_node), group_check."""
    t = build(c)
    x, meta, dout, dlse = local(t, c, rank)
    k, mode = job["k"], job["mode"]
    kb, vb = (x["k_blk"], x["v_blk"]) if job.get("own", True) else (None, None)
    axis_kw = {"config": msk.SplitKVConfig(chunk_axis=axis)} if mode == "env" else {"chunk_axis": axis}
    if True:
        md = None
        if mode != "call":
            md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                              block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                              head_dim=c["D"], dtype=x["q"].dtype, cp_group=group, num_chunks=k,
                                              cp_ranks_per_node=job.get("L"),
                                              group_check=job.get("group_check", False), **axis_kw)
        reps = 2 if mode in ("meta", "env") else 1  # metadata= reused: the second call must give the same
        outs = []
        for i in range(reps):
            xi = {n: v.detach().clone().requires_grad_(True) for n, v in x.items()}
            kbi, vbi = (xi["k_blk"], xi["v_blk"]) if kb is not None else (None, None)
            with comm_stats() as st:
                if md is None:
                    out, lse = msk.splitkv_attention(xi["q"], xi["k_ctx"], xi["v_ctx"], kbi, vbi, meta["q_seq"],
                                                     meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                                     block_size=c["B"], cp_group=group, backend="math",
                                                     return_lse=True, num_chunks=k,
                                                     cp_ranks_per_node=job.get("L"), **axis_kw)
                else:
                    q = xi["q"] * 1.0 if mode == "early" else xi["q"]
                    handle = msk.splitkv_start_query_gather(q, metadata=md) if mode == "early" else None
                    out, lse = msk.splitkv_attention(q, xi["k_ctx"], xi["v_ctx"], kbi, vbi, metadata=md,
                                                     backend="math", return_lse=True, query_gather=handle,
                                                     num_chunks=k, **axis_kw)
                loss_of(out, lse, dout, dlse).backward()
            res = dict(out=out.detach().double(), lse=lse.detach().double(),
                       records=[(r.op, r.kind, r.bytes) for r in st.records])
            for name, key in zip(GRAD_NAMES, KEYS):
                g = xi[key].grad
                res[name] = None if g is None else g.double()
            outs.append(res)
    res = outs[0]
    res["repeat_equal"] = all(
        all((a is None and b is None) or torch.equal(a, b) for a, b in ((o[n], outs[0][n]) for n in
                                                                          ("out", "lse") + GRAD_NAMES))
        for o in outs[1:])
    if md is not None:
        res.update(k_used=md.num_chunks, axis=md.chunk_axis, chunk_heads=list(md.chunk_heads), chunks=list(md.chunks),
                   same_masks=all(m is md.chunk_masks[0] for m in md.chunk_masks)
                   and all(m is md.chunk_masks_own[0] for m in md.chunk_masks_own))
    return res


def _worker(rank, world, jobs):
    def both_axes(job, group):
        c, what = job
        return {axis: _run(c, rank, group, axis, what) for axis in ("heads", "rows")}

    return run_jobs(rank, world, jobs, both_axes, case_index=0)


def _jobs(seed):
    tk = 13 + 7 + 20
    h8 = dict(Hq=16, Hkv=8)
    c1 = case(seed, 1, blocks=[5], **h8)
    c2 = case(seed + 1, 2, Hq=6, Hkv=2, blocks=[5, 3])  # GQA G = 3, Hkv 2: k = 3 / 4 clamp to 2
    c2e = case(seed + 2, 2, blocks=[0, 4], ctx=[tk, 0], **h8)  # a rank without blocks, a rank without context
    c3 = case(seed + 3, 3, blocks=[2, 0, 3], ctx=[10, 25, 5], **h8)
    c4 = case(seed + 4, 4, blocks=[3, 0, 6, 2], ctx=[10, 0, 25, 5], poison=True, p_invalid=0.3, **h8)
    c4b = case(seed + 5, 4, Hq=4, Hkv=2, blocks=[3, 2, 0, 0], ctx=[0, 20, 15, 5])  # node 1 of L = 2 empty
    return [
        (c1, dict(k=3, mode="call")), (c1, dict(k=4, mode="meta")), (c1, dict(k=2, mode="early")),
        (c2, dict(k=2, mode="call")), (c2, dict(k=3, mode="meta")), (c2, dict(k=4, mode="call", own=False)),
        (c2e, dict(k=4, mode="meta")), (c2e, dict(k=3, mode="env")),
        (c3, dict(k=3, mode="call")), (c3, dict(k=2, mode="meta", own=False)),
        (c4, dict(k=4, mode="call")), (c4, dict(k=3, mode="early", group_check=True)),
        (c4, dict(k=2, mode="meta", L=2)), (c4, dict(k=3, mode="meta", L=2)),
        (c4, dict(k=2, mode="early", L=2, own=False)), (c4b, dict(k=2, mode="call", L=2)),
        (c4b, dict(k=3, mode="early", L=2)),
    ]


@pytest.fixture(scope="module")
def head_run():
    jobs = _jobs(new_seed())
    return jobs, run_distributed(_worker, 4, jobs, timeout=600)


def _per_rank(results, j, P, axis):
    return [results[r][j][axis] for r in range(P)]


def test_head_chunks_exact_vs_reference(head_run):
    jobs, results = head_run
    for j, (c, job) in enumerate(jobs):
        per_rank = _per_rank(results, j, c["P"], "heads")
        if job.get("own", True):
            check("splitkv", c, per_rank)
        else:
            check_no_own(c, per_rank)
        assert all(r["repeat_equal"] for r in per_rank), (j, job)  # metadata= reused: identical results


def test_head_chunks_metadata(head_run):
    """k clamped to [1, Hkv]; chunk c = all rows, the kv heads of chunk_bounds(k, Hkv)[c] times G; the one-call
    masks shared by every chunk."""
    jobs, results = head_run
    for j, (c, job) in enumerate(jobs):
        if job["mode"] == "call":
            continue
        for res in _per_rank(results, j, c["P"], "heads"):
            k = min(job["k"], c["Hkv"])
            G = c["Hq"] // c["Hkv"]
            assert res["axis"] == "heads" and res["k_used"] == k, (job, res["k_used"])
            assert res["chunk_heads"] == [(g0 * G, g1 * G) for g0, g1 in chunk_bounds(k, c["Hkv"])]
            assert res["chunks"] == [(0, max(c["blocks"]))] * k and res["same_masks"]
        for res in _per_rank(results, j, c["P"], "rows"):
            assert res["axis"] == "rows" and res["chunk_heads"] == [(0, c["Hq"])] * res["k_used"]


def test_head_chunks_equal_row_chunks(head_run):
    jobs, results = head_run
    for j, (c, job) in enumerate(jobs):
        for h, r in zip(_per_rank(results, j, c["P"], "heads"), _per_rank(results, j, c["P"], "rows")):
            for key in ("out", "lse") + GRAD_NAMES:
                a, b = h[key], r[key]
                if a is None or b is None:
                    assert a is None and b is None, key
                    continue
                fin = torch.isfinite(b)
                assert torch.equal(fin, torch.isfinite(a)), (j, key)
                assert torch.allclose(a[fin], b[fin], atol=1e-12, rtol=1e-12), (j, job, key)


def test_head_chunks_keep_bytes_per_collective(head_run):
    """The same bytes per collective name as row chunks (exactly); k records per data collective name."""
    jobs, results = head_run
    for j, (c, job) in enumerate(jobs):
        for h, r in zip(_per_rank(results, j, c["P"], "heads"), _per_rank(results, j, c["P"], "rows")):
            agg_h, agg_r = aggregate_records(h["records"]), aggregate_records(r["records"])
            bytes_h = {key: b for key, (n, b) in agg_h.items()}
            bytes_r = {key: b for key, (n, b) in agg_r.items()}
            assert bytes_h == bytes_r, (j, job, bytes_h, bytes_r)
            k = min(job["k"], c["Hkv"])
            n_q = agg_h[("splitkv.fwd.q", "all_gather")][0]
            assert n_q == k, (j, n_q, k)


def test_records_equal_the_schedule_description(head_run):
    """Every rank's comm_stats records (name, kind, bytes) equal `ops.schedule.describe_splitkv` of the case's
    sizes and options, head and row chunks, flat and two-level (the size / block metadata gathers of a call
    without metadata= and the group_check verdict aside: `ops.metadata`'s, not the op's schedule)."""
    from megatron_splitkv.ops.schedule import describe_splitkv

    jobs, results = head_run
    for j, (c, job) in enumerate(jobs):
        for axis in ("heads", "rows"):
            desc = describe_splitkv(cp_size=c["P"], max_blocks=max(c["blocks"]), block_size=c["B"],
                                    num_heads_q=c["Hq"], num_heads_kv=c["Hkv"], head_dim=c["D"],
                                    dtype=getattr(torch, c["dtype"]), num_chunks=job["k"], chunk_axis=axis,
                                    cp_ranks_per_node=job.get("L"))
            want = sorted((x.name, x.kind, x.bytes) for x in desc)
            for r in _per_rank(results, j, c["P"], axis):
                got = sorted(x for x in r["records"] if x[0] not in ("splitkv.meta", "splitkv.fwd.block_meta",
                                                                         "splitkv.check"))
                assert got == want, (j, job, axis, got, want)


# ------------------------------------------------------------------------------- resolution and errors


def test_resolve_chunk_axis():
    assert resolve_chunk_axis() == "rows" and resolve_chunk_axis("heads") == "heads"
    heads = msk.SplitKVConfig(chunk_axis="heads")
    assert resolve_chunk_axis(None, heads) == "heads" and resolve_chunk_axis("rows", heads) == "rows"  # the argument wins
    for bad in ("cols", "Heads", "1"):
        with pytest.raises(ValueError, match="SplitKVConfig.chunk_axis must be one of rows, heads"):
            msk.SplitKVConfig(chunk_axis=bad)
    for bad in ("cols", 1, True, ("heads",)):
        with pytest.raises(ValueError, match="chunk_axis must be None, 'rows' or 'heads'"):
            resolve_chunk_axis(bad)


def test_single_process_errors_and_copies():
    x, m = small_inputs()
    with pytest.raises(ValueError, match="chunk_axis must be None, 'rows' or 'heads', got 'cols'"):
        prepare_small(m, chunk_axis="cols")
    with pytest.raises(ValueError, match="chunk_axis must be None, 'rows' or 'heads'"):
        msk.splitkv_attention(*x.values(), *m.values(), block_size=4, chunk_axis="cols")
    meta = prepare_small(m, num_chunks=5, config=msk.SplitKVConfig(chunk_axis="heads"))  # Hkv = 2: clamped
    assert meta.chunk_axis == "heads" and meta.num_chunks == 2 and meta.chunk_heads == [(0, 2), (2, 4)]
    ref = msk.splitkv_attention(*x.values(), *m.values(), block_size=4)
    assert torch.allclose(msk.splitkv_attention(*x.values(), metadata=meta, chunk_axis="heads", num_chunks=9), ref,
                          atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="chunk_axis='rows' differs from the metadata's chunk_axis='heads'"):
        msk.splitkv_attention(*x.values(), metadata=meta, chunk_axis="rows")
    with pytest.raises(ValueError, match="num_chunks=1 differs from the metadata's num_chunks=2"):
        msk.splitkv_attention(*x.values(), metadata=meta, num_chunks=1)
    for other in (copy.copy(meta), pickle.loads(pickle.dumps(meta))):  # single process: picklable
        assert other.chunk_axis == "heads" and other.chunk_heads == meta.chunk_heads
        assert torch.equal(msk.splitkv_attention(*x.values(), metadata=other), msk.splitkv_attention(
            *x.values(), metadata=meta))
    # the baselines ignore the axis
    assert prepare_small(m, impl="ring_kv", chunk_axis="heads").chunk_axis == "rows"


def test_host_built_metadata_carries_the_axis():
    import numpy as np

    from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan
    from megatron_splitkv.planning import plan_context_parallel

    plan = plan_context_parallel([13, 7], [np.array([0, 3, 9]), np.array([2])], block_size=4, cp_size=1,
                                 chunk_size=4)
    host = prepare_splitkv_metadata_from_plan(plan, 0, block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                              dtype=torch.float32, num_chunks=2,
                                              config=msk.SplitKVConfig(chunk_axis="heads"))
    assert host.chunk_axis == "heads" and host.num_chunks == 2
    bound = pickle.loads(pickle.dumps(host)).bind(None, "cpu")
    assert bound.chunk_axis == "heads" and all(mm is bound.chunk_masks_own[0] for mm in bound.chunk_masks_own)
    explicit = prepare_splitkv_metadata_from_plan(plan, 0, block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                                  dtype=torch.float32, num_chunks=2, chunk_axis="heads")
    assert explicit.bind(None, "cpu").chunk_axis == "heads"


def _disagree_worker(rank, world_size):
    from megatron_splitkv.ops import check_environment_agreement

    x, m = small_inputs(rank)
    axis = "heads" if rank == 0 else "rows"
    seen = []

    config = msk.SplitKVConfig(chunk_axis=axis)
    for what, fn, want in (
        ("prepare", lambda: prepare_small(m, num_chunks=2, chunk_axis=axis), "chunk_axis must be the same on every CP rank"),
        ("call", lambda: msk.splitkv_attention(*x.values(), *m.values(), block_size=4, num_chunks=2, chunk_axis=axis),
         "chunk_axis must be the same on every CP rank"),
        ("prepare config", lambda: prepare_small(m, num_chunks=2, config=config),
         "chunk_axis must be the same on every CP rank"),
        ("call config", lambda: msk.splitkv_attention(*x.values(), *m.values(), block_size=4, num_chunks=2,
                                                      config=config), "chunk_axis must be the same on every CP rank"),
        ("check config", lambda: check_environment_agreement(config=config),
         "SplitKVConfig.chunk_axis (chunk_axis)"),
    ):
        try:
            fn()
        except ValueError as exc:
            assert want in str(exc) and "['heads', 'rows']" in str(exc), str(exc)
            seen.append((what, str(exc)))
        else:
            raise AssertionError(f"{what}: no ValueError on rank {rank}")
    # still in step afterwards: an agreed call works
    out = msk.splitkv_attention(*x.values(), *m.values(), block_size=4, num_chunks=2, chunk_axis="heads")
    assert torch.isfinite(out).all()
    return seen


def test_chunk_axis_must_agree_across_ranks():
    s0, s1 = run_distributed(_disagree_worker, 2, timeout=120)
    assert s0 == s1 and len(s0) == 5
