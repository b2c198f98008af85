"""Spawn launcher: run a function on P gloo ranks (CPU processes) and collect results, failing fast.

`run_gloo(fn, world_size, *args, timeout=..., error=RuntimeError)` spawns `world_size` processes,
initialises a gloo process group over a file store in a fresh temporary directory, calls
`fn(rank, world_size, *args)` on each, and returns the list of per-rank return values (which must be
picklable). Used by examples/train_demo.py (`make demo`), examples/op_demo.py, tools and the test suite (tests/_dist.py).
Not product API: Megatron jobs and the op's users start their ranks with torchrun.

Every way a worker can go wrong raises `error` naming the rank, as soon as it is seen (the other ranks,
which may wait in a collective forever, are killed):
- an exception on any rank: that rank's traceback (the lowest such rank when several reported one), preceded by
  the ranks that died without a report meanwhile (a segfault on one rank makes its peers fail in their
  collectives with gloo's "Connection closed by peer": the dead rank and its signal are the cause);
- a rank that dies before reporting a result (os._exit, segfault, abort, killed): its exit code (a
  negative code is the signal number, named);
- a rank that reported its result but then exits non-zero (e.g. an abort in its teardown or in interpreter
  finalisation): its exit code;
- a rank that does not report within `timeout` seconds (whole call, from the spawn), or does not exit within
  `TEARDOWN_TIMEOUT` seconds after the last result: a timeout naming the ranks.

Workers tear torch.distributed down with `megatron_splitkv.comm.shutdown_distributed` (barrier, Megatron
groups, default group, gc) and end with `exit_process`, the shared teardown of the tools: a bare
`destroy_process_group()` can leave gloo worker threads alive into interpreter finalisation, where they
abort the process now and then ("terminate called without an active exception", exit code -6).
"""

import os
import pickle
import queue as queue_mod
import signal
import tempfile
import time
import traceback

import torch.multiprocessing as mp

__all__ = ["run_gloo", "TEARDOWN_TIMEOUT"]

# seconds a worker may take to exit after the last rank reported its result (teardown, interpreter exit)
TEARDOWN_TIMEOUT = 120
# seconds a worker that exited may take for its already-sent report to be read from the queue
_DRAIN_TIMEOUT = 5


def _die_with_parent(parent_pid: int) -> None:
    """Linux: this process gets SIGKILL when its parent (the launcher) dies, e.g. killed with kill -9, so no
    orphaned rank goes on training and writing checkpoints beside a resumed run; exits at once when the parent is
    already gone. Elsewhere (no prctl) a no-op. A worker started by a fork server (the tests' context) has the
    server as its parent: it only checks that the launcher still lives."""
    if os.getppid() != parent_pid:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def _worker(rank, world_size, init_file, fn, args, queue, parent_pid=None):
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    import torch
    import torch.distributed as dist

    from megatron_splitkv.comm import exit_process, shutdown_distributed

    torch.set_num_threads(1)
    ok = False
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        out = fn(rank, world_size, *args)
        # pickle by value here: tensors sent through a torch.multiprocessing queue would travel as
        # shared-memory handles that die with this process.
        payload = pickle.dumps(out)
        del out
        ok = True
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = traceback.format_exc()
    queue.put((rank, ok, payload))
    # the report must be in the pipe before this process can end with os._exit (exit_process)
    queue.close()
    queue.join_thread()
    # barrier only after a normal return: a rank that failed must not wait for ranks that may never come
    shutdown_distributed(barrier=ok)
    exit_process(0 if ok else 1)


def _describe_exit(code):
    """'exit code 3' / 'exit code -6 (SIGABRT)' for a multiprocessing exit code."""
    if code is not None and code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def run_gloo(fn, world_size, *args, timeout=300, error=RuntimeError, context=None):
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks (spawned processes, CPU).

    `fn` must be importable by the spawned processes (a module-level function). `context` is the
    multiprocessing context that starts them (default: `torch.multiprocessing.get_context("spawn")`; the
    tests pass a "forkserver" one whose server has torch and Megatron imported once). Returns the list of
    per-rank return values, index = rank. `timeout` (seconds) bounds the whole call up to the last rank's
    result; the workers then have `TEARDOWN_TIMEOUT` seconds to exit. Raises `error` (an exception class;
    RuntimeError by default, AssertionError in the tests) naming the rank as soon as a rank raises (its
    traceback), dies or exits non-zero (its exit code, before or after reporting), or times out; the
    other ranks are killed then."""
    ctx = context if context is not None else mp.get_context("spawn")
    queue = ctx.Queue()
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, queue, os.getpid()), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results, errors = {}, {}
        dead = {}  # rank -> exit code, for ranks that ended without a report
        failure = None
        killed = set()  # pids this launcher killed
        try:
            while len(results) + len(errors) + len(dead) < world_size and not errors and not dead:
                now = time.monotonic()
                if now >= deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    failure = (f"ranks {missing} of {world_size} did not finish within {timeout}s (hang?); "
                               f"rank {missing[0]} did not report a result")
                    break
                try:
                    rank, ok, payload = queue.get(timeout=min(0.5, deadline - now))
                except queue_mod.Empty:
                    # a rank that ended has its report (if any) already in the pipe: drain before judging it
                    ended = [r for r, p in enumerate(procs)
                             if r not in results and r not in errors and p.exitcode is not None]
                    if not ended:
                        continue
                    try:
                        rank, ok, payload = queue.get(timeout=_DRAIN_TIMEOUT)
                    except queue_mod.Empty:
                        for r in ended:
                            dead[r] = procs[r].exitcode
                        continue
                (results if ok else errors)[rank] = pickle.loads(payload) if ok else payload
        finally:
            if errors or dead or failure:
                # some rank failed: the others may wait in a collective forever. A rank that reported an
                # exception tears down without a barrier: give it a moment to exit on its own.
                for r in errors:
                    procs[r].join(timeout=_DRAIN_TIMEOUT)
                for p in procs:
                    p.join(timeout=0.5)
                    if p.is_alive():
                        killed.add(p.pid)
                        p.kill()
                        p.join()
            else:
                teardown_deadline = time.monotonic() + TEARDOWN_TIMEOUT
                for p in procs:
                    p.join(timeout=max(0.0, teardown_deadline - time.monotonic()))
        if errors:
            # reports still in the pipe (the loop stopped at the first error): the lowest failed rank is named,
            # whichever report came first; a rank that reported did not die silently
            reported = set(results)
            try:
                while True:
                    r, ok, payload = queue.get(timeout=0.2)
                    reported.add(r)
                    if not ok:
                        errors[r] = payload
            except queue_mod.Empty:
                pass
            rank = min(errors)
            how = ("killed by the launcher after its report" if procs[rank].pid in killed
                   else _describe_exit(procs[rank].exitcode))
            # a rank that died without a report (segfault, os._exit) is usually why the others failed (gloo:
            # "Connection closed by peer"), and its death may be noticed after their reports: named first
            died = [r for r, p in enumerate(procs) if r not in reported and r not in errors and p.pid not in killed
                    and p.exitcode is not None]
            cause = "".join(f"rank {r} of {world_size} exited without reporting a result, "
                            f"{_describe_exit(procs[r].exitcode)}; " for r in died)
            raise error(f"{cause}rank {rank} of {world_size} failed ({how}):\n{errors[rank]}")
        if dead:
            rank = min(dead)
            raise error(
                f"rank {rank} of {world_size} exited without reporting a result, {_describe_exit(dead[rank])} "
                f"(its output is above in the captured stderr)")
        if failure:
            raise error(failure)
        for rank, p in enumerate(procs):
            if p.is_alive():
                for q in procs:
                    if q.is_alive():
                        q.kill()
                        q.join()
                raise error(f"rank {rank} of {world_size} reported its result but did not exit within "
                                     f"{TEARDOWN_TIMEOUT}s (hang in teardown?)")
        for rank, p in enumerate(procs):
            if p.exitcode != 0:
                raise error(f"rank {rank} of {world_size} reported its result but then ended with "
                                     f"{_describe_exit(p.exitcode)} (teardown / interpreter exit; its output is "
                                     f"above in the captured stderr)")
        return [results[r] for r in range(world_size)]
