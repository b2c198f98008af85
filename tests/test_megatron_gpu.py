"""The DFlash block from the Split-KV spec on one CUDA GPU (skipped without CUDA).

CP=1 (world of one, gloo): bf16 and fp32 block on the GPU, fused op (`backend="auto"`), against the
float64 functional reference of test_megatron_block.py.
"""

import pytest
import torch

from _dist import run_distributed
from test_megatron_block import B, _config, functional_block, make_problem

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_worker(rank, world, cfg, state, data, dtype):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_splitkv.megatron import DFlashPackedSeqParams, get_dflash_layer_spec

    ps.initialize_model_parallel(create_gloo_process_groups=False)
    try:
        dev = torch.device("cuda", 0)
        block = TransformerBlock(_config(cfg, 1, 1, 1), get_dflash_layer_spec("splitkv", use_te=False,
                                 rotary_base=10000.0), post_layer_norm=True)
        block.load_state_dict({k: v for k, v in state.items()}, strict=False)
        block = block.to(dev, dtype)
        params = DFlashPackedSeqParams(q_seq=data["q_seq"].to(dev), q_anchor=data["q_anchor"].to(dev),
                                       kv_seq=data["kv_seq"].to(dev), kv_pos=data["kv_pos"].to(dev),
                                       block_size=B)
        h = data["h"].to(dev, dtype).requires_grad_(True)
        ctx = data["ctx"].to(dev, dtype).requires_grad_(True)
        out = block(hidden_states=h, attention_mask=None, context=ctx, packed_seq_params=params)
        (out.float() * data["w_out"].to(dev)).sum().backward()
        grads = {k: p.grad.double().cpu() for k, p in block.named_parameters()}
        return out.double().cpu(), h.grad.double().cpu(), ctx.grad.double().cpu(), grads
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-4), (torch.bfloat16, 4e-2)])
def test_block_on_gpu_matches_float64_reference(dtype, tol):
    cfg, state, data = make_problem(hidden=128, heads=8, groups=2, kv_channels=16, ffn=128, num_layers=2)
    out_r, dh_r, dctx_r, grads_r = functional_block(cfg, state, data)
    out, dh, dctx, grads = run_distributed(_gpu_worker, 1, cfg, state, data, dtype, timeout=300)[0]

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    errs = {"out": rel(out[:, 0], out_r), "dh": rel(dh[:, 0], dh_r), "dctx": rel(dctx[:, 0], dctx_r)}
    errs.update({k: rel(g, grads_r[k]) for k, g in grads.items()})
    print(dtype, {k: f"{v:.2e}" for k, v in errs.items()})
    assert all(torch.isfinite(t).all() for t in (out, dh, dctx))
    bad = {k: v for k, v in errs.items() if not v < tol}
    assert not bad, bad
