"""What does the per-step metadata cost? Device ops and host syncs of `prepare_splitkv_metadata` and of the
FlexAttention BlockMask builds (docs/lab/perf-notes.md "Prepare cost (item 13)"; CPU or one GPU).

Issue 6 asks for planner + sharding < 1% of a training step. Split-KV's per-step metadata is made once per
step on every CP rank (`ops.prepare_splitkv_metadata`, 1.2-3.0 ms on the H200: bench_attention's 'prep ms')
and the first kernel call of the step builds one FlexAttention BlockMask per chunk mask
(`kernels.flex.build_block_mask`, ~1.9 ms at 16K keys). Both are small tensors: on the GPU their cost is
kernel-launch latency (~5-10 us of CPU per op) and host syncs (each waits until the GPU queue drains). This
tool counts both with a `TorchDispatchMode`, on the DFlash Qwen3-8B drafter shapes (512 anchors x block 16,
Hq 32, Hkv 8, D 128, bf16; the planner's CP=1 placement of one sequence of each context length; CP=1 with a
size-1 gloo group):

  ops      aten ops that launch work (views, allocations without a fill, and ops on meta tensors excluded;
           one aten op ~ one kernel launch on a GPU, a sort or a searchsorted may launch a few)
  views    view / alias ops (no launch)
  syncs    host syncs: reads of device values (`.item()` / `bool()` / `int()` = aten._local_scalar_dense,
           `.tolist()`, copies device -> host), ops whose output size depends on the data (nonzero,
           masked_select, unique, repeat_interleave with a tensor of repeats, boolean indexing), and copies
           host -> device from pageable memory (`torch.tensor(list, device=cuda)`: synchronising in
           PyTorch unless pinned and non_blocking). On CPU every tensor stands for a device tensor: a
           tensor made from host data (aten.lift_fresh) counts as such an upload, `.tolist()` as a read
  ms       wall time per call (median of --reps; on CUDA between torch.cuda.synchronize calls, i.e. what
           the step pays when the GPU is idle; CPU: time of the calls themselves)

for prepare_splitkv_metadata(impl="splitkv", num_chunks=k) and for the first BlockMask build of each
chunk's own-block mask (`SplitKVMetadata.chunk_masks_own[c]` at the padded lengths the flex kernel runs,
`kernels.flex.padded_lengths`; built directly with `build_block_mask`, which is what the kernel's first
call does and what the CPU tests exercise). Prints one markdown table (and --json writes the rows).

    .venv/bin/python tools/prepare_cost.py                               # CPU: counts (+ CPU wall ms)
    python tools/prepare_cost.py --device cuda --reps 50                 # H200: counts + wall ms
    .venv/bin/python tools/prepare_cost.py --contexts 16384 --num-chunks 1 --breakdown   # ops by name

No thresholds: the counts are reported, not checked (the exactness of the rewritten pieces is tested in
tests/test_prepare_cost.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import benchlib as bench  # noqa: E402
from megatron_splitkv.kernels import flex  # noqa: E402

#: the DFlash Qwen3-8B drafter's attention shapes (docs/benchmarks.md)
ANCHORS, BLOCK, HQ, HKV, D = 512, 16, 32, 8, 128

_aten = torch.ops.aten
#: allocations without a kernel (a fill is its own op: full / zeros / ones count)
_NO_LAUNCH = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.new_empty.default,
              _aten.new_empty_strided.default, _aten.empty_like.default, _aten.lift_fresh.default,
              _aten.detach.default, _aten.alias.default, _aten._local_scalar_dense.default,
              _aten.set_.source_Storage_storage_offset, _aten.resize_.default}
#: ops whose output size depends on the data: a host sync on CUDA
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                   "unique_consecutive", "argwhere", "nonzero_static"}


def _overload_name(func) -> str:
    return func._schema.name.split("::")[-1]


class OpCounter(TorchDispatchMode):
    """Counts aten ops (launches / views) and host syncs issued inside the `with` block.

    `device`: the device the workload's tensors live on ("cpu" or "cuda"); on CPU every tensor stands for
    a device tensor (see the module docstring). `.tolist()` never reaches the dispatcher on a CPU tensor:
    it is counted by wrapping `torch.Tensor.tolist` while the mode is active."""

    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.cpu_mode = torch.device(device).type == "cpu"
        self.ops, self.views, self.syncs, self.host_ops = Counter(), Counter(), Counter(), Counter()
        self._in_tolist = 0

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._in_tolist:
            return out
        tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
        everything = tensors + _tensors_of(out)
        if everything and all(t.device.type == "meta" for t in everything):
            return out  # no data (e.g. the comm-stats record of a size-1 group)
        name = _overload_name(func)
        if func == _aten._local_scalar_dense.default:
            if not self.cpu_mode and tensors and tensors[0].device.type == "cpu":
                return out
            self.syncs["item/bool (_local_scalar_dense)"] += 1
            return out
        if func == _aten.lift_fresh.default:
            if self.cpu_mode:  # torch.tensor(host data, device=...): an upload on the GPU
                self.syncs["host->device upload (torch.tensor)"] += 1
            return out
        if name in ("_to_copy", "copy_", "copy"):
            kind = self._transfer(func, args, kwargs, out)
            if kind:
                self.syncs[kind] += 1
        if self._data_dependent(func, name, args, kwargs):
            if self.cpu_mode or any(t.device.type != "cpu" for t in tensors):
                self.syncs[f"data-dependent size ({name})"] += 1
        if func in _NO_LAUNCH or (func == _aten.scalar_tensor.default and self.cpu_mode):
            # scalar_tensor on CPU: the wrapped Python scalar of e.g. torch.where(c, x, 0), a kernel
            # argument on the GPU (on CUDA a device scalar_tensor is a real fill and counts)
            return out
        if not self.cpu_mode and all(t.device.type == "cpu" for t in everything):
            self.host_ops[name] += 1  # host-side work in a CUDA run: no launch
            return out
        if getattr(func, "is_view", False) or _returns_alias(func):
            self.views[name] += 1
        else:
            self.ops[name] += 1
        return out

    @staticmethod
    def _data_dependent(func, name, args, kwargs) -> bool:
        if name in _DATA_DEPENDENT:
            return True
        if func == _aten.repeat_interleave.Tensor:  # the output size is the sum of the repeats
            return kwargs.get("output_size") is None
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
            # boolean / uint8 masks are turned into indices with nonzero inside the kernel
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        return False

    def _transfer(self, func, args, kwargs, out):
        """'device->host copy' / 'host->device copy (pageable)' for a copy between devices, else None."""
        if self.cpu_mode:
            return None
        name = _overload_name(func)
        if name == "_to_copy":
            src, dst = args[0], out
            non_blocking = kwargs.get("non_blocking", False)
        else:  # copy_(self=dst, src)
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
            return None
        if src.device.type != "cpu" and dst.device.type == "cpu":
            return "device->host copy"
        if src.device.type == "cpu" and dst.device.type != "cpu" and not (non_blocking and src.is_pinned()):
            return "host->device copy (pageable)"
        return None

    # ------------------------------------------------------------------ tolist
    def __enter__(self):
        self._orig_tolist = torch.Tensor.tolist
        counter = self

        def tolist(t, *a, **k):
            if counter.cpu_mode and t.device.type == "cpu":
                counter.syncs["tolist (device->host)"] += 1
            elif not counter.cpu_mode and t.device.type != "cpu":
                counter.syncs["tolist (device->host)"] += 1
            counter._in_tolist += 1
            try:
                return counter._orig_tolist(t, *a, **k)
            finally:
                counter._in_tolist -= 1

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._orig_tolist
        return super().__exit__(*exc)

    @property
    def n_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def n_views(self) -> int:
        return sum(self.views.values())

    @property
    def n_syncs(self) -> int:
        return sum(self.syncs.values())


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _tensors_of(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def _returns_alias(func) -> bool:
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def count(fn, device) -> OpCounter:
    with OpCounter(device) as c:
        fn()
    return c


def wall_ms(fn, device, reps: int) -> float:
    """Median wall ms of fn() (CUDA: synchronised before and after each call)."""
    cuda = torch.device(device).type == "cuda"
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def size_one_group():
    """A CP group of size 1 (a single-process gloo group: the op's CP=1 path with a real group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def workload(context: int, device):
    """One rank's metadata tensors of the planner's CP=1 placement (activations unused: tiny heads)."""
    lens, anchors = bench.make_workload(context, ANCHORS, seed=0)
    plan = bench.place(lens, anchors, cp_size=1, block_size=BLOCK)
    return bench.rank_inputs(plan, 0, Hq=1, Hkv=1, D=1, dtype=torch.bfloat16, device=device, requires_grad=False)


def measure(context: int, k: int, device, group, reps: int, breakdown: bool):
    x = workload(context, device)

    def prep():
        return bench.prepare_meta("splitkv", x, block_size=BLOCK, cp_group=group, Hq=HQ, Hkv=HKV, D=D,
                                  dtype=torch.bfloat16, num_chunks=k)

    meta = prep()  # warm-up (lazy imports, allocator)
    masks = meta.chunk_masks_own
    lengths = [flex.padded_lengths(m.num_blocks * m.block_size, m.num_keys) for m in masks]

    def build():
        return [flex.build_block_mask(m, tq, tk) for m, (tq, tk) in zip(masks, lengths)]

    build()
    c_prep, c_mask = count(prep, device), count(build, device)
    row = {"context": context, "num_chunks": meta.num_chunks, "keys": meta.tk_local,
           "padded": [list(t) for t in lengths],
           "prep_ops": c_prep.n_ops, "prep_views": c_prep.n_views, "prep_syncs": c_prep.n_syncs,
           "mask_ops": c_mask.n_ops, "mask_views": c_mask.n_views, "mask_syncs": c_mask.n_syncs,
           "prep_ms": wall_ms(prep, device, reps), "mask_ms": wall_ms(build, device, reps),
           "prep_sync_kinds": dict(c_prep.syncs), "mask_sync_kinds": dict(c_mask.syncs)}
    if breakdown:
        row["prep_by_op"] = dict(c_prep.ops.most_common())
        row["mask_by_op"] = dict(c_mask.ops.most_common())
    return row


def main(argv=None):
    from megatron_splitkv._ints import int_arg  # strict decimal numbers within their limits

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="16384,131072", help="context tokens (one sequence), comma list")
    ap.add_argument("--num-chunks", default="1,2", help="Split-KV query chunks k, comma list")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int_arg(1), default=10, help="timed calls per row (median)")
    ap.add_argument("--breakdown", action="store_true", help="also print the ops by name")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    contexts = bench.int_list_arg(ap, "--contexts", args.contexts, 1)
    chunks = bench.int_list_arg(ap, "--num-chunks", args.num_chunks, 1)
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError):
        ap.error(f"--device: not a device, got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device must be cpu or a CUDA device, got {args.device!r}")
    if device.type == "cuda" and not (torch.cuda.is_available() and 0 <= (device.index or 0) < torch.cuda.device_count()):
        ap.error(f"--device {args.device}: no such CUDA device here ({torch.cuda.device_count()} available)")
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    group = size_one_group()
    rows = [measure(c, k, device, group, args.reps, args.breakdown) for c in contexts for k in chunks]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"prepare_splitkv_metadata(impl='splitkv') and the first flex BlockMask build per chunk mask; "
          f"CP=1 (size-1 gloo group), {ANCHORS} anchors x B {BLOCK}, Hq {HQ}, Hkv {HKV}, D {D}, bf16; {where}; "
          f"torch {torch.__version__}")
    print(bench.md_table(
        ["context", "k", "keys", "flex padded (Tq, Tk)", "prepare ops", "prepare syncs", "prepare ms",
         "BlockMask ops (all chunks)", "BlockMask syncs", "BlockMask ms"],
        [[r["context"], r["num_chunks"], r["keys"], "; ".join(f"{a}x{b}" for a, b in r["padded"]), r["prep_ops"],
          r["prep_syncs"], f"{r['prep_ms']:.2f}", r["mask_ops"], r["mask_syncs"], f"{r['mask_ms']:.2f}"]
         for r in rows]))
    for r in rows:
        kinds = ", ".join(f"{n} x{v}" for n, v in r["prep_sync_kinds"].items()) or "none"
        mk = ", ".join(f"{n} x{v}" for n, v in r["mask_sync_kinds"].items()) or "none"
        print(f"{r['context']} k={r['num_chunks']}: prepare syncs: {kinds}; BlockMask syncs: {mk}; views "
              f"{r['prep_views']} / {r['mask_views']}")
        if args.breakdown:
            print("  prepare ops:", ", ".join(f"{n} {v}" for n, v in r["prep_by_op"].items()))
            print("  BlockMask ops:", ", ".join(f"{n} {v}" for n, v in r["mask_by_op"].items()))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
