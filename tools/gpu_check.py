#!/usr/bin/env python3
"""One-script GPU check and benchmark of the FlexAttention kernel and the Split-KV op (issue 2).

Modes (logs and JSON go to --out, default $OUT or ./out/gpu_check; a markdown table is printed last):

  kernel  single GPU: (1) FlexAttentionKernel exactness, bf16, forward + backward with GLOBAL lse/delta
          over a two-part key split, vs float64 autograd; (2) compiled-graph count (torch._dynamo
          counters) over 6 shapes with Tq and Tk varying inside one bucket (expect 0 new), new Tq / Tk
          buckets (1 each) and a Tk one bucket below a compiled one (0, reused); (3) throughput for 512 anchors x 16 (Lq 8192), Hq 32, Hkv 8,
          D 128 at 16K and 64K keys: useful TFLOP/s (4 * visible pairs * Hq * D forward, x2.5 fwd+bwd)
          next to dense SDPA doing the same useful FLOPs; (4) if the ops import: splitkv / allgather-kv /
          ring-kv on one GPU (CP=1): exactness vs `dflash_attention_reference` and fwd+bwd time.
  dist    under torchrun (2+ processes, NCCL; gloo with --cpu): op exactness at CP=P (bf16 vs float64,
          output + all five grads) for the three ops, then the timing table: Lq 512 x 16, context 32K and
          128K total, Hq 32, Hkv 8, D 128, bf16, median fwd+bwd with CUDA events, comm bytes per
          collective (comm_stats) and peak memory.

  --cpu   tiny shapes on CPU (flex emulated, gloo): a dry run of every code path, no timings of note.

Examples:
  PYTHONPATH=. python tools/gpu_check.py kernel
  PYTHONPATH=. torchrun --nproc-per-node 2 tools/gpu_check.py dist
  PYTHONPATH=. python tools/gpu_check.py kernel --cpu
  PYTHONPATH=. torchrun --nproc-per-node 2 tools/gpu_check.py dist --cpu
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
    """Median and min milliseconds of fn() (megatron_splitkv.bench.time_fn: CUDA events on GPU)."""
    from megatron_splitkv.bench import time_fn

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


def op_exactness(dev, cpu, world, rank, group, res, backend):
    """Each op at CP=world vs float64 reference: out and the five grads (errors gathered to rank 0)."""
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
    for name, fn in ops.items():
        x = {k: v.detach().to(dev).clone().requires_grad_() for k, v in loc.items()}
        mm = {k: v.to(dev) for k, v in lmeta.items()}
        err = {}
        try:
            out = fn(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], mm["q_seq"], mm["q_anchor"],
                     mm["kv_seq"], mm["kv_pos"], block_size=B, cp_group=group, backend=backend)
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
        nan = float("nan")
        lines += ["", "| Tk | density | raw flex fwd ms (TF/s) | raw flex fwd+bwd ms (TF/s) | kernel fwd ms (TF/s) fresh / cached mask | kernel fwd+bwd ms (TF/s) fresh / cached | mask build ms | SDPA fwd ms (TF/s) | SDPA fwd+bwd ms (TF/s) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in tp:
            lines.append(
                f"| {r['tk']} | {r['density']:.3f} | {r.get('raw_fwd_ms', nan):.2f} ({r.get('raw_fwd_tflops', nan):.0f}) | "
                f"{r.get('raw_fwdbwd_ms', nan):.2f} ({r.get('raw_fwdbwd_tflops', nan):.0f}) | "
                f"{r['kernel_fwd_ms']:.2f} ({r['kernel_fwd_tflops']:.0f}) / {r['kernel_fwd_cached_ms']:.2f} ({r['kernel_fwd_cached_tflops']:.0f}) | "
                f"{r['kernel_fwdbwd_ms']:.2f} ({r['kernel_fwdbwd_tflops']:.0f}) / {r['kernel_fwdbwd_cached_ms']:.2f} ({r['kernel_fwdbwd_cached_tflops']:.0f}) | "
                f"{r['mask_ms']:.2f} | {r.get('sdpa_fwd_ms', nan):.2f} ({r.get('sdpa_fwd_tflops', nan):.0f}) | "
                f"{r.get('sdpa_fwdbwd_ms', nan):.2f} ({r.get('sdpa_fwdbwd_tflops', nan):.0f}) |")
        vlines = []
        for r in tp:
            for v in r.get("variants", []):
                if "error" in v:
                    vlines.append(f"| {r['tk']} | {v['name']} | ERROR {v['error'][:80]} | | |")
                else:
                    vlines.append(f"| {r['tk']} | {v['name']} | {v['fwd_ms']:.2f} ({v['fwd_tflops']:.0f}) | "
                                  f"{v['fwdbwd_ms']:.2f} ({v['fwdbwd_tflops']:.0f}) | {v['compile_s']:.1f} |")
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
        lines += ["", f"| op CP={world} | context | fwd+bwd ms | useful TF/s/GPU | comm MB/rank (per collective) | peak mem GiB |",
                  "|---|---|---|---|---|---|"]
        for r in tm:
            if "error" in r:
                lines.append(f"| {r['op']} | {r['ctx']} | ERROR {r['error'].splitlines()[-1][:60]} | | | |")
                continue
            per = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(r["bytes"].items()))
            lines.append(f"| {r['op']} | {r['ctx']} | {r['fwdbwd_ms']:.2f} | {r['useful_tflops_per_gpu']:.0f} | "
                         f"{r['total_mb']:.1f} ({per}) | {r.get('peak_mem_gib', float('nan')):.2f} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["kernel", "dist"])
    ap.add_argument("--cpu", action="store_true", help="tiny CPU dry run (flex emulated, gloo)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "out", "gpu_check"))
    ap.add_argument("--backend", default="flex", help="local kernel backend for the ops")
    ap.add_argument("--skip", default="", help="comma list of: exact,compile,tput,op")
    ap.add_argument("--contexts", default="", help="dist timing context sizes, e.g. 32768,131072")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    os.makedirs(args.out, exist_ok=True)
    LOGFILE[0] = os.path.join(args.out, f"progress_{args.mode}.log")
    if args.cpu and args.backend == "flex" and args.mode == "dist":
        args.backend = "math"
    res = {}
    t_start = time.perf_counter()
    if args.mode == "kernel":
        dev = torch.device("cpu" if args.cpu else "cuda")
        res["env"] = env_info(dev)
        log(f"[env] {res['env']}")
        stages = [("exact", kernel_exactness), ("compile", compile_counts), ("tput", throughput)]
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
                op_timing(dev, args.cpu, 1, 0, None, res, backend, [int(x) for x in (args.contexts or ("1024" if args.cpu else "16384")).split(",")])
            except Exception:  # noqa: BLE001
                res["op_error"] = traceback.format_exc()
                log(f"[op] ERROR\n{res['op_error']}")
            log(f"[op] {time.perf_counter() - t0:.1f}s")
        lines = table_kernel(res) + table_ops(res, 1)
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
        contexts = [int(x) for x in (args.contexts or ("1024,2048" if args.cpu else "32768,131072")).split(",")]
        if "exact" not in skip:
            op_exactness(dev, args.cpu, world, rank, group, res, args.backend)
        if "op" not in skip:
            op_timing(dev, args.cpu, world, rank, group, res, args.backend, contexts)
        lines = table_ops(res, world)
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
