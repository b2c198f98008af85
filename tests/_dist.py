"""Multi-process test harness: run a function on P gloo ranks (CPU) and collect results.

`run_distributed(fn, world_size, *args, timeout=...)` spawns `world_size` processes, initialises a gloo
process group over a file store in a fresh temporary directory, calls `fn(rank, world_size, *args)` on
each, and returns the list of per-rank return values (which must be picklable). An exception on any
rank is re-raised in the parent with that rank's traceback; a rank that does not finish within
`timeout` seconds fails the test (a hang is a failure, never a silent pass).
"""

import os
import pickle
import queue as queue_mod
import tempfile
import traceback

import torch.multiprocessing as mp


def _worker(rank, world_size, init_file, fn, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # pickle by value here: tensors sent through a torch.multiprocessing queue would travel as
        # shared-memory handles that die with this process.
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_distributed(fn, world_size, *args, timeout=300):
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, queue), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results, errors = {}, {}
        try:
            for _ in range(world_size):
                rank, ok, payload = queue.get(timeout=timeout)
                (results if ok else errors)[rank] = pickle.loads(payload) if ok else payload
                if errors:
                    break
        except queue_mod.Empty as exc:  # some rank hung
            missing = sorted(set(range(world_size)) - set(results) - set(errors))
            raise AssertionError(f"ranks {missing} did not finish within {timeout}s (hang?)") from exc
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
        if errors:
            rank = min(errors)
            raise AssertionError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
        return [results[r] for r in range(world_size)]
