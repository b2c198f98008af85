#!/usr/bin/env python3
"""One-script GPU check and benchmark of the FlexAttention kernel and the Split-KV op (issue 2).

Modes (logs and JSON go to --out, default ./out/gpu_check or $OUT when set; a markdown table is printed last):

  kernel  single GPU: (1) FlexAttentionKernel exactness, bf16, forward + backward with GLOBAL lse/delta
          over a two-part key split, vs float64 autograd; (2) compiled-graph count (torch._dynamo
          counters) over 6 shapes with Tq and Tk varying inside one bucket (expect 0 new), new Tq / Tk
          buckets (1 each) and a Tk one bucket below a compiled one (0, reused); (3) throughput for 512 anchors x 16 (Lq 8192), Hq 32, Hkv 8,
          D 128 at 16K and 64K keys: useful TFLOP/s (4 * visible pairs * Hq * D forward, x2.5 fwd+bwd)
          next to dense SDPA doing the same useful FLOPs; (4) if the ops import: splitkv / allgather-kv /
          ring-kv on one GPU (CP=1): exactness vs `dflash_attention_reference` and fwd+bwd time;
          (5) the staircase kernel (kernels/staircase.py: dense cuDNN rectangles + flex remainder):
          exactness vs a float64 reference with GLOBAL lse/delta (bf16, packed sequences, with and without
          own-block intervals, rows needing the math fix-up), for its default options and fine-grained /
          key-major / 2-stream / native-GQA variants; reports the dense path that ran (`--skip stair`).
  compare single GPU, the local-kernel comparison (issue 6): for the DFlash interval mask (512 anchors x 16,
          Hq 32, Hkv 8, D 128, bf16, one sequence, 16K and 64K keys) every local kernel that loads
          (`--kernels`, default "fa4,flex,te,staircase"; a kernel that does not import gets a row saying why)
          through the kernel API with a cached mask: forward and forward + backward (backward with the
          global lse/delta, as in the op) ms, useful TF/s (4 * pairs * Hq * D forward, x3.5 forward +
          backward, tools.benchlib's convention) and % of dense SDPA at the same useful FLOPs;
          exactness vs a float64 reference (out, lse, dq, dk, dv; at the first Tk also over a two-part key
          split merged by lse, the op's global-lse path). Then the own-block part (each block's B queries x
          its own B keys): today's fp32 einsum path (ops.common.own_block_forward/backward) and its lse
          merge vs the kernels on a block-diagonal IntervalMask; and, when IntervalMask has second intervals
          (lo2/hi2), the context and own block fused into one kernel call. Then the staircase sweep
          (`--staircase-sweep`, one row per option variant: TF/s, % of dense, exactness vs float64, the
          dense path that ran, share of pairs served densely). JSON + tables are rewritten after every
          section, so a timeout keeps what finished.
  dist    under torchrun (2+ processes, NCCL; gloo with --cpu): op exactness at CP=P (bf16 vs float64,
          output + all five grads) for the three ops and for splitkv through per-step metadata (the
          training path), then the timing table: Lq 512 x 16, context 32K and
          128K total, Hq 32, Hkv 8, D 128, bf16, median fwd+bwd with CUDA events, comm bytes per
          collective (comm_stats) and peak memory.

  --cpu   tiny shapes on CPU (flex emulated, gloo): a dry run of every code path, no timings of note.

Examples (from the repository root; no PYTHONPATH needed: the script puts the repository on sys.path):
  python tools/gpu_check.py kernel
  python tools/gpu_check.py compare --out out/cmp   # flex vs te vs staircase vs dense SDPA
  python tools/gpu_check.py compare --kernels flex,staircase \
      --staircase-sweep "group_blocks=16;group_blocks=64;bwd_mode=key;streams=2"
  torchrun --nproc-per-node 2 tools/gpu_check.py dist
  python tools/gpu_check.py kernel --cpu
  torchrun --nproc-per-node 2 tools/gpu_check.py dist --cpu
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from tools.benchlib import NA_CPU, finite, gpu_cell  # noqa: E402
from megatron_splitkv._ints import int_arg, output_dir  # noqa: E402
from megatron_splitkv.kernels import flex  # noqa: E402
from megatron_splitkv.kernels.base import IntervalMask  # noqa: E402

LOG = []
LOGFILE = [None]


def log(*a, rank0=True):
    msg = " ".join(str(x) for x in a)
    if rank0 and _rank() != 0:
        return
    print(msg, flush=True)
    LOG.append(msg)
    if LOGFILE[0]:
        with open(LOGFILE[0], "a") as f:
            f.write(msg + "\n")


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bench(fn, dev, reps=10, warmup=3):
    """Median and min milliseconds of fn() (tools.benchlib.time_fn: CUDA events on GPU)."""
    from tools.benchlib import time_fn

    med, mn, _ = time_fn(fn, dev, reps=reps, warmup=warmup)
    return med, mn


def dflash_intervals(n_anchors, num_keys, gen, device):
    """One sequence of num_keys context tokens; anchors uniform without replacement in [1, num_keys]."""
    a = torch.randperm(num_keys, generator=gen)[:n_anchors] + 1
    a = torch.sort(a).values
    return torch.zeros_like(a).to(device), a.to(device)


# ------------------------------------------------------------------------------------- kernel mode
def kernel_exactness(dev, cpu, res):
    import test_gpu_kernels as tgk

    shapes = dict(B=16, n_blocks=8, Hq=4, Hkv=2, D=32, key_parts=(200, 300)) if cpu else dict(
        B=16, n_blocks=64, Hq=32, Hkv=8, D=128, key_parts=(3000, 3050))
    rows = []
    for dtype in (torch.bfloat16,):
        for seed in (0, 1):
            r = tgk.check_split_exactness(dev.type, dtype, compile=None if cpu else True, seed=seed,
                                          ref_device=dev.type, **shapes)
            rows.append(dict(dtype=str(dtype), seed=seed, **r))
            log(f"[exact] flex {dtype} seed={seed} {shapes}: " + " ".join(f"{k}={v:.2e}" for k, v in r.items()))
    res["kernel_exactness"] = rows
    worst = {k: max(r[k] for r in rows) for k in ("out", "dq", "dk", "dv", "lse")}
    res["kernel_exactness_ok"] = all(worst[k] < 2e-2 for k in ("out", "dq", "dk", "dv")) and worst["lse"] < 0.05
    return worst


#: staircase options for the exactness checks: small rectangles, so these small shapes make many dense calls
STAIR_FINE = dict(group_blocks=8, min_group_blocks=2, key_grain=128, min_keys=128, min_pairs=0)
#: the CPU dry run of the compare sweep (8 anchors, 256-512 keys): tiny rectangles so dense calls happen
STAIR_CPU = dict(group_blocks=2, min_group_blocks=1, key_grain=16, min_keys=16, min_pairs=0)
#: (name, options) checked by `staircase_exactness`; native GQA last (a rejected call could break the context)
STAIR_EXACT_VARIANTS = [
    ("default", {}),
    ("fine", STAIR_FINE),
    ("fine key-major", dict(STAIR_FINE, bwd_mode="key")),
    ("fine kv copy", dict(STAIR_FINE, kv_layout="copy")),
    ("fine streams=2", dict(STAIR_FINE, streams=2)),
    ("fine native-gqa", dict(STAIR_FINE, gqa="native")),
]


def _reference_by_kv_head(reference, q, k, v, mask, scale, dout, lse_g, delta):
    """`reference` (dense float64, [Hq, Tq, Tk] scores) one kv head (and its G query heads) at a time:
    heads are independent, so memory drops Hkv-fold. Returns (out, lse, dq, dk, dv) over all heads."""
    hkv = k.shape[1]
    g = q.shape[1] // hkv
    parts = []
    for h in range(hkv):
        qs = slice(h * g, (h + 1) * g)
        parts.append(reference(q[:, qs].double(), k[:, h:h + 1].double(), v[:, h:h + 1].double(), mask, scale,
                               dout[:, qs].double(), lse_g[:, qs], delta[:, qs]))
    return tuple(torch.cat([p[i] for p in parts], 1) for i in range(5))


def staircase_exactness(dev, cpu, res):
    """Staircase kernel vs a float64 reference of the contract (tests/test_staircase_kernel.py's helpers, on
    the device): bf16 forward, backward with a GLOBAL lse/delta (other ranks' keys simulated), packed
    sequences (blocks of 3 sequences, some empty), with and without own-block second intervals, and two
    entries per call whose dO is zero with a nonzero delta (the math fix-up). One row per variant x own;
    each row says which dense path ran (cuDNN / CPU flash, GQA fold or native, K/V views or copies, the
    backward's rectangle set) and how many dense calls it made."""
    import test_staircase_kernel as tsk

    from megatron_splitkv.kernels.staircase import StaircaseAttentionKernel

    if cpu:  # dry run: tiny rectangles under every variant so that dense calls happen
        B, nb, Hq, Hkv, D, lens = 16, 24, 4, 2, 32, [300, 70, 130]
    else:  # one long sequence (~64 blocks): the default policy makes dense calls too (32-block groups)
        B, nb, Hq, Hkv, D, lens = 16, 192, 32, 8, 128, [10000, 500, 500]
    scale = D ** -0.5
    rows, broken = [], None
    for name, opts in STAIR_EXACT_VARIANTS:
        for own in (False, True):
            r = dict(variant=name, own=own, options=opts)
            if broken:
                r["skipped"] = f"CUDA context broken by {broken}"
                rows.append(r)
                continue
            try:
                gen = torch.Generator().manual_seed(17 + own)
                m = tsk.dflash_mask(gen, nb, B, lens, p_empty=0.1, own=own, align=128)
                q, k, v, do = tsk.make_inputs(gen, m, Hq, Hkv, D, torch.bfloat16, poison=False)
                md = IntervalMask(B, m.lo.to(dev), m.hi.to(dev), m.num_keys,
                                  m.lo2.to(dev) if own else None, m.hi2.to(dev) if own else None,
                                  num_ctx_keys=m.num_ctx_keys)
                qd, kd, vd = q.to(dev), k.to(dev), v.to(dev)
                kern = StaircaseAttentionKernel(**(dict(opts, **STAIR_CPU) if cpu else opts))
                t0 = time.perf_counter()
                out, lse, st = kern.forward(qd, kd, vd, md, scale)
                lse_g, delta = tsk.global_stats(gen, lse.cpu(), do, out.cpu())
                plan = kern.plan(md)
                if plan.groups:  # two entries of a dense block: dO = 0, delta != 0 (a gradient through lse)
                    row0 = int(plan.blocks[0]) * B
                    do[row0, 0] = 0
                    do[row0 + 1] = 0
                    delta[row0, 0], delta[row0 + 1] = 0.5, -0.25
                grads = kern.backward(qd, kd, vd, md, scale, do.to(dev), lse_g.float().to(dev), delta.float().to(dev),
                                      st)
                sync(dev)
                r["first_call_s"] = time.perf_counter() - t0
                ref = _reference_by_kv_head(tsk.reference, qd, kd, vd, md, scale, do.to(dev), lse_g.to(dev),
                                            delta.to(dev))
                fin = torch.isfinite(ref[1])
                r["lse_pattern_ok"] = bool(torch.equal(torch.isfinite(lse), fin))
                r["lse"] = float((lse.double()[fin] - ref[1][fin]).abs().max()) if bool(fin.any()) else 0.0
                for key, a, b in zip(("out", "dq", "dk", "dv"), (out,) + tuple(grads), (ref[0],) + tuple(ref[2:])):
                    r[key] = tsk.rel(a, b)
                r["nonfinite"] = int(sum(int((~torch.isfinite(t)).sum()) for t in (out,) + tuple(grads)))
                r["paths"] = dict(kern.paths)
                r["counts"] = dict(kern.counts)
                r["dense_fraction"] = plan.dense_fraction
                r["ok"] = (r["lse_pattern_ok"] and r["nonfinite"] == 0 and r["lse"] < 0.05
                           and all(r[x] < 2e-2 for x in ("out", "dq", "dk", "dv")))
                del out, lse, st, grads, ref, qd, kd, vd
            except Exception as e:  # noqa: BLE001
                broken = _row_failed(r, e, dev, f"staircase {name}", traceback_limit=6) or broken
                r["ok"] = False
            rows.append(r)
            log(f"[stair-exact] {json.dumps({kk: vv for kk, vv in r.items() if kk != 'traceback'}, default=str)}")
    res["staircase_exactness"] = rows
    res["staircase_exactness_ok"] = all(r.get("ok") for r in rows if "skipped" not in r)
    return rows


def compile_counts(dev, cpu, res):
    """Compiled-graph counts (torch._dynamo counters) over a sequence of varying (Tq, Tk), fwd + bwd.

    1 shape to start, then 6 more with Tq AND Tk varying inside the same (Tq bucket, Tk bucket) (expect 0
    new graphs), a new query bucket and a new key bucket (1 new graph each), and keys one bucket below a
    compiled one (expect 0: `reuse_larger_kv_bucket`). Each step builds a fresh IntervalMask (fresh
    BlockMask and mask_mod closure), as the op does per training step. Times include the compiles.
    """
    import torch._dynamo.utils as du

    kern = flex.FlexAttentionKernel()
    gen = torch.Generator().manual_seed(7)
    B = 16
    if cpu:
        Hq, Hkv, D = 2, 1, 16
        first, same = (50, 1100), [(64, 1536), (49, 1030), (55, 1400), (60, 1250), (52, 1500), (58, 1111)]
        new_q, new_k, reuse = (70, 1200), (50, 1600), (55, 1000)
    else:
        Hq, Hkv, D = 32, 8, 128
        # Tq bucket 8192 (6145..8192 rows), Tk bucket 16384 (12289..16384 keys)
        first, same = (512, 15000), [(400, 16384), (450, 13000), (390, 15500), (480, 12500), (505, 16000),
                                     (420, 14000)]
        new_q, new_k, reuse = (600, 15000), (512, 60000), (512, 12000)

    def step(nb, tk):
        q = torch.randn(nb * B, Hq, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(tk, Hkv, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(tk, Hkv, D, device=dev, dtype=torch.bfloat16)
        lo, hi = dflash_intervals(nb, tk, gen, dev)
        m = IntervalMask(B, lo, hi, tk)
        o, l, st = kern.forward(q, k, v, m, D ** -0.5)
        kern.backward(q, k, v, m, D ** -0.5, torch.randn_like(q), l, (o * o).sum(-1), st)
        sync(dev)

    def graphs():
        return du.counters["stats"]["unique_graphs"]

    def phase(shapes):
        t0, g0 = time.perf_counter(), graphs()
        for nb, tk in shapes:
            step(nb, tk)
        return graphs() - g0, time.perf_counter() - t0

    def buckets(shapes):
        return [flex.padded_lengths(nb * B, tk, kern.q_bucket_steps, kern.bucket_steps) for nb, tk in shapes]

    out = dict(first=[first], same=same, new_q=[new_q], new_k=[new_k], reuse=[reuse],
               buckets={name: buckets(sh) for name, sh in (("first", [first]), ("same", same), ("new_q", [new_q]),
                                                           ("new_k", [new_k]), ("reuse", [reuse]))},
               q_bucket_steps=kern.q_bucket_steps, kv_bucket_steps=kern.bucket_steps,
               reuse_larger_kv_bucket=kern.reuse_larger_kv_bucket)
    out["first_graphs"], out["first_s"] = phase([first])
    out["same_bucket_new_graphs"], out["same_bucket_s"] = phase(same)
    out["new_q_bucket_graphs"], out["new_q_bucket_s"] = phase([new_q])
    out["new_k_bucket_graphs"], out["new_k_bucket_s"] = phase([new_k])
    out["reuse_graphs"], out["reuse_s"] = phase([reuse])
    out["again_graphs"], out["again_s"] = phase(same[:2] + [new_q, new_k, reuse])
    if not cpu:
        out["ok"] = (out["same_bucket_new_graphs"] == 0 and out["reuse_graphs"] == 0 and out["again_graphs"] == 0
                     and out["new_q_bucket_graphs"] <= 1 and out["new_k_bucket_graphs"] <= 1)
    res["compile"] = out
    log(f"[compile] {out}")
    return out


def throughput(dev, cpu, res):
    import torch.nn.functional as F

    kern = flex.FlexAttentionKernel()
    gen = torch.Generator().manual_seed(11)
    if cpu:
        n_anchors, Hq, Hkv, D, tks, reps = 8, 4, 2, 32, (512,), 2
    else:
        n_anchors, Hq, Hkv, D, tks, reps = 512, 32, 8, 128, (16384, 65536), 10
    B = 16
    Tq = n_anchors * B
    dt = torch.bfloat16
    scale = D ** -0.5
    rows = []
    for tk in tks:
        lo, hi = dflash_intervals(n_anchors, tk, gen, dev)
        m = IntervalMask(B, lo, hi, tk)
        pairs = float(((hi - lo).sum() * B).item())
        f_fwd = 4 * pairs * Hq * D
        q = torch.randn(Tq, Hq, D, device=dev, dtype=dt)
        k = torch.randn(tk, Hkv, D, device=dev, dtype=dt)
        v = torch.randn(tk, Hkv, D, device=dev, dtype=dt)
        do = torch.randn(Tq, Hq, D, device=dev, dtype=dt)
        r = dict(tk=tk, Tq=Tq, pairs=pairs, density=pairs / (Tq * tk))
        # block mask construction alone
        tqp, tkp = flex.padded_lengths(Tq, tk)
        r["mask_ms"], _ = bench(lambda: flex.build_block_mask(m, tqp, tkp), dev, reps)
        bm = flex.build_block_mask(m, tqp, tkp)
        r["partial_tiles"] = int(bm.kv_num_blocks.sum())
        r["full_tiles"] = int(bm.full_kv_num_blocks.sum())
        # kernel API (includes padding copies, fp32 upcasts; "fresh": a new IntervalMask per call, so the
        # BlockMask is rebuilt as in the op today; "cached": the same mask object, BlockMask reused)
        def fresh():
            return IntervalMask(B, lo, hi, tk)

        o, l, st = kern.forward(q, k, v, fresh(), scale)
        delta = (do.float() * o).sum(-1)
        del st

        def fwdbwd(mk):
            mm_ = mk()
            o_, l_, st_ = kern.forward(q, k, v, mm_, scale)
            kern.backward(q, k, v, mm_, scale, do, l_, delta, st_)

        kern_nograd = flex.FlexAttentionKernel(save_graph=False)
        kern_nograd.forward(q, k, v, m, scale)
        r["kernel_fwd_ms"], _ = bench(lambda: kern_nograd.forward(q, k, v, fresh(), scale), dev, reps)
        r["kernel_fwd_cached_ms"], _ = bench(lambda: kern_nograd.forward(q, k, v, m, scale), dev, reps)
        r["kernel_fwdbwd_ms"], _ = bench(lambda: fwdbwd(fresh), dev, reps)
        r["kernel_fwdbwd_cached_ms"], _ = bench(lambda: fwdbwd(lambda: m), dev, reps)
        # raw compiled flex on pre-padded inputs with a pre-built mask
        if True:
            fn = flex.compiled_flex_attention() if not cpu else flex.dense_flex_emulation
            qh = torch.randn(1, Hq, tqp, D, device=dev, dtype=dt, requires_grad=True)
            kh = torch.randn(1, Hkv, tkp, D, device=dev, dtype=dt, requires_grad=True)
            vh = torch.randn(1, Hkv, tkp, D, device=dev, dtype=dt, requires_grad=True)
            go = torch.randn(1, Hq, tqp, D, device=dev, dtype=dt)

            def raw_fwd(ko=None):
                with torch.no_grad():
                    fn(qh, kh, vh, block_mask=bm, scale=scale, enable_gqa=True,
                       return_aux=flex.AuxRequest(lse=True), kernel_options=ko)

            def raw_fwdbwd(ko=None):
                out, aux = fn(qh, kh, vh, block_mask=bm, scale=scale, enable_gqa=True,
                              return_aux=flex.AuxRequest(lse=True), kernel_options=ko)
                torch.autograd.grad((out, aux.lse), (qh, kh, vh), (go, torch.zeros_like(aux.lse)))

            r["raw_fwd_ms"], _ = bench(raw_fwd, dev, reps)
            r["raw_fwdbwd_ms"], _ = bench(raw_fwdbwd, dev, reps)
            r["variants"] = []
            for vname, ko in VARIANTS:
                vr = dict(name=vname, options=ko)
                try:
                    t0 = time.perf_counter()
                    raw_fwdbwd(ko)
                    sync(dev)
                    vr["compile_s"] = time.perf_counter() - t0
                    vr["fwd_ms"], _ = bench(lambda: raw_fwd(ko), dev, reps)
                    vr["fwdbwd_ms"], _ = bench(lambda: raw_fwdbwd(ko), dev, reps)
                    vr["bwd_ms"] = vr["fwdbwd_ms"] - vr["fwd_ms"]
                    vr["fwd_tflops"] = f_fwd / vr["fwd_ms"] / 1e9
                    vr["fwdbwd_tflops"] = 2.5 * f_fwd / vr["fwdbwd_ms"] / 1e9
                except Exception as e:  # noqa: BLE001
                    vr["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                r["variants"].append(vr)
                log(f"[variant] tk={tk} {json.dumps(vr)}")
            # dense SDPA, same useful FLOPs: Lq x Lk_dense with Lk_dense = pairs / Lq (MHA, K/V expanded)
            lk = max(128, int(round(pairs / Tq / 128)) * 128)
            qd = torch.randn(1, Hq, Tq, D, device=dev, dtype=dt, requires_grad=True)
            kd = torch.randn(1, Hq, lk, D, device=dev, dtype=dt, requires_grad=True)
            vd = torch.randn(1, Hq, lk, D, device=dev, dtype=dt, requires_grad=True)
            god = torch.randn(1, Hq, Tq, D, device=dev, dtype=dt)
            fd = 4.0 * Tq * lk * Hq * D

            def sdpa_fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(qd, kd, vd, scale=scale)

            def sdpa_fwdbwd():
                out = F.scaled_dot_product_attention(qd, kd, vd, scale=scale)
                torch.autograd.grad(out, (qd, kd, vd), god)

            r["sdpa_lk"] = lk
            r["sdpa_fwd_ms"], _ = bench(sdpa_fwd, dev, reps)
            r["sdpa_fwdbwd_ms"], _ = bench(sdpa_fwdbwd, dev, reps)
            r["sdpa_fwd_tflops"] = fd / r["sdpa_fwd_ms"] / 1e9
            r["sdpa_fwdbwd_tflops"] = 2.5 * fd / r["sdpa_fwdbwd_ms"] / 1e9
            r["raw_fwd_tflops"] = f_fwd / r["raw_fwd_ms"] / 1e9
            r["raw_fwdbwd_tflops"] = 2.5 * f_fwd / r["raw_fwdbwd_ms"] / 1e9
        for key in ("kernel_fwd", "kernel_fwd_cached"):
            r[key + "_tflops"] = f_fwd / r[key + "_ms"] / 1e9
        for key in ("kernel_fwdbwd", "kernel_fwdbwd_cached"):
            r[key + "_tflops"] = 2.5 * f_fwd / r[key + "_ms"] / 1e9
        rows.append(r)
        log(f"[tput] {json.dumps(r)}")
        del q, k, v, do, o
    res["throughput"] = rows
    return rows


def _make_problem(gen, n_seqs, ctx_per_seq, anchors_per_seq, B, Hq, Hkv, D, dtype, p_invalid=0.05):
    """Global DFlash problem on CPU: context tokens of n_seqs sequences (shuffled), blocks with anchors."""
    kv_seq = torch.arange(n_seqs).repeat_interleave(ctx_per_seq)
    kv_pos = torch.arange(ctx_per_seq).repeat(n_seqs)
    q_seq, q_anchor = [], []
    for s in range(n_seqs):
        a = torch.sort(torch.randperm(ctx_per_seq, generator=gen)[:anchors_per_seq]).values
        q_seq.append(torch.full((anchors_per_seq,), s))
        q_anchor.append(a)
    q_seq, q_anchor = torch.cat(q_seq), torch.cat(q_anchor)
    inval = torch.rand(q_anchor.shape, generator=gen) < p_invalid
    q_anchor = torch.where(inval, torch.full_like(q_anchor, -1), q_anchor)
    nb, tk = q_seq.shape[0], kv_seq.shape[0]
    t = dict(q=torch.randn(nb * B, Hq, D, generator=gen), k_ctx=torch.randn(tk, Hkv, D, generator=gen),
             v_ctx=torch.randn(tk, Hkv, D, generator=gen), k_blk=torch.randn(nb * B, Hkv, D, generator=gen),
             v_blk=torch.randn(nb * B, Hkv, D, generator=gen))
    t = {k: v.to(dtype) for k, v in t.items()}
    meta = dict(q_seq=q_seq, q_anchor=q_anchor, kv_seq=kv_seq, kv_pos=kv_pos)
    return t, meta


def _shard(t, meta, B, rank, world, chunk, gen_seed):
    """Rank's queries (contiguous equal block slices) and context (chunks dealt by a seeded permutation)."""
    nb = meta["q_seq"].shape[0]
    per = -(-nb // world)
    b0, b1 = min(rank * per, nb), min((rank + 1) * per, nb)
    tk = meta["kv_seq"].shape[0]
    n_chunks = -(-tk // chunk)
    perm = torch.randperm(n_chunks, generator=torch.Generator().manual_seed(gen_seed))
    mine = perm[rank::world]
    idx = torch.cat([torch.arange(c * chunk, min((c + 1) * chunk, tk)) for c in mine.tolist()]) if len(mine) \
        else torch.zeros(0, dtype=torch.long)
    loc = dict(q=t["q"][b0 * B:b1 * B], k_blk=t["k_blk"][b0 * B:b1 * B], v_blk=t["v_blk"][b0 * B:b1 * B],
               k_ctx=t["k_ctx"][idx], v_ctx=t["v_ctx"][idx])
    lmeta = dict(q_seq=meta["q_seq"][b0:b1], q_anchor=meta["q_anchor"][b0:b1], kv_seq=meta["kv_seq"][idx],
                 kv_pos=meta["kv_pos"][idx])
    return loc, lmeta, (b0, b1), idx


def _ops():
    import megatron_splitkv as msk

    ops = {}
    for name, attr in (("splitkv", "splitkv_attention"), ("allgather-kv", "allgather_kv_attention"),
                       ("ring-kv", "ring_kv_attention")):
        fn = getattr(msk, attr, None)
        if fn is None:
            try:
                import importlib

                mod = importlib.import_module("megatron_splitkv.ops")
                fn = getattr(mod, attr, None)
            except Exception:  # noqa: BLE001
                fn = None
        if fn is not None:
            ops[name] = fn
    return ops


# FlexAttention kernel_options variants timed on the raw kernel (flex's sm90 defaults: fwd BLOCK_M/N 128/64,
# 3 stages, 8 warps; bwd BLOCK_M1/N1/N2/M2 64/128/128/64, 3 stages, 8 warps)
VARIANTS = [
    ("fwd_tma", {"fwd_USE_TMA": True}),
    ("fwd_n128_s2", {"fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8}),
    ("fwd_s4", {"fwd_num_stages": 4}),
    ("bwd_64x64_s3_w4", {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_N2": 64, "bwd_BLOCK_M2": 64,
                         "bwd_num_stages": 3, "bwd_num_warps": 4}),
    ("bwd_s2", {"bwd_num_stages": 2}),
    ("bwd_s4", {"bwd_num_stages": 4}),
]

GRAD_NAMES = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")


def op_exactness(dev, cpu, world, rank, group, res, backend, config=None):
    """Each op at CP=world vs float64 reference: out and the five grads (errors gathered to rank 0). `config`: the
    ops' SplitKVConfig (--chunk-axis / --num-chunks; None: the defaults)."""
    import torch.distributed as dist

    from megatron_splitkv.reference import dflash_attention_reference

    ops = _ops()
    if not ops:
        log("[op-exact] ops not importable: skipped")
        return None
    B = 16
    if cpu:
        shp = dict(n_seqs=2, ctx_per_seq=300, anchors_per_seq=8, Hq=4, Hkv=2, D=16)
        chunk = 64
    else:
        shp = dict(n_seqs=3, ctx_per_seq=3000, anchors_per_seq=20 * world, Hq=32, Hkv=8, D=128)
        chunk = 512
    gen = torch.Generator().manual_seed(1234)
    t, meta = _make_problem(gen, B=B, dtype=torch.bfloat16, **shp)
    dout = torch.randn(t["q"].shape, generator=gen)
    # float64 reference (global), on the device
    rt = {k: v.to(dev).double().requires_grad_() for k, v in t.items()}
    rm = {k: v.to(dev) for k, v in meta.items()}
    ref_out, _ = dflash_attention_reference(rt["q"], rt["k_ctx"], rt["v_ctx"], rt["k_blk"], rt["v_blk"],
                                            rm["q_seq"], rm["q_anchor"], rm["kv_seq"], rm["kv_pos"],
                                            block_size=B)
    ref_out.backward(dout.to(dev).double())
    ref_grads = {k: rt[k].grad for k in GRAD_NAMES}
    loc, lmeta, (b0, b1), idx = _shard(t, meta, B, rank, world, chunk, 99)
    idx = idx.to(dev)
    rows = []
    # splitkv also through per-step metadata (prepare_splitkv_metadata, then metadata=): the training path
    runs = [(name, fn, False) for name, fn in ops.items()]
    if "splitkv" in ops:
        runs.insert(1, ("splitkv (metadata)", ops["splitkv"], True))
    for name, fn, with_meta in runs:
        x = {k: v.detach().to(dev).clone().requires_grad_() for k, v in loc.items()}
        mm = {k: v.to(dev) for k, v in lmeta.items()}
        err = {}
        try:
            if with_meta:
                from megatron_splitkv.ops import prepare_splitkv_metadata

                pm = prepare_splitkv_metadata(mm["q_seq"], mm["q_anchor"], mm["kv_seq"], mm["kv_pos"], block_size=B,
                                              num_heads_q=shp["Hq"], num_heads_kv=shp["Hkv"], head_dim=shp["D"],
                                              dtype=x["q"].dtype, cp_group=group, impl="splitkv", device=dev,
                                              config=config)
                out = fn(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], None, None, None, None,
                         metadata=pm, backend=backend)
            else:
                out = fn(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], mm["q_seq"], mm["q_anchor"],
                         mm["kv_seq"], mm["kv_pos"], block_size=B, cp_group=group, backend=backend,
                         **({"config": config} if name == "splitkv" else {}))
            out.backward(dout[b0 * B:b1 * B].to(dev, out.dtype))
            # squared-error sums, reduced over ranks -> global relative errors
            pieces = {"out": (out.detach(), ref_out.detach()[b0 * B:b1 * B]), "q": (x["q"].grad, ref_grads["q"][b0 * B:b1 * B]),
                      "k_blk": (x["k_blk"].grad, ref_grads["k_blk"][b0 * B:b1 * B]),
                      "v_blk": (x["v_blk"].grad, ref_grads["v_blk"][b0 * B:b1 * B]),
                      "k_ctx": (x["k_ctx"].grad, ref_grads["k_ctx"][idx]),
                      "v_ctx": (x["v_ctx"].grad, ref_grads["v_ctx"][idx])}
            sums = []
            nan = 0.0
            for key in ("out",) + GRAD_NAMES:
                a, b = pieces[key]
                a = torch.zeros_like(b) if a is None else a.detach().double()
                nan += float((~torch.isfinite(a)).sum())
                sums += [float(((a - b) ** 2).sum()), float((b ** 2).sum())]
            vec = torch.tensor(sums + [nan], dtype=torch.float64, device=dev if not cpu else "cpu")
            if world > 1:
                dist.all_reduce(vec, group=group)
            vec = vec.cpu().tolist()
            for i, key in enumerate(("out",) + GRAD_NAMES):
                err[key] = math.sqrt(vec[2 * i] / max(vec[2 * i + 1], 1e-300))
            err["nonfinite"] = vec[-1]
            ok = all(err[k] < 2e-2 for k in ("out",) + GRAD_NAMES) and err["nonfinite"] == 0
        except Exception:  # noqa: BLE001
            err = {"error": traceback.format_exc(limit=4)}
            ok = False
        rows.append(dict(op=name, cp=world, ok=ok, **err))
        log(f"[op-exact] {name} CP={world}: ok={ok} " + " ".join(
            f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in err.items()))
    res[f"op_exactness_cp{world}"] = rows
    return rows


def op_timing(dev, cpu, world, rank, group, res, backend, contexts, reps=None, n_anchors=None):
    """fwd+bwd median per op at CP=world: Lq = 512 x 16 (global), one sequence per context size."""
    from megatron_splitkv.comm import comm_stats

    ops = _ops()
    if not ops:
        return None
    B = 16
    if cpu:
        na, Hq, Hkv, D, nrep, chunk = 16, 4, 2, 16, 2, 64
    else:
        na, Hq, Hkv, D, nrep, chunk = 512, 32, 8, 128, 10, 2048
    n_anchors = n_anchors or na
    reps = reps or nrep
    rows = []
    for ctx in contexts:
        gen = torch.Generator().manual_seed(ctx)
        t, meta = _make_problem(gen, n_seqs=1, ctx_per_seq=ctx, anchors_per_seq=n_anchors, B=B, Hq=Hq, Hkv=Hkv,
                                D=D, dtype=torch.bfloat16, p_invalid=0.0)
        loc, lmeta, (b0, b1), idx = _shard(t, meta, B, rank, world, chunk, 7)
        x = {k: v.detach().to(dev).clone().requires_grad_() for k, v in loc.items()}
        mm = {k: v.to(dev) for k, v in lmeta.items()}
        dout = torch.randn(x["q"].shape, device=dev, dtype=torch.bfloat16)
        pairs = float(((meta["q_anchor"].clamp(min=0)).sum() * B).item())
        for name, fn in ops.items():
            def step():
                for v in x.values():
                    v.grad = None
                out = fn(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], mm["q_seq"], mm["q_anchor"],
                         mm["kv_seq"], mm["kv_pos"], block_size=B, cp_group=group, backend=backend)
                out.backward(dout)

            r = dict(op=name, cp=world, ctx=ctx, Lq=n_anchors * B)
            try:
                step()
                sync(dev)
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                    base = torch.cuda.memory_allocated(dev)
                with comm_stats() as st:
                    step()
                sync(dev)
                if dev.type == "cuda":
                    r["peak_mem_gib"] = (torch.cuda.max_memory_allocated(dev) - base) / 2 ** 30
                r["bytes"] = dict(st.bytes_by_collective)
                r["total_mb"] = st.total_bytes / 1e6
                med, mn = bench(step, dev, reps, warmup=2)
                tt = torch.tensor([med], dtype=torch.float64, device=dev)
                if world > 1:
                    import torch.distributed as dist

                    dist.all_reduce(tt, op=dist.ReduceOp.MAX, group=group)
                r["fwdbwd_ms"] = float(tt.item())
                r["useful_tflops_per_gpu"] = 2.5 * 4 * pairs * Hq * D / r["fwdbwd_ms"] / 1e9 / world
            except Exception:  # noqa: BLE001
                r["error"] = traceback.format_exc(limit=4)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(r)
            log(f"[op-time] {json.dumps(r)}")
        del x, t
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    res[f"op_timing_cp{world}"] = rows
    return rows



# ------------------------------------------------------------------------------------- compare mode
def _load_kernel(name, dev, dtype, D, te_emulator=False):
    """(kernel instance, None) or (None, reason) for backend `name`; never raises."""
    from megatron_splitkv.kernels import get_kernel

    try:
        if name == "te" and te_emulator:  # CPU tests: TE's fused attention emulated (tests/te_emulator.py)
            import te_emulator as tem

            from megatron_splitkv.kernels.te import TEAttentionKernel

            return TEAttentionKernel(fused_attn=tem.EmulatedFusedAttn()), None
        return get_kernel(name, dev, dtype, head_dim=D), None
    except Exception as e:  # noqa: BLE001 - ImportError (TE missing) and anything else: report, go on
        msg = " ".join(str(e).split())
        if "import failed:" in msg:  # get_kernel's install hint first, the cause last: keep the cause
            msg = "import failed: " + msg.split("import failed:", 1)[1].strip()
        return None, f"{type(e).__name__}: {msg[:200]}"


def _exact(o, l, grads, ref):
    from tools import benchlib as mb

    return mb.kernel_errors(o, l, grads, ref)


def _split_exactness(kern, q, k, v, mask, scale, do, ref):
    """The op's global-lse path: keys in two halves, a forward per half, lse merge, then each half's
    backward with the GLOBAL lse and delta; errors of the merged out/lse and the summed/concatenated
    gradients vs the float64 reference of the whole."""
    from megatron_splitkv.kernels.base import IntervalMask

    tk = k.shape[0]
    cuts = [(0, tk // 2), (tk // 2, tk)]
    outs, lses, sts, masks = [], [], [], []
    for a, b in cuts:
        n = b - a
        lo = (mask.lo - a).clamp(0, n)
        hi = torch.maximum((mask.hi - a).clamp(0, n), lo)
        m = IntervalMask(mask.block_size, lo, hi, n)
        o, l, st = kern.forward(q, k[a:b].contiguous(), v[a:b].contiguous(), m, scale)
        outs.append(o), lses.append(l), sts.append(st), masks.append(m)
    lse = torch.logsumexp(torch.stack(lses), 0)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = sum(torch.exp(l - safe)[..., None] * o for o, l in zip(outs, lses))
    delta = (do.float() * out).sum(-1)
    dq, dks, dvs = 0, [], []
    for (a, b), m, st in zip(cuts, masks, sts):
        g = kern.backward(q, k[a:b].contiguous(), v[a:b].contiguous(), m, scale, do, lse, delta, st)
        dq = dq + g[0]
        dks.append(g[1]), dvs.append(g[2])
    return _exact(out, lse, (dq, torch.cat(dks), torch.cat(dvs)), ref)


def _time_kernel(kern, q, k, v, mask, scale, do, dev, reps, warmup):
    from tools import benchlib as mb

    return mb.time_kernel_api(kern, q, k, v, mask, scale, do, dev, reps=reps, warmup=warmup)


def _err_str(e):
    return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''}"


def _cuda_broken(e) -> bool:
    """True for errors after which every later CUDA call of the process fails (a sticky context error)."""
    msg = f"{type(e).__name__}: {e}"
    return "CUDA error" in msg or "illegal memory" in msg.lower() or "AcceleratorError" in msg


def _row_failed(r: dict, e, dev, label: str, traceback_limit=None):
    """Record a row's failure in r["error"] (and, with `traceback_limit`, the current exception's last
    frames in r["traceback"] first); returns `label` when the CUDA context is now broken (later GPU rows
    must be skipped), else None."""
    if traceback_limit is not None:
        r["traceback"] = traceback.format_exc(limit=traceback_limit)
    r["error"] = _err_str(e)
    return label if dev.type == "cuda" and _cuda_broken(e) else None


def kernel_compare(dev, cpu, res, args, flush):
    """The compare mode (module docstring). Fills res["compare"]; calls flush() after every section.

    Order: dense SDPA and the einsum own block first, then kernel by kernel (flex, then te): its rows at
    every Tk, its block-diagonal own block, its fused context + own block call. So a kernel that breaks the
    CUDA context (rows say so; the later ones are skipped) cannot take the earlier kernels' rows with it.
    Inputs are seeded per Tk: every kernel sees the same tensors; float64 references are kept per Tk."""
    from tools import benchlib as mb
    from megatron_splitkv.lse import merge

    try:  # the op's separate own-block pass (trees before the fused own block)
        from megatron_splitkv.ops.common import own_block_backward, own_block_forward
        einsum_src = "ops.common"
    except ImportError:  # fused trees: the pre-fusion implementation, kept here for the comparison
        own_block_forward, own_block_backward = _einsum_own_block_forward, _einsum_own_block_backward
        einsum_src = "pre-fusion ops.common, copied in gpu_check"

    B = 16
    if cpu:
        n_anchors, Hq, Hkv, D, tks, reps, warm = 8, 4, 2, 32, (256, 512), 2, 1
    else:
        n_anchors, Hq, Hkv, D, tks, reps, warm = 512, 32, 8, 128, (16384, 65536), 10, 2
    if args.contexts:
        tks = tuple(args.contexts)
    dt = torch.bfloat16
    scale = D ** -0.5
    Tq = n_anchors * B
    names = args.kernels
    kernels = [(n,) + _load_kernel(n, dev, dt, D, te_emulator=args.te_emulator) for n in names]
    for n, kern, why in kernels:
        log(f"[compare] kernel {n}: " + ("loaded " + type(kern).__name__ if kern is not None else f"unavailable ({why})"))
    out = dict(shapes=dict(n_anchors=n_anchors, B=B, Tq=Tq, Hq=Hq, Hkv=Hkv, D=D, dtype="bfloat16", tks=list(tks)),
               flop_convention=f"useful fwd = 4*pairs*Hq*D; fwd+bwd = {mb.FWD_BWD_FACTOR}x fwd",
               kernels={n: (type(k).__name__ if k is not None else None) for n, k, _ in kernels},
               unavailable={n: why for n, k, why in kernels if k is None}, rows=[], sdpa=[], own_block=[],
               fused=[], einsum_source=einsum_src)
    res["compare"] = out

    def problem(i, tk):  # the same tensors for every kernel
        mask = mb.dflash_interval_mask(n_anchors, tk, block_size=B, seed=11 + i, device=dev)
        gen = torch.Generator(device=dev).manual_seed(100 + i)
        q = mb._rand((Tq, Hq, D), gen, dev, dt)
        k = mb._rand((tk, Hkv, D), gen, dev, dt)
        v = mb._rand((tk, Hkv, D), gen, dev, dt)
        do = mb._rand((Tq, Hq, D), gen, dev, dt)
        return mask, q, k, v, do, float(B * (mask.hi - mask.lo).sum().item())

    refs, sdpa = {}, {}
    for i, tk in enumerate(tks):
        t0 = time.perf_counter()
        mask, q, k, v, do, pairs = problem(i, tk)
        refs[tk] = mb.interval_attention_reference(q, k, v, mask, scale, do)
        sync(dev)
        log(f"[compare] Tk={tk}: pairs {pairs:.3e} (density {pairs / (Tq * tk):.3f}), float64 reference "
            f"{time.perf_counter() - t0:.1f}s")
        try:
            # warm-up of its own: on 2026-11-30 the first SDPA timings of this mode (after the float64
            # reference) came out at ~357 TF/s where bench_attention measured 660-690 fwd on the same GPU
            mb.dense_sdpa_rate(Tq, pairs, Hq=Hq, D=D, dtype=dt, device=dev, reps=1, warmup=3)
            sd = mb.dense_sdpa_rate(Tq, pairs, Hq=Hq, D=D, dtype=dt, device=dev, reps=reps, warmup=warm)
        except Exception as e:  # noqa: BLE001
            sd = dict(error=_err_str(e))
        sd["tk"] = tk
        sdpa[tk] = sd
        out["sdpa"].append(sd)
        log(f"[compare] dense SDPA Tk={tk}: {json.dumps(sd)}")
        del mask, q, k, v, do
    own = _own_block_setup(dev, n_anchors, B, Hq, Hkv, D, dt, scale, problem(0, tks[0]), reps, warm,
                           own_block_forward, own_block_backward, merge)
    out["own_block"] = list(own["rows"])
    flush()
    ctx_ms, broken = {}, None
    for name, kern, why in kernels:
        t_k = time.perf_counter()
        for i, tk in enumerate(tks):
            r = dict(kernel=name, tk=tk, Tq=Tq)
            if kern is None:
                r["unavailable"] = why
            elif broken:
                r["skipped"] = f"CUDA context broken by {broken}"
            else:
                mask, q, k, v, do, pairs = problem(i, tk)
                r.update(pairs=pairs, density=pairs / (Tq * tk))
                f_fwd = mb.fwd_flops(pairs, Hq, D)
                try:
                    t0 = time.perf_counter()
                    o, l, st = kern.forward(q, k, v, mask, scale)
                    delta = (do.float() * o).sum(-1)
                    g = kern.backward(q, k, v, mask, scale, do, l, delta, st)
                    sync(dev)
                    r["first_call_s"] = time.perf_counter() - t0  # includes compiles / cuDNN graph builds
                    r["exact"] = _exact(o, l, g, refs[tk])
                    del o, l, st, g, delta
                    if i == 0:
                        try:
                            r["split_exact"] = _split_exactness(kern, q, k, v, mask, scale, do, refs[tk])
                        except Exception as e:  # noqa: BLE001
                            if _cuda_broken(e):
                                raise
                            r["split_exact"] = dict(error=_err_str(e))
                    _time_row(r, kern, q, k, v, mask, scale, do, dev, reps, warm, f_fwd, sdpa[tk])
                    ctx_ms[(name, tk)] = r["fwdbwd_ms"]
                    _kernel_details(r, kern)
                except Exception as e:  # noqa: BLE001
                    broken = _row_failed(r, e, dev, f"{name} at Tk {tk}", traceback_limit=4) or broken
                del mask, q, k, v, do
            _keep_row(out["rows"], r, "compare", dev, broken)
        flush()
        if kern is not None and not broken:
            broken = _own_block_kernel(dev, out, name, kern, own, scale, reps, warm) or broken
            flush()
        if kern is not None and not broken:
            broken = _fused(dev, out, name, kern, problem(0, tks[0]), tks[0], B, Hkv, D, dt, scale, reps, warm,
                            ctx_ms, own) or broken
            flush()
        elif kern is None:
            out["fused"].append(dict(kernel=name, tk=tks[0], unavailable=why))
            out["own_block"].append(dict(path=f"{name} kernel, block-diagonal IntervalMask", name=f"{name} block-diag",
                                         kernel=name, Tq=Tq, unavailable=why))
        log(f"[compare] kernel {name}: {time.perf_counter() - t_k:.1f}s")
    variants = _parse_stair_sweep(args.staircase_sweep)
    out["staircase_sweep"] = []
    if variants and broken:
        out["staircase_sweep"].append(dict(variant="all", skipped=f"CUDA context broken by {broken}"))
    elif variants:
        _staircase_sweep(dev, cpu, out, variants, problem, refs, sdpa, ctx_ms, tks, Tq, Hq, D, scale, reps, warm,
                         flush)
    return out


#: the group-size sweep (the main staircase row is group_blocks=32); a fuller one, e.g.
#: "default;group_blocks=16;group_blocks=64;bwd_mode=query;bwd_mode=key;streams=2;key_grain=1024;kv_layout=copy;gqa=native",
#: takes minutes on the H200 (cuDNN builds a graph per new dense shape on first use)
DEFAULT_STAIR_SWEEP = "group_blocks=16;group_blocks=64;group_blocks=128"


def _parse_stair_sweep(spec: str):
    """'a=1,b=x;c=2' -> [("a=1,b=x", {"a": 1, "b": "x"}), ("c=2", {"c": 2})]; 'default' -> ("default", {});
    'none' / '' -> []. Variants with gqa=native go last (a rejected cuDNN call could break the context).
    Raises ValueError on a malformed item or an unknown option."""
    from megatron_splitkv.kernels.staircase import _DEFAULTS, option_from_text

    out = []
    for item in (x.strip() for x in (spec or "").split(";")):
        if not item or item == "none":
            continue
        if item == "default":
            out.append(("default", {}))
            continue
        opts = {}
        for kv in item.split(","):
            if "=" not in kv:
                raise ValueError(f"--staircase-sweep: expected name=value, got {kv!r} in {item!r}")
            key, val = (x.strip() for x in kv.split("=", 1))
            if key not in _DEFAULTS or key == "inner":
                raise ValueError(f"--staircase-sweep: unknown staircase option {key!r}")
            opts[key] = option_from_text(key, val, where=f"--staircase-sweep: {key} in {item!r}")
        out.append((item, opts))
    return sorted(out, key=lambda x: x[1].get("gqa") == "native")


def _time_row(r: dict, kern, q, k, v, mask, scale, do, dev, reps, warm, f_fwd: float, sd: dict) -> None:
    """Time `kern` on the inputs (`_time_kernel`) into r["fwd_ms"] / r["fwdbwd_ms"], then its rates (`_add_rates`)."""
    r["fwd_ms"], r["fwdbwd_ms"] = _time_kernel(kern, q, k, v, mask, scale, do, dev, reps, warm)
    _add_rates(r, f_fwd, sd)


def _add_rates(r: dict, f_fwd: float, sd: dict) -> None:
    """r's forward and forward+backward TF/s from its fwd_ms / fwdbwd_ms and the forward's useful FLOPs f_fwd
    ("fwd_tflops", "fwdbwd_tflops"), and as % of the dense SDPA row `sd` of the same keys ("fwd_pct_dense",
    "fwdbwd_pct_dense"; not when `sd` has no rate: its run failed or was skipped)."""
    from tools import benchlib as mb  # as the other sections: torch and the package on first use

    r["fwd_tflops"] = f_fwd / r["fwd_ms"] / 1e9
    r["fwdbwd_tflops"] = mb.FWD_BWD_FACTOR * f_fwd / r["fwdbwd_ms"] / 1e9
    if "fwd_tflops" in sd:
        r["fwd_pct_dense"] = 100 * r["fwd_tflops"] / sd["fwd_tflops"]
        r["fwdbwd_pct_dense"] = 100 * r["fwdbwd_tflops"] / sd["fwdbwd_tflops"]


def _keep_row(rows: list, r: dict, tag: str, dev, broken: bool) -> None:
    """Append the row r to `rows`, log it (without its traceback) as "[tag] {json}", and free the CUDA cache
    unless the device is broken."""
    rows.append(r)
    log(f"[{tag}] {json.dumps({kk: vv for kk, vv in r.items() if kk != 'traceback'}, default=str)}")
    if dev.type == "cuda" and not broken:
        torch.cuda.empty_cache()


def _kernel_details(r: dict, kern):
    """Staircase rows: which dense path ran, its options and call counts, the share of pairs served densely."""
    if hasattr(kern, "paths"):
        r["paths"] = dict(kern.paths)
        r["options"] = kern.options()
        r["kernel_counts"] = dict(kern.counts)


def _staircase_sweep(dev, cpu, out, variants, problem, refs, sdpa, ctx_ms, tks, Tq, Hq, D, scale, reps, warm, flush):
    """One StaircaseAttentionKernel per option variant on the compare mode's masks and tensors: exactness vs
    the float64 reference, forward and forward + backward timing (kernel API, cached mask), TF/s on useful
    FLOPs, % of dense SDPA, speed-up over flex, the dense path that ran. On CPU (dry run) every variant
    gets STAIR_CPU underneath so that the tiny shapes make dense calls."""
    from tools import benchlib as mb
    from megatron_splitkv.kernels.staircase import StaircaseAttentionKernel

    broken = None
    for label, opts in variants:
        for i, tk in enumerate(tks):
            r = dict(variant=label, tk=tk, options=opts)
            if broken:
                r["skipped"] = f"CUDA context broken by {broken}"
                out["staircase_sweep"].append(r)
                continue
            mask, q, k, v, do, pairs = problem(i, tk)
            try:
                kern = StaircaseAttentionKernel(**(dict(STAIR_CPU, **opts) if cpu else opts))
                f_fwd = mb.fwd_flops(pairs, Hq, D)
                t0 = time.perf_counter()
                o, l, st = kern.forward(q, k, v, mask, scale)
                g = kern.backward(q, k, v, mask, scale, do, l, (do.float() * o).sum(-1), st)
                sync(dev)
                r["first_call_s"] = time.perf_counter() - t0
                r["exact"] = _exact(o, l, g, refs[tk])
                del o, l, st, g
                plan = kern.plan(mask)
                r.update(groups=len(plan.groups), dense_fraction=plan.dense_fraction)
                _time_row(r, kern, q, k, v, mask, scale, do, dev, reps, warm, f_fwd, sdpa.get(tk, {}))
                if ("flex", tk) in ctx_ms:
                    r["speedup_vs_flex"] = ctx_ms[("flex", tk)] / r["fwdbwd_ms"]
                _kernel_details(r, kern)
                e = r["exact"]
                r["ok"] = e.get("nonfinite", 1) == 0 and all(e.get(x, 1.0) < 2e-2 for x in ("out", "dq", "dk", "dv"))
            except Exception as e:  # noqa: BLE001
                broken = _row_failed(r, e, dev, f"staircase {label}", traceback_limit=6) or broken
            del mask, q, k, v, do
            _keep_row(out["staircase_sweep"], r, "stair-sweep", dev, broken)
        flush()


def _einsum_own_block_forward(q, k_blk, v_blk, valid, block_size, scale, acc):
    """The op's separate own-block forward before the own block was fused into the kernel (ops/common.py
    at f067c81): each block's B queries attend its own B keys, dense fp32 einsums. Returns out, lse."""
    tq, hq, d = q.shape
    hkv = k_blk.shape[1]
    nb = tq // block_size
    v4 = valid.view(-1, 1, 1, 1)
    qb = torch.where(v4[..., None], q.to(acc).view(nb, block_size, hkv, hq // hkv, d), 0)
    kb = torch.where(v4, k_blk.to(acc).view(nb, block_size, hkv, d), 0)
    vb = torch.where(v4, v_blk.to(acc).view(nb, block_size, hkv, d), 0)
    s = torch.einsum("nikgd,njkd->nkgij", qb, kb) * scale
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("nkgij,njkd->nikgd", torch.exp(s - lse[..., None]), vb)
    o = torch.where(valid.view(-1, 1, 1, 1, 1), o, torch.zeros_like(o)).reshape(tq, hq, d)
    lse = torch.where(valid.view(-1, 1, 1, 1), lse, torch.full_like(lse, float("-inf")))
    return o, lse.permute(0, 3, 1, 2).reshape(tq, hq)


def _einsum_own_block_backward(q, k_blk, v_blk, valid, block_size, scale, dout, lse, delta, acc):
    """Backward of `_einsum_own_block_forward` with the GLOBAL lse/delta (ops/common.py at f067c81)."""
    tq, hq, d = q.shape
    hkv = k_blk.shape[1]
    nb = tq // block_size
    g = hq // hkv
    v4 = valid.view(-1, 1, 1, 1)
    qb = torch.where(v4[..., None], q.to(acc).view(nb, block_size, hkv, g, d), 0)
    kb = torch.where(v4, k_blk.to(acc).view(nb, block_size, hkv, d), 0)
    vb = torch.where(v4, v_blk.to(acc).view(nb, block_size, hkv, d), 0)

    def heads_first(x):
        return x.to(acc).view(nb, block_size, hkv, g).permute(0, 2, 3, 1)[..., None]

    lse_g = heads_first(lse)
    ok = torch.isfinite(lse_g) & valid.view(-1, 1, 1, 1, 1)
    s = torch.einsum("nikgd,njkd->nkgij", qb, kb) * scale
    p = torch.where(ok, torch.exp(s - torch.where(ok, lse_g, torch.zeros_like(lse_g))), torch.zeros_like(s))
    do = torch.where(valid.view(-1, 1, 1, 1, 1), dout.to(acc).view(nb, block_size, hkv, g, d), 0)
    dv = torch.einsum("nkgij,nikgd->njkd", p, do)
    ds = torch.where(ok, p * (torch.einsum("nikgd,njkd->nkgij", do, vb) - heads_first(delta)), 0)
    dq = torch.einsum("nkgij,njkd->nikgd", ds, kb) * scale
    dk = torch.einsum("nkgij,nikgd->njkd", ds, qb) * scale
    return dq.reshape(tq, hq, d), dk.reshape(tq, hkv, d), dv.reshape(tq, hkv, d)


def _own_block_setup(dev, n_anchors, B, Hq, Hkv, D, dt, scale, prob, reps, warm, own_block_forward,
                     own_block_backward, merge):
    """Own-block inputs (Tq = n_anchors * B rows, the first Tk's q and dO), its float64 reference on the
    block-diagonal mask, and the einsum pass + merge rows (no kernel involved)."""
    from tools import benchlib as mb
    from megatron_splitkv.kernels.base import IntervalMask

    _, q, _, _, do, _ = prob
    Tq = n_anchors * B
    acc = torch.float32
    gen = torch.Generator(device=dev).manual_seed(7)
    k_blk = mb._rand((Tq, Hkv, D), gen, dev, dt)
    v_blk = mb._rand((Tq, Hkv, D), gen, dev, dt)
    valid = torch.ones(n_anchors, dtype=torch.bool, device=dev)
    lo = torch.arange(n_anchors, device=dev, dtype=torch.int64) * B
    diag = IntervalMask(B, lo, lo + B, Tq)
    ref = mb.interval_attention_reference(q, k_blk, v_blk, diag, scale, do)
    rows = []
    r = dict(path="einsum (separate pass, fp32)", name="einsum", Tq=Tq)
    try:
        o_e, l_e = own_block_forward(q, k_blk, v_blk, valid, B, scale, acc)
        delta = (do.float() * o_e).sum(-1)
        g = own_block_backward(q, k_blk, v_blk, valid, B, scale, do, l_e, delta, acc)
        r["exact"] = _exact(o_e, l_e, g, ref)
        del g

        def e_fwd():
            own_block_forward(q, k_blk, v_blk, valid, B, scale, acc)

        def e_fwdbwd():
            o_, l_ = own_block_forward(q, k_blk, v_blk, valid, B, scale, acc)
            own_block_backward(q, k_blk, v_blk, valid, B, scale, do, l_, delta, acc)

        r["fwd_ms"], _, _ = mb.time_fn(e_fwd, dev, reps=reps, warmup=warm)
        r["fwdbwd_ms"], _, _ = mb.time_fn(e_fwdbwd, dev, reps=reps, warmup=warm)
        rows.append(r)
        o_c = torch.randn(Tq, Hq, D, device=dev, dtype=acc)
        l_c = torch.randn(Tq, Hq, device=dev, dtype=acc)
        m_ms, _, _ = mb.time_fn(lambda: merge(o_c, l_c, o_e, l_e), dev, reps=reps, warmup=warm)
        rows.append(dict(path="lse merge with the context part (fwd, fp32)", name="merge", Tq=Tq, fwd_ms=m_ms,
                         fwdbwd_ms=m_ms))
        del o_c, l_c, o_e, l_e
    except Exception as e:  # noqa: BLE001
        r["error"] = _err_str(e)
        rows.insert(0, r)
    for x in rows:
        log(f"[own-block] {json.dumps(x)}")
    return dict(rows=rows, q=q, do=do, k_blk=k_blk, v_blk=v_blk, diag=diag, ref=ref, Tq=Tq)


def _own_block_kernel(dev, out, name, kern, own, scale, reps, warm):
    """One kernel on the block-diagonal own-block mask (exactness + timing); returns a "broken" label
    when the CUDA context failed, else None."""
    r = dict(path=f"{name} kernel, block-diagonal IntervalMask", name=f"{name} block-diag", Tq=own["Tq"],
             kernel=name)
    q, do, kb, vb, diag = own["q"], own["do"], own["k_blk"], own["v_blk"], own["diag"]
    broken = None
    try:
        o, l, st = kern.forward(q, kb, vb, diag, scale)
        delta = (do.float() * o).sum(-1)
        g = kern.backward(q, kb, vb, diag, scale, do, l, delta, st)
        r["exact"] = _exact(o, l, g, own["ref"])
        del o, l, st, g
        r["fwd_ms"], r["fwdbwd_ms"] = _time_kernel(kern, q, kb, vb, diag, scale, do, dev, reps, warm)
    except Exception as e:  # noqa: BLE001
        broken = _row_failed(r, e, dev, f"{name} (own block)") or broken
    out["own_block"].append(r)
    log(f"[own-block] {json.dumps(r)}")
    return broken


def _fused(dev, out, name, kern, prob, tk, B, Hkv, D, dt, scale, reps, warm, ctx_ms, own):
    """Context + own block in ONE kernel call, built exactly as the ops build it (keys [context ; zero
    padding to a multiple of 128 ; own keys], second intervals `ops.common.with_own_blocks`), vs the
    separate path (context kernel + einsum own block + merge). Returns a "broken" label or None."""
    from tools import benchlib as mb

    try:
        from megatron_splitkv.ops.common import with_own_blocks, with_own_keys
    except ImportError:
        out["fused"].append(dict(kernel=name, tk=tk,
                                 unavailable="this tree's ops have no fused own block (ops.common.with_own_blocks)"))
        return None
    mask, q, k, v, do, _ = prob
    nb = mask.num_blocks
    valid = torch.ones(nb, dtype=torch.bool, device=dev)
    r = dict(kernel=name, tk=tk, Tq=nb * B)
    broken = None
    try:
        kk = with_own_keys(k, None, own["k_blk"], valid.repeat_interleave(B))
        vv = with_own_keys(v, None, own["v_blk"], valid.repeat_interleave(B))
        m2 = with_own_blocks(mask, valid, nb)
        ref = mb.interval_attention_reference(q, kk, vv, m2, scale, do)
        o, l, st = kern.forward(q, kk, vv, m2, scale)
        delta = (do.float() * o).sum(-1)
        g = kern.backward(q, kk, vv, m2, scale, do, l, delta, st)
        r["exact"] = _exact(o, l, g, ref)
        del o, l, st, g, ref
        r["fwd_ms"], r["fwdbwd_ms"] = _time_kernel(kern, q, kk, vv, m2, scale, do, dev, reps, warm)
        ein = next((x for x in own["rows"] if x.get("name") == "einsum"), {})
        mrg = next((x for x in own["rows"] if x.get("name") == "merge"), {})
        if (name, tk) in ctx_ms and "fwdbwd_ms" in ein:
            r["separate_fwdbwd_ms"] = ctx_ms[(name, tk)] + ein["fwdbwd_ms"] + mrg.get("fwd_ms", 0.0)
    except Exception as e:  # noqa: BLE001
        broken = _row_failed(r, e, dev, f"{name} (fused)") or broken
    out["fused"].append(r)
    log(f"[fused] {json.dumps(r)}")
    return broken


CPU_NOTE = ("CPU dry run (--cpu: tiny shapes, FlexAttention emulated): TF/s, % of dense SDPA and peak GPU memory "
            f"are GPU measures and read {NA_CPU}; the ms columns only show that each path ran, not its speed.")


def _is_cpu(res) -> bool:
    """Whether `res` comes from a --cpu run (its env device is the CPU)."""
    return str(res.get("env", {}).get("device", "")).startswith("cpu")


_num = finite  # `fmt` of a number, '-' for None / NaN


def _g(cpu, value, fmt="{:.0f}"):
    """A GPU-only measure as a table cell (`bench.gpu_cell`): NA_CPU in a CPU dry run."""
    return gpu_cell(cpu, value, fmt)


def _ms_tf(cpu, ms, tf):
    """'ms (TF/s)' cell; in a CPU dry run only the ms (the TF/s is n/a there, see CPU_NOTE)."""
    return _num(ms) if cpu else f"{_num(ms)} ({_num(tf, '{:.0f}')})"


def cpu_note(res) -> list:
    """[CPU_NOTE] (with a blank line before it) for a --cpu run's output, else []."""
    return ["", CPU_NOTE] if _is_cpu(res) else []


def table_compare(res):
    c = res.get("compare")
    if not c:
        return []
    nan = float("nan")
    cpu = _is_cpu(res)
    sh = c["shapes"]
    lines = ["", f"Local kernels, DFlash interval mask: {sh['n_anchors']} anchors x {sh['B']} (Tq {sh['Tq']}), one "
             f"sequence, Hq {sh['Hq']}, Hkv {sh['Hkv']}, D {sh['D']}, bf16; kernel API, cached mask; TF/s on useful "
             f"FLOPs ({c['flop_convention']}); % = of dense SDPA at the same useful FLOPs; errors vs float64 "
             f"(rel. norm; lse: max abs); split = two-part key split merged by lse (the op's global-lse path).", "",
             "| kernel | Tk | fwd ms | fwd TF/s | % dense | fwd+bwd ms | fwd+bwd TF/s | % dense | out | lse | dq | dk | dv "
             "| split out/dq/dk/dv | first call s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for sd in c["sdpa"]:
        if "error" in sd:
            lines.append(f"| dense SDPA | {sd['tk']} | ERROR {sd['error'][:80]} |" + " |" * 12)
            continue
        lines.append(f"| dense SDPA (Lk {sd['lk']}) | {sd['tk']} | {sd['fwd_ms']:.2f} | {_g(cpu, sd['fwd_tflops'])} | "
                     f"{_g(cpu, 100, '{:.0f}%')} | {sd['fwdbwd_ms']:.2f} | {_g(cpu, sd['fwdbwd_tflops'])} | "
                     f"{_g(cpu, 100, '{:.0f}%')} | | | | | | | |")
    for r in c["rows"]:
        head = f"| {r['kernel']} | {r['tk']} |"
        if "unavailable" in r or "skipped" in r:
            what = f"unavailable: {r['unavailable'][:90]}" if "unavailable" in r else f"SKIPPED: {r['skipped'][:90]}"
            lines.append(head + f" {what} |" + " |" * 12)
            continue
        if "error" in r and "fwd_ms" not in r:
            lines.append(head + f" ERROR {r['error'][:100]} |" + " |" * 12)
            continue
        e = r.get("exact", {})
        se = r.get("split_exact")
        split = "-" if not se else (f"ERROR {se['error'][:40]}" if "error" in se else
                                    "/".join(f"{se.get(x, nan):.1e}" for x in ("out", "dq", "dk", "dv")))
        lines.append(head + f" {r['fwd_ms']:.2f} | {_g(cpu, r['fwd_tflops'])} | {_g(cpu, r.get('fwd_pct_dense'), '{:.0f}%')} | "
                     f"{r['fwdbwd_ms']:.2f} | {_g(cpu, r['fwdbwd_tflops'])} | {_g(cpu, r.get('fwdbwd_pct_dense'), '{:.0f}%')} | "
                     + " | ".join(f"{e.get(x, nan):.1e}" for x in ("out", "lse", "dq", "dk", "dv"))
                     + f" | {split} | {r.get('first_call_s', nan):.1f} |")
    st_rows = [r for r in c["rows"] if "paths" in r]
    if st_rows:
        lines += ["", "Staircase rows above: the dense path that ran (kernels/staircase.py):", "",
                  "| kernel | Tk | dense | gqa | K/V | bwd | streams | groups | pairs served densely | calls fwd/bwd/inner/fixup |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in st_rows:
            p, n = r["paths"], r.get("kernel_counts", {})
            lines.append(f"| {r['kernel']} | {r['tk']} | {p.get('dense', '-')} | {p.get('gqa', '-')} | "
                         f"{p.get('kv_layout', '-')} | {p.get('bwd', '-')} | {p.get('streams', '-')} | "
                         f"{p.get('groups', '-')} | {100 * p.get('dense_fraction', 0):.1f}% | "
                         f"{n.get('dense_fwd', 0)}/{n.get('dense_bwd', 0)}/{n.get('inner_bwd', 0)}/{n.get('fixup', 0)} |")
    sw = c.get("staircase_sweep") or []
    if sw:
        lines += ["", "Staircase option sweep (same masks and tensors; TF/s on useful FLOPs, % of dense SDPA, "
                  "speed-up over flex fwd+bwd, errors vs float64):", "",
                  "| variant | Tk | groups | dense pairs | bwd | gqa | fwd ms | fwd TF/s | % dense | fwd+bwd ms | "
                  "fwd+bwd TF/s | % dense | x flex | out | dq | dk | dv | first call s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sw:
            head = f"| {r['variant']} | {r.get('tk', '-')} |"
            if "skipped" in r or ("error" in r and "fwd_ms" not in r):
                what = r.get("skipped") or f"ERROR {r['error']}"
                lines.append(head + f" {what[:100]} |" + " |" * 16)
                continue
            e, p = r.get("exact", {}), r.get("paths", {})
            lines.append(head + f" {r.get('groups', '-')} | {100 * r.get('dense_fraction', 0):.1f}% | "
                         f"{p.get('bwd', '-')} | {p.get('gqa', '-')} | {r['fwd_ms']:.2f} | {_g(cpu, r['fwd_tflops'])} | "
                         f"{_g(cpu, r.get('fwd_pct_dense'), '{:.0f}%')} | {r['fwdbwd_ms']:.2f} | "
                         f"{_g(cpu, r['fwdbwd_tflops'])} | {_g(cpu, r.get('fwdbwd_pct_dense'), '{:.0f}%')} | "
                         f"{r.get('speedup_vs_flex', nan):.2f} | "
                         + " | ".join(f"{e.get(x, nan):.1e}" for x in ("out", "dq", "dk", "dv"))
                         + f" | {r.get('first_call_s', nan):.1f} |")
    ob = c.get("own_block") or []
    if ob:
        lines += ["", f"Own block ({sh['Tq']} rows, each block's {sh['B']} queries x its own {sh['B']} keys, bidirectional; "
                  f"the op runs it on the owner's rows, Lq/P at CP=P):", "",
                  "| own-block path | fwd ms | fwd+bwd ms | out | lse | dq | dk | dv |", "|---|---|---|---|---|---|---|---|"]
        for r in ob:
            if "unavailable" in r:
                lines.append(f"| {r['path']} | unavailable: {r['unavailable'][:80]} | | | | | | |")
            elif "error" in r:
                lines.append(f"| {r['path']} | ERROR {r['error'][:80]} | | | | | | |")
            else:
                e = r.get("exact", {})
                lines.append(f"| {r['path']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | "
                             + " | ".join(f"{e[x]:.1e}" if x in e else "-" for x in ("out", "lse", "dq", "dk", "dv")) + " |")
    fu = c.get("fused") or []
    if fu:
        lines += ["", "Context + own block fused in one kernel call (second intervals lo2/hi2) vs separate (context "
                  "kernel + einsum own block + merge):", "",
                  "| kernel | Tk | fused fwd ms | fused fwd+bwd ms | separate fwd+bwd ms | out | dq | dk | dv |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in fu:
            if "unavailable" in r or "error" in r:
                lines.append(f"| {r.get('kernel', '-')} | {r.get('tk', '-')} | "
                             f"{'unavailable: ' + r['unavailable'] if 'unavailable' in r else 'ERROR ' + r['error']} | | | | | | |")
                continue
            e = r.get("exact", {})
            lines.append(f"| {r['kernel']} | {r['tk']} | {r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | "
                         f"{r.get('separate_fwdbwd_ms', nan):.2f} | "
                         + " | ".join(f"{e.get(x, nan):.1e}" for x in ("out", "dq", "dk", "dv")) + " |")
    return lines


# ------------------------------------------------------------------------------------------- main
def env_info(dev):
    info = dict(torch=torch.__version__, device=str(dev), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def table_kernel(res):
    lines = []
    ex = res.get("kernel_exactness")
    if ex:
        lines += ["", "| flex exactness (bf16 vs float64) | out | dq | dk | dv | max abs lse err |", "|---|---|---|---|---|---|"]
        for r in ex:
            lines.append(f"| seed {r['seed']} | {r['out']:.2e} | {r['dq']:.2e} | {r['dk']:.2e} | {r['dv']:.2e} | {r['lse']:.2e} |")
    se = res.get("staircase_exactness")
    if se:
        nan = float("nan")
        lines += ["", f"| staircase exactness (bf16 vs float64, global lse/delta, fix-up rows) | own | ok | out | dq | dk | "
                  f"dv | max abs lse err | dense path | dense pairs | calls fwd/bwd/inner/fixup | first call s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in se:
            if "skipped" in r or "error" in r:
                lines.append(f"| {r['variant']} | {r['own']} | {r.get('skipped') or 'ERROR ' + r['error'][:80]} |"
                             + " |" * 9)
                continue
            p, n = r.get("paths", {}), r.get("counts", {})
            path = "/".join(str(p.get(x, "-")) for x in ("dense", "gqa", "kv_layout", "bwd", "streams"))
            lines.append(f"| {r['variant']} | {r['own']} | {r['ok']} | {r['out']:.2e} | {r['dq']:.2e} | {r['dk']:.2e} | "
                         f"{r['dv']:.2e} | {r['lse']:.2e} | {path} | {100 * r.get('dense_fraction', 0):.0f}% | "
                         f"{n.get('dense_fwd', 0)}/{n.get('dense_bwd', 0)}/{n.get('inner_bwd', 0)}/{n.get('fixup', 0)} | "
                         f"{r.get('first_call_s', nan):.1f} |")
    c = res.get("compile")
    if c:
        tq = lambda sh: [nb * 16 for nb, _ in sh]  # noqa: E731
        tk = lambda sh: [t for _, t in sh]  # noqa: E731
        bk = c["buckets"]
        lines += ["", f"compile (q/kv bucket steps {c['q_bucket_steps']}/{c['kv_bucket_steps']}, reuse larger kv "
                  f"bucket {c['reuse_larger_kv_bucket']}): first call {c['first_graphs']} graph(s) {c['first_s']:.1f}s "
                  f"at (Tq, Tk) pad {bk['first'][0]}; {len(c['same'])} shapes in the same bucket, Tq {tq(c['same'])} "
                  f"Tk {tk(c['same'])}: **{c['same_bucket_new_graphs']} new graph(s)** {c['same_bucket_s']:.1f}s; "
                  f"new Tq bucket {bk['new_q'][0]}: {c['new_q_bucket_graphs']} ({c['new_q_bucket_s']:.1f}s); "
                  f"new Tk bucket {bk['new_k'][0]}: {c['new_k_bucket_graphs']} ({c['new_k_bucket_s']:.1f}s); "
                  f"Tk one bucket below a compiled one {c['reuse'][0]}: {c['reuse_graphs']} ({c['reuse_s']:.1f}s); "
                  f"all buckets again: {c['again_graphs']} ({c['again_s']:.1f}s); ok={c.get('ok')}"]
    tp = res.get("throughput")
    if tp:
        cpu = _is_cpu(res)
        lines += ["", "| Tk | density | raw flex fwd ms (TF/s) | raw flex fwd+bwd ms (TF/s) | kernel fwd ms (TF/s) fresh / cached mask | kernel fwd+bwd ms (TF/s) fresh / cached | mask build ms | SDPA fwd ms (TF/s) | SDPA fwd+bwd ms (TF/s) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in tp:
            def mt(key):
                return _ms_tf(cpu, r.get(key + "_ms"), r.get(key + "_tflops"))

            lines.append(
                f"| {r['tk']} | {r['density']:.3f} | {mt('raw_fwd')} | {mt('raw_fwdbwd')} | "
                f"{mt('kernel_fwd')} / {mt('kernel_fwd_cached')} | {mt('kernel_fwdbwd')} / {mt('kernel_fwdbwd_cached')} | "
                f"{r['mask_ms']:.2f} | {mt('sdpa_fwd')} | {mt('sdpa_fwdbwd')} |")
        vlines = []
        for r in tp:
            for v in r.get("variants", []):
                if "error" in v:
                    vlines.append(f"| {r['tk']} | {v['name']} | ERROR {v['error'][:80]} | | |")
                else:
                    vlines.append(f"| {r['tk']} | {v['name']} | {_ms_tf(cpu, v['fwd_ms'], v['fwd_tflops'])} | "
                                  f"{_ms_tf(cpu, v['fwdbwd_ms'], v['fwdbwd_tflops'])} | {v['compile_s']:.1f} |")
        if vlines:
            lines += ["", "| Tk | raw flex variant | fwd ms (TF/s) | fwd+bwd ms (TF/s) | compile s |", "|---|---|---|---|---|"] + vlines
    return lines


def table_ops(res, world):
    lines = []
    ex = res.get(f"op_exactness_cp{world}")
    if ex:
        lines += ["", f"| op exactness CP={world} (bf16 vs float64) | ok | out | dq | dk_ctx | dv_ctx | dk_blk | dv_blk |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in ex:
            if "error" in r:
                lines.append(f"| {r['op']} | ERROR | {r['error'].splitlines()[-1][:80]} | | | | | |")
            else:
                lines.append(f"| {r['op']} | {r['ok']} | {r['out']:.2e} | {r['q']:.2e} | {r['k_ctx']:.2e} | "
                             f"{r['v_ctx']:.2e} | {r['k_blk']:.2e} | {r['v_blk']:.2e} |")
    tm = res.get(f"op_timing_cp{world}")
    if tm:
        cpu = _is_cpu(res)
        lines += ["", f"| op CP={world} | context | fwd+bwd ms | useful TF/s/GPU | comm MB/rank (per collective) | peak mem GiB |",
                  "|---|---|---|---|---|---|"]
        for r in tm:
            if "error" in r:
                lines.append(f"| {r['op']} | {r['ctx']} | ERROR {r['error'].splitlines()[-1][:60]} | | | |")
                continue
            per = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(r["bytes"].items()))
            lines.append(f"| {r['op']} | {r['ctx']} | {r['fwdbwd_ms']:.2f} | {_g(cpu, r['useful_tflops_per_gpu'])} | "
                         f"{r['total_mb']:.1f} ({per}) | {_g(cpu, r.get('peak_mem_gib'), '{:.2f}')} |")
    return lines


def _op_config(args):
    """The ops' SplitKVConfig from --chunk-axis / --num-chunks (an error line naming the flag)."""
    from megatron_splitkv import SplitKVConfig

    try:
        return SplitKVConfig(chunk_axis=args.chunk_axis or "rows", num_chunks=args.num_chunks)
    except ValueError as exc:
        raise SystemExit(f"gpu_check.py: error: {exc}") from None


SKIPPABLE = ("exact", "compile", "tput", "stair", "op")


def check_args(ap, args):
    """The comma-list flags parsed in place (`ap.error`, exit 2, naming the flag, for a bad or repeated value):
    args.skip -> list of SKIPPABLE sections ([] for ''), args.kernels -> list of `kernels.BACKENDS` names,
    args.contexts -> list of ints, each at least the anchors per context of the mode (compare: 512, --cpu 8;
    kernel / dist op rows: 512, --cpu 16; `kernel_compare`, `op_timing`) ([] for '': the mode's default)."""
    from tools import benchlib as mb
    from megatron_splitkv.kernels import BACKENDS

    args.skip = mb.choices_arg(ap, "--skip", args.skip, SKIPPABLE, "section") if args.skip else []
    args.kernels = mb.choices_arg(ap, "--kernels", args.kernels, BACKENDS, "kernel backend")
    anchors = 512 if not args.cpu else 8 if args.mode == "compare" else 16
    args.contexts = mb.int_list_arg(ap, "--contexts", args.contexts, anchors) if args.contexts else []


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["kernel", "dist", "compare"])
    ap.add_argument("--cpu", action="store_true", help="tiny CPU dry run (flex emulated, gloo)")
    ap.add_argument("--out", type=output_dir, default=os.environ.get("OUT") or os.path.join(ROOT, "out", "gpu_check"))
    ap.add_argument("--backend", default="flex", help="local kernel backend for the ops")
    ap.add_argument("--skip", default="",
                    help="comma list of: exact,compile,tput,stair,op (kernel mode; dist: exact,op)")
    ap.add_argument("--contexts", default="",
                    help="op timing context sizes (kernel, dist), e.g. 32768,131072 (compare: the key counts Tk, "
                         "default 16384,65536); each once and at least the anchors per context: 512 (--cpu: 16, "
                         "compare 8)")
    ap.add_argument("--kernels", default="fa4,flex,te,staircase", help="compare: local kernel backends to compare")
    ap.add_argument("--staircase-sweep", default=DEFAULT_STAIR_SWEEP,
                    help="compare: staircase option variants, ';'-separated, each a ','-separated list of "
                         "name=value (StaircaseAttentionKernel options: group_blocks, min_group_blocks, key_grain, "
                         "min_keys, min_pairs, bwd_mode, kmajor_min_keys, gqa, kv_layout, streams); 'default' = "
                         "the kernel's defaults; 'none' skips the sweep. Default: %(default)s")
    ap.add_argument("--chunk-axis", choices=("rows", "heads"), default=None,
                    help="dist: SplitKVConfig.chunk_axis of the op exactness rows (default: the op's, rows)")
    ap.add_argument("--num-chunks", type=int_arg(1), default=None,
                    help="dist: SplitKVConfig.num_chunks of the op exactness rows (default: the op's)")
    ap.add_argument("--te-emulator", action="store_true",
                    help="compare: run backend 'te' on the CPU emulator of TE's fused attention (tests only)")
    args = ap.parse_args(argv)
    check_args(ap, args)
    skip = set(args.skip)
    os.makedirs(args.out, exist_ok=True)
    LOGFILE[0] = os.path.join(args.out, f"progress_{args.mode}.log")
    if args.cpu and args.backend == "flex" and args.mode == "dist":
        args.backend = "math"
    res = {}
    t_start = time.perf_counter()
    if args.mode == "compare":
        dev = torch.device("cpu" if args.cpu else "cuda")
        res["env"] = env_info(dev)
        log(f"[env] {res['env']}")
        tag = f"compare{'_cpu' if args.cpu else ''}_w1"

        def flush():
            res["wall_s"] = time.perf_counter() - t_start
            with open(os.path.join(args.out, f"gpu_check_{tag}.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
            with open(os.path.join(args.out, f"gpu_check_{tag}.log"), "w") as f:
                f.write("\n".join(LOG + table_compare(res) + cpu_note(res)) + "\n")

        try:
            kernel_compare(dev, args.cpu, res, args, flush)
        except Exception:  # noqa: BLE001
            res["compare_error"] = traceback.format_exc()
            log(f"[compare] ERROR\n{res['compare_error']}")
        flush()
        print("\n".join(table_compare(res) + cpu_note(res)), flush=True)
        print(f"[done] {time.perf_counter() - t_start:.1f}s", flush=True)
        bad = [r for r in res.get("compare", {}).get("rows", []) if "error" in r] or "compare_error" in res
        sys.exit(1 if bad else 0)
    if args.mode == "kernel":
        dev = torch.device("cpu" if args.cpu else "cuda")
        res["env"] = env_info(dev)
        log(f"[env] {res['env']}")
        stages = [("exact", kernel_exactness), ("compile", compile_counts), ("tput", throughput),
                  ("stair", staircase_exactness)]
        for key, fn in stages:
            if key in skip:
                continue
            t0 = time.perf_counter()
            try:
                fn(dev, args.cpu, res)
            except Exception:  # noqa: BLE001
                res[f"{key}_error"] = traceback.format_exc()
                log(f"[{key}] ERROR\n{res[f'{key}_error']}")
            log(f"[{key}] {time.perf_counter() - t0:.1f}s")
        if "op" not in skip:
            t0 = time.perf_counter()
            backend = args.backend
            try:
                op_exactness(dev, args.cpu, 1, 0, None, res, backend)
                op_timing(dev, args.cpu, 1, 0, None, res, backend, args.contexts or ([1024] if args.cpu else [16384]))
            except Exception:  # noqa: BLE001
                res["op_error"] = traceback.format_exc()
                log(f"[op] ERROR\n{res['op_error']}")
            log(f"[op] {time.perf_counter() - t0:.1f}s")
        lines = table_kernel(res) + table_ops(res, 1) + cpu_note(res)
        world = 1
    else:
        import torch.distributed as dist

        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if args.cpu:
            dev = torch.device("cpu")
            dist.init_process_group("gloo")
        else:
            torch.cuda.set_device(local)
            dev = torch.device("cuda", local)
            dist.init_process_group("nccl", device_id=dev)
        res["env"] = env_info(dev)
        res["env"]["world"] = world
        log(f"[env] {res['env']}")
        group = dist.group.WORLD
        contexts = args.contexts or ([1024, 2048] if args.cpu else [32768, 131072])
        if "exact" not in skip:
            op_exactness(dev, args.cpu, world, rank, group, res, args.backend, _op_config(args))
        if "op" not in skip:
            op_timing(dev, args.cpu, world, rank, group, res, args.backend, contexts)
        lines = table_ops(res, world) + cpu_note(res)
        dist.barrier()
    res["wall_s"] = time.perf_counter() - t_start
    if _rank() == 0:
        tag = f"{args.mode}{'_cpu' if args.cpu else ''}_w{world}"
        with open(os.path.join(args.out, f"gpu_check_{tag}.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(os.path.join(args.out, f"gpu_check_{tag}.log"), "w") as f:
            f.write("\n".join(LOG + lines) + "\n")
        print("\n".join(lines), flush=True)
        print(f"[done] {res['wall_s']:.1f}s", flush=True)
    if args.mode == "dist":
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
