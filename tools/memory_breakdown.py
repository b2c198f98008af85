#!/usr/bin/env python3
"""Predicted per-rank peak memory of one attention layer (forward + backward) of splitkv vs allgather-kv
(and ring-kv), from the ops' own code at the real shapes, on CPU (issue 6 goal: splitkv's peak <=
allgather-kv's at every size).

How: P gloo processes run the real op (bench.rank_inputs / prepare_meta / the bench step: grads None,
forward with the per-step metadata, backward with dout) at the real shapes, with the local kernel's
attention arithmetic replaced by a stand-in that allocates exactly what FlexAttention returns (`--kernel
flex`, default: the real `kernels/flex.py` code runs, padding, casts, global-lse backward and all, only its
`flex_attention` call is replaced by one that returns empty tensors of the right shapes and dtypes) or by
nothing at all (`--kernel none`: outputs allocated as the kernel contract says, fp32, no padded copies,
no saved graph). Every tensor allocated during the step is tracked (a TorchDispatchMode over all aten
ops; a storage counts from its allocation until Python frees it), so the live bytes at every point are
those of the code as written: no hand model to keep in sync. Not counted: FlexAttention's internal
workspace (its Triton kernels allocate little: the backward's delta, [Hq, Tq] fp32), NCCL buffers, and the
CUDA caching allocator's rounding (blocks of 512 bytes; fragmentation is not modelled). Not modelled: the
staircase kernel (CUDA's `auto` picks it from 32K context keys per rank), and CUDA lifetimes: a buffer of an
asynchronous collective or a side-stream kernel is `record_stream`-ed and stays allocated until its stream's
work is done, while here it is freed when Python drops it (at CP=2 the GPU peaks are ~0.1 GiB above this
tool's, at CP=1 within 1%: docs/benchmarks.md, "Peak memory vs P at fixed total context").

Reported per method (max over ranks): `inputs` (q, k_ctx, v_ctx, k_blk, v_blk, dout: alive for the whole
step, as in tools/bench_attention.py), `peak` (inputs + the most step-allocated bytes alive at once; what
torch.cuda.max_memory_allocated shows on the GPU, up to the metadata / BlockMask tables and the
allocator's rounding), where the peak happens, and the largest tensors alive at that point by the line
that allocated them. Compare with bench_attention's "peak GiB" column (same workload: Lq = anchors x B,
Hq 32, Hkv 8, D 128, bf16, one sequence of --context tokens, LPT placement).

Context vs query split (issue 6: "the context part of the peak falling as 1/P at a fixed total context"):
every tracked tensor (and every input) is put in a class by its token dimension (its largest dimension):
`query_all` (the gathered query rows: Lq = all ranks' query rows, or Lq / num_chunks, or their flex
bucket: gathered Q, partial O / lse, gathered dO and (delta, lse), dQ partials, padded flex q/out),
`query_local` (this rank's Tq_local rows or their bucket: q / dout inputs, own-block k_blk / v_blk, the
merged O, dq), `context` (>= the smallest rank's context token count and not query-sized: k_ctx / v_ctx,
their grads, the own-block-appended and padded K/V copies, fp32 dK / dV, allgather-kv's gathered K/V) and
`other` (everything smaller: per-block tables, scalars). At CP=1 Tq_local = Lq: its rows count as
`query_all`. The classes assume the query sizes and the context sizes differ (at the real shapes: for P <
total context / Lq, i.e. P <= 8 at 128K); the tool warns when they overlap. `--cp-sweep 1,2,4,8` runs
those CP sizes one after the other at the same --context and prints, per method and P: inputs, peak, and
the peak split into its context-sized and query-sized parts (inputs + step-allocated tensors live at the
peak), with context(P) * P / context(P0) * P0 for the sweep's smallest P0 (1.00 = exactly 1/P).

Examples (from the repository root):
  .venv/bin/python tools/memory_breakdown.py --context 16384 --cp 2
  .venv/bin/python tools/memory_breakdown.py --context 131072 --cp 2 --methods splitkv,allgather-kv --top 12
  .venv/bin/python tools/memory_breakdown.py --context 16384 --cp 2 --query-gather   # the early Q gather path
  .venv/bin/python tools/memory_breakdown.py --context 131072 --cp-sweep 1,2,4,8   # context part vs P (P = 8
      at 128K: 8 processes of ~3-4 GiB each; on a 23 GiB host allgather-kv's P = 8 is killed: --methods splitkv)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import weakref
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import benchlib as bench  # noqa: E402
from tools.launch import run_gloo  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

_PKG = os.path.join(ROOT, "megatron_splitkv") + os.sep
_THIS = os.path.abspath(__file__)


def _site():
    """'file:line function | source' of the innermost frame in megatron_splitkv (else in torch's flex
    stand-in, else the caller's), for attributing an allocation."""
    frames = traceback.extract_stack()[:-3]
    for f in reversed(frames):
        if f.filename.startswith(_PKG):
            rel = os.path.relpath(f.filename, ROOT)
            return f"{rel}:{f.lineno} {f.name} | {(f.line or '').strip()[:90]}"
    for f in reversed(frames):
        if f.filename == _THIS:
            return f"tools/memory_breakdown.py:{f.lineno} {f.name} | {(f.line or '').strip()[:90]}"
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"


class LiveBytes(TorchDispatchMode):
    """Track every storage created by an aten op while active: live bytes now, the peak, and a snapshot
    (site -> bytes, tensors) at the peak."""

    def __init__(self):
        super().__init__()
        self.live = {}  # storage key -> (nbytes, site, shape, dtype)
        self.cur = 0
        self.peak = 0
        self.peak_snapshot = {}
        self.peak_site = ""
        self.ops = 0
        self.phase = "forward"
        self.phase_peak = {}  # phase -> (peak live bytes, site, snapshot)

    def _free(self, key):
        rec = self.live.pop(key, None)
        if rec is not None:
            self.cur -= rec[0]

    def _track(self, t, known):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        s = t.untyped_storage()
        key = s.data_ptr(), s.nbytes()
        if key in self.live or key in known or s.nbytes() == 0:
            return
        site = _site()
        self.live[key] = (s.nbytes(), site, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        self.cur += s.nbytes()
        weakref.finalize(s, self._free, key)
        if self.cur > self.peak:
            self.peak = self.cur
            self.peak_site = site
            self.peak_snapshot = dict(self.live)
        if self.cur > self.phase_peak.get(self.phase, (0,))[0]:
            self.phase_peak[self.phase] = (self.cur, site, dict(self.live))

    def live_bytes(self):
        return self.cur

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        known = set()
        for a in tree_leaves((args, kwargs)):  # inputs (incl. in-place / out= targets) are not new
            if isinstance(a, torch.Tensor) and a.device.type != "meta":
                s = a.untyped_storage()
                known.add((s.data_ptr(), s.nbytes()))
        out = func(*args, **kwargs)
        self.ops += 1
        for t in tree_leaves(out):
            self._track(t, known)
        return out


def _install_flex_standin(kind):
    """--kernel flex: the real FlexAttentionKernel with its flex_attention call replaced by a stand-in
    that allocates flex's outputs (out [1, Hq, Tq, D] in q's dtype, lse [1, Hq, Tq] fp32) and, in
    backward, its input gradients (dq, dk, dv like q, k, v: flex computes GQA dk/dv per kv head).
    --kernel none: a kernel that allocates only the contract's outputs."""
    import types

    from megatron_splitkv import kernels

    class _FakeFlex(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            out = q.new_empty(q.shape[:3] + (v.shape[-1],))
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            return out, lse

        @staticmethod
        def backward(ctx, g_out, g_lse):
            q, k, v = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def fake_flex(q, k, v, *, block_mask=None, scale=None, enable_gqa=False, return_aux=None, **kw):
        out, lse = _FakeFlex.apply(q, k, v)
        if return_aux is not None:
            return out, types.SimpleNamespace(lse=lse)
        return out, lse

    if kind == "flex":
        from megatron_splitkv.kernels.flex import FlexAttentionKernel

        kern = FlexAttentionKernel(compile=False)
        kern._fn = lambda device: fake_flex  # noqa: SLF001 - the stand-in (see the module docstring)
        kern.block_mask = lambda mask, q_len, kv_len: None  # no BlockMask (only the stand-in reads it)
    else:
        class _Contract:
            name = "none"

            def forward(self, q, k, v, mask, scale):
                acc = torch.float64 if q.dtype == torch.float64 else torch.float32
                return (torch.empty(q.shape[:2] + (v.shape[-1],), dtype=acc),
                        torch.empty(q.shape[:2], dtype=acc), None)

            def backward(self, q, k, v, mask, scale, dout, lse, delta, state):
                acc = torch.float64 if q.dtype == torch.float64 else torch.float32
                return (torch.empty(q.shape, dtype=acc), torch.empty(k.shape, dtype=acc),
                        torch.empty(v.shape, dtype=acc))

        kern = _Contract()
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        kernels._CACHE[("flex", "cpu", dt)] = kern  # noqa: SLF001 - the ops resolve backend "flex" here


def _rank_main(rank, world, args):
    """One rank of `_spawn` (run by `launch.run_gloo`, which set up the gloo group)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    return _run_rank(rank, world, args)


class _RankFailed(RuntimeError):
    """A rank of `_spawn` raised or died (`launch.run_gloo`'s report: the rank and its traceback or exit code)."""


def _nbytes(t):
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


CLASSES = ("context", "query_all", "query_local", "other")


def size_classes(tq_local, lq_all, tk_ranks, num_chunks=1):
    """The token counts that make a tensor query-sized or context-sized on one rank (see the module
    docstring): {"query_all": set, "query_local": set, "ctx_min": int, "overlap": bool}. Query sizes: the
    rows and their per-chunk parts, each also as flex pads it (`bucket_length`, query and key steps)."""
    from megatron_splitkv.kernels.flex import DEFAULT_BUCKET_STEPS, DEFAULT_Q_BUCKET_STEPS, bucket_length

    def sizes(n):
        out = set()
        for k in {1, max(1, int(num_chunks))}:
            m = n // k
            if m > 0:
                out |= {m, bucket_length(m, DEFAULT_Q_BUCKET_STEPS), bucket_length(m, DEFAULT_BUCKET_STEPS)}
        return out

    q_all, q_local = sizes(int(lq_all)), sizes(int(tq_local)) - sizes(int(lq_all))
    ctx_min = min(int(t) for t in tk_ranks)
    return dict(query_all=q_all, query_local=q_local, ctx_min=ctx_min,
                overlap=ctx_min <= max(q_all | q_local))


def classify(shape, classes):
    """'context' | 'query_all' | 'query_local' | 'other' of a tensor of `shape` by its token dimension
    (its largest one) under `size_classes`."""
    n = max(shape) if len(shape) else 0
    if n in classes["query_all"]:
        return "query_all"
    if n in classes["query_local"]:
        return "query_local"
    if n >= classes["ctx_min"]:
        return "context"
    return "other"


def split_bytes(records, classes):
    """{class: bytes} of (nbytes, shape) records."""
    out = dict.fromkeys(CLASSES, 0)
    for nb, shape in records:
        out[classify(shape, classes)] += nb
    return out


def _run_rank(rank, world, args):
    _install_flex_standin(args.kernel)
    dtype = getattr(torch, args.dtype)
    B, Hq, Hkv, D = args.block_size, args.hq, args.hkv, args.d
    lens, anchors = bench.make_workload(args.context, args.anchors, seed=args.seed + args.context)
    plan = bench.place(lens, anchors, cp_size=world, strategy=args.placement, block_size=B)
    x = bench.rank_inputs(plan, rank, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, device="cpu", seed=args.seed)
    results = {}
    for method in args.methods:
        opts = {"num_chunks": args.num_chunks} if method == "splitkv" and args.num_chunks else {}
        meta = bench.prepare_meta(method, x, block_size=B, cp_group=None, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype,
                                  **opts)
        early = args.query_gather and method == "splitkv"

        tracker = None

        def step():
            for k in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk"):
                x[k].grad = None
            if early:  # a layer-like call: q through one op, the gather started before k/v
                import megatron_splitkv as msk

                q = x["q"] * 1
                h = msk.splitkv_start_query_gather(q, metadata=meta)
                kv = [x[k] * 1 for k in ("k_ctx", "v_ctx", "k_blk", "v_blk")]
                out = msk.splitkv_attention(q, *kv, metadata=meta, backend="flex", query_gather=h)
                del q, kv, h
            else:
                out = bench.op_fn(method)(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], None, None,
                                          None, None, metadata=meta, backend="flex")
            if tracker is not None:
                tracker.saved = tracker.live_bytes()  # kept from forward to backward (+ the output)
                tracker.phase = "backward"
            out.backward(x["dout"])
            del out

        step()  # warm-up (kernel caches), as bench_attention does before measuring
        for k in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk"):
            x[k].grad = None
        inputs = sum(_nbytes(x[k]) for k in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk", "dout"))
        tracker = LiveBytes()
        with tracker:
            step()
        tracker.phase = "done"
        grads = sum(_nbytes(x[k].grad) for k in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk"))
        def top_sites(snapshot):
            by_site = defaultdict(lambda: [0, 0, None])
            for nb, site, shape, dt in snapshot.values():
                e = by_site[site]
                e[0] += nb
                e[1] += 1
                e[2] = f"{list(shape)} {dt}"
            return sorted(((v[0], k, v[1], v[2]) for k, v in by_site.items()), reverse=True)[: args.top]

        top = top_sites(tracker.peak_snapshot)
        n_chunks = int(getattr(meta, "num_chunks", 1) or 1)
        classes = size_classes(int(x["q"].shape[0]), plan.blocks_per_rank * world * B,
                               [int(plan.token_index(r).shape[0]) for r in range(world)], n_chunks)
        in_split = split_bytes([(_nbytes(x[k]), tuple(x[k].shape))
                                for k in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk", "dout")], classes)
        step_split = split_bytes([(v[0], v[2]) for v in tracker.peak_snapshot.values()], classes)
        site_cls = defaultdict(lambda: defaultdict(int))  # the largest sites of each class at the peak
        for nb, site, shape, dt in tracker.peak_snapshot.values():
            site_cls[classify(shape, classes)][(site, f"{list(shape)} {dt}")] += nb
        by_class = {c: sorted(((b, k[0], k[1]) for k, b in d.items()), reverse=True)[:4]
                    for c, d in site_cls.items()}
        phases = {ph: dict(peak=inputs + v[0], site=v[1], top=top_sites(v[2]))
                  for ph, v in tracker.phase_peak.items()}
        results[method] = dict(inputs=inputs, step_peak=tracker.peak, peak=inputs + tracker.peak,
                               saved=tracker.saved, phases=phases,
                               grads_after=grads, peak_site=tracker.peak_site, ops=tracker.ops,
                               top=top, tk_local=int(x["k_ctx"].shape[0]), tq_local=int(x["q"].shape[0]),
                               num_chunks=n_chunks, inputs_split=in_split, step_split=step_split,
                               class_top=by_class,
                               classes_overlap=bool(classes["overlap"]))
        del meta
    return results


def main(argv=None):
    from megatron_splitkv._ints import int_arg  # strict decimal numbers within their limits

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int_arg(1), default=16384, help="total context tokens (one sequence)")
    ap.add_argument("--cp", type=int_arg(1, bench.MAX_HOST_RANKS), default=2,
                    help=f"CP size = number of gloo processes (at most {bench.MAX_HOST_RANKS})")
    ap.add_argument("--methods", default="splitkv,allgather-kv")
    bench.add_attention_shape_args(ap)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--placement", default="lpt")
    ap.add_argument("--num-chunks", type=int_arg(1), default=None, help="splitkv's chunk count (default: the op's)")
    ap.add_argument("--kernel", default="flex", choices=("flex", "none"),
                    help="flex: kernels/flex.py with a stand-in flex_attention; none: contract outputs only")
    ap.add_argument("--query-gather", action="store_true",
                    help="splitkv through splitkv_start_query_gather + query_gather= (layer-like call)")
    ap.add_argument("--seed", type=int_arg(0), default=0)
    ap.add_argument("--top", type=int_arg(0), default=10, help="allocation sites listed at the peak")
    ap.add_argument("--phases", action="store_true", help="also list the sites at the forward / backward peaks")
    ap.add_argument("--class-sites", action="store_true",
                    help="also list the largest sites of each size class (context / query) at the peak")
    ap.add_argument("--cp-sweep", default=None, metavar="P1,P2,...",
                    help="run these CP sizes (each once) one after the other at the same --context (overrides "
                         f"--cp; each <= {bench.MAX_HOST_RANKS}) and tabulate the peak's context vs query parts per P")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    args.methods = bench.choices_arg(ap, "--methods", args.methods, tuple(bench.METHODS), "method")
    if args.hq % args.hkv:  # the ints' ranges: int_arg (argparse's error, exit 2)
        ap.error(f"--hq {args.hq} must be a multiple of --hkv {args.hkv}")
    from megatron_splitkv.planning import STRATEGIES

    if args.placement not in STRATEGIES:
        ap.error(f"--placement must be one of {', '.join(STRATEGIES)}, got {args.placement!r}")

    if args.cp_sweep is not None:
        return _sweep(args, bench.int_list_arg(ap, "--cp-sweep", args.cp_sweep, 1, bench.MAX_HOST_RANKS))
    summary = _report(args, args.cp, _spawn(args, args.cp))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items()}, summary=summary), f, indent=1)
    return summary


def _spawn(args, cp):
    """Run the step on `cp` gloo processes; {rank: _run_rank's results}. A rank that raises or dies (e.g. killed by
    the host's out-of-memory killer) ends the run at once with its message (`launch.run_gloo`), exit status 1."""
    try:
        return dict(enumerate(run_gloo(_rank_main, cp, args, timeout=3600, error=_RankFailed)))
    except _RankFailed as exc:
        err = str(exc)
        hint = ("\n(a peer's 'Connection closed' or a rank killed by a signal usually means the host's out-of-memory "
                "killer: each of the P processes holds tensors of the real shapes; use fewer ranks or a smaller "
                "--context)") if ("Connection closed" in err or "closed by peer" in err or "SIGKILL" in err) else ""
        sys.exit(f"{err}{hint}")


def _report(args, cp, per_rank):
    """Print one CP size's report; the summary (max over ranks) per method."""
    gib = 2.0 ** 30
    print(f"context {args.context}, CP {cp}, Lq {args.anchors * args.block_size}, Hq {args.hq}, "
          f"Hkv {args.hkv}, D {args.d}, {args.dtype}, kernel stand-in: {args.kernel}"
          + (", early Q gather" if args.query_gather else ""))
    summary = {}
    for m in args.methods:
        worst = max(range(cp), key=lambda r: per_rank[r][m]["peak"])
        r = per_rank[worst][m]
        split = {c: (r["inputs_split"][c] + r["step_split"][c]) / gib for c in CLASSES}
        summary[m] = dict(peak_gib=r["peak"] / gib, inputs_gib=r["inputs"] / gib, step_gib=r["step_peak"] / gib,
                          saved_gib=r["saved"] / gib,
                          phase_peak_gib={ph: v["peak"] / gib for ph, v in r["phases"].items()},
                          rank=worst, per_rank_peak_gib=[per_rank[i][m]["peak"] / gib for i in range(cp)],
                          peak_site=r["peak_site"], num_chunks=r["num_chunks"],
                          tk_local=r["tk_local"], tq_local=r["tq_local"],
                          split_gib=split,
                          inputs_split_gib={c: v / gib for c, v in r["inputs_split"].items()},
                          step_split_gib={c: v / gib for c, v in r["step_split"].items()},
                          classes_overlap=r["classes_overlap"],
                          top=[dict(mib=t[0] / 2**20, site=t[1], count=t[2], example=t[3]) for t in r["top"]])
        print(f"\n{m}: peak {r['peak'] / gib:.3f} GiB on rank {worst} (inputs {r['inputs'] / gib:.3f} + step "
              f"{r['step_peak'] / gib:.3f}); Tq_local {r['tq_local']}, Tk_local {r['tk_local']}"
              + (f", k={r['num_chunks']}" if m == "splitkv" else "") + "; per rank: "
              + ", ".join(f"{v:.3f}" for v in summary[m]["per_rank_peak_gib"]))
        print(f"  peak reached at: {r['peak_site']}")
        print(f"  kept from forward to backward (saved tensors, output, kernel state): {r['saved'] / gib:.3f} GiB; "
              + "; ".join(f"{ph} peak {v['peak'] / gib:.3f} GiB" for ph, v in r["phases"].items()))
        print("  the peak by size class (inputs + step): "
              + ", ".join(f"{c} {split[c]:.3f} GiB ({r['inputs_split'][c] / gib:.3f} + {r['step_split'][c] / gib:.3f})"
                          for c in CLASSES))
        if r["classes_overlap"]:
            print("  warning: query and context token counts overlap at these sizes; the class split is unreliable")
        print("  live at the peak (allocated during the step), by allocation site:")
        for nb, site, cnt, ex in r["top"]:
            print(f"    {nb / 2**20:9.1f} MiB  x{cnt:<3d} {ex:<28s} {site}")
        if args.class_sites:
            for c in CLASSES:
                for nb, site, ex in r["class_top"].get(c, []):
                    print(f"    [{c:<11s}] {nb / 2**20:9.1f} MiB  {ex:<28s} {site}")
        if args.phases:
            for ph, v in r["phases"].items():
                print(f"  {ph} peak {v['peak'] / gib:.3f} GiB at {v['site']}:")
                for nb, site, cnt, ex in v["top"]:
                    print(f"    {nb / 2**20:9.1f} MiB  x{cnt:<3d} {ex:<28s} {site}")
    if len(args.methods) > 1 and "splitkv" in summary:
        for m in args.methods:
            if m != "splitkv":
                print(f"\nsplitkv / {m} peak: {summary['splitkv']['peak_gib'] / summary[m]['peak_gib']:.3f}")
    return summary


def _sweep(args, cps):
    """--cp-sweep: each CP size in turn at the same --context; a table per method of the peak split into
    its context and query parts, and context(P) * P / context(P0) for the smallest P0 of the sweep."""
    per_cp, failed = {}, None
    for cp in cps:
        print(f"\n===== CP {cp} =====", flush=True)
        try:
            per_cp[cp] = _report(args, cp, _spawn(args, cp))
        except SystemExit as exc:  # one CP size failed (e.g. out of host memory): report the finished ones
            failed = f"--cp-sweep: CP {cp} failed: {exc}"
            print(failed, file=sys.stderr, flush=True)
            break
    if not per_cp:
        sys.exit(failed)
    cps = [cp for cp in cps if cp in per_cp]
    p0 = min(cps)
    rows = {}
    print(f"\n===== peak per rank vs P at a fixed total context of {args.context} tokens (GiB; the rank with "
          f"the highest peak; split = inputs + step-allocated tensors live at the peak) =====")
    for m in args.methods:
        ctx0 = per_cp[p0][m]["split_gib"]["context"]
        print(f"\n{m}:\n| P | Tk_local | Tq_local | inputs | peak | context part | query part (all Lq rows) | "
              f"query part (local rows) | other | context x P / context(P={p0}) x {p0} |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        rows[m] = []
        for cp in cps:
            s_ = per_cp[cp][m]
            sp = s_["split_gib"]
            ratio = sp["context"] * cp / (ctx0 * p0) if ctx0 > 0 else float("nan")
            rows[m].append(dict(cp=cp, tk_local=s_["tk_local"], tq_local=s_["tq_local"], inputs_gib=s_["inputs_gib"],
                                peak_gib=s_["peak_gib"], context_gib=sp["context"], query_all_gib=sp["query_all"],
                                query_local_gib=sp["query_local"], other_gib=sp["other"], context_ratio=ratio,
                                context_inputs_gib=s_["inputs_split_gib"]["context"],
                                context_step_gib=s_["step_split_gib"]["context"],
                                classes_overlap=s_["classes_overlap"]))
            print(f"| {cp} | {s_['tk_local']} | {s_['tq_local']} | {s_['inputs_gib']:.3f} | {s_['peak_gib']:.3f} | "
                  f"{sp['context']:.3f} | {sp['query_all']:.3f} | {sp['query_local']:.3f} | {sp['other']:.4f} | "
                  f"{ratio:.3f} |" + (" (classes overlap)" if s_["classes_overlap"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items()}, rows=rows,
                           summary={str(cp): v for cp, v in per_cp.items()}, failed=failed), f, indent=1)
    if failed:
        sys.exit(failed + " (the table above has the CP sizes that finished)")
    return dict(rows=rows, summary=per_cp)


if __name__ == "__main__":
    main()
