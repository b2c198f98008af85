"""Probe the dense SDPA backends of this GPU for the staircase decomposition of the DFlash mask (GPU).

For each aten backend (flash, cudnn, efficient) and each key length: forward and backward time (median
of repeats, CUDA events) of a dense call shaped like one query group of the drafter (GQA folded into
rows: q [1, Hkv, G * rows, D], k/v [1, Hkv, Lk, D], bf16), and whether its backward is exact when
given a GLOBAL (out, lse) from a two-way key split (the property the decomposition needs: dQ of the
halves sums to the full dQ, dK/dV of the halves concatenate to the full ones). Prints a table last.

    python tools/probe_dense_backends.py [--rows 8192] [--keys 8192,16384] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs without PYTHONPATH

A = torch.ops.aten


def _fwd(name, q, k, v, scale):
    if name == "flash":
        r = A._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
        return r[0], r[1], r
    if name == "cudnn":
        r = A._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
        return r[0], r[1], r
    r = A._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)
    return r[0], r[1], r


def _bwd(name, do, q, k, v, out, lse, aux, scale):
    if name == "flash":
        _, _, cq, ck, mq, mk, rng, unused, _ = aux
        return A._scaled_dot_product_flash_attention_backward(do, q, k, v, out, lse, cq, ck, mq, mk, 0.0,
                                                              False, rng, unused, scale=scale)
    if name == "cudnn":
        _, _, cq, ck, mq, mk, seed, off, _ = aux
        return A._scaled_dot_product_cudnn_attention_backward(do, q, k, v, out, lse, seed, off, None, cq, ck,
                                                              mq, mk, 0.0, False, scale=scale)
    _, _, seed, off = aux
    r = A._scaled_dot_product_efficient_attention_backward(do, q, k, v, None, out, lse, seed, off, 0.0,
                                                           [True, True, True, False], False, scale=scale)
    return r[0], r[1], r[2]


def _time(fn, repeats):
    ts = []
    for _ in range(repeats + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts[2:])


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main(argv=None):
    from megatron_splitkv._ints import int_arg  # strict decimal numbers within their limits

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int_arg(1), default=8192, help="query rows (tokens) before GQA folding")
    ap.add_argument("--keys", default="8192,16384", help="comma list of key lengths")
    ap.add_argument("--heads-q", type=int_arg(1), default=32)
    ap.add_argument("--heads-kv", type=int_arg(1), default=8)
    ap.add_argument("--head-dim", type=int_arg(1), default=128)
    ap.add_argument("--repeats", type=int_arg(1), default=10)
    a = ap.parse_args(argv)
    from tools.benchlib import int_list_arg  # noqa: PLC0415

    keys = int_list_arg(ap, "--keys", a.keys, 2)
    for flag, v in (("--rows", a.rows), ("--heads-q", a.heads_q), ("--heads-kv", a.heads_kv),
                    ("--head-dim", a.head_dim), ("--repeats", a.repeats)):
        if v < 1:
            ap.error(f"{flag} must be >= 1, got {v}")
    if a.heads_q % a.heads_kv:
        ap.error(f"--heads-q ({a.heads_q}) must be a multiple of --heads-kv ({a.heads_kv})")
    if not torch.cuda.is_available():
        raise SystemExit("probe_dense_backends.py needs a CUDA GPU")
    dev = torch.device("cuda")
    g = a.heads_q // a.heads_kv
    rows_f = g * a.rows
    scale = a.head_dim ** -0.5
    table = []
    for lk in keys:
        torch.manual_seed(0)
        q = torch.randn(1, a.heads_kv, rows_f, a.head_dim, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, a.heads_kv, lk, a.head_dim, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        do = torch.randn_like(q)
        flops_f = 4.0 * rows_f * lk * a.head_dim * a.heads_kv
        for name in ("flash", "cudnn", "efficient"):
            try:
                out, lse, aux = _fwd(name, q, k, v, scale)
                dq, dk, dv = _bwd(name, do, q, k, v, out, lse, aux, scale)
                # exactness with a global (out, lse): split the keys in two halves
                h = lk // 2
                parts = [_fwd(name, q, k[:, :, s], v[:, :, s], scale) for s in (slice(0, h), slice(h, lk))]
                flat = lambda t: t.reshape(1, a.heads_kv, -1)[..., :rows_f].float()  # noqa: E731
                l1, l2 = flat(parts[0][1]), flat(parts[1][1])
                lg = torch.logaddexp(l1, l2)
                og = (parts[0][0].float() * (l1 - lg).exp().unsqueeze(-1)
                      + parts[1][0].float() * (l2 - lg).exp().unsqueeze(-1)).to(q.dtype)
                lse_g = lse.clone()
                lse_g.view(1, a.heads_kv, -1)[..., :rows_f] = lg
                g1 = _bwd(name, do, q, k[:, :, :h], v[:, :, :h], og, lse_g, parts[0][2], scale)
                g2 = _bwd(name, do, q, k[:, :, h:], v[:, :, h:], og, lse_g, parts[1][2], scale)
                err = max(_rel(og, out), _rel(g1[0] + g2[0], dq), _rel(torch.cat([g1[1], g2[1]], 2), dk),
                          _rel(torch.cat([g1[2], g2[2]], 2), dv))
                tf = _time(lambda: _fwd(name, q, k, v, scale), a.repeats)
                tb = _time(lambda: _bwd(name, do, q, k, v, out, lse, aux, scale), a.repeats)
                row = (lk, name, tf, tb, flops_f / tf / 1e9, 3.5 * flops_f / (tf + tb) / 1e9,
                       tuple(lse.shape), f"{err:.1e}")
            except Exception as e:  # a backend this GPU / build cannot run: report, go on
                row = (lk, name, float("nan"), float("nan"), float("nan"), float("nan"), (),
                       f"{type(e).__name__}: {str(e)[:60]}")
            table.append(row)
            print(row, flush=True)
    print("\n| keys | backend | fwd ms | bwd ms | fwd TF/s | fwd+bwd TF/s (3.5x) | lse shape | split-exactness rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.0f} | {r[5]:.0f} | {r[6]} | {r[7]} |")


if __name__ == "__main__":
    main()
