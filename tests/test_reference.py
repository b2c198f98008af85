"""The float64 reference itself: mask semantics on a hand-made example, values vs an independent
per-row loop, gradients vs finite differences (gradcheck), GQA head mapping, and empty rows (anchor 0
with an invalid block: O = 0, lse = -inf, zero gradients, no NaN). Source: DESIGN.md section 1."""

import math

import torch

from megatron_splitkv import dflash_attention_mask, dflash_attention_reference


def _inputs(seed=0, nb=4, B=2, Hq=4, Hkv=2, D=3, Tk=9):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, kc, vc, kb, vb = r(nb * B, Hq, D), r(Tk, Hkv, D), r(Tk, Hkv, D), r(nb * B, Hkv, D), r(nb * B, Hkv, D)
    q_seq = torch.tensor([0, 1, 0, 1])[:nb]
    q_anchor = torch.tensor([3, 0, -1, 5])[:nb]  # block 1: anchor 0, block 2: invalid
    kv_seq = torch.tensor([1, 0, 0, 1, 0, 1, 1, 0, 0])[:Tk]
    kv_pos = torch.tensor([4, 0, 2, 0, 3, 6, 1, 1, 5])[:Tk]
    return (q, kc, vc, kb, vb, q_seq, q_anchor, kv_seq, kv_pos), B


def test_mask_by_hand():
    q_seq, q_anchor = torch.tensor([0, 1, 0]), torch.tensor([2, 0, -1])
    kv_seq, kv_pos = torch.tensor([0, 0, 0, 1]), torch.tensor([1, 2, 0, 0])
    m = dflash_attention_mask(q_seq, q_anchor, kv_seq, kv_pos, block_size=2)
    expect_ctx = [[1, 0, 1, 0]] * 2 + [[0, 0, 0, 0]] * 4  # strict pos < anchor; anchor 0; invalid
    expect_own = [[1, 1, 0, 0, 0, 0]] * 2 + [[0, 0, 1, 1, 0, 0]] * 2 + [[0] * 6] * 2
    assert m.tolist() == [[bool(v) for v in a + b] for a, b in zip(expect_ctx, expect_own)]


def test_values_vs_loop():
    args, B = _inputs()
    q, kc, vc, kb, vb, q_seq, q_anchor, kv_seq, kv_pos = args
    out, lse = dflash_attention_reference(*args, block_size=B)
    Hq, Hkv, D = q.shape[1], kc.shape[1], q.shape[2]
    for i in range(q.shape[0]):
        b = i // B
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            keys = []
            if q_anchor[b] >= 0:
                keys += [(kc[j, kh], vc[j, kh]) for j in range(kc.shape[0])
                         if kv_seq[j] == q_seq[b] and kv_pos[j] < q_anchor[b]]
                keys += [(kb[b * B + m, kh], vb[b * B + m, kh]) for m in range(B)]
            if not keys:
                assert lse[i, h] == -math.inf and out[i, h].abs().max() == 0
                continue
            s = [float(q[i, h] @ k) / math.sqrt(D) for k, _ in keys]
            mx = max(s)
            z = sum(math.exp(x - mx) for x in s)
            o = sum(math.exp(x - mx) / z * v for (x, (_, v)) in zip(s, keys))
            assert abs(lse[i, h].item() - (mx + math.log(z))) < 1e-12
            assert torch.allclose(out[i, h], o, atol=1e-12, rtol=0)


def test_gradients_gradcheck_and_empty_rows():
    args, B = _inputs(nb=4, B=2, Hq=2, Hkv=1, D=2, Tk=9)
    floats = [a.clone().requires_grad_(True) for a in args[:5]]
    meta = args[5:]

    def f(*xs):
        out, lse = dflash_attention_reference(*xs, *meta, block_size=B)
        return out, lse.masked_fill(~torch.isfinite(lse), 0.0)

    assert torch.autograd.gradcheck(f, floats, eps=1e-6, atol=1e-7)
    out, lse = dflash_attention_reference(*floats, *meta, block_size=B)
    (out.sum() + lse.masked_fill(~torch.isfinite(lse), 0.0).sum()).backward()
    for x in floats:
        assert torch.isfinite(x.grad).all()
    empty = torch.isinf(lse).all(1)  # rows of the invalid block 2 only (block 1 still sees its block)
    assert empty.tolist() == [False] * 4 + [True] * 2 + [False] * 2
    assert (out[empty] == 0).all() and (floats[0].grad[empty] == 0).all()
    assert (floats[3].grad[4:6] == 0).all() and (floats[4].grad[4:6] == 0).all()


def test_masked_nan_inf_do_not_leak():
    """#2: a NaN/inf in a context key/value no query sees, or in an invalid block's q / k_blk / v_blk,
    does not reach out, lse or any gradient (selected away, never multiplied by 0): the results equal
    those with the same entries set to 0 (which by the mask's definition cannot matter)."""
    args, B = _inputs(nb=4, Tk=9)
    q, kc, vc, kb, vb, q_seq, q_anchor, kv_seq, kv_pos = args
    seen = dflash_attention_mask(q_seq, q_anchor, kv_seq, kv_pos, block_size=B, own_block=False).any(0)
    inv = (q_anchor < 0).repeat_interleave(B)
    assert (~seen).any() and inv.any()

    def run(fill):
        x = [t.clone() for t in (q, kc, vc, kb, vb)]
        x[1][~seen], x[2][~seen] = fill[0], fill[1]
        x[0][inv], x[3][inv], x[4][inv] = fill[2], fill[0], fill[1]
        x = [t.requires_grad_(True) for t in x]
        out, lse = dflash_attention_reference(*x, q_seq, q_anchor, kv_seq, kv_pos, block_size=B)
        (out.square().sum() + lse.masked_fill(~torch.isfinite(lse), 0).sum()).backward()
        return [out.detach(), lse.detach()] + [t.grad for t in x]

    got = run((float("inf"), float("nan"), float("nan")))
    want = run((0.0, 0.0, 0.0))
    for a, b in zip(got, want):
        assert not torch.isnan(a).any()
        assert torch.equal(a, b)
