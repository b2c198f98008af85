#!/usr/bin/env python3
"""Weak-scaling simulation of one DFlash attention layer (forward + backward) to CP 8, 16, 32, 64 for
splitkv, allgather-kv and ring-kv (issue 6, deliverable 2).

Weak scaling: context per rank fixed (`--ctx-per-rank`, default 16K; total context = P x that, one
sequence), query budget fixed (`--anchors` 512 x B 16 = 8192 query rows), anchors sampled as in training,
context placed by the planner (LPT; `--placements lpt,zigzag` adds splitkv under zigzag). Efficiency
= T(P0) / T(P) at constant per-rank context, per method and topology, P0 = the smallest P in `--cps` (1
by default; the base is the fastest variant at P0: placements, chunk counts, overlap).

T(P) = compute + exposed communication + op overhead, per method, modelled as the code does it
(read ops/*.py):
  - compute: the local-kernel calls of the slowest rank (`tools.benchlib.kernel_calls`: splitkv =
    all Lq queries vs the rank's keys, one call per chunk; allgather-kv = the rank's Lq/P queries vs all
    keys; ring-kv = the rank's queries vs each shard, one call per ring step; each with the own block
    where the op fuses it). Measured mode: each sampled rank's real shard is run on one GPU with the
    kernel `--backend` (auto = fa4 where installed, else flex; staircase, te, ... as registered in megatron_splitkv.kernels)
    (`--sample-ranks`: the ranks with the most and the median visible pairs; ring-kv: every step of the
    most loaded rank), forward + backward through the kernel API; every chunk count's calls are timed
    (k = 1 of every method first; a chunk count the budget cut is scaled from the measured k = 1 by the
    chunk-loss model below). Model mode (`--model-only`): per call `--call-overhead-ms` + 3.5 x 4 x pairs x
    Hq x D / `--kernel-tflops`; splitkv's k chunk calls take the one-call time x (1 + `--chunk-loss` x
    (k - 1)) (`chunked_calls_ms`; 8.5% per extra chunk, fitted on the measured NVLink chunk A/B).
    `--chunk-axis heads`: splitkv's chunks are the op's head chunks (ops/splitkv.py item 3; k clamped to
    Hkv): measured mode times k calls over all rows with Hq / k, Hkv / k heads and one mask, dK / dV written per
    chunk (`bench.kernel_calls(..., chunk_axis="heads")`, `bench.chunk_loop`); the schedule model's
    per-chunk messages are the op's head-chunk records (`bench.predicted_records(..., chunk_axis="heads")`),
    and model-only mode uses the same chunk-loss model.
    `--paired-rounds R` (measured mode, one process; docs/lab/perf-notes.md item 21: T(1) drifted ~5% between runs):
    after the measuring phase the P0 reference shard (splitkv k = 1) and every measured splitkv shard of the
    first placement (sampled ranks, chunk counts) are re-timed in R interleaved rounds (inputs built
    once, every task once per round, the order rotated by one each round: `bench.time_kernel_calls_rounds`);
    their per-call ms = the median over the rounds, and every splitkv row with P > P0 gets efficiency_rounds =
    [T(P0)_i / T(P)_i], both sides recomputed with round i's shards (round i's slowest sampled rank; overhead
    and projection windows as in the row), shown as median [min-max] in the summary and the headline's own
    table. The rounds are not cut by --budget-s and hold every re-timed shard's inputs at once.
  - communication: the exact per-collective messages the op issues (`bench.predicted_records`, checked
    against comm_stats in tests/test_simulate_scaling.py), each timed by `bench.LinkModel` under every
    `--topology` (default node,flat; the first is the headline; formulas in the LinkModel docstring):
      node: P ranks on ceil(P / `--gpus-per-node`) nodes; NCCL rings cross each node boundary once
        (latency base + (P - N) NVLink hops (`--intra-hop-us`) + (N - 1) network hops (`--inter-alpha-us`),
        bandwidth (P - 1) n / min(NVLink, L x NIC)); all-to-all = concurrent send/recv to every peer
        (latency one path + `--a2a-peer-us` per peer, bandwidth max(on-node bytes / NVLink, off-node bytes
        / NIC), PXN relay on NVLink unless `--no-pxn`); send/recv over the NIC at node boundaries;
      flat (the first model): every collective a ring of P ranks, (P - 1) alpha + (P - 1) n / bw, with the
        inter-node figures for every hop once P > gpus per node.
    NVLink figures: fitted to collectives measured on this machine's GPUs in the same run (all_gather,
    reduce_scatter, all_reduce, send/recv separately), or `--link-json` (e.g.
    docs/lab/results/link_h200x2_2026-11-30c.json, the third H200 run's fit), else stated; inter-node
    `--inter-node-gbps` (= `--inter-bw-gbs`, GB/s per GPU, default 50, a 400 Gb/s NIC) and
    `--inter-alpha-us` (default 15 us per hop).
  - overlap, as the code does it (read ops/*.py):
    splitkv pipelines its merge over k query chunks (`--num-chunks`: candidates, default 1,2,3,4,6,8 in
    model-only and 1,2,4 measured; the table reports k = 1 and the best k per P): the simulator replays the
    op's issue order on two in-order streams (compute; one NCCL stream) with the cross-stream dependencies
    (`splitkv_forward_ms`, `splitkv_backward_ms`): forward, Q chunk c + 1 gathered while chunk c's kernel
    runs, chunk c's all-to-all of [O | lse] (inputs' dtype) issued after its kernel and overlapping the
    next one, the owners' fused merges at the end, so the first Q gather and the last all-to-all stay
    exposed; backward, dO/stats of chunk c + 1 gathered while chunk c's kernel runs, each chunk's dQ
    all-to-all behind the next kernel, the first gathers and the last all-to-all exposed. k = 1 is the
    serial sum (compute + every collective). Each chunk's collectives pay their latency again, and each
    chunk call loses kernel efficiency: what chunking costs.
    "+ovl" rows (`--overlap-q-gather on` makes them the headline; both are always computed; the overlap
    is built and on by default in `DFlashAttention`, docs/lab/perf-notes.md item 3): the layer starts the Q
    all-gathers (all chunks, `ops.splitkv_start_query_gather`) before its k/v projections and
    runs the projections' backward while the dQ all-to-alls are in flight (`splitkv_attention(...,
    query_gather=)`): forward window = the k/v projection, 2 x (Tk_local + Tq_local) x `--hidden` x 2 Hkv D
    FLOPs, backward window twice that, at `--matmul-tflops` (790, DESIGN.md section 5) or timed on the GPU
    in measured mode; the projections are the layer's work, so T(P) does not include them.
    allgather-kv issues its collectives synchronously (no overlap): T = compute + sum(collectives).
    ring-kv overlaps the exchange of the shard for step s+1 with step s's compute: forward step =
    max(compute_s, kv_s); backward step = max(compute_s, kv_s + dkv_{s-1}) (the K/V and the dK/dV
    accumulator exchanges share the link), plus the last dK/dV hop exposed. Ring steps are synchronous:
    the most loaded rank's step time is used.
    Forward share of kernel time: `--fwd-fraction` (0.29, docs/benchmarks.md: flex fwd 3.06 of 10.15 ms).
  - splitkv variants (compared in one run, one set of rows each; the first is the summary's reference, the
    best at the headline setting per P is the headline; `splitkv_collectives`, `splitkv_time_ms`):
    `--bwd-gather` separate / fused / two-level / auto: the backward's dO and (delta, lse) as two all-gathers
    per chunk, or ONE all-gather of [dO | delta, lse] (the stats bit-packed in the inputs' dtype: the bytes of
    both, one latency), or that gather in two stages with a two-level layout (`ops/splitkv.py`
    `_gather_dout_stats`: stage 1 among the N ranks of one local index over the NICs, stream "N2", two chunks
    ahead of its kernel; stage 2 among the node's L ranks over NVLink, stream "N1", issued from the compute
    stream after it waited for stage 1, one chunk ahead; `splitkv_backward_ms`), auto = as
    `bench.predicted_records` issues them (no "splitkv.bwd.stats" = fused; "splitkv.bwd.dout.inter" /
    ".intra" = two-level, which the op does from N >= 16 nodes; either record set is converted to the variant
    asked for). `--cp-ranks-per-node` L (comma list; clamped to P; 1 or >= P
    = one all-to-all, bit for bit the model before): the two-level all-to-all of [O | lse] and of dQ: stage
    1 among the node's L ranks (NVLink; the rows of the N = P / L owners with each local index, inputs'
    dtype), waited on the compute stream, which merges (forward) or sums (dQ) the L partials in fp32
    (`--merge-gbs` of received bytes, measured on the device in measured mode), then stage 2 among the N
    ranks with the same local index (one per node, NICs; fp32 node partials), in flight behind the next
    kernel / the k/v projection's backward; each stage on its sub-group's own NCCL stream. Messages from the
    op's "<name>.intra" / "<name>.inter" records when present, else `two_level_msgs`. `--two-level-wait
    relay` (default, as the op is built on CUDA since perf-notes item 18: a relay stream waits for stage 1,
    runs the node merge / sum and issues stage 2, so the compute stream never waits for stage 1: the next
    kernel, and after the last one the k/v projection's backward, run meanwhile); `deferred` (the op before
    item 18: chunk c's node merge and stage 2 issued from the compute stream after chunk c + 1's kernel
    and stage 1, so stage 1 overlaps that kernel; the node merges on the compute stream's path); `inline`:
    a what-if (stage 1 waited right after its own chunk's kernel). `--replay` uses the flag's value too
    (default relay), not the saved run's.
  - own block: fused into the kernel call (second intervals over the block keys appended after the
    context, `ops.common.with_own_blocks`) when the tree does it (`--fused-own-block auto`): its few
    FLOPs are in the kernel calls (`bench.kernel_calls`) and no separate pass remains. The stated
    `--op-overhead-ms` describes the op with a SEPARATE own block, so a fused model subtracts
    `--own-block-ms` (the einsum pass + its lse merge, from `--kernels-json` = tools/gpu_check.py
    compare's own-block table when given, else 2.0 ms stated); a measured overhead is the real op's and
    is only adjusted when the flag differs from the tree.
  - calls use per-step metadata (`prepare_splitkv_metadata`, as every drafter layer does): no size or
    key gathers per call, cached BlockMasks, ring-kv rotates K/V without keys; its once-per-step cost is
    not in T(P). `--no-metadata` models the self-contained calls instead.
  - op overhead (lse merges, sorting, padding copies, the own block when it is a separate pass): op time
    minus kernel time at CP=1 (measured in the same run in measured mode; `--op-overhead-ms` otherwise:
    3.4 = the third H200 run's measured 1.41 ms + the 2.0 ms own block a fused model takes off),
    assumed constant in P.
Not modelled: NCCL kernels slowing the attention kernel (SM contention), NCCL's tree / NVLS / PAT
algorithms, network congestion, the op-level cost of chunks beyond their kernel calls in measured mode
(dK/dV accumulation across chunks), and the rest of the layer (projections, MLP) except as overlap windows.

Outputs to --out: simulate_scaling.json (rows for every P x method x placement x k x topology x overlap x
splitkv variant, plus "summary"), simulate_scaling.md (a summary table per topology: splitkv k = 1 / best k,
without / with the overlap, allgather-kv, ring-kv, speedup; with several splitkv variants one more table
per topology: every variant's best k (+ ovl) and the best variant; then the headline topology's rows),
simulate_scaling.png (matplotlib), and the tables printed last. With `--bench-json` (bench_attention.json
of the same run) a CP=2 row shows the measured op time next to the model's.

Examples (from the repository root; no PYTHONPATH needed: the script puts the repository on sys.path):
  torchrun --nproc-per-node 2 tools/simulate_scaling.py --out out/sim      # measured (2 GPUs)
  torchrun --nproc-per-node 2 tools/simulate_scaling.py --backend staircase --out out/sim
  python tools/simulate_scaling.py --model-only --link-json docs/lab/results/link_h200x2_2026-11-30c.json \
      --out /tmp/sim                                                        # CPU, FLOP model
  python tools/simulate_scaling.py --model-only --link-json docs/lab/results/link_h200x2_2026-11-30c.json \
      --bwd-gather separate,fused --cp-ranks-per-node 1,8 --out /tmp/sim    # before / after the two op changes
  python tools/simulate_scaling.py --replay docs/lab/results/simulate_scaling_2026-11-30g_h200.json \
      --bwd-gather fused,auto --out /tmp/replay   # a saved run's measurements, this tree's collectives (CPU)

`--replay` (`replay`): a saved simulate_scaling.json's splitkv rows recomputed without a GPU from what the run
saved per row (per-chunk kernel ms, k/v projection windows, op overhead) and per run (link, node-merge rate,
workload arguments), with this tree's `bench.predicted_records` and schedule model; the baselines' rows as
saved. The same tree and variants reproduce the saved rows (tests/test_simulate_scaling.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import inspect
import json
import os
import sys
import time
import traceback

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import benchlib as bench  # noqa: E402
from megatron_splitkv.planning import STRATEGIES as PLACEMENTS  # noqa: E402

QUERY_FLOPS_NOTE = "useful fwd = 4*pairs*Hq*D; fwd+bwd = 3.5x"


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def log(msg):
    d = _dist()
    if d is None or d.get_rank() == 0:
        print(msg, flush=True)


# ------------------------------------------------------------------------------------------ model pieces
def model_call_ms(call, *, Hq, D, tflops, overhead_ms):
    """Model time (ms) of one local-kernel call forward + backward: overhead + 3.5*4*pairs*Hq*D / rate."""
    if call.rows == 0 or call.num_keys == 0:
        return 0.0
    return overhead_ms + bench.FWD_BWD_FACTOR * bench.fwd_flops(call.pairs, Hq, D) / (tflops * 1e12) * 1e3


#: kernel time lost per extra chunk, as a fraction of the one-chunk kernel time (fitted on the chunk A/B of
#: docs/benchmarks.md, NVLink, CP=2, 128K, same process: op k = 1 / 2 / 4 = 44.73 / 47.91 / 55.04 ms: 8.7% and
#: 8.6% per extra chunk; tools/chunk_cost.py, the kernels alone on one stream, 2026-11-30: 5.7-7.7% at k = 2).
#: The op over NCCL lost more than this in the seventh run (CP=2 16K: +20% at k = 2: GPU idle gaps, not in
#: any kernel; docs/benchmarks.md), so k > 1 rows of the model are optimistic. Used only for shards the
#: budget left unmeasured; measured shards time the chunks as the op issues them (`bench.chunk_loop`).
CHUNK_LOSS = 0.085


def calibrated_tflops(samples, *, Hq, D, overhead_ms):
    """The kernel rate (TF/s, useful fwd+bwd FLOPs as `model_call_ms` counts them) at which the FLOP model
    reproduces measured shards: sum of their modelled FLOP-ms at 1 TF/s / (sum of measured ms - the per-call
    overhead of their non-empty calls). samples: [(calls, measured per-call ms)]. None without usable
    samples (no FLOPs, or measured time not above the overheads)."""
    flop_ms, ms = 0.0, 0.0
    for calls, times in samples:
        for c, t in zip(calls, times):
            if c.rows == 0 or c.num_keys == 0:
                continue
            flop_ms += model_call_ms(c, Hq=Hq, D=D, tflops=1.0, overhead_ms=0.0)
            ms += float(t) - overhead_ms
    if flop_ms <= 0 or ms <= 0:
        return None
    return flop_ms / ms


def chunked_calls_ms(one_chunk_ms, pairs, chunk_loss):
    """Per-chunk fwd+bwd ms of Split-KV's k = len(pairs) chunk calls from the time of the same work in ONE
    call: the total grows to one_chunk_ms * (1 + chunk_loss * (k - 1)) (smaller kernel calls lose
    efficiency: each chunk call re-reads and re-writes the rank's keys (K/V, dK/dV accumulators) and runs
    fewer query tiles per key tile), shared by the chunks' visible pairs."""
    k = len(pairs)
    tot = float(sum(pairs))
    total = one_chunk_ms * (1.0 + chunk_loss * (k - 1))
    if tot <= 0:
        return [total / k] * k
    return [total * p / tot for p in pairs]


def kv_proj_flops(tokens, hidden, Hkv, D):
    """Forward FLOPs of the drafter layer's k/v projection on one rank: linear_kv(cat[context features,
    block tokens]), hidden -> 2 * Hkv * D per token: 2 * tokens * hidden * 2 * Hkv * D. Its backward
    (dgrad + wgrad) is twice that."""
    return 2.0 * tokens * hidden * 2 * Hkv * D


def comm_time_s(records, P, link: bench.LinkModel):
    """Seconds of a list of non-ring records issued back to back (no overlap)."""
    return sum(link.time(r.kind, P, r.msg) for r in records)


def p2p_step_s(records, P, link):
    """Seconds of one ring exchange: the messages of one batch_isend_irecv go out together (one alpha);
    send and receive overlap (full duplex), so the larger of the two directions counts."""
    if not records:
        return 0.0
    snd = sum(r.msg for r in records if r.kind == "send")
    rcv = sum(r.msg for r in records if r.kind == "recv")
    return link.time("send", P, max(snd, rcv))


class Streams:
    """Two in-order CUDA streams as the op uses them: "C" (compute: kernels, elementwise) and "N" (NCCL:
    every collective of one process group runs on one NCCL stream, in issue order). `op` appends work of
    `dur` ms that may start when its stream is free and every dependency (finish times) is done;
    `wait(stream, t)` is a cudaStreamWaitEvent: later work on `stream` starts no earlier than t."""

    def __init__(self):
        self.free = {"C": 0.0, "N": 0.0}  # further NCCL streams ("N1", "N2": sub-group communicators) on first use

    def op(self, stream, dur, deps=()):
        start = max([self.free.get(stream, 0.0)] + [d for d in deps if d is not None])
        self.free[stream] = start + dur
        return self.free[stream]

    def wait(self, stream, t):
        if t is not None:
            self.free[stream] = max(self.free.get(stream, 0.0), t)

    def end(self):
        return max(self.free.values())


def _advance_two_level(S, held, stage2, merge, out, keep, relay=False):
    """Advance the two-level all-to-all's chunks held in stage 1 ((chunk, stage-1 op), oldest first) until
    `keep` remain: the compute stream waits for stage 1, runs the node merge / sum (`merge[c]` ms), and
    stage 2 (`stage2[c]` ms) is issued on its own NCCL stream; out[c] = the stage-2 op.

    relay=True (the op on CUDA since perf-notes item 18: `ops.splitkv._TwoStage` with a relay stream): the
    wait, the node merge / sum and the issue of stage 2 are on the relay stream "R" instead (one stream
    for every chunk, in issue order), so the compute stream never waits for stage 1; only the consumer of
    stage 2's result (the owner's merge / dQ sum) waits, for stage 2 (which follows the relay)."""
    while len(held) > keep:
        c0, s1 = held.pop(0)
        m = merge[c0] if merge else 0.0
        if relay:
            out[c0] = S.op("N2", stage2[c0], [S.op("R", m, [s1])])
        else:
            S.wait("C", s1)
            out[c0] = S.op("N2", stage2[c0], [S.op("C", m)])


def splitkv_forward_ms(G, K, A2A, M=None, pre=0.0, A1=None, NM=None, defer=False, relay=False):
    """Forward of the chunked Split-KV op (ops/splitkv.py `_SplitKV.forward`, k = len(K) chunks) on the
    two streams, in the code's issue order: gather Q chunk 0; per chunk c: issue the gather of chunk
    c + 1 (prefetch), wait for chunk c's Q, kernel c, issue chunk c's all-to-all of [O | lse] (after the
    kernel: it overlaps kernel c + 1); then, per chunk, wait for its all-to-all and merge (M[c],
    elementwise on the compute stream). G, K, A2A, M: per-chunk ms (Q all-gather, kernel forward,
    [O | lse] all-to-all, owner's merge). With k = 1 this is the serial sum G + K + A2A + M.

    pre: ms of compute the layer runs on the compute stream after it started the Q gather and before the
    first kernel (the k/v projections, with the Q all-gather overlapped with them); it is the layer's
    work, not the op's, so it is subtracted: the result is the op's time from the moment the projections
    end (>= the time without `pre` minus `pre`, never less than the compute). With pre > 0 the gathers of
    ALL chunks are issued first, as `ops.splitkv_start_query_gather` does (then the all-to-alls queue
    behind them on the NCCL stream).

    A1, NM (per-chunk ms; None: the single all-to-all): the two-level all-to-all (`two_level_layout`). At
    the place of the single all-to-all, chunk c's stage 1 (A1[c], the intra-node sub-group's NCCL stream
    "N1") is issued after kernel c and WAITED by the compute stream, which then lse-merges the L partials
    in fp32 (NM[c]); stage 2 (A2A[c], the inter-node sub-group's stream "N2") is issued after that merge
    and overlaps the next kernel. So stage 1 and the node merge of every chunk are on the compute
    stream's path; only stage 2 overlaps. defer=True (the op's host order since the deferred wait; False:
    a what-if): chunk c's stage 1 is waited only after kernel c + 1 was issued (merge c and stage 2 c
    after kernel c + 1), so stage 1 overlaps the next kernel too; the last chunk's is waited at once.
    relay=True (the op on CUDA, perf-notes item 18; `_advance_two_level`): that wait and the node merge
    run on the relay stream "R" instead of the compute stream.

    Exchange pieces (records with several stage pairs per chunk): A1[c], A2A[c], NM[c] of the
    two-level all-to-all may each be a list, one value per row piece of chunk c. The op issues the pieces'
    stage 1 one after the other after kernel c (each on "N1", behind the one before) and, after each stage 1,
    advances the exchange before it (piece or chunk) as it advanced chunk c - 1 (defer: keep one held), so
    piece i's node merge and stage 2 ("N2") overlap stage 1 of piece i + 1; the owner's merge of chunk c
    waits for all its pieces' stage 2. One value = one piece (the schedule before item 19)."""
    n = len(K)
    M = M or [0.0] * n
    S = Streams()
    g, a = [None] * n, [None] * n
    held = []  # two-level: (exchange, stage-1 end) not yet waited
    if A1 is not None:  # flattened over (chunk, piece): exchange e of chunk chunk_of[e]
        def _pieces(x):
            return list(x) if isinstance(x, (list, tuple)) else [x]

        s1, s2, nm, chunk_of = [], [], [], []
        for c in range(n):
            p1, p2 = _pieces(A1[c]), _pieces(A2A[c])
            pm = _pieces(NM[c]) if NM else [0.0] * len(p1)
            if not len(p1) == len(p2) == len(pm):
                raise ValueError(f"chunk {c}: {len(p1)} stage-1, {len(p2)} stage-2 and {len(pm)} merge pieces")
            s1 += p1
            s2 += p2
            nm += pm
            chunk_of += [c] * len(p1)
        a_e = [None] * len(s1)
    early = pre > 0
    if early:
        S.op("C", pre)
        for c in range(n):
            g[c] = S.op("N", G[c])
    else:
        g[0] = S.op("N", G[0])
    for c in range(n):
        if c + 1 < n and not early:
            g[c + 1] = S.op("N", G[c + 1])
        S.wait("C", g[c])
        k = S.op("C", K[c])
        if A1 is None:
            a[c] = S.op("N", A2A[c], [k])
        else:  # two-level: stage 1 waited, node merge, stage 2 in flight; piece by piece
            for e in (e for e in range(len(s1)) if chunk_of[e] == c):
                held.append((e, S.op("N1", s1[e], [k])))
                _advance_two_level(S, held, s2, nm, a_e, 1 if defer else 0, relay)
    if A1 is not None:
        _advance_two_level(S, held, s2, nm, a_e, 0, relay)
    for c in range(n):
        if A1 is None:
            S.wait("C", a[c])
        else:
            for e in (e for e in range(len(s1)) if chunk_of[e] == c):
                S.wait("C", a_e[e])
        S.op("C", M[c])
    return S.end() - pre


def splitkv_backward_ms(DO, ST, KB, RQ, post=0.0, RQ1=None, NS=None, defer=False, DO1=None, relay=False):
    """Backward of the chunked Split-KV op (`_SplitKV.backward`): all-gather chunk 0's dO and stats;
    per chunk c: issue the gathers of chunk c + 1 (prefetch), wait for chunk c's, kernel backward c,
    issue chunk c's dQ all-to-all (after the kernel). Ends when the last all-to-all and the compute
    stream are done. DO, ST, KB, RQ: per-chunk ms (dO gather, stats gather, kernel backward, dQ
    all-to-all). With k = 1 the serial sum.

    post: ms of compute that may run after the last kernel while the last dQ all-to-all is in flight (the
    k/v projections' backward, dgrad + wgrad: it needs dK/dV, complete after the last chunk, not dQ); the
    layer's work, subtracted like `pre` in `splitkv_forward_ms`.

    ST may be all zeros: the fused backward gather (one all-gather of [dO | delta, lse] per chunk, its time
    in DO). RQ1, NS (None: the single dQ all-to-all): the two-level dQ all-to-all, as in the forward:
    stage 1 (RQ1[c], stream "N1") waited by the compute stream, the fp32 node sum of the L partials
    (NS[c]) on it, then stage 2 (RQ[c], stream "N2") in flight behind the next kernel; defer and relay
    (the wait and the node sum on the relay stream "R": the last chunk's chain then overlaps `post`) as
    in `splitkv_forward_ms`.

    DO1 (per-chunk ms; None: one flat gather per chunk): the two-level [dO | stats] gather (`ops/splitkv.py`
    `_gather_dout_stats`), DO then being its stage 2. Stage 1 (DO1[c], between nodes: the inter-node
    sub-group's stream "N2") is issued two chunks ahead of its kernel (before kernel c - 2; chunks 0, 1
    and 2 before kernel 0); before kernel c the compute stream waits for stage 1 of chunk c + 1 and issues
    its stage 2 (DO[c + 1], inside the node: stream "N1"), which therefore starts after everything the
    compute stream ran before (kernel c - 1) and runs during kernel c; kernel c waits for its own stage 2.
    So only chunk 0's gather and, before kernel 0, the wait for chunk 1's stage 1 are exposed."""
    n = len(KB)
    S = Streams()
    d, st, rq = [None] * n, [None] * n, [None] * n
    held = []
    s1, issued, adv = [None] * n, [0], [0]

    def prefetch(c):  # the op's `prefetch(c)`, before kernel c
        if DO1 is None:
            while issued[0] < min(c + 2, n):
                i = issued[0]
                d[i] = S.op("N", DO[i])
                st[i] = S.op("N", ST[i])
                issued[0] += 1
            return
        while issued[0] < min(c + 3, n):
            s1[issued[0]] = S.op("N2", DO1[issued[0]])
            issued[0] += 1
        while adv[0] < min(c + 2, n):
            i = adv[0]
            S.wait("C", s1[i])
            d[i] = S.op("N1", DO[i], [S.op("C", 0.0)])  # issued from the compute stream's position
            adv[0] += 1

    for c in range(n):
        prefetch(c)
        S.wait("C", d[c])
        S.wait("C", st[c])
        kb = S.op("C", KB[c])
        if RQ1 is None:
            rq[c] = S.op("N", RQ[c], [kb])
        else:
            held.append((c, S.op("N1", RQ1[c], [kb])))
            _advance_two_level(S, held, RQ, NS, rq, 1 if defer else 0, relay)
    _advance_two_level(S, held, RQ, NS, rq, 0, relay)
    if post > 0:
        S.op("C", post)
    return S.end() - post


#: Split-KV's per-chunk collectives (record names after "splitkv."): Q gather, [O | lse] all-to-all, dO and
#: stats gathers (one fused gather of [dO | delta, lse] when the op packs them: no "bwd.stats"), dQ
#: all-to-all, and the two stages of the two-level all-to-all when the op issues them
_SPLITKV_CHUNKED = ("fwd.q", "fwd.out", "bwd.dout", "bwd.stats", "bwd.dq",
                    "fwd.out.intra", "fwd.out.inter", "bwd.dq.intra", "bwd.dq.inter",
                    "bwd.dout.inter", "bwd.dout.intra")

#: `--bwd-gather`: auto = as the records say (no "splitkv.bwd.stats" record: the op packs the stats into
#: the dO gather; "splitkv.bwd.dout.inter" / ".intra" records: that gather in two stages), separate = two
#: all-gathers per chunk (dO; delta and lse), fused = one flat all-gather per chunk over the CP group,
#: two-level = the fused gather in two stages (between nodes, then inside the node) where the two-level
#: layout applies (`two_level_layout`; elsewhere = fused)
BWD_GATHERS = ("auto", "separate", "fused", "two-level")

#: `--two-level-wait`: how the two-level all-to-all's stage 1 is waited (`_advance_two_level`). relay = as the
#: op is built on CUDA (perf-notes item 18: a relay stream waits for stage 1, runs the node merge / sum and
#: issues stage 2; the compute stream never waits for stage 1), deferred = the op before item 18 (and on
#: CPU, where nothing overlaps anyway): the compute stream waits for chunk c's stage 1 after chunk c + 1's
#: kernel and runs the node merge; inline = a what-if (waited right after its own chunk's kernel)
TWO_LEVEL_WAITS = ("relay", "deferred", "inline")
DEFAULT_TWO_LEVEL_WAIT = "relay"

#: stated rate (GB/s of RECEIVED stage-1 bytes) of the two-level all-to-all's node merge on the compute
#: stream: forward, unpack the L bf16 partials to fp32, lse max, weights, weighted sum (`ops.common.
#: merge_partials`); backward, sum the L bf16 dQ partials in fp32. ~10 HBM bytes per received 2-byte element
#: (read bf16, write + read fp32, accumulate) at ~4 TB/s. Measured mode times it on the GPU instead.
MERGE_GBS = 800.0

def default_head_split(k, Hkv):
    """The kv heads per chunk of the op's k head chunks (`chunk_bounds(k, Hkv)`), as a tuple."""
    return tuple(g1 - g0 for g0, g1 in bench.chunk_bounds(int(k), int(Hkv)))


def round_totals(total_of, per_call_rounds):
    """[total_of(per-call ms of round i)] for the rounds of `--paired-rounds` (None without rounds)."""
    if not per_call_rounds:
        return None
    return [float(total_of(list(pc))) for pc in per_call_rounds]


def splitkv_row(base, *, a, plan, P, k, per_call, variant, link, ovl, merge_gbs, recs_memo, per_call_rounds=None):
    """One splitkv row recomputed from per-chunk kernel ms (the rows of `--replay`): `base` (a row: slowest_rank,
    overhead_ms, proj_fwd_ms / proj_bwd_ms, placement, the measured fields) updated with the variant's fields and
    `method_time` of this tree's `bench.predicted_records` for the base's slowest rank and the schedule `a` asks
    for (a run's args: B, Hq, Hkv, D, no_metadata, fwd_fraction, two_level_wait). per_call: fwd+bwd ms per
    chunk; per_call_rounds (the
    `--paired-rounds` values: one per-chunk list per round) adds "per_call_ms_rounds" and "total_ms_rounds" (T of
    each round's compute, the rest of the row alike). recs_memo: a dict the records are cached in."""
    L = variant["cp_ranks_per_node"]
    rkey = (P, base["placement"], base["slowest_rank"], k, L)
    if rkey not in recs_memo:
        nb = [plan.blocks_per_rank] * P
        nc = [int(plan.token_index(i).shape[0]) for i in range(P)]
        recs = bench.predicted_records("splitkv", P=P, rank=base["slowest_rank"], n_blocks=nb, n_ctx=nc, B=a.B,
                                       Hq=a.Hq, Hkv=a.Hkv, D=a.D, elem=2, metadata=not a.no_metadata,
                                       num_chunks=k, cp_ranks_per_node=min(L, P),
                                       chunk_axis=getattr(a, "chunk_axis", "rows"))  # runs before --chunk-axis: rows
        recs_memo[rkey] = recs
    recs = recs_memo[rkey]

    def timed(pc, det=None):
        return method_time("splitkv", P, list(pc), recs, link, fwd_fraction=a.fwd_fraction,
                           overhead_ms=base["overhead_ms"],
                           proj_ms=(base["proj_fwd_ms"], base["proj_bwd_ms"]) if ovl else (0.0, 0.0),
                           bwd_gather=variant["bwd_gather"], cp_ranks_per_node=L, D=a.D, elem=2, acc=4,
                           merge_gbs=merge_gbs, two_level_wait=a.two_level_wait, detail=det)

    det = {}
    t = timed(per_call, det)
    row = dict(base)
    row.update(variant_fields(variant, det, L))
    row["bytes_per_rank"] = sum(row["bytes_by_name"].values())
    row.update(t)
    row.update(num_chunks=k, per_call_ms=list(per_call))
    if per_call_rounds:
        row.update(per_call_ms_rounds=[list(pc) for pc in per_call_rounds],
                   total_ms_rounds=round_totals(lambda pc: timed(pc)["total_ms"], per_call_rounds))
    return row


def set_efficiency_rounds(rows, p0):
    """`--paired-rounds`: every row with "total_ms_rounds" and P > p0 gets "efficiency_rounds" = [T(p0)_i / T(P)_i],
    T(p0)_i = round i's fastest row of the same method and topology at p0 among those with rounds (as
    `set_efficiency`'s base, each round on its own compute)."""
    base = {}
    for r in rows:
        tr = r.get("total_ms_rounds")
        if r["P"] == p0 and tr:
            key = (r["method"], r.get("topology", "flat"))
            base[key] = tr if key not in base else [min(x, y) for x, y in zip(base[key], tr)]
    for r in rows:
        tr = r.get("total_ms_rounds")
        b = base.get((r["method"], r.get("topology", "flat")))
        if r["P"] > p0 and tr and b and len(b) == len(tr):
            r["efficiency_rounds"] = [x / t if t > 0 else float("nan") for x, t in zip(b, tr)]


def rounds_text(eff_rounds):
    """"median [min-max]" (percent) of a row's efficiency_rounds, "" without."""
    if not eff_rounds:
        return ""
    e = sorted(100 * x for x in eff_rounds)
    med = float(np.median(e))
    return f"{med:.1f}% [{e[0]:.1f}-{e[-1]:.1f}]"


@dataclasses.dataclass(frozen=True)
class Coll:
    """One collective of the modelled Split-KV schedule. name: record name after "splitkv." ("fwd.out",
    "fwd.out.intra", ...); kind; group: ranks in the collective's group; msg: bytes per rank and block
    (`bench.PredRecord.msg` convention: an all-to-all sends msg to each of group - 1 peers); chunk (-1: not
    chunked); per_node: ranks of the group per node for a sub-group of the CP group (None: the CP group,
    node by node; `bench.LinkModel.nodes`); stream: "N" (the CP group's NCCL stream), "N1" / "N2" (the
    two-level all-to-all's intra-node / inter-node sub-groups: own communicators, own streams)."""

    name: str
    kind: str
    group: int
    msg: float
    chunk: int = -1
    per_node: object = None
    stream: str = "N"

    @property
    def bytes(self) -> float:
        """Bytes sent + received by this rank (the comm_stats convention, `megatron_splitkv.comm`)."""
        g = self.group
        if g <= 1:
            return 0.0
        if self.kind in ("all_gather", "reduce_scatter", "all_to_all"):
            return 2.0 * (g - 1) * self.msg
        if self.kind == "all_reduce":
            return 4.0 * (g - 1) * self.msg / g
        return float(self.msg)

    def ms(self, link) -> float:
        return link.time(self.kind, self.group, self.msg, per_node=self.per_node) * 1e3

    def nic_bytes(self, link) -> float:
        """Bytes this rank SENDS to peers on other nodes (all-to-all only; 0 for other kinds): (group - l)
        msg with l the group's ranks on this node (`LinkModel.nodes`)."""
        if self.kind != "all_to_all" or self.group <= 1:
            return 0.0
        _, l = link.nodes(self.group, self.per_node)
        return float((self.group - l) * self.msg)


def two_level_layout(P, cp_ranks_per_node, gpus_per_node=8):
    """The two-level all-to-all's groups at CP size P with L = `cp_ranks_per_node` (clamped to P): None when
    the op keeps ONE all-to-all (L = 1 or L = P: one rank per node, or the whole group on one node), else
    dict(L, N = P / L, intra_per_node = ranks of a stage-1 group (L consecutive ranks) per node, inter_per_node
    = ranks of a stage-2 group (the N ranks with one local index, stride L) per node: 1 when L = gpus per
    node). Raises ValueError when L does not divide P."""
    P = int(P)
    L = min(int(cp_ranks_per_node), P)
    if L <= 1 or L >= P:
        return None
    if P % L:
        raise ValueError(f"cp_ranks_per_node {L} must divide the CP size {P}")
    G = max(int(gpus_per_node), 1)
    return dict(L=L, N=P // L, intra_per_node=min(L, G), inter_per_node=max(G // L, 1))


def packed_row_bytes(D, elem, acc, stats=1):
    """Bytes per row and head of a tensor of D elements in the inputs' dtype with `stats` fp32 (acc) values
    bit-packed beside it (`ops.common.pack_partial`): (D + stats * max(acc / elem, 1)) * elem."""
    return (D + stats * max(acc // elem, 1)) * elem


def two_level_msgs(what, single_msg, N, *, D, elem=2, acc=4):
    """(stage 1, stage 2) per-peer messages of the two-level all-to-all from the single all-to-all's per-peer
    message m = rh x (row bytes), rh = the rows of ONE owner in the chunk x Hq:
      fwd.out: m = rh (D + acc / elem) elem ([O | lse] packed in the inputs' dtype);
        stage 1 (intra-node, L ranks): to local peer j' the rows of the N owners with local index j',
          packed like m: N m;
        stage 2 (inter-node, N ranks): to each other node the node-merged rows of ONE owner, fp32 O and
          fp32 lse: rh (D + 1) acc.
      bwd.dq: m = rh D elem; stage 1 N m (bf16 partials); stage 2 rh D acc (fp32 node sums).
    Per rank and chunk (Lq_c = P rc rows in the chunk, rc per owner) that sends (L - 1) N m = (L - 1) / L
    Lq_c Hq (D elem + acc) in stage 1 and (N - 1) rh (D + 1) acc = (N - 1) / N (Lq_c / L) Hq (D + 1) acc in
    stage 2 (forward; dQ without the lse terms)."""
    if what == "fwd.out":
        rh = single_msg / packed_row_bytes(D, elem, acc)
        return N * single_msg, rh * (D + 1) * acc
    if what == "bwd.dq":
        rh = single_msg / (D * elem)
        return N * single_msg, rh * D * acc
    raise ValueError(f"two-level all-to-all of {what!r}: only 'fwd.out' and 'bwd.dq'")


def splitkv_collectives(recs, P, n_chunks, *, bwd_gather="auto", cp_ranks_per_node=1, gpus_per_node=8,
                        D=None, elem=2, acc=4):
    """The collectives the modelled Split-KV op issues, from `bench.predicted_records` (either record set:
    the op's before or after the fused backward gather and the two-level all-to-all), transformed to the
    variant asked for. Returns dict(serial = [Coll] not chunked (exposed first), "fwd.q" / "fwd.out" /
    "bwd.dout" / "bwd.stats" / "bwd.dq" = per-chunk lists of `Coll`, layout = `two_level_layout` (None: one
    all-to-all), bwd_gather = "separate" / "fused" (resolved), sources = where each part came from).

    - bwd_gather: "separate" = dO ("bwd.dout", rh D elem) and stats ("bwd.stats", rh 2 acc) as two
      all-gathers per chunk; "fused" = ONE all-gather "bwd.dout" of rh (D + 2 acc / elem) elem per chunk
      (the two messages' sum, one latency), no "bwd.stats"; "two-level" (only with a two-level layout,
      else "fused") = that packed segment m gathered in two stages as `ops/splitkv.py` `_gather_dout_stats`
      does: "bwd.dout.inter" (all_gather over the N ranks of one local index, one per node: NIC only,
      stream "N2", message m) then "bwd.dout.intra" (all_gather over the node's L ranks: NVLink, stream
      "N1", message N m), both in the "bwd.dout" lists; "auto" = as the records are. Records without
      "bwd.stats" are read as the fused gather (dout carries both), records with "bwd.dout.inter" /
      ".intra" as the two-level one (m = the inter record's message); the other variants are derived from
      m: "separate" splits it by the formula (needs D).
    - cp_ranks_per_node L (`two_level_layout`): L = 1 or L >= P: the records' single all-to-alls, unchanged
      (bit for bit today's model). Otherwise stage 1 ("<name>.intra", group L, NVLink, stream "N1") and
      stage 2 ("<name>.inter", group N, one rank per node, NICs, stream "N2"): from records with those
      names when present (per-peer message = record bytes / (2 (group - 1)), the comm_stats convention),
      else from the single all-to-all's message by `two_level_msgs` (needs D). Missing single records (a
      two-level record set asked for one all-to-all) are rebuilt from the Q gather's message (rh = msg /
      (D elem)).
    - "fwd.out.pieces": per chunk, the forward exchange's row pieces (perf-notes item 19) as [(stage 1, stage
      2) `Coll` pairs]: the records' i-th ".intra" with their i-th ".inter" (`bench.predicted_records` issues
      one pair per piece, as the op does); one pair (the chunk) when the stages come from the formula; []
      without a two-level layout."""
    n = max(int(n_chunks), 1)
    by, serial = {}, []
    for r in recs:
        name = r.op.split(".", 1)[1]
        if name in _SPLITKV_CHUNKED:
            key = (name, min(max(r.step, 0), n - 1))
            by.setdefault(key, []).append(r)
        else:
            serial.append(Coll(name, r.kind, P, r.msg))
    names = {k[0] for k in by}
    lay = two_level_layout(P, cp_ranks_per_node, gpus_per_node) if P > 1 else None
    has_stats = "bwd.stats" in names
    if bwd_gather not in BWD_GATHERS:
        raise ValueError(f"bwd_gather must be one of {BWD_GATHERS}, got {bwd_gather!r}")
    rec_mode = "separate" if has_stats else ("two-level" if "bwd.dout.inter" in names else "fused")
    mode = rec_mode if bwd_gather == "auto" else bwd_gather
    if mode == "two-level" and lay is None:  # one node or one rank per node: the op's flat gather
        mode = "fused"
    src = dict(bwd_gather="records" if mode == rec_mode else "formula")

    def need_d(what):
        if D is None:
            raise ValueError(f"splitkv_collectives: {what} needs the head dim D")
        return D

    def rec_colls(name, c):
        return [Coll(name, r.kind, P, r.msg, c) for r in by.get((name, c), [])]

    out = {k: [[] for _ in range(n)] for k in ("fwd.q", "fwd.out", "bwd.dout", "bwd.stats", "bwd.dq",
                                               "fwd.out.pieces")}
    for c in range(n):
        out["fwd.q"][c] = rec_colls("fwd.q", c)
    for what in ("fwd.out", "bwd.dq"):
        for c in range(n):
            single = by.get((what, c), [])
            intra, inter = by.get((what + ".intra", c), []), by.get((what + ".inter", c), [])
            if single:
                m = float(sum(r.msg for r in single))
            else:  # rebuilt from the Q gather: rh = rows of one owner x Hq
                rh = sum(r.msg for r in by.get(("fwd.q", c), [])) / (need_d("a missing " + what) * elem)
                m = rh * (packed_row_bytes(D, elem, acc) if what == "fwd.out" else D * elem)
            if lay is None:
                out[what][c] = rec_colls(what, c) if single else [Coll(what, "all_to_all", P, m, c)]
                src[what] = "records" if single else "formula (from fwd.q)"
            elif intra and inter:
                L, N = lay["L"], lay["N"]
                c1 = [Coll(what + ".intra", r.kind, L, r.bytes / (2.0 * (L - 1)), c, lay["intra_per_node"], "N1")
                      for r in intra]
                c2 = [Coll(what + ".inter", r.kind, N, r.bytes / (2.0 * (N - 1)), c, lay["inter_per_node"], "N2")
                      for r in inter]
                out[what][c] = c1 + c2
                if what == "fwd.out":
                    if len(c1) != len(c2):
                        raise ValueError(f"chunk {c}: {len(c1)} fwd.out.intra but {len(c2)} fwd.out.inter records")
                    out["fwd.out.pieces"][c] = list(zip(c1, c2))
                src[what] = "records (.intra / .inter)"
            else:
                m1, m2 = two_level_msgs(what, m, lay["N"], D=need_d("the two-level " + what), elem=elem, acc=acc)
                out[what][c] = [Coll(what + ".intra", "all_to_all", lay["L"], m1, c, lay["intra_per_node"], "N1"),
                                Coll(what + ".inter", "all_to_all", lay["N"], m2, c, lay["inter_per_node"], "N2")]
                if what == "fwd.out":
                    out["fwd.out.pieces"][c] = [tuple(out[what][c])]
                src[what] = "formula (two_level_msgs)"
    for c in range(n):
        dout, st = by.get(("bwd.dout", c), []), by.get(("bwd.stats", c), [])
        inter, intra = by.get(("bwd.dout.inter", c), []), by.get(("bwd.dout.intra", c), [])
        if mode == rec_mode:  # as the records are
            out["bwd.dout"][c], out["bwd.stats"][c] = rec_colls("bwd.dout", c), rec_colls("bwd.stats", c)
            if inter or intra:  # per-peer message = record bytes / (2 (group - 1)), as for the all-to-alls
                colls = []
                for r, (name, grp, pn, stream) in [(r, ("bwd.dout.inter", lay["N"], lay["inter_per_node"], "N2"))
                                                   for r in inter] + \
                                                  [(r, ("bwd.dout.intra", lay["L"], lay["intra_per_node"], "N1"))
                                                   for r in intra]:
                    colls.append(Coll(name, r.kind, grp, r.bytes / (2.0 * (grp - 1)), c, pn, stream))
                out["bwd.dout"][c] = colls
            continue
        # the packed per-rank segment m = rh (D + 2 acc / elem) elem of the chunk, from any record set
        if not (dout or st or inter):
            continue
        m = float(sum(r.msg for r in dout) + sum(r.msg for r in st) + sum(r.msg for r in inter))
        if mode == "separate":  # stats = rh 2 acc
            rh = m / packed_row_bytes(need_d("splitting the fused dO gather"), elem, acc, stats=2)
            out["bwd.dout"][c] = [Coll("bwd.dout", "all_gather", P, m - rh * 2 * acc, c)]
            out["bwd.stats"][c] = [Coll("bwd.stats", "all_gather", P, rh * 2 * acc, c)]
        elif mode == "fused":  # one gather: the two messages' sum
            out["bwd.dout"][c] = [Coll("bwd.dout", "all_gather", P, m, c)]
        else:  # two-level
            out["bwd.dout"][c] = [
                Coll("bwd.dout.inter", "all_gather", lay["N"], m, c, lay["inter_per_node"], "N2"),
                Coll("bwd.dout.intra", "all_gather", lay["L"], lay["N"] * m, c, lay["intra_per_node"], "N1")]
    return dict(serial=serial, layout=lay, bwd_gather=mode, sources=src, **out)


def splitkv_time_ms(P, comp_calls_ms, recs, link, *, fwd_fraction, proj_ms=(0.0, 0.0), bwd_gather="auto",
                    cp_ranks_per_node=1, D=None, elem=2, acc=4, merge_gbs=MERGE_GBS, two_level_wait=DEFAULT_TWO_LEVEL_WAIT,
                    detail=None):
    """(total, comm) ms of Split-KV's kernel + communication, overlapped as the code does it
    (`splitkv_forward_ms`, `splitkv_backward_ms`); k = len(comp_calls_ms) chunks, one kernel call each
    (split forward / backward by `fwd_fraction`). Records not chunked (the self-contained call's
    "meta" / "fwd.block_meta" gathers) are exposed, before the pipeline. comm = all collectives' time
    (what a serial schedule would expose). proj_ms = (forward, backward) ms of the k/v projections the
    layer overlaps with the first Q gather and the last dQ all-to-all ((0, 0): no overlap, the op alone).
    bwd_gather, cp_ranks_per_node, D, elem, acc: the variant (`splitkv_collectives`); with the two-level
    all-to-all every chunk's node merge (forward) and node sum (backward) take L x the stage-1 per-peer
    message (the received bytes, own partial included) / `merge_gbs` GB/s (one rate, or (forward,
    backward)) on the compute stream (in the
    returned total, not in comm). detail: a dict to fill with the variant's bytes per rank (comm_stats
    convention) per collective name, the all-to-alls' off-node bytes sent per rank, the node merge ms, the
    resolved bwd_gather, the layout and the sources. two_level_wait (`TWO_LEVEL_WAITS`): "relay" (as the op
    is built on CUDA: stage 1 waited, merged and stage 2 issued on a relay stream, `_advance_two_level`),
    "deferred" (the op before perf-notes item 18: stage 1 of chunk c waited on the compute stream after
    chunk c + 1's kernel was issued; `splitkv_forward_ms`) or "inline" (a what-if: waited right after the
    chunk's own kernel). The backward processes the chunks in the forward's order 0..k-1, as the op does.
    """
    if two_level_wait not in TWO_LEVEL_WAITS:
        raise ValueError(f"two_level_wait must be one of {TWO_LEVEL_WAITS}, got {two_level_wait!r}")
    n = max(len(comp_calls_ms), 1)
    cs = splitkv_collectives(recs, P, n, bwd_gather=bwd_gather, cp_ranks_per_node=cp_ranks_per_node,
                             gpus_per_node=link.gpus_per_node, D=D, elem=elem, acc=acc)
    lay = cs["layout"]

    def col(name, stream=None):
        return [sum(x.ms(link) for x in cs[name][c] if stream is None or x.stream == stream) for c in range(n)]

    rates = tuple(merge_gbs) if isinstance(merge_gbs, (tuple, list)) else (merge_gbs, merge_gbs)

    def merge(name):  # ms of each chunk's node merge: the received stage-1 bytes (L blocks) at merge_gbs
        gbs = rates[0] if name == "fwd.out" else rates[1]
        return [sum(x.group * x.msg for x in cs[name][c] if x.stream == "N1") / (gbs * 1e9) * 1e3
                for c in range(n)]

    comp = list(comp_calls_ms) or [0.0]
    K = [fwd_fraction * c for c in comp]
    KB = [(1 - fwd_fraction) * c for c in comp]
    if lay is None:
        A, A1, NM = col("fwd.out"), None, None
        RQ, RQ1, NS = col("bwd.dq"), None, None
    else:  # the forward per exchange piece (stage 1, node merge, stage 2 of each; one piece = the chunk)
        pcs = cs["fwd.out.pieces"]
        A1 = [[x1.ms(link) for x1, _ in pcs[c]] for c in range(n)]
        A = [[x2.ms(link) for _, x2 in pcs[c]] for c in range(n)]
        NM = [[x1.group * x1.msg / (rates[0] * 1e9) * 1e3 for x1, _ in pcs[c]] for c in range(n)]
        RQ, RQ1, NS = col("bwd.dq", "N2"), col("bwd.dq", "N1"), merge("bwd.dq")
    defer, relay = two_level_wait in ("deferred", "relay"), two_level_wait == "relay"
    t_f = splitkv_forward_ms(col("fwd.q"), K, A, pre=proj_ms[0], A1=A1, NM=NM, defer=defer, relay=relay)
    if any(x.stream == "N2" for c in range(n) for x in cs["bwd.dout"][c]):  # the two-level [dO | stats] gather
        DO, DO1 = col("bwd.dout", "N1"), col("bwd.dout", "N2")
    else:
        DO, DO1 = col("bwd.dout"), None
    ST = col("bwd.stats")
    t_b = splitkv_backward_ms(DO, ST, KB, RQ, post=proj_ms[1], RQ1=RQ1, NS=NS, defer=defer, DO1=DO1,
                              relay=relay)
    serial = [x.ms(link) for x in cs["serial"]]
    # every chunk's collectives in the records' order (chunk by chunk, forward then backward), as summed before
    per = [sum(x.ms(link) for x in cs[name][c]) for name in ("fwd.q", "fwd.out") for c in range(n)]
    per = [v for c in range(n) for v in (per[c], per[n + c])]
    per += [sum(x.ms(link) for x in cs[name][c]) for c in range(n) for name in ("bwd.dout", "bwd.stats", "bwd.dq")]
    comm = sum(serial) + sum(per)
    if detail is not None:
        by_name, nic = {}, {}
        for x in cs["serial"] + [x for name in ("fwd.q", "fwd.out", "bwd.dout", "bwd.stats", "bwd.dq")
                                 for c in range(n) for x in cs[name][c]]:
            by_name[x.name] = by_name.get(x.name, 0.0) + x.bytes
            if x.kind == "all_to_all":
                nic[x.name] = nic.get(x.name, 0.0) + x.nic_bytes(link)
        detail.update(bytes_by_name=by_name, a2a_nic_bytes_sent=nic, bwd_gather=cs["bwd_gather"], layout=lay,
                      sources=cs["sources"], node_merge_ms=sum(sum(x) for x in NM or []) + sum(NS or []),
                      exchange_pieces=[len(p) for p in cs["fwd.out.pieces"]] if lay is not None else None)
    return sum(serial) + t_f + t_b, comm


def method_time(method, P, comp_calls_ms, recs, link, *, fwd_fraction, overhead_ms, proj_ms=(0.0, 0.0),
                **variant):
    """T(P) in ms and its parts for one method. comp_calls_ms: the slowest rank's per-call fwd+bwd ms
    (splitkv: one per chunk; allgather-kv: one; ring-kv: one per step). Overlap as the code does it:
    splitkv pipelines its chunks (`splitkv_time_ms`; one chunk = no overlap) and, with proj_ms != (0, 0),
    hides its first Q gather behind the k/v projections and its last dQ all-to-all behind their backward;
    allgather-kv none, ring-kv overlaps the next shard's exchange with the current step. variant: splitkv's
    `splitkv_time_ms` options (bwd_gather, cp_ranks_per_node, D, elem, acc, merge_gbs, detail); the splitkv
    result then has node_merge_ms (inside exposed_comm_ms: the two-level all-to-all's merges on the compute
    stream)."""
    if method == "splitkv":
        comp = float(sum(comp_calls_ms))
        detail = variant.pop("detail", None)
        det = {} if detail is None else detail
        t, comm = splitkv_time_ms(P, comp_calls_ms, recs, link, fwd_fraction=fwd_fraction, proj_ms=proj_ms,
                                  detail=det, **variant)
        return dict(compute_ms=comp, comm_ms=comm, exposed_comm_ms=max(t - comp, 0.0), overhead_ms=overhead_ms,
                    total_ms=t + overhead_ms, node_merge_ms=det.get("node_merge_ms", 0.0))
    if method == "allgather-kv":
        comp = float(sum(comp_calls_ms))
        comm = comm_time_s(recs, P, link) * 1e3
        return dict(compute_ms=comp, comm_ms=comm, exposed_comm_ms=comm, overhead_ms=overhead_ms,
                    total_ms=comp + comm + overhead_ms)
    # ring-kv
    meta = [r for r in recs if r.step < 0]
    t_meta = comm_time_s(meta, P, link) * 1e3
    by = {}
    for r in recs:
        if r.step >= 0:
            by.setdefault((r.op.split(".", 1)[1], r.step), []).append(r)
    kv_f = [p2p_step_s(by.get(("fwd.kv", s), []), P, link) * 1e3 for s in range(P)]
    kv_b = [p2p_step_s(by.get(("bwd.kv", s), []), P, link) * 1e3 for s in range(P)]
    dkv = [p2p_step_s(by.get(("bwd.dkv", s), []), P, link) * 1e3 for s in range(P)]
    cf = [fwd_fraction * c for c in comp_calls_ms]
    cb = [(1 - fwd_fraction) * c for c in comp_calls_ms]
    t_f = sum(max(cf[s], kv_f[s] if s < P - 1 else 0.0) for s in range(P))
    t_b = sum(max(cb[s], (kv_b[s] if s < P - 1 else 0.0) + (dkv[s - 1] if s > 0 else 0.0)) for s in range(P))
    t_b += dkv[P - 1] if P > 1 else 0.0
    comp = float(sum(comp_calls_ms))
    comm = t_meta + sum(kv_f) + sum(kv_b) + sum(dkv)
    total = t_meta + t_f + t_b + overhead_ms
    return dict(compute_ms=comp, comm_ms=comm, exposed_comm_ms=max(total - overhead_ms - comp, 0.0),
                overhead_ms=overhead_ms, total_ms=total)


# ------------------------------------------------------------------------------------------ jobs
def build_problem(P, args, placement):
    """The weak-scaling batch at CP size P (P x ctx_per_rank tokens, `args.anchors` anchors) placed by
    `placement` ("lpt" at P = 1): a `planning.Plan`."""
    lens, anchors = bench.make_workload(P * args.ctx_per_rank, args.anchors, n_seqs=args.n_seqs,
                                        seed=args.seed + P, mask=args.loss_mask)
    plan = bench.place(lens, anchors, cp_size=P, strategy=placement if P > 1 else "lpt", block_size=args.B)
    return plan


def sample_ranks(method, plan, k):
    """Ranks to measure: the one with the most visible pairs in its kernel calls, then the median one
    (k = 2). ring-kv: the most loaded rank only (all of its P step calls are measured).
    Returns (ranks, per-rank pairs)."""
    P, B = plan.cp_size, plan.block_size
    if method == "splitkv":
        pairs = np.array([sum(c.pairs for c in bench.kernel_calls("splitkv", plan, r, num_chunks=1))
                          for r in range(P)])
    else:  # allgather-kv / ring-kv: own queries vs all keys (the ring visits every shard)
        keys = np.sort(np.concatenate([bench._keys_np(plan.token_seq_ids(r), plan.token_positions(r))
                                       for r in range(P)]))
        lo, hi = bench._intervals_np(keys, plan.q_seq, plan.q_anchor)
        per_block = B * np.maximum(hi - lo, 0).astype(np.float64)
        n = plan.blocks_per_rank
        pairs = per_block.reshape(P, n).sum(1)
    order = np.argsort(pairs, kind="stable")
    out = [int(order[-1])]
    if method != "ring-kv" and k > 1 and P > 1:
        med = int(order[len(order) // 2])
        if med not in out:
            out.append(med)
    return out, pairs


def job_chunking(k, axis, Hkv):
    """The op's chunking of a splitkv job, as a hashable key and a label: (("one",), "k=1") for one call,
    (("rows", k), "rows k=K") for query-row chunks, (("heads", split), "heads a/b") for head chunks (the op's
    even split, `default_head_split`)."""
    if int(k) == 1:
        return ("one",), "k=1"
    if axis != "heads":
        return ("rows", int(k)), f"rows k={int(k)}"
    sp = default_head_split(k, Hkv)
    return ("heads", sp), "heads " + "/".join(map(str, sp))


def time_chunking_overhead(key, plan1, args, *, dtype, device, group, fused, reps):
    """The op's own ms beyond its kernel at P = 1 for one chunking (`job_chunking` key): the real op with per-step
    metadata of that chunking (num_chunks / chunk_axis) and its kernel calls of the same chunking,
    timed side by side (`bench.time_fns_interleaved`, `reps` rounds). Returns (op_ms, kernel_ms), medians. The
    glue a chunk adds (head slices, packs, merges, the chunk loop's waits) is in op - kernel; what the kernel
    itself loses per chunk is in the shards' measured kernel times."""
    opts, kc = {}, {}
    if key[0] == "rows":
        opts, kc = {"num_chunks": key[1], "chunk_axis": "rows"}, {"num_chunks": key[1]}
    elif key[0] == "heads":
        sp = tuple(key[1])
        opts = {"num_chunks": len(sp), "chunk_axis": "heads"}
        kc = {"chunk_axis": "heads", "num_heads_kv": args.Hkv, "num_chunks": len(sp)}
    else:
        opts = {"num_chunks": 1}
    x = bench.rank_inputs(plan1, 0, Hq=args.Hq, Hkv=args.Hkv, D=args.D, dtype=dtype, device=device)
    meta = None if args.no_metadata else bench.prepare_meta(
        "splitkv", x, block_size=args.B, cp_group=group, Hq=args.Hq, Hkv=args.Hkv, D=args.D, dtype=dtype, **opts)
    op_kw = None if meta is not None or key == ("one",) else opts

    def op():
        bench.run_op("splitkv", x, block_size=args.B, cp_group=group, backend=args.backend, meta=meta,
                     op_kwargs=op_kw)
    spec = bench.kernel_calls_timing(bench.kernel_calls("splitkv", plan1, 0, own_block=fused, **kc), dtype=dtype,
                                     device=device, backend=args.backend, fresh_mask=args.no_metadata,
                                     Hq=args.Hq, Hkv=args.Hkv, D=args.D)
    steps = [b() for b in spec.steps]

    def kern():
        for st in steps:
            st()
    (op_ms, _, _), (k_ms, _, _) = bench.time_fns_interleaved([op, kern], device, reps=reps, warmup=2)
    return float(op_ms), float(k_ms)


#: `--paired-rounds` at most: each round re-times every measured splitkv shard (~40 at the default CP sizes, ~10 ms each
#: on the H200); 1000 rounds are ~7 minutes there, more than one device call allows
MAX_PAIRED_ROUNDS = 1000


def check_args(ap, args):
    """Validate the flags up front (argparse error, exit 2, naming the flag). Returns (cps, methods,
    placements) as lists."""
    if not str(args.out).strip():
        ap.error("--out must be a directory path, got an empty string")
    cps = bench.int_list_arg(ap, "--cps", args.cps, 1)
    if len(set(cps)) != len(cps):
        ap.error(f"--cps has duplicates: {args.cps!r}")
    methods = bench.choices_arg(ap, "--methods", args.methods, bench.METHODS, "method")
    placements = bench.choices_arg(ap, "--placements", args.placements, PLACEMENTS, "placement")
    for flag in ("ctx_per_rank", "anchors", "B", "Hq", "Hkv", "D", "n_seqs", "sample_ranks", "reps",
                 "gpus_per_node"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.Hq % args.Hkv:
        ap.error(f"--Hq ({args.Hq}) must be a multiple of --Hkv ({args.Hkv}) (grouped-query attention)")
    if args.n_seqs > args.ctx_per_rank * min(cps):
        ap.error(f"--n-seqs ({args.n_seqs}) must be <= the smallest total context "
                 f"(--ctx-per-rank x min(--cps) = {args.ctx_per_rank * min(cps)})")
    for flag in ("kernel_tflops", "intra_bw_gbs", "inter_bw_gbs", "matmul_tflops"):
        v = getattr(args, flag)
        if not (np.isfinite(v) and v > 0):
            ap.error(f"--{flag.replace('_', '-')} must be a finite number > 0, got {v}")
    for flag in ("call_overhead_ms", "op_overhead_ms", "intra_alpha_us", "inter_alpha_us", "budget_s",
                 "intra_hop_us", "a2a_peer_us"):
        v = getattr(args, flag)
        if not (np.isfinite(v) and v >= 0):
            ap.error(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {v}")
    if not 0 <= args.fwd_fraction <= 1:
        ap.error(f"--fwd-fraction must be in [0, 1], got {args.fwd_fraction}")
    nchunks = [] if args.num_chunks == "auto" else bench.int_list_arg(ap, "--num-chunks", args.num_chunks, 1)
    if not (np.isfinite(args.own_block_ms) and (args.own_block_ms >= 0 or args.own_block_ms == -1.0)):
        ap.error(f"--own-block-ms must be a finite number >= 0, got {args.own_block_ms}")
    args._num_chunks = nchunks
    if args.hidden < 1:
        ap.error(f"--hidden must be >= 1, got {args.hidden}")
    if not (np.isfinite(args.chunk_loss) and (args.chunk_loss >= 0 or args.chunk_loss == -1.0)):
        ap.error(f"--chunk-loss must be a finite number >= 0 (or -1: the fitted {CHUNK_LOSS}), got {args.chunk_loss}")
    if not 0 <= args.paired_rounds <= MAX_PAIRED_ROUNDS:
        ap.error(f"--paired-rounds must be an int in [0, {MAX_PAIRED_ROUNDS}], got {args.paired_rounds}")
    if args.paired_rounds > 0:
        if args.model_only:
            ap.error("--paired-rounds: not with --model-only (it re-times measured shards)")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            ap.error(f"--paired-rounds: one process only (WORLD_SIZE={os.environ.get('WORLD_SIZE')}): every shard is "
                     f"re-timed on one device; take the link from --link-json")
    args._topologies = bench.choices_arg(ap, "--topology", args.topology, ("node", "flat"), "topology")
    args._bwd_gathers = bench.choices_arg(ap, "--bwd-gather", args.bwd_gather, BWD_GATHERS, "backward gather")
    args._ranks_per_node = bench.int_list_arg(ap, "--cp-ranks-per-node", args.cp_ranks_per_node, 1)
    for L in args._ranks_per_node:
        bad = [P for P in cps if P > L and P % L]
        if bad:
            ap.error(f"--cp-ranks-per-node {L} must divide every CP size above it; not {bad} of --cps")
    if not (np.isfinite(args.merge_gbs) and args.merge_gbs > 0):
        ap.error(f"--merge-gbs must be a finite number > 0, got {args.merge_gbs}")
    from megatron_splitkv.kernels import BACKENDS

    if args.backend not in BACKENDS:
        ap.error(f"--backend: unknown kernel backend {args.backend!r}; valid: {', '.join(BACKENDS)}")
    for flag in ("link_json", "bench_json", "kernels_json"):
        v = getattr(args, flag)
        if v and not os.path.isfile(v):
            ap.error(f"--{flag.replace('_', '-')}: no such file {v!r}")
    return cps, methods, placements


#: `--cpu`: the tiny shapes a CPU dry run takes for the shape flags left at their defaults (the full defaults
#: would time a 16K-per-rank shard of the Qwen3-8B drafter on the CPU for CP up to 64: hours)
CPU_SHAPES = dict(cps="1,2,4", ctx_per_rank=256, anchors=8, B=4, Hq=4, Hkv=2, D=16, hidden=64, reps=2)


def main(argv=None):
    """CLI (see the module docstring). Returns the result dict (also written as JSON on rank 0)."""
    from megatron_splitkv._ints import float_arg, int_arg, output_dir  # strict decimal numbers within their limits

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cps", default="1,2,8,16,32,64")
    ap.add_argument("--methods", default="splitkv,allgather-kv,ring-kv")
    ap.add_argument("--placements", default="lpt,zigzag", help="splitkv placements (others: first one)")
    ap.add_argument("--ctx-per-rank", type=int_arg(1), default=16384)
    bench.add_workload_args(ap, reps=5)
    ap.add_argument("--B", type=int_arg(1), default=16)
    ap.add_argument("--Hq", type=int_arg(1), default=32)
    ap.add_argument("--Hkv", type=int_arg(1), default=8)
    ap.add_argument("--D", type=int_arg(1), default=128)
    ap.add_argument("--model-only", action="store_true", help="no GPU: FLOP model for the compute")
    ap.add_argument("--backend", default="auto",
                    help="measured mode: local kernel backend the shards are timed with (megatron_splitkv.kernels."
                         "BACKENDS: auto = fa4 where installed, else flex on CUDA, math on CPU; flex, te, math, and any backend this tree "
                         "registers, e.g. staircase)")
    ap.add_argument("--kernel-tflops", type=float_arg(0, above=True), default=320.0,
                    help="model: useful fwd+bwd TF/s of the local kernel through the kernel API (3.5x "
                         "convention; H200 flex 11.97 ms at 16K with a cached mask = 322, docs/benchmarks.md; "
                         "a dense-call kernel at 80-90%% of dense SDPA's ~575-600 would be ~460-540)")
    ap.add_argument("--call-overhead-ms", type=float_arg(0), default=0.3,
                    help="model: fixed ms per kernel call (launches, padding; the BlockMask is cached "
                         "with per-step metadata; without it add ~2 ms, docs/benchmarks.md)")
    ap.add_argument("--no-metadata", action="store_true",
                    help="model the self-contained op calls (masks rebuilt, ring keys travel) instead of "
                         "calls with per-step metadata")
    ap.add_argument("--op-overhead-ms", type=float_arg(0), default=3.4,
                    help="model: op ms beyond the kernel WITH a separate own-block pass (a fused model takes "
                         "--own-block-ms off): 3.4 = 1.41 ms measured for the fused op (CP=1 op - kernel, third "
                         "H200 run, docs/benchmarks.md) + the 2.0 ms stated own block; measured mode measures it")
    ap.add_argument("--fwd-fraction", type=float_arg(0, 1), default=0.29)
    ap.add_argument("--num-chunks", default="auto",
                    help="splitkv chunk counts to model, comma list (one splitkv row per value and P; the table "
                         "reports k = 1 and the best k per P), or 'auto': 1,2,3,4,6,8 (model-only) / 1,2,4 "
                         "(measured), plus the op's default (ops.metadata.resolve_num_chunks); each clamped to "
                         "the blocks per rank")
    ap.add_argument("--chunk-axis", default="rows", choices=("rows", "heads"),
                    help="splitkv: what the chunks split (the op's chunk_axis): rows (query blocks; default) or "
                         "heads (all rows with Hq / k, Hkv / k heads per chunk, k clamped to --Hkv): measured mode "
                         "times the head chunks as the op runs them, and the schedule model uses the op's head-chunk "
                         "records")
    ap.add_argument("--paired-rounds", type=int_arg(0), default=0,
                    help="measured mode, one process: after the measuring phase re-time, in R interleaved rounds, the "
                         "P = min(--cps) reference shard (splitkv k = 1: what T(P0) is built from) and every measured "
                         "splitkv shard of the first placement (every sampled rank and k), each task once "
                         "per round (a median of --reps), the order rotated by one each round, inputs built once; their "
                         "per-call ms = the median over the rounds, and every splitkv row with P > P0 gets "
                         "efficiency_rounds (T(P0)_i / T(P)_i of round i's compute; shown as median [min-max]). "
                         "0 (default): no rounds")
    ap.add_argument("--chunk-loss", type=float, default=-1.0,
                    help=f"modelled kernel time lost per extra chunk, fraction of the one-chunk kernel time "
                         f"(-1: {CHUNK_LOSS}, fitted on the NVLink chunk A/B at CP=2 128K, docs/benchmarks.md). "
                         f"Used where chunk times are modelled (model-only; measured mode: chunk counts whose "
                         f"shards were not timed, from the measured k = 1); measured chunk calls carry their own")
    ap.add_argument("--own-block-ms", type=float, default=-1.0,
                    help="fwd+bwd ms of the SEPARATE own-block pass and its lse merge at Lq rows (the pre-fusion "
                         "op; measured by tools/gpu_check.py compare, see --kernels-json); default 2.0 ms "
                         "(stated) unless --kernels-json gives it")
    ap.add_argument("--kernels-json", default="",
                    help="gpu_check_compare_w1.json: take --own-block-ms from its own-block table")
    ap.add_argument("--fused-own-block", default="auto", choices=["auto", "on", "off"],
                    help="model the own block fused into the kernel call (auto: as this tree's ops do). The "
                         "stated --op-overhead-ms describes the op WITH a separate own block: fused subtracts "
                         "--own-block-ms from it. A measured overhead is the real op's: adjusted only when "
                         "this flag differs from the tree")
    ap.add_argument("--overlap-q-gather", default="on", choices=["on", "off"],
                    help="splitkv's headline variant: the layer overlaps the first Q all-gather with the k/v "
                         "projections and the last dQ all-to-all with their backward (on), or not (off). "
                         "Both are always computed and tabulated")
    ap.add_argument("--hidden", type=int_arg(1), default=4096,
                    help="drafter hidden size: the k/v projection is hidden -> 2 * Hkv * D per token")
    ap.add_argument("--matmul-tflops", type=float_arg(0, above=True), default=790.0,
                    help="model: bf16 matmul TF/s of the k/v projection (DESIGN.md section 5: ~790 on H200); "
                         "measured mode times the projection on the GPU instead")
    ap.add_argument("--bwd-gather", default="auto",
                    help="splitkv backward gathers per chunk, comma list (one splitkv variant per value, compared in "
                         "one run): separate (dO; delta and lse: two all-gathers), fused (one flat all-gather of [dO "
                         "| delta, lse], the stats bit-packed: the bytes of both, one latency), two-level (that "
                         "gather in two stages with a two-level layout: between nodes, then inside the node; "
                         "elsewhere = fused), auto (as bench.predicted_records issues them: no 'bwd.stats' record "
                         "= fused, 'bwd.dout.inter' records = two-level)")
    ap.add_argument("--cp-ranks-per-node", default="1",
                    help="splitkv's two-level all-to-all, comma list of L (CP ranks per node; one variant per value): "
                         "1 = one all-to-all of the CP group (as before); L > 1 = stage 1 among the node's L ranks "
                         "(NVLink, inputs' dtype), node merge in fp32, stage 2 among the N = P / L ranks of one "
                         "local index (NICs, fp32) for the [O | lse] merge and the dQ sums; clamped to P (L >= P: "
                         "one all-to-all); must divide every P of --cps that exceeds it")
    ap.add_argument("--merge-gbs", type=float_arg(0, above=True), default=MERGE_GBS,
                    help=f"model: GB/s of received stage-1 bytes of the two-level all-to-all's node merge / node sum "
                         f"on the compute stream (stated {MERGE_GBS:.0f}: ~10 HBM bytes per received bf16 element at "
                         f"~4 TB/s); measured mode times the merge on the device")
    ap.add_argument("--two-level-wait", default=None, choices=list(TWO_LEVEL_WAITS),
                    help="two-level all-to-all (default relay, as the op is built on CUDA; also for --replay, "
                         "whatever the saved run used): relay = a relay stream waits for stage 1, runs the node "
                         "merge and issues stage 2, the compute stream never waits for stage 1 (perf-notes item "
                         "16); deferred = the op before item 18 (the compute stream waits for stage 1 of chunk c "
                         "after chunk c + 1's kernel was issued, then merges and issues stage 2); inline = a "
                         "what-if: each chunk's stage 1 waited right after its own kernel")
    ap.add_argument("--sample-ranks", type=int_arg(1), default=2)
    ap.add_argument("--topology", default="node,flat",
                    help="communication model(s), comma list, the first is the headline: node (P ranks on "
                         "ceil(P / gpus-per-node) nodes: NVLink inside, NIC per GPU between; "
                         "bench.LinkModel) and/or flat (every collective a flat ring of P ranks, all hops "
                         "inter-node beyond one node: the first model)")
    ap.add_argument("--gpus-per-node", type=int_arg(1), default=8)
    ap.add_argument("--intra-alpha-us", type=float_arg(0), default=8.0,
                    help="stated NVLink latency per collective step at P = 2 (measured mode fits it)")
    ap.add_argument("--intra-bw-gbs", type=float_arg(0, above=True), default=225.0,
                    help="stated NVLink bus bandwidth GB/s (measured mode fits it)")
    ap.add_argument("--intra-hop-us", type=float_arg(0), default=3.4,
                    help="node topology: NVLink latency per extra ring hop (NCCL tuning.cc, ring Simple); the "
                         "rest of the P = 2 latency is a per-collective base")
    ap.add_argument("--a2a-peer-us", type=float_arg(0), default=1.0,
                    help="node topology: all-to-all issue cost per extra peer (stated assumption)")
    ap.add_argument("--no-pxn", action="store_true",
                    help="node topology: off-node all-to-all bytes leave over this GPU's NIC without the PXN "
                         "NVLink relay")
    ap.add_argument("--inter-alpha-us", type=float_arg(0), default=15.0, help="inter-node latency per hop (us)")
    ap.add_argument("--inter-bw-gbs", "--inter-node-gbps", dest="inter_bw_gbs", type=float_arg(0, above=True), default=50.0,
                    help="inter-node bandwidth per GPU in GB/s (bytes; 50 = a 400 Gb/s NIC per GPU)")
    ap.add_argument("--link-json", default="",
                    help="use a fitted intra link from this JSON (a simulate_scaling.json, or {'link': {'intra': "
                         "{kind: {alpha_us, bw_GBs}}}})")
    ap.add_argument("--no-measure-collectives", action="store_true")
    ap.add_argument("--bench-json", default="", help="bench_attention.json: show measured CP=2 next to model")
    ap.add_argument("--budget-s", type=float_arg(0), default=0.0, help="measured mode: stop measuring after this")
    ap.add_argument("--out", type=output_dir, default=os.environ.get("OUT") or os.path.join(ROOT, "out", "simulate"))
    ap.add_argument("--cpu", action="store_true",
                    help="measured mode on CPU, a dry run: the shape flags left at their defaults take tiny values "
                         f"({' '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in CPU_SHAPES.items())})")
    ap.add_argument("--replay", default="",
                    help="a saved simulate_scaling.json (or .json.gz): recompute its splitkv rows with this tree's collectives and "
                         "schedule model from the run's saved kernel times, projection windows, overhead, node-merge "
                         "rate and link (no GPU; `replay`); --bwd-gather picks the variants (crossed with the saved "
                         "run's L values), --out the output directory; the other flags are ignored")
    args = ap.parse_args(argv)
    if args.cpu:  # a dry run: tiny shapes for every shape flag the command line left at its default
        for name, tiny in CPU_SHAPES.items():
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, tiny)
    if args.two_level_wait is None:
        args.two_level_wait = DEFAULT_TWO_LEVEL_WAIT
    if args.replay:
        return replay_main(ap, args)
    cps, methods, placements = check_args(ap, args)
    topologies = args._topologies
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    dtype = torch.bfloat16
    elem = 2

    # ---- devices / distributed
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    dev = torch.device("cpu")
    if not args.model_only:
        if args.cpu:
            dev = torch.device("cpu")
        else:
            if not torch.cuda.is_available():
                sys.exit("no CUDA: use --model-only (or --cpu for a tiny dry run)")
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
    if world > 1:
        import torch.distributed as dist

        if dev.type == "cuda":
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
        rank = dist.get_rank()
        for r in range(world):  # one-rank groups (every rank must create every group)
            g = dist.new_group([r])
            if r == rank:
                _SOLO[0] = g

    # ---- link model: one per topology, sharing the fitted / stated figures
    link = bench.LinkModel(gpus_per_node=args.gpus_per_node, intra_hop_s=args.intra_hop_us * 1e-6,
                           a2a_peer_s=args.a2a_peer_us * 1e-6, pxn=not args.no_pxn)
    for k in link.intra:
        link.intra[k] = bench.AlphaBeta(args.intra_alpha_us * 1e-6, args.intra_bw_gbs * 1e9)
        link.inter[k] = bench.AlphaBeta(args.inter_alpha_us * 1e-6, args.inter_bw_gbs * 1e9)
    link_source = "stated defaults"
    measured_coll = None
    if args.link_json:
        with open(args.link_json) as f:
            lj = json.load(f)["link"]["intra"]
        for k, v in lj.items():
            link.intra[k] = bench.AlphaBeta(v["alpha_us"] * 1e-6, v["bw_GBs"] * 1e9)
        link_source = f"from {args.link_json}"
    elif world > 1 and not args.no_measure_collectives:
        import torch.distributed as dist

        sizes = None if dev.type == "cuda" else [1 << e for e in range(12, 21, 2)]
        measured_coll = bench.measure_collectives(dist.group.WORLD, dev, sizes, reps=args.reps)
        fits = bench.fit_link(measured_coll, world)
        for k, ab in fits.items():
            link.intra[k] = ab
        link_source = f"fitted to collectives measured on {world} {'GPUs' if dev.type == 'cuda' else 'gloo ranks'}"
    links = {t: dataclasses.replace(link, topology=t) for t in topologies}
    log(f"[link] {link_source}: {json.dumps(links[topologies[0]].to_dict())}")

    # ---- own block: fused into the kernel call (as this tree's ops do) or a separate pass
    fused = args.fused_own_block != "off"
    own_ms, own_src = 2.0, "stated"
    if args.own_block_ms >= 0:
        own_ms, own_src = args.own_block_ms, "--own-block-ms"
    elif args.kernels_json:
        try:
            with open(args.kernels_json) as f:
                ob = json.load(f)["compare"]["own_block"]
            ein = next(r for r in ob if r["path"].startswith("einsum"))["fwdbwd_ms"]
            mrg = next((r["fwd_ms"] for r in ob if r["path"].startswith("lse merge")), 0.0)
            own_ms, own_src = ein + mrg, f"measured ({os.path.basename(args.kernels_json)}: einsum + merge)"
        except Exception as e:  # noqa: BLE001
            log(f"[own-block] {args.kernels_json}: no own-block timing ({type(e).__name__}: {e}); stated {own_ms} ms")

    # ---- chunk counts of splitkv (the merge pipeline), per P: candidates, clamped as the op clamps them
    measured = not args.model_only
    chunk_loss = CHUNK_LOSS if args.chunk_loss < 0 else args.chunk_loss

    def chunk_list(P, nb):
        if P == 1:  # nothing to pipeline without communication
            return [1]
        req = args._num_chunks or ([1, 2, 4] if measured else [1, 2, 3, 4, 6, 8])
        limit = args.Hkv if args.chunk_axis == "heads" else nb  # head chunks clamp to Hkv, as the op
        ks = [bench.resolve_chunks(k, P, limit) for k in req]
        if not args._num_chunks:
            ks.append(bench.resolve_chunks(None, P, limit))
        return sorted(dict.fromkeys(ks), key=lambda k: (k != req[0], k))  # the first requested first

    # ---- problems and compute
    plans = {}
    for P in cps:
        for pl in placements:
            key = (P, pl if P > 1 else placements[0])
            if key not in plans:
                plans[key] = build_problem(P, args, key[1])
    jobs = []  # (P, method, placement, num_chunks of the chunk axis of --chunk-axis)
    for P in cps:
        for m in methods:
            for pl in (placements if m == "splitkv" else placements[:1]):
                if P == 1 and pl != placements[0]:
                    continue
                nb = plans[(P, pl if P > 1 else placements[0])].blocks_per_rank
                if m != "splitkv":
                    ks = [1]
                elif pl == placements[0]:
                    ks = chunk_list(P, nb)
                else:
                    ks = chunk_list(P, nb)[:1]
                for k in ks:
                    jobs.append((P, m, pl, k))
    job_index = {jb: j for j, jb in enumerate(jobs)}

    # compute tasks: (job index, rank); the most loaded rank of every job first, then the others (so a
    # budget cut leaves the median ranks to the model, not the slowest); k = 1 of every method before the
    # other chunk counts of splitkv (a chunk count cut by the budget is scaled from the measured k = 1; the
    # baselines have no such fallback), splitkv first, then by P
    calls_of = {}
    tasks = []
    for j, (P, m, pl, k) in enumerate(jobs):
        plan = plans[(P, pl if P > 1 else placements[0])]
        ranks, _ = sample_ranks(m, plan, args.sample_ranks)
        for i, r in enumerate(ranks):
            calls = bench.kernel_calls(m, plan, r, num_chunks=k, own_block=fused,
                                       **({"chunk_axis": args.chunk_axis, "num_heads_kv": args.Hkv}
                                          if m == "splitkv" else {}))
            calls_of[(j, r)] = calls
            tasks.append((i, j, r))
    mprio = {m: i for i, m in enumerate(("splitkv", "allgather-kv", "ring-kv"))}
    tasks = [(j, r) for _, j, r in sorted(tasks, key=lambda t: (t[0], jobs[t[1]][3] != 1, mprio.get(jobs[t[1]][1], 9),
                                                                jobs[t[1]][3], jobs[t[1]][0]))]
    comp = {}  # (j, r) -> list of per-call ms
    rounds = {}  # (j, r) -> per --paired-rounds round: its list of per-call ms
    proj_rate = None  # measured (fwd, bwd) TF/s of the k/v projection
    merge_rate = None  # measured (fwd, bwd) GB/s of the two-level all-to-all's node merge / node sum
    over_by = {}  # measured mode: the op's overhead per chunking (`time_chunking_overhead`)
    if measured:
        mine = [t for i, t in enumerate(tasks) if i % max(world, 1) == rank]
        shapes = dict(Hq=args.Hq, Hkv=args.Hkv, D=args.D)
        local = {}
        for i, (j, r) in enumerate(mine):
            # each rank measures at least its first shard (tasks are ordered k = 1 first, smallest P first),
            # whatever the budget: the calibration of the modelled shards needs one
            if i and args.budget_s > 0 and time.perf_counter() - t_start > args.budget_s:
                local[(j, r)] = None
                continue
            try:
                # every call timed alone (ring-kv's steps are separated by its exchanges)
                kt = bench.time_kernel_calls(calls_of[(j, r)], dtype=dtype, device=dev, backend=args.backend,
                                             reps=args.reps, warmup=1, fresh_mask=args.no_metadata, **shapes)
                local[(j, r)] = kt["per_call_ms"]
                print(f"[measure r{rank}] P={jobs[j][0]} {jobs[j][1]} {jobs[j][2]} k={jobs[j][3]} rank {r}: "
                      f"{kt['ms']:.2f} ms, {kt['tflops']:.0f} TF/s", flush=True)
            except Exception:  # noqa: BLE001
                print(f"[measure r{rank}] P={jobs[j][0]} {jobs[j][1]} rank {r} ERROR\n{traceback.format_exc(limit=3)}",
                      flush=True)
                local[(j, r)] = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        # op overhead at CP=1: the real op vs its kernel; the k/v projection's matmul rate
        op_over = None
        over_by = {}  # job_chunking key -> dict(label, op_ms, kernel_ms, overhead_ms)
        if rank == 0:
            plan1 = plans[(1, placements[0])] if (1, placements[0]) in plans else build_problem(1, args, "lpt")
            keys = {("one",): "k=1"}
            for (P_, m_, pl_, k_) in jobs:
                if m_ == "splitkv":
                    key, lab = job_chunking(k_, args.chunk_axis, args.Hkv)
                    keys.setdefault(key, lab)
            for key, lab in keys.items():  # k = 1 first: the overhead of T(P0) and of every k = 1 row
                try:
                    op_ms, k_ms = time_chunking_overhead(key, plan1, args, dtype=dtype, device=dev,
                                                         group=_solo_group(), fused=True,
                                                         reps=max(3 * args.reps, 9))
                    over_by[key] = dict(label=lab, op_ms=op_ms, kernel_ms=k_ms, overhead_ms=max(op_ms - k_ms, 0.0))
                    print(f"[overhead] CP=1 {lab}: op {op_ms:.2f} ms - kernel {k_ms:.2f} ms = "
                          f"{over_by[key]['overhead_ms']:.2f} ms", flush=True)
                except Exception:  # noqa: BLE001
                    print(f"[overhead] {lab} ERROR\n{traceback.format_exc(limit=3)}", flush=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            if ("one",) in over_by:
                op_over = over_by[("one",)]["overhead_ms"]
            if any(two_level_layout(P, L, args.gpus_per_node) for P in cps for L in args._ranks_per_node):
                try:
                    Lm = max(L for L in args._ranks_per_node if any(two_level_layout(P, L, args.gpus_per_node)
                                                                   for P in cps))
                    merge_rate = time_node_merge(min(Lm, max(cps)), args.anchors * args.B, args.Hq, args.D,
                                                 dtype=dtype, device=dev, reps=args.reps)
                    old = time_node_merge(min(Lm, max(cps)), args.anchors * args.B, args.Hq, args.D,
                                          dtype=dtype, device=dev, reps=args.reps, path="torch")
                    print(f"[node-merge] L={Lm}, {args.anchors * args.B} rows: fwd {merge_rate[0]:.1f} GB/s, "
                          f"bwd {merge_rate[1]:.1f} GB/s of received bytes (the op's merge; the torch path: "
                          f"fwd {old[0]:.1f}, bwd {old[1]:.1f})", flush=True)
                except Exception:  # noqa: BLE001
                    print(f"[node-merge] ERROR\n{traceback.format_exc(limit=3)}", flush=True)
            try:
                proj_rate = time_kv_projection(args.ctx_per_rank + args.anchors * args.B, args.hidden,
                                               2 * args.Hkv * args.D, dtype=dtype, device=dev, reps=args.reps)
                print(f"[kv-proj] {args.ctx_per_rank + args.anchors * args.B} tokens: fwd {proj_rate[0]:.0f} TF/s, "
                      f"bwd {proj_rate[1]:.0f} TF/s", flush=True)
            except Exception:  # noqa: BLE001
                print(f"[kv-proj] ERROR\n{traceback.format_exc(limit=3)}", flush=True)
        if world > 1:
            import torch.distributed as dist

            objs = [None] * world
            dist.all_gather_object(objs, (local, op_over, proj_rate, merge_rate, over_by))
            for loc, ov, pr, mr, ob in objs:
                comp.update(loc)
                if ov is not None:
                    op_over = ov
                if ob:
                    over_by = ob
                if pr is not None:
                    proj_rate = pr
                if mr is not None:
                    merge_rate = mr
        else:
            comp.update(local)
        if args.paired_rounds > 0:  # one process (check_args): every shard re-timed here
            # the P0 reference shard (splitkv k = 1, what T(P0) is built from) first, then every measured splitkv
            # shard of the first placement in the measuring order; inputs built once, R rounds, rotated order
            p0 = min(cps)
            rt = [(j, r) for (j, r) in tasks if jobs[j][1] == "splitkv" and jobs[j][2] == placements[0]
                  and comp.get((j, r)) is not None]
            rt.sort(key=lambda t: not (jobs[t[0]][0] == p0 and jobs[t[0]][3] == 1))
            try:
                t_r = time.perf_counter()
                specs = [bench.kernel_calls_timing(calls_of[t], dtype=dtype, device=dev, backend=args.backend,
                                                   fresh_mask=args.no_metadata, **shapes) for t in rt]
                got = bench.time_kernel_calls_rounds(specs, device=dev, rounds=args.paired_rounds, reps=args.reps,
                                                     warmup=1)
                for t, per_round in zip(rt, got):
                    rounds[t] = [list(x["per_call_ms"]) for x in per_round]
                    comp[t] = [float(np.median([pc[c] for pc in rounds[t]])) for c in range(len(rounds[t][0]))]
                log(f"[rounds] {len(rt)} splitkv shards x {args.paired_rounds} interleaved rounds: "
                    f"{time.perf_counter() - t_r:.1f}s")
            except Exception:  # noqa: BLE001
                rounds.clear()
                print(f"[rounds] ERROR (the single measurements kept)\n{traceback.format_exc(limit=3)}", flush=True)
        overhead_ms = op_over if op_over is not None else args.op_overhead_ms
        overhead_src = "measured (CP=1 op - kernel)" if op_over is not None else "stated"
    else:
        overhead_ms, overhead_src = args.op_overhead_ms, "stated"
    # the stated overhead describes the op with a SEPARATE own block; a measured one, this tree's op
    base_fused = True if overhead_src.startswith("measured") else False
    if fused != base_fused:
        overhead_ms = max(overhead_ms + (-own_ms if fused else own_ms), 0.0)
        overhead_src += f", {'-' if fused else '+'} own block {own_ms:.2f} ms ({own_src})"
    overhead_src += "; own block " + ("fused in the kernel" if fused else "a separate pass")
    if len(over_by) > 1 and ("one",) in over_by:
        overhead_src += ("; chunked rows: + their chunking's measured CP=1 (op - kernel) minus k = 1's ("
                         + ", ".join(f"{v['label']} {v['overhead_ms'] - over_by[('one',)]['overhead_ms']:+.2f} ms"
                                     for key, v in over_by.items() if key != ("one",)) + ")")

    glue = {key: v["overhead_ms"] for key, v in over_by.items()}

    def job_overhead(k):
        """The op overhead of a splitkv row of k chunks: k = 1's (overhead_ms) plus what its
        chunking's measured CP=1 glue adds over k = 1's (0 where not measured)."""
        got = chunked_overhead(overhead_ms, glue, [job_chunking(k, args.chunk_axis, args.Hkv)[0]])
        return overhead_ms if got is None else got
    # unmeasured shards: splitkv k > 1 from the same rank's measured k = 1 x the chunk-loss model, else the
    # FLOP model (splitkv: the one-call time x the chunk-loss model) at a kernel rate CALIBRATED on this
    # run's measured k = 1 shards of the same method (else of any method; else --kernel-tflops), so that a
    # budget-cut measurement does not mix a measured T(1) with a differently fast model at larger P
    rates, rate_src = {}, {}
    if not args.model_only:
        def measured(m=None):
            return [(calls_of[(j, r)], comp[(j, r)]) for (j, r) in tasks
                    if comp.get((j, r)) is not None and jobs[j][3] == 1 and (m is None or jobs[j][1] == m)]
        every = calibrated_tflops(measured(), Hq=args.Hq, D=args.D, overhead_ms=args.call_overhead_ms)
        for m in dict.fromkeys(jobs[j][1] for j, _ in tasks):
            own = calibrated_tflops(measured(m), Hq=args.Hq, D=args.D, overhead_ms=args.call_overhead_ms)
            if own is not None:
                rates[m], rate_src[m] = own, f"calibrated on its measured shards: {own:.0f} TF/s"
            elif every is not None:
                rates[m], rate_src[m] = every, f"calibrated on all measured shards: {every:.0f} TF/s"
    for (j, r) in tasks:
        if comp.get((j, r)) is not None:
            comp[("src", j, r)] = f"measured, {args.paired_rounds} interleaved rounds" if (j, r) in rounds \
                else "measured"
            continue
        P, m, pl, k = jobs[j]
        pairs = [c.pairs for c in calls_of[(j, r)]]
        j1 = job_index.get((P, m, pl, 1))
        if m == "splitkv" and k > 1 and j1 is not None and comp.get((j1, r)) is not None \
                and comp.get(("src", j1, r)) == "measured":
            comp[(j, r)] = chunked_calls_ms(sum(comp[(j1, r)]), pairs, chunk_loss)
            comp[("src", j, r)] = "measured k=1 x chunk loss"
        elif m == "splitkv":
            one = bench.KernelCall(np.zeros(1), np.zeros(1), np.zeros(1), None, None, args.B, float(sum(pairs)))
            t1 = model_call_ms(one, Hq=args.Hq, D=args.D, tflops=rates.get(m, args.kernel_tflops),
                               overhead_ms=args.call_overhead_ms)
            comp[(j, r)] = chunked_calls_ms(t1, pairs, chunk_loss) if sum(pairs) > 0 else [0.0] * len(pairs)
            comp[("src", j, r)] = "model"
        else:
            comp[(j, r)] = [model_call_ms(c, Hq=args.Hq, D=args.D, tflops=rates.get(m, args.kernel_tflops),
                                          overhead_ms=args.call_overhead_ms) for c in calls_of[(j, r)]]
            comp[("src", j, r)] = "model"
    if proj_rate is None:
        proj_rate, proj_src = (args.matmul_tflops, args.matmul_tflops), f"stated {args.matmul_tflops:.0f} TF/s"
    else:
        proj_src = f"measured fwd {proj_rate[0]:.0f} / bwd {proj_rate[1]:.0f} TF/s"
    if merge_rate is None:
        merge_rate, merge_src = (args.merge_gbs, args.merge_gbs), f"stated {args.merge_gbs:.0f} GB/s"
    else:
        merge_src = f"measured fwd {merge_rate[0]:.0f} / bwd {merge_rate[1]:.0f} GB/s"
    variants = splitkv_variants(args, elem)
    log("[variants] " + "; ".join(f"{v['label']}: backward gather {v['bwd_gather']}, L = {v['cp_ranks_per_node']}"
                                  for v in variants))

    def proj_ms(plan, r):
        """(fwd, bwd) ms of rank r's k/v projection: its context tokens + its query block tokens."""
        tokens = int(plan.token_index(r).shape[0]) + plan.blocks_per_rank * args.B
        f = kv_proj_flops(tokens, args.hidden, args.Hkv, args.D)
        return f / (proj_rate[0] * 1e12) * 1e3, 2 * f / (proj_rate[1] * 1e12) * 1e3

    # ---- assemble: every job under every topology, splitkv with and without the projection overlap, per
    # splitkv variant (backward gather x two-level all-to-all)
    rows = []
    takes_l = "cp_ranks_per_node" in inspect.signature(bench.predicted_records).parameters
    for j, (P, m, pl, k) in enumerate(jobs):
        plan = plans[(P, pl if P > 1 else placements[0])]
        rks = [r for (jj, r) in tasks if jj == j]
        # slowest sampled rank
        r_slow = max(rks, key=lambda r: sum(comp[(j, r)]))
        nb = [plan.blocks_per_rank] * P
        nc = [int(plan.token_index(r).shape[0]) for r in range(P)]
        pairs = [sum(c.pairs for c in calls_of[(j, r)]) for r in rks]
        pj = proj_ms(plan, r_slow)
        ov_j = job_overhead(k) if m == "splitkv" else overhead_ms
        # --paired-rounds: round i's compute = that round's slowest sampled rank (every sampled rank re-timed)
        pc_rounds = None
        if rks and all((j, r) in rounds for r in rks):
            pc_rounds = [max((rounds[(j, r)][i] for r in rks), key=sum) for i in range(args.paired_rounds)]
        # the fields every row of this job has (topology, overlap and the timing are added per row)
        common = dict(P=P, method=m, placement=pl if P > 1 else "-", num_chunks=k, proj_fwd_ms=pj[0],
                      proj_bwd_ms=pj[1], context=P * args.ctx_per_rank, sampled_ranks=rks, slowest_rank=r_slow,
                      compute_source=comp[("src", j, r_slow)], per_call_ms=comp[(j, r_slow)],
                      sampled_compute_ms=[sum(comp[(j, r)]) for r in rks], sampled_pairs=pairs,
                      planner_imbalance=float(plan.imbalance))
        recs_of = {}
        for v in (variants if m == "splitkv" else [None]):
            L = v["cp_ranks_per_node"] if v else 1
            if L not in recs_of:  # the op's records for this L (its own two-level records when it has them)
                recs_of[L] = bench.predicted_records(
                    m, P=P, rank=r_slow, n_blocks=nb, n_ctx=nc, B=args.B, Hq=args.Hq, Hkv=args.Hkv, D=args.D,
                    elem=elem, metadata=not args.no_metadata, num_chunks=k,
                    **({"chunk_axis": args.chunk_axis} if m == "splitkv" else {}),
                    **({"cp_ranks_per_node": min(L, P)} if takes_l and m == "splitkv" else {}))  # clamped as the
                # op clamps SplitKVConfig.cp_ranks_per_node: a CP group within one node gets one all-to-all
            recs = recs_of[L]
            opts = {} if v is None else dict(bwd_gather=v["bwd_gather"], cp_ranks_per_node=L, D=args.D, elem=elem,
                                             acc=4, merge_gbs=merge_rate, two_level_wait=args.two_level_wait)
            for topo in topologies:
                for ovl in ((False, True) if m == "splitkv" else (False,)):
                    det = {}

                    def timed(pc, det=None):
                        return method_time(m, P, pc, recs, links[topo], fwd_fraction=args.fwd_fraction,
                                           overhead_ms=ov_j, proj_ms=pj if ovl else (0.0, 0.0),
                                           **(dict(opts, detail=det) if v else {}))
                    t = timed(comp[(j, r_slow)], det)
                    extra = variant_fields(v, det, L) if v is not None else {}
                    nbytes = sum(extra["bytes_by_name"].values()) if v else sum(r.bytes for r in recs)
                    if pc_rounds:  # each round's T, the rest of the row alike
                        extra.update(per_call_ms_rounds=pc_rounds,
                                     total_ms_rounds=round_totals(lambda pc: timed(pc)["total_ms"], pc_rounds))
                    rows.append(dict(common, topology=topo, overlap_q_gather=ovl, bytes_per_rank=nbytes,
                                     **extra, **t))
    set_efficiency(rows, min(cps))
    set_efficiency_rounds(rows, min(cps))
    # measured CP=2 from bench_attention (the op alone: rows without the projection overlap)
    bj = {}
    if args.bench_json and os.path.exists(args.bench_json):
        try:
            with open(args.bench_json) as f:
                bj = json.load(f)
        except ValueError as e:  # a bench run killed while writing: no measured column
            log(f"[bench-json] {args.bench_json}: unreadable ({e})")
    if bj:
        for r in rows:
            if r["overlap_q_gather"]:
                continue
            for b in bj.get("rows", []):
                if (b.get("cp") == r["P"] and b.get("method") == r["method"] and b.get("context") == r["context"]
                        and b.get("placement") in (r["placement"], "-") and "op_ms" in b
                        and b.get("Lq") == args.anchors * args.B
                        and b.get("num_chunks", r["num_chunks"]) == r["num_chunks"]):
                    r["bench_measured_ms"] = b["op_ms"]
    result = dict(
        env=dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 torch=torch.__version__, device=str(dev),
                 gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", world=world),
        args=vars(args), link=links[topologies[0]].to_dict(), link_source=link_source, topologies=topologies,
        overhead_ms=overhead_ms, overhead_source=overhead_src,
        overhead_by_chunking=[dict(v, key=list(map(str, key))) for key, v in over_by.items()],
        model_kernel_rate={m: rate_src.get(m, f"stated {args.kernel_tflops:.0f} TF/s") for m in
                           dict.fromkeys(jobs[j][1] for j, _ in tasks)},
        own_block=dict(fused=fused, separate_ms=own_ms, source=own_src),
        chunked_pipeline=True, chunk_loss=chunk_loss, kv_projection=dict(source=proj_src, tflops=list(proj_rate)),
        variants=variants, node_merge=dict(source=merge_src, gbs=list(merge_rate)),
        measured_collectives=measured_coll, flop_convention=QUERY_FLOPS_NOTE,
        rows=rows, wall_s=time.perf_counter() - t_start)
    result["summary"] = summarize(result)
    if rank == 0:
        md = render(result)
        with open(os.path.join(args.out, "simulate_scaling.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.join(args.out, "simulate_scaling.md"), "w") as f:
            f.write(md + "\n")
        try:
            plot(result, os.path.join(args.out, "simulate_scaling.png"))
        except Exception:  # noqa: BLE001
            print(f"[plot] failed\n{traceback.format_exc(limit=2)}", flush=True)
        print(md, flush=True)
        print(f"[done] {time.perf_counter() - t_start:.1f}s", flush=True)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return result


def replay_main(ap, args):
    """`--replay`: validate, `replay`, write simulate_scaling.json / .md (prefixed with the replay note) to
    --out and print the tables. Returns the result."""
    if args.paired_rounds:
        ap.error("--paired-rounds: not with --replay (it re-times measured shards; a replay recomputes a saved run's "
                 "rounds from its saved per-round kernel times)")
    if not os.path.isfile(args.replay):
        ap.error(f"--replay: no such file {args.replay!r}")
    if not str(args.out).strip():
        ap.error("--out must be a directory path, got an empty string")
    gathers = bench.choices_arg(ap, "--bwd-gather", args.bwd_gather, BWD_GATHERS, "backward gather")
    try:  # a saved run, plain or gzip-compressed (docs/lab/results keeps the larger ones as .json.gz)
        with (gzip.open(args.replay, "rt") if args.replay.endswith(".gz") else open(args.replay)) as f:
            saved = json.load(f)
    except (OSError, ValueError, EOFError) as e:
        ap.error(f"--replay {args.replay!r}: not a simulate_scaling.json ({type(e).__name__}: {e})")
    try:
        res = replay(saved, bwd_gathers=gathers, source=args.replay, two_level_wait=args.two_level_wait)
    except KeyError as e:
        ap.error(f"--replay: {args.replay} lacks {e} (not a simulate_scaling.json of a tree with the splitkv variants)")
    os.makedirs(args.out, exist_ok=True)
    md = f"Replay of {args.replay}: {res['replay']['note']}.\n\n" + render(res)
    with open(os.path.join(args.out, "simulate_scaling.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(args.out, "simulate_scaling.md"), "w") as f:
        f.write(md + "\n")
    print(md, flush=True)
    return res


def time_kv_projection(tokens, hidden, out_features, *, dtype, device, reps=5):
    """Measured (forward, backward) TF/s of the k/v projection y = x W^T, x [tokens, hidden], W
    [out_features, hidden], backward = dgrad + wgrad (2x the forward FLOPs)."""
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(out_features, hidden, device=device, dtype=dtype) * hidden ** -0.5).requires_grad_(True)
    gy = torch.randn(tokens, out_features, device=device, dtype=dtype)

    def fwd():
        with torch.no_grad():
            torch.nn.functional.linear(x, w)

    def fwdbwd():
        x.grad = w.grad = None
        torch.nn.functional.linear(x, w).backward(gy)

    f_ms, _, _ = bench.time_fn(fwd, device, reps=reps, warmup=2)
    fb_ms, _, _ = bench.time_fn(fwdbwd, device, reps=reps, warmup=2)
    flops = 2.0 * tokens * hidden * out_features
    b_ms = max(fb_ms - f_ms, 1e-6)
    return flops / (f_ms * 1e9), 2 * flops / (b_ms * 1e9)


def time_node_merge(L, rows, Hq, D, *, dtype, device, reps=5, path="op"):
    """Measured (forward, backward) GB/s of RECEIVED bytes of the two-level all-to-all's node merge: L packed
    [O | lse] partials of rows / L rows (`ops.common.pack_partial`) lse-merged, and the dQ node sum of L
    partials in the inputs' dtype accumulated in fp32.

    path="op": what the op runs (`ops.fused_merge.merge_packed`: one Triton kernel on CUDA, else the torch
    path; `fused_merge.sum_partials`: one reduction). path="torch": the session-4 torch path (unpack to an
    fp32 copy, max / exp / einsum / finalize; the dQ sum one partial at a time), for the side-by-side record."""
    from megatron_splitkv.ops.common import pack_partial
    from megatron_splitkv.ops.fused_merge import merge_packed, merge_packed_torch, sum_partials

    if path not in ("op", "torch"):
        raise ValueError(f"path must be 'op' or 'torch', got {path!r}")
    r = max(int(rows) // int(L), 1)
    acc = torch.float32
    x = pack_partial(torch.randn(L * r, Hq, D, device=device, dtype=dtype),
                     torch.randn(L * r, Hq, device=device, dtype=acc), dtype)
    dq = torch.randn(L, r, Hq, D, device=device, dtype=dtype)

    def fwd():
        (merge_packed if path == "op" else merge_packed_torch)(x, L, r, D, acc)

    def bwd():
        if path == "op":
            sum_partials(dq, acc)
            return
        a = torch.zeros((r, Hq, D), dtype=acc, device=device)
        for i in range(L):
            a += dq[i]

    f_ms, _, _ = bench.time_fn(fwd, device, reps=reps, warmup=2)
    b_ms, _, _ = bench.time_fn(bwd, device, reps=reps, warmup=2)
    return (x.numel() * x.element_size() / (max(f_ms, 1e-6) * 1e6),
            dq.numel() * dq.element_size() / (max(b_ms, 1e-6) * 1e6))


def variant_fields(v, det, L):
    """The splitkv variant's columns of a row: label, resolved backward gather, L, two-level or not, where the
    collectives came from, bytes per collective name (comm_stats convention) and the all-to-alls' off-node
    bytes sent (`splitkv_time_ms`'s `detail`)."""
    lay = det.get("layout")
    return dict(variant=v["label"], bwd_gather=det.get("bwd_gather"), cp_ranks_per_node=L,
                two_level=lay is not None, comm_sources=det.get("sources"), exchange_pieces=det.get("exchange_pieces"),
                bytes_by_name={a: int(round(b)) for a, b in det.get("bytes_by_name", {}).items()},
                a2a_nic_bytes_sent={a: int(round(b)) for a, b in det.get("a2a_nic_bytes_sent", {}).items()})


def set_efficiency(rows, p0):
    """Efficiency of every row vs its method's own T at P0 (the smallest P), per topology: the fastest row of
    that method at P0 (splitkv: placements, chunk counts, overlap and variants alike)."""
    base = {}
    for r in rows:
        if r["P"] == p0:
            key = (r["method"], r.get("topology", "flat"))
            base[key] = min(base.get(key, float("inf")), r["total_ms"])
    for r in rows:
        b = base.get((r["method"], r.get("topology", "flat")))
        r["efficiency"] = b / r["total_ms"] if b and r["total_ms"] > 0 else float("nan")
        r["efficiency_base_P"] = p0


def link_from_dict(d, topology=None):
    """The `bench.LinkModel` of its `to_dict()` (a saved simulate_scaling.json's "link"), under `topology`
    (default: the saved one). Raises KeyError on a dict without intra / inter tables."""
    def table(t):
        return {k: bench.AlphaBeta(v["alpha_us"] * 1e-6, v["bw_GBs"] * 1e9) for k, v in t.items()}

    return bench.LinkModel(intra=table(d["intra"]), inter=table(d["inter"]), gpus_per_node=int(d["gpus_per_node"]),
                           topology=topology or d.get("topology", "node"),
                           intra_hop_s=d.get("intra_hop_us", 3.4) * 1e-6, a2a_peer_s=d.get("a2a_peer_us", 1.0) * 1e-6,
                           pxn=bool(d.get("pxn", True)))


def chunked_overhead(base_ms, glue, keys):
    """The op overhead of a chunked row: `base_ms` (k = 1's) plus what the first of `keys` (`job_chunking` keys)
    found in `glue` ({key: CP=1 op - kernel ms}) adds over k = 1's (glue[("one",)]), at least 0. None when `glue`
    has no k = 1 entry or none of `keys` (the caller keeps its base)."""
    if ("one",) not in glue:
        return None
    for key in keys:
        if key in glue:
            return max(float(base_ms) + glue[key] - glue[("one",)], 0.0)
    return None


def replay(saved, *, bwd_gathers=None, source="", two_level_wait=DEFAULT_TWO_LEVEL_WAIT):
    """Recompute the splitkv rows of a saved run (`main`'s result: a simulate_scaling.json) with THIS tree's
    collectives (`bench.predicted_records`) and schedule model, from what the run measured or modelled and
    saved: each row's per-chunk kernel ms (`per_call_ms`), k/v projection windows, op overhead, the node-merge
    rate, the link (fitted NVLink, stated inter-node) and the workload arguments (the plans are rebuilt to
    get the per-rank block counts). No GPU, no measuring. The baselines' rows are kept as saved.

    bwd_gathers: the variants' backward gathers (`BWD_GATHERS`; default the saved run's), crossed with the
    saved run's `--cp-ranks-per-node` values. "auto" means as this tree's op issues them (the saved run's
    "auto" meant its own tree's op); "fused" with L = 8 is the op before the two-level [dO | stats] gather.
    two_level_wait (`TWO_LEVEL_WAITS`): the two-level all-to-all's schedule; default this tree's op (relay),
    NOT the saved run's (its "deferred" was the op of its tree); args.two_level_wait of the result is the
    one used. Returns a result dict like `main`'s (rows, variants, summary; "replay" =
    source and note); the same inputs with the saved run's variants, schedule and tree reproduce its rows.

    Rows saved with per-round kernel ms (`--paired-rounds`) get their rounds' T and efficiency_rounds again
    (`set_efficiency_rounds`). Rows of uneven head splits (a "head_split" field, saved by trees whose op had
    them) are dropped: the op runs even head chunks only.
    Raises KeyError on a saved result without the fields above (a run of a tree before the variants)."""
    import argparse as _ap

    a = _ap.Namespace(**{k: v for k, v in saved["args"].items()})
    a._ranks_per_node = list(saved["args"]["_ranks_per_node"])
    a._bwd_gathers = list(saved["args"]["_bwd_gathers"] if bwd_gathers is None else bwd_gathers)
    if two_level_wait not in TWO_LEVEL_WAITS:
        raise ValueError(f"two_level_wait must be one of {TWO_LEVEL_WAITS}, got {two_level_wait!r}")
    a.two_level_wait = two_level_wait
    variants = splitkv_variants(a)
    topologies = list(saved.get("topologies") or ["node"])
    links = {t: link_from_dict(saved["link"], t) for t in topologies}
    merge = tuple(saved["node_merge"]["gbs"])
    first = a.placements.split(",")[0].strip()
    plans, groups = {}, {}
    for r in saved["rows"]:  # one saved row per (P, placement, k, topology, overlap): its measured inputs
        if r["method"] == "splitkv" and not r.get("head_split"):
            groups.setdefault((r["P"], r["placement"], r["num_chunks"], r["topology"], r["overlap_q_gather"]), r)
    rows = []
    recs_memo = {}

    def plan_of(P, pl):
        key = (P, pl if P > 1 else first)
        if key not in plans:
            plans[key] = build_problem(P, a, key[1] if P > 1 else "lpt")
        return plans[key]

    def kw(P, pl, topo, ovl, per_call, rounds=None):
        return dict(a=a, plan=plan_of(P, pl), P=P, per_call=per_call, link=links[topo], ovl=ovl, merge_gbs=merge,
                    recs_memo=recs_memo, per_call_rounds=rounds)

    for (P, pl, k, topo, ovl), r in groups.items():
        for v in variants:
            rows.append(splitkv_row(r, k=k, variant=v, **kw(P, pl, topo, ovl, r["per_call_ms"],
                                                             r.get("per_call_ms_rounds"))))
    rows += [dict(r) for r in saved["rows"] if r["method"] != "splitkv"]
    set_efficiency(rows, min(r["P"] for r in rows))
    set_efficiency_rounds(rows, min(r["P"] for r in rows))
    res = dict(saved)
    res.update(args=dict(vars(a)), variants=variants, rows=rows,
               replay=dict(source=source, note="splitkv rows recomputed from the saved per-chunk kernel times, "
                                               "projection windows, overhead, node-merge rate and link with this "
                                               "tree's collectives; baselines as saved"))
    res["summary"] = summarize(res)
    return res


def splitkv_variants(args, elem=2):
    """The splitkv variants of a run: every --cp-ranks-per-node L x every --bwd-gather, duplicates dropped,
    in the order given (the first is the reference variant of the summary). "auto" stays auto: it is
    resolved per P by the records this tree's `bench.predicted_records` issues there (the op fuses the
    backward gathers only for groups larger than one node or with the two-level all-to-all,
    `ops.common.fuse_bwd_gather`). Each: dict(label, bwd_gather, cp_ranks_per_node)."""
    out = []
    for L in args._ranks_per_node:
        for g in args._bwd_gathers:
            name = {"separate": "sep", "fused": "fused", "auto": "auto", "two-level": "2lvl"}[g]
            v = dict(label=f"{name}/L={L}", bwd_gather=g, cp_ranks_per_node=L)
            if v not in out:
                out.append(v)
    return out


_SOLO = [None]


def _solo_group():
    """This rank's one-rank process group (made in `main` by every rank), None when not distributed."""
    return _SOLO[0]


def label(res, r):
    """Method label of a row: splitkv rows carry their chunk count (k) when the tree pipelines, and "+ovl"
    when the layer overlaps the Q gather / dQ all-to-all with the k/v projections."""
    k = r.get("num_chunks", 1)
    var = f" [{r['variant']}]" if len(res.get("variants") or []) > 1 and r.get("variant") else ""
    if r["method"] == "splitkv" and (res.get("chunked_pipeline") or k != 1):
        return f"splitkv k={k}" + (" +ovl" if r.get("overlap_q_gather") else "") + var
    if r["method"] == "splitkv" and r.get("overlap_q_gather"):
        return "splitkv +ovl" + var
    return r["method"] + (var if r["method"] == "splitkv" else "")


def variant_labels(res):
    """The splitkv variants' labels in the run's order (the first is the reference); [None] for results
    without variants."""
    return [v["label"] for v in res.get("variants") or []] or [None]


def summarize(res):
    """Per topology and P: splitkv (first placement) at k = 1 and at its best k, each without and with the
    projection overlap, for the reference variant (the first of `res["variants"]`) and, in "variants", for
    every variant; allgather-kv; ring-kv; the headline variant (the fastest at the headline setting: best k,
    with the overlap unless --overlap-q-gather off) and its speedup over the faster baseline. Returns a
    list of dicts (one per topology and P); each cell is {T, exposed, efficiency, k, variant} or None."""
    rows = res["rows"]
    a = res["args"]
    first = a["placements"].split(",")[0].strip()
    head_ovl = a.get("overlap_q_gather", "on") == "on"
    head_key = "best_ovl" if head_ovl else "best"
    labels = variant_labels(res)

    def cell(r):
        return None if r is None else dict(T=r["total_ms"], exposed=r["exposed_comm_ms"], efficiency=r["efficiency"],
                                           k=r.get("num_chunks", 1), source=r["compute_source"],
                                           variant=r.get("variant"),
                                           efficiency_rounds=r.get("efficiency_rounds"))

    out = []
    for topo in res.get("topologies", ["flat"]):
        for P in sorted({r["P"] for r in rows}):
            sel = [r for r in rows if r["P"] == P and r.get("topology", "flat") == topo]
            sk = [r for r in sel if r["method"] == "splitkv" and r["placement"] in (first, "-")]

            def pick(ovl, k=None, var=None):
                c = [r for r in sk if bool(r.get("overlap_q_gather")) == ovl and (k is None or r["num_chunks"] == k)
                     and (var is None or r.get("variant") == var)]
                return min(c, key=lambda r: r["total_ms"]) if c else None

            per = {v: dict(k1=cell(pick(False, 1, v)), k1_ovl=cell(pick(True, 1, v)), best=cell(pick(False, None, v)),
                           best_ovl=cell(pick(True, None, v))) for v in labels}
            ref = per[labels[0]]
            ag = next((r for r in sel if r["method"] == "allgather-kv"), None)
            rg = next((r for r in sel if r["method"] == "ring-kv"), None)
            e = dict(topology=topo, P=P, allgather_kv=cell(ag), ring_kv=cell(rg), **ref)
            e["variants"] = per
            cands = [v for v in labels if per[v][head_key]]
            hv = min(cands, key=lambda v: per[v][head_key]["T"]) if cands else labels[0]
            head = per[hv][head_key]
            bases = [c["T"] for c in (e["allgather_kv"], e["ring_kv"]) if c]
            e["headline"] = head_key
            e["headline_variant"] = hv
            e["head"] = head
            e["speedup_vs_best_baseline"] = (min(bases) / head["T"]) if head and bases else None
            out.append(e)
    return out


def render_summary(res):
    """Markdown: one weak-scaling table per topology (cells: T ms (exposed comm ms) efficiency) for the
    reference splitkv variant, then, with several variants, one table per topology of every variant's
    headline cell and the best variant."""
    def fmt(c, with_k=False):
        if not c:
            return "-"
        rt = rounds_text(c.get("efficiency_rounds"))
        return ((f"k={c['k']}: " if with_k else "")
                + f"{c['T']:.1f} ({c['exposed']:.1f}) {100 * c['efficiency']:.0f}%" + (f", rounds {rt}" if rt else ""))

    parts = []
    summ = res.get("summary") or summarize(res)
    labels = variant_labels(res)
    multi = len(labels) > 1
    title = {"node": "Topology 'node' (NVLink inside a node, one NIC per GPU between nodes)",
             "flat": "Topology 'flat' (the first model: flat rings of P ranks, all hops inter-node beyond one node)"}
    for topo in res.get("topologies", ["flat"]):
        ents = [e for e in summ if e["topology"] == topo]
        if not ents:
            continue
        head = "best k + ovl" if ents[0]["headline"] == "best_ovl" else "best k"
        hdr = ["P", "splitkv k=1", "k=1 + ovl", "best k", "best k + ovl", "allgather-kv", "ring-kv",
               f"speedup ({head}) vs best baseline"]
        def sp(e, c):  # the faster baseline's T / the cell's T
            bases = [b["T"] for b in (e["allgather_kv"], e["ring_kv"]) if b]
            return f"{min(bases) / c['T']:.1f}x" if c and bases else "-"

        def ref_sp(e):
            return sp(e, e[e["headline"]])
        body = [[e["P"], fmt(e["k1"]), fmt(e["k1_ovl"]), fmt(e["best"], True), fmt(e["best_ovl"], True),
                 fmt(e["allgather_kv"]), fmt(e["ring_kv"]), ref_sp(e)] for e in ents]
        parts.append(f"{title.get(topo, topo)}{f', splitkv variant {labels[0]}' if multi else ''}; cells: T(P) ms "
                     f"(exposed communication ms) efficiency\n\n" + bench.md_table(hdr, body))
        if multi:
            key = ents[0]["headline"]
            hdr = (["P", f"{labels[0]}: k=1 + ovl" if key == "best_ovl" else f"{labels[0]}: k=1"]
                   + [f"{v}: {head}" for v in labels] + ["headline (best variant)", "speedup vs best baseline"])
            body = [[e["P"], fmt(e["variants"][labels[0]]["k1_ovl" if key == "best_ovl" else "k1"])]
                    + [fmt(e["variants"][v][key], True) for v in labels]
                    + [f"{e['headline_variant']} " + fmt(e["head"], True), sp(e, e["head"])] for e in ents]
            parts.append(f"{title.get(topo, topo)}, splitkv variants (sep / fused: backward dO and stats gathers "
                         f"separate / one fused gather; L: CP ranks per node of the two-level all-to-all, 1 = one "
                         f"all-to-all); cells: T(P) ms (exposed communication ms) efficiency\n\n"
                         + bench.md_table(hdr, body))
        paired = [e for e in ents if e["head"] and e["head"].get("efficiency_rounds")]
        if paired:  # --paired-rounds: the headline's efficiency per round
            n = len(paired[0]["head"]["efficiency_rounds"])
            body = [[e["P"], e["headline_variant"] or "-", e["head"]["k"], f"{100 * e['head']['efficiency']:.1f}%",
                     rounds_text(e["head"]["efficiency_rounds"]),
                     " ".join(f"{100 * x:.1f}" for x in e["head"]["efficiency_rounds"])] for e in paired]
            parts.append(f"{title.get(topo, topo)}, headline ({head}) efficiency over {n} paired rounds (T(P0)_i / "
                         f"T(P)_i, each side with round i's re-timed shards; the usual column = the shards' median over "
                         f"the rounds)\n\n" + bench.md_table(["P", "variant", "k", "efficiency", "rounds median [min-max]",
                                                             "per round %"], body))
    return "\n\n".join(parts)


def render(res):
    """Markdown: the summary tables, then the rows of the headline topology (splitkv at k = 1 and its
    best k, with and without the overlap; the baselines; other placements), plus a note on the model."""
    rows = res["rows"]
    topo = res.get("topologies", ["flat"])[0]
    summ = res.get("summary") or summarize(res)
    best_k = {(e["P"], ovl, v): e["variants"][v][key]["k"] for e in summ if e["topology"] == topo
              for v in variant_labels(res) for ovl, key in ((False, "best"), (True, "best_ovl"))
              if e["variants"][v][key]}
    first = res["args"]["placements"].split(",")[0].strip()
    hdr = ["P", "method", "placement", "context", "compute ms", "comm ms (exposed)", "overhead ms", "T(P) ms",
           "efficiency", "bytes/rank", "source"]
    has_bench = any("bench_measured_ms" in r for r in rows)
    if has_bench:
        hdr.append("measured op ms")
    out = []
    for r in rows:
        if r.get("topology", "flat") != topo:
            continue
        if r["method"] == "splitkv" and r["placement"] in (first, "-") and r["num_chunks"] not in (
                1, best_k.get((r["P"], bool(r.get("overlap_q_gather")), r.get("variant")))):
            continue
        line = [r["P"], label(res, r), r["placement"], r["context"], f"{r['compute_ms']:.2f}",
                f"{r['comm_ms']:.2f} ({r['exposed_comm_ms']:.2f})", f"{r['overhead_ms']:.2f}",
                f"{r['total_ms']:.2f}", f"{100 * r['efficiency']:.0f}%" + (
                    f" (rounds {rounds_text(r['efficiency_rounds'])})" if r.get("efficiency_rounds") else ""),
                bench.fmt_bytes(r["bytes_per_rank"]),
                r["compute_source"]]
        if has_bench:
            line.append(bench.finite(r.get("bench_measured_ms")))
        out.append(line)
    a = res["args"]
    ln = res["link"]
    kp = res.get("kv_projection", {})
    note = (f"Weak scaling, one attention layer fwd+bwd: {a['ctx_per_rank']} context tokens per rank, "
            f"Lq = {a['anchors']} x {a['B']}, Hq {a['Hq']}, Hkv {a['Hkv']}, D {a['D']}, bf16. Link (NVLink): "
            f"{res['link_source']}; inter-node {a['inter_bw_gbs']} GB/s per GPU, {a['inter_alpha_us']} us per hop; "
            f"{a['gpus_per_node']} GPUs per node. Topology 'node' (bench.LinkModel): ring all-gather / "
            f"reduce-scatter a0 + (P-N) h + (N-1) h_net + (P-1) n / min(B_nvl, L B_nic), N nodes of L ranks, "
            f"h = {ln.get('intra_hop_us', 0):.1f} us per NVLink hop, a0 = the P=2 latency - h; all-to-all "
            f"a0 + h_path + (P-2) x {ln.get('a2a_peer_us', 0):.1f} us + max(on-node bytes / B_nvl, off-node "
            f"bytes / B_nic){' (PXN relay on NVLink)' if ln.get('pxn') else ''}. Topology 'flat': every collective "
            f"a ring of P ranks, (P-1) alpha + (P-1) n / bw, inter-node figures for every hop beyond one node. "
            f"Overhead: {res['overhead_source']}. Modelled shards' kernel rate: "
            f"{'; '.join(f'{m} {v}' for m, v in res.get('model_kernel_rate', {}).items()) or 'stated'}. "
            f"Efficiency = T(P0)/T(P) per method and topology, P0 = "
            f"{min(r['P'] for r in rows) if rows else 1} (the fastest variant at P0). Overlap as coded: splitkv "
            f"k>1 pipelines its k query chunks (Q/dO gathers one chunk ahead, each chunk's [O | lse] and dQ "
            f"all-to-alls behind the next chunk's kernel; the first gathers and the last all-to-alls exposed; "
            f"two-stream schedule in the code's issue order); kernel time lost per extra chunk: "
            f"{100 * res.get('chunk_loss', 0):.1f}% where modelled. '+ovl': the layer starts the Q all-gather "
            f"before its k/v projections and runs their backward while the last dQ all-to-all is in flight "
            f"(projection hidden {a['hidden']} -> {2 * a['Hkv'] * a['D']}, {kp.get('source', '')}). allgather-kv "
            f"none; ring-kv: next shard overlaps the current step. Not modelled: NCCL kernels slowing the "
            f"attention kernel (SM sharing), NCCL's tree/NVLS algorithms, network congestion.")
    return render_summary(res) + "\n\n" + bench.md_table(hdr, out) + "\n\n" + note


def plot(res, path):
    """PNG: weak-scaling efficiency and T(P) vs P (matplotlib, Agg): splitkv at k = 1 and at its best k
    with the projection overlap, allgather-kv, ring-kv under the headline topology (solid), every other
    splitkv variant's best k + ovl (dash-dot); splitkv k = 1 under the other topology (dashed) when it was
    computed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = res.get("summary") or summarize(res)
    topos = res.get("topologies", ["flat"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series = [(topos[0], "k1", "splitkv k=1", "-"), (topos[0], "best_ovl", "splitkv best k + ovl", "-"),
              (topos[0], "allgather_kv", "allgather-kv", "-"), (topos[0], "ring_kv", "ring-kv", "-")]
    labels = variant_labels(res)
    if len(labels) > 1:  # every other variant's best k + ovl, and the reference's label on its own lines
        series = [(t, k, f"{lab} [{labels[0]}]", ls) if k in ("k1", "best_ovl") else (t, k, lab, ls)
                  for t, k, lab, ls in series]
        series[2:2] = [(topos[0], ("variants", v, "best_ovl"), f"splitkv best k + ovl [{v}]", "-.") for v in labels[1:]]
    for t in topos[1:]:
        series += [(t, "k1", f"splitkv k=1 ({t})", "--"), (t, "allgather_kv", f"allgather-kv ({t})", "--")]

    def get(e, key):
        return e.get(key) if isinstance(key, str) else e.get(key[0], {}).get(key[1], {}).get(key[2])

    for topo, key, lab, ls in series:
        pts = [(e["P"], get(e, key)) for e in summ if e["topology"] == topo and get(e, key)]
        if not pts:
            continue
        xs = [p for p, _ in pts]
        axes[0].plot(xs, [100 * c["efficiency"] for _, c in pts], marker="o", ls=ls, label=lab)
        axes[1].plot(xs, [c["T"] for _, c in pts], marker="o", ls=ls, label=lab)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("CP size P (context per rank fixed)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("weak-scaling efficiency T(1)/T(P) [%]")
    axes[0].set_ylim(0, 110)
    axes[0].axhline(90, color="gray", lw=0.8, ls=":")
    axes[1].set_ylabel("attention layer fwd+bwd [ms]")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    a = res["args"]
    fig.suptitle(f"Simulated weak scaling: {a['ctx_per_rank'] // 1024}K ctx/rank, Lq {a['anchors']}x{a['B']}; "
                 f"{a['gpus_per_node']} GPUs/node, inter-node {a['inter_bw_gbs']} GB/s per GPU "
                 f"(solid: {topos[0]} topology)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
