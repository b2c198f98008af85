"""DFlash anchor sampling (DESIGN.md section 1; DFlash drafter training as in arXiv 2611.05926).

Per sequence, up to N anchors (the query budget, default 512) are drawn uniformly without replacement
among the candidate positions a with ``loss_mask[a] = loss_mask[a+1] = 1`` (so the block predicts at
least one supervised token), then sorted. Sequences with fewer candidates get all of them (the caller
pads the rest with invalid blocks, anchor -1).
"""

import numpy as np

from .._ints import as_int

DEFAULT_NUM_ANCHORS = 512


def anchor_candidates(loss_mask) -> np.ndarray:
    """[n_cand] int64 ascending positions a with loss_mask[a] and loss_mask[a+1] (a <= len - 2).

    Args: loss_mask: [S] bool/int array (numpy or torch CPU tensor) of one sequence.
    """
    m = np.asarray(loss_mask).astype(bool).reshape(-1)
    if m.shape[0] < 2:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(m[:-1] & m[1:]).astype(np.int64)


def sample_anchors(loss_mask, num_anchors=DEFAULT_NUM_ANCHORS, *, rng=None, seed=None) -> np.ndarray:
    """Sample the DFlash anchors of one sequence.

    Args:
        loss_mask: [S] bool/int array of one sequence (1 = supervised token, e.g. assistant tokens).
        num_anchors: N >= 0, the most anchors to return.
        rng: a `numpy.random.Generator` (advanced by the call), or
        seed: an int seed for a fresh `numpy.random.default_rng(seed)` (used when rng is None).
            Neither: a fresh unseeded generator (non-deterministic).

    Returns:
        [min(N, n_cand)] int64 sorted ascending distinct anchors, each a candidate (see module
        docstring); uniform without replacement among the candidates. Deterministic for a given seed.

    Raises:
        ValueError: num_anchors < 0.
    """
    num_anchors = as_int(num_anchors, "num_anchors", minimum=0, what="an integer >= 0")
    cand = anchor_candidates(loss_mask)
    if rng is None:
        rng = np.random.default_rng(seed)
    if cand.shape[0] <= num_anchors:
        return cand
    pick = rng.choice(cand.shape[0], size=int(num_anchors), replace=False)
    return np.sort(cand[pick])


def sample_anchors_packed(loss_mask, seq_lens, num_anchors=DEFAULT_NUM_ANCHORS, *, rng=None, seed=None):
    """`sample_anchors` for every sequence of a packed batch (one generator, sequences in order).

    Args:
        loss_mask: [S_total] packed loss mask; seq_lens: [n_seq] lengths summing to S_total.
    Returns: list of n_seq int64 arrays of positions within each sequence (the planner's `anchors`).
    Raises: ValueError when a seq_len is negative, sum(seq_lens) != len(loss_mask) or num_anchors < 0.
    """
    m = np.asarray(loss_mask).reshape(-1)
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if (lens < 0).any():
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()}")
    if int(lens.sum()) != m.shape[0]:
        raise ValueError(f"sum(seq_lens) = {int(lens.sum())} must equal len(loss_mask) = {m.shape[0]}")
    if rng is None:
        rng = np.random.default_rng(seed)
    out, o = [], 0
    for L in lens.tolist():
        out.append(sample_anchors(m[o:o + L], num_anchors, rng=rng))
        o += L
    return out
