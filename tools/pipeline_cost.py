"""Main-process host cost of the prefetching data pipeline per item, on CPU (issue 6; docs/lab/perf-notes.md item 17).

`data.pipeline.PrefetchedBatches` runs the planner, the sharding, the draft blocks and (with a `MetadataSpec`) the
Split-KV metadata in DataLoader worker processes; what is left on the training process per step is `next()`
(the DataLoader's receive + unpickle of the item), the pin-memory thread's `PlannedBatch.pin_memory` (on CUDA),
`PlannedBatch.to(device)` and `SplitKVMetadata.bind`. This tool measures those pieces per item at the drafter's
real shapes (Qwen3-8B: 32 / 8 heads, head dim 128, bf16; 512 anchors x block 16; one sequence per context;
LPT, chunk 2048 as tools/step_overhead.py) on CPU, for one CP rank (simulated: the pipeline takes cp_rank /
cp_size; bind gets a fake process group of size P):

  worker ms      `plan_batch` alone in this process (what a worker spends per item; not on the step)
  tensors        tensors / storages crossing the worker boundary per item (pickled by the DataLoader's queue:
                 one shared-memory segment, i.e. one file descriptor, each) and pickled bytes
  next ms        `next()` of a `PrefetchedBatches` (1 worker), the worker's item already received (the tool
                 waits until the DataLoader's queue holds it, then times next alone), median
  unpickle ms    the item's unpickle alone (ForkingPickler, in this process: the rebuild part of next)
  pin-rebuild ms `PlannedBatch.pin_memory`'s work without the page-locked copy (CPU has no pinned memory: the
                 buffer is cloned instead, the clone's time taken out): the pin thread's Python per item
  to ms          `PlannedBatch.to("cpu")` (no copy on CPU: the rebuild of the item around the moved buffer)
  bind ms        `item.metadata.bind(group, "cpu")`
  main ms        next + to + bind (the step's host time; the pin thread's is separate), wall
  next cpu ms, main cpu ms  the same on the main thread's CPU clock (`time.thread_time`: without the waits for
                 the pipe, other processes or threads; the host work itself; 1 ms resolution on some kernels)

Medians over `--reps` items (after `--warmup`); CPU times are noisy: compare alternated runs.

    PYTHONPATH=$PWD python tools/pipeline_cost.py                       # 16K, 32K, 128K; P = 1, 2
    PYTHONPATH=$PWD python tools/pipeline_cost.py --contexts 16384 --cp-sizes 2 --reps 50 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pickle
import pstats
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _repeat(batch):
    while True:
        yield batch


def _batch(context, anchors, seed=0):
    from megatron_splitkv.data.sharegpt import make_packed_batch

    rng = np.random.default_rng(seed + context)
    ids = rng.integers(0, 151669, size=context, dtype=np.int64)
    return make_packed_batch([(ids, np.ones(context, dtype=bool))], num_anchors=anchors, rng=rng)


def crossing(item):
    """(tensors, shared segments, pickled bytes) of `item` through torch's ForkingPickler (what the DataLoader's
    worker queue does): tensors = torch tensors reduced by torch's reducers (meta-device ones included) plus
    `_ItemBuffer`s; segments = storages torch shares plus `_ItemBuffer`s (one shared-memory segment each)."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    from megatron_splitkv.data import pipeline

    counts = {"tensor": 0, "storage": 0, "item": 0}
    orig_t, orig_s = reductions.reduce_tensor, reductions.reduce_storage
    orig_i = getattr(pipeline, "_reduce_item_buffer", None)

    def counted(key, fn):
        def f(x):
            counts[key] += 1
            return fn(x)
        return f

    class P(ForkingPickler):
        _extra_reducers = dict(ForkingPickler._extra_reducers)

    for k, v in list(P._extra_reducers.items()):
        if v is orig_t:
            P._extra_reducers[k] = counted("tensor", orig_t)
        elif v is orig_s:
            P._extra_reducers[k] = counted("storage", orig_s)
        elif v is orig_i:
            P._extra_reducers[k] = counted("item", orig_i)
    buf = io.BytesIO()
    P(buf, pickle.HIGHEST_PROTOCOL).dump(item)
    return counts["tensor"] + counts["item"], counts["storage"] + counts["item"], len(buf.getvalue())


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def _ready(pipe):
    """Items put by the worker (the queue's count) when the first of them is already in the pipe (its bytes
    written by the worker's feeder thread), else 0."""
    it = pipe._it
    try:
        cached = len(it._task_info.get(it._rcvd_idx, ())) == 2
        if not cached and not it._data_queue._reader.poll(0):
            return 0
        return int(it._data_queue.qsize()) + int(cached)
    except (AttributeError, NotImplementedError, TypeError):
        return None


def _group(P, rank):
    """A process group of size P in which this process is `rank` (torch's fake backend: no communication)."""
    import torch.distributed as dist

    if P == 1:
        return None
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=P)
    if dist.get_world_size() != P or dist.get_rank() != rank:
        raise SystemExit("pipeline_cost: one CP size / rank per process (run --cp-sizes one at a time)")
    return dist.group.WORLD


def measure(context, P, rank, args):
    from megatron_splitkv.data.pipeline import MetadataSpec, PrefetchedBatches, plan_batch

    batch = _batch(context, args.anchors)
    spec = MetadataSpec(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype=torch.bfloat16,
                        num_chunks=args.num_chunks, flex_block_masks=args.flex)
    kw = dict(cp_size=P, cp_rank=rank, block_size=16, mask_token_id=151669, chunk_size=args.chunk_size,
              strategy="lpt", metadata=spec)
    group = _group(P, rank)
    ws = []
    for _ in range(3):
        t0 = time.perf_counter()
        item = plan_batch(batch, **kw)
        ws.append((time.perf_counter() - t0) * 1e3)
    # unpickle alone (the item pickled once with ForkingPickler; shared-memory storages as a worker makes them)
    from multiprocessing.reduction import ForkingPickler

    row = {"context": context, "P": P, "rank": rank, "worker ms": _med(ws)}
    nxt, unp, pin, to, bind, cpu_next, cpu_main = [], [], [], [], [], [], []
    prof = cProfile.Profile(time.thread_time) if args.profile else None  # CPU time of this thread
    with PrefetchedBatches(lambda: _repeat(batch), num_workers=1, prefetch=2, pin_memory=False, **kw) as pipe:
        for i in range(args.warmup + args.reps):
            t_wait = time.perf_counter()
            while (_ready(pipe) or 0) < args.ready:
                time.sleep(0.001)
                if time.perf_counter() - t_wait > 60:
                    raise SystemExit("pipeline_cost: the worker produced nothing for 60 s")
            if prof is not None and i >= args.warmup:
                prof.enable()
            h0, t0 = time.thread_time(), time.perf_counter()
            it = next(pipe)
            h1, t1 = time.thread_time(), time.perf_counter()
            dev = it.to("cpu")
            t2 = time.perf_counter()
            dev.metadata.bind(group, "cpu")
            h3, t3 = time.thread_time(), time.perf_counter()
            if prof is not None:
                prof.disable()
            if i == 0:  # an item as a worker sends it (its buffers in shared memory)
                row["tensors"], row["segments"], nbytes = crossing(it)
                row["pickled KiB"] = nbytes / 1024
            # the pin thread's work without the page-locked copy: the clone's own time taken out
            upload = it.buffers[0]
            c0 = time.perf_counter()
            upload.clone()
            c1 = time.perf_counter()
            it._with_upload(lambda t: t.clone(), pinning=True) if hasattr(it, "_with_upload") else it.pin_memory()
            c2 = time.perf_counter()
            data = ForkingPickler.dumps(it)
            u0 = time.perf_counter()
            pickle.loads(data)
            u1 = time.perf_counter()
            if i >= args.warmup:
                cpu_next.append((h1 - h0) * 1e3)
                cpu_main.append((h3 - h0) * 1e3)
                nxt.append((t1 - t0) * 1e3)
                to.append((t2 - t1) * 1e3)
                bind.append((t3 - t2) * 1e3)
                pin.append(max(0.0, (c2 - c1) - (c1 - c0)) * 1e3)
                unp.append((u1 - u0) * 1e3)
            time.sleep(args.gap)
    row.update({"next ms": _med(nxt), "unpickle ms": _med(unp), "pin-rebuild ms": _med(pin), "to ms": _med(to),
                "bind ms": _med(bind), "main ms": _med([a + b + c for a, b, c in zip(nxt, to, bind)]),
                "next cpu ms": _med(cpu_next), "main cpu ms": _med(cpu_main)})
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        row["profile"] = s.getvalue()
    return row


COLS = ["context", "P", "rank", "worker ms", "tensors", "segments", "pickled KiB", "next ms", "unpickle ms",
        "pin-rebuild ms", "to ms", "bind ms", "main ms", "next cpu ms", "main cpu ms"]


def main(argv=None):
    from megatron_splitkv._ints import float_arg, int_arg  # finite reals only: float() takes "nan" / "inf"
    from tools import benchlib as bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16384,32768,131072",
                    help="context tokens (one sequence each), comma-separated, each once and >= 2")
    ap.add_argument("--cp-sizes", default="1,2", help="CP sizes, comma-separated, each once and >= 1")
    ap.add_argument("--cp-rank", type=int_arg(0), default=0, help="the simulated CP rank (default 0; clipped to P - 1)")
    ap.add_argument("--anchors", type=int_arg(1), default=512)
    ap.add_argument("--chunk-size", type=int_arg(1), default=2048)
    ap.add_argument("--num-chunks", type=int_arg(1), default=1)
    ap.add_argument("--no-flex", dest="flex", action="store_false",
                    help="without the host-built FlexAttention tables (default: with, as on CUDA)")
    ap.add_argument("--reps", type=int_arg(1), default=30)
    ap.add_argument("--warmup", type=int_arg(0), default=3)
    ap.add_argument("--gap", type=float_arg(0), default=0.0, help="seconds to sleep after each item")
    ap.add_argument("--ready", type=int_arg(0), default=1,
                    help="items received before next is timed (default 1; 2 = the worker idle, prefetch 2)")
    ap.add_argument("--switch-interval", type=float_arg(0, above=True), default=None,
                    help="sys.setswitchinterval (s, > 0), inherited by forked workers")
    ap.add_argument("--sharing-strategy", default=None, help="torch.multiprocessing sharing strategy")
    ap.add_argument("--profile", action="store_true", help="cProfile of next + to + bind, printed per row")
    ap.add_argument("--top", type=int_arg(1), default=20)
    args = ap.parse_args(argv)
    sizes = bench.int_list_arg(ap, "--cp-sizes", args.cp_sizes, 1)
    contexts = bench.int_list_arg(ap, "--contexts", args.contexts, 2)
    if len(sizes) > 1 and os.environ.get("PIPELINE_COST_CHILD") is None:
        # one process per CP size (bind's fake group is the default group of the process)
        import subprocess

        for P in sizes:
            argv = [a for a in sys.argv[1:]]
            if "--cp-sizes" in argv:
                j = argv.index("--cp-sizes")
                argv[j + 1] = str(P)
            else:
                argv += ["--cp-sizes", str(P)]
            env = dict(os.environ, PIPELINE_COST_CHILD="1")
            subprocess.run([sys.executable, os.path.abspath(__file__)] + argv, check=True, env=env)
        return
    torch.set_num_threads(1)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.sharing_strategy:
        torch.multiprocessing.set_sharing_strategy(args.sharing_strategy)
    if os.environ.get("PIPELINE_COST_CHILD") is None or sizes[0] == 1:
        print("| " + " | ".join(COLS) + " |")
        print("|" + "---|" * len(COLS))
    for P in sizes:
        for c in contexts:
            row = measure(c, P, min(args.cp_rank, P - 1), args)
            print("| " + " | ".join(f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k]) for k in COLS)
                  + " |", flush=True)
            if "profile" in row:
                print(row["profile"], flush=True)


if __name__ == "__main__":
    main()
