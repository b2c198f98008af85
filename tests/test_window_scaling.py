"""tools/window_scaling.py (issue 23 item 4) end to end on CPU (--cpu: tiny shapes, math kernel), in-process:
every (P, W, method) row is there; its bytes are `benchlib.predicted_records` of the planner's windowed LPT
layout; its visible pairs equal a brute-force count of the float64 reference's mask; the summary names a
fastest method per (W, P). No timing thresholds."""

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_splitkv.planning import CostModel  # noqa: E402
from megatron_splitkv.reference import dflash_attention_mask  # noqa: E402
from tools import benchlib as bench  # noqa: E402
from tools import window_scaling  # noqa: E402

CTX, CPS, WINDOWS, ANCHORS, B = 192, (1, 2, 3), (3, 24, None), 12, 4


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("window")
    window_scaling.main(["--cpu", "--contexts", str(CTX), "--cps", ",".join(map(str, CPS)), "--windows", "3,24,none",
                         "--anchors", str(ANCHORS), "--out", str(out)])
    with open(out / "window_scaling.json") as f:
        res = json.load(f)
    assert (out / "window_scaling.md").read_text().startswith("# Sliding-window layers")
    return res


def _plan(window, P):
    """The layout the tool must use: the windowed cost model's LPT plan of the same workload."""
    lens, anchors = bench.make_workload(CTX, ANCHORS, seed=CTX)
    cm = CostModel(layer_windows=(window,)) if window is not None else None
    return bench.place(lens, anchors, cp_size=P, block_size=B, cost_model=cm)


def _row(res, window, P, method):
    got = [r for r in res["rows"] if (r["context"], r["window"], r["P"], r["method"]) == (CTX, window, P, method)]
    assert len(got) == 1, (window, P, method, len(got))
    return got[0]


def test_every_row_and_causal_default(result):
    assert not result["cut"] and not result["errors"]
    assert len(result["rows"]) == len(CPS) * len(WINDOWS) * len(window_scaling.METHODS)
    for P in CPS:
        for w in WINDOWS:
            for m in window_scaling.METHODS:
                r = _row(result, w, P, m)
                assert r["causal"] is (w is not None)  # sliding_attention causal, full_attention not
                assert r["backend"] == "math"
                for x in r["links"].values():
                    assert x["step"] == pytest.approx(r["kernel_ms"] + x["comm_ms"])
                    assert x["overlap"] == pytest.approx(max(r["kernel_ms"], x["comm_ms"]))
                    assert (x["comm_ms"] > 0) == (P > 1)


@pytest.mark.parametrize("window", WINDOWS)
def test_bytes_are_the_predicted_records(result, window):
    for P in CPS:
        plan = _plan(window, P)
        nb = [plan.blocks_per_rank] * P
        nc = [int(plan.token_index(r).shape[0]) for r in range(P)]
        for m in window_scaling.METHODS:
            r = _row(result, window, P, m)
            assert r["n_ctx"] == nc and r["n_blocks"] == nb
            want = [bench.predicted_bytes(m, P=P, rank=q, n_blocks=nb, n_ctx=nc, B=B, Hq=4, Hkv=2, D=16, elem=4,
                                          metadata=True) for q in range(P)]
            assert r["comm_bytes"] == want
            assert (sum(want) > 0) == (P > 1)


@pytest.mark.parametrize("window", [3, 24])
def test_windowed_pairs_equal_the_reference_mask(result, window):
    """P = 3: every method's total pairs, and splitkv's per rank (all query blocks vs the rank's keys, plus its
    own blocks' keys), counted from `reference.dflash_attention_mask` (causal windowed layer)."""
    P = 3
    plan = _plan(window, P)
    kv_seq = [torch.as_tensor(plan.token_seq_ids(r), dtype=torch.int64) for r in range(P)]
    kv_pos = [torch.as_tensor(plan.token_positions(r), dtype=torch.int64) for r in range(P)]
    q_seq, q_anchor = torch.as_tensor(plan.q_seq), torch.as_tensor(plan.q_anchor)
    mask = dflash_attention_mask(q_seq, q_anchor, torch.cat(kv_seq), torch.cat(kv_pos), block_size=B,
                                 window=window, causal=True)
    total = int(mask.sum())
    for m in window_scaling.METHODS:
        assert _row(result, window, P, m)["pairs_total"] == total
    nctx = sum(int(x.shape[0]) for x in kv_seq)
    own = mask[:, nctx:]
    start = 0
    pairs = _row(result, window, P, "splitkv")["pairs"]
    for r in range(P):
        n = int(kv_seq[r].shape[0])
        rows = slice(r * plan.blocks_per_rank * B, (r + 1) * plan.blocks_per_rank * B)
        assert pairs[r] == int(mask[:, start:start + n].sum()) + int(own[rows].sum())
        start += n
    assert total > 0 and int(own.sum()) < own.shape[0] * B  # windowed and causal: not every own key


def test_summary_names_a_method_per_window_and_P(result):
    for w in WINDOWS:
        for link in result["links"]:
            for model in window_scaling.MODELS:
                s = [x for x in result["summary"] if (x["window"], x["link"], x["model"]) == (w, link, model)]
                assert len(s) == 1
                assert sorted(int(P) for P in s[0]["fastest"]) == list(CPS)
                for got in s[0]["fastest"].values():
                    assert got["method"] in window_scaling.METHODS
                    assert got["ms"][got["method"]] == min(got["ms"].values())
                assert s[0]["sentence"].startswith(f"{CTX} tokens, ")


def test_bad_flags_exit_2(capsys):
    for argv, flag in ((["--windows", "0"], "--windows"), (["--windows", "abc"], "--windows"),
                       (["--cps", "0"], "--cps"), (["--methods", "foo"], "--methods"),
                       (["--contexts", "1"], "--contexts"), (["--link-gbs", "0"], "--link-gbs")):
        with pytest.raises(SystemExit) as e:
            window_scaling.main(["--cpu"] + argv)
        assert e.value.code == 2
        assert flag in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, twice", [("--windows", "3,3", "3"), ("--windows", "none,24,NONE", "none"),
                                               ("--cps", "1,2,1", "1"), ("--contexts", "256,256", "256"),
                                               ("--methods", f"{window_scaling.METHODS[0]},{window_scaling.METHODS[0]}",
                                                window_scaling.METHODS[0])])
def test_repeated_list_values_exit_2_naming_the_flag(flag, value, twice, capsys):
    """`--windows 3,3` ran the same rows twice (and --contexts / --methods repeats too): a repeated value in a
    comma-list flag is argparse's error (exit 2) naming the flag and the value (benchlib.unique_list, shared by
    the tools' list parsers)."""
    with pytest.raises(SystemExit) as e:
        window_scaling.main(["--cpu", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: {flag} names {twice} more than once in {value!r}: each value once"), err


def test_sample_ranks_and_budget_cut(tmp_path):
    """--sample-ranks times the 2 ranks with the most visible pairs; a spent --budget-s leaves whole groups out."""
    res = window_scaling.main(["--cpu", "--contexts", str(CTX), "--cps", "3", "--windows", "24", "--anchors",
                               str(ANCHORS), "--sample-ranks"])
    for r in res["rows"]:
        top2 = sorted(range(3), key=lambda q: -r["pairs"][q])[:2]
        assert sorted(int(q) for q in r["kernel_ms_by_rank"]) == sorted(top2)
        assert r["kernel_ms"] == max(r["kernel_ms_by_rank"].values())
    res = window_scaling.main(["--cpu", "--contexts", str(CTX), "--cps", "1,2", "--windows", "24,none", "--anchors",
                               str(ANCHORS), "--budget-s", "1e-9", "--out", str(tmp_path)])
    assert res["rows"] == [] and res["summary"] == []
    assert res["cut"] == [f"{CTX}/W={w}/P={P}" for w in ("24", "none") for P in (1, 2)]
    assert "Cut by --budget-s" in (tmp_path / "window_scaling.md").read_text()
