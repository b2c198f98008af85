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


def test_size_classes_at_real_shapes():
    # the Qwen3-8B drafter shapes at 128K, P = 8: Lq 8192 gathered rows, 1024 local rows, 16384 keys per rank
    c = mb.size_classes(1024, 8192, [16384] * 8)
    assert not c["overlap"]
    assert mb.classify((8192, 32, 128), c) == "query_all"  # gathered Q / dO, partial O, dQ partials
    assert mb.classify((1, 32, 8192), c) == "query_all"  # flex's lse
    assert mb.classify((8192, 32, 2), c) == "query_all"  # gathered (delta, lse)
    assert mb.classify((1024, 32, 128), c) == "query_local"  # q, dout, the merged O, dq
    assert mb.classify((17408, 8, 128), c) == "context"  # K/V with the own block appended
    assert mb.classify((1, 8, 24576, 128), c) == "context"  # flex's padded dK / dV (bucket of 17408)
    assert mb.classify((64,), c) == "other" and mb.classify((), c) == "other"
    # P = 1: the local rows are the gathered rows
    c1 = mb.size_classes(8192, 8192, [131072])
    assert mb.classify((8192, 32, 128), c1) == "query_all" and not c1["query_local"]
    # 16K at P = 2: ~8K keys per rank against 8192 gathered rows: the classes overlap, and say so
    assert mb.size_classes(4096, 8192, [8704, 7680])["overlap"]
    assert mb.split_bytes([(10, (8192, 32, 128)), (5, (17408, 8, 128)), (1, (3,))], c) == dict(
        context=5, query_all=10, query_local=0, other=1)


def test_cp_sweep_splits_the_peak(tmp_path):
    # fixed total context over P = 1, 2 at tiny shapes (Lq 32 rows, 4096 keys: the classes do not overlap)
    out = tmp_path / "sweep.json"
    s = mb.main(["--context", "4096", "--cp-sweep", "1,2", "--anchors", "8", "--block-size", "4", "--hq", "4",
                 "--hkv", "2", "--d", "16", "--dtype", "float32", "--top", "0", "--json", str(out)])
    assert out.exists() and set(s["rows"]) == {"splitkv", "allgather-kv"}
    for m, rows in s["rows"].items():
        assert [r["cp"] for r in rows] == [1, 2]
        assert rows[0]["context_ratio"] == 1.0
        for r in rows:
            assert not r["classes_overlap"]
            parts = r["context_gib"] + r["query_all_gib"] + r["query_local_gib"] + r["other_gib"]
            assert abs(parts - r["peak_gib"]) < 1e-9  # the classes partition the peak
            assert r["context_inputs_gib"] > 0 and r["context_gib"] >= r["context_inputs_gib"]
    sk, ag = s["rows"]["splitkv"], s["rows"]["allgather-kv"]
    assert sk[1]["tk_local"] * 2 <= sk[0]["tk_local"] + 64 and sk[1]["tq_local"] * 2 == sk[0]["tq_local"]
    # splitkv keeps each rank's context where it is: its context part halves with P (up to padding);
    # allgather-kv gathers the whole context on every rank: its context part does not
    assert 0.8 < sk[1]["context_ratio"] < 1.25
    assert ag[1]["context_ratio"] > 1.5
    assert sk[1]["query_all_gib"] > 0  # the gathered query rows appear from P = 2 on
