"""Split-KV attention at CP=2 over gloo on CPU vs the two baselines.

Spawns `--cp` processes (default 2), runs `splitkv_attention`, `allgather_kv_attention` and
`ring_kv_attention` forward + backward on the same sharded DFlash problem (packed sequences, shuffled
context, GQA, some invalid blocks), then prints for each op the relative max error of the output and of
all five gradients vs the single-process float64 reference, and the bytes each collective moved per rank
(convention: `megatron_splitkv.comm`). It repeats at a 4x longer context with the same query budget:
Split-KV's bytes stay put, the baselines' grow. Source: arXiv 2611.05926, DESIGN.md section 2.

Usage: .venv/bin/python examples/op_demo.py [--cp 2] [--ctx 1024] [--blocks 8] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository: its package, tools

from megatron_splitkv import allgather_kv_attention, comm_stats, ring_kv_attention, splitkv_attention  # noqa: E402
from megatron_splitkv.reference import dflash_attention_reference  # noqa: E402
from tools.launch import run_gloo  # noqa: E402

OPS = {"splitkv": splitkv_attention, "allgather_kv": allgather_kv_attention, "ring_kv": ring_kv_attention}
FLOATS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")


def make_problem(seed, cp, ctx, blocks_per_rank, B=16, Hq=4, Hkv=2, D=32, dtype=torch.float32):
    """Global inputs: two packed sequences of `ctx` tokens each, blocks_per_rank * cp query blocks."""
    g = torch.Generator().manual_seed(seed)
    lens = [ctx, ctx]
    kv_seq = torch.cat([torch.full((n,), j) for j, n in enumerate(lens)])
    kv_pos = torch.cat([torch.arange(n) for n in lens])
    nb, tk = blocks_per_rank * cp, sum(lens)
    q_seq = torch.randint(0, 2, (nb,), generator=g)
    anchor = torch.randint(0, ctx, (nb,), generator=g)
    anchor[torch.rand(nb, generator=g) < 0.1] = -1
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    t = dict(q=r(nb * B, Hq, D), k_ctx=r(tk, Hkv, D), v_ctx=r(tk, Hkv, D), k_blk=r(nb * B, Hkv, D),
             v_blk=r(nb * B, Hkv, D), q_seq=q_seq, q_anchor=anchor, kv_seq=kv_seq, kv_pos=kv_pos,
             dout=r(nb * B, Hq, D), B=B)
    t["ctx_idx"] = list(torch.randperm(tk, generator=g).chunk(cp))  # planner-like: any tokens, any order
    return t


def _rank_main(rank, cp, problems):
    """One CP rank (a `launch.run_gloo` worker, gloo group initialised): every op on every problem."""
    torch.set_num_threads(1)
    res = []
    for t in problems:
        B, nbl = t["B"], t["q_seq"].shape[0] // cp
        rows = slice(rank * nbl * B, (rank + 1) * nbl * B)
        idx = t["ctx_idx"][rank]
        loc = dict(q=t["q"][rows], k_ctx=t["k_ctx"][idx], v_ctx=t["v_ctx"][idx], k_blk=t["k_blk"][rows],
                   v_blk=t["v_blk"][rows])
        row = {}
        for name, fn in OPS.items():
            x = {k: v.clone().requires_grad_(True) for k, v in loc.items()}
            with comm_stats() as st:
                out = fn(*x.values(), t["q_seq"][rank * nbl:(rank + 1) * nbl],
                         t["q_anchor"][rank * nbl:(rank + 1) * nbl], t["kv_seq"][idx], t["kv_pos"][idx],
                         block_size=B, backend="math")
                out.backward(t["dout"][rows])
            row[name] = dict(out=out.detach(), grads={k: v.grad for k, v in x.items()},
                             bytes=st.bytes_by_collective, total=st.total_bytes)
        res.append(row)
    return res


class DemoRankError(RuntimeError):
    """A demo rank failed (its traceback or exit code in the message; `launch.run_gloo`)."""


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main(argv=None):
    from megatron_splitkv._ints import int_arg  # strict decimal numbers within their limits

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int_arg(1), default=2)
    ap.add_argument("--ctx", type=int_arg(2), default=1024, help="tokens per sequence (2 packed sequences)")
    ap.add_argument("--blocks", type=int_arg(1), default=8, help="query blocks of 16 per rank")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    ap.add_argument("--seed", type=int_arg(0), default=0)
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    problems = [make_problem(a.seed, a.cp, c, a.blocks, dtype=dtype) for c in (a.ctx, 4 * a.ctx)]
    # a rank that raises or dies ends the demo at once with its traceback / exit code (the others are killed;
    # they would wait in a collective forever): `launch.run_gloo`
    try:
        per_rank = run_gloo(_rank_main, a.cp, problems, timeout=600, error=DemoRankError)
    except DemoRankError as exc:
        print(f"op_demo: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"DFlash attention, CP={a.cp} (gloo, CPU), {a.dtype}, Lq={problems[0]['q'].shape[0]} query rows, "
          f"Hq=4 Hkv=2 D=32 B=16; errors are relative max errors vs the float64 single-process reference")
    for i, t in enumerate(problems):
        x = {k: t[k].double().clone().requires_grad_(True) for k in FLOATS}
        ref, _ = dflash_attention_reference(*x.values(), t["q_seq"], t["q_anchor"], t["kv_seq"], t["kv_pos"],
                                            block_size=t["B"])
        ref.backward(t["dout"].double())
        print(f"\ncontext Lk = {t['k_ctx'].shape[0]} tokens ({t['k_ctx'].shape[0] // a.cp} per rank)")
        for name in OPS:
            out = torch.cat([per_rank[r][i][name]["out"] for r in range(a.cp)])
            errs = {"out": _rel(out, ref)}
            for k in FLOATS:
                parts = [per_rank[r][i][name]["grads"][k] for r in range(a.cp)]
                if k == "k_ctx" or k == "v_ctx":
                    full = torch.zeros_like(x[k].grad)
                    for r in range(a.cp):
                        full[t["ctx_idx"][r]] = parts[r].double()
                else:
                    full = torch.cat(parts)
                errs["d" + k] = _rel(full, x[k].grad)
            b = per_rank[0][i][name]
            kinds = ", ".join(f"{k} {v / 1e6:.3f} MB" if v >= 5e3 else f"{k} {int(v)} B"  # small: metadata
                              for k, v in sorted(b["bytes"].items()))
            print(f"  {name:13s} err " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
            print(f"  {'':13s} rank 0 moved {b['total'] / 1e6:.3f} MB: {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
