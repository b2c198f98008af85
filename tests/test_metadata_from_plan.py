"""Split-KV metadata built on the host from the plan (`prepare_splitkv_metadata_from_plan` + `bind`).

For P = 1, 2, 3, 4 (gloo, CPU; one spawn of 4 processes, subgroups for P < 4), uneven and empty shards
(fewer context tokens than ranks, padding blocks with anchor -1, several sequences, an empty sequence, no
query block at all), num_chunks 1 and 2, cp_ranks_per_node 1 and 2 (P = 4), the plan's context order and
a shuffled one (kv_seq / kv_pos given): every field and tensor of the bound metadata equals
`prepare_splitkv_metadata`'s on the same rank (bit for bit, dtype, shape, device; the metadata also went
through pickle, as from a data-loader worker), `bind` issues no collective, and `splitkv_attention(...,
metadata=bound)` forward + backward equals the call with the collective metadata bit for bit and the
single-process float64 reference. Bad inputs raise ValueError naming the argument. Source: DESIGN.md
sections 2-3.
"""

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import GRAD_NAMES, TOL, loss_of, new_seed, rel_err
from megatron_splitkv import SplitKVConfig, comm_stats, dflash_attention_reference, splitkv_attention
from megatron_splitkv.kernels.base import IntervalMask
from megatron_splitkv.ops import SplitKVMetadata, prepare_splitkv_metadata, prepare_splitkv_metadata_from_plan
from megatron_splitkv.ops.packing import pack, remapped, unique_tensors, unpacked
from megatron_splitkv.planning import plan_context_parallel

KEYS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")
HQ, HKV, D = 4, 2, 8


def mk(name, P, seq_lens, anchors, *, B=4, strategy="lpt", chunk_size=4, k=1, L=None, shuffle=False, axis=None):
    return dict(name=name, P=P, seq_lens=seq_lens, anchors=anchors, B=B, strategy=strategy,
                chunk_size=chunk_size, k=k, L=L, shuffle=shuffle, axis=axis)


LENS3 = [13, 7, 20]
ANC3 = [[0, 3, 5, 11], [2], [1, 10, 18]]  # 8 blocks: padded to 9 at P = 3

CASES = [
    mk("P1 k1", 1, LENS3, ANC3),
    mk("P1 k2 shuffled", 1, LENS3, ANC3, k=2, shuffle=True),
    mk("P2 lpt k1", 2, LENS3, ANC3),
    mk("P2 lpt k2 B3", 2, [9, 30], [[0, 4, 7], [0, 5, 9, 28]], B=3, k=2),
    mk("P3 zigzag k2 padded, empty sequence", 3, [5, 9, 0, 12], [[1, 3], [0, 7], [], [4, 6, 10]],
       strategy="zigzag", k=2),
    mk("P3 contiguous uneven shuffled", 3, [10, 1], [[0, 2, 8], []], strategy="contiguous", shuffle=True),
    mk("P4 fewer tokens than ranks k1", 4, [2], [[0]], strategy="contiguous"),
    mk("P4 fewer tokens than ranks k2 L2", 4, [2, 1], [[0], []], strategy="contiguous", k=2, L=2),
    mk("P4 lpt k2 L2", 4, LENS3 + [25], ANC3 + [[0, 1, 2, 12, 23]], k=2, L=2),
    mk("P4 lpt k1 L2 shuffled", 4, LENS3, ANC3, L=2, shuffle=True),
    mk("P4 lpt k2 L1", 4, LENS3, ANC3, k=2, L=1),
    mk("P4 no query blocks", 4, [6, 3], [[], []], strategy="zigzag", k=2, L=2),
    # head chunks (ops/chunking.py `HeadChunks`): every chunk all rows, Hkv = 2 kv heads (k = 3 clamps to 2)
    mk("P2 heads k2 shuffled", 2, LENS3, ANC3, k=2, shuffle=True, axis="heads"),
    mk("P4 heads k3 L2", 4, LENS3 + [25], ANC3 + [[0, 1, 2, 12, 23]], k=3, L=2, axis="heads"),
]


def make_plan(c):
    anchors = [np.array(a, dtype=np.int64) for a in c["anchors"]]
    kw = {"chunk_size": c["chunk_size"]} if c["strategy"] in ("lpt", "hypergraph") else {}
    return plan_context_parallel(c["seq_lens"], anchors, block_size=c["B"], cp_size=c["P"],
                                 strategy=c["strategy"], **kw)


def global_inputs(c, plan, seed):
    g = torch.Generator().manual_seed(seed)
    nq, T = plan.q_seq.shape[0] * c["B"], plan.num_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return dict(q=rnd(nq, HQ, D), k_ctx=rnd(T, HKV, D), v_ctx=rnd(T, HKV, D), k_blk=rnd(nq, HKV, D),
                v_blk=rnd(nq, HKV, D), dout=rnd(nq, HQ, D), dlse=rnd(nq, HQ))


def local_context(c, plan, rank, seed):
    """(token index, kv_seq, kv_pos) of `rank`: the plan's order, or shuffled with c["shuffle"]."""
    idx = plan.token_index(rank)
    seq, pos = plan.token_seq_ids(rank), plan.token_positions(rank)
    if c["shuffle"]:
        perm = np.random.default_rng(seed + rank).permutation(idx.shape[0])
        idx, seq, pos = idx[perm], seq[perm], pos[perm]
    return idx, seq, pos


# ----------------------------------------------------------------------------- comparison


def _tensor_diff(a, b):
    if a is None or b is None:
        return a is not b
    return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device and torch.equal(a, b))


def _mask_diff(a, b):
    if a is None or b is None:
        return a is not b
    if (a.block_size, a.num_keys, a.num_ctx_keys) != (b.block_size, b.num_keys, b.num_ctx_keys):
        return True
    return any(_tensor_diff(getattr(a, n), getattr(b, n))
               for n in ("lo", "hi", "lo2", "hi2", "row_lo", "row_lo2", "row_hi2"))


def _group_diff(a, b):
    return (a.size, a.rank) != (b.size, b.rank) or a.pg is not b.pg


def meta_diff(a: SplitKVMetadata, b: SplitKVMetadata) -> list:
    """Names of the fields of two metadata objects that differ (every dataclass field; `sources` is the
    caller's tensors of prepare, () in the plan path, and is skipped)."""
    bad = []
    for f in dataclasses.fields(SplitKVMetadata):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "sources":
            continue
        if f.name == "group":
            diff = _group_diff(x, y)
        elif f.name == "node_groups":
            diff = (x is None) != (y is None) or (x is not None and (
                len(x) != len(y) or any(_group_diff(u, v) for u, v in zip(x, y))))
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            diff = _tensor_diff(x, y)
        elif isinstance(x, IntervalMask) or isinstance(y, IntervalMask):
            diff = _mask_diff(x, y)
        elif f.name in ("step_masks", "chunk_masks", "chunk_masks_own"):
            diff = (x is None) != (y is None) or (x is not None and (
                len(x) != len(y) or any(_mask_diff(u, v) for u, v in zip(x, y))))
        else:
            diff = type(x) is not type(y) or x != y
        if diff:
            bad.append(f.name)
    return bad


# ----------------------------------------------------------------------------- the distributed run


def run_op(meta, x, dout, dlse, backend="math"):
    x = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    out, lse = splitkv_attention(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], metadata=meta,
                                 backend=backend, return_lse=True)
    loss_of(out, lse, dout, dlse).backward()
    res = dict(out=out.detach(), lse=lse.detach())
    res.update({n: x[k].grad for n, k in zip(GRAD_NAMES, KEYS)})
    return res


def worker(rank, world_size, cases, seed):
    import torch.distributed as dist

    groups = {P: dist.new_group(list(range(P))) for P in sorted({c["P"] for c in cases}) if P < world_size}
    out = {}
    for j, c in enumerate(cases):
        if rank >= c["P"]:
            continue
        group = groups.get(c["P"])
        plan = make_plan(c)
        B, sl = c["B"], plan.query_slice(rank)
        idx, kv_seq, kv_pos = local_context(c, plan, rank, seed)
        over = dict(kv_seq=kv_seq, kv_pos=kv_pos) if c["shuffle"] else {}
        host = prepare_splitkv_metadata_from_plan(plan, rank, block_size=B, num_heads_q=HQ, num_heads_kv=HKV,
                                                  head_dim=D, dtype=torch.float64, num_chunks=c["k"],
                                                  cp_ranks_per_node=c["L"], chunk_axis=c.get("axis"), **over)
        assert not host.bound
        host = pickle.loads(pickle.dumps(host))  # as from a data-loader worker process
        with comm_stats() as stats:
            bound = host.bind(group, "cpu")
        bind_records = len(stats.records)
        coll = prepare_splitkv_metadata(torch.from_numpy(plan.q_seq[sl].copy()),
                                        torch.from_numpy(plan.q_anchor[sl].copy()), torch.from_numpy(kv_seq),
                                        torch.from_numpy(kv_pos), block_size=B, num_heads_q=HQ, num_heads_kv=HKV,
                                        head_dim=D, dtype=torch.float64, cp_group=group, num_chunks=c["k"],
                                        cp_ranks_per_node=c["L"], chunk_axis=c.get("axis"))
        t = global_inputs(c, plan, seed + j)
        rows = slice(sl.start * B, sl.stop * B)
        x = dict(q=t["q"][rows], k_ctx=t["k_ctx"][idx], v_ctx=t["v_ctx"][idx], k_blk=t["k_blk"][rows],
                 v_blk=t["v_blk"][rows])
        res_plan = run_op(bound, x, t["dout"][rows], t["dlse"][rows])
        res_coll = run_op(coll, x, t["dout"][rows], t["dlse"][rows])
        # the FlexAttention BlockMasks built on the host (flex's CPU emulation reads the block tables)
        host_f = prepare_splitkv_metadata_from_plan(plan, rank, block_size=B, num_heads_q=HQ, num_heads_kv=HKV,
                                                    head_dim=D, dtype=torch.float64, num_chunks=c["k"],
                                                    cp_ranks_per_node=c["L"], chunk_axis=c.get("axis"),
                                                    flex_block_masks=True, **over)
        bound_f = pickle.loads(pickle.dumps(host_f)).bind(group, "cpu")
        cached = [dict(m.__dict__.get("_flex_block_masks", {})) for m in bound_f.chunk_masks_own]
        flex_diff = block_mask_diff(bound_f, coll)
        res_flex = run_op(bound_f, x, t["dout"][rows], t["dlse"][rows], backend="flex")
        res_flex_coll = run_op(coll, x, t["dout"][rows], t["dlse"][rows], backend="flex")
        rebuilt = [m.__dict__.get("_flex_block_masks", {}) != before
                   for m, before in zip(bound_f.chunk_masks_own, cached)]
        out[j] = dict(diff=meta_diff(bound, coll), bind_records=bind_records, idx=idx, plan=res_plan,
                      coll=res_coll, num_chunks=bound.num_chunks, L=bound.cp_ranks_per_node,
                      has_order=bound.order is not None, nb=bound.n_blocks[rank], nk=bound.tk_local,
                      node_groups=bound.node_groups is not None, flex=res_flex, flex_coll=res_flex_coll,
                      flex_diff=flex_diff, flex_rebuilt=rebuilt, flex_cached=[len(d) for d in cached],
                      diff_f=meta_diff(bound_f, coll))
    return out


def block_mask_diff(meta, ref_meta) -> list:
    """For every chunk c: what differs between the BlockMask cached on meta.chunk_masks_own[c] (from the
    host tables) and `kernels.flex.build_block_mask` of ref_meta's mask at the same lengths (what the
    kernel builds on the device): "missing" when a mask with rows and keys has none cached, "tables" /
    "lengths" / "mask_mod" (evaluated densely) when they differ; [] when all equal."""
    from megatron_splitkv.kernels import flex

    bad = []
    for c, (m, r) in enumerate(zip(meta.chunk_masks_own, ref_meta.chunk_masks_own)):
        cache = m.__dict__.get("_flex_block_masks", {})
        if m.num_blocks * m.block_size == 0 or m.num_keys == 0:
            if cache:
                bad.append((c, "unexpected"))
            continue
        want = flex.padded_lengths(m.num_blocks * m.block_size, m.num_keys)
        if list(cache) != [want]:
            bad.append((c, "missing"))
            continue
        got, ref = cache[want], flex.build_block_mask(r, *want)
        if got.seq_lengths != ref.seq_lengths or got.BLOCK_SIZE != ref.BLOCK_SIZE:
            bad.append((c, "lengths"))
        names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices")
        if any(_tensor_diff(getattr(got, n), getattr(ref, n)) or getattr(got, n).stride() != getattr(ref, n).stride()
               for n in names):
            bad.append((c, "tables"))
        qi, ki = torch.arange(want[0])[:, None], torch.arange(want[1])[None, :]
        if not torch.equal(got.mask_mod(0, 0, qi, ki), ref.mask_mod(0, 0, qi, ki)):
            bad.append((c, "mask_mod"))
    return bad


@pytest.fixture(scope="module")
def plan_run():
    seed = new_seed()
    return seed, run_distributed(worker, 4, CASES, seed, timeout=600)


def reference(c, plan, t):
    x = {k: t[k].clone().requires_grad_(True) for k in KEYS}
    q_seq = torch.from_numpy(np.where(plan.q_anchor >= 0, plan.q_seq, 0))
    out, lse = dflash_attention_reference(
        x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], q_seq, torch.from_numpy(plan.q_anchor),
        torch.from_numpy(_all_seq(plan)),
        torch.from_numpy(_all_pos(plan)), block_size=c["B"])
    loss_of(out, lse, t["dout"], t["dlse"]).backward()
    ref = dict(out=out.detach(), lse=lse.detach())
    ref.update({n: x[k].grad for n, k in zip(GRAD_NAMES, KEYS)})
    return ref


def _all_seq(plan):  # per packed token: its sequence id
    return np.repeat(np.arange(plan.seq_lens.shape[0], dtype=np.int64), plan.seq_lens)


def _all_pos(plan):
    return np.arange(plan.num_tokens, dtype=np.int64) - np.repeat(plan.seq_offsets[:-1], plan.seq_lens)


@pytest.mark.parametrize("j", range(len(CASES)), ids=[c["name"] for c in CASES])
def test_bound_metadata_equals_prepare(plan_run, j):
    seed, results = plan_run
    c = CASES[j]
    for r in range(c["P"]):
        res = results[r][j]
        assert res["diff"] == [], f"{c['name']} rank {r} (seed {seed}): fields differ from prepare: {res['diff']}"
        assert res["bind_records"] == 0, f"{c['name']} rank {r}: bind issued {res['bind_records']} collectives"
        limit = HKV if c.get("axis") == "heads" else max(res["nb"], 1)  # head chunks clamp to Hkv
        assert res["num_chunks"] == min(c["k"], limit) and res["L"] == (c["L"] or 1)
        assert res["has_order"] == (c["shuffle"] and res["nk"] > 1 and
                                    bool((np.diff(_all_keys(c, res)) < 0).any()))
        assert res["node_groups"] == (c["L"] == 2 and c["P"] == 4)


def _all_keys(c, res):
    plan = make_plan(c)
    seq, pos = _all_seq(plan)[res["idx"]], _all_pos(plan)[res["idx"]]
    return seq * (1 << 32) + pos


@pytest.mark.parametrize("j", range(len(CASES)), ids=[c["name"] for c in CASES])
def test_host_built_flex_block_masks(plan_run, j):
    """flex_block_masks=True: the BlockMasks cached at bind equal the device builder's (tables, lengths,
    mask_mod), the flex kernel uses them (no new build during forward + backward) and the op's results
    equal the collective metadata's bit for bit."""
    seed, results = plan_run
    c = CASES[j]
    for r in range(c["P"]):
        res = results[r][j]
        assert res["diff_f"] == [], f"{c['name']} rank {r}: fields differ with flex_block_masks: {res['diff_f']}"
        assert res["flex_diff"] == [], f"{c['name']} rank {r} (seed {seed}): BlockMask differs: {res['flex_diff']}"
        assert not any(res["flex_rebuilt"]), f"{c['name']} rank {r}: the kernel built a BlockMask itself"
        if res["nb"] and c["P"] == 1:
            assert res["flex_cached"] == [1] * res["num_chunks"]
        for k in res["flex"]:
            assert torch.equal(res["flex"][k], res["flex_coll"][k]), f"{c['name']} rank {r}: flex {k} differs"
    if any(results[r][j]["nb"] for r in range(c["P"])):  # some rank holds query rows: masks were built
        assert any(sum(results[r][j]["flex_cached"]) for r in range(c["P"]))


@pytest.mark.parametrize("j", range(len(CASES)), ids=[c["name"] for c in CASES])
def test_op_with_bound_metadata_exact(plan_run, j):
    seed, results = plan_run
    c = CASES[j]
    plan = make_plan(c)
    t = global_inputs(c, plan, seed + j)
    for r in range(c["P"]):
        a, b = results[r][j]["plan"], results[r][j]["coll"]
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), \
                f"{c['name']} rank {r} (seed {seed}): {k} differs from the collective metadata's call"
    ref = reference(c, plan, t)
    got = {k: torch.cat([results[r][j]["plan"][k] for r in range(c["P"])]) for k in ("out", "lse", "dq", "dk_blk",
                                                                                       "dv_blk")}
    for k in ("dk_ctx", "dv_ctx"):
        full = torch.zeros_like(ref[k])
        for r in range(c["P"]):
            full[torch.from_numpy(results[r][j]["idx"])] = results[r][j]["plan"][k]
        got[k] = full
    fin = torch.isfinite(ref["lse"])
    assert torch.equal(fin, torch.isfinite(got["lse"])), f"{c['name']}: lse -inf pattern differs"
    errs = {k: rel_err(got[k][fin] if k == "lse" else got[k], ref[k][fin] if k == "lse" else ref[k]) for k in ref}
    bad = {k: v for k, v in errs.items() if not v <= TOL["float64"]}
    assert not bad, f"{c['name']} (seed {seed}): errors vs the float64 reference {bad}"


# ----------------------------------------------------------------------------- single process


def _plan(P=2, B=4):
    return plan_context_parallel(LENS3, [np.array(a) for a in ANC3], block_size=B, cp_size=P, chunk_size=4)


def _build(plan=None, rank=0, **kw):
    args = dict(block_size=4, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D, dtype=torch.float32)
    args.update(kw)
    return prepare_splitkv_metadata_from_plan(_plan() if plan is None else plan, rank, **args)


def test_meta_diff_detects_differences():
    """The comparison of the distributed test is not vacuous: a changed tensor value, dtype, mask, count
    or a missing order is reported."""
    plan = _plan(P=1)
    a = _build(plan).bind(None, "cpu")
    assert meta_diff(a, _build(plan).bind(None, "cpu")) == []
    changes = {
        "kv_pos": lambda m: dataclasses.replace(m, kv_pos=m.kv_pos + (m.kv_pos == m.kv_pos.max())),
        "valid": lambda m: dataclasses.replace(m, valid=m.valid.to(torch.int64)),
        "order": lambda m: dataclasses.replace(m, order=torch.arange(m.tk_local)),
        "num_chunks": lambda m: dataclasses.replace(m, num_chunks=2),
        "n_ctx": lambda m: dataclasses.replace(m, n_ctx=[m.n_ctx[0] + 1]),
        "chunk_masks_own": lambda m: dataclasses.replace(m, chunk_masks_own=[dataclasses.replace(
            m.chunk_masks_own[0], hi2=m.chunk_masks_own[0].hi2.flip(0))]),
        "block_meta": lambda m: dataclasses.replace(m, block_meta=m.block_meta[:, [1, 0]]),
    }
    for name, change in changes.items():
        assert meta_diff(change(a), a) == [name], name


def test_single_process_matches_prepare_and_packed_upload_layout():
    """P = 1 without torch.distributed: bind(None) equals prepare's metadata; the packed layout that bind
    uploads (`ops.packing.pack` / `unpacked`, here on CPU) reproduces every tensor, with shared tensors shared."""
    plan = _plan(P=1)
    for k in (1, 2, 3):
        host = _build(plan, num_chunks=k)
        bound = host.bind(None, "cpu")
        sl = plan.query_slice(0)
        ref = prepare_splitkv_metadata(torch.from_numpy(plan.q_seq[sl].copy()),
                                       torch.from_numpy(plan.q_anchor[sl].copy()),
                                       torch.from_numpy(plan.token_seq_ids(0)),
                                       torch.from_numpy(plan.token_positions(0)),
                                       block_size=4, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D,
                                       dtype=torch.float32, num_chunks=k)
        assert meta_diff(bound, ref) == []
        tensors = unique_tensors(host)
        # q_seq q_anchor kv_seq kv_pos valid keys block_meta valid_rows + lo hi lo2 hi2 per chunk (lo / hi shared)
        assert len(tensors) == 8 + 4 * k
        buf, offs = pack(tensors, pin=False)
        assert all(o % 16 == 0 for o in offs) and buf.dtype == torch.uint8
        packed = remapped(host, {id(t): unpacked(buf, o, t) for t, o in zip(tensors, offs)}, host_build=None,
                              group=bound.group)
        assert meta_diff(packed, bound) == []
        assert all(p.lo is q.lo for p, q in zip(packed.chunk_masks, packed.chunk_masks_own))
        assert all(t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                   for t in unique_tensors(packed))


def test_unbound_metadata_refused_by_the_op():
    host = _build(_plan(P=1))
    x = {k: torch.randn(n, h, D) for k, n, h in (("q", host.tq_local, HQ), ("k_ctx", host.tk_local, HKV),
                                                  ("v_ctx", host.tk_local, HKV), ("k_blk", host.tq_local, HKV),
                                                  ("v_blk", host.tq_local, HKV))}
    with pytest.raises(ValueError, match="not bound to a CP group yet.*bind"):
        splitkv_attention(*x.values(), metadata=host, backend="math")
    from megatron_splitkv.ops import splitkv_start_query_gather
    with pytest.raises(ValueError, match="not bound to a CP group yet"):
        splitkv_start_query_gather(x["q"], metadata=host)
    bound = host.bind(None, "cpu")
    splitkv_attention(*x.values(), metadata=bound, backend="math")  # and the bound one runs
    with pytest.raises(ValueError, match="SplitKVMetadata.bind: .*already bound"):
        bound.bind(None, "cpu")
    assert not host.bound and bound.bound  # bind returns a new object; the host metadata stays re-bindable


BAD = [
    (dict(rank=2), r"cp_rank must be an int in \[0, 2\)"),
    (dict(rank=-1), "cp_rank must be an int"),
    (dict(rank=True), "cp_rank must be an int"),
    (dict(rank=0.0), "cp_rank must be an int"),
    (dict(plan="no plan"), "plan must be a megatron_splitkv.planning.Plan"),
    (dict(block_size=8), "block_size=8 differs from the plan's block_size=4"),
    (dict(block_size=0), "block_size must be a positive int"),
    (dict(block_size=4.0), "block_size must be a positive int"),
    (dict(num_heads_q=0), "num_heads_q must be a positive int"),
    (dict(num_heads_kv=True), "num_heads_kv must be a positive int"),
    (dict(head_dim="8"), "head_dim must be a positive int"),
    (dict(num_heads_q=3), r"Hq % Hkv != 0: num_heads_q=3, num_heads_kv=2"),
    (dict(dtype=torch.int32), "dtype must be one of"),
    (dict(dtype="bf16"), "dtype must be one of"),
    (dict(impl="nope"), "impl must be one of"),
    (dict(impl="ring-kv"), "impl='ring-kv': only 'splitkv'"),
    (dict(num_chunks=0), "num_chunks must be None or a positive int"),
    (dict(cp_ranks_per_node=3), "cp_ranks_per_node=3 must divide the CP group size P=2"),
    (dict(device="meta"), "device=meta cannot hold the metadata"),
    (dict(device="nodevice"), "device must be a torch.device"),
    (dict(kv_seq=np.zeros(3, np.int64)), "kv_seq and kv_pos must both be given"),
    (dict(kv_seq=np.zeros(3, np.int64), kv_pos=np.zeros(3, np.int64)), "kv_seq must have length"),
    (dict(kv_seq=torch.zeros(3), kv_pos=torch.zeros(3)), "kv_seq must have a signed integer dtype"),
    (dict(kv_seq=np.zeros(3, np.uint64), kv_pos=np.zeros(3, np.int64)), "kv_seq must be a 1-D signed integer"),
    (dict(kv_seq=[0, 0], kv_pos=[0, 1]), "kv_seq must be a 1-D integer tensor"),
]


@pytest.mark.parametrize("kw,pattern", BAD, ids=[p for _, p in BAD])
def test_bad_arguments_raise_naming_the_argument(kw, pattern):
    kw = dict(kw)
    plan = kw.pop("plan", None)
    rank = kw.pop("rank", 0)
    with pytest.raises(ValueError, match="^prepare_splitkv_metadata_from_plan: " + pattern):
        _build(plan, rank, **kw)


def test_range_check_and_config():
    plan = _plan(P=1)
    n = plan.num_tokens
    big = np.full(n, 1 << 31, dtype=np.int64)
    with pytest.raises(ValueError, match=r"kv_pos values must lie in \[-2\*\*31, 2\*\*31\)"):
        _build(plan, kv_seq=plan.token_seq_ids(0), kv_pos=big)
    # num_chunks from the config: fixed at build time, carried to bind
    config = SplitKVConfig(num_chunks=2)
    host = _build(plan, config=config)
    assert host.num_chunks == 2 and host.num_chunks_requested == 2 and host.config == config
    bound = host.bind(None, "cpu")
    assert bound.num_chunks == 2 and bound.config == config
    assert _build(plan, num_chunks=3, config=config).config.num_chunks == 3  # the argument overrides the field
    with pytest.raises(ValueError, match="from_plan: config must be None or a SplitKVConfig, got dict"):
        _build(plan, config={"num_chunks": 2})


def _bind_errors_worker(rank, world_size):
    out = {}

    def expect(name, fn):
        try:
            fn()
        except ValueError as exc:
            out[name] = str(exc)
        else:
            out[name] = None

    plan2, plan3 = _plan(P=2), _plan(P=3)
    expect("size", lambda: _build(plan3, rank).bind(None, "cpu"))
    expect("rank", lambda: _build(plan2, 1 - rank).bind(None, "cpu"))
    expect("device", lambda: _build(plan2, rank).bind(None, "meta"))
    expect("ok", lambda: _build(plan2, rank).bind(None))  # gloo: the default device is the CPU
    return out


def test_bind_errors_distributed():
    """bind checks the group against the plan on each rank (no collective: the ranks do not wait for
    each other)."""
    for rank, out in enumerate(run_distributed(_bind_errors_worker, 2, timeout=300)):
        assert out["size"] == ("SplitKVMetadata.bind: cp_group has size 2 but the metadata was built for a "
                               "plan with cp_size=3")
        assert out["rank"] == (f"SplitKVMetadata.bind: this process is rank {rank} of cp_group but the metadata "
                               f"was built for cp_rank={1 - rank}")
        assert out["device"].startswith("SplitKVMetadata.bind: device=meta cannot hold the metadata")
        assert out["ok"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and CUDA upload need a GPU")
def test_pin_memory_and_cuda_bind():
    plan = _plan(P=1)
    host = _build(plan, num_chunks=2)
    pinned = host.pin_memory()
    assert pinned.host_build.buffer.is_pinned() and pinned.pin_memory() is pinned
    dev = torch.device("cuda", torch.cuda.current_device())
    for h in (host, pinned):
        bound = h.bind(None, dev)
        assert bound.device == dev and bound.q_seq.device == dev
        assert meta_diff(bound, host.bind(None, "cpu")) == [
            n for n in ("device", "q_seq", "q_anchor", "kv_seq", "kv_pos", "valid", "keys", "block_meta",
                        "valid_rows", "chunk_masks", "chunk_masks_own")]
        for n in md_tensor_fields(bound):
            assert torch.equal(getattr(bound, n).cpu(), getattr(host, n))


def md_tensor_fields(meta):
    return [n for n in ("q_seq", "q_anchor", "kv_seq", "kv_pos", "valid", "keys", "block_meta", "valid_rows")
            if getattr(meta, n) is not None]


def test_flex_tables_larger_plan_match_device_builder():
    """Many tiles (B = 16, ~1.1K context tokens, P = 1 and 3, k = 1 and 2): the host-built tables equal
    `build_block_mask` of the same mask (which part 1's tests show equals prepare's), for every rank."""
    rng = np.random.default_rng(0)
    lens = [300, 700, 90, 45]
    anchors = [np.sort(rng.choice(n - 1, size=min(n - 1, 12), replace=False)) for n in lens]
    for P in (1, 3):
        plan = plan_context_parallel(lens, anchors, block_size=16, cp_size=P, chunk_size=64)
        for k in (1, 2):
            for r in range(P):
                host = prepare_splitkv_metadata_from_plan(plan, r, block_size=16, num_heads_q=HQ, num_heads_kv=HKV,
                                                          head_dim=D, dtype=torch.bfloat16, num_chunks=k,
                                                          flex_block_masks=True)
                # the tables are built at bind; compare on a copy bound as if P were 1 (no group needed)
                fake = dataclasses.replace(host, host_build=None)
                ts = unique_tensors(fake)
                bound = remapped(fake, {id(t): t for t in ts}, block_masks=True)
                assert block_mask_diff(bound, host) == [], (P, k, r)
                assert all(len(m.__dict__["_flex_host_tables"]) == 1 for m in host.chunk_masks_own)
                assert not any(m.__dict__.get("_flex_block_masks") for m in host.chunk_masks_own)  # host: tables only


def test_flex_block_masks_single_process_op():
    """P = 1 with a larger plan: the op through the flex kernel with host-built BlockMasks (bind(None))
    equals the call with prepare's metadata bit for bit, without building a BlockMask in the kernel."""
    from megatron_splitkv.kernels import flex

    rng = np.random.default_rng(1)
    lens = [300, 200]
    anchors = [np.sort(rng.choice(n - 1, size=10, replace=False)) for n in lens]
    plan = plan_context_parallel(lens, anchors, block_size=16, cp_size=1, chunk_size=64)
    host = prepare_splitkv_metadata_from_plan(plan, 0, block_size=16, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D,
                                              dtype=torch.float32, num_chunks=2, flex_block_masks=True)
    bound = pickle.loads(pickle.dumps(host)).bind(None, "cpu")
    ref = prepare_splitkv_metadata(torch.from_numpy(plan.q_seq.copy()), torch.from_numpy(plan.q_anchor.copy()),
                                   torch.from_numpy(plan.token_seq_ids(0)), torch.from_numpy(plan.token_positions(0)),
                                   block_size=16, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D, dtype=torch.float32,
                                   num_chunks=2)
    assert meta_diff(bound, ref) == [] and block_mask_diff(bound, ref) == []
    g = torch.Generator().manual_seed(0)
    nq, T = bound.tq_local, bound.tk_local
    x = {k: torch.randn(n, h, D, generator=g) for k, n, h in (("q", nq, HQ), ("k_ctx", T, HKV), ("v_ctx", T, HKV),
                                                               ("k_blk", nq, HKV), ("v_blk", nq, HKV))}
    dout, dlse = torch.randn(nq, HQ, D, generator=g, dtype=torch.float64), torch.randn(nq, HQ, generator=g,
                                                                                        dtype=torch.float64)
    builds = []
    orig = flex.build_block_mask
    flex.build_block_mask = lambda *a, **k: builds.append(1) or orig(*a, **k)
    try:
        a = run_op(bound, x, dout, dlse, backend="flex")
        assert builds == []  # every BlockMask came from the host tables
        b = run_op(ref, x, dout, dlse, backend="flex")
        assert len(builds) == 2  # the collective metadata's masks: built by the kernel, one per chunk
    finally:
        flex.build_block_mask = orig
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("bad", ["cp", 3, object()])
def test_bind_rejects_a_cp_group_that_is_not_a_process_group(bad):
    """`SplitKVMetadata.bind(cp_group=<not a ProcessGroup>)` raised a bare AttributeError / TypeError from
    torch.distributed; its contract is a ValueError prefixed "SplitKVMetadata.bind" naming cp_group."""
    plan = plan_context_parallel([13], [np.array([0, 3])], block_size=4, cp_size=1, chunk_size=4)
    meta = prepare_splitkv_metadata_from_plan(plan, 0, block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                              dtype=torch.float32)
    with pytest.raises(ValueError, match=r"SplitKVMetadata\.bind: cp_group"):
        meta.bind(bad, "cpu")
    assert meta.bind(None, "cpu").bound  # still bindable
