"""Adversarial (s4): tools/staircase_shapes.py bad flags.

Its docstring promises "argparse errors (exit 2) for malformed flags and unknown options". Before the fix (session 4):
- `--strategy nope` ends in a ValueError traceback from bench.place (after the run started);
- `--moved-pair-ns nan`, `--call-us -1`, `--max-seqs -1` are accepted (NaN / negative costs in the tables);
- `--steps x`, `--cp 0`, `--sizes -5`, `--key-bins x` exit 2 but the message does not name the flag
  ("invalid literal for int() with base 10: 'x'", "expected a list of positive ints, got '0'").
Correct behaviour: exit 2 with a one-line message naming the flag, before any simulation.
"""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("staircase_shapes_adv_s4", REPO / "tools" / "staircase_shapes.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

# cheap otherwise (if a bad flag is accepted the run stays short)
BASE = ["--steps", "1", "--cp", "1", "--sizes", "8192", "--min-len", "4096", "--max-len", "8192",
        "--max-tokens", "8192", "--anchors", "8", "--quiet"]


@pytest.mark.parametrize("flag,value", [("--strategy", "nope"), ("--moved-pair-ns", "nan"), ("--call-us", "-1"),
                                        ("--max-seqs", "-1"), ("--steps", "x"), ("--cp", "0"), ("--sizes", "-5"),
                                        ("--key-bins", "x")])
def test_bad_flag_is_an_argparse_error_naming_it(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(BASE + [flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err.strip().splitlines()[-1], err[-300:]
