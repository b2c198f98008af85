"""Split-KV's kernel lanes (`ops.common.KernelLanes`, docs/perf-notes.md item 12) on CUDA: the chunks' local
kernels on alternating side streams, collectives and merges on the caller's stream.

- exactness: CP = 1 with 2-4 chunks (the pipeline runs at P = 1 too: size-1 collectives) against the
  single-process float64 reference, forward and all five gradients, flex and staircase kernels;
- bit-identical to the same call with the lanes off (MEGATRON_SPLITKV_KERNEL_LANES=1);
- stream safety: the op's collectives replaced by DELAYED ones (their result written on a side stream
  after a GPU sleep, the receive buffer NaN until then, `wait()` a stream wait, as NCCL's asynchronous
  work behaves), so a kernel lane that read a received buffer before waiting for it, or the caller's
  stream reading a lane's output before waiting for the lane, gives NaN or a wrong value. The results
  must equal the undelayed run bit for bit.

GPU-only (skipped without CUDA); a 2-GPU NCCL run is in tests/nightly (tests/nightly/run.sh).
"""

import pytest
import torch

from _splitkv_helpers import case, check, delayed_pending, new_seed, run_local

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(seed, k, backend, dtype="bfloat16"):
    # P = 1, one rank with 24 blocks of 16 (3 x 8 for k = 3), two packed sequences, invalid / zero anchors
    return case(seed, 1, B=16, Hq=4, Hkv=2, D=64, dtype=dtype, seq_lens=[700, 333], blocks=[24],
                num_chunks=k, device="cuda", backend=backend)


def _run(c, monkeypatch, lanes):
    monkeypatch.setenv("MEGATRON_SPLITKV_KERNEL_LANES", str(lanes))
    res = run_local("splitkv", c, 0)
    torch.cuda.synchronize()
    return res


def _small_staircase(monkeypatch):
    """Staircase options that give this small case dense rectangles (a fresh kernel instance reads them)."""
    from megatron_splitkv import kernels

    for name, v in (("GROUP_BLOCKS", "8"), ("MIN_GROUP_BLOCKS", "2"), ("SUB_GROUP_BLOCKS", "0"), ("MIN_KEYS", "16"),
                    ("KEY_GRAIN", "16"), ("MIN_PAIRS", "1"), ("KEY_BUCKETS", "0")):
        monkeypatch.setenv("MEGATRON_SPLITKV_STAIRCASE_" + name, v)
    monkeypatch.setattr(kernels, "_CACHE", {})


@pytest.mark.parametrize("backend", ["flex", "staircase", "fa4"])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_lanes_exact(monkeypatch, backend, k):
    """Lanes on: the float64 reference holds. flex: bit-identical to the lanes off (its kernels are
    deterministic); staircase (cuDNN's backward may accumulate dQ in any order) and fa4 (its dQ is
    accumulated with atomics): within bf16 tolerance."""
    if backend == "fa4":
        from megatron_splitkv.kernels.fa4 import fa4_runs_on

        if not fa4_runs_on("cuda", torch.bfloat16, 64):
            pytest.skip("flash_attn.cute (extra 'fa4') not installed or not a Hopper/Blackwell GPU")
    if backend == "staircase":
        _small_staircase(monkeypatch)
    c = _case(new_seed(), k, backend)
    on = _run(c, monkeypatch, 2)
    check("splitkv", c, [on])
    off = _run(c, monkeypatch, 1)
    check("splitkv", c, [off])
    if backend == "flex":
        for key in on:
            assert torch.equal(on[key], off[key]), f"{key}: lanes on vs off differ (seed {c['seed']}, k={k})"
    if backend == "staircase":
        from megatron_splitkv.kernels import get_kernel

        kern = get_kernel("staircase", torch.device("cuda"), torch.bfloat16, 64)
        assert kern.counts["dense_bwd"] > 0, "the staircase case ran no dense call: the test lost its point"


def _delayed(fn_name, stream):
    """A size-1 collective whose result lands late: the receive buffer is NaN-filled on the caller's
    stream, then a side stream (after the caller's work so far, like NCCL) sleeps and copies the input."""
    def coll(x, group, op, async_op=False):
        assert group.size == 1
        p = delayed_pending(x.contiguous(), stream)
        if async_op:
            return p
        return p.wait()

    coll.__name__ = fn_name
    return coll


@pytest.mark.parametrize("backend", ["flex", "fa4"])
@pytest.mark.parametrize("k", [2, 3])
def test_lanes_wait_for_delayed_collectives(monkeypatch, k, backend):
    """flex: bit-identical to the undelayed run; fa4 (dQ accumulated with atomics, so not bit-stable): the
    float64 reference holds for the delayed run (a stream bug gives NaN or garbage, far outside it)."""
    from megatron_splitkv.ops import splitkv as sk

    if backend == "fa4":
        from megatron_splitkv.kernels.fa4 import fa4_runs_on

        if not fa4_runs_on("cuda", torch.bfloat16, 64):
            pytest.skip("flash_attn.cute (extra 'fa4') not installed or not a Hopper/Blackwell GPU")
    c = _case(new_seed(), k, backend)
    plain = _run(c, monkeypatch, 2)
    side = torch.cuda.Stream()
    monkeypatch.setattr(sk, "all_gather", _delayed("all_gather", side))
    monkeypatch.setattr(sk, "all_to_all", _delayed("all_to_all", side))
    for lanes in (2, 1):
        late = _run(c, monkeypatch, lanes)
        if backend == "fa4":
            check("splitkv", c, [late])
            continue
        for key in plain:
            assert torch.equal(late[key], plain[key]), \
                f"{key}: delayed collectives changed the result (lanes={lanes}, seed {c['seed']}, k={k})"
