"""A kernel option the chosen kernel ignores warns once, naming the option, the kernel in use and what applies.

`SplitKVConfig.flex` (`FlexOptions`) is read by the flex kernel and the staircase kernel's flex remainder only,
`SplitKVConfig.staircase` (`StaircaseOptions`) by the staircase kernel only. An op call whose kernel reads
neither (math, fa4, te; staircase with a math remainder for FlexOptions) gets one `UserWarning` per process for
each option set and kernel, with the exact text below; defaults, or options the kernel (or "auto" on this
device) does use, warn nothing. One process on CPU: "auto" is the math kernel here, and the staircase kernel's
remainder ("auto") is math too. Source: issue 24 item 4.
"""

import warnings

import pytest
import torch

from megatron_splitkv import kernels
from megatron_splitkv.config import FlexOptions, SplitKVConfig, StaircaseOptions
from megatron_splitkv.ops import prepare_splitkv_metadata, splitkv_attention

B, H, D = 4, 2, 8


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch):
    monkeypatch.setattr(kernels, "_WARNED", set())  # as in a new process: nothing warned yet


def _calls(config, backend, n=2, metadata=False):
    """n op calls (one process) with `config` and `backend`; the warnings about SplitKVConfig they emit."""
    g = torch.Generator().manual_seed(0)
    q, kb, vb = (torch.randn(2 * B, H, D, generator=g) for _ in range(3))
    kc, vc = (torch.randn(6, H, D, generator=g) for _ in range(2))
    m = (torch.zeros(2, dtype=torch.int64), torch.tensor([3, 5]), torch.zeros(6, dtype=torch.int64), torch.arange(6))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if metadata:
            meta = prepare_splitkv_metadata(*m, block_size=B, num_heads_q=H, num_heads_kv=H, head_dim=D,
                                            dtype=q.dtype, config=config)
        for _ in range(n):
            if metadata:
                splitkv_attention(q, kc, vc, kb, vb, metadata=meta, backend=backend)
            else:
                splitkv_attention(q, kc, vc, kb, vb, *m, block_size=B, backend=backend, config=config)
    return [str(w.message) for w in seen if str(w.message).startswith("SplitKVConfig.")]


def test_flex_options_with_the_math_kernel_warn_once():
    got = _calls(SplitKVConfig(flex=FlexOptions(bucket_steps=3, cache_block_mask=False)), "math", n=3)
    assert got == [
        "SplitKVConfig.flex sets bucket_steps=3, cache_block_mask=False, but the local kernel in use is 'math' "
        "(backend='math' on cpu), which does not read FlexOptions: ignored (FlexOptions applies to the flex kernel "
        "and the staircase kernel's flex remainder only); the math kernel runs with its own settings"]


def test_staircase_options_with_auto_on_cpu_warn_once_with_metadata():
    got = _calls(SplitKVConfig(staircase=StaircaseOptions(group_blocks=64)), "auto", n=3, metadata=True)
    assert got == [
        "SplitKVConfig.staircase sets group_blocks=64, but the local kernel in use is 'math' (backend='auto' on "
        "cpu), which does not read StaircaseOptions: ignored (StaircaseOptions applies to the staircase kernel "
        "only); the math kernel runs with its own settings"]


def test_flex_options_with_a_math_remainder_of_the_staircase_kernel_warn():
    cfg = SplitKVConfig(flex=FlexOptions(q_bucket_steps=4), staircase=StaircaseOptions(min_keys=8, min_pairs=0))
    got = _calls(cfg, "staircase")
    assert got == [  # the staircase options are read: only the flex options are reported
        "SplitKVConfig.flex sets q_bucket_steps=4, but the local kernel in use is 'staircase' (backend='staircase' "
        "on cpu), which does not read FlexOptions: ignored (FlexOptions applies to the flex kernel and the "
        "staircase kernel's flex remainder only); the staircase kernel runs with its own settings"]


def test_defaults_and_used_options_warn_nothing():
    assert _calls(SplitKVConfig(), "math") == []
    assert _calls(SplitKVConfig(staircase=StaircaseOptions(min_keys=8)), "staircase") == []
    # another set of fields is another warning; the same set again (another config object) is not
    first = _calls(SplitKVConfig(flex=FlexOptions(bucket_steps=3)), "math", n=1)
    again = _calls(SplitKVConfig(flex=FlexOptions(bucket_steps=3)), "math", n=1)
    other = _calls(SplitKVConfig(flex=FlexOptions(bucket_steps=5)), "math", n=1)
    assert len(first) == 1 and again == [] and len(other) == 1 and "bucket_steps=5" in other[0], (first, again, other)
