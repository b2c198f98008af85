"""Split-KV's head chunks (`chunk_axis="heads"`, ops/chunking.py `HeadChunks`) on CUDA, bf16, CP = 1
(the pipeline runs at P = 1 too: size-1 collectives):
backends flex and fa4 (skipped where FlashAttention-4 is not installed or the GPU is not Hopper / Blackwell).

Head chunks and row chunks, each against the single-process float64 reference (output, lse and all five
gradients within bf16 tolerance), and head chunks against row chunks within the same tolerance (the kernels
run other tile shapes: not bit-identical). GPU-only (skipped without CUDA).
"""

import pytest
import torch

from _splitkv_helpers import TOL, case, check, new_seed, rel_err, run_local

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(seed, k, backend, axis, Hq=8, Hkv=4):
    # P = 1, one rank with 24 blocks of 16, two packed sequences, invalid / zero anchors; Hkv 4: k = 3 -> 1/1/2
    return case(seed, 1, B=16, Hq=Hq, Hkv=Hkv, D=64, dtype="bfloat16", seq_lens=[700, 333], blocks=[24],
                num_chunks=k, chunk_axis=axis, device="cuda", backend=backend, metadata=True)


def _run(c):
    res = run_local("splitkv", c, 0)
    torch.cuda.synchronize()
    return res


@pytest.mark.parametrize("backend", ["flex", "fa4"])
@pytest.mark.parametrize("k", [2, 3])
def test_head_chunks_match_rows_on_cuda(backend, k):
    if backend == "fa4":
        from megatron_splitkv.kernels.fa4 import fa4_runs_on

        if not fa4_runs_on("cuda", torch.bfloat16, 64):
            pytest.skip("flash_attn.cute (extra 'fa4') not installed or not a Hopper/Blackwell GPU")
    seed = new_seed()
    heads = _case(seed, k, backend, "heads")
    rows = _case(seed, k, backend, "rows")
    on = _run(heads)
    check("splitkv", heads, [on])
    by_rows = _run(rows)
    check("splitkv", rows, [by_rows])
    tol = TOL["bfloat16"]
    for key in on:
        fin = torch.isfinite(by_rows[key])
        assert torch.equal(fin, torch.isfinite(on[key])), key
        assert rel_err(on[key][fin], by_rows[key][fin]) <= tol, f"{key}: heads vs rows (seed {seed}, k={k})"
