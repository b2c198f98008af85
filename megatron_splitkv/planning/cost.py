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

Sliding-window layers (z-lab dflash 0.1.0 `_attention_mask`; `CostModel.layer_windows`): row j of the block
at anchor a (position a + j) of a layer with window W sees the context positions p with
``a + j - W < p < a``, so only rows j < W - 1 see context at all, and a chunk [s, e) serves

    pairs_W(j, s, e) = sum_{valid anchors a of j} sum_{row = 0}^{min(B, W - 1) - 1}
                       clamp(a - s, 0, e - s) - clamp(max(a + row - W + 1, 0) - s, 0, e - s)

pairs (`chunk_window_pair_counts`). A model that mixes layer types costs the mean over its layers of each
layer's pairs (`CostModel.attn_pair_cost` is per pair seen by every layer). Own-block attention (causal or
not) is query-side work, equal per rank, and not modelled.
"""

from dataclasses import dataclass

import numpy as np

from .._ints import as_int


@dataclass(frozen=True)
class CostModel:
    """Linear cost model: ``cost = attn_pair_cost * visible_pairs + token_cost * tokens``.

    Units are nanoseconds per training step (forward + backward, all drafter layers) on one GPU. Only
    the ratio matters for balance; absolute units make `Plan.loads` readable as time.

    Defaults: measured with `tools/calibrate_cost.py` on one H200 (torch 2.11.0+cu130, bf16, DFlash
    Qwen3-8B drafter shapes: hidden 4096, 32 q / 8 kv heads, head dim 128, 5 layers, fc over 5 target
    layers, B = 16; 2026-11-30, docs/lab/cost_calibration_h200.json):
      * attn_pair_cost = 0.72 ns per visible (query row, key) pair, FlexAttention forward + backward,
        5 layers (0.145 ns per layer; FLOP estimate: 4*Hq*D = 16384 FLOP forward per layer, ~3.5x
        forward+backward, at ~360 TFLOP/s = 0.16 ns).
      * token_cost = 830 ns per context token: fc (forward + weight grad, 336 MFLOP) plus k_proj/v_proj
        (forward + both grads, 50 MFLOP per layer) of 5 layers (FLOP estimate at 600 TFLOP/s: 980 ns).
    So a context token that all 512 anchors of its sequence see costs 0.72 * 16 * 512 + 830 = 6.7 us,
    one that no anchor sees 0.83 us.

    layer_windows: None (default): every drafter layer sees all context keys before the anchor. Otherwise
    one entry per drafter layer: its sliding window W (an int >= 1; `sliding_attention` layers) or None
    (`full_attention`); the attention term then counts, per chunk, the mean over the layers of the pairs
    that layer serves (module docstring; `attn_pair_cost` stays the cost of a pair seen by all layers).
    A list is stored as a tuple. ValueError naming the entry for anything else (bool, float, W < 1, empty).

    Not modelled: an online target forward on the same shard (add its per-token cost to
    `token_cost`; its causal attention is not linear in tokens), and the query-side work (own-block
    attention, q_proj, MLP on draft blocks), which is equal per rank because query blocks are split
    evenly.
    """

    attn_pair_cost: float = 0.72
    token_cost: float = 830.0
    layer_windows: tuple | None = None

    def __post_init__(self):
        if not (self.attn_pair_cost >= 0 and self.token_cost >= 0):
            raise ValueError(
                f"CostModel coefficients must be >= 0, got attn_pair_cost={self.attn_pair_cost}, "
                f"token_cost={self.token_cost}"
            )
        if self.layer_windows is not None:
            if isinstance(self.layer_windows, (str, bytes)) or not hasattr(self.layer_windows, "__len__") \
                    or len(self.layer_windows) == 0:
                raise ValueError("CostModel.layer_windows must be None or a non-empty sequence with one window "
                                 f"(int >= 1, or None for a full-attention layer) per layer, got {self.layer_windows!r}")
            windows = tuple(None if w is None else as_int(w, f"CostModel.layer_windows[{i}]", minimum=1,
                                                          what="a sliding window (int >= 1) or None")
                            for i, w in enumerate(self.layer_windows))
            object.__setattr__(self, "layer_windows", windows)

    def window_counts(self) -> dict:
        """{window (None = full attention): number of drafter layers with it}; {None: 1} without layer_windows."""
        out = {}
        for w in self.layer_windows or (None,):
            out[w] = out.get(w, 0) + 1
        return out


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


def chunk_window_pair_counts(anchors_flat, anchor_ptr, seq_offsets, chunk_seq, chunk_start, chunk_end, *,
                             block_size, window):
    """Visible (query row, context key) pairs per chunk of a sliding-window layer with window `window`
    (module docstring): row j of the block at anchor a sees positions p with ``a + j - W < p < a``.

    Args: as `chunk_pair_counts`, plus seq_offsets: [n_seq + 1] int64 packed offsets of the sequences (a
        window's lower end is clamped to its sequence's start); block_size: B; window: W (int >= 1).
    Returns: [n_chunks] float64 pair counts (not divided by B; exact integers up to 2**53).

    Computed as min(B, W - 1) shifted `chunk_pair_counts`: rows j < W - 1 see ``[0, a) - [0, a + j - W + 1)``;
    O(min(B, W) * (n_chunks log N_a + N_a)).
    """
    block_size = as_int(block_size, "block_size", minimum=1)
    window = as_int(window, "window", minimum=1, what="a sliding window (int >= 1)")
    anchors = np.asarray(anchors_flat, dtype=np.int64)
    ptr = np.asarray(anchor_ptr, dtype=np.int64)
    seq = np.asarray(chunk_seq)
    s = np.asarray(chunk_start, dtype=np.int64)
    e = np.asarray(chunk_end, dtype=np.int64)
    rows = min(block_size, window - 1)
    if rows <= 0:
        return np.zeros(seq.shape[0], dtype=np.float64)
    first = np.repeat(np.asarray(seq_offsets, dtype=np.int64)[:-1], np.diff(ptr))  # each anchor's sequence start
    total = rows * _pair_counts_inplace(anchors.copy(), ptr, seq, s, e)
    for row in range(rows):  # shifted anchors stay sorted and inside their sequence
        total -= _pair_counts_inplace(np.maximum(anchors + (row - window + 1), first), ptr, seq, s, e)
    return total
