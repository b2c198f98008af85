"""Where does a Split-KV chunk cost its time at the OP level? (GPU, torchrun over NCCL)

tools/chunk_cost.py times the local kernel's chunks alone; over NCCL the op's k = 2 cost more than that
(docs/benchmarks.md, seventh run: CP=2 16K op 8.92 -> 10.73 ms at k = 1 -> 2). This tool runs the real op
(per-step metadata, forward + backward, LPT placement, drafter shapes) for each num_chunks
variant and, on rank 0, times the host's issue of one step (no synchronize inside: close to the wall time when
the host is the bottleneck) and profiles 3 steps with torch.profiler: wall ms per step, the top host ops, GPU-busy ms (union of all
kernels' intervals on the device), the local kernels' summed time (flex / cuDNN / Triton templates / FlashAttention-4), the
NCCL kernels' summed time, and the time the local kernels overlap NCCL kernels. Prints a table last.

With `--ab-rounds R` it first times the variants round-robin without the profiler (R rounds; before each
step a barrier and a synchronize, so no rank starts a step late; CUDA events; median per rank, then the
MAX over ranks, since the slowest rank sets the step). `--all-ranks` profiles and reports every rank (the
per-rank rows are gathered to rank 0), `--trace DIR` writes each rank's chrome trace per variant there
(trace_k{k}_r{rank}.json).

    torchrun --nproc-per-node 2 tools/profile_op.py --context 16384 --variants 1,2
    torchrun --nproc-per-node 2 tools/profile_op.py --context 16384 --variants 1,2 --ab-rounds 30 \
        --all-ranks --trace out/trace

A variant is a num_chunks. Writes nothing but the traces; no thresholds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import benchlib as bench  # noqa: E402


def _intervals(events, pred):
    from torch.autograd import DeviceType

    out = []
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        if pred(e.name):
            out.append((e.time_range.start, e.time_range.end))
    return out


def _union(iv):
    tot, end = 0.0, None
    for a, b in sorted(iv):
        if end is None or a > end:
            tot += b - a
            end = b
        elif b > end:
            tot += b - end
            end = b
    return tot


def _overlap(a, b):
    """Total time (us) where an interval of a overlaps an interval of b (each list unioned first)."""
    def merged(iv):
        out = []
        for x, y in sorted(iv):
            if out and x <= out[-1][1]:
                out[-1][1] = max(out[-1][1], y)
            else:
                out.append([x, y])
        return out
    a, b = merged(a), merged(b)
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            tot += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def main(argv=None):
    from megatron_splitkv._ints import int_arg  # strict decimal numbers within their limits

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int_arg(1), default=16384)
    ap.add_argument("--variants", default="1,2", help="comma list of num_chunks, each once")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--steps", type=int_arg(1), default=3, help="profiled steps per variant")
    ap.add_argument("--ab-rounds", type=int_arg(0), default=0, help="round-robin timed steps per variant (0: none)")
    ap.add_argument("--all-ranks", action="store_true", help="profile rows of every rank (default rank 0)")
    ap.add_argument("--trace", default=None, help="directory for per-rank chrome traces")
    a = ap.parse_args(argv)
    variants = [(k,) for k in bench.int_list_arg(ap, "--variants", a.variants, 1)]
    if a.context < 1 or a.steps < 1:
        ap.error("--context and --steps must be >= 1")
    if a.ab_rounds < 0:
        ap.error(f"--ab-rounds must be >= 0, got {a.ab_rounds}")
    from megatron_splitkv.kernels import BACKENDS

    if a.backend not in BACKENDS:
        ap.error(f"--backend must be one of {', '.join(BACKENDS)}, got {a.backend!r}")
    if not torch.cuda.is_available():
        raise SystemExit("profile_op.py needs a CUDA GPU")
    if "RANK" not in os.environ:
        raise SystemExit("profile_op.py runs under torchrun (e.g. torchrun --nproc-per-node 2 tools/profile_op.py)")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    s = bench.QWEN3_8B_DRAFTER
    lens, anchors = bench.make_workload(a.context, s["n_anchors"], seed=world)
    plan = bench.place(lens, anchors, cp_size=world, strategy="lpt", block_size=s["B"])
    x = bench.rank_inputs(plan, rank, Hq=s["Hq"], Hkv=s["Hkv"], D=s["D"], dtype=s["dtype"], device=dev)
    g = dist.group.WORLD
    metas = {}
    for (k,) in variants:
        if k not in metas:
            metas[k] = bench.prepare_meta("splitkv", x, block_size=s["B"], cp_group=g, Hq=s["Hq"], Hkv=s["Hkv"],
                                          D=s["D"], num_chunks=k)

    def step(k):
        bench.run_op("splitkv", x, block_size=s["B"], cp_group=g, backend=a.backend, meta=metas[k])

    for v in variants:
        for _ in range(3):
            step(*v)
    torch.cuda.synchronize()
    dist.barrier()
    ab = {}
    if a.ab_rounds:
        times = {v: [] for v in variants}
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(a.ab_rounds):
            for v in variants:
                torch.cuda.synchronize()
                dist.barrier()
                e0.record()
                step(*v)
                e1.record()
                torch.cuda.synchronize()
                times[v].append(e0.elapsed_time(e1))
        med = torch.tensor([sorted(times[v])[len(times[v]) // 2] for v in variants], device=dev)
        allmed = [torch.empty_like(med) for _ in range(world)]
        dist.all_gather(allmed, med)
        allmed = torch.stack(allmed).cpu()
        for i, v in enumerate(variants):
            ab[v] = dict(max=float(allmed[:, i].max()), per_rank=[float(t) for t in allmed[:, i]])
    rows = []
    for (k,) in variants:
        dist.barrier()
        # host time to issue one step (no synchronize inside): ~wall when the host is the bottleneck
        issue = []
        for _ in range(a.steps):
            t1 = time.perf_counter()
            step(k)
            issue.append((time.perf_counter() - t1) * 1e3)
            torch.cuda.synchronize()
        dist.barrier()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(k)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 / a.steps
        dist.barrier()
        if a.trace:
            os.makedirs(a.trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(a.trace, f"trace_k{k}_r{rank}.json"))
        row = None
        if rank == 0 or a.all_ranks:
            ev = prof.events()
            allk = _intervals(ev, lambda n: True)
            nccl = _intervals(ev, lambda n: "nccl" in n.lower())
            local = _intervals(ev, lambda n: any(t in n for t in ("flex_attention", "cudnn", "sdpa", "fmha", "flash_attncute")))
            other = [iv for iv in allk if iv not in set(nccl) | set(local)]
            n = a.steps * 1e3
            row = dict(rank=rank, k=k, wall=wall, issue=sorted(issue)[len(issue) // 2], busy=_union(allk) / n,
                       local=sum(b - x0 for x0, b in local) / n, local_union=_union(local) / n, nccl=_union(nccl) / n,
                       overlap=_overlap(local, nccl) / n, other=sum(b - x0 for x0, b in other) / n,
                       n_other=len(other) // a.steps)
        if rank == 0:
            ka = prof.key_averages()
            attr = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
            print(f"\n== k={k}: wall {wall:.2f} ms/step", flush=True)
            kern = [e for e in ka if str(getattr(e, "device_type", "")).endswith("CUDA")]
            for e in sorted(kern, key=lambda e: -getattr(e, attr))[:12]:
                print(f"    {getattr(e, attr) / 1e3 / a.steps:8.3f} ms  x{e.count // a.steps:<4d} {e.key[:90]}", flush=True)
            print("  host (self CPU time per step, top ops):", flush=True)
            host = [e for e in ka if not str(getattr(e, "device_type", "")).endswith("CUDA")]
            for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:10]:
                print(f"    {e.self_cpu_time_total / 1e3 / a.steps:8.3f} ms  x{e.count // a.steps:<4d} {e.key[:90]}", flush=True)
        got = [None] * world
        dist.all_gather_object(got, row)
        rows += [r for r in got if r is not None]
    if rank == 0:
        if ab:
            print(f"\nround-robin A/B (CP={world}, context {a.context}, {a.ab_rounds} rounds, barrier + synchronize "
                  "before each step; ms per step: median per rank, max over ranks)")
            print("| num_chunks | max over ranks | per rank | vs first variant |")
            print("|---|---|---|---|")
            base = ab[variants[0]]["max"]
            for v in variants:
                pr = " / ".join(f"{t:.2f}" for t in ab[v]["per_rank"])
                print(f"| {v[0]} | {ab[v]['max']:.2f} | {pr} | {ab[v]['max'] / base:.3f}x |")
        who = "every rank" if a.all_ranks else "rank 0"
        print(f"\nop profile (CP={world}, context {a.context}, {who}, {a.steps} steps, {torch.cuda.get_device_name(0)}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); ms per step")
        print("| rank | num_chunks | wall | host issue (no profiler) | GPU busy (union) | local kernels (sum) | local kernels (union) | NCCL (union) "
              "| local x NCCL overlap | other kernels (sum, count) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['rank']} | {r['k']} | {r['wall']:.2f} | {r['issue']:.2f} | {r['busy']:.2f} | {r['local']:.2f} | {r['local_union']:.2f} "
                  f"| {r['nccl']:.2f} | {r['overlap']:.2f} | {r['other']:.2f} ({r['n_other']}) |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
