"""Pieces shared by Split-KV attention and its two baselines (one copy of each, used by all three ops).

- context sorting by (sequence id, position) and per-block key intervals (`IntervalMask`).
- the lse merge (`lse_weights`, `finalize`, `merge`): fp32 accumulation, rows whose partial lse are all
  -inf give O = 0 and lse = -inf, never NaN.
- dense B x B own-block attention forward/backward (batched matmul, float32/float64); absent when the
  call passes k_blk = v_blk = None (plain cross-attention: rows attend only the context).
- empty-input guards around the local kernel.

Validation, the size all-gather and the per-step metadata (sort order, intervals) live in
`ops/metadata.py` (`prepare_splitkv_metadata`, `SplitKVMetadata`, `run_op`).

Source: arXiv 2611.05926 (Split-KV), DESIGN.md sections 1 (mask) and 2 (algorithm).
"""

from __future__ import annotations

import torch

from ..kernels.base import IntervalMask

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INT32 = 1 << 31  # sequence ids and positions must lie in [-2**31, 2**31)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- sorting and intervals


def context_keys(kv_seq: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
    """One int64 key per context token, ordered like (seq, pos): seq * 2**32 + (pos + 2**31)."""
    return kv_seq * (1 << 32) + (kv_pos + _INT32)


def sort_keys(keys: torch.Tensor):
    """Return (sorted keys, order) with keys_sorted = keys[order]; order is None when already sorted
    (no copy). The already-sorted test is one host sync: called once per step, at metadata time."""
    if keys.numel() <= 1 or bool((keys[1:] >= keys[:-1]).all()):
        return keys, None
    return torch.sort(keys, stable=True)


def sorted_context(meta, k_ctx, v_ctx):
    """This rank's context K/V in sorted (seq, pos) order using the metadata's precomputed `order`
    (no copy when the context is already sorted: order None). No host sync."""
    if meta.order is None:
        return k_ctx.contiguous(), v_ctx.contiguous()
    return k_ctx[meta.order], v_ctx[meta.order]


def unsort(x_sorted: torch.Tensor, order):
    """Inverse of `x[order]` along dim 0 (identity when order is None)."""
    if order is None:
        return x_sorted
    return torch.empty_like(x_sorted).index_copy_(0, order, x_sorted)


def intervals(keys_sorted, block_seq, block_anchor, block_size) -> IntervalMask:
    """IntervalMask of blocks against sorted context keys: block b sees keys of sequence block_seq[b]
    with position < block_anchor[b] (strictly); blocks with anchor < 0 see nothing."""
    base = block_seq * (1 << 32)
    lo = torch.searchsorted(keys_sorted, base)
    # keys with pos < anchor  <=>  key <= base + (anchor - 1) + 2**31 (searchsorted right). The anchor is
    # clamped to [0, 2**31] (positions lie in [-2**31, 2**31): anchor 2**31 already sees every position),
    # so the bound is at most (2**31 - 1) * 2**32 + 2**32 - 1 = 2**63 - 1 and never wraps in int64.
    # Anchors < 0 (invalid blocks) get the empty interval [lo, lo).
    hi = torch.searchsorted(keys_sorted, base + (block_anchor.clamp(0, _INT32) + (_INT32 - 1)), right=True)
    hi = torch.where(block_anchor >= 0, hi, lo)
    return IntervalMask(block_size, lo, hi, int(keys_sorted.shape[0]))


def pad_rows(x: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    """Pad dim 0 of x to `rows` with `value`."""
    if x.shape[0] == rows:
        return x
    pad = x.new_full((rows - x.shape[0],) + tuple(x.shape[1:]), value)
    return torch.cat([x, pad], 0)


# ----------------------------------------------------------------------------- merge by lse


def lse_weights(lse: torch.Tensor, m: torch.Tensor):
    """(m_safe, exp(lse - m_safe)) with m_safe = m where finite else 0: rows where every partial lse is
    -inf get weight 0, never NaN. m must be >= lse element-wise (a max over partials)."""
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m_safe, torch.exp(lse - m_safe)


def finalize(num: torch.Tensor, den: torch.Tensor, m_safe: torch.Tensor):
    """out = num / den (0 where den = 0), lse = m_safe + log(den) (-inf where den = 0)."""
    out = num / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return out, m_safe + torch.log(den)


def merge(o1, lse1, o2, lse2):
    """Exact merge of two partial attention states (o [T, H, D], lse [T, H]) in their dtype. A state
    given as (None, None) is absent (no own block): the other state is returned unchanged."""
    if o1 is None:
        return o2, lse2
    if o2 is None:
        return o1, lse1
    m_safe, w1 = lse_weights(lse1, torch.maximum(lse1, lse2))
    _, w2 = lse_weights(lse2, m_safe)
    return finalize(o1 * w1[..., None] + o2 * w2[..., None], w1 + w2, m_safe)


# ----------------------------------------------------------------------------- own block (B x B dense)


def _block_views(q, k_blk, v_blk, block_size, acc, valid):
    """Blocked views in `acc`; rows of invalid blocks are SELECTED to 0 (not multiplied), so a NaN/inf
    in an invalid block's q/k/v never reaches any output or gradient (0 * NaN = NaN in the einsums)."""
    tq, hq, d = q.shape
    hkv = k_blk.shape[1]
    nb = tq // block_size
    v4 = valid.view(-1, 1, 1, 1)
    qb = torch.where(v4[..., None], q.to(acc).view(nb, block_size, hkv, hq // hkv, d), 0)
    kb = torch.where(v4, k_blk.to(acc).view(nb, block_size, hkv, d), 0)
    vb = torch.where(v4, v_blk.to(acc).view(nb, block_size, hkv, d), 0)
    return qb, kb, vb


def own_block_forward(q, k_blk, v_blk, valid, block_size, scale, acc):
    """Each query block attends its own B keys (bidirectional); invalid blocks: out 0, lse -inf.
    Returns out [Tq, Hq, D], lse [Tq, Hq] in `acc`; (None, None) when k_blk is None (no own block,
    an absent state for `merge`)."""
    if k_blk is None:
        return None, None
    tq, hq, d = q.shape
    qb, kb, vb = _block_views(q, k_blk, v_blk, block_size, acc, valid)
    s = torch.einsum("nikgd,njkd->nkgij", qb, kb) * scale
    lse = torch.logsumexp(s, -1)  # [nb, Hkv, G, B]
    o = torch.einsum("nkgij,njkd->nikgd", torch.exp(s - lse[..., None]), vb)
    v5 = valid.view(-1, 1, 1, 1, 1)
    o = torch.where(v5, o, torch.zeros_like(o)).reshape(tq, hq, d)
    lse = torch.where(valid.view(-1, 1, 1, 1), lse, torch.full_like(lse, float("-inf")))
    return o, lse.permute(0, 3, 1, 2).reshape(tq, hq)


def own_block_backward(q, k_blk, v_blk, valid, block_size, scale, dout, lse, delta, acc):
    """Own-block gradients with the GLOBAL lse and delta ([Tq, Hq]); returns dq, dk_blk, dv_blk in acc,
    or (None, None, None) when k_blk is None (no own block)."""
    if k_blk is None:
        return None, None, None
    tq, hq, d = q.shape
    qb, kb, vb = _block_views(q, k_blk, v_blk, block_size, acc, valid)
    nb, bsz, hkv, g, _ = qb.shape

    def heads_first(x):  # [Tq, Hq] -> [nb, Hkv, G, B, 1]
        return x.to(acc).view(nb, bsz, hkv, g).permute(0, 2, 3, 1)[..., None]

    lse_g = heads_first(lse)
    ok = torch.isfinite(lse_g) & valid.view(-1, 1, 1, 1, 1)
    s = torch.einsum("nikgd,njkd->nkgij", qb, kb) * scale
    p = torch.where(ok, torch.exp(s - torch.where(ok, lse_g, torch.zeros_like(lse_g))), torch.zeros_like(s))
    do = torch.where(valid.view(-1, 1, 1, 1, 1), dout.to(acc).view(nb, bsz, hkv, g, d), 0)
    dv = torch.einsum("nkgij,nikgd->njkd", p, do)
    ds = torch.where(ok, p * (torch.einsum("nikgd,njkd->nkgij", do, vb) - heads_first(delta)), 0)
    dq = torch.einsum("nkgij,njkd->nikgd", ds, kb) * scale
    dk = torch.einsum("nkgij,nikgd->njkd", ds, qb) * scale
    return dq.reshape(tq, hq, d), dk.reshape(tq, hkv, d), dv.reshape(tq, hkv, d)


def add_grad(a, b):
    """a + b where either may be None (an absent own-block gradient)."""
    return a if b is None else b if a is None else a + b


def cast(t, dtype):
    """t.to(dtype), None passing through (the gradients of k_blk = v_blk = None)."""
    return None if t is None else t.to(dtype)


# ----------------------------------------------------------------------------- kernel guards


def kernel_forward(plan, q, k, v, mask: IntervalMask):
    """Local kernel forward; empty queries or keys short-circuit to (0, -inf, None)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=plan.acc, device=q.device)
        return out, torch.full(q.shape[:2], float("-inf"), dtype=plan.acc, device=q.device), None
    out, lse, state = plan.kernel.forward(q, k, v, mask, plan.scale)
    return out.to(plan.acc), lse.to(plan.acc), state


def kernel_backward(plan, q, k, v, mask, dout, lse, delta, state):
    """Local kernel backward with the global lse/delta; empty inputs give zero gradients (acc dtype)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        z = lambda t: torch.zeros(t.shape, dtype=plan.acc, device=q.device)  # noqa: E731
        return z(q), z(k), z(v)
    dq, dk, dv = plan.kernel.backward(q, k, v, mask, plan.scale, dout, lse, delta, state)
    return dq.to(plan.acc), dk.to(plan.acc), dv.to(plan.acc)


def delta_and_dout(plan, dout, dlse, out, lse, like):
    """delta = rowsum(dO * O_final) - dlse (acc dtype; dlse folds the gradient of a returned lse into
    the same formula: d lse / d s = P). Returns (dout as a tensor shaped like `like`, delta)."""
    if dout is None:
        dout = torch.zeros_like(like)
    delta = (dout.to(plan.acc) * out).sum(-1)
    if dlse is not None:
        delta = delta - torch.where(torch.isfinite(lse), dlse.to(plan.acc), torch.zeros_like(delta))
    return dout, delta
