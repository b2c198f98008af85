"""Profile one local kernel (kernels/) on the DFlash interval mask: where does its time go? (GPU)

For each backend spec and key count: warm up, then `torch.profiler` over `--iters` forward + backward
calls through the kernel API (backward with the global lse/delta, as in the op; cached mask, as with the
per-step metadata). Prints, per case, the wall time per iteration, the summed GPU kernel time per
iteration (busy time; wall - busy = launch gaps / host syncs), and the top GPU kernels by total time.
Shapes: 512 anchors x 16 (Lq 8192), Hq 32, Hkv 8, D 128, bf16, one sequence (tools.benchlib).

    python tools/profile_kernel.py --backends "flex;staircase;staircase:streams=2,group_blocks=64" \
        --keys 16384,65536 [--iters 3] [--top 15]

A spec is `backend[:opt=value,...]`; options go to the kernel's constructor (staircase: see
kernels/staircase.py). Writes nothing; the last lines are a summary table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # as the other tools: runs from a checkout without PYTHONPATH

from tools import benchlib as mb  # noqa: E402
from megatron_splitkv.kernels import get_kernel  # noqa: E402


def _spec(ap, spec: str):
    """(name, options) of one `--backends` item, validated (argparse error naming the flag)."""
    from megatron_splitkv.kernels import BACKENDS

    name, _, opts = spec.strip().partition(":")
    if name not in BACKENDS:
        ap.error(f"--backends: unknown backend {name!r} in {spec!r} (one of {BACKENDS})")
    items = [item.partition("=") for item in filter(None, opts.split(","))]
    if items and name != "staircase":
        ap.error(f"--backends: options are only supported for staircase, got {spec!r}")
    from megatron_splitkv.kernels.staircase import StaircaseAttentionKernel, option_from_text

    kw = {}
    for k, eq, v in items:
        if not eq:
            ap.error(f"--backends: expected option=value, got {k!r} in {spec!r}")
        try:  # ints: plain decimal digits only ("64", not "+64" or "64.0")
            kw[k.strip()] = option_from_text(k.strip(), v, where=f"--backends: {k.strip()} in {spec!r}")
        except ValueError as exc:
            ap.error(str(exc))
    if kw:
        try:
            StaircaseAttentionKernel(**kw)  # validates the options (no device work)
        except (TypeError, ValueError) as exc:
            ap.error(f"--backends: {spec!r}: {exc}")
    return name, kw


def _kernel(name: str, kw: dict, dev, dtype):
    if not kw:
        return get_kernel(name, dev, dtype, 128)
    from megatron_splitkv.kernels.staircase import StaircaseAttentionKernel

    return StaircaseAttentionKernel(**kw)


def main(argv=None):
    from megatron_splitkv._ints import int_arg  # strict decimal numbers within their limits

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="flex;staircase", help="';'-separated backend specs")
    ap.add_argument("--keys", default="16384,65536")
    ap.add_argument("--iters", type=int_arg(1), default=3)
    ap.add_argument("--top", type=int_arg(1), default=15)
    a = ap.parse_args(argv)
    specs = [(spec, *_spec(ap, spec)) for spec in a.backends.split(";") if spec.strip()]
    if not specs:
        ap.error(f"--backends must name at least one backend, got {a.backends!r}")
    keys = mb.int_list_arg(ap, "--keys", a.keys, 1)
    for flag, v in (("--iters", a.iters), ("--top", a.top)):
        if v < 1:
            ap.error(f"{flag} must be >= 1, got {v}")
    if not torch.cuda.is_available():
        raise SystemExit("profile_kernel.py needs a CUDA GPU")
    dev, dt = torch.device("cuda"), torch.bfloat16
    Hq, Hkv, D, B, n_anchors = 32, 8, 128, 16, 512
    scale = D ** -0.5
    summary = []
    for tk in keys:
        mask = mb.dflash_interval_mask(n_anchors, tk, block_size=B, seed=11, device=dev)
        Tq = n_anchors * B
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(Tq, Hq, D, device=dev, dtype=dt, generator=g)
        k = torch.randn(tk, Hkv, D, device=dev, dtype=dt, generator=g)
        v = torch.randn(tk, Hkv, D, device=dev, dtype=dt, generator=g)
        do = torch.randn(Tq, Hq, D, device=dev, dtype=dt, generator=g)
        pairs = B * int(mask.hi.sum())
        for spec, name, kw in specs:
            kern = _kernel(name, kw, dev, dt)

            def step():
                o, lse, st = kern.forward(q, k, v, mask, scale)
                delta = (do.float() * o.float()).sum(-1)
                return kern.backward(q, k, v, mask, scale, do, lse, delta, st)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    step()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) * 1e3 / a.iters
            ka = prof.key_averages()
            dev_attr = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
            # kernel rows only (the aten rows above them report the same device time again)
            busy = sum(getattr(e, dev_attr) for e in ka
                       if str(getattr(e, "device_type", "")).endswith("CUDA")) / 1e3 / a.iters
            print(f"\n== {spec} Tk={tk}: wall {wall:.2f} ms/iter, GPU busy {busy:.2f} ms/iter, "
                  f"useful fwd+bwd {3.5 * 4 * pairs * Hq * D / wall / 1e9:.0f} TF/s", flush=True)
            print(ka.table(sort_by=dev_attr, row_limit=a.top, max_name_column_width=70))
            summary.append((spec, tk, wall, busy))
    print("\n| backend | Tk | wall ms/iter (fwd+bwd, incl. delta) | GPU busy ms/iter | gaps ms |")
    print("|---|---|---|---|---|")
    for spec, tk, wall, busy in summary:
        print(f"| {spec} | {tk} | {wall:.2f} | {busy:.2f} | {wall - busy:.2f} |")


if __name__ == "__main__":
    main()
