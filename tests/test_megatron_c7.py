"""Case C7: head split under TP + CP with grouped-query attention (DESIGN cases/README.md).

* H=12, Hkv=4, TP=4, CP=2 (8 ranks): the DFlash block equals the single-process model, whose attention
  uses Megatron's grouping q head h -> kv head h // (H / Hkv); so every TP shard maps its local q
  heads to the right local kv head.
* H=12, Hkv=3, TP=2: a clear error at construction naming the flag, on every rank, no hang.
"""

import pytest

from _dist import run_distributed
from test_megatron_block import assemble, block_worker, compare, functional_reference, make_problem

pytest.importorskip("megatron.core")


def test_c7_gqa_tp4_cp2_mapping():
    cfg, state, data = make_problem(hidden=24, heads=12, groups=4, kv_channels=4, ffn=16, num_layers=1, seed=7)
    # float64 single-process functional reference (attention via dflash_attention_reference, whose
    # grouping is q head h -> kv head h // (H / Hkv) = h // 3); the block's CP=1 equivalence to it
    # is covered by test_megatron_block.py
    ref = functional_reference(cfg, state, data)
    res = run_distributed(block_worker, 8, 4, 2, 1, cfg, state, data, ("splitkv",), "sbhd", timeout=400)
    compare(ref, assemble(res, cfg, data, 2), cfg)


def _bad_gqa_worker(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_splitkv.megatron import get_dflash_layer_spec
    from test_megatron_block import _config

    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    msgs = {}
    try:
        cfg = dict(hidden=24, heads=12, groups=3, kv_channels=4, ffn=16, num_layers=1)
        for config_tp in (2, 1):
            try:
                config = _config(cfg, 2, 1, 1, config_tp=config_tp)
                TransformerBlock(config, get_dflash_layer_spec("splitkv", use_te=False))
                msgs[config_tp] = "no error"
            except ValueError as e:
                msgs[config_tp] = f"{type(e).__name__}: {e}"
        return msgs
    finally:
        ps.destroy_model_parallel()


def test_c7_gqa_heads_not_divisible_errors_at_construction():
    # config TP=2: TransformerConfig itself rejects it; config TP=1 (config not told about TP, the TP
    # group comes from parallel_state): DFlashAttention's own check fires, naming --num-query-groups.
    # Either way every rank raises at construction (no collective is entered): no hang.
    res = run_distributed(_bad_gqa_worker, 2, timeout=120)
    for msgs in res:
        for config_tp, msg in msgs.items():
            assert msg != "no error", config_tp
            assert "num_query_groups" in msg or "--num-query-groups" in msg, msg
            assert "3" in msg and "2" in msg
        assert "--num-query-groups (3)" in msgs[1] and "--tensor-model-parallel-size (2)" in msgs[1], msgs[1]


def test_c7_validate_args_names_flag():
    import argparse

    from megatron_splitkv.megatron import SplitKVArgumentError, validate_splitkv_args

    args = argparse.Namespace(
        context_parallel_impl="splitkv", tensor_model_parallel_size=2, context_parallel_size=2,
        num_attention_heads=12, num_query_groups=3, group_query_attention=True, micro_batch_size=1,
        dflash_num_anchors=8,
    )
    with pytest.raises(SplitKVArgumentError, match="--num-query-groups \\(3\\).*--tensor-model-parallel-size \\(2\\)"):
        validate_splitkv_args(args)
