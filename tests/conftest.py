import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# the ops re-check the interval masks they build (ops.common.debug_checks; off by default in production)
os.environ.setdefault("MEGATRON_SPLITKV_DEBUG_CHECKS", "1")
