"""tools/memory_breakdown.py: the live-bytes tracker on a toy computation, and a tiny CP=2 run of the tool
(gloo, CPU) for splitkv and allgather-kv with both kernel stand-ins and the early query gather."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import memory_breakdown as mb  # noqa: E402


def test_tracker_counts_live_bytes():
    a = torch.ones(1000)
    t = mb.LiveBytes()
    with t:
        b = a * 2  # 4000 bytes
        c = b + 1  # 8000 live
        del b  # 4000 live
        d = torch.empty(500)  # 6000 live
        c.add_(1)  # in place: nothing new
        e = c[:10]  # a view: nothing new
    assert t.peak == 8000
    assert t.cur == 6000
    del c, d, e
    assert t.cur == 0
    sites = {site for _, site, _, _ in t.peak_snapshot.values()}
    assert all("test_memory_breakdown.py" in s or "memory_breakdown.py" in s or s for s in sites)


def test_tool_smoke(tmp_path):
    out = tmp_path / "mem.json"
    common = ["--context", "700", "--cp", "2", "--anchors", "8", "--block-size", "4", "--hq", "4", "--hkv", "2",
              "--d", "16", "--dtype", "float32", "--top", "3"]
    s = mb.main(common + ["--json", str(out)])
    assert set(s) == {"splitkv", "allgather-kv"} and out.exists()
    for m, r in s.items():
        assert r["peak_gib"] > r["inputs_gib"] > 0
        assert r["phase_peak_gib"]["backward"] <= r["peak_gib"] + 1e-12
    s2 = mb.main(common + ["--methods", "splitkv", "--kernel", "none", "--query-gather", "--num-chunks", "2"])
    assert s2["splitkv"]["num_chunks"] == 2 and s2["splitkv"]["peak_gib"] > 0
