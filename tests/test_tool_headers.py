"""The module docstrings of tools/*.py (what `python tools/X.py --help` users and readers see first) are
written for someone running the tool on their own GPU machine: no instructions that only hold on the
project's borrowed test machines (a "carried" wheel, /tmp/site or /tmp/tp installs, "lent" machines); those
stay in tools/run_gpu_suite.sh and the docs. step_overhead.py's missing-megatron hint follows the same rule."""

import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = sorted(glob.glob(os.path.join(ROOT, "tools", "*.py")))
MACHINE_ONLY = ("lending", "lent machine", "carried", "carry \"", "/tmp/tp", "/tmp/site", ".whl/", "--out $OUT")


@pytest.mark.parametrize("path", TOOLS, ids=os.path.basename)
def test_tool_docstring_has_no_test_machine_instructions(path):
    doc = ast.get_docstring(ast.parse(open(path).read())) or ""
    found = [w for w in MACHINE_ONLY if w in doc]
    assert not found, f"{os.path.basename(path)} module docstring: {found}"


def test_step_overhead_megatron_hint_is_for_any_machine():
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import step_overhead
    finally:
        sys.path.pop(0)
    assert "requirements.txt" in step_overhead.WHEEL_HINT
    assert not [w for w in MACHINE_ONLY if w in step_overhead.WHEEL_HINT], step_overhead.WHEEL_HINT
