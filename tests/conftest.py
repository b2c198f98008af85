import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


# megatron-core's import-time notes about this machine (no Apex): emitted once, during collection, by
# whichever test module imports megatron first, so no per-test mark can cover them (tests/_warning_marks.py has
# the marks for the warnings tests trigger). Exact message only: any other warning still shows.
_IMPORT_TIME_WARNINGS = ("ignore:Apex is not installed. Falling back to Torch Norm:UserWarning",)


def pytest_configure(config):
    for spec in _IMPORT_TIME_WARNINGS:
        config.addinivalue_line("filterwarnings", spec)
