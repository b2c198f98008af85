#!/usr/bin/env python3
"""FlexAttention `kernel_options` sweep for the DFlash interval mask (issue 6, item e).

Workload: 512 anchors x 16 (Tq 8192), one sequence, Hq 32, Hkv 8, D 128, bf16, `--tks` keys (16K, 64K),
the mask of `tools.benchlib.dflash_interval_mask` (the same as tools/gpu_check.py compare). Each
config runs through the kernel API (`FlexAttentionKernel(kernel_options=...)`, cached mask: what the op
runs; note that flex silently drops `USE_TMA` when its inputs do not qualify, so the API path, not raw
flex, is what counts), compiled once per (config, Tk): forward and forward + backward ms, useful TF/s
(4 * pairs * Hq * D forward, x3.5 forward + backward) and % of dense SDPA at the same useful FLOPs, and
exactness vs a float64 reference (out, lse, dq, dk, dv) so that a fast but wrong config is never
reported as best.

Option names (torch 2.11, torch/_inductor/kernel/flex/flex_attention.py): keys prefixed "fwd_" apply to the
forward kernel only, "bwd_" to the backward kernels only (unprefixed keys to both). Forward: BLOCK_M,
BLOCK_N, num_warps, num_stages, USE_TMA; backward: BLOCK_M1, BLOCK_N1 (dK/dV kernel: query rows x keys),
BLOCK_M2, BLOCK_N2 (dQ kernel), num_warps, num_stages, USE_TMA. Constraints: 128 (the BlockMask tile) must
be a multiple of every BLOCK_*, BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0. sm90 defaults for
bf16, D 128: forward (128, 64), 3 stages, 8 warps; backward (64, 128, 128, 64), 3 stages, 8 warps.

Order: every config at the first Tk, then every config at the next (a `--budget-s` cut keeps a complete
first column); a (config, Tk) is not started after --budget-s seconds. Best config: the largest geometric
mean of fwd+bwd speedup over "default" across the Tks measured for it and for default, among the exact
ones (max relative error < 2e-2, lse < 0.05, nothing non-finite).

Outputs in --out: tune_flex.json, tune_flex.md; the table and the best config are printed last. With --cpu
no config is recommended ("best": null, "no_recommendation": the reason): the emulated flex ignores
kernel_options, so any difference is noise.

Examples (from the repository root; no PYTHONPATH needed: the script puts the repository on sys.path):
  python tools/tune_flex.py --out out/tune_flex --budget-s 120
  python tools/tune_flex.py --configs default,fwd_tma --tks 16384
  python tools/tune_flex.py --cpu        # plumbing only: flex emulated on CPU ignores kernel_options
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import benchlib as bench  # noqa: E402

#: (name, kernel_options), at most six, ordered by expected value (the first is the baseline)
#: (forward-only changes first: the backward variants are the likelier to fail to compile or, worse, to
#: break the CUDA context, after which the remaining rows of this process are skipped)
CONFIGS = [
    ("default", {}),
    ("fwd_tma", {"fwd_USE_TMA": True}),
    ("fwd_128x128_s2_w8_tma", {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8,
                               "fwd_USE_TMA": True}),
    ("fwd_64x128_s3_w4_tma", {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_stages": 3, "fwd_num_warps": 4,
                              "fwd_USE_TMA": True}),
    ("fwd_tma+bwd_tma", {"fwd_USE_TMA": True, "bwd_USE_TMA": True}),
    ("fwd_tma+bwd_32x128_128x32", {"fwd_USE_TMA": True, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128,
                                   "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32, "bwd_num_stages": 3,
                                   "bwd_num_warps": 8}),
]

EXACT_TOL = dict(rel=2e-2, lse=0.05)


def is_exact(e: dict) -> bool:
    """The exactness verdict of a `bench.kernel_errors` dict (bf16 tolerances)."""
    rel = [e.get(k, float("nan")) for k in ("out", "dq", "dk", "dv")]
    return (all(x < EXACT_TOL["rel"] for x in rel) and e.get("lse", float("inf")) < EXACT_TOL["lse"]
            and e.get("nonfinite", 1) == 0)


def best_config(rows):
    """(name, geometric-mean fwd+bwd speedup over "default", per-Tk speedups) of the best exact config
    (default included, speedup 1), or None when default was not measured."""
    ok = {(r["config"], r["tk"]): r for r in rows if "fwdbwd_ms" in r and r.get("exact_ok")}
    base = {tk: r["fwdbwd_ms"] for (c, tk), r in ok.items() if c == "default"}
    if not base:
        return None
    best = None
    for name in dict.fromkeys(c for c, _ in ok):
        sp = {tk: base[tk] / ok[(name, tk)]["fwdbwd_ms"] for tk in base if (name, tk) in ok}
        if len(sp) < len(base):  # judge a config only where default was measured too
            continue
        g = math.exp(sum(math.log(v) for v in sp.values()) / len(sp))
        if best is None or g > best[1]:
            best = (name, g, sp)
    return best


#: why a --cpu run recommends no config (in the JSON as "no_recommendation", in the table's last line)
NO_RECOMMENDATION_CPU = ("CPU run: FlexAttention is emulated on the CPU and ignores kernel_options, so the configs "
                         "differ only by timing noise; run on a GPU to choose kernel_options")


def table(res) -> str:
    hdr = ["config", "Tk", "fwd ms", "fwd TF/s", "% dense", "fwd+bwd ms", "fwd+bwd TF/s", "% dense",
           "vs default", "max rel. err", "exact", "compile s"]
    base = {r["tk"]: r["fwdbwd_ms"] for r in res["rows"] if r["config"] == "default" and "fwdbwd_ms" in r}
    out = []
    for r in res["rows"]:
        if "fwdbwd_ms" not in r:
            what = ("ERROR " + r["error"][:90]) if "error" in r else ("SKIPPED " + r.get("skipped", ""))
            out.append([r["config"], r["tk"], what] + [""] * 9)
            continue
        e = r["exact"]
        err = max(e.get(k, float("nan")) for k in ("out", "dq", "dk", "dv"))
        vs = f"{base[r['tk']] / r['fwdbwd_ms']:.3f}x" if r["tk"] in base else "-"
        out.append([r["config"], r["tk"], f"{r['fwd_ms']:.2f}", f"{r['fwd_tflops']:.0f}",
                    bench.finite(r.get("fwd_pct_dense"), "{:.0f}%"), f"{r['fwdbwd_ms']:.2f}",
                    f"{r['fwdbwd_tflops']:.0f}", bench.finite(r.get("fwdbwd_pct_dense"), "{:.0f}%"), vs,
                    f"{err:.1e}", "yes" if r["exact_ok"] else "NO", f"{r['compile_s']:.1f}"])
    sd = [f"Tk {s['tk']}: dense SDPA fwd {s['fwd_tflops']:.0f}, fwd+bwd {s['fwdbwd_tflops']:.0f} TF/s"
          for s in res["sdpa"] if "fwd_tflops" in s]
    b = res.get("best")
    if res.get("no_recommendation"):
        best = f"best: - (no recommendation: {res['no_recommendation']})"
    else:
        best = (f"best: **{b['name']}** {json.dumps(b['options'])}, fwd+bwd {b['speedup']:.3f}x default "
                f"(geometric mean over Tk {', '.join(str(k) for k in b['per_tk'])}); to use it: "
                f"SplitKVConfig(flex=FlexOptions(kernel_options={json.dumps(b['options'])}))") if b else "best: -"
    note = (f"FlexAttention kernel_options through FlexAttentionKernel (cached mask), DFlash interval mask "
            f"{res['shapes']['n_anchors']} x {res['shapes']['B']}, Hq {res['shapes']['Hq']}, Hkv "
            f"{res['shapes']['Hkv']}, D {res['shapes']['D']}, bf16. TF/s on useful FLOPs "
            f"({res['flop_convention']}); % of dense SDPA at the same useful FLOPs ({'; '.join(sd) or '-'}). "
            f"Exact: max rel. error vs float64 < {EXACT_TOL['rel']}, lse < {EXACT_TOL['lse']}.")
    return bench.md_table(hdr, out) + "\n\n" + note + "\n\n" + best


def main(argv=None):
    from megatron_splitkv._ints import int_arg, output_dir  # strict decimal numbers within their limits

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tks", default="16384,65536", help="key counts, comma list")
    ap.add_argument("--configs", default="all",
                    help="'all', a comma list of names from CONFIGS, or a JSON object {name: options}")
    ap.add_argument("--anchors", type=int_arg(1), default=512)
    ap.add_argument("--reps", type=int_arg(1), default=10)
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no (config, Tk) after this many seconds")
    ap.add_argument("--out", type=output_dir, default=os.environ.get("OUT") or os.path.join(ROOT, "out", "tune_flex"))
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on CPU (flex emulated: options ignored)")
    args = ap.parse_args(argv)
    tks = bench.int_list_arg(ap, "--tks", args.tks, 1)
    if args.configs == "all":
        configs = list(CONFIGS)
    elif args.configs.strip().startswith("{"):
        try:
            configs = list(json.loads(args.configs).items())
        except ValueError as e:
            ap.error(f"--configs: bad JSON ({e})")
        if not configs or configs[0][0] != "default":
            configs = [("default", {})] + [c for c in configs if c[0] != "default"]
    else:
        known = dict(CONFIGS)
        names = bench.choices_arg(ap, "--configs", args.configs, list(known), "config")
        configs = [(n, known[n]) for n in names]
    for flag in ("anchors", "reps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if not args.budget_s >= 0:
        ap.error(f"--budget-s must be >= 0, got {args.budget_s}")
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    from megatron_splitkv.kernels.flex import FlexAttentionKernel

    if args.cpu:
        dev = torch.device("cpu")
        n_anchors, Hq, Hkv, D, reps, warm = min(args.anchors, 8), 4, 2, 32, min(args.reps, 2), 1
        if args.tks == ap.get_default("tks"):
            tks = [256, 512]
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --cpu")
        dev = torch.device("cuda", torch.cuda.current_device())
        n_anchors, Hq, Hkv, D, reps, warm = args.anchors, 32, 8, 128, args.reps, 2
    B, dt = 16, torch.bfloat16
    scale = D ** -0.5
    Tq = n_anchors * B
    res = dict(env=dict(torch=torch.__version__, device=str(dev),
                        gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")),
               shapes=dict(n_anchors=n_anchors, B=B, Tq=Tq, Hq=Hq, Hkv=Hkv, D=D, tks=tks),
               flop_convention=f"useful fwd = 4*pairs*Hq*D; fwd+bwd = {bench.FWD_BWD_FACTOR}x fwd",
               configs=[dict(name=n, options=o) for n, o in configs], rows=[], sdpa=[], args=vars(args))
    json_path, md_path = os.path.join(args.out, "tune_flex.json"), os.path.join(args.out, "tune_flex.md")

    if dev.type != "cuda":
        # flex runs emulated on the CPU and ignores kernel_options: the configs differ only by timing noise
        res["no_recommendation"] = NO_RECOMMENDATION_CPU

    def flush():
        b = None if res.get("no_recommendation") else best_config(res["rows"])
        res["best"] = (dict(name=b[0], options=dict(configs)[b[0]], speedup=b[1], per_tk=b[2]) if b else None)
        res["wall_s"] = time.perf_counter() - t_start
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(md_path, "w") as f:
            f.write(f"# tune_flex ({res['env']['gpu']}, {res['env']['date']})\n\n{table(res)}\n")

    print(f"[env] {json.dumps(res['env'])}", flush=True)
    stopped, poisoned = False, None
    for i, tk in enumerate(tks):
        if stopped or poisoned:
            break
        mask = bench.dflash_interval_mask(n_anchors, tk, block_size=B, seed=11 + i, device=dev)
        pairs = float(B * (mask.hi - mask.lo).sum().item())
        f_fwd = bench.fwd_flops(pairs, Hq, D)
        gen = torch.Generator(device=dev).manual_seed(100 + i)
        q = bench._rand((Tq, Hq, D), gen, dev, dt)
        k = bench._rand((tk, Hkv, D), gen, dev, dt)
        v = bench._rand((tk, Hkv, D), gen, dev, dt)
        do = bench._rand((Tq, Hq, D), gen, dev, dt)
        ref = bench.interval_attention_reference(q, k, v, mask, scale, do)
        try:
            sd = bench.dense_sdpa_rate(Tq, pairs, Hq=Hq, D=D, dtype=dt, device=dev, reps=reps, warmup=warm)
        except Exception as e:  # noqa: BLE001
            sd = dict(error=f"{type(e).__name__}: {e}")
        sd["tk"] = tk
        res["sdpa"].append(sd)
        for name, opts in configs:
            r = dict(config=name, options=opts, tk=tk, pairs=pairs)
            if poisoned:
                r["skipped"] = f"the CUDA context failed in {poisoned}"
                res["rows"].append(r)
                continue
            if args.budget_s > 0 and time.perf_counter() - t_start > args.budget_s:
                r["skipped"] = f"budget {args.budget_s:.0f}s reached"
                res["rows"].append(r)
                stopped = True
                continue
            try:
                kern = FlexAttentionKernel(kernel_options=dict(opts))
                t0 = time.perf_counter()
                r["exact"] = bench.check_kernel(kern, q, k, v, mask, scale, do, ref)  # compiles (fwd + bwd)
                bench._sync(dev)
                r["compile_s"] = time.perf_counter() - t0
                r["exact_ok"] = is_exact(r["exact"])
                r["fwd_ms"], r["fwdbwd_ms"] = bench.time_kernel_api(kern, q, k, v, mask, scale, do, dev, reps=reps,
                                                                    warmup=warm)
                r["fwd_tflops"] = f_fwd / r["fwd_ms"] / 1e9
                r["fwdbwd_tflops"] = bench.FWD_BWD_FACTOR * f_fwd / r["fwdbwd_ms"] / 1e9
                if "fwd_tflops" in sd:
                    r["fwd_pct_dense"] = 100 * r["fwd_tflops"] / sd["fwd_tflops"]
                    r["fwdbwd_pct_dense"] = 100 * r["fwdbwd_tflops"] / sd["fwdbwd_tflops"]
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result too
                r["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
                r["traceback"] = traceback.format_exc(limit=3)
                if dev.type == "cuda" and ("CUDA error" in str(e) or "illegal" in str(e).lower()
                                           or "AcceleratorError" in type(e).__name__):
                    poisoned = f"{name} at Tk {tk}"  # every later CUDA call of this process would fail
            res["rows"].append(r)
            print(f"[tune] {json.dumps({kk: vv for kk, vv in r.items() if kk != 'traceback'}, default=str)}",
                  flush=True)
            flush()
            if dev.type == "cuda" and not poisoned:
                torch.cuda.empty_cache()
        del q, k, v, do, ref, mask
    flush()
    md = table(res)
    print(md, flush=True)
    print(f"[done] {time.perf_counter() - t_start:.1f}s, {len(res['rows'])} rows -> {md_path}", flush=True)
    return res


if __name__ == "__main__":
    r = main()
    sys.exit(1 if not any("fwdbwd_ms" in x for x in r["rows"]) else 0)
