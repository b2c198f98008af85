"""Split-KV's early query all-gather (perf-notes item 3): `splitkv_start_query_gather` + `query_gather=`.

The same layer-like computation (q from a leaf through one op, then the gather started, then k/v from
their leaves through one op each, then the op) with and without the early gather: outputs, lse and all
five gradients are BIT-identical, equal to the float64 reference, and the collectives (names, bytes) are
the same; CP sizes 1, 2, 3, 4 with uneven and zero-block ranks, num_chunks 1 and 3, with and without
own block, float64 / float32 / bf16. Backward order: the k/v path's backward runs after the op's
backward and before the gather's, while the dQ all-to-alls are still unwaited. Misuse: wrong or
modified q, reuse, discard, no metadata, wrong metadata, unconsumed handles (warning), a group where
only some ranks use it (group_check: the same ValueError on every rank). CPU, gloo.
Source: DESIGN.md section 2, arXiv 2611.05926.
"""

import gc
import warnings

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import GRAD_NAMES, build, case, check, local, loss_of, new_seed
from megatron_splitkv import comm_stats
from megatron_splitkv.ops.splitkv import SplitKVQueryGather, UnconsumedQueryGatherWarning

KEYS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")


def _prep(meta, c, group, num_chunks=None, group_check=False, impl="splitkv", dtype=None):
    return msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                        block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                        head_dim=c["D"], dtype=dtype or getattr(torch, c["dtype"]),
                                        cp_group=group, impl=impl, num_chunks=num_chunks,
                                        group_check=group_check)


def run_layer(c, rank, group, num_chunks, early, own=True, log=None):
    """A layer-like call: q = 1 * q_leaf, [start the gather], k/v = 1 * leaves, op, loss backward."""
    t = build(c)
    x, meta, dout, dlse = local(t, c, rank)
    md = _prep(meta, c, group, num_chunks)
    with comm_stats() as st:
        q = x["q"] * 1.0  # a non-leaf, like the layer's q after projection / norm / RoPE
        handle = msk.splitkv_start_query_gather(q, metadata=md) if early else None
        kv = {k: x[k] * 1.0 for k in KEYS[1:]}  # created after the start: the "k/v projections"
        if not own:
            kv["k_blk"] = kv["v_blk"] = None
        out, lse = msk.splitkv_attention(q, kv["k_ctx"], kv["v_ctx"], kv["k_blk"], kv["v_blk"], metadata=md,
                                         backend=c.get("backend", "math"), return_lse=True,
                                         **({"query_gather": handle} if early else {}))
        if log is not None and early:
            _install_order_hooks(log, handle, out, kv, q)
        loss_of(out, lse, dout, dlse).backward()
    res = dict(out=out.detach().clone(), lse=lse.detach().clone(), k=md.num_chunks,
               records=sorted((r.op, r.kind, r.bytes) for r in st.records), state=handle and handle.state)
    for name, key in zip(GRAD_NAMES, KEYS):
        g = x[key].grad
        res[name] = None if g is None else g.clone()
    return res


def _install_order_hooks(log, handle, out, kv, q):
    """Log the backward order of the op (its output's node), the k/v path, the gather and the q path; at
    the k/v path, record whether the op's dQ all-to-alls were issued and not yet waited."""
    op_node = out.grad_fn

    def pre(name):
        def hook(grad_outputs):
            entry = name
            if name == "kv":
                pend = list(handle._shared.dq)
                entry = ("kv", len(pend), all(p._work is not None for ps in pend for p in ps))
            log.append(entry)
        return hook

    op_node.register_prehook(pre("op"))
    kv["k_ctx"].grad_fn.register_prehook(pre("kv"))
    # the gather Function's node: the op node's next edge for the gathered chunks
    gather_fn = next(fn for fn, _ in op_node.next_functions if fn is not None and "QueryGather" in type(fn).__name__)
    gather_fn.register_prehook(pre("gather"))
    q.grad_fn.register_prehook(pre("q"))


def _worker(rank, world, jobs):
    import torch.distributed as dist

    sizes = sorted({c["P"] for c, *_ in jobs})
    groups = {P: dist.new_group(list(range(P))) for P in sizes if P < world}
    out = {}
    for j, (c, k, own) in enumerate(jobs):
        if rank < c["P"]:
            g = groups.get(c["P"])
            log = []
            base = run_layer(c, rank, g, k, early=False, own=own)
            early = run_layer(c, rank, g, k, early=True, own=own, log=log)
            out[j] = dict(base=base, early=early, log=log)
    return out


def _cases(seed):
    tk = 13 + 7 + 20
    return [
        case(seed, 2, dtype="float64", Hq=6, Hkv=2, blocks=[5, 3]),  # uneven, GQA
        case(seed + 1, 3, dtype="float32", blocks=[0, 4, 2], ctx=[tk - 9, 0, 9]),  # zero-block, no ctx
        case(seed + 2, 4, dtype="float64", blocks=[3, 0, 6, 2], ctx=[10, 0, 25, 5], poison=True, p_invalid=0.3),
        case(seed + 3, 2, dtype="bfloat16", B=3, Hq=4, Hkv=1, blocks=[4, 4]),
        case(seed + 4, 1, dtype="float32", blocks=[5]),
        case(seed + 5, 4, dtype="bfloat16", blocks=[0, 0, 0, 0], ctx=[tk, 0, 0, 0], p_invalid=0.0),  # no query
    ]


@pytest.fixture(scope="module")
def runs():
    seed = new_seed()
    jobs = []
    for c in _cases(seed):
        for k in (1, 3):
            jobs.append((c, k, True))
        jobs.append((c, 3, False))
    return seed, jobs, run_distributed(_worker, 4, jobs, timeout=400)


def test_early_gather_bit_identical_and_exact(runs):
    seed, jobs, results = runs
    for j, (c, k, own) in enumerate(jobs):
        per_rank = [results[r][j] for r in range(c["P"])]
        for r, res in enumerate(per_rank):
            a, b = res["base"], res["early"]
            assert a["k"] == b["k"]
            for key in ("out", "lse") + GRAD_NAMES:
                if a[key] is None:
                    assert b[key] is None, (key, c, k)
                    continue
                assert torch.equal(a[key], b[key]), f"{key} differs (case {c}, k={k}, own={own}, rank {r}, seed {seed})"
            # the same collectives: names, kinds, bytes (the gathers moved, nothing added)
            assert a["records"] == b["records"], (c, k)
            assert b["state"] == "consumed"
        if own and sum(c["blocks"]):
            check("splitkv", c, [{key: v.double() if torch.is_tensor(v) else v for key, v in res["early"].items()}
                                 for res in per_rank])


def test_backward_order_overlaps_dq_all_to_all(runs):
    """op backward -> k/v path backward (dQ all-to-alls issued, not waited) -> gather -> q path."""
    _, jobs, results = runs
    for j, (c, k, own) in enumerate(jobs):
        for r in range(c["P"]):
            log = results[r][j]["log"]
            assert log[0] == "op" and log[-1] == "q", log
            kv = [e for e in log if isinstance(e, tuple)]
            assert len(kv) == 1, log
            i_kv, i_g = log.index(kv[0]), log.index("gather")
            assert i_kv < i_g, log
            n_pending, unwaited = kv[0][1], kv[0][2]
            assert n_pending == 1, log
            if c["P"] > 1 and sum(c["blocks"]):
                assert unwaited, f"dQ all-to-all already waited when the k/v backward ran: {log}"


# ------------------------------------------------------------------------------------------------ misuse


def _misuse_worker(rank, world):
    import torch.distributed as dist

    c = case(7, 2, dtype="float32", blocks=[3, 2])
    t = build(c)
    x, meta, dout, dlse = local(t, c, rank)
    md = _prep(meta, c, None)
    msgs = {}

    def expect(name, fn, text, exc=ValueError):
        try:
            fn()
        except exc as e:  # noqa: PERF203
            assert text in str(e), (name, str(e))
            msgs[name] = str(e)
        else:
            raise AssertionError(f"{name}: no {exc.__name__}")

    def call(q, **kw):
        return msk.splitkv_attention(q, x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], backend="math", **kw)

    q = x["q"] * 1.0
    # another tensor than the one given to start (same values): local error before any collective
    h = msk.splitkv_start_query_gather(q, metadata=md)
    expect("other q", lambda: call(q.clone(), metadata=md, query_gather=h), "very tensor")
    # the handle stays usable after a rejected call
    out1 = call(q, metadata=md, query_gather=h)
    assert h.state == "consumed"
    # reuse
    expect("reuse", lambda: call(q, metadata=md, query_gather=h), "already consumed")
    # no metadata
    h2 = msk.splitkv_start_query_gather(q, metadata=md)
    expect("no metadata", lambda: call(q, query_gather=h2, q_seq=meta["q_seq"], q_anchor=meta["q_anchor"],
                                        kv_seq=meta["kv_seq"], kv_pos=meta["kv_pos"], block_size=c["B"]),
           "query_gather= needs metadata=")
    # another metadata object (prepared identically)
    md_b = _prep(meta, c, None)
    expect("other metadata", lambda: call(q, metadata=md_b, query_gather=h2), "another metadata")
    h2.discard()
    expect("discarded", lambda: call(q, metadata=md, query_gather=h2), "already discarded")
    # modified in place after the start
    q3 = x["q"].detach().clone()
    h3 = msk.splitkv_start_query_gather(q3, metadata=md)
    q3.mul_(1.0)
    expect("in place", lambda: call(q3, metadata=md, query_gather=h3), "modified in place")
    h3.discard()
    # not a handle
    expect("not a handle", lambda: call(q, metadata=md, query_gather=object()), "")
    # start: wrong shape / dtype / impl
    expect("start shape", lambda: msk.splitkv_start_query_gather(q[:4], metadata=md), "does not match the metadata")
    expect("start dtype", lambda: msk.splitkv_start_query_gather(q.double(), metadata=md), "dtype")
    md_ag = _prep(meta, c, None, impl="allgather_kv")
    expect("start impl", lambda: msk.splitkv_start_query_gather(q, metadata=md_ag), "impl='splitkv'")
    expect("start no metadata", lambda: msk.splitkv_start_query_gather(q, metadata=None), "SplitKVMetadata")
    # a handle garbage-collected unconsumed: a warning, no hang; the group stays usable afterwards
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        h4 = msk.splitkv_start_query_gather(x["q"] * 1.0, metadata=md)
        del h4
        gc.collect()
    assert any(issubclass(i.category, UnconsumedQueryGatherWarning) for i in w), [str(i.message) for i in w]
    # ... and a discarded or consumed one is silent
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        h5 = msk.splitkv_start_query_gather(x["q"] * 1.0, metadata=md)
        h5.discard()
        del h5
        gc.collect()
    assert not [i for i in w if issubclass(i.category, UnconsumedQueryGatherWarning)]
    out2 = call(q, metadata=md)
    assert torch.equal(out1, out2)
    # group_check: rank 0 starts a gather, rank 1 calls the op plainly -> both raise the same error
    mdc = _prep(meta, c, None, group_check=True)
    if rank == 0:
        expect("mixed", lambda: msk.splitkv_start_query_gather(q, metadata=mdc), "query_gather")
    else:
        expect("mixed", lambda: call(q, metadata=mdc), "query_gather")
    # group_check: rank 1 passes another q at consume -> every rank raises (then both discard)
    h6 = msk.splitkv_start_query_gather(q, metadata=mdc)
    q_other = q.clone() if rank == 1 else q
    expect("group q", lambda: call(q_other, metadata=mdc, query_gather=h6), "very tensor")
    h6.discard()
    # group_check, valid: start and call each exchange one verdict row ("splitkv.check")
    with comm_stats() as st:
        h7 = msk.splitkv_start_query_gather(q, metadata=mdc)
        out3 = call(q, metadata=mdc, query_gather=h7)
    assert [r.op for r in st.records].count("splitkv.check") == 2
    assert torch.equal(out3, out1)
    dist.barrier()
    return msgs


def test_misuse_errors():
    res = run_distributed(_misuse_worker, 2, timeout=240)
    # the same verdict on both ranks (prefixed by the function each rank was in)
    assert res[0]["mixed"].split(": ", 1)[1] == res[1]["mixed"].split(": ", 1)[1]
    assert res[0]["mixed"].startswith("splitkv_start_query_gather: ") and res[1]["mixed"].startswith("splitkv: ")
    assert "['splitkv_start_query_gather', 'with metadata=']" in res[0]["mixed"]
    assert res[0]["group q"] == res[1]["group q"]


def test_handle_repr_and_single_process():
    """CP size 1 without a process group: the gather is a no-op wrapper, results identical."""
    c = case(11, 1, dtype="float64", blocks=[4])
    t = build(c)
    x, meta, dout, dlse = local(t, c, 0)
    md = _prep(meta, c, None)
    q = x["q"] * 1.0
    h = msk.splitkv_start_query_gather(q, metadata=md)
    assert isinstance(h, SplitKVQueryGather) and h.pending and "pending" in repr(h)
    out = msk.splitkv_attention(q, x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], metadata=md, query_gather=h,
                                backend="math")
    ref = msk.splitkv_attention(q, x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], metadata=md, backend="math")
    assert torch.equal(out, ref) and not h.pending
    (g1,) = torch.autograd.grad(out.sum(), x["q"], retain_graph=True)
    (g2,) = torch.autograd.grad(ref.sum(), x["q"])
    assert torch.equal(g1, g2)


def test_no_reference_cycles():
    """Outputs, the merged O and the gathered queries are freed by reference counting alone (no cycle
    through the autograd graph): plain call and early gather, bf16 and fp32 (where the returned output
    is the merged O itself), with and without backward, and an unconsumed dropped handle."""
    import weakref

    c = case(5, 1, dtype="float32", blocks=[3])
    gc.collect()
    gc.disable()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for early in (False, True):
                for backward in (False, True):
                    t = build(c)
                    x, meta, dout, dlse = local(t, c, 0)
                    x = {k: v.detach().to(dtype).requires_grad_(True) for k, v in x.items()}
                    md = _prep(meta, c, None, dtype=dtype)
                    q = x["q"] * 1
                    h = msk.splitkv_start_query_gather(q, metadata=md) if early else None
                    out = msk.splitkv_attention(q, x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], metadata=md,
                                                backend="math", query_gather=h)
                    freed = []
                    weakref.finalize(out.untyped_storage(), freed.append, "out")
                    if early:
                        weakref.finalize(h._shared, freed.append, "shared")
                    if backward:
                        out.float().sum().backward()
                    del out, q, h
                    assert "out" in freed and (not early or "shared" in freed), (dtype, early, backward, freed)
        # an unconsumed handle dropped: everything it started is freed (after the warning)
        t = build(c)
        x, meta, _, _ = local(t, c, 0)
        md = _prep(meta, c, None)
        freed = []
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            h = msk.splitkv_start_query_gather(x["q"] * 1, metadata=md)
            weakref.finalize(h._shared, freed.append, "shared")
            weakref.finalize(h._gathered[0].untyped_storage(), freed.append, "gathered")
            del h
        assert set(freed) == {"shared", "gathered"}, freed
    finally:
        gc.enable()
