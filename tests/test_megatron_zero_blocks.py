"""SplitKVCoreAttention at CP=2 where rank 1 holds zero query blocks (sbhd and thd): rank 0's output and every
rank's gradients equal the float64 single-process reference; rank 1's output is an empty [0, b, H*D]."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_splitkv.reference import dflash_attention_reference  # noqa: E402
from _dist import run_distributed  # noqa: E402
from _warning_marks import MEGATRON_ENV  # noqa: E402

pytestmark = MEGATRON_ENV

B, H, HKV, D, SK = 4, 4, 2, 8, 6


def _problem():
    g = torch.Generator().manual_seed(3)
    nb = 3
    q = torch.randn(nb * B, H, D, generator=g, dtype=torch.float64)
    k_ctx, v_ctx = (torch.randn(SK, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    k_blk, v_blk = (torch.randn(nb * B, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(nb * B, H, D, generator=g, dtype=torch.float64)
    meta = dict(q_seq=torch.zeros(nb, dtype=torch.int64), q_anchor=torch.tensor([0, 2, 5]),
                kv_seq=torch.zeros(SK, dtype=torch.int64), kv_pos=torch.arange(SK))
    return q, k_ctx, v_ctx, k_blk, v_blk, w, meta


def _worker(rank, world, fmt, cp_impl):
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_splitkv.megatron import DFlashPackedSeqParams, splitkv_core_attention

    ps.initialize_model_parallel(context_parallel_size=world, create_gloo_process_groups=False)
    try:
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=H, num_query_groups=HKV,
                                kv_channels=D, context_parallel_size=world, use_cpu_initialization=True,
                                attention_dropout=0.0)
        pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        core = splitkv_core_attention(cp_impl)(
            config=cfg, layer_number=1, attn_mask_type=AttnMaskType.no_mask, attention_type="cross",
            cp_comm_type=None, softmax_scale=None, pg_collection=pgs)
        q, k_ctx, v_ctx, k_blk, v_blk, w, meta = _problem()
        nb = meta["q_seq"].numel() if rank == 0 else 0  # rank 0: every query block; rank 1: none
        ch = SK // world
        cs = slice(rank * ch, (rank + 1) * ch)  # the context is split evenly
        ql, kb, vb, wl = (x[: nb * B].clone() for x in (q, k_blk, v_blk, w))
        kc, vc = k_ctx[cs].clone(), v_ctx[cs].clone()
        leaves = [t.requires_grad_(True) for t in (ql, kc, vc, kb, vb)]
        params = DFlashPackedSeqParams(qkv_format=fmt, q_seq=meta["q_seq"][:nb], q_anchor=meta["q_anchor"][:nb],
                                       kv_seq=meta["kv_seq"][cs], kv_pos=meta["kv_pos"][cs], block_size=B)
        key, value = torch.cat([kc, kb]), torch.cat([vc, vb])
        if fmt == "sbhd":
            out = core(ql[:, None], key[:, None], value[:, None], None, attn_mask_type=AttnMaskType.no_mask,
                       attention_bias=None, packed_seq_params=params)
            assert out.shape == (nb * B, 1, H * D), out.shape
        else:
            out = core(ql, key, value, None, attn_mask_type=AttnMaskType.no_mask, attention_bias=None,
                       packed_seq_params=params)
            assert out.shape == (nb * B, H * D), out.shape
        out = out.reshape(nb * B, H, D)
        (out * wl).sum().backward()
        return {"out": out.detach(), "grads": [t.grad for t in leaves], "cs": (cs.start, cs.stop)}
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_cp_rank_with_zero_query_blocks_equals_reference(fmt):
    q, k_ctx, v_ctx, k_blk, v_blk, w, meta = _problem()
    leaves = [t.clone().requires_grad_(True) for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
    ref, _ = dflash_attention_reference(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], meta["q_seq"],
                                        meta["q_anchor"], meta["kv_seq"], meta["kv_pos"], block_size=B)
    (ref * w).sum().backward()
    res = run_distributed(_worker, 2, fmt, "splitkv", timeout=240)
    torch.testing.assert_close(res[0]["out"], ref.detach(), rtol=1e-10, atol=1e-10)
    assert res[1]["out"].shape == (0, H, D)
    for r, rr in enumerate(res):
        a, b = rr["cs"]
        dq, dkc, dvc, dkb, dvb = rr["grads"]
        torch.testing.assert_close(dkc, leaves[1].grad[a:b], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(dvc, leaves[2].grad[a:b], rtol=1e-10, atol=1e-10)
        if r == 0:
            for got, want in ((dq, leaves[0]), (dkb, leaves[3]), (dvb, leaves[4])):
                torch.testing.assert_close(got, want.grad, rtol=1e-10, atol=1e-10)
