"""Cost model of the context side of DFlash drafter training, used by the CP planner.

Source: arXiv 2611.05926 (Split-KV), section on LPT load balancing; DESIGN.md section 3.

A context token at position p of sequence j is a key for every query row of every block whose anchor
a > p (DESIGN.md section 1: keys strictly before the anchor), i.e. for ``B * #{anchors a of j : a > p}``
query rows. Summed over a chunk [s, e) of sequence j this is

    pairs(j, s, e) = B * sum_{valid anchors a of j} clamp(a - s, 0, e - s)

visible query-key pairs. The chunk's realized cost is

    cost(j, s, e) = attn_pair_cost * pairs(j, s, e) + token_cost * (e - s)

where ``token_cost`` covers the per-token linear work on the context side (fc projection of the target
features, k_proj/v_proj of every drafter layer, forward and backward).
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Linear cost model: ``cost = attn_pair_cost * visible_pairs + token_cost * tokens``.

    Units are nanoseconds per training step (forward + backward, all drafter layers) on one GPU. Only
    the ratio matters for balance; absolute units make `Plan.loads` readable as time.

    Defaults: measured with `tools/calibrate_cost.py` on one H200 (torch 2.11.0+cu130, bf16, DFlash
    Qwen3-8B drafter shapes: hidden 4096, 32 q / 8 kv heads, head dim 128, 5 layers, fc over 5 target
    layers, B = 16; 2026-11-30, docs/cost_calibration_h200.json):
      * attn_pair_cost = 0.72 ns per visible (query row, key) pair, FlexAttention forward + backward,
        5 layers (0.145 ns per layer; FLOP estimate: 4*Hq*D = 16384 FLOP forward per layer, ~3.5x
        forward+backward, at ~360 TFLOP/s = 0.16 ns).
      * token_cost = 830 ns per context token: fc (forward + weight grad, 336 MFLOP) plus k_proj/v_proj
        (forward + both grads, 50 MFLOP per layer) of 5 layers (FLOP estimate at 600 TFLOP/s: 980 ns).
    So a context token that all 512 anchors of its sequence see costs 0.72 * 16 * 512 + 830 = 6.7 us,
    one that no anchor sees 0.83 us.

    Not modelled: an online target forward on the same shard (add its per-token cost to
    `token_cost`; its causal attention is not linear in tokens), and the query-side work (own-block
    attention, q_proj, MLP on draft blocks), which is equal per rank because query blocks are split
    evenly.
    """

    attn_pair_cost: float = 0.72
    token_cost: float = 830.0

    def __post_init__(self):
        if not (self.attn_pair_cost >= 0 and self.token_cost >= 0):
            raise ValueError(
                f"CostModel coefficients must be >= 0, got attn_pair_cost={self.attn_pair_cost}, "
                f"token_cost={self.token_cost}"
            )


def chunk_pair_counts(anchors_flat, anchor_ptr, chunk_seq, chunk_start, chunk_end):
    """Visible-pair counts per chunk divided by B: ``sum_a clamp(a - s, 0, e - s)`` (vectorised).

    Args:
        anchors_flat: [N_a] int64, the anchors of all sequences concatenated, each sequence's anchors
            sorted ascending and shifted by that sequence's packed offset (so the whole array is sorted).
        anchor_ptr: [n_seq + 1] int64, sequence j's anchors are ``anchors_flat[ptr[j]:ptr[j+1]]``.
        chunk_seq, chunk_start, chunk_end: [n_chunks] int64; chunk_start/end are packed (offset) token
            indices of the same shift as `anchors_flat`.

    Returns:
        [n_chunks] float64 sums (exact integers up to 2**53).

    Uses integer prefix sums and `np.searchsorted`: O(n_chunks log N_a + N_a), no loop over tokens or
    anchors. The sums are exact in int64 (they are at most N_a * max packed index).
    """
    a = np.array(anchors_flat, dtype=np.int64)  # a copy: `_pair_counts_inplace` overwrites it
    return _pair_counts_inplace(a, np.asarray(anchor_ptr, dtype=np.int64), np.asarray(chunk_seq),
                                np.asarray(chunk_start, dtype=np.int64), np.asarray(chunk_end, dtype=np.int64))


def _pair_counts_inplace(a, anchor_ptr, chunk_seq, s, e):
    """`chunk_pair_counts` that overwrites `a` (int64) with its inclusive prefix sums: the planner's
    packed-anchor array is a temporary, and reusing it avoids allocating (and page-faulting) another
    array of N_a int64 per batch."""
    i1 = np.searchsorted(a, s, side="right")  # anchors > s (anchors == s contribute 0)
    i2 = np.searchsorted(a, e, side="left")  # anchors < e
    np.cumsum(a, out=a)  # a[i] = sum of the first i + 1 anchors

    def upto(i):  # sum of the first i anchors
        return np.where(i > 0, a[np.maximum(i - 1, 0)], 0) if a.shape[0] else np.zeros_like(i)

    cnt = np.maximum(i2 - i1, 0)
    inside = (upto(i2) - upto(i1)) * (cnt > 0) - s * cnt  # anchors in (s, e): a - s each
    beyond = (e - s) * (anchor_ptr[chunk_seq + 1] - np.maximum(i2, i1))  # anchors >= e of the sequence
    return (inside + beyond).astype(np.float64)
