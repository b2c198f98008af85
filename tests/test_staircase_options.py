"""Option and flag handling of the staircase kernel and its GPU tools (adversarial findings, session 3):
bad `inner` values and `inner="staircase"` (its own remainder kernel: unbounded recursion) raise a
ValueError naming the option at construction; non-integer numbers (inf, 1.7, True) are ValueErrors;
tools/probe_dense_backends.py and tools/profile_kernel.py check their flags before looking for a GPU."""

import os
import sys

import pytest
import torch

from megatron_splitkv import SplitKVConfig, StaircaseOptions, kernels
from megatron_splitkv.kernels.staircase import StaircaseAttentionKernel

from _tool_runs import run_tools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("val", ["bogus", "0", "-1", "1.5", "staircase"])
def test_inner_option_bad_value_raises_at_construction(val):
    with pytest.raises(ValueError, match="StaircaseOptions.inner must be one of"):
        StaircaseOptions(inner=val)


@pytest.mark.parametrize("val", [5, "staircase", object()])
def test_inner_not_a_kernel_raises(val):
    with pytest.raises(ValueError, match="inner"):
        StaircaseAttentionKernel(inner=val)


def test_inner_staircase_kernel_object_rejected_and_registry_does_not_recurse(monkeypatch):
    with pytest.raises(ValueError, match="inner"):
        StaircaseAttentionKernel(inner=StaircaseAttentionKernel())
    monkeypatch.setattr(kernels, "_CACHE", {})
    with pytest.raises(ValueError, match="inner"):
        kernels.get_kernel("staircase", "cpu", torch.float64,
                           config=SplitKVConfig(staircase=StaircaseOptions(inner="staircase")))


def test_inner_names_every_backend_but_staircase():
    """The remainder kernel takes every registered backend name except staircase: "auto" resolves to "fa4"
    where FlashAttention-4 is installed, so "fa4" is accepted by name too (was refused as a bad value)."""
    from megatron_splitkv.kernels import staircase

    assert set(staircase._INNER_CHOICES) == set(kernels.BACKENDS) - {"staircase"}
    for name in staircase._INNER_CHOICES:
        assert StaircaseAttentionKernel(StaircaseOptions(inner=name)).options()["inner"] == name
        assert StaircaseAttentionKernel(inner=name).options()["inner"] == name


def test_inner_math_kernel_object_accepted():
    from megatron_splitkv.kernels.math import MathAttentionKernel

    k = StaircaseAttentionKernel(inner=MathAttentionKernel())
    assert k.options()["inner"] == "MathAttentionKernel"


@pytest.mark.parametrize("val", [float("inf"), float("nan"), 1.7, True, "1.5", "x"])
def test_numeric_option_non_integer_is_valueerror(val):
    with pytest.raises(ValueError, match="group_blocks"):
        StaircaseAttentionKernel(group_blocks=val)


@pytest.mark.parametrize("val", [64.0, "64"])
def test_numeric_option_float_or_string_rejected(val):
    """An integer option takes ints only (the package's integer policy, `_ints.as_int`): 64.0 and "64" were
    accepted silently (int() of them); an int and any `__index__` integer still are."""
    with pytest.raises(ValueError, match=r"StaircaseOptions.group_blocks must be a positive int, got (64\.0|'64')"):
        StaircaseAttentionKernel(group_blocks=val)
    assert StaircaseAttentionKernel(group_blocks=64).group_blocks == 64
    assert StaircaseAttentionKernel(group_blocks=torch.tensor(64)).group_blocks == 64


PROBE_BAD = [("--keys", "abc"), ("--keys", "0"), ("--heads-kv", "0"), ("--head-dim", "0"), ("--rows", "-1"),
             ("--repeats", "0"), ("--heads-kv", "5")]
PROFILE_BAD = [("--keys", "abc"), ("--iters", "0"), ("--backends", "bogus"), ("--backends", "staircase:group_blocks=-1"),
               ("--backends", "staircase:nosuch=1"), ("--backends", "flex:x=1")]
PROFILE_BAD_OPTION_VALUES = ["staircase:group_blocks=\u00b2", "staircase:group_blocks=--5", "staircase:group_blocks=+64",
                             "staircase:group_blocks"]


def _tool_runs(cases, setup=""):
    """{argv: (returncode, stdout, stderr)} of `python SCRIPT ARGV` for every (script, argv) case, all in one
    interpreter (`_tool_runs.run_tools`, CUDA_VISIBLE_DEVICES="", `setup` run first)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return dict(zip((tuple(argv) for _, argv in cases), run_tools(cases, env, timeout=300, setup=setup)))


@pytest.fixture(scope="module")
def probe_runs():
    return _tool_runs([("tools/probe_dense_backends.py", [flag, val]) for flag, val in PROBE_BAD])


@pytest.fixture(scope="module")
def profile_runs():
    """tools/profile_kernel.py on a host with a GPU (simulated: torch.cuda.is_available patched to True)."""
    argvs = [[flag, val] for flag, val in PROFILE_BAD] + [["--backends", val] for val in PROFILE_BAD_OPTION_VALUES]
    return _tool_runs([("tools/profile_kernel.py", argv) for argv in argvs],
                      setup="import torch; torch.cuda.is_available = lambda: True")


@pytest.mark.parametrize("flag,val", PROBE_BAD)
def test_probe_dense_backends_bad_flag(flag, val, probe_runs):
    returncode, _, stderr = probe_runs[(flag, val)]
    assert returncode == 2 and "Traceback" not in stderr and flag in stderr.splitlines()[-1], stderr


@pytest.mark.parametrize("flag,val", PROFILE_BAD)
def test_profile_kernel_flags_checked_before_gpu(flag, val, profile_runs):
    """Flags are checked by the parser before the GPU check: the same error on a host with a GPU (here
    simulated by patching torch.cuda.is_available)."""
    returncode, _, stderr = profile_runs[(flag, val)]
    assert returncode == 2 and "Traceback" not in stderr and flag in stderr.splitlines()[-1], stderr


# -------------------------------------------------------------------- one strict parser for integer text


@pytest.mark.parametrize("text,want", [("64", 64), (" 64 ", 64), ("0", 0), ("-3", -3)])
def test_parse_int_accepts_plain_decimal(text, want):
    from megatron_splitkv._ints import is_int_text, parse_int

    assert parse_int(text, "X") == want and is_int_text(text)


@pytest.mark.parametrize("text", ["+64", "64.0", "1e2", "1_000", "0x40", "", " ", "--5", "\u00b2", "\u0663", "6 4"])
def test_parse_int_rejects_other_forms(text):
    from megatron_splitkv._ints import is_int_text, parse_int

    assert not is_int_text(text)
    with pytest.raises(ValueError) as exc:
        parse_int(text, "X", minimum=1)
    assert str(exc.value) == f"X must be a positive int (decimal digits), got {text!r}"


@pytest.mark.parametrize("text", ["1" * 4301, "-" + "9" * 5000, " " + "7" * 100000 + " "])
def test_parse_int_refuses_more_digits_than_the_limit_with_its_own_message(text):
    """More than 4300 digits: the package's message (variable, range, digit limit), not Python's
    int-conversion ValueError ("Exceeds the limit (4300 digits) ..."); the text is quoted cut."""
    from megatron_splitkv._ints import MAX_DIGITS, parse_int

    n = len(text.strip().lstrip("-"))
    with pytest.raises(ValueError) as exc:
        parse_int(text, "X", minimum=1, maximum=64)
    msg = str(exc.value)
    assert msg.startswith(f"X must be an int in [1, 64] (at most {MAX_DIGITS} digits), got a {n}-digit number ")
    assert "Exceeds the limit" not in msg and len(msg) < 200 and f"({len(text)} characters)" in msg


def test_parse_int_leading_zeros_and_the_digit_limit():
    from megatron_splitkv._ints import MAX_DIGITS, parse_int

    assert parse_int("0" * 5000 + "42", "X") == 42  # zeros are not significant digits
    assert parse_int("-" + "0" * 5000 + "3", "X") == -3
    assert parse_int("9" * MAX_DIGITS, "X") == int("9" * MAX_DIGITS)
    with pytest.raises(ValueError, match=r"^X must be an int >= 0, got '-00000000001'$"):
        parse_int("-" + "0" * 10 + "1", "X", minimum=0)


def _tool(name):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import importlib

        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


@pytest.mark.parametrize("val", ["+64", "\u00b2", "--5", "64.0"])
def test_tool_option_values_use_the_strict_parser(val):
    """`opt=value` in tools/staircase_shapes.py --variants and tools/gpu_check.py --staircase-sweep: an int
    option's value is a plain decimal integer, else a ValueError naming the option and the item ("+64" was
    kept as the string "+64", "²" and "--5" passed `isdigit` and crashed in int())."""
    shapes, gpu_check = _tool("staircase_shapes"), _tool("gpu_check")
    with pytest.raises(ValueError) as exc:
        shapes.parse_variants(f"a:group_blocks={val}")
    assert str(exc.value) == (f"group_blocks in 'a:group_blocks={val}' must be a positive int (decimal digits), "
                              f"got {val!r}")
    with pytest.raises(ValueError) as exc:
        gpu_check._parse_stair_sweep(f"group_blocks={val}")
    assert str(exc.value).startswith(f"--staircase-sweep: group_blocks in 'group_blocks={val}' must be a positive int")
    # the accepted forms are unchanged: ints for int options, strings for choices
    assert shapes.parse_variants("a:group_blocks=64,bwd_mode=key") == [("a", {"group_blocks": 64, "bwd_mode": "key"})]
    assert gpu_check._parse_stair_sweep("min_pairs=0,gqa=native") == [
        ("min_pairs=0,gqa=native", {"min_pairs": 0, "gqa": "native"})]


@pytest.mark.parametrize("val", PROFILE_BAD_OPTION_VALUES)
def test_profile_kernel_option_values_strict(val, profile_runs):
    """tools/profile_kernel.py --backends staircase:<opt>=<value>: a flag error (exit 2, the flag named on the
    last line), never a traceback ("²" passed `isdigit` and int() raised uncaught)."""
    returncode, _, stderr = profile_runs[("--backends", val)]
    assert returncode == 2 and "Traceback" not in stderr, stderr
    assert "--backends" in stderr.splitlines()[-1], stderr


def test_as_int_message_for_an_int_beyond_the_conversion_limit():
    """An out-of-range int too long for repr() (Python's 4300-digit limit) raised Python's own ValueError while
    the message was formatted; now the package's message, with the digit count."""
    from megatron_splitkv._ints import as_int

    for v in (10 ** 5000, -(10 ** 5000)):
        with pytest.raises(ValueError, match=r"^block_size must be an int in \[1, 64\], got an int of about 5001 "
                                             r"digits$"):
            as_int(v, "block_size", minimum=1, maximum=64)
