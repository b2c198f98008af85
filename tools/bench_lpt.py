#!/usr/bin/env python
"""Benchmark the CP planner: load imbalance and planning time of every strategy at CP 2..64.

Batches: ShareGPT conversations packed to 32K tokens (Qwen chat template, 512 anchors per sequence,
`megatron_splitkv.data.ShareGPTLoader`), and synthetic long batches of up to 128K tokens (one 64K
sequence of concatenated real conversations plus 300-token sequences, `synthetic_long_batch`).

Imbalance = max/mean - 1 of the realized per-rank cost (default CostModel); planning time = median
thread CPU time of `plan_context_parallel` over repeats (single-threaded, so this equals wall time on
an idle machine and is robust to other jobs; wall times go to the JSON; per-rank index arrays are
built lazily on each rank and are not included). Writes `lpt_bench.md` (markdown table), `lpt_bench.png`
(plot) and `lpt_bench.json` into --out (default out/lpt_bench; the committed results in docs/lab/ were
written with `--out docs/lab`).

    .venv/bin/python tools/bench_lpt.py [--out docs/lab] [--batches 8] [--long-batches 4] [--quick]

Source: arXiv 2611.05926 (Split-KV), LPT section: < 1% imbalance, ~1000x faster than DCP's hypergraph.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_splitkv.data.sharegpt import ShareGPTLoader, load_sharegpt, synthetic_long_batch  # noqa: E402
from megatron_splitkv.planning import plan_context_parallel  # noqa: E402

CP_SIZES = (2, 4, 8, 16, 32, 64)
BLOCK = 16
# variants: name -> plan_context_parallel keyword arguments
VARIANTS = {
    "lpt": dict(strategy="lpt"),  # default: auto chunk (64..2048, >= 8 per rank, halved to meet 0.5%), refinement
    "lpt-pure": dict(strategy="lpt", refine=False),  # Graham's LPT alone (same automatic chunk rule)
    "lpt-min128": dict(strategy="lpt", min_chunk=128),  # the old 128-token chunk floor
    "contiguous": dict(strategy="contiguous"),
    "zigzag": dict(strategy="zigzag"),
    "hypergraph": dict(strategy="hypergraph"),
}


def time_plan(batch, P, variant, repeats):
    """(plan, median thread CPU seconds, median wall seconds) over `repeats` calls. The planner is
    single-threaded; CPU time is robust to other jobs sharing the machine, wall time is not."""
    cpu, wall = [], []
    plan = None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = plan_context_parallel(batch.seq_lens, batch.anchors, block_size=BLOCK, cp_size=P, **VARIANTS[variant])
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return plan, statistics.median(cpu), statistics.median(wall)


def main(argv=None):
    from megatron_splitkv._ints import int_arg, output_dir  # strict decimal numbers within their limits
    from tools.benchlib import choices_arg

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=output_dir, default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out",
                                                  "lpt_bench"),
                    help="output directory (default out/lpt_bench; `--out docs/lab` rewrites the committed results)")
    ap.add_argument("--batches", type=int_arg(1), default=8, help="ShareGPT 32K batches")
    ap.add_argument("--long-batches", type=int_arg(1), default=4, help="synthetic 128K batches")
    ap.add_argument("--repeats", type=int_arg(1), default=21, help="timing repeats (lpt/contiguous/zigzag)")
    ap.add_argument("--hg-repeats", type=int_arg(1), default=3, help="timing repeats (hypergraph)")
    ap.add_argument("--strategies", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    ap.add_argument("--quick", action="store_true", help="small-data mode (first 300 conversations)")
    ap.add_argument("--cache-dir", default=None,
                    help="tokenized ShareGPT cache directory (whole corpus; default ~/.cache/megatron_splitkv)")
    args = ap.parse_args(argv)
    strategies = choices_arg(ap, "--strategies", args.strategies, tuple(VARIANTS), "strategy")
    for flag in ("batches", "long_batches", "repeats", "hg_repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")

    try:
        import kahypar  # noqa: F401
    except ImportError:
        print("kahypar not installed: skipping the hypergraph strategy", file=sys.stderr)
        strategies = [s for s in strategies if s != "hypergraph"]
        if not strategies:
            ap.error("--strategies: hypergraph alone, and it needs kahypar (not installed)")

    corpus = load_sharegpt(300 if args.quick else None, cache_dir=args.cache_dir)
    loader = ShareGPTLoader(max_tokens=32768, num_anchors=512, seed=0, corpus=corpus, drop_last=True)
    data = {
        "ShareGPT 32K": [b for _, b in zip(range(args.batches), loader)],
        "long 128K (64K + 300s)": [synthetic_long_batch(seed=s, corpus=corpus) for s in range(args.long_batches)],
    }
    rows = []
    for name, batches in data.items():
        ntok = [b.num_tokens for b in batches]
        nseq = [len(b.seq_lens) for b in batches]
        print(f"{name}: {len(batches)} batches, tokens {min(ntok)}-{max(ntok)}, sequences {min(nseq)}-{max(nseq)}",
              flush=True)
        for P in CP_SIZES:
            for strat in strategies:
                reps = args.hg_repeats if strat == "hypergraph" else args.repeats
                imb, tms, walls, chunks = [], [], [], []
                for b in batches:
                    plan, t, w = time_plan(b, P, strat, reps)
                    imb.append(plan.imbalance)
                    tms.append(t)
                    walls.append(w)
                    chunks.append(plan.chunk_size or 0)
                row = dict(data=name, P=P, strategy=strat, imb_mean=float(np.mean(imb)), imb_max=float(np.max(imb)),
                           time_ms=float(np.median(tms)) * 1e3, wall_ms=float(np.median(walls)) * 1e3,
                           time_ms_max=float(np.max(tms)) * 1e3,
                           chunk=int(np.median(chunks)), chunk_min=int(np.min(chunks)), chunk_max=int(np.max(chunks)))
                rows.append(row)
                print(f"  P={P:3d} {strat:11s} imbalance mean {row['imb_mean']*100:8.3f}% max "
                      f"{row['imb_max']*100:8.3f}%  plan {row['time_ms']:9.3f} ms CPU ({row['wall_ms']:9.3f} wall)  "
                      f"chunk {row['chunk']}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), machine=platform.processor() or
                platform.machine(), cpus=os.cpu_count(), python=platform.python_version(), numpy=np.__version__,
                command="python " + " ".join(sys.argv), quick=args.quick,
                load=" ".join(f"{x:.1f}" for x in os.getloadavg()))
    with open(os.path.join(args.out, "lpt_bench.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)

    lines = [f"Imbalance (max/mean - 1; mean / max over batches) and planning time (ms of thread CPU time, median "
             f"over batches of the median over repeats; wall times and the slowest batch in lpt_bench.json); "
             f"lpt chunk = chunk size(s) the default planner used. {meta['date']}, "
             f"{meta['cpus']} CPUs, load average {meta['load']}, `{meta['command']}`.", ""]
    lines.append("| batches | P | lpt chunk | " + " | ".join(f"{s} imbalance" for s in strategies) + " | " +
                 " | ".join(f"{s} ms" for s in strategies) +
                 (" | hypergraph / lpt time |" if "hypergraph" in strategies and "lpt" in strategies else " |"))
    ncol = 3 + 2 * len(strategies) + (1 if "hypergraph" in strategies and "lpt" in strategies else 0)
    lines.append("|" + "---|" * ncol)
    for name in data:
        for P in CP_SIZES:
            rs = {r["strategy"]: r for r in rows if r["data"] == name and r["P"] == P}
            lp = rs.get("lpt")
            cells = [name, str(P), "-" if lp is None else (str(lp["chunk_min"]) if lp["chunk_min"] == lp["chunk_max"]
                                                            else f"{lp['chunk_min']}-{lp['chunk_max']}")]
            cells += [f"{rs[s]['imb_mean']*100:.2f}% / {rs[s]['imb_max']*100:.2f}%" for s in strategies]
            cells += [f"{rs[s]['time_ms']:.3f}" for s in strategies]
            if "hypergraph" in strategies and "lpt" in strategies:
                cells.append(f"{rs['hypergraph']['time_ms'] / rs['lpt']['time_ms']:.0f}x")
            lines.append("| " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "lpt_bench.md"), "w") as f:
        f.write(md)
    print(md)

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(2, len(data), figsize=(6 * len(data), 8), squeeze=False)
    for col, name in enumerate(data):
        for s in strategies:
            rs = [r for r in rows if r["data"] == name and r["strategy"] == s]
            axes[0, col].plot([r["P"] for r in rs], [max(r["imb_mean"] * 100, 1e-3) for r in rs], "o-", label=s)
            axes[1, col].plot([r["P"] for r in rs], [r["time_ms"] for r in rs], "o-", label=s)
        axes[0, col].set(title=f"{name}: load imbalance", yscale="log", xlabel="CP size",
                         ylabel="max/mean - 1 (%)")
        axes[1, col].set(title=f"{name}: planning time", yscale="log", xlabel="CP size",
                         ylabel="CPU ms per batch (median)")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xticks(CP_SIZES, [str(p) for p in CP_SIZES])
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "lpt_bench.png"), dpi=110)
    print("wrote", os.path.join(args.out, "lpt_bench.png"))


if __name__ == "__main__":
    main()
