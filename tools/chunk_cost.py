"""What does splitkv's merge pipeline cost the local kernel? Query chunks vs head chunks (one GPU; `--cpu`: tiny
shapes, a smoke test).

The chunked merge pipeline (docs/lab/perf-notes.md item 2) runs the local kernel k times per layer so that each
chunk's collectives overlap the next chunk's kernel. Measured in the sixth run (docs/benchmarks.md), a chunk
costs ~6-10% of the kernel per extra chunk. This tool times, on ONE rank's real shard (the planner's placement
of the weak-scaling batch, the most loaded rank), forward + backward through the kernel API with the global
(lse, delta) as the op passes them, side by side (interleaved repeats, medians):

  one call      k = 1: every gathered query row against this rank's keys
  query k       the op's chunks (`bench.kernel_calls(num_chunks=k)`: chunk c = blocks [b0_c, b1_c) of
                every rank's segment, one IntervalMask each), with dK / dV accumulated in fp32 across chunks
                as `ops.splitkv._SplitKV.backward` does, all on one stream
  head k        the op's head chunks (`chunk_axis="heads"`, `bench.kernel_calls(..., chunk_axis="heads")`): k
                calls over ALL query rows with Hq / k query heads and Hkv / k kv heads each (the GQA groups stay
                whole; k clamped to Hkv, near-even heads as `chunk_bounds` where k does not divide Hkv), the
                one-call mask shared; dK / dV of a chunk
                written into its heads: no accumulation (`bench.chunk_loop`, as the op)

    python tools/chunk_cost.py --cp 2 --ctx-per-rank 16384,65536 --chunks 2,4 --backends flex,staircase --reverse

Prints one markdown table (ms, ratio to one call, peak GiB of the timed step) and writes it with the JSON
to --out (default out/chunk_cost). Timings are medians of --reps interleaved rounds; no thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import benchlib as bench  # noqa: E402

#: the note under a --cpu run's table
CPU_NOTE = (f"CPU smoke run (--cpu: tiny shapes): TF/s, GPU busy time and peak memory are GPU measures and read "
            f"{bench.NA_CPU}; the ms columns only show that each variant ran, not its speed.")


def _reversed(call):
    """The call with its query blocks in reverse order (the data is random: only the mask's block order
    changes), so that the kernels' grids meet the blocks with the largest prefixes first."""
    import copy

    r = copy.copy(call)
    for a in ("lo", "hi", "own_lo", "own_hi"):
        if getattr(r, a) is not None:
            setattr(r, a, getattr(r, a)[::-1].copy())
    return r


def _variant(kern, calls, Hq, Hkv, D, dtype, dev, gen):
    """The op's chunks (`bench.kernel_calls`: query or head chunks) as the op's chunk loop runs them
    (`bench.chunk_loop`: query chunks' dK / dV summed in fp32, head chunks' written into their heads)."""
    parts, k, v = bench.chunk_inputs(calls, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, device=dev, gen=gen)
    scale = D ** -0.5
    return lambda: bench.chunk_loop(kern, parts, k, v, scale)


def _profile(fn, name, tag, iters=2, top=8):
    """GPU-busy ms per step (sum of the kernels' device time) of fn under torch.profiler; prints the wall
    time, the busy time and the top kernels."""
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / iters
    ka = prof.key_averages()
    attr = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    kern = [e for e in ka if str(getattr(e, "device_type", "")).endswith("CUDA")]
    busy = sum(getattr(e, attr) for e in kern) / 1e3 / iters
    print(f"[profile] {tag} {name}: wall {wall:.2f} ms/step (profiled), GPU busy {busy:.2f} ms/step", flush=True)
    for e in sorted(kern, key=lambda e: -getattr(e, attr))[:top]:
        print(f"    {getattr(e, attr) / 1e3 / iters:8.3f} ms  x{e.count // iters:<4d} {e.key[:90]}", flush=True)
    return busy


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def main(argv=None):
    from megatron_splitkv._ints import int_arg  # strict decimal numbers within their limits

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int_arg(1), default=2, help="CP size of the placed batch (one rank's shard is timed)")
    ap.add_argument("--ctx-per-rank", default=None,
                    help="comma list of context tokens per rank (default 16384,65536; with --cpu 256)")
    ap.add_argument("--chunks", default="2,4", help="comma list of chunk counts k > 1")
    ap.add_argument("--backends", default="flex,staircase", help="comma list of local kernels")
    ap.add_argument("--anchors", type=int_arg(1), default=None, help="anchors (query blocks) of the batch (default 512; "
                                                                 "with --cpu 8)")
    ap.add_argument("--reps", type=int_arg(1), default=7)
    ap.add_argument("--seed", type=int_arg(0), default=0)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "out", "chunk_cost"))
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (a smoke test of the tool)")
    ap.add_argument("--no-heads", dest="heads", action="store_false", help="leave out the head-chunk variants")
    ap.add_argument("--reverse", action="store_true",
                    help="also time each query variant with its blocks in reverse order (largest prefixes first)")
    ap.add_argument("--profile", action="store_true",
                    help="per variant: torch.profiler over 2 steps: wall vs GPU-busy ms and the top kernels")
    args = ap.parse_args(argv)
    if args.ctx_per_rank is None:
        args.ctx_per_rank = "256" if args.cpu else "16384,65536"
    if args.anchors is None:
        args.anchors = 8 if args.cpu else 512
    ctxs = bench.int_list_arg(ap, "--ctx-per-rank", args.ctx_per_rank, 1)
    ks = bench.int_list_arg(ap, "--chunks", args.chunks, 2)
    from megatron_splitkv.kernels import BACKENDS, get_kernel

    backends = bench.choices_arg(ap, "--backends", args.backends, BACKENDS, "backend")
    if args.cp < 1 or args.reps < 1 or args.anchors < 1:
        ap.error("--cp, --reps and --anchors must be >= 1")
    s = bench.QWEN3_8B_DRAFTER
    Hq, Hkv, D, B = s["Hq"], s["Hkv"], s["D"], s["B"]
    if args.cpu:
        dev, dtype, Hq, Hkv, D, B = torch.device("cpu"), torch.float32, 4, 4, 16, 4
    elif not torch.cuda.is_available():
        sys.exit("chunk_cost.py: needs a CUDA device (or --cpu for a tiny smoke run)")
    else:
        dev, dtype = torch.device("cuda", 0), torch.bfloat16
    cuda = dev.type == "cuda"
    try:  # before the measurement: an unusable --out must not cost the run
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {args.out!r}: cannot create the directory ({exc.strerror or exc})")
    rows, t0 = [], time.time()
    for ctx in ctxs:
        lens, anchors = bench.make_workload(args.cp * ctx, args.anchors, seed=args.seed + args.cp)
        plan = bench.place(lens, anchors, cp_size=args.cp, strategy="lpt", block_size=B)
        pairs = [sum(c.pairs for c in bench.kernel_calls("splitkv", plan, r, num_chunks=1))
                 for r in range(args.cp)]
        r = max(range(args.cp), key=lambda i: pairs[i])
        one = bench.kernel_calls("splitkv", plan, r, num_chunks=1)
        for be in backends:
            kern = get_kernel(be, dev, dtype, head_dim=D)
            gen = torch.Generator(device=dev).manual_seed(args.seed)
            names, fns = ["one call"], [_variant(kern, one, Hq, Hkv, D, dtype, dev, gen)]

            if args.reverse:
                names.append("one call, reversed")
                fns.append(_variant(kern, [_reversed(c) for c in one], Hq, Hkv, D, dtype, dev, gen))
            for k in ks:
                qc = bench.kernel_calls("splitkv", plan, r, num_chunks=k)
                names.append(f"query k={len(qc)}")
                fns.append(_variant(kern, qc, Hq, Hkv, D, dtype, dev, gen))
                if args.reverse:
                    names.append(f"query k={len(qc)}, reversed")
                    fns.append(_variant(kern, [_reversed(c) for c in qc], Hq, Hkv, D, dtype, dev, gen))
                if args.heads:
                    hc = bench.kernel_calls("splitkv", plan, r, num_chunks=k, chunk_axis="heads", num_heads_kv=Hkv)
                    names.append(f"head k={len(hc)}")
                    fns.append(_variant(kern, hc, Hq, Hkv, D, dtype, dev, gen))
            peaks = []
            for fn in fns:  # peak of each step alone (inputs of every variant allocated: same base for all)
                if not cuda:  # no GPU measure on the CPU: None (the table reads n/a (CPU))
                    fn()
                    peaks.append(None)
                    continue
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                peaks.append((torch.cuda.max_memory_allocated() - base) / 2 ** 30)
            res = bench.time_fns_interleaved(fns, dev, reps=args.reps, warmup=2)
            busy = [_profile(fn, name, f"{_tokens(ctx)} {be}") if args.profile and cuda
                    else (float("nan") if cuda else None) for name, fn in zip(names, fns)]
            ms1 = res[0][0]
            for name, (med, mn, _), pk, bz in zip(names, res, peaks, busy):
                rows.append(dict(ctx_per_rank=ctx, cp=args.cp, rank=r, backend=be, variant=name, ms=med,
                                 min_ms=mn, vs_one=med / ms1, step_peak_gib=pk, gpu_busy_ms=bz,
                                 tflops=bench.FWD_BWD_FACTOR * bench.fwd_flops(pairs[r], Hq, D) / med / 1e9))
                print(f"[chunk-cost] ctx/rank {ctx} {be} {name}: {med:.2f} ms ({med / ms1:.3f}x), "
                      f"step peak {bench.gpu_cell(not cuda, pk)}{' GiB' if cuda else ''}", flush=True)
            del fns
            if cuda:
                torch.cuda.empty_cache()
    lines = [f"chunk cost (CP={args.cp} batch, most loaded rank's shard, fwd+bwd through the kernel API, median of "
             f"{args.reps}; {torch.cuda.get_device_name(0) if cuda else 'CPU'}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             "| ctx/rank | kernel | variant | ms | vs one call | TF/s (useful) | GPU busy ms (profiler) | "
             "step peak GiB (above inputs) |",
             "|---|---|---|---|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {_tokens(x['ctx_per_rank'])} | {x['backend']} | {x['variant']} | {x['ms']:.2f} | "
                     f"{x['vs_one']:.3f}x | {bench.gpu_cell(not cuda, x['tflops'], '{:.0f}')} | "
                     f"{bench.gpu_cell(not cuda, x['gpu_busy_ms'])} | {bench.gpu_cell(not cuda, x['step_peak_gib'])} |")
    if not cuda:
        lines += ["", CPU_NOTE]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chunk_cost.json"), "w") as f:
        json.dump(dict(rows=rows, argv=sys.argv, seconds=time.time() - t0), f, indent=1)
    with open(os.path.join(args.out, "chunk_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
