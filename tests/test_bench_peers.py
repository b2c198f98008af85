"""The peers' input mappings (tools/peers.py) against our float64 reference, on CPU.

FlexAttention's mask_mod peer runs eagerly on CPU in float64: its output and gradients are compared with
`dflash_attention_reference`. Turbo-dLLM runs on CUDA only: its input mapping is checked instead, by
rebuilding the visible sets from its per-anchor intervals and comparing them with `dflash_attention_mask`
(computed independently, from the metadata, not from the intervals).
"""

import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from megatron_splitkv.reference import dflash_attention_mask, dflash_attention_reference
from tools import peers

B = 4


def _case(seed=0, n_seqs=3, Hq=4, Hkv=2, D=8, dtype=torch.float64):
    """A packed batch of `n_seqs` sequences with shuffled context keys, a padding block, an anchor at 0."""
    g = torch.Generator().manual_seed(seed)
    lens = [7, 12, 5][:n_seqs]
    kv_seq = torch.cat([torch.full((L,), s, dtype=torch.int64) for s, L in enumerate(lens)])
    kv_pos = torch.cat([torch.arange(L) for L in lens])
    perm = torch.randperm(kv_seq.shape[0], generator=g)
    kv_seq, kv_pos = kv_seq[perm], kv_pos[perm]
    q_seq = torch.tensor([0, 0, 1, 1, 1, 2, 0])
    q_anchor = torch.tensor([3, 6, 0, 5, 11, 4, -1])
    nb, Tk = q_seq.shape[0], kv_seq.shape[0]

    def r(*s):
        return torch.randn(*s, generator=g, dtype=dtype).requires_grad_()

    return dict(q=r(nb * B, Hq, D), k_ctx=r(Tk, Hkv, D), v_ctx=r(Tk, Hkv, D), k_blk=r(nb * B, Hkv, D),
                v_blk=r(nb * B, Hkv, D), q_seq=q_seq, q_anchor=q_anchor, kv_seq=kv_seq, kv_pos=kv_pos)


ARGS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk", "q_seq", "q_anchor", "kv_seq", "kv_pos")


def test_flex_peer_matches_reference_forward():
    """Forward only: FlexAttention has no CPU backward (torch 2.11); `bench_attention.py --check` compares
    its gradients with the reference on the GPU."""
    x = _case()
    ref, _ = dflash_attention_reference(*[x[n] for n in ARGS], block_size=B)
    with torch.no_grad():
        out = peers.flex_peer(peers.flex_inputs(*[x[n].detach() for n in ARGS], block_size=B))
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref.detach(), rtol=1e-9, atol=1e-9)
    assert float(out[-B:].abs().max()) == 0.0  # the padding block sees nothing


def test_flex_mask_mod_equals_reference_mask():
    x = _case(seed=1)
    fi = peers.flex_inputs(*[x[n] for n in ARGS], block_size=B)
    qi = torch.arange(fi.q_len)[:, None]
    ki = torch.arange(fi.kv_len)[None, :]
    dense = fi.mask_mod(0, 0, qi, ki)
    want = dflash_attention_mask(x["q_seq"], x["q_anchor"], x["kv_seq"], x["kv_pos"], block_size=B)
    assert torch.equal(dense, want)


def _mask_from_intervals(starts, stops, valid, order, Tk):
    """[n_blocks * B, Tk] visible sets in OUR key order rebuilt from Turbo's packed intervals."""
    packed = torch.zeros(starts.shape[0], Tk, dtype=torch.bool)
    for b, (a, z, ok) in enumerate(zip(starts.tolist(), stops.tolist(), valid.tolist())):
        if ok:
            packed[b, a:z] = True
    ours = torch.zeros_like(packed)
    ours[:, order] = packed  # packed column j is our key order[j]
    return ours.repeat_interleave(B, dim=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_turbo_intervals_equal_reference_visible_sets(seed):
    x = _case(seed=seed)
    t = peers.turbo_inputs(*[x[n] for n in ARGS], block_size=B)
    assert t["context_starts"].dtype == torch.int32 and t["context_stops"].dtype == torch.int32
    Tk = x["k_ctx"].shape[0]
    got = _mask_from_intervals(t["context_starts"][0], t["context_stops"][0], t["anchor_valid"][0], t["order"], Tk)
    want = dflash_attention_mask(x["q_seq"], x["q_anchor"], x["kv_seq"], x["kv_pos"], block_size=B,
                                 own_block=False)
    assert torch.equal(got, want)
    # the packed context is (sequence, position) order and carries our keys' values
    s, p = x["kv_seq"][t["order"]], x["kv_pos"][t["order"]]
    assert bool(((s[1:] > s[:-1]) | ((s[1:] == s[:-1]) & (p[1:] > p[:-1]))).all())
    assert torch.equal(t["global_key"][0], x["k_ctx"][t["order"]])
    assert t["query"].shape == (1,) + tuple(x["q"].shape) and t["local_key"].shape == (1,) + tuple(x["k_blk"].shape)
    assert t["anchor_valid"][0].tolist() == (x["q_anchor"] >= 0).tolist()


def test_turbo_masks_and_shard_layout():
    x = _case()
    t = peers.turbo_inputs(*[x[n] for n in ARGS], block_size=B)
    local, glob = peers.turbo_masks(t, block_size=B, global_anchor_count=14)
    assert glob.global_anchor_count == 14 and local.block_size == B
    keys = [peers.turbo_shard(t, r, 2) for r in range(2)]
    owners = keys[0][2]
    assert [sum(b - a for a, b in o) for o in owners] == [k[0].shape[1] for k in keys]
    assert torch.equal(torch.cat([k[0] for k in keys], 1), t["global_key"])  # contiguous halves, in order


def test_turbo_inputs_rejects_bad_rows():
    x = _case()
    with pytest.raises(ValueError, match="n_blocks"):
        peers.turbo_inputs(x["q"][:-1], *[x[n] for n in ARGS[1:]], block_size=B)


def test_sharegpt_pack_workload():
    from tools.bench_attention import pack_workload

    lens, anchors = pack_workload("sharegpt", 4096, 64, seed=0, limit=200)
    assert lens.sum() <= 4096 and len(lens) > 1
    assert sum(a.shape[0] for a in anchors) <= 64 and sum(a.shape[0] for a in anchors) > 32
    for L, a in zip(lens, anchors):
        assert np.all(np.diff(a) > 0) and (a.shape[0] == 0 or a.max() < L - 1)


def test_pack_cache_round_trip(tmp_path, monkeypatch):
    """--pack-cache: a pack built once is read back equal, without building it again; other keys are added."""
    import tools.bench_attention as ba

    path = str(tmp_path / "packs.json")
    lens, anchors = ba.cached_pack_workload(path, "sharegpt", 4096, 64, seed=0, limit=200)
    ref_lens, ref_anchors = ba.pack_workload("sharegpt", 4096, 64, seed=0, limit=200)
    assert np.array_equal(lens, ref_lens) and all(np.array_equal(a, b) for a, b in zip(anchors, ref_anchors))
    monkeypatch.setattr(ba, "pack_workload", lambda *a, **k: pytest.fail("built again, not read from the cache"))
    lens2, anchors2 = ba.cached_pack_workload(path, "sharegpt", 4096, 64, seed=0, limit=200)
    assert np.array_equal(lens2, ref_lens) and all(np.array_equal(a, b) for a, b in zip(anchors2, ref_anchors))
    monkeypatch.undo()
    ba.cached_pack_workload(path, "one", 1024, 8, seed=1)
    assert len(json.load(open(path))) == 2


def test_split_budget_water_fills():
    from tools.bench_attention import split_budget

    assert split_budget([100, 3, 100], 30).tolist() == [14, 3, 13]
    assert split_budget([2, 1], 30).tolist() == [2, 1]  # fewer candidates than the budget: all of them
    assert split_budget([5, 5, 5], 4).sum() == 4


def test_cli_pack_rows_and_check_on_cpu(tmp_path):
    """The --packs / --check path end to end on CPU (tiny shapes): ours is timed on a ShareGPT pack and a
    one-sequence pack, the GPU-only peers are marked skipped, the check reports ours and flex's errors."""
    import json

    from tools.bench_attention import exit_code, main

    rows = main(["--cpu-smoke", "--peers-only", "--check", "--packs", "1024", "--pack-limit", "40",
                 "--pack-reps", "1", "--pack-profile", "splitkv", "--pack-profile-packs", "1024",
                 "--out", str(tmp_path)])
    assert exit_code(rows) == 0
    data = json.loads((tmp_path / "bench_attention.json").read_text())
    ours = [r for r in data["pack_rows"] if r["method"] == "splitkv"]
    assert sorted(r["kind"] for r in ours) == ["one", "sharegpt"] and all(r["op_ms"] > 0 for r in ours)
    assert all("Self CPU time total" in r["profile"] for r in ours)  # --pack-profile: the table by op (CPU)
    assert {r["method"] for r in data["pack_rows"] if "skipped" in r} == {"turbo", "flex"}
    assert data["check"]["splitkv"] < 0.05 and data["check"]["flex (forward only: no CPU backward)"] < 0.05
    assert "% of dense" in (tmp_path / "bench_attention.md").read_text()


def test_plot_packs(tmp_path):
    import json

    from tools import plot_packs

    rows = [dict(kind="sharegpt", tokens=16384, n_seqs=12, cp=1, method=m, pct_dense=p)
            for m, p in (("splitkv", 21.0), ("turbo", 12.0), ("flex", 25.0))]
    rows += [dict(kind="one", tokens=16384, n_seqs=1, cp=1, method="splitkv", pct_dense=83.0),
             dict(kind="one", tokens=16384, n_seqs=1, cp=1, method="turbo", error="boom"),
             dict(kind="one", tokens=16384, n_seqs=1, cp=2, method="splitkv", pct_dense=70.0)]
    shapes, bars = plot_packs.pack_bars(rows, cp=1)
    assert shapes == ["sharegpt 16K (12 seqs)", "one 16K (1 seq)"]
    assert bars == {"splitkv": [21.0, 83.0], "turbo": [12.0, None], "flex": [25.0, None]}
    src = tmp_path / "b.json"
    src.write_text(json.dumps(dict(pack_rows=rows)))
    plot_packs.main([str(src), "--out", str(tmp_path / "p.png")])
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as e:
        plot_packs.main([str(src), "--cp", "4", "--out", str(tmp_path / "q.png")])
    assert e.value.code == 2 and not (tmp_path / "q.png").exists()


def test_old_tree_method_runs_another_checkout(tmp_path):
    """--old-tree DIR: DIR's megatron_splitkv is imported under another name (its own modules, not this tree's)
    and its op is the pack method splitkv-old, checked against the float64 reference like ours; the flags go
    together and a DIR without the package is an argparse error (exit 2)."""
    from tools import bench_attention as ba

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copytree(os.path.join(root, "megatron_splitkv"), tmp_path / "megatron_splitkv",
                    ignore=shutil.ignore_patterns("__pycache__"))
    sys.modules.pop(ba.OLD_PACKAGE, None)
    try:
        old = ba.load_old_tree(str(tmp_path))
        ops = sys.modules[ba.OLD_PACKAGE + ".ops.splitkv"]
        assert old.__file__.startswith(str(tmp_path)) and ops.__file__.startswith(str(tmp_path))
        assert old.splitkv_attention is not __import__("megatron_splitkv").splitkv_attention
        errs = ba.check_peers(["splitkv", "splitkv-old"], dev=torch.device("cpu"), backend="math")
        assert errs["splitkv"] < 0.05 and errs["splitkv-old"] < 0.05, errs
    finally:
        for name in [m for m in sys.modules if m == ba.OLD_PACKAGE or m.startswith(ba.OLD_PACKAGE + ".")]:
            del sys.modules[name]
    for argv in (["--pack-methods", "splitkv,splitkv-old"], ["--old-tree", str(tmp_path / "nowhere"),
                                                            "--pack-methods", "splitkv,splitkv-old"],
                 ["--pack-methods", "splitkv", "--pack-profile", "turbo"]):
        with pytest.raises(SystemExit) as exc:
            ba.main(["--cpu-smoke", "--peers-only", "--packs", "1024", "--out", str(tmp_path)] + argv)
        assert exc.value.code == 2


def test_fold_method_toggles_the_fa4_kernel_and_restores_it(monkeypatch):
    """The pack method splitkv-fold runs the op with the cached fa4 kernel's `fold_gqa` on and restores the
    previous value afterwards, also when the call raises; with another backend it changes nothing; checked
    against the float64 reference like splitkv."""
    import megatron_splitkv.kernels as kernels
    from tools import bench_attention as ba

    class Kern:
        fold_gqa = False

    kern = Kern()
    monkeypatch.setattr(kernels, "get_kernel", lambda name, *a, **k: kern if name == "fa4" else None)
    seen = []
    with ba._fa4_fold(True, torch.device("cpu"), torch.bfloat16, "fa4"):
        seen.append(kern.fold_gqa)
    with pytest.raises(RuntimeError):
        with ba._fa4_fold(True, torch.device("cpu"), torch.bfloat16, "fa4"):
            seen.append(kern.fold_gqa)
            raise RuntimeError("call failed")
    with ba._fa4_fold(True, torch.device("cpu"), torch.bfloat16, "math"):
        seen.append(kern.fold_gqa)
    assert seen == [True, True, False] and kern.fold_gqa is False
    monkeypatch.undo()
    errs = ba.check_peers(["splitkv", "splitkv-fold"], dev=torch.device("cpu"), backend="math")
    assert errs["splitkv"] < 0.05 and errs["splitkv-fold"] < 0.05, errs


def test_profile_step_reports_wall_host_and_device_time():
    """bench_attention.profile_step: the table by kernel opens with one line of wall, host-issue and device
    time of the profiled step (CPU: no device kernels), and the table lists the step's own ops."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import bench_attention

    a = torch.randn(64, 64)
    text = bench_attention.profile_step(lambda: (a @ a).sum(), torch.device("cpu"), rows=5)
    head, table = text.split("\n", 1)
    assert head.startswith("wall ") and "host issue" in head and "device kernels 0.00 ms in 0 launches" in head
    wall, issue = (float(head.split(w, 1)[1].split(" ms")[0]) for w in ("wall ", "host issue "))
    assert 0 < issue <= wall
    assert "aten::mm" in table
