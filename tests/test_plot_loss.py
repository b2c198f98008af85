"""tools/plot_loss.py: parsing Megatron log lines, the markdown table, and both PNG back ends (CPU)."""

import importlib.util
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("plot_loss", os.path.join(_HERE, "..", "tools", "plot_loss.py"))
plot_loss = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_loss)

CP2 = """\
W1130 03:14:32.131000 2473 torch/distributed/run.py:851] *****
training ...
 [2026-11-30 03:14:57.833543] iteration        1/     100 | consumed samples:            2 | elapsed time per iteration (ms): 3282.8 | learning rate: 1.000000E-03 | global batch size:     2 | lm loss: 1.193346E+01 | planner-imbalance: 6.946757E-04 | loss scale: 1.0 | grad norm: 1.139 | number of skipped iterations:   0 | number of nan iterations:   0 |Number of parameters in most loaded shard in b
[Rank 0] (after 1 iterations) memory (MB) | allocated: 145.65 | max allocated: 374.77
 [2026-11-30 03:14:59.099207] iteration        2/     100 | consumed samples:            4 | elapsed time per iteration (ms): 2274.2 | learning rate: 2.000000E-03 | global batch size:     2 | lm loss: 1.194629E+01 | planner-imbalance: 1.109102E-03 | tokens-per-sec: 2.287827E+03 | loss scale: 1.0 | grad norm: 0.979 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-11-30 03:14:59.918932] iteration        3/     100 | consumed samples:            6 | elapsed time per iteration (ms): 819.6 | learning rate: 1.931492E-03 | global batch size:     2 | lm loss: 1.185695E+01 | planner-imbalance: 5.461770E-04 | tokens-per-sec: 8.613327E+03 | loss scale: 1.0 | grad norm: 0.726 |
 [2026-11-30 03:15:00.0] iteration        4/     100 | consumed samples:            8 | elapsed time per itera
"""
CP1 = """\
 [2026-11-30 03:20:00.000000] iteration        1/     100 | lm loss: 1.193340E+01 | planner-imbalance: 0.000000E+00 | loss scale: 1.0 |
 [2026-11-30 03:20:01.000000] iteration        2/     100 | lm loss: 1.194600E+01 | planner-imbalance: 0.000000E+00 | tokens-per-sec: 1.5E+04 |
"""


def test_parse_numbers():
    run = plot_loss.parse_log(CP2)
    assert sorted(run) == [1, 2, 3]  # the truncated iteration 4 line has no loss: skipped
    assert run[1]["lm loss"] == pytest.approx(11.93346)
    assert run[1]["planner-imbalance"] == pytest.approx(6.946757e-4)
    assert "tokens-per-sec" not in run[1]
    assert run[2]["tokens-per-sec"] == pytest.approx(2287.827)
    assert run[3]["lm loss"] == pytest.approx(11.85695)
    assert run[3]["grad norm"] == pytest.approx(0.726)
    assert run[3]["elapsed time per iteration (ms)"] == pytest.approx(819.6)
    assert run[3]["train iters"] == 100
    # memory lines ("| allocated: ...") carry no iteration field and are not mistaken for one
    assert all("allocated" not in f for f in run.values())


def test_table_and_summary():
    cp2, cp1 = plot_loss.parse_log(CP2), plot_loss.parse_log(CP1)
    table = plot_loss.markdown_table(cp2, cp1).splitlines()
    assert table[0].startswith("| iteration | loss CP=2 | loss CP=1 |")
    assert table[2] == "| 1 | 11.9335 | 11.9334 |  |  | 6.95e-04 |"
    assert table[3] == "| 2 | 11.9463 | 11.9460 | 2288 | 15000 | 1.11e-03 |"
    assert table[4] == "| 3 | 11.8569 |  | 8613 |  | 5.46e-04 |"
    s = plot_loss.summary_lines({"CP=2": cp2, "CP=1": cp1})
    assert s[0].startswith("- CP=2: 3 iterations (1..3 of 100), loss 11.9335 -> 11.8569")
    assert "over 2 common iterations" in s[-1]


def test_main_writes_md_and_png(tmp_path, capsys, monkeypatch):
    a, b = tmp_path / "cp2.log", tmp_path / "cp1.log"
    a.write_text(CP2)
    b.write_text(CP1)
    out = str(tmp_path / "curves")
    plot_loss.main(["--cp2", str(a), "--cp1", str(b), "--out", out])
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-1].startswith("| 3 | 11.8569 |")  # the table is printed last
    assert open(out + ".png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "| iteration |" in open(out + ".md").read()
    # without matplotlib: the standard-library fallback still writes a valid PNG
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_loss.plot_png({"CP=2": plot_loss.parse_log(CP2)}, out + "_plain.png", "t") == "plain"
    data = open(out + "_plain.png", "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
