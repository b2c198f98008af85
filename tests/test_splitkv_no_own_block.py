"""The three CP ops with `k_blk = v_blk = None` (no own-block part: rows attend only the context; how
SplitKVCoreAttention runs Megatron's plain CrossAttention) vs the float64 reference with the same option:
output, lse and the gradients of q, k_ctx, v_ctx at CP sizes 1, 2, 3 with uneven and empty shards
(ranks without blocks, ranks without context), invalid blocks, the cross-attention encoding (block_size 1,
anchor 2**31 - 1, masked keys with sequence id -1), with and without per-step `metadata=`; and the
validation of a half-given own block. Source: DESIGN.md section 2.
"""

import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import OPS, TOL, build, case, local, loss_of, new_seed, rel_err
from megatron_splitkv import dflash_attention_mask, dflash_attention_reference
from megatron_splitkv.ops import prepare_splitkv_metadata

SEE_ALL = 2**31 - 1
GRADS = (("dq", "q"), ("dk_ctx", "k_ctx"), ("dv_ctx", "v_ctx"))


def build_nob(c):
    """`build(c)` plus the case's masked context tokens (kv_seq = -1: seen by no block)."""
    t = build(c)
    for j in c.get("masked", ()):
        t["kv_seq"][j] = -1
    return t


def cases(P, seed):
    tk = 13 + 7 + 20
    skew = [0] * P
    for i in range(tk):  # the last rank holds no context when P > 1
        skew[(i * i) % max(P - 1, 1)] += 1
    blocks = [(3 * r + 1) % 4 for r in range(P)]  # P > 1: rank 1 holds no block
    cross_blocks = [5, 0, 4][:P] if P > 1 else [7]
    nq = sum(cross_blocks)
    return [
        case(seed, P, dtype="float64", blocks=blocks, ctx=skew),
        case(seed + 1, P, dtype="float64", Hq=6, Hkv=3, B=3, blocks=[2] * P, p_invalid=0.3),
        case(seed + 2, P, dtype="float32", Hq=4, Hkv=1, D=16, seq_lens=[25, 11], blocks=[3] * P),
        # plain cross-attention: one row per block seeing its whole sequence, some keys masked out
        # (all of sequence 1's keys on one case: its rows see nothing and output 0)
        case(seed + 3, P, dtype="float64", B=1, blocks=cross_blocks, ctx=skew,
             anchors=[SEE_ALL] * nq, q_seqs=[i % 3 for i in range(nq)], masked=list(range(0, 40, 3))),
        case(seed + 4, P, dtype="float64", B=1, blocks=cross_blocks, anchors=[SEE_ALL] * nq,
             q_seqs=[i % 3 for i in range(nq)], masked=list(range(13, 20))),
    ]


def reference(c):
    t = build_nob(c)
    x = {k: t[k].double().clone().requires_grad_(True) for k in ("q", "k_ctx", "v_ctx")}
    out, lse = dflash_attention_reference(x["q"], x["k_ctx"], x["v_ctx"], None, None, t["q_seq"], t["q_anchor"],
                                          t["kv_seq"], t["kv_pos"], block_size=c["B"])
    loss_of(out, lse, t["dout"], t["dlse"]).backward()
    ref = dict(out=out.detach(), lse=lse.detach())
    ref.update({n: x[k].grad for n, k in GRADS})
    return t, ref


def run_one(op, c, rank, cp_group, with_meta):
    t = build_nob(c)
    x, meta, dout, dlse = local(t, c, rank)
    kw = dict(block_size=c["B"], cp_group=cp_group)
    if with_meta:  # per-step metadata, two "layers" on the same metadata (the second is returned)
        md = prepare_splitkv_metadata(*meta.values(), block_size=c["B"], num_heads_q=c["Hq"],
                                      num_heads_kv=c["Hkv"], head_dim=c["D"], dtype=x["q"].dtype,
                                      cp_group=cp_group, impl=op)
        OPS[op](x["q"].detach(), x["k_ctx"].detach(), x["v_ctx"].detach(), None, None, metadata=md)
        meta, kw = dict.fromkeys(meta), dict(metadata=md)
    out, lse = OPS[op](x["q"], x["k_ctx"], x["v_ctx"], None, None, *meta.values(), return_lse=True,
                       backend="math", **kw)
    assert out.dtype == x["q"].dtype and out.shape == x["q"].shape
    loss_of(out, lse, dout, dlse).backward()
    res = dict(out=out.detach().double(), lse=lse.detach().double())
    res.update({n: x[k].grad.double() for n, k in GRADS})
    return res


def worker(rank, world_size, jobs):
    import torch.distributed as dist

    groups = {P: dist.new_group(list(range(P))) for P in sorted({c["P"] for _, c, _ in jobs}) if P < world_size}
    return {j: run_one(op, c, rank, groups.get(c["P"]), wm) for j, (op, c, wm) in enumerate(jobs) if rank < c["P"]}


def check(op, c, per_rank):
    t, ref = reference(c)
    got = {k: torch.cat([per_rank[r][k] for r in range(c["P"])]) for k in ("out", "lse", "dq")}
    for k in ("dk_ctx", "dv_ctx"):
        full = torch.zeros(ref[k].shape, dtype=torch.float64)
        for r in range(c["P"]):
            full[t["ctx_idx"][r]] = per_rank[r][k]
        got[k] = full
    tol = TOL[c["dtype"]]
    for k, r in ref.items():
        a = got[k]
        assert not torch.isnan(a).any(), (op, k)
        if k == "lse":
            fin = torch.isfinite(r)
            assert torch.equal(fin, torch.isfinite(a)), (op, c, "lse -inf pattern")
            a, r = a[fin], r[fin]
        err = rel_err(a, r)
        assert err <= tol, f"{op} case {c} (seed {c['seed']}): {k} error {err} > {tol}"
    return ref


def test_reference_without_own_block():
    """The reference's own_block=False is the context part of the full mask and output."""
    c = case(new_seed(), 1, blocks=[4])
    t = build(c)
    args = (t["q_seq"], t["q_anchor"], t["kv_seq"], t["kv_pos"])
    full = dflash_attention_mask(*args, block_size=c["B"])
    ctx = dflash_attention_mask(*args, block_size=c["B"], own_block=False)
    assert torch.equal(ctx, full[:, : t["kv_seq"].numel()])
    out, lse = dflash_attention_reference(t["q"], t["k_ctx"], t["v_ctx"], None, None, *args, block_size=c["B"])
    s = torch.einsum("qhd,khd->hqk", t["q"], t["k_ctx"].repeat_interleave(2, 1)) / c["D"] ** 0.5
    s = s.masked_fill(~ctx[None], float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).t())
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", torch.softmax(s, -1).nan_to_num(0.0),
                                                 t["v_ctx"].repeat_interleave(2, 1)))
    with pytest.raises(ValueError, match="both"):
        dflash_attention_reference(t["q"], t["k_ctx"], t["v_ctx"], t["k_blk"], None, *args, block_size=c["B"])


@pytest.mark.parametrize("op", list(OPS))
def test_no_own_block_single_process(op):
    seed = new_seed()
    for c in cases(1, seed):
        for wm in (False, True):
            check(op, c, [run_one(op, c, 0, None, wm)])


@pytest.fixture(scope="module")
def cp_run():
    seed = new_seed()
    jobs = [(op, c, wm) for P in (2, 3) for c in cases(P, seed + 100 * P) for op in OPS for wm in (False, True)]
    return jobs, run_distributed(worker, 3, jobs, timeout=400)


@pytest.mark.parametrize("P", [2, 3])
def test_no_own_block_cp(cp_run, P):
    jobs, results = cp_run
    n = 0
    for j, (op, c, _) in enumerate(jobs):
        if c["P"] == P:
            check(op, c, [results[r][j] for r in range(P)])
            n += 1
    assert n


def test_half_given_own_block_raises():
    c = case(new_seed(), 1)
    t = build(c)
    x, meta, _, _ = local(t, c, 0)
    for name, op in OPS.items():
        md = prepare_splitkv_metadata(*meta.values(), block_size=c["B"], num_heads_q=c["Hq"],
                                      num_heads_kv=c["Hkv"], head_dim=c["D"], dtype=x["q"].dtype, impl=name)
        with pytest.raises(ValueError, match="k_blk and v_blk must both be tensors or both be None"):
            op(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], None, *meta.values(), block_size=c["B"])
        with pytest.raises(ValueError, match="k_blk and v_blk must both be tensors or both be None"):
            op(x["q"], x["k_ctx"], x["v_ctx"], None, x["v_blk"], metadata=md)
