"""tools/simulate_scaling.py and the alpha-beta / byte model of tools.benchlib (issue 6).

- `fit_alpha_beta` recovers known latency/bandwidth from synthetic timings of every collective kind;
- `predicted_records` (the byte counts the simulator uses) equal the ops' own comm_stats records, op
  name by op name, for splitkv / allgather-kv / ring-kv at CP 2 and 3 on gloo with uneven (LPT) shards;
- the ring-kv overlap model: hidden when compute dominates, additive when compute is zero;
- `--model-only` runs end to end on CPU and writes the table, JSON and PNG.
"""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest
import torch

from _dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from tools import benchlib as bench  # noqa: E402


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce", "send"])
@pytest.mark.parametrize("P", [2, 8])
def test_alpha_beta_fit_recovers_parameters(kind, P):
    true = bench.AlphaBeta(alpha_s=7e-6, bw=180e9)
    sizes = [1 << e for e in range(12, 29, 2)]
    rng = np.random.default_rng(0)
    times = [true.time(kind, P, n) * (1 + 0.01 * rng.standard_normal()) for n in sizes]
    fit = bench.fit_alpha_beta(kind, P, sizes, times)
    assert fit.alpha_s == pytest.approx(true.alpha_s, rel=0.1)
    assert fit.bw == pytest.approx(true.bw, rel=0.05)


def test_alpha_beta_formulas():
    ab = bench.AlphaBeta(1e-5, 100e9)
    n = 1e8
    assert ab.time("all_gather", 4, n) == pytest.approx(3 * 1e-5 + 3 * n / 100e9)
    assert ab.time("reduce_scatter", 4, n) == pytest.approx(3 * 1e-5 + 3 * n / 100e9)
    assert ab.time("all_reduce", 4, n) == pytest.approx(6 * 1e-5 + 1.5 * n / 100e9)
    assert ab.time("send", 4, n) == pytest.approx(1e-5 + n / 100e9)
    assert ab.time("all_gather", 1, n) == 0.0
    link = bench.LinkModel(gpus_per_node=8)
    assert link.ab("all_gather", 8) is link.intra["all_gather"]
    assert link.ab("send", 16) is link.inter["p2p"]


def _agg(recs):
    out = {}
    for r in recs:
        out[(r.op, r.kind)] = out.get((r.op, r.kind), 0) + r.bytes
    return out


def _uneven_plan(rank, world):
    """The volume tests' workload: its LPT plan over `world` ranks and `predicted_records`' keywords for `rank`.
    1000 tokens: uneven shards at P = 3 whichever layout the planner returns (on this batch its LPT falls back
    to the contiguous split, which is never worse: 900 tokens gave 300 per rank)."""
    lens, anc = bench.make_workload(1000, 14, n_seqs=2, seed=5)
    plan = bench.place(lens, anc, cp_size=world, strategy="lpt", block_size=4, chunk_size=64)
    nb = [plan.blocks_per_rank] * world
    nc = [int(plan.token_index(r).shape[0]) for r in range(world)]
    return plan, dict(P=world, rank=rank, n_blocks=nb, n_ctx=nc, B=4, Hq=4, Hkv=2, D=8)


def _volumes(rank, world):
    import torch.distributed as dist

    from megatron_splitkv import comm_stats

    plan, kw = _uneven_plan(rank, world)
    out = {}
    for m in bench.METHODS:
        x = bench.rank_inputs(plan, rank, Hq=4, Hkv=2, D=8, dtype=torch.bfloat16)
        # self-contained call
        with comm_stats() as st:
            bench.run_op(m, x, block_size=4, cp_group=dist.group.WORLD, backend="math")
        # per-step metadata, then a call that reuses it
        with comm_stats() as sp:
            meta = bench.prepare_meta(m, x, block_size=4, cp_group=dist.group.WORLD, Hq=4, Hkv=2, D=8)
        with comm_stats() as sm:
            bench.run_op(m, x, block_size=4, cp_group=None, backend="math", meta=meta)
        out[m] = dict(
            call=(_agg(st.records), _agg(bench.predicted_records(m, **kw))),
            prepare=(_agg(sp.records), _agg(bench.prepare_records(m, P=world, n_blocks=kw["n_blocks"],
                                                                        n_ctx=kw["n_ctx"]))),
            with_meta=(_agg(sm.records), _agg(bench.predicted_records(m, metadata=True, **kw))),
            total=st.total_bytes, n_ctx=kw["n_ctx"])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_predicted_bytes_match_comm_stats(world):
    for res in run_distributed(_volumes, world, timeout=120):
        for m, r in res.items():
            for mode in ("call", "prepare", "with_meta"):
                got, exp = r[mode]
                assert got == exp, (m, world, mode, got, exp)
            assert r["total"] > 0
        assert len(set(res["ring-kv"]["n_ctx"])) > 1 or world == 2  # uneven shards exercised


def test_ring_overlap_model():
    import simulate_scaling as ss

    P = 4
    recs = bench.predicted_records("ring-kv", P=P, rank=0, n_blocks=[8] * P, n_ctx=[1000, 1200, 900, 1100],
                                   B=16, Hq=32, Hkv=8, D=128)
    link = bench.LinkModel()
    zero = ss.method_time("ring-kv", P, [0.0] * P, recs, link, fwd_fraction=0.3, overhead_ms=0.0)
    assert zero["total_ms"] == pytest.approx(zero["comm_ms"], rel=1e-6)  # nothing to hide behind
    big = ss.method_time("ring-kv", P, [1000.0] * P, recs, link, fwd_fraction=0.3, overhead_ms=0.0)
    # all but the metadata gather and the last dK/dV hop are hidden
    assert big["total_ms"] - 4000.0 < 0.2 * big["comm_ms"] + 1e-3
    sk = bench.predicted_records("splitkv", P=P, rank=0, n_blocks=[8] * P, n_ctx=[1000] * P, B=16, Hq=32,
                                 Hkv=8, D=128)
    t = ss.method_time("splitkv", P, [10.0], sk, link, fwd_fraction=0.3, overhead_ms=1.0)
    assert t["total_ms"] == pytest.approx(11.0 + t["comm_ms"])  # no overlap, as coded


def test_model_only_end_to_end(tmp_path):
    import simulate_scaling as ss

    res = ss.main(["--model-only", "--cps", "1,2,8,16", "--ctx-per-rank", "4096", "--out", str(tmp_path)])
    rows = res["rows"]
    assert {r["method"] for r in rows} == {"splitkv", "allgather-kv", "ring-kv"}
    for r in rows:
        assert r["total_ms"] > 0 and np.isfinite(r["efficiency"])
        if r["P"] == 1:
            assert r["efficiency"] == pytest.approx(1.0)
    # split-KV's bytes per rank are query-sized: bounded as P grows; all-gather KV's grow with P
    sk = {r["P"]: r["bytes_per_rank"] for r in rows if r["method"] == "splitkv" and r["placement"] in ("lpt", "-")}
    ag = {r["P"]: r["bytes_per_rank"] for r in rows if r["method"] == "allgather-kv"}
    assert sk[16] < 2 * sk[2] and ag[16] > 5 * ag[2]
    for f in ("simulate_scaling.json", "simulate_scaling.md", "simulate_scaling.png"):
        assert (tmp_path / f).stat().st_size > 0
    json.loads((tmp_path / "simulate_scaling.json").read_text())


# ------------------------------------------------------------------ the chunked Split-KV pipeline model


def test_pipeline_one_chunk_is_serial():
    import simulate_scaling as ss

    assert ss.splitkv_forward_ms([1.5], [10.0], [3.25]) == pytest.approx(14.75)
    assert ss.splitkv_forward_ms([1.5], [10.0], [3.25], [0.5]) == pytest.approx(15.25)
    assert ss.splitkv_backward_ms([1.0], [0.5], [20.0], [3.0]) == pytest.approx(24.5)


def test_pipeline_two_chunks_hand_computed():
    """Two chunks, worked out on paper from the code's issue order (ops/splitkv.py):
    forward: gather Q0 [0, 1], gather Q1 [1, 2], kernel 0 [1, 6], all-to-all 0 [6, 8.5], kernel 1
    [6, 11], all-to-all 1 [11, 13.5], merges 0 [8.5 -> 11, 11.5] and 1 [13.5, 14]: 14 ms instead of 18.5
    serial. Backward: dO0 [0, 1], stats0 [1, 1.5], dO1 [1.5, 2.5], stats1 [2.5, 3], kernel 0 [1.5, 11.5],
    dQ0 [11.5, 14.5], kernel 1 [11.5, 21.5], dQ1 [21.5, 24.5]: 24.5 ms instead of 29."""
    import simulate_scaling as ss

    assert ss.splitkv_forward_ms([1, 1], [5, 5], [2.5, 2.5], [0.5, 0.5]) == pytest.approx(14.0)
    assert ss.splitkv_backward_ms([1, 1], [0.5, 0.5], [10, 10], [3, 3]) == pytest.approx(24.5)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_pipeline_bounds(n):
    """Never more than the serial sum of its own pieces, never less than either stream's busy time; the
    first Q gather and the last all-to-all are always exposed."""
    import simulate_scaling as ss

    rng = np.random.default_rng(n)
    for _ in range(50):
        G, K, A = (list(rng.uniform(0, 5, n)) for _ in range(3))
        t = ss.splitkv_forward_ms(G, K, A)
        assert t <= sum(G) + sum(K) + sum(A) + 1e-9
        assert t >= max(sum(K), sum(G) + sum(A)) - 1e-9
        assert t >= G[0] + K[-1] + A[-1] - 1e-9
        D, S, KB, RQ = (list(rng.uniform(0, 5, n)) for _ in range(4))
        tb = ss.splitkv_backward_ms(D, S, KB, RQ)
        assert tb <= sum(D) + sum(S) + sum(KB) + sum(RQ) + 1e-9
        assert tb >= max(sum(KB), sum(D) + sum(S) + sum(RQ)) - 1e-9
        assert tb >= D[0] + S[0] + KB[-1] + RQ[-1] - 1e-9


def _split_calls(total, k):
    return [total / k] * k


@pytest.mark.parametrize("P", [2, 8, 64])
def test_more_chunks_never_slower_without_latency(P):
    """Bandwidth-only links (alpha = 0), compute split evenly: k chunks never predict more than one
    (= today's serial sum), and k = 1 is exactly compute + communication."""
    import simulate_scaling as ss

    link = bench.LinkModel()
    for t in list(link.intra) + list(link.inter):
        link.intra[t] = bench.AlphaBeta(0.0, 225e9)
        link.inter[t] = bench.AlphaBeta(0.0, 50e9)
    nb, nc = [512 // P] * P, [16384] * P
    kw = dict(P=P, rank=0, n_blocks=nb, n_ctx=nc, B=16, Hq=32, Hkv=8, D=128, metadata=True)
    for comp in (1.0, 20.0, 200.0):
        one = ss.method_time("splitkv", P, [comp], bench.predicted_records("splitkv", num_chunks=1, **kw), link,
                             fwd_fraction=0.3, overhead_ms=2.0)
        assert one["total_ms"] == pytest.approx(comp + one["comm_ms"] + 2.0)
        assert one["exposed_comm_ms"] == pytest.approx(one["comm_ms"])
        prev = one["total_ms"]
        for k in (2, 4, 8):
            t = ss.method_time("splitkv", P, _split_calls(comp, k),
                               bench.predicted_records("splitkv", num_chunks=k, **kw), link, fwd_fraction=0.3,
                               overhead_ms=2.0)
            assert t["comm_ms"] == pytest.approx(one["comm_ms"])  # same bytes, no latency
            assert t["total_ms"] <= one["total_ms"] + 1e-9
            assert t["total_ms"] <= prev + 1e-9 or comp < t["comm_ms"]  # monotone while compute hides comm
            prev = t["total_ms"]


def test_chunk_records_split_the_messages():
    kw = dict(P=4, rank=1, n_blocks=[10] * 4, n_ctx=[1000] * 4, B=16, Hq=8, Hkv=2, D=32, metadata=True)
    one = bench.predicted_records("splitkv", num_chunks=1, **kw)
    three = bench.predicted_records("splitkv", num_chunks=3, **kw)
    assert _agg(one) == _agg(three)  # bytes per op name do not depend on the chunk count
    assert len(three) == 3 * len(one)
    assert sorted({r.step for r in three}) == [0, 1, 2]
    rows = [r.msg for r in three if r.op == "splitkv.fwd.q"]
    assert rows == [3 * 16 * 8 * 32 * 2, 3 * 16 * 8 * 32 * 2, 4 * 16 * 8 * 32 * 2]  # blocks 0-2, 3-5, 6-9


def _chunk_volumes(rank, world, ks):
    import torch.distributed as dist

    from megatron_splitkv import comm_stats

    plan, kw = _uneven_plan(rank, world)
    out = {}
    for k in ks:
        x = bench.rank_inputs(plan, rank, Hq=4, Hkv=2, D=8, dtype=torch.bfloat16)
        meta = bench.prepare_meta("splitkv", x, block_size=4, cp_group=dist.group.WORLD, Hq=4, Hkv=2, D=8,
                                  num_chunks=k)
        with comm_stats() as st:
            bench.run_op("splitkv", x, block_size=4, cp_group=None, backend="math", meta=meta)
        got_n, exp_n = {}, {}
        for r in st.records:
            got_n[(r.op, r.kind)] = got_n.get((r.op, r.kind), 0) + 1
        pred = bench.predicted_records("splitkv", metadata=True, num_chunks=k, **kw)
        for r in pred:
            exp_n[(r.op, r.kind)] = exp_n.get((r.op, r.kind), 0) + 1
        # the kernel calls the simulator times mirror the op's per-chunk masks (context + own block)
        calls = bench.kernel_calls("splitkv", plan, rank, num_chunks=k)
        masks = meta.chunk_masks_own
        same = len(calls) == len(masks) == meta.num_chunks and all(
            np.array_equal(c.lo, m.lo.numpy()) and np.array_equal(c.hi, m.hi.numpy())
            and np.array_equal(c.own_lo, m.lo2.numpy()) and np.array_equal(c.own_hi, m.hi2.numpy())
            and c.num_keys == m.num_keys and c.ctx_keys_padded == m.num_ctx_keys for c, m in zip(calls, masks))
        out[k] = dict(bytes=(_agg(st.records), _agg(pred)), counts=(got_n, exp_n), masks_mirror=same,
                      k_used=meta.num_chunks)
    return out


def test_chunked_records_and_calls_match_the_op():
    if bench.op_option("num_chunks") != "prepare":
        pytest.skip("this tree's prepare_splitkv_metadata has no num_chunks")
    for res in run_distributed(_chunk_volumes, 2, (1, 2, 3), timeout=180):
        for k, r in res.items():
            assert r["k_used"] == k
            assert r["bytes"][0] == r["bytes"][1], (k, r["bytes"])
            assert r["counts"][0] == r["counts"][1], (k, r["counts"])
            assert r["masks_mirror"], k


def test_model_only_chunks_and_fused_own_block(tmp_path):
    import simulate_scaling as ss

    base = ["--model-only", "--cps", "1,2,64", "--ctx-per-rank", "4096", "--num-chunks", "1,4",
            "--own-block-ms", "1.5", "--placements", "lpt"]
    on = ss.main(base + ["--fused-own-block", "on", "--out", str(tmp_path / "on")])
    off = ss.main(base + ["--fused-own-block", "off", "--out", str(tmp_path / "off")])
    ks = {(r["P"], r["num_chunks"]) for r in on["rows"] if r["method"] == "splitkv"}
    assert {(1, 1), (2, 1), (2, 4), (64, 1), (64, 4)} <= ks and (1, 4) not in ks  # P = 1: nothing to pipeline
    # the stated overhead is the op with a separate own block: fused takes the own-block time off
    assert off["overhead_ms"] - on["overhead_ms"] == pytest.approx(1.5)
    def key(r):
        return r["P"], r["method"], r["placement"], r["num_chunks"], r["topology"], r["overlap_q_gather"]

    r_on = {key(r): r for r in on["rows"]}
    r_off = {key(r): r for r in off["rows"]}
    assert len(r_on) == len(on["rows"])
    for key, r in r_on.items():
        assert r_off[key]["total_ms"] - r["total_ms"] == pytest.approx(1.5, abs=0.3)  # + the own tiles' FLOPs
    md = (tmp_path / "on" / "simulate_scaling.md").read_text()
    assert "splitkv k=1" in md and "best k" in md


# ------------------------------------------------------------------ topology, overlap and per-P chunking


def _link(topology, **kw):
    link = bench.LinkModel(gpus_per_node=8, topology=topology, **kw)
    fits = {"all_gather": (56e-6, 240e9), "reduce_scatter": (64e-6, 246e9), "all_reduce": (32e-6, 300e9),
            "p2p": (113e-6, 296e9)}
    for k, (a, b) in fits.items():
        link.intra[k] = bench.AlphaBeta(a, b)
        link.inter[k] = bench.AlphaBeta(15e-6, 50e9)
    return link


KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")


@pytest.mark.parametrize("kind", KINDS)
def test_node_topology_at_two_ranks_is_the_fitted_collective(kind):
    """P = 2 on one node: the node model gives exactly what was fitted there (= the flat model)."""
    node, flat = _link("node"), _link("flat")
    for n in (4096, 1 << 20, 1 << 27):
        assert node.time(kind, 2, n) == pytest.approx(flat.time(kind, 2, n), rel=1e-12)
    assert node.time(kind, 1, 1 << 20) == 0.0


@pytest.mark.parametrize("P", [2, 3, 5, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_node_topology_within_one_node_uses_only_nvlink(kind, P):
    """P <= gpus per node: no inter-node figure enters; the time is the intra-node (NVLink) model."""
    a, b = _link("node"), _link("node")
    for k in b.inter:
        b.inter[k] = bench.AlphaBeta(1e-3, 1e9)  # absurd network: must not matter inside a node
    n = 3 << 20
    assert a.time(kind, P, n) == pytest.approx(b.time(kind, P, n), rel=1e-12)
    z = a.parts(kind, P, n)
    assert z["network"] == 0.0
    ab = a.intra[a._key(a.intra, kind)]
    h = a.intra_hop_s
    if kind in ("all_gather", "reduce_scatter"):  # ring of P on NVLink: base + (P - 1) hops
        assert a.time(kind, P, n) == pytest.approx(ab.alpha_s - h + (P - 1) * h + (P - 1) * n / ab.bw)
    if kind == "all_to_all":  # P - 1 concurrent peers: one path latency, not (P - 1) alpha
        assert a.time(kind, P, n) == pytest.approx(ab.alpha_s + (P - 2) * a.a2a_peer_s + (P - 1) * n / ab.bw)


def test_ring_all_gather_across_nodes():
    """P = 64 on 8 nodes: latency = base + 56 NVLink hops + 7 network hops; bandwidth = (P-1) n over the
    slower of NVLink and the node's 8 NICs."""
    link = _link("node")
    n, P = 1 << 20, 64
    ab, h, hn = link.intra["all_gather"], link.intra_hop_s, 15e-6
    lat = ab.alpha_s - h + 56 * h + 7 * hn
    assert link.parts("all_gather", P, n)["latency"] == pytest.approx(lat)
    # 8 x 50 GB/s = 400 GB/s > 240 GB/s NVLink: NVLink-bound
    assert link.time("all_gather", P, n) == pytest.approx(lat + 63 * n / ab.bw)
    for k in link.inter:
        link.inter[k] = bench.AlphaBeta(15e-6, 10e9)  # 8 x 10 GB/s = 80 GB/s: NIC-bound
    assert link.time("all_gather", P, n) == pytest.approx(lat + 63 * n / 80e9)
    # the flat model: 63 inter-node hops at one NIC's bandwidth
    flat = _link("flat")
    assert flat.time("all_gather", P, n) == pytest.approx(63 * 15e-6 + 63 * n / 50e9)


@pytest.mark.parametrize("pxn", [True, False])
def test_all_to_all_decomposes_into_on_node_and_off_node_parts(pxn):
    link = _link("node", pxn=pxn)
    n, P = 1 << 20, 64  # 7 on-node peers, 56 off-node peers
    ab = link.intra["reduce_scatter"]  # all_to_all is timed with the reduce-scatter fit on NVLink
    z = link.parts("all_to_all", P, n)
    assert z["network"] == pytest.approx(56 * n / 50e9)  # off-node bytes over this GPU's NIC
    assert z["nvlink"] == pytest.approx((7 * n + (56 * n * 7 / 8 if pxn else 0.0)) / ab.bw)
    assert z["latency"] == pytest.approx(ab.alpha_s - link.intra_hop_s + 15e-6 + 62 * link.a2a_peer_s)
    assert link.time("all_to_all", P, n) == pytest.approx(z["latency"] + max(z["nvlink"], z["network"]))
    # a faster NIC only moves the network part
    fast = _link("node", pxn=pxn)
    for k in fast.inter:
        fast.inter[k] = bench.AlphaBeta(15e-6, 500e9)
    zf = fast.parts("all_to_all", P, n)
    assert zf["nvlink"] == z["nvlink"] and zf["latency"] == z["latency"] and zf["network"] < z["network"]


def test_flat_k1_without_overlap_reproduces_the_first_model(tmp_path):
    """--topology flat, k = 1, no projection overlap: T = compute + sum over the op's collectives of
    (P-1) alpha + (P-1) n / bw (intra figures up to one node, inter beyond) + overhead, as before."""
    import simulate_scaling as ss

    res = ss.main(["--model-only", "--cps", "1,2,8,16", "--ctx-per-rank", "4096", "--num-chunks", "1",
                   "--placements", "lpt", "--topology", "node,flat", "--out", str(tmp_path)])
    a8, b8, a15, b50 = 8e-6, 225e9, 15e-6, 50e9
    checked = 0
    for r in res["rows"]:
        if r["topology"] != "flat" or r["method"] != "splitkv" or r["overlap_q_gather"]:
            continue
        P = r["P"]
        recs = bench.predicted_records("splitkv", P=P, rank=r["slowest_rank"], n_blocks=[512 // P] * P,
                                       n_ctx=[4096] * P, B=16, Hq=32, Hkv=8, D=128, metadata=True, num_chunks=1)
        a, b = (a8, b8) if P <= 8 else (a15, b50)
        comm = sum((P - 1) * a + (P - 1) * x.msg / b for x in recs) * 1e3 if P > 1 else 0.0
        assert r["comm_ms"] == pytest.approx(comm, rel=1e-9)
        assert r["total_ms"] == pytest.approx(r["compute_ms"] + comm + r["overhead_ms"], rel=1e-9)
        checked += 1
    assert checked == 4
    node = {(r["P"], r["method"]): r["total_ms"] for r in res["rows"]
            if r["topology"] == "node" and not r["overlap_q_gather"]}
    flat = {(r["P"], r["method"]): r["total_ms"] for r in res["rows"]
            if r["topology"] == "flat" and not r["overlap_q_gather"]}
    for m in ("splitkv", "allgather-kv", "ring-kv"):
        assert node[(1, m)] == flat[(1, m)] and node[(2, m)] == pytest.approx(flat[(2, m)])
    for m in ("splitkv", "allgather-kv"):  # rings stay on NVLink but for the node boundaries
        assert node[(16, m)] < flat[(16, m)]


def test_projection_overlap_hides_the_first_gather_and_the_last_all_to_all():
    import simulate_scaling as ss

    # forward, k = 1: G + K + A serial; a 1 ms projection hides 1 ms of the 1.5 ms gather
    assert ss.splitkv_forward_ms([1.5], [10.0], [3.0], pre=0.0) == pytest.approx(14.5)
    assert ss.splitkv_forward_ms([1.5], [10.0], [3.0], pre=1.0) == pytest.approx(13.5)
    assert ss.splitkv_forward_ms([1.5], [10.0], [3.0], pre=5.0) == pytest.approx(13.0)  # all hidden
    # two chunks, pre 0.5: gathers [0, 1], [1, 2] (both issued first); kernels [1, 6], [6, 11]; all-to-alls
    # [6, 8.5], [11, 13.5]: 13.5 - 0.5 = 13.0 (13.5 without the projection in front)
    assert ss.splitkv_forward_ms([1, 1], [5, 5], [2.5, 2.5]) == pytest.approx(13.5)
    assert ss.splitkv_forward_ms([1, 1], [5, 5], [2.5, 2.5], pre=0.5) == pytest.approx(13.0)
    # backward, k = 1: the projection backward runs under the dQ all-to-all
    assert ss.splitkv_backward_ms([1.0], [0.5], [20.0], [3.0], post=2.0) == pytest.approx(22.5)
    assert ss.splitkv_backward_ms([1.0], [0.5], [20.0], [3.0], post=9.0) == pytest.approx(21.5)
    rng = np.random.default_rng(3)
    for n in (1, 2, 4):
        for _ in range(30):
            G, K, A = (list(rng.uniform(0, 5, n)) for _ in range(3))
            pre = float(rng.uniform(0, 5))
            t1 = ss.splitkv_forward_ms(G, K, A, pre=pre)  # all gathers issued first (query_gather)
            assert max(sum(K), sum(G) + sum(A) - pre) - 1e-9 <= t1 <= sum(G) + sum(K) + sum(A) + 1e-9
            assert t1 >= K[-1] + A[-1] - 1e-9  # the last all-to-all stays exposed
            D, S, KB, RQ = (list(rng.uniform(0, 5, n)) for _ in range(4))
            b0, b1 = ss.splitkv_backward_ms(D, S, KB, RQ), ss.splitkv_backward_ms(D, S, KB, RQ, post=pre)
            assert sum(KB) - 1e-9 <= b1 <= b0 + 1e-9 and b1 >= b0 - min(pre, sum(D) + sum(S) + sum(RQ)) - 1e-9
    # the projection's FLOPs: 2 * tokens * hidden * 2 * Hkv * D
    assert ss.kv_proj_flops(16384 + 128, 4096, 8, 128) == 2.0 * 16512 * 4096 * 2048


def test_chunk_loss_model():
    import simulate_scaling as ss

    assert ss.chunked_calls_ms(10.0, [5.0], 0.1) == [10.0]
    t = ss.chunked_calls_ms(10.0, [1.0, 3.0], 0.1)
    assert sum(t) == pytest.approx(11.0) and t[1] == pytest.approx(3 * t[0])
    assert sum(ss.chunked_calls_ms(10.0, [1.0] * 4, ss.CHUNK_LOSS)) == pytest.approx(10.0 * (1 + 3 * ss.CHUNK_LOSS))


def test_summary_reports_k1_best_k_and_overlap(tmp_path):
    import simulate_scaling as ss

    res = ss.main(["--model-only", "--cps", "1,2,64", "--ctx-per-rank", "4096", "--placements", "lpt",
                   "--out", str(tmp_path)])
    summ = res["summary"]
    assert {e["topology"] for e in summ} == {"node", "flat"}
    for e in summ:
        rows = [r for r in res["rows"] if r["P"] == e["P"] and r["topology"] == e["topology"]
                and r["method"] == "splitkv"]
        for ovl, key in ((False, "best"), (True, "best_ovl")):
            best = min(r["total_ms"] for r in rows if r["overlap_q_gather"] == ovl)
            assert e[key]["T"] == pytest.approx(best)
            assert e[key]["T"] <= e["k1" if not ovl else "k1_ovl"]["T"] + 1e-12
        assert e["best_ovl"]["T"] <= e["best"]["T"] + 1e-12  # the overlap never hurts
        base = min(e["allgather_kv"]["T"], e["ring_kv"]["T"])
        assert e["speedup_vs_best_baseline"] == pytest.approx(base / e["best_ovl"]["T"])
        if e["P"] == 1:
            assert e["k1"]["efficiency"] == pytest.approx(1.0) and e["best"]["k"] == 1
    p64 = [e for e in summ if e["P"] == 64]
    assert all(e["best"]["k"] >= 1 for e in p64)
    md = (tmp_path / "simulate_scaling.md").read_text()
    assert "Topology 'node'" in md and "Topology 'flat'" in md and "best k + ovl" in md


# ------------------------------------------------ the fused backward gather and the two-level all-to-all

SHAPE = dict(B=16, Hq=32, Hkv=8, D=128)


def _records_before(P, k, *, nb_max, B=16, Hq=32, D=128, elem=2, acc=4):
    """The op's per-chunk records BEFORE the fused gather and the two-level all-to-all (as
    bench.predicted_records wrote them): dO and stats gathered separately, one [O | lse] and one dQ
    all-to-all per chunk."""
    recs = []

    def add(op, kind, msg, c):
        recs.append(bench.PredRecord(f"splitkv.{op}", kind, 2 * (P - 1) * msg if P > 1 else 0, msg, c))

    bounds = bench.chunk_bounds(k, nb_max)
    for c, (b0, b1) in enumerate(bounds):
        rc = (b1 - b0) * B
        add("fwd.q", "all_gather", rc * Hq * D * elem, c)
        add("fwd.out", "all_to_all", rc * Hq * (D + acc // elem) * elem, c)
    for c, (b0, b1) in enumerate(bounds):
        rc = (b1 - b0) * B
        add("bwd.dout", "all_gather", rc * Hq * D * elem, c)
        add("bwd.stats", "all_gather", rc * Hq * 2 * acc, c)
        add("bwd.dq", "all_to_all", rc * Hq * D * elem, c)
    return recs


def _today_ms(P, comp, recs, link, fwd_fraction, proj):
    """The simulator's Split-KV time as it was before the variants (one NCCL stream, every record timed by
    link.time(kind, P, msg), summed per name and chunk): the reference L = 1 must reproduce bit for bit."""
    import simulate_scaling as ss

    n = len(comp)
    per, serial = {}, []
    for r in recs:
        name = r.op.split(".", 1)[1]
        t = link.time(r.kind, P, r.msg) * 1e3
        if name in ("fwd.q", "fwd.out", "bwd.dout", "bwd.stats", "bwd.dq"):
            key = (name, min(max(r.step, 0), n - 1))
            per[key] = per.get(key, 0.0) + t
        else:
            serial.append(t)

    def col(name):
        return [per.get((name, c), 0.0) for c in range(n)]

    K = [fwd_fraction * c for c in comp]
    KB = [(1 - fwd_fraction) * c for c in comp]
    t = (sum(serial) + ss.splitkv_forward_ms(col("fwd.q"), K, col("fwd.out"), pre=proj[0])
         + ss.splitkv_backward_ms(col("bwd.dout"), col("bwd.stats"), KB, col("bwd.dq"), post=proj[1]))
    return t, sum(serial) + sum(per.values())


@pytest.mark.parametrize("topology", ["node", "flat"])
@pytest.mark.parametrize("P", [2, 8, 16, 64])
def test_one_rank_per_node_or_whole_group_reproduces_today_exactly(topology, P):
    """cp_ranks_per_node L = 1 or L >= P (one all-to-all) with the separate gathers gives exactly the
    model before the variants, from the records before the change (bwd_gather separate / auto) and from
    the op's new records (fused dO gather split back by the formula)."""
    import simulate_scaling as ss

    link = _link(topology)
    nb = 512 // P
    for k in (1, 2, 3):
        old = _records_before(P, k, nb_max=nb)
        new = bench.predicted_records("splitkv", P=P, rank=0, n_blocks=[nb] * P, n_ctx=[4096] * P, metadata=True,
                                      num_chunks=k, **SHAPE)
        comp = [10.0 / k + 0.1 * c for c in range(k)]
        for proj in ((0.0, 0.0), (0.35, 0.7)):
            ref_t, ref_comm = _today_ms(P, comp, old, link, 0.3, proj)
            for L in (1, P, 2 * P):
                for recs, g in ((old, "separate"), (old, "auto"), (new, "separate")):
                    det = {}
                    r = ss.method_time("splitkv", P, comp, recs, link, fwd_fraction=0.3, overhead_ms=1.0,
                                       proj_ms=proj, bwd_gather=g, cp_ranks_per_node=L, D=128, detail=det)
                    assert r["total_ms"] == ref_t + 1.0 and r["comm_ms"] == ref_comm, (k, L, g, proj)
                    assert det["layout"] is None and r["node_merge_ms"] == 0.0
                    assert sum(det["bytes_by_name"].values()) == sum(x.bytes for x in old)


def _sent_per_chunk(cs, name, n):
    """Bytes SENT per rank per chunk by the collectives of `name` (comm_stats counts sent + received)."""
    return [sum(x.bytes for x in cs[name][c]) / 2 for c in range(n)]


@pytest.mark.parametrize("P,L", [(64, 8), (16, 8), (32, 4), (16, 2)])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_two_level_stage_bytes_match_the_formula(P, L, k):
    """Per rank and chunk (Lq_c rows in the chunk, N = P / L): stage 1 sends (L - 1) / L x Lq_c x Hq x
    (2 D + 4) bytes (bf16 O, lse packed), stage 2 (N - 1) / N x Lq_c / L x Hq x (4 D + 4) (fp32 O and lse);
    dQ the same without the lse (2 D, 4 D). Both from the single all-to-all's records (formula) and, when
    this tree's predicted_records issues them, from its own ".intra" / ".inter" records."""
    import simulate_scaling as ss

    Hq, D, B, nb = 32, 128, 16, 512 // P
    N = P // L
    lq = [(b1 - b0) * B * P for b0, b1 in bench.chunk_bounds(k, nb)]
    kw = dict(P=P, rank=0, n_blocks=[nb] * P, n_ctx=[4096] * P, metadata=True, num_chunks=k, **SHAPE)
    sources = [bench.predicted_records("splitkv", cp_ranks_per_node=1, **kw)]
    two = bench.predicted_records("splitkv", cp_ranks_per_node=L, **kw)
    if any(r.op.endswith(".intra") for r in two):
        sources.append(two)
    for recs in sources:
        cs = ss.splitkv_collectives(recs, P, k, cp_ranks_per_node=L, gpus_per_node=8, D=D)
        assert cs["layout"] == dict(L=L, N=N, intra_per_node=L, inter_per_node=8 // L)
        for c in range(k):
            (i1, i2), (d1, d2) = cs["fwd.out"][c], cs["bwd.dq"][c]
            assert (i1.name, i1.group, i1.stream, i2.name, i2.group, i2.stream) == (
                "fwd.out.intra", L, "N1", "fwd.out.inter", N, "N2")
            assert i1.bytes / 2 == pytest.approx((L - 1) / L * lq[c] * Hq * (2 * D + 4), rel=1e-12)
            assert i2.bytes / 2 == pytest.approx((N - 1) / N * lq[c] / L * Hq * (4 * D + 4), rel=1e-12)
            assert d1.bytes / 2 == pytest.approx((L - 1) / L * lq[c] * Hq * 2 * D, rel=1e-12)
            assert d2.bytes / 2 == pytest.approx((N - 1) / N * lq[c] / L * Hq * 4 * D, rel=1e-12)
    if len(sources) == 2:  # the op's records and the formula agree message by message
        a, b = (ss.splitkv_collectives(r, P, k, cp_ranks_per_node=L, D=D) for r in sources)
        for name in ("fwd.out", "bwd.dq"):
            assert [[(x.name, x.group, x.msg) for x in a[name][c]] for c in range(k)] == \
                   [[(x.name, x.group, x.msg) for x in b[name][c]] for c in range(k)]


def test_two_level_cuts_the_forward_merge_nic_bytes_to_a_quarter():
    """P = 64 on 8-GPU nodes, L = 8: the [O | lse] bytes each rank sends through its NIC fall from 56/63 of
    the partials in bf16 (56 x rc Hq (2 D + 4)) to 7 fp32 node partials (7 x rc Hq (4 D + 4)): 0.248x."""
    import simulate_scaling as ss

    link, P, D = _link("node"), 64, 128
    recs = bench.predicted_records("splitkv", P=P, rank=0, n_blocks=[8] * P, n_ctx=[16384] * P, metadata=True,
                                   num_chunks=1, **SHAPE)
    nic = {}
    for L in (1, 8):
        cs = ss.splitkv_collectives(recs, P, 1, cp_ranks_per_node=L, D=D)
        nic[L] = {name: sum(x.nic_bytes(link) for x in cs[name][0]) for name in ("fwd.out", "bwd.dq")}
    rc_hq = 128 * 32
    assert nic[1]["fwd.out"] == 56 * rc_hq * (2 * D + 4)
    assert nic[8]["fwd.out"] == 7 * rc_hq * (4 * D + 4)
    ratio = nic[8]["fwd.out"] / nic[1]["fwd.out"]
    assert ratio == pytest.approx(7 * 516 / (56 * 260)) and 0.23 < ratio < 0.27
    assert nic[8]["bwd.dq"] / nic[1]["bwd.dq"] == pytest.approx(0.25)  # fp32 vs bf16 partials, 7 vs 56 peers
    # stage 1 stays on the node: no NIC bytes; stage 2 has no NVLink part (one rank per node, no PXN relay)
    cs = ss.splitkv_collectives(recs, P, 1, cp_ranks_per_node=8, D=D)
    s1, s2 = cs["fwd.out"][0]
    assert s1.nic_bytes(link) == 0 and link.parts(s1.kind, s1.group, s1.msg, s1.per_node)["network"] == 0
    z2 = link.parts(s2.kind, s2.group, s2.msg, s2.per_node)
    assert z2["nvlink"] == 0 and z2["network"] == pytest.approx(7 * s2.msg / 50e9)


def test_fused_backward_gather_pays_one_latency():
    """One all-gather of [dO | delta, lse] per chunk instead of two: the bytes of both, one latency. With
    k = 1 and no overlap the backward saves exactly the stats gather's latency; both record sets agree."""
    import simulate_scaling as ss

    for P in (8, 64):
        link = _link("node")
        old = _records_before(P, 1, nb_max=512 // P)
        new = bench.predicted_records("splitkv", P=P, rank=0, n_blocks=[512 // P] * P, n_ctx=[4096] * P,
                                      metadata=True, num_chunks=1, **SHAPE)
        res = {}
        for recs in (old, new):
            for g in ("separate", "fused"):
                cs = ss.splitkv_collectives(recs, P, 1, bwd_gather=g, D=128)
                d, st = cs["bwd.dout"][0], cs["bwd.stats"][0]
                rows_hq = (512 // P) * 16 * 32
                if g == "fused":
                    assert len(d) == 1 and st == [] and d[0].msg == rows_hq * (128 * 2 + 8)
                else:
                    assert [x.msg for x in d + st] == [rows_hq * 256, rows_hq * 8]
                res[(id(recs), g)] = ss.method_time("splitkv", P, [10.0], recs, link, fwd_fraction=0.3,
                                                    overhead_ms=0.0, bwd_gather=g, D=128)["total_ms"]
        for g in ("separate", "fused"):
            assert res[(id(old), g)] == pytest.approx(res[(id(new), g)], rel=1e-12)  # robust to both record sets
        lat = link.parts("all_gather", P, 1.0)["latency"] * 1e3
        assert res[(id(old), "separate")] - res[(id(old), "fused")] == pytest.approx(lat, rel=1e-9)
    # auto: as the records are
    assert ss.splitkv_collectives(old, 64, 1)["bwd_gather"] == "separate"
    assert ss.splitkv_collectives(new, 64, 1)["bwd_gather"] == "fused"


def test_two_level_schedule_hand_computed():
    """k = 1: serial G + K + stage 1 + node merge + stage 2. k = 2 (inline, as built): Q gathers [0, 1],
    [1, 2]; kernel 0 [1, 6]; stage 1 of 0 [6, 7] waited; merge 0 [7, 7.5]; stage 2 of 0 [7.5, 9.5] behind
    kernel 1 [7.5, 12.5]; stage 1 of 1 [12.5, 13.5]; merge [13.5, 14]; stage 2 [14, 16]: 16. Deferred: kernel
    1 [6, 11] right after kernel 0, stage 1 of 0 [6, 7] hidden; merge 0 [11, 11.5], stage 2 of 0 [11.5, 13.5];
    stage 1 of 1 [11, 12] waited; merge 1 [12, 12.5]; stage 2 of 1 [13.5, 15.5] (after stage 2 of 0 on "N2"): 15.5."""
    import simulate_scaling as ss

    assert ss.splitkv_forward_ms([1.0], [5.0], [2.0], A1=[1.0], NM=[0.5]) == pytest.approx(9.5)
    assert ss.splitkv_forward_ms([1.0], [5.0], [2.0], A1=[1.0], NM=[0.5], defer=True) == pytest.approx(9.5)
    assert ss.splitkv_forward_ms([1, 1], [5, 5], [2, 2], A1=[1, 1], NM=[0.5, 0.5]) == pytest.approx(16.0)
    assert ss.splitkv_forward_ms([1, 1], [5, 5], [2, 2], A1=[1, 1], NM=[0.5, 0.5], defer=True) == pytest.approx(15.5)
    # backward, k = 1: dO + stats + kernel + stage 1 + node sum + stage 2; fused gather: no stats
    assert ss.splitkv_backward_ms([1.0], [0.5], [20.0], [2.0], RQ1=[1.0], NS=[0.5]) == pytest.approx(25.0)
    assert ss.splitkv_backward_ms([1.0], [0.0], [20.0], [2.0], RQ1=[1.0], NS=[0.5]) == pytest.approx(24.5)
    # the projection backward hides stage 2 only (stage 1 and the node sum are waited inside the op)
    assert ss.splitkv_backward_ms([1.0], [0.0], [20.0], [2.0], RQ1=[1.0], NS=[0.5], post=5.0) == pytest.approx(22.5)
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 5):
        for _ in range(30):
            G, K, A, A1, NM = (list(rng.uniform(0, 3, n)) for _ in range(5))
            t, td = (ss.splitkv_forward_ms(G, K, A, A1=A1, NM=NM, defer=d) for d in (False, True))
            serial = sum(G) + sum(K) + sum(A) + sum(A1) + sum(NM)
            last = sum(G) + K[-1] + A1[-1] + NM[-1] + A[-1]  # the last chunk's chain after every Q gather
            for x in (t, td):
                assert max(sum(K) + sum(NM), last) - 1e-9 <= x <= serial + 1e-9
            assert t >= sum(K) + sum(A1) + sum(NM) - 1e-9  # inline: every stage 1 on the compute path
            # (deferred is not always faster: it holds each stage 2 back by one kernel)


def test_sub_group_link_model():
    """per_node: a stage-1 group of L consecutive ranks of one node is the CP group of L ranks (NVLink only);
    a stage-2 group of N ranks, one per node, is NIC only with one network latency and no PXN relay."""
    for topo in ("node", "flat"):
        link = _link(topo)
        for L in (2, 4, 8):
            for kind in KINDS:
                assert link.time(kind, L, 1 << 22, per_node=L) == link.time(kind, L, 1 << 22)
    link = _link("node")
    ab, n = link.intra["reduce_scatter"], 1 << 22
    for N in (2, 4, 8):
        z = link.parts("all_to_all", N, n, per_node=1)
        assert z["nvlink"] == 0 and z["network"] == pytest.approx((N - 1) * n / 50e9)
        assert z["latency"] == pytest.approx(ab.alpha_s - link.intra_hop_s + 15e-6 + (N - 2) * link.a2a_peer_s)
        assert _link("flat").time("all_to_all", N, n, per_node=1) == pytest.approx((N - 1) * (15e-6 + n / 50e9))
    assert link.nodes(8, per_node=1) == (8, 1) and link.nodes(8, per_node=8) == (1, 8) and link.nodes(64) == (8, 8)


def test_model_only_variants_end_to_end(tmp_path):
    import simulate_scaling as ss

    res = ss.main(["--model-only", "--cps", "1,2,8,64", "--ctx-per-rank", "4096", "--placements", "lpt",
                   "--num-chunks", "1,2", "--bwd-gather", "separate,fused", "--cp-ranks-per-node", "1,8",
                   "--out", str(tmp_path)])
    labels = ["sep/L=1", "fused/L=1", "sep/L=8", "fused/L=8"]
    assert [v["label"] for v in res["variants"]] == labels

    def key(r):
        return r["P"], r["num_chunks"], r["topology"], r["overlap_q_gather"]

    sk = {(r["variant"],) + key(r): r for r in res["rows"] if r["method"] == "splitkv"}
    assert len(sk) == len([r for r in res["rows"] if r["method"] == "splitkv"])
    for (v, P, k, topo, ovl), r in sk.items():
        assert r["two_level"] == (v.endswith("L=8") and P == 64)
        if P <= 8 and v.endswith("L=8"):  # L >= P: the single all-to-all, exactly as L = 1
            assert r["total_ms"] == sk[(v.replace("L=8", "L=1"), P, k, topo, ovl)]["total_ms"]
        if r["two_level"]:
            assert {"fwd.out.intra", "fwd.out.inter", "bwd.dq.intra", "bwd.dq.inter"} <= set(r["bytes_by_name"])
            assert r["node_merge_ms"] > 0 and "fwd.out" not in r["bytes_by_name"]
        assert ("bwd.stats" in r["bytes_by_name"]) == v.startswith("sep") or P == 1
    for e in res["summary"]:
        assert set(e["variants"]) == set(labels)
        best = min(e["variants"][v]["best_ovl"]["T"] for v in labels)
        assert e["head"]["T"] == best and e["variants"][e["headline_variant"]]["best_ovl"]["T"] == best
        assert e["best_ovl"] == e["variants"]["sep/L=1"]["best_ovl"]  # the reference columns: the first variant
        if e["P"] == 64 and e["topology"] == "node":  # the two changes help at P = 64, each and together
            T = {v: e["variants"][v]["best_ovl"]["T"] for v in labels}
            assert T["fused/L=8"] < min(T["fused/L=1"], T["sep/L=8"])
            assert max(T["fused/L=1"], T["sep/L=8"]) < T["sep/L=1"]
    md = (tmp_path / "simulate_scaling.md").read_text()
    assert "splitkv variants" in md and "fused/L=8: best k + ovl" in md and "headline (best variant)" in md


def test_measured_mode_cpu_runs_the_variants(tmp_path):
    """The measured path (kernel shards and the node merge timed on the device; here the CPU, tiny shapes)
    carries the new options: L = 2 on 2-rank 'nodes' makes P = 4 two-level."""
    import simulate_scaling as ss

    res = ss.main(["--cpu", "--cps", "1,2,4", "--ctx-per-rank", "256", "--anchors", "8", "--B", "4", "--Hq", "4",
                   "--Hkv", "2", "--D", "16", "--hidden", "64", "--reps", "1", "--gpus-per-node", "2",
                   "--methods", "splitkv", "--placements", "lpt", "--num-chunks", "1,2",
                   "--bwd-gather", "separate,fused", "--cp-ranks-per-node", "1,2", "--out", str(tmp_path)])
    assert res["node_merge"]["source"].startswith("measured")
    two = [r for r in res["rows"] if r["two_level"]]
    assert two and {r["P"] for r in two} == {4} and all(r["cp_ranks_per_node"] == 2 for r in two)
    assert all(r["compute_source"].startswith("measured") for r in res["rows"] if r["num_chunks"] == 1)
    assert all(np.isfinite(r["total_ms"]) and r["total_ms"] > 0 for r in res["rows"])


@pytest.mark.parametrize("argv,flag", [(["--cp-ranks-per-node", "3"], "--cp-ranks-per-node"),
                                       (["--cp-ranks-per-node", "0"], "--cp-ranks-per-node"),
                                       (["--bwd-gather", "both"], "--bwd-gather"),
                                       (["--merge-gbs", "0"], "--merge-gbs")])
def test_variant_flag_errors(argv, flag, capsys):
    import simulate_scaling as ss

    with pytest.raises(SystemExit) as e:
        ss.main(["--model-only", "--cps", "1,2,8"] + argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_calibrated_rate_reproduces_measured_shards():
    """The calibrated kernel rate is the one at which the FLOP model gives back the measured times (per-call
    overhead included); empty calls are ignored; no usable sample gives None."""
    import simulate_scaling as ss

    calls = [bench.KernelCall(np.zeros(1), np.zeros(1), np.zeros(1), None, None, 16, float(p))
             for p in (3e7, 5e7)]
    for c in calls:  # a non-empty call: rows and keys present
        assert c.rows and c.num_keys
    rate, over = 437.0, 0.3
    times = [ss.model_call_ms(c, Hq=32, D=128, tflops=rate, overhead_ms=over) for c in calls]
    got = ss.calibrated_tflops([(calls[:1], times[:1]), (calls[1:], times[1:])], Hq=32, D=128, overhead_ms=over)
    assert got == pytest.approx(rate, rel=1e-9)
    assert ss.calibrated_tflops([], Hq=32, D=128, overhead_ms=over) is None
    assert ss.calibrated_tflops([(calls, [0.1, 0.1])], Hq=32, D=128, overhead_ms=over) is None


def test_measured_mode_models_cut_shards_at_the_calibrated_rate(tmp_path):
    """A measured-mode run whose budget cuts the shard measurements models the rest at the rate calibrated
    on the measured ones (not at --kernel-tflops), and says so."""
    import simulate_scaling as ss

    res = ss.main(["--cpu", "--cps", "1,2,4", "--ctx-per-rank", "256", "--anchors", "8", "--B", "4", "--Hq", "4",
                   "--Hkv", "2", "--D", "16", "--hidden", "64", "--reps", "1", "--gpus-per-node", "2",
                   "--methods", "splitkv", "--placements", "lpt", "--num-chunks", "1", "--budget-s", "0.001",
                   "--kernel-tflops", "1e6", "--out", str(tmp_path)])
    src = res["model_kernel_rate"]["splitkv"]
    assert src.startswith("calibrated"), src
    modelled = [r for r in res["rows"] if r["compute_source"] == "model"]
    assert modelled, "the tiny budget should leave shards to the model"
    # at the stated 1e6 TF/s the model would give ~the per-call overhead only; calibrated, it is CPU-slow
    assert all(r["compute_ms"] > 2 * ss.model_call_ms(bench.KernelCall(np.zeros(1), np.zeros(1), np.zeros(1), None,
                                                                        None, 4, 1.0), Hq=4, D=16, tflops=1e6,
                                                      overhead_ms=0.3) for r in modelled)


def test_measured_mode_scales_an_untimed_chunked_shard_from_its_measured_k1(tmp_path, monkeypatch):
    """A splitkv shard of k = 2 chunks that could not be timed takes its rank's measured k = 1 time x the chunk-loss
    model (`chunked_calls_ms`), and says so; the k = 1 rows stay measured."""
    import simulate_scaling as ss

    orig = bench.time_kernel_calls

    def fail_chunked(calls, **kw):
        if len(calls) == 2:
            raise RuntimeError("not timed")
        return orig(calls, **kw)

    monkeypatch.setattr(bench, "time_kernel_calls", fail_chunked)
    res = ss.main(_TINY + ["--cps", "1,2", "--placements", "lpt", "--out", str(tmp_path)])
    one = {(r["P"], r["topology"], r["overlap_q_gather"], r.get("variant")): r for r in res["rows"]
           if r["num_chunks"] == 1}
    two = [r for r in res["rows"] if r["num_chunks"] == 2]
    assert two and all(r["compute_source"] == "measured" for r in one.values())
    for r in two:
        base = one[(r["P"], r["topology"], r["overlap_q_gather"], r.get("variant"))]
        assert r["compute_source"] == "measured k=1 x chunk loss", r["compute_source"]
        assert sum(r["per_call_ms"]) == pytest.approx(sum(base["per_call_ms"]) * (1 + ss.CHUNK_LOSS), rel=1e-9)


# ------------------------------------------------ the two-level [dO | stats] all-gather (perf-notes item 14)


def test_two_level_dout_gather_schedule_hand_computed():
    """The op's prefetch with the two-stage gather (stage 1 "N2" two chunks ahead, stage 2 "N1" issued from
    the compute stream after it waited for stage 1, one chunk ahead). k = 1: serial. k = 2: stage 1 of 0
    [0, 1] and of 1 [1, 2]; the compute stream waits 1, stage 2 of 0 [1, 1.5]; waits 2, stage 2 of 1
    [2, 2.5]; kernel 0 [2, 7], kernel 1 [7, 12]; dQ all-to-alls [7, 9], [12, 14]: 14. k = 4: stage 1 of 3
    [3, 4] before kernel 1, stage 2 of 2 [7, 7.5] and of 3 [12, 12.5] behind kernels 1 and 2: only the first
    2 ms exposed, 22."""
    import simulate_scaling as ss

    assert ss.splitkv_backward_ms([0.5], [0.0], [5.0], [2.0], DO1=[1.0]) == pytest.approx(8.5)
    assert ss.splitkv_backward_ms([0.5] * 2, [0.0] * 2, [5.0] * 2, [2.0] * 2, DO1=[1.0] * 2) == pytest.approx(14.0)
    assert ss.splitkv_backward_ms([0.5] * 4, [0.0] * 4, [5.0] * 4, [0.0] * 4, DO1=[1.0] * 4) == pytest.approx(22.0)
    # with the two-level dQ all-to-all on the same sub-group streams (stage 1 "N1", stage 2 "N2"): k = 1
    # serial, dO stage 1 + stage 2 + kernel + dQ stage 1 + node sum + dQ stage 2
    assert ss.splitkv_backward_ms([0.5], [0.0], [5.0], [2.0], RQ1=[1.0], NS=[0.25], DO1=[1.0]) == pytest.approx(9.75)
    # flat (DO1 None), each gather as long as both stages: 1.5 + 10 + 2 = 13.5; the two stages pay 0.5 more
    # at k = 2 (before kernel 0 the compute stream also waits for chunk 1's stage 1, which queues behind
    # chunk 0's on "N2")
    assert ss.splitkv_backward_ms([1.5] * 2, [0.0] * 2, [5.0] * 2, [2.0] * 2) == pytest.approx(13.5)
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 5):
        for _ in range(30):
            DO, DO1, KB, RQ = (list(rng.uniform(0, 3, n)) for _ in range(4))
            t = ss.splitkv_backward_ms(DO, [0.0] * n, KB, RQ, DO1=DO1)
            assert DO1[0] + DO[0] + sum(KB) - 1e-9 <= t <= sum(DO) + sum(DO1) + sum(KB) + sum(RQ) + 1e-9


SEVENTH = os.path.join(ROOT, "docs", "lab", "results", "simulate_scaling_2026-11-30g_h200.json")


def test_replay_reproduces_the_saved_run(tmp_path):
    """`--replay` of the committed seventh-run JSON: every splitkv row comes back as saved ("auto" = this tree's
    op, whose backward gather is the flat fused one at L = 8, as the saved run's), "fused" too except where it
    is a what-if (one node, where the saved op used two separate gathers)."""
    import simulate_scaling as ss

    with open(SEVENTH) as f:
        saved = json.load(f)

    def key(r):
        return r["P"], r["placement"], r["num_chunks"], r["topology"], r["overlap_q_gather"], r["cp_ranks_per_node"]

    old = {key(r): r for r in saved["rows"] if r["method"] == "splitkv"}
    res = ss.main(["--replay", SEVENTH, "--bwd-gather", "fused,auto", "--two-level-wait", "deferred",
                   "--out", str(tmp_path)])  # the saved run's schedule (before item 18)
    assert [v["label"] for v in res["variants"]] == ["fused/L=1", "auto/L=1", "fused/L=8", "auto/L=8"]
    for r in res["rows"]:
        if r["method"] != "splitkv":
            continue
        if r["variant"].startswith("fused") and r["P"] < 16:
            continue  # the saved op used two separate gathers on one node: "fused" is a what-if there
        s = old[key(r)]
        assert r["total_ms"] == pytest.approx(s["total_ms"], rel=1e-12, abs=1e-12), (key(r), r["variant"])
    def bkey(r):
        return r["method"], r["P"], r["placement"], r["topology"]

    base = {bkey(r): r["total_ms"] for r in saved["rows"] if r["method"] != "splitkv"}
    assert {bkey(r): r["total_ms"] for r in res["rows"] if r["method"] != "splitkv"} == base
    md = (tmp_path / "simulate_scaling.md").read_text()
    assert md.startswith(f"Replay of {SEVENTH}") and "auto/L=8: best k + ovl" in md
    assert json.loads((tmp_path / "simulate_scaling.json").read_text())["replay"]["source"] == SEVENTH


def test_replay_errors(tmp_path, capsys):
    import simulate_scaling as ss

    with pytest.raises(SystemExit) as e:
        ss.main(["--replay", str(tmp_path / "missing.json"), "--out", str(tmp_path)])
    assert e.value.code == 2 and "--replay" in capsys.readouterr().err
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({"rows": [], "args": {}}))
    with pytest.raises(SystemExit) as e:
        ss.main(["--replay", str(bad), "--out", str(tmp_path)])
    assert e.value.code == 2 and "--replay" in capsys.readouterr().err


def test_relay_schedule_hand_computed():
    """Item 16 (the relay stream): the compute stream never waits for stage 1; the relay "R" waits for it,
    merges, and stage 2 follows. Forward k = 2 (G 1, K 5, stage 1 1, merge 0.5, stage 2 2): Q [0, 1], [1, 2];
    kernel 0 [1, 6], kernel 1 [6, 11]; stage 1 of 0 [6, 7], relay merge [7, 7.5], stage 2 [7.5, 9.5];
    stage 1 of 1 [11, 12], merge [12, 12.5], stage 2 [12.5, 14.5]: 14.5 (deferred 15.5, inline 16). k = 1:
    serial, 9.5 as before. Backward k = 1 with the projection's backward (post 5): dO 1, kernel 20, then the
    projection [21, 26] while stage 1 [21, 22], the node sum [22, 22.5], stage 2 [22.5, 24.5] run: the op's
    time 26 - 5 = 21 (deferred: stage 1 and the sum on the compute path, 22.5)."""
    import simulate_scaling as ss

    f = dict(A1=[1, 1], NM=[0.5, 0.5])
    assert ss.splitkv_forward_ms([1, 1], [5, 5], [2, 2], defer=True, relay=True, **f) == pytest.approx(14.5)
    assert ss.splitkv_forward_ms([1, 1], [5, 5], [2, 2], defer=True, **f) == pytest.approx(15.5)
    assert ss.splitkv_forward_ms([1.0], [5.0], [2.0], A1=[1.0], NM=[0.5], relay=True) == pytest.approx(9.5)
    b = dict(RQ1=[1.0], NS=[0.5], post=5.0)
    assert ss.splitkv_backward_ms([1.0], [0.0], [20.0], [2.0], relay=True, **b) == pytest.approx(21.0)
    assert ss.splitkv_backward_ms([1.0], [0.0], [20.0], [2.0], **b) == pytest.approx(22.5)
    # a projection shorter than the chain: stage 2 ends after it (21 + 1 + 0.5 + 2 = 24.5 > 21 + 2)
    assert ss.splitkv_backward_ms([1.0], [0.0], [20.0], [2.0], RQ1=[1.0], NS=[0.5], post=2.0,
                                  relay=True) == pytest.approx(24.5 - 2.0)
    rng = np.random.default_rng(11)
    for n in (1, 2, 3, 5):  # never slower than the deferred wait; never below the compute
        for _ in range(30):
            G, K, A, A1, NM = (list(rng.uniform(0, 3, n)) for _ in range(5))
            pre, post = rng.uniform(0, 2, 2)
            tr = ss.splitkv_forward_ms(G, K, A, pre=pre, A1=A1, NM=NM, defer=True, relay=True)
            td = ss.splitkv_forward_ms(G, K, A, pre=pre, A1=A1, NM=NM, defer=True)
            assert sum(K) - 1e-9 <= tr <= td + 1e-9
            DO, KB, RQ, RQ1, NS = (list(rng.uniform(0, 3, n)) for _ in range(5))
            br = ss.splitkv_backward_ms(DO, [0.0] * n, KB, RQ, post=post, RQ1=RQ1, NS=NS, defer=True, relay=True)
            bd = ss.splitkv_backward_ms(DO, [0.0] * n, KB, RQ, post=post, RQ1=RQ1, NS=NS, defer=True)
            assert sum(KB) - 1e-9 <= br <= bd + 1e-9
    with pytest.raises(ValueError, match="two_level_wait"):
        ss.splitkv_time_ms(2, [1.0], [], bench.LinkModel.__new__(bench.LinkModel), fwd_fraction=0.3,
                           two_level_wait="late")


def test_replay_relay_changes_only_the_two_level_rows(tmp_path):
    """The default replay (this tree's op: the relay) against the same replay with the op before item 18
    (`--two-level-wait deferred`): rows without the two-level all-to-all (L = 1, P <= 8) identical; every
    two-level row no slower; at k = 1 with the projection overlap the change is exactly the backward's dQ
    stage 1 + node sum (the forward has nothing to overlap at k = 1; the projection's backward, 0.71 ms,
    hides the whole relayed chain of 0.70 ms at P = 64)."""
    import simulate_scaling as ss

    new = ss.main(["--replay", SEVENTH, "--bwd-gather", "auto", "--out", str(tmp_path / "relay")])
    old = ss.main(["--replay", SEVENTH, "--bwd-gather", "auto", "--two-level-wait", "deferred",
                   "--out", str(tmp_path / "deferred")])
    assert new["args"]["two_level_wait"] == "relay" and old["args"]["two_level_wait"] == "deferred"

    def key(r):
        return (r["method"], r["P"], r["placement"], r.get("num_chunks"), r["topology"], r.get("overlap_q_gather"),
                r.get("variant"))

    before = {key(r): r for r in old["rows"]}
    saved = json.load(open(SEVENTH))
    link = ss.link_from_dict(saved["link"], "node")
    gbs = saved["node_merge"]["gbs"]
    n_changed = 0
    for r in new["rows"]:
        s = before[key(r)]
        if r["method"] != "splitkv" or not r.get("two_level"):
            assert r["total_ms"] == s["total_ms"], key(r)
            continue
        assert r["total_ms"] <= s["total_ms"] + 1e-12, key(r)
        n_changed += r["total_ms"] < s["total_ms"] - 1e-9
        if (r["P"], r["num_chunks"], r["topology"], r["placement"], r["overlap_q_gather"]) == (64, 1, "node", "lpt",
                                                                                                True):
            m1 = r["bytes_by_name"]["bwd.dq.intra"] / (2 * 7)  # per-peer stage-1 message, one chunk
            stage1 = link.time("all_to_all", 8, m1, per_node=8) * 1e3
            node_sum = 8 * m1 / (gbs[1] * 1e9) * 1e3
            assert r["total_ms"] - s["total_ms"] == pytest.approx(-(stage1 + node_sum), rel=1e-9)
            assert r["efficiency"] > s["efficiency"]
    assert n_changed > 0


def test_exchange_pieces_schedule_hand_computed():
    """The forward's two-level exchange in row pieces (perf-notes item 19), k = 1: Q gather [0, 1], kernel
    [1, 6]; 2 pieces: stage 1 of 0 [6, 7], of 1 [7, 8] ("N1", in order); merge 0 [7, 7.5] (relay or compute),
    stage 2 of 0 [7.5, 9.5]; merge 1 [8, 8.5], stage 2 of 1 after stage 2 of 0 on "N2" [9.5, 11.5]: 11.5,
    against one piece of the same totals: stage 1 [6, 8], merge [8, 9], stage 2 [9, 13]: 13. One piece given
    as a list = the scalar schedule."""
    import simulate_scaling as ss

    for relay in (False, True):
        two = ss.splitkv_forward_ms([1.0], [5.0], [[2.0, 2.0]], A1=[[1.0, 1.0]], NM=[[0.5, 0.5]], defer=True,
                                    relay=relay)
        one = ss.splitkv_forward_ms([1.0], [5.0], [4.0], A1=[2.0], NM=[1.0], defer=True, relay=relay)
        assert (two, one) == (pytest.approx(11.5), pytest.approx(13.0))
        assert ss.splitkv_forward_ms([1.0], [5.0], [[4.0]], A1=[[2.0]], NM=[[1.0]], defer=True, relay=relay) == one
    # k = 2 with 2 pieces each (defer, relay): chunk 1's kernel [6, 11] runs while chunk 0's pieces advance
    t = ss.splitkv_forward_ms([1, 1], [5, 5], [[2, 2], [2, 2]], A1=[[1, 1], [1, 1]], NM=[[0.5, 0.5]] * 2, defer=True,
                              relay=True)
    # s1: [6, 7], [7, 8], [11, 12], [12, 13]; s2: [7.5, 9.5], [9.5, 11.5], [12.5, 14.5], [14.5, 16.5]
    assert t == pytest.approx(16.5)
    with pytest.raises(ValueError, match="pieces"):
        ss.splitkv_forward_ms([1.0], [5.0], [[2.0]], A1=[[1.0, 1.0]], NM=[[0.5, 0.5]])


# ------------------------------------------------ head chunks (ops/splitkv.py item 3, --chunk-axis heads)


def test_head_chunk_calls_mirror_the_op():
    """`bench.kernel_calls(..., chunk_axis="heads")` mirrors the op's head chunks (k clamped to Hkv, every call the
    one-call mask, pairs split by kv-head share), and `bench.chunk_loop` over them gives the one call's dK / dV
    (written per head chunk) in float64 with the math kernel."""
    from megatron_splitkv.kernels import get_kernel

    lens, anchors = bench.make_workload(256, 8, seed=3)
    plan = bench.place(lens, anchors, cp_size=1, strategy="lpt", block_size=4)
    x = bench.rank_inputs(plan, 0, Hq=6, Hkv=3, D=8, dtype=torch.float64, device="cpu")
    for k in (2, 3, 5):
        meta = bench.prepare_meta("splitkv", x, block_size=4, cp_group=None, Hq=6, Hkv=3, D=8, dtype=torch.float64,
                                  num_chunks=k, chunk_axis="heads")
        one = bench.kernel_calls("splitkv", plan, 0, num_chunks=1)[0]
        calls = bench.kernel_calls("splitkv", plan, 0, num_chunks=k, chunk_axis="heads", num_heads_kv=3)
        assert len(calls) == meta.num_chunks == min(k, 3)
        assert [(g0 * 2, g1 * 2) for g0, g1 in (c.kv_heads for c in calls)] == meta.chunk_heads
        m = meta.chunk_masks_own[0]
        for c in calls:
            assert np.array_equal(c.lo, m.lo.numpy()) and np.array_equal(c.own_lo, m.lo2.numpy())
            assert c.num_keys == m.num_keys
        assert sum(c.pairs for c in calls) == pytest.approx(one.pairs)
    kern = get_kernel("math", torch.device("cpu"), torch.float64, head_dim=8)
    gen = torch.Generator().manual_seed(0)
    parts, ks, vs = bench.chunk_inputs(calls, Hq=6, Hkv=3, D=8, dtype=torch.float64, device="cpu", gen=gen)
    dk, dv = bench.chunk_loop(kern, parts, ks, vs, 8 ** -0.5)
    q, do = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
    k_all, v_all = torch.cat(ks, 1), torch.cat(vs, 1)
    rk, rv = bench.chunk_loop(kern, [(q, do, parts[0][2])], k_all, v_all, 8 ** -0.5)
    assert torch.allclose(dk, rk, atol=1e-12, rtol=1e-12) and torch.allclose(dv, rv, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="chunk_axis='heads' needs num_heads_kv"):
        bench.kernel_calls("splitkv", plan, 0, num_chunks=2, chunk_axis="heads")
    with pytest.raises(ValueError, match="chunk_axis must be 'rows' or 'heads'"):
        bench.kernel_calls("splitkv", plan, 0, num_chunks=2, chunk_axis="cols")


def test_measured_mode_cpu_head_chunks(tmp_path):
    """--chunk-axis heads in measured mode: splitkv's chunk counts clamp to --Hkv and are timed as head chunks."""
    import simulate_scaling as ss

    res = ss.main(["--cpu", "--cps", "1,2", "--ctx-per-rank", "256", "--anchors", "8", "--B", "4", "--Hq", "4",
                   "--Hkv", "2", "--D", "16", "--hidden", "64", "--reps", "1", "--methods", "splitkv",
                   "--placements", "lpt", "--num-chunks", "1,2,3", "--chunk-axis", "heads", "--out", str(tmp_path)])
    ks = {r["num_chunks"] for r in res["rows"] if r["P"] == 2}
    assert ks == {1, 2}, ks  # 3 clamps to Hkv = 2
    assert all(r["compute_source"].startswith("measured") for r in res["rows"])
    assert all(np.isfinite(r["total_ms"]) and r["total_ms"] > 0 for r in res["rows"])


#: a saved run of head chunks (H200 x 2): a replay input
HEADS = os.path.join(ROOT, "docs", "lab", "results", "simulate_heads_2026-11-30k_h200x2.json")


def test_cpu_flag_is_a_tiny_dry_run(tmp_path):
    """`--cpu` alone is the tiny dry run its help promises (fresh-user finding, session 9: it kept the 16K-per-rank
    Qwen3-8B shapes and CP up to 64 and ran for hours on the CPU): the shape flags left at their defaults take
    `CPU_SHAPES`, a flag given on the command line keeps its value."""
    import simulate_scaling as ss

    res = ss.main(["--cpu", "--ctx-per-rank", "128", "--methods", "splitkv", "--placements", "lpt",
                   "--out", str(tmp_path)])
    a = res["args"]
    assert a["ctx_per_rank"] == 128  # given
    for name in ("cps", "anchors", "B", "Hq", "Hkv", "D", "hidden", "reps"):
        assert a[name] == ss.CPU_SHAPES[name], name
    assert sorted({r["P"] for r in res["rows"]}) == [1, 2, 4]


# ------------------------------------------------ measured head splits and paired rounds (perf-notes items 21-22)


def _tiny_calls():
    """splitkv's k = 2 row chunks of rank 0 at P = 2 (tiny CPU shapes) and an empty call between them."""
    lens, anchors = bench.make_workload(512, 8, n_seqs=1, seed=3)
    plan = bench.place(lens, anchors, cp_size=2, strategy="lpt", block_size=4)
    calls = bench.kernel_calls("splitkv", plan, 0, num_chunks=2)
    empty = bench.KernelCall(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), 4)
    return [calls[0], empty, calls[1]]


def test_time_kernel_calls_refactor_keeps_its_result(monkeypatch):
    """`time_kernel_calls` through `kernel_calls_timing`: one step per live call on CPU, per_call_ms = each step's
    median at the live calls' places (0.0 for an empty call), ms = their sum, the rest of the dict as before; a
    real CPU run has the same structure."""
    calls = _tiny_calls()
    kw = dict(Hq=4, Hkv=2, D=16, dtype=torch.float32, device="cpu", backend="math")
    real = bench.time_kernel_calls(calls, reps=1, warmup=0, **kw)
    assert set(real) == {"ms", "per_call_ms", "pairs", "tile_pairs", "fwd_flops", "tflops"}
    assert len(real["per_call_ms"]) == 3 and real["per_call_ms"][1] == 0.0
    assert real["ms"] == pytest.approx(sum(real["per_call_ms"])) and min(real["per_call_ms"][::2]) > 0
    fake = iter([7.0, 5.0])
    ran = []

    def fake_time_fn(fn, device, reps, warmup):
        fn()  # the step runs (forward + backward of its call)
        ran.append(fn)
        return next(fake), 0.0, []

    monkeypatch.setattr(bench, "time_fn", fake_time_fn)
    got = bench.time_kernel_calls(calls, reps=1, warmup=0, **kw)
    assert got["per_call_ms"] == [7.0, 0.0, 5.0] and got["ms"] == 12.0 and len(ran) == 2
    spec = bench.kernel_calls_timing(calls, **kw)
    assert len(spec.steps) == 2
    assert spec.result([7.0, 5.0]) == got
    assert got["pairs"] == sum(c.pairs for c in calls) == real["pairs"]
    with pytest.raises(ValueError, match="step times"):
        spec.result([1.0])


def _noting(step, ran, t):
    """`step` wrapped so that calling it notes task t in `ran` (its `task` tag kept)."""
    def f():
        ran.append(t)
        return step()
    f.task = step.task
    return f


def test_time_kernel_calls_rounds_builds_once_and_rotates(monkeypatch):
    """`time_kernel_calls_rounds`: every task's steps built once; round i times the tasks in their order rotated by
    i; one result per task and round, the per-call structure of `time_kernel_calls`."""
    calls = _tiny_calls()
    kw = dict(Hq=4, Hkv=2, D=16, dtype=torch.float32, device="cpu", backend="math")
    specs = [bench.kernel_calls_timing(calls[:1], **kw), bench.kernel_calls_timing(calls, **kw)]
    built, seq = [], []

    def counted(build, t):  # a step builder that records its calls and tags its step with the task
        def b():
            built.append(t)
            step = build()
            step.task = t
            return step
        return b

    for t, s in enumerate(specs):
        s.steps = [counted(b, t) for b in s.steps]

    def fake_time_fn(fn, device, reps, warmup):
        seq.append(fn.task)
        return float(len(seq)), 0.0, []

    ran = []
    for t, s in enumerate(specs):  # every step also notes its untimed runs (the warm-up round)
        s.steps = [(lambda b, t=t: (lambda: _noting(b(), ran, t)))(b) for b in s.steps]
    monkeypatch.setattr(bench, "time_fn", fake_time_fn)
    out = bench.time_kernel_calls_rounds(specs, device="cpu", rounds=3, reps=1)
    assert ran == [0, 1, 1]  # one untimed warm-up round over every step before the timed rounds
    assert sorted(built) == [0, 1, 1]  # once per step: task 0 one step, task 1 two (the empty call has none)
    assert seq == [0, 1, 1, 1, 1, 0, 0, 1, 1]  # rounds: (0, 1), (1, 0), (0, 1)
    assert [len(o) for o in out] == [3, 3]
    assert [o["per_call_ms"] for o in out[0]] == [[1.0], [6.0], [7.0]]
    assert [o["per_call_ms"] for o in out[1]] == [[2.0, 0.0, 3.0], [4.0, 0.0, 5.0], [8.0, 0.0, 9.0]]
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        bench.time_kernel_calls_rounds(specs, device="cpu", rounds=0)


_TINY = ["--cpu", "--methods", "splitkv", "--reps", "1", "--num-chunks", "1,2"]


def _row_key(r):
    return r["P"], r["placement"], r["num_chunks"], r["topology"], r["overlap_q_gather"], r.get("variant")


def test_measured_overhead_per_chunking(tmp_path, monkeypatch):
    """Measured mode times the op's own ms beyond its kernel at P = 1 for every chunking its splitkv rows use (k = 1,
    the head chunks): a chunked row's overhead = k = 1's + what its chunking's (op - kernel)
    adds over k = 1's; the k = 1 rows keep k = 1's; the result lists every chunking's measurement."""
    import simulate_scaling as ss

    fake = {("one",): (10.0, 9.0), ("heads", (2, 2)): (12.0, 10.5)}
    asked = []

    def fake_time(key, plan1, args, **kw):
        asked.append(key)
        assert plan1.cp_size == 1 and kw["reps"] >= 9
        return fake[key]

    monkeypatch.setattr(ss, "time_chunking_overhead", fake_time)
    res = ss.main(_TINY + ["--Hkv", "4", "--Hq", "8", "--placements", "lpt", "--chunk-axis", "heads",
                           "--out", str(tmp_path / "run")])
    assert asked == [("one",), ("heads", (2, 2))]
    want = {1: 1.0, 2: 1.5}
    for r in res["rows"]:
        assert r["overhead_ms"] == pytest.approx(want[r["num_chunks"]]), (r["P"], r["num_chunks"])
        assert r["total_ms"] >= r["compute_ms"] + r["overhead_ms"] - 1e-9
    got = {tuple(e["key"]): (e["label"], e["overhead_ms"]) for e in res["overhead_by_chunking"]}
    assert got[("one",)] == ("k=1", 1.0) and got[("heads", "(2, 2)")] == ("heads 2/2", pytest.approx(1.5))
    assert "heads 2/2 +0.50 ms" in res["overhead_source"]


def test_paired_rounds_efficiency_per_round(tmp_path, monkeypatch):
    """--paired-rounds 2: the P0 reference shard first, then every measured splitkv shard of the first placement (the
    not zigzag's), each timed once per round; their per-call ms = the median over the rounds; every
    first-placement splitkv row with P > 1 has efficiency_rounds = T(1)_i / T(P)_i of round i's compute (P = 1
    rows and other placements none); the summary shows median [min-max]; the JSON replays to the same rounds."""
    import simulate_scaling as ss

    seen = []
    orig = bench.time_kernel_calls_rounds

    def spy(specs, **kw):
        seen.append((specs, kw))
        return orig(specs, **kw)

    monkeypatch.setattr(bench, "time_kernel_calls_rounds", spy)
    res = ss.main(_TINY + ["--placements", "lpt,zigzag", "--sample-ranks", "1",
                           "--paired-rounds", "2", "--out", str(tmp_path / "run")])
    (specs, kw), = seen
    assert kw["rounds"] == 2
    assert len(specs[0].calls) == 1 and specs[0].calls[0].num_ctx == 256  # P = 1, k = 1: the T(1) shard
    # P = 1: k = 1; P = 2, 4: k = 1, 2 (lpt only; one sampled rank each)
    assert len(specs) == 1 + 2 * 2
    rows = [r for r in res["rows"] if r["method"] == "splitkv"]
    first = [r for r in rows if r["placement"] in ("lpt", "-")]
    assert all(r["compute_source"] == "measured, 2 interleaved rounds" for r in first)
    assert all("efficiency_rounds" not in r for r in rows if r["placement"] == "zigzag" or r["P"] == 1)
    base = {}
    for r in first:
        assert len(r["per_call_ms_rounds"]) == 2 and len(r["total_ms_rounds"]) == 2
        for c, ms in enumerate(r["per_call_ms"]):  # one sampled rank: the median of its two rounds
            assert ms == pytest.approx(np.median([pc[c] for pc in r["per_call_ms_rounds"]]), rel=1e-12)
        if r["P"] == 1:
            b = base.setdefault(r["topology"], list(r["total_ms_rounds"]))
            base[r["topology"]] = [min(x, y) for x, y in zip(b, r["total_ms_rounds"])]
    for r in first:
        if r["P"] > 1:
            assert r["efficiency_rounds"] == [b / t for b, t in zip(base[r["topology"]], r["total_ms_rounds"])]
    md = (tmp_path / "run" / "simulate_scaling.md").read_text()
    assert "efficiency over 2 paired rounds" in md
    head = next(e for e in res["summary"] if e["P"] == 4 and e["topology"] == "node")["head"]
    assert ss.rounds_text(head["efficiency_rounds"]) in md
    rep = ss.main(["--replay", str(tmp_path / "run" / "simulate_scaling.json"), "--out", str(tmp_path / "replay")])
    got = {_row_key(r): r for r in rep["rows"] if r["method"] == "splitkv"}
    for r in rows:
        assert got[_row_key(r)].get("efficiency_rounds") == r.get("efficiency_rounds"), _row_key(r)
        assert got[_row_key(r)]["total_ms"] == r["total_ms"]


@pytest.mark.parametrize("argv,flag", [
    (["--cpu", "--paired-rounds", "-1"], "--paired-rounds"),
    (["--cpu", "--paired-rounds", "1001"], "--paired-rounds"),
    (["--model-only", "--paired-rounds", "1"], "--paired-rounds"),
])
def test_rounds_flag_errors(argv, flag, tmp_path, capsys):
    """Negative or too many rounds, rounds without measuring: exit 2 naming the flag, before anything is
    measured."""
    import simulate_scaling as ss

    with pytest.raises(SystemExit) as e:
        ss.main(argv + ["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err, err
    assert not os.path.exists(tmp_path / "simulate_scaling.json")


def test_paired_rounds_refused_with_replay_or_several_ranks(tmp_path, capsys, monkeypatch):
    import simulate_scaling as ss

    with pytest.raises(SystemExit) as e:
        ss.main(["--replay", HEADS, "--paired-rounds", "1", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--paired-rounds" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        ss.main(["--cpu", "--paired-rounds", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--paired-rounds" in err and "WORLD_SIZE=2" in err


def test_replay_reads_gzip_and_refuses_garbage(tmp_path, capsys):
    """--replay reads a gzip-compressed saved run (docs/lab/results keeps the large ones as .json.gz) to the same rows
    as the plain file; a file that is neither exits 2 naming the flag (no traceback)."""
    import gzip

    import simulate_scaling as ss

    gz = tmp_path / "run.json.gz"
    with open(SEVENTH, "rb") as f, gzip.open(gz, "wb") as g:
        g.write(f.read())
    plain = ss.main(["--replay", SEVENTH, "--out", str(tmp_path / "a")])
    zipped = ss.main(["--replay", str(gz), "--out", str(tmp_path / "b")])
    assert [r["total_ms"] for r in plain["rows"]] == [r["total_ms"] for r in zipped["rows"]]
    bad = tmp_path / "bad.json.gz"
    bad.write_text("not gzip")
    with pytest.raises(SystemExit) as e:
        ss.main(["--replay", str(bad), "--out", str(tmp_path / "c")])
    assert e.value.code == 2 and "--replay" in capsys.readouterr().err


@pytest.mark.parametrize("kw, name", [
    (dict(rounds=2.7), "rounds"), (dict(rounds=True), "rounds"), (dict(rounds="3"), "rounds"),
    (dict(rounds=2, reps=0), "reps"), (dict(rounds=2, reps=1.5), "reps"), (dict(rounds=2, warmup=-1), "warmup"),
    (dict(rounds=2, warmup_rounds=-2), "warmup_rounds"), (dict(rounds=2, warmup_rounds=0.5), "warmup_rounds"),
])
def test_time_kernel_calls_rounds_refuses_non_int_counts(kw, name):
    """time_kernel_calls_rounds int()'d its counts: rounds=2.7 ran 2 rounds, rounds=True / "3" ran, reps=0 gave NaN
    per-call ms (a median of no times), a negative warmup_rounds was taken as 0. The package's int check
    (`_ints.as_int`): a ValueError naming the argument, before anything is built or timed."""
    built = []
    spec = bench.KernelCallsTiming(calls=[], steps=[lambda: built.append(1) or (lambda: None)], Hq=4, D=16,
                                   backward=True)
    with pytest.raises(ValueError, match=rf"^{name} must be "):
        bench.time_kernel_calls_rounds([spec], device="cpu", **kw)
    assert not built
