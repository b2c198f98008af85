"""Data-sharding hook for Split-KV context parallelism (framework-level: numpy/torch only).

Source: arXiv 2611.05926 (Split-KV) and DESIGN.md sections 2-3: every CP rank receives the context
tokens a `Plan` assigns to it (ids, features, loss mask) with their GLOBAL positions (RoPE stays right,
case C8) and sequence ids, plus an equal share of the query blocks with their metadata.

Batch layout (the global packed batch, identical on every CP rank, as Megatron loads it):
    per-token entries, leading dim T = sum(seq_lens), sequences back to back:
        "input_ids" [T] int (required), "loss_mask" [T] bool/int (required for labels),
        optional "positions" [T], "seq_ids" [T], features e.g. "hidden_states" [T, H], any other
        per-token array/tensor.
    "anchors" (optional, ignored here: the plan already holds them) and keys starting with "q_"
    (ignored: regenerated from the plan).

Naming rule of the shard dict: keys starting with "q_" are per local query block, all others are per
local context token.
"""

import numpy as np

try:  # torch is a hard dependency of the package, but keep the hook usable on numpy alone
    import torch
except ImportError:  # pragma: no cover
    torch = None


def _is_torch(x):
    return torch is not None and isinstance(x, torch.Tensor)


def _take(x, idx):
    if _is_torch(x):
        return x.index_select(0, torch.as_tensor(idx, dtype=torch.int64, device=x.device))
    return np.asarray(x)[idx]


def _like(ref, arr):
    """numpy int/bool array `arr` as a tensor on ref's device when ref is a torch tensor."""
    if _is_torch(ref):
        return torch.as_tensor(arr, device=ref.device)
    return arr


def _token_keys(batch, T):
    keys = []
    for k, v in batch.items():
        if k == "anchors" or k.startswith("q_"):
            continue
        shape = tuple(v.shape) if hasattr(v, "shape") else (len(v),)
        if not shape or shape[0] != T:
            raise ValueError(
                f"batch[{k!r}] must be per-token with leading dim T = sum(seq_lens) = {T}, got shape {shape}"
            )
        keys.append(k)
    return keys


def shard_batch(batch: dict, plan, cp_rank: int) -> dict:
    """This CP rank's share of a packed global batch under `plan`.

    Args:
        batch: global packed batch (module docstring), numpy arrays or torch tensors.
        plan: `megatron_splitkv.planning.Plan` of this batch; cp_rank: 0 <= cp_rank < plan.cp_size.

    Returns dict (torch tensors on the input's device when "input_ids" is a tensor, else numpy):
        per local context token (T_r of them, ascending packed order = (seq, position) order):
            every per-token batch entry sliced (e.g. "input_ids", "loss_mask", "hidden_states"),
            "token_index" [T_r] int64 packed indices into the global batch,
            "kv_seq" [T_r] int64 sequence ids, "kv_pos" [T_r] int64 GLOBAL positions within the
            sequence (what `splitkv_attention` takes as kv_seq, kv_pos, and what RoPE needs),
            plus "seq_ids"/"positions" equal to kv_seq/kv_pos when the batch lacks them.
        per local query block (n_local = plan.blocks_per_rank, equal on every rank):
            "q_seq", "q_anchor" [n_local] int64 (padding blocks: -1, -1), "q_keep" [n_local] bool,
            "q_block_index" [n_local] int64 index into the global padded block list,
            "q_anchor_token" [n_local] input id at the anchor (0 for padding blocks),
            "q_labels" [n_local, B] int64 input ids at a + k, k = 0..B-1 (0 where a + k is outside the
                sequence or the block is padding), "q_label_mask" [n_local, B] bool:
                keep & (a + k < seq_len) & loss_mask[a + k] & (k >= 1) (DESIGN.md section 1 loss, before
                the exp(-(k-1)/gamma) decay).

    Raises: ValueError for a cp_rank outside [0, cp_size), missing "input_ids", or per-token entries
        whose leading dim is not T.
    """
    plan._check_rank(cp_rank)
    if "input_ids" not in batch:
        raise ValueError("batch must contain 'input_ids' [T]")
    T = plan.num_tokens
    keys = _token_keys(batch, T)
    ids = batch["input_ids"]
    idx = plan.token_index(cp_rank)
    out = {k: _take(batch[k], idx) for k in keys}
    kv_seq = plan.token_seq_ids(cp_rank)
    kv_pos = plan.token_positions(cp_rank)
    out["token_index"] = _like(ids, idx)
    out["kv_seq"] = _like(ids, kv_seq)
    out["kv_pos"] = _like(ids, kv_pos)
    out.setdefault("seq_ids", out["kv_seq"])
    out.setdefault("positions", out["kv_pos"])

    sl = plan.query_slice(cp_rank)
    q_seq = plan.q_seq[sl]
    q_anchor = plan.q_anchor[sl]
    keep = q_anchor >= 0
    B = plan.block_size
    k = np.arange(B, dtype=np.int64)
    seq_c = np.where(keep, q_seq, 0)
    base = plan.seq_offsets[seq_c] + np.where(keep, q_anchor, 0) if seq_c.size else np.zeros(0, np.int64)
    pos = q_anchor[:, None] + k[None, :]
    in_seq = keep[:, None] & (pos < plan.seq_lens[seq_c][:, None]) if seq_c.size else np.zeros((0, B), bool)
    gidx = np.where(in_seq, base[:, None] + k[None, :], 0)
    ids_np = ids.detach().cpu().numpy() if _is_torch(ids) else np.asarray(ids)
    labels = np.where(in_seq, ids_np[gidx] if T else 0, 0).astype(np.int64)
    if "loss_mask" in batch:
        lm = batch["loss_mask"]
        lm_np = (lm.detach().cpu().numpy() if _is_torch(lm) else np.asarray(lm)).astype(bool)
        sup = lm_np[gidx] if T else np.zeros_like(in_seq)
    else:
        sup = np.ones_like(in_seq)
    label_mask = in_seq & sup & (k[None, :] >= 1)
    out["q_seq"] = _like(ids, q_seq.copy())
    out["q_anchor"] = _like(ids, q_anchor.copy())
    out["q_keep"] = _like(ids, keep)
    out["q_block_index"] = _like(ids, np.arange(sl.start, sl.stop, dtype=np.int64))
    out["q_anchor_token"] = _like(ids, labels[:, 0].copy())
    out["q_labels"] = _like(ids, labels)
    out["q_label_mask"] = _like(ids, label_mask)
    return out


def unshard(shards, plan) -> dict:
    """Inverse of `shard_batch`: gather the shards of all ranks back into the global batch (for tests).

    Args: shards: list of cp_size dicts from `shard_batch`, in rank order; plan: the same `Plan`.
    Returns: dict with every per-token key scattered back to [T, ...] (by "token_index"; "token_index"
        itself becomes arange(T)), and every "q_" key concatenated over ranks ([n_blocks_padded, ...]).
    Raises: ValueError when the shard count is not cp_size or the shards do not cover every token once.
    """
    if len(shards) != plan.cp_size:
        raise ValueError(f"need {plan.cp_size} shards (one per CP rank), got {len(shards)}")
    T = plan.num_tokens
    idx = [np.asarray(s["token_index"].cpu() if _is_torch(s["token_index"]) else s["token_index"])
           for s in shards]
    allidx = np.concatenate(idx) if idx else np.zeros(0, np.int64)
    if allidx.shape[0] != T or not np.array_equal(np.sort(allidx), np.arange(T)):
        raise ValueError("shards do not cover every context token exactly once")
    out = {}
    for key in shards[0]:
        parts = [s[key] for s in shards]
        if key.startswith("q_"):
            out[key] = torch.cat(parts) if _is_torch(parts[0]) else np.concatenate(parts)
            continue
        p0 = parts[0]
        if _is_torch(p0):
            full = p0.new_zeros((T,) + tuple(p0.shape[1:]))
            for i, p in zip(idx, parts):
                full[torch.as_tensor(i, device=p0.device)] = p
        else:
            full = np.zeros((T,) + np.asarray(p0).shape[1:], dtype=np.asarray(p0).dtype)
            for i, p in zip(idx, parts):
                full[i] = p
        out[key] = full
    return out
