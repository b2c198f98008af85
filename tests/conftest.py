import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# the ops re-check the interval masks they build (ops.common.debug_checks; off by default in production)
os.environ.setdefault("MEGATRON_SPLITKV_DEBUG_CHECKS", "1")


# megatron-core's import-time notes about this machine (no Apex): emitted once, during collection, by
# whichever test module imports megatron first, so no per-test mark can cover them (tests/_warning_marks.py has
# the marks for the warnings tests trigger). Exact message only: any other warning still shows.
_IMPORT_TIME_WARNINGS = ("ignore:Apex is not installed. Falling back to Torch Norm:UserWarning",)


def pytest_configure(config):
    for spec in _IMPORT_TIME_WARNINGS:
        config.addinivalue_line("filterwarnings", spec)


@pytest.fixture(autouse=True)
def _restore_splitkv_env():
    """Put this process's MEGATRON_SPLITKV_* variables back after every test: `validate_splitkv_args` exports
    its automatic choices (MEGATRON_SPLITKV_RANKS_PER_NODE, _NUM_CHUNKS, _CHUNK_AXIS) into
    os.environ, which monkeypatch does not undo for a variable it did not set, so a later test's op would run
    with them (e.g. head chunks)."""
    before = {k: v for k, v in os.environ.items() if k.startswith("MEGATRON_SPLITKV_")}
    yield
    for k in [k for k in os.environ if k.startswith("MEGATRON_SPLITKV_") and k not in before]:
        del os.environ[k]
    os.environ.update(before)
    # and validate's process-wide record of what it exported (`arguments._EXPORTED`), now undone here: a later
    # test setting one of them to the same value must not have it taken for validate's (and put back)
    args_mod = sys.modules.get("megatron_splitkv.megatron.arguments")
    if args_mod is not None:
        args_mod._EXPORTED.clear()
