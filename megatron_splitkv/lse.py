"""The exact merge of partial attention states by their log-sum-exp (the ground floor of the ops and kernels).

A partial state over a subset of the keys is (o [T, H, D], lse [T, H]) with lse the natural-log sum of the
row's exp(scores); two states of disjoint key sets merge as lse = logaddexp(lse1, lse2), o = o1 * exp(lse1 -
lse) + o2 * exp(lse2 - lse). Rows whose partial lse are all -inf (no visible key) give o = 0 and lse = -inf,
never NaN. Source: DESIGN.md section 2 (forward step 3).
"""

from __future__ import annotations

import torch


def lse_weights(lse: torch.Tensor, m: torch.Tensor):
    """(m_safe, exp(lse - m_safe)) with m_safe = m where finite else 0: rows where every partial lse is
    -inf get weight 0, never NaN. m must be >= lse element-wise (a max over partials)."""
    # nan_to_num(m, 0, 0, 0) == where(isfinite(m), m, 0) bit for bit, in one op instead of six (isfinite is
    # abs, ne, eq, mul; plus the zeros and the select)
    m_safe = torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0)
    return m_safe, torch.exp(lse - m_safe)


def finalize(num: torch.Tensor, den: torch.Tensor, m_safe: torch.Tensor, inplace: bool = False):
    """out = num / den (0 where den = 0), lse = m_safe + log(den) (-inf where den = 0). inplace: divide
    num in place (the same arithmetic, no second [T, H, D] tensor)."""
    den_safe = torch.where(den > 0, den, 1.0)[..., None]  # a scalar 1: no ones_like fill
    out = num.div_(den_safe) if inplace else num / den_safe
    return out, m_safe + torch.log(den)


def merge(o1, lse1, o2, lse2):
    """Exact merge of two partial attention states (o [T, H, D], lse [T, H]) in their dtype. A state
    given as (None, None) is absent (e.g. before ring-kv's first step): the other state is returned
    unchanged."""
    if o1 is None:
        return o2, lse2
    if o2 is None:
        return o1, lse1
    m_safe, w1 = lse_weights(lse1, torch.maximum(lse1, lse2))
    _, w2 = lse_weights(lse2, m_safe)
    return finalize(o1 * w1[..., None] + o2 * w2[..., None], w1 + w2, m_safe, inplace=True)
