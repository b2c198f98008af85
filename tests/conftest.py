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


# The slowest test files, longest first (a serial run on 2 busy cores, 2026-12-08: 50-125 s each), moved to the
# front of the collection. `make test` runs the files on 2 pytest-xdist workers in collection order (`--dist
# loadfile --no-loadscope-reorder`), each worker taking the next file when it is free: the longest files first
# (longest processing time first) leave short files for the end, so the workers end close together instead of
# one running a long file alone. The other files keep their order after these; a name not collected is ignored.
_SLOWEST_FIRST = ("test_step_overhead.py", "test_faults_kill.py", "test_fa4_emulated.py", "test_dist_launcher.py",
                  "test_cases_op.py", "test_gpu_suite_tools.py", "test_staircase_options.py",
                  "test_demo_round_trip.py", "test_bench_smoke.py", "test_sliding_window.py", "test_teardown.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a file's tests stay in order
