"""Sliding-window / causal drafter layers in Megatron (issue 23 item 3): the flags, their errors, and a block
mixing windowed and full layers at TP 2 x CP 2 equal to CP 1, itself equal to the float64 functional reference
(megatron_splitkv.reference with window / causal per layer). CPU, gloo."""

import argparse

import pytest
import torch

pytest.importorskip("megatron.core")

from _dist import run_distributed  # noqa: E402
from _warning_marks import MEGATRON_ENV  # noqa: E402
from test_megatron_block import SMALL, assemble, block_worker, compare, functional_reference, make_problem  # noqa: E402

from megatron_splitkv.megatron import (SplitKVArgumentError, add_splitkv_args,  # noqa: E402
                                       validate_splitkv_args)
from megatron_splitkv.megatron.arguments import (host_metadata_from_args, layer_attention_from_args,  # noqa: E402
                                                 planner_cost_model_from_args)
from megatron_splitkv.megatron.sharding import planner_kwargs_from_args  # noqa: E402

pytestmark = MEGATRON_ENV

# the block of test_megatron_block (B = 4, anchors up to 10 in sequences of 11 and 9 tokens): a window
# smaller than the block, the full layer, the same window again (one metadata for both), and a window larger
# than the block with dflash's is_causal = false (symmetric inside the block)
KINDS = ((3, True), (None, False), (3, True), (6, False))


def _parse(argv, num_layers=4):
    p = argparse.ArgumentParser()
    add_splitkv_args(p)
    a = p.parse_args(["--context-parallel-impl", "splitkv", *argv])
    a.num_layers = num_layers
    return a


def test_flags_give_dflash_layer_kinds():
    a = _parse(["--dflash-layer-types", "sliding_attention,full_attention, sliding_attention,full_attention",
                "--dflash-sliding-window", "2048"])
    validate_splitkv_args(a)
    assert layer_attention_from_args(a) == ((2048, True), (None, False), (2048, True), (None, False))
    a = _parse(["--dflash-layer-types", "sliding_attention,full_attention", "--dflash-sliding-window", "64",
                "--dflash-is-causal", "false"], num_layers=2)
    assert layer_attention_from_args(a) == ((64, False), (None, False))
    a = _parse(["--dflash-is-causal", "true"], num_layers=3)  # no types: every layer full, causal block
    assert layer_attention_from_args(a) == ((None, True),) * 3
    assert layer_attention_from_args(_parse([])) is None


def test_planner_gets_the_layer_windows():
    a = _parse(["--dflash-layer-types", "sliding_attention,full_attention,sliding_attention",
                "--dflash-sliding-window", "128"], num_layers=3)
    assert planner_cost_model_from_args(a).layer_windows == (128, None, 128)
    assert planner_kwargs_from_args(a)["cost_model"].layer_windows == (128, None, 128)
    # causal-only layers change no context cost: the default model
    assert planner_cost_model_from_args(_parse(["--dflash-is-causal", "true"])) is None


@pytest.mark.parametrize("argv,num_layers,message", [
    (["--dflash-layer-types", "sliding_attention,full_attention", "--dflash-sliding-window", "8"], 3,
     "--dflash-layer-types must name one type per drafter layer: --num-layers is 3, got 2"),
    (["--dflash-layer-types", "sliding_attention,full_attention"], 2,
     "--dflash-sliding-window (the window W, an int >= 1) is required"),
    (["--dflash-sliding-window", "8"], 2, "--dflash-sliding-window (8) applies to sliding_attention layers"),
])
def test_bad_layer_flag_combinations_name_the_flag(argv, num_layers, message):
    with pytest.raises(SplitKVArgumentError) as e:
        validate_splitkv_args(_parse(argv, num_layers))
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("kernel", ["te", "staircase"])
@pytest.mark.parametrize("argv", [["--dflash-layer-types", "sliding_attention,full_attention",
                                   "--dflash-sliding-window", "8"], ["--dflash-is-causal", "true"]])
def test_kernels_without_row_bounds_refused_for_windowed_layers(kernel, argv):
    """te and staircase refuse windowed / causal layers in the op: the flags are refused at parse time."""
    a = _parse(["--splitkv-kernel", kernel, *argv], num_layers=2)
    with pytest.raises(SplitKVArgumentError, match=f"--splitkv-kernel {kernel} does not support sliding-window"):
        validate_splitkv_args(a, have_te=True)
    a = _parse(["--splitkv-kernel", kernel, "--dflash-layer-types", "full_attention,full_attention"], num_layers=2)
    validate_splitkv_args(a, have_te=True)


@pytest.mark.parametrize("argv,message", [
    (["--dflash-sliding-window", "0"], "argument --dflash-sliding-window: must be a positive int < 2**63, got '0'"),
    (["--dflash-sliding-window", "-4"], "argument --dflash-sliding-window: must be a positive int < 2**63, got '-4'"),
    (["--dflash-sliding-window", str(2**63)],
     f"argument --dflash-sliding-window: must be a positive int < 2**63, got '{2**63}'"),
    (["--dflash-layer-types", "full_attention,swa"], "argument --dflash-layer-types: must be a comma-separated list "
                                                     "of full_attention / sliding_attention"),
    (["--dflash-is-causal", "yes"], "argument --dflash-is-causal: invalid choice"),
])
def test_bad_layer_flag_values_are_argparse_errors(argv, message, capsys):
    p = argparse.ArgumentParser()
    add_splitkv_args(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_data_pipeline_plans_with_the_windowed_cost():
    """prefetch_planned_batches (examples/pretrain_dflash.py's data pipeline) plans every batch with the layer
    windows of the flags: the item's plan loads equal a plan made with that cost model directly."""
    import numpy as np
    from test_data_pipeline import MASK_ID, _source

    from megatron_splitkv.megatron import prefetch_planned_batches
    from megatron_splitkv.planning import CostModel, plan_context_parallel

    a = _parse(["--dflash-layer-types", "sliding_attention,full_attention", "--dflash-sliding-window", "16",
                "--dflash-block-size", "4", "--cp-chunk-size", "64", "--dflash-data-workers", "0"], num_layers=2)
    it = prefetch_planned_batches(_source(), a, mask_token_id=MASK_ID, cp_rank=0, cp_size=2)
    item = next(it)
    cm = CostModel(layer_windows=(16, None))
    assert item.plan.cost_model == cm
    batch = next(iter(_source()()))
    want = plan_context_parallel(batch.seq_lens, batch.anchors, block_size=4, cp_size=2, chunk_size=64,
                                 cost_model=cm)
    np.testing.assert_array_equal(item.plan.loads, want.loads)
    full = plan_context_parallel(batch.seq_lens, batch.anchors, block_size=4, cp_size=2, chunk_size=64)
    assert full.loads.sum() > want.loads.sum()  # the window lowers the modelled work
    it.close()


def test_host_metadata_with_layer_kinds():
    """--dflash-host-metadata (built in the data workers) is built for the first layer's kind; on by default as
    without layer kinds (the other kinds are derived in the step)."""
    from megatron_splitkv.megatron import splitkv_metadata_spec
    from test_megatron_block import _config

    cfg = _config(dict(SMALL, num_layers=2), 1, 1, 1)
    for types, want in (("sliding_attention,full_attention", (8, True)), ("full_attention,sliding_attention",
                                                                          (None, False))):
        a = _parse(["--dflash-layer-types", types, "--dflash-sliding-window", "8"], num_layers=2)
        validate_splitkv_args(a)
        assert host_metadata_from_args(a, num_workers=1) is True
        spec = splitkv_metadata_spec(cfg, tp_size=1, cuda=False, layer_attention=layer_attention_from_args(a))
        assert (spec.window, spec.causal) == want


def test_worker_metadata_of_a_windowed_model_equals_prepare_from_plan():
    """The data pipeline's host-built metadata with a window (MetadataSpec.window / causal) is the from-plan
    metadata of that kind; bound, a layer of that kind takes it and a layer of another kind derives its own."""
    from test_data_pipeline import MASK_ID, _source

    from megatron_splitkv.data.pipeline import MetadataSpec, plan_batch
    from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan

    spec = MetadataSpec(num_heads_q=2, num_heads_kv=1, head_dim=8, dtype=torch.float64, window=5,
                        causal=True)
    batch = next(iter(_source()()))
    item = plan_batch(batch, cp_size=2, cp_rank=1, block_size=4, mask_token_id=MASK_ID, chunk_size=64,
                      metadata=spec)
    want = prepare_splitkv_metadata_from_plan(item.plan, 1, block_size=4, num_heads_q=2, num_heads_kv=1, head_dim=8,
                                              dtype=spec.dtype, window=5, causal=True)
    got = item.metadata
    assert (got.window, got.causal) == (5, True)
    for name in ("q_seq", "q_anchor", "kv_seq", "kv_pos"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # bound (one process, CP 1) and given to a layer of another kind: refused, naming the kind
    from megatron_splitkv.megatron import DFlashPackedSeqParams

    item = plan_batch(batch, cp_size=1, cp_rank=0, block_size=4, mask_token_id=MASK_ID, chunk_size=64, metadata=spec)
    params = DFlashPackedSeqParams(q_seq=item.blocks.q_seq.long(), q_anchor=item.blocks.q_anchor.long(),
                                   kv_seq=item.kv_seq, kv_pos=item.kv_pos, block_size=4,
                                   metadata=item.metadata.bind(None, "cpu"))
    kw = dict(num_heads_q=2, num_heads_kv=1, head_dim=8, dtype=torch.float64, device="cpu")
    assert params.op_metadata("splitkv", window=5, causal=True, **kw) is params.metadata
    full = params.op_metadata("splitkv", **kw)  # a full layer: derived from it (no collective), then cached
    assert (full.window, full.causal) == (None, False) and full is not params.metadata
    assert params.op_metadata("splitkv", **kw) is full
    with pytest.raises(ValueError, match=r"head_dim 8 \(layer: 16\)"):  # the rest is still checked
        params.op_metadata("splitkv", **dict(kw, head_dim=16))


# ------------------------------------------------------------------------------------------------
# the block


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_layers=len(KINDS), **SMALL)


@pytest.fixture(scope="module")
def reference(problem):
    cfg, state, data = problem
    res = run_distributed(block_worker, 1, 1, 1, 1, cfg, state, data, ("splitkv",), "sbhd", KINDS, timeout=240)
    assert res[0]["splitkv"]["n_metadata"] == 3  # one op metadata per distinct (window, causal), not per layer
    return assemble(res, cfg, data, 1)


def test_cp1_mixed_block_matches_functional_reference(problem, reference):
    cfg, state, data = problem
    compare(functional_reference(cfg, state, data, KINDS), reference, cfg)
    # the windows matter: the same block with every layer full gives other outputs
    full = functional_reference(cfg, state, data)
    assert (full[0] - reference[0]).abs().max() > 1e-3


def test_tp2_cp2_mixed_block_equals_cp1(problem, reference):
    cfg, state, data = problem
    impls = ("splitkv", "allgather-kv", "ring-kv")
    res = run_distributed(block_worker, 4, 2, 2, 1, cfg, state, data, impls, "sbhd", KINDS, timeout=300)
    for impl in impls:
        compare(reference, assemble(res, cfg, data, 2, impl), cfg)
    assert {r["splitkv"]["n_metadata"] for r in res} == {3}


def test_layer_kind_table_must_match_the_layer_count(problem):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_splitkv.megatron import splitkv_core_attention
    from test_megatron_block import _config

    cfg = problem[0]
    with pytest.raises(ValueError, match="--dflash-layer-types has 2 layer kinds"):
        splitkv_core_attention("splitkv", layer_attention=KINDS[:2])(
            config=_config(cfg, 1, 1, 1), layer_number=1, attn_mask_type=AttnMaskType.no_mask,
            attention_type="cross")
    core = splitkv_core_attention("splitkv", layer_attention=KINDS)(
        config=_config(cfg, 1, 1, 1), layer_number=4, attn_mask_type=AttnMaskType.no_mask, attention_type="cross")
    assert (core.window, core.causal) == (6, False)
