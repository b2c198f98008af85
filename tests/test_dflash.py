"""DFlash semantics (megatron_splitkv.dflash) against direct dense constructions from DESIGN.md section 1.

Expected values are written by hand from the design text (loops over sequences, anchors and offsets),
never from the implementation under test. Loss normalisation is checked across gloo ranks (case C4).
"""

import math

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from megatron_splitkv.dflash import (
    build_draft_blocks,
    dflash_loss,
    loss_decay_weights,
    target_layer_ids,
)
from megatron_splitkv.reference import dflash_attention_mask

MASK = 99


def test_target_layer_ids():
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert target_layer_ids(36, 1) == [18]
    assert target_layer_ids(28, 3) == [1, 13, 25]
    assert target_layer_ids(8, 2) == [1, 5]
    with pytest.raises(ValueError):
        target_layer_ids(3, 2)
    with pytest.raises(ValueError):
        target_layer_ids(8, 0)


def test_decay_weights():
    w = loss_decay_weights(16)
    assert w[0] == 0
    for k in range(1, 16):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)


def _dense_expected(x, seq_lens, loss_mask, q_seq, q_anchor, B, gamma):
    """Loop construction straight from DESIGN.md section 1 over a packed batch."""
    offs = [sum(seq_lens[:j]) for j in range(len(seq_lens))]
    ids, pos, lab, wt, qs, qa = [], [], [], [], [], []
    for j, a in zip(q_seq, q_anchor):
        keep = j >= 0 and a >= 0
        qs.append(j if keep else -1)
        qa.append(a if keep else -1)
        for k in range(B):
            if not keep:
                ids.append(MASK), pos.append(k), lab.append(0), wt.append(0.0)
                continue
            S, o = seq_lens[j], offs[j]
            ids.append(int(x[o + a]) if k == 0 else MASK)
            pos.append(a + k)
            w = 0.0
            if k >= 1 and a + k < S and loss_mask[o + a + k]:
                w = math.exp(-(k - 1) / gamma)
            wt.append(w)
            lab.append(int(x[o + a + k]) if w > 0 else 0)
    # context keys: every token of every sequence, (sequence id, position)
    kv_seq = [j for j in range(len(seq_lens)) for _ in range(seq_lens[j])]
    kv_pos = [t for j in range(len(seq_lens)) for t in range(seq_lens[j])]
    nb = len(qa)
    mask = torch.zeros(nb * B, len(kv_seq) + nb * B, dtype=torch.bool)
    for b in range(nb):
        if qa[b] < 0:
            continue  # invalid blocks see nothing
        for i in range(b * B, (b + 1) * B):
            for t in range(len(kv_seq)):
                mask[i, t] = kv_seq[t] == qs[b] and kv_pos[t] < qa[b]  # strictly before the anchor
            for m in range(b * B, (b + 1) * B):
                mask[i, len(kv_seq) + m] = True  # own block, bidirectional
    T = lambda v, dt=torch.long: torch.tensor(v, dtype=dt)  # noqa: E731
    return dict(ids=T(ids), pos=T(pos), lab=T(lab), wt=T(wt, torch.float64), qs=T(qs), qa=T(qa),
                kv_seq=T(kv_seq), kv_pos=T(kv_pos), mask=mask)


def _check(x, seq_lens, loss_mask, q_seq, q_anchor, B, gamma=None):
    g = gamma if gamma is not None else 7.0 * B / 16
    blk = build_draft_blocks(x, seq_lens, q_seq, q_anchor, block_size=B, mask_token_id=MASK,
                             loss_mask=loss_mask, gamma=gamma)
    exp = _dense_expected(x, list(seq_lens), loss_mask, list(q_seq), list(q_anchor), B, g)
    assert torch.equal(blk.input_ids, exp["ids"])
    assert torch.equal(blk.position_ids, exp["pos"])
    assert torch.equal(blk.labels, exp["lab"])
    torch.testing.assert_close(blk.loss_weight.double(), exp["wt"], rtol=1e-6, atol=0)
    assert torch.equal(blk.q_seq, exp["qs"]) and torch.equal(blk.q_anchor, exp["qa"])
    assert torch.equal(blk.block_keep, exp["qa"] >= 0)
    mask = dflash_attention_mask(blk.q_seq, blk.q_anchor, exp["kv_seq"], exp["kv_pos"], block_size=B)
    assert torch.equal(mask, exp["mask"])
    return blk


def test_blocks_from_sampled_anchors_match_dense():
    from megatron_splitkv.data.anchors import sample_anchors_packed
    from megatron_splitkv.planning import plan_context_parallel

    gen = torch.Generator().manual_seed(0)
    seq_lens, B, P = [24, 11, 3, 2], 4, 3
    x = torch.randint(0, 90, (sum(seq_lens),), generator=gen)
    loss_mask = torch.rand(sum(seq_lens), generator=gen) > 0.25
    anchors = sample_anchors_packed(loss_mask.numpy(), seq_lens, 6, seed=0)
    plan = plan_context_parallel(seq_lens, anchors, block_size=B, cp_size=P, strategy="contiguous")
    blk = _check(x, seq_lens, loss_mask, plan.q_seq.tolist(), plan.q_anchor.tolist(), B)
    assert (~blk.block_keep).any() and blk.num_blocks % P == 0  # padded to a multiple of P
    # one rank's share built alone equals the slice of the whole
    sl = plan.query_slice(1)
    part = build_draft_blocks(x, seq_lens, plan.q_seq[sl], plan.q_anchor[sl], block_size=B,
                              mask_token_id=MASK, loss_mask=loss_mask)
    whole = blk.select_blocks(sl.start, sl.stop)
    for name in ("input_ids", "position_ids", "labels", "loss_weight", "q_seq", "q_anchor", "block_keep"):
        assert torch.equal(getattr(part, name), getattr(whole, name)), name
    # agrees with the data-sharding hook's per-block labels (before the decay)
    from megatron_splitkv.data import shard_batch

    shard = shard_batch({"input_ids": x, "loss_mask": loss_mask}, plan, 1)
    sup = torch.as_tensor(shard["q_label_mask"]).reshape(-1)
    assert torch.equal(part.loss_weight > 0, sup)
    assert torch.equal(part.labels[sup], torch.as_tensor(shard["q_labels"]).reshape(-1)[sup])


def test_edge_anchors_overlapping_and_padding():
    seq_lens, B = [10, 7], 4
    x = (torch.arange(17) * 7) % 90
    loss_mask = torch.ones(17, dtype=torch.bool)
    loss_mask[3] = False
    # anchor at 0, overlapping anchors 1 and 2, anchor at the last token (nothing to predict),
    # anchors of sequence 1 near its end, two padding blocks (planner convention: seq -1, anchor -1)
    q_seq = [0, 0, 0, 0, 1, 1, -1, -1]
    q_anchor = [0, 1, 2, 9, 4, 6, -1, -1]
    blk = _check(x, seq_lens, loss_mask, q_seq, q_anchor, B)
    w = blk.loss_weight.view(-1, B)
    assert float(w[3].sum()) == 0.0  # anchor at the end: a+k >= S for all k >= 1
    assert float(w[0, 3]) == 0.0  # loss_mask[3] = 0
    assert float(w[6:].sum()) == 0.0  # padding blocks
    assert bool((w[4, 1:3] > 0).all()) and float(w[4, 3]) == 0.0  # sequence 1 ends at 7
    assert float(w[5].sum()) == 0.0
    # anchor 0 sees no context key
    m = dflash_attention_mask(blk.q_seq, blk.q_anchor, torch.tensor([0] * 10 + [1] * 7),
                              torch.tensor(list(range(10)) + list(range(7))), block_size=B)
    assert not m[:B, :17].any()
    _check(x, seq_lens, loss_mask, q_seq, q_anchor, B, gamma=2.5)  # non-default gamma


def test_bad_anchor_raises():
    x = torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError):
        build_draft_blocks(x, [5], [0], [5], block_size=4, mask_token_id=MASK)
    with pytest.raises(ValueError):
        build_draft_blocks(x, [4], [0], [0], block_size=4, mask_token_id=MASK)


# ---------------------------------------------------------------- loss normalisation across ranks (C4)

def _c4_inputs():
    gen = torch.Generator().manual_seed(1)
    Lq, V = 64, 11
    logits = torch.randn(Lq, V, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, V, (Lq,), generator=gen)
    w = torch.rand(Lq, generator=gen, dtype=torch.float64) + 0.1
    w[-16:] = 0  # the last 16 queries are unsupervised: at P = 4 one rank holds none
    return logits, labels, w


def _single(logits, labels, w):
    lg = logits.clone().requires_grad_(True)
    ce = torch.nn.functional.cross_entropy(lg, labels, reduction="none")
    out = dflash_loss(ce, w, None)
    out.loss.backward()
    return out, lg.grad


def _loss_rank(rank, world, zero_all):
    logits, labels, w = _c4_inputs()
    if zero_all:
        w = torch.zeros_like(w)
    n = logits.shape[0] // world
    sl = slice(rank * n, (rank + 1) * n)
    lg = logits[sl].clone().requires_grad_(True)
    ce = torch.nn.functional.cross_entropy(lg, labels[sl], reduction="none")
    out = dflash_loss(ce, w[sl], dist.group.WORLD)
    out.loss.backward()
    total_parts = out.loss.detach().clone()
    dist.all_reduce(total_parts)
    # plain Python values: tensors sent through the result queue would not outlive the worker
    return dict(loss=float(out.loss.detach()), sum=float(total_parts), total=float(out.total),
                den=float(out.weight_sum), grad=lg.grad.tolist())


@pytest.mark.parametrize("zero_all", [False, True])
def test_loss_normalisation_across_ranks_c4(zero_all):
    logits, labels, w = _c4_inputs()
    if zero_all:
        w = torch.zeros_like(w)
    ref, ref_grad = _single(logits, labels, w)
    # direct expected value: sum(w*CE)/sum(w) (0 when nothing is supervised)
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    expected = 0.0 if zero_all else float((w * ce).sum() / w.sum())
    assert math.isclose(float(ref.total), expected, rel_tol=1e-6, abs_tol=1e-12)
    res = run_distributed(_loss_rank, 4, zero_all, timeout=120)
    n = logits.shape[0] // 4
    for r, out in enumerate(res):
        out["grad"] = torch.tensor(out["grad"], dtype=torch.float64)
        assert math.isclose(out["sum"], expected, rel_tol=1e-6, abs_tol=1e-12)
        assert math.isclose(out["total"], expected, rel_tol=1e-6, abs_tol=1e-12)
        assert math.isfinite(out["loss"])
        assert torch.isfinite(out["grad"]).all()
        torch.testing.assert_close(out["grad"].double(), ref_grad[r * n : (r + 1) * n].double(),
                                   rtol=1e-5, atol=1e-7)
    assert res[3]["loss"] == 0.0 and float(res[3]["grad"].abs().max()) == 0.0  # the unsupervised rank


# ---------------------------------------------------------------- regressions (tester's defects, #8)

def test_loss_ignores_nonfinite_ce_at_zero_weight():
    """A CE of inf/NaN at weight-0 positions (unsupervised / padding tokens) does not make the loss or
    the gradients NaN: expected = sum over w > 0 of w * CE / sum(w), computed directly."""
    gen = torch.Generator().manual_seed(3)
    ce_vals = torch.rand(8, generator=gen, dtype=torch.float64)
    w = torch.rand(8, generator=gen, dtype=torch.float64)
    w[[1, 4, 6]] = 0
    ce_vals[1], ce_vals[4], ce_vals[6] = float("inf"), float("nan"), float("-inf")
    ce = ce_vals.clone().requires_grad_(True)
    out = dflash_loss(ce, w, None)
    out.loss.backward()
    keep = w > 0
    expected = float((ce_vals[keep] * w[keep]).sum() / w.sum())
    assert math.isclose(out.loss.item(), expected, rel_tol=1e-12)
    assert math.isclose(out.total.item(), expected, rel_tol=1e-12)
    assert torch.allclose(ce.grad, torch.where(keep, w / w.sum(), torch.zeros_like(w)), rtol=1e-12, atol=0)


def test_build_draft_blocks_rejects_bad_block_size_lens_and_ids():
    from megatron_splitkv.data.anchors import sample_anchors_packed

    x = torch.arange(8)
    for B in (0, -2, 1):
        with pytest.raises(ValueError, match="block_size"):
            build_draft_blocks(x, [8], [0], [2], block_size=B, mask_token_id=MASK)
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        build_draft_blocks(torch.arange(8), [10, -2], [0], [2], block_size=4, mask_token_id=MASK)
    with pytest.raises(ValueError, match="input_ids must have an integer dtype"):
        build_draft_blocks(torch.rand(8), [8], [0], [2], block_size=4, mask_token_id=MASK)
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        sample_anchors_packed(torch.ones(6).numpy(), [8, -2], 3, seed=0)
