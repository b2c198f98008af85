"""tools/host_overhead.py runs on CPU (gloo, P = 1 and 2 through torch.distributed.run) and prints its table with
every column, one row per (backend, P, k). A smoke test: no timing assertions (the tool has no thresholds)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def test_host_overhead_cpu_smoke(tmp_path):
    import host_overhead

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    out = tmp_path / "rows.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "host_overhead.py"), "--nproc", "1,2", "--num-chunks", "1,2",
           "--backends", "math,staircase", "--context", "256", "--anchors", "16", "--steps", "2", "--warmup", "1",
           "--profile-steps", "1", "--top", "3", "--digest", "--json", str(out)]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    header = "| " + " | ".join(host_overhead.COLUMNS) + " |"
    assert header in p.stdout, p.stdout[-3000:]
    table = p.stdout[p.stdout.index(header):].splitlines()[2:]
    assert len(table) == 2 * 2 * 2, table  # backends x P x k
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["backend"], r["P"], r["k"]) for r in rows) == sorted(
        (b, P, k) for b in ("math", "staircase") for P in (1, 2) for k in (1, 2))
    for r in rows:
        assert r["wall_ms"] > 0 and r["py_calls"] > 0 and r["aten_ops"] > 0, r
        assert set(host_overhead.CATEGORIES) <= set(r["split_ms"]), r
        assert len(set(r["digest_by_rank"])) >= 1 and r["digest"], r
