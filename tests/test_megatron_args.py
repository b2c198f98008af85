"""Flags, validation errors, spec builders and the Megatron-LM patch series (no process groups needed)."""

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_splitkv.megatron import (  # noqa: E402
    SplitKVArgumentError,
    add_splitkv_args,
    get_dflash_layer_spec,
    validate_splitkv_args,
)
from megatron_splitkv import SplitKVConfig  # noqa: E402
from megatron_splitkv.megatron.arguments import (LOCAL_SIZE_ENVS, auto_cp_ranks_per_node,  # noqa: E402
                                                 splitkv_config_from_args)
from _warning_marks import MEGATRON_ENV  # marks of the warnings these tests trigger

pytestmark = MEGATRON_ENV

REPO = Path(__file__).resolve().parents[1]


def _args(**kw):
    base = dict(
        context_parallel_impl="splitkv", tensor_model_parallel_size=2, context_parallel_size=2,
        num_attention_heads=8, num_query_groups=4, group_query_attention=True, micro_batch_size=1,
        dflash_num_anchors=8, dflash_block_size=16, cp_chunk_size=None, cp_balance="lpt",
        transformer_impl="local", attention_dropout=0.0, sequence_parallel=False,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_add_args_defaults_and_idempotent():
    p = argparse.ArgumentParser()
    add_splitkv_args(p)
    add_splitkv_args(p)  # second call (or a patched Megatron parser) must not conflict
    a = p.parse_args([])
    assert a.context_parallel_impl is None and a.cp_balance == "lpt" and a.cp_chunk_size is None
    a = p.parse_args(["--context-parallel-impl", "ring-kv", "--cp-chunk-size", "256", "--cp-balance", "zigzag"])
    assert (a.context_parallel_impl, a.cp_chunk_size, a.cp_balance) == ("ring-kv", 256, "zigzag")
    with pytest.raises(SystemExit):
        p.parse_args(["--context-parallel-impl", "ulysses"])


def test_valid_combination_passes_and_unset_impl_is_ignored():
    validate_splitkv_args(_args())
    validate_splitkv_args(_args(context_parallel_impl=None, num_attention_heads=7))


@pytest.mark.parametrize(
    "kw, flag",
    [
        (dict(num_attention_heads=6, num_query_groups=2, tensor_model_parallel_size=4), "--num-attention-heads"),
        (dict(num_attention_heads=12, num_query_groups=3), "--num-query-groups"),
        (dict(num_attention_heads=12, num_query_groups=5, tensor_model_parallel_size=1), "--num-query-groups"),
        (dict(dflash_num_anchors=3, context_parallel_size=2), "--context-parallel-size"),
        (dict(micro_batch_size=1, dflash_num_anchors=6, context_parallel_size=4), "--dflash-num-anchors"),
        (dict(cp_chunk_size=0), "--cp-chunk-size"),
        (dict(attention_dropout=0.1), "--attention-dropout"),
        (dict(sequence_parallel=True), "--sequence-parallel"),
        (dict(context_parallel_impl="ulysses"), "--context-parallel-impl"),
        (dict(splitkv_kernel="fa4", deterministic_mode=True), "--deterministic-mode"),
    ],
)
def test_bad_combinations_name_the_flag(kw, flag):
    with pytest.raises(SplitKVArgumentError) as e:
        validate_splitkv_args(_args(**kw))
    assert flag in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(dflash_block_size=1), "--dflash-block-size must be >= 2, got 1"),
        (dict(dflash_block_size=0), "--dflash-block-size must be >= 2, got 0"),
        (dict(context_parallel_size=0), "--context-parallel-size must be >= 1, got 0"),
        (dict(context_parallel_size=-2), "--context-parallel-size must be >= 1, got -2"),
        (dict(tensor_model_parallel_size=0), "--tensor-model-parallel-size must be >= 1, got 0"),
        (dict(micro_batch_size=0), "--micro-batch-size must be >= 1, got 0"),
        (dict(micro_batch_size=-1, context_parallel_size=1), "--micro-batch-size must be >= 1, got -1"),
        (dict(num_attention_heads=0), "--num-attention-heads must be >= 1, got 0"),
        (dict(dflash_num_anchors="8"), "--dflash-num-anchors must be an integer, got '8'"),
        (dict(dflash_num_anchors=8.0), "--dflash-num-anchors must be an integer, got 8.0"),
        (dict(dflash_num_anchors=0), "--dflash-num-anchors must be >= 1, got 0"),
    ],
)
def test_out_of_range_values_are_rejected_with_their_value(kw, message):
    """Regression (#9): no `x or 1` coercion of 0; B >= 2 as build_draft_blocks needs; a non-integer
    --dflash-num-anchors is a SplitKVArgumentError (not a TypeError); messages show the value given."""
    with pytest.raises(SplitKVArgumentError) as e:
        validate_splitkv_args(_args(**kw))
    assert message in str(e.value), str(e.value)
    # unset (None) still means the default
    validate_splitkv_args(_args(micro_batch_size=None, context_parallel_size=None, dflash_block_size=None))


def _pretrain_parse_only(modname):
    """examples/pretrain_dflash.py loaded as a module, and a minimal CPU-safe --parse-only argv."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(modname, REPO / "examples" / "pretrain_dflash.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, ["--parse-only", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
                 "--attention-dropout", "0", "--transformer-impl", "local", "--num-anchors", "8"]


def test_pretrain_parse_only_validates_splitkv_flags():
    """examples/pretrain_dflash.py --parse-only runs validate_splitkv_args (CPU-safe)."""
    mod, base = _pretrain_parse_only("pretrain_dflash_t")
    argv = sys.argv
    try:
        args = mod.main(base + ["--block-size", "4"])
        assert args.dflash_block_size == 4
        for bad, msg in ((["--block-size", "1"], "--dflash-block-size must be >= 2, got 1"),
                         (["--block-size", "0"], "--dflash-block-size must be >= 2, got 0")):
            with pytest.raises(SplitKVArgumentError, match=msg):
                mod.main(base + bad)
    finally:
        sys.argv = argv


@pytest.mark.parametrize("world, tp, pp, cp", [("12", 2, 1, 4), ("8", 1, 1, 3), ("8", 1, 2, 8), ("6", 4, 1, 1)])
def test_cp_size_not_dividing_the_launcher_world_size_is_an_error(world, tp, pp, cp):
    """The launcher's WORLD_SIZE (in `launcher_env`) must be a multiple of TP x PP x CP: an error naming the flags
    and the numbers, not a pass that Megatron's later assert or a hang at group creation turns up."""
    a = _args(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
              num_attention_heads=8, num_query_groups=4, dflash_num_anchors=24)
    with pytest.raises(SplitKVArgumentError) as e:
        validate_splitkv_args(a, launcher_env={"WORLD_SIZE": world})
    msg = str(e.value)
    for want in (f"--context-parallel-size ({cp})", f"WORLD_SIZE ({world})", f"--tensor-model-parallel-size ({tp})",
                 f"--pipeline-model-parallel-size ({pp})", f"TP x PP x CP = {tp * pp * cp}"):
        assert want in msg, (want, msg)


def test_cp_size_dividing_the_launcher_world_size_passes():
    for world, tp, pp, cp in (("16", 2, 2, 4), ("8", 2, 1, 4), ("4", 1, 1, 4)):
        validate_splitkv_args(_args(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                    context_parallel_size=cp), launcher_env={"WORLD_SIZE": world})
    validate_splitkv_args(_args(context_parallel_size=3, dflash_num_anchors=6), launcher_env={})  # no size: no check
    with pytest.raises(SplitKVArgumentError, match="the launcher's WORLD_SIZE must be a positive int .*'8x'"):
        validate_splitkv_args(_args(), launcher_env={"WORLD_SIZE": "8x"})


def test_pretrain_parse_only_checks_cp_size_against_world_size(monkeypatch):
    """`pretrain_dflash.py --parse-only` under torchrun (WORLD_SIZE set): a CP size that does not divide
    WORLD_SIZE / (TP x PP) fails at parse time naming the flags and the numbers; one that divides passes."""
    mod, base = _pretrain_parse_only("pretrain_dflash_ws")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    for name in LOCAL_SIZE_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    cp3 = ["--context-parallel-impl", "splitkv", "--context-parallel-size", "3", "--num-anchors", "6"]
    with pytest.raises(SplitKVArgumentError, match=r"--context-parallel-size \(3\) must divide the launcher's "
                                                   r"WORLD_SIZE \(8\)"):
        mod.main(base + cp3)
    args = mod.main(base + ["--context-parallel-impl", "splitkv", "--context-parallel-size", "4"])
    assert args.context_parallel_size == 4


def test_missing_te_for_te_spec_is_a_clear_error():
    with pytest.raises(SplitKVArgumentError, match="--transformer-impl"):
        validate_splitkv_args(_args(transformer_impl="transformer_engine"), have_te=False)
    from megatron_splitkv.megatron.specs import have_te

    if not have_te():
        with pytest.raises(SplitKVArgumentError, match="--transformer-impl"):
            get_dflash_layer_spec("splitkv", use_te=True)


def test_hypergraph_needs_kahypar(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    # simulate an environment without kahypar (requirements.txt installs it, so hide it here)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kahypar" else real(name, *a))
    with pytest.raises(SplitKVArgumentError, match="--cp-balance hypergraph"):
        validate_splitkv_args(_args(cp_balance="hypergraph"))
    monkeypatch.setattr(importlib.util, "find_spec", real)
    validate_splitkv_args(_args(cp_balance="hypergraph"))  # with kahypar present: accepted


def test_spec_builder():
    from megatron_splitkv.megatron import DFlashAttention, DFlashTransformerLayer

    for impl in ("splitkv", "allgather-kv", "ring-kv"):
        spec = get_dflash_layer_spec(impl, use_te=False)
        assert spec.module is DFlashTransformerLayer
        att = spec.submodules.self_attention
        assert att.module is DFlashAttention
        assert att.submodules.core_attention.keywords["cp_impl"] == impl
    with pytest.raises(SplitKVArgumentError, match="--context-parallel-impl"):
        get_dflash_layer_spec("ulysses")


def _site_megatron():
    import megatron.core

    return Path(megatron.core.__file__).resolve().parents[1]  # .../site-packages/megatron


def test_patch_series_applies_to_wheel_and_imports(tmp_path):
    patches = sorted((REPO / "patches").glob("*.patch"))
    assert [p.name[:4] for p in patches] == ["0001", "0002"]
    src = _site_megatron() / "training"
    assert src.is_dir(), "the megatron-core wheel ships megatron/training"
    dst = tmp_path / "megatron" / "training"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    for p in patches:
        r = subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(p)], cwd=tmp_path,
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{p.name} does not apply cleanly:\n{r.stdout}\n{r.stderr}"
        assert "offset" not in r.stdout and "fuzz" not in r.stdout, r.stdout
    code = textwrap.dedent(
        f"""
        import sys, argparse
        sys.path.insert(0, {str(tmp_path)!r})
        import megatron.training.arguments as A
        assert A.__file__.startswith({str(tmp_path)!r}), A.__file__
        p = argparse.ArgumentParser()
        A.add_megatron_arguments(p)
        from megatron_splitkv.megatron import add_splitkv_args
        add_splitkv_args(p)  # idempotent on top of the patched parser
        a = p.parse_args(["--context-parallel-impl", "splitkv", "--cp-balance", "zigzag", "--cp-chunk-size", "512"])
        assert (a.context_parallel_impl, a.cp_balance, a.cp_chunk_size) == ("splitkv", "zigzag", 512)
        import megatron.training.argument_utils as U
        assert U.__file__.startswith({str(tmp_path)!r})
        import megatron.training.models.gpt as G
        from megatron.core.transformer.transformer_config import TransformerConfig
        tc = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               use_cpu_initialization=True, transformer_impl="local")
        cfg = G.GPTModelConfig(transformer=tc, context_parallel_impl="ring-kv",
                               position_embedding_type="rope", rotary_base=1000000)
        spec = G.default_layer_spec(cfg, vp_stage=None)
        from megatron_splitkv.megatron import DFlashTransformerLayer
        assert spec.module is DFlashTransformerLayer, spec
        assert spec.submodules.self_attention.submodules.core_attention.keywords["cp_impl"] == "ring-kv"
        assert spec.submodules.self_attention.params["rotary_base"] == 1000000
        assert spec.submodules.self_attention.submodules.core_attention.keywords["kernel_backend"] == "auto"
        cfg3 = G.GPTModelConfig(transformer=tc, context_parallel_impl="splitkv", splitkv_kernel="staircase",
                                splitkv_overlap_q_gather=False)
        sa3 = G.default_layer_spec(cfg3, vp_stage=None).submodules.self_attention
        assert sa3.submodules.core_attention.keywords["kernel_backend"] == "staircase"
        assert sa3.params["overlap_query_gather"] is False
        kinds = ((8, True),)  # --dflash-layer-types sliding_attention --dflash-sliding-window 8
        cfg4 = G.GPTModelConfig(transformer=tc, context_parallel_impl="splitkv", splitkv_layer_attention=kinds)
        sa4 = G.default_layer_spec(cfg4, vp_stage=None).submodules.self_attention
        assert sa4.submodules.core_attention.keywords["layer_attention"] == kinds
        import inspect
        src = inspect.getsource(U.gpt_config_from_args)  # the patched config builder copies the flags
        assert 'kwargs["splitkv_kernel"]' in src and 'kwargs["splitkv_overlap_q_gather"]' in src
        assert 'kwargs["splitkv_layer_attention"] = layer_attention_from_args(args)' in src
        cfg2 = G.GPTModelConfig(transformer=tc)
        assert G.default_layer_spec(cfg2, vp_stage=None).module is not DFlashTransformerLayer
        print("PATCH-OK")
        """
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0 and "PATCH-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]


def test_splitkv_kernel_flag_parses_validates_and_reaches_core_attention():
    """--splitkv-kernel: every kernel name parses (default auto), a bad value names the flag (argparse
    and validate_splitkv_args), `te` without Transformer Engine is refused, and the value reaches
    SplitKVCoreAttention.kernel_backend through kernel_backend_from_args -> get_dflash_layer_spec."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_splitkv.kernels import BACKENDS
    from megatron_splitkv.megatron import SplitKVCoreAttention
    from megatron_splitkv.megatron.arguments import KERNEL_BACKENDS, kernel_backend_from_args

    assert KERNEL_BACKENDS == tuple(BACKENDS)
    p = argparse.ArgumentParser()
    add_splitkv_args(p)
    add_splitkv_args(p)  # idempotent
    assert p.parse_args([]).splitkv_kernel == "auto"
    assert kernel_backend_from_args(argparse.Namespace()) == "auto"  # a parser without the flag
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                            use_cpu_initialization=True)
    for name in KERNEL_BACKENDS:
        a = p.parse_args(["--context-parallel-impl", "splitkv", "--splitkv-kernel", name])
        assert kernel_backend_from_args(a) == name
        validate_splitkv_args(_args(splitkv_kernel=name), have_te=True, have_fa4=True)
        spec = get_dflash_layer_spec("splitkv", use_te=False, kernel_backend=kernel_backend_from_args(a))
        core = spec.submodules.self_attention.submodules.core_attention(
            config=cfg, layer_number=1, attn_mask_type=AttnMaskType.no_mask, attention_type="cross",
            cp_comm_type=None, softmax_scale=None, pg_collection=None)
        assert isinstance(core, SplitKVCoreAttention) and core.kernel_backend == name
    with pytest.raises(SystemExit):
        p.parse_args(["--splitkv-kernel", "cudnn"])
    for bad in ("cudnn", "Flex", ""):
        with pytest.raises(SplitKVArgumentError, match="--splitkv-kernel must be one of"):
            validate_splitkv_args(_args(splitkv_kernel=bad))
        with pytest.raises(SplitKVArgumentError, match="--splitkv-kernel"):
            kernel_backend_from_args(argparse.Namespace(splitkv_kernel=bad))
    with pytest.raises(SplitKVArgumentError, match="--splitkv-kernel te needs Transformer Engine"):
        validate_splitkv_args(_args(splitkv_kernel="te"), have_te=False)


def test_fa4_kernel_flag_needs_flash_attention_4_at_start_up(monkeypatch):
    """`--splitkv-kernel fa4` on a machine without FlashAttention-4 fails at argument validation (as `te`
    without Transformer Engine), naming the flag and the extra, not at the first training step after the
    model, the checkpoint and the data workers are up; --parse-only (another machine) does not check it."""
    from megatron_splitkv.kernels import fa4
    from megatron_splitkv.megatron import arguments as ma

    with pytest.raises(SplitKVArgumentError, match=r"--splitkv-kernel fa4 needs FlashAttention-4 .*\[fa4\]"):
        validate_splitkv_args(_args(splitkv_kernel="fa4"), have_fa4=False)
    validate_splitkv_args(_args(splitkv_kernel="fa4"), have_fa4=True)
    validate_splitkv_args(_args(splitkv_kernel="auto"), have_fa4=False)  # auto falls back: no requirement
    monkeypatch.setattr(fa4, "fa4_available", lambda: False)  # the detection used without have_fa4
    with pytest.raises(SplitKVArgumentError, match="--splitkv-kernel fa4 needs FlashAttention-4"):
        validate_splitkv_args(_args(splitkv_kernel="fa4"))
    monkeypatch.setattr(fa4, "fa4_available", lambda: True)
    validate_splitkv_args(_args(splitkv_kernel="fa4"))
    assert ma._fa4_available() is True


def test_splitkv_kernel_bad_value_names_the_flag_on_the_command_line(capsys):
    p = add_splitkv_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        p.parse_args(["--splitkv-kernel", "cudnn"])
    err = capsys.readouterr().err
    assert "--splitkv-kernel" in err and "invalid choice" in err, err


def test_pretrain_parse_only_threads_splitkv_kernel():
    """examples/pretrain_dflash.py parses --splitkv-kernel and validates it (CPU-safe)."""
    from megatron_splitkv.megatron.arguments import kernel_backend_from_args

    mod, base = _pretrain_parse_only("pretrain_dflash_k")
    argv = sys.argv
    try:
        assert kernel_backend_from_args(mod.main(base)) == "auto"
        assert kernel_backend_from_args(mod.main(base + ["--splitkv-kernel", "staircase"])) == "staircase"
        with pytest.raises(SystemExit):
            mod.main(base + ["--splitkv-kernel", "cudnn"])
        # explicit fa4 under Megatron's --deterministic-mode would raise in the first layer on the GPU:
        # refused on the command line instead; auto (-> flex there) and fa4 alone pass
        assert kernel_backend_from_args(mod.main(base + ["--splitkv-kernel", "fa4"])) == "fa4"
        assert kernel_backend_from_args(mod.main(base + ["--splitkv-kernel", "auto", "--deterministic-mode"])) == "auto"
        with pytest.raises(SplitKVArgumentError, match="--splitkv-kernel fa4 .*--deterministic-mode"):
            mod.main(base + ["--splitkv-kernel", "fa4", "--deterministic-mode"])
    finally:
        sys.argv = argv
    src = (REPO / "examples" / "pretrain_dflash.py").read_text()
    assert "kernel_backend=kernel_backend_from_args(args)" in src


def test_cp_ranks_per_node_flag_validates_and_reaches_the_op():
    """--splitkv-cp-ranks-per-node parses (default None: the op's default), must divide the CP size (the
    error names the flag and the CP size), and a valid value reaches the op through the config
    (args.splitkv_config.cp_ranks_per_node, resolved by ops.metadata.resolve_ranks_per_node)."""
    from megatron_splitkv.ops.metadata import resolve_ranks_per_node

    p = add_splitkv_args(argparse.ArgumentParser())
    assert p.parse_args([]).splitkv_cp_ranks_per_node is None
    a = _args(context_parallel_size=8, dflash_num_anchors=8)
    validate_splitkv_args(a)
    assert a.splitkv_config.cp_ranks_per_node is None  # unset flag: the op's default
    for bad in (3, 0, -2):
        with pytest.raises(SplitKVArgumentError, match=r"--splitkv-cp-ranks-per-node"):
            validate_splitkv_args(_args(context_parallel_size=8, dflash_num_anchors=8, splitkv_cp_ranks_per_node=bad))
    # >= the CP size: clamped (one all-to-all), as the op clamps the config field
    a = _args(context_parallel_size=4, dflash_num_anchors=8, splitkv_cp_ranks_per_node=8)
    validate_splitkv_args(a)
    assert a.splitkv_config.cp_ranks_per_node == 4
    a = p.parse_args(["--context-parallel-impl", "splitkv", "--splitkv-cp-ranks-per-node", "4"])
    assert a.splitkv_cp_ranks_per_node == 4
    a = _args(context_parallel_size=8, dflash_num_anchors=8, splitkv_cp_ranks_per_node=4)
    validate_splitkv_args(a)
    assert splitkv_config_from_args(a).cp_ranks_per_node == 4
    assert resolve_ranks_per_node(None, 8, splitkv_config_from_args(a)) == 4


@pytest.mark.parametrize("env,tp,cp,want", [
    ({"LOCAL_WORLD_SIZE": "8"}, 1, 64, 8),  # 8 nodes of 8 CP ranks: two-level
    ({"LOCAL_WORLD_SIZE": "8"}, 2, 16, 4),  # TP 2: 4 CP ranks per node
    ({"LOCAL_WORLD_SIZE": "8"}, 1, 8, 1),  # one node: one all-to-all
    ({"LOCAL_WORLD_SIZE": "8"}, 1, 4, 1),
    ({"LOCAL_WORLD_SIZE": "6"}, 1, 8, 1),  # 6 per node does not divide 8
    ({"LOCAL_WORLD_SIZE": "8"}, 3, 8, 1),  # TP 3 does not divide 8
    ({"LOCAL_WORLD_SIZE": "8"}, 8, 16, 1),  # one CP rank per node
    ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, 1, 8, 4),  # Slurm's count, the repeat suffix dropped
    ({"LOCAL_WORLD_SIZE": "x", "SLURM_NTASKS_PER_NODE": "2"}, 1, 8, 2),  # malformed: the next source
    ({"LOCAL_WORLD_SIZE": "0"}, 1, 8, 1),
    ({"SLURM_TASKS_PER_NODE": "8(x4)"}, 1, 32, 8),  # Slurm's always-set variable, homogeneous
    ({"SLURM_NTASKS_PER_NODE": "8(x2),8"}, 1, 32, 8),  # a list of equal counts is homogeneous
    ({}, 1, 64, 1),  # unknown: one all-to-all
])
def test_auto_cp_ranks_per_node(env, tp, cp, want):
    """`auto_cp_ranks_per_node`: the launcher's processes per node / TP when the CP group spans whole nodes (1 < L
    < CP, L divides CP), else 1, with the reason."""
    L, why = auto_cp_ranks_per_node(tp, cp, launcher_env=env)
    assert L == want, why
    assert isinstance(why, str) and why


@pytest.mark.parametrize("name", ["SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])
def test_auto_cp_ranks_per_node_heterogeneous_slurm_is_one(name):
    """Slurm's '8(x2),4' (two nodes of 8 ranks, one of 4) was read as 8: nodes of different sizes give no
    whole-node CP groups, so the automatic L is 1 and the reason says why."""
    L, why = auto_cp_ranks_per_node(1, 16, launcher_env={name: "8(x2),4"})
    assert L == 1 and "heterogeneous" in why and f"{name}=8(x2),4" in why, why
    assert auto_cp_ranks_per_node(1, 16, launcher_env={name: "8(x2)"})[0] == 8  # homogeneous stays 8
    for bad in ("8(x0)", "8(x", "8,", "(x2)", "8(x2)4"):  # malformed: no size, not a heterogeneous one
        L, why = auto_cp_ranks_per_node(1, 16, launcher_env={name: bad})
        assert L == 1 and "not a positive int" in why, (bad, why)


def test_auto_cp_ranks_per_node_chosen_by_validate(monkeypatch):
    """No --splitkv-cp-ranks-per-node: validate puts the automatic L (> 1 only; impl splitkv only) in the config
    and records the choice for the start-up line; the flag wins over it; the op then resolves it
    (ops.metadata.resolve_ranks_per_node). The launcher's variables come as the `launcher_env` argument (the
    entry script picks them from its os.environ with `launcher_env_from`): the process environment is neither
    read nor written."""
    from megatron_splitkv.megatron import launcher_env_from
    from megatron_splitkv.ops.metadata import resolve_ranks_per_node

    for name in (*LOCAL_SIZE_ENVS, "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # the process's: ignored by the library
    a = _args(tensor_model_parallel_size=1, context_parallel_size=32, dflash_num_anchors=32)
    validate_splitkv_args(a)
    assert a.splitkv_config.cp_ranks_per_node is None and a.splitkv_cp_ranks_per_node_auto.startswith(
        "auto -> 1 (no launcher size per node"), a.splitkv_cp_ranks_per_node_auto
    env = launcher_env_from(dict(os.environ, SLURM_JOB_ID="7"))
    assert env == {"LOCAL_WORLD_SIZE": "8"}
    before = dict(os.environ)
    a = _args(tensor_model_parallel_size=1, context_parallel_size=32, dflash_num_anchors=32)
    validate_splitkv_args(a, launcher_env=env)
    assert a.splitkv_config.cp_ranks_per_node == 8 and resolve_ranks_per_node(None, 32, a.splitkv_config) == 8
    assert a.splitkv_cp_ranks_per_node_auto.startswith("auto -> 8 (LOCAL_WORLD_SIZE=8")
    assert dict(os.environ) == before
    a = _args(tensor_model_parallel_size=1, context_parallel_size=4, dflash_num_anchors=8)  # one node: none
    validate_splitkv_args(a, launcher_env=env)
    assert a.splitkv_config.cp_ranks_per_node is None and a.splitkv_cp_ranks_per_node_auto.startswith("auto -> 1 ")
    a = _args(context_parallel_impl="allgather-kv", tensor_model_parallel_size=1, context_parallel_size=32, dflash_num_anchors=32)
    validate_splitkv_args(a, launcher_env=env)  # the baselines run no two-level exchange: none
    assert a.splitkv_config.cp_ranks_per_node is None
    a = _args(tensor_model_parallel_size=1, context_parallel_size=32, dflash_num_anchors=32, splitkv_cp_ranks_per_node=1)
    validate_splitkv_args(a, launcher_env=env)
    assert a.splitkv_config.cp_ranks_per_node == 1  # the flag wins (1 = one all-to-all)


def _dest_clashes(parser, actions):
    """{dest: [option strings of each action]} for dests that two or more of `actions` write."""
    by_dest = {}
    for a in actions:
        if a.option_strings and a.dest != "help":
            by_dest.setdefault(a.dest, []).append(a)
    return {d: [a.option_strings for a in acts] for d, acts in by_dest.items() if len(acts) > 1}


def test_flag_spellings_share_one_action_and_help_text(capsys):
    """Every option pretrain_dflash.py adds to Megatron's parser (add_dflash_args, with add_splitkv_args) is
    ONE argparse action per dest: --num-anchors / --dflash-num-anchors and --block-size / --dflash-block-size
    were two actions each with different help texts and defaults (512 vs SUPPRESS); now aliases of one
    action, listed together in --help with one help text."""
    from megatron.training.arguments import add_megatron_arguments

    mod, base = _pretrain_parse_only("pretrain_dflash_alias")
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    before = set(map(id, parser._actions))
    mod.add_dflash_args(parser)
    ours = [a for a in parser._actions if id(a) not in before]
    assert ours and _dest_clashes(parser, ours) == {}
    # and none of ours writes a dest Megatron's own flags write
    megatron_dests = {a.dest for a in parser._actions if id(a) in before}
    assert [a.option_strings for a in ours if a.dest in megatron_dests] == []
    for short, long_ in (("--num-anchors", "--dflash-num-anchors"), ("--block-size", "--dflash-block-size")):
        assert parser._option_string_actions[short] is parser._option_string_actions[long_]
    capsys.readouterr()
    argv = sys.argv
    try:
        assert mod.main(["--help"]) is None  # Megatron's parser + ours (megatron-core 0.19.2 needs '%' escaped)
    finally:
        sys.argv = argv
    help_text = " ".join(capsys.readouterr().out.split())
    assert ("--dflash-num-anchors DFLASH_NUM_ANCHORS, --num-anchors DFLASH_NUM_ANCHORS DFlash query budget: "
            "anchors (query blocks) per sequence (default 512).") in help_text
    assert "--dflash-block-size DFLASH_BLOCK_SIZE, --block-size DFLASH_BLOCK_SIZE DFlash draft block size B" in help_text
    assert help_text.count("--num-anchors") == 1 and help_text.count("--block-size") == 1
    # either spelling parses to the same value; the last one given wins (one action)
    argv = sys.argv
    try:
        assert mod.main(base + ["--dflash-num-anchors", "16"]).dflash_num_anchors == 16
        assert mod.main(base + ["--block-size", "4", "--dflash-block-size", "8"]).dflash_block_size == 8
    finally:
        sys.argv = argv
    capsys.readouterr()


def test_add_splitkv_args_aliases():
    """aliases= on a fresh parser (one add_argument call), on a parser that already had the flag (attached to
    its action), and the errors: an unknown flag, an alias that is already another option."""
    p = add_splitkv_args(argparse.ArgumentParser(), aliases={"--dflash-num-anchors": ("--num-anchors",)})
    assert p.parse_args(["--num-anchors", "4"]).dflash_num_anchors == 4
    assert p.parse_args([]).dflash_num_anchors == 512
    assert _dest_clashes(p, p._actions) == {}
    pre = argparse.ArgumentParser()
    pre.add_argument("--dflash-block-size", type=int, default=16, help="from a patched parser")
    add_splitkv_args(pre, aliases={"--dflash-block-size": ("--block-size",)})
    assert pre.parse_args(["--block-size", "3"]).dflash_block_size == 3 and _dest_clashes(pre, pre._actions) == {}
    with pytest.raises(ValueError, match="'--no-such-flag' is not an option"):
        add_splitkv_args(argparse.ArgumentParser(), aliases={"--no-such-flag": ("--x",)})
    taken = argparse.ArgumentParser()
    taken.add_argument("--dflash-block-size", type=int)
    taken.add_argument("--block-size", type=int)
    with pytest.raises(ValueError, match="cannot make --block-size an alias of --dflash-block-size"):
        add_splitkv_args(taken, aliases={"--dflash-block-size": ("--block-size",)})


@pytest.mark.parametrize("pre_existing", [False, True])
def test_add_splitkv_args_alias_values_checked(pre_existing):
    """An alias given as a bare string is ONE alias (was iterated per character: on a parser that already had
    the flag the action silently gained the option strings '-', 'n', 'u', ... and '--num-anchors' stayed
    unknown); an alias that is not an option string ('num-anchors', 5) raises ValueError naming it, before
    the parser is changed (was added silently on a parser that had the flag)."""
    def parser():
        p = argparse.ArgumentParser()
        if pre_existing:
            p.add_argument("--dflash-num-anchors", type=int, default=512)
        return p

    p = add_splitkv_args(parser(), aliases={"--dflash-num-anchors": "--num-anchors"})
    assert p.parse_args(["--num-anchors", "3"]).dflash_num_anchors == 3
    assert p._option_string_actions["--dflash-num-anchors"].option_strings == ["--dflash-num-anchors", "--num-anchors"]
    for bad in (("num-anchors",), (5,), ("--num anchors",), ("-",), 7):
        p = parser()
        before = dict(p._option_string_actions)
        with pytest.raises(ValueError, match=r"add_splitkv_args: alias.* of --dflash-num-anchors|aliases\["):
            add_splitkv_args(p, aliases={"--dflash-num-anchors": bad})
        assert p._option_string_actions == before  # nothing added before the error
    with pytest.raises(ValueError, match="aliases must be a dict"):
        add_splitkv_args(parser(), aliases=[("--dflash-num-anchors", "--num-anchors")])


def test_pretrain_start_line_names_what_auto_resolves_to(monkeypatch):
    """The start-up line says which local kernel "auto" runs here (fa4 / flex / math), not just "auto"."""
    import torch

    import megatron_splitkv.kernels as kernels

    mod, _ = _pretrain_parse_only("pretrain_dflash_label")
    dcfg = argparse.Namespace(kv_channels=None, hidden_size=64, num_attention_heads=4, params_dtype=None)
    seen = []

    def fake(keys, device, dtype, head_dim, config=None):
        seen.append((keys, torch.device(device).type, head_dim))
        return fake.answer

    monkeypatch.setattr(kernels, "resolve_auto_backend", fake)
    monkeypatch.setattr(kernels, "staircase_runs_on", lambda *a: True)
    fake.answer = "fa4"
    assert mod._kernel_label(argparse.Namespace(splitkv_kernel=None), dcfg) == "auto -> fa4"
    fake.answer = "flex"
    assert mod._kernel_label(argparse.Namespace(splitkv_kernel="auto"), dcfg) == \
        "auto -> flex, staircase from 32768 keys per call"
    assert seen[0][0] is None and seen[0][2] == 16  # no key count; head dim = hidden / heads
    assert mod._kernel_label(argparse.Namespace(splitkv_kernel="te"), dcfg) == "te"
    assert len(seen) == 2  # an explicit kernel is named as given, nothing resolved


@pytest.mark.parametrize("raw", ["\u00b2", "9" * 5000, "\u0668", "+8", "8.0", "1_6"])
def test_auto_cp_ranks_per_node_malformed_launcher_size_is_no_size(raw):
    """A launcher size that is not a plain ASCII positive int ('²' passed str.isdigit() and then int() raised
    Python's ValueError out of validate_splitkv_args; a 5000-digit value hit the int-conversion limit; '٨' (an
    Arabic-Indic 8) was taken as 8, which the package's text-int policy refuses) is unknown: L = 1, and the
    reason names the variable and its value instead of claiming it is unset."""
    L, why = auto_cp_ranks_per_node(1, 16, launcher_env={"LOCAL_WORLD_SIZE": raw})
    assert L == 1
    assert "LOCAL_WORLD_SIZE=" in why and "not a positive int" in why, why
    assert len(why) < 300, why
    # the next source is still read
    assert auto_cp_ranks_per_node(1, 16, launcher_env={"LOCAL_WORLD_SIZE": raw, "SLURM_NTASKS_PER_NODE": "4"})[0] == 4


def test_runtime_flag_values_shows_the_automatic_choice_after_validate():
    """--parse-only prints runtime_flag_values after validate_splitkv_args: the automatic L is shown as the
    automatic choice with its reason."""
    from megatron_splitkv.megatron.arguments import runtime_flag_values

    env = {"LOCAL_WORLD_SIZE": "4"}
    a = _args(tensor_model_parallel_size=1, context_parallel_size=8, dflash_num_anchors=8,
              splitkv_cp_ranks_per_node=None)
    validate_splitkv_args(a, launcher_env=env)
    assert a.splitkv_config.cp_ranks_per_node == 4
    shown = runtime_flag_values(a)["splitkv_cp_ranks_per_node"]
    assert shown.startswith("auto -> 4 (LOCAL_WORLD_SIZE=4"), shown


_INT_FLAGS = ("--cp-chunk-size", "--dflash-block-size", "--dflash-num-anchors", "--splitkv-cp-ranks-per-node",
              "--splitkv-num-chunks",
              "--dflash-data-workers", "--dflash-data-prefetch")


@pytest.mark.parametrize("flag", _INT_FLAGS)
def test_plugin_int_flags_take_plain_decimals_only(flag, capsys):
    """The plugin's own int flags parse with `_ints.int_arg` (`parse_int`): argparse's type=int took '+64',
    '1_000' and non-ASCII digits ('٨'). A bad value is argparse's one error line naming the flag, exit 2."""
    p = add_splitkv_args(argparse.ArgumentParser())
    dest = flag.lstrip("-").replace("-", "_")
    assert getattr(p.parse_args([flag, "64"]), dest) == 64
    for bad in ("+64", "1_000", "\u0668", "64.0", "0x40"):
        with pytest.raises(SystemExit) as exc:
            p.parse_args([flag, bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"argument {flag}: must be an int (decimal digits), got {bad!r}" in err, err


# ---- the automatic chunked pipeline across nodes (`auto_pipeline`; docs/lab/perf-notes.md item 25) ----
from megatron_splitkv.megatron.arguments import auto_pipeline, runtime_flag_values  # noqa: E402

ON = {"num_chunks": 2, "chunk_axis": "heads"}


@pytest.mark.parametrize("env,tp,cp,kv,want", [
    ({"LOCAL_WORLD_SIZE": "8"}, 1, 16, 8, ON),  # 2 nodes of 8: head chunks
    ({"LOCAL_WORLD_SIZE": "8"}, 2, 8, 4, ON),  # TP 2: 4 CP ranks per node < 8
    ({"LOCAL_WORLD_SIZE": "1"}, 1, 2, 8, ON),  # one GPU per node: the socket stand-in's CP 2
    ({"LOCAL_WORLD_SIZE": "6"}, 1, 8, 8, ON),  # spans nodes though L = 6 does not divide 8 (L stays 1)
    ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, 1, 8, 2, ON),  # Slurm's count
    ({"LOCAL_WORLD_SIZE": "8"}, 1, 8, 8, {}),  # one node: NVLink, one call is best
    ({"LOCAL_WORLD_SIZE": "8"}, 2, 4, 4, {}),  # TP 2, one node
    ({"LOCAL_WORLD_SIZE": "8"}, 3, 8, 8, {}),  # TP 3 does not divide 8: unknown layout
    ({}, 1, 64, 8, {}),  # unknown launcher size
    ({"LOCAL_WORLD_SIZE": "x"}, 1, 64, 8, {}),  # malformed launcher size
    ({"SLURM_NTASKS_PER_NODE": "8(x2),4"}, 1, 16, 8, {}),  # heterogeneous nodes: layout unknown
    ({"LOCAL_WORLD_SIZE": "8"}, 8, 16, 1, {}),  # Hkv / TP = 1: no head chunks
    ({"LOCAL_WORLD_SIZE": "8"}, 1, 16, None, {}),  # kv heads unknown
])
def test_auto_pipeline(env, tp, cp, kv, want):
    """`auto_pipeline`: 2 head chunks when the CP group spans nodes (launcher's processes per node / TP < CP) and
    each TP rank holds >= 2 kv heads; else no change; always a one-line reason."""
    fields, why = auto_pipeline(tp, cp, kv, launcher_env=env)
    assert fields == want, why
    assert isinstance(why, str) and why and "\n" not in why


def _pipeline(a):
    c = a.splitkv_config
    return {k: v for k, v in (("num_chunks", c.num_chunks), ("chunk_axis", c.chunk_axis)) if v not in (None, "rows")}


def _spanning(**kw):  # with LOCAL_WORLD_SIZE=8: 2 nodes of 8 GPUs, TP 1, CP 16, 4 kv heads
    return _args(**{"tensor_model_parallel_size": 1, "context_parallel_size": 16, "dflash_num_anchors": 16, **kw})


def test_auto_pipeline_chosen_by_validate():
    """validate_splitkv_args puts the automatic pipeline in the config (impl splitkv only) and records it for the
    start-up line; the same 2 head chunks whatever the local kernel; nothing is written to the environment."""
    env = {"LOCAL_WORLD_SIZE": "8"}
    before = dict(os.environ)
    a = _spanning()
    validate_splitkv_args(a, have_fa4=True, launcher_env=env)
    assert _pipeline(a) == ON and dict(os.environ) == before
    assert a.splitkv_pipeline_auto.startswith("auto -> 2 head chunks (LOCAL_WORLD_SIZE=8 / TP 1"), \
        a.splitkv_pipeline_auto
    for kw, fa4 in ((dict(), False), (dict(deterministic_mode=True), True), (dict(bf16=False, fp16=False), True),
                    (dict(splitkv_kernel="flex"), True), (dict(splitkv_kernel="fa4", bf16=False), True)):
        a = _spanning(**kw)
        validate_splitkv_args(a, have_fa4=fa4, launcher_env=env)
        assert _pipeline(a) == ON, kw
        assert a.splitkv_pipeline_auto.startswith("auto -> 2 head chunks ("), (kw, a.splitkv_pipeline_auto)
    for kw in (dict(context_parallel_impl="allgather-kv"), dict(context_parallel_size=8, dflash_num_anchors=8),
               dict(num_query_groups=1)):
        a = _spanning(**kw)
        validate_splitkv_args(a, have_fa4=True, launcher_env=env)  # a baseline, one node, one kv head: the op's defaults
        assert _pipeline(a) == {}, kw
    assert a.splitkv_pipeline_auto.startswith("auto -> off ("), a.splitkv_pipeline_auto


@pytest.mark.parametrize("flag,attr,field,value", [
    ("--splitkv-num-chunks", "splitkv_num_chunks", "num_chunks", 4),
    ("--splitkv-chunk-axis", "splitkv_chunk_axis", "chunk_axis", "rows"),
])
def test_pipeline_flags_win_over_automatic(flag, attr, field, value):
    """Each pipeline flag parses (default None), sets its config field and turns the automatic pipeline off (the
    other field keeps the op's default)."""
    p = add_splitkv_args(argparse.ArgumentParser())
    assert getattr(p.parse_args([]), attr) is None
    assert getattr(p.parse_args([flag, str(value)]), attr) == value
    with pytest.raises(SystemExit):  # argparse: an int / one of rows, heads
        p.parse_args([flag, "cols"])
    env = {"LOCAL_WORLD_SIZE": "8"}
    a = _spanning(**{attr: value})
    validate_splitkv_args(a, have_fa4=True, launcher_env=env)
    assert getattr(a.splitkv_config, field) == value and splitkv_config_from_args(a) is a.splitkv_config
    other = "chunk_axis" if field == "num_chunks" else "num_chunks"
    assert getattr(a.splitkv_config, other) == getattr(SplitKVConfig(), other)  # nothing automatic
    assert a.splitkv_pipeline_auto == f"auto -> off (set by a flag: {flag})", a.splitkv_pipeline_auto


@pytest.mark.parametrize("kw,match", [
    (dict(splitkv_num_chunks=0), r"--splitkv-num-chunks must be >= 1, got 0"),
    (dict(splitkv_num_chunks=-2), r"--splitkv-num-chunks must be >= 1, got -2"),
    (dict(splitkv_num_chunks="2"), r"--splitkv-num-chunks"),
    (dict(splitkv_num_chunks=True), r"--splitkv-num-chunks"),
    (dict(splitkv_chunk_axis="cols"), r"--splitkv-chunk-axis must be one of \('rows', 'heads'\), got 'cols'"),
])
def test_pipeline_flags_bad_values(kw, match):
    with pytest.raises(SplitKVArgumentError, match=match):
        validate_splitkv_args(_spanning(**kw))


def test_validate_twice_gives_the_same_result():
    """validate_splitkv_args on the same args twice, or on another namespace, gives what each gets alone (no
    state in the process: the config lives on the namespace)."""
    env = {"LOCAL_WORLD_SIZE": "8"}
    a = _spanning()
    validate_splitkv_args(a, have_fa4=True, launcher_env=env)
    first = (a.splitkv_config, a.splitkv_pipeline_auto, a.splitkv_cp_ranks_per_node_auto, runtime_flag_values(a))
    validate_splitkv_args(a, have_fa4=True, launcher_env=env)
    assert (a.splitkv_config, a.splitkv_pipeline_auto, a.splitkv_cp_ranks_per_node_auto, runtime_flag_values(a)) == first
    assert a.splitkv_config.cp_ranks_per_node == 8 and _pipeline(a) == ON
    b = _spanning(context_parallel_size=4, dflash_num_anchors=4)  # inside one node
    validate_splitkv_args(b, have_fa4=True, launcher_env=env)
    assert _pipeline(b) == {} and b.splitkv_config.cp_ranks_per_node is None
    assert b.splitkv_pipeline_auto.startswith("auto -> off (LOCAL_WORLD_SIZE=8, TP 1: the CP group of 4 fits"), \
        b.splitkv_pipeline_auto
    assert runtime_flag_values(b)["splitkv_num_chunks"] == "auto -> 1 (splitkv_pipeline_auto)"
    env = {"LOCAL_WORLD_SIZE": "16"}  # the inputs changed (one node now): nothing stale remains
    validate_splitkv_args(a, have_fa4=True, launcher_env=env)
    assert _pipeline(a) == {} and a.splitkv_config.cp_ranks_per_node is None
    assert a.splitkv_pipeline_auto.startswith("auto -> off (") and a.splitkv_cp_ranks_per_node_auto.startswith("auto -> 1 (")


def test_runtime_flag_values_shows_the_automatic_pipeline():
    a = _spanning()
    shown = runtime_flag_values(a)  # before validate: what the run would do
    assert shown["splitkv_num_chunks"].startswith("auto (") and shown["splitkv_chunk_axis"].startswith("auto (")
    env = {"LOCAL_WORLD_SIZE": "8"}
    validate_splitkv_args(a, have_fa4=True, launcher_env=env)
    shown = runtime_flag_values(a)
    assert (shown["splitkv_num_chunks"], shown["splitkv_chunk_axis"]) == (
        "auto -> 2 (splitkv_pipeline_auto)", "auto -> heads (splitkv_pipeline_auto)")


def test_fresh_user_reasons():
    """Reasons a fresh user found wrong or unhelpful: TP = processes per node gave '1 CP ranks per node do not
    divide CP 16' (1 divides it); the automatic pipeline's 'off' reason names the flag that set it."""
    L, why = auto_cp_ranks_per_node(8, 16, launcher_env={"LOCAL_WORLD_SIZE": "8"})
    assert L == 1 and why.endswith("1 CP rank per node (one all-to-all)") and "divide" not in why, why
    env = {"LOCAL_WORLD_SIZE": "8"}
    a = _spanning(splitkv_num_chunks=1)
    validate_splitkv_args(a, have_fa4=True, launcher_env=env)
    assert "--splitkv-num-chunks" in a.splitkv_pipeline_auto, a.splitkv_pipeline_auto


@pytest.mark.parametrize("kw", [dict(splitkv_num_chunks=2), dict(splitkv_chunk_axis="heads")])
def test_pipeline_flags_refused_with_the_baselines(kw):
    """The merge pipeline is Split-KV's: its flags with --context-parallel-impl allgather-kv / ring-kv were accepted
    and ignored (fresh user, session 11)."""
    for impl in ("allgather-kv", "ring-kv"):
        with pytest.raises(SplitKVArgumentError, match=r"applies to --context-parallel-impl splitkv only .*" + impl):
            validate_splitkv_args(_args(context_parallel_impl=impl, **kw))
    validate_splitkv_args(_args(**kw))  # splitkv: fine


def test_c7_validate_args_names_flag():
    """Case C7: --num-query-groups 3 at TP 2 is an error naming both flags."""
    args = argparse.Namespace(
        context_parallel_impl="splitkv", tensor_model_parallel_size=2, context_parallel_size=2,
        num_attention_heads=12, num_query_groups=3, group_query_attention=True, micro_batch_size=1,
        dflash_num_anchors=8,
    )
    with pytest.raises(SplitKVArgumentError, match="--num-query-groups \\(3\\).*--tensor-model-parallel-size \\(2\\)"):
        validate_splitkv_args(args)


@pytest.mark.parametrize("name,value", [("WORLD_SIZE", "abc"), ("WORLD_SIZE", ""), ("WORLD_SIZE", "0"),
                                        ("RANK", "x1"), ("RANK", "-1")])
def test_pretrain_malformed_launcher_ints_are_one_error_line(monkeypatch, name, value):
    """Megatron-LM's parser reads WORLD_SIZE and RANK with int() when it is built: `WORLD_SIZE=abc` or an empty
    WORLD_SIZE ended `pretrain_dflash.py --parse-only` (and --help, and a run) in a ValueError traceback from
    megatron/training/arguments.py before our WORLD_SIZE check. Now a SplitKVArgumentError naming the variable
    and its value (the command line prints it as one line, exit 2); well-formed values still pass."""
    from megatron_splitkv.megatron.arguments import check_launcher_ints

    mod, base = _pretrain_parse_only("pretrain_dflash_ints")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    for other in ("WORLD_SIZE", "RANK", *LOCAL_SIZE_ENVS):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(SplitKVArgumentError, match=f"the launcher's {name} must be .*got {value!r}"):
        mod.main(base + ["--context-parallel-impl", "splitkv"])
    with pytest.raises(SplitKVArgumentError, match=f"the launcher's {name} must be"):
        mod.main(["--help"])
    check_launcher_ints({"WORLD_SIZE": " 8 ", "RANK": "0"})
    check_launcher_ints({})
