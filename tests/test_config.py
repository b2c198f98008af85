"""SplitKVConfig and the kernels' option objects: defaults, validation naming the field, digest stability."""
import dataclasses
import os
import subprocess
import sys

import pytest

from _splitkv_helpers import prepare_small, small_inputs
from megatron_splitkv.config import FlexOptions, SplitKVConfig, StaircaseOptions, resolve_config


def test_defaults_are_documented_behaviour():
    c = SplitKVConfig()
    assert (c.num_chunks, c.chunk_axis, c.cp_ranks_per_node) == (None, "rows", None)
    assert (c.overlap_q_gather, c.debug_checks, c.auto_fa4) == (True, False, True)
    assert c.staircase_auto_min_keys == 32768 and c.resolved_num_chunks == 1
    assert c.flex == FlexOptions() and c.staircase == StaircaseOptions()
    assert SplitKVConfig(chunk_axis="heads", num_chunks=2).resolved_num_chunks == 2


@pytest.mark.parametrize("kw, msg", [
    (dict(num_chunks=0), "SplitKVConfig.num_chunks"),
    (dict(num_chunks=2.0), "SplitKVConfig.num_chunks"),
    (dict(num_chunks=True), "SplitKVConfig.num_chunks"),
    (dict(chunk_axis="cols"), "SplitKVConfig.chunk_axis must be one of rows, heads"),
    (dict(cp_ranks_per_node=0), "SplitKVConfig.cp_ranks_per_node"),
    (dict(staircase_auto_min_keys=-1), "SplitKVConfig.staircase_auto_min_keys must be an int >= 0"),
    (dict(debug_checks=1), "SplitKVConfig.debug_checks must be True or False"),
    (dict(overlap_q_gather="0"), "SplitKVConfig.overlap_q_gather"),
    (dict(auto_fa4=None), "SplitKVConfig.auto_fa4"),
    (dict(flex={}), "SplitKVConfig.flex must be a FlexOptions"),
    (dict(staircase=FlexOptions()), "SplitKVConfig.staircase must be a StaircaseOptions"),
])
def test_config_errors_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(".", r"\.")):
        SplitKVConfig(**kw)


@pytest.mark.parametrize("cls, kw, msg", [
    (FlexOptions, dict(bucket_steps=0), "FlexOptions.bucket_steps must be a positive int"),
    (FlexOptions, dict(q_bucket_steps=1.5), "FlexOptions.q_bucket_steps"),
    (FlexOptions, dict(reuse_larger_kv_bucket=0), "FlexOptions.reuse_larger_kv_bucket"),
    (FlexOptions, dict(kernel_options=3), "FlexOptions.kernel_options must be None, a dict"),
    (StaircaseOptions, dict(group_blocks=0), "StaircaseOptions.group_blocks must be a positive int"),
    (StaircaseOptions, dict(key_buckets=0), "StaircaseOptions.key_buckets must be a positive int, got 0"),
    (StaircaseOptions, dict(bwd_mode="both"), "StaircaseOptions.bwd_mode must be one of auto, query, key"),
    (StaircaseOptions, dict(inner="staircase"), "StaircaseOptions.inner must be one of"),
    (StaircaseOptions, dict(inner=object()), "StaircaseOptions.inner must be a backend name"),
    (StaircaseOptions, dict(piece_min_pairs=True), "StaircaseOptions.piece_min_pairs"),
])
def test_kernel_option_errors_name_the_field(cls, kw, msg):
    with pytest.raises(ValueError, match=msg.replace(".", r"\.")):
        cls(**kw)


def test_frozen_normalised_and_replace():
    c = SplitKVConfig(chunk_axis="heads", flex=FlexOptions(kernel_options={"B": 2, "A": 1}))
    assert c.flex.kernel_options == (("A", 1), ("B", 2))
    assert c.flex.kernel_options_dict() == {"A": 1, "B": 2}
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_chunks = 3
    assert c.replace(num_chunks=None) is c
    assert c.replace(debug_checks=True).debug_checks and not c.debug_checks
    assert resolve_config(None, num_chunks=2) == SplitKVConfig(num_chunks=2)
    assert resolve_config(c) is c
    with pytest.raises(ValueError, match="config must be None or a SplitKVConfig"):
        resolve_config({"num_chunks": 2})
    with pytest.raises(ValueError, match="SplitKVConfig.num_chunks"):
        resolve_config(None, num_chunks=-1)


_VARIANTS = dict(num_chunks=2, chunk_axis="heads", cp_ranks_per_node=2,
                 overlap_q_gather=False, debug_checks=True, auto_fa4=False, staircase_auto_min_keys=0,
                 flex=FlexOptions(bucket_steps=3), staircase=StaircaseOptions(group_blocks=64))


def test_digest_changes_with_every_field():
    base = SplitKVConfig()
    fields = {f.name for f in dataclasses.fields(SplitKVConfig)}
    assert fields == set(_VARIANTS)  # a new field needs its variant here
    seen = {base.digest()}
    for name, value in _VARIANTS.items():
        other = dataclasses.replace(base, **{name: value})
        assert other.digest() not in seen
        seen.add(other.digest())
        changed = [k for k, v in other.field_digests().items() if v != base.field_digests()[k]]
        assert changed == [name]
    assert SplitKVConfig(num_chunks=2).digest() == SplitKVConfig(num_chunks=2).digest()


def test_digest_is_stable_across_processes():
    code = ("from megatron_splitkv.config import *; c = SplitKVConfig(num_chunks=2, flex=FlexOptions("
            "kernel_options={'BLOCK_M': 64, 'x': 'y'})); print(c.digest(), sorted(c.field_digests().items()))")
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                text=True).stdout)
    assert len(outs) == 1
    c = SplitKVConfig(num_chunks=2, flex=FlexOptions(kernel_options={"x": "y", "BLOCK_M": 64}))
    assert outs.pop().split()[0] == c.digest()


def test_deleted_options_are_refused_naming_their_replacement():
    """Options deleted for lack of a measured gain (docs/tuning.md "Deleted"): uneven head splits (the
    `head_split` argument: a ValueError naming the even head chunks that replace it, which still work), the
    fused-gather threshold and the config's head split (no such field), the legacy staircase rounding."""
    _, m = small_inputs()
    with pytest.raises(ValueError, match=r"head_split=\(1, 1\): uneven head splits were removed .*"
                                         r"chunk_axis='heads' with num_chunks=k"):
        prepare_small(m, chunk_axis="heads", head_split=(1, 1))
    even = prepare_small(m, chunk_axis="heads", num_chunks=2)
    assert even.num_chunks == 2 and even.chunk_axis == "heads"
    for name in ("head_split", "fused_bwd_gather_min_p"):
        with pytest.raises(TypeError, match=name):
            SplitKVConfig(**{name: 2})
    with pytest.raises(ValueError, match="StaircaseOptions.key_buckets must be a positive int, got 0"):
        StaircaseOptions(key_buckets=0)
