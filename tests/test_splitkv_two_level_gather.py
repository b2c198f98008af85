"""Split-KV's two-level all-gather of the backward's packed [dO | delta, lse] (docs/perf-notes.md item 14;
ops/splitkv.py `_gather_dout_stats`, ops.common.two_level_bwd_gather).

With the two-level all-to-all (`cp_ranks_per_node` L, 1 < L < P, N = P / L) and N >= 8 nodes the op gathers
each chunk's packed segment in two stages: "splitkv.bwd.dout.inter" (all-gather over the N ranks with this
local index) then "splitkv.bwd.dout.intra" (all-gather of that N-segment buffer over the node's L ranks),
which delivers the segments local-index-major; `unpack_dout_stats(..., nodes=N)` reads them in rank order.
CPU, gloo, one spawn of 8 ranks; the node threshold (`TWO_LEVEL_GATHER_MIN_NODES`, 16) is lowered in every
process so that P = 4 (L = 2) and P = 8 (L = 2, 4) take the two-stage route, and raised to force the flat
gather with the same L:

- transport: the two-stage result is the flat all-gather's buffer in local-index-major order, and unpacks
  to the flat gather's dO and statistics bit for bit (P = 8 with L = 2 and 4, a P = 4 sub-group with L = 2,
  bf16 / fp32 / fp64, empty segments); the records carry the sub-group sizes and the ring-convention bytes;
- the op: output, lse and all five gradients equal the single-process float64 reference (uneven and empty
  shards, invalid blocks with NaN / inf, num_chunks 1, 2 and 4, with and without per-step metadata, the
  early query gather), are bit-identical to the same call with the flat gather (same L: only the route
  differs), and every rank's records equal `bench.predicted_records` (two stage records, no
  "splitkv.bwd.dout", at the threshold; the flat record above it).
Source: DESIGN.md section 2 (backward step 1: all-gather dO and the global statistics); the two-level
exchange is our extension for multi-node CP groups.
"""

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import GRAD_NAMES, build, case, check, local, loss_of, new_seed
from megatron_splitkv import comm_stats
from tools import benchlib as bench
from megatron_splitkv.ops import common

KEYS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")
STAGES = ("splitkv.bwd.dout.inter", "splitkv.bwd.dout.intra")
WORLD = 8
TWO, FLAT = 1, 1 << 20  # TWO_LEVEL_GATHER_MIN_NODES: every two-level layout gathers in two stages / never


def _bits(t):
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# ------------------------------------------------------------------------------------ no processes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("N,L,rows", [(2, 2, 3), (2, 4, 2), (4, 2, 1), (3, 2, 0)])
def test_unpack_local_index_major_is_the_flat_unpack(dtype, N, L, rows):
    """Segments in local-index-major order (position j * N + n = rank n * L + j) unpack with nodes=N to
    exactly what the rank-ordered buffer unpacks to with nodes=1."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(N * 100 + L * 10 + rows)
    P, H, D = N * L, 3, 4
    segs = []
    for r in range(P):
        dout = torch.randn(rows, H, D, generator=g).to(dtype)
        stats = torch.randn(rows, H, 2, generator=g).to(acc)
        if rows:
            stats[0, 0, 1] = float("-inf")
            stats[-1, -1, 0] = float("nan")
        segs.append(common.pack_dout_stats(dout, stats, dtype))
    flat = torch.cat(segs)
    lim = torch.cat([segs[n * L + j] for j in range(L) for n in range(N)])
    assert torch.equal(_bits(common.local_index_major(flat.view(P, -1), N, L).reshape(-1)), _bits(lim))
    d1, s1 = common.unpack_dout_stats(flat, P, H, D, acc)
    d2, s2 = common.unpack_dout_stats(lim, P, H, D, acc, nodes=N)
    assert d2.is_contiguous() and s2.is_contiguous() and d2.shape == (P * rows, H, D)
    assert torch.equal(_bits(d1), _bits(d2)) and torch.equal(_bits(s1), _bits(s2))
    if N > 1 and rows:  # the layout matters: read as rank order, the local-major buffer is something else
        assert not torch.equal(_bits(common.unpack_dout_stats(lim, P, H, D, acc)[0]), _bits(d1))


def test_unpack_rejects_a_node_count_not_dividing_the_parts():
    x = torch.zeros(6 * 2 * (4 + 4), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="nodes=4 must divide parts=6"):
        common.unpack_dout_stats(x, 6, 2, 4, torch.float32, nodes=4)


def test_rule_and_default_threshold():
    assert common.TWO_LEVEL_GATHER_MIN_NODES == 16
    assert [common.two_level_bwd_gather(n) for n in (2, 4, 8, 15, 16, 32)] == [False] * 4 + [True, True]
    # the records follow the rule: P = 128 with L = 8 (16 nodes) gathers in two stages, P = 64 (8 nodes) does not
    kw = dict(rank=0, B=16, Hq=32, Hkv=8, D=128, metadata=True, num_chunks=1, cp_ranks_per_node=8)
    ops128 = {r.op for r in bench.predicted_records("splitkv", P=128, n_blocks=[4] * 128, n_ctx=[0] * 128, **kw)}
    ops64 = {r.op for r in bench.predicted_records("splitkv", P=64, n_blocks=[8] * 64, n_ctx=[0] * 64, **kw)}
    assert set(STAGES) <= ops128 and "splitkv.bwd.dout" not in ops128
    assert "splitkv.bwd.dout" in ops64 and not set(STAGES) & ops64


def test_predicted_stage_bytes_at_p64(monkeypatch):
    """P = 64 (threshold lowered to its 8 nodes), L = 8, k = 1, bf16, Hq 32, D 128, 8 blocks of 16 rows per rank: the segment is 128 rows x 32
    heads x (128 + 4) bf16 elements; stage 1 moves 2 x 7 segments, stage 2 2 x 7 x 8: together the flat
    gather's 2 x 63 segments."""
    monkeypatch.setattr(common, "TWO_LEVEL_GATHER_MIN_NODES", 8)
    kw = dict(P=64, rank=0, n_blocks=[8] * 64, n_ctx=[0] * 64, B=16, Hq=32, Hkv=8, D=128, metadata=True,
              num_chunks=1)
    two = {r.op: r for r in bench.predicted_records("splitkv", cp_ranks_per_node=8, **kw)}
    one = {r.op: r for r in bench.predicted_records("splitkv", cp_ranks_per_node=1, **kw)}
    seg = 128 * 32 * (128 + 4) * 2
    assert (two[STAGES[0]].msg, two[STAGES[0]].bytes) == (seg, 2 * 7 * seg)
    assert (two[STAGES[1]].msg, two[STAGES[1]].bytes) == (8 * seg, 2 * 7 * 8 * seg)
    assert one["splitkv.bwd.dout"].bytes == 2 * 63 * seg == two[STAGES[0]].bytes + two[STAGES[1]].bytes


# ------------------------------------------------------------------------------------ 8 processes


def _transport(rank, group, P, L):
    """This rank's two-stage and flat gathers of random packed segments (bf16 / fp32 / fp64 and an empty
    one), the records of the two-stage route, and the unpacked results of both."""
    from types import SimpleNamespace

    from megatron_splitkv.comm import all_gather, node_groups, resolve_group
    from megatron_splitkv.ops.splitkv import _gather_dout_stats

    g = resolve_group(group)
    meta = SimpleNamespace(group=g, node_groups=node_groups(g, L))
    N = P // L
    out = []
    for dt, rows in ((torch.bfloat16, 3), (torch.float32, 2), (torch.float64, 1), (torch.bfloat16, 0)):
        acc = torch.float64 if dt == torch.float64 else torch.float32
        gen = torch.Generator().manual_seed(1000 * rank + rows)
        stats = torch.randn(rows, 2, 2, generator=gen).to(acc)
        if rows:
            stats[0, 1, 1] = float("-inf")
        seg = common.pack_dout_stats(torch.randn(rows, 2, 4, generator=gen).to(dt), stats, dt)
        with comm_stats() as st:
            pend = _gather_dout_stats(seg, meta, True)
            pend.advance()
            two = pend.take()
        flat = all_gather(seg, g, "flat")
        u2 = common.unpack_dout_stats(two, P, 2, 4, acc, nodes=N)
        u1 = common.unpack_dout_stats(flat, P, 2, 4, acc)
        out.append(dict(two=two, flat=flat, u1=u1, u2=u2, seg_bytes=seg.numel() * seg.element_size(),
                        records=[(r.op, r.kind, r.bytes, r.group_size) for r in st.records]))
    return out


def _run_op(c, rank, group, L, k, use_meta, early, min_nodes):
    """This rank's results of case c with cp_ranks_per_node=L, num_chunks=k and the node threshold."""
    common.TWO_LEVEL_GATHER_MIN_NODES = min_nodes
    t = build(c)
    x, meta, dout, dlse = local(t, c, rank)
    md = None
    if use_meta:
        md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                          block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                          head_dim=c["D"], dtype=x["q"].dtype, cp_group=group, num_chunks=k,
                                          cp_ranks_per_node=L)
    with comm_stats() as st:
        q = x["q"] * 1.0 if early else x["q"]
        handle = msk.splitkv_start_query_gather(q, metadata=md) if early else None
        if use_meta:
            out, lse = msk.splitkv_attention(q, x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], metadata=md,
                                             backend="math", return_lse=True, query_gather=handle)
        else:
            out, lse = msk.splitkv_attention(q, x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], meta["q_seq"],
                                             meta["q_anchor"], meta["kv_seq"], meta["kv_pos"], block_size=c["B"],
                                             cp_group=group, backend="math", return_lse=True, num_chunks=k,
                                             cp_ranks_per_node=L)
        loss_of(out, lse, dout, dlse).backward()
    res = dict(out=out.detach().double(), lse=lse.detach().double(),
               records=[(r.op, r.kind, r.bytes, r.group_size) for r in st.records])
    for name, key in zip(GRAD_NAMES, KEYS):
        res[name] = x[key].grad.double()
    return res


def _worker(rank, world, transport_jobs, op_jobs):
    import torch.distributed as dist

    sizes = sorted({P for P, _ in transport_jobs} | {c["P"] for c, *_ in op_jobs})
    groups = {P: dist.new_group(list(range(P))) for P in sizes if P < world}
    out = {"transport": {}, "op": {}}
    try:
        for j, (P, L) in enumerate(transport_jobs):
            if rank < P:
                out["transport"][j] = _transport(rank, groups.get(P), P, L)
        for j, (c, L, k, use_meta, early, min_nodes) in enumerate(op_jobs):
            if rank < c["P"]:
                out["op"][j] = _run_op(c, rank, groups.get(c["P"]), L, k, use_meta, early, min_nodes)
    finally:
        common.TWO_LEVEL_GATHER_MIN_NODES = 16
    return out


def _cases(seed):
    return [
        # P = 8: uneven and empty shards (no blocks, no context), NaN / inf in invalid blocks, fp64
        case(seed, 8, dtype="float64", blocks=[3, 0, 5, 2, 1, 0, 4, 2], ctx=[9, 0, 6, 5, 4, 7, 9, 0], poison=True,
             p_invalid=0.3),
        # P = 8, fp32, GQA, the last node (ranks 6, 7 at L = 2) without query blocks
        case(seed + 1, 8, dtype="float32", Hq=4, Hkv=1, blocks=[2, 4, 1, 3, 2, 1, 0, 0]),
        # P = 4 (the sub-group of ranks 0-3), bf16, a rank without blocks and one without context
        case(seed + 2, 4, dtype="bfloat16", blocks=[2, 0, 3, 1], ctx=[0, 14, 13, 13]),
    ]


@pytest.fixture(scope="module")
def run8():
    seed = new_seed()
    transport_jobs = [(8, 2), (8, 4), (4, 2)]
    op_jobs = []
    for c in _cases(seed):
        for L in ((2, 4) if c["P"] == 8 else (2,)):
            for k in (1, 2):
                for min_nodes in (TWO, FLAT):  # the same call with the two-stage and with the flat gather
                    op_jobs.append((c, L, k, k == 2, False, min_nodes))
    c0 = _cases(seed)[0]
    op_jobs += [(c0, 2, 4, True, False, TWO), (c0, 2, 4, True, False, FLAT),  # 4 chunks: the steady state
                (c0, 4, 2, True, True, TWO), (c0, 4, 2, True, True, FLAT)]  # the early query gather
    return seed, transport_jobs, op_jobs, run_distributed(_worker, WORLD, transport_jobs, op_jobs, timeout=500)


def test_two_stage_transport_is_the_flat_gather(run8):
    seed, transport_jobs, op_jobs, results = run8
    for j, (P, L) in enumerate(transport_jobs):
        N = P // L
        for r in range(P):
            for x in results[r]["transport"][j]:
                two, flat = x["two"], x["flat"]
                # position j' * N + n holds CP rank n * L + j' (what `local_index_major` makes of rank order)
                want = common.local_index_major(flat.view(P, -1), N, L).reshape(-1)
                assert torch.equal(_bits(two), _bits(want)), (P, L, r)
                for a, b in zip(x["u1"], x["u2"]):
                    assert torch.equal(_bits(a), _bits(b)), (P, L, r)
                n = x["seg_bytes"]
                assert x["records"] == [(STAGES[0], "all_gather", 2 * (N - 1) * n, N),
                                        (STAGES[1], "all_gather", 2 * (L - 1) * N * n, L)], (P, L, r)


def _per_rank(results, j, P):
    return [results[r]["op"][j] for r in range(P)]


def test_exact_vs_reference(run8):
    seed, _, op_jobs, results = run8
    for j, (c, L, k, use_meta, early, min_nodes) in enumerate(op_jobs):
        check("splitkv", c, _per_rank(results, j, c["P"]))


def test_bit_identical_to_the_flat_gather(run8):
    """Same inputs, same L and k: the two-stage gather and the flat gather give the same bits everywhere."""
    seed, _, op_jobs, results = run8
    pairs = 0
    for j, (c, L, k, use_meta, early, min_nodes) in enumerate(op_jobs):
        if min_nodes != TWO:
            continue
        jf = next(i for i, jb in enumerate(op_jobs) if jb == (c, L, k, use_meta, early, FLAT))
        for r, (a, b) in enumerate(zip(_per_rank(results, j, c["P"]), _per_rank(results, jf, c["P"]))):
            for key in ("out", "lse") + GRAD_NAMES:
                assert torch.equal(a[key], b[key]), (c["seed"], c["P"], L, k, r, key)
        pairs += 1
    assert pairs == 12


def test_records_match_prediction(run8, monkeypatch):
    seed, _, op_jobs, results = run8
    for j, (c, L, k, use_meta, early, min_nodes) in enumerate(op_jobs):
        monkeypatch.setattr(common, "TWO_LEVEL_GATHER_MIN_NODES", min_nodes)
        elem = torch.empty((), dtype=getattr(torch, c["dtype"])).element_size()
        n_ctx = [int(i.numel()) for i in build(c)["ctx_idx"]]
        P, N = c["P"], c["P"] // L
        for r, res in enumerate(_per_rank(results, j, P)):
            exp = bench.predicted_records("splitkv", P=P, rank=r, n_blocks=c["blocks"], n_ctx=n_ctx, B=c["B"],
                                          Hq=c["Hq"], Hkv=c["Hkv"], D=c["D"], elem=elem, acc=8 if elem == 8 else 4,
                                          metadata=use_meta, num_chunks=k, cp_ranks_per_node=L)
            got = sorted((op, kind, b) for op, kind, b, _ in res["records"])
            assert got == sorted((p.op, p.kind, p.bytes) for p in exp), (c["seed"], P, L, k, min_nodes, r)
            ops = [op for op, *_ in res["records"]]
            kk = min(k, max(c["blocks"]))
            if min_nodes == TWO:
                assert ops.count(STAGES[0]) == ops.count(STAGES[1]) == kk and "splitkv.bwd.dout" not in ops
            else:
                assert ops.count("splitkv.bwd.dout") == kk and not set(STAGES) & set(ops)
            for op, kind, b, size in res["records"]:
                if op.endswith(".inter"):
                    assert size == N, (op, size)
                elif op.endswith(".intra"):
                    assert size == L, (op, size)
