"""Split-KV's uneven head split with the backward's chunks in reverse order (`head_split` of
`prepare_splitkv_metadata`, SplitKVConfig.head_split; docs/perf-notes.md item 22).

CPU, gloo, one spawn of 4 ranks (P = 1, 2, 3 on sub-groups): output, lse and all five gradients against the
float64 reference for splits 6/2, 1/7, 2/1/5 (Hkv 8), uneven and empty shards, the two-level all-to-all (P = 4,
L = 2), the early query gather, `metadata=` reused, the split from the config
variable; the metadata's chunk heads; bytes per collective name equal to the even split's; errors (single
process) and ranks disagreeing (the same ValueError on every rank); the host-built path (data pipeline) takes it too.
"""

import copy
import os
import pickle

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import (GRAD_NAMES, aggregate_records, build, case, check, local, loss_of, new_seed,
                              prepare_small, small_inputs)
from megatron_splitkv import comm_stats
from megatron_splitkv.ops.splitkv import _bwd_order

KEYS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")


def _run(c, rank, group, split, job):
    t = build(c)
    x, meta, dout, dlse = local(t, c, rank)
    env = job.get("env") and split is not None  # the split from the config instead of the argument
    kw = {"config": msk.SplitKVConfig(chunk_axis="heads", head_split=split)} if env else {"head_split": split}
    if True:
        md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                          block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                          head_dim=c["D"], dtype=x["q"].dtype, cp_group=group, chunk_axis="heads",
                                          num_chunks=None if split else job["k"], cp_ranks_per_node=job.get("L"),
                                          **kw)
    outs = []
    for _ in range(2):  # metadata= reused
        xi = {n: v.detach().clone().requires_grad_(True) for n, v in x.items()}
        with comm_stats() as st:
            q = xi["q"] * 1.0 if job.get("early") else xi["q"]
            handle = msk.splitkv_start_query_gather(q, metadata=md) if job.get("early") else None
            out, lse = msk.splitkv_attention(q, xi["k_ctx"], xi["v_ctx"], xi["k_blk"], xi["v_blk"], metadata=md,
                                             backend="math", return_lse=True, query_gather=handle)
            loss_of(out, lse, dout, dlse).backward()
        res = dict(out=out.detach().double(), lse=lse.detach().double(),
                   records=[(r.op, r.kind, r.bytes) for r in st.records],
                   order=[r.op for r in st.records if r.op.startswith("splitkv.bwd")])
        for name, key in zip(GRAD_NAMES, KEYS):
            g = xi[key].grad
            res[name] = None if g is None else g.double()
        outs.append(res)
    res = outs[0]
    res["repeat_equal"] = all(torch.equal(outs[1][n], res[n]) for n in ("out", "lse") + GRAD_NAMES
                              if res[n] is not None)
    res.update(k=md.num_chunks, chunk_heads=list(md.chunk_heads), bwd_order=_bwd_order(md))
    return res


def _worker(rank, world, jobs):
    import torch.distributed as dist

    groups = {P: dist.new_group(list(range(P))) for P in sorted({c["P"] for c, _ in jobs}) if P < world}
    out = {}
    for j, (c, job) in enumerate(jobs):
        if rank < c["P"]:
            out[j] = {"split": _run(c, rank, groups.get(c["P"]), job["split"], job),
                      "even": _run(c, rank, groups.get(c["P"]), None, job)}
    return out


def _jobs(seed):
    h8 = dict(Hq=16, Hkv=8)
    tk = 13 + 7 + 20
    c1 = case(seed, 1, blocks=[5], **h8)
    c2e = case(seed + 1, 2, blocks=[0, 4], ctx=[tk, 0], **h8)  # a rank without blocks, a rank without context
    c3 = case(seed + 2, 3, blocks=[2, 0, 3], ctx=[10, 25, 5], **h8)
    c4 = case(seed + 3, 4, blocks=[3, 0, 6, 2], ctx=[10, 0, 25, 5], poison=True, p_invalid=0.3, **h8)
    return [
        (c1, dict(split=(6, 2), k=2)), (c2e, dict(split=(1, 7), k=2)), (c2e, dict(split=(6, 2), k=2, env=True)),
        (c3, dict(split=(2, 1, 5), k=3, early=True)), (c4, dict(split=(6, 2), k=2)),
        (c4, dict(split=(2, 1, 5), k=3, L=2)), (c4, dict(split=(6, 2), k=2, L=2, early=True)),
    ]


@pytest.fixture(scope="module")
def split_run():
    jobs = _jobs(new_seed())
    return jobs, run_distributed(_worker, 4, jobs, timeout=600)


def test_head_split_exact_vs_reference_and_reused(split_run):
    jobs, results = split_run
    for j, (c, job) in enumerate(jobs):
        per_rank = [results[r][j]["split"] for r in range(c["P"])]
        check("splitkv", c, per_rank)
        assert all(r["repeat_equal"] for r in per_rank), job


def test_head_split_metadata_and_reversed_backward(split_run):
    """chunk c = the split's kv heads (x G q heads); the uneven split's backward runs k-1..0 (its dQ exchanges are
    issued last chunk first: the records' order), the even split's 0..k-1."""
    jobs, results = split_run
    for j, (c, job) in enumerate(jobs):
        G = c["Hq"] // c["Hkv"]
        for r in range(c["P"]):
            res, even = results[r][j]["split"], results[r][j]["even"]
            s, acc, want = job["split"], 0, []
            for h in s:
                want.append((acc * G, (acc + h) * G))
                acc += h
            assert res["k"] == len(s) and res["chunk_heads"] == want
            assert res["bwd_order"] == list(range(len(s)))[::-1] and even["bwd_order"] == list(range(len(s)))


def test_head_split_keeps_bytes_per_collective(split_run):
    jobs, results = split_run
    for j, (c, job) in enumerate(jobs):
        for r in range(c["P"]):
            a = aggregate_records(results[r][j]["split"]["records"])
            b = aggregate_records(results[r][j]["even"]["records"])
            assert {k: v[1] for k, v in a.items()} == {k: v[1] for k, v in b.items()}, (j, job)
            assert {k: v[0] for k, v in a.items()} == {k: v[0] for k, v in b.items()}, (j, job)


# ------------------------------------------------------------------------------- errors, copies, agreement


def test_head_split_errors_and_copies():
    x, m = small_inputs()
    for bad, msg in (((1, 2), "head_split must be positive kv-head counts summing to Hkv = 2, got 1,2"),
                     ((2, 0), "head_split must be positive kv-head counts summing to Hkv = 2, got 2,0"),
                     ((3, -1), "head_split must be positive kv-head counts summing to Hkv = 2, got 3,-1"),
                     ((1, "1"), "head_split must be a sequence of positive ints, got '1'"), ("1,1", "head_split must be None or a sequence"),
                     ((1.5, 0.5), "head_split must be"), ((True, True), "head_split must be")):
        with pytest.raises(ValueError, match=msg):
            prepare_small(m, chunk_axis="heads", head_split=bad)
    with pytest.raises(ValueError, match="head_split needs chunk_axis 'heads'"):
        prepare_small(m, chunk_axis="rows", head_split=(1, 1))
    with pytest.raises(ValueError, match=r"num_chunks=1 differs from the 2 chunks of head_split=1,1"):
        prepare_small(m, chunk_axis="heads", head_split=(1, 1), num_chunks=1)
    with pytest.raises(ValueError, match="head_split is for impl 'splitkv' only"):
        prepare_small(m, impl="ring_kv", head_split=(1, 1))
    for bad in ((3,), (1, 1, 1)):  # the config's split against this Hkv = 2
        with pytest.raises(ValueError, match="SplitKVConfig.head_split must be positive kv-head counts summing"):
            prepare_small(m, config=msk.SplitKVConfig(chunk_axis="heads", head_split=bad))
    split_config = msk.SplitKVConfig(chunk_axis="heads", head_split=(1, 1))
    with pytest.raises(ValueError, match="SplitKVConfig.head_split is set, but a call without metadata="):
        msk.splitkv_attention(*x.values(), *m.values(), block_size=4, config=split_config)
    meta = prepare_small(m, config=split_config)
    assert meta.head_split == (1, 1) and meta.num_chunks == 2
    ref = msk.splitkv_attention(*x.values(), *m.values(), block_size=4)
    assert torch.allclose(msk.splitkv_attention(*x.values(), metadata=meta), ref, atol=1e-6, rtol=1e-6)
    for other in (copy.copy(meta), pickle.loads(pickle.dumps(meta))):
        assert other.head_split == (1, 1) and other.chunk_heads == meta.chunk_heads
        assert torch.equal(msk.splitkv_attention(*x.values(), metadata=other),
                           msk.splitkv_attention(*x.values(), metadata=meta))


def test_host_built_metadata_takes_the_split():
    """prepare_splitkv_metadata_from_plan (the data pipeline's worker build) takes head_split as an argument
    or from the config, like prepare: bound, it equals prepare's metadata field for field (tests/
    test_metadata_from_plan.py's comparison) and survives the data pipeline's packed recipe."""
    import numpy as np

    from megatron_splitkv.ops import metadata as md
    from megatron_splitkv.ops import prepare_splitkv_metadata, prepare_splitkv_metadata_from_plan
    from megatron_splitkv.planning import plan_context_parallel
    from test_metadata_from_plan import meta_diff

    plan = plan_context_parallel([13, 7], [np.array([0, 3, 9]), np.array([2])], block_size=4, cp_size=1,
                                 chunk_size=4)
    kw = dict(block_size=4, num_heads_q=6, num_heads_kv=3, head_dim=8, dtype=torch.float32, chunk_axis="heads")
    sl = plan.query_slice(0)
    ref = prepare_splitkv_metadata(torch.from_numpy(plan.q_seq[sl].copy()), torch.from_numpy(plan.q_anchor[sl].copy()),
                                   torch.from_numpy(plan.token_seq_ids(0)), torch.from_numpy(plan.token_positions(0)),
                                   head_split=(2, 1), **kw)
    assert ref.head_split == (2, 1) and ref.chunk_heads == [(0, 4), (4, 6)]
    by_arg = prepare_splitkv_metadata_from_plan(plan, 0, head_split=(2, 1), **kw)
    assert meta_diff(by_arg.bind(None, "cpu"), ref) == []
    by_env = prepare_splitkv_metadata_from_plan(plan, 0, config=msk.SplitKVConfig(chunk_axis="heads",
                                                                                  head_split=(2, 1)), **kw)
    assert by_env.head_split == (2, 1) and meta_diff(by_env.bind(None, "cpu"), ref) == []
    packed = md._from_recipe(md._pack(md._unique_tensors(by_env), pin=False)[0], md._pack_recipe(by_env))
    assert packed.head_split == (2, 1) and meta_diff(packed.bind(None, "cpu"), ref) == []



def _disagree_worker(rank, world_size):
    from megatron_splitkv.ops import check_environment_agreement

    x, m = small_inputs(rank)
    split = (1, 1) if rank == 0 else None  # the same k = 2, the split requested on rank 0 only
    seen = []

    config = msk.SplitKVConfig(chunk_axis="heads", head_split=(1, 1) if rank == 0 else None)
    for what, fn, want in (
        ("prepare", lambda: prepare_small(m, chunk_axis="heads", num_chunks=2, head_split=split),
         "head_split must be the same"),
        ("prepare config", lambda: prepare_small(m, chunk_axis="heads", num_chunks=2, config=config),
         "head_split must be the same"),
        ("check config", lambda: check_environment_agreement(config=config),
         "SplitKVConfig.head_split (head_split, None = even)"),
    ):
        try:
            fn()
        except ValueError as exc:
            assert want in str(exc), str(exc)
            seen.append((what, str(exc)))
        else:
            raise AssertionError(f"{what}: no ValueError on rank {rank}")
    meta = prepare_small(m, chunk_axis="heads", head_split=(1, 1))  # still in step: an agreed prepare works
    assert torch.isfinite(msk.splitkv_attention(*x.values(), metadata=meta)).all()
    return seen


def test_head_split_must_agree_across_ranks():
    s0, s1 = run_distributed(_disagree_worker, 2, timeout=120)
    assert s0 == s1 and len(s0) == 3


@pytest.mark.parametrize("text,want", [
    ("3,2", "{n} must be positive kv-head counts summing to Hkv = 4, got 3,2"),
    ("4,0", "{n} must be positive kv-head counts summing to Hkv = 4, got 4,0"),
    ("5,-1", "{n} must be positive kv-head counts summing to Hkv = 4, got 5,-1"),
    ("2,x", "{n} must be a comma list of positive ints (kv heads per chunk, summing to Hkv = 4), got '2,x'"),
    ("2,+2", "{n} must be a comma list of positive ints (kv heads per chunk, summing to Hkv = 4), got '2,+2'"),
])
def test_one_head_split_validator_for_the_op_and_the_tools(text, want):
    """The tools' --head-split(s) (`bench.parse_head_splits`) and the op's
    / `bench.kernel_calls`' head_split value go through one validator (`ops.metadata.check_head_split` /
    `head_split_from_text`) with one message; each only names its own argument."""
    from tools import benchlib as bench
    from megatron_splitkv.ops import metadata as md

    with pytest.raises(ValueError) as flag_err:
        bench.parse_head_splits("2,2:" + text, 4, "--head-split")
    assert str(flag_err.value) == want.format(n="--head-split")
    if "x" not in text and "+" not in text:
        value = tuple(int(h) for h in text.split(","))
        with pytest.raises(ValueError) as arg_err:
            md.check_head_split(value, 4)
        assert str(arg_err.value) == want.format(n="head_split")
    assert bench.parse_head_splits("3,1:1,3:3,1", 4, "--head-split") == [(3, 1), (1, 3)]


def test_head_split_messages_name_the_argument_for_huge_counts_and_long_values():
    """check_head_split([10**5000, 1], 4) raised Python's own 'Exceeds the limit (4300 digits) for integer string
    conversion' (the range message str()'d every count), not a message naming head_split; a long split or text
    was quoted whole (a 3000-count split: a 6 KB message, a 10 KB variable: 10 KB). Now the message names the
    argument and quotes long values cut (as `_ints.parse_int` / `as_int`)."""
    from megatron_splitkv.ops import metadata as md

    for value in ([10 ** 5000, 1], [1, -(10 ** 5000)], [2] * 3000):
        with pytest.raises(ValueError) as err:
            md.check_head_split(value, 4)
        msg = str(err.value)
        assert msg.startswith("head_split must be positive kv-head counts summing to Hkv = 4, got "), msg[:120]
        assert len(msg) < 400, len(msg)
    assert "3000 counts" in msg
    for text in ("9" * 5000 + ",1", "2" + "," * 10000, "2," * 3000 + "2"):
        with pytest.raises(ValueError) as err:
            md.head_split_from_text(text, 4, "X")
        assert str(err.value).startswith("X must be ") and len(str(err.value)) < 400, len(str(err.value))
    # short values keep their exact messages
    with pytest.raises(ValueError, match=r"^head_split must be positive kv-head counts summing to Hkv = 4, got 3,3$"):
        md.check_head_split((3, 3), 4)
