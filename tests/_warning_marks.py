"""Warnings some tests trigger on purpose or cannot avoid, as precise `pytest.mark.filterwarnings` marks
(message prefix + category) for the modules / tests that trigger them (`pytestmark = [...]`), instead of a
global filter: an unexpected warning anywhere else still shows in the summary.

Megatron-Core 0.19 on a CPU machine without Transformer Engine / Apex (the test environment):
- MEGATRON_ENV: notes about this machine (no Apex / TE, no rank in the environment) and its own
  deprecations (argparse `type=` with BooleanOptionalAction under Python 3.12, "full scope" of its
  TransformerConfig default, MLP / linear layers built without ffn_hidden_size / tp_group by its specs).
- FORK: DataLoader workers (the data pipeline's `--dflash-data-workers`) are forked from a process that
  already runs torch threads; Python 3.12 warns, the tests use it deliberately (the training default).
Import-time notes (emitted once, at collection, by whichever module imports megatron first) are in
conftest.py: no test mark can cover them.
"""

import pytest

_MEGATRON_MESSAGES = (
    ("'type' is deprecated as of Python 3.12", "DeprecationWarning"),
    ("full scope is deprecated", "UserWarning"),
    ("Could not determine rank from torch.distributed", "UserWarning"),
    ("Transformer Engine and Apex are not installed", "UserWarning"),
    ("Only transformer-engine>=1.7.0 supports MoE experts", "UserWarning"),
    ("MLP requires ffn_hidden_size, but it was not provided", "DeprecationWarning"),
    ("Warning. tp_group is None, using default tp group", "DeprecationWarning"),  # '.': the mark splits on ':'
)

MEGATRON_ENV = [pytest.mark.filterwarnings(f"ignore:{msg}:{cat}") for msg, cat in _MEGATRON_MESSAGES]
FORK = [pytest.mark.filterwarnings(
    r"ignore:This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks:DeprecationWarning")]
