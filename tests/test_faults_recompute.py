"""A setting that cannot take effect must not be silently ignored (issue 24): Megatron's selective recompute of the
core attention (`--recompute-granularity selective --recompute-modules core_attn`, i.e.
`TransformerConfig.recompute_granularity = "selective"` with "core_attn" in `recompute_modules`) was ignored by
the DFlash attention layer (0 recomputes in backward). Now the layer runs its core attention through
Megatron's `_checkpointed_attention_forward`: the core attention runs again in backward (counted), and the
outputs and every gradient equal the run without recompute bitwise.

The DFlash block of tests/test_megatron_block.py (2 layers, float64, CPU) at CP = 2 over gloo, per CP
implementation.
"""

import pytest
import torch

from _dist import run_distributed

pytest.importorskip("megatron.core")

import test_megatron_block as tmb  # noqa: E402


def _worker(rank, world, cfg, state, data, impl):
    from megatron.core import parallel_state as ps

    from megatron_splitkv.megatron import splitkv_core_attention

    core_cls = splitkv_core_attention(impl)
    core_cls = getattr(core_cls, "func", core_cls)  # a functools.partial of the class
    calls = {"n": 0}
    orig_forward = core_cls.forward

    def counted(self, *a, **k):
        calls["n"] += 1
        return orig_forward(self, *a, **k)

    core_cls.forward = counted
    orig_config = tmb._config

    def run(recompute):
        def config(*a, **k):
            c = orig_config(*a, **k)
            if recompute:
                c.recompute_granularity = "selective"
                c.recompute_modules = ["core_attn"]
            return c

        tmb._config = config
        calls["n"] = 0
        torch.manual_seed(1234)
        out = tmb._run_block(1, world, 1, cfg, state, data, impl, "sbhd")
        out["core_calls"] = calls["n"]
        return out

    ps.initialize_model_parallel(context_parallel_size=world, create_gloo_process_groups=False)
    try:
        return run(False), run(True)
    finally:
        ps.destroy_model_parallel()
        tmb._config = orig_config
        core_cls.forward = orig_forward


@pytest.mark.parametrize("impl", ["splitkv"])  # the layer code is the same for every CP implementation
def test_selective_core_attn_recompute_runs_and_gradients_equal(impl):
    cfg, state, data = tmb.make_problem(hidden=32, heads=4, groups=2, kv_channels=8, ffn=64, num_layers=2)
    for plain, recomputed in run_distributed(_worker, 2, cfg, state, data, impl, timeout=300):
        layers = cfg["num_layers"]
        assert plain["core_calls"] == layers  # forward only
        assert recomputed["core_calls"] == 2 * layers  # forward + the recompute in backward
        assert torch.equal(plain["out"], recomputed["out"])
        assert torch.equal(plain["h_grad"], recomputed["h_grad"])
        assert torch.equal(plain["ctx_grad"], recomputed["ctx_grad"])
        assert plain["grads"].keys() == recomputed["grads"].keys()
        for k in plain["grads"]:
            assert torch.equal(plain["grads"][k], recomputed["grads"][k]), k
