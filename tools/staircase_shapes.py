#!/usr/bin/env python3
"""Count the dense-call shapes the staircase kernel requests over a simulated DFlash training run (CPU
only, no attention runs), and what bounding them costs (pairs moved from the dense part to flex).

Why: the staircase kernel (kernels/staircase.py, docs/kernels.md "Staircase kernel") runs the fully
visible rectangles of the DFlash mask as dense cuDNN SDPA calls, and cuDNN builds (1-2 s on the H200,
gpu_check's "first call" column) and caches one graph per new call shape and direction. Training data
changes the rectangles every step, so the number of distinct shapes over a run decides whether the
kernel can be the default. Source: our design (docs/kernels.md, "Bounded dense shapes").

What it simulates, per step (a fresh batch each step, seeded):
  * sequences with lengths drawn from `--dist` (log-uniform by default) in [--min-len, --max-len]
    tokens, packed next-fit into batches of at most `--max-tokens` tokens (longer ones truncated), one
    packed batch per step;
  * anchors as training samples them (`data.anchors.sample_anchors`, all-ones loss mask): `--anchors`
    per sequence (`--anchors-per seq`, ShareGPTLoader / examples/pretrain_dflash.py) or split over the
    batch (`--anchors-per batch`, `bench.make_workload`);
  * the planner (`bench.place`, LPT by default) at every CP size of `--cp`, and on every rank the local
    kernel calls of `--impl` with the own block fused (`bench.kernel_calls`, a mirror of ops/*.py,
    Split-KV's chunk pipeline included);
  * for every option variant of `--variants`, the staircase plan of each call
    (`StaircaseAttentionKernel.call_shapes`: `staircase_plan` + `dense_call_shapes`, pure host code).

A shape is what torch's cuDNN graph caches key on (kernels/staircase.py `DenseShape`): direction (fwd /
bwd are separate caches), heads, query rows (folded GQA: blocks x B x Hq/Hkv), kv heads, key rows, head
dim, dtype; batch 1 and strides fixed by the heads and D. Each CP rank is one process with its own
cache: "per rank" is the largest distinct count over the ranks of a CP size, "union" over all of them.
Not counted: the one-time kv-layout probe (`probe_kv_views`: one fwd + one bwd graph per process).

Outputs (stdout, and `--out` markdown, `--json`):
  1. distinct shapes (fwd + bwd graphs) after each step count of `--steps`, per variant and CP size;
  2. per context size of `--sizes` (one sequence of that many tokens, `--anchors` anchors, CP 1: the
     rank's context keys = the size): share of visible pairs served densely, pairs moved to the inner
     kernel (flex) relative to the first variant, dense calls per forward, and a modelled cost:
     moved pairs x `--moved-pair-ns` + extra calls x `--call-us` (fwd + bwd, fitted to H200 timings of
     rounding variants, docs/kernels.md "Bounded dense shapes");
  3. the same shares over the simulated steps, by context keys per call (buckets of `--key-bins`).

Usage:
    python tools/staircase_shapes.py                      # 1000 steps, CP 1,2,8
    python tools/staircase_shapes.py --steps 10,100 --cp 1,8 --dist uniform
    python tools/staircase_shapes.py --variants "default;k2:key_buckets=2"

Variants: `name:opt=value,...` separated by ';' (options of `StaircaseAttentionKernel`, env-free: the
defaults of kernels/staircase.py `_DEFAULTS`); "default" alone is the current defaults; the first
variant is the baseline of the "moved" columns.

Errors: argparse errors (exit 2) for malformed flags and unknown options.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the defaults first (the "moved" baseline), then the fewer-shape setting of docs/tuning.md
DEFAULT_VARIANTS = "default;fewer:key_buckets=2,key_pieces=2,max_tile_keys=16384"
FLOAT_DTYPES = ("bfloat16", "float16")


def parse_variants(spec: str):
    """'a:x=1,y=2;default' -> [("a", {"x": 1, "y": 2}), ("default", {})]. ValueError on a malformed item
    or an option the kernel does not have (or one that does not change the plan or the shapes' count)."""
    from megatron_splitkv.kernels.staircase import _DEFAULTS, option_from_text

    out = []
    for item in (x.strip() for x in spec.split(";")):
        if not item:
            continue
        name, _, rest = item.partition(":")
        name = name.strip()
        if not name:
            raise ValueError(f"variant without a name in {item!r}")
        opts = {}
        for kv in (x.strip() for x in rest.split(",") if x.strip()):
            if "=" not in kv:
                raise ValueError(f"expected opt=value, got {kv!r} in {item!r}")
            k, v = (x.strip() for x in kv.split("=", 1))
            if k not in _DEFAULTS or k in ("inner", "streams", "kv_layout"):
                raise ValueError(f"unknown (or shape-neutral) staircase option {k!r} in {item!r}")
            opts[k] = option_from_text(k, v, where=f"{k} in {item!r}")  # ints: plain decimal digits only
        out.append((name, opts))
    if not out:
        raise ValueError("no variants")
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"variant names must differ: {[n for n, _ in out]}")
    return out


def sample_lengths(rng, n, dist, lo, hi):
    """n sequence lengths (tokens) from `dist` in [lo, hi]."""
    if dist == "uniform":
        x = rng.uniform(lo, hi, n)
    elif dist == "loguniform":
        x = np.exp(rng.uniform(math.log(lo), math.log(hi), n))
    else:
        raise ValueError(dist)
    return np.clip(np.round(x).astype(np.int64), 2, hi)


def sample_batch(rng, args):
    """One step's packed batch: (seq_lens int64 array, anchors list): lengths drawn until the next one
    would overflow --max-tokens (next-fit, like data.sharegpt.pack_order; the first one is truncated to
    --max-tokens), anchors per sequence or split over the batch."""
    from megatron_splitkv.data.anchors import sample_anchors

    lens, used = [], 0
    while True:
        L = int(min(sample_lengths(rng, 1, args.dist, args.min_len, args.max_len)[0], args.max_tokens))
        if lens and used + L > args.max_tokens:
            break
        lens.append(L)
        used += L
        if used >= args.max_tokens or args.max_seqs and len(lens) >= args.max_seqs:
            break
    if args.anchors_per == "seq":
        per = [args.anchors] * len(lens)
    else:
        per = [args.anchors // len(lens) + (1 if j < args.anchors % len(lens) else 0) for j in range(len(lens))]
    anchors = [sample_anchors(np.ones(L, dtype=bool), n, rng=rng) for L, n in zip(lens, per)]
    return np.asarray(lens, dtype=np.int64), anchors


def call_masks(plan, rank, impl):
    """(IntervalMask, context keys) of each local-kernel call of `impl` on `rank` (own block fused)."""
    import torch

    from tools import benchlib as bench
    from megatron_splitkv.kernels.base import IntervalMask

    out = []
    for c in bench.kernel_calls(impl, plan, rank):
        t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64)  # noqa: E731
        if c.own_lo is None:
            m = IntervalMask(c.block_size, t(c.lo), t(c.hi), c.num_keys)
        else:
            m = IntervalMask(c.block_size, t(c.lo), t(c.hi), c.num_keys, t(c.own_lo), t(c.own_hi),
                             num_ctx_keys=c.ctx_keys_padded)
        out.append((m, c.num_ctx))
    return out


class Tally:
    """Distinct shapes per (variant, CP, rank) and pair / call sums per (variant, key bin)."""

    def __init__(self):
        self.shapes = {}  # (variant, P, rank) -> set
        self.bins = {}  # (variant, bin) -> [pairs_total, pairs_dense, fwd calls, calls counted]

    def add(self, variant, P, rank, shapes):
        self.shapes.setdefault((variant, P, rank), set()).update(shapes)

    def per_rank(self, variant, P):
        return max((len(s) for (v, p, _), s in self.shapes.items() if v == variant and p == P), default=0)

    def union(self, variant, P=None):
        u = set()
        for (v, p, _), s in self.shapes.items():
            if v == variant and (P is None or p == P):
                u |= s
        return u


def keys_bin(keys, edges):
    for e in edges:
        if keys < e:
            return e
    return math.inf


def model_ms(moved_pairs, extra_calls, args):
    """Modelled extra fwd + bwd time (ms, one rank, one layer) of moving pairs from the dense part to the
    remainder and of extra dense calls: moved_pairs x --moved-pair-ns + extra_calls x --call-us (both
    fitted to H200 measurements of the variants, Hq 32 / Hkv 8 / D 128 bf16; docs/kernels.md)."""
    return 1e3 * (moved_pairs * args.moved_pair_ns * 1e-9 + extra_calls * args.call_us * 1e-6)


def run(args):
    import torch

    from tools import benchlib as bench
    from megatron_splitkv.kernels.staircase import StaircaseAttentionKernel

    dtype = getattr(torch, args.dtype)
    variants = [(n, StaircaseAttentionKernel(inner="math", **o)) for n, o in args.variants]
    names = [n for n, _ in variants]
    checkpoints = sorted(set(args.steps))
    tally = Tally()
    counts = []  # rows: step, variant, P, per-rank, union (all ranks of that P)
    edges = args.key_bins
    t0 = time.time()
    rng = np.random.default_rng(args.seed)
    for step in range(1, checkpoints[-1] + 1):
        lens, anchors = sample_batch(rng, args)
        for P in args.cp:
            plan = bench.place(lens, anchors, cp_size=P, strategy=args.strategy, block_size=args.block_size)
            for rank in range(P):
                for mask, nctx in call_masks(plan, rank, args.impl):
                    b = keys_bin(nctx, edges)
                    for name, kern in variants:
                        shapes = kern.call_shapes(mask, args.hq, args.hkv, args.head_dim, dtype)
                        tally.add(name, P, rank, shapes)
                        p = kern.plan(mask)
                        acc = tally.bins.setdefault((name, b), [0, 0, 0, 0])
                        acc[0] += p.pairs_total
                        acc[1] += p.pairs_dense
                        acc[2] += len(p.groups)
                        acc[3] += 1
        if step in checkpoints:
            for name in names:
                for P in args.cp:
                    counts.append(dict(step=step, variant=name, cp=P, per_rank=tally.per_rank(name, P),
                                       union=len(tally.union(name, P))))
                counts.append(dict(step=step, variant=name, cp="all", per_rank=None,
                                   union=len(tally.union(name))))
            if not args.quiet:
                print(f"step {step}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    sizes = []
    for size in args.sizes:
        lens, anchors = bench.make_workload(size, args.anchors, seed=args.seed)
        plan = bench.place(lens, anchors, cp_size=1, block_size=args.block_size)
        (mask, _), = call_masks(plan, 0, "splitkv")
        row = dict(size=size)
        for name, kern in variants:
            p = kern.plan(mask)
            row[name] = dict(dense=p.pairs_dense / p.pairs_total, pairs=p.pairs_total, calls=len(p.groups))
        sizes.append(row)
    ranges = {}
    for name in names:  # the distinct key / row counts: what bounds the shapes
        u = tally.union(name)
        ranges[name] = dict(keys=sorted({s.keys for s in u}), rows=sorted({s.rows for s in u}))
    return dict(counts=counts, sizes=sizes, bins={f"{v}|{b}": x for (v, b), x in tally.bins.items()},
                ranges=ranges, names=names, seconds=time.time() - t0)


def render(res, args) -> str:
    names, base = res["names"], res["names"][0]
    lines = [f"Simulated: {args.dist} sequence lengths in [{args.min_len}, {args.max_len}] packed into "
             f"<= {args.max_tokens} tokens per step (max {args.max_seqs or 'any'} sequences), {args.anchors} "
             f"anchors per {'sequence' if args.anchors_per == 'seq' else 'batch'}, B {args.block_size}, "
             f"{args.impl} with {args.strategy} at CP {','.join(map(str, args.cp))}, Hq {args.hq} / Hkv "
             f"{args.hkv} / D {args.head_dim} {args.dtype}, seed {args.seed}.",
             "Variants: " + "; ".join(f"`{n}`" + (f" ({', '.join(f'{k}={v}' for k, v in o.items())})" if o else
                                                   " (kernel defaults)") for n, o in args.variants),
             "", "### Distinct dense-call shapes (cuDNN graphs: fwd + bwd) after N steps", "",
             "| steps | variant | " + " | ".join(f"CP {P} per rank / union" for P in args.cp) + " | all CP sizes |",
             "|---|---|" + "---|" * (len(args.cp) + 1)]
    by = {}
    for r in res["counts"]:
        by.setdefault((r["step"], r["variant"]), {})[r["cp"]] = r
    for (step, name), d in sorted(by.items(), key=lambda x: (x[0][0], names.index(x[0][1]))):
        cells = [f"{d[P]['per_rank']} / {d[P]['union']}" for P in args.cp]
        lines.append(f"| {step} | {name} | " + " | ".join(cells) + f" | {d['all']['union']} |")
    lines += ["", "Distinct key lengths / query rows over the run (all CP sizes):", ""]
    for name in names:
        k, r = res["ranges"][name]["keys"], res["ranges"][name]["rows"]
        ks = ", ".join(map(str, k)) if len(k) <= 16 else f"{len(k)} values, {k[0]}..{k[-1]}"
        lines.append(f"- `{name}`: {len(k)} key lengths ({ks}); {len(r)} row counts ({', '.join(map(str, r))})")
    lines += ["", f"### One sequence per context size (CP 1, {args.anchors} anchors): dense share, pairs moved "
              f"to flex vs `{base}`, dense calls per forward, modelled cost", "",
              "| context keys | " + " | ".join(f"{n} dense % | {n} calls" for n in names) + " | "
              + " | ".join(f"{n}: moved pp / model +ms" for n in names[1:]) + " |",
              "|---|" + "---|---|" * len(names) + "---|" * (len(names) - 1)]
    for row in res["sizes"]:
        cells = [f"{100 * row[n]['dense']:.1f} | {row[n]['calls']}" for n in names]
        moved = []
        for n in names[1:]:
            mv = row[base]["dense"] - row[n]["dense"]
            ms = model_ms(mv * row[n]["pairs"], row[n]["calls"] - row[base]["calls"], args)
            moved.append(f"{100 * mv:+.2f} / {ms:+.2f}")
        lines.append(f"| {row['size']} | " + " | ".join(cells) + " | " + " | ".join(moved) + " |")
    lines += ["", "### Over the simulated steps, by context keys per call (all CP sizes and ranks)", "",
              "| keys per call < | calls | " + " | ".join(f"{n} dense %" for n in names) + " | "
              + " | ".join(f"{n} moved pp | {n} calls/fwd | {n} model +ms/call" for n in names[1:]) + " |",
              "|---|---|" + "---|" * len(names) + "---|---|---|" * (len(names) - 1)]
    bins = sorted({float(k.split("|")[1]) for k in res["bins"]})
    for b in bins:
        key = lambda n: f"{n}|{int(b) if b != math.inf else 'inf'}"  # noqa: E731
        if key(base) not in res["bins"]:
            continue
        tb = res["bins"][key(base)]
        cells = [f"{100 * res['bins'][key(n)][1] / max(res['bins'][key(n)][0], 1):.1f}" for n in names]
        moved = []
        for n in names[1:]:
            x = res["bins"][key(n)]
            ms = model_ms((tb[1] - x[1]) / max(tb[3], 1), (x[2] - tb[2]) / max(tb[3], 1), args)
            moved.append(f"{100 * (tb[1] - x[1]) / max(tb[0], 1):+.2f} | {x[2] / max(x[3], 1):.1f} "
                         f"(vs {tb[2] / max(tb[3], 1):.1f}) | {ms:+.2f}")
        label = "inf" if b == math.inf else str(int(b))
        lines.append(f"| {label} | {tb[3]} | " + " | ".join(cells) + " | " + " | ".join(moved) + " |")
    lines += ["", f"Model: moved pairs x {args.moved_pair_ns} ns + extra dense calls x {args.call_us} us (fwd + bwd, "
              "one rank, one layer; fitted to H200 timings of rounding variants vs the legacy rounding at 32K-128K "
              "keys, Hq 32 / Hkv 8 / D 128 bf16)."]
    return "\n".join(lines)


def main(argv=None):
    from megatron_splitkv._ints import float_arg, int_arg  # finite reals only: float() takes "nan" / "inf"

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="10,100,1000", help="checkpoints (the run lasts the largest)")
    ap.add_argument("--cp", default="1,2,8", help="CP sizes")
    ap.add_argument("--impl", default="splitkv", choices=("splitkv", "allgather-kv", "ring-kv"))
    ap.add_argument("--strategy", default="lpt", help="planner strategy (bench.place)")
    ap.add_argument("--dist", default="loguniform", choices=("loguniform", "uniform"))
    ap.add_argument("--min-len", type=int_arg(1), default=4096)
    ap.add_argument("--max-len", type=int_arg(1), default=131072)
    ap.add_argument("--max-tokens", type=int_arg(1), default=131072, help="packed batch budget (tokens per step)")
    ap.add_argument("--max-seqs", type=int_arg(0), default=0, help="most sequences per batch (0: no limit)")
    ap.add_argument("--anchors", type=int_arg(1), default=512)
    ap.add_argument("--anchors-per", default="seq", choices=("seq", "batch"))
    ap.add_argument("--block-size", type=int_arg(1), default=16)
    ap.add_argument("--hq", type=int_arg(1), default=32)
    ap.add_argument("--hkv", type=int_arg(1), default=8)
    ap.add_argument("--head-dim", type=int_arg(1), default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=FLOAT_DTYPES)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--sizes", default="8192,16384,32768,65536,131072", help="one-sequence context sizes")
    ap.add_argument("--key-bins", default="16384,32768,65536,131072", help="bin edges of keys per call")
    ap.add_argument("--moved-pair-ns", type=float_arg(0), default=0.21,
                    help="extra fwd+bwd ns per visible pair moved from the dense part to flex (H200 fit)")
    ap.add_argument("--call-us", type=float_arg(0), default=200.0,
                    help="extra fwd+bwd us per additional dense call (H200 fit, incl. the merge/accumulation)")
    ap.add_argument("--seed", type=int_arg(0), default=0)
    ap.add_argument("--out", default=None, help="write the markdown tables here")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    from tools.benchlib import int_list_arg
    from megatron_splitkv.planning import STRATEGIES

    for flag in ("--steps", "--cp", "--sizes", "--key-bins"):
        name = flag[2:].replace("-", "_")
        setattr(args, name, int_list_arg(ap, flag, getattr(args, name), 1))
    if args.strategy not in STRATEGIES:
        ap.error(f"--strategy must be one of {', '.join(STRATEGIES)}, got {args.strategy!r}")
    if args.max_seqs < 0:
        ap.error(f"--max-seqs must be >= 0 (0: no limit), got {args.max_seqs}")
    for flag in ("--moved-pair-ns", "--call-us"):
        v = getattr(args, flag[2:].replace("-", "_"))
        if not math.isfinite(v) or v < 0:
            ap.error(f"{flag} must be a finite number >= 0, got {v}")
    try:
        args.variants = parse_variants(args.variants)
        from megatron_splitkv.kernels.staircase import StaircaseAttentionKernel

        for _, o in args.variants:
            StaircaseAttentionKernel(inner="math", **o)  # validates the values
    except ValueError as exc:
        ap.error(f"--variants: {exc}")
    for name in ("min_len", "max_len", "max_tokens", "anchors", "block_size", "hq", "hkv", "head_dim"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.min_len < 2 or args.max_len < args.min_len or args.hq % args.hkv:
        ap.error("need 2 <= --min-len <= --max-len and --hq a multiple of --hkv")
    res = run(args)
    text = render(res, args)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(res, args={k: v for k, v in vars(args).items() if k != "variants"},
                           variants=args.variants), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
