"""The local attention kernel contract shared by every backend (math, FlexAttention, Transformer Engine).

Split-KV (arXiv 2611.05926, section 3; DESIGN.md section 2) runs, on each CP rank, attention of ALL
gathered queries against this rank's context keys only, then merges partial results by their lse. The
context part of the DFlash mask is, after sorting the local context keys by (sequence id, position), one
contiguous key interval per query block:

    query row i (block b = i // block_size) sees sorted keys j with lo[b] <= j < hi[b]

(`lo[b] == hi[b]` means it sees none: anchor at 0, another sequence, an invalid block or an empty rank).
`IntervalMask` carries exactly that; no dense Tq x Tk mask is ever materialised.

Kernels implement:

    forward(q, k, v, mask, scale) -> (out, lse, state)
        q [Tq, Hq, D], k/v [Tk, Hkv, D] (same dtype: fp16/bf16/fp32/fp64; Hq % Hkv == 0, query head h
        uses kv head h // (Hq // Hkv)). out [Tq, Hq, D] float32 (float64 for float64 inputs), lse
        [Tq, Hq] float32 (float64 for float64 inputs), natural log of sum(exp(scale * q.k)) over visible
        keys; rows with no visible key: out = 0, lse = -inf. `state` is whatever the kernel wants back in
        backward (may be None).

    backward(q, k, v, mask, scale, dout, lse, delta, state) -> (dq, dk, dv)
        dout [Tq, Hq, D] (any float dtype), lse [Tq, Hq] and delta [Tq, Hq] float32/64 are the GLOBAL
        merged log-sum-exp and rowsum(dO * O_final) (DESIGN.md section 2, backward step 2: using this
        rank's own lse or O here is the known bug class, case C1). Returns dq [Tq, Hq, D], dk, dv
        [Tk, Hkv, D], all float32 (float64 for float64 inputs):
            P = exp(scale * q k^T - lse) on visible entries, 0 elsewhere (and on rows with lse = -inf)
            dV = P^T dO ;  dS = P * (dO V^T - delta) ;  dQ = scale * dS K ;  dK = scale * dS^T Q
"""

from dataclasses import dataclass

import torch


@dataclass
class IntervalMask:
    """Context visibility of query blocks as key intervals over sorted local keys.

    Attributes:
        block_size: B, query rows per block (rows are grouped block by block).
        lo, hi: [n_blocks] int64 on the kernel's device; block b sees keys [lo[b], hi[b]).
        num_keys: Tk, the number of local context keys.
    """

    block_size: int
    lo: torch.Tensor
    hi: torch.Tensor
    num_keys: int

    @property
    def num_blocks(self) -> int:
        return int(self.lo.shape[0])
