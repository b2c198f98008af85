#!/usr/bin/env python3
"""Benchmark one DFlash drafter attention layer (the attention op, forward + backward) under context
parallelism: splitkv vs allgather-kv vs ring-kv at CP=1 and CP=2 (issue 6, deliverable 1).

Workload (DESIGN.md sections 1 and 5): query budget 512 anchors x block 16 (Lq = 8192 rows in total),
Qwen3-8B drafter shapes (Hq 32, Hkv 8, head dim 128, bf16), one sequence of `--contexts` tokens (16K ..
128K and beyond). Anchors are sampled as in training (uniform without replacement among valid
positions, `data.anchors.sample_anchors`); context is placed by the planner (`--placements lpt`) and by
Megatron's zigzag (`zigzag`) to show what balancing buys. Query blocks are split evenly (plan.query_slice).

Per row (method, CP, placement, context), written to --out as bench_attention.{json,md} and printed last:
  - op ms: median of `--reps` forward + backward calls (CUDA events), MAX over ranks, each call with the
    per-step metadata (`prepare_splitkv_metadata`, reused as every drafter layer does; `--no-metadata`
    times the self-contained call instead); "prep ms": the metadata preparation, once per step;
  - comm bytes per rank (comm_stats, the ops' own accounting; max over ranks) and the model's count
    (`tools.benchlib.predicted_bytes`, must agree);
  - peak memory: torch.cuda.max_memory_allocated during one step (max over ranks), absolute GiB;
  - local kernel: the rank's local-kernel calls timed alone (`bench.kernel_calls`, fresh mask per call as
    in the op), slowest rank's ms and its useful TF/s; next to dense SDPA's TF/s at about the same
    useful FLOPs on the same GPU. FLOP convention: useful forward FLOPs = 4 * visible pairs * Hq * D,
    forward + backward = 3.5 x (flash-attn convention; tools/gpu_check.py uses 2.5 x, i.e. its TF/s are
    1/1.4 of ours for the same time);
  - op useful TF/s per GPU = 3.5 * 4 * all visible pairs * Hq * D / op time / P;
  - pair imbalance: max / mean - 1 of the per-rank visible pairs of the method's kernel calls.
CP=1 rows run on every rank with a one-rank group (rank 0's numbers are reported; all ranks run them so
no rank waits); CP=2 rows use the world group (NCCL).

`--slow-path` only labels the rows (link "socket"): launch with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 so
the traffic takes NCCL's network (socket) transport, a stand-in for an inter-node link. The script
warns when the flag and the environment disagree.

Split-KV's merge pipeline: splitkv rows run the op's default chunk count (`prepare_splitkv_metadata`:
1 at CP=1, else 4; `--num-chunks` overrides; the row's `num_chunks`, "splitkv k=4" in the table), the
kernel column times the same chunked calls. `--chunks-ab 1,2,4` adds, after the rows and in the same
process, an A/B of chunk counts at CP = world (`--ab-contexts`, default 128K): same inputs, one metadata
per k, results cross-checked against the first k, timed round-robin (`bench.time_fns_interleaved`).
`--chunk-axis rows|heads` picks what the chunks split (the op's `chunk_axis`: query rows, or heads of all rows,
ops/splitkv.py item 3 "Head chunks"; the kernel column then times the head chunks as the op runs them), and
`--chunk-axis-ab rows,heads` runs every --chunks-ab count with each axis side by side.

Sliding-window layers (issue 23): `--window W` (and `--causal`) runs every --contexts row as a `sliding_attention`
drafter layer (z-lab's dflash semantics: row j of a block at anchor a sees context positions > a + j - W and, with
--causal, its own block's keys <= j): prepare and every call get window= / causal=, the kernel column times the
op's own windowed masks, the useful pairs (TF/s) count the windowed pairs (`benchlib.context_pairs`); the
bytes do not change (every collective of the three ops is independent of the mask). Rows hold "window" and
"causal" and are labelled "W=..." in the table. Not with --packs / --chunks-ab. One GPU, W in {512, 2048, 4096}:
  python tools/bench_attention.py --cp 1 --contexts 65536,131072 --window 2048 --causal --tag w2048

Budget helpers: `--row-target-s` sizes each row's repeats to about that many seconds (>= 3), `--sdpa-max-lk`
caps the dense reference's size (its rate is flat in Lk), `--cp1-methods` / `--alt-placement-methods`
drop redundant rows (at CP=1 the three ops do the same kernel work; allgather-kv's compute ignores the
placement), rows whose memory estimate (`estimate_mem_gib`) exceeds 85% of the free device memory are
SKIPPED (an OOM anyway is caught and recorded as the row's error).

Packs and peers (issue 22; `--packs`, additive to the rows above): per pack shape (kind x tokens x CP) the
methods `--pack-methods` run side by side on the same inputs (`pack_rows`): splitkv (ours, per-step
metadata), splitkv-fold (ours with the fa4 kernel's GQA fold on, `FA4AttentionKernel.fold_gqa`; the same as
splitkv off fa4), splitkv-old (the same op from another checkout, `--old-tree DIR`, imported under another package
name: old vs new tree in one process), turbo (Turbo-dLLM 0.1.6 `dflash_attention`, tools/peers.py: BSHD,
per-anchor context intervals; CP=2 through its own K/V or query ring, contiguous context shards) and flex (FlexAttention `mask_mod` over
`[context | block keys]`, SpecForge's formulation with sequence ids, compiled; CP=1 only). Kinds: sharegpt (the
first batch of our ShareGPT loader at that many tokens: Qwen tokenizer, chat template, next-fit packing, anchors
by `sample_anchors` on the real loss masks, the query budget --anchors shared by the conversations, LPT
placement) and one (one sequence, every token supervised). Per row: median ms of --pack-reps forward + backward
calls (interleaved round robin, max over the CP group), TF/s per GPU on useful FLOPs (context + own-block
pairs), % of dense (`benchlib.dense_sdpa_rate` at the same useful FLOPs per GPU, same process), the time over
ours. `--check` first prints each method's max abs error (out and the five gradients) vs the float64
reference on a small pack. `--peers-only` skips the --contexts rows. `--pack-profile splitkv[,splitkv-old]` adds,
after the timing, a torch.profiler table by kernel of one forward + backward of those methods at the
`--pack-profile-packs` sizes (printed, and stored as the row's "profile").

Pack rows on a GPU (the turbo rows need `pip install turbo-dllm==0.1.6` with its FA4 stack: flash-attn-4
`flash_attn.cute`, cutlass, tvm_ffi, and nvcc + ninja for its JIT-built merge kernels; the sharegpt rows need
the `data` extra). --budget-s stops new pack shapes after that many seconds (the remaining shapes, largest
last, are then missing from the table, never half-measured); about 4 minutes on one H100 / H200:
  python tools/bench_attention.py --peers-only --check --cp 1 --packs 16384,32768,65536,131072 \
      --pack-kinds sharegpt,one --pack-methods splitkv,turbo,flex --pack-reps 5 --budget-s 240 \
      --tag packs_cp1 --out out/bench
  python tools/plot_packs.py out/bench/bench_attention_packs_cp1.json --out out/bench/packs_pct_dense.png
  # two GPUs: ours vs Turbo-dLLM at CP=2, same packs
  torchrun --nproc-per-node 2 tools/bench_attention.py --peers-only --cp 2 --packs 16384,32768,65536,131072 \
      --pack-kinds sharegpt,one --pack-methods splitkv,turbo --pack-reps 5 --budget-s 240 \
      --tag packs_cp2 --out out/bench
bench_attention_packs_cp{1,2}.{json,md} hold the tables (machine, date and the command line are in the JSON's
env); docs/benchmarks.md has the measured ones.

Examples (from the repository root; no PYTHONPATH needed: the script puts the repository on sys.path):
  torchrun --nproc-per-node 2 tools/bench_attention.py --cp 1,2 --contexts 16384,32768,65536,131072
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 torchrun --nproc-per-node 2 tools/bench_attention.py --cp 2 \
      --contexts 32768,131072 --slow-path --tag slow
  python -m torch.distributed.run --standalone --nproc-per-node 2 tools/bench_attention.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import benchlib as bench  # noqa: E402
from tools import peers  # noqa: E402
from megatron_splitkv.data.anchors import anchor_candidates, sample_anchors  # noqa: E402
from megatron_splitkv.data.sharegpt import ShareGPTLoader, load_sharegpt  # noqa: E402
from megatron_splitkv.reference import dflash_attention_reference  # noqa: E402
from megatron_splitkv._ints import float_arg, int_arg, output_dir  # noqa: E402
from megatron_splitkv.comm import comm_stats, exit_process, shutdown_distributed  # noqa: E402
from megatron_splitkv.kernels import BACKENDS  # noqa: E402
from megatron_splitkv.planning import STRATEGIES  # noqa: E402


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def log(msg):
    if _rank() == 0:
        print(msg, flush=True)


def _allmax(vals, device):
    """MAX over the world of a list of floats (NaN-safe: NaN -> -inf)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return vals
    t = torch.tensor([v if v == v else float("-inf") for v in vals], dtype=torch.float64,
                     device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [x if x != float("-inf") else float("nan") for x in t.tolist()]


def _any(flag: bool, device) -> bool:
    return _allmax([1.0 if flag else 0.0], device)[0] > 0


def estimate_mem_gib(method, cp, plan, *, Hq, Hkv, D, B):
    """Rough upper estimate (GiB) of one rank's peak device memory in a row: inputs and their gradients,
    the gathered / padded / fp32 buffers of the op (per element of query rows: ~26 bytes per head-dim
    element for the gathered queries; per context key: ~40 bytes per Hkv x D element for the key-side
    buffers), plus 1 GiB. Used to skip rows that would not fit instead of running into an OOM."""
    rows_local = plan.blocks_per_rank * B
    tk_local = max(int(plan.token_index(r).shape[0]) for r in range(cp))
    total = sum(int(plan.token_index(r).shape[0]) for r in range(cp))
    q_rows = cp * rows_local if method == "splitkv" else rows_local
    keys = total if method == "allgather-kv" else tk_local
    if method == "ring-kv":
        keys = 2 * tk_local  # the shard in flight and the one computed
    b = 26.0 * q_rows * Hq * D + 40.0 * (keys + rows_local) * Hkv * D + 12.0 * rows_local * (2 * Hq + 2 * Hkv) * D
    return b / 2**30 + 1.0


def bench_row(method, cp, placement, ctx, args, dev, group, shapes, sdpa_cache):
    """One row: returns a dict (rank 0's view with cross-rank maxima)."""
    B, Hq, Hkv, D, dtype = shapes["B"], shapes["Hq"], shapes["Hkv"], shapes["D"], shapes["dtype"]
    rank = dist.get_rank(group) if group is not None else 0
    lens, anchors = bench.make_workload(ctx, args.anchors, n_seqs=args.n_seqs, seed=args.seed + ctx,
                                        mask=args.loss_mask)
    plan = bench.place(lens, anchors, cp_size=cp, strategy=placement if cp > 1 else "lpt", block_size=B)
    x = bench.rank_inputs(plan, rank, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, device=dev, seed=args.seed)
    total_pairs = bench.context_pairs(anchors, B, args.window)
    layer = layer_type(args)
    row = dict(method=method, cp=cp, placement=placement if cp > 1 else "-", context=ctx, loss_mask=args.loss_mask,
               Lq=args.anchors * B, link=("socket" if args.slow_path else ("nvlink" if dev.type == "cuda" else "gloo"))
               if cp > 1 else "-", planner_imbalance=float(plan.imbalance), total_pairs=total_pairs,
               window=args.window, causal=bool(args.causal))

    row["est_mem_gib"] = estimate_mem_gib(method, cp, plan, Hq=Hq, Hkv=Hkv, D=D, B=B)
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0] / 2**30
        over = _any(row["est_mem_gib"] > 0.85 * free, dev)
        if over:  # every rank skips together (the row's collectives must match)
            row["skipped"] = (f"estimated {row['est_mem_gib']:.1f} GiB > 85% of the free "
                              f"{free:.1f} GiB (estimate_mem_gib)")
            return row
    chunk_opt = {}  # --num-chunks / --chunk-axis: at prepare time (with metadata) or at the call (without)
    if method == "splitkv" and args.num_chunks is not None:
        chunk_opt = {"num_chunks": args.num_chunks}
    if method == "splitkv" and args.chunk_axis is not None:
        chunk_opt["chunk_axis"] = args.chunk_axis
    prep_opt = {n: v for n, v in chunk_opt.items() if bench.op_accepts(n, "prepare")}
    call_opt = {n: v for n, v in chunk_opt.items() if bench.op_accepts(n, "call")} if args.no_metadata else None
    if layer:  # the layer type: at prepare and, as the op requires it equal there, at every call
        prep_opt.update(layer)
        call_opt = {**(call_opt or {}), **layer}
    meta, prep_ms = None, 0.0
    if not args.no_metadata:
        def prep():
            return bench.prepare_meta(method, x, block_size=B, cp_group=group, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype,
                                      **prep_opt)

        prep_ms, _, _ = bench.time_fn(prep, dev, reps=3, warmup=1, group=group)
        meta = prep()
    # the chunk count this call pipelines over (splitkv; 1 elsewhere and in trees without chunks) and its axis
    axis = _chunk_axis(args.chunk_axis) if method == "splitkv" else "rows"
    k_used = int(getattr(meta, "num_chunks", 0) or 0) if meta is not None else 0
    if not k_used:
        k_used = (bench.resolve_chunks(args.num_chunks, cp, Hkv if axis == "heads" else plan.blocks_per_rank)
                  if method == "splitkv" else 1)
    row["num_chunks"], row["chunk_axis"] = k_used, axis

    def step():
        bench.run_op(method, x, block_size=B, cp_group=group, backend=args.backend, meta=meta, op_kwargs=call_opt)

    step()  # compile / warm up (and the BlockMask, cached on the metadata's mask)
    bench._sync(dev)
    base = 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    with comm_stats() as st:
        step()
    bench._sync(dev)
    t_step = _allmax([time.perf_counter() - t0], dev)[0]  # the same on every rank: equal repeat counts
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    extra = (torch.cuda.max_memory_allocated(dev) - base) / 2**30 if dev.type == "cuda" else float("nan")
    nb = [plan.blocks_per_rank] * cp
    nc = [int(plan.token_index(r).shape[0]) for r in range(cp)]
    pred = bench.predicted_bytes(method, P=cp, rank=rank, n_blocks=nb, n_ctx=nc, B=B, Hq=Hq, Hkv=Hkv, D=D,
                                 elem=torch.finfo(dtype).bits // 8, acc=8 if dtype == torch.float64 else 4,
                                 metadata=meta is not None, num_chunks=k_used)
    reps = bench.adaptive_reps(args.reps, t_step, args.row_target_s)
    kreps = bench.adaptive_reps(args.kernel_reps, t_step, args.row_target_s)
    row.update(reps=reps, kernel_reps=kreps)
    med, mn, _ = bench.time_fn(step, dev, reps=reps, warmup=1, group=group)
    # local kernel alone on this rank's calls (the op's chunks and fused own block, as the tree has them)
    calls = bench.kernel_calls(method, plan, rank, num_chunks=k_used, chunk_axis=axis, num_heads_kv=Hkv, **layer)
    kt = bench.time_kernel_calls(calls, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, device=dev, backend=args.backend,
                                 reps=kreps, warmup=1, fresh_mask=meta is None)
    my_pairs = kt["pairs"]
    bytes_by = st.bytes_by_collective
    mx = _allmax([st.total_bytes, pred, peak, extra, kt["ms"], my_pairs]
                 + [float(bytes_by.get(k, 0)) for k in ("all_gather", "reduce_scatter", "all_reduce", "send", "recv")],
                 dev)
    # the slowest rank's kernel: gather (ms, tflops) pairs and take the one with the largest ms
    kms, ktf = kt["ms"], kt["tflops"]
    if cp > 1:
        obj = [None] * cp
        dist.all_gather_object(obj, (kms, ktf, my_pairs), group=group)
        kms, ktf, _ = max(obj, key=lambda t: t[0])
        pairs_all = [o[2] for o in obj]
        row["pair_imbalance"] = max(pairs_all) / (sum(pairs_all) / cp) - 1 if sum(pairs_all) else 0.0
    else:
        row["pair_imbalance"] = 0.0
    # dense SDPA at about the slowest rank's kernel FLOPs (cached per Lk_dense)
    q_rows = calls[0].rows if calls else 0
    sd = None
    if dev.type == "cuda" and not args.no_sdpa and q_rows:
        per_call = mx[5] / max(len(calls), 1)  # ring-kv: P calls, splitkv: k chunks; SDPA sized like one
        if args.sdpa_max_lk > 0:  # dense SDPA's rate is flat in Lk beyond a few K keys: cap its size
            per_call = min(per_call, float(q_rows) * args.sdpa_max_lk)
        key = (q_rows, int(round(per_call / max(q_rows, 1) / 128)))
        if key not in sdpa_cache:
            sdpa_cache[key] = bench.dense_sdpa_rate(q_rows, per_call, Hq=Hq, D=D, dtype=dtype, device=dev,
                                                    reps=max(3, min(args.kernel_reps, 5)))
        sd = sdpa_cache[key]
    row.update(op_ms=med, op_min_ms=mn, prepare_ms=prep_ms, metadata=meta is not None, comm_bytes=mx[0], predicted_bytes=mx[1], peak_mem_gib=mx[2],
               step_extra_mem_gib=mx[3], bytes_by_collective=dict(zip(
                   ("all_gather", "reduce_scatter", "all_reduce", "send", "recv"), mx[6:])),
               kernel_ms=kms, kernel_tflops=ktf, kernel_calls=len(calls),
               op_tflops_per_gpu=bench.FWD_BWD_FACTOR * bench.fwd_flops(total_pairs, Hq, D) / med / 1e9 / cp,
               sdpa=sd, sdpa_fwdbwd_tflops=(sd or {}).get("fwdbwd_tflops"))
    del x
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _label(r):
    """Method label: splitkv rows carry their chunk count k (the merge pipeline) when k > 1, and "heads" for
    head chunks."""
    k = r.get("num_chunks", 1) or 1
    if r["method"] != "splitkv" or k == 1:
        return r["method"] + _layer_label(r)
    return f"splitkv k={k}" + (" heads" if r.get("chunk_axis") == "heads" else "") + _layer_label(r)


def _layer_label(r) -> str:
    """" W=2048 causal" for a row of a sliding-window / causal layer (--window / --causal), else ""."""
    return (f" W={r['window']}" if r.get("window") else "") + (" causal" if r.get("causal") else "")


def layer_type(args) -> dict:
    """The op's layer-type keywords of --window / --causal (window=, causal=), only those set: {} for the full
    DFlash mask (the calls then look as they did before the option)."""
    return {**({"window": args.window} if args.window is not None else {}), **({"causal": True} if args.causal else {})}


def _chunk_axis(requested):
    """The chunk axis the op uses for --chunk-axis `requested` (None: its default, SplitKVConfig.chunk_axis,
    rows); "rows" in a tree without head chunks."""
    try:
        from megatron_splitkv.ops.metadata import resolve_chunk_axis
    except ImportError:
        return "rows"
    return resolve_chunk_axis(requested)


def chunks_ab(args, dev, shapes, contexts, ks, log_row, axes=(None,)):
    """A/B of Split-KV's chunk count (and chunk axis) at CP = world (one process, side by side): for each
    context, the same inputs and plan (LPT), one prepared metadata per (k, axis) in ks x `axes` (axis None:
    the op's default; "rows" / "heads": `chunk_axis=`), every variant warmed up, checked against the first
    (out and the five gradients, relative norm; MAX over ranks) and timed round-robin
    (`bench.time_fns_interleaved`). Returns rows (method "splitkv", num_chunks k, chunk_axis, op_ms,
    ab_speedup vs the first, ab_rel_diff, comm bytes). A tree whose op has no num_chunks option gives one row
    saying so."""
    B, Hq, Hkv, D, dtype = shapes["B"], shapes["Hq"], shapes["Hkv"], shapes["D"], shapes["dtype"]
    where = bench.op_option("num_chunks")
    cp = dist.get_world_size() if dist.is_initialized() else 1
    link = ("socket" if args.slow_path else ("nvlink" if dev.type == "cuda" else "gloo"))
    if where is None or cp < 2:
        why = ("this tree's splitkv_attention / prepare_splitkv_metadata has no num_chunks option"
               if where is None else "needs CP >= 2 (run under torchrun with 2+ processes)")
        row = dict(method="splitkv", cp=cp, placement="lpt", context=0, link=link, ab=True, skipped=why)
        log_row(row)
        return [row]
    rows = []
    rank = dist.get_rank()
    group = dist.group.WORLD
    for ctx in contexts:
        t0 = time.perf_counter()
        try:
            lens, anchors = bench.make_workload(ctx, args.anchors, n_seqs=args.n_seqs, seed=args.seed + ctx,
                                                mask=args.loss_mask)
            plan = bench.place(lens, anchors, cp_size=cp, strategy="lpt", block_size=B)
            x = bench.rank_inputs(plan, rank, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, device=dev, seed=args.seed)
            metas, steps, used, variants = [], [], [], [(k, a) for k in ks for a in axes]
            for k, a in variants:
                opt = {"num_chunks": k, **({} if a is None else {"chunk_axis": a})}
                if where == "prepare":
                    m = bench.prepare_meta("splitkv", x, block_size=B, cp_group=group, Hq=Hq, Hkv=Hkv, D=D,
                                           dtype=dtype, **opt)
                    kw = None
                else:
                    m = bench.prepare_meta("splitkv", x, block_size=B, cp_group=group, Hq=Hq, Hkv=Hkv, D=D,
                                           dtype=dtype)
                    kw = opt
                metas.append(m)
                used.append((int(getattr(m, "num_chunks", k) or k), getattr(m, "chunk_axis", "rows")))
                steps.append(lambda m=m, kw=kw: bench.run_op("splitkv", x, block_size=B, cp_group=group,
                                                             backend=args.backend, meta=m, op_kwargs=kw))
            results, comm, peaks = [], [], []
            for fn in steps:  # warm up (compiles), results for the cross-check, bytes, peak memory
                fn()
                bench._sync(dev)
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                with comm_stats() as st:
                    out = fn()
                bench._sync(dev)
                peaks.append(torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan"))
                results.append([out.detach().float()] + [x[n].grad.detach().float()
                                                         for n in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")])
                comm.append((st.total_bytes, len(st.records)))
            bench._sync(dev)
            diffs = []
            for res in results:
                d = max(bench.rel_err(a, b) for a, b in zip(res, results[0]))
                diffs.append(d)
            diffs = _allmax(diffs, dev)
            timed = bench.time_fns_interleaved(steps, dev, reps=max(args.reps, 5), warmup=1, group=group)
            del results
            for (k, _), (ku, au), (med, mn, _), d, (nbytes, nrec), pk in zip(variants, used, timed, diffs, comm,
                                                                              peaks):
                mx = _allmax([float(nbytes), float(nrec), pk], dev)
                rows.append(dict(method="splitkv", cp=cp, placement="lpt", context=ctx, link=link, ab=True,
                                 num_chunks_requested=k, num_chunks=ku, chunk_axis=au, op_ms=med, op_min_ms=mn,
                                 ab_speedup=timed[0][0] / med if med > 0 else float("nan"), ab_rel_diff=d,
                                 comm_bytes=mx[0], comm_records=int(mx[1]), peak_mem_gib=mx[2], Lq=args.anchors * B,
                                 wall_s=time.perf_counter() - t0))
                log_row(rows[-1])
            del x, metas, steps
        except Exception as e:  # noqa: BLE001
            rows.append(dict(method="splitkv", cp=cp, placement="lpt", context=ctx, link=link, ab=True,
                             error=f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=3)))
            log_row(rows[-1])
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------ packs and peers
#: methods of the pack rows (--pack-methods): ours, ours from another tree (--old-tree), Turbo-dLLM 0.1.6,
#: FlexAttention mask_mod (tools/peers.py)
PACK_METHODS = ("splitkv", "splitkv-fold", "splitkv-old", "turbo", "flex")
#: the name the --old-tree package is imported under (`load_old_tree`)
OLD_PACKAGE = "megatron_splitkv_old"


def load_old_tree(path: str):
    """The `megatron_splitkv` package of another checkout (`path`/megatron_splitkv, e.g. the tree before a
    change), imported under the name `OLD_PACKAGE` next to this tree's package, so that the same process times
    both ops on the same inputs (the `splitkv-old` pack method). The op's modules import each other relatively,
    so the old op runs the old code end to end (its kernels, metadata and merge). Raises ValueError when
    `path` has no megatron_splitkv/__init__.py."""
    init = os.path.join(os.path.abspath(path), "megatron_splitkv", "__init__.py")
    if not os.path.isfile(init):
        raise ValueError(f"--old-tree {path!r}: no megatron_splitkv/__init__.py there")
    if OLD_PACKAGE in sys.modules:
        return sys.modules[OLD_PACKAGE]
    spec = importlib.util.spec_from_file_location(OLD_PACKAGE, init, submodule_search_locations=[os.path.dirname(init)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[OLD_PACKAGE] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception:
        del sys.modules[OLD_PACKAGE]
        raise
    return mod


def old_meta(old, x, *, block_size, group, Hq, Hkv, D, dtype):
    """`prepare_splitkv_metadata` of the --old-tree package on `x` (as `benchlib.prepare_meta`)."""
    return old.prepare_splitkv_metadata(x["q_seq"], x["q_anchor"], x["kv_seq"], x["kv_pos"], block_size=block_size,
                                        num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=dtype, cp_group=group,
                                        impl="splitkv", device=x["q"].device, group_check=False)
#: pack kinds (--pack-kinds): real ShareGPT packs, or one sequence of the same length
PACK_KINDS = ("sharegpt", "one")
#: the positional inputs of the ops and of the reference, in order
OP_ARGS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk", "q_seq", "q_anchor", "kv_seq", "kv_pos")
_GRADS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")


def split_budget(n_cand, budget: int) -> np.ndarray:
    """Anchors per sequence for a query budget shared by a pack: as even as possible, capped by each
    sequence's candidate count, the leftover of short sequences handed to the others (water filling).
    Returns [n_seq] int64 summing to min(budget, sum(n_cand))."""
    n_cand = np.asarray(n_cand, dtype=np.int64)
    take = np.zeros_like(n_cand)
    left = int(budget)
    while left > 0:
        open_ = np.nonzero(take < n_cand)[0]
        if open_.size == 0:
            break
        share = max(left // open_.size, 1)
        for j in open_.tolist():
            add = min(share, int(n_cand[j] - take[j]), left)
            take[j] += add
            left -= add
            if left == 0:
                break
    return take


def pack_workload(kind: str, tokens: int, n_anchors: int, *, seed: int, limit=None, corpus=None):
    """The sequences and anchors of one pack of `tokens` tokens.

    kind "sharegpt": the first batch of our ShareGPT loader (`data.ShareGPTLoader(max_tokens=tokens, seed=)`:
    Qwen chat template and tokenizer, next-fit packing of conversations), its anchors drawn by
    `data.anchors.sample_anchors` on each conversation's real loss mask, the query budget `n_anchors` shared
    by the pack's conversations (`split_budget`: the fixed query length Lq = n_anchors * B of DESIGN.md
    section 1). `limit`: the loader's small-data mode (first `limit` conversations); `corpus`: a loaded
    `TokenizedCorpus`. kind "one": one sequence of `tokens` tokens, every token supervised
    (`benchlib.make_workload`). Returns (seq_lens [n_seq] int64, anchors: list of sorted int64 arrays).
    """
    if kind == "one":
        return bench.make_workload(tokens, n_anchors, n_seqs=1, seed=seed)
    if kind != "sharegpt":
        raise ValueError(f"pack kind must be one of {PACK_KINDS}, got {kind!r}")
    batch = next(iter(ShareGPTLoader(max_tokens=tokens, num_anchors=n_anchors, seed=seed, limit=limit,
                                     corpus=corpus)))
    masks = np.split(batch.loss_mask, np.cumsum(batch.seq_lens)[:-1])
    counts = split_budget([anchor_candidates(m).shape[0] for m in masks], n_anchors)
    rng = np.random.default_rng([seed, tokens])
    return batch.seq_lens, [sample_anchors(m, int(n), rng=rng) for m, n in zip(masks, counts)]


def useful_pairs(anchors, block_size: int) -> float:
    """Visible (query row, key) pairs of a pack: context (B * anchor per block: the tokens before it) plus
    own block (B * B per block); padding blocks have none."""
    n_blocks = sum(int(a.shape[0]) for a in anchors)
    return float(block_size * sum(int(a.sum()) for a in anchors) + block_size * block_size * n_blocks)


def _leaves(tensors: dict) -> dict:
    """Floating tensors of `tensors` as fresh leaves with requires_grad (the layout conversion of a peer's
    inputs is done once, outside the timed call); the others as they are."""
    return {n: (t.detach().clone().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t)
            for n, t in tensors.items()}


def _peer_step(method, x, *, block_size, backend, meta=None, group=None, ti=None, fi=None, fbm=None,
               turbo_kw=None):
    """One forward + backward (with x["dout"]) of `method` on prepared inputs: ours on `x` (+ `meta`), Turbo
    on `ti` (`_leaves(turbo_inputs(...))`, `turbo_kw` for CP > 1), flex on `fi` (`_flex_leaves`) with its
    BlockMask `fbm`. Returns out [Tq, Hq, D]; the gradients are on the leaves."""
    if method in ("splitkv", "splitkv-fold"):
        with _fa4_fold(method == "splitkv-fold", x["q"].device, x["q"].dtype, backend):
            return bench.run_op("splitkv", x, block_size=block_size, cp_group=group, backend=backend, meta=meta)
    if method == "splitkv-old":
        for n in _GRADS:
            x[n].grad = None
        old = sys.modules[OLD_PACKAGE]
        args = [x[n] for n in OP_ARGS]
        if meta is not None:
            out = old.splitkv_attention(*args[:5], None, None, None, None, metadata=meta, backend=backend)
        else:
            out = old.splitkv_attention(*args, block_size=block_size, cp_group=group, backend=backend)
        out.backward(x["dout"])
        return out
    leaves = ti if method == "turbo" else fi
    for t in leaves.values():
        if torch.is_tensor(t) and t.requires_grad:
            t.grad = None
    if method == "turbo":
        out = peers.turbo_peer(ti, block_size=block_size, **(turbo_kw or {}))
    else:
        out = peers.flex_peer(fi["_fi"], fbm)
    out.backward(x["dout"])
    return out


@contextlib.contextmanager
def _fa4_fold(on: bool, device, dtype, backend):
    """Run the block with the cached fa4 kernel's GQA fold on or off (`FA4AttentionKernel.fold_gqa`, read at
    every call), then restore it: the pack methods splitkv / splitkv-fold time both on the same inputs in one
    process. A no-op unless `backend` is "fa4" (the fold is the fa4 kernel's)."""
    if backend != "fa4":
        yield
        return
    from megatron_splitkv.kernels import get_kernel

    kern = get_kernel("fa4", device, dtype)
    prev, kern.fold_gqa = kern.fold_gqa, on
    try:
        yield
    finally:
        kern.fold_gqa = prev


def _flex_leaves(x, B):
    fi = peers.flex_inputs(*[x[n].detach() for n in OP_ARGS], block_size=B)
    lv = _leaves(dict(q=fi.q, k=fi.k, v=fi.v))
    fi.q, fi.k, fi.v = lv["q"], lv["k"], lv["v"]
    return dict(lv, _fi=fi)


def cached_pack_workload(path, kind, tokens, n_anchors, *, seed, limit=None, corpus=None):
    """`pack_workload`, read from the JSON file `path` when it holds this pack (key: kind, tokens, n_anchors,
    seed, limit), else built and added to it (`path` None: always built). Lets a machine without the ShareGPT
    data and tokenizer run the sharegpt rows with the packs built elsewhere. `corpus`: a loaded corpus or a
    callable returning one (called only when a pack must be built)."""
    key = json.dumps([kind, tokens, n_anchors, seed, limit])
    table = {}
    if path and os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    if key in table:
        lens, anchors = table[key]
        return np.asarray(lens, dtype=np.int64), [np.asarray(a, dtype=np.int64) for a in anchors]
    lens, anchors = pack_workload(kind, tokens, n_anchors, seed=seed, limit=limit,
                                  corpus=corpus() if callable(corpus) else corpus)
    if path:
        table[key] = [np.asarray(lens).tolist(), [np.asarray(a).tolist() for a in anchors]]
        with open(path, "w") as f:
            json.dump(table, f)
    return lens, anchors


def pack_rows(kind, tokens, cp, methods, args, dev, group, shapes, corpus=None):
    """The rows of one pack shape: every method of `methods` timed side by side (`time_fns_interleaved`,
    median of --pack-reps forward + backward calls, max over the CP group), each with useful TF/s per GPU
    and % of dense (`benchlib.dense_sdpa_rate` at the same useful FLOPs per GPU, same process). CP=1: the
    same tensors for all methods (the planner's layout, `benchlib.rank_inputs`); CP > 1 (splitkv, turbo):
    the same pack, queries split by the planner; Turbo's context in its own contiguous ring layout."""
    B, Hq, Hkv, D, dtype = shapes["B"], shapes["Hq"], shapes["Hkv"], shapes["D"], shapes["dtype"]
    rank = dist.get_rank(group) if group is not None and cp > 1 else 0
    lens, anchors = cached_pack_workload(args.pack_cache, kind, tokens, args.anchors, seed=args.seed,
                                         limit=args.pack_limit, corpus=corpus)
    plan = bench.place(lens, anchors, cp_size=cp, strategy="lpt", block_size=B)
    x = bench.rank_inputs(plan, rank, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, device=dev, seed=args.seed)
    pairs = useful_pairs(anchors, B)
    base = dict(kind=kind, tokens=tokens, cp=cp, n_seqs=int(len(lens)), n_blocks=int(sum(a.shape[0] for a in anchors)),
                Lq=args.anchors * B, useful_pairs=pairs)
    skipped = [dict(base, method=m, skipped="CUDA only (no CPU backward)") for m in methods
               if not m.startswith("splitkv") and dev.type != "cuda"]
    skipped += [dict(base, method="flex", skipped="the peer runs at CP=1 only")
                for m in methods if m == "flex" and cp > 1 and dev.type == "cuda"]
    methods = [m for m in methods if (m.startswith("splitkv") or dev.type == "cuda") and (cp == 1 or m != "flex")]
    steps, prep = {}, {}
    for m in methods:
        t0 = time.perf_counter()
        if m in ("splitkv", "splitkv-fold"):
            meta = bench.prepare_meta("splitkv", x, block_size=B, cp_group=group, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
            steps[m] = lambda meta=meta, m=m: _peer_step(m, x, block_size=B, backend=args.backend, meta=meta,
                                                         group=group)
        elif m == "splitkv-old":
            meta = old_meta(sys.modules[OLD_PACKAGE], x, block_size=B, group=group, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
            steps[m] = lambda meta=meta: _peer_step("splitkv-old", x, block_size=B, backend=args.backend, meta=meta,
                                                    group=group)
        elif m == "turbo":
            peers.turbo_enable_jit()
            if cp == 1:
                ti = _leaves(peers.turbo_inputs(*[x[n] for n in OP_ARGS], block_size=B))
                kw = {}
            else:  # the whole pack's context, same seed on every rank, Turbo's contiguous shard of it
                g = torch.Generator(device=dev).manual_seed(args.seed + 17)
                T = int(lens.sum())
                kg = torch.randn((T, Hkv, D), generator=g, device=dev).to(dtype)
                vg = torch.randn((T, Hkv, D), generator=g, device=dev).to(dtype)
                seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.as_tensor(lens, device=dev))
                pos = torch.arange(T, device=dev) - torch.repeat_interleave(
                    torch.as_tensor(np.concatenate([[0], np.cumsum(lens)[:-1]]), device=dev),
                    torch.as_tensor(lens, device=dev))
                full = peers.turbo_inputs(x["q"], kg, vg, x["k_blk"], x["v_blk"], x["q_seq"], x["q_anchor"], seq, pos,
                                          block_size=B)
                gk, gv, owners = peers.turbo_shard(full, rank, cp)
                ti = _leaves(dict(full, global_key=gk, global_value=gv))
                kw = dict(runtime=peers.turbo_runtime(group, rank, range(cp)), intervals_by_owner=owners,
                          global_anchor_count=int(plan.q_seq.shape[0]))
            steps[m] = lambda ti=ti, kw=kw: _peer_step("turbo", x, block_size=B, backend=None, ti=ti, turbo_kw=kw)
        else:
            fi = _flex_leaves(x, B)
            fbm = peers.flex_block_mask(fi["_fi"])
            steps[m] = lambda fi=fi, fbm=fbm: _peer_step("flex", x, block_size=B, backend=None, fi=fi, fbm=fbm)
        bench._sync(dev)
        prep[m] = (time.perf_counter() - t0) * 1e3
    names = list(steps)
    timed = bench.time_fns_interleaved([steps[n] for n in names], dev, reps=args.pack_reps, warmup=2,
                                       group=group if cp > 1 else None)
    flops = bench.FWD_BWD_FACTOR * bench.fwd_flops(pairs, Hq, D) / cp
    dense = (bench.dense_sdpa_rate(args.anchors * B, pairs / cp, Hq=Hq, D=D, dtype=dtype, device=dev,
                                   reps=args.pack_reps) if dev.type == "cuda" else None)
    rows = []
    for n, (med, mn, _) in zip(names, timed):
        tf = flops / med / 1e9 if med > 0 else float("nan")
        row = dict(base, method=n, op_ms=med, op_min_ms=mn, prep_ms=prep[n], tflops_per_gpu=tf)
        if dense is not None:
            row.update(dense_lk=dense["lk"], dense_ms=dense["fwdbwd_ms"], dense_tflops=dense["fwdbwd_tflops"],
                       pct_dense=100.0 * tf / dense["fwdbwd_tflops"])
        if n in args._pack_profile_methods and tokens in args._pack_profile_tokens:
            row["profile"] = profile_step(steps[n], dev, rows=args.pack_profile_rows)
            log(f"[profile] {kind} {tokens} CP={cp} {n}: one forward + backward, by kernel\n{row['profile']}")
        rows.append(row)
    return rows + skipped


def profile_step(step, dev, rows: int = 25) -> str:
    """torch.profiler table of one call of `step` (after the timed calls: warm), its kernels sorted by their own
    device time (CPU ops by their own CPU time off CUDA): where a pack's op time goes, kernel by kernel."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    bench._sync(dev)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        t_issue = time.perf_counter() - t0
        bench._sync(dev)
        t_wall = time.perf_counter() - t0
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    avg = prof.key_averages()
    dev_ms = sum(e.self_device_time_total for e in avg) / 1e3
    n_kernels = sum(e.count for e in avg if e.self_device_time_total > 0)
    head = (f"wall {1e3 * t_wall:.2f} ms (profiled), host issue {1e3 * t_issue:.2f} ms (until the step returned), "
            f"device kernels {dev_ms:.2f} ms in {n_kernels} launches\n")
    return head + avg.table(sort_by=key, row_limit=rows, max_name_column_width=70)


def check_peers(methods, *, dev, backend, dtype=torch.bfloat16, seed=0):
    """Max abs error of every method's out and five gradients vs the float64 reference on a small pack
    (3 sequences, 1,000 tokens, 24 anchors, B 16, Hq 4, Hkv 2, D 128), CP = 1. Returns {method: error or
    a string saying why it did not run} (turbo: CUDA only; flex: no CPU backward, forward error only)."""
    B, Hq, Hkv, D = 16, 4, 2, 128
    lens, anchors = bench.make_workload(1000, 24, n_seqs=3, seed=seed)
    plan = bench.place(lens, anchors, cp_size=1, strategy="lpt", block_size=B)
    x = bench.rank_inputs(plan, 0, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, device=dev, seed=seed)
    leaves = {n: x[n].detach().cpu().double().requires_grad_() for n in _GRADS}
    ref, _ = dflash_attention_reference(*[leaves.get(n, x[n].cpu()) for n in OP_ARGS], block_size=B)
    ref.backward(x["dout"].detach().cpu().double())
    want = [ref.detach()] + [leaves[n].grad for n in _GRADS]
    errs = {}
    for m in methods:
        try:
            if m == "turbo" and dev.type != "cuda":
                errs[m] = "skipped: CUDA only"
                continue
            if m == "flex" and dev.type != "cuda":
                with torch.no_grad():
                    out = peers.flex_peer(peers.flex_inputs(*[x[n].detach() for n in OP_ARGS], block_size=B))
                errs[m + " (forward only: no CPU backward)"] = float((out.double().cpu() - want[0]).abs().max())
                continue
            if m.startswith("splitkv"):
                out = _peer_step(m, x, block_size=B, backend=backend)
                got = [out] + [x[n].grad for n in _GRADS]
            elif m == "turbo":
                peers.turbo_enable_jit()
                ti = _leaves(peers.turbo_inputs(*[x[n] for n in OP_ARGS], block_size=B))
                out = _peer_step("turbo", x, block_size=B, backend=None, ti=ti)
                kc = torch.empty_like(ti["global_key"][0])
                vc = torch.empty_like(kc)
                kc[ti["order"]] = ti["global_key"].grad[0]  # back to our key order
                vc[ti["order"]] = ti["global_value"].grad[0]
                got = [out, ti["query"].grad[0], kc, vc, ti["local_key"].grad[0], ti["local_value"].grad[0]]
            else:
                fi = _flex_leaves(x, B)
                out = _peer_step("flex", x, block_size=B, backend=None, fi=fi, fbm=peers.flex_block_mask(fi["_fi"]))
                Tk = x["k_ctx"].shape[0]
                dk, dv = fi["k"].grad[0].transpose(0, 1), fi["v"].grad[0].transpose(0, 1)
                got = [out, fi["q"].grad[0].transpose(0, 1), dk[:Tk], dv[:Tk], dk[Tk:], dv[Tk:]]
            errs[m] = max(float((g.detach().double().cpu() - w).abs().max()) for g, w in zip(got, want))
        except Exception as e:  # noqa: BLE001 - report per method
            errs[m] = f"error: {type(e).__name__}: {e}"
    return errs


def pack_table(rows, cpu=False) -> str:
    """Markdown table of the pack rows (ms, useful TF/s per GPU, % of dense, speedups vs splitkv)."""
    hdr = ["pack", "tokens", "seqs", "CP", "method", "op ms (median)", "prep ms", "TF/s/GPU", "dense TF/s",
           "% of dense", "splitkv speedup"]
    ours = {(r["kind"], r["tokens"], r["cp"]): r["op_ms"] for r in rows
            if r.get("method") == "splitkv" and "op_ms" in r}
    out = []
    for r in rows:
        if "error" in r or "skipped" in r:
            what = ("ERROR " + r["error"].strip().splitlines()[-1][:80]) if "error" in r else "SKIPPED " + r["skipped"]
            out.append([r["kind"], r["tokens"], r.get("n_seqs", ""), r["cp"], r.get("method", ""), what] + [""] * 5)
            continue
        o = ours.get((r["kind"], r["tokens"], r["cp"]))
        out.append([r["kind"], r["tokens"], r["n_seqs"], r["cp"], r["method"], f"{r['op_ms']:.2f}",
                    f"{r['prep_ms']:.1f}", bench.gpu_cell(cpu, r["tflops_per_gpu"], "{:.0f}"),
                    bench.gpu_cell(cpu, r.get("dense_tflops"), "{:.0f}"),
                    bench.gpu_cell(cpu, r.get("pct_dense"), "{:.0f}%"),
                    f"{r['op_ms'] / o:.2f}x" if o else "-"])
    note = (f"\nForward + backward of one attention layer on packs (sharegpt: our ShareGPT loader's first "
            f"batch, the query budget shared by its conversations; one: one sequence); Lq = anchors x B, Hq 32, "
            f"Hkv 8, D 128, bf16 (smoke: tiny). TF/s per GPU: useful FLOPs = {bench.FWD_BWD_FACTOR} x 4 x "
            f"(context + own-block pairs) x Hq x D / CP; % of dense: vs dense SDPA at the same useful FLOPs per "
            f"GPU, same process. splitkv speedup: the method's time over ours (> 1: ours faster). turbo: "
            f"Turbo-dLLM 0.1.6 dflash_attention; flex: FlexAttention mask_mod over [context | block keys] "
            f"(SpecForge's formulation), compiled.")
    return bench.md_table(hdr, out) + note + ("\n\n" + CPU_NOTE if cpu else "")


#: the note under a --cpu-smoke run's tables
CPU_NOTE = (f"CPU smoke run (--cpu-smoke: tiny shapes, gloo): TF/s and peak GPU memory are GPU measures and read "
            f"{bench.NA_CPU}; the ms columns only show that each row ran, not its speed.")


def ab_table(rows, slow, cpu=False):
    """Markdown table of the chunk-count A/B rows (cpu: a --cpu-smoke run, GPU measures read n/a (CPU))."""
    hdr = ["link", "CP", "context", "num_chunks", "chunk axis", "op ms (median)", "speedup vs first",
           "max rel. diff vs first", "comm / rank", "collectives", "peak GiB"]
    out = []
    for r in rows:
        if "error" in r or "skipped" in r:
            what = ("ERROR " + r["error"].strip().splitlines()[-1][:80]) if "error" in r else "SKIPPED " + r["skipped"]
            out.append([r.get("link", ""), r["cp"], r.get("context", ""), "", "", what, "", "", "", "", ""])
            continue
        out.append([r["link"], r["cp"], r["context"], r["num_chunks"], r.get("chunk_axis", "rows"), f"{r['op_ms']:.2f}",
                    f"{r['ab_speedup']:.3f}x", f"{r['ab_rel_diff']:.1e}", bench.fmt_bytes(r["comm_bytes"]),
                    r["comm_records"], bench.gpu_cell(cpu, r.get("peak_mem_gib"))])
    note = ("\nSplit-KV merge pipeline, chunk counts side by side in one process (same inputs, LPT placement; "
            "timed round-robin, median, max over ranks); diff: out and the five gradients vs the first "
            "chunk count (bf16 results; reassociation only); peak: torch.cuda.max_memory_allocated during one "
            "step (absolute, max over ranks; the other variants' inputs and results are resident too).")
    if slow:
        note += " link socket: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1."
    return bench.md_table(hdr, out) + "\n" + note


def table(rows, slow, cpu=False):
    """Markdown table of the bench rows, with a note stating the conventions (cpu: a --cpu-smoke run, GPU
    measures read n/a (CPU) and the note says so)."""
    hdr = ["method", "CP", "placement", "link", "context", "op ms (median)", "prep ms", "comm / rank", "peak GiB",
           "kernel ms", "kernel TF/s", "SDPA TF/s", "op TF/s/GPU", "pair imb.", "planner imb."]
    out = []
    for r in rows:
        if "error" in r or "skipped" in r:
            what = ("ERROR " + r["error"].strip().splitlines()[-1][:60]) if "error" in r else "SKIPPED " + r["skipped"]
            out.append([_label(r), r["cp"], r.get("placement", ""), r.get("link", ""), r["context"], what] + [""] * 9)
            continue
        out.append([_label(r), r["cp"], r["placement"], r["link"], r["context"], f"{r['op_ms']:.2f}",
                    f"{r['prepare_ms']:.2f}" if r.get("metadata") else "-",
                    bench.fmt_bytes(r["comm_bytes"]) + ("" if r["comm_bytes"] == r["predicted_bytes"] else
                                                        f" (model {bench.fmt_bytes(r['predicted_bytes'])})"),
                    bench.gpu_cell(cpu, r["peak_mem_gib"]), f"{r['kernel_ms']:.2f}",
                    bench.gpu_cell(cpu, r["kernel_tflops"], "{:.0f}"),
                    bench.gpu_cell(cpu, r.get("sdpa_fwdbwd_tflops"), "{:.0f}"),
                    bench.gpu_cell(cpu, r["op_tflops_per_gpu"], "{:.0f}"),
                    f"{100 * r['pair_imbalance']:.1f}%", f"{100 * r['planner_imbalance']:.2f}%"])
    note = (f"\nForward + backward of one attention layer; Lq = 512 x 16, Hq 32, Hkv 8, D 128, bf16 (smoke: tiny). "
            f"TF/s: useful FLOPs, fwd+bwd = {bench.FWD_BWD_FACTOR} x 4 x pairs x Hq x D. kernel: slowest rank's local "
            f"kernel calls alone; SDPA: dense attention at about the same FLOPs. comm: comm_stats bytes per rank "
            f"(send + receive, ring convention; max over ranks).")
    if slow:
        note += " link socket: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (inter-node stand-in)."
    if cpu:
        note += "\n\n" + CPU_NOTE
    return bench.md_table(hdr, out) + "\n" + note


def check_args(ap, args):
    """Validate the flags up front (argparse error, exit 2, naming the flag). Returns (cps, contexts,
    methods, placements)."""
    cps = bench.int_list_arg(ap, "--cp", args.cp, 1)
    contexts = bench.int_list_arg(ap, "--contexts", args.contexts, 2)
    methods = bench.choices_arg(ap, "--methods", args.methods, bench.METHODS, "method")
    placements = bench.choices_arg(ap, "--placements", args.placements, STRATEGIES, "placement")
    if args.backend not in BACKENDS:
        ap.error(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    for flag in ("anchors", "n_seqs", "reps", "kernel_reps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.n_seqs > min(contexts):
        ap.error(f"--n-seqs {args.n_seqs} must be <= the smallest --contexts value {min(contexts)} (a sequence "
                 "holds at least one token)")
    if not args.budget_s >= 0:
        ap.error(f"--budget-s must be >= 0, got {args.budget_s}")
    if not args.row_target_s >= 0:
        ap.error(f"--row-target-s must be >= 0, got {args.row_target_s}")
    if args.sdpa_max_lk < 0:
        ap.error(f"--sdpa-max-lk must be >= 0, got {args.sdpa_max_lk}")
    if args.num_chunks is not None and args.num_chunks < 1:
        ap.error(f"--num-chunks must be >= 1, got {args.num_chunks}")
    if (args.window is not None or args.causal) and (args.packs or args.chunks_ab):
        ap.error("--window / --causal apply to the --contexts rows only, not to --packs or --chunks-ab")
    args._ab = bench.int_list_arg(ap, "--chunks-ab", args.chunks_ab, 1) if args.chunks_ab else []
    args._ab_axes = (bench.choices_arg(ap, "--chunk-axis-ab", args.chunk_axis_ab, ("rows", "heads"), "chunk axis")
                     if args.chunk_axis_ab else [args.chunk_axis])
    args._ab_contexts = bench.int_list_arg(ap, "--ab-contexts", args.ab_contexts, 2)
    args._packs = bench.int_list_arg(ap, "--packs", args.packs, 64) if args.packs else []
    args._pack_kinds = bench.choices_arg(ap, "--pack-kinds", args.pack_kinds, PACK_KINDS, "pack kind")
    args._pack_methods = bench.choices_arg(ap, "--pack-methods", args.pack_methods, PACK_METHODS, "method")
    args._pack_profile_methods = (bench.choices_arg(ap, "--pack-profile", args.pack_profile, args._pack_methods,
                                                    "method of --pack-methods") if args.pack_profile else [])
    args._pack_profile_tokens = bench.int_list_arg(ap, "--pack-profile-packs", args.pack_profile_packs, 64)
    if ("splitkv-old" in args._pack_methods) != bool(args.old_tree):
        ap.error("--pack-methods splitkv-old and --old-tree DIR go together (the old tree's op is that method)")
    if args.old_tree:
        try:
            load_old_tree(args.old_tree)
        except ValueError as e:
            ap.error(str(e))
    if args.pack_reps < 1:
        ap.error(f"--pack-reps must be >= 1, got {args.pack_reps}")
    if args.pack_limit is not None and args.pack_limit < 1:
        ap.error(f"--pack-limit must be >= 1, got {args.pack_limit}")
    args._cp1_methods = (bench.choices_arg(ap, "--cp1-methods", args.cp1_methods, bench.METHODS, "method")
                         if args.cp1_methods else methods)
    args._alt_methods = (bench.choices_arg(ap, "--alt-placement-methods", args.alt_placement_methods, bench.METHODS,
                                           "method") if args.alt_placement_methods else methods)
    return cps, contexts, methods, placements


def main(argv=None):
    """CLI (see the module docstring). Returns the rows (rank 0 writes JSON + markdown)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="16384,32768,65536,131072", help="total context tokens, comma list")
    ap.add_argument("--cp", default="1,2", help="CP sizes (each <= world size), comma list")
    ap.add_argument("--methods", default="splitkv,allgather-kv,ring-kv")
    ap.add_argument("--placements", default="lpt,zigzag", help="planner strategies for CP > 1")
    ap.add_argument("--cp1-methods", default="",
                    help="methods of the CP=1 rows (default: --methods; at CP=1 the three ops do the same kernel "
                         "work, so 'splitkv' alone is the one-GPU reference)")
    ap.add_argument("--alt-placement-methods", default="",
                    help="methods that also run the placements after the first (default: --methods; "
                         "allgather-kv's compute does not depend on the context placement)")
    bench.add_workload_args(ap, reps=10)
    ap.add_argument("--kernel-reps", type=int_arg(1), default=5)
    ap.add_argument("--backend", default="auto", help="local kernel backend (auto: fa4 where installed, else flex on CUDA)")
    ap.add_argument("--slow-path", action="store_true",
                    help="label rows link=socket; launch with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1")
    ap.add_argument("--no-metadata", action="store_true",
                    help="call the ops without per-step metadata (validation, metadata gathers and the "
                         "BlockMask build in every call); default: prepare_splitkv_metadata once, reuse it")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the dense SDPA reference")
    ap.add_argument("--sdpa-max-lk", type=int_arg(0), default=0,
                    help="cap the dense SDPA reference at this many keys per query row (its rate is flat in Lk "
                         "beyond a few K; saves time at 256K+ contexts); 0 = no cap")
    ap.add_argument("--row-target-s", type=float_arg(0), default=0.0,
                    help="time each row's op (and kernel) loop for about this many seconds: repeats = "
                         "clip(target / one step, 3, --reps); 0 = always --reps")
    ap.add_argument("--num-chunks", type=int_arg(1), default=None,
                    help="splitkv: chunk count of the merge pipeline (prepare_splitkv_metadata(num_chunks=)); "
                         "default: the op's own default")
    ap.add_argument("--window", type=int_arg(1), default=None,
                    help="sliding window W of the drafter layer (every --contexts row runs windowed; default: none)")
    ap.add_argument("--causal", action="store_true",
                    help="causal own block (dflash's sliding_attention layers are causal; default: bidirectional)")
    ap.add_argument("--chunk-axis", default=None, choices=("rows", "heads"),
                    help="splitkv: what the chunks split (prepare_splitkv_metadata(chunk_axis=)): rows (query blocks) "
                         "or heads (all rows, Hq / k and Hkv / k heads per chunk); default: the op's own "
                         "(SplitKVConfig.chunk_axis, rows)")
    ap.add_argument("--chunk-axis-ab", default="",
                    help="with --chunks-ab: chunk axes to compare side by side, comma list (e.g. rows,heads: every "
                         "chunk count with each axis); default: --chunk-axis")
    ap.add_argument("--chunks-ab", default="",
                    help="after the rows: A/B of splitkv chunk counts at CP = world, e.g. 1,2,4 (needs an op "
                         "with num_chunks; otherwise one row says so)")
    ap.add_argument("--ab-contexts", default="131072", help="contexts of the --chunks-ab A/B, comma list")
    ap.add_argument("--ab-reserve-s", type=float_arg(0), default=0.0,
                    help="with --chunks-ab and --budget-s: the rows stop starting at --budget-s minus this, "
                         "leaving it to the A/B (which always runs, after the rows)")
    ap.add_argument("--packs", default="",
                    help="pack rows: tokens per pack, comma list (e.g. 16384,32768,65536,131072); every --pack-kinds "
                         "kind x --pack-methods method side by side, with %% of dense; default: none")
    ap.add_argument("--pack-kinds", default="sharegpt,one",
                    help="pack kinds: sharegpt (our ShareGPT loader's packs) and/or one (one sequence)")
    ap.add_argument("--pack-methods", default="splitkv,turbo,flex",
                    help="methods of the pack rows: splitkv (ours), turbo (Turbo-dLLM 0.1.6 dflash_attention), "
                         "flex (FlexAttention mask_mod peer, CP=1 only)")
    ap.add_argument("--pack-reps", type=int_arg(1), default=5, help="timed forward + backward calls per pack method")
    ap.add_argument("--pack-profile", default="",
                    help="after timing, profile one forward + backward of these pack methods (comma list, e.g. "
                         "splitkv,splitkv-old) with torch.profiler and print / store its table by kernel")
    ap.add_argument("--pack-profile-packs", default="16384",
                    help="with --pack-profile: the pack sizes (tokens, comma list) to profile")
    ap.add_argument("--pack-profile-rows", type=int_arg(1), default=25, help="kernels per --pack-profile table")
    ap.add_argument("--old-tree", default=None,
                    help="another checkout's root (its megatron_splitkv/ package, e.g. the tree before a change, "
                         "`git archive OLD megatron_splitkv | tar -x -C DIR`): its op is the pack method splitkv-old, "
                         "timed side by side with this tree's in the same process")
    ap.add_argument("--pack-limit", type=int_arg(1), default=None,
                    help="ShareGPT small-data mode: pack from the first N conversations only (default: all)")
    ap.add_argument("--cache-dir", default=None,
                    help="tokenized ShareGPT cache directory (whole corpus; default ~/.cache/megatron_splitkv)")
    ap.add_argument("--fa4-fold", action="store_true",
                    help="run the fa4 kernel with the GQA fold (kernels.fa4.FOLD_GQA; off by default until measured)")
    ap.add_argument("--pack-cache", default=None,
                    help="JSON file of pack workloads (sequence lengths, anchors): packs it holds are read from it, "
                         "the others built and added (run once where the ShareGPT data is installed, then carry it)")
    ap.add_argument("--peers-only", action="store_true",
                    help="skip the --contexts rows (only --check and the --packs rows)")
    ap.add_argument("--check", action="store_true",
                    help="before timing: max abs error of each --pack-methods method (out and gradients) vs the "
                         "float64 reference on a small pack, printed and stored as check in the JSON")
    ap.add_argument("--budget-s", type=float_arg(0), default=0.0, help="start no new row after this many seconds")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--out", type=output_dir, default=os.environ.get("OUT") or os.path.join(ROOT, "out", "bench"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, gloo (tests)")
    args = ap.parse_args(argv)
    cps, contexts, methods, placements = check_args(ap, args)
    if args.fa4_fold:  # before any kernel instance exists (get_kernel caches them)
        from megatron_splitkv.kernels import fa4 as fa4_kernel

        fa4_kernel.FOLD_GQA = True

    t_start = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu_smoke:
        dev = torch.device("cpu")
        shapes = dict(B=4, Hq=4, Hkv=2, D=16, dtype=torch.bfloat16)
        if args.contexts == ap.get_default("contexts"):
            args.contexts = "512,1024"
            contexts = [512, 1024]
        if args.anchors == ap.get_default("anchors"):
            args.anchors = 16
        args.reps, args.kernel_reps = min(args.reps, 2), min(args.kernel_reps, 1)
        if args.backend == "auto":
            args.backend = "math"
        backend = "gloo"
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --cpu-smoke")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        shapes = dict(B=16, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16)
        backend = "nccl"
    if world > 1 or "RANK" in os.environ:
        if backend == "nccl":
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
    rank = _rank()
    env_slow = os.environ.get("NCCL_P2P_DISABLE") == "1" and os.environ.get("NCCL_SHM_DISABLE") == "1"
    if args.slow_path != env_slow and world > 1 and backend == "nccl":
        log(f"[warn] --slow-path={args.slow_path} but NCCL_P2P_DISABLE/NCCL_SHM_DISABLE set={env_slow}")
    os.makedirs(args.out, exist_ok=True)
    tag = ("_" + args.tag) if args.tag else ""
    json_path = os.path.join(args.out, f"bench_attention{tag}.json")
    md_path = os.path.join(args.out, f"bench_attention{tag}.md")
    env = dict(argv=sys.argv, torch=torch.__version__, world=world, device=str(dev), backend=backend,
               gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               nccl_env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
               shapes={k: str(v) for k, v in shapes.items()}, args=vars(args),
               flop_convention=f"useful fwd = 4*pairs*Hq*D; fwd+bwd = {bench.FWD_BWD_FACTOR}x fwd")
    log(f"[env] {json.dumps(env)}")
    # one-rank groups for CP=1 rows (every rank must create every group)
    solo = None
    if dist.is_initialized():
        for r in range(world):
            g = dist.new_group([r])
            if r == rank:
                solo = g
    rows, sdpa_cache = [], {}
    stopped = False
    runnable = []
    for cp in cps:
        if cp > max(world, 1) or (cp > 1 and cp != world):
            log(f"[skip] CP={cp}: only CP=1 or CP=world ({world}) can run here")
            continue
        runnable.append(cp)
    # contexts outermost: when the budget runs out, the largest contexts go first, for every CP alike
    plan_rows = [(ctx, cp, placement, method) for ctx in contexts for cp in runnable
                 for placement in (placements if cp > 1 else ["lpt"]) for method in methods
                 if (cp > 1 or method in args._cp1_methods)
                 and (cp == 1 or placement == placements[0] or method in args._alt_methods)]
    if args.peers_only:
        plan_rows = []
    check = {}
    if args.check:
        check = check_peers(args._pack_methods, dev=dev, backend=args.backend)
        for m, e in check.items():
            log(f"[check] {m}: max abs error vs float64 reference (out, 5 grads) = "
                f"{e if isinstance(e, str) else f'{e:.2e}'}")
    row_budget = max(args.budget_s - (args.ab_reserve_s if args._ab else 0.0), 1e-9) if args.budget_s > 0 else 0.0
    for ctx, cp, placement, method in plan_rows:
        group = solo if cp == 1 else dist.group.WORLD
        over = row_budget > 0 and time.perf_counter() - t_start > row_budget
        if dist.is_initialized():
            over = _any(over, dev)
        if over:
            log(f"[budget] {row_budget:.0f}s reached: skipping the remaining rows from context {ctx}")
            stopped = True
            break
        t0 = time.perf_counter()
        try:
            row = bench_row(method, cp, placement, ctx, args, dev, group, shapes, sdpa_cache)
        except Exception as e:  # noqa: BLE001 - keep going; record the error
            row = dict(method=method, cp=cp, placement=placement, context=ctx,
                       error=f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=3))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        log(f"[row] {json.dumps(row, default=str)}")
        if rank == 0:
            with open(json_path, "w") as f:
                json.dump(dict(env=env, rows=rows), f, indent=1, default=str)
    ab_rows = []
    if args._ab:
        def log_row(r):
            log(f"[ab] {json.dumps(r, default=str)}")
            if rank == 0:
                with open(json_path, "w") as f:
                    json.dump(dict(env=env, rows=rows, ab_rows=ab_rows + [r]), f, indent=1, default=str)

        ab_rows = chunks_ab(args, dev, shapes, args._ab_contexts, args._ab, log_row, axes=args._ab_axes)
    pk_rows = []
    if args._packs:
        loaded = []

        def corpus():  # loaded on the first pack --pack-cache does not hold
            if not loaded:
                loaded.append(load_sharegpt(args.pack_limit, cache_dir=args.cache_dir))
            return loaded[0]
        for tokens in args._packs:
            for kind in args._pack_kinds:
                for cp in runnable:
                    group = solo if cp == 1 else dist.group.WORLD
                    if _any(args.budget_s > 0 and time.perf_counter() - t_start > args.budget_s, dev):
                        log(f"[budget] {args.budget_s:.0f}s reached: no more pack rows from {tokens} tokens")
                        stopped = True
                        break
                    try:
                        got = pack_rows(kind, tokens, cp, args._pack_methods, args, dev, group, shapes, corpus=corpus)
                    except Exception as e:  # noqa: BLE001 - keep going; record the error
                        got = [dict(kind=kind, tokens=tokens, cp=cp, method=",".join(args._pack_methods),
                                    error=f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=3))]
                        if dev.type == "cuda":
                            torch.cuda.empty_cache()
                    for r in got:
                        log(f"[pack] {json.dumps(r, default=str)}")
                    pk_rows += got
                    if rank == 0:
                        with open(json_path, "w") as f:
                            json.dump(dict(env=env, check=check, rows=rows, pack_rows=pk_rows), f, indent=1,
                                      default=str)
    md = table(rows, args.slow_path, cpu=dev.type != "cuda") if rows or not pk_rows else ""
    if check:
        md += "\n\nExactness vs float64 (small pack, out and gradients, max abs error): " + ", ".join(
            f"{m} {e if isinstance(e, str) else f'{e:.1e}'}" for m, e in check.items())
    if pk_rows:
        md += "\n\n" + pack_table(pk_rows, cpu=dev.type != "cuda")
    if ab_rows:
        md += "\n\n" + ab_table(ab_rows, args.slow_path, cpu=dev.type != "cuda")
    if rank == 0:
        with open(json_path, "w") as f:
            json.dump(dict(env=env, check=check, rows=rows, ab_rows=ab_rows, pack_rows=pk_rows,
                           wall_s=time.perf_counter() - t_start,
                           stopped_by_budget=stopped), f, indent=1, default=str)
        with open(md_path, "w") as f:
            f.write(f"# bench_attention{tag} ({env['gpu']}, {env['date']})\n\n{md}\n")
        print(md, flush=True)
        print(f"[done] {time.perf_counter() - t_start:.1f}s, {len(rows)} rows, {len(ab_rows)} A/B rows -> {md_path}",
              flush=True)
        n_err = sum("error" in r for r in rows + ab_rows + pk_rows)
        if n_err:
            print(f"bench_attention: error: {n_err} of {len(rows) + len(ab_rows)} rows failed (see the ERROR rows)",
                  file=sys.stderr, flush=True)
        elif not rows and not pk_rows and not stopped:
            print(f"bench_attention: error: no row could run (--cp {args.cp} with world size {world})",
                  file=sys.stderr, flush=True)
    shutdown_distributed()  # barrier, destroy, gc: no gloo thread may outlive main (comm.shutdown_distributed)
    return rows + ab_rows + pk_rows


def exit_code(rows):
    """Process exit status of the CLI: 1 when a row errored or no row ran, else 0."""
    return 1 if (not rows or any("error" in r for r in rows)) else 0


if __name__ == "__main__":
    exit_process(exit_code(main()))
