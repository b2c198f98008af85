#!/usr/bin/env python3
"""Sliding-window drafter layers under context parallelism on ONE GPU: splitkv vs allgather-kv vs ring-kv
(issue 23 item 4: where Split-KV stops paying off, and what `auto` should pick there).

Workload (as tools/bench_attention.py --window): one sequence per --contexts value, 512 anchors x block 16
(sampled as in training, `benchlib.make_workload`), Hq 32 / Hkv 8 / D 128, bf16. A windowed row is a
`sliding_attention` layer with window W (z-lab dflash 0.1.0 semantics: row j of the block at anchor a sees
context positions p with a + j - W < p < a, and with causal, the default, its own block's keys <= j); a
"none" row is a `full_attention` layer (bidirectional own block).

Per (context, W, P, method), P in --cps:
  - plan: the planner's LPT layout with the windowed cost model (`CostModel(layer_windows=(W,))`, so LPT
    balances what that layer really costs; the full-attention model for "none"), one plan for the three
    methods (all three ops take the plan's layout); "blind_pair_imbalance" is the splitkv pair imbalance
    the window-blind plan (full-attention costs) would give, to show what the windowed costs buy;
  - kernel: every rank's local-kernel calls (`benchlib.kernel_calls`, the op's chunks, fused own block and
    per-row windowed masks) timed on the device, forward + backward (`benchlib.time_kernel_calls`;
    --sample-ranks: only the 2 ranks with the most visible pairs); "kernel_ms" = the slowest rank's;
  - comm: each rank's collectives with their exact bytes (`benchlib.predicted_records`, per-step metadata;
    the bytes do not depend on the window; the once-per-step metadata gathers, shared by the layers, are
    not counted), timed by a flat-ring alpha-beta link (`benchlib.LinkModel`)
    at --link-gbs (NVLink class) and --slow-link-gbs (inter-node class); "comm_ms" = the slowest rank's
    serial sum (`simulate_scaling.method_time`'s "comm_ms");
  - modelled step: "step" = kernel + comm (no overlap; the figure the summary ranks by), "overlap" =
    max(kernel, comm) (perfect overlap), "schedule" = the op's own overlap as tools/simulate_scaling.py
    replays it (splitkv's chunk pipeline, ring-kv's step overlap, allgather-kv none; op overhead 0);
  - pairs: visible (query row, key) pairs per rank (own block included) and their imbalance max/mean - 1.

Summary: for each (context, W, link, model) the fastest method per P and the crossover, the first P > 1
where splitkv is not the fastest, as a sentence. At P = 1 the three methods do the same kernel work.

Rows run group by group (context, W, P: the three methods together); --budget-s stops before a group once
that many seconds have passed (compiles included): the groups not run are listed under "cut", never half
measured. A group whose measurement raises (out of memory, a kernel refusing a mask) is listed under
"errors" and left out. Outputs --out/window_scaling.{json,md} (machine, date and the command line in both).

  python tools/window_scaling.py --backend fa4 --sample-ranks --reps 3 --warmup 1 --budget-s 80 --out out/window
`--backend auto` times what `auto` runs today (flex for windowed masks, fa4 for full ones where installed); flex
compiles one graph per (query, key) length bucket (~6 s each, ~12 per context here), fa4 one per mask class.
  python tools/window_scaling.py --cpu --out /tmp/window     # CPU smoke: tiny shapes, math kernel, seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_splitkv._ints import float_arg, int_arg, output_dir, parse_int  # noqa: E402
from megatron_splitkv.kernels import BACKENDS, get_kernel  # noqa: E402
from megatron_splitkv.planning import CostModel  # noqa: E402
from tools import benchlib as bench  # noqa: E402
from tools.simulate_scaling import method_time  # noqa: E402

METHODS = ("splitkv", "allgather-kv", "ring-kv")
MODELS = ("step", "overlap", "schedule")
GPU = dict(B=16, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16)
#: --cpu: tiny shapes (W below, inside and above the block of 4), float32, the math kernel
CPU = dict(B=4, Hq=4, Hkv=2, D=16, dtype=torch.float32)
CPU_DEFAULTS = dict(contexts="256,512", windows="3,24,none", anchors=16, reps=1, warmup=0, backend="math")


def windows_arg(ap, value: str) -> list:
    """--windows: a comma list of distinct sliding windows (ints >= 1) and "none" (a full-attention layer);
    `ap.error` naming the flag otherwise (`bench.unique_list` for a repeated value)."""
    out = []
    for item in bench.list_items(ap, "--windows", value):
        if item.lower() == "none":
            out.append(None)
            continue
        try:
            out.append(parse_int(item, "--windows", minimum=1))
        except ValueError:
            ap.error(f"--windows must be a comma list of ints >= 1 and 'none', got {value!r}")
    if not out:
        ap.error(f"--windows must be a comma list of ints >= 1 and 'none', got {value!r}")
    return bench.unique_list(ap, "--windows", out, value)


def link_model(gbs: float, alpha_us: float) -> bench.LinkModel:
    """A flat ring of alpha `alpha_us` per hop and `gbs` GB/s per GPU, for every collective kind."""
    ab = bench.AlphaBeta(alpha_us * 1e-6, gbs * 1e9)
    return bench.LinkModel(intra={k: ab for k in ("all_gather", "reduce_scatter", "all_reduce", "p2p")},
                           topology="flat", gpus_per_node=1 << 20)


def layer_of(window, args) -> dict:
    """The layer type keywords of `kernel_calls`: windowed rows causal unless --no-causal, "none" rows full."""
    return dict(window=window, causal=bool(window is not None and args.causal))


def plan_for(anchors_lens, window, P, B, blind=False):
    """The LPT plan of the workload at CP size P, with the windowed cost model (blind: the full-attention one)."""
    lens, anchors = anchors_lens
    cm = CostModel(layer_windows=(window,)) if window is not None and not blind else None
    return bench.place(lens, anchors, cp_size=P, block_size=B, cost_model=cm)


def rank_pairs(method, plan, layer, num_chunks):
    """Per-rank kernel calls and visible pairs (own block included) of `method` under `plan`."""
    calls = [bench.kernel_calls(method, plan, r, num_chunks=num_chunks, **layer) for r in range(plan.cp_size)]
    return calls, [float(sum(c.pairs for c in cs)) for cs in calls]


def imbalance(x) -> float:
    return float(max(x) / (sum(x) / len(x)) - 1) if sum(x) else 0.0


def measure_group(ctx, window, P, args, shapes, work, dev, links):
    """The three method rows of one (context, W, P): dicts as documented in the module docstring."""
    B, Hq, Hkv, D, dtype = (shapes[k] for k in ("B", "Hq", "Hkv", "D", "dtype"))
    layer = layer_of(window, args)
    plan = plan_for(work, window, P, B)
    nb = [plan.blocks_per_rank] * P
    nc = [int(plan.token_index(r).shape[0]) for r in range(P)]
    blind = None
    if window is not None:
        blind = imbalance(rank_pairs("splitkv", plan_for(work, window, P, B, blind=True), layer, None)[1])
    backend = get_kernel(args.backend, dev, dtype, head_dim=D,
                         row_intervals=layer["window"] is not None or layer["causal"]).name
    rows = []
    for method in args.methods:
        k = bench.resolve_chunks(None, P, plan.blocks_per_rank) if method == "splitkv" else 1
        calls, pairs = rank_pairs(method, plan, layer, k)
        order = sorted(range(P), key=lambda r: -pairs[r])
        timed = order[:2] if args.sample_ranks else list(range(P))
        per_rank = {r: bench.time_kernel_calls(calls[r], Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, device=dev,
                                               backend=args.backend, reps=args.reps, warmup=args.warmup,
                                               seed=args.seed + r) for r in timed}
        slow = max(timed, key=lambda r: per_rank[r]["ms"])
        kms = per_rank[slow]["ms"]
        recs = [bench.predicted_records(method, P=P, rank=r, n_blocks=nb, n_ctx=nc, B=B, Hq=Hq, Hkv=Hkv, D=D,
                                        elem=torch.finfo(dtype).bits // 8, metadata=True, num_chunks=k)
                for r in range(P)]
        row = dict(context=ctx, window=window, causal=layer["causal"], P=P, method=method, num_chunks=k,
                   backend=backend, kernel_ms=kms, kernel_ms_by_rank={str(r): per_rank[r]["ms"] for r in timed},
                   slowest_rank=slow, pairs=pairs, pairs_total=float(sum(pairs)), pair_imbalance=imbalance(pairs),
                   planner_imbalance=float(plan.imbalance), blind_pair_imbalance=blind, n_blocks=nb, n_ctx=nc,
                   comm_bytes=[int(sum(x.bytes for x in rr)) for rr in recs], links={})
        for name, link in links.items():
            def model(r, calls_ms):
                return method_time(method, P, calls_ms, recs[r], link, fwd_fraction=args.fwd_fraction,
                                   overhead_ms=0.0, D=D, elem=torch.finfo(dtype).bits // 8)
            comm = max(model(r, [0.0] * len(calls[r]))["comm_ms"] for r in range(P))
            sched = model(slow, per_rank[slow]["per_call_ms"])["total_ms"]
            row["links"][name] = dict(comm_ms=comm, step=kms + comm, overlap=max(kms, comm), schedule=sched)
        rows.append(row)
    return rows


def summarize(rows, args, links) -> list:
    """Per (context, W, link, model): the fastest method per P (ms of each) and the crossover sentence."""
    out = []
    for ctx in args.contexts:
        for w in args.windows:
            for link in links:
                for m in MODELS:
                    best = {}
                    for P in args.cps:
                        got = {r["method"]: r["links"][link][m] for r in rows
                               if (r["context"], r["window"], r["P"]) == (ctx, w, P)}
                        if got:
                            best[P] = dict(method=min(got, key=got.get), ms=got)
                    if best:
                        out.append(dict(context=ctx, window=w, link=link, model=m, fastest=best,
                                        sentence=crossover_sentence(ctx, w, link, m, best)))
    return out


def crossover_sentence(ctx, w, link, model, best) -> str:
    """The first P > 1 where splitkv is not the fastest, in words."""
    head = f"{ctx} tokens, {'W=' + str(w) if w is not None else 'full attention'}, {link}, {model}: "
    multi = [P for P in sorted(best) if P > 1]
    if not multi:
        return head + "no P > 1 measured."
    lost = [P for P in multi if best[P]["method"] != "splitkv"]
    if not lost:
        return head + f"splitkv is the fastest at every P measured ({', '.join(map(str, multi))})."
    P = lost[0]
    win = best[P]["method"]
    text = f"splitkv is the fastest up to P={multi[multi.index(P) - 1]}; " if P != multi[0] else ""
    ms = best[P]["ms"]
    text += f"at P={P} {win} wins ({ms[win]:.3f} ms vs splitkv {ms.get('splitkv', float('nan')):.3f} ms)"
    again = [Q for Q in multi if Q > P and best[Q]["method"] == "splitkv"]
    if again:
        return head + text + f"; splitkv is the fastest again at P={', '.join(map(str, again))}."
    return head + text + ("; splitkv is not the fastest at any larger P measured." if P != multi[-1] else ".")


def render(res, links) -> str:
    env = res["env"]
    lines = [f"# Sliding-window layers: splitkv vs allgather-kv vs ring-kv\n",
             f"Machine: {env['gpu']} ({env['machine']}), torch {env['torch']}, {env['date']}.  ",
             f"Command: `{env['command']}`\n",
             "Kernel: the slowest rank's local-kernel ms (forward + backward, measured); comm: the slowest rank's "
             "collectives (exact bytes, alpha-beta link: " + ", ".join(
                 f"{n} with {v['alpha_us']:g} us per hop" for n, v in res["links"].items()) + "); step = kernel + "
             "comm; overlap = max(kernel, comm); schedule = the op's own overlap (tools/simulate_scaling.py). Windowed "
             "rows: causal=" + str(res["causal"]) + ". At P = 1 the three methods run the same kernel calls: their "
             "differences there are timing noise.\n"]
    head = ["context", "W", "P", "method", "backend", "kernel ms", "comm MB/rank", "pairs (M)", "pair imb.",
            "blind imb."] + [f"{n} {m}" for n in links for m in ("comm ms", "step", "overlap", "schedule")]
    body = []
    for r in res["rows"]:
        cells = [r["context"], r["window"] or "none", r["P"], r["method"] + (f" k={r['num_chunks']}" if r["num_chunks"]
                 > 1 else ""), r["backend"], f"{r['kernel_ms']:.3f}", f"{max(r['comm_bytes']) / 1e6:.1f}",
                 f"{r['pairs_total'] / 1e6:.2f}", f"{r['pair_imbalance']:.3f}", bench.finite(r["blind_pair_imbalance"],
                                                                                         "{:.3f}")]
        for n in links:
            x = r["links"][n]
            cells += [f"{x['comm_ms']:.3f}", f"{x['step']:.3f}", f"{x['overlap']:.3f}", f"{x['schedule']:.3f}"]
        body.append(cells)
    lines.append(bench.md_table(head, body))
    lines.append("\n## Fastest method per P\n")
    cps = sorted({P for s in res["summary"] for P in s["fastest"]})
    lines.append(bench.md_table(["context", "W", "link", "model"] + [f"P={P}" for P in cps], [
        [s["context"], s["window"] or "none", s["link"], s["model"]]
        + [s["fastest"][P]["method"] if P in s["fastest"] else "-" for P in cps] for s in res["summary"]]))
    lines.append("\n## Crossover\n")
    lines += [f"- {s['sentence']}" for s in res["summary"]]
    if res["cut"]:
        lines.append(f"\nCut by --budget-s (not run): {', '.join(res['cut'])}")
    if res["errors"]:
        lines.append(f"\nErrors (left out): {'; '.join(res['errors'])}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--contexts", default="65536,131072", help="context tokens (one sequence each), comma list")
    ap.add_argument("--cps", default="1,2,4,8", help="CP sizes P, comma list")
    ap.add_argument("--windows", default="512,2048,4096,none", help="sliding windows W and 'none' (full attention)")
    ap.add_argument("--no-causal", dest="causal", action="store_false",
                    help="windowed rows with a bidirectional own block (default: causal, dflash's sliding_attention)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    ap.add_argument("--backend", default="auto", choices=BACKENDS, help="local kernel (megatron_splitkv.kernels)")
    ap.add_argument("--sample-ranks", action="store_true", help="time only the 2 ranks with the most visible pairs")
    ap.add_argument("--warmup", type=int_arg(0), default=2, help="untimed calls before each timed call")
    ap.add_argument("--link-gbs", type=float_arg(0, above=True), default=225.0, help="fast link, GB/s per GPU")
    ap.add_argument("--link-alpha-us", type=float_arg(0), default=8.0, help="fast link latency per ring hop")
    ap.add_argument("--slow-link-gbs", type=float_arg(0, above=True), default=50.0, help="slow link, GB/s per GPU")
    ap.add_argument("--slow-link-alpha-us", type=float_arg(0), default=15.0, help="slow link latency per ring hop")
    ap.add_argument("--fwd-fraction", type=float_arg(0, 1), default=0.29,
                    help="forward share of the kernel time (the schedule model's; tools/simulate_scaling.py)")
    ap.add_argument("--budget-s", type=float_arg(0, above=True), default=None,
                    help="start no new (context, W, P) group after this many seconds (default: no limit)")
    ap.add_argument("--cpu", action="store_true", help="CPU smoke: tiny shapes, float32, math kernel, " +
                    ", ".join(f"--{k} {v}" for k, v in CPU_DEFAULTS.items()) + " unless given")
    ap.add_argument("--out", type=output_dir, default=None, help="directory for window_scaling.{json,md}")
    bench.add_workload_args(ap, reps=5)
    if "--cpu" in (sys.argv[1:] if argv is None else argv):
        ap.set_defaults(**CPU_DEFAULTS)
    args = ap.parse_args(argv)
    args.contexts = bench.int_list_arg(ap, "--contexts", args.contexts, 2)
    args.cps = sorted(bench.int_list_arg(ap, "--cps", args.cps, 1))
    args.windows = windows_arg(ap, args.windows)
    args.methods = bench.choices_arg(ap, "--methods", args.methods, METHODS, "method")
    if args.cpu and args.backend != "math":
        ap.error(f"--cpu runs the math kernel only, got --backend {args.backend}")
    dev = torch.device("cpu" if args.cpu else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run on a GPU, or pass --cpu for the CPU smoke")
    shapes = CPU if args.cpu else GPU
    try:  # the kernel --backend names exists here (a windowed row may still pick another under "auto")
        get_kernel(args.backend, dev, shapes["dtype"], head_dim=shapes["D"])
    except (ImportError, ValueError) as e:
        ap.error(f"--backend {args.backend}: {e}")
    works = {}
    for ctx in args.contexts:
        try:
            works[ctx] = bench.make_workload(ctx, args.anchors, n_seqs=args.n_seqs, seed=args.seed + ctx,
                                             mask=args.loss_mask)
        except ValueError as e:
            ap.error(f"--contexts {ctx} with --n-seqs {args.n_seqs} and --anchors {args.anchors}: {e}")
    links = {f"{args.link_gbs:g} GB/s": link_model(args.link_gbs, args.link_alpha_us),
             f"{args.slow_link_gbs:g} GB/s": link_model(args.slow_link_gbs, args.slow_link_alpha_us)}
    t0 = time.perf_counter()
    rows, cut, errors = [], [], []
    for ctx in args.contexts:
        for w in args.windows:
            for P in args.cps:
                name = f"{ctx}/W={w or 'none'}/P={P}"
                if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
                    cut.append(name)
                    continue
                try:
                    got = measure_group(ctx, w, P, args, shapes, works[ctx], dev, links)
                except (RuntimeError, ValueError, ImportError) as e:  # OOM, a kernel refusing the mask
                    errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    continue
                rows += got
                print(f"[{time.perf_counter() - t0:6.1f}s] {name}: " + ", ".join(
                    f"{r['method']} {r['kernel_ms']:.3f} ms" for r in got), flush=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    res = dict(env=dict(command=" ".join(["python", "tools/window_scaling.py"] + list(
                   sys.argv[1:] if argv is None else argv)), machine=platform.node(), platform=platform.platform(),
                   gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   elapsed_s=time.perf_counter() - t0),
               shapes={k: str(v) for k, v in shapes.items()}, anchors=args.anchors, causal=args.causal,
               links={n: dict(gbs=m.intra["p2p"].bw / 1e9, alpha_us=m.intra["p2p"].alpha_s * 1e6)
                      for n, m in links.items()},
               rows=rows, cut=cut, errors=errors)
    res["summary"] = summarize(rows, args, links)
    text = render(res, links)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "window_scaling.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "window_scaling.md"), "w") as f:
            f.write(text)
    return res


if __name__ == "__main__":
    main()
