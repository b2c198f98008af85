"""Cost of the per-call rank agreement (`prepare_splitkv_metadata(group_check=True)`) on CPU with gloo.

Issue 24 item 2: with `group_check=True` (the default) every op call with `metadata=` checks, group-wide, that
every rank's tensors fit the metadata and that every rank calls the same way. This tool times one op call with
metadata prepared with `group_check=True` ("check") and with `group_check=False` ("no check") side by side in
one process group: both metadata objects are prepared from the same inputs, and every repeat times `--calls`
calls of each arm back to back, the arms' order alternating from one repeat to the next. A repeat's time per
call is the max over the CP ranks (an all-reduce outside the timed region); the table reports medians over
`--reps` repeats, the median of the paired difference (check minus no check of the same repeat) with its
quartiles, and the bare verdict exchange alone ("row": the [1, 12] int64 all-gather and
its host read that the check adds, without the op). "cpu" columns: the process's CPU time per call (every
thread, gloo's included; `time.process_time`), median of the max over ranks: less disturbed than the wall time
by other processes on a shared machine, it shows the check's own work without its wait. The op runs at small shapes (`--blocks` blocks of B 16 per
rank, `--context` context tokens per rank, Hq = Hkv = `--heads`, D = `--head-dim`, fp32, the math kernel): the
agreement's cost does not depend on them, the op's does (state both when quoting a share).

    .venv/bin/python tools/agreement_cost.py                      # CP = 2 and 4, forward calls
    .venv/bin/python tools/agreement_cost.py --backward --cp 2    # forward + backward per call
    .venv/bin/python tools/agreement_cost.py --device cuda --cp 1 # one GPU (see docs/lab/agreement_cost.md)

Each CP size runs in its own processes (`torch.multiprocessing`, a file store). `--device cuda` needs P GPUs
(NCCL); with one GPU only P = 1 runs, where the check is skipped by design (no group to agree with): see
docs/lab/agreement_cost.md for what a one-GPU run can show. The numbers are noisy on a shared CPU: compare
only arms of the same run. No thresholds: a tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_splitkv._ints import int_arg  # noqa: E402
from megatron_splitkv.ops import allgather_kv_attention, prepare_splitkv_metadata, ring_kv_attention, splitkv_attention  # noqa: E402,E501

OPS = {"splitkv": splitkv_attention, "allgather_kv": allgather_kv_attention, "ring_kv": ring_kv_attention}
B = 16


def _cp_list(text):
    try:
        sizes = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cp must be comma-separated ints >= 1, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--cp must be comma-separated ints >= 1, got {text!r}")
    return sizes


def _inputs(rank, args, dev):
    g = torch.Generator().manual_seed(1000 + rank)
    nb, tk, h, d = args.blocks, args.context, args.heads, args.head_dim

    def r(*s):
        return torch.randn(*s, generator=g).to(dev).requires_grad_(args.backward)

    x = dict(q=r(nb * B, h, d), k_ctx=r(tk, h, d), v_ctx=r(tk, h, d), k_blk=r(nb * B, h, d), v_blk=r(nb * B, h, d))
    m = dict(q_seq=torch.zeros(nb, dtype=torch.int64, device=dev),
             q_anchor=(torch.arange(nb) * args.context // max(nb, 1) + rank + 1).to(dev),
             kv_seq=torch.zeros(tk, dtype=torch.int64, device=dev),
             kv_pos=(torch.arange(tk) * args.world + rank).to(dev))
    return x, m


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _worker(rank, world, store, args, out):
    dev = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    torch.set_num_threads(1)  # P processes share the cores: no intra-op thread oversubscription
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    args.world = world
    op = OPS[args.impl]
    x, m = _inputs(rank, args, dev)
    metas = {arm: prepare_splitkv_metadata(*m.values(), block_size=B, num_heads_q=args.heads,
                                           num_heads_kv=args.heads, head_dim=args.head_dim, dtype=torch.float32,
                                           impl=args.impl, group_check=arm == "check", device=dev)
             for arm in ("check", "no check")}
    comm_dev = dev if backend == "nccl" else torch.device("cpu")

    def call(meta):
        out_ = op(*x.values(), metadata=meta, backend="math")
        if args.backward:
            out_.sum().backward()

    def row():  # the verdict exchange the check adds: one [1, 12] int64 all-gather and its host read
        t = torch.zeros(1, 12, dtype=torch.int64, device=comm_dev)
        buf = torch.empty(world, 12, dtype=torch.int64, device=comm_dev)
        dist.all_gather_into_tensor(buf, t)
        return buf.tolist()

    arms = {"check": lambda: call(metas["check"]), "no check": lambda: call(metas["no check"]), "row": row}
    grad = torch.enable_grad() if args.backward else torch.no_grad()
    times = {a: [] for a in arms}
    with grad:
        for fn in arms.values():  # warm-up
            for _ in range(3):
                fn()
        for rep in range(args.reps):
            order = list(arms) if rep % 2 == 0 else list(arms)[::-1]
            for a in order:
                dist.barrier()
                _sync(dev)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.calls):
                    arms[a]()
                _sync(dev)
                per_call = torch.tensor([time.perf_counter() - t0, time.process_time() - c0],
                                        dtype=torch.float64) / args.calls
                if backend == "nccl":
                    per_call = per_call.to(dev)
                dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
                times[a].append(per_call.tolist())
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=_cp_list, default=[2, 4], help="CP sizes, comma-separated (default 2,4)")
    p.add_argument("--impl", choices=sorted(OPS), default="splitkv")
    p.add_argument("--reps", type=int_arg(1), default=40, help="repeats per arm (default 40)")
    p.add_argument("--calls", type=int_arg(1), default=20, help="op calls per repeat (default 20)")
    p.add_argument("--blocks", type=int_arg(1), default=4, help="query blocks (B = 16) per rank (default 4)")
    p.add_argument("--context", type=int_arg(1), default=256, help="context tokens per rank (default 256)")
    p.add_argument("--heads", type=int_arg(1), default=2, help="Hq = Hkv (default 2)")
    p.add_argument("--head-dim", type=int_arg(1), default=16, help="D (default 16)")
    p.add_argument("--backward", action="store_true", help="time forward + backward per call")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", help="write the medians to this file")
    args = p.parse_args(argv)
    if args.device == "cuda" and max(args.cp) > torch.cuda.device_count():
        p.error(f"--cp {max(args.cp)} needs that many GPUs with --device cuda; "
                f"{torch.cuda.device_count()} visible")
    rows = []
    print(f"# {args.impl}, {'forward + backward' if args.backward else 'forward'} per call, {args.device}, "
          f"{args.blocks} blocks x B {B} and {args.context} context tokens per rank, H {args.heads}, "
          f"D {args.head_dim}; medians over {args.reps} repeats of {args.calls} calls (max over ranks)")
    print(f"{'CP':>3} {'no check ms':>12} {'check ms':>9} {'diff ms':>8} {'diff %':>7} {'diff quartiles':>18} "
          f"{'row ms':>7} {'no check cpu':>12} {'check cpu':>9}")
    for world in args.cp:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "times.json")
            mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), args, out), nprocs=world,
                               join=True, start_method="spawn")
            with open(out) as f:
                times = json.load(f)
        med = {a: statistics.median(t[0] for t in v) * 1e3 for a, v in times.items()}
        cpu = {a: statistics.median(t[1] for t in v) * 1e3 for a, v in times.items()}
        # the paired difference: check minus no check of the same repeat (adjacent in time)
        pair = [1e3 * (c[0] - n[0]) for c, n in zip(times["check"], times["no check"])]
        q1, diff, q3 = statistics.quantiles(pair, n=4) if len(pair) > 1 else (pair[0],) * 3
        rows.append(dict(cp=world, **{f"{a} ms": v for a, v in med.items()}, diff_ms=diff, diff_q1_ms=q1,
                         diff_q3_ms=q3, **{f"{a} cpu ms": v for a, v in cpu.items()}))
        print(f"{world:>3} {med['no check']:>12.3f} {med['check']:>9.3f} {diff:>8.3f} "
              f"{100 * diff / med['no check']:>7.1f} {f'[{q1:.3f}, {q3:.3f}]':>18} {med['row']:>7.3f} "
              f"{cpu['no check']:>12.3f} {cpu['check']:>9.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items() if k != "json"}, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
