"""tools/bench_attention.py --cpu-smoke: two gloo ranks, tiny shapes, every method / CP / placement row
runs, writes JSON + markdown, and the ops' comm_stats bytes equal the model's (no timing assertions)."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_attention_cpu_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tools", "bench_attention.py"), "--cpu-smoke", "--contexts", "512",
           "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((tmp_path / "bench_attention.json").read_text())
    rows = data["rows"]
    # CP=1: 3 methods; CP=2: 3 methods x 2 placements
    assert len(rows) == 9, rows
    for r in rows:
        assert "error" not in r, r
        assert r["comm_bytes"] == r["predicted_bytes"], r
        assert (r["comm_bytes"] == 0) == (r["cp"] == 1), r
        assert r["op_ms"] > 0 and r["kernel_ms"] > 0
    md = (tmp_path / "bench_attention.md").read_text()
    # splitkv rows carry the chunk count of their merge pipeline (k > 1 at CP=2 by default)
    assert re.search(r"\| splitkv( k=\d+)? \| 2 \| lpt \|", md) and "| ring-kv | 2 | zigzag |" in md
    assert "| method |" in p.stdout  # the table is printed last
    # GPU-only measures read "n/a (CPU)" (were 0 TF/s and nan / '-' GiB), and the note says why
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    hdr = [c.strip() for c in lines[0].strip("|").split("|")]
    gpu_cols = [hdr.index(c) for c in ("peak GiB", "kernel TF/s", "SDPA TF/s", "op TF/s/GPU")]
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert [cells[i] for i in gpu_cols] == ["n/a (CPU)"] * 4, ln
        assert float(cells[hdr.index("op ms (median)")]) > 0, ln
    assert "CPU smoke run (--cpu-smoke" in md


def test_bench_attention_table_numbers_on_gpu():
    """The same table for a CUDA run keeps the numbers (the n/a cells are a CPU run's only)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import bench_attention
    finally:
        sys.path.pop(0)
    row = dict(method="splitkv", cp=2, placement="lpt", link="nvlink", context=512, op_ms=1.5, prepare_ms=0.2,
               metadata=True, comm_bytes=100, predicted_bytes=100, peak_mem_gib=1.25, kernel_ms=0.5,
               kernel_tflops=321.0, sdpa_fwdbwd_tflops=400.0, op_tflops_per_gpu=123.0, pair_imbalance=0.01,
               planner_imbalance=0.001)
    gpu = bench_attention.table([row], slow=False)
    assert "| 1.25 | 0.50 | 321 | 400 | 123 |" in gpu and "n/a (CPU)" not in gpu, gpu
    cpu = bench_attention.table([row], slow=False, cpu=True)
    assert "| n/a (CPU) | 0.50 | n/a (CPU) | n/a (CPU) | n/a (CPU) |" in cpu and bench_attention.CPU_NOTE in cpu, cpu


def test_bench_attention_cpu_smoke_head_chunks(tmp_path):
    """--chunk-axis heads (the op's head chunks) and --chunk-axis-ab rows,heads with --chunks-ab: the rows run
    head chunks with the model's bytes; the A/B runs every count with each axis, the same bytes per count."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tools", "bench_attention.py"), "--cpu-smoke", "--contexts", "512", "--cp", "2",
           "--methods", "splitkv", "--placements", "lpt", "--num-chunks", "2", "--chunk-axis", "heads",
           "--chunks-ab", "1,2", "--chunk-axis-ab", "rows,heads", "--ab-contexts", "512", "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((tmp_path / "bench_attention.json").read_text())
    (row,) = data["rows"]
    assert "error" not in row and row["chunk_axis"] == "heads" and row["num_chunks"] == 2, row
    assert row["comm_bytes"] == row["predicted_bytes"] and row["kernel_calls"] == 2, row
    ab = data["ab_rows"]
    assert [(r["num_chunks_requested"], r["chunk_axis"]) for r in ab] == [(1, "rows"), (1, "heads"), (2, "rows"),
                                                                          (2, "heads")], ab
    assert all("error" not in r for r in ab), ab
    by_k = {}
    for r in ab:
        by_k.setdefault(r["num_chunks"], set()).add(r["comm_bytes"])
    assert all(len(b) == 1 for b in by_k.values()), by_k  # head chunks move the bytes row chunks move
    md = (tmp_path / "bench_attention.md").read_text()
    assert "| splitkv k=2 heads | 2 | lpt |" in md and "| chunk axis |" in md


def test_bench_attention_cpu_smoke_window(tmp_path, capsys):
    """--window / --causal: every row runs the windowed layer (the ops get window= / causal=) with the model's
    bytes (unchanged by the mask), labelled W=... causal; --window with --packs is an argparse error."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tools", "bench_attention.py"), "--cpu-smoke", "--contexts", "512", "--window", "64",
           "--causal", "--placements", "lpt", "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_attention.json").read_text())["rows"]
    assert len(rows) == 6, rows  # CP=1 and CP=2 (lpt) x 3 methods
    for r in rows:
        assert "error" not in r and r["window"] == 64 and r["causal"] is True, r
        assert r["comm_bytes"] == r["predicted_bytes"], r
    assert "| splitkv W=64 causal | 2 | lpt |" in (tmp_path / "bench_attention.md").read_text()
    # the flag errors through main(argv) in this process (argparse's exit 2, before any process group)
    code, stderr = _main_exit(capsys, ["--cpu-smoke", "--window", "64", "--packs", "1024"])
    assert code == 2 and "--window / --causal apply to the --contexts rows only" in stderr, stderr
    code, stderr = _main_exit(capsys, ["--cpu-smoke", "--window", "0"])
    assert code == 2 and "--window" in stderr, stderr


def _main_exit(capsys, argv):
    """(exit status, stderr) of `bench_attention.main(argv)`, which must exit (SystemExit)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import bench_attention
    finally:
        sys.path.pop(0)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        bench_attention.main(argv)
    return e.value.code, capsys.readouterr().err


def test_windowed_pairs_match_the_reference_mask():
    """The benchmark's useful pairs of a windowed layer (`benchlib.context_pairs`, and the kernel calls' pairs of
    every method summed over the ranks) equal the visible pairs of the float64 reference's dense mask."""
    import numpy as np
    import torch

    sys.path.insert(0, ROOT)
    from tools import benchlib as bench
    from megatron_splitkv.reference import dflash_attention_mask

    B = 4
    lens, anchors = bench.make_workload(300, 24, n_seqs=1, seed=3)
    for window, causal in ((16, True), (5, False), (2, True), (1000, False)):
        q_anchor = torch.from_numpy(np.concatenate(anchors))
        kv_pos = torch.arange(int(lens[0]))
        dense = dflash_attention_mask(torch.zeros_like(q_anchor), q_anchor, torch.zeros_like(kv_pos), kv_pos,
                                      block_size=B, window=window, causal=causal)
        ctx_pairs, own_pairs = float(dense[:, :300].sum()), float(dense[:, 300:].sum())
        assert bench.context_pairs(anchors, B, window) == ctx_pairs
        for P in (1, 3):
            plan = bench.place(lens, anchors, cp_size=P, block_size=B)
            for method in ("splitkv", "allgather-kv", "ring-kv"):
                got = sum(c.pairs for r in range(P) for c in bench.kernel_calls(method, plan, r, window=window,
                                                                                causal=causal))
                # splitkv: every rank's calls see all gathered blocks against its own keys; the baselines: each
                # rank's own blocks against all keys (allgather) or every shard in turn (ring); own pairs once
                assert got == ctx_pairs + own_pairs, (method, P, window, causal, got, ctx_pairs, own_pairs)
