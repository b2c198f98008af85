"""Host overhead of the Split-KV op per step, measured WITHOUT a GPU (CPU, gloo; docs/lab/perf-notes.md item 15).

On 2 x H200 (CP=2, 16K context, Qwen3-8B drafter shapes, flex) the op is HOST-bound once chunked: one
forward + backward with reused metadata takes 5.4-6.0 ms of host issue time at num_chunks k = 1 and
10.8-12.2 ms at k = 2, against ~7.4 ms of GPU work (tools/profile_op.py). That host work is Python (the
op, the comm wrappers, the kernels' glue), small aten ops and their dispatch: none of it depends on the
tensors' sizes. So this tool runs the op's REAL structure (the planner's LPT placement of `--anchors`
anchors x block 16 over `--context` tokens, per-step metadata prepared once and reused, forward +
backward, every chunk, every collective) at small shapes (default 64 anchors x B 16 over 1024 tokens,
Hq = Hkv = 1, D = 8, bf16; the op's structure does not depend on them, and the kernel's own CPU arithmetic
is timed and taken out) on CPU with gloo, for P = 1 and 2 processes (`torch.distributed.run`) and k = 1,
2, 4, and reports per step:

  wall ms     median wall time of one forward + backward (no profiler), max over ranks; on CPU this is
              host work + the kernel's CPU arithmetic + gloo waits
  host ms     the same minus the kernel compute and the collectives' waits (`ComputeTimer`): the op's own
              issue work (Python, small aten ops, collective calls), median, max over ranks
  py calls    Python function calls (cProfile's count, built-ins included); 'op / glue': those made by the
              op's and the glue's Python (their own functions and the built-ins / torch helpers they call)
  aten ops    aten ops that would launch work on a GPU (a `TorchDispatchMode` counter:
              `tools/prepare_cost.OpCounter`; views, allocations without a fill excluded), split by where
              they are issued (op / glue / kernel / other: autograd's AccumulateGrad, the harness), and views
  split       cProfile time per step by where it is spent:
                op py      self time of our op's Python (megatron_splitkv/ops, comm.py)
                op aten    built-in (C) calls made from it (small torch ops, their dispatch)
                glue py    self time of the kernels' Python glue (kernels/*.py outside the compute below)
                glue aten  built-in calls made from the glue
                kernel     the kernel COMPUTE: the math kernel (kernels/math.py), the staircase kernel's dense
                           calls (DenseOps), the flex CPU emulation; with their built-in calls
                comm       torch.distributed's Python and the gloo calls / waits
                autograd   torch's Python around it (autograd.Function, Tensor methods) and the engine
              cProfile slows Python down (the ms are inflated); compare like with like
  top         the functions with the largest self time (cProfile), ours and overall (`--top`)

Backends: "math" (the CPU kernel, default), "staircase" (its dense calls run the CPU flash kernel and the
remainder the math kernel; options scaled down to the shapes by default, `--staircase small`, so that it
makes about as many dense calls as at 16K-128K on the GPU: see the 'dense calls' column), "flex" (CPU: the
dense emulation of flex; the glue as on the GPU but no compiled kernel, and the backward tangents and the
owner's merge take their torch paths, one Triton kernel each on the GPU: the CPU counts overstate those).

    .venv/bin/python tools/host_overhead.py                         # P = 1, 2; k = 1, 2, 4; math
    .venv/bin/python tools/host_overhead.py --backends math,flex,staircase --breakdown --top 25 \\
        --json out/host_overhead.json                               # + aten ops by issuing function
    .venv/bin/python tools/host_overhead.py --heads 32 --heads-kv 8 --num-chunks 2 --chunk-axis heads \
        --breakdown --digest                                        # head chunks

Without RANK in the environment it launches itself once per P with `python -m torch.distributed.run` and
prints one table at the end; under torchrun it is the worker (rank 0 reports). `--digest` adds a sha256 of
each row's outputs and gradients (bit-identity before/after a change of the op's code; tools/op_bits.py
checks many more configurations). The CPU ms are noisy on a shared machine: compare alternated runs with
more `--steps`; the counts are exact. No thresholds: a tool, not a test (tests/test_host_overhead.py only
checks that it runs and prints its columns).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

PKG = os.path.join(ROOT, "megatron_splitkv") + os.sep
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

COLUMNS = ["backend", "P", "k", "wall ms", "host ms", "py calls", "py calls op / glue", "aten ops", "aten op / glue / kernel / other", "views", "syncs",
           "op py", "op aten", "glue py", "glue aten", "kernel", "comm", "autograd", "profiled ms", "dense calls"]
CATEGORIES = ["op py", "op aten", "glue py", "glue aten", "kernel", "comm", "autograd", "other"]

#: (file suffix, function name) of the kernel COMPUTE (everything else under kernels/ is glue)
_COMPUTE = {("kernels/staircase.py", "fwd"), ("kernels/staircase.py", "bwd"),
            ("kernels/flex.py", "dense_flex_emulation"), ("kernels/flex.py", "block_mask_to_dense"),
            ("kernels/flex.py", "tiles"), ("kernels/flex.py", "mask_mod")}


def _where(func) -> str:
    """Category of a Python function's own (self) time; built-ins: '~'."""
    file, _, name = func
    if file == "~":
        return "~"
    if file.startswith(PKG):
        rel = file[len(PKG):].replace(os.sep, "/")
        if rel.startswith("kernels/"):
            if rel == "kernels/math.py" or any(rel == f and name == n for f, n in _COMPUTE):
                return "kernel"
            return "glue py"
        if rel == "comm.py" and name == "wait":  # Pending.wait: its self time is gloo's blocking wait
            return "comm"
        if rel.startswith("ops/") or rel == "comm.py":
            return "op py"
        return "other"  # the harness (bench.run_op)
    if file.startswith(TORCH_DIR + "distributed"):
        return "comm"
    if file.startswith(TORCH_DIR):
        return "autograd"
    return "other"


#: torch Python that is a category of its own whatever calls it (else: the caller's, `split_profile`)
_ROOTS = (("distributed", "comm"), ("autograd" + os.sep + "function.py", "autograd"))
_ATEN_OF = {"op py": "op aten", "glue py": "glue aten"}
#: torch.autograd.grad / backward run from the kernels' glue: the backward of the kernel's own graph (on the
#: GPU flex's compiled backward, on CPU the emulation's autograd) is kernel compute
_AUTOGRAD_OF = {"op py": "autograd", "other": "autograd", "glue py": "kernel"}


def _own_category(func):
    """Category of a function's self time when it does not depend on the caller, else None."""
    cat = _where(func)
    if cat in ("op py", "glue py", "kernel"):
        return cat
    file = func[0]
    if file.startswith(PKG):
        return "other"
    if file.startswith(TORCH_DIR):
        for sub, c in _ROOTS:
            if file.startswith(TORCH_DIR + sub):
                return c
    if file == "~" and "wait" in func[2]:
        return "comm"
    return None


def split_profile(stats: pstats.Stats, steps: int, calls: bool = False) -> dict:
    """ms per step by category (`CATEGORIES`) from a cProfile run. Our functions' self time goes to their own
    category; a built-in's or a torch Python helper's (torch/functional.py's einsum, Tensor methods) to its
    callers' categories, resolved through helper chains and weighted by the time spent under each caller:
    'op aten' / 'glue aten' under the op / the glue, 'kernel' under the kernel compute; torch.distributed
    (and gloo waits) is 'comm', torch.autograd (Function.apply, the engine) 'autograd'. calls: the same split
    of the CALL counts per step (weights from the callers' call counts) instead of ms."""
    idx = 1 if calls else 2  # cProfile caller entries: (primitive calls, calls, self time, cumulative time)
    memo, active = {}, set()

    def mix(func):
        """{category: weight} of the time spent in `func` itself."""
        if func in memo:
            return memo[func]
        own = _own_category(func)
        if own is not None:
            memo[func] = {own: 1.0}
            return memo[func]
        if func in active:  # recursion through helpers: call it torch's
            return {"autograd": 1.0}
        active.add(func)
        callers = stats.stats[func][4]
        total = sum(e[idx] for e in callers.values())
        engine = func[0].startswith(TORCH_DIR + "autograd")
        out = {}
        for caller, e in callers.items():
            w = e[idx] / total if total > 0 else 1.0 / len(callers)
            for cat, f in mix(caller).items():
                cat = _AUTOGRAD_OF.get(cat, cat) if engine else _ATEN_OF.get(cat, cat)
                out[cat] = out.get(cat, 0.0) + w * f
        active.discard(func)
        memo[func] = out or {"other": 1.0}
        return memo[func]

    out = dict.fromkeys(CATEGORIES, 0.0)
    for func, entry in stats.stats.items():
        for cat, f in mix(func).items():
            out[cat] += entry[idx] * f
    return {k: v * (1 if calls else 1e3) / steps for k, v in out.items()}


def top_functions(stats: pstats.Stats, steps: int, n: int, ours_only: bool) -> list:
    """[(self ms per step, calls per step, 'file:line(name)')] by self time."""
    rows = []
    for func, (_, nc, tt, _, _) in stats.stats.items():
        if ours_only and not func[0].startswith(PKG):
            continue
        file, line, name = func
        where = name if file == "~" else f"{os.path.relpath(file, ROOT) if file.startswith(ROOT) else file}:{line}({name})"
        rows.append((tt * 1e3 / steps, nc / steps, where))
    rows.sort(key=lambda r: -r[0])
    return rows[:n]


def _stack_category():
    """Where an aten op was issued from: (category, function) of the innermost frame of our package (op /
    glue / kernel / other) or of torch.distributed (comm); ('autograd', '') when neither is on the stack."""
    f, engine = sys._getframe(2), False
    while f is not None:
        code = f.f_code
        file = code.co_filename
        if file.startswith(PKG):
            cat = _where((file, 0, code.co_name))
            if engine and cat == "glue py":  # the backward of the kernel's own graph (flex's): compute
                cat = "kernel"
            return {"op py": "op", "glue py": "glue"}.get(cat, cat), \
                f"{os.path.relpath(file, PKG)}:{getattr(code, 'co_qualname', code.co_name)}"
        if file.startswith(TORCH_DIR + "distributed"):
            return "comm", ""
        engine = engine or file.startswith(TORCH_DIR + "autograd")
        f = f.f_back
    return "autograd", ""


def _op_counter():
    """`tools/prepare_cost.OpCounter` that also counts the ops by where they were issued (`by_where`)."""
    from collections import Counter

    from prepare_cost import OpCounter

    class WhereCounter(OpCounter):
        def __init__(self):
            super().__init__("cpu")
            self.by_where, self.by_func = Counter(), Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.n_ops
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.n_ops != before:
                cat, fn = _stack_category()
                self.by_where[cat] += 1
                if cat in ("op", "glue"):
                    self.by_func[f"{fn} {func._schema.name.split('::')[-1]}"] += 1
            return out

    return WhereCounter()


class ComputeTimer:
    """Wall time of the kernel COMPUTE and of the collectives' waits during the timed steps (no profiler).

    Compute: the math kernel's forward / backward, the staircase kernel's dense calls (`DenseOps.fwd` /
    `bwd`), the flex CPU emulation and `torch.autograd.grad` (on the op's path only flex's backward calls
    it: the backward of its own graph). Waits: `comm.Pending.wait` (gloo blocks the host until the peers'
    data arrived: at P > 1 that includes the other rank's compute). Wrapped with perf_counter, nested calls
    counted once. `host = wall - compute - waits`: the op's own issue work."""

    def __init__(self):
        from megatron_splitkv import comm
        from megatron_splitkv.kernels import flex, math as kmath, staircase

        self.ms, self.wait_ms, self._depth, self._patched = 0.0, 0.0, 0, []
        for owner, name in ((kmath.MathAttentionKernel, "forward"), (kmath.MathAttentionKernel, "backward"),
                            (staircase.DenseOps, "fwd"), (staircase.DenseOps, "bwd"),
                            (flex, "dense_flex_emulation"), (torch.autograd, "grad"), (comm.Pending, "wait")):
            self._patched.append((owner, name, getattr(owner, name)))

    def reset(self):
        self.ms = self.wait_ms = 0.0

    def _wrap(self, fn, attr):
        timer = self

        def timed(*args, **kwargs):
            if timer._depth:
                return fn(*args, **kwargs)
            timer._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(timer, attr, getattr(timer, attr) + (time.perf_counter() - t0) * 1e3)
                timer._depth -= 1

        return timed

    def __enter__(self):
        for owner, name, fn in self._patched:
            setattr(owner, name, self._wrap(fn, "wait_ms" if name == "wait" else "ms"))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self._patched:
            setattr(owner, name, fn)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(b"none" if t is None else t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------ worker


def worker(a) -> None:
    import torch.distributed as dist

    from tools import benchlib as bench
    from megatron_splitkv import SplitKVConfig
    from megatron_splitkv.kernels import get_kernel
    torch.set_num_threads(1)
    config = SplitKVConfig(staircase=_staircase_options(a))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = dist.group.WORLD
    dtype = getattr(torch, a.dtype)
    lens, anchors = bench.make_workload(a.context, a.anchors, seed=0)
    plan = bench.place(lens, anchors, cp_size=world, strategy="lpt", block_size=a.block_size)
    hkv = a.heads_kv or a.heads
    x = bench.rank_inputs(plan, rank, Hq=a.heads, Hkv=hkv, D=a.head_dim, dtype=dtype, device="cpu")
    if a.shuffle_context:  # this rank's context tokens in a fixed random order: the op sorts / unsorts them
        perm = torch.randperm(x["kv_seq"].shape[0], generator=torch.Generator().manual_seed(rank))
        for name in ("k_ctx", "v_ctx"):
            x[name] = x[name].detach()[perm].requires_grad_()
        for name in ("kv_seq", "kv_pos"):
            x[name] = x[name][perm]
    chunking = {"config": config} if a.chunk_axis is None else {"chunk_axis": a.chunk_axis, "config": config}
    rows = []
    for backend in a.backends:
        for k in a.num_chunks:
            meta = bench.prepare_meta("splitkv", x, block_size=a.block_size, cp_group=g, Hq=a.heads, Hkv=hkv,
                                      D=a.head_dim, dtype=dtype, num_chunks=k, **chunking)

            def step():
                return bench.run_op("splitkv", x, block_size=a.block_size, cp_group=g, backend=backend, meta=meta)

            kern = get_kernel(backend, "cpu", dtype, head_dim=a.head_dim, config=config)
            counts = getattr(kern, "counts", None)
            for _ in range(a.warmup):  # builds the masks' caches (math groups, staircase plans, BlockMasks)
                step()
            dense0 = dict(counts) if counts is not None else None
            step()
            dense = None if counts is None else counts["dense_fwd"] + counts["dense_bwd"] - dense0["dense_fwd"] - dense0["dense_bwd"]
            times, hosts = [], []
            with ComputeTimer() as timer:
                for _ in range(a.steps):
                    dist.barrier()
                    timer.reset()
                    t0 = time.perf_counter()
                    step()
                    times.append((time.perf_counter() - t0) * 1e3)
                    hosts.append(times[-1] - timer.ms - timer.wait_ms)
            med = torch.tensor([statistics.median(times), statistics.median(hosts)], dtype=torch.float64)
            allmed = [torch.empty_like(med) for _ in range(world)]
            dist.all_gather(allmed, med)
            dist.barrier()
            with _op_counter() as c:
                step()
            dist.barrier()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(a.profile_steps):
                step()
            prof.disable()
            prof_ms = (time.perf_counter() - t0) * 1e3 / a.profile_steps
            st = pstats.Stats(prof)
            row = {"backend": backend, "P": world, "k": meta.num_chunks, "context": a.context, "anchors": a.anchors,
                   "chunk_axis": getattr(meta, "chunk_axis", "rows"),
                   "wall_ms": max(float(t[0]) for t in allmed), "wall_ms_by_rank": [float(t[0]) for t in allmed],
                   "host_ms": max(float(t[1]) for t in allmed), "host_ms_by_rank": [float(t[1]) for t in allmed],
                   "py_calls": st.total_calls / a.profile_steps,
                   "py_calls_split": split_profile(st, a.profile_steps, calls=True), "aten_ops": c.n_ops, "views": c.n_views,
                   "syncs": c.n_syncs, "aten_by_where": dict(c.by_where), "split_ms": split_profile(st, a.profile_steps), "profiled_ms": prof_ms,
                   "dense_calls": dense,
                   "top_ours": top_functions(st, a.profile_steps, a.top, True),
                   "top_all": top_functions(st, a.profile_steps, a.top, False)}
            if a.breakdown:
                row["aten_by_op"] = dict(c.ops.most_common())
                row["aten_by_func"] = dict(c.by_func.most_common())
            if a.digest:
                out = step()
                row["digest"] = _digest([out] + [x[n].grad for n in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")])
            got = [None] * world
            dist.all_gather_object(got, row.get("digest"))
            if a.digest:
                row["digest_by_rank"] = got
            rows.append(row)
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f)


# ------------------------------------------------------------------------------------------ launcher


#: staircase options scaled down with the shapes (`--staircase small`, the default): at the drafter's 16K-128K
#: keys per rank the kernel makes ~10-40 dense calls per layer; at this tool's few hundred keys the defaults
#: would make none. Environment variables already set win.
STAIRCASE_SMALL = dict(group_blocks=16, sub_group_blocks=4, min_group_blocks=2, key_grain=32, min_keys=32,
                       min_pairs=2048, max_tile_keys=256)


def _staircase_options(a):
    """The staircase kernel's options of this run: STAIRCASE_SMALL with --staircase small, else the defaults."""
    from megatron_splitkv import StaircaseOptions

    return StaircaseOptions(**STAIRCASE_SMALL) if "staircase" in a.backends and a.staircase == "small" \
        else StaircaseOptions()


def _fmt_row(r) -> list:
    s = r["split_ms"]
    w = r["aten_by_where"]
    where = " / ".join(str(w.get(c, 0)) for c in ("op", "glue", "kernel")) + \
        f" / {sum(v for c, v in w.items() if c not in ('op', 'glue', 'kernel'))}"
    c = r["py_calls_split"]
    calls = f"{c['op py'] + c['op aten']:.0f} / {c['glue py'] + c['glue aten']:.0f}"
    k = r["k"] if r.get("chunk_axis", "rows") == "rows" or r["k"] == 1 else f"{r['k']} heads"
    return [r["backend"], r["P"], k, f"{r['wall_ms']:.2f}", f"{r['host_ms']:.2f}", f"{r['py_calls']:.0f}", calls, r["aten_ops"], where,
            r["views"], r["syncs"]] + [f"{s[c]:.2f}" for c in CATEGORIES[:7]] + [
        f"{r['profiled_ms']:.2f}", "-" if r["dense_calls"] is None else r["dense_calls"]]


def report(rows, a) -> None:
    from tools import benchlib as bench

    if "staircase" in a.backends:
        opts = _staircase_options(a)
        print("staircase options: " + ", ".join(f"{n}={getattr(opts, n)}" for n in STAIRCASE_SMALL))
    print(f"\nSplit-KV op host overhead per step (forward + backward, metadata reused; CPU, gloo, 1 thread per "
          f"rank; context {a.context}, {a.anchors} anchors x B {a.block_size}, Hq {a.heads}, Hkv {a.heads_kv or a.heads}, "
          f"D {a.head_dim}, "
          f"{a.dtype}; debug checks off; torch {torch.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print("wall ms: median of --steps, max over ranks, no profiler. op py ... autograd: cProfile ms per step "
          "(inflated by the profiler), 'profiled ms' their wall total.")
    for r in rows:
        print(f"\n== {r['backend']} P={r['P']} k={r['k']}: wall {r['wall_ms']:.2f} ms, host {r['host_ms']:.2f} ms "
              "(by rank " + " / ".join(f"{t:.2f}" for t in r["host_ms_by_rank"]) + ")" +
              (f", digest {r['digest']} (by rank {', '.join(r['digest_by_rank'])})" if "digest" in r else ""))
        print("  our functions, self ms per step (calls):")
        for ms, nc, where in r["top_ours"]:
            print(f"    {ms:7.3f} ms  x{nc:<6.0f} {where}")
        print("  all functions, self ms per step (calls):")
        for ms, nc, where in r["top_all"]:
            print(f"    {ms:7.3f} ms  x{nc:<6.0f} {where}")
        if "aten_by_op" in r:
            print("  aten ops:", ", ".join(f"{n} {v}" for n, v in r["aten_by_op"].items()))
            print("  aten ops of the op and the glue, by issuing function:")
            for n, v in r["aten_by_func"].items():
                print(f"    {v:4d}  {n}")
    print()
    print(bench.md_table(COLUMNS, [_fmt_row(r) for r in rows]))


def main(argv=None):
    from megatron_splitkv._ints import int_arg  # strict decimal numbers within their limits

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", default="1,2", help="CP sizes P (processes), comma list, each <= MAX_HOST_RANKS (64)")
    ap.add_argument("--num-chunks", default="1,2,4", help="Split-KV query chunks k, comma list")
    ap.add_argument("--backends", default="math", help="local kernels: math, staircase, flex (comma list)")
    ap.add_argument("--context", type=int_arg(1), default=1024, help="context tokens (one sequence)")
    ap.add_argument("--anchors", type=int_arg(1), default=64, help="query blocks (the drafter: 512; fewer keep the CPU "
                    "kernel's arithmetic small, the op's structure does not depend on it)")
    ap.add_argument("--staircase", default="small", choices=["small", "default"],
                    help="staircase options: scaled to the shapes (STAIRCASE_SMALL) or the kernel's defaults")
    ap.add_argument("--block-size", type=int_arg(1), default=16)
    ap.add_argument("--heads", type=int_arg(1), default=1, help="Hq (= Hkv unless --heads-kv)")
    ap.add_argument("--heads-kv", type=int_arg(1), default=None, help="Hkv (dividing --heads; default: --heads)")
    ap.add_argument("--chunk-axis", default=None, choices=["rows", "heads"],
                    help="what the --num-chunks chunks split (docs/lab/perf-notes.md item 21; default: the op's default)")
    ap.add_argument("--head-dim", type=int_arg(1), default=8)
    ap.add_argument("--shuffle-context", action="store_true",
                    help="each rank's context tokens in a random order (the planner gives them sorted: no unsort)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    ap.add_argument("--steps", type=int_arg(1), default=20, help="timed steps per row (median)")
    ap.add_argument("--warmup", type=int_arg(0), default=3)
    ap.add_argument("--profile-steps", type=int_arg(1), default=5, help="steps under cProfile")
    ap.add_argument("--top", type=int_arg(1), default=15, help="functions listed per row")
    ap.add_argument("--breakdown", action="store_true", help="also list the aten ops by name")
    ap.add_argument("--digest", action="store_true", help="sha256 of outputs and gradients per row")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from tools import benchlib as bench

    nprocs = bench.int_list_arg(ap, "--nproc", a.nproc, 1, bench.MAX_HOST_RANKS)
    a.num_chunks = bench.int_list_arg(ap, "--num-chunks", a.num_chunks, 1)
    a.backends = bench.choices_arg(ap, "--backends", a.backends, ("math", "staircase", "flex"), "backend")
    if a.heads_kv is not None and (a.heads_kv < 1 or a.heads % a.heads_kv):
        ap.error(f"--heads-kv must be >= 1 and divide --heads ({a.heads}), got {a.heads_kv}")
    for flag in ("context", "anchors", "block_size", "heads", "head_dim", "steps", "profile_steps", "top"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {a.warmup}")
    if a.worker or "RANK" in os.environ:
        from megatron_splitkv.comm import exit_process, shutdown_distributed

        worker(a)
        # no gloo worker thread may outlive the process groups into interpreter finalisation (it can abort
        # the process there: comm.shutdown_distributed); checked by exit_process
        shutdown_distributed()
        exit_process(0)
    rows = []
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    fwd = [arg for arg in (argv if argv is not None else sys.argv[1:])]
    with tempfile.TemporaryDirectory() as tmp:
        for p in nprocs:
            out = os.path.join(tmp, f"rows_{p}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(p),
                   os.path.abspath(__file__), "--worker"] + _strip(fwd, ("--json", "--nproc")) + ["--json", out]
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode:
                sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
                raise SystemExit(f"host_overhead: the P={p} run failed (exit {proc.returncode})")
            with open(out) as f:
                rows += json.load(f)
    report(rows, a)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "args": {k: v for k, v in vars(a).items() if k != "worker"},
                       "rows": rows}, f, indent=1)
    return rows


def _strip(argv, flags) -> list:
    """argv without `flags` and their values (`--flag v` or `--flag=v`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in flags:
            skip = True
            continue
        if any(arg.startswith(f + "=") for f in flags):
            continue
        out.append(arg)
    return out


if __name__ == "__main__":
    main()
