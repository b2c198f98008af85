"""SplitKVCoreAttention alone, one process, no process groups: layouts (sbhd with b > 1, thd) and errors."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_splitkv.megatron import DFlashPackedSeqParams, splitkv_core_attention  # noqa: E402
from megatron_splitkv.reference import dflash_attention_reference  # noqa: E402
from _warning_marks import MEGATRON_ENV  # marks of the warnings these tests trigger

pytestmark = MEGATRON_ENV

B, H, HKV, D = 4, 4, 2, 8


def _core(cp_impl="splitkv"):
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=H, num_query_groups=HKV,
                            kv_channels=D, use_cpu_initialization=True, attention_dropout=0.0)
    return splitkv_core_attention(cp_impl)(
        config=cfg, layer_number=1, attn_mask_type=AttnMaskType.no_mask, attention_type="cross",
        cp_comm_type=None, softmax_scale=None, pg_collection=None,
    )


def _meta(b, sq, sk):
    """Sample-major metadata: sample i has sequence id i, context positions 0..sk-1."""
    nb = sq // B
    q_seq = torch.arange(b).repeat_interleave(nb)
    q_anchor = torch.tensor([0, 3, sk, -1, 2, sk - 1][: b * nb], dtype=torch.int64)
    kv_seq = torch.arange(b).repeat_interleave(sk)
    kv_pos = torch.arange(sk).repeat(b)
    return q_seq, q_anchor, kv_seq, kv_pos


@pytest.mark.parametrize("cp_impl", ["splitkv", "allgather-kv", "ring-kv"])
def test_sbhd_batch2_and_thd_match_reference(cp_impl):
    g = torch.Generator().manual_seed(0)
    b, sq, sk = 2, 12, 5
    q = torch.randn(sq, b, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(sk + sq, b, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(sk + sq, b, HKV, D, generator=g, dtype=torch.float64)
    q_seq, q_anchor, kv_seq, kv_pos = _meta(b, sq, sk)
    core = _core(cp_impl)
    p = DFlashPackedSeqParams(q_seq=q_seq, q_anchor=q_anchor, kv_seq=kv_seq, kv_pos=kv_pos, block_size=B)
    out = core(q, k, v, None, attn_mask_type=AttnMaskType.no_mask, attention_bias=None, packed_seq_params=p)
    assert out.shape == (sq, b, H * D)

    def flat(x):
        return x.transpose(0, 1).reshape(-1, x.shape[2], x.shape[3])

    ref, _ = dflash_attention_reference(flat(q), flat(k[:sk]), flat(v[:sk]), flat(k[sk:]), flat(v[sk:]),
                                        q_seq, q_anchor, kv_seq, kv_pos, block_size=B)
    torch.testing.assert_close(out.transpose(0, 1).reshape(b * sq, H, D), ref, rtol=1e-10, atol=1e-10)
    # thd: the same tokens, flattened, keys [all context | all block tokens]
    pt = DFlashPackedSeqParams(qkv_format="thd", q_seq=q_seq, q_anchor=q_anchor, kv_seq=kv_seq, kv_pos=kv_pos,
                               block_size=B)
    kt = torch.cat([flat(k[:sk]), flat(k[sk:])])
    vt = torch.cat([flat(v[:sk]), flat(v[sk:])])
    out_t = core(flat(q), kt, vt, None, attn_mask_type=AttnMaskType.no_mask, attention_bias=None,
                 packed_seq_params=pt)
    torch.testing.assert_close(out_t.view(-1, H, D), ref, rtol=1e-10, atol=1e-10)


def test_errors():
    core = _core()
    q = torch.randn(8, 1, H, D)
    k = torch.randn(8 + 3, 1, HKV, D)
    q_seq, q_anchor = torch.zeros(2, dtype=torch.int64), torch.tensor([1, 2])
    kv_seq, kv_pos = torch.zeros(3, dtype=torch.int64), torch.arange(3)
    with pytest.raises(ValueError, match="int64"):
        bad = DFlashPackedSeqParams(q_seq=q_seq.int(), q_anchor=q_anchor, kv_seq=kv_seq, kv_pos=kv_pos, block_size=4)
        core(q, k, k, None, attn_mask_type=None, attention_bias=None, packed_seq_params=bad)
    p = DFlashPackedSeqParams(q_seq=q_seq, q_anchor=q_anchor, kv_seq=kv_seq, kv_pos=kv_pos, block_size=4)
    with pytest.raises(ValueError, match="key length"):
        core(q, k[:-1], k[:-1], None, attn_mask_type=None, attention_bias=None, packed_seq_params=p)
    with pytest.raises(NotImplementedError, match="attention_bias"):
        core(q, k, k, None, attn_mask_type=None, attention_bias=torch.zeros(1), packed_seq_params=p)
    with pytest.raises(ValueError, match="--context-parallel-impl"):
        splitkv_core_attention("ulysses")
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=H, attention_dropout=0.1,
                            use_cpu_initialization=True)
    with pytest.raises(ValueError, match="--attention-dropout"):
        splitkv_core_attention()(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.no_mask,
                                 attention_type="cross", cp_comm_type=None, softmax_scale=None, pg_collection=None)


@pytest.mark.parametrize("cp_impl", ["splitkv", "allgather-kv", "ring-kv"])
def test_op_metadata_built_once_per_params(cp_impl, monkeypatch):
    """Several layers (fresh q/k/v, sbhd b = 2) on one DFlashPackedSeqParams: the op metadata is
    prepared once (first layer) and reused; every layer still matches the reference."""
    import megatron_splitkv.megatron.attention as att

    calls = []
    real = att.prepare_splitkv_metadata
    monkeypatch.setattr(att, "prepare_splitkv_metadata", lambda *a, **k: calls.append(k) or real(*a, **k))
    b, sq, sk = 2, 12, 5
    q_seq, q_anchor, kv_seq, kv_pos = _meta(b, sq, sk)
    p = DFlashPackedSeqParams(q_seq=q_seq, q_anchor=q_anchor, kv_seq=kv_seq, kv_pos=kv_pos, block_size=B)
    core = _core(cp_impl)

    def flat(x):
        return x.transpose(0, 1).reshape(-1, x.shape[2], x.shape[3])

    for layer in range(3):
        g = torch.Generator().manual_seed(layer)
        q = torch.randn(sq, b, H, D, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(sk + sq, b, HKV, D, generator=g, dtype=torch.float64)
        v = torch.randn(sk + sq, b, HKV, D, generator=g, dtype=torch.float64)
        out = core(q, k, v, None, attn_mask_type=AttnMaskType.no_mask, attention_bias=None, packed_seq_params=p)
        out.sum().backward()
        ref, _ = dflash_attention_reference(flat(q), flat(k[:sk]), flat(v[:sk]), flat(k[sk:]), flat(v[sk:]),
                                            q_seq, q_anchor, kv_seq, kv_pos, block_size=B)
        torch.testing.assert_close(out.transpose(0, 1).reshape(b * sq, H, D), ref, rtol=1e-10, atol=1e-10)
    assert len(calls) == 1 and calls[0]["impl"] == cp_impl and calls[0]["num_heads_q"] == H
    assert len(p._op_metadata) == 1
    # another dtype (or head count, impl, device, group) is another cache entry
    core(torch.randn(sq, b, H, D), torch.randn(sk + sq, b, HKV, D), torch.randn(sk + sq, b, HKV, D), None,
         attn_mask_type=AttnMaskType.no_mask, attention_bias=None, packed_seq_params=p)
    assert len(calls) == 2 and len(p._op_metadata) == 2


@pytest.mark.parametrize("cp_impl", ["splitkv", "allgather-kv", "ring-kv"])
def test_plain_cross_attention_matches_dense_softmax(cp_impl):
    """packed_seq_params=None: every query sees every unmasked key of its sample (one process; the CP
    version runs in tests/test_megatron_block.py)."""
    g = torch.Generator().manual_seed(3)
    sq, b, sk = 5, 3, 9
    q = torch.randn(sq, b, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sk, b, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sk, b, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    masked = torch.zeros(b, 1, 1, sk, dtype=torch.bool)
    masked[1, ..., 4:] = True
    masked[2, ..., ::2] = True
    core = _core(cp_impl)
    out = core(q, k, v, masked, attn_mask_type=AttnMaskType.padding, attention_bias=None, packed_seq_params=None)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    kk, vv = k.repeat_interleave(H // HKV, 2), v.repeat_interleave(H // HKV, 2)
    s = torch.einsum("qbhd,kbhd->bhqk", q, kk) / D**0.5
    ref = torch.einsum("bhqk,kbhd->qbhd", s.masked_fill(masked, float("-inf")).softmax(-1), vv).reshape(sq, b, -1)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)
    # no mask, and a mask broadcast over the batch
    out = core(q, k, v, None, attn_mask_type=AttnMaskType.no_mask, attention_bias=None, packed_seq_params=None)
    ref = torch.einsum("bhqk,kbhd->qbhd", s.softmax(-1), vv).reshape(sq, b, -1)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    out = core(q, k, v, masked[2:], attn_mask_type=AttnMaskType.padding, attention_bias=None,
               packed_seq_params=None)
    ref = torch.einsum("bhqk,kbhd->qbhd", s.masked_fill(masked[2:], float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(out, ref.reshape(sq, b, -1), rtol=1e-10, atol=1e-10)
    with pytest.raises(NotImplementedError, match="key-padding"):
        core(q, k, v, torch.zeros(b, 1, sq, sk, dtype=torch.bool), attn_mask_type=AttnMaskType.padding,
             attention_bias=None, packed_seq_params=None)
    with pytest.raises(NotImplementedError, match="causal"):
        core(q, k, v, None, attn_mask_type=AttnMaskType.causal, attention_bias=None, packed_seq_params=None)
