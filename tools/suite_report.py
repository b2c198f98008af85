#!/usr/bin/env python3
"""Collect and summarise the results of tools/run_gpu_suite.sh (issue 6).

  python tools/suite_report.py collect WORK OUT   # WORK/*/*.json -> OUT/suite.json; every markdown table ->
                                                  # OUT/tables.md; WORK/*/*.png -> OUT (at most 2)
  python tools/suite_report.py summary WORK [OUT] # the compact tables printed last by the suite

Reads what each step wrote (missing or partial files give a line saying so, never an exception):
kernels/gpu_check_compare*_w1.json (tools/gpu_check.py compare), tune/tune_flex.json (tools/tune_flex.py),
bench/bench_attention.json and slow/bench_attention_slow.json (tools/bench_attention.py, rows and the
chunk A/B), sim/simulate_scaling.json (tools/simulate_scaling.py), exact/gpu_check_dist*_w2.json
(tools/gpu_check.py dist), plus the optional steps' files.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys


def _load(work, pattern):
    for p in sorted(glob.glob(os.path.join(work, pattern))):
        try:
            with open(p) as f:
                return json.load(f)
        except Exception:  # noqa: BLE001 - a partial file is reported as missing
            return None
    return None


def _f(x, fmt="{:.2f}", nan="-"):
    if x is None or not isinstance(x, (int, float)) or x != x:
        return nan
    return fmt.format(x)


def collect(work, out):
    """suite.json (every step's JSON by relative path), tables.md (every .md, plus the markdown tables
    at the end of gpu_check logs), the PNGs (at most 2)."""
    merged = {}
    for p in sorted(glob.glob(os.path.join(work, "*", "*.json"))):
        try:
            with open(p) as f:
                merged[os.path.relpath(p, work)] = json.load(f)
        except Exception as e:  # noqa: BLE001
            merged[os.path.relpath(p, work)] = {"unreadable": str(e)}
    with open(os.path.join(out, "suite.json"), "w") as f:
        json.dump(merged, f, indent=1, default=str)
    parts = []
    for p in sorted(glob.glob(os.path.join(work, "*", "*.md"))):
        with open(p) as f:
            parts.append(f"<!-- {os.path.relpath(p, work)} -->\n" + f.read())
    for p in sorted(glob.glob(os.path.join(work, "*", "gpu_check_*.log"))):
        with open(p) as f:
            txt = f.read().splitlines()
        tab = [ln for ln in txt if ln.startswith("|") or ln == "" or ln.startswith("Local kernels")
               or ln.startswith("Own block") or ln.startswith("Context + own")]
        parts.append(f"<!-- {os.path.relpath(p, work)} (tables) -->\n" + "\n".join(tab))
    with open(os.path.join(out, "tables.md"), "w") as f:
        f.write("\n\n".join(parts) + "\n")
    pngs = sorted(glob.glob(os.path.join(work, "*", "*.png")))[:2]
    for p in pngs:
        shutil.copy(p, os.path.join(out, os.path.basename(p)))
    print(f"collected {len(merged)} json, {len(parts)} tables, {len(pngs)} png")


def _kernels(work):
    c = _load(work, "kernels/gpu_check_compare*_w1.json")
    if not c or "compare" not in c:
        print("kernels: no result" + (f" ({c['compare_error'].strip().splitlines()[-1]})" if c and "compare_error" in c else ""))
        return
    c = c["compare"]
    print("\n| kernel (a) | Tk | fwd ms (TF/s, % dense) | fwd+bwd ms (TF/s, % dense) | max rel. err out/dq/dk/dv (split) |")
    print("|---|---|---|---|---|")
    for sd in c.get("sdpa", []):
        if "fwd_ms" in sd:
            print(f"| dense SDPA | {sd['tk']} | {sd['fwd_ms']:.2f} ({sd['fwd_tflops']:.0f}, 100%) | "
                  f"{sd['fwdbwd_ms']:.2f} ({sd['fwdbwd_tflops']:.0f}, 100%) | |")
    for r in c.get("rows", []):
        if "unavailable" in r or "skipped" in r:
            what = f"unavailable: {r['unavailable'][:70]}" if "unavailable" in r else f"SKIPPED: {r['skipped'][:70]}"
            print(f"| {r['kernel']} | {r['tk']} | {what} | | |")
            continue
        if "fwd_ms" not in r:
            print(f"| {r['kernel']} | {r['tk']} | ERROR {r.get('error', '?')[:80]} | | |")
            continue
        e = r.get("exact", {})
        err = max(e.get(k, 0.0) for k in ("out", "dq", "dk", "dv"))
        se = r.get("split_exact") or {}
        serr = max((se.get(k, 0.0) for k in ("out", "dq", "dk", "dv")), default=0.0) if "error" not in se else None
        print(f"| {r['kernel']} | {r['tk']} | {r['fwd_ms']:.2f} ({r['fwd_tflops']:.0f}, {_f(r.get('fwd_pct_dense'), '{:.0f}%')}) | "
              f"{r['fwdbwd_ms']:.2f} ({r['fwdbwd_tflops']:.0f}, {_f(r.get('fwdbwd_pct_dense'), '{:.0f}%')}) | "
              f"{err:.1e}" + (f" ({serr:.1e})" if se and serr is not None else (" (split ERROR)" if se else "")) + " |")
    ob = c.get("own_block") or []
    parts = []
    for r in ob:
        n = r.get("name") or r["path"]
        if "fwdbwd_ms" in r:
            parts.append(f"{n} {r['fwdbwd_ms']:.3f} ms")
        elif "unavailable" in r:
            parts.append(f"{n} unavailable")
        elif "error" in r:
            parts.append(f"{n} ERROR")
    if parts:
        print(f"own block fwd+bwd ({ob[0].get('Tq', '?')} rows): " + "; ".join(parts))
    for r in c.get("fused") or []:
        if "fwdbwd_ms" in r:
            e = r.get("exact", {})
            print(f"fused ctx+own {r['kernel']} Tk={r['tk']}: {r['fwdbwd_ms']:.2f} ms fwd+bwd vs separate "
                  f"{_f(r.get('separate_fwdbwd_ms'))} ms; max err {max(e.get(k, 0.0) for k in ('out', 'dq', 'dk', 'dv')):.1e}")
        else:
            print(f"fused ctx+own {r.get('kernel', '')}: {r.get('unavailable') or r.get('error', '?')}"[:140])


def _tune(work):
    t = _load(work, "tune/tune_flex.json")
    if not t:
        print("\ntune: no result")
        return
    base = {r["tk"]: r["fwdbwd_ms"] for r in t["rows"] if r["config"] == "default" and "fwdbwd_ms" in r}
    print("\n| flex kernel_options (e) | " + " | ".join(f"Tk {tk}: fwd+bwd ms (vs default)" for tk in t["shapes"]["tks"])
          + " | exact |")
    print("|---|" + "---|" * len(t["shapes"]["tks"]) + "---|")
    names = list(dict.fromkeys(r["config"] for r in t["rows"]))
    for n in names:
        cells, ok = [], True
        for tk in t["shapes"]["tks"]:
            r = next((x for x in t["rows"] if x["config"] == n and x["tk"] == tk), None)
            if r is None:
                cells.append("-")
            elif "fwdbwd_ms" in r:
                vs = f" ({base[tk] / r['fwdbwd_ms']:.3f}x)" if tk in base else ""
                cells.append(f"{r['fwdbwd_ms']:.2f}{vs}")
                ok = ok and r.get("exact_ok", False)
            else:
                cells.append(("ERROR " + r["error"][:40]) if "error" in r else "skipped")
        print(f"| {n} | " + " | ".join(cells) + f" | {'yes' if ok else 'NO'} |")
    b = t.get("best")
    if t.get("no_recommendation"):
        print(f"tune best: - (no recommendation: {t['no_recommendation']})")
        return
    print("tune best: " + (f"{b['name']} {json.dumps(b['options'])}: {b['speedup']:.3f}x default fwd+bwd" if b else "-"))


def _bench(work, tag, pattern):
    b = _load(work, pattern)
    if not b:
        print(f"\nbench {tag}: no result")
        return
    rows = b.get("rows", [])
    print(f"\n| {tag} (b) | CP | place | method | op ms | comm/rank MB | peak GiB | kernel TF/s (% SDPA) | reps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        k = r.get("num_chunks", 1) or 1
        m = f"{r['method']} k={k}" if r["method"] == "splitkv" and k > 1 else r["method"]
        c = r.get("context") or 0
        ctx = f"{c // 1024}K" if c >= 1024 else str(c)
        if "error" in r or "skipped" in r:
            what = ("ERROR " + r["error"].strip().splitlines()[0][:60]) if "error" in r else "SKIPPED " + r["skipped"][:60]
            print(f"| {ctx} | {r['cp']} | {r.get('placement', '')} | {m} | {what} | | | | |")
            continue
        sd = r.get("sdpa_fwdbwd_tflops")
        pct = f", {100 * r['kernel_tflops'] / sd:.0f}%" if sd else ""
        print(f"| {ctx} | {r['cp']} | {r['placement']} | {m} | {r['op_ms']:.2f} | {r['comm_bytes'] / 1e6:.0f} | "
              f"{_f(r.get('peak_mem_gib'), '{:.1f}')} | {_f(r.get('kernel_tflops'), '{:.0f}')}{pct} | {r.get('reps', '')} |")
    if b.get("stopped_by_budget"):
        print(f"({tag}: rows stopped by the budget)")
    ab = b.get("ab_rows") or []
    if ab:
        print(f"\n| {tag} chunk A/B (d) | CP | ctx | num_chunks (axis) | op ms | vs first | max rel. diff | collectives | peak GiB |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in ab:
            if "error" in r or "skipped" in r:
                what = ("ERROR " + r["error"].strip().splitlines()[0][:70]) if "error" in r else "SKIPPED " + r["skipped"]
                print(f"| {r.get('link', '')} | {r['cp']} | {r.get('context', '')} | {what} | | | | | |")
                continue
            c = r["context"]
            k = f"{r['num_chunks']}" + (" heads" if r.get("chunk_axis") == "heads" else "")
            print(f"| {r['link']} | {r['cp']} | {f'{c // 1024}K' if c >= 1024 else c} | {k} | {r['op_ms']:.2f} | "
                  f"{r['ab_speedup']:.3f}x | {r['ab_rel_diff']:.1e} | {r['comm_records']} | "
                  f"{_f(r.get('peak_mem_gib'), '{:.1f}')} |")


def _simulate(work):
    s = _load(work, "sim/simulate_scaling.json")
    if not s:
        print("\nsimulate: no result")
        return
    print(f"\nsimulated weak scaling (c) ({s['link_source']}; overhead {s['overhead_ms']:.1f} ms {s['overhead_source']}; "
          f"backend {s.get('args', {}).get('backend', 'auto')}; k/v projection {s.get('kv_projection', {}).get('source', '-')})")
    if s.get("summary"):  # per topology: splitkv k=1 / best k, without / with the projection overlap; baselines

        def cell(c, with_k=False):
            if not c:
                return "-"
            src = "" if c.get("source") == "measured" else "*"
            return (f"k={c['k']}: " if with_k else "") + f"{c['T']:.1f} ({c['exposed']:.1f}) {100 * c['efficiency']:.0f}%{src}"

        for topo in s.get("topologies", []):
            print(f"| {topo}: P | splitkv k=1 | k=1 + ovl | best k | best k + ovl | allgather-kv | ring-kv | speedup |")
            print("|---|---|---|---|---|---|---|---|")
            for e in s["summary"]:
                if e["topology"] != topo:
                    continue
                sp = e.get("speedup_vs_best_baseline")
                print(f"| {e['P']} | {cell(e['k1'])} | {cell(e['k1_ovl'])} | {cell(e['best'], True)} | "
                      f"{cell(e['best_ovl'], True)} | {cell(e['allgather_kv'])} | {cell(e['ring_kv'])} | "
                      f"{'-' if sp is None else f'{sp:.1f}x'} |")
        print("cells: T ms (exposed comm ms) efficiency; * = compute modelled, not measured (budget)")
    else:
        print("| P | method | place | T(P) ms | compute | comm (exposed) | eff. | src | measured |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in s["rows"]:
            if r["placement"] not in ("-", "lpt"):  # the other placements are in tables.md
                continue
            k = r.get("num_chunks", 1)
            m = f"{r['method']} k={k}" if r["method"] == "splitkv" and (s.get("chunked_pipeline") or k != 1) else r["method"]
            meas = r.get("bench_measured_ms")
            print(f"| {r['P']} | {m} | {r['placement']} | {r['total_ms']:.1f} | {r['compute_ms']:.1f} | "
                  f"{r['comm_ms']:.1f} ({r['exposed_comm_ms']:.1f}) | {100 * r['efficiency']:.0f}% | {r['compute_source']} | "
                  f"{_f(meas, '{:.1f}')} |")
    p2 = [r for r in s["rows"] if r["P"] == 2 and "bench_measured_ms" in r and r.get("topology", "flat") == (s.get("topologies") or ["flat"])[0]]
    if p2:
        print("model check P=2: " + "; ".join(f"{r['method']} k={r.get('num_chunks', 1)} {r['placement']}: model "
                                            f"{r['total_ms']:.1f} vs measured {r['bench_measured_ms']:.1f} ms" for r in p2))
    link = s.get("link", {}).get("intra", {})
    print("link (intra, fitted or stated): " + json.dumps({k: {kk: round(vv, 1) for kk, vv in v.items()}
                                                          for k, v in link.items()}))


def _exact(work):
    g = _load(work, "exact/gpu_check_dist*_w2.json") or _load(work, "gpucheck/gpu_check_dist*_w2.json")
    if not g:
        print("\nexact: no result")
        return
    print()
    for key in sorted(k for k in g if k.startswith("op_exactness_cp")):
        for r in g[key]:
            errs = " ".join(f"{k}={r[k]:.1e}" for k in ("out", "q", "k_ctx", "v_ctx", "k_blk", "v_blk")
                            if isinstance(r.get(k), float))
            print(f"exact {key[len('op_exactness_'):]} {r['op']}: ok={r['ok']} {errs}" + (" ERROR" if "error" in r else ""))


def _stepcost(work):
    """tools/step_overhead.py (step `stepcost`): overhead against the drafter training step, per CP size: (a) the
    pieces alone, (b) fresh - reused step, (c) prefetched (plan + shard in the data pipeline's worker) - reused,
    (d) prefetched+meta (the Split-KV metadata built there too, bound in the step) - reused."""
    paths = sorted(glob.glob(os.path.join(work, "stepcost", "step_overhead_cp*.json")))
    print("\n| stepcost: context | CP | step ms (fresh) | attention ms | overhead ms (a / b / c / d) | "
          "% of step (a / b / c / d) |")
    print("|---|---|---|---|---|---|")
    for p in paths:
        d = _load(work, os.path.relpath(p, work)) or {}
        for r in d.get("rows", []):
            if "skipped" in r:
                print(f"| {r.get('context')} | {r.get('cp')} | skipped: {r['skipped']} | | | |")
                continue
            print(f"| {r['context']} | {r['cp']} | {_f(r.get('step_fresh_ms'))} | {_f(r.get('attention_ms'))} | "
                  f"{_f(r.get('overhead_pieces_ms'))} / {_f(r.get('overhead_ab_ms'))} / "
                  f"{_f(r.get('overhead_prefetched_ms'))} / {_f(r.get('overhead_prefetched_meta_ms'))} | "
                  f"{_f(r.get('pct_step_pieces'))} / {_f(r.get('pct_step_ab'))} / {_f(r.get('pct_step_prefetched'))}"
                  f" / {_f(r.get('pct_step_prefetched_meta'))} |")


def summary(work):
    for fn in (_kernels, _tune):
        fn(work)
    _bench(work, "nvlink", "bench/bench_attention.json")
    _bench(work, "socket", "slow/bench_attention_slow.json")
    if glob.glob(os.path.join(work, "nometa", "*.json")):
        _bench(work, "no-metadata", "nometa/bench_attention_nometa.json")
    _simulate(work)
    _exact(work)
    if glob.glob(os.path.join(work, "stepcost", "*.json")):
        _stepcost(work)


def main(argv):
    if len(argv) < 2 or argv[0] not in ("collect", "summary"):
        sys.exit("usage: suite_report.py collect WORK OUT | summary WORK [OUT]")
    if argv[0] == "collect":
        if len(argv) < 3:
            sys.exit("usage: suite_report.py collect WORK OUT")
        collect(argv[1], argv[2])
    else:
        summary(argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
