"""Single-process dense reference for DFlash drafter attention (the ground truth of every test).

Source: DESIGN.md section 1 (the DFlash mask) after arXiv 2611.05926 (Split-KV), section 2.
"""

import math

import torch

from ._ints import as_int
from .layer_types import MAX_WINDOW


def check_attention_type(window=None, causal=False):
    """The per-layer attention type of DFlash attention as (window, causal), checked.

    window: None (no sliding window) or the sliding window W, an int >= 1 (any `__index__` integer);
    causal: a bool. Semantics (z-lab's dflash 0.1.0, `Qwen3DFlashAttention` / `_attention_mask`): a
    `sliding_attention` layer is window=config.sliding_window, causal=True; a `full_attention` layer
    window=None, causal=False (config.is_causal overrides causal for both). See `dflash_attention_mask`.

    Raises:
        ValueError: "window must be None or a positive int (the sliding window W, 1 <= W < 2**63), got ..." for a
            bool, float, string, 0, negative or >= 2**63 window; "causal must be a bool, got ..." otherwise.
    """
    window = as_int(window, "window", minimum=1, maximum=MAX_WINDOW, allow_none=True,
                    what="None or a positive int (the sliding window W, 1 <= W < 2**63)")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    return window, causal


def own_block_pattern(block_size, window=None, causal=False, device=None):
    """[B, B] bool: row j of a block sees the block's own key i iff (not causal or i <= j) and (window is
    None or (j - i < W and (causal or i - j < W))) (dflash's `_attention_mask` with query position a + j
    and key position a + i)."""
    j = torch.arange(block_size, device=device)[:, None]
    i = torch.arange(block_size, device=device)[None, :]
    pat = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if causal:
        pat &= i <= j
    if window is not None:
        pat &= (j - i) < window
        if not causal:
            pat &= (i - j) < window
    return pat


def dflash_attention_mask(q_seq, q_anchor, kv_seq, kv_pos, *, block_size, own_block=True, window=None,
                          causal=False):
    """Dense boolean mask of DFlash drafter attention over `[context keys | block keys]`.

    Args:
        q_seq, q_anchor: [n_blocks] int64, sequence id and anchor position of each query block;
            `q_anchor < 0` marks an invalid (padding) block, which sees nothing.
        kv_seq, kv_pos: [Tk] int64, sequence id and global position of each context token.
        block_size: B, query rows per block.
        own_block: False: no own-block part (plain cross-attention, the ops' k_blk = v_blk = None).
        window: None or the sliding window W >= 1; causal: causal inside the own block
            (`check_attention_type`; z-lab's dflash 0.1.0 semantics, query row j of block b at position
            q_anchor[b] + j, its own block's key i at q_anchor[b] + i).

    Returns:
        [n_blocks * B, Tk + n_blocks * B] bool: query row r (block b = r // B, offset j = r % B) sees
        context key k iff `kv_seq[k] == q_seq[b] and kv_pos[k] < q_anchor[b]` (strictly) and (window is
        None or `q_anchor[b] + j - kv_pos[k] < window`), and block key `Tk + m` iff `m // B == b` and
        `own_block_pattern(B, window, causal)[j, m % B]`; invalid blocks see nothing. With
        own_block=False: [n_blocks * B, Tk], the context part only.

    Raises:
        ValueError: a bad window / causal (`check_attention_type`).
    """
    window, causal = check_attention_type(window, causal)
    nb = q_seq.shape[0]
    valid = q_anchor >= 0
    ctx = (kv_seq[None, :] == q_seq[:, None]) & (kv_pos[None, :] < q_anchor[:, None]) & valid[:, None]
    own = torch.eye(nb, dtype=torch.bool, device=q_seq.device) & valid[:, None]
    ctx = ctx.repeat_interleave(block_size, dim=0)
    if window is not None:
        offset = torch.arange(block_size, device=q_seq.device).repeat(nb)
        q_pos = q_anchor.repeat_interleave(block_size) + offset
        ctx &= (q_pos[:, None] - kv_pos[None, :]) < window
    if not own_block:
        return ctx
    own = own.repeat_interleave(block_size, dim=0).repeat_interleave(block_size, dim=1)
    if window is not None or causal:
        own &= own_block_pattern(block_size, window, causal, q_seq.device).repeat(nb, nb)
    return torch.cat([ctx, own], dim=1)


def dflash_attention_reference(
    q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos, *, block_size, softmax_scale=None,
    window=None, causal=False
):
    """Dense float64 DFlash attention on one process: the reference for Split-KV and its baselines.

    Args:
        q: [Tq, Hq, D] queries of all blocks, block by block (Tq = n_blocks * B).
        k_ctx, v_ctx: [Tk, Hkv, D] context keys/values (any order); k_blk, v_blk: [Tq, Hkv, D], or
            both None: no own-block part (rows attend only the context; plain cross-attention).
        q_seq, q_anchor, kv_seq, kv_pos: int64 metadata, see `dflash_attention_mask`.
        block_size: B. softmax_scale: defaults to 1/sqrt(D).
        window, causal: the layer's attention type (`check_attention_type`, `dflash_attention_mask`).
        Grouped-query attention: query head h uses kv head h // (Hq // Hkv) (Megatron's grouping).

    Returns:
        (out, lse): out [Tq, Hq, D] float64, lse [Tq, Hq] float64 natural-log log-sum-exp of the scaled
        scores. Rows that see no key have out = 0 and lse = -inf; their gradients are 0 (no NaN).
        Differentiable in all floating inputs (computed in float64 from upcast copies). Keys that no
        query sees and queries that see no key (invalid blocks) are excluded by selection: a NaN/inf
        there does not affect any output or gradient. A NaN/inf in a key that SOME query sees makes
        every row of the matmul that reads it NaN (as in any dense attention).
    """
    Tq, Hq, D = q.shape
    Hkv = k_ctx.shape[1]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    if (k_blk is None) != (v_blk is None):
        raise ValueError("k_blk and v_blk must both be tensors or both be None")
    own = k_blk is not None
    mask = dflash_attention_mask(q_seq, q_anchor, kv_seq, kv_pos, block_size=block_size, own_block=own,
                                 window=window, causal=causal)
    k = (torch.cat([k_ctx, k_blk], 0) if own else k_ctx).double().repeat_interleave(Hq // Hkv, dim=1)
    v = (torch.cat([v_ctx, v_blk], 0) if own else v_ctx).double().repeat_interleave(Hq // Hkv, dim=1)
    # Keys no query sees and queries that see no key are SELECTED to 0 (never multiplied by a 0 weight),
    # so a NaN/inf there reaches no output or gradient (0 * NaN = NaN in the matmuls).
    seen_k, sees_q = mask.any(0)[:, None, None], mask.any(1)[:, None, None]
    k, v = torch.where(seen_k, k, 0), torch.where(seen_k, v, 0)
    s = torch.einsum("qhd,khd->hqk", torch.where(sees_q, q.double(), 0), k) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Tq], -inf on empty rows
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.where(mask[None], torch.exp(s - lse_safe[..., None]), 0)  # 0 on masked entries, empty rows
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, lse.transpose(0, 1).contiguous()
