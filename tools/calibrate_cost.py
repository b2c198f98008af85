#!/usr/bin/env python
"""Calibrate the planner's CostModel on a GPU: time the real local attention and the linear layers.

Fits, for the DFlash drafter (DESIGN.md section 1) on this GPU:
  * attn_pair_cost: ns per visible (query row, key) pair of context attention, forward + backward,
    summed over `--layers` drafter layers. Timed with FlexAttention (torch.compile) on the DFlash
    context mask (query block b sees keys with position < anchor_b) for several context lengths and
    anchor counts; slope of a least-squares fit time = slope * pairs + intercept.
  * token_cost: ns per context token of the context-side linear work, forward + backward: the fc
    projection (taps*hidden -> hidden; forward + weight grad, its input is the frozen target features)
    plus k_proj and v_proj (hidden -> kv_heads*head_dim; forward + input and weight grads) of every
    layer. Slope of a fit over token counts.

Prints the fitted `CostModel(attn_pair_cost=..., token_cost=...)` and writes JSON (--out). Not needed
by the tests (defaults are documented in megatron_splitkv/planning/cost.py).

    python tools/calibrate_cost.py [--dtype bf16] [--layers 5] [--out cost_calibration.json]

Source of the cost model: arXiv 2611.05926 (Split-KV), LPT section: "realized attention cost plus a
per-token term for the linear layers (calibrated)".
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs without PYTHONPATH


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e6)  # ns
    return float(np.median(times))


def fit_slope(x, y):
    A = np.stack([np.asarray(x, float), np.ones(len(x))], 1)
    (slope, icpt), *_ = np.linalg.lstsq(A, np.asarray(y, float), rcond=None)
    return float(slope), float(icpt)


def time_attention(args, dtype, lk, n_anchors, flex, create_block_mask):
    B, D = args.block, args.head_dim
    g = torch.Generator().manual_seed(lk + n_anchors)
    anchors = torch.sort(torch.randperm(lk - 1, generator=g)[:n_anchors]).values.cuda()
    lq = n_anchors * B
    q = torch.randn(1, args.heads, lq, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(1, args.kv_heads, lk, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(1, args.kv_heads, lk, D, device="cuda", dtype=dtype, requires_grad=True)

    def mask_mod(b, h, qi, kj):
        return kj < anchors[qi // B]

    bm = create_block_mask(mask_mod, 1, 1, lq, lk, device="cuda")
    do = torch.randn(1, args.heads, lq, D, device="cuda", dtype=dtype)

    def step():
        out = flex(q, k, v, block_mask=bm, enable_gqa=args.heads != args.kv_heads)
        out.backward(do)

    t = timed(step, args.warmup, args.iters)
    pairs = B * int(anchors.sum().item())
    return pairs, t


def time_linear(args, dtype, tokens):
    H, kvd = args.hidden, args.kv_heads * args.head_dim
    fc = torch.nn.Linear(args.taps * H, H, bias=False, device="cuda", dtype=dtype)
    kp = torch.nn.Linear(H, kvd, bias=False, device="cuda", dtype=dtype)
    vp = torch.nn.Linear(H, kvd, bias=False, device="cuda", dtype=dtype)
    feats = torch.randn(tokens, args.taps * H, device="cuda", dtype=dtype)  # frozen target features
    x = torch.randn(tokens, H, device="cuda", dtype=dtype, requires_grad=True)
    dk = torch.randn(tokens, kvd, device="cuda", dtype=dtype)

    def fc_step():
        fc(feats).backward(torch.ones(tokens, H, device="cuda", dtype=dtype))

    def kv_step():
        torch.autograd.backward([kp(x), vp(x)], [dk, dk])

    return timed(fc_step, args.warmup, args.iters), timed(kv_step, args.warmup, args.iters)


def main(argv=None):
    from megatron_splitkv._ints import int_arg  # strict decimal numbers within their limits
    from tools import benchlib as bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int_arg(1), default=4096)
    ap.add_argument("--heads", type=int_arg(1), default=32)
    ap.add_argument("--kv-heads", type=int_arg(1), default=8)
    ap.add_argument("--head-dim", type=int_arg(1), default=128)
    ap.add_argument("--layers", type=int_arg(1), default=5)
    ap.add_argument("--taps", type=int_arg(1), default=5, help="target layers concatenated into fc")
    ap.add_argument("--block", type=int_arg(1), default=16)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--ctx-lens", default="4096,16384,65536",
                    help="context lengths of the attention fit, comma-separated, each once and >= 2")
    ap.add_argument("--anchor-counts", default="128,512",
                    help="anchors per context of the attention fit, comma-separated, each once and >= 1")
    ap.add_argument("--token-counts", default="4096,16384,65536",
                    help="tokens of the linear-layer fit, comma-separated, each once and >= 1 (two at least)")
    ap.add_argument("--warmup", type=int_arg(0), default=3)
    ap.add_argument("--iters", type=int_arg(1), default=10)
    ap.add_argument("--out", default="cost_calibration.json")
    args = ap.parse_args(argv)
    ctx_lens = bench.int_list_arg(ap, "--ctx-lens", args.ctx_lens, 2)
    anchor_counts = bench.int_list_arg(ap, "--anchor-counts", args.anchor_counts, 1)
    token_counts = bench.int_list_arg(ap, "--token-counts", args.token_counts, 1)
    if len(token_counts) < 2:
        ap.error(f"--token-counts needs two values at least (the fit of a slope), got {args.token_counts!r}")
    if len(ctx_lens) * len(anchor_counts) < 2:
        ap.error(f"--ctx-lens x --anchor-counts needs two pairs at least (the fit of a slope), got "
                 f"{args.ctx_lens!r} x {args.anchor_counts!r}")
    if not torch.cuda.is_available():
        sys.exit("calibrate_cost.py needs a CUDA GPU")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    flex = torch.compile(flex_attention, dynamic=False)

    attn = []
    for lk in ctx_lens:
        for na in anchor_counts:
            pairs, t = time_attention(args, dtype, lk, min(na, lk - 1), flex, create_block_mask)
            attn.append(dict(ctx_len=lk, anchors=na, pairs=pairs, ns=t))
            print(f"attention Lk={lk:6d} anchors={na:4d}: {pairs:.3e} pairs, {t / 1e6:8.3f} ms fwd+bwd per layer, "
                  f"{t / pairs * 1e3:.3f} ps/pair", flush=True)
    a_slope, a_icpt = fit_slope([r["pairs"] for r in attn], [r["ns"] for r in attn])

    lin = []
    for T in token_counts:
        fc_ns, kv_ns = time_linear(args, dtype, T)
        lin.append(dict(tokens=T, fc_ns=fc_ns, kv_ns=kv_ns, total_ns=fc_ns + args.layers * kv_ns))
        print(f"linear T={T:6d}: fc {fc_ns / 1e6:.3f} ms, k/v proj {kv_ns / 1e6:.3f} ms per layer", flush=True)
    t_slope, t_icpt = fit_slope([r["tokens"] for r in lin], [r["total_ns"] for r in lin])

    result = dict(
        attn_pair_cost=a_slope * args.layers,
        token_cost=t_slope,
        per_layer_attn_ns_per_pair=a_slope,
        attn_intercept_ns=a_icpt,
        token_intercept_ns=t_icpt,
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        args=vars(args),
        attention=attn,
        linear=lin,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nCostModel(attn_pair_cost={result['attn_pair_cost']:.4g}, token_cost={result['token_cost']:.4g})"
          f"  # ns, fwd+bwd, {args.layers} layers, {result['device']}, {args.dtype}; wrote {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
