"""DFlash drafter training semantics, framework level (torch only, no Megatron import).

Everything here follows DESIGN.md section 1 (after DFlash and arXiv 2611.05926, "Split-KV: Efficient
Context Parallelism for Training Diffusion Drafters"):

- `target_layer_ids`: which target layers feed the drafter's fused context features;
- `loss_decay_weights`: the per-offset weight `exp(-(k-1)/gamma)` (offset 0 weight 0);
- `build_draft_blocks`: draft-block input ids, position ids, attention metadata (`q_seq`, `q_anchor`),
  labels and loss weights from sampled anchors;
- `dflash_loss`: `sum(w * CE) / sum(w)` with the denominator all-reduced over every rank that holds part
  of the batch (no 0/0 when a rank, or the whole batch, has no supervised token: case C4).

Layout conventions used by the whole package: blocks are ordered sequence-major (all blocks of sequence
0, then sequence 1, ...), block `b` covers query rows `b*B .. b*B+B-1`; padding blocks carry anchor -1
and `block_keep = False`; a block's metadata (`q_seq[b]`, `q_anchor[b]`) is exactly what
`megatron_splitkv.reference.dflash_attention_mask` and the Split-KV op consume.
"""

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist

from ._ints import as_int

DEFAULT_BLOCK_SIZE = 16
DEFAULT_GAMMA_B16 = 7.0


def target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose hidden states are concatenated into the drafter's context features.

    Args:
        num_target_layers: n_target >= 1, layers of the frozen target (e.g. 36 for Qwen3-8B).
        num_draft_layers: n_draft >= 1, drafter layers (e.g. 5).

    Returns:
        n_draft layer ids (0-based indices into the target's per-layer outputs):
        `round(1 + i*(n_target-4)/(n_draft-1))` for i in 0..n_draft-1, or `[n_target // 2]` for one draft
        layer. Python's `round` (half to even), as in DFlash's reference code.
        E.g. (36, 5) -> [1, 9, 17, 25, 33].

    Raises:
        ValueError: non-positive sizes, or n_target < 4 with several draft layers.

    Source: DESIGN.md section 1 "Context features" (DFlash).
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(f"need n_target >= 1 and n_draft >= 1, got {num_target_layers}, {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(f"{num_draft_layers} draft layers need a target of >= 4 layers, got {num_target_layers}")
    return [
        round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)) for i in range(num_draft_layers)
    ]


def default_gamma(block_size: int) -> float:
    """Loss-decay gamma: 7 for B = 16 (DESIGN.md section 1), scaled linearly with B otherwise."""
    return DEFAULT_GAMMA_B16 * block_size / DEFAULT_BLOCK_SIZE


def loss_decay_weights(block_size: int, gamma: float | None = None, dtype=torch.float32, device=None):
    """Per-offset loss weights of a draft block.

    Returns:
        [B] tensor (`dtype`): 0 at offset 0 (the anchor token itself is given, not predicted), and
        `exp(-(k-1)/gamma)` at offsets k = 1..B-1 (gamma defaults to `default_gamma(B)`, 7 for B = 16).

    Raises:
        ValueError: block_size < 2 or gamma <= 0.

    Source: DESIGN.md section 1 "Loss" (DFlash).
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float64, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.to(dtype)


@dataclass
class DraftBlocks:
    """Draft blocks of a batch, flattened block by block (n = number of blocks, B = block size).

    Attributes:
        input_ids: [n*B] int64, `[x[a], MASK, ..., MASK]` per block (all MASK for padding blocks).
        position_ids: [n*B] int64, `a + 0..B-1` (global positions; `0..B-1` for padding blocks).
        q_seq: [n] int64, sequence id of each block.
        q_anchor: [n] int64, anchor position, -1 for padding blocks (which see nothing).
        block_keep: [n] bool, False for padding blocks.
        labels: [n*B] int64, `x[a+k]` where supervised, 0 elsewhere (always a valid vocabulary id, so a
            vocab-parallel cross entropy never sees an ignore index).
        loss_weight: [n*B] float32, `block_keep * (a+k < S) * loss_mask[a+k] * exp(-(k-1)/gamma)`, 0 at
            offset 0.
        block_size: B.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    q_seq: torch.Tensor
    q_anchor: torch.Tensor
    block_keep: torch.Tensor
    labels: torch.Tensor
    loss_weight: torch.Tensor
    block_size: int

    @property
    def num_blocks(self) -> int:
        return int(self.q_anchor.shape[0])

    def select_blocks(self, start: int, end: int) -> "DraftBlocks":
        """Blocks [start, end) (e.g. this CP rank's equal share of the query blocks)."""
        B = self.block_size
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "block_size":
                out[f.name] = v
            elif v.shape[0] == self.num_blocks:
                out[f.name] = v[start:end]
            else:
                out[f.name] = v[start * B : end * B]
        return DraftBlocks(**out)

    def to(self, device) -> "DraftBlocks":
        return DraftBlocks(
            **{
                f.name: (getattr(self, f.name) if f.name == "block_size" else getattr(self, f.name).to(device))
                for f in fields(self)
            }
        )


def _as_long(x, device=None) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.long, device=device).reshape(-1)


def build_draft_blocks(
    input_ids,
    seq_lens,
    q_seq,
    q_anchor,
    *,
    block_size: int,
    mask_token_id: int,
    loss_mask=None,
    gamma: float | None = None,
) -> DraftBlocks:
    """Build the draft blocks (inputs, positions, mask metadata, labels, loss weights) of a packed batch.

    Args:
        input_ids: [S_total] int64 token ids of a packed batch (sequence j occupies packed indices
            `[off_j, off_j + seq_lens[j])`, positions 0..seq_lens[j]-1). torch or numpy.
        seq_lens: [n_seq] int64 sequence lengths (sum = S_total).
        q_seq, q_anchor: [n] int64 query blocks, usually `Plan.q_seq` / `Plan.q_anchor` from
            `megatron_splitkv.planning.plan_context_parallel` (anchors from
            `megatron_splitkv.data.anchors`, sequence-major, padded with invalid blocks). A block with
            `q_seq < 0` or `q_anchor < 0` is a padding block (`block_keep = False`). Pass a slice (e.g.
            `Plan.query_slice(rank)`) to build only one CP rank's blocks.
        block_size: B >= 2.
        mask_token_id: id of the reserved MASK token (an unused row of the target's embedding).
        loss_mask: [S_total] bool/0-1, supervised tokens; default all ones.
        gamma: loss decay (default `default_gamma(B)`, 7 for B = 16).

    Returns:
        `DraftBlocks` with n blocks. Block at anchor a of sequence j (length S_j): input ids
        `[x[a], MASK, ...]`, position ids `a + 0..B-1`, labels `x[a+k]` where supervised (0 elsewhere),
        loss weights `block_keep * (a+k < S_j) * loss_mask[a+k] * exp(-(k-1)/gamma)` (0 at k = 0).
        Padding blocks: ids all MASK, positions 0..B-1, `q_seq = q_anchor = -1`, weights 0.
        Tensors live on `input_ids`' device (CPU for numpy input).

    Raises:
        ValueError: block_size not an int >= 2, input_ids not of an integer dtype, a negative seq_len,
            shape mismatches, sum(seq_lens) != S_total, a block's sequence id >= n_seq, or a valid
            anchor outside [0, S_j).

    Source: DESIGN.md section 1 "Draft block" and "Loss" (DFlash; arXiv 2611.05926).
    """
    block_size = as_int(block_size, "block_size", minimum=2,
                        what="an int >= 2 (a draft block is [anchor token, MASK...])")
    ids_raw = torch.as_tensor(input_ids)
    if ids_raw.dtype.is_floating_point or ids_raw.dtype.is_complex or ids_raw.dtype == torch.bool:
        raise ValueError(f"input_ids must have an integer dtype (token ids), got {ids_raw.dtype}")
    x = _as_long(ids_raw)
    dev = x.device
    lens = _as_long(seq_lens, dev)
    if bool((lens < 0).any()):
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()}")
    qs, qa = _as_long(q_seq, dev), _as_long(q_anchor, dev)
    if qs.shape != qa.shape:
        raise ValueError(f"q_seq {tuple(qs.shape)} and q_anchor {tuple(qa.shape)} must match")
    if int(lens.sum()) != x.shape[0]:
        raise ValueError(f"sum(seq_lens) = {int(lens.sum())} must equal len(input_ids) = {x.shape[0]}")
    lm = (torch.ones_like(x, dtype=torch.bool) if loss_mask is None
          else torch.as_tensor(loss_mask, device=dev).reshape(-1).to(torch.bool))
    if lm.shape != x.shape:
        raise ValueError(f"loss_mask {tuple(lm.shape)} must match input_ids {tuple(x.shape)}")
    B = int(block_size)
    keep = (qs >= 0) & (qa >= 0)
    if bool((keep & (qs >= lens.shape[0])).any()):
        raise ValueError(f"a query block names a sequence id >= n_seq = {lens.shape[0]}")
    j = torch.where(keep, qs, torch.zeros_like(qs))
    S = lens[j] if lens.shape[0] else torch.zeros_like(qs)
    if bool((keep & (qa >= S)).any()):
        raise ValueError("an anchor lies at or beyond its sequence's length")
    offsets = torch.cumsum(lens, 0) - lens
    off = offsets[j] if lens.shape[0] else torch.zeros_like(qs)
    a = torch.where(keep, qa, torch.zeros_like(qa))
    k = torch.arange(B, device=dev)
    pos = a[:, None] + k  # [n, B]
    in_seq = (pos < S[:, None]) & keep[:, None]
    idx = torch.where(in_seq, off[:, None] + pos, torch.zeros_like(pos))
    tok = x[idx] if x.shape[0] else torch.zeros_like(idx)
    sup_mask = in_seq & (lm[idx] if x.shape[0] else in_seq)

    ids = torch.full_like(tok, int(mask_token_id))
    ids[:, 0] = torch.where(keep, tok[:, 0], ids[:, 0])
    w = sup_mask.to(torch.float32) * loss_decay_weights(B, gamma, device=dev)  # 0 at k = 0
    labels = torch.where(w > 0, tok, torch.zeros_like(tok))
    minus1 = torch.full_like(qs, -1)
    return DraftBlocks(
        input_ids=ids.reshape(-1),
        position_ids=torch.where(keep[:, None], pos, k.expand_as(pos)).reshape(-1),
        q_seq=torch.where(keep, qs, minus1),
        q_anchor=torch.where(keep, qa, minus1),
        block_keep=keep,
        labels=labels.reshape(-1),
        loss_weight=w.reshape(-1),
        block_size=B,
    )


@dataclass
class DFlashLoss:
    """Result of `dflash_loss`.

    Attributes:
        loss: scalar (differentiable), this rank's share `sum_local(w*CE) / sum_global(w)`; summing it
            over the group gives the global loss, and SUMMING parameter gradients over the group gives
            the exact global gradient (a framework that averages over G ranks must scale by G).
        total: scalar float64 (detached), the global loss (identical on every rank).
        weight_sum: scalar float64 (detached), the global `sum(w)`.
    """

    loss: torch.Tensor
    total: torch.Tensor
    weight_sum: torch.Tensor


def dflash_loss(ce: torch.Tensor, weight: torch.Tensor, group=None) -> DFlashLoss:
    """Decayed DFlash loss normalised over every rank that holds part of the batch.

    Args:
        ce: [T] per-token cross entropy (any float dtype; summed in float32, float64 for float64 input),
            this rank's query rows.
        weight: [T] loss weights (`DraftBlocks.loss_weight`), not differentiated.
        group: process group of all ranks holding part of the batch (CP, or DP x CP); None = no
            communication (single process). Every rank of the group must call this (a rank with no
            supervised tokens still contributes 0 to both sums). One all-reduce of two float64 scalars
            (numerator for the reported total, denominator for the normalisation).

    Returns:
        `DFlashLoss`. When the global `sum(w)` is 0 the loss is 0 (gradients 0), never 0/0 = NaN (C4).

    Source: DESIGN.md section 1 "Loss"; cases/README.md C4.
    """
    if ce.shape != weight.shape:
        raise ValueError(f"ce {tuple(ce.shape)} and weight {tuple(weight.shape)} must match")
    acc = torch.float64 if ce.dtype == torch.float64 else torch.float32
    w = weight.detach().to(acc)
    # select, never multiply by 0: a CE of inf/NaN at a weight-0 position (an unsupervised or padding
    # token) must not turn the loss into NaN (inf * 0 = NaN); its gradient there is 0
    num = torch.where(w > 0, ce.to(acc) * w, 0).sum()
    stats = torch.stack([num.detach().double(), w.sum().double()])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    den = stats[1]
    safe = torch.where(den > 0, den, torch.ones_like(den))
    loss = num / safe.to(num.dtype)
    total = torch.where(den > 0, stats[0] / safe, torch.zeros_like(den))
    return DFlashLoss(loss=loss, total=total, weight_sum=den)


__all__ = [
    "DraftBlocks",
    "DFlashLoss",
    "build_draft_blocks",
    "default_gamma",
    "dflash_loss",
    "loss_decay_weights",
    "target_layer_ids",
]
