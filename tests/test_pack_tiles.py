"""tools/pack_tiles.py: the fa4 tile accounting of real packs (docs/lab/packs_accounting.md), on CPU, small."""

import json

import numpy as np
import pytest
import torch

from megatron_splitkv.kernels.base import IntervalMask
from tools import pack_tiles
from tools.bench_attention import pack_workload, useful_pairs


def test_call_stats_against_brute_force():
    """One call's numbers from a dense [rows, keys] visibility (independent of the tile tables): useful pairs,
    tiles touched by some row (listed tiles), and the folded call's tiles (2 blocks x G heads per 128 rows)."""
    g = torch.Generator().manual_seed(0)
    B, nb, c0 = 16, 24, 640
    lo = torch.randint(0, 300, (nb,), generator=g)
    hi = (lo + torch.randint(0, 300, (nb,), generator=g)).clamp(max=600)
    lo2 = c0 + torch.arange(nb) * B
    mask = IntervalMask(B, lo, hi, c0 + nb * B, lo2, lo2 + B, num_ctx_keys=c0)
    st = pack_tiles.call_stats(mask, Hq=8, Hkv=2, D=16)

    def dense(lo_, hi_, lo2_, hi2_):
        c = torch.arange(mask.num_keys)[None]
        rows = lambda t: t.repeat_interleave(B)[:, None]  # noqa: E731
        return ((c >= rows(lo_)) & (c < rows(hi_))) | ((c >= rows(lo2_)) & (c < rows(hi2_)))

    def tiles(vis):
        r, k = -(-vis.shape[0] // 128) * 128, -(-vis.shape[1] // 128) * 128
        pad = torch.zeros(r, k, dtype=torch.bool)
        pad[: vis.shape[0], : vis.shape[1]] = vis
        return int(pad.view(r // 128, 128, k // 128, 128).any(3).any(1).sum())

    vis = dense(mask.lo, mask.hi, mask.lo2, mask.hi2)
    assert st["useful"] == int(vis.sum())
    assert st["tile_pairs"] == tiles(vis) * 128 * 128
    rep = lambda t: t.repeat_interleave(4)  # noqa: E731
    folded = dense(rep(mask.lo), rep(mask.hi), rep(mask.lo2), rep(mask.hi2))
    assert st["fold_tile_pairs"] == tiles(folded) * 128 * 128 / 4
    assert st["useful"] <= st["fold_tile_pairs"] <= st["tile_pairs"]
    assert st["ctas"] == 4 * st["fold_ctas"] == -(-mask.num_keys // 128) * 8


def test_cli_small_pack(tmp_path):
    """The CLI on a small ShareGPT pack at CP 1 and 2: the useful pairs over the ranks' calls add up to the
    pack's (counted from the anchors alone), tile pairs cover them, the table and JSON are written."""
    out = tmp_path / "t.md"
    assert pack_tiles.main(["--packs", "2048", "--kinds", "sharegpt", "--cp", "1,2", "--pack-limit", "200",
                            "--reps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    _, anchors = pack_workload("sharegpt", 2048, 512, seed=0, limit=200)
    want = useful_pairs(anchors, 16)
    one = [r for r in rows if r["cp"] == 1][0]
    assert one["useful"] == want and one["tile_pairs"] >= one["fold_tile_pairs"] >= want
    assert [r for r in rows if r["cp"] == 2][0]["useful"] >= want / 2  # the slowest rank holds at least half
    assert "| sharegpt 2K |" in out.read_text()
    with pytest.raises(SystemExit) as exc:
        pack_tiles.main(["--kinds", "two"])
    assert exc.value.code == 2
    assert np.isfinite(one["waste"])
