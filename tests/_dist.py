"""Multi-process test harness: run a function on P gloo ranks (CPU) and collect results.

`run_distributed(fn, world_size, *args, timeout=..., fresh=False)` is `tools.launch.run_gloo`
(see there: the gloo group over a file store, the teardown, every failure mode) with AssertionError as its
error: every way a worker can go wrong (an exception, a death, a non-zero exit before or after its report, a
timeout) fails the test naming the rank, never a silent pass.

Every call still gets new processes and a new gloo group (no state carries from one test to the next), but
they are forked from one "forkserver" process per test session that imported torch, torch.distributed,
megatron-core and this package once (`_PRELOAD`): a spawned worker spends 3 s (torch) to 8 s (megatron.core)
of CPU importing them, P times per test, which was most of the suite's time on 2 cores. The worker's
environment is the caller's `os.environ` at the call (a forked worker would otherwise see the server's, taken
when it started); its sys.path and working directory are the caller's (multiprocessing's preparation data).
`fresh=True` spawns a bare interpreter per rank as before: for a test of start-up or interpreter finalisation
(atexit handlers do not run in a forked worker, which ends with os._exit), or one that needs the workers to
inherit the caller's file descriptors (capfd). Since megatron-core is imported in every worker, a tensor a
worker returns is pickled through megatron-core's `torch.storage._load_from_bytes` override: unpickling it
imports megatron.core in the test process (as the Megatron test modules do at collection).
"""

import gc
import os

import torch.multiprocessing as mp

from tools import launch
from tools.launch import run_gloo  # the real one, also while `forked_ranks` patches launch.run_gloo


# imported once by the fork server (modules importable from any interpreter of this venv: Python 3.12's fork
# server does not take the caller's sys.path, so tests/ is not on its path)
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "tools.launch", "megatron_splitkv.comm",
            "megatron_splitkv.ops", "megatron_splitkv.megatron"]

_FORKSERVER = None  # the multiprocessing context, set up on first use


def _forkserver():
    global _FORKSERVER
    if _FORKSERVER is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _FORKSERVER = ctx
    return _FORKSERVER


def _with_environ(rank, world_size, environ, fn, *args):
    """`fn(rank, world_size, *args)` with os.environ set to `environ` (the caller's, at the call).

    First `gc.freeze()`: the objects inherited from the fork server (the preloaded modules) go to the
    collector's permanent generation, so the `gc.collect()` of the worker's teardown
    (`megatron_splitkv.comm.shutdown_distributed`, `exit_process`) neither walks them (0.3 s each with
    megatron-core imported) nor writes their headers (which copies the server's whole heap into every
    worker). Objects made from here on, the test's process groups among them, are collected as before."""
    gc.freeze()
    os.environ.clear()
    os.environ.update(environ)
    return fn(rank, world_size, *args)


def run_distributed(fn, world_size, *args, timeout=300, fresh=False):
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks (new processes, CPU).

    Returns the list of per-rank return values, index = rank. Raises AssertionError naming the rank when a
    rank raises (its traceback), dies or exits non-zero (its exit code, before or after reporting), or times
    out (`tools.launch.run_gloo`). The ranks are forked from the session's fork server with the
    caller's environment; `fresh=True`: spawned interpreters (`run_gloo`'s default)."""
    if fresh:
        return run_gloo(fn, world_size, *args, timeout=timeout, error=AssertionError)
    return run_gloo_forked(fn, world_size, *args, timeout=timeout, error=AssertionError)


def run_gloo_forked(fn, world_size, *args, timeout=300, error=RuntimeError, context=None):
    """`tools.launch.run_gloo` with the ranks forked from the session's fork server (the caller's
    environment, as `run_distributed`) instead of spawned: a stand-in for `launch.run_gloo` in the tests of a
    command's `main` (`forked_ranks`), which spend most of their time importing torch and Megatron in each
    spawned rank otherwise. The spawned path itself stays covered (tests/test_dist_launcher.py and one demo run
    of tests/test_demo_round_trip.py)."""
    assert context is None, "run_gloo_forked picks its own context"
    return run_gloo(_with_environ, world_size, dict(os.environ), fn, *args, timeout=timeout, error=error,
                    context=_forkserver())


def forked_ranks(monkeypatch):
    """Patch `tools.launch.run_gloo` (what `train_demo.main` and the examples call) with
    `run_gloo_forked` for the rest of the test (`monkeypatch`: pytest's fixture or a `pytest.MonkeyPatch`)."""
    monkeypatch.setattr(launch, "run_gloo", run_gloo_forked)
