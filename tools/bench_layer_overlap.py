#!/usr/bin/env python3
"""A/B of Split-KV's early query all-gather (docs/lab/perf-notes.md item 3) in the Megatron DFlash attention
layer: `DFlashAttention` forward + backward with `overlap_query_gather` on vs off, side by side.

tools/bench_attention.py times the attention OP alone (q, k, v given): there is nothing for the query
gather to overlap with there. The overlap is a layer property: `DFlashAttention` computes q (projection,
q-norm, RoPE), starts the gather, then computes k/v of [context | block tokens] (projection, k-norm, RoPE)
while it is in flight; in backward the k/v projection's backward runs while the dQ all-to-all is in
flight. This tool times exactly that module (Megatron-Core local spec: ColumnParallelLinear /
RowParallelLinear, torch RMSNorm; the local attention kernel `--backend`, default auto = fa4 / flex on CUDA),
one CP rank per process, for each context size:

  - op ms: median forward + backward of the layer (CUDA events; round-robin on / off, `bench.
    time_fns_interleaved`; MAX over ranks), with the per-step metadata prepared by the first call and
    reused (as layers 2..5 of a step do);
  - diff: the two variants' outputs and every gradient (input, context, parameters) must be bit-identical
    (`max |a - b|` reported, must be 0);
  - peak GiB: torch.cuda.max_memory_allocated during one step of each variant (max over ranks);
  - the k/v projection FLOPs that the gather / all-to-all can hide behind.

Workload: Qwen3-8B drafter layer (hidden 4096, 32 q / 8 kv heads, head dim 128, bf16), query budget
--anchors x B, one sequence of `--contexts` tokens placed by the LPT planner (as bench_attention).

Examples (repository root):
  torchrun --nproc-per-node 2 tools/bench_layer_overlap.py --contexts 16384,32768,131072
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 torchrun --nproc-per-node 2 tools/bench_layer_overlap.py \\
      --contexts 32768,131072 --tag socket            # the slow-link stand-in: the gather costs more there
  python -m torch.distributed.run --standalone --nproc-per-node 2 tools/bench_layer_overlap.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import benchlib as bench  # noqa: E402


def log(msg):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def _allmax(vals, device):
    t = torch.tensor(vals, dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def build_layer(args, cp, device, dtype):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_splitkv.megatron import get_dflash_layer_spec
    from megatron_splitkv.megatron.models import qwen3_config

    config = qwen3_config(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.hq,
                          num_query_groups=args.hkv, kv_channels=args.d, params_dtype=dtype,
                          use_cpu_initialization=True, context_parallel_size=cp)  # same weights on every rank
    spec = get_dflash_layer_spec("splitkv", use_te=False, rotary_base=1e6, kernel_backend=args.backend,
                                 overlap_query_gather=True)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    attn = build_module(spec.submodules.self_attention, config=config, layer_number=1, pg_collection=pgs)
    return attn.to(device)


def run_context(attn, ctx_len, args, device, dtype, rank, cp):
    from megatron_splitkv.megatron import DFlashPackedSeqParams

    B = args.block_size
    lens, anchors = bench.make_workload(ctx_len, args.anchors, seed=args.seed + ctx_len)
    plan = bench.place(lens, anchors, cp_size=cp, strategy="lpt", block_size=B)
    sl = plan.query_slice(rank)
    nq = (sl.stop - sl.start) * B
    tk = int(plan.token_index(rank).shape[0])
    g = torch.Generator(device=device).manual_seed(args.seed * 7919 + rank)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    import numpy as np

    h = rnd(nq, 1, args.hidden).requires_grad_(True)
    ctx = rnd(tk, 1, args.hidden).requires_grad_(True)
    dout = rnd(nq, 1, args.hidden)
    params = DFlashPackedSeqParams(
        q_seq=torch.as_tensor(np.maximum(plan.q_seq[sl], 0), device=device),
        q_anchor=torch.as_tensor(plan.q_anchor[sl].copy(), device=device),
        kv_seq=torch.as_tensor(plan.token_seq_ids(rank), device=device),
        kv_pos=torch.as_tensor(plan.token_positions(rank), device=device), block_size=B)

    def step(overlap):
        def fn():
            attn.overlap_query_gather = overlap
            for t in [h, ctx] + list(attn.parameters()):
                t.grad = None
            out, _ = attn(h, key_value_states=ctx, packed_seq_params=params)
            out.backward(dout)
            return out
        return fn

    results = {}
    for name, overlap in (("on", True), ("off", False)):
        fn = step(overlap)
        fn()  # warm-up (compiles, metadata, BlockMask)
        bench._sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        bench._sync(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        results[name] = dict(peak=peak, tensors=[out.detach().clone(), h.grad.clone(), ctx.grad.clone()]
                             + [p.grad.clone() for p in attn.parameters()])
    diff = max((a.float() - b.float()).abs().max().item() if a.numel() else 0.0
               for a, b in zip(results["on"]["tensors"], results["off"]["tensors"]))
    timed = bench.time_fns_interleaved([step(True), step(False)], device, reps=args.reps, warmup=1,
                                       group=dist.group.WORLD)
    mx = _allmax([diff, results["on"]["peak"], results["off"]["peak"], float(tk)], device)
    kv_rows = mx[3] + nq  # the slowest rank's k/v projection rows: [context | block tokens]
    kv_fwd_flops = 2.0 * kv_rows * args.hidden * 2 * args.hkv * args.d
    return dict(context=ctx_len, cp=cp, on_ms=timed[0][0], off_ms=timed[1][0], speedup=timed[1][0] / timed[0][0],
                max_abs_diff=mx[0], peak_on_gib=mx[1], peak_off_gib=mx[2], tk_local_max=int(mx[3]), tq_local=nq,
                kv_proj_fwd_gflop=kv_fwd_flops / 1e9, kv_proj_bwd_gflop=2 * kv_fwd_flops / 1e9,
                q_gather_mib=nq * args.hq * args.d * torch.finfo(dtype).bits / 8 / 2**20)


def main(argv=None):
    from megatron_splitkv._ints import int_arg, output_dir  # strict decimal numbers within their limits

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16384,32768,131072",
                    help="total context tokens per row, comma-separated, each once and >= 2")
    bench.add_attention_shape_args(ap)
    ap.add_argument("--hidden", type=int_arg(1), default=4096)
    ap.add_argument("--reps", type=int_arg(1), default=10)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--seed", type=int_arg(0), default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=output_dir, default=os.environ.get("OUT") or os.path.join(ROOT, "out", "bench"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, gloo")
    args = ap.parse_args(argv)
    contexts = bench.int_list_arg(ap, "--contexts", args.contexts, 2)
    if args.cpu_smoke:
        args.hidden, args.hq, args.hkv, args.d, args.anchors, args.block_size, args.reps = 64, 4, 2, 16, 8, 4, 2
        args.backend = "math"
        contexts = [300]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(context_parallel_size=world, create_gloo_process_groups=False)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(args.seed)
    attn = build_layer(args, world, device, dtype)
    rows = []
    for c in contexts:
        t0 = time.perf_counter()
        r = run_context(attn, c, args, device, dtype, dist.get_rank(), world)
        r["wall_s"] = time.perf_counter() - t0
        rows.append(r)
        log(f"context {c:>7d} CP {world}: overlap on {r['on_ms']:.3f} ms, off {r['off_ms']:.3f} ms "
            f"(x{r['speedup']:.3f}); max |diff| {r['max_abs_diff']:.1e}; peak on/off {r['peak_on_gib']:.3f} / "
            f"{r['peak_off_gib']:.3f} GiB; k/v projection {r['kv_proj_fwd_gflop']:.0f} GFLOP fwd, "
            f"{r['kv_proj_bwd_gflop']:.0f} bwd; Q gather {r['q_gather_mib']:.0f} MiB/rank")
        if r["max_abs_diff"] != 0:
            log("  WARNING: overlap on/off results differ (must be bit-identical)")
    if dist.get_rank() == 0 and not args.cpu_smoke:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"bench_layer_overlap{args.tag and '_' + args.tag}.json"), "w") as f:
            json.dump(dict(rows=rows, args=vars(args), nccl_env={k: v for k, v in os.environ.items()
                                                               if k.startswith("NCCL_")}), f, indent=1)
    from megatron_splitkv.comm import shutdown_distributed

    shutdown_distributed()  # Megatron's groups too; no gloo thread may outlive main (comm.shutdown_distributed)
    return rows


if __name__ == "__main__":
    from megatron_splitkv.comm import exit_process

    main()
    exit_process(0)
