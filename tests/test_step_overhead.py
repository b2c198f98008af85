"""tools/step_overhead.py --cpu-smoke (the planner and sharding overhead against a DFlash drafter training
step): one process and two gloo ranks, tiny shapes. Checks the table's columns, that the numbers are finite
and positive, that a fresh step prepares the op metadata once and a reused one never, and that both give
the same loss, and that the arm with the worker-built metadata prepares nothing and gives that loss too; no
timing thresholds. One data pipeline per process (both prefetched arms share it), `--arms` subsets, the
`--profile-data` table. Also the flag errors (exit 2 naming the flag) and the model's
`packed_seq_params=` reuse hook (`DFlashDraftModel.forward`)."""

import json
import math
import os
import subprocess
import sys

import pytest

from _dist import run_distributed
from _tool_runs import run_tools

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "step_overhead.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore")


# One interpreter runs every one-process command line of the tool below, each as `python step_overhead.py ARGV`
# would (a process each spent ~6 s of CPU importing torch and Megatron-Core): per case a freshly imported
# `step_overhead` module (its module state - the pipeline count, the prepare counter - as new), a new
# one-process env:// group (main makes it and shuts it down), `main(argv)`'s return value as the exit status
# (1 and the traceback on stderr for an exception), its stdout / stderr captured. A case with "oom": CONTEXT
# has measure_context raise a CUDA out-of-memory error at that context (the tool's skip path).
_DRIVER = """
import contextlib, io, json, sys, traceback
sys.path.insert(0, sys.argv[1])
import torch
results = []
for case in json.loads(sys.stdin.read()):
    sys.modules.pop("step_overhead", None)
    import step_overhead as so
    if case.get("oom"):
        def fake(context, *a, _inner=so.measure_context, _at=case["oom"]):
            if context == _at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
            return _inner(context, *a)
        so.measure_context = fake
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):  # main's own, from the case before
        so.os.environ.pop(k, None)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = so.main(case["argv"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append([code, out.getvalue(), err.getvalue()])
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""

# {name: (argv, oom context or None)}; --out is added per case
ONE_PROCESS_RUNS = {
    "smoke": (["--cpu-smoke", "--contexts", "256,512", "--reps", "2", "--profile-data"], None),
    "blockmask": (["--cpu-smoke", "--contexts", "256", "--reps", "2", "--kernel", "flex", "--arms", "fresh"], None),
    "oom": (["--cpu-smoke", "--contexts", "512,256", "--reps", "1", "--warmup", "0"], 512),
    **{f"arms={arms}": (["--cpu-smoke", "--contexts", "256", "--reps", "2", "--arms", arms], None)
       for arms in ("reused,prefetched+meta", "prefetched", "fresh", "ahead")},
}


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """{name: (returncode, stdout, stderr, out_dir)} of every ONE_PROCESS_RUNS case, run in one interpreter
    (_DRIVER)."""
    cases, outs = [], {}
    for name, (argv, oom) in ONE_PROCESS_RUNS.items():
        outs[name] = tmp_path_factory.mktemp("so")
        cases.append({"argv": argv + ["--out", str(outs[name])], "oom": oom})
    report = tmp_path_factory.mktemp("so_report") / "report.json"
    p = subprocess.run([sys.executable, "-c", _DRIVER, os.path.join(ROOT, "tools"), str(report)],
                       input=json.dumps(cases), env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = json.loads(report.read_text())
    return {name: (*r, outs[name]) for name, r in zip(ONE_PROCESS_RUNS, results)}


@pytest.mark.parametrize("nproc", [1, 2])
def test_step_overhead_cpu_smoke(tmp_path, nproc, request):
    from step_overhead import COLUMNS

    if nproc == 1:
        returncode, stdout, stderr, tmp_path = request.getfixturevalue("one_process_runs")["smoke"]
        p = subprocess.CompletedProcess([], returncode, stdout, stderr)
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        p = subprocess.run(launch + [TOOL] + ONE_PROCESS_RUNS["smoke"][0] + ["--out", str(tmp_path)],
                           env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    from step_overhead import ARMS, PROFILE_COLUMNS
    # the table is printed last, with every column
    lines = p.stdout.strip().splitlines()
    assert lines[-4] == "| " + " | ".join(COLUMNS) + " |", lines[-6:]
    assert [ln.split(" | ")[:2] for ln in lines[-2:]] == [["| 256", str(nproc)], ["| 512", str(nproc)]]
    data = json.loads((tmp_path / f"step_overhead_cp{nproc}.json").read_text())
    assert "offline features" in data["setup"]
    rows = data["rows"]
    assert [r["context"] for r in rows] == [256, 512] and all(r["cp"] == nproc for r in rows)
    positive = ["step_fresh_ms", "step_reused_ms", "fwdbwd_ms", "gradsync_opt_ms", "data_ms", "fwd_ms", "bwd_ms",
                "attention_ms", "rest_ms", "plan_ms", "shard_ms", "prepare_ms", "op_first_call_ms",
                "op_cached_call_ms", "loss_fresh",
                "step_prefetched_ms", "prefetched_data_ms", "upload_ms", "step_prefetched_meta_ms",
                "prefetched_meta_data_ms", "upload_bind_ms", "step_ahead_ms", "ahead_data_ms"]
    # differences of whole steps may be < 0 on a loaded CPU
    finite = positive + ["overhead_pieces_ms", "pct_step_pieces", "pct_fwdbwd_pieces",
                         "overhead_ab_ms", "pct_step_ab", "pct_fwdbwd_ab",
                         "overhead_prefetched_ms", "pct_step_prefetched", "pct_fwdbwd_prefetched",
                         "overhead_pieces_prefetched_ms", "overhead_prefetched_meta_ms", "pct_step_prefetched_meta",
                         "pct_fwdbwd_prefetched_meta", "overhead_ahead_ms", "pct_step_ahead", "pct_fwdbwd_ahead"]
    for r in rows:
        assert "skipped" not in r, r
        # the math kernel (CPU) builds no BlockMask: that piece is n/a, not a difference of two noisy timings
        # (the first op call minus a cached one, which read < 0 here)
        assert r["block_masks_built"] == 0 and r["mask_ms"] is None, r
        assert math.isclose(r["overhead_pieces_ms"], r["plan_ms"] + r["shard_ms"] + r["prepare_ms"],
                            rel_tol=1e-9, abs_tol=1e-9), r  # (a) is the sum of the pieces it names
        for k in finite:
            assert isinstance(r[k], float) and math.isfinite(r[k]), (k, r)
        for k in positive:
            assert r[k] > 0, (k, r)
        # the A/B is what it says: a fresh step prepares once, a reused one never; same weights, same loss
        assert r["prepares_per_step_fresh"] == [1] and r["prepares_per_step_reused"] == [0], r
        assert r["prepares_per_step_prefetched"] == [1] and r["data_workers"] == 1, r
        # the worker-built metadata, bound in the step: nothing prepared there, the same loss
        assert r["prepares_per_step_prefetched_meta"] == [0] and r["prepares_per_step_ahead"] == [0], r
        assert r["host_metadata_flex_tables"] is False, r  # CPU: the math kernel, no FlexAttention tables
        assert r["loss_max_abs_diff"] <= 1e-6 * abs(r["loss_fresh"]), r
        assert (r["loss_fresh"] == r["loss_reused"] == r["loss_prefetched"] == r["loss_prefetched_meta"]
                == r["loss_ahead"]), r
        assert r["blocks_per_rank"] * nproc >= 8 and r["tokens_this_rank"] > 0
        # ONE data pipeline per process, serving both prefetched arms (its items carry the metadata), one worker
        assert r["data_pipelines_max_alive"] == 1 and r["data_worker_processes"] == 1, r
        assert r["pipeline_metadata"] is True and r["arms"] == list(ARMS) and r["pct_of"] == "fresh", r
        # --profile-data: the (d) step's data part on the host
        for k in ("profile_next_ms", "profile_upload_host_ms", "profile_bind_ms"):
            assert isinstance(r[k], float) and r[k] > 0, (k, r)
        assert r["profile_items_ready"] >= 0 and 0 <= r["profile_next_waited_reps"] <= r["reps"], r
    md = (tmp_path / f"step_overhead_cp{nproc}.md").read_text()
    assert "| " + " | ".join(COLUMNS) + " |" in md and md.count(f" | {nproc} | ") >= 2
    main_rows = [ln.split(" | ") for ln in md.splitlines() if ln.count(" | ") == len(COLUMNS) - 1
                 and ln.split(" | ")[0] in ("| 256", "| 512")]
    assert [c[COLUMNS.index("BlockMask ms")] for c in main_rows] == ["n/a (none built)"] * 2, md
    # the prefetched arm's columns, next to the A/B's; the header says which arm is which
    for col in ("next + upload ms", "overhead ms (b: fresh - reused)", "overhead ms (c: prefetched - reused)",
                "% of step (c)", "next + upload + bind ms", "overhead ms (d: prefetched+meta - reused)",
                "% of step (d)", "overhead ms (e: ahead - reused)", "% of step (e)"):
        assert col in COLUMNS, col
    assert COLUMNS.index("overhead ms (c: prefetched - reused)") == COLUMNS.index("overhead ms (b: fresh - reused)") + 1
    assert COLUMNS.index("overhead ms (d: prefetched+meta - reused)") == COLUMNS.index(
        "overhead ms (c: prefetched - reused)") + 1
    assert COLUMNS.index("overhead ms (e: ahead - reused)") == COLUMNS.index(
        "overhead ms (d: prefetched+meta - reused)") + 1
    assert COLUMNS.index("% of step (e)") == COLUMNS.index("% of step (d)") + 1
    assert COLUMNS.index("% of step (c)") == COLUMNS.index("% of step (b)") + 1
    assert COLUMNS.index("% of step (d)") == COLUMNS.index("% of step (c)") + 1
    assert "| " + " | ".join(PROFILE_COLUMNS) + " |" in p.stdout and "| " + " | ".join(PROFILE_COLUMNS) + " |" in md
    for words in ("ONE data pipeline per process", "serving every prefetched arm", "arms run: fresh, reused, "
                  "prefetched, prefetched+meta, ahead (Williams order)", "(e) = ahead - reused",
                  "ahead = prefetched+meta with the next batch's next + upload + bind issued right after this "
                  "step's forward is issued", "arms: fresh = plan + shard", "reused = none of them", "prefetched = plan + shard + blocks in 1 "
                  "DataLoader worker", "(c) = prefetched - reused", "prefetched+meta = the same worker(s) also build "
                  "the Split-KV metadata", "(d) = prefetched+meta - reused"):
        assert words in data["setup"] and words in md.splitlines()[0], words


def test_step_overhead_blockmask_measured_directly(one_process_runs):
    """--kernel flex (FlexAttention, CPU emulation): the BlockMask piece is the builds' own time (device
    synchronised around each), so it is a measured non-negative number inside the first op call's time and
    part of (a); it was the first call minus a cached call, which read -7 ms here."""
    returncode, stdout, stderr, tmp_path = one_process_runs["blockmask"]
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    (r,) = json.loads((tmp_path / "step_overhead_cp1.json").read_text())["rows"]
    assert r["block_masks_built"] >= 1, r
    assert isinstance(r["mask_ms"], float) and 0 < r["mask_ms"] <= r["op_first_call_ms"], r
    assert math.isclose(r["overhead_pieces_ms"], r["plan_ms"] + r["shard_ms"] + r["prepare_ms"] + r["mask_ms"],
                        rel_tol=1e-9, abs_tol=1e-9), r


BAD_FLAGS = [
    (["--cpu-smoke", "--reps", "0"], "--reps"),
    (["--cpu-smoke", "--contexts", "256,x"], "--contexts"),
    (["--cpu-smoke", "--contexts", "1"], "--contexts"),
    (["--cpu-smoke", "--kernel", "bogus"], "--kernel"),
    (["--cpu-smoke", "--balance", "best"], "--balance"),
    (["--cpu-smoke", "--optimizer", "sgd"], "--optimizer"),
    (["--cpu-smoke", "--heads", "6", "--kv-heads", "4"], "--heads"),
    (["--cpu-smoke", "--budget-s", "-1"], "--budget-s"),
    (["--cpu-smoke", "--data-workers", "0"], "--data-workers"),
    (["--cpu-smoke", "--data-prefetch", "0"], "--data-prefetch"),
    (["--cpu-smoke", "--frobnicate"], "--frobnicate"),
    (["--cpu-smoke", "--arms", "fresh,bogus"], "--arms"),
    (["--cpu-smoke", "--arms", ","], "--arms"),
    (["--cpu-smoke", "--arms", "fresh,fresh"], "--arms"),
    (["--cpu-smoke", "--arms", "fresh", "--profile-data"], "--profile-data"),
]


NO_CPU_SMOKE = ("--reps", "1")  # without CUDA: exit 2 naming --cpu-smoke


@pytest.fixture(scope="module")
def bad_flag_runs():
    """{argv: (returncode, stdout, stderr)} of `step_overhead.py ARGV` for every BAD_FLAGS case and NO_CPU_SMOKE, all
    run in one interpreter (`_tool_runs.run_tools`: each case as its command line would, without a process each)."""
    argvs = [argv for argv, _ in BAD_FLAGS] + [list(NO_CPU_SMOKE)]
    return dict(zip(map(tuple, argvs), run_tools([("tools/step_overhead.py", argv) for argv in argvs], _env())))


@pytest.mark.parametrize("argv, flag", BAD_FLAGS)
def test_step_overhead_bad_flags_exit_2(argv, flag, bad_flag_runs):
    returncode, _, stderr = bad_flag_runs[tuple(argv)]
    assert returncode == 2 and flag in stderr and "Traceback" not in stderr, (returncode, stderr[-2000:])


@pytest.mark.parametrize("arms, run, pipelines", [
    ("reused,prefetched+meta", ["reused", "prefetched+meta"], 1),
    ("prefetched", ["reused", "prefetched"], 1),  # reused always runs; the pipeline then without metadata
    ("fresh", ["fresh", "reused"], 0),  # no prefetched arm: no pipeline, no worker
    ("ahead", ["reused", "ahead"], 1),  # the device prefetcher over the pipeline, items with metadata
])
def test_step_overhead_arms_subset(one_process_runs, arms, run, pipelines):
    from step_overhead import COLUMNS

    returncode, stdout, stderr, tmp_path = one_process_runs[f"arms={arms}"]
    p = subprocess.CompletedProcess([], returncode, stdout, stderr)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (r,) = json.loads((tmp_path / "step_overhead_cp1.json").read_text())["rows"]
    assert r["arms"] == run and r["data_pipelines_max_alive"] == pipelines, r
    assert r["data_worker_processes"] == pipelines, r
    assert r["pipeline_metadata"] == ("prefetched+meta" in run or "ahead" in run), r
    assert r["pct_of"] == ("fresh" if "fresh" in run else "reused"), r
    wall = {"fresh": "step_fresh_ms", "reused": "step_reused_ms", "prefetched": "step_prefetched_ms",
            "prefetched+meta": "step_prefetched_meta_ms", "ahead": "step_ahead_ms"}
    loss = {"fresh": "loss_fresh", "reused": "loss_reused", "prefetched": "loss_prefetched",
            "prefetched+meta": "loss_prefetched_meta", "ahead": "loss_ahead"}
    for arm, key in wall.items():  # an arm not run: no time (NaN, '-' in the table), no loss, no prepares
        assert (math.isfinite(r[key]) and r[key] > 0) if arm in run else math.isnan(r[key]), (arm, r)
        assert (r[loss[arm]] == r["loss_reused"]) if arm in run else r[loss[arm]] is None, (arm, r)
    assert r["prepares_per_step_reused"] == [0] and r["loss_max_abs_diff"] == 0.0, r
    if "prefetched+meta" in run:
        assert r["prepares_per_step_prefetched_meta"] == [0] and math.isfinite(r["overhead_prefetched_meta_ms"])
    if "ahead" in run:
        assert r["prepares_per_step_ahead"] == [0] and math.isfinite(r["overhead_ahead_ms"])
    if "prefetched" in run:
        assert r["prepares_per_step_prefetched"] == [1] and math.isfinite(r["overhead_prefetched_ms"])
    if "fresh" not in run:
        assert r["prepares_per_step_fresh"] == [] and math.isnan(r["overhead_ab_ms"]), r
        assert "% of step: of the REUSED step" in p.stdout
    lines = p.stdout.strip().splitlines()
    assert lines[-3] == "| " + " | ".join(COLUMNS) + " |" and lines[-1].startswith("| 256 | 1 |"), lines[-4:]


def test_williams_orders_balanced():
    """The arms' orders: a Williams design of all arms; the four-arm square as before; for any subset every arm once in every position and
    right after every other arm equally often."""
    from step_overhead import ARMS, ORDERS, williams_orders

    assert ORDERS == williams_orders(ARMS) and len(ORDERS) == 2 * len(ARMS) == 10
    assert williams_orders("abcd") == [tuple("abcd"[i] for i in row)
                                       for row in ((0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1))]
    for n in range(1, 6):
        arms = tuple(range(n))
        rows = williams_orders(arms)
        assert all(sorted(r) == list(arms) for r in rows)
        for pos in range(n):
            assert sorted(r[pos] for r in rows).count(0) == len(rows) // n
        pairs = [(r[i], r[i + 1]) for r in rows for i in range(n - 1)]
        if n > 1:
            assert len({pairs.count((a, b)) for a in arms for b in arms if a != b}) == 1, (n, rows)


def test_one_pipeline_per_process_guard_and_metadata_drop():
    """The tool refuses a second live pipeline; the prefetched arm's item, taken from the shared pipeline whose
    items carry the metadata, uploads exactly the bytes a pipeline without metadata would (the same fields)."""
    import types

    import numpy as np
    import torch

    import step_overhead as so
    from megatron_splitkv.data.pipeline import MetadataSpec, plan_batch
    from megatron_splitkv.data.sharegpt import make_packed_batch

    so.PIPELINES["alive"] = 1
    try:
        with pytest.raises(RuntimeError, match="second data pipeline"):
            with so.Workload.pipeline(types.SimpleNamespace()):
                pass
    finally:
        so.PIPELINES["alive"] = 0
    rng = np.random.default_rng(0)
    batch = make_packed_batch([(rng.integers(0, 200, size=300), np.ones(300, dtype=bool))], num_anchors=8, rng=rng)
    kw = dict(cp_size=2, cp_rank=1, block_size=16, mask_token_id=255)
    spec = MetadataSpec(num_heads_q=4, num_heads_kv=2, head_dim=16, dtype=torch.float32)
    plain, with_meta = plan_batch(batch, **kw), plan_batch(batch, metadata=spec, **kw)
    dropped = so._without_metadata(with_meta)
    assert dropped.metadata is None and with_meta.metadata is not None
    assert dropped.buffers[0].numel() == plain.buffers[0].numel() < with_meta.buffers[0].numel()
    assert dropped.buffers[1] == plain.buffers[1]  # the same layout; every field the same bytes (not the padding)
    from megatron_splitkv.data.pipeline import _views

    a, b = _views(dropped.buffers[0], dropped.buffers[1]), _views(plain.buffers[0], plain.buffers[1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    up = dropped.to("cpu")
    assert torch.equal(up.kv_pos, plain.kv_pos) and torch.equal(up.blocks.input_ids, plain.blocks.input_ids)
    assert so._without_metadata(plain) is plain


def test_step_overhead_needs_cuda_without_cpu_smoke(bad_flag_runs):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    returncode, _, stderr = bad_flag_runs[NO_CPU_SMOKE]
    assert returncode == 2 and "--cpu-smoke" in stderr and "Traceback" not in stderr, stderr[-2000:]


def _reuse_worker(rank, world):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_splitkv.dflash import build_draft_blocks
    from megatron_splitkv.megatron.models import DFlashDraftModel, build_target_model, qwen3_config

    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    try:
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        cfg = dict(hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=64)
        target = build_target_model(qwen3_config(num_layers=1, **cfg), vocab_size=64, max_sequence_length=128,
                                    pg_collection=pgs, seed=0)
        torch.manual_seed(0)
        model = DFlashDraftModel(qwen3_config(num_layers=2, **cfg), num_taps=2,
                                 word_embeddings=target.embedding.word_embeddings, output_layer=target.output_layer,
                                 mask_token_id=63, block_size=4, pg_collection=pgs, use_te=False)
        ids = torch.randint(0, 63, (40,))
        blocks = build_draft_blocks(ids, [40], torch.tensor([0, 0]), torch.tensor([5, 20]), block_size=4,
                                    mask_token_id=63)
        kv_seq, kv_pos = torch.zeros(40, dtype=torch.long), torch.arange(40)
        feats = torch.randn(40, 64)
        params = model.packed_seq_params(blocks, kv_seq, kv_pos)
        fresh = float(model(feats, blocks, kv_seq, kv_pos).total)
        first = float(model(feats, blocks, kv_seq, kv_pos, packed_seq_params=params).total)
        meta = dict(params._op_metadata)
        again = float(model(feats, blocks, kv_seq, kv_pos, packed_seq_params=params).total)
        same_meta = len(meta) == 1 and all(params._op_metadata[k] is v for k, v in meta.items())
        errors = []
        for bad in (PackedSeqParams(qkv_format="thd"),
                    model.packed_seq_params(blocks, kv_seq[:30], kv_pos[:30])):
            try:
                model(feats, blocks, kv_seq, kv_pos, packed_seq_params=bad)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        return fresh, first, again, same_meta, errors
    finally:
        ps.destroy_model_parallel()


def test_drafter_packed_seq_params_reuse_hook():
    """`forward(..., packed_seq_params=model.packed_seq_params(...))` gives the loss of a plain call, keeps
    the op metadata cached on the object across calls, and rejects params of another type or batch."""
    fresh, first, again, same_meta, errors = run_distributed(_reuse_worker, 1, timeout=240)[0]
    assert fresh == first == again and same_meta
    assert "got PackedSeqParams" in errors[0], errors
    assert "describes another batch" in errors[1], errors


def test_suite_step_stepcost_cpu(tmp_path):
    """tools/run_gpu_suite.sh's `stepcost` step on CPU: the tool at CP=1 and CP=2, collected and summarised.
    One context (SUITE_STEPCOST_CONTEXTS): the tool's rows at both contexts are test_step_overhead_cpu_smoke's."""
    env = dict(_env(), SUITE_CPU="1", SUITE_STEPS="stepcost", SUITE_STEPCOST_CONTEXTS="512", PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               WORK=str(tmp_path / "work"))
    p = subprocess.run(["bash", "tools/run_gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[s_stepcost_cp1] rc=0" in p.stdout and "[s_stepcost_cp2] rc=0" in p.stdout, p.stdout[-3000:]
    assert "| stepcost: context | CP |" in p.stdout and "| 512 | 2 |" in p.stdout
    suite = json.loads((tmp_path / "out" / "suite.json").read_text())
    assert {"stepcost/step_overhead_cp1.json", "stepcost/step_overhead_cp2.json"} <= set(suite)


def test_step_overhead_skips_a_context_that_runs_out_of_memory(one_process_runs):
    """CP=1: a context whose step raises an out-of-memory error is reported as skipped and the next one
    runs (the error injected by wrapping measure_context in the driver: ONE_PROCESS_RUNS["oom"])."""
    returncode, stdout, stderr, tmp_path = one_process_runs["oom"]
    p = subprocess.CompletedProcess([], returncode, stdout, stderr)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "out of device memory at context 512, CP=1" in p.stderr
    rows = json.loads((tmp_path / "step_overhead_cp1.json").read_text())["rows"]
    assert rows[0] == {"context": 512, "cp": 1, "skipped": "out of memory"} and rows[1]["context"] == 256
    assert "skipped" not in rows[1] and rows[1]["step_fresh_ms"] > 0
    assert "| 512 | 1 | skipped: out of memory |" in p.stdout
