"""Split-KV's two-level all-to-all (`cp_ranks_per_node` = L; ops/transport.py `TwoLevelAllToAll`).

CPU, gloo. At P = 4 with L in {1, 2, 4} and P = 2 with L in {1, 2} (one spawn of 4 ranks), and at P = 6
with L = 3 plus a P = 4 sub-group of a 6-rank world with L = 2 (the sub-groups then come from
`new_group(..., use_local_synchronization=True)`; one spawn of 6 ranks): output, lse and all five
gradients against the single-process float64 reference, with uneven and empty shards (no blocks, no
context), invalid blocks with NaN/inf inputs, num_chunks 1 and 2, bf16 / fp32 / fp64, k_blk = v_blk =
None, with and without per-step metadata, and with the early query gather (bit-identical to the call
without it). L = 1 and L = P are today's single all-to-all (bit-identical to each other); 1 < L < P
agrees with it to fp32 reassociation. Every rank's comm_stats records equal `bench.predicted_records`
(op, kind, bytes, count) and the stage records carry the sub-group sizes. Errors: L not dividing P, L
differing across ranks (the same ValueError on every rank), a call's L differing from the metadata's,
bad values and the environment variable. Source: DESIGN.md section 2 (merge rule); the two-level
exchange is our extension for multi-node CP groups.
"""

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import GRAD_NAMES, TOL, build, case, check, local, loss_of, new_seed, rel_err, small_inputs
from megatron_splitkv import comm_stats
from tools import benchlib as bench
from megatron_splitkv.ops.metadata import resolve_ranks_per_node

KEYS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")
TWO_LEVEL = ("splitkv.fwd.out.intra", "splitkv.fwd.out.inter", "splitkv.bwd.dq.intra", "splitkv.bwd.dq.inter")


def run_case(c, rank, group, L, k, use_meta, own=True, early=False):
    """This rank's results of case c with cp_ranks_per_node=L and num_chunks=k (records of the call only)."""
    t = build(c)
    x, meta, dout, dlse = local(t, c, rank)
    dt = x["q"].dtype
    md = None
    if use_meta:
        md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                          block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                          head_dim=c["D"], dtype=dt, cp_group=group, num_chunks=k,
                                          cp_ranks_per_node=L, group_check=False)  # data collectives only
    with comm_stats() as st:
        q = x["q"] * 1.0 if early else x["q"]  # early: a non-leaf q, as a layer's
        handle = msk.splitkv_start_query_gather(q, metadata=md) if early else None
        kb, vb = (x["k_blk"], x["v_blk"]) if own else (None, None)
        if use_meta:
            out, lse = msk.splitkv_attention(q, x["k_ctx"], x["v_ctx"], kb, vb, metadata=md, backend="math",
                                             return_lse=True, query_gather=handle,
                                             cp_ranks_per_node=L if rank % 2 else None)  # None or the same
        else:
            out, lse = msk.splitkv_attention(q, x["k_ctx"], x["v_ctx"], kb, vb, meta["q_seq"], meta["q_anchor"],
                                             meta["kv_seq"], meta["kv_pos"], block_size=c["B"], cp_group=group,
                                             backend="math", return_lse=True, num_chunks=k, cp_ranks_per_node=L)
        loss_of(out, lse, dout, dlse).backward()
    res = dict(out=out.detach().double(), lse=lse.detach().double(),
               records=[(r.op, r.kind, r.bytes, r.group_size) for r in st.records],
               k_used=md.num_chunks if md is not None else None, L_used=md.cp_ranks_per_node if md else L)
    for name, key in zip(GRAD_NAMES, KEYS):
        g = x[key].grad
        res[name] = None if g is None else g.double()
    return res


def _worker(rank, world, jobs):
    """jobs: (case, L, k, use_meta, own, early); a case with P < world runs on ranks 0..P-1 (its group
    created by every rank, in the same order)."""
    import torch.distributed as dist

    sizes = sorted({c["P"] for c, *_ in jobs})
    groups = {P: dist.new_group(list(range(P))) for P in sizes if P < world}
    out = {}
    for j, (c, L, k, use_meta, own, early) in enumerate(jobs):
        if rank < c["P"]:
            out[j] = run_case(c, rank, groups.get(c["P"]), L, k, use_meta, own, early)
    return out


def _predicted(c, rank, L, k, use_meta):
    elem = torch.empty((), dtype=getattr(torch, c["dtype"])).element_size()
    t = build(c)
    n_ctx = [int(i.numel()) for i in t["ctx_idx"]]
    kw = dict(P=c["P"], rank=rank, n_blocks=c["blocks"], n_ctx=n_ctx, B=c["B"], Hq=c["Hq"], Hkv=c["Hkv"],
              D=c["D"], elem=elem, acc=8 if elem == 8 else 4, metadata=use_meta, num_chunks=k,
              cp_ranks_per_node=L)
    return bench.predicted_records("splitkv", **kw)


from _splitkv_helpers import aggregate_records as _agg  # noqa: E402


def _cases_4(seed):
    tk = 13 + 7 + 20
    return [
        # uneven and empty shards, NaN/inf in invalid blocks and unseen keys, fp64
        case(seed, 4, dtype="float64", blocks=[3, 0, 5, 2], ctx=[10, 0, 25, 5], poison=True, p_invalid=0.3),
        # bf16, GQA, equal blocks
        case(seed + 1, 4, dtype="bfloat16", Hq=4, Hkv=1, blocks=[2, 2, 2, 2]),
        # fp32, a node (ranks 2, 3) without any query block
        case(seed + 2, 4, dtype="float32", blocks=[3, 2, 0, 0], ctx=[0, 20, 15, 5]),
        # P = 2 (the sub-group of ranks 0, 1), fp64, uneven
        case(seed + 3, 2, dtype="float64", Hq=6, Hkv=2, blocks=[5, 3], ctx=[tk, 0]),
    ]


@pytest.fixture(scope="module")
def run4():
    seed = new_seed()
    jobs = []
    for c in _cases_4(seed):
        Ls = (1, 2, 4) if c["P"] == 4 else (1, 2)
        for L in Ls:
            for k in (1, 2):
                jobs.append((c, L, k, k == 2, True, False))  # k = 2 via metadata, k = 1 via the call
        jobs.append((c, 2, 2, True, False, False))  # no own block, two-level
        if c["dtype"] != "bfloat16":
            jobs.append((c, 2, 2, True, True, True))  # two-level with the early query gather
    # no query block on any rank (every chunk empty), two-level, plain and with the early gather
    empty = case(seed + 4, 4, dtype="float32", blocks=[0, 0, 0, 0], ctx=[40, 0, 0, 0], p_invalid=0.0)
    jobs += [(empty, 2, 1, False, True, False), (empty, 2, 2, True, True, False), (empty, 2, 2, True, True, True)]
    return seed, jobs, run_distributed(_worker, 4, jobs, timeout=400)


def _per_rank(results, j, P):
    return [results[r][j] for r in range(P)]


def test_exact_vs_reference(run4):
    seed, jobs, results = run4
    for j, (c, L, k, use_meta, own, early) in enumerate(jobs):
        per_rank = _per_rank(results, j, c["P"])
        if not sum(c["blocks"]):  # nothing to attend: empty outputs, zero context gradients
            for pr in per_rank:
                assert pr["out"].shape[0] == 0 and pr["dq"].shape[0] == 0
                assert not pr["dk_ctx"].any() and not pr["dv_ctx"].any()
            continue
        if own:
            check("splitkv", c, per_rank)
        else:
            _check_no_own(c, per_rank)
        if use_meta:
            assert per_rank[0]["k_used"] == min(k, max(c["blocks"])) and per_rank[0]["L_used"] == L


def _check_no_own(c, per_rank):
    import _splitkv_helpers as h

    t = build(c)
    x = {kk: t[kk].double().clone().requires_grad_(True) for kk in ("q", "k_ctx", "v_ctx")}
    out, lse = h.dflash_attention_reference(x["q"], x["k_ctx"], x["v_ctx"], None, None, t["q_seq"],
                                            t["q_anchor"], t["kv_seq"], t["kv_pos"], block_size=c["B"])
    loss_of(out, lse, t["dout"], t["dlse"]).backward()
    tol = TOL[c["dtype"]]
    for r, pr in enumerate(per_rank):
        b0, b1 = t["block_range"][r]
        rows = slice(b0 * c["B"], b1 * c["B"])
        assert pr["dk_blk"] is None and pr["dv_blk"] is None
        for key, ref in (("out", out.detach()), ("dq", x["q"].grad)):
            assert rel_err(pr[key], ref[rows]) <= tol, (key, r)
        assert torch.equal(torch.isfinite(pr["lse"]), torch.isfinite(lse.detach()[rows]))
        for key, ref in (("dk_ctx", x["k_ctx"].grad), ("dv_ctx", x["v_ctx"].grad)):
            assert rel_err(pr[key], ref[t["ctx_idx"][r]]) <= tol, (key, r)


def test_single_all_to_all_bit_identical_and_two_level_close(run4):
    """L = 1 and L = P run the same single all-to-all (bit-identical); 1 < L < P agrees to fp32
    reassociation (the lse-merge / dQ sum regrouped per node; fp64 inputs: fp64 throughout)."""
    seed, jobs, results = run4
    base = {}
    for j, (c, L, k, use_meta, own, early) in enumerate(jobs):
        if own and not early:
            base[(c["seed"], L, k)] = _per_rank(results, j, c["P"])
    for (s, L, k), runs in base.items():
        c = next(cc for cc, *_ in jobs if cc["seed"] == s)
        if (s, 1, k) not in base:
            continue
        ref = base[(s, 1, k)]
        tol = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 1e-2}[c["dtype"]]
        for r in range(c["P"]):
            for key in ("out", "lse") + GRAD_NAMES:
                a, b = runs[r][key], ref[r][key]
                if L == c["P"]:
                    assert torch.equal(a, b), (s, L, k, r, key)
                else:
                    fin = torch.isfinite(b)
                    assert torch.equal(torch.isfinite(a), fin), (s, L, k, r, key)
                    assert torch.allclose(a[fin], b[fin], atol=tol, rtol=tol), (s, L, k, r, key)


def test_early_query_gather_bit_identical(run4):
    seed, jobs, results = run4
    for j, (c, L, k, use_meta, own, early) in enumerate(jobs):
        if not early:
            continue
        jb = next(i for i, (cc, LL, kk, um, ow, ea) in enumerate(jobs)
                  if cc is c and (LL, kk, um, ow, ea) == (L, k, True, True, False))
        for a, b in zip(_per_rank(results, j, c["P"]), _per_rank(results, jb, c["P"])):
            for key in ("out", "lse") + GRAD_NAMES:
                assert torch.equal(a[key], b[key]), (c["seed"], key)
            assert sorted(a["records"]) == sorted(b["records"])


def test_records_match_prediction(run4):
    seed, jobs, results = run4
    for j, (c, L, k, use_meta, own, early) in enumerate(jobs):
        for r, res in enumerate(_per_rank(results, j, c["P"])):
            got = _agg([(op, kind, b) for op, kind, b, _ in res["records"]])
            exp = _agg([(p.op, p.kind, p.bytes) for p in _predicted(c, r, L, k, use_meta)])
            assert got == exp, (c["seed"], c["P"], L, k, use_meta, r, got, exp)
            two = 1 < L < c["P"]
            ops = {op for op, *_ in res["records"]}
            assert (ops >= set(TWO_LEVEL)) == two and ("splitkv.fwd.out" in ops) == (not two)
            for op, kind, b, size in res["records"]:
                if op.endswith(".intra"):
                    assert size == L
                elif op.endswith(".inter"):
                    assert size == c["P"] // L


# ------------------------------------------------------------------------ 6 ranks: P = 6, L = 3; sub-group


def test_six_ranks_and_local_subgroups():
    """P = 6 with L = 3 (the CP group is the world: every rank creates every sub-group) and L = 2, and a
    P = 4 sub-group of the 6-rank world with L = 2 (sub-groups by use_local_synchronization)."""
    seed = new_seed()
    c6 = case(seed, 6, dtype="float64", blocks=[2, 0, 3, 1, 2, 2], ctx=[8, 0, 12, 6, 7, 7], p_invalid=0.2)
    c4 = case(seed + 1, 4, dtype="float32", blocks=[2, 3, 0, 2], ctx=[15, 10, 0, 15])
    jobs = [(c6, 3, 2, True, True, False), (c6, 2, 1, False, True, False), (c4, 2, 2, True, True, False),
            (c4, 2, 1, False, True, False)]
    results = run_distributed(_worker, 6, jobs, timeout=400)
    for j, (c, L, k, use_meta, *_rest) in enumerate(jobs):
        per_rank = _per_rank(results, j, c["P"])
        check("splitkv", c, per_rank)
        for r, res in enumerate(per_rank):
            got = _agg([(op, kind, b) for op, kind, b, _ in res["records"]])
            exp = _agg([(p.op, p.kind, p.bytes) for p in _predicted(c, r, L, k, use_meta)])
            assert got == exp, (c["P"], L, k, r)


# ------------------------------------------------------------------------------------------ errors


def _prep(m, **kw):
    return msk.prepare_splitkv_metadata(*m.values(), block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                        dtype=torch.float32, **kw)


def _errors_worker(rank, world):
    import os

    x, m = small_inputs(rank)
    seen = []
    cases = (
        ("prepare, L = 3", lambda: _prep(m, cp_ranks_per_node=3),
         "cp_ranks_per_node=3 must divide the CP group size P=4"),
        ("call, L = 3", lambda: msk.splitkv_attention(*x.values(), *m.values(), block_size=4, cp_ranks_per_node=3),
         "cp_ranks_per_node=3 must divide the CP group size P=4"),
        ("call, L = 8", lambda: msk.splitkv_attention(*x.values(), *m.values(), block_size=4, cp_ranks_per_node=8),
         "cp_ranks_per_node=8 must divide the CP group size P=4"),
        ("prepare, L by rank", lambda: _prep(m, cp_ranks_per_node=1 + (rank >= 2)),
         "cp_ranks_per_node must be the same on every CP rank; got [1, 1, 2, 2]"),
        ("call, L by rank", lambda: msk.splitkv_attention(*x.values(), *m.values(), block_size=4,
                                                          cp_ranks_per_node=4 if rank else 2),
         "cp_ranks_per_node must be the same on every CP rank; got [2, 4, 4, 4]"),
        ("prepare, bad type on rank 1", lambda: _prep(m, cp_ranks_per_node=2.0 if rank == 1 else 2),
         "cp_ranks_per_node must be None or a positive int, got 2.0"),
    )
    for what, fn, msg in cases:
        try:
            fn()
        except ValueError as exc:
            assert msg in str(exc), (what, str(exc))
            if "by rank" in what:  # what Megatron may have chosen automatically, and what to check
                assert "LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE are the same on every node" in str(exc), str(exc)
            seen.append((what, str(exc)))
        else:
            raise AssertionError(f"{what}: no ValueError on rank {rank}")
    # the config field: the default of both, clamped to P; not dividing P -> ValueError on every rank
    meta = _prep(m, config=msk.SplitKVConfig(cp_ranks_per_node=2))
    assert meta.cp_ranks_per_node == 2 and meta.node_groups is not None
    assert [gg.size for gg in meta.node_groups] == [2, 2]
    assert [gg.rank for gg in meta.node_groups] == [rank % 2, rank // 2]
    assert _prep(m, cp_ranks_per_node=2).node_groups is meta.node_groups  # built once per (CP group, L)
    out = msk.splitkv_attention(*x.values(), metadata=meta)
    ref = msk.splitkv_attention(*x.values(), *m.values(), block_size=4, cp_ranks_per_node=1)
    assert torch.allclose(out, ref, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="cp_ranks_per_node=1 differs from the metadata's cp_ranks_per_node=2"):
        msk.splitkv_attention(*x.values(), metadata=meta, cp_ranks_per_node=1)
    meta = _prep(m, config=msk.SplitKVConfig(cp_ranks_per_node=8))  # a whole node for a CP group of 4
    assert meta.cp_ranks_per_node == 4 and meta.node_groups is None  # the single all-to-all
    try:
        _prep(m, config=msk.SplitKVConfig(cp_ranks_per_node=3))
    except ValueError as exc:
        assert "SplitKVConfig.cp_ranks_per_node=3 must divide the CP group size P=4" in str(exc), str(exc)
        seen.append(("config", str(exc)))
    else:
        raise AssertionError("config 3: no ValueError")
    # still in step afterwards
    out = msk.splitkv_attention(*x.values(), *m.values(), block_size=4, cp_ranks_per_node=2)
    assert torch.isfinite(out).all()
    return seen


def test_errors_on_every_rank():
    seen = run_distributed(_errors_worker, 4, timeout=200)
    assert all(s == seen[0] for s in seen) and len(seen[0]) == 7


def test_resolve_ranks_per_node():
    assert resolve_ranks_per_node(None, 8) == 1 and resolve_ranks_per_node(None, 1) == 1
    assert resolve_ranks_per_node(4, 8) == 4 and resolve_ranks_per_node(8, 8) == 8 and resolve_ranks_per_node(1, 1) == 1
    for bad, msg in ((3, "cp_ranks_per_node=3 must divide the CP group size P=8"),
                     (16, "cp_ranks_per_node=16 must divide the CP group size P=8"),
                     (0, "cp_ranks_per_node must be None or a positive int"),
                     (True, "cp_ranks_per_node must be None or a positive int"),
                     ("2", "cp_ranks_per_node must be None or a positive int")):
        with pytest.raises(ValueError, match=msg):
            resolve_ranks_per_node(bad, 8)
    eight = msk.SplitKVConfig(cp_ranks_per_node=8)
    assert resolve_ranks_per_node(None, 64, eight) == 8 and resolve_ranks_per_node(None, 4, eight) == 4
    assert resolve_ranks_per_node(None, 1, eight) == 1 and resolve_ranks_per_node(2, 64, eight) == 2  # explicit wins
    with pytest.raises(ValueError, match="SplitKVConfig.cp_ranks_per_node=8 must divide the CP group size P=12"):
        resolve_ranks_per_node(None, 12, eight)


def test_single_process():
    x, m = small_inputs()
    ref = msk.splitkv_attention(*x.values(), *m.values(), block_size=4,
                                config=msk.SplitKVConfig(cp_ranks_per_node=8))  # clamped to P = 1
    assert torch.equal(msk.splitkv_attention(*x.values(), *m.values(), block_size=4, cp_ranks_per_node=1), ref)
    with pytest.raises(ValueError, match="cp_ranks_per_node=2 must divide the CP group size P=1"):
        msk.splitkv_attention(*x.values(), *m.values(), block_size=4, cp_ranks_per_node=2)
    with pytest.raises(ValueError, match="cp_ranks_per_node=2 must divide the CP group size P=1"):
        _prep(m, cp_ranks_per_node=2)
    # the baselines ignore it
    assert _prep(m, impl="ring_kv", cp_ranks_per_node=2).cp_ranks_per_node == 1


def test_local_index_major_and_prediction_formula():
    from megatron_splitkv.ops.common import local_index_major, pack_partial, pack_partial_local_major

    N, L, t = 3, 2, 5
    x = torch.randn(N * L * t, 2, 4)
    y = local_index_major(x, N, L, torch.bfloat16)
    for j in range(L):
        for n in range(N):
            s = n * L + j
            assert torch.equal(y[(j * N + n) * t:(j * N + n + 1) * t], x[s * t:(s + 1) * t].to(torch.bfloat16))
    lse = torch.randn(N * L * t, 2)
    lse[3] = float("-inf")
    p = pack_partial_local_major(x, lse, torch.bfloat16, N, L)
    flat = pack_partial(x, lse, torch.bfloat16)
    assert torch.equal(p.view(torch.int16), local_index_major(flat, N, L).view(torch.int16))
    # bytes at P = 64, L = 8 (bf16, D = 128, 8 blocks of 16 rows per rank): stage 2 carries 1 / L of the
    # rows in fp32, 4 x less than the off-node share (P - L) / (P - 1) of the single dQ all-to-all
    kw = dict(P=64, rank=0, n_blocks=[8] * 64, n_ctx=[0] * 64, B=16, Hq=32, Hkv=8, D=128, metadata=True)
    one, two = {}, {}
    for d, L in ((one, 1), (two, 8)):  # summed per op name: at k = 1 the forward exchange runs in 2 row pieces
        for r in bench.predicted_records("splitkv", cp_ranks_per_node=L, **kw):
            d[r.op] = d.get(r.op, 0) + r.bytes
    # the [dO | stats] gather stays one ring
    assert set(two) == {"splitkv.fwd.q", "splitkv.bwd.dout"} | set(TWO_LEVEL)
    rows = 8 * 16
    assert two["splitkv.fwd.out.intra"] == 2 * 7 * 8 * rows * 32 * (128 + 2) * 2
    assert two["splitkv.fwd.out.inter"] == 2 * 7 * rows * 32 * (128 + 1) * 4
    assert two["splitkv.bwd.dq.intra"] == 2 * 7 * 8 * rows * 32 * 128 * 2
    assert one["splitkv.bwd.dq"] == 2 * 63 * rows * 32 * 128 * 2
    assert one["splitkv.bwd.dq"] * (64 - 8) // 63 == 4 * two["splitkv.bwd.dq.inter"]
