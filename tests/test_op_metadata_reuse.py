"""Per-step metadata reuse (`prepare_splitkv_metadata` + `metadata=`) for all three CP attention ops.

Several "layers" (different q/k/v tensors, one metadata object prepared once) must give outputs, lse
and all five gradients equal to the single-process float64 reference, at CP sizes 1, 2, 3 with uneven and
empty shards, bit-identical to calls without `metadata=`; per call no metadata collective is issued
("*.meta", "block_meta", "kv_meta", "ctx_meta") but the default group_check's verdict row ("<op>.check", one
per forward call at P > 1); the FlexAttention BlockMask is built once per mask and step; tensors that do not
match the metadata raise ValueError (on every rank with `group_check=True`, the default; locally with
False); bad metadata raises on every rank at prepare time. Source: DESIGN.md section 2.

The odd shapes (`_odd_cases`) through `prepare_splitkv_metadata` for all three ops and num_chunks 1-5: empty
contexts and zero blocks on some ranks, Lk < P, P = 3 / 5 / 6, num_chunks above the block count, extreme and
duplicate sequence ids, positions at both int32 ends, anchors beyond the ends and beyond int32, sorted /
reverse-sorted / shuffled contexts, lse-only losses, the query gather, retain_graph, the two-level all-to-all
(SplitKVConfig.cp_ranks_per_node); expected values from the float64 reference.
"""

import random

import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import (
    GRAD_NAMES,
    OPS,
    TOL,
    assemble,
    build,
    case,
    expect_value_error,
    job_results,
    local,
    loss_of,
    new_seed,
    rel_err,
    run_jobs,
)
from megatron_splitkv import SplitKVConfig, comm_stats, dflash_attention_reference, splitkv_start_query_gather
from megatron_splitkv.ops import SplitKVMetadata, prepare_splitkv_metadata, validation

LAYERS = 3
META_TAGS = (".meta", "block_meta", "kv_meta", "ctx_meta", ".check")
KEYS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")


def layer_inputs(c, layer):
    """Global inputs of `layer`: the case's metadata and shards, fresh activations per layer."""
    t = build(c)
    if layer:
        g = torch.Generator().manual_seed(c["seed"] * 7919 + layer)
        dt = getattr(torch, c["dtype"])
        for k in KEYS + ("dout",):
            t[k] = torch.randn(t[k].shape, generator=g, dtype=torch.float64).to(dt)
        t["dout"] = t["dout"].double()
        t["dlse"] = torch.randn(t["dlse"].shape, generator=g, dtype=torch.float64)
    return t


def layer_reference(c, t):
    x = {k: t[k].double().clone().requires_grad_(True) for k in KEYS}
    out, lse = dflash_attention_reference(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], t["q_seq"],
                                          t["q_anchor"], t["kv_seq"], t["kv_pos"], block_size=c["B"])
    loss_of(out, lse, t["dout"], t["dlse"]).backward()
    ref = dict(out=out.detach(), lse=lse.detach())
    ref.update({n: x[k].grad for n, k in zip(GRAD_NAMES, KEYS)})
    return ref


def check_layer(op, c, t, per_rank):
    ref = layer_reference(c, t)
    got = assemble(t, c, per_rank)
    tol = TOL[c["dtype"]]
    errs = {}
    for key, r in ref.items():
        a = got[key]
        assert not torch.isnan(a).any(), (op, key)
        if key == "lse":
            fin = torch.isfinite(r)
            assert torch.equal(fin, torch.isfinite(a)), (op, "lse -inf pattern")
            a, r = a[fin], r[fin]
        errs[key] = rel_err(a, r)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{op} case {c} (seed {c['seed']}): errors {bad} above {tol}; all {errs}"


def _result(x, out, lse):
    res = dict(out=out.detach().double(), lse=lse.detach().double())
    res.update({n: x[k].grad.double() for n, k in zip(GRAD_NAMES, KEYS)})
    return res


def _reuse_one(op, c, rank, group, backend):
    """Prepare once, run LAYERS forwards then one backward; plus a call without metadata on layer 0."""
    import megatron_splitkv.kernels.flex as fx

    dt = getattr(torch, c["dtype"])
    _, meta_kw, _, _ = local(build(c), c, rank)
    with comm_stats() as prep:
        meta = prepare_splitkv_metadata(meta_kw["q_seq"], meta_kw["q_anchor"], meta_kw["kv_seq"],
                                        meta_kw["kv_pos"], block_size=c["B"], num_heads_q=c["Hq"],
                                        num_heads_kv=c["Hkv"], head_dim=c["D"], dtype=dt, cp_group=group,
                                        impl=op)
    builds = []
    orig = fx.build_block_mask
    fx.build_block_mask = lambda *a, **k: builds.append(1) or orig(*a, **k)
    try:
        runs, losses, fwd_ops = [], [], []
        for layer in range(LAYERS):
            x, _, dout, dlse = local(layer_inputs(c, layer), c, rank)
            # layer 0 passes the very metadata tensors given to prepare (allowed), the others None.
            m = [meta_kw[k] for k in ("q_seq", "q_anchor", "kv_seq", "kv_pos")] if layer == 0 else [None] * 4
            with comm_stats() as st:
                out, lse = OPS[op](*[x[k] for k in KEYS], *m, metadata=meta, backend=backend, return_lse=True)
            fwd_ops.append([r.op for r in st.records])
            runs.append((x, out, lse))
            losses.append(loss_of(out, lse, dout, dlse))
        with comm_stats() as bst:
            sum(losses).backward()
        bwd_ops = [r.op for r in bst.records]
    finally:
        fx.build_block_mask = orig
    per_layer = [_result(*r) for r in runs]
    # the same layer-0 call without metadata (internal metadata): must be bit-identical.
    x, meta_kw0, dout, dlse = local(layer_inputs(c, 0), c, rank)
    with comm_stats() as st:
        out, lse = OPS[op](*[x[k] for k in KEYS], *[meta_kw0[k] for k in ("q_seq", "q_anchor", "kv_seq",
                                                                            "kv_pos")],
                           block_size=c["B"], cp_group=group, backend=backend, return_lse=True)
        loss_of(out, lse, dout, dlse).backward()
    plain = _result(x, out, lse)
    return dict(layers=per_layer, plain=plain, prep_ops=[r.op for r in prep.records], fwd_ops=fwd_ops,
                bwd_ops=bwd_ops, plain_ops=[r.op for r in st.records], mask_builds=len(builds),
                n_step_masks=len(meta.step_masks) if meta.step_masks is not None else None,
                num_chunks=meta.num_chunks)


def reuse_worker(rank, world_size, jobs):
    return run_jobs(rank, world_size, jobs, lambda job, g: _reuse_one(job[0], job[1], rank, g, job[2]), case_index=1)


def reuse_cases(seed):
    tk = 13 + 7 + 20
    return [
        (case(seed, 1, dtype="float64", blocks=[3]), "math"),
        (case(seed + 1, 2, dtype="float64", blocks=[3, 0], ctx=[tk, 0]), "math"),  # empty shards
        (case(seed + 2, 2, dtype="float64", seq_lens=[9, 11],  # context already sorted (order None)
              ctx_idx=[list(range(0, 12)), list(range(12, 20))]), "math"),
        (case(seed + 3, 3, dtype="float64", blocks=[2, 0, 3], ctx=[25, 0, 15]), "math"),
        (case(seed + 4, 3, dtype="float32", Hq=6, Hkv=3, B=3, blocks=[1, 2, 2], ctx=[3, 30, 7]), "math"),
        (case(seed + 5, 2, dtype="float32", D=16, blocks=[2, 3], ctx=[11, 29]), "flex"),
    ]


@pytest.fixture(scope="module")
def reuse_run():
    seed = new_seed()
    jobs = [(op, c, be) for c, be in reuse_cases(seed) for op in OPS]
    return jobs, run_distributed(reuse_worker, 3, jobs, timeout=600)


def _per_rank(results, j, P):
    return [results[r][j] for r in range(P)]


def test_layers_exact_and_identical_to_plain_call(reuse_run):
    jobs, results = reuse_run
    for j, (op, c, backend) in enumerate(jobs):
        runs = _per_rank(results, j, c["P"])
        for layer in range(LAYERS):
            check_layer(op, c, layer_inputs(c, layer), [r["layers"][layer] for r in runs])
        for rank, r in enumerate(runs):
            for key, v in r["plain"].items():
                assert torch.equal(v, r["layers"][0][key]), (op, backend, c["P"], rank, key)


def test_no_metadata_collectives_per_call(reuse_run):
    jobs, results = reuse_run
    for j, (op, c, backend) in enumerate(jobs):
        for r in _per_rank(results, j, c["P"]):
            extra = {"splitkv": "splitkv.fwd.block_meta", "allgather_kv": "allgather_kv.fwd.kv_meta",
                     "ring_kv": "ring_kv.ctx_meta"}[op]
            assert r["prep_ops"] == [f"{op}.meta", extra], r["prep_ops"]
            # the default group_check: one tiny verdict row "<op>.check" per forward call (P > 1), nothing else
            check = [f"{op}.check"] if c["P"] > 1 else []
            for ops in r["fwd_ops"]:
                assert [o for o in ops if any(tag in o for tag in META_TAGS)] == check, ops
            assert not [o for o in r["bwd_ops"] if any(tag in o for tag in META_TAGS)], r["bwd_ops"]
            n_call = len(r["fwd_ops"][0]) + len(r["bwd_ops"]) // LAYERS
            assert n_call < len(r["plain_ops"]), (op, n_call, r["plain_ops"])
            assert f"{op}.meta" in r["plain_ops"]  # the plain call still validates group-wide
            if op == "splitkv":  # exactly the 5 data collectives of Split-KV remain, once per chunk
                k = r["num_chunks"]
                assert sorted(r["fwd_ops"][0]) == sorted(["splitkv.fwd.q", "splitkv.fwd.out"] * k + check)
                assert sorted(r["bwd_ops"]) == sorted(
                    ["splitkv.bwd.dout", "splitkv.bwd.stats", "splitkv.bwd.dq"] * k * LAYERS)


def test_flex_block_mask_built_once_per_step(reuse_run):
    jobs, results = reuse_run
    flex_jobs = [(j, op, c) for j, (op, c, be) in enumerate(jobs) if be == "flex"]
    assert flex_jobs
    for j, op, c in flex_jobs:
        for r in _per_rank(results, j, c["P"]):
            # ring: one mask per step of the ring; splitkv: one per query chunk of the merge pipeline
            expect = {"ring_kv": c["P"], "splitkv": r["num_chunks"]}.get(op, 1)
            assert r["mask_builds"] == expect, (op, r["mask_builds"], expect)


# ----------------------------------------------------------------------------------------- errors


def _tensors(nb=2, B=4, Hq=4, Hkv=2, D=8, tk=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    x = dict(q=r(nb * B, Hq, D), k_ctx=r(tk, Hkv, D), v_ctx=r(tk, Hkv, D), k_blk=r(nb * B, Hkv, D),
             v_blk=r(nb * B, Hkv, D))
    m = dict(q_seq=torch.zeros(nb, dtype=torch.int64), q_anchor=torch.full((nb,), 3, dtype=torch.int64),
             kv_seq=torch.zeros(tk, dtype=torch.int64), kv_pos=torch.arange(tk))
    return x, m


def _prep(m, impl="splitkv", group=None, **kw):
    args = dict(block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8, dtype=torch.float32)
    args.update(kw)
    return prepare_splitkv_metadata(m["q_seq"], m["q_anchor"], m["kv_seq"], m["kv_pos"], cp_group=group,
                                    impl=impl, **args)


def test_mismatch_raises_single_process():
    x, m = _tensors()
    for impl in OPS:
        meta = _prep(m, impl=impl)
        assert isinstance(meta, SplitKVMetadata) and meta.n_blocks == [2] and meta.n_ctx == [5]
        ok = OPS[impl](*x.values(), metadata=meta)
        assert ok.shape == x["q"].shape
        bad = [
            ({"q": x["q"][:4], "k_blk": x["k_blk"][:4], "v_blk": x["v_blk"][:4]}, {}, r"q.shape \(4, 4, 8\)"),
            ({"k_ctx": x["k_ctx"][:4], "v_ctx": x["v_ctx"][:4]}, {}, r"k_ctx.shape \(4, 2, 8\)"),
            ({"q": torch.zeros(8, 2, 8)}, {}, r"q.shape \(8, 2, 8\).*Hq = 4"),
            ({"k_ctx": torch.zeros(5, 1, 8), "v_ctx": torch.zeros(5, 1, 8)}, {}, r"k_ctx.shape"),
            ({"v_blk": torch.zeros(8, 2, 4)}, {}, r"v_blk.shape"),
            ({"q": x["q"].double()}, {}, r"q.dtype torch.float64 does not match"),
            ({}, {"q_seq": m["q_seq"].clone()}, r"q_seq must be None or the very tensor"),
            ({}, {"block_size": 2}, r"block_size=2 differs"),
            ({}, {"backend": "nope"}, r"backend must be one of"),
        ]
        for tens, kw, pattern in bad:
            args = {**x, **tens}
            with pytest.raises(ValueError, match=pattern):
                OPS[impl](*[args[k] for k in KEYS], metadata=meta, **kw)
        other = next(o for o in OPS if o != impl)
        with pytest.raises(ValueError, match=f"prepared for impl='{impl}'"):
            OPS[other](*x.values(), metadata=meta)
    with pytest.raises(ValueError, match="impl must be one of"):
        _prep(m, impl="ulysses")
    with pytest.raises(ValueError, match=r"Hq % Hkv != 0"):
        _prep(m, num_heads_q=3)
    with pytest.raises(ValueError, match="q_anchor must be a 1-D integer tensor of length 2"):
        _prep({**m, "q_anchor": m["q_anchor"][:1]})
    assert _prep(m, impl="ring-kv").impl == "ring_kv" and _prep(m, impl="allgather-kv").impl == "allgather_kv"


def _errors_worker(rank, world_size):
    seen = []

    def expect_error(name, fn, pattern):
        seen.append(expect_value_error(name, fn, pattern, rank))

    x, m = _tensors(tk=5 + rank, seed=rank)
    # prepare-time errors: every rank raises the same message.
    bad_m = {**m, "q_anchor": m["q_anchor"][:1]} if rank == 1 else m
    expect_error("prepare: q_anchor length on rank 1", lambda: _prep(bad_m), "q_anchor must be")
    expect_error("prepare: Hq differs", lambda: _prep(m, num_heads_q=4 + 4 * rank), "Hq (num_heads_q)")
    expect_error("prepare: impl differs", lambda: _prep(m, impl="splitkv" if rank else "ring_kv"), "impl")
    # group_check is agreed at prepare time: differing, every rank raises (no hang in the first call)
    expect_error("prepare: group_check differs", lambda: _prep(m, group_check=rank == 0),
                 "group_check must be the same on every CP rank; got [True, False]")
    for impl in OPS:
        # group_check calls compare the resolved softmax_scale and the call mode across ranks
        meta = _prep(m, impl=impl, group_check=True)
        expect_error(f"{impl}: group_check softmax_scale differs",
                     lambda: OPS[impl](*x.values(), metadata=meta, softmax_scale=0.5 if rank else 0.25),
                     "softmax_scale (resolved) must be the same on every CP rank; got [0.25, 0.5]")
        expect_error(f"{impl}: group_check metadata= on rank 0 only",
                     lambda: OPS[impl](*x.values(), metadata=meta) if rank == 0
                     else OPS[impl](*x.values(), *m.values(), block_size=4),
                     "all with metadata= or all without; got ['with metadata=', 'without metadata=']")
    for impl in OPS:
        # group_check: a mismatch on rank 1 only raises the same ValueError on both ranks.
        meta = _prep(m, impl=impl, group_check=True)
        args = {**x, "k_ctx": x["k_ctx"][:2], "v_ctx": x["v_ctx"][:2]} if rank == 1 else x
        expect_error(f"{impl}: group_check k_ctx on rank 1", lambda: OPS[impl](*args.values(), metadata=meta),
                     "k_ctx.shape (2, 2, 8) does not match the metadata: expected [6, 2, 8] on CP rank 1")
        with comm_stats() as st:  # a valid call with group_check: one extra tiny verdict all-gather
            out_gc = OPS[impl](*x.values(), metadata=meta)
        assert [r.op for r in st.records].count(f"{impl}.check") == 1
        # without group_check: a mismatch on every rank raises locally before any collective, no hang.
        meta = _prep(m, impl=impl, group_check=False)
        q_bad = x["q"][:4]
        expect_error(f"{impl}: local q on every rank", lambda: OPS[impl](q_bad, *list(x.values())[1:],
                                                                          metadata=meta), "q.shape (4, 4, 8)")
        # the group is still in step: valid calls with the same metadata work.
        out = OPS[impl](*x.values(), metadata=meta)
        ref = OPS[impl](*x.values(), *m.values(), block_size=4)
        assert torch.equal(out, ref) and torch.equal(out_gc, ref)
    return seen


def test_errors_distributed_every_rank():
    seen0, seen1 = run_distributed(_errors_worker, 2, timeout=180)
    assert [s[0] for s in seen0] == [s[0] for s in seen1]
    for (name, m0), (_, m1) in zip(seen0, seen1):
        if "group_check" in name or name.startswith("prepare"):
            assert m0 == m1, f"{name}: ranks raised different messages:\n{m0}\n{m1}"


def test_index_less_cuda_device_is_the_current_one(monkeypatch):
    """prepare_splitkv_metadata(device="cuda") / bind(device="cuda"): the metadata's device is the current CUDA
    device ("cuda:<current>"), the device tensors made with "cuda" land on, so the per-call check
    (`q.device == meta.device`) accepts them (it compared cuda:0 with cuda and refused every call; found by the
    GPU head-chunk test). An explicit index stays as given; CPU is untouched."""
    monkeypatch.setattr(validation, "usable_device", lambda dev: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert validation.check_device("cuda") == torch.device("cuda", 1)
    assert validation.check_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert validation.check_device("cuda:0") == torch.device("cuda", 0)
    assert validation.check_device("cpu") == torch.device("cpu")

# ------------------------------------------------------------------ odd shapes through prepare_splitkv_metadata


def _build_x(c):
    """`_splitkv_helpers.build` plus: pos_shift (added to every position and valid anchor, a valid anchor
    kept >= 0: it then sees every negative position of its sequence), anchor_big (every positive anchor replaced),
    ctx_order ("sorted" / "reverse": each rank's context in (sequence, position) order or reversed)."""
    t = build(c)
    sh = c.get("pos_shift", 0)
    if sh:
        t["kv_pos"] = t["kv_pos"] + sh
        t["q_anchor"] = torch.where(t["q_anchor"] >= 0, (t["q_anchor"] + sh).clamp_min(0), t["q_anchor"])
    if c.get("anchor_big"):
        t["q_anchor"] = torch.where(t["q_anchor"] > 0, torch.full_like(t["q_anchor"], c["anchor_big"]),
                                    t["q_anchor"])
    if c.get("ctx_order"):
        key = t["kv_seq"] * (1 << 32) + t["kv_pos"] + (1 << 31)
        idx = []
        for i in t["ctx_idx"]:
            o = torch.argsort(key[i], stable=True)
            idx.append(i[o.flip(0) if c["ctx_order"] == "reverse" else o])
        t["ctx_idx"] = idx
    return t


def _run_x(op, c, rank, group):
    t = _build_x(c)
    x, meta, dout, dlse = local(t, c, rank)
    own = not c.get("no_own")
    kb, vb = (x["k_blk"], x["v_blk"]) if own else (None, None)
    config = SplitKVConfig(cp_ranks_per_node=c.get("rpn_env"))
    if c.get("metadata"):
        md = prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                      block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                      head_dim=c["D"], dtype=x["q"].dtype, cp_group=group, impl=op,
                                      num_chunks=c.get("num_chunks"), group_check=c.get("group_check", False),
                                      config=config)
        q = x["q"] * 1.0
        qg = splitkv_start_query_gather(q, metadata=md) if c.get("qg") else None
        out, lse = OPS[op](q, x["k_ctx"], x["v_ctx"], kb, vb, metadata=md, backend="math", return_lse=True,
                           **({"query_gather": qg} if qg is not None else {}))
    else:
        extra = {"num_chunks": c.get("num_chunks")} if op == "splitkv" else {}
        out, lse = OPS[op](x["q"], x["k_ctx"], x["v_ctx"], kb, vb, meta["q_seq"], meta["q_anchor"], meta["kv_seq"],
                           meta["kv_pos"], block_size=c["B"], cp_group=group, backend="math", return_lse=True,
                           config=config, **extra)
    loss = _loss(c, out, lse, dout, dlse)
    reps = 2 if c.get("retain") else 1  # fp32 / fp64: a retained graph's second backward adds the same grads
    for i in range(reps):
        loss.backward(retain_graph=i + 1 < reps)
    res = dict(out=out.detach().double(), lse=lse.detach().double())
    for name, key in zip(GRAD_NAMES, ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")):
        g = x[key].grad
        res[name] = torch.zeros(x[key].shape, dtype=torch.float64) if g is None else g.double() / reps
    return res


def _loss(c, out, lse, dout, dlse):
    if c.get("lse_only"):  # dout is None in the op's backward
        return (lse.double().masked_fill(~torch.isfinite(lse), 0.0) * dlse).sum()
    return loss_of(out, lse, dout, dlse)


def _reference_x(c):
    t = _build_x(c)
    own = not c.get("no_own")
    x = {k: t[k].double().clone().requires_grad_(True) for k in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")}
    out, lse = dflash_attention_reference(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"] if own else None,
                                          x["v_blk"] if own else None, t["q_seq"], t["q_anchor"], t["kv_seq"],
                                          t["kv_pos"], block_size=c["B"])
    _loss(c, out, lse, t["dout"], t["dlse"]).backward()
    ref = dict(out=out.detach(), lse=lse.detach())
    for name, key in zip(GRAD_NAMES, ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")):
        g = x[key].grad
        ref[name] = torch.zeros_like(x[key]) if g is None else g
    return t, ref


def _check_x(op, c, per_rank):
    t, ref = _reference_x(c)
    P = c["P"]
    got = {k: torch.cat([per_rank[r][k] for r in range(P)], 0) for k in ("out", "lse", "dq", "dk_blk", "dv_blk")}
    for k in ("dk_ctx", "dv_ctx"):
        full = torch.zeros((t["kv_seq"].numel(),) + tuple(per_rank[0][k].shape[1:]), dtype=torch.float64)
        for r in range(P):
            full[t["ctx_idx"][r]] = per_rank[r][k]
        got[k] = full
    errs = {}
    for k, r in ref.items():
        a = got[k]
        assert not torch.isnan(a).any(), (op, c, k)
        if k == "lse":
            fin = torch.isfinite(r)
            assert torch.equal(fin, torch.isfinite(a)), (op, c, "lse -inf pattern")
            a, r = a[fin], r[fin]
        else:
            assert torch.isfinite(a).all(), (op, c, k)
        errs[k] = rel_err(a, r)
    bad = {k: v for k, v in errs.items() if not v <= TOL[c["dtype"]]}
    assert not bad, f"{op} case {c}: errors {bad}"


def _odd_cases(seed, world):
    """Named odd shapes (deterministic layouts, random values), then seeded random ones."""
    fixed = [
        # Lk < P, empty contexts, zero blocks, num_chunks above the block count, P = 3 / 5
        case(seed, 5, seq_lens=[2], blocks=[0, 3, 0, 1, 2], ctx=[0, 1, 0, 1, 0], num_chunks=5),
        case(seed + 1, 3, seq_lens=[10], blocks=[1, 0, 4], ctx=[0, 10, 0], num_chunks=4),
        # no blocks anywhere on some ranks and no context anywhere but one
        case(seed + 2, world, seq_lens=[7, 1], blocks=[0] * (world - 1) + [2], ctx=[8] + [0] * (world - 1),
             num_chunks=3),
        # extreme and duplicated sequence ids (two sequences share id -2**31: duplicate positions)
        case(seed + 3, 3, seq_lens=[9, 5, 4], seq_ids=[-2 ** 31, -2 ** 31, 2 ** 31 - 1], blocks=[2, 1, 3],
             num_chunks=2),
        # positions at the int32 ends (the keys' extremes), anchors beyond int32
        case(seed + 4, 2, seq_lens=[6, 3], seq_ids=[2 ** 31 - 1, -2 ** 31], pos_shift=2 ** 31 - 6, full=True,
             blocks=[2, 2], num_chunks=2),
        case(seed + 5, 2, seq_lens=[6, 3], seq_ids=[-2 ** 31, 2 ** 31 - 1], pos_shift=-2 ** 31, blocks=[3, 1],
             num_chunks=3),
        case(seed + 10, 3, seq_lens=[6, 3, 4], anchor_big=2 ** 62, blocks=[1, 3, 1], num_chunks=3),
        # sorted / reverse-sorted contexts (the "already sorted" read: order None vs a permutation)
        case(seed + 6, 3, seq_lens=[13, 7, 20], ctx_order="sorted", blocks=[2, 2, 2], num_chunks=2),
        case(seed + 7, 3, seq_lens=[13, 7, 20], ctx_order="reverse", blocks=[2, 2, 2], num_chunks=2),
        # every block invalid; every anchor 0 (no context key seen anywhere)
        case(seed + 8, 4, p_invalid=1.0, blocks=[1, 2, 0, 3], num_chunks=2),
        case(seed + 9, 4, p_invalid=0.0, p_zero=1.0, blocks=[1, 2, 0, 3], num_chunks=4),
    ]
    jobs = []
    for i, c in enumerate(fixed):
        for op in ("splitkv", "allgather_kv", "ring_kv"):
            jobs.append((op, dict(c, metadata=True)))
        jobs.append(("splitkv", dict(c, metadata=False, no_own=i % 2 == 1, lse_only=i % 3 == 0)))
    rng = random.Random(seed)
    for i in range(24):
        P = rng.choice([p for p in (1, 2, 3, 4, 5, 6) if p <= world])
        lens = [rng.choice([0, 1, 2, 5, 9, 17]) for _ in range(rng.randint(1, 3))]
        if not sum(lens):
            lens[0] = 3
        kw = dict(seq_lens=lens, blocks=[rng.choice([0, 1, 2, 5]) for _ in range(P)], B=rng.choice([1, 2, 3]),
                  p_invalid=rng.choice([0.0, 0.3]), p_zero=rng.choice([0.0, 0.3]), metadata=rng.random() < 0.7,
                  num_chunks=rng.choice([None, 1, 2, 3, 4, 5, 64]), dtype=rng.choice(["float64", "float32"]),
                  lse_only=rng.random() < 0.2, no_own=rng.random() < 0.2, full=rng.random() < 0.2)
        if rng.random() < 0.5:
            cuts = sorted(rng.randint(0, sum(lens)) for _ in range(P - 1))
            kw["ctx"] = [b - a for a, b in zip([0] + cuts, cuts + [sum(lens)])]
        if rng.random() < 0.3:
            kw["seq_ids"] = [rng.choice([-2 ** 31, -7, 5, 5, 2 ** 31 - 1]) for _ in lens]
        if rng.random() < 0.3:
            kw["ctx_order"] = rng.choice(["sorted", "reverse"])
        op = rng.choice(["splitkv", "splitkv", "allgather_kv", "ring_kv"])
        if op == "splitkv" and kw["metadata"]:
            kw["qg"] = rng.random() < 0.5
            kw["retain"] = rng.random() < 0.3
            if P == world:  # the node sub-groups need a symmetric group history: whole-world jobs only
                kw["rpn_env"] = rng.choice([d for d in range(1, P + 1) if P % d == 0])
        jobs.append((op, case(seed * 1000 + i, P, **kw)))
    return jobs


def _odd_worker(rank, world, jobs):
    import torch.distributed as dist

    def one(job, group):
        return _run_x(*job, rank, dist.group.WORLD if group is None else group)

    return run_jobs(rank, world, jobs, one, case_index=1)


def test_odd_shapes_through_prepare_match_reference():
    world = 6
    seed = new_seed()
    jobs = _odd_cases(seed, world)
    res = run_distributed(_odd_worker, world, jobs, timeout=500)
    for j, (op, c) in enumerate(jobs):
        _check_x(op, c, job_results(res, j, c["P"]))
