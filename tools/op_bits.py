"""Bit-identity of the CP attention ops across two source trees (docs/lab/perf-notes.md item 15): saves the raw
outputs and gradients (every rank, exact bytes) of ~460 configurations, then compares two saved files.

Configurations (4 gloo ranks, CPU): splitkv at P = 1, 2, 4 x bf16 / fp32 / fp64 x backends math / flex (CPU
emulation) / staircase (options scaled down so it makes dense calls) x num_chunks 1-3 x with / without own
blocks x loss on out only / lse only / both; without metadata=, with query_gather=, a poisoned case
(NaN / inf where no query looks), the two-level all-to-all (L = 2 at P = 4, with its fused backward gather);
the baselines allgather-kv and ring-kv. Run it once per tree (PYTHONPATH selects the tree), then compare:

    PYTHONPATH=/tmp/before python tools/op_bits.py --tree /tmp/before --out /tmp/bits_before.pt
    PYTHONPATH=. python tools/op_bits.py --tree . --out /tmp/bits_after.pt
    python tools/op_bits.py --compare /tmp/bits_before.pt /tmp/bits_after.pt     # exit 1 on any difference

With TRITON_INTERPRET=1 the Triton merge runs in Triton's CPU interpreter (slower: ~1.5 min). The options
(staircase scaled down) are `SplitKVConfig` fields; a tree from before the
config reads them from MEGATRON_SPLITKV_* variables: run that tree's own op_bits on it. Not a test: a before / after check of
a refactoring (tests/test_host_identity.py keeps the permanent checks).
"""
import argparse
import os
import sys

import torch

#: staircase options scaled down to these shapes (B 4, ~30-60 keys per rank) so that it makes dense calls
STAIR = dict(group_blocks=4, sub_group_blocks=2, min_group_blocks=1, key_grain=4, min_keys=4, min_pairs=16,
             max_tile_keys=16)


def configs() -> list:
    """The configurations, each a dict (its sorted items name it in the saved file)."""
    out = []

    def add(**kw):
        out.append(dict(dict(op="splitkv", dtype="bfloat16", k=2, own=True, loss="both", meta=True), **kw))

    for P in (1, 2, 4):
        for dt in ("bfloat16", "float32", "float64"):
            for backend in ("math", "flex", "staircase"):
                for k in (1, 2, 3):
                    for own in (True, False):
                        for loss in ("both", "out", "lse"):
                            if backend == "math" or loss == "both" or k < 3:
                                add(P=P, dtype=dt, backend=backend, k=k, own=own, loss=loss, seed=1000 + P * 7 + k)
        add(P=P, backend="flex", meta=False, seed=5)
        add(P=P, backend="flex", qg=True, seed=6)
        add(P=P, backend="math", qg=True, seed=6)
        add(P=P, backend="flex", poison=True, seed=8)
        for op in ("allgather_kv", "ring_kv"):
            for dt in ("bfloat16", "float64"):
                for backend in ("math", "flex"):
                    add(op=op, P=P, dtype=dt, backend=backend, k=1, seed=9)
    for k in (1, 2):
        for backend in ("math", "flex"):
            add(P=4, backend=backend, k=k, L=2, seed=11)
            add(P=4, backend=backend, k=k, L=2, qg=True, seed=13)
    return out


def worker(rank, world, cfgs):
    """run_distributed target: every configuration with P <= world on ranks 0..P-1; {index: results}."""
    import torch.distributed as dist

    import megatron_splitkv as msk
    from _splitkv_helpers import build, case, local

    base = msk.SplitKVConfig(staircase=msk.StaircaseOptions(**STAIR))
    groups = {P: dist.new_group(list(range(P))) for P in (1, 2)}
    ops = {"splitkv": msk.splitkv_attention, "allgather_kv": msk.allgather_kv_attention,
           "ring_kv": msk.ring_kv_attention}
    res = {}
    for i, cf in enumerate(cfgs):
        P = cf["P"]
        if rank >= P:
            continue
        g = groups.get(P)
        c = case(cf["seed"], P, dtype=cf["dtype"], B=4, Hq=4, Hkv=2, D=16, seq_lens=[40, 23, 61],
                 blocks=[5, 3, 6, 4][:P] if P > 1 else [7], poison=cf.get("poison", False))
        t = build(c)
        x, meta, dout, dlse = local(t, c, rank)
        kb, vb = (x["k_blk"], x["v_blk"]) if cf["own"] else (None, None)
        config = base
        kw = dict(num_chunks=cf["k"], cp_ranks_per_node=cf.get("L")) if cf["op"] == "splitkv" else {}
        md = None
        if cf["meta"]:
            md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                              block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=16,
                                              dtype=x["q"].dtype, cp_group=g, impl=cf["op"], config=config, **kw)
        fn = ops[cf["op"]]
        if md is not None:
            extra = {"query_gather": msk.splitkv_start_query_gather(x["q"], metadata=md)} if cf.get("qg") else {}
            out, lse = fn(x["q"], x["k_ctx"], x["v_ctx"], kb, vb, metadata=md, backend=cf["backend"],
                          return_lse=True, **extra)
        else:
            out, lse = fn(x["q"], x["k_ctx"], x["v_ctx"], kb, vb, meta["q_seq"], meta["q_anchor"], meta["kv_seq"],
                          meta["kv_pos"], block_size=4, cp_group=g, backend=cf["backend"], return_lse=True,
                          config=config, **kw)
        d = dout.to(out.dtype)
        lse_f = lse.masked_fill(~torch.isfinite(lse), 0.0)
        if cf["loss"] == "both":
            ((out.float() * d.float()).sum() + (lse_f.float() * dlse.float()).sum()).backward()
        elif cf["loss"] == "out":
            out.backward(d)
        else:
            (lse_f * dlse.to(lse.dtype)).sum().backward()
        r = {"out": out.detach(), "lse": lse.detach()}
        for n in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk"):
            r["d" + n] = None if x[n].grad is None else x[n].grad.detach()
        res[i] = r
    return res


def key(cf):
    return ",".join(f"{k}={v}" for k, v in sorted(cf.items()))


def same_bytes(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def compare(path_a, path_b) -> int:
    """Print every differing tensor of the configurations both files hold, and every configuration only one
    holds (a mode deleted between the trees: listed, not compared); 0 when all compared bytes are equal, else 1."""
    a, b = torch.load(path_a), torch.load(path_b)
    for name, only in (("A", a.keys() - b.keys()), ("B", b.keys() - a.keys())):
        for kk in sorted(only):
            print(f"only in {name} (not compared):", kk)
    bad = 0
    common = [kk for kk in a if kk in b]
    if not common:
        print("no configuration in common")
        return 1
    for kk in common:
        for r, (ra, rb) in enumerate(zip(a[kk], b[kk])):
            for n in ra:
                ta, tb = ra[n], rb[n]
                if ta is None or tb is None:
                    if (ta is None) != (tb is None):
                        print("None vs tensor:", kk, "rank", r, n)
                        bad += 1
                    continue
                if not same_bytes(ta, tb):
                    err = (ta.double() - tb.double()).abs().max().item() if ta.shape == tb.shape else "shape"
                    print("DIFF", kk, "rank", r, n, ta.dtype, tb.dtype, err)
                    bad += 1
    print(f"{len(common)} configs compared, {bad} differences")
    return 1 if bad else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", help="source tree whose tests/ helpers build the inputs (the tree under test)")
    ap.add_argument("--out", help="save the results here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved files")
    a = ap.parse_args(argv)
    # checked here, not with megatron_splitkv._ints' argparse types: this tool also runs against older trees
    for flag, path in [("--tree", a.tree)] + [("--compare", p) for p in a.compare or ()]:
        if path is not None and not os.path.exists(path):
            ap.error(f"{flag}: no such file or directory: {path!r}")
    if a.compare:
        return compare(*a.compare)
    if not (a.tree and a.out):
        ap.error("give --tree and --out (save), or --compare A B")
    sys.path.insert(0, os.path.join(os.path.abspath(a.tree), "tests"))
    from _dist import run_distributed

    cfgs = configs()
    results = run_distributed(worker, 4, cfgs, timeout=1800)
    out = {}
    for i, cf in enumerate(cfgs):
        out[key(cf)] = [results[r][i] for r in range(cf["P"])]
    torch.save(out, a.out)
    print(len(out), "configs saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
