"""Cost of the per-call rank agreement (`prepare_splitkv_metadata(group_check=True)`), op call by op call.

Issue 24 item 2: with `group_check=True` (the default) every op call with `metadata=` all-gathers a [1, 12]
int64 verdict row and reads it on the host before its first data collective (`ops.agreement.check_call`), so
that one rank's wrong tensors or calling mode fail every rank. This tool times op calls with metadata prepared
with `group_check=True` ("check") and `group_check=False` ("no check") side by side in one process group (both
prepared from the same inputs): every repeat times `--calls` calls of each arm back to back, the arms' order
alternating from one repeat to the next; a repeat's time per call is the max over the CP ranks (an all-reduce
outside the timed region). Columns, medians over `--reps` repeats:

  ms, no check ms   wall time per call of the arm and of "no check"
  diff ms, diff %   the paired difference (arm minus "no check" of the same repeat), its share of "no check",
                    and its quartiles
  cpu ms            the process's CPU time per call (every thread, gloo's included; `time.process_time`): less
                    disturbed than the wall time by other processes on a shared machine; the check's own work
                    without its wait
  arm "row"         the bare verdict exchange without the op: the all-gather and its host read

With P > 1 the arm "check, check_group" prepares its metadata with `check_group=` a gloo group of the same ranks
(`prepare_splitkv_metadata(..., check_group=)`; Megatron: `megatron.create_cp_check_groups`): its rows go over
that group as CPU tensors ("row, check_group": the bare exchange). On CPU (gloo CP group) that only moves the
rows from one gloo group to another: it shows the CPU cost, not the device sync it removes; on GPUs (NCCL CP
group) it is the check without a device tensor, stream or host read of the stream.

The op runs at small shapes by default (`--blocks` blocks of B 16 per rank, `--context` context tokens per rank,
Hq = Hkv = `--heads`, D = `--head-dim`, fp32, the math kernel): the agreement's cost does not depend on them,
the op's does (state both when quoting a share). `--mlp H` adds an MLP (hidden H, FFN 3H) over the rank's
query rows to every call: the rest of a layer, which a GPU has queued when the check reads its row.

One GPU (`--device cuda --cp 1 --emulate`): a single process has no group, so its check is skipped by design;
`--emulate` instead adds the check's device round trip (the row to the device and `.tolist()` back: the host
waits for everything queued on the stream) before each op call, on the current stream ("check") and on a side
stream ("check, side stream": waits for nothing queued on the compute stream) and as the check_group path does
it, on the host only ("check, check_group": the row built and read as a CPU tensor, no device work; a group of
one has nothing to exchange). That measures the stall of the host read, the check's dominant GPU cost; it
cannot measure NCCL's or gloo's latency or the ranks' skew (see docs/lab/agreement_cost.md).

    .venv/bin/python tools/agreement_cost.py                      # CPU, gloo, CP = 2 and 4, forward calls
    .venv/bin/python tools/agreement_cost.py --backward --cp 2    # forward + backward per call
    .venv/bin/python tools/agreement_cost.py --device cuda --cp 1 --emulate --dtype bfloat16 --backend auto \
        --blocks 512 --context 16384 --heads 8 --head-dim 128 --mlp 4096   # one GPU

Each CP size runs in its own processes (`torch.multiprocessing`, a file store); `--device cuda` needs P GPUs
(NCCL). The CPU numbers are noisy on a shared machine: compare only arms of one run. No thresholds: a tool,
not a test.
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
from tools import benchlib as bench  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPS = {"splitkv": splitkv_attention, "allgather_kv": allgather_kv_attention, "ring_kv": ring_kv_attention}
B = 16


def _inputs(rank, args, dev):
    g = torch.Generator().manual_seed(1000 + rank)
    nb, tk, h, d = args.blocks, args.context, args.heads, args.head_dim

    def r(*s):
        return torch.randn(*s, generator=g).to(dev, DTYPES[args.dtype]).requires_grad_(args.backward)

    x = dict(q=r(nb * B, h, d), k_ctx=r(tk, h, d), v_ctx=r(tk, h, d), k_blk=r(nb * B, h, d), v_blk=r(nb * B, h, d))
    m = dict(q_seq=torch.zeros(nb, dtype=torch.int64, device=dev),
             q_anchor=(torch.arange(nb) * args.context // max(nb, 1) + rank + 1).to(dev),
             kv_seq=torch.zeros(tk, dtype=torch.int64, device=dev),
             kv_pos=(torch.arange(tk) * args.world + rank).to(dev))
    return x, m


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _host_read(dev, stream=None):
    """What the check does on the device besides its all-gather: an int64 row to the device (pinned,
    non-blocking, as `ops.agreement._device_row`) and back to the host (`.tolist()`: the host waits for the
    stream it is read on). stream: read on this side stream instead of the current one; "host": the check_group
    path, a CPU row read on the host (no device work)."""
    if stream == "host":
        return torch.full((1, 12), -1, dtype=torch.int64).tolist()
    row = torch.full((12,), -1, dtype=torch.int64, pin_memory=dev.type == "cuda")
    if stream is None:
        return row.to(dev, non_blocking=True).tolist()
    with torch.cuda.stream(stream):
        return row.to(dev, non_blocking=True).tolist()


def _worker(rank, world, store, args, out):
    dev = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    torch.set_num_threads(1) if dev.type == "cpu" else None  # P processes share the cores: no oversubscription
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    args.world = world
    op = OPS[args.impl]
    x, m = _inputs(rank, args, dev)
    # the verdict rows' gloo group over the same ranks (every rank creates it)
    check_group = dist.new_group(list(range(world)), backend="gloo") if world > 1 else None
    metas = {arm: prepare_splitkv_metadata(*m.values(), block_size=B, num_heads_q=args.heads,
                                           num_heads_kv=args.heads, head_dim=args.head_dim,
                                           dtype=DTYPES[args.dtype], impl=args.impl, group_check=arm != "no check",
                                           device=dev, check_group=check_group if "check_group" in arm else None)
             for arm in ("check", "no check", "check, check_group")}
    comm_dev = dev if backend == "nccl" else torch.device("cpu")
    if args.mlp:  # the rest of a layer: an MLP of hidden --mlp, FFN 3 x --mlp, over this rank's query rows
        act = torch.randn(args.blocks * B, args.mlp, device=dev, dtype=DTYPES[args.dtype])
        w1 = torch.randn(args.mlp, 3 * args.mlp, device=dev, dtype=DTYPES[args.dtype]) / args.mlp ** 0.5
        w2 = torch.randn(3 * args.mlp, args.mlp, device=dev, dtype=DTYPES[args.dtype]) / args.mlp ** 0.5
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def call(meta, read=None):
        if read is not None:
            _host_read(dev, read if read != "current" else None)
        out_ = op(*x.values(), metadata=meta, backend=args.backend)
        if args.mlp:
            out_ = out_.sum() + torch.relu(act @ w1) @ w2
        if args.backward:
            out_.sum().backward()

    def row(group=None, where=comm_dev):  # the verdict exchange the check adds: a [1, 12] all-gather, its host read
        t = torch.zeros(1, 12, dtype=torch.int64, device=where)
        buf = torch.empty(world, 12, dtype=torch.int64, device=where)
        dist.all_gather_into_tensor(buf, t, group=group)
        return buf.tolist()

    if args.emulate:  # one process: the check's host read emulated, on the current stream and on a side one
        arms = {"check": lambda: call(metas["no check"], "current"), "no check": lambda: call(metas["no check"]),
                "check, check_group": lambda: call(metas["no check"], "host")}
        if side is not None:
            arms["check, side stream"] = lambda: call(metas["no check"], side)
    else:
        arms = {"check": lambda: call(metas["check"]), "no check": lambda: call(metas["no check"])}
        if world > 1:
            arms["check, check_group"] = lambda: call(metas["check, check_group"])
            arms["row"] = row
            arms["row, check_group"] = lambda: row(check_group, torch.device("cpu"))
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
    p.add_argument("--cp", default="2,4", help=f"CP sizes, comma-separated, each once, each <= {bench.MAX_HOST_RANKS} (default 2,4)")
    p.add_argument("--impl", choices=sorted(OPS), default="splitkv")
    p.add_argument("--reps", type=int_arg(1), default=40, help="repeats per arm (default 40)")
    p.add_argument("--calls", type=int_arg(1), default=20, help="op calls per repeat (default 20)")
    p.add_argument("--blocks", type=int_arg(1), default=4, help="query blocks (B = 16) per rank (default 4)")
    p.add_argument("--context", type=int_arg(1), default=256, help="context tokens per rank (default 256)")
    p.add_argument("--heads", type=int_arg(1), default=2, help="Hq = Hkv (default 2)")
    p.add_argument("--head-dim", type=int_arg(1), default=16, help="D (default 16)")
    p.add_argument("--backward", action="store_true", help="time forward + backward per call")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--backend", default="math", help="the op's local kernel (default math; 'auto' on a GPU)")
    p.add_argument("--mlp", type=int_arg(0), default=0,
                   help="per call also an MLP (hidden MLP, FFN 3 x MLP) over the rank's query rows (0: none)")
    p.add_argument("--emulate", action="store_true",
                   help="--cp 1 only: emulate the check by its host read of a device row (no group to agree with), "
                        "on the current stream ('check') and, on CUDA, on a side stream ('check, side stream')")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", help="write the medians to this file")
    args = p.parse_args(argv)
    args.cp = bench.int_list_arg(p, "--cp", args.cp, 1, bench.MAX_HOST_RANKS)
    if args.emulate and args.cp != [1]:
        p.error("--emulate needs --cp 1 (with P > 1 the check itself runs)")
    if args.device == "cuda" and max(args.cp) > torch.cuda.device_count():
        p.error(f"--cp {max(args.cp)} needs that many GPUs with --device cuda; "
                f"{torch.cuda.device_count()} visible")
    rows = []
    print(f"# {args.impl}, {'forward + backward' if args.backward else 'forward'} per call, {args.device}, "
          f"{args.blocks} blocks x B {B} and {args.context} context tokens per rank, H {args.heads}, "
          f"D {args.head_dim}; medians over {args.reps} repeats of {args.calls} calls (max over ranks)")
    print(f"{'CP':>3} {'arm':>20} {'ms':>8} {'no check ms':>12} {'diff ms':>8} {'diff %':>7} {'diff quartiles':>18} "
          f"{'cpu ms':>8} {'no check cpu':>13}")
    for world in args.cp:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "times.json")
            mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), args, out), nprocs=world,
                               join=True, start_method="spawn")
            with open(out) as f:
                times = json.load(f)
        med = {a: statistics.median(t[0] for t in v) * 1e3 for a, v in times.items()}
        cpu = {a: statistics.median(t[1] for t in v) * 1e3 for a, v in times.items()}
        row = dict(cp=world)
        for a in (a for a in times if a != "no check"):
            if a.startswith("row"):
                row[a] = dict(ms=med[a], cpu_ms=cpu[a])
                print(f"{world:>3} {a:>20} {med[a]:>8.3f} {'':>12} {'':>8} {'':>7} {'':>18} {cpu[a]:>8.3f}")
                continue
            # the paired difference: the arm minus no check of the same repeat (adjacent in time)
            pair = [1e3 * (c[0] - n[0]) for c, n in zip(times[a], times["no check"])]
            q1, diff, q3 = statistics.quantiles(pair, n=4) if len(pair) > 1 else (pair[0],) * 3
            row[a] = dict(ms=med[a], cpu_ms=cpu[a], diff_ms=diff, diff_q1_ms=q1, diff_q3_ms=q3)
            print(f"{world:>3} {a:>20} {med[a]:>8.3f} {med['no check']:>12.3f} {diff:>8.3f} "
                  f"{100 * diff / med['no check']:>7.1f} {f'[{q1:.3f}, {q3:.3f}]':>18} {cpu[a]:>8.3f} "
                  f"{cpu['no check']:>13.3f}", flush=True)
        row["no check"] = dict(ms=med["no check"], cpu_ms=cpu["no check"])
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items() if k != "json"}, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
