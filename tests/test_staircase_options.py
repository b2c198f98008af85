"""Option and flag handling of the staircase kernel and its GPU tools (adversarial findings, session 3):
bad `inner` values and `inner="staircase"` (its own remainder kernel: unbounded recursion) raise a
ValueError naming the option at construction; non-integer numbers (inf, 1.7, True) are ValueErrors;
tools/probe_dense_backends.py and tools/profile_kernel.py check their flags before looking for a GPU."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_splitkv import kernels
from megatron_splitkv.kernels.staircase import StaircaseAttentionKernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("val", ["bogus", "0", "-1", "1.5", "staircase"])
def test_inner_env_bad_value_raises_at_construction(monkeypatch, val):
    monkeypatch.setenv("MEGATRON_SPLITKV_STAIRCASE_INNER", val)
    with pytest.raises(ValueError, match="inner"):
        StaircaseAttentionKernel()


@pytest.mark.parametrize("val", [5, "staircase", object()])
def test_inner_not_a_kernel_raises(val):
    with pytest.raises(ValueError, match="inner"):
        StaircaseAttentionKernel(inner=val)


def test_inner_staircase_kernel_object_rejected_and_registry_does_not_recurse(monkeypatch):
    with pytest.raises(ValueError, match="inner"):
        StaircaseAttentionKernel(inner=StaircaseAttentionKernel())
    monkeypatch.setenv("MEGATRON_SPLITKV_STAIRCASE_INNER", "staircase")
    monkeypatch.setattr(kernels, "_CACHE", {})
    with pytest.raises(ValueError, match="inner"):
        kernels.get_kernel("staircase", "cpu", torch.float64)


def test_inner_math_kernel_object_accepted():
    from megatron_splitkv.kernels.math import MathAttentionKernel

    k = StaircaseAttentionKernel(inner=MathAttentionKernel())
    assert k.options()["inner"] == "MathAttentionKernel"


@pytest.mark.parametrize("val", [float("inf"), float("nan"), 1.7, True, "1.5", "x"])
def test_numeric_option_non_integer_is_valueerror(val):
    with pytest.raises(ValueError, match="group_blocks"):
        StaircaseAttentionKernel(group_blocks=val)


def test_numeric_option_integral_float_accepted():
    assert StaircaseAttentionKernel(group_blocks=64.0).group_blocks == 64


def _run(args, code=None):
    cmd = [sys.executable] + (["-c", code] if code else args)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("flag,val", [("--keys", "abc"), ("--keys", "0"), ("--heads-kv", "0"), ("--head-dim", "0"),
                                      ("--rows", "-1"), ("--repeats", "0"), ("--heads-kv", "5")])
def test_probe_dense_backends_bad_flag(flag, val):
    p = _run(["tools/probe_dense_backends.py", flag, val])
    assert p.returncode == 2 and "Traceback" not in p.stderr and flag in p.stderr.splitlines()[-1], p.stderr


@pytest.mark.parametrize("flag,val", [("--keys", "abc"), ("--iters", "0"), ("--backends", "bogus"),
                                      ("--backends", "staircase:group_blocks=-1"),
                                      ("--backends", "staircase:nosuch=1"), ("--backends", "flex:x=1")])
def test_profile_kernel_flags_checked_before_gpu(flag, val):
    """Flags are checked by the parser before the GPU check: the same error on a host with a GPU (here
    simulated by patching torch.cuda.is_available)."""
    code = ("import runpy, sys, torch; torch.cuda.is_available = lambda: True; "
            f"sys.argv = ['profile_kernel.py', {flag!r}, {val!r}]; "
            "runpy.run_path('tools/profile_kernel.py', run_name='__main__')")
    p = _run(None, code)
    assert p.returncode == 2 and "Traceback" not in p.stderr and flag in p.stderr.splitlines()[-1], p.stderr
