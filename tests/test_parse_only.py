"""`examples/pretrain_dflash.py --parse-only` prints, for every flag the run resolves later, what it will
resolve to ('auto (-> X on CUDA, Y on CPU)' where that depends on the machine) instead of None; the returned
namespace is unchanged. `--dflash-host-metadata on --dflash-data-workers 0` is the documented synchronous
mode (help text, --parse-only line). Expected values: the documented rules (docs/megatron.md "Data
pipeline": workers default 1 with CUDA else 0, host metadata on with splitkv and workers > 0; DESIGN.md
section 1: gamma = 7 for B = 16, scaled with B)."""

import argparse
import importlib.util
import os
import sys

import pytest
from _warning_marks import MEGATRON_ENV  # marks of the warnings these tests trigger

pytestmark = MEGATRON_ENV

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--parse-only", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
        "--transformer-impl", "local", "--ffn-hidden-size", "128"]


@pytest.fixture(scope="module")
def pre():
    spec = importlib.util.spec_from_file_location("pretrain_dflash_po", os.path.join(ROOT, "examples", "pretrain_dflash.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _parse(pre, capsys, monkeypatch, *extra):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    capsys.readouterr()
    args = pre.main([*BASE, *extra])
    printed = capsys.readouterr().out
    return args, printed


def test_parse_only_prints_resolved_values_not_none(pre, capsys, monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):  # the automatic CP ranks per node: 1 without them
        monkeypatch.delenv(name, raising=False)
    args, out = _parse(pre, capsys, monkeypatch, "--context-parallel-impl", "splitkv", "--block-size", "4")
    # runtime-resolved flags: their values, not None
    lines = out.splitlines()
    for want in ("dflash_data_workers = 'auto (-> 1 on CUDA, 0 on CPU)'",
                 "dflash_host_metadata = 'auto (-> on on CUDA, off on CPU)'",
                 "dflash_data_prefetch = 2", "dflash_device_prefetch = 'on'", "splitkv_no_overlap_q_gather = False",
                 "loss_decay_gamma = 1.75",  # 7 * 4 / 16
                 "target_ffn_hidden_size = '128 (--ffn-hidden-size)'",
                 "target_num_attention_heads = '4 (--num-attention-heads)'"):
        assert want in lines, want
    assert any(ln.startswith("splitkv_cp_ranks_per_node = 'auto -> 1 (") for ln in lines)  # auto_cp_ranks_per_node
    for flag in ("dflash_data_workers", "dflash_data_prefetch", "dflash_host_metadata", "dflash_device_prefetch",
                 "loss_decay_gamma",
                 "splitkv_cp_ranks_per_node", "splitkv_no_overlap_q_gather", "cp_chunk_size", "target_ffn_hidden_size",
                 "splitkv_num_chunks", "splitkv_chunk_axis"):
        assert f"{flag} = None" not in lines, flag
    # one node (no launcher size): the automatic pipeline is off, and says why
    assert any(ln.startswith("splitkv_pipeline_auto = 'auto -> off (no launcher size per node") for ln in lines)
    assert "splitkv_num_chunks = 'auto -> 1 (splitkv_pipeline_auto)'" in lines
    # the namespace the caller gets is the parsed one (resolution stays at run time)
    assert args.dflash_data_workers is None and args.dflash_host_metadata is None and args.loss_decay_gamma is None


def test_parse_only_prints_one_sorted_name_value_line_per_flag(pre, capsys, monkeypatch):
    """--parse-only printed `Namespace(a=1, b=2, ...)` on one line (hundreds of flags); now one `name = value`
    line per attribute of the shown namespace, sorted by name, every attribute once, values as repr()."""
    import re

    args, out = _parse(pre, capsys, monkeypatch, "--context-parallel-impl", "splitkv", "--block-size", "4")
    lines = out.splitlines()
    assert len(lines) > 100 and not out.startswith("Namespace(")
    # the last line: the one-line verdict (issue 21 item 5)
    assert lines[-1] == pre.parse_only_verdict(args) and lines[-1].startswith("pretrain_dflash.py --parse-only: OK, ")
    lines = lines[:-1]
    names = []
    for line in lines:
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*) = (.+)", line)
        assert m, line
        names.append(m.group(1))
    assert names == sorted(names) and len(set(names)) == len(names)
    assert set(names) == set(vars(pre._shown_args(args)))
    assert "num_layers = 2" in lines and "hidden_size = 64" in lines and "context_parallel_impl = 'splitkv'" in lines
    assert "dflash_block_size = 4" in lines


@pytest.mark.parametrize("extra, workers, host", [
    (("--context-parallel-impl", "splitkv", "--dflash-data-workers", "2"), "2", "'on'"),
    (("--context-parallel-impl", "splitkv", "--dflash-data-workers", "0"), "0", "'off'"),
    (("--context-parallel-impl", "allgather-kv"), "'auto (-> 1 on CUDA, 0 on CPU)'", "'off'"),
    (("--context-parallel-impl", "splitkv", "--dflash-data-workers", "3", "--dflash-host-metadata", "off"), "3",
     "'off'"),
])
def test_parse_only_host_metadata_follows_workers(pre, capsys, monkeypatch, extra, workers, host):
    _, out = _parse(pre, capsys, monkeypatch, *extra)
    lines = out.splitlines()
    assert f"dflash_data_workers = {workers}" in lines and f"dflash_host_metadata = {host}" in lines


def test_ranks_per_node_from_the_flag(pre, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    capsys.readouterr()
    pre.main([*BASE, "--context-parallel-impl", "splitkv", "--context-parallel-size", "16",
              "--dflash-num-anchors", "16", "--splitkv-cp-ranks-per-node", "8"])
    out = capsys.readouterr().out
    assert "splitkv_cp_ranks_per_node = 8" in out.splitlines(), out
    assert any(line.startswith("splitkv_config = SplitKVConfig(") and "cp_ranks_per_node=8" in line
               for line in out.splitlines()), out


def test_synchronous_host_metadata_is_documented(pre, capsys, monkeypatch):
    """--dflash-host-metadata on with --dflash-data-workers 0: accepted as the synchronous mode, and said
    so (the flag's help and the --parse-only line), not silently."""
    from megatron_splitkv.megatron import add_splitkv_args
    from megatron_splitkv.megatron.arguments import host_metadata_from_args

    args, out = _parse(pre, capsys, monkeypatch, "--context-parallel-impl", "splitkv", "--dflash-data-workers", "0",
                       "--dflash-host-metadata", "on")
    assert host_metadata_from_args(args, 0) is True
    assert ("dflash_host_metadata = 'on (synchronous: built on the host in forward_step, --dflash-data-workers 0)'"
            in out.splitlines())
    p = add_splitkv_args(argparse.ArgumentParser())
    help_text = " ".join(p.format_help().split())
    assert "'on' with --dflash-data-workers 0 is the synchronous mode" in help_text


def test_help_lists_parse_only(pre, capsys, monkeypatch):
    """`--help` documents `--parse-only` (it was handled by main() but missing from the help output), and the
    namespace --parse-only returns has no parse_only attribute (the flag is main()'s, not the run's)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    capsys.readouterr()
    assert pre.main(["--help"]) is None
    out = " ".join(capsys.readouterr().out.split())
    assert "--parse-only CPU check of a command line" in out, out[-3000:]
    assert "exit without training" in out
    args, _ = _parse(pre, capsys, monkeypatch)
    assert not hasattr(args, "parse_only")


def test_parse_only_command_line_prints_no_machine_warnings():
    """`python examples/pretrain_dflash.py ... --parse-only` on a CPU machine: stderr was ~20 lines of
    megatron-core's import-time UserWarnings (Transformer Engine / Apex / absl not installed) and torch's
    "No CUDA runtime is found" before the namespace; they describe the machine, not the flags, and are not
    shown. A bad flag is still its one error line (exit status 2)."""
    import subprocess

    script = os.path.join(ROOT, "examples", "pretrain_dflash.py")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, script, *BASE, "--context-parallel-impl", "splitkv"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "context_parallel_impl = 'splitkv'" in p.stdout.splitlines()
    assert "Warning" not in p.stderr and "No CUDA runtime" not in p.stderr, p.stderr
    p = subprocess.run([sys.executable, script, *BASE, "--context-parallel-impl", "splitkv", "--cp-chunk-size", "0"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "pretrain_dflash.py: error: --cp-chunk-size must be a positive number of tokens, got 0"], p.stderr


@pytest.mark.parametrize("extra", [("--bf16",), ()])
def test_parse_only_shows_the_automatic_pipeline_across_nodes(pre, capsys, monkeypatch, extra):
    """A CP group spanning nodes (LOCAL_WORLD_SIZE=8, CP 16): --parse-only shows the automatic pipeline (2 head
    chunks, whatever the kernel) as the two flags' values and its reason; the
    record of the automatic config fields (splitkv_auto_fields) is not shown; the config carries them."""
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args, out = _parse(pre, capsys, monkeypatch, "--context-parallel-impl", "splitkv", "--context-parallel-size", "16",
                       *extra)
    lines = out.splitlines()
    for want in ("splitkv_num_chunks = 'auto -> 2 (splitkv_pipeline_auto)'",
                 "splitkv_chunk_axis = 'auto -> heads (splitkv_pipeline_auto)'",
                 "splitkv_cp_ranks_per_node = 'auto -> 8 (LOCAL_WORLD_SIZE=8 / TP 1)'"):
        assert want in lines, (want, [ln for ln in lines if ln.startswith("splitkv")])
    label = "2 head chunks"
    assert any(ln.startswith(f"splitkv_pipeline_auto = 'auto -> {label} (LOCAL_WORLD_SIZE=8 / TP 1 = 8 CP ranks per "
                             "node < CP 16: the group spans nodes; 4 kv heads per TP rank") for ln in lines), lines
    assert not any(ln.startswith("splitkv_auto_fields") for ln in lines)
    assert any(ln.startswith("splitkv_config = SplitKVConfig(num_chunks=2, chunk_axis='heads'") for ln in lines), lines
