"""The tools/*.py CLIs reject bad flags up front: a one-line argparse error naming the flag, exit status 2
(never 0, never a traceback); the GPU-only tools exit with one line when there is no CUDA GPU. All cases fail during argument validation, before any data, model or
process group is set up, so each took about the interpreter + import time as a process of its own: the bad-flag
cases run in one interpreter, each as its command line would (`_tool_runs.run_tools`)."""

import os
import subprocess
import sys

import pytest
from _tool_runs import run_tools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name):
    return os.path.join(ROOT, "tools", name)


# (tool, argv, text the error must contain)
CASES = [
    ("simulate_scaling.py", ["--model-only", "--cps", "a,b"], "--cps"),
    ("simulate_scaling.py", ["--model-only", "--cps", "0,2"], "--cps"),
    ("simulate_scaling.py", ["--model-only", "--methods", "bogus"], "--methods"),
    ("simulate_scaling.py", ["--model-only", "--B", "0"], "--B"),
    ("simulate_scaling.py", ["--model-only", "--placements", "foo"], "--placements"),
    ("simulate_scaling.py", ["--model-only", "--ctx-per-rank", "-5"], "--ctx-per-rank"),
    ("simulate_scaling.py", ["--model-only", "--Hq", "6", "--Hkv", "4"], "--Hkv"),
    ("simulate_scaling.py", ["--model-only", "--topology", "torus"], "--topology"),
    ("simulate_scaling.py", ["--model-only", "--backend", "nope"], "--backend"),
    ("simulate_scaling.py", ["--model-only", "--chunk-loss", "-0.5"], "--chunk-loss"),
    ("bench_attention.py", ["--cpu-smoke", "--methods", "bogus"], "--methods"),
    ("bench_attention.py", ["--cpu-smoke", "--cp", "0"], "--cp"),
    ("bench_attention.py", ["--cpu-smoke", "--backend", "nope"], "--backend"),
    ("bench_attention.py", ["--methods", "bogus"], "--methods"),
    ("bench_attention.py", ["--cpu-smoke", "--contexts", "x"], "--contexts"),
    ("bench_lpt.py", ["--strategies", "foo"], "--strategies"),
    ("bench_lpt.py", ["--batches", "0"], "--batches"),
    ("plot_loss.py", ["--cp2", "/nonexistent/cp2.log"], "--cp2"),
    ("plot_loss.py", ["--cp1", "{empty_log}"], "--cp1"),
    ("extract_features.py", ["--tap-layers", "99"], "--tap-layers"),
    ("extract_features.py", ["--tap-layers", "-1", "3"], "--tap-layers"),
    ("extract_features.py", ["--target-num-layers", "3", "--draft-num-layers", "5"], "--target-num-layers"),
    # real-valued flags: finite numbers within their limits (`_ints.float_arg`); float() took "nan" and "inf"
    ("extract_features.py", ["--rotary-base", "nan"], "--rotary-base"),
    ("extract_features.py", ["--rotary-base", "0"], "--rotary-base"),
    ("staircase_shapes.py", ["--moved-pair-ns", "nan"], "--moved-pair-ns"),
    ("staircase_shapes.py", ["--call-us", "inf"], "--call-us"),
    ("bench_attention.py", ["--cpu-smoke", "--ab-reserve-s", "nan"], "--ab-reserve-s"),
    ("step_overhead.py", ["--cpu-smoke", "--budget-s", "nan"], "--budget-s"),
]


def _run_all(cases, tmp_path):
    """Run every case (in one interpreter, `_tool_runs.run_tools`); returns [(case, returncode, stdout, stderr)]."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    (tmp_path / "empty.log").write_text("no iteration lines here\n")
    runs = []
    for i, (tool, argv, want) in enumerate(cases):
        argv = [a.replace("{empty_log}", str(tmp_path / "empty.log")) for a in argv]
        runs.append((os.path.join("tools", tool), [*argv, "--out", str(tmp_path / f"out{i}")]))
    return [((tool, argv, want), *result) for (tool, argv, want), result in zip(cases, run_tools(runs, env))]


def test_bad_flags_fail_with_a_clear_error(tmp_path):
    problems = []
    for (tool, argv, want), rc, so, se in _run_all(CASES, tmp_path):
        err_lines = [ln for ln in se.splitlines() if ": error: " in ln]
        if rc != 2:
            problems.append(f"{tool} {argv}: exit status {rc} (want 2)\n{se[-800:]}")
        elif "Traceback" in se or not err_lines:
            problems.append(f"{tool} {argv}: not a one-line argparse error:\n{se[-800:]}")
        elif want not in err_lines[-1]:
            problems.append(f"{tool} {argv}: error does not name {want}: {err_lines[-1]}")
    assert not problems, "\n\n".join(problems)


def test_bench_attention_exits_nonzero_when_a_row_errors(tmp_path):
    """A row that fails (here: CP larger than the world size, so nothing can run; and the TE backend
    on CPU, which errors in the row) still writes the table but makes the process exit 1."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    base = [sys.executable, _tool("bench_attention.py"), "--cpu-smoke", "--contexts", "512", "--methods", "splitkv"]
    p = subprocess.run(base + ["--cp", "4", "--out", str(tmp_path / "a")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "no row could run" in p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("transformer_engine installed: the te backend may not error here")
    except ImportError:
        pass
    p = subprocess.run(base + ["--cp", "1", "--backend", "te", "--out", str(tmp_path / "b")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "1 of 1 rows failed" in p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    assert "ERROR" in (tmp_path / "b" / "bench_attention.md").read_text()


@pytest.mark.parametrize("tool", ["profile_kernel.py", "probe_dense_backends.py"])
def test_gpu_only_tools_exit_with_one_line_without_cuda(tool):
    """No CUDA GPU (hidden with CUDA_VISIBLE_DEVICES=""): exit 1 with the single line
    "<tool> needs a CUDA GPU", no traceback."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, _tool(tool)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
    assert lines == [f"{tool} needs a CUDA GPU"], p.stderr[-2000:]


def test_simulate_scaling_empty_out_is_a_flag_error():
    """`--out ''` (the harness above always passes its own --out, so this case runs alone)."""
    p = subprocess.run([sys.executable, _tool("simulate_scaling.py"), "--model-only", "--out", ""], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--out" in p.stderr.splitlines()[-1], p.stderr


def test_pretrain_dflash_bad_splitkv_flag_exits_2_with_one_line():
    """examples/pretrain_dflash.py run as a script: a bad Split-KV flag (validate_splitkv_args) is one line
    naming the flag on stderr and exit status 2, like argparse's own errors (no traceback)."""
    pytest.importorskip("megatron.core")
    argv = [sys.executable, os.path.join(ROOT, "examples", "pretrain_dflash.py"), "--parse-only", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
            "--max-position-embeddings", "256", "--micro-batch-size", "1", "--context-parallel-impl", "splitkv",
            "--dflash-data-workers", "-1"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "pretrain_dflash.py: error: --dflash-data-workers must be >= 0" in p.stderr
    assert "Traceback" not in p.stderr


def test_pretrain_dflash_too_many_data_workers_exits_2_with_one_line():
    """--dflash-data-workers above its cap (32 per rank): one line naming the flag and the limit, exit status 2."""
    pytest.importorskip("megatron.core")
    argv = [sys.executable, os.path.join(ROOT, "examples", "pretrain_dflash.py"), "--parse-only", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
            "--max-position-embeddings", "256", "--micro-batch-size", "1", "--dflash-data-workers", "1000000"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("pretrain_dflash.py: error: --dflash-data-workers must be at most 32"), last
    assert "got 1000000" in last and "Traceback" not in p.stderr


@pytest.mark.parametrize("flag,value,want", [
    ("--context-parallel-impl", "bogus",
     "argument --context-parallel-impl: invalid choice: 'bogus' (choose from 'splitkv', 'allgather-kv', 'ring-kv')"),
    ("--num-layers", "x", "argument --num-layers: invalid int value: 'x'"),
    ("--no-such-flag", "1", "unrecognized arguments: --no-such-flag 1"),
])
def test_pretrain_dflash_argparse_error_without_the_usage(flag, value, want):
    """A bad choice / type / unknown flag (argparse's own errors, Megatron's parser): the error line naming the
    flag (and the allowed values) plus a --help hint, exit status 2; not Megatron's ~750-line usage first."""
    pytest.importorskip("megatron.core")
    argv = [sys.executable, os.path.join(ROOT, "examples", "pretrain_dflash.py"), "--parse-only", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
            "--max-position-embeddings", "256", "--micro-batch-size", "1", flag, value]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.splitlines() == [f"pretrain_dflash.py: error: {want}",
                                     "pretrain_dflash.py: run with --help for every flag"], p.stderr[-2000:]
    assert p.stdout == ""
