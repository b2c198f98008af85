"""Bad flags of every command-line entry point fail at parse time (issue 24): argparse's error naming the flag
and its limit, exit status 2, no traceback, before any data, model or process is set up; a rank that dies
makes the demo's launcher exit with its message instead of waiting.

The table runs each entry point's `main(argv)` (train_demo, examples/*.py, tools/*.py) in-process and asserts
SystemExit(2) with the flag in stderr; two cases also run as commands to check the whole path (one line, no
traceback). Issue 24's cases: train_demo `--cp 0/-2` (KeyError), `--target-layers 0` (ZeroDivisionError),
`--num-anchors 0` (reshape error in three tracebacks), `--hidden 0` (trained a 64-parameter model), `--steps -1`,
`--threads 0` (hang), `--block-size` named as `block_size`; pretrain_dflash.py --parse-only accepting
`--features-path /nonexistent`, `--mask-token-id -1`, `--target-num-layers -1`, `--sharegpt-limit -3`.
"""

import importlib
import importlib.util
import os
import sys

import pytest
from _dist import run_gloo_forked
from _tool_runs import run_tools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN_BASE = ["--parse-only", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
                 "--transformer-impl", "local", "--ffn-hidden-size", "128"]
FILE = os.path.abspath(__file__)  # an existing file that is not a directory

# (entry point, argv, text the error must contain)
CASES = [
    ("train_demo", ["--cp", "0"], "--cp: must be an int in [1, 16]"),
    ("train_demo", ["--cp", "64"], "--cp: must be an int in [1, 16]"),
    ("train_demo", ["--cp", "-2"], "--cp: must be an int in [1, 16]"),
    ("train_demo", ["--target-layers", "0"], "--target-layers: must be a positive int"),
    ("train_demo", ["--draft-layers", "0"], "--draft-layers: must be a positive int"),
    ("train_demo", ["--target-layers", "2", "--draft-layers", "2"], "--target-layers >= 4"),
    ("train_demo", ["--num-anchors", "0"], "--num-anchors: must be a positive int"),
    ("train_demo", ["--hidden", "0"], "--hidden: must be an int >= 16"),
    ("train_demo", ["--steps", "-1"], "--steps: must be a positive int"),
    ("train_demo", ["--steps", "0"], "--steps: must be a positive int"),
    ("train_demo", ["--threads", "0"], "--threads: must be a positive int"),
    ("train_demo", ["--block-size", "1"], "--block-size: must be an int >= 2"),
    ("train_demo", ["--block-size", "8192"], "--block-size 8192 must be <= --max-tokens 4096"),
    ("train_demo", ["--max-tokens", "1"], "--max-tokens: must be an int >= 2"),
    ("train_demo", ["--limit", "0"], "--limit: must be a positive int"),
    ("train_demo", ["--seed", "-1"], "--seed: must be an int in [0, 4294967295]"),
    ("train_demo", ["--lr", "nan"], "--lr: must be a finite number >= 0"),
    ("train_demo", ["--save", "/tmp/x", "--save-interval", "0"], "--save-interval: must be a positive int"),
    ("train_demo", ["--save", "/proc/no-such-dir/x"], "argument --save: cannot create directory '/proc/no-such-dir/x'"),
    ("train_demo", ["--save-interval", "2"], "--save-interval needs --save"),
    ("train_demo", ["--load", "/tmp/x", "--ckpt-step", "-1"], "--ckpt-step: must be an int >= 0"),
    ("train_demo", ["--load", FILE], "--load"),
    ("train_demo", ["--save", FILE], "--save"),
    ("train_demo", ["--cp-balance", "best"], "--cp-balance: invalid choice"),
    ("pretrain_dflash", ["--features-path", "/nonexistent"], "--features-path: no such directory"),
    ("pretrain_dflash", ["--features-path", FILE], "--features-path: no such directory"),
    ("pretrain_dflash", ["--mask-token-id", "-1"], "--mask-token-id: must be an int >= 0"),
    ("pretrain_dflash", ["--target-num-layers", "-1"], "--target-num-layers: must be a positive int"),
    ("pretrain_dflash", ["--sharegpt-limit", "-3"], "--sharegpt-limit: must be a positive int"),
    ("pretrain_dflash", ["--target-load", "/nonexistent"], "--target-load: no such file or directory"),
    ("pretrain_dflash", ["--target-kv-channels", "0"], "--target-kv-channels: must be a positive int"),
    ("pretrain_dflash", ["--data-seed", "-1"], "--data-seed: must be an int >= 0"),
    ("pretrain_dflash", ["--dflash-sliding-window", "0"], "--dflash-sliding-window: must be a positive int"),
    ("pretrain_dflash", ["--dflash-layer-types", "full_attention,swa"],
     "--dflash-layer-types: must be a comma-separated list of full_attention / sliding_attention"),
    ("pretrain_dflash", ["--dflash-is-causal", "1"], "--dflash-is-causal: invalid choice"),
    ("pretrain_dflash", ["--target-seed", "+3"], "--target-seed: must be an int >= 0"),
    ("examples/op_demo.py", ["--cp", "0"], "--cp: must be a positive int"),
    ("examples/op_demo.py", ["--ctx", "1"], "--ctx: must be an int >= 2"),
    ("tools.bench_attention", ["--kernel-reps", "0"], "--kernel-reps: must be a positive int"),
    ("tools.bench_attention", ["--anchors", "0"], "--anchors: must be a positive int"),
    ("tools.bench_layer_overlap", ["--block-size", "0"], "--block-size: must be a positive int"),
    ("tools.bench_lpt", ["--repeats", "0"], "--repeats: must be a positive int"),
    ("tools.calibrate_cost", ["--iters", "0"], "--iters: must be a positive int"),
    ("tools.chunk_cost", ["--reps", "0"], "--reps: must be a positive int"),
    ("tools.extract_features", ["--out", "/tmp/x", "--max-tokens", "1"], "--max-tokens: must be an int >= 2"),
    ("tools.extract_features", ["--out", "/tmp/x", "--target-load", "/nonexistent"], "--target-load: no such file"),
    ("tools.extract_features", ["--out", "/tmp/x", "--sharegpt-limit", "0"], "--sharegpt-limit: must be a positive"),
    ("tools.host_overhead", ["--context", "0"], "--context: must be a positive int"),
    ("tools.memory_breakdown", ["--cp", "0"], "--cp: must be an int in [1, 64]"),
    ("tools.pipeline_cost", ["--cp-rank", "-1"], "--cp-rank: must be an int >= 0"),
    ("tools.prepare_cost", ["--reps", "0"], "--reps: must be a positive int"),
    ("tools.probe_dense_backends", ["--rows", "0"], "--rows: must be a positive int"),
    ("tools.profile_kernel", ["--iters", "0"], "--iters: must be a positive int"),
    ("tools.profile_op", ["--steps", "0"], "--steps: must be a positive int"),
    ("tools.simulate_scaling", ["--Hq", "0"], "--Hq: must be a positive int"),
    ("tools.simulate_scaling", ["--kernel-tflops", "0"], "--kernel-tflops: must be a finite number > 0"),
    ("tools.simulate_scaling", ["--fwd-fraction", "1.5"], "--fwd-fraction: must be a finite number >= 0 and <= 1"),
    ("tools.staircase_shapes", ["--anchors", "0"], "--anchors: must be a positive int"),
    ("tools.step_overhead", ["--data-workers", "0"], "--data-workers: must be a positive int"),
    ("tools.step_overhead", ["--hidden", "0"], "--hidden: must be a positive int"),
    ("tools.tune_flex", ["--reps", "0"], "--reps: must be a positive int"),
    # an output directory under a file / empty: refused at parse time (was makedirs' traceback at the end of the run)
    ("megatron_splitkv.export", ["--load", ROOT, "--out", os.path.join(FILE, "x")], "is an existing file, not a dir"),
    ("megatron_splitkv.export", ["--load", ROOT, "--out", ""], "argument --out: an empty path"),
    ("train_demo", ["--out-dir", FILE], "argument --out-dir: "),
    ("tools.window_scaling", ["--cpu", "--out", FILE], "argument --out: "),
    ("tools.window_scaling", ["--cpu", "--out", ""], "argument --out: an empty path"),
    ("tools.simulate_scaling", ["--out", os.path.join(FILE, "x")], "argument --out: "),
    ("tools.bench_lpt", ["--out", FILE], "argument --out: "),
    ("tools.extract_features", ["--out", os.path.join(FILE, "x", "y")], "argument --out: "),
    ("tools.bench_attention", ["--out", FILE], "argument --out: "),
    ("tools.chunk_cost", ["--out", FILE], "argument --out: "),
    ("tools.step_overhead", ["--out", FILE], "argument --out: "),
    ("tools.tune_flex", ["--out", FILE], "argument --out: "),
    # a place no directory can be made in (/proc: os.access says writable to root): refused at parse time (the
    # bad flag after it keeps a run short where the check is missing)
    ("train_demo", ["--out-dir", "/proc/x", "--cp", "0"], "argument --out-dir: '/proc/x': cannot create a directory in /proc"),
    ("train_demo", ["--save", "/proc", "--cp", "0"], "argument --save: cannot write in '/proc'"),
    ("tools.chunk_cost", ["--out", "/proc/x/y", "--reps", "0"], "argument --out: '/proc/x/y': cannot create a directory in /proc"),
    ("megatron_splitkv.export", ["--load", ROOT, "--out", "/proc/x"], "argument --out: '/proc/x': cannot create a directory in /proc"),
    # more sequences than context tokens: an error (was a workload of empty sequences, timed as 0 ms)
    ("tools.window_scaling", ["--cpu", "--n-seqs", "1000"], "--n-seqs 1000"),
    ("tools.bench_attention", ["--cpu-smoke", "--n-seqs", "100000"], "--n-seqs 100000 must be <= the smallest"),
]


def _load(entry):
    if entry == "train_demo":
        from examples import train_demo

        return train_demo.main
    if entry == "pretrain_dflash" or entry.startswith("examples/"):
        path = os.path.join(ROOT, "examples", "pretrain_dflash.py" if entry == "pretrain_dflash" else entry[9:])
        name = "faults_" + os.path.basename(path)[:-3]
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            sys.modules[name] = mod
        return sys.modules[name].main
    return importlib.import_module(entry).main


@pytest.mark.parametrize("entry,argv,text", CASES, ids=[f"{e}{' '.join(a)}" for e, a, _ in CASES])
def test_bad_flag_exits_2_naming_it(entry, argv, text, capsys, monkeypatch):
    if entry == "pretrain_dflash":
        pytest.importorskip("megatron.training")
        argv = PRETRAIN_BASE + argv
    monkeypatch.setattr(sys, "argv", [entry, *argv])  # pretrain_dflash's main parses sys.argv
    main = _load(entry)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert text in err, err
    assert "Traceback" not in err


def test_pretrain_dflash_cross_flag_limits(capsys, monkeypatch):
    """Limits between this script's and Megatron's flags (`check_dflash_args`): a SplitKVArgumentError naming
    both flags (the command line prints it as one line, exit 2: test below)."""
    pytest.importorskip("megatron.training")
    from megatron_splitkv.megatron.arguments import SplitKVArgumentError

    main = _load("pretrain_dflash")
    monkeypatch.setattr(sys, "argv", ["pretrain_dflash.py"])
    with pytest.raises(SplitKVArgumentError, match=r"--mask-token-id 2000 must be < 1024 \(--vocab-size 1000 padded"):
        main(PRETRAIN_BASE + ["--vocab-size", "1000", "--mask-token-id", "2000"])
    with pytest.raises(SplitKVArgumentError, match="--target-num-layers 2 must be >= 4 for a drafter of --num-layers 2"):
        main(PRETRAIN_BASE[:2] + ["2"] + PRETRAIN_BASE[3:] + ["--target-num-layers", "2"])
    with pytest.raises(SplitKVArgumentError, match="--dflash-layer-types must name one type per drafter layer: "
                                                   "--num-layers is 1, got 2"):
        main(PRETRAIN_BASE + ["--dflash-layer-types", "sliding_attention,full_attention",
                              "--dflash-sliding-window", "64"])
    with pytest.raises(SplitKVArgumentError, match="--dflash-sliding-window .the window W, an int >= 1. is required"):
        main(PRETRAIN_BASE + ["--dflash-layer-types", "sliding_attention"])
    # inside the padded vocabulary (Qwen3's MASK id 151669 in the padding rows of --vocab-size 151669) is fine
    main(PRETRAIN_BASE + ["--vocab-size", "151669", "--mask-token-id", "151669"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("pretrain_dflash.py --parse-only: OK")


@pytest.fixture(scope="module")
def command_lines(tmp_path_factory):
    """(returncode, stdout, stderr) of the command lines below, run in one interpreter (`_tool_runs.run_tools`,
    each as its command line would): "threads", "mask" (one error line each), and examples/pretrain_dflash.py
    --parse-only against a --target-hf-path whose config.json has vocab_size 1000 and hidden size 32, with
    --hidden-size / --mask-token-id "64/999", "32/1000" (errors) and "32/999" (passes)."""
    pytest.importorskip("megatron.training")
    from transformers import Qwen3Config

    hf = tmp_path_factory.mktemp("hf")
    Qwen3Config(vocab_size=1000, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=64, architectures=["Qwen3ForCausalLM"]).to_json_file(
        str(hf / "config.json"))
    at = PRETRAIN_BASE.index("--hidden-size") + 1
    runs = {"threads": ("examples/train_demo.py", ["--threads", "0"]),
            "mask": ("examples/pretrain_dflash.py", [*PRETRAIN_BASE, "--vocab-size", "1000", "--mask-token-id", "2000"])}
    for hidden, mask in (("64", "999"), ("32", "1000"), ("32", "999")):
        argv = PRETRAIN_BASE[:at] + [hidden] + PRETRAIN_BASE[at + 1:]
        runs[f"{hidden}/{mask}"] = ("examples/pretrain_dflash.py",
                                    [*argv, "--target-hf-path", str(hf), "--mask-token-id", mask])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return dict(zip(runs, run_tools(list(runs.values()), env)))


@pytest.mark.parametrize("name,text", [("threads", "--threads: must be a positive int"),
                                       ("mask", "--mask-token-id 2000 must be < 1024")])
def test_command_line_prints_one_error_line(command_lines, name, text):
    """`python examples/train_demo.py --threads 0`; examples/pretrain_dflash.py with a --mask-token-id
    beyond --vocab-size."""
    rc, _, err = command_lines[name]
    assert rc == 2, err
    assert "Traceback" not in err and text in err, err


def _help_titles(main, monkeypatch, capsys, flag):
    monkeypatch.setattr(sys, "argv", ["pretrain_dflash.py", flag])
    assert main([flag]) is None
    out = capsys.readouterr().out
    return out, [ln[:-1] for ln in out.splitlines() if ln and not ln.startswith(" ") and ln.endswith(":")]


def test_pretrain_dflash_help_shows_our_groups_and_help_all_adds_megatron_after_them(capsys, monkeypatch):
    """--help: only our groups (Split-KV, drafter, target, data, this script) with their defaults, and a last line
    pointing to --help-all (before: 4,000+ lines, Megatron's first); --help-all: ours first, then Megatron-LM's."""
    pytest.importorskip("megatron.training")
    main = _load("pretrain_dflash")
    ours = ["split-kv context parallelism", "dflash drafter", "dflash data", "this script"]
    out, titles = _help_titles(main, monkeypatch, capsys, "--help")
    assert all(t in titles for t in ours), titles
    assert all(t in ours or t.startswith("dflash") for t in titles), titles  # no Megatron-LM group
    assert "--mask-token-id MASK_TOKEN_ID" in out and "(default: 151669)" in out
    assert "--tensor-model-parallel-size TENSOR_MODEL_PARALLEL_SIZE" not in out  # Megatron's own flag line
    assert out.rstrip().splitlines()[-1].endswith("flags (--tensor-model-parallel-size, --seq-length, --save, ...): "
                                                  "--help-all")
    assert len(out.splitlines()) < 400
    out, titles = _help_titles(main, monkeypatch, capsys, "--help-all")
    assert "--tensor-model-parallel-size TENSOR_MODEL_PARALLEL_SIZE" in out
    first_megatron = min(i for i, t in enumerate(titles) if t not in ours and not t.startswith("dflash")
                         and t not in ("options", "usage"))
    assert max(titles.index(t) for t in ours) < first_megatron, titles


def test_demo_help_shows_every_default(capsys):
    from examples import train_demo

    with pytest.raises(SystemExit) as info:
        train_demo.parse_args(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--steps", "30"), ("--cp", "2"), ("--block-size", "16"), ("--threads", "1"),
                          ("--cp-balance", "lpt"), ("--lr", "0.01")):
        assert flag in out and f"(default: {default})" in out, (flag, out)


def _dies(rank, world, args):
    if rank == 1:
        os._exit(7)
    import time

    time.sleep(600)  # rank 0 would wait for rank 1 in a collective forever


def test_a_dead_rank_ends_the_demo_with_its_message(monkeypatch, capsys, tmp_path):
    """train_demo's parent waited on its queue for a rank that had died (`--threads 0` made both ranks die
    before reporting: a hang). The ranks now run through `launch.run_gloo`: a rank that dies ends the run at
    once, the others killed, exit status 2 with the rank and its exit code. (`--random-target`: the ranks are
    the subject, not the demo target, which the default flags would make in ./out/demo first.)"""
    from examples import train_demo
    from tools import launch

    monkeypatch.setattr(launch, "run_gloo", lambda fn, world, *a, **kw: run_gloo_forked(_dies, world, *a, **kw))
    assert train_demo.main(["--steps", "1", "--random-target", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "rank 1 of 2 exited without reporting a result, exit code 7" in err, err


@pytest.mark.parametrize("argv,text", [(["--tree", "/nonexistent", "--out", "/tmp/x"], "--tree: no such file"),
                                       (["--compare", FILE, "/nonexistent"], "--compare: no such file")])
def test_op_bits_paths_must_exist(argv, text, capsys):
    from tools import op_bits

    with pytest.raises(SystemExit) as info:
        op_bits.main(argv)
    assert info.value.code == 2 and text in capsys.readouterr().err


def test_pretrain_dflash_parse_only_checks_the_hf_target(command_lines):
    """--parse-only --target-hf-path DIR reads DIR's config.json against the flags (`check_dflash_args` through
    `read_qwen3_config`): a hidden size other than --hidden-size, or --mask-token-id outside its vocab_size, is
    one error line naming --target-hf-path and the field, exit 2; a matching config.json passes."""
    for name, field in (("64/999", "hidden_size"), ("32/1000", "vocab_size")):
        rc, _, err = command_lines[name]
        assert rc == 2, err
        assert "--target-hf-path" in err and field in err and "Traceback" not in err, err
    rc, out, err = command_lines["32/999"]
    assert rc == 0 and "--parse-only: OK" in out, err


def test_output_dir_refuses_a_dangling_link_on_the_path(tmp_path, capsys):
    """`output_dir` (--out-dir, --out) walked up to the nearest existing parent with os.path.exists, which is
    False for a symbolic link to a missing target or a link loop: such a path passed the parse-time check and
    the command's makedirs failed later, after the run (File exists / No such file). Now argparse's error
    naming the flag and the link; a link to a directory still passes."""
    import argparse

    from megatron_splitkv._ints import output_dir

    (tmp_path / "dang").symlink_to(tmp_path / "missing" / "x")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "real").mkdir()
    (tmp_path / "good").symlink_to(tmp_path / "real")
    for name in ("dang", "dang/", "dang/sub/deeper", "loop1", "loop1/sub"):
        with pytest.raises(argparse.ArgumentTypeError, match="is a symbolic link to nothing"):
            output_dir(str(tmp_path / name))
    for name in ("good", "good/new", "real/new/deeper"):
        path = str(tmp_path / name)
        assert output_dir(path) == path
        os.makedirs(path, exist_ok=True)  # what the command does later: it succeeds where the check passed
    with pytest.raises(SystemExit) as info:  # through an entry point: exit 2 naming the flag, no traceback
        _load("train_demo")(["--out-dir", str(tmp_path / "dang"), "--cp", "0"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "argument --out-dir: " in err and "symbolic link to nothing" in err, err
    assert "Traceback" not in err
