#!/usr/bin/env python
"""Loss curves of Megatron training logs (examples/pretrain_dflash.py): a markdown table and a PNG.

    python tools/plot_loss.py --cp2 out/pretrain_cp2.log --cp1 out/pretrain_cp1.log --out out/loss_curves
    python tools/plot_loss.py --cp2 run1.log --out /tmp/curves        # one run is enough

Parses Megatron's per-iteration log lines
    `[date] iteration N/ M | ... | lm loss: X | planner-imbalance: Y | tokens-per-sec: Z | ...`
(other lines, interleaved output of other ranks and a truncated last line are ignored) and writes
`<out>.md` (columns: iteration, loss CP=2, loss CP=1, tokens/s CP=2, tokens/s CP=1, planner imbalance
CP=2; a summary first) and `<out>.png` (both loss curves; matplotlib when importable, otherwise a plain
PNG drawn with the standard library, so that it also works on a machine without matplotlib). The
table is printed last on stdout. A log that is missing, unreadable or holds no iteration line with a
loss is an error (exit status 2, nothing written). CPU only; standard library (+ matplotlib when present).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import struct
import zlib

_ITER = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)")
_FIELD = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 _()\-/]*?)\s*:\s*([-+0-9.eEinfa]+)\s*$")


def parse_log(text: str) -> dict:
    """{iteration: {field: float}} of the Megatron log lines in `text` (last occurrence wins).

    Fields keep Megatron's names ("lm loss", "planner-imbalance", "tokens-per-sec", "grad norm",
    "learning rate", "elapsed time per iteration (ms)", ...)."""
    out = {}
    for line in text.splitlines():
        m = _ITER.search(line)
        if not m or "|" not in line:
            continue
        fields = {}
        for part in line[m.end():].split("|"):
            f = _FIELD.match(part)
            if f:
                try:
                    fields[f.group(1).strip()] = float(f.group(2))
                except ValueError:
                    pass
        if "lm loss" in fields:
            fields["train iters"] = float(m.group(2))
            out[int(m.group(1))] = fields
    return out


def _fmt(v, spec):
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _get(run, it, key):
    return run.get(it, {}).get(key) if run else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def summary_lines(runs: dict) -> list:
    """Per run: iterations, first/last loss, mean loss of the first and last 10 iterations, median
    tokens/s and planner imbalance after 5 warm-up iterations."""
    lines = []
    for label, run in runs.items():
        if not run:
            lines.append(f"- {label}: no iteration lines found")
            continue
        its = sorted(run)
        loss = [run[i]["lm loss"] for i in its]
        k = min(10, len(loss))
        warm = [i for i in its if i > 5] or its
        tps = _median([run[i].get("tokens-per-sec") for i in warm])
        imb = _mean([run[i].get("planner-imbalance") for i in its])
        lines.append(
            f"- {label}: {len(its)} iterations ({its[0]}..{its[-1]} of {int(run[its[-1]]['train iters'])}), "
            f"loss {loss[0]:.4f} -> {loss[-1]:.4f} (mean of first {k}: {_mean(loss[:k]):.4f}, last {k}: "
            f"{_mean(loss[-k:]):.4f}), median tokens/s after iteration 5: {_fmt(tps, '.0f') or 'n/a'}, "
            f"mean planner imbalance: {_fmt(imb, '.2e') or 'n/a'}")
    both = [r for r in runs.values() if r]
    if len(both) == 2:
        common = sorted(set(both[0]) & set(both[1]))
        if common:
            d = [abs(both[0][i]["lm loss"] - both[1][i]["lm loss"]) for i in common]
            lines.append(f"- |loss CP=2 - loss CP=1| over {len(common)} common iterations: max {max(d):.2e}, "
                         f"mean {sum(d) / len(d):.2e}")
    return lines


def markdown_table(cp2: dict, cp1: dict) -> str:
    its = sorted(set(cp2 or {}) | set(cp1 or {}))
    rows = ["| iteration | loss CP=2 | loss CP=1 | tokens/s CP=2 | tokens/s CP=1 | planner imbalance CP=2 |",
            "|---:|---:|---:|---:|---:|---:|"]
    for i in its:
        rows.append("| {} | {} | {} | {} | {} | {} |".format(
            i, _fmt(_get(cp2, i, "lm loss"), ".4f"), _fmt(_get(cp1, i, "lm loss"), ".4f"),
            _fmt(_get(cp2, i, "tokens-per-sec"), ".0f"), _fmt(_get(cp1, i, "tokens-per-sec"), ".0f"),
            _fmt(_get(cp2, i, "planner-imbalance"), ".2e")))
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------- PNG
def _png_bytes(img: bytearray, w: int, h: int) -> bytes:
    """RGB rows (bytearray of h * w * 3) -> PNG file bytes (standard library only)."""
    raw = b"".join(b"\x00" + bytes(img[y * w * 3:(y + 1) * w * 3]) for y in range(h))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _plain_png(series: dict, path: str, w=800, h=480) -> None:
    """Fallback plot without matplotlib (standard library only): axes box, light grid, one polyline per
    series (blue, orange, ...), no text."""
    img = bytearray(b"\xff" * (w * h * 3))

    def put(x, y, c):
        if 0 <= x < w and 0 <= y < h:
            img[(y * w + x) * 3:(y * w + x) * 3 + 3] = bytes(c)

    ml, mr, mt, mb = 50, 20, 20, 40
    xs = [x for s in series.values() for x in s[0]]
    ys = [y for s in series.values() for y in s[1]]
    for k in range(1, 10):  # grid
        gy, gx = mt + k * (h - mt - mb) // 10, ml + k * (w - ml - mr) // 10
        for x in range(ml, w - mr):
            put(x, gy, (225, 225, 225))
        for y in range(mt, h - mb):
            put(gx, y, (225, 225, 225))
    for x in range(ml, w - mr + 1):
        put(x, mt, (0, 0, 0))
        put(x, h - mb, (0, 0, 0))
    for y in range(mt, h - mb + 1):
        put(ml, y, (0, 0, 0))
        put(w - mr, y, (0, 0, 0))
    if xs:
        x0, x1 = min(xs), (max(xs) if max(xs) > min(xs) else min(xs) + 1)
        y0, y1 = min(ys), (max(ys) if max(ys) > min(ys) else min(ys) + 1)
        pad = 0.05 * (y1 - y0)
        y0, y1 = y0 - pad, y1 + pad

        def px(x, y):
            return (ml + (x - x0) / (x1 - x0) * (w - ml - mr), mt + (y1 - y) / (y1 - y0) * (h - mt - mb))

        colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
        for (xv, yv), c in zip(series.values(), colors):
            pts = [px(x, y) for x, y in zip(xv, yv)]
            for (ax, ay), (bx, by) in zip(pts, pts[1:] or pts):
                n = int(max(abs(bx - ax), abs(by - ay))) + 1
                for j in range(n + 1):
                    t = j / n
                    cx, cy = int(round(ax + t * (bx - ax))), int(round(ay + t * (by - ay)))
                    for dx in (-1, 0, 1):
                        for dy in (-1, 0, 1):
                            put(cx + dx, cy + dy, c)
    with open(path, "wb") as f:
        f.write(_png_bytes(img, w, h))


def plot_png(runs: dict, path: str, title: str) -> str:
    """Write the loss curves to `path`; returns "matplotlib" or "plain" (the backend used)."""
    series = {label: (sorted(r), [r[i]["lm loss"] for i in sorted(r)]) for label, r in runs.items() if r}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plain_png(series, path)
        return "plain"
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    for (label, (x, y)), st in zip(series.items(), ("-", "--", ":", "-.")):
        ax.plot(x, y, st, label=label, linewidth=1.6)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (DFlash decayed CE)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp2", help="Megatron log of the CP=2 run")
    p.add_argument("--cp1", help="Megatron log of the CP=1 run")
    p.add_argument("--out", required=True, help="output prefix: writes <out>.md and <out>.png")
    p.add_argument("--title", default="pretrain_dflash.py loss, CP=2 vs CP=1 (same seed, global batch 2)")
    args = p.parse_args(argv)
    if not (args.cp2 or args.cp1):
        p.error("give --cp2 and/or --cp1")
    runs = {}
    for label, path in (("CP=2", args.cp2), ("CP=1", args.cp1)):
        if path:
            flag = "--cp2" if label == "CP=2" else "--cp1"
            try:
                with open(path, errors="replace") as f:
                    runs[label] = parse_log(f.read())
            except OSError as e:
                p.error(f"{flag}: cannot read {path!r}: {e.strerror or e}")
            if not runs[label]:
                p.error(f"{flag}: no iteration lines with a loss ('iteration N/ M | ... | lm loss: X |') in "
                        f"{path!r}")
    table = markdown_table(runs.get("CP=2", {}), runs.get("CP=1", {}))
    summary = "\n".join(summary_lines(runs))
    try:
        backend = plot_png(runs, args.out + ".png", args.title)
    except Exception as e:  # noqa: BLE001 - the table matters more than the picture
        backend = f"failed: {type(e).__name__}: {e}"
    with open(args.out + ".md", "w") as f:
        f.write(f"## Loss curves\n\n{summary}\n\nPlot: `{os.path.basename(args.out)}.png` ({backend}).\n\n{table}\n")
    print(summary)
    print(f"[plot_loss] wrote {args.out}.md and {args.out}.png ({backend})")
    print(table)
    return runs


if __name__ == "__main__":
    main()
