"""The GPU suite's tools on CPU (tiny shapes; the timings mean nothing there, the plumbing and the
exactness checks do): tools/gpu_check.py compare (flex, te through the CPU emulator of Transformer
Engine's fused attention, or "unavailable", staircase and its option sweep), tools/tune_flex.py, tools/bench_attention.py's chunk-count
A/B and row selection flags, tools/suite_report.py on missing results."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from tools import benchlib as bench  # noqa: E402


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _te_importable():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def _max_err(e):
    return max(e[k] for k in ("out", "dq", "dk", "dv"))


def test_gpu_check_compare_cpu_with_te_emulator(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "compare", "--cpu",
                        "--te-emulator", "--out", str(tmp_path), "--staircase-sweep",
                        "default;group_blocks=4;bwd_mode=key;streams=2;gqa=native"], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    c = json.loads((tmp_path / "gpu_check_compare_cpu_w1.json").read_text())["compare"]
    rows = {(r["kernel"], r["tk"]): r for r in c["rows"]}
    assert set(rows) == {(k, tk) for k in ("fa4", "flex", "te", "staircase") for tk in (256, 512)}
    for tk in (256, 512):  # default --kernels lists fa4 first: on CPU a row that says why it did not run
        assert "import failed" in rows[("fa4", tk)]["unavailable"], rows[("fa4", tk)]
        del rows[("fa4", tk)]
    for key, r in rows.items():
        assert "error" not in r, (key, r)
        assert _max_err(r["exact"]) < 2e-2 and r["exact"]["lse"] < 1e-3 and r["exact"]["nonfinite"] == 0, (key, r)
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["fwdbwd_pct_dense"] > 0
        if key[1] == 256:  # the two-part key split with the global-lse backward
            assert _max_err(r["split_exact"]) < 2e-2, (key, r["split_exact"])
    ob = {r["name"]: r for r in c["own_block"]}
    assert _max_err(ob["einsum"]["exact"]) < 1e-5  # fp32 einsums
    for name in ("flex block-diag", "te block-diag", "staircase block-diag"):
        assert _max_err(ob[name]["exact"]) < 2e-2, ob[name]
    assert ob["merge"]["fwd_ms"] > 0
    fused = {r["kernel"]: r for r in c["fused"]}
    for name in ("flex", "te", "staircase"):
        assert _max_err(fused[name]["exact"]) < 2e-2, fused[name]
        assert fused[name]["separate_fwdbwd_ms"] > 0
    # the staircase option sweep: every variant exact, the dense (CPU flash) path exercised
    sweep = c["staircase_sweep"]
    assert [r["variant"] for r in sweep[::2]] == ["default", "group_blocks=4", "bwd_mode=key", "streams=2",
                                                   "gqa=native"]  # native GQA last
    for r in sweep:
        assert "error" not in r and r["ok"], r
    assert any(r["groups"] > 0 and r["paths"]["dense"] == "cpu-flash" for r in sweep)
    assert {r["paths"].get("bwd") for r in sweep if r["groups"]} == {"query", "key"}
    log = (tmp_path / "gpu_check_compare_cpu_w1.log").read_text()
    assert "| dense SDPA" in log and "| te | 256 |" in log and "Staircase option sweep" in log
    assert "| kernel | Tk |" in p.stdout  # the table is printed last
    # GPU-only measures read "n/a (CPU)" (were 0 TF/s and nan% columns), and the output says why
    import gpu_check

    assert gpu_check.CPU_NOTE in p.stdout and gpu_check.CPU_NOTE in log
    first_table = p.stdout.split("| kernel | Tk |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    unavailable = [ln for ln in first_table if ln.startswith("| fa4 |")]
    assert len(unavailable) == 2 and all("unavailable" in ln for ln in unavailable), unavailable
    first_table = [ln for ln in first_table if ln not in unavailable]
    assert len(first_table) == 8  # dense SDPA and three kernels at two Tk
    for ln in first_table:  # fwd TF/s, % dense, fwd+bwd TF/s, % dense
        cells = ln.split(" | ")
        assert [cells[i] for i in (3, 4, 6, 7)] == ["n/a (CPU)"] * 4, cells
    assert "nan" not in p.stdout.split("| kernel | Tk |", 1)[1], p.stdout[-3000:]


@pytest.mark.skipif(_te_importable(), reason="Transformer Engine is installed here")
def test_gpu_check_compare_reports_missing_te(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "compare", "--cpu",
                        "--contexts", "256", "--out", str(tmp_path)], env=_env(), cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    c = json.loads((tmp_path / "gpu_check_compare_cpu_w1.json").read_text())["compare"]
    te = [r for r in c["rows"] if r["kernel"] == "te"]
    assert len(te) == 1 and "unavailable" in te[0] and "transformer_engine" in te[0]["unavailable"]
    assert "unavailable" in p.stdout


def test_tune_flex_cpu(tmp_path):
    import tune_flex

    res = tune_flex.main(["--cpu", "--configs", "default,fwd_tma", "--tks", "256", "--out", str(tmp_path)])
    assert [r["config"] for r in res["rows"]] == ["default", "fwd_tma"]
    for r in res["rows"]:
        assert r["exact_ok"] and r["fwdbwd_ms"] > 0 and r["compile_s"] >= 0, r
    # on CPU flex is emulated and ignores kernel_options: no config is recommended (it was, from timing noise)
    assert res["best"] is None and res["no_recommendation"] == tune_flex.NO_RECOMMENDATION_CPU
    assert "ignores kernel_options" in res["no_recommendation"]
    md = (tmp_path / "tune_flex.md").read_text()
    assert "best: - (no recommendation: CPU run: " in md
    assert "best: **" not in md and "MEGATRON_SPLITKV_FLEX_KERNEL_OPTIONS" not in md
    saved = json.loads((tmp_path / "tune_flex.json").read_text())
    assert saved["best"] is None and saved["no_recommendation"] == tune_flex.NO_RECOMMENDATION_CPU
    # the configs are valid option names for torch 2.11's flex (forward / backward prefixes)
    for name, opts in tune_flex.CONFIGS:
        for k in opts:
            assert k.split("_", 1)[0] in ("fwd", "bwd"), (name, k)
            assert k.split("_", 1)[1] in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "USE_TMA", "BLOCK_M1",
                                          "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"), (name, k)
        if "bwd_BLOCK_N1" in opts:
            assert opts["bwd_BLOCK_N1"] % opts["bwd_BLOCK_M1"] == 0 and opts["bwd_BLOCK_M2"] % opts["bwd_BLOCK_N2"] == 0
    assert len(tune_flex.CONFIGS) <= 6 and tune_flex.CONFIGS[0] == ("default", {})


def test_tune_flex_best_needs_exactness():
    import tune_flex

    rows = [dict(config="default", tk=1, fwdbwd_ms=10.0, exact_ok=True),
            dict(config="fast_wrong", tk=1, fwdbwd_ms=1.0, exact_ok=False),
            dict(config="fast", tk=1, fwdbwd_ms=8.0, exact_ok=True)]
    name, speedup, _ = tune_flex.best_config(rows)
    assert name == "fast" and speedup == pytest.approx(1.25)
    assert tune_flex.best_config(rows[1:]) is None  # no baseline measured


def test_bench_chunk_ab_and_row_selection(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tools", "bench_attention.py"), "--cpu-smoke", "--cp", "1,2", "--contexts", "512",
           "--placements", "lpt,zigzag", "--cp1-methods", "splitkv", "--alt-placement-methods", "splitkv",
           "--chunks-ab", "1,2", "--ab-contexts", "1024", "--row-target-s", "0.05", "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((tmp_path / "bench_attention.json").read_text())
    got = [(r["cp"], r["placement"], r["method"]) for r in data["rows"]]
    assert got == [(1, "-", "splitkv"), (2, "lpt", "splitkv"), (2, "lpt", "allgather-kv"), (2, "lpt", "ring-kv"),
                   (2, "zigzag", "splitkv")]
    for r in data["rows"]:
        assert r["comm_bytes"] == r["predicted_bytes"], r
        assert 1 <= r["reps"] <= 2 and r["est_mem_gib"] > 0
    ab = data["ab_rows"]
    if bench.op_option("num_chunks") is None:
        assert len(ab) == 1 and "skipped" in ab[0]
        return
    assert [r["num_chunks"] for r in ab] == [1, 2]
    assert ab[0]["comm_bytes"] == ab[1]["comm_bytes"] and ab[1]["comm_records"] == 2 * ab[0]["comm_records"]
    assert ab[1]["ab_rel_diff"] < 1e-2 and ab[0]["ab_speedup"] == pytest.approx(1.0)
    md = (tmp_path / "bench_attention.md").read_text()
    assert "| num_chunks |" in md
    k2 = data["rows"][1]["num_chunks"]  # CP=2 splitkv row: the op's default chunk count, in its label
    assert k2 == bench.resolve_chunks(None, 2, 8) and (f"| splitkv k={k2} | 2 | lpt |" in md if k2 > 1 else True)


def test_suite_report_on_missing_results(tmp_path):
    work, out = tmp_path / "w", tmp_path / "o"
    work.mkdir()
    out.mkdir()
    (work / "bench").mkdir()
    (work / "bench" / "bench_attention.json").write_text("{ truncated")  # a step killed mid-write
    for cmd in (["collect", str(work), str(out)], ["summary", str(work)]):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "suite_report.py")] + cmd, env=_env(),
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
    assert (out / "suite.json").exists() and (out / "tables.md").exists()
    assert "kernels: no result" in p.stdout and "bench nvlink: no result" in p.stdout and "simulate: no result" in p.stdout


def test_suite_rejects_unknown_backend_before_any_step(tmp_path):
    """A misspelled SUITE_* backend stops the suite at once (exit 2, naming the variable), and the
    script's list of names is the registry's (megatron_splitkv.kernels.BACKENDS)."""
    import re

    from megatron_splitkv.kernels import BACKENDS

    script = open(os.path.join(ROOT, "tools", "run_gpu_suite.sh")).read()
    known = re.search(r'KNOWN_BACKENDS=" ([a-z0-9 ]+) "', script).group(1).split()
    assert sorted(known) == sorted(BACKENDS)
    for var, val in [("SUITE_BACKEND", "bogus"), ("SUITE_EXACT_BACKENDS", "flex,stair"),
                     ("SUITE_SIM_CHUNK_AXIS", "cols"), ("SUITE_CHUNK_AXIS_AB", "rows,head")]:
        env = dict(os.environ, SUITE_CPU="1", SUITE_STEPS="exact", PYTHON=sys.executable,
                   OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), **{var: val})
        p = subprocess.run(["bash", "tools/run_gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and var in p.stderr and "start at" not in p.stdout, (p.stdout, p.stderr)


def test_chunk_cost_cpu(tmp_path):
    """tools/chunk_cost.py --cpu: tiny defaults, every variant timed, the table and JSON written."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "chunk_cost.py"), "--cpu", "--backends", "math",
                        "--chunks", "2", "--reps", "1", "--reverse", "--out",
                        str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.load(open(tmp_path / "chunk_cost.json"))["rows"]
    names = [x["variant"] for x in rows]
    assert names == ["one call", "one call, reversed", "query k=2", "query k=2, reversed", "head k=2"], names
    assert all(x["ctx_per_rank"] == 256 and x["ms"] > 0 for x in rows)
    assert rows[0]["vs_one"] == 1.0
    md = (tmp_path / "chunk_cost.md").read_text()
    assert md.count("| 256 | math |") == len(rows)
    # TF/s, GPU busy time and peak memory are GPU measures: "n/a (CPU)" (were 0 and nan), null in the JSON
    table = [ln for ln in md.splitlines() if ln.startswith("| 256 | math |")]
    assert all(ln.endswith("| n/a (CPU) | n/a (CPU) | n/a (CPU) |") for ln in table), table
    assert "GPU measures and read n/a (CPU)" in md and "nan" not in md.lower() and "| 0 |" not in md
    assert all(x["gpu_busy_ms"] is None and x["step_peak_gib"] is None for x in rows), rows


def test_run_gpu_suite_names_its_output_folder(tmp_path):
    """The closing line of tools/run_gpu_suite.sh names the real output folder (it printed a literal '$OUT'
    outside the device harness, e.g. on CPU machines). Every step skipped by a 10 s budget: only the
    collection and the summary run."""
    out = tmp_path / "out"
    env = dict(os.environ, SUITE_CPU="1", SUITE_STEPS="kernels", SUITE_BUDGET_S="10", PYTHON=sys.executable,
               OUT=str(out), WORK=str(tmp_path / "work"))
    p = subprocess.run(["bash", "tools/run_gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith(f"in OUT={out}: ") and "suite.log" in last, last
    assert "$OUT" not in p.stdout, p.stdout[-2000:]


def test_gpu_check_tables_gpu_measures_na_on_cpu():
    """tools/gpu_check.py tables: TF/s, % of dense and peak memory are "n/a (CPU)" for a --cpu run (they printed
    0 TF/s and nan), numbers for a CUDA run; the CPU note is added to a CPU run's output only."""
    import gpu_check

    def res(device):
        return {"env": {"device": device},
                "op_timing_cp1": [dict(op="splitkv", ctx=1024, fwdbwd_ms=12.5, useful_tflops_per_gpu=0.04,
                                       total_mb=0.0, bytes={}, **({"peak_mem_gib": 1.25} if device != "cpu" else {}))],
                "throughput": [dict(tk=512, density=0.5, raw_fwd_ms=1.0, raw_fwd_tflops=0.2, raw_fwdbwd_ms=2.0,
                                    raw_fwdbwd_tflops=0.3, kernel_fwd_ms=1.5, kernel_fwd_tflops=0.1,
                                    kernel_fwd_cached_ms=1.4, kernel_fwd_cached_tflops=0.1, kernel_fwdbwd_ms=3.0,
                                    kernel_fwdbwd_tflops=0.1, kernel_fwdbwd_cached_ms=2.9,
                                    kernel_fwdbwd_cached_tflops=0.1, mask_ms=0.2, sdpa_fwd_ms=0.3,
                                    sdpa_fwd_tflops=float("nan"), sdpa_fwdbwd_ms=0.6, sdpa_fwdbwd_tflops=0.4)]}

    cpu = "\n".join(gpu_check.table_ops(res("cpu"), 1) + gpu_check.table_kernel(res("cpu")) + gpu_check.cpu_note(res("cpu")))
    assert "| splitkv | 1024 | 12.50 | n/a (CPU) | 0.0 () | n/a (CPU) |" in cpu
    assert "| 512 | 0.500 | 1.00 | 2.00 | 1.50 / 1.40 | 3.00 / 2.90 | 0.20 | 0.30 | 0.60 |" in cpu
    assert "nan" not in cpu and "(0)" not in cpu and gpu_check.CPU_NOTE in cpu
    gpu = "\n".join(gpu_check.table_ops(res("cuda:0"), 1) + gpu_check.table_kernel(res("cuda:0"))
                    + gpu_check.cpu_note(res("cuda:0")))
    assert "| splitkv | 1024 | 12.50 | 0 | 0.0 () | 1.25 |" in gpu
    assert "| 512 | 0.500 | 1.00 (0) | 2.00 (0) | 1.50 (0) / 1.40 (0) | 3.00 (0) / 2.90 (0) | 0.20 | 0.30 (-) | 0.60 (0) |" in gpu
    assert "n/a" not in gpu and gpu_check.CPU_NOTE not in gpu


@pytest.mark.parametrize("var,val", [("SUITE_SIM_HEAD_SPLIT", "1,1"), ("SUITE_CHUNKCOST_SPLITS", "3,1"),
                                     ("SUITE_SIM_ROUNDS", "-1"), ("SUITE_SIM_ROUNDS", "two"), ("SUITE_SIM_ROUNDS", "")])
def test_suite_rejects_removed_head_split_or_bad_rounds(tmp_path, var, val):
    """The removed uneven head-split variables (SUITE_SIM_HEAD_SPLIT, SUITE_CHUNKCOST_SPLITS) and a
    SUITE_SIM_ROUNDS that is not a whole number are refused before any step: exit 2 naming the variable."""
    env = dict(os.environ, SUITE_CPU="1", SUITE_STEPS="simulate", PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               WORK=str(tmp_path / "work"), **{var: val})
    p = subprocess.run(["bash", "tools/run_gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and var in p.stderr and "start at" not in p.stdout, (p.stdout, p.stderr)


@pytest.mark.parametrize("var,value", [("SUITE_STEPS", "chunkcots"), ("SUITE_STEPS", "gputests,,exakt"),
                                       ("SUITE_BUDGET_S", "abc"), ("SUITE_CHUNKCOST_S", "2m"),
                                       ("SUITE_GPU_TESTS_S", "-5")])
def test_suite_rejects_bad_steps_or_time_limits_before_any_step(tmp_path, var, value):
    """A misspelled step name ran nothing and exited 0; a non-integer time limit broke bash arithmetic
    (step rc=125, suite exit 0) or skipped every step. Now exit 2 naming the variable, no step started."""
    env = dict(_env(), SUITE_CPU="1", SUITE_STEPS="chunkcost", PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               WORK=str(tmp_path / "work"))
    env[var] = value
    p = subprocess.run(["bash", "tools/run_gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and var in p.stderr and "start at" not in p.stdout, (p.stdout[-1500:], p.stderr)


def test_suite_sim_rounds_reach_the_tool(tmp_path):
    """SUITE_SIM_ROUNDS=2 on CPU: simulate runs as one process (not torchrun) with --paired-rounds 2, and its JSON
    has the rounds."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(_env(), SUITE_CPU="1", SUITE_STEPS="simulate", SUITE_SIM_ROUNDS="2",
               PYTHON=sys.executable, OUT=str(out), WORK=str(work))
    p = subprocess.run(["bash", "tools/run_gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    start = next(ln for ln in (out / "suite.log").read_text().splitlines() if ln.startswith("=== [c_simulate] start"))
    assert "torch.distributed.run" not in start and "tools/simulate_scaling.py" in start, start
    assert "--paired-rounds 2" in start, start
    res = json.load(open(work / "sim" / "simulate_scaling.json"))
    assert all(len(r["efficiency_rounds"]) == 2 for r in res["rows"]
               if r["method"] == "splitkv" and r["P"] > 1 and r["placement"] == "lpt")


def test_gpu_check_dist_cpu_runs_splitkv_with_metadata_and_head_chunks(tmp_path):
    """tools/gpu_check.py dist (2 gloo ranks, --cpu): besides the ops' self-contained calls, splitkv through per-step
    metadata (prepare_splitkv_metadata, metadata=: the training path); with 2 head chunks (Hkv = 2 at --cpu) both
    rows are exact against float64."""
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(ROOT, "tools", "gpu_check.py"), "dist", "--cpu", "--skip", "op", "--out",
                        str(tmp_path), "--chunk-axis", "heads", "--num-chunks", "2"],
                       capture_output=True, text=True, env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = {r["op"]: r for r in json.loads((tmp_path / "gpu_check_dist_cpu_w2.json").read_text())["op_exactness_cp2"]}
    for name in ("splitkv (metadata)", "splitkv"):
        row = rows[name]
        assert row["ok"] and max(row[k] for k in ("out", "q", "k_ctx", "v_ctx", "k_blk", "v_blk")) < 2e-2, row
    assert rows["allgather-kv"]["ok"] and rows["ring-kv"]["ok"]
