"""Planner and sharding overhead against a REAL DFlash drafter training step (issue 6: "planner and sharding
overhead < 1% of a training step"; docs/lab/perf-notes.md "Prepare cost (item 13)").

Until now the per-step overhead was divided by 5 x the attention op's time only. This tool builds the
project's Megatron DFlash drafter (`megatron_splitkv.megatron.models.DFlashDraftModel`, as
examples/pretrain_dflash.py builds it) at the Qwen3-8B drafter shapes (hidden 4096, 5 layers, 32 q / 8 kv
heads, head dim 128, FFN 12288, vocab 151936, taps `target_layer_ids(36, 5)` = 5 target layers -> fc
20480 -> 4096, bf16, local layer spec; the frozen embedding / LM head borrowed from a target built by
`build_target_model`, here with one layer since only its embedding and head are used),
`--context-parallel-impl splitkv`, query budget 512 anchors x block 16, and times one training step per
context length (`--contexts`, one sequence each):

  step   = per micro-batch work of pretrain_dflash.py's forward_step: LPT plan
           (`planning.plan_context_parallel`), the batch sharding (`data.shard_batch`, `build_draft_blocks`,
           the index tensors to the device), then the drafter's forward (the first layer's call prepares the
           op metadata, `prepare_splitkv_metadata`, and the local kernel builds its mask, e.g. the
           FlexAttention BlockMask) and backward, then (CP > 1) one all-reduce of the flat gradient buffer
           over the CP group (Megatron's DDP reduction, not overlapped), then the optimizer step
           (`--optimizer adamw`: torch AdamW, fused on CUDA, on the bf16 parameters, lr 0 so that every
           step sees the same weights and the A/B below can compare losses; Megatron's distributed
           optimizer with fp32 main weights costs more, so this step is shorter and the overhead's share
           larger; `--optimizer none`: no optimizer)
  input  = offline-feature mode: the target's tapped hidden states are random features already on the
           device (`--features-path` in pretrain_dflash.py); the frozen target's forward and the feature
           read are NOT part of the step. A step with the online target (36 Qwen3-8B layers over the whole
           context) is several times longer, so the shares reported are upper bounds (conservative).
  batch  = the same batch every step (the A/B needs it): what is cached per object (the plan, the shards,
           the params with their metadata and masks) is rebuilt by every fresh step; what is cached by
           shape only (FlexAttention compilations, cuDNN graphs, the staircase kernel's host caches) is warm
           in both arms, as it is in training once the bounded shape set has been seen.

The overhead is measured two ways, in ONE run, interleaved (every repeat runs all of them, the A/B order
alternating), medians over `--reps` repeats of the max over CP ranks:

  (a) each piece alone: plan (host), shard (shard_batch + blocks + upload, synchronised), prepare
      (`DFlashPackedSeqParams.op_metadata` on a new params object: `prepare_splitkv_metadata`, collective),
      BlockMask (the local kernel's first-call mask build, timed directly: the FlexAttention BlockMask
      builds of one forward op call with that new metadata, device synchronised around each build; n/a
      when the kernel builds none, e.g. the math kernel of --cpu-smoke; the op's first and cached calls
      are reported too)
  (b) A/B of the whole step: fresh (everything above per step) vs reused (the plan, the shards, the device
      tensors and the `DFlashPackedSeqParams` of the previous step, whose cached metadata and mask skip
      the prepare and the mask build: `DFlashDraftModel.forward(..., packed_seq_params=)`); overhead =
      median of the paired differences. Both give the same loss (checked, reported).
  (c) the same A/B for the arm "prefetched", pretrain_dflash.py's default data pipeline
      (`megatron_splitkv.data.pipeline.PrefetchedBatches`, `--dflash-data-workers`): plan + shard + draft
      blocks of the coming steps' batches are produced by `--data-workers` DataLoader worker processes
      (pinned memory on CUDA) while earlier steps run; the step takes the next one (`next`), uploads it
      (non_blocking) and builds new params, so it still prepares the metadata and builds the BlockMask.
      Overhead = median of (prefetched - reused); the piece "next + upload" is timed alone too. Same loss.
  (d) the arm "prefetched+meta", pretrain_dflash.py's default with --dflash-host-metadata (on with workers):
      the worker also builds this rank's Split-KV metadata from the plan
      (`ops.prepare_splitkv_metadata_from_plan`, FlexAttention block tables included on CUDA, packed into the
      batch's pinned buffer); the step takes the next batch, uploads it (one copy, metadata included), binds
      the metadata to the CP group (`SplitKVMetadata.bind`: views + BlockMask objects, no copy, no
      collective) and passes it in (`DFlashDraftModel.forward(..., metadata=)`): no prepare, no BlockMask
      build left on the step. Overhead = median of (prefetched+meta - reused); the piece "next + upload +
      bind" is timed alone too. Same loss as reused (checked), zero prepares per step (checked).
  (e) the arm "ahead", pretrain_dflash.py's default with --dflash-device-prefetch (on): prefetched+meta, but
      the next batch's next + upload + bind are issued right after this step's forward is issued
      (`megatron_splitkv.data.prefetch.DevicePrefetcher.prefetch`), while the GPU runs the forward, so the
      step starts with its batch on the device and bound. Overhead = median of (ahead - reused). Same loss.
  The arms run in a balanced order (a Williams design: each arm in each position and after each other
  arm once per 4 repeats for 4 arms; 2 x n repeats for an odd count n). `--arms` picks a subset (reused always runs; Williams order over the subset;
  % columns then of the reused step when fresh is left out).
  ONE data pipeline per process serves both prefetched arms, as a training run has one (one DataLoader: its
  worker process(es) and one pin thread; a second one alive raises): its items carry the metadata whenever
  prefetched+meta runs, and the prefetched arm drops it (the upload buffer cut before the metadata's region,
  its last: the same bytes as a pipeline without --dflash-host-metadata uploads). Before, each prefetched arm
  had a pipeline of its own (two workers and two pin threads competing with the timed steps).
  `--profile-data`: the prefetched+meta step's data part on host clocks (next alone, split by whether the
  worker's item was already received, the non_blocking upload's issue, the bind), a second table.

Also reported: the step's split (data = plan + shard in the fresh step, forward, backward, grad sync +
optimizer; CUDA events), the core attention's own time (forward + backward of every layer's
`SplitKVCoreAttention`, events at its forward and at the gradients of its output and key, in the reused
step: no prepare inside) and the rest, and the peak memory. % columns: overhead / fresh step, and /
(fresh step minus grad sync and optimizer), the more conservative one.

    # on one GPU (CP=1) and on two (CP=2, NCCL); needs megatron-core (requirements.txt; a directory
    # with it installed elsewhere can be named in $MEGATRON_SPLITKV_SITE):
    python tools/step_overhead.py
    torchrun --nproc-per-node 2 tools/step_overhead.py
    # or as a step of the GPU suite: SUITE_STEPS=stepcost bash tools/run_gpu_suite.sh
    # CPU smoke (tiny shapes, gloo): .venv/bin/python tools/step_overhead.py --cpu-smoke
    #                                .venv/bin/torchrun --nproc-per-node 2 tools/step_overhead.py --cpu-smoke

Prints the table last; writes step_overhead_cp<P>.json and .md into --out (default out/step_overhead),
rewritten after every context. A context that runs out of device memory is reported as skipped at CP=1;
at CP > 1 the rank that ran out prints it and exits (torchrun then stops the other ranks; the finished
rows are in the files). No thresholds: the numbers are reported, not checked.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# an extra site directory with megatron-core (tools/run_gpu_suite.sh installs it into /tmp/site)
SITE = os.environ.get("MEGATRON_SPLITKV_SITE", "/tmp/site")
if os.path.isdir(SITE) and SITE not in sys.path:
    sys.path.append(SITE)

from tools import benchlib as bench  # noqa: E402
from megatron_splitkv._ints import float_arg, int_arg, output_dir, parse_float  # noqa: E402

PREPARES = None  # PrepareCounter, set in main
BLOCK_MASKS = None  # BlockMaskTimer, set in main

QWEN3_FIRST_UNUSED_ID = 151669  # as examples/pretrain_dflash.py: the MASK row of the Qwen3 vocabulary
WHEEL_HINT = ("pip install -r requirements.txt (megatron-core 0.19), or name a directory where it is installed in "
              "MEGATRON_SPLITKV_SITE=<dir>")

#: the drafter at the Qwen3-8B shapes, and the CPU smoke shapes
REAL = dict(hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128, ffn=12288, vocab=151936,
            target_layers=36, anchors=512, block_size=16, contexts="16384,32768,131072", reps=20, warmup=2)
SMOKE = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256, target_layers=6,
             anchors=8, block_size=16, contexts="256,512", reps=3, warmup=1)

COLUMNS = ["context", "CP", "step ms (fresh)", "step ms (reused)", "fwd+bwd ms", "grad sync + opt ms",
           "attention ms", "rest ms", "plan ms", "shard ms", "prepare ms", "BlockMask ms", "next + upload ms",
           "next + upload + bind ms", "overhead ms (a: pieces)", "overhead ms (b: fresh - reused)",
           "overhead ms (c: prefetched - reused)", "overhead ms (d: prefetched+meta - reused)",
           "overhead ms (e: ahead - reused)", "% of step (a)", "% of step (b)", "% of step (c)", "% of step (d)",
           "% of step (e)", "% of fwd+bwd (a)", "loss - reused (b, c, d, e)",
           "peak GiB"]
#: the step's arms (see the module docstring), and the orders they run in, one per repeat in turn
ARMS = ("fresh", "reused", "prefetched", "prefetched+meta", "ahead")
#: the (d) step's data part with --profile-data (host clocks), printed as a second table before the main one
PROFILE_COLUMNS = ["context", "CP", "(d) data ms (events)", "next ms", "next ms (item ready)", "next ms (waited)",
                   "next waited (repeats)", "upload ms (host)", "bind ms", "items ready at next"]


def williams_orders(arms) -> list:
    """A Williams design over `arms`: every arm once in every position and right after every other arm once,
    per len(arms) repeats (an even count; an odd count needs the mirrored rows too: 2 x len(arms))."""
    n = len(arms)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [tuple(arms[i] for i in row) for row in rows]


#: a Williams design of the five arms (ten orders)
ORDERS = williams_orders(ARMS)
#: data pipelines (`PrefetchedBatches`) alive in this process now, and the most ever alive at once: the tool
#: runs ONE per process (both prefetched arms share it), as a training run does
PIPELINES = {"alive": 0, "max_alive": 0}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default=None,
                    help=f"context lengths, one sequence each, comma list (default {REAL['contexts']}; "
                         f"--cpu-smoke {SMOKE['contexts']})")
    ap.add_argument("--reps", type=int_arg(1), default=None, help="timed repeats (median; default 20, smoke 3)")
    ap.add_argument("--warmup", type=int_arg(0), default=None, help="untimed rounds per context (default 2, smoke 1)")
    ap.add_argument("--anchors", type=int_arg(1), default=None, help="query budget N per sequence (default 512)")
    ap.add_argument("--block-size", type=int_arg(2), default=None, help="draft block B (default 16)")
    ap.add_argument("--hidden", type=int_arg(1), default=None, help="hidden size (default 4096)")
    ap.add_argument("--layers", type=int_arg(1), default=None, help="drafter layers (default 5)")
    ap.add_argument("--heads", type=int_arg(1), default=None, help="query heads (default 32)")
    ap.add_argument("--kv-heads", type=int_arg(1), default=None, help="kv heads (default 8)")
    ap.add_argument("--head-dim", type=int_arg(1), default=None, help="head dim (default 128)")
    ap.add_argument("--ffn", type=int_arg(1), default=None, help="FFN hidden size (default 12288)")
    ap.add_argument("--vocab", type=int_arg(2), default=None, help="vocabulary (default 151936)")
    ap.add_argument("--target-layers", type=int_arg(1), default=None,
                    help="layers of the (virtual) target: sets the taps, target_layer_ids(n, layers) (default 36)")
    ap.add_argument("--kernel", default="auto", help="the op's local kernel (--splitkv-kernel; default auto)")
    ap.add_argument("--balance", default="lpt", help="planner strategy (--cp-balance; default lpt)")
    ap.add_argument("--chunk-size", type=int_arg(1), default=None, help="planner chunk (--cp-chunk-size; default auto)")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "none"),
                    help="optimizer step in the step: torch AdamW with lr 0 (default) or none")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help=f"the step's arms to time, comma list of {', '.join(ARMS)} (default all); reused always "
                         "runs (every overhead is paired with it), e.g. --arms reused,prefetched+meta")
    ap.add_argument("--profile-data", action="store_true",
                    help="also break the prefetched+meta step's data part down on the host: next() alone (and "
                         "whether the worker's item was ready), the pinned upload's issue, the bind; a second table")
    ap.add_argument("--data-workers", type=int_arg(1), default=1,
                    help="DataLoader worker processes of the ONE data pipeline per process that serves both "
                         "prefetched arms (pretrain_dflash.py --dflash-data-workers; default 1)")
    ap.add_argument("--data-prefetch", type=int_arg(1), default=2,
                    help="batches each worker prepares ahead (--dflash-data-prefetch; default 2)")
    ap.add_argument("--budget-s", type=float_arg(0), default=480.0,
                    help="start no new context after this many seconds (default 480; 0: no limit)")
    ap.add_argument("--seed", type=int_arg(0), default=0)
    ap.add_argument("--out", type=output_dir, default=os.path.join(ROOT, "out", "step_overhead"), help="output folder")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on CPU with gloo (a plumbing test; the timings mean nothing)")
    args = ap.parse_args(argv)
    base = SMOKE if args.cpu_smoke else REAL
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.context_list = bench.int_list_arg(ap, "--contexts", args.contexts, 1)
    for flag, name, lo in (("--reps", "reps", 1), ("--warmup", "warmup", 0), ("--anchors", "anchors", 1),
                           ("--block-size", "block_size", 2), ("--hidden", "hidden", 1), ("--layers", "layers", 1),
                           ("--heads", "heads", 1), ("--kv-heads", "kv_heads", 1), ("--head-dim", "head_dim", 1),
                           ("--ffn", "ffn", 1), ("--vocab", "vocab", 2), ("--target-layers", "target_layers", 1),
                           ("--data-workers", "data_workers", 1), ("--data-prefetch", "data_prefetch", 1)):
        if getattr(args, name) < lo:
            ap.error(f"{flag} must be >= {lo}, got {getattr(args, name)}")
    names = bench.choices_arg(ap, "--arms", args.arms, ARMS, "arm")
    args.arm_list = tuple(a for a in ARMS if a in names or a == "reused")  # in ARMS order, reused always
    if args.profile_data and "prefetched+meta" not in args.arm_list:
        ap.error("--profile-data profiles the prefetched+meta step: add prefetched+meta to --arms")
    if args.heads % args.kv_heads:
        ap.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.chunk_size is not None and args.chunk_size < 1:
        ap.error(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.budget_s < 0:
        ap.error(f"--budget-s must be >= 0, got {args.budget_s}")
    try:
        pg_timeout_s()
    except ValueError as exc:
        ap.error(str(exc))
    from megatron_splitkv.kernels import BACKENDS
    from megatron_splitkv.planning import STRATEGIES

    if args.kernel not in BACKENDS:
        ap.error(f"--kernel: unknown local kernel {args.kernel!r}; one of {', '.join(BACKENDS)}")
    if args.balance not in STRATEGIES:
        ap.error(f"--balance: unknown planner strategy {args.balance!r}; one of {', '.join(STRATEGIES)}")
    if args.layers > 1 and args.target_layers < 4:
        ap.error(f"--target-layers must be >= 4 with several drafter layers, got {args.target_layers}")
    if min(args.context_list) < 2:
        ap.error("--contexts: every context needs >= 2 tokens (an anchor a needs a + 1)")
    if not args.cpu_smoke and not torch.cuda.is_available():
        ap.error("no CUDA GPU here: run on a GPU, or pass --cpu-smoke (tiny shapes on CPU)")
    try:
        os.makedirs(args.out, exist_ok=True)
        probe = os.path.join(args.out, f".probe{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        ap.error(f"--out {args.out!r} is not writable: {e}")
    return args


# --------------------------------------------------------------------------------------------------
# process groups, clock
# --------------------------------------------------------------------------------------------------


#: env var: the process groups' timeout in seconds (default 600)
PG_TIMEOUT_ENV = "STEP_OVERHEAD_PG_TIMEOUT_S"


def pg_timeout_s() -> float:
    """STEP_OVERHEAD_PG_TIMEOUT_S (unset or empty: 600) as seconds: a finite number > 0
    (`_ints.parse_float`; float() took "nan" and "inf"); ValueError naming the variable otherwise."""
    raw = os.environ.get(PG_TIMEOUT_ENV, "").strip()
    return 600.0 if not raw else parse_float(raw, PG_TIMEOUT_ENV, minimum=0, above=True)


def init_distributed(cpu: bool):
    """The world (torchrun: WORLD_SIZE processes; else one) = one CP group; Megatron's parallel state with
    TP = 1, CP = world. Returns (device, rank, world, pgs, host_group) with host_group a gloo group for
    barriers and the exchange of timings (None for one process)."""
    import datetime

    import torch.distributed as dist

    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)  # NVLink multicast (NVLS) off unless the environment sets these
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if cpu:
        device = torch.device("cpu")
        backend = "gloo"
    else:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend = "nccl"
    timeout = datetime.timedelta(seconds=pg_timeout_s())
    if world == 1:  # plain `python`: a one-process group through env://, as `torchrun --nproc-per-node 1` makes
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(k, v)
    dist.init_process_group(backend, timeout=timeout)
    host = None
    if world > 1:
        host = dist.group.WORLD if cpu else dist.new_group(backend="gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=world,
                                 create_gloo_process_groups=False)
    if not cpu:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return device, rank, world, ProcessGroupCollection.use_mpu_process_groups(), host


class Clock:
    """Stamps on the device's stream (CUDA events; CPU: perf_counter), host barriers, max over ranks."""

    def __init__(self, device, host_group, world):
        self.cuda = device.type == "cuda"
        self.host, self.world = host_group, world

    def stamp(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def barrier(self):
        self.sync()
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.host)

    def gather(self, values: list) -> list:
        """Every rank's list of floats (same length everywhere), as a list per rank."""
        if self.world == 1:
            return [list(values)]
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.host)
        return [p.tolist() for p in parts]

    def agree(self, flag: bool) -> bool:
        """Rank 0's decision, on every rank."""
        if self.world == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.host)
        return bool(t.item())


class AttentionTimer:
    """Core attention time per step: stamps at each `SplitKVCoreAttention` forward (pre / post hooks) and,
    in backward, when its output's gradient arrives and when its key's gradient is complete (tensor hooks;
    the layers' backward intervals do not interleave). Module full-backward hooks are not used: they would
    replace the query tensor that the early query all-gather checks by identity."""

    def __init__(self, model, clock):
        from megatron_splitkv.megatron.attention import SplitKVCoreAttention

        self.clock, self.on = clock, False
        self.mods = [m for m in model.modules() if isinstance(m, SplitKVCoreAttention)]
        for m in self.mods:
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post)
        self.reset()

    def reset(self):
        self.fwd, self.bwd_start, self.bwd_end, self._t0 = [], [], [], None

    def _pre(self, mod, args):
        if not self.on:
            return
        self._t0 = self.clock.stamp()
        key = args[1] if len(args) > 1 else None
        if isinstance(key, torch.Tensor) and key.requires_grad:
            key.register_hook(lambda g: self.bwd_end.append(self.clock.stamp()))

    def _post(self, mod, args, out):
        if not self.on:
            return
        self.fwd.append((self._t0, self.clock.stamp()))
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: self.bwd_start.append(self.clock.stamp()))

    def total_ms(self) -> float:
        """Forward + backward of every layer's core attention in the last step (after a sync)."""
        f = sum(self.clock.ms(a, b) for a, b in self.fwd)
        if len(self.bwd_start) != len(self.bwd_end):
            return float("nan")
        return f + sum(self.clock.ms(a, b) for a, b in zip(self.bwd_start, self.bwd_end))


# --------------------------------------------------------------------------------------------------
# the model and one context's workload
# --------------------------------------------------------------------------------------------------


def build_model(args, device, dtype, pgs):
    """DFlashDraftModel as examples/pretrain_dflash.py's model_provider builds it (local spec, splitkv),
    with the embedding / LM head of a one-layer target. Returns (model, num_taps, mask_token_id)."""
    from megatron_splitkv.dflash import target_layer_ids
    from megatron_splitkv.megatron.models import DFlashDraftModel, build_target_model, qwen3_config

    cpu_init = device.type == "cpu"
    taps = target_layer_ids(args.target_layers, args.layers)
    shape = dict(hidden_size=args.hidden, num_attention_heads=args.heads, num_query_groups=args.kv_heads,
                 kv_channels=args.head_dim, ffn_hidden_size=args.ffn, params_dtype=dtype,
                 use_cpu_initialization=cpu_init)
    # only the embedding and the LM head of the target are used (offline features): one layer suffices
    target = build_target_model(qwen3_config(num_layers=1, **shape), vocab_size=args.vocab,
                                max_sequence_length=max(args.context_list) + args.block_size,
                                pg_collection=pgs, seed=args.seed + 1)
    mask_id = QWEN3_FIRST_UNUSED_ID if args.vocab > QWEN3_FIRST_UNUSED_ID else args.vocab - 1
    torch.manual_seed(args.seed)
    model = DFlashDraftModel(qwen3_config(num_layers=args.layers, **shape), num_taps=len(taps),
                             word_embeddings=target.embedding.word_embeddings, output_layer=target.output_layer,
                             mask_token_id=mask_id, block_size=args.block_size, cp_impl="splitkv",
                             pg_collection=pgs, loss_group=pgs.cp, rotary_base=1e6, kernel_backend=args.kernel,
                             use_te=False)
    del target  # its decoder layer is freed; the drafter holds the embedding and the head
    model = model.to(device=device, dtype=dtype)
    model.train()
    return model, len(taps), mask_id


class Trainer:
    """The step's parameter side: gradients in one flat buffer (Megatron's DDP layout: one all-reduce over
    the CP group at CP > 1), torch AdamW with lr 0 (or none)."""

    def __init__(self, model, args, device, cp_group, world):
        self.params = [p for p in model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in self.params)
        self.num_params = n
        self.flat = torch.zeros(n, dtype=self.params[0].dtype, device=device)
        off = 0
        for p in self.params:
            p.grad = self.flat[off:off + p.numel()].view_as(p)  # backward accumulates in place
            off += p.numel()
        self.cp_group, self.world = cp_group, world
        self.opt = None
        if args.optimizer == "adamw":
            kw = {"fused": True} if device.type == "cuda" else {"foreach": False}
            self.opt = torch.optim.AdamW(self.params, lr=0.0, **kw)

    def finish(self):
        """Grad sync (CP > 1) + optimizer step + zeroing for the next step."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(self.flat, group=self.cp_group)
        if self.opt is not None:
            self.opt.step()
        self.flat.zero_()


def _repeat(batch):
    """The same packed batch, endless (the prefetched arm's batch stream)."""
    while True:
        yield batch


class Workload:
    """One context length: a packed batch of one sequence (random ids, loss mask all ones, `anchors`
    DFlash anchors), this rank's random features, and the pieces of the per-step preparation."""

    def __init__(self, context, args, device, dtype, rank, world, num_taps, mask_id):
        from megatron_splitkv.data.sharegpt import make_packed_batch

        self.args, self.device, self.rank, self.world, self.mask_id = args, device, rank, world, mask_id
        rng = np.random.default_rng(args.seed + context)
        ids = rng.integers(0, min(mask_id, args.vocab), size=context, dtype=np.int64)
        self.batch = make_packed_batch([(ids, np.ones(context, dtype=bool))], num_anchors=args.anchors, rng=rng)
        plan, blocks, kv_seq, kv_pos = self.shard(self.plan())
        self.plan0, self.blocks, self.kv_seq, self.kv_pos = plan, blocks, kv_seq, kv_pos
        g = torch.Generator(device=device).manual_seed(args.seed + 7 * rank + 1)
        self.feats = torch.randn(kv_seq.shape[0], num_taps * args.hidden, generator=g, device=device,
                                 dtype=torch.float32).to(dtype)

    @contextlib.contextmanager
    def pipeline(self, metadata=None):
        """THE data pipeline of this process (pretrain_dflash.py's, `data.pipeline.PrefetchedBatches`) over this
        batch, repeated: --data-workers DataLoader worker processes plan, shard and build the draft blocks of
        the next steps' batches (the features are on the device already, as in `__init__`), pinned on CUDA;
        with `metadata` (a `MetadataSpec`, --dflash-host-metadata) also this rank's Split-KV metadata. Both
        prefetched arms take their items from it (the prefetched arm drops the metadata: `_without_metadata`).
        Counted in PIPELINES; a second one alive at once raises (a training run has one: two would compete
        with the timed steps for the cores and, through their pin threads, for the GIL)."""
        from megatron_splitkv.data.pipeline import PrefetchedBatches

        if PIPELINES["alive"]:
            raise RuntimeError("step_overhead: a second data pipeline in this process (the tool runs one)")
        a = self.args
        pipe = PrefetchedBatches(functools.partial(_repeat, self.batch), num_workers=a.data_workers,
                                 prefetch=a.data_prefetch, pin_memory=self.device.type == "cuda", cp_size=self.world,
                                 cp_rank=self.rank, block_size=a.block_size, mask_token_id=self.mask_id,
                                 chunk_size=a.chunk_size, strategy=a.balance, metadata=metadata)
        PIPELINES["alive"] += 1
        PIPELINES["max_alive"] = max(PIPELINES["max_alive"], PIPELINES["alive"])
        try:
            yield pipe
        finally:
            PIPELINES["alive"] -= 1
            pipe.close()

    def plan(self):
        from megatron_splitkv.planning import plan_context_parallel

        b = self.batch
        return plan_context_parallel(b.seq_lens, b.anchors, block_size=self.args.block_size, cp_size=self.world,
                                     chunk_size=self.args.chunk_size, strategy=self.args.balance)

    def shard(self, plan):
        """pretrain_dflash.py's forward_step after the plan: shard_batch, this rank's draft blocks, the
        index tensors on the device (the features are the data loader's, not timed)."""
        from megatron_splitkv.data import shard_batch
        from megatron_splitkv.dflash import build_draft_blocks

        b = self.batch
        shard = shard_batch(b.to_dict(), plan, self.rank)
        sl = plan.query_slice(self.rank)
        blocks = build_draft_blocks(b.input_ids, b.seq_lens, plan.q_seq[sl], plan.q_anchor[sl],
                                    block_size=self.args.block_size, mask_token_id=self.mask_id,
                                    loss_mask=b.loss_mask).to(self.device)
        kv_seq = torch.as_tensor(shard["kv_seq"]).to(self.device)
        kv_pos = torch.as_tensor(shard["kv_pos"]).to(self.device)
        return plan, blocks, kv_seq, kv_pos


# --------------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------------


class PrepareCounter:
    """Counts `prepare_splitkv_metadata` calls made through `DFlashPackedSeqParams.op_metadata` (the
    per-step prepare of the core attention), so that the report shows that a fresh step prepares once and
    a reused one never: wraps the name that `megatron_splitkv.megatron.attention` calls, for this tool."""

    def __init__(self):
        import megatron_splitkv.megatron.attention as att

        self.calls = 0
        inner = att.prepare_splitkv_metadata

        def counted(*a, **k):
            self.calls += 1
            return inner(*a, **k)

        att.prepare_splitkv_metadata = counted


class BlockMaskTimer:
    """Times the FlexAttention BlockMask builds directly: wraps `kernels.flex.build_block_mask` (the name the
    flex kernel's `block_mask` calls on a cache miss), synchronising the device (`sync`) before and after
    each build. `builds` / `ms`: their count and total milliseconds since `reset()`; a kernel that builds no
    BlockMask (math, ...) leaves builds at 0. (The BlockMask piece was the first op call minus a cached
    call: two noisy timings whose difference went negative where no BlockMask is built at all.)"""

    def __init__(self, sync):
        import megatron_splitkv.kernels.flex as flex

        self.builds, self.ms = 0, 0.0
        inner = flex.build_block_mask

        def timed(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = inner(*a, **k)
            sync()
            self.ms += (time.perf_counter() - t0) * 1e3
            self.builds += 1
            return out

        flex.build_block_mask = timed

    def reset(self):
        self.builds, self.ms = 0, 0.0


def _without_metadata(item):
    """The item as a pipeline without --dflash-host-metadata makes it: no metadata, and the upload buffer cut
    before the metadata's region (its last; the other fields' offsets unchanged), so that the prefetched arm
    uploads what it uploaded with a pipeline of its own. Host only: a view, a few objects."""
    if item.metadata is None:
        return item
    upload, layout, host, host_layout = item.buffers
    (_, _, _, off), = [x for x in layout if x[0] == "metadata"]
    rest = [x for x in layout if x[0] != "metadata"]
    assert all(x[3] < off for x in rest), "the metadata region is not the upload buffer's last"
    return dataclasses.replace(item, metadata=None, buffers=(upload[:off], rest, host, host_layout))


def _items_ready(pipe):
    """Items of `pipe` that `next` can take without waiting for a worker (the DataLoader iterator's received
    queue: from the pin thread on CUDA, from the workers on CPU, plus one already received out of turn), or
    None where the DataLoader does not show it. Cheap (a queue's size under its lock)."""
    it = getattr(pipe, "_it", None)
    try:
        cached = len(it._task_info.get(it._rcvd_idx, ())) == 2
        return int(it._data_queue.qsize()) + int(cached)
    except (AttributeError, NotImplementedError, TypeError):
        return None


def _next_item(pipe, kind, device):
    """The prefetched arms' data part up to the upload: the next item of the ONE pipeline (prefetched: without
    its metadata), uploaded (non_blocking)."""
    item = next(pipe)
    if kind == "prefetched":
        item = _without_metadata(item)
    return item.to(device, non_blocking=True)


def ahead_prefetcher(pipe, device, cp_group):
    """The "ahead" arm's iterator: pretrain_dflash.py's `DevicePrefetcher` over the ONE pipeline, each item
    uploaded (non_blocking) and its metadata bound, one step ahead when `prefetch()` is called."""
    from megatron_splitkv.data.prefetch import DevicePrefetcher

    def prepare(item):
        dev = item.to(device, non_blocking=True)
        return dev, dev.metadata.bind(cp_group, device)

    return DevicePrefetcher(pipe, prepare)


def run_step(model, trainer, work, clock, attn, kind, reused=None, pipe=None, profile=False, ahead=None):
    """One training step of arm `kind`: "fresh" (plan, shard, new params: prepare + mask in the first layer),
    "reused" (the cached batch and params `reused`), "prefetched" (the next planned batch of the pipeline
    `pipe`, prepared by its DataLoader worker while earlier steps ran, its metadata dropped: upload, new params:
    prepare + mask) or "prefetched+meta" (the next item with the worker-built metadata: upload, bind, no
    prepare) or "ahead" (prefetched+meta through `ahead`, a `DevicePrefetcher`: the batch prepared during
    the previous "ahead" step's forward; this step prepares the next one right after its forward is issued).
    With `profile` (prefetched+meta only) host clocks split its data part: next, upload, bind, and
    the items ready before next. Returns (timings dict, loss tensor)."""
    clock.barrier()
    attn.reset()
    n_prep = PREPARES.calls
    t0 = time.perf_counter()
    s0 = clock.stamp()
    extra, prof = {}, {}
    if kind == "fresh":
        plan = work.plan()
        _, blocks, kv_seq, kv_pos = work.shard(plan)
        params = None
    elif kind == "prefetched+meta" and profile:
        ready = _items_ready(pipe)
        h0 = time.perf_counter()
        item = next(pipe)
        h1 = time.perf_counter()
        dev = item.to(work.device, non_blocking=True)
        h2 = time.perf_counter()
        extra["metadata"] = dev.metadata.bind(model.pg_collection.cp, work.device)
        h3 = time.perf_counter()
        blocks, kv_seq, kv_pos, params = dev.blocks, dev.kv_seq, dev.kv_pos, None
        prof = {"next_host": (h1 - h0) * 1e3, "upload_host": (h2 - h1) * 1e3, "bind_host": (h3 - h2) * 1e3,
                "ready": float("nan") if ready is None else float(ready)}
    elif kind in ("prefetched", "prefetched+meta"):
        dev = _next_item(pipe, kind, work.device)
        blocks, kv_seq, kv_pos = dev.blocks, dev.kv_seq, dev.kv_pos
        params = None
        if dev.metadata is not None:  # bound to the drafter's CP group: views of the uploaded buffer, no copy
            extra["metadata"] = dev.metadata.bind(model.pg_collection.cp, work.device)
    elif kind == "ahead":
        dev, extra["metadata"] = next(ahead)
        blocks, kv_seq, kv_pos, params = dev.blocks, dev.kv_seq, dev.kv_pos, None
    else:
        blocks, kv_seq, kv_pos, params = work.blocks, work.kv_seq, work.kv_pos, reused
    s1 = clock.stamp()
    out = model(work.feats, blocks, kv_seq, kv_pos, packed_seq_params=params, **extra)
    s2 = clock.stamp()
    if kind == "ahead":  # as pretrain_dflash.py's forward_step: the GPU has the forward queued
        ahead.prefetch()
    out.loss.backward()
    s3 = clock.stamp()
    trainer.finish()
    s4 = clock.stamp()
    clock.sync()
    wall = (time.perf_counter() - t0) * 1e3
    t = {"wall": wall, "data": clock.ms(s0, s1), "fwd": clock.ms(s1, s2), "bwd": clock.ms(s2, s3),
         "opt": clock.ms(s3, s4), "attn": attn.total_ms(), "prepares": PREPARES.calls - n_prep, **prof}
    return t, out.total.detach()


def time_pieces(model, work, clock, args, qkv, pipe):
    """(a): plan, shard, prepare, BlockMask (its builds in the first op call, `BlockMaskTimer`), each alone; and the
    prefetched arms' data pieces alone (those of the arms run): the next planned batch from the pipeline + its
    upload (+ the bind of its metadata for prefetched+meta)."""
    from megatron_splitkv import splitkv_attention

    cp = model.pg_collection.cp
    clock.barrier()
    t0 = time.perf_counter()
    plan = work.plan()
    plan_ms = (time.perf_counter() - t0) * 1e3
    clock.barrier()
    t0 = time.perf_counter()
    _, blocks, kv_seq, kv_pos = work.shard(plan)
    clock.sync()
    shard_ms = (time.perf_counter() - t0) * 1e3
    upload_ms = bind_ms = float("nan")
    if "prefetched" in args.arm_list:
        clock.barrier()
        t0 = time.perf_counter()
        _next_item(pipe, "prefetched", work.device)
        clock.sync()
        upload_ms = (time.perf_counter() - t0) * 1e3
    if "prefetched+meta" in args.arm_list:
        clock.barrier()
        t0 = time.perf_counter()
        _next_item(pipe, "prefetched+meta", work.device).metadata.bind(cp, work.device)
        clock.sync()
        bind_ms = (time.perf_counter() - t0) * 1e3
    params = model.packed_seq_params(blocks, kv_seq, kv_pos)
    clock.barrier()
    t0 = time.perf_counter()
    meta = params.op_metadata("splitkv", num_heads_q=args.heads, num_heads_kv=args.kv_heads,
                              head_dim=args.head_dim, dtype=qkv[0].dtype, device=qkv[0].device, cp_group=cp)
    clock.sync()
    prep_ms = (time.perf_counter() - t0) * 1e3
    calls = []
    BLOCK_MASKS.reset()
    for i in range(2):  # the first builds the kernel's mask on the new metadata, the second finds it cached
        if i == 1:
            mask_ms, mask_builds = BLOCK_MASKS.ms, BLOCK_MASKS.builds
        clock.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            splitkv_attention(*qkv, None, None, None, None, metadata=meta, backend=args.kernel,
                              softmax_scale=1.0 / math.sqrt(args.head_dim))
        clock.sync()
        calls.append((time.perf_counter() - t0) * 1e3)
    return {"plan": plan_ms, "shard": shard_ms, "prepare": prep_ms, "mask": mask_ms,
            "mask_builds": float(mask_builds), "op_cold": calls[0], "op_warm": calls[1], "upload": upload_ms,
            "upload_bind": bind_ms}


def _med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def measure_context(context, model, trainer, attn, clock, args, device, dtype, rank, world, num_taps, mask_id):
    work = Workload(context, args, device, dtype, rank, world, num_taps, mask_id)
    reused = model.packed_seq_params(work.blocks, work.kv_seq, work.kv_pos)
    nq = work.blocks.input_ids.shape[0]
    g = torch.Generator(device=device).manual_seed(args.seed + 100 + rank)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    qkv = (rnd(nq, args.heads, args.head_dim), rnd(work.kv_seq.shape[0], args.kv_heads, args.head_dim),
           rnd(work.kv_seq.shape[0], args.kv_heads, args.head_dim), rnd(nq, args.kv_heads, args.head_dim),
           rnd(nq, args.kv_heads, args.head_dim))
    from megatron_splitkv.megatron import splitkv_metadata_spec

    spec = splitkv_metadata_spec(model.config, tp_size=1, kernel_backend=args.kernel, cuda=device.type == "cuda")
    arms = args.arm_list
    order = williams_orders(arms)
    # ONE pipeline per process for both prefetched arms: its items carry the metadata when prefetched+meta runs
    # (the prefetched arm drops it), none otherwise; no pipeline when neither runs
    prefetching = any(a in arms for a in ("prefetched", "prefetched+meta", "ahead"))
    with_meta = "prefetched+meta" in arms or "ahead" in arms
    pipeline = (work.pipeline(metadata=spec if with_meta else None) if prefetching
                else contextlib.nullcontext(None))
    nan = float("nan")
    with pipeline as pipe:
        ahead = ahead_prefetcher(pipe, device, model.pg_collection.cp) if "ahead" in arms else None
        attn.on = True
        for _ in range(args.warmup):  # compiles, cuDNN graphs, allocator; the reused params get their metadata
            for kind in arms:
                run_step(model, trainer, work, clock, attn, kind, reused, pipe, ahead=ahead)
            time_pieces(model, work, clock, args, qkv, pipe)
        import multiprocessing

        workers_alive = len(multiprocessing.active_children())  # this process's DataLoader workers (ranks: none)
        keys = ["fresh_wall", "reused_wall", "diff", "fresh_data", "fresh_fwd", "fresh_bwd", "fresh_opt",
                "fresh_attn", "reused_fwd", "reused_bwd", "reused_opt", "reused_attn",
                "pref_wall", "pref_diff", "pref_data", "pmeta_wall", "pmeta_diff", "pmeta_data",
                "next_host", "upload_host", "bind_host", "ready", "ahead_wall", "ahead_diff", "ahead_data",
                "plan", "shard", "prepare", "mask", "mask_builds", "op_cold", "op_warm", "upload", "upload_bind"]
        n_step_keys = keys.index("plan")
        empty = {"wall": nan, "data": nan, "fwd": nan, "bwd": nan, "opt": nan, "attn": nan}
        per_rep, losses, prepares = [], [], {k: set() for k in ARMS}
        for r in range(args.reps):
            res = {}
            for kind in order[r % len(order)]:  # the balanced orders of the arms run, in turn
                t, loss = run_step(model, trainer, work, clock, attn, kind, reused, pipe, args.profile_data, ahead)
                res[kind], res[kind + "_loss"] = t, loss
                prepares[kind].add(t["prepares"])
            p = time_pieces(model, work, clock, args, qkv, pipe)
            f, u, q, m, e = (res.get(k, empty) for k in ARMS)
            per_rep.append([f["wall"], u["wall"], f["wall"] - u["wall"], f["data"], f["fwd"], f["bwd"], f["opt"],
                            f["attn"], u["fwd"], u["bwd"], u["opt"], u["attn"], q["wall"], q["wall"] - u["wall"],
                            q["data"], m["wall"], m["wall"] - u["wall"], m["data"],
                            m.get("next_host", nan), m.get("upload_host", nan), m.get("bind_host", nan),
                            m.get("ready", nan), e["wall"], e["wall"] - u["wall"], e["data"]]
                           + [p[k] for k in keys[n_step_keys:]])
            losses.append({k: float(res[k + "_loss"]) for k in arms})
        attn.on = False
    # max over ranks per repeat (every rank's time counts: the step waits for the slowest), then medians
    flat = [v for row in per_rep for v in row]
    by_rank = clock.gather(flat + [float(PIPELINES["max_alive"]), float(workers_alive)])
    max_pipelines = max(int(rk[-2]) for rk in by_rank)
    workers_alive = max(int(rk[-1]) for rk in by_rank)
    n = len(keys)
    worst = [[max(rk[i * n + j] for rk in by_rank) for j in range(n)] for i in range(args.reps)]
    ready_min = [min(rk[i * n + keys.index("ready")] for rk in by_rank) for i in range(args.reps)]
    med = {k: _med([row[j] for row in worst]) for j, k in enumerate(keys)}
    # --profile-data: next() pooled over ranks and repeats, split by whether the worker's item was ready
    pooled = [(rk[i * n + keys.index("next_host")], rk[i * n + keys.index("ready")]) for rk in by_rank
              for i in range(args.reps)]
    next_ready = _med([t for t, k in pooled if k == k and k > 0])
    next_waited = _med([t for t, k in pooled if k == k and k == 0])
    waits = sum(1 for k in ready_min if k == k and k == 0)  # repeats where some rank found no item ready
    peak = None  # CPU: not measured
    if device.type == "cuda":
        peak = max(v[0] for v in clock.gather([torch.cuda.max_memory_allocated(device) / 2**30]))
    # the % columns' step: the fresh one, or the reused one when --arms leaves fresh out
    base_wall, base_opt = ((med["fresh_wall"], med["fresh_opt"]) if "fresh" in arms
                           else (med["reused_wall"], med["reused_opt"]))
    # no BlockMask built on any rank (e.g. the math kernel): the piece is n/a (None), 0 ms in the sums
    mask_ms = med["mask"] if med["mask_builds"] > 0 else None
    pieces = med["plan"] + med["shard"] + med["prepare"] + (mask_ms or 0.0)
    fwdbwd = base_wall - base_opt
    loss_diff = max(abs(v - ls["reused"]) for ls in losses for v in ls.values())
    return {
        "context": context, "cp": world, "tokens_this_rank": int(work.kv_seq.shape[0]),
        "blocks_per_rank": int(work.blocks.q_seq.shape[0]), "imbalance": float(work.plan0.imbalance),
        "step_fresh_ms": med["fresh_wall"], "step_reused_ms": med["reused_wall"], "fwdbwd_ms": fwdbwd,
        "gradsync_opt_ms": base_opt, "data_ms": med["fresh_data"], "fwd_ms": med["fresh_fwd"],
        "bwd_ms": med["fresh_bwd"], "reused_fwd_ms": med["reused_fwd"], "reused_bwd_ms": med["reused_bwd"],
        "attention_ms": med["reused_attn"], "attention_fresh_ms": med["fresh_attn"],
        "rest_ms": med["reused_wall"] - med["reused_attn"],
        "plan_ms": med["plan"], "shard_ms": med["shard"], "prepare_ms": med["prepare"], "mask_ms": mask_ms,
        "block_masks_built": int(med["mask_builds"]),
        "op_first_call_ms": med["op_cold"], "op_cached_call_ms": med["op_warm"],
        "overhead_pieces_ms": pieces, "overhead_ab_ms": med["diff"],
        "pct_step_pieces": 100 * pieces / base_wall, "pct_step_ab": 100 * med["diff"] / base_wall,
        "pct_fwdbwd_pieces": 100 * pieces / fwdbwd, "pct_fwdbwd_ab": 100 * med["diff"] / fwdbwd,
        # (c) the prefetched arm: plan + shard + blocks in the data pipeline's worker, the step uploads
        "step_prefetched_ms": med["pref_wall"], "prefetched_data_ms": med["pref_data"], "upload_ms": med["upload"],
        "overhead_prefetched_ms": med["pref_diff"], "pct_step_prefetched": 100 * med["pref_diff"] / base_wall,
        "pct_fwdbwd_prefetched": 100 * med["pref_diff"] / fwdbwd,
        "overhead_pieces_prefetched_ms": med["upload"] + med["prepare"] + (mask_ms or 0.0),
        # (d) prefetched+meta: the metadata built in the worker too; the step uploads + binds it
        "step_prefetched_meta_ms": med["pmeta_wall"], "prefetched_meta_data_ms": med["pmeta_data"],
        "upload_bind_ms": med["upload_bind"], "overhead_prefetched_meta_ms": med["pmeta_diff"],
        "pct_step_prefetched_meta": 100 * med["pmeta_diff"] / base_wall,
        "pct_fwdbwd_prefetched_meta": 100 * med["pmeta_diff"] / fwdbwd,
        # (e) ahead: prefetched+meta with the next batch's upload + bind issued during this step's forward
        "step_ahead_ms": med["ahead_wall"], "ahead_data_ms": med["ahead_data"],
        "overhead_ahead_ms": med["ahead_diff"], "pct_step_ahead": 100 * med["ahead_diff"] / base_wall,
        "pct_fwdbwd_ahead": 100 * med["ahead_diff"] / fwdbwd,
        "host_metadata_flex_tables": bool(spec.flex_block_masks),
        "data_workers": args.data_workers, "arms": list(arms), "pct_of": "fresh" if "fresh" in arms else "reused",
        # one data pipeline per process (both prefetched arms share it): the most alive at once on any rank, and
        # the worker processes alive in a rank after the warm-up (its DataLoader's; 0 without a prefetched arm)
        "data_pipelines_max_alive": max_pipelines, "data_worker_processes": workers_alive,
        "pipeline_metadata": with_meta,
        "loss_fresh": losses[-1].get("fresh"), "loss_reused": losses[-1]["reused"],
        "loss_prefetched": losses[-1].get("prefetched"), "loss_prefetched_meta": losses[-1].get("prefetched+meta"),
        "loss_ahead": losses[-1].get("ahead"),
        "loss_max_abs_diff": loss_diff, "peak_gib": peak, "reps": args.reps,
        "prepares_per_step_fresh": sorted(prepares["fresh"]), "prepares_per_step_reused": sorted(prepares["reused"]),
        "prepares_per_step_prefetched": sorted(prepares["prefetched"]),
        "prepares_per_step_prefetched_meta": sorted(prepares["prefetched+meta"]),
        "prepares_per_step_ahead": sorted(prepares["ahead"]),
        # --profile-data (host clocks, the prefetched+meta step's data part; medians of the max over ranks)
        "profile_data": bool(args.profile_data), "profile_next_ms": med["next_host"],
        "profile_next_ready_ms": next_ready, "profile_next_waited_ms": next_waited,
        "profile_next_waited_reps": waits if any(k == k for k in ready_min) else None,
        "profile_upload_host_ms": med["upload_host"], "profile_bind_ms": med["bind_host"],
        "profile_items_ready": _med(ready_min),  # per repeat the fewest over ranks
    }


def _fmt(x, f="{:.2f}"):
    return bench.finite(x, f)


#: the BlockMask cell when the kernel built none (math kernel, --cpu-smoke)
NO_MASK = "n/a (none built)"


def _mask_cell(ms):
    return NO_MASK if ms is None else _fmt(ms)


def table(rows) -> str:
    out = []
    for r in rows:
        if "skipped" in r:
            out.append([r["context"], r["cp"]] + [f"skipped: {r['skipped']}"] + ["-"] * (len(COLUMNS) - 3))
            continue
        out.append([r["context"], r["cp"], _fmt(r["step_fresh_ms"]), _fmt(r["step_reused_ms"]), _fmt(r["fwdbwd_ms"]),
                    _fmt(r["gradsync_opt_ms"]), _fmt(r["attention_ms"]), _fmt(r["rest_ms"]), _fmt(r["plan_ms"]),
                    _fmt(r["shard_ms"]), _fmt(r["prepare_ms"]), _mask_cell(r["mask_ms"]), _fmt(r["upload_ms"]),
                    _fmt(r["upload_bind_ms"]), _fmt(r["overhead_pieces_ms"]), _fmt(r["overhead_ab_ms"]),
                    _fmt(r["overhead_prefetched_ms"]), _fmt(r["overhead_prefetched_meta_ms"]),
                    _fmt(r["overhead_ahead_ms"]), _fmt(r["pct_step_pieces"]), _fmt(r["pct_step_ab"]),
                    _fmt(r["pct_step_prefetched"]), _fmt(r["pct_step_prefetched_meta"]), _fmt(r["pct_step_ahead"]),
                    _fmt(r["pct_fwdbwd_pieces"]),
                    f"{r['loss_max_abs_diff']:.1e}", _fmt(r["peak_gib"])])
    return bench.md_table(COLUMNS, out)


def profile_table(rows) -> str:
    """--profile-data: the prefetched+meta step's data part, host clocks (rows measured with it)."""
    out = []
    for r in rows:
        if "skipped" in r or not r.get("profile_data"):
            continue
        w = r["profile_next_waited_reps"]
        out.append([r["context"], r["cp"], _fmt(r["prefetched_meta_data_ms"]), _fmt(r["profile_next_ms"], "{:.3f}"),
                    _fmt(r["profile_next_ready_ms"], "{:.3f}"), _fmt(r["profile_next_waited_ms"], "{:.3f}"),
                    "-" if w is None else f"{w} of {r['reps']}", _fmt(r["profile_upload_host_ms"], "{:.3f}"),
                    _fmt(r["profile_bind_ms"], "{:.3f}"), _fmt(r["profile_items_ready"], "{:g}")])
    return bench.md_table(PROFILE_COLUMNS, out)


PROFILE_NOTE = ("the prefetched+meta step's data part on the host (--profile-data): (d) data = its CUDA-event span "
                "(next + upload + bind as the stream sees it), next = `next(pipeline)` alone, split by whether the "
                "worker's item was already received (items ready > 0 before the call) or next had to wait for it "
                "(pooled over ranks and repeats), waited = repeats in which some rank found none ready, upload = "
                "issuing the non_blocking copy (host), bind = `item.metadata.bind`: since item 17 it includes building the "
                "metadata's views of the uploaded buffer on first access (lazy: not in next, the pin thread or "
                "the upload); medians of the max over ranks")


def header(args, device, world, num_params) -> str:
    import importlib.metadata as md

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    try:
        mcore = md.version("megatron-core")
    except md.PackageNotFoundError:
        import megatron.core

        mcore = getattr(megatron.core, "__version__", "?")
    try:  # only when ROOT is itself a checkout (a `git archive` copy inside another repository is not)
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10).stdout.split()
        git = out[1] if len(out) == 2 and os.path.realpath(out[0]) == os.path.realpath(ROOT) else "? (not a checkout)"
    except (OSError, subprocess.SubprocessError):
        git = "?"
    dt = "bf16" if device.type == "cuda" else "fp32"
    opt = (f"torch AdamW lr 0{' (fused)' if device.type == 'cuda' else ''} on the {dt} params"
           if args.optimizer == "adamw" else "none")
    return (f"DFlash drafter training step, CP={world} ({'NCCL' if device.type == 'cuda' else 'gloo'}), {where}; "
            f"hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads x {args.head_dim}, FFN "
            f"{args.ffn}, vocab {args.vocab}, taps of a {args.target_layers}-layer target, "
            f"{num_params / 1e6:.4g}M trainable {dt} params; {args.anchors} anchors x B {args.block_size}; "
            f"splitkv, kernel {args.kernel}, planner {args.balance}; offline features (target forward not in "
            f"the step); optimizer: {opt}; {args.reps} repeats, medians of the max over ranks; arms: fresh = plan + "
            f"shard (+ blocks, upload) + prepare + BlockMask in the step (pretrain_dflash.py with "
            f"--dflash-data-workers 0), reused = none of them (the previous step's batch and params), prefetched = "
            f"plan + shard + blocks in {args.data_workers} DataLoader worker process(es) ahead of the step, which "
            f"takes the next batch, uploads it{' from pinned memory' if device.type == 'cuda' else ''} and does "
            f"prepare + BlockMask (--dflash-host-metadata off), prefetched+meta = the same worker(s) also build the "
            f"Split-KV metadata from the plan{' (+ FlexAttention block tables)' if device.type == 'cuda' else ''}, "
            f"the step takes the next batch, uploads it (metadata included) and binds the metadata to the CP group: "
            f"no prepare, no BlockMask build (--dflash-host-metadata on), ahead = prefetched+meta with the next "
            f"batch's next + upload + bind issued right after this step's forward is issued (the default, "
            f"--dflash-device-prefetch on); overhead (a) = "
            f"plan + shard + prepare + BlockMask each alone (BlockMask: its builds timed directly, {NO_MASK} "
            f"when the kernel builds none), (b) = fresh - reused, (c) = prefetched - reused, "
            f"(d) = prefetched+meta - reused, (e) = ahead - reused (paired per repeat); arms run: {', '.join(args.arm_list)} (Williams "
            f"order){'' if 'fresh' in args.arm_list else '; % of step: of the REUSED step (no fresh arm run)'}; "
            f"{_pipeline_note(args)}; torch "
            f"{torch.__version__}, megatron-core {mcore}, git {git}, "
            "debug checks off (SplitKVConfig default)")


def _pipeline_note(args) -> str:
    arms = args.arm_list
    if not any(a in arms for a in ("prefetched", "prefetched+meta", "ahead")):
        return "no data pipeline (no prefetched arm run)"
    note = (f"ONE data pipeline per process (one DataLoader: {args.data_workers} worker process(es), one pin "
            f"thread), as in training")
    if "prefetched" in arms and ("prefetched+meta" in arms or "ahead" in arms):
        note += (", serving every prefetched arm: its items carry the metadata, the prefetched arm drops it "
                 "(uploads the batch without the metadata's region, as with --dflash-host-metadata off)")
    return note


def write(args, world, head, rows):
    base = os.path.join(args.out, f"step_overhead_cp{world}")
    with open(base + ".json", "w") as f:
        json.dump({"setup": head, "args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1,
                  default=str)
    with open(base + ".md", "w") as f:
        f.write(f"{head}\n\n{table(rows)}\n")
        if args.profile_data:
            f.write(f"\n{PROFILE_NOTE}\n\n{profile_table(rows)}\n")
    return base


def main(argv=None):
    args = parse_args(argv)
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        print(f"step_overhead.py needs megatron-core: {WHEEL_HINT}", file=sys.stderr)
        return 2
    if args.cpu_smoke:
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    device, rank, world, pgs, host = init_distributed(args.cpu_smoke)
    global PREPARES, BLOCK_MASKS
    PREPARES = PrepareCounter()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    clock = Clock(device, host, world)
    BLOCK_MASKS = BlockMaskTimer(clock.sync)
    t_start = time.perf_counter()
    model, num_taps, mask_id = build_model(args, device, dtype, pgs)
    trainer = Trainer(model, args, device, pgs.cp, world)
    attn = AttentionTimer(model, clock)
    head = header(args, device, world, trainer.num_params)
    if rank == 0:
        print(head, flush=True)
    rows = []
    for context in args.context_list:
        late = args.budget_s > 0 and time.perf_counter() - t_start > args.budget_s
        if clock.agree(late):
            rows.append({"context": context, "cp": world, "skipped": f"--budget-s {args.budget_s:g} reached"})
            if rank == 0:
                print(f"context {context}: skipped, --budget-s {args.budget_s:g} reached", flush=True)
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        try:
            row = measure_context(context, model, trainer, attn, clock, args, device, dtype, rank, world,
                                  num_taps, mask_id)
        except (torch.OutOfMemoryError, RuntimeError) as e:  # cuDNN / Triton may report it as a RuntimeError
            if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e).lower():
                raise
            attn.on = False
            msg = f"out of device memory at context {context}, CP={world}, rank {rank}: {str(e).splitlines()[0]}"
            print(msg, file=sys.stderr, flush=True)
            if world > 1:  # the other ranks wait in a collective: stop here (torchrun ends them)
                if rank == 0:
                    write(args, world, head, rows + [{"context": context, "cp": world, "skipped": "out of memory"}])
                sys.stderr.flush()
                os._exit(3)
            row = {"context": context, "cp": world, "skipped": "out of memory"}
            trainer.flat.zero_()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        if rank == 0:
            print(f"context {context}: {time.perf_counter() - t0:.1f} s", flush=True)
            write(args, world, head, rows)
    if rank == 0:
        base = write(args, world, head, rows)
        print(f"wrote {base}.json, {base}.md")
        if args.profile_data:  # before the main table, which stays last
            print(f"{PROFILE_NOTE}\n\n{profile_table(rows)}\n")
        print(table(rows))
    from megatron_splitkv.comm import shutdown_distributed

    shutdown_distributed()  # Megatron's groups too; no gloo thread may outlive main (comm.shutdown_distributed)
    return 0


if __name__ == "__main__":
    from megatron_splitkv.comm import exit_process

    exit_process(main())
