"""The two-level forward exchange in row pieces (`exchange_pieces`; docs/perf-notes.md item 19; ops/splitkv.py
module docstring, item 5 "Exchange pieces").

With the two-level all-to-all (`cp_ranks_per_node` L, 1 < L < P) the forward sends each chunk's [O | lse]
partials in p row pieces (piece i = the i-th share of EVERY owner's block rows of the chunk,
`ops.metadata.piece_bounds`): stage 1 of piece i + 1 is issued before piece i's node merge and stage 2, so
they overlap it. Default p = 2 at num_chunks 1, else 1; MEGATRON_SPLITKV_EXCHANGE_PIECES or `exchange_pieces=`
of prepare override it; the flat path (L = 1, L = P) ignores it.

CPU, gloo (one spawn of 8 ranks; P = 4 on the sub-group of ranks 0-3):

- exactness: output, lse and all five gradients against the single-process float64 reference, P = 4 (L = 2)
  and P = 8 (L = 2, 4), pieces 1 / 2 / 3 / automatic / more than the blocks (clamped), num_chunks 1 and 2,
  uneven and empty shards (ranks or a whole node without query blocks, ranks without context, no block at
  all), NaN / inf in invalid blocks, fp64 / fp32 / bf16, the early query gather, k_blk = v_blk = None;
- bit-identical to pieces = 1 (the node merge and the owner merge are per row: the same arithmetic on the
  same rows), and on the flat path to the call without the setting;
- the collectives: the forward's stage-1 / stage-2 all-to-alls in the op's order (stage 1 of exchange e + 1
  before stage 2 of exchange e), the bytes per collective name unchanged, `bench.predicted_records` equal
  to the op's comm_stats records (count and bytes per name);
- the relay code path (a stand-in `RelayStream`, as tests/test_splitkv_two_level_relay.py): one mark per
  stage 1, one relay run per exchange issuing exactly its stage 2.

Single process: the resolution (`resolve_exchange_pieces`, `piece_bounds`), the environment variable and the
argument (ValueError naming them and the limit), the agreement row's encoding, the piece-major packing
(`ops.common.pack_partial_local_major(..., pieces)`), the host-built metadata (`prepare_splitkv_metadata_from_plan`,
re-checked at `bind`). Group-wide: ranks requesting different pieces raise the same ValueError.
"""

import numpy as np
import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import (RelayRecorder as _Recorder, aggregate_records, build, case, check, local, loss_of, new_seed,
                              raw_and_double_results)
from megatron_splitkv import comm_stats
from tools import benchlib as bench
from megatron_splitkv.ops.common import (
    EXCHANGE_PIECES_ENV,
    MAX_EXCHANGE_PIECES,
    exchange_pieces_env,
    local_index_major,
    pack_partial,
    pack_partial_local_major,
)
from megatron_splitkv.ops.metadata import (
    _decoded,
    _request_code,
    chunk_bounds,
    piece_bounds,
    resolve_exchange_pieces,
)





def _run(c, rank, group, L, k, pieces, early, own, relay):
    """This rank's results, comm records and relay log of case c (cp_ranks_per_node L, num_chunks k,
    exchange_pieces `pieces`: None = automatic / the environment)."""
    from megatron_splitkv.ops import splitkv as sk

    log = []
    rec = _Recorder(log) if relay else None
    orig = sk.all_to_all, sk.RelayStream.get

    def coll(x, g, op, async_op=False):
        log.append(("coll", op, rec.inside if rec is not None else False))
        return orig[0](x, g, op, async_op=async_op)

    sk.all_to_all = coll
    sk.RelayStream.get = staticmethod(lambda device: rec)
    try:
        t = build(c)
        x, meta, dout, dlse = local(t, c, rank)
        md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                          block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                          head_dim=c["D"], dtype=x["q"].dtype, cp_group=group, num_chunks=k,
                                          cp_ranks_per_node=L, exchange_pieces=pieces)
        with comm_stats() as st:
            q = x["q"] * 1.0 if early else x["q"]
            handle = msk.splitkv_start_query_gather(q, metadata=md) if early else None
            kb, vb = (x["k_blk"], x["v_blk"]) if own else (None, None)
            out, lse = msk.splitkv_attention(q, x["k_ctx"], x["v_ctx"], kb, vb, metadata=md, backend="math",
                                             return_lse=True, query_gather=handle)
            loss_of(out, lse, dout, dlse).backward()
    finally:
        sk.all_to_all, sk.RelayStream.get = orig
    return raw_and_double_results(out, lse, x, log=log, records=[(r.op, r.kind, r.bytes) for r in st.records],
                                  k_used=md.num_chunks, pieces=md.exchange_pieces, bounds=md.exchange_bounds,
                                  chunks=list(md.chunks))


def _worker(rank, world, jobs):
    import torch.distributed as dist

    sizes = sorted({c["P"] for c, *_ in jobs})
    groups = {P: dist.new_group(list(range(P))) for P in sizes if P < world}
    out = {}
    for j, (c, L, k, pieces, early, own, relay) in enumerate(jobs):
        if rank < c["P"]:
            out[j] = _run(c, rank, groups.get(c["P"]), L, k, pieces, early, own, relay)
    return out


def _jobs(seed):
    """(case, L, k, pieces, early, own, relay); every configuration also runs with pieces = 1 and no relay
    (the reference of the bit-identity check: the schedule before item 19)."""
    c4 = [
        case(seed, 4, dtype="float64", blocks=[3, 0, 5, 2], ctx=[10, 0, 25, 5], poison=True, p_invalid=0.3),
        case(seed + 1, 4, dtype="bfloat16", Hq=4, Hkv=1, blocks=[3, 3, 3, 3]),
        case(seed + 2, 4, dtype="float32", Hq=3, Hkv=1, D=5, blocks=[3, 2, 0, 0], ctx=[0, 20, 15, 5]),  # node 1 empty
    ]
    empty = case(seed + 3, 4, dtype="float32", blocks=[0, 0, 0, 0], ctx=[40, 0, 0, 0], p_invalid=0.0)
    c8 = case(seed + 4, 8, dtype="float64", blocks=[2, 0, 3, 1, 4, 2, 0, 3], ctx=[8, 0, 12, 6, 4, 3, 0, 7],
              p_invalid=0.2)
    cfg = []
    for c in c4:
        for pieces in (2, 3, None):
            cfg.append((c, 2, 1, pieces, False, True))
    cfg += [
        (c4[0], 2, 2, 2, False, True),  # k = 2: two pieces per chunk (chunks (0, 2), (2, 5))
        (c4[0], 2, 1, MAX_EXCHANGE_PIECES, False, True),  # clamped to the 5 blocks: one block per piece
        (c4[0], 2, 1, 2, True, True),  # early query gather
        (c4[2], 2, 1, 2, False, False),  # no own block
        (c4[0], 1, 1, 3, False, True),  # flat paths: the setting is ignored (one all-to-all)
        (c4[1], 4, 1, 3, False, True),
        (empty, 2, 1, 2, False, True),  # no block anywhere: clamped to one piece
        (c8, 2, 1, 2, False, True),
        (c8, 4, 1, 3, True, True),  # nb_max 4 in 3 pieces: (0, 1), (1, 2), (2, 4)
        (c8, 4, 2, 2, False, True),
    ]
    jobs = []
    for c, L, k, pieces, early, own in cfg:
        jobs.append((c, L, k, pieces, early, own, True))
        jobs.append((c, L, k, 1, early, own, False))
    return jobs


@pytest.fixture(scope="module")
def run8():
    jobs = _jobs(new_seed())
    return jobs, run_distributed(_worker, 8, jobs, timeout=900)


def _expected_fwd_order(n_ex):
    """The forward's two-level all-to-alls in the op's issue order for n_ex exchanges (pieces of every
    chunk, in order): stage 1 of exchange e, then stage 2 of exchange e - 1; the last stage 2 at the end."""
    seq = []
    for e in range(n_ex):
        seq.append(("intra", e))
        if e:
            seq.append(("inter", e - 1))
    return seq + [("inter", n_ex - 1)]


_agg = aggregate_records


def test_exact_bit_identical_and_collectives(run8):
    jobs, results = run8
    for j in range(0, len(jobs), 2):
        c, L, k, pieces, early, own, _ = jobs[j]
        P = c["P"]
        got = [results[r][j] for r in range(P)]
        base = [results[r][j + 1] for r in range(P)]
        two_level = 1 < L < P
        nb_max = max(c["blocks"])
        what = f"P={P} L={L} k={k} pieces={pieces} early={early} own={own} seed={c['seed']}"
        # the resolution: the request (automatic: 2 at k = 1), clamped to the smallest chunk; 1 on the flat path
        chunks = got[0]["chunks"]
        want = 1 if not two_level else max(1, min(pieces or (2 if k == 1 else 1), min(b1 - b0 for b0, b1 in chunks)))
        assert got[0]["pieces"] == want, what
        assert got[0]["bounds"] == piece_bounds(chunks, want), what
        if own and nb_max:
            check("splitkv", c, got)
        for r in range(P):
            a, b = got[r]["raw"], base[r]["raw"]
            for key in a:
                assert (a[key] is None) == (b[key] is None), key
                if a[key] is not None:  # bit for bit
                    assert torch.equal(a[key], b[key]), f"{key} differs from pieces = 1 on rank {r}: {what}"
            # the same bytes per collective name (pieces split a chunk's rows), the prediction's records
            ra, rb = _agg(got[r]["records"]), _agg(base[r]["records"])
            assert {n: v[1] for n, v in ra.items()} == {n: v[1] for n, v in rb.items()}, what
            elem = torch.empty((), dtype=getattr(torch, c["dtype"])).element_size()
            n_ctx = [int(i.numel()) for i in build(c)["ctx_idx"]]
            pred = bench.predicted_records("splitkv", P=P, rank=r, n_blocks=c["blocks"], n_ctx=n_ctx, B=c["B"],
                                           Hq=c["Hq"], Hkv=c["Hkv"], D=c["D"], elem=elem,
                                           acc=8 if elem == 8 else 4, metadata=True, num_chunks=k,
                                           cp_ranks_per_node=L, exchange_pieces=pieces or 0)
            assert _agg((p.op, p.kind, p.bytes) for p in pred) == ra, what
            colls = [e for e in got[r]["log"] if e[0] == "coll"]
            n_ex = sum(len(b) for b in got[r]["bounds"])
            if not two_level:
                assert n_ex == k and [e[1] for e in colls] == [e[1] for e in base[r]["log"]], what
                assert not any(e[0] != "coll" for e in got[r]["log"]), what
                continue
            fwd = [(e[1].rsplit(".", 1)[1], e[2]) for e in colls if e[1].startswith("splitkv.fwd.out.")]
            # in order; stage 2 (".inter") always inside the relay, stage 1 never
            assert [x[0] for x in fwd] == [s for s, _ in _expected_fwd_order(n_ex)], what
            assert all(inside == (s == "inter") for s, inside in fwd), what
            # the relay protocol: a mark per stage 1 (forward exchanges + backward chunks), a run per exchange
            # that issues exactly its stage 2, a `taken` per consumed stage-2 result
            log = got[r]["log"]
            assert sum(e[0] == "mark" for e in log) == n_ex + k, what
            runs = [i for i, e in enumerate(log) if e[0] == "run"]
            assert len(runs) == n_ex + k and sum(e[0] == "taken" for e in log) == n_ex + k, what
            for i in runs:
                nxt = next(e for e in log[i + 1:] if e[0] == "coll")
                assert nxt[1].endswith(".inter") and nxt[2], what
            # which exchange each forward relay run advances (its stage-1 mark): exchange e - 1 right after
            # stage 1 of exchange e (so it overlaps that stage 1), the last one after the loop
            first_bwd = next(i for i, e in enumerate(log) if e[0] == "coll" and e[1].startswith("splitkv.bwd"))
            steps = [(e[0], e[1]) for e in log[:first_bwd] if e[0] in ("mark", "run")]
            assert steps == [x for e in range(1, n_ex + 1) for x in [("mark", e)] + ([("run", e - 1)] if e > 1 else [])
                             ] + [("run", n_ex)], what
            # the stage-1 messages: piece p holds (p1 - p0) blocks of every owner (balanced)
            sizes = [b for op, kind, b in got[r]["records"] if op == "splitkv.fwd.out.intra"]
            rows = [(p1 - p0) for bounds in got[r]["bounds"] for p0, p1 in bounds]
            assert len(sizes) == n_ex and (sum(rows) == 0 or all(
                s * sum(rows) == sum(sizes) * n for s, n in zip(sizes, rows))), what


# ----------------------------------------------------------------------------- single process


def test_resolution_and_bounds():
    # the flat path ignores the request; two-level: automatic 2 at k = 1, 1 at k > 1; clamped to the chunks
    assert resolve_exchange_pieces(0, 1, 1, 8) == 1 and resolve_exchange_pieces(3, 1, 8, 8) == 1
    assert resolve_exchange_pieces(0, 1, 8, 64, chunk_bounds(1, 8)) == 2
    assert resolve_exchange_pieces(0, 2, 8, 64, chunk_bounds(2, 8)) == 1
    assert resolve_exchange_pieces(3, 2, 8, 64, chunk_bounds(2, 8)) == 3
    assert resolve_exchange_pieces(64, 1, 2, 4, chunk_bounds(1, 5)) == 5
    assert resolve_exchange_pieces(64, 2, 2, 4, chunk_bounds(2, 5)) == 2  # the smaller chunk: 2 blocks
    assert resolve_exchange_pieces(0, 1, 2, 4, chunk_bounds(1, 0)) == 1  # no block at all
    assert resolve_exchange_pieces(0, 1, 2, 4, chunk_bounds(1, 1)) == 1
    # piece p of a chunk = the p-th share of every owner's blocks: at k = 1 the chunks of k = pieces
    assert piece_bounds(chunk_bounds(1, 8), 2) == (tuple(chunk_bounds(2, 8)),)
    assert piece_bounds(chunk_bounds(1, 5), 3) == (((0, 1), (1, 3), (3, 5)),)
    assert piece_bounds(chunk_bounds(2, 5), 2) == (((0, 1), (1, 2)), ((2, 3), (3, 5)))
    assert piece_bounds(chunk_bounds(2, 8), 1) == (((0, 4),), ((4, 8),))


def test_environment_and_argument(monkeypatch):
    monkeypatch.delenv(EXCHANGE_PIECES_ENV, raising=False)
    assert exchange_pieces_env() == 0
    for v, want in (("", 0), ("  ", 0), ("2", 2), (" 3 ", 3), ("64", 64)):
        monkeypatch.setenv(EXCHANGE_PIECES_ENV, v)
        assert exchange_pieces_env() == want
    for v, hint in (("0", ""), ("-1", ""), ("x", " (decimal digits)"), ("2.0", " (decimal digits)"),
                    ("+2", " (decimal digits)"), ("65", ""), ("1000", "")):
        monkeypatch.setenv(EXCHANGE_PIECES_ENV, v)
        with pytest.raises(ValueError) as exc:
            exchange_pieces_env()
        assert str(exc.value) == f"{EXCHANGE_PIECES_ENV} must be a positive int <= 64{hint}, got '{v}'"
    x, m = _small()
    # prepare (P = 1): a malformed variable or argument raises naming it and the limit
    monkeypatch.setenv(EXCHANGE_PIECES_ENV, "65")
    with pytest.raises(ValueError,
                       match=f"prepare_splitkv_metadata: {EXCHANGE_PIECES_ENV} must be a positive int <= 64"):
        _prepare(x, m)
    with pytest.raises(ValueError, match=f"splitkv: {EXCHANGE_PIECES_ENV} must be a positive int <= 64"):
        msk.splitkv_attention(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], **m, block_size=4)
    monkeypatch.setenv(EXCHANGE_PIECES_ENV, "3")
    md = _prepare(x, m)
    assert md.exchange_pieces_requested == 3 and md.exchange_pieces == 1  # P = 1: the flat path
    assert _prepare(x, m, exchange_pieces=2).exchange_pieces_requested == 2  # the argument wins
    monkeypatch.delenv(EXCHANGE_PIECES_ENV)
    for bad in (0, 65, True, 2.0, "2"):
        with pytest.raises(ValueError, match="exchange_pieces must be None or a positive int <= 64"):
            _prepare(x, m, exchange_pieces=bad)
    assert _prepare(x, m, exchange_pieces=np.int64(64)).exchange_pieces_requested == 64


def test_agreement_row_encoding():
    for chunks, pieces, L, fused, axis in ((0, 0, 1, 9, 0), ((1 << 23) - 1, 64, 1 << 16, 1 << 14, 1),
                                           ((1 << 23) - 1, 64, 1 << 16, 1 << 14, 0), (3, 2, 8, 1, 1), (7, 1, 2, 9, 0)):
        row = [0] * 10 + [_request_code(chunks, L, fused, pieces, axis)]
        assert _decoded([row])[0][11:] == [chunks, L, fused, pieces, axis, 0]  # 0: no head split
    assert _request_code(5, 2, 9) == _request_code(5, 2, 9, 0)  # no request: the rows as before item 19's field
    # a head split (perf-notes item 22): k in column 11, its code + 1 in column 16, the other fields intact
    codes = set()
    for split in ((6, 2), (2, 6), (4, 4), (8,), (2, 1, 5), tuple(range(1, 9)) + (28,)):
        d = _decoded([[0] * 10 + [_request_code(0, 8, 9, 64, 1, split)]])[0]
        assert d[11:16] == [min(len(split), 31), 8, 9, 64, 1] and d[16] > 0, split
        codes.add(d[16])
    assert len(codes) == 6


def test_piece_major_packing():
    """`pack_partial_local_major(..., pieces)`: piece i = rows [P r0, P r1) of the buffer = the
    `local_index_major` order of every owner's rows [r0, r1) (equal pieces: one copy; uneven: one per piece)."""
    N, L, t = 3, 2, 6
    x = torch.randn(N * L * t, 2, 4)
    lse = torch.randn(N * L * t, 2)
    lse[5] = float("-inf")
    flat = pack_partial(x, lse, torch.bfloat16).view(N * L, t, 2, -1)  # owner-major [P, t, ...]
    for pieces in ([(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 6)], [(0, 6)], None):
        p = pack_partial_local_major(x, lse, torch.bfloat16, N, L, pieces)
        assert p.shape == (N * L * t, 2, 4 + 2) and p.is_contiguous()  # D + the fp32 lse in 2 bf16
        for r0, r1 in pieces or [(0, t)]:
            want = local_index_major(flat[:, r0:r1].reshape(N * L * (r1 - r0), 2, -1), N, L)
            assert torch.equal(p[N * L * r0:N * L * r1].view(torch.int16), want.view(torch.int16)), pieces
    # a non-contiguous o / lse (FlexAttention's lse is a transposed view)
    lse_t = lse.t().contiguous().t()
    assert torch.equal(pack_partial_local_major(x, lse_t, torch.bfloat16, N, L, [(0, 3), (3, 6)]).view(torch.int16),
                       pack_partial_local_major(x, lse, torch.bfloat16, N, L, [(0, 3), (3, 6)]).view(torch.int16))


def test_host_built_metadata(monkeypatch):
    """`prepare_splitkv_metadata_from_plan`: the argument or the variable (read at build, re-checked at bind),
    resolved as prepare resolves it."""
    from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan
    from megatron_splitkv.planning import plan_context_parallel

    plan = plan_context_parallel([40, 24], [np.array([3, 9, 20, 30]), np.array([5, 11])], block_size=4, cp_size=4,
                                 chunk_size=4)
    kw = dict(block_size=4, num_heads_q=2, num_heads_kv=1, head_dim=8, dtype=torch.float32, cp_ranks_per_node=2)
    monkeypatch.delenv(EXCHANGE_PIECES_ENV, raising=False)
    host = prepare_splitkv_metadata_from_plan(plan, 0, **kw)
    nb = plan.blocks_per_rank
    assert host.exchange_pieces_requested == 0 and host.exchange_pieces == min(2, nb)
    assert host.exchange_bounds == piece_bounds(chunk_bounds(1, nb), min(2, nb))
    host = prepare_splitkv_metadata_from_plan(plan, 0, exchange_pieces=1, **kw)
    assert host.exchange_pieces == 1 and host.exchange_bounds == ((tuple(chunk_bounds(1, nb))[0],),)
    monkeypatch.setenv(EXCHANGE_PIECES_ENV, "3")
    host = prepare_splitkv_metadata_from_plan(plan, 0, **kw)
    assert host.exchange_pieces_requested == 3 and host.exchange_pieces == min(3, nb)
    # bind (one process: a plan of cp_size 1) re-checks a variable read at build time, not an argument
    plan1 = plan_context_parallel([40, 24], [np.array([3, 9, 20, 30]), np.array([5, 11])], block_size=4, cp_size=1,
                                  chunk_size=4)
    kw1 = dict(kw, cp_ranks_per_node=1)
    host = prepare_splitkv_metadata_from_plan(plan1, 0, **kw1)
    monkeypatch.setenv(EXCHANGE_PIECES_ENV, "2")
    with pytest.raises(ValueError, match=f"SplitKVMetadata.bind: {EXCHANGE_PIECES_ENV} resolves to 2 here but to 3"):
        host.bind(None, "cpu")
    assert prepare_splitkv_metadata_from_plan(plan1, 0, exchange_pieces=3, **kw1).bind(None, "cpu").bound
    monkeypatch.setenv(EXCHANGE_PIECES_ENV, "x")
    with pytest.raises(ValueError, match=f"prepare_splitkv_metadata_from_plan: {EXCHANGE_PIECES_ENV} must be"):
        prepare_splitkv_metadata_from_plan(plan, 0, **kw)
    with pytest.raises(ValueError, match="from_plan: exchange_pieces must be None or a positive int <= 64"):
        prepare_splitkv_metadata_from_plan(plan, 0, exchange_pieces=0, **kw)


def _small():
    from _splitkv_helpers import small_inputs

    return small_inputs()


def _prepare(x, m, **kw):
    return msk.prepare_splitkv_metadata(m["q_seq"], m["q_anchor"], m["kv_seq"], m["kv_pos"], block_size=4,
                                        num_heads_q=4, num_heads_kv=2, head_dim=8, dtype=torch.float32, **kw)


# ----------------------------------------------------------------------------- group-wide agreement


def _disagree_worker(rank, world):
    import os

    from _splitkv_helpers import small_inputs

    x, m = small_inputs(rank)
    out = {}
    try:
        msk.prepare_splitkv_metadata(m["q_seq"], m["q_anchor"], m["kv_seq"], m["kv_pos"], block_size=4,
                                     num_heads_q=4, num_heads_kv=2, head_dim=8, dtype=torch.float32,
                                     exchange_pieces=2 + rank)
    except ValueError as exc:
        out["prepare"] = str(exc)
    os.environ[EXCHANGE_PIECES_ENV] = str(1 + rank)  # the call without metadata= reads the variable
    try:
        msk.splitkv_attention(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], **m, block_size=4)
    except ValueError as exc:
        out["call"] = str(exc)
    return out


def test_ranks_disagreeing_raise_on_every_rank():
    outs = run_distributed(_disagree_worker, 2, timeout=300)
    for key in ("prepare", "call"):
        msgs = {o.get(key) for o in outs}
        assert len(msgs) == 1, msgs
        msg = msgs.pop()
        assert msg is not None and "exchange_pieces (requested)" in msg, msg


# ----------------------------------------------------------------------------- the in-place merge (CUDA path)

_INTERP = r"""
import sys
sys.path.insert(0, {tests!r})
import torch
from _dist import run_distributed
from test_splitkv_exchange_pieces import _in_place_results

res = run_distributed(_in_place_results, 4, timeout=1200)
for r in range(4):
    for what, runs in res[r]:
        base = runs[0]
        for run in runs[1:]:
            for x, y in zip(run, base):
                assert x.dtype == y.dtype and torch.equal(x.contiguous().view(torch.uint8),
                                                          y.contiguous().view(torch.uint8)), (r, what)
print("pieces in place ok")
"""


def _in_place_results(rank, world):
    """P = 4, L = 2 in Triton's interpreter (the CUDA path of the merges: the node merge and the owner's merge
    are the Triton kernel, and with several exchanges each piece is merged straight into its rows of one
    output, `fused_merge.merges_in_place`): pieces 2 / 3 / 5 at k = 1 and 2 at k = 2 against pieces = 1."""
    from megatron_splitkv.ops import splitkv

    out = []
    c = case(7, 4, dtype="bfloat16", B=4, Hq=2, Hkv=1, D=16, seq_lens=[40, 23, 61], blocks=[5, 3, 0, 4])
    for k, pieces_list in ((1, (1, 2, 3, 5)), (2, (1, 2))):
        runs = []
        for pieces in pieces_list:
            t = build(c)
            x, meta, dout, dlse = local(t, c, rank)
            md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                              block_size=4, num_heads_q=2, num_heads_kv=1, head_dim=16,
                                              dtype=x["q"].dtype, num_chunks=k, cp_ranks_per_node=2,
                                              exchange_pieces=pieces)
            assert md.exchange_pieces == pieces
            assert splitkv.merges_in_place(x["q"].device, torch.float32, 16, torch.float32)
            o, lse = msk.splitkv_attention(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], metadata=md,
                                           backend="math", return_lse=True)
            loss_of(o, lse, dout, dlse).backward()
            runs.append([o.detach(), lse.detach(), x["q"].grad, x["k_ctx"].grad, x["v_blk"].grad])
        out.append((f"k={k}", runs))
    return out


def test_pieces_merged_in_place_in_the_triton_interpreter():
    import os

    from _splitkv_helpers import run_in_triton_interpreter

    pytest.importorskip("triton")
    tests = os.path.dirname(os.path.abspath(__file__))
    run_in_triton_interpreter(_INTERP.format(tests=tests), "pieces in place ok", 1200)
