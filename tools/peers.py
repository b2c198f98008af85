"""Peer implementations of DFlash drafter attention, fed from our op's inputs (issue 22, benchmarks only).

Our inputs (the ops' and `reference.dflash_attention_reference`'s): q [Tq, Hq, D] block by block,
k_ctx / v_ctx [Tk, Hkv, D] context keys in any order, k_blk / v_blk [Tq, Hkv, D] own-block keys,
q_seq / q_anchor [n_blocks] (anchor < 0: padding block, sees nothing), kv_seq / kv_pos [Tk] (sequence id and
position in the sequence). A block at anchor a of sequence s sees the context keys of s with position < a,
and its own B keys.

Peers:
- Turbo-dLLM 0.1.6 (`dllm_parallel.core.attention.dflash_attention.dflash_attention`): BSHD tensors
  (batch 1), the context packed in (sequence, position) order, one context interval [start, stop) per anchor
  (`DFlashGlobalContextMask`), own-block keys as "local" keys (`DFlashLocalBlockMask`). CUDA only (FA4 and
  its JIT-built merge kernels). `turbo_inputs` is the mapping (pure torch, CPU-testable).
- FlexAttention with a `mask_mod` over keys `[context | block keys]`, the formulation of SpecForge's DFlash
  trainer (`create_dflash_block_mask`), with sequence ids added for packs of many conversations.
  `flex_inputs` is the mapping; `flex_peer` runs it (eager on CPU, compiled on CUDA).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

try:  # Turbo-dLLM (PyPI turbo-dllm==0.1.6, the dev extra); only its rows need it
    from dllm_parallel.core.attention.dflash_attention import dflash_attention as _turbo_dflash_attention
    from dllm_parallel.core.attention.layout import clean_intervals as _turbo_clean_intervals
    from dllm_parallel.core.attention.masks import DFlashGlobalContextMask, DFlashLocalBlockMask
    from dllm_parallel.core.kernels.runtime import configure_kernel_runtime as _turbo_configure
except ImportError as _e:  # pragma: no cover - reported when a turbo row runs
    _turbo_dflash_attention = _turbo_clean_intervals = _turbo_configure = None
    DFlashGlobalContextMask = DFlashLocalBlockMask = None
    _TURBO_IMPORT_ERROR = _e
else:
    _TURBO_IMPORT_ERROR = None

__all__ = ["turbo_inputs", "turbo_masks", "turbo_shard", "turbo_runtime", "turbo_peer", "flex_inputs",
           "flex_peer", "flex_block_mask", "FlexInputs", "turbo_enable_jit"]

_compiled_flex = None


def _need_turbo():
    if _TURBO_IMPORT_ERROR is not None:
        raise ImportError(f"the turbo method needs turbo-dllm==0.1.6 (module dllm_parallel): {_TURBO_IMPORT_ERROR}")


def _packed_order(kv_seq, kv_pos):
    """Permutation sorting context keys by (sequence id, position)."""
    key = kv_seq.to(torch.int64) * (1 << 32) + (kv_pos.to(torch.int64) + (1 << 31))
    return torch.argsort(key, stable=True), key


def turbo_inputs(q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos, *, block_size):
    """Map our inputs to Turbo-dLLM's `dflash_attention` layout (CP = 1: the whole context is one shard).

    Returns a dict: query [1, Tq, Hq, D], local_key / local_value [1, Tq, Hkv, D] (own-block keys),
    global_key / global_value [1, Tk, Hkv, D] (context sorted by (sequence, position)), context_starts /
    context_stops [1, n_blocks] int32 (block b sees packed keys [start, stop): the first key of its
    sequence up to the first key of its sequence at position >= its anchor), anchor_valid [1, n_blocks]
    bool, global_seq_len (Tk), order [Tk] int64 (global_key = k_ctx[order]). Views / gathers of the
    inputs: gradients flow back to q, k_ctx, ... Padding blocks get [0, 0) and anchor_valid False.
    Raises ValueError when Tq != n_blocks * block_size.
    """
    nb = int(q_seq.shape[0])
    if q.shape[0] != nb * block_size:
        raise ValueError(f"q has {q.shape[0]} rows, expected n_blocks * block_size = {nb} * {block_size}")
    order, key = _packed_order(kv_seq, kv_pos)
    keys = key[order]
    valid = q_anchor >= 0
    seq = torch.where(valid, q_seq, 0).to(torch.int64)
    lo = torch.searchsorted(keys, seq * (1 << 32))
    hi = torch.searchsorted(keys, seq * (1 << 32) + (q_anchor.to(torch.int64).clamp(min=0) + (1 << 31)))
    lo = torch.where(valid, lo, 0)
    hi = torch.where(valid, hi, 0)
    return dict(query=q.unsqueeze(0), local_key=k_blk.unsqueeze(0), local_value=v_blk.unsqueeze(0),
                global_key=k_ctx[order].unsqueeze(0), global_value=v_ctx[order].unsqueeze(0),
                context_starts=lo.to(torch.int32).unsqueeze(0), context_stops=hi.to(torch.int32).unsqueeze(0),
                anchor_valid=valid.unsqueeze(0), global_seq_len=int(k_ctx.shape[0]), order=order)


def turbo_masks(inp, *, block_size, global_anchor_count=None):
    """Turbo-dLLM's (local, global) mask objects for `turbo_inputs(...)` output; global_anchor_count
    defaults to this call's block count (CP = 1)."""
    _need_turbo()
    n = int(inp["anchor_valid"].shape[1]) if global_anchor_count is None else int(global_anchor_count)
    g = DFlashGlobalContextMask(context_starts=inp["context_starts"], context_stops=inp["context_stops"],
                                anchor_valid=inp["anchor_valid"], block_size=block_size, global_anchor_count=n)
    return DFlashLocalBlockMask(anchor_valid=inp["anchor_valid"], block_size=block_size), g


def turbo_shard(inp, rank: int, cp_size: int):
    """Rank `rank`'s context shard of `turbo_inputs(...)` under Turbo's contiguous ring layout (CP > 1):
    returns (global_key, global_value, intervals_by_owner), the shard being packed keys
    [intervals_by_owner[rank][0]] (Turbo's `clean_intervals(..., layout="contiguous")`)."""
    _need_turbo()
    owners = _turbo_clean_intervals(inp["global_seq_len"], cp_size, layout="contiguous")
    idx = torch.cat([torch.arange(a, b, device=inp["global_key"].device) for a, b in owners[rank]])
    return inp["global_key"][:, idx], inp["global_value"][:, idx], owners


def turbo_runtime(group, rank: int, ranks):
    """The attributes of Turbo's runtime that `dflash_attention` reads for its ring (block parallel size 1:
    the contiguous context layout; a SimpleNamespace standing in for its ParallelRuntime)."""
    return types.SimpleNamespace(uses_context_parallel_attention=True, context_block_parallel_group=group,
                                 context_block_parallel_group_ranks=list(ranks), context_parallel_rank=int(rank),
                                 block_parallel_size=1, active_block_mode=None)


def turbo_peer(inp, *, block_size, runtime=None, global_key=None, global_value=None, intervals_by_owner=None,
               global_anchor_count=None, plan_cache=None, scale=None):
    """Turbo-dLLM's `dflash_attention` on `turbo_inputs(...)` output; returns out [Tq, Hq, D].
    CP > 1: pass `runtime` (`turbo_runtime`), this rank's shard and `intervals_by_owner` (`turbo_shard`)."""
    local, glob = turbo_masks(inp, block_size=block_size, global_anchor_count=global_anchor_count)
    out = _turbo_dflash_attention(query=inp["query"], local_key=inp["local_key"], local_value=inp["local_value"],
                           global_key=inp["global_key"] if global_key is None else global_key,
                           global_value=inp["global_value"] if global_value is None else global_value,
                           local_attn_mask=local, global_attn_mask=glob, interval_plan_cache=plan_cache,
                           scale=scale, runtime=runtime, global_seq_len=inp["global_seq_len"],
                           global_intervals_by_owner=intervals_by_owner)
    return out.squeeze(0)


@dataclass
class FlexInputs:
    """FlexAttention inputs: q [1, Hq, Tq, D], k / v [1, Hkv, Tk + Tq, D] (`[context | block keys]`),
    mask_mod(b, h, q_idx, kv_idx) -> bool, and the lengths."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask_mod: object
    q_len: int
    kv_len: int


def flex_inputs(q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos, *, block_size):
    """Map our inputs to the FlexAttention peer: keys `[context | own-block keys]`, and a mask_mod where
    query row i (block b = i // B) sees context key j iff kv_seq[j] == q_seq[b] and kv_pos[j] < q_anchor[b],
    block key Tk + m iff m // B == b, nothing when q_anchor[b] < 0 (SpecForge's rule, with sequence ids).
    Context keys keep our order (the mask reads their ids). Returns `FlexInputs`."""
    Tk, Tq = int(k_ctx.shape[0]), int(q.shape[0])
    dev = q.device
    pad = torch.full((Tq,), -2, dtype=torch.int64, device=dev)  # block keys: no sequence, never context
    kseq = torch.cat([kv_seq.to(torch.int64), pad])
    kpos = torch.cat([kv_pos.to(torch.int64), pad])
    qseq, qanc = q_seq.to(torch.int64), q_anchor.to(torch.int64)
    B = int(block_size)

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // B
        ctx = (kv_idx < Tk) & (kseq[kv_idx] == qseq[blk]) & (kpos[kv_idx] < qanc[blk])
        own = (kv_idx >= Tk) & ((kv_idx - Tk) // B == blk)
        return (ctx | own) & (qanc[blk] >= 0)

    def bhsd(t):
        return t.transpose(0, 1).unsqueeze(0)

    return FlexInputs(bhsd(q), bhsd(torch.cat([k_ctx, k_blk])), bhsd(torch.cat([v_ctx, v_blk])), mask_mod,
                      Tq, Tk + Tq)


def flex_block_mask(fi: FlexInputs):
    """The BlockMask of `fi` (compiled build on CUDA, eager on CPU)."""
    dev = fi.q.device
    return create_block_mask(fi.mask_mod, 1, None, fi.q_len, fi.kv_len, device=dev, _compile=dev.type == "cuda")


def flex_peer(fi: FlexInputs, block_mask=None, *, scale=None):
    """FlexAttention on `flex_inputs(...)` output (GQA by `enable_gqa`); compiled on CUDA, eager on CPU.
    Returns out [Tq, Hq, D]."""
    global _compiled_flex
    bm = flex_block_mask(fi) if block_mask is None else block_mask
    scale = 1.0 / math.sqrt(fi.q.shape[-1]) if scale is None else scale
    fn = flex_attention
    if fi.q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)  # a second shape compiles once more, dynamic
        fn = _compiled_flex
    out = fn(fi.q, fi.k, fi.v, block_mask=bm, scale=scale, enable_gqa=fi.k.shape[1] != fi.q.shape[1])
    return out.squeeze(0).transpose(0, 1)


def turbo_enable_jit():
    """Let Turbo-dLLM build its CUDA merge kernels on first use (its `configure_kernel_runtime`)."""
    _need_turbo()
    _turbo_configure(allow_runtime_jit=True)
