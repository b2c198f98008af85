"""The tools/*.py CLIs and examples/pretrain_dflash.py reject bad flags up front: a one-line argparse error naming
the flag, exit status 2 (never 0, never a traceback); the GPU-only tools exit with one line when there is no CUDA
GPU. All cases fail during argument validation, before any data, model or process group is set up, so each took
about the interpreter + import time as a process of its own: they run in one interpreter per fixture, each as its
command line would (`_tool_runs.run_tools`)."""

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


# tools/staircase_shapes.py: a short run's flags, so that a bad flag accepted keeps the run short
_STAIRCASE_BASE = ["--steps", "1", "--cp", "1", "--sizes", "8192", "--min-len", "4096", "--max-len", "8192",
                   "--max-tokens", "8192", "--anchors", "8", "--quiet"]
# its docstring promises "argparse errors (exit 2) for malformed flags and unknown options": `--strategy nope`
# was a ValueError traceback after the run started; nan / negative costs were accepted; `--steps x`, `--cp 0`,
# `--sizes -5`, `--key-bins x` exited 2 with a message not naming the flag
CASES += [("staircase_shapes.py", _STAIRCASE_BASE + [flag, value], flag)
          for flag, value in [("--strategy", "nope"), ("--moved-pair-ns", "nan"), ("--call-us", "-1"),
                              ("--max-seqs", "-1"), ("--steps", "x"), ("--cp", "0"), ("--sizes", "-5"),
                              ("--key-bins", "x")]]
# tools without an --out flag (the harness passes its own --out to the others, so that a bad flag accepted
# writes nowhere in the tree)
_NO_OUT = {"profile_op.py", "prepare_cost.py", "memory_breakdown.py", "agreement_cost.py", "pipeline_cost.py",
           "host_overhead.py"}
CASES += [
    ("profile_op.py", ["--variants", "1,x"], "--variants"),
    ("profile_op.py", ["--variants", "0,2"], "--variants"),
    ("profile_op.py", ["--steps", "0"], "--steps"),
    ("profile_op.py", ["--context", "0"], "--context"),
    ("profile_op.py", ["--backend", "nope"], "--backend"),
    ("prepare_cost.py", ["--reps", "0"], "--reps"),
    ("prepare_cost.py", ["--device", "foo"], "--device"),
    ("prepare_cost.py", ["--device", "cuda:99"], "--device"),
    ("memory_breakdown.py", ["--cp-sweep", "2", "--context", "0"], "--context"),
    ("memory_breakdown.py", ["--cp-sweep", "2", "--placement", "nope"], "--placement"),
    ("memory_breakdown.py", ["--cp-sweep", "2", "--hq", "3", "--hkv", "2"], "--hq"),
    ("memory_breakdown.py", ["--cp-sweep", "2", "--block-size", "0"], "--block-size"),
    ("memory_breakdown.py", ["--cp-sweep", "2", "--anchors", "0"], "--anchors"),
    ("memory_breakdown.py", ["--cp-sweep", "2", "--num-chunks", "-1"], "--num-chunks"),
    ("memory_breakdown.py", ["--cp-sweep", "2", "--d", "0"], "--d"),
    ("memory_breakdown.py", ["--cp-sweep", "2", "--top", "-1"], "--top"),
    ("chunk_cost.py", ["--cpu", "--out", "{a_file}/sub"], "--out"),  # --out under a file
    ("simulate_scaling.py", ["--model-only", "--out", ""], "--out"),  # --out ''
    # a repeated value in a comma-list flag (benchlib.int_list_arg / choices_arg: the same row twice)
    ("simulate_scaling.py", ["--model-only", "--cps", "2,4,2"], "--cps"),
    ("simulate_scaling.py", ["--model-only", "--bwd-gather", "auto,auto"], "--bwd-gather"),
    ("chunk_cost.py", ["--cpu", "--backends", "math,math"], "--backends"),
]
# comma-list flags once parsed with int() / split(","): "+1" and "1_0" were taken as 1 and 10, a repeat ran the
# same row twice, "x" was a traceback in some; now benchlib.int_list_arg / choices_arg at parse time
CASES += [
    ("agreement_cost.py", ["--cp", "2,2"], "--cp"),
    ("agreement_cost.py", ["--cp", "+2"], "--cp"),
    ("bench_layer_overlap.py", ["--contexts", "1_0"], "--contexts"),
    ("bench_layer_overlap.py", ["--contexts", "512,512"], "--contexts"),
    ("calibrate_cost.py", ["--ctx-lens", "4096,4096"], "--ctx-lens"),
    ("calibrate_cost.py", ["--ctx-lens", "x"], "--ctx-lens"),
    ("calibrate_cost.py", ["--anchor-counts", "+128"], "--anchor-counts"),
    ("calibrate_cost.py", ["--token-counts", "4096"], "--token-counts"),  # one point: no slope to fit
    ("gpu_check.py", ["compare", "--cpu", "--contexts", "256,256"], "--contexts"),
    ("gpu_check.py", ["compare", "--cpu", "--contexts", "256,x"], "--contexts"),
    ("gpu_check.py", ["kernel", "--cpu", "--contexts", "8"], "--contexts"),  # fewer keys than the 16 anchors
    ("gpu_check.py", ["compare", "--cpu", "--kernels", "flex,bogus"], "--kernels"),
    ("gpu_check.py", ["compare", "--cpu", "--kernels", "flex,flex"], "--kernels"),
    ("gpu_check.py", ["dist", "--cpu", "--skip", "op,op"], "--skip"),
    ("gpu_check.py", ["kernel", "--cpu", "--skip", "exact,nope"], "--skip"),
    ("memory_breakdown.py", ["--cp-sweep", "2,2"], "--cp-sweep"),
    ("memory_breakdown.py", ["--cp-sweep", "1_0"], "--cp-sweep"),
    ("memory_breakdown.py", ["--cp-sweep", "2", "--methods", "splitkv,splitkv"], "--methods"),
    ("pipeline_cost.py", ["--cp-sizes", "1,1"], "--cp-sizes"),
    ("pipeline_cost.py", ["--cp-sizes", "1", "--contexts", "+16384"], "--contexts"),
    ("pipeline_cost.py", ["--cp-sizes", "1", "--contexts", "16384,x"], "--contexts"),
    ("bench_lpt.py", ["--strategies", "lpt,lpt"], "--strategies"),
    ("profile_op.py", ["--variants", "2,2"], "--variants"),
    ("profile_op.py", ["--variants", "+1"], "--variants"),
    ("step_overhead.py", ["--cpu-smoke", "--arms", "fresh,fresh"], "--arms"),
]
# an empty item in a comma-list flag ("2,,4", a trailing or a leading comma) was dropped silently (the list ran
# shorter than typed); a CP size of the tools that start one gloo process per rank had no upper limit
# (memory_breakdown --cp-sweep 1000000000 set out to start a billion processes): now argparse's error
CASES += [
    ("agreement_cost.py", ["--cp", "2,,4"], "--cp has an empty item"),
    ("memory_breakdown.py", ["--cp-sweep", "2,4,"], "--cp-sweep has an empty item"),
    ("pipeline_cost.py", ["--cp-sizes", ",1"], "--cp-sizes has an empty item"),
    ("bench_lpt.py", ["--strategies", "lpt,,zigzag"], "--strategies has an empty item"),
    ("window_scaling.py", ["--cpu", "--windows", "3,,none"], "--windows has an empty item"),
    ("agreement_cost.py", ["--cp", "2,100000"], "--cp must be a comma list of integers in [1, 64]"),
    ("memory_breakdown.py", ["--cp-sweep", "1000000000"], "--cp-sweep must be a comma list of integers in [1, 64]"),
    ("memory_breakdown.py", ["--cp", "1000000000"], "--cp"),
    ("host_overhead.py", ["--nproc", "1,65"], "--nproc must be a comma list of integers in [1, 64]"),
]
# the GPU-only tools without a CUDA GPU (hidden with CUDA_VISIBLE_DEVICES=""): exit 1, one line
GPU_ONLY = ["profile_kernel.py", "probe_dense_backends.py", "profile_op.py"]


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory):
    """Every case of CASES and GPU_ONLY (in one interpreter, `_tool_runs.run_tools`), with CUDA hidden:
    {"flags": [(case, returncode, stdout, stderr)], "gpu_only": {tool: (returncode, stdout, stderr)}}."""
    tmp_path = tmp_path_factory.mktemp("cli")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    (tmp_path / "empty.log").write_text("no iteration lines here\n")
    (tmp_path / "a_file").write_text("x")
    runs = []
    for i, (tool, argv, want) in enumerate(CASES):
        argv = [a.replace("{empty_log}", str(tmp_path / "empty.log")).replace("{a_file}", str(tmp_path / "a_file"))
                for a in argv]
        if "--out" not in argv and tool not in _NO_OUT:
            argv += ["--out", str(tmp_path / f"out{i}")]
        runs.append((os.path.join("tools", tool), argv))
    runs += [(os.path.join("tools", tool), []) for tool in GPU_ONLY]
    results = run_tools(runs, env)
    return {"flags": [(case, *result) for case, result in zip(CASES, results)],
            "gpu_only": dict(zip(GPU_ONLY, results[len(CASES):]))}


def test_bad_flags_fail_with_a_clear_error(tool_runs):
    problems = []
    for (tool, argv, want), rc, so, se in tool_runs["flags"]:
        err_lines = [ln for ln in se.splitlines() if ": error: " in ln]
        if rc != 2:
            problems.append(f"{tool} {argv}: exit status {rc} (want 2)\n{se[-800:]}")
        elif "Traceback" in se or not err_lines:
            problems.append(f"{tool} {argv}: not a one-line argparse error:\n{se[-800:]}")
        elif want not in err_lines[-1]:
            problems.append(f"{tool} {argv}: error does not name {want}: {err_lines[-1]}")
    assert not problems, "\n\n".join(problems)


@pytest.mark.parametrize("tool", GPU_ONLY)
def test_gpu_only_tools_exit_with_one_line_without_cuda(tool_runs, tool):
    """No CUDA GPU: exit 1 with the single line "<tool> needs a CUDA GPU", no traceback (profile_op.py: before,
    a torch.distributed rendezvous traceback)."""
    rc, _, err = tool_runs["gpu_only"][tool]
    assert rc == 1, (rc, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
    assert lines == [f"{tool} needs a CUDA GPU"], err[-2000:]


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


# examples/pretrain_dflash.py run as a script (`_tool_runs.run_tools`: in one interpreter, each as its command
# line would): a short valid command line, then the bad flag
_PRETRAIN = ["--parse-only", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1"]
PRETRAIN_CASES = {
    "splitkv flag": ["--context-parallel-impl", "splitkv", "--dflash-data-workers", "-1"],
    "too many data workers": ["--dflash-data-workers", "1000000"],
    "--context-parallel-impl": ["--context-parallel-impl", "bogus"],
    "--num-layers": ["--num-layers", "x"],
    "--no-such-flag": ["--no-such-flag", "1"],
}


@pytest.fixture(scope="module")
def pretrain_runs():
    """{name: (returncode, stdout, stderr)} of examples/pretrain_dflash.py with each of PRETRAIN_CASES."""
    pytest.importorskip("megatron.core")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = run_tools([(os.path.join("examples", "pretrain_dflash.py"), _PRETRAIN + argv)
                         for argv in PRETRAIN_CASES.values()], env)
    return dict(zip(PRETRAIN_CASES, results))


def test_pretrain_dflash_bad_splitkv_flag_exits_2_with_one_line(pretrain_runs):
    """A bad Split-KV flag (validate_splitkv_args) is one line naming the flag on stderr and exit status 2,
    like argparse's own errors (no traceback)."""
    rc, _, err = pretrain_runs["splitkv flag"]
    assert rc == 2, err[-2000:]
    assert "pretrain_dflash.py: error: --dflash-data-workers must be >= 0" in err
    assert "Traceback" not in err


def test_pretrain_dflash_too_many_data_workers_exits_2_with_one_line(pretrain_runs):
    """--dflash-data-workers above its cap (32 per rank): one line naming the flag and the limit, exit status 2."""
    rc, _, err = pretrain_runs["too many data workers"]
    assert rc == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("pretrain_dflash.py: error: --dflash-data-workers must be at most 32"), last
    assert "got 1000000" in last and "Traceback" not in err


@pytest.mark.parametrize("flag,want", [
    ("--context-parallel-impl",
     "argument --context-parallel-impl: invalid choice: 'bogus' (choose from 'splitkv', 'allgather-kv', 'ring-kv')"),
    ("--num-layers", "argument --num-layers: invalid int value: 'x'"),
    ("--no-such-flag", "unrecognized arguments: --no-such-flag 1"),
])
def test_pretrain_dflash_argparse_error_without_the_usage(pretrain_runs, flag, want):
    """A bad choice / type / unknown flag (argparse's own errors, Megatron's parser): the error line naming the
    flag (and the allowed values) plus a --help hint, exit status 2; not Megatron's ~750-line usage first."""
    rc, out, err = pretrain_runs[flag]
    assert rc == 2, err[-2000:]
    assert err.splitlines() == [f"pretrain_dflash.py: error: {want}",
                                "pretrain_dflash.py: run with --help for every flag"], err[-2000:]
    assert out == ""
