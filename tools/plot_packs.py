#!/usr/bin/env python
"""% of dense per pack shape, ours vs Turbo-dLLM vs the FlexAttention peer, from bench_attention's --packs JSON.

    python tools/plot_packs.py out/bench/bench_attention_packs_cp1.json --out docs/img/packs_pct_dense.png

One grouped bar chart (matplotlib, Agg): x = pack shape ("sharegpt 16K (12 seqs)", "one 16K", ...), one bar per
method (splitkv, turbo, flex) at the chosen CP (`--cp`, default 1), height = `pct_dense` (forward + backward
useful TF/s as % of dense SDPA at the same useful FLOPs, same process). Rows without a measurement (errors,
skipped) are left out. A file that is missing, not JSON or has no measured pack row at that CP is an error
(exit status 2, nothing written).
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"splitkv": "ours (Split-KV)", "turbo": "Turbo-dLLM 0.1.6", "flex": "FlexAttention mask_mod"}


def pack_bars(rows, cp: int = 1):
    """(shapes, {method: [pct_dense or None per shape]}) of the measured pack rows at `cp`, in row order."""
    shapes, vals = [], {}
    for r in rows:
        if r.get("cp") != cp or "pct_dense" not in r:
            continue
        shape = f"{r['kind']} {r['tokens'] // 1024}K ({r['n_seqs']} seq{'s' if r['n_seqs'] > 1 else ''})"
        if shape not in shapes:
            shapes.append(shape)
        vals.setdefault(r["method"], {})[shape] = r["pct_dense"]
    return shapes, {m: [v.get(s) for s in shapes] for m, v in vals.items()}


def plot(shapes, bars, path: str, title: str = "") -> None:
    """Write the grouped bar chart of `pack_bars` output to `path` (PNG)."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(shapes) + 2), 4.0))
    w = 0.8 / max(len(bars), 1)
    for i, (m, ys) in enumerate(bars.items()):
        xs = [j + (i - (len(bars) - 1) / 2) * w for j in range(len(shapes))]
        ax.bar([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], w,
               label=LABELS.get(m, m))
    ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("% of dense SDPA (useful FLOPs, fwd + bwd)")
    ax.axhline(100, color="grey", lw=0.5)
    ax.set_title(title or "DFlash attention on packs, % of dense")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="bench_attention.py JSON with pack_rows (--packs)")
    ap.add_argument("--out", required=True, help="PNG path")
    ap.add_argument("--cp", type=int, default=1, help="CP size of the rows to plot (default 1)")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    try:
        with open(args.json) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        ap.error(f"json: cannot read {args.json}: {e}")
    shapes, bars = pack_bars(data.get("pack_rows", []) if isinstance(data, dict) else [], args.cp)
    if not shapes:
        ap.error(f"json: {args.json} has no measured pack row (pct_dense) at --cp {args.cp}")
    plot(shapes, bars, args.out, args.title)
    print(f"[plot] {len(shapes)} pack shapes, methods {', '.join(bars)} -> {args.out}")


if __name__ == "__main__":
    main()
