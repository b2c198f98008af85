"""The host-overhead cuts of docs/lab/perf-notes.md item 15 leave every result bit-identical.

- the rewritten elementwise formulas (`ops.common.lse_weights`, `finalize`, `delta_and_dout`, `_as_bits`,
  `zero_invalid_rows`, `with_own_keys`) against the former ones, kept here, on inputs with NaN, +-inf, -0;
- the kernels' native-dtype results (`native_dtype_results`, FlexAttention: out / dq / dk / dv in the input
  dtype instead of their fp32 upcast) against the fp32 path, through the whole Split-KV op (P = 1 and 2,
  k = 1-3, with and without own blocks, every loss shape: out only, lse only, both);
- an unused output's gradient as None (`set_materialize_grads(False)`) against a zero gradient passed
  explicitly (the former materialised zeros);
- the chunked forward's in-place Triton merge (`fused_merge.merges_in_place`) against the concatenation of
  the chunks' merges, in Triton's CPU interpreter.

Bit-identical means equal bytes (torch.equal on the raw bytes: -0.0 and NaN payloads included)."""

import os

import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import build, case, local, new_seed, run_in_triton_interpreter

import megatron_splitkv as msk
from megatron_splitkv.ops import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def specials(g, *shape, dtype=torch.float32):
    """Random values with NaN, +-inf, -0.0 and subnormals sprinkled in."""
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    flat = x.view(-1)
    if not flat.numel():
        return x
    vals = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40], dtype=torch.float64).to(dtype)
    idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 5),), generator=g)
    flat[idx] = vals[torch.randint(0, vals.numel(), idx.shape, generator=g)]
    return x


# ----------------------------------------------------------------------------- the former formulas


def old_lse_weights(lse, m):
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m_safe, torch.exp(lse - m_safe)


def old_finalize(num, den, m_safe):
    den_safe = torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return num.div_(den_safe), m_safe + torch.log(den)


def old_delta_dlse(delta, lse, dlse):
    return delta - torch.where(torch.isfinite(lse), dlse, torch.zeros_like(delta))


def old_zero_invalid_rows(x, valid_rows, rows):
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    torch.where(valid_rows[:, None, None], x, torch.zeros((), dtype=x.dtype), out=out[: x.shape[0]])
    out[x.shape[0]:].zero_()
    return out


def old_with_own_keys(src, index, k_blk, valid_rows):
    n = src.shape[0] if index is None else index.shape[0]
    c0 = common.own_key_start(n)
    out = src.new_empty((c0 + k_blk.shape[0],) + tuple(src.shape[1:]))
    if index is None:
        out[:n].copy_(src)
    else:
        torch.index_select(src, 0, index, out=out[:n])
    out[n:c0].zero_()
    torch.where(valid_rows[:, None, None], k_blk, torch.zeros((), dtype=k_blk.dtype), out=out[c0:])
    return out


@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
def test_rewritten_formulas_are_bit_identical(dt):
    g = torch.Generator().manual_seed(new_seed())
    for _ in range(20):
        lse = specials(g, 3, 17, 4, dtype=dt)
        m = lse.max(0).values
        assert all(same_bits(a, b) for a, b in zip(common.lse_weights(lse, m), old_lse_weights(lse, m)))
        num, den, m_safe = specials(g, 17, 4, 8, dtype=dt), specials(g, 17, 4, dtype=dt).abs(), specials(g, 17, 4, dtype=dt)
        new = common.finalize(num.clone(), den, m_safe, inplace=True)
        assert all(same_bits(a, b) for a, b in zip(new, old_finalize(num.clone(), den, m_safe)))
        delta, lse2, dlse = (specials(g, 17, 4, dtype=dt) for _ in range(3))
        plan = type("P", (), {"acc": dt})()
        out = specials(g, 17, 4, 8, dtype=dt)
        dout = specials(g, 17, 4, 8, dtype=dt)
        _, d_new = common.delta_and_dout(plan, dout, dlse, out, lse2, None)
        d_old = old_delta_dlse((dout * out).sum(-1), lse2, dlse)
        assert same_bits(d_new, d_old)
        # the unused lse's gradient: None now, a materialised zero tensor before
        _, d_none = common.delta_and_dout(plan, dout, None, out, lse2, None)
        assert same_bits(d_none, old_delta_dlse((dout * out).sum(-1), lse2, torch.zeros_like(lse2)))
        if dt == torch.float32:  # dO in the inputs' dtype: the product in fp32 without the upcast copy
            for low in (torch.bfloat16, torch.float16):
                d_low = dout.to(low)
                _, d_new = common.delta_and_dout(plan, d_low, None, out, lse2, None)
                assert same_bits(d_new, (d_low.to(dt) * out).sum(-1))


def test_as_bits_strided_view_is_the_contiguous_copy():
    g = torch.Generator().manual_seed(new_seed())
    for dt, src in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float64)):
        base = torch.randn(4, 9, generator=g, dtype=torch.float64).to(src)  # [Hq, Tqp] as flex stores lse
        lse = base[:, :7].t()  # [Tq, Hq] view, strides (1, 9)
        got = common._as_bits(lse[..., None], dt)
        want = lse.contiguous()[..., None].contiguous().reshape(-1).view(dt).view(7, 4, -1)
        assert got.data_ptr() == base.data_ptr() and same_bits(got, want)
        o = torch.randn(8, 7, 4, generator=g).to(dt).permute(1, 2, 0)  # a strided O in the transport dtype
        packed = common.pack_partial(o, lse, dt)  # one cat
        former = torch.empty(7, 4, 8 + got.shape[-1], dtype=dt)  # the former two copies
        former[..., :8].copy_(o)
        former[..., 8:].copy_(want)
        assert same_bits(packed, former)
        assert same_bits(common.unpack_partial(packed, 8, src)[1], lse.contiguous())


@pytest.mark.parametrize("index", [False, True])
def test_zero_selects_are_bit_identical(index):
    g = torch.Generator().manual_seed(new_seed())
    for dt in (torch.bfloat16, torch.float32):
        for n in (0, 5, 128, 130):
            src, k_blk = specials(g, n, 2, 8, dtype=dt), specials(g, 12, 2, 8, dtype=dt)
            valid = torch.rand(12, generator=g) > 0.3
            idx = torch.randperm(n, generator=g) if index else None
            assert same_bits(common.with_own_keys(src, idx, k_blk, valid), old_with_own_keys(src, idx, k_blk, valid))
            for rows in (12, 16):
                assert same_bits(common.zero_invalid_rows(k_blk, valid, rows), old_zero_invalid_rows(k_blk, valid, rows))


# ----------------------------------------------------------------------------- through the op


def _op_results(rank, world, cfgs):
    """Every config twice: (flex with native results, without) or (loss with dlse None, dlse = 0)."""
    import torch.distributed as dist

    from megatron_splitkv.kernels import flex

    out = []
    for cf in cfgs:
        c = case(cf["seed"], world, dtype=cf["dtype"], B=4, Hq=4, Hkv=2, D=16, seq_lens=[40, 23, 61],
                 blocks=[5, 3] if world == 2 else [7])
        runs = []
        for variant in (0, 1):
            t = build(c)
            x, meta, dout, dlse = local(t, c, rank)
            kb, vb = (x["k_blk"], x["v_blk"]) if cf["own"] else (None, None)
            md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                              block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=16,
                                              dtype=x["q"].dtype, cp_group=dist.group.WORLD, num_chunks=cf["k"])
            native = cf["what"] != "native" or variant == 0
            saved = flex.FlexAttentionKernel.native_dtype_results
            flex.FlexAttentionKernel.native_dtype_results = native
            try:
                o, lse = msk.splitkv_attention(x["q"], x["k_ctx"], x["v_ctx"], kb, vb, metadata=md,
                                               backend=cf["backend"], return_lse=True)
                lse_f = lse.masked_fill(~torch.isfinite(lse), 0.0)
                d = dout.to(o.dtype)
                if cf["loss"] == "out":
                    if cf["what"] == "materialize" and variant == 1:  # the former materialised zero dlse
                        torch.autograd.backward((o, lse), (d, torch.zeros_like(lse)))
                    else:
                        o.backward(d)
                elif cf["loss"] == "lse":
                    if cf["what"] == "materialize" and variant == 1:
                        torch.autograd.backward((o, lse_f), (torch.zeros_like(o), dlse.to(lse.dtype)))
                    else:
                        (lse_f * dlse.to(lse.dtype)).sum().backward()
                else:
                    ((o.float() * d.float()).sum() + (lse_f.float() * dlse.float()).sum()).backward()
            finally:
                flex.FlexAttentionKernel.native_dtype_results = saved
            runs.append([o.detach(), lse.detach()] + [x[n].grad for n in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")])
        out.append(runs)
    return out


def _configs(seed):
    cfgs = []
    for k in (1, 2, 3):
        for own in (True, False):
            for loss in ("out", "lse", "both"):
                for dt in ("bfloat16", "float32"):
                    cfgs.append(dict(what="native", backend="flex", k=k, own=own, loss=loss, dtype=dt, seed=seed + k))
                if loss != "both":
                    cfgs.append(dict(what="materialize", backend="math", k=k, own=own, loss=loss, dtype="bfloat16",
                                     seed=seed + 7 * k))
    return cfgs


@pytest.mark.parametrize("P", [1, 2])
def test_native_results_and_unmaterialised_grads_through_the_op(P):
    cfgs = _configs(new_seed())
    per_rank = run_distributed(_op_results, P, cfgs, timeout=600)
    for r in range(P):
        for cf, (a, b) in zip(cfgs, per_rank[r]):
            for i, (x, y) in enumerate(zip(a, b)):
                assert same_bits(x, y), f"rank {r} {cf}: result {i} differs"


_INTERP = r"""
import sys
sys.path.insert(0, {tests!r})
import torch
from _dist import run_distributed
from test_host_identity import _merge_results

for P in (1, 2):
    res = run_distributed(_merge_results, P, timeout=1200)
    for r in range(P):
        for a, b in res[r]:
            for x, y in zip(a, b):
                assert x.dtype == y.dtype and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
print("in-place merge ok")
"""


def _merge_results(rank, world):
    """The op at k = 2 / 3 with the in-place Triton merge and with it off (the chunks' results concatenated)."""
    import torch.distributed as dist

    from megatron_splitkv.ops import splitkv

    out = []
    for k in (2, 3):
        c = case(100 + k, world, dtype="bfloat16", B=4, Hq=4, Hkv=2, D=16, seq_lens=[40, 23, 61],
                 blocks=[5, 3] if world == 2 else [7])
        runs = []
        for in_place in (True, False):
            t = build(c)
            x, meta, dout, dlse = local(t, c, rank)
            md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                              block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=16,
                                              dtype=x["q"].dtype, cp_group=dist.group.WORLD, num_chunks=k)
            saved = splitkv.merges_in_place
            if not in_place:
                splitkv.merges_in_place = lambda *a: False
            else:
                assert saved(x["q"].device, torch.bfloat16, 16, torch.float32)
            try:
                o, lse = msk.splitkv_attention(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], metadata=md,
                                               backend="math", return_lse=True)
                o.backward(dout.to(o.dtype))
            finally:
                splitkv.merges_in_place = saved
            runs.append([o.detach(), lse.detach(), x["q"].grad, x["k_ctx"].grad])
        out.append(runs)
    return out


def test_in_place_merge_in_the_triton_interpreter():
    pytest.importorskip("triton")
    run_in_triton_interpreter(_INTERP.format(tests=os.path.join(ROOT, "tests")), "in-place merge ok", 1200)
