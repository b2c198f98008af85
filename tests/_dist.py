"""Multi-process test harness: run a function on P gloo ranks (CPU) and collect results.

`run_distributed(fn, world_size, *args, timeout=...)` is `megatron_splitkv.launch.run_gloo` (see there: the
spawn, the gloo group over a file store, the teardown, every failure mode) with AssertionError as its error:
every way a worker can go wrong (an exception, a death, a non-zero exit before or after its report, a
timeout) fails the test naming the rank, never a silent pass.
"""

from megatron_splitkv.launch import run_gloo


def run_distributed(fn, world_size, *args, timeout=300):
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks (spawned processes, CPU).

    Returns the list of per-rank return values, index = rank. Raises AssertionError naming the rank when a
    rank raises (its traceback), dies or exits non-zero (its exit code, before or after reporting), or times
    out (`megatron_splitkv.launch.run_gloo`)."""
    return run_gloo(fn, world_size, *args, timeout=timeout, error=AssertionError)
