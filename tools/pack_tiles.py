#!/usr/bin/env python3
"""Tile and byte accounting of Split-KV's local fa4 kernel calls on real packs, on the CPU (issue 22 item 3).

For the packs `tools/bench_attention.py --packs` times (the first batch of our ShareGPT loader at that many
tokens, the query budget of --anchors anchors shared by its conversations, LPT placement; or one sequence),
at each CP size, every CP rank's per-step metadata is built on the host (`ops.prepare_splitkv_metadata_from_plan`,
the op's default chunk count) and, from the very `IntervalMask`s the kernel gets (`chunk_masks_own`: context +
own block), the tables the fa4 kernel builds (`kernels.flex._block_tables` at FA4's lengths, 128 x 128 tiles):

  - useful pairs: visible (query row, key) pairs, context + own block (per query head);
  - tile pairs: the pairs of the listed (query tile, key tile) tiles, partial + full (per query head); the
    backward's tables are the same classification transposed (tests/test_fa4_kernel.py), so the same pairs;
  - waste: 1 - useful / tile pairs;
  - backward CTAs: FA4's backward runs one CTA per (key tile, query head) (GQA: `qhead_per_kvhead > 1`, its
    backward has no packed GQA), each looping over the query tiles its table lists; "q tiles / CTA" is that
    loop's mean length, "empty" the key tiles no query tile lists (a CTA with no math);
  - GQA fold (kernels/fa4.py `FA4AttentionKernel(fold_gqa=True)`): the same call with the G = Hq / Hkv query
    heads of a kv head folded into the query rows (block b -> G sub-blocks, one per head), so FA4 sees Hkv
    heads: "fold tile pairs" are its tile pairs per query head (a 128-row tile holds 2 blocks x G heads
    instead of 8 blocks), its backward runs nk x Hkv CTAs and writes dK / dV straight in the input dtype;
  - bytes moved per call that scale with the rank's KEYS (not with the query budget), from reading the code:
    the gathering copy of K and V into [context ; padding ; own keys] (`ops.common.with_own_keys`, forward),
    and FA4's GQA backward dK / dV path (`flash_attn.cute.interface._flash_attn_bwd`: fp32 accumulators
    [Hkv, Tk_rounded * D] zero-filled, one fp32 reduce-add of a 128 x D dK and dV tile per CTA, a postprocess
    that reads them and writes dK / dV in bf16) against the fold's zero-fill and direct write of dK / dV;
  - whether the gathered query blocks are in (sequence, anchor) order and the local keys already sorted (the
    metadata then keeps `order` None: no gather, only the copy above);
  - host (CPU) time of the metadata build and of the kernel tables, unfolded and folded, at these shapes (the
    fastest of --reps after a warm-up; on a shared machine the others measure the neighbours).

Output: a markdown table (stdout, and --out FILE.md with a JSON twin). No GPU, no process group.

    python tools/pack_tiles.py --packs 16384,32768,65536,131072 --cp 1,2,4,8 --out docs/lab/packs_accounting_table.md
    python tools/pack_tiles.py --packs 2048 --cp 1,2 --pack-limit 200 --reps 1      # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import benchlib as bench  # noqa: E402
from tools.bench_attention import pack_workload  # noqa: E402 - the benchmark's own packs (the same batches)
from megatron_splitkv._ints import int_arg  # noqa: E402
from megatron_splitkv.data.sharegpt import load_sharegpt  # noqa: E402
from megatron_splitkv.kernels.fa4 import fold_gqa_mask  # noqa: E402
from megatron_splitkv.kernels.flex import TILE, _block_tables, _rows_table  # noqa: E402
from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan  # noqa: E402

#: bytes per element: bf16 inputs, fp32 accumulators
_IN, _F32 = 2, 4


def fa4_tables(mask):
    """(rows, the 8 tables) FA4's `_Tables` builds for `mask` (kernels/fa4.py, no host-built tables)."""
    q_len, kv_len = mask.num_blocks * mask.block_size, mask.num_keys
    nq, nk = -(-max(q_len, 1) // TILE), -(-max(kv_len, 1) // TILE)
    rows = _rows_table(mask, nq * TILE)
    return rows, _block_tables(rows, nq * TILE, nk * TILE, TILE, rows_per_block=mask.block_size, q_tables=True)


def call_stats(mask, Hq: int, Hkv: int, D: int) -> dict:
    """Tile and byte accounting of one fa4 call over `mask` (an own-block IntervalMask of the op)."""
    G = Hq // Hkv
    _, t = fa4_tables(mask)
    kv_num, _, full_num, _, q_num, _, full_q_num, _ = t
    part, full = int(kv_num.sum()), int(full_num.sum())
    per_key_tile = (q_num + full_q_num)[0, 0]
    nk = int(per_key_tile.shape[0])
    useful = mask.block_size * int((mask.hi - mask.lo).sum())
    if mask.has_union:
        useful += mask.block_size * int((mask.hi2 - mask.lo2).sum())
    _, tf = fa4_tables(fold_gqa_mask(mask, G))
    fold_part, fold_full = int(tf[0].sum()), int(tf[2].sum())  # tiles of Hkv heads (G x the rows of a head's)
    fold_tiles = fold_part + fold_full
    tk, tq = mask.num_keys, mask.num_blocks * mask.block_size
    tk_r = nk * TILE
    kv_copy = 2 * (2 * tk) * Hkv * D * _IN  # K and V: read the context (and own keys), write the new tensor
    ctas = nk * Hq
    gqa_dkv = (2 * Hkv * tk_r * D * _F32  # zero-fill of the two fp32 accumulators
               + ctas * 2 * TILE * D * _F32 * 2  # reduce-add of a dK and a dV tile per CTA (read + write)
               + 2 * Hkv * tk_r * D * _F32 + 2 * tk * Hkv * D * _IN)  # postprocess: read fp32, write bf16
    fold_dkv = 2 * 2 * tk * Hkv * D * _IN  # zero-filled (kernels/fa4.py), then written once by the tile's CTA
    fold_copies = 3 * tq * Hq * D * _IN * 2  # q, dO into the folded layout, dQ back (read + write each)
    return dict(useful=useful, tiles=part + full, partial=part, full=full, tile_pairs=(part + full) * TILE * TILE,
                fold_tile_pairs=fold_tiles * TILE * TILE / G, fold_partial=fold_part, fold_full=fold_full,
                nk=nk, nq=int(kv_num.shape[-1]), empty=int((per_key_tile == 0).sum()),
                ctas=ctas, fold_ctas=nk * Hkv, q_tiles_per_cta=float(per_key_tile.float().mean()),
                kv_copy_bytes=kv_copy, gqa_dkv_bytes=gqa_dkv, fold_dkv_bytes=fold_dkv + fold_copies, keys=tk, rows=tq)


def _min_ms(fn, reps: int) -> float:
    """Fastest host ms of `reps` calls of fn, after one warm-up call (the minimum: the machine is shared, so
    the other samples measure the neighbours)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(min(ts))


def shape_rows(kind, tokens, cps, args, corpus, shapes) -> list:
    """One row per CP size: the slowest rank's calls (most tile pairs), summed over its chunk calls."""
    B, Hq, Hkv, D = shapes
    lens, anchors = pack_workload(kind, tokens, args.anchors, seed=args.seed, limit=args.pack_limit, corpus=corpus)
    rows = []
    for P in cps:
        plan = bench.place(lens, anchors, cp_size=P, strategy="lpt", block_size=B)
        q_sorted = bool(np.all(np.diff(plan.q_seq[plan.q_anchor >= 0]) >= 0))
        worst = None
        for r in range(P):
            def build(r=r):
                return prepare_splitkv_metadata_from_plan(plan, r, block_size=B, num_heads_q=Hq, num_heads_kv=Hkv,
                                                          head_dim=D, dtype=torch.bfloat16)
            meta = build()
            calls = [call_stats(m, Hq, Hkv, D) for m in meta.chunk_masks_own]
            tot = {k: sum(c[k] for c in calls) for k in calls[0] if k != "q_tiles_per_cta"}
            tot["q_tiles_per_cta"] = float(np.mean([c["q_tiles_per_cta"] for c in calls]))
            tot.update(rank=r, calls=len(calls), keys_sorted=meta.order is None)
            if worst is None or tot["tile_pairs"] > worst["tile_pairs"]:
                worst = tot
                worst["meta_ms"] = _min_ms(build, args.reps)
                worst["tables_ms"] = _min_ms(lambda m=meta: [fa4_tables(x) for x in m.chunk_masks_own], args.reps)
                worst["fold_tables_ms"] = _min_ms(lambda m=meta: [fa4_tables(fold_gqa_mask(x, Hq // Hkv))
                                                                  for x in m.chunk_masks_own], args.reps)
        rows.append(dict(worst, kind=kind, tokens=tokens, cp=P, n_seqs=int(len(lens)), blocks_seq_sorted=q_sorted,
                         waste=1 - worst["useful"] / max(worst["tile_pairs"], 1),
                         fold_waste=1 - worst["useful"] / max(worst["fold_tile_pairs"], 1)))
    return rows


def table(rows) -> str:
    hdr = ["pack", "seqs", "CP", "keys / rank", "calls", "sorted: blocks, keys", "useful M pairs",
           "tile M pairs (partial / full tiles)", "waste", "fold: tile M pairs (partial / full), waste",
           "bwd CTAs (empty key tiles)", "q tiles / CTA", "fold: bwd CTAs", "K/V copy MB", "GQA dK/dV MB -> fold MB",
           "meta ms", "tables ms (fold)"]
    out = []
    for r in rows:
        out.append([f"{r['kind']} {r['tokens'] // 1024}K", r["n_seqs"], r["cp"], r["keys"], r["calls"],
                    f"{'yes' if r['blocks_seq_sorted'] else 'no'}, {'yes' if r['keys_sorted'] else 'no'}",
                    f"{r['useful'] / 1e6:.1f}", f"{r['tile_pairs'] / 1e6:.1f} ({r['partial']} / {r['full']})",
                    f"{100 * r['waste']:.0f}%",
                    f"{r['fold_tile_pairs'] / 1e6:.1f} ({r['fold_partial']} / {r['fold_full']}), "
                    f"{100 * r['fold_waste']:.0f}%",
                    f"{r['ctas']} ({r['empty']})", f"{r['q_tiles_per_cta']:.2f}", r["fold_ctas"],
                    f"{r['kv_copy_bytes'] / 1e6:.0f}",
                    f"{r['gqa_dkv_bytes'] / 1e6:.0f} -> {r['fold_dkv_bytes'] / 1e6:.0f}",
                    f"{r['meta_ms']:.1f}", f"{r['tables_ms']:.1f} ({r['fold_tables_ms']:.1f})"])
    return bench.md_table(hdr, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packs", default="16384,32768,65536,131072", help="tokens per pack, comma list")
    ap.add_argument("--kinds", default="sharegpt,one", help="pack kinds: sharegpt and/or one")
    ap.add_argument("--cp", default="1,2,4,8", help="CP sizes, comma list")
    ap.add_argument("--anchors", type=int_arg(1), default=512, help="query budget per pack (anchors)")
    ap.add_argument("--pack-limit", type=int_arg(1), default=None, help="pack from the first N conversations only")
    ap.add_argument("--reps", type=int_arg(1), default=3, help="repeats of the host timings (the fastest is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the table to this .md file (and a .json beside it)")
    args = ap.parse_args(argv)
    packs = bench.int_list_arg(ap, "--packs", args.packs, 64)
    cps = bench.int_list_arg(ap, "--cp", args.cp, 1)
    kinds = bench.choices_arg(ap, "--kinds", args.kinds, ("sharegpt", "one"), "pack kind")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host timings on one thread: stable on a shared machine, and a worker's setting
    try:
        return _run(args, packs, cps, kinds)
    finally:
        torch.set_num_threads(threads)


def _run(args, packs, cps, kinds) -> int:
    shapes = (16, 32, 8, 128)  # B, Hq, Hkv, D: the drafter shapes of the benchmark
    corpus = load_sharegpt(args.pack_limit) if "sharegpt" in kinds else None
    rows = []
    for tokens in packs:
        for kind in kinds:
            rows += shape_rows(kind, tokens, cps, args, corpus, shapes)
            print(json.dumps({k: rows[-1][k] for k in ("kind", "tokens", "cp", "waste", "fold_waste")}), flush=True)
    md = table(rows)
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(md + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(dict(argv=sys.argv, rows=rows), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
