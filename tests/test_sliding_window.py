"""Sliding-window and causal drafter layers (issue 23 item 1): the mask against z-lab's dflash 0.1.0 itself
(`dflash.model._attention_mask`, the inference code's own mask), the three CP ops' out, lse and all five
gradients against the float64 reference at CP 1, 2, 3, 4, 8 (gloo, CPU; math, flex and the fa4 wrapper on an
emulated FA4; plain and metadata= calls, host-built metadata from the plan, metadata derived per layer type),
edge windows (W = 1, = the block size, beyond every sequence, with a rank holding neither blocks nor keys,
every block on one rank, NaN / inf where no query looks, anchors at 0; CP 1-3), the per-rank key intervals
against the dense mask (a window narrows the blocks each rank computes), and bad
windows (ValueError naming window, on every rank)."""

import random

import pytest
import torch
import torch.distributed as dist
from dflash.model import _attention_mask

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import build, case, check, job_results, jobs_worker, local, new_seed, run_local
from megatron_splitkv.ops import agreement, prepare_splitkv_metadata_from_plan
from megatron_splitkv.ops.common import context_keys, intervals, own_key_start, sort_keys, with_own_blocks
from megatron_splitkv.ops.host_metadata import from_recipe, pack_recipe
from megatron_splitkv.ops.packing import pack, unique_tensors
from megatron_splitkv.reference import dflash_attention_mask
from test_splitkv_op import check_cp_size

OPS = ("splitkv", "allgather_kv", "ring_kv")


def _dflash_block_mask(anchor, block_size, window, causal):
    """[B, anchor + B] bool: what dflash's attention lets a draft block at `anchor` see at inference (keys =
    the anchor cached context tokens 0..anchor-1, then the block's B tokens; queries = the block). dflash
    builds no mask for a full, non-causal layer (attention_mask None: every key)."""
    query = torch.zeros(1, 1, block_size, 1)
    key = torch.zeros(1, 1, anchor + block_size, 1)
    if window is None and not causal:
        return torch.ones(block_size, anchor + block_size, dtype=torch.bool)
    return _attention_mask(query, key, is_causal=causal, sliding_window=window)[0, 0]


def test_mask_matches_dflash_single_sequence():
    """Our dense mask of one block over one sequence equals dflash's own mask, bit for bit, for random
    anchors (0 included, anchors closer to the start than W), windows (1, < B, > the context, None), block
    sizes and causal True / False."""
    rng = random.Random(new_seed())
    for _ in range(300):
        anchor, bsz = rng.randrange(0, 40), rng.randrange(1, 10)
        window = rng.choice([None, 1, rng.randrange(1, bsz + 1), rng.randrange(1, 60), 1000])
        causal = rng.random() < 0.5
        ours = dflash_attention_mask(torch.tensor([0]), torch.tensor([anchor]), torch.zeros(anchor, dtype=torch.long),
                                     torch.arange(anchor), block_size=bsz, window=window, causal=causal)
        want = _dflash_block_mask(anchor, bsz, window, causal)
        assert torch.equal(ours, want), (anchor, bsz, window, causal)
        ctx_only = dflash_attention_mask(torch.tensor([0]), torch.tensor([anchor]),
                                         torch.zeros(anchor, dtype=torch.long), torch.arange(anchor),
                                         block_size=bsz, own_block=False, window=window, causal=causal)
        assert torch.equal(ctx_only, want[:, :anchor])


def test_mask_matches_dflash_packed_blocks():
    """Many blocks of packed sequences, context in shuffled order, invalid blocks: every block's rows equal
    dflash's mask of that block (its sequence's positions < anchor, then its own block); other sequences'
    keys, other blocks' keys and invalid blocks see nothing."""
    rng = random.Random(new_seed())
    for _ in range(30):
        lens = [rng.randrange(0, 25) for _ in range(3)]
        kv_seq = torch.cat([torch.full((n,), s, dtype=torch.long) for s, n in enumerate(lens)])
        kv_pos = torch.cat([torch.arange(n) for n in lens])
        perm = torch.randperm(kv_seq.numel(), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        kv_seq, kv_pos = kv_seq[perm], kv_pos[perm]
        nb, bsz = rng.randrange(1, 6), rng.randrange(1, 7)
        q_seq = torch.tensor([rng.randrange(3) for _ in range(nb)])
        q_anchor = torch.tensor([rng.choice([-1, 0, rng.randrange(0, 30)]) for _ in range(nb)])
        window, causal = rng.choice([None, 1, 3, 8, 100]), rng.random() < 0.5
        m = dflash_attention_mask(q_seq, q_anchor, kv_seq, kv_pos, block_size=bsz, window=window, causal=causal)
        tk = kv_seq.numel()
        for b in range(nb):
            rows = m[b * bsz:(b + 1) * bsz]
            a = int(q_anchor[b])
            if a < 0:
                assert not rows.any()
                continue
            mine = (kv_seq == q_seq[b]) & (kv_pos < a)
            want = _dflash_block_mask(a, bsz, window, causal)
            assert not rows[:, :tk][:, ~mine].any()
            assert torch.equal(rows[:, :tk][:, mine], want[:, kv_pos[mine]])
            own = rows[:, tk:].view(bsz, nb, bsz)
            assert torch.equal(own[:, b], want[:, a:])
            assert not own[:, torch.arange(nb) != b].any()


def test_full_layer_is_todays_mask():
    """window=None, causal=False is exactly the mask without the arguments (the default)."""
    t = build(case(new_seed(), 1, blocks=[6]))
    args = (t["q_seq"], t["q_anchor"], t["kv_seq"], t["kv_pos"])
    assert torch.equal(dflash_attention_mask(*args, block_size=4),
                       dflash_attention_mask(*args, block_size=4, window=None, causal=False))


def _edge_cases(P, seed):
    """Edge windows for CP size P (run at CP 1-3) (B = 4, sequences 13, 7, 20 tokens: 40 context keys)."""
    tk = 40
    empty_last = [tk // (P - 1) + (r < tk % (P - 1)) for r in range(P - 1)] + [0] if P > 1 else [tk]
    blocks_empty_last = [2] * (P - 1) + [0] if P > 1 else [2]  # the last rank: no block and no key
    one_rank = [3 * P] + [0] * (P - 1)  # every query block on rank 0
    cases = []
    for causal in (True, False):
        cases += [
            case(seed, P, window=1, causal=causal, ctx=empty_last, blocks=blocks_empty_last),
            case(seed + 1, P, window=1, causal=causal, blocks=one_rank, backend="flex", metadata=True),
            case(seed + 2, P, window=4, causal=causal, ctx=empty_last, blocks=blocks_empty_last, metadata=True),
            case(seed + 3, P, window=4, causal=causal, anchors=[0] * (2 * P), p_invalid=0.0),
            case(seed + 4, P, window=21, causal=causal, blocks=one_rank, ctx=empty_last, backend="flex"),
            case(seed + 5, P, window=1 << 40, causal=causal, ctx=empty_last, blocks=blocks_empty_last,
                 metadata=True),
            case(seed + 6, P, window=1, causal=causal, poison=True, dtype="float32"),
        ]
        seed += 10
    return cases


def _cases(P, seed):
    """Windowed / causal layouts for CP size P: W below the block (B = 4), below a chunk (the context per
    rank), equal to it and beyond every sequence; anchors closer to the start than W; uneven and empty shards
    and ranks without blocks; float64, float32 and bfloat16; math and flex; plain and metadata= calls."""
    tk = 13 + 7 + 20
    chunk = max(tk // P, 1)
    ctx_uneven = [0] * P
    for i in range(tk):  # skewed, the last rank holds no context when P > 1
        ctx_uneven[(i * i) % max(P - 1, 1)] += 1
    blocks_uneven = [(3 * r + 1) % 4 for r in range(P)]  # P > 1: rank 1 holds no block
    near_start = [1, 0, 2, 3, 1, 4, 2, 0, 5, 3] * P
    return [
        case(seed, P, window=2, causal=True, blocks=blocks_uneven, ctx=ctx_uneven),
        case(seed + 1, P, window=max(chunk // 2, 1), causal=False, metadata=True, backend="flex"),
        case(seed + 2, P, window=chunk, causal=True, blocks=[3] * P, anchors=near_start[:3 * P],
             metadata=True, p_invalid=0.0),
        case(seed + 3, P, window=100, causal=False, ctx=ctx_uneven, backend="flex", Hq=6, Hkv=3, B=3),
        case(seed + 4, P, window=6, causal=True, dtype="float32", backend="flex", metadata=True),
        case(seed + 5, P, window=5, causal=False, dtype="bfloat16", D=16, seq_lens=[50, 30], blocks=[3] * P),
        case(seed + 6, P, window=None, causal=True, blocks=blocks_uneven),
    ] + (_edge_cases(P, seed + 50) if P <= 3 else [])


def test_ops_single_process():
    seed = new_seed()
    for op in OPS:
        for c in _cases(1, seed):
            check(op, c, [run_local(op, c, 0)])


CP_SIZES = [2, 3, 4, 8]


@pytest.fixture(scope="module")
def cp_run():
    """Every op on every case of every CP size in ONE 8-rank spawn (smaller sizes on subgroups)."""
    seed = new_seed()
    jobs = [(op, c) for P in CP_SIZES for op in OPS for c in _cases(P, seed + 100 * P)]
    return jobs, run_distributed(jobs_worker, max(CP_SIZES), jobs, timeout=600)


@pytest.mark.parametrize("P", CP_SIZES)
def test_ops_cp(cp_run, P):
    check_cp_size(cp_run, P)


def test_window_narrows_each_ranks_blocks():
    """Split-KV's per-rank key intervals with a window, against the dense mask restricted to each rank's keys:
    every row's visible keys are exactly the reference's (context and own block), and a block gets a non-empty
    interval on a rank iff some row of it sees one of that rank's keys there. A window smaller than the context
    leaves fewer (rank, block) pairs with work than W = None, by the count the dense mask predicts."""
    seed = new_seed()
    for P, window, causal in ((4, 3, True), (3, 7, False), (8, 1, True), (2, 1000, False)):
        c = case(seed + P, P, blocks=[5] * P, seq_lens=[40, 25, 60], p_invalid=0.1, p_zero=0.05)
        t = build(c)
        bsz = c["B"]
        live = {}
        for w in (None, window):
            dense = dflash_attention_mask(t["q_seq"], t["q_anchor"], t["kv_seq"], t["kv_pos"], block_size=bsz,
                                          window=w, causal=causal)
            n_live = 0
            for r in range(P):
                idx = t["ctx_idx"][r]
                keys, order = sort_keys(context_keys(t["kv_seq"][idx], t["kv_pos"][idx]))
                sorted_idx = idx if order is None else idx[order]
                m = intervals(keys, t["q_seq"], t["q_anchor"], bsz, w)
                rows = m.row_bounds()
                j = torch.arange(keys.numel())
                got = (j[None, :] >= rows[0][:, None]) & (j[None, :] < rows[1][:, None])
                assert torch.equal(got, dense[:, sorted_idx]), (P, w, r)
                want_live = dense[:, sorted_idx].view(-1, bsz, keys.numel()).any(2).any(1)
                assert torch.equal(m.hi > m.lo, want_live), (P, w, r)
                n_live += int(want_live.sum())
                # the own block (this rank's blocks as the op appends them): exactly the reference's own part
                b0, b1 = t["block_range"][r]
                valid = t["q_anchor"][b0:b1] >= 0
                mo = with_own_blocks(intervals(keys, t["q_seq"][b0:b1], t["q_anchor"][b0:b1], bsz, w), valid,
                                     b1 - b0, window=w, causal=causal)
                ro = mo.row_bounds()
                c0 = own_key_start(keys.numel())
                k2 = torch.arange(c0, mo.num_keys)
                got2 = (k2[None, :] >= ro[2][:, None]) & (k2[None, :] < ro[3][:, None])
                ntk = t["kv_seq"].numel()
                assert torch.equal(got2, dense[b0 * bsz:b1 * bsz, ntk + b0 * bsz:ntk + b1 * bsz]), (P, w, r)
            live[w] = n_live
        assert live[window] <= live[None], (P, window, live)
        if window == 1 and P == 8:  # W = 1: a block is live on the one rank holding position anchor - 1 (with
            # 40 blocks over 8 ranks of random tokens, W = None leaves many blocks live on several ranks)
            assert live[window] < live[None], (P, window, live)


def _bad_windows(rank, world_size):
    """Rank 0 passes a bad window, the others a good one: every rank must raise the ValueError naming window
    (the check runs before the first collective and its verdict is shared), for every op and prepare."""
    c = case(11, world_size)
    t = build(c)
    x, meta, _, _ = local(t, c, rank)
    seen = []
    for bad in (0, -3, 2.5):
        window = bad if rank == 0 else 3
        for op in OPS:
            fn = getattr(msk, f"{op}_attention")
            try:
                fn(*x.values(), *meta.values(), block_size=c["B"], backend="math", window=window, causal=True)
            except ValueError as exc:
                seen.append(str(exc))
            else:
                raise AssertionError(f"{op}: no ValueError on rank {rank} for window={bad!r} on rank 0")
            try:
                msk.prepare_splitkv_metadata(*meta.values(), block_size=c["B"], num_heads_q=c["Hq"],
                                             num_heads_kv=c["Hkv"], head_dim=c["D"], dtype=x["q"].dtype, impl=op,
                                             window=window)
            except ValueError as exc:
                seen.append(str(exc))
            else:
                raise AssertionError(f"prepare {op}: no ValueError on rank {rank} for window={bad!r} on rank 0")
    return seen


def _mixed_window_metadata(rank, cp_group):
    """Metadata of another window on rank 0 (derived with `with_attention_type`, no collective; group_check, the
    default): every rank's call raises the same ValueError (the call's verdict row carries the layer type)."""
    c = case(12, 2)
    x, meta, _, _ = local(build(c), c, rank)
    md = msk.prepare_splitkv_metadata(*meta.values(), block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                      head_dim=c["D"], dtype=x["q"].dtype, cp_group=cp_group, window=4, causal=True)
    window = 3 if rank == 0 else 4
    try:
        msk.splitkv_attention(*x.values(), metadata=md.with_attention_type(window, True), backend="math",
                              window=window, causal=True)
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"no ValueError on rank {rank} for metadata of different windows")


#: the layer types one odd rank passes while the others pass window=None, causal=False, and how the error
#: shows it (`ops.agreement._kind_text`)
_ODD_KINDS = ((dict(window=8), "window=8, causal=False"), (dict(causal=True), "window=None, causal=True"))


def _differing_kinds(rank, P, cp_group, check_group):
    """On the CP group of ranks 0..P-1: rank P - 1 (window=8) or rank 1 (causal=True only) passes another layer
    type than the others in a plain call of each op, in prepare_splitkv_metadata, and in a plain call while the
    others call with metadata=. Every rank must raise; returns (case, odd rank, its kind's text, message)."""
    c = case(13, P)
    x, meta, _, _ = local(build(c), c, rank)
    ck = {} if check_group is None else {"check_group": check_group}
    seen = []
    for (kind, text), odd in zip(_ODD_KINDS, (P - 1, 1)):
        mine = kind if rank == odd else {}
        calls = [(op, lambda op=op: getattr(msk, f"{op}_attention")(
            *x.values(), *meta.values(), block_size=c["B"], cp_group=cp_group, **ck, **mine)) for op in OPS]
        calls += [(f"prepare {op}", lambda op=op: msk.prepare_splitkv_metadata(
            *meta.values(), block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"], head_dim=c["D"],
            dtype=x["q"].dtype, cp_group=cp_group, impl=op, **ck, **mine)) for op in OPS]
        md = msk.prepare_splitkv_metadata(*meta.values(), block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                          head_dim=c["D"], dtype=x["q"].dtype, cp_group=cp_group, **ck)
        calls.append(("plain vs metadata=", lambda: msk.splitkv_attention(
            *x.values(), *meta.values(), block_size=c["B"], cp_group=cp_group, **ck, **kind) if rank == odd
            else msk.splitkv_attention(*x.values(), metadata=md)))
        for name, fn in calls:
            try:
                fn()
            except ValueError as exc:
                seen.append((name, odd, text, str(exc)))
            else:
                raise AssertionError(f"{name}: no ValueError on rank {rank} of {P} for {kind} on rank {odd}")
    return seen


#: the windowed call after the errors (the CP group still in step)
_AFTER = {P: case(14 + P, P, window=8, causal=True) for P in (2, 3)}


def _bad_window_worker(rank, world_size):
    """`_bad_windows` over the 3 ranks; at P = 2 (ranks 0, 1) `_mixed_window_metadata`; at P = 2 and 3
    `_differing_kinds` without and with a check group (a second gloo group of the CP group's ranks), then a
    windowed call (still in step)."""
    groups = {2: dist.new_group([0, 1]), 3: None}
    checks = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2])}  # every rank creates every group
    out = {"bad": _bad_windows(rank, world_size)}
    if rank < 2:
        out["mixed"] = _mixed_window_metadata(rank, groups[2])
    for P in (2, 3):
        if rank < P:
            out[P] = _differing_kinds(rank, P, groups[P], None) + _differing_kinds(rank, P, groups[P], checks[P])
            out[("after", P)] = run_local("splitkv", _AFTER[P], rank, cp_group=groups[P])
    return out


def test_bad_or_differing_window_raises_on_every_rank():
    """A bad window on one rank; metadata of another window on one rank; and (P = 2, 3) a window / causal that
    differs on one rank in a plain call, a prepare, or a plain call facing metadata= calls: a ValueError on every
    rank (a hang fails through the harness's timeout) naming window / causal, each rank's values and the odd
    rank (the plain call facing metadata=: the calling modes, in the same first collective); then the group is
    in step."""
    results = run_distributed(_bad_window_worker, 3, timeout=300)
    for out in results:
        assert len(out["bad"]) == 18
        for m in out["bad"]:
            assert "window must be None or a positive int" in m and "1 <= W < 2**63" in m, m
    for msg in (results[r]["mixed"] for r in range(2)):
        assert ("window / causal must be the same on every CP rank; got ['window=3, causal=True', 'window=4, "
                "causal=True'] (by rank); CP rank 1 differs from rank 0") in msg, msg
    for P in (2, 3):
        per_rank = [results[r][P] for r in range(P)]
        assert len(per_rank[0]) == 2 * len(_ODD_KINDS) * (2 * len(OPS) + 1), per_rank[0]
        assert all([s[:2] for s in got] == [s[:2] for s in per_rank[0]] for got in per_rank), per_rank
        for name, odd, text, msg in (s for got in per_rank for s in got):
            if "metadata=" in name:
                assert "every rank of the CP group must call the op the same way" in msg, (P, name, msg)
                assert f"CP rank {odd} differs from rank 0" in msg, (P, name, msg)
                continue
            vals = ["window=None, causal=False"] * P
            vals[odd] = text
            assert (f"window / causal must be the same on every CP rank; got {vals} (by rank); CP rank {odd} "
                    "differs from rank 0") in msg, (P, name, msg)
        check("splitkv", _AFTER[P], [results[r][("after", P)] for r in range(P)])


def test_bad_window_single_process():
    c = case(3, 1)
    t = build(c)
    x, meta, _, _ = local(t, c, 0)
    for bad in (0, -3, 2.5, True, "4", 2**63):
        for op in OPS:
            with pytest.raises(ValueError, match="window must be None or a positive int"):
                getattr(msk, f"{op}_attention")(*x.values(), *meta.values(), block_size=c["B"], window=bad)
        with pytest.raises(ValueError, match="window must be None or a positive int"):
            dflash_attention_mask(*meta.values(), block_size=c["B"], window=bad)
        with pytest.raises(ValueError, match="window must be None or a positive int"):
            msk.dflash_attention_reference(*x.values(), *meta.values(), block_size=c["B"], window=bad)
    with pytest.raises(ValueError, match="causal must be a bool"):
        msk.splitkv_attention(*x.values(), *meta.values(), block_size=c["B"], causal="yes")


def test_metadata_window_must_match_the_call():
    """With metadata=, the call's window / causal must be the metadata's (the mask is fixed at prepare)."""
    c = case(5, 1)
    t = build(c)
    x, meta, _, _ = local(t, c, 0)
    md = msk.prepare_splitkv_metadata(*meta.values(), block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                      head_dim=c["D"], dtype=x["q"].dtype, window=4, causal=True)
    msk.splitkv_attention(*x.values(), metadata=md, window=4, causal=True)
    for kw in (dict(), dict(window=4), dict(window=5, causal=True), dict(causal=True)):
        with pytest.raises(ValueError, match="differ from the metadata's window=4, causal=True"):
            msk.splitkv_attention(*x.values(), metadata=md, **kw)


def test_backend_without_row_bounds_refused():
    """A kernel that cannot read per-row bounds (staircase: dense rectangles; te likewise, not importable on
    CPU) refuses a windowed / causal call with a ValueError naming it and window, for every op."""
    c = case(6, 1)
    t = build(c)
    x, meta, _, _ = local(t, c, 0)
    for op in OPS:
        for kw in (dict(window=3), dict(causal=True)):
            with pytest.raises(ValueError, match="backend 'staircase' does not support sliding-window / causal"):
                getattr(msk, f"{op}_attention")(*x.values(), *meta.values(), block_size=c["B"],
                                                backend="staircase", **kw)


def _long_cases(P, seed):
    """Many 128-row query tiles and 128-key tiles (gathered rows = P x 160): a window of 16 leaves most key
    tiles unlisted and the rest partial; 400 makes some full. Exercises the per-row tile classification."""
    return [case(seed, P, window=16, causal=True, seq_lens=[600, 300], blocks=[40] * P, p_invalid=0.05,
                 dtype="float32", metadata=True),
            case(seed + 1, P, window=400, causal=False, seq_lens=[600, 300], blocks=[40] * P, p_zero=0.0,
                 dtype="float32")]


def _fa4_worker(rank, world_size, jobs):
    from test_fa4_emulated import install_emulator

    install_emulator()
    return jobs_worker(rank, world_size, jobs)


def test_long_windows_flex_and_fa4_wrapper():
    """flex (CPU emulation: the block tables decide which tiles run, the mask_mod the partial ones) and the
    fa4 wrapper (tests/test_fa4_emulated.py's float64 stand-in for FA4's entry points: its block-sparse tables,
    aux rows and mask_mod) with windowed / causal layers over many tiles, every op, P = 1 and 3, against the
    float64 reference (the stand-in runs fp32 inputs, as FA4's lse is fp32)."""
    seed = new_seed()
    jobs = []
    for P in (1, 3):
        for c in _long_cases(P, seed + P) + _cases(P, seed + 10 * P)[:5]:
            for backend in ("flex", "fa4") if c["seq_lens"][0] == 600 else ("fa4",):  # flex: test_ops_cp
                dt = {"float64": "float32"}.get(c["dtype"], c["dtype"]) if backend == "fa4" else c["dtype"]
                for op in OPS:
                    jobs.append((op, dict(c, backend=backend, dtype=dt)))
    results = run_distributed(_fa4_worker, 3, jobs, timeout=900)
    for j, (op, c) in enumerate(jobs):
        check(op, c, job_results(results, j, c["P"]))


def _emulate_fa4(monkeypatch):
    """tests/test_fa4_emulated.py's stand-in for FA4 on this process, undone after the test."""
    import test_fa4_emulated as emu
    from megatron_splitkv import kernels
    from megatron_splitkv.kernels import fa4

    monkeypatch.setattr(fa4, "_interface", lambda: (emu._fwd, emu._bwd, emu._bst, emu._ONE, emu._TWO))
    monkeypatch.setattr(fa4.FA4AttentionKernel, "check_dtype", lambda self, dtype, device=None, head_dim=None: None)
    monkeypatch.setattr(fa4.FA4AttentionKernel, "_check", lambda self, q, k, v, mask: fa4.check_call(q, k, v, mask))
    monkeypatch.setattr(kernels, "_CACHE", {k: v for k, v in kernels._CACHE.items() if k[0] != "fa4"})


def test_metadata_from_plan_with_window(monkeypatch):
    """The data pipeline's host-built metadata with a window (per-row bounds included, pickled, bound, with
    host-built flex tables) equals prepare's field for field, and the op through it (math, flex, fa4 wrapper)
    equals the float64 reference."""
    import pickle

    import numpy as np

    from megatron_splitkv.planning import plan_context_parallel
    from test_metadata_from_plan import meta_diff

    _emulate_fa4(monkeypatch)
    rng = np.random.default_rng(new_seed())
    lens, bsz = [300, 0, 170], 4
    anchors = [np.sort(rng.choice(np.arange(1, n - 1), size=30, replace=False)) if n > 2 else np.zeros(0, np.int64)
               for n in lens]
    plan = plan_context_parallel(lens, anchors, block_size=bsz, cp_size=1, chunk_size=16)
    q_seq, q_anchor = torch.from_numpy(plan.q_seq.copy()), torch.from_numpy(plan.q_anchor.copy())
    kv_seq, kv_pos = torch.from_numpy(plan.token_seq_ids(0)), torch.from_numpy(plan.token_positions(0))
    for window, causal, k in ((7, True, 1), (50, False, 2), (None, True, 2)):
        kw = dict(block_size=bsz, num_heads_q=4, num_heads_kv=2, head_dim=8, dtype=torch.float32, num_chunks=k,
                  window=window, causal=causal)
        host = prepare_splitkv_metadata_from_plan(plan, 0, flex_block_masks=True, **kw)
        # the data loader's packed form (one region + a recipe of plain values) carries the per-row bounds too
        region, _ = pack(unique_tensors(host), pin=False)
        assert meta_diff(from_recipe(region, pack_recipe(host)), host) == ["host_build"]
        bound = pickle.loads(pickle.dumps(host)).bind(None, "cpu")
        ref_meta = msk.prepare_splitkv_metadata(q_seq, q_anchor, kv_seq, kv_pos, **kw)
        assert meta_diff(bound, ref_meta) == [], (window, causal)
        assert all(m.has_rows for m in bound.chunk_masks_own)
        g = torch.Generator().manual_seed(k)
        nq, nk = q_seq.numel() * bsz, kv_seq.numel()
        x = dict(q=torch.randn(nq, 4, 8, generator=g), k_ctx=torch.randn(nk, 2, 8, generator=g),
                 v_ctx=torch.randn(nk, 2, 8, generator=g), k_blk=torch.randn(nq, 2, 8, generator=g),
                 v_blk=torch.randn(nq, 2, 8, generator=g))
        dout = torch.randn(nq, 4, 8, generator=g)
        xr = {n: t.double().requires_grad_(True) for n, t in x.items()}
        ref, _ = msk.dflash_attention_reference(*xr.values(), q_seq, q_anchor, kv_seq, kv_pos, block_size=bsz,
                                                window=window, causal=causal)
        (ref * dout.double()).sum().backward()
        for backend in ("math", "flex", "fa4"):
            xo = {n: t.clone().requires_grad_(True) for n, t in x.items()}
            out = msk.splitkv_attention(*xo.values(), metadata=bound, backend=backend, window=window, causal=causal)
            (out * dout).sum().backward()
            assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), (backend, window)
            for n in x:
                assert (xo[n].grad.double() - xr[n].grad).abs().max() <= 1e-5 * xr[n].grad.abs().max(), (backend, n)


def test_with_attention_type_equals_prepare():
    """One prepare per step, one derived metadata per layer type (`SplitKVMetadata.with_attention_type`, no
    collective): field for field what a prepare with that window / causal returns, splitkv (also row chunks and
    the host-built metadata from the plan) and allgather_kv; and the op through it equals the reference."""
    import numpy as np

    from megatron_splitkv.planning import plan_context_parallel
    from test_metadata_from_plan import meta_diff

    c = case(new_seed(), 1, blocks=[6])
    t = build(c)
    x, meta, _, _ = local(t, c, 0)
    kw = dict(block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"], head_dim=c["D"], dtype=x["q"].dtype)
    for impl, extra in (("splitkv", {}), ("splitkv", {"num_chunks": 3}), ("allgather_kv", {})):
        full = msk.prepare_splitkv_metadata(*meta.values(), impl=impl, **kw, **extra)
        for window, causal in ((3, True), (None, True), (7, False)):
            derived = full.with_attention_type(window, causal)
            want = msk.prepare_splitkv_metadata(*meta.values(), impl=impl, window=window, causal=causal, **kw, **extra)
            assert meta_diff(derived, want) == [], (impl, window, causal)
            assert full.window is None and not full.causal and meta_diff(full.with_attention_type(), full) == []
            xo = {n: v.detach().clone().requires_grad_(True) for n, v in x.items()}
            xr = {n: v.detach().clone().requires_grad_(True) for n, v in x.items()}
            out = getattr(msk, f"{impl}_attention")(*xo.values(), metadata=derived, window=window, causal=causal)
            ref, _ = msk.dflash_attention_reference(*xr.values(), *meta.values(), block_size=c["B"], window=window,
                                                    causal=causal)
            out.sum().backward()
            ref.sum().backward()
            assert torch.allclose(out, ref, atol=1e-10, rtol=0)
            assert all(torch.allclose(xo[n].grad, xr[n].grad, atol=1e-10, rtol=0) for n in x)
    # values a call cached on the metadata (its verdict row, with the digest) are not carried over
    full = msk.prepare_splitkv_metadata(*meta.values(), **kw)
    agreement._metadata_row(full, 0, 1)
    derived = full.with_attention_type(5, True)
    digest = agreement._metadata_row(derived, 0, 1)[-1]
    assert digest == agreement.metadata_digest(derived) != agreement.metadata_digest(full)
    ring = msk.prepare_splitkv_metadata(*meta.values(), impl="ring_kv", **kw)
    with pytest.raises(ValueError, match="ring_kv metadata cannot be derived"):
        ring.with_attention_type(4, True)
    with pytest.raises(ValueError, match="window must be None or a positive int"):
        full.with_attention_type(0)
    # the data pipeline's host-built metadata (P = 3, every rank), derived before bind
    rng = np.random.default_rng(1)
    lens = [200, 90]
    anchors = [np.sort(rng.choice(np.arange(1, n - 1), size=20, replace=False)) for n in lens]
    plan = plan_context_parallel(lens, anchors, block_size=4, cp_size=3, chunk_size=16)
    for r in range(3):
        args = dict(block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8, dtype=torch.float32, num_chunks=2)
        derived = prepare_splitkv_metadata_from_plan(plan, r, **args).with_attention_type(9, True)
        want = prepare_splitkv_metadata_from_plan(plan, r, window=9, causal=True, **args)
        assert meta_diff(derived, want) == [], r


def test_benchmark_reference_reads_row_bounds():
    """tools/benchlib's float64 interval reference (what the GPU kernel tests compare against) sees exactly the
    dense mask's keys under a windowed / causal mask's per-row bounds."""
    from tools import benchlib as mb

    c = case(new_seed(), 1, blocks=[7], seq_lens=[60])
    t = build(c)
    keys, order = sort_keys(context_keys(t["kv_seq"], t["kv_pos"]))
    perm = torch.arange(t["kv_seq"].numel()) if order is None else order
    for window, causal in ((5, True), (30, False), (None, True), (2, False)):
        m = with_own_blocks(intervals(keys, t["q_seq"], t["q_anchor"], c["B"], window), t["q_anchor"] >= 0, 7,
                            window=window, causal=causal)
        vis = mb._mask_rows(m, torch.arange(7 * c["B"]), m.num_keys)
        dense = dflash_attention_mask(t["q_seq"], t["q_anchor"], t["kv_seq"], t["kv_pos"], block_size=c["B"],
                                      window=window, causal=causal)
        tk, c0 = keys.numel(), own_key_start(keys.numel())
        assert torch.equal(vis[:, :tk], dense[:, :tk][:, perm]) and not vis[:, tk:c0].any()
        assert torch.equal(vis[:, c0:], dense[:, tk:])
