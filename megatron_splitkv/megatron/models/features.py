"""Offline target features: a memory-mapped file of tapped hidden states with an index.

Written by `tools/extract_features.py`, read by training (`examples/pretrain_dflash.py --features-path`):
a CP rank reads only the rows of its own context shard (the memory map touches nothing else).

Layout of a feature directory:
    features.bin   raw row-major [num_rows, dim] array (float32, float16, or bfloat16 stored as 16-bit
                   words); row `offsets[i] + t` = the features of token t of conversation i.
    index.npz      offsets [n+1] int64 row offsets; tokens [num_rows] int64 token ids; loss_mask
                   [num_rows] bool; conv_ids [n] int64 source ids (e.g. ShareGPT record numbers).
    meta.json      {"dim", "dtype", "num_rows", "num_conversations", "tap_layers", "hidden_size", ...}

Source: DESIGN.md section 1 (context features = concatenated hidden states of the tapped target layers,
aligned with token t); DFlash offline feature extraction.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ...data.sharegpt import TokenizedCorpus
from ...data.sharding import shard_batch
from ...planning import plan_context_parallel

__all__ = ["FeatureStore", "FeatureWriter", "write_features"]

_DTYPES = {"float32": (torch.float32, np.float32), "float16": (torch.float16, np.float16),
           "bfloat16": (torch.bfloat16, np.uint16)}


def _dtype_name(dt: torch.dtype) -> str:
    for k, (t, _) in _DTYPES.items():
        if t == dt:
            return k
    raise ValueError(f"unsupported feature dtype {dt}; use one of {list(_DTYPES)}")


class FeatureWriter:
    """Append conversations' features to a feature directory (single writer).

    Args:
        path: directory (created). dim: feature width (n_taps * hidden). dtype: torch.float32 /
            float16 / bfloat16. meta: extra JSON-serialisable fields for meta.json (tap layers, ...).
    Use: `append(conv_id, token_ids [S], loss_mask [S], feats [S, dim])` per conversation, then
    `close()` (writes index.npz and meta.json). Errors: ValueError on shape/dtype mismatches.
    """

    def __init__(self, path: str, dim: int, dtype: torch.dtype = torch.bfloat16, meta: Optional[dict] = None):
        os.makedirs(path, exist_ok=True)
        self.path, self.dim, self.dtype = path, int(dim), dtype
        self.dtype_name = _dtype_name(dtype)
        self.meta = dict(meta or {})
        self._f = open(os.path.join(path, "features.bin"), "wb")
        self._offsets, self._tokens, self._mask, self._conv = [0], [], [], []

    def append(self, conv_id: int, token_ids, loss_mask, feats: torch.Tensor) -> None:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        lm = np.asarray(loss_mask).astype(bool).reshape(-1)
        if feats.dim() != 2 or feats.shape[1] != self.dim or feats.shape[0] != ids.shape[0] or lm.shape != ids.shape:
            raise ValueError(f"feats {tuple(feats.shape)} must be [{ids.shape[0]}, {self.dim}] with "
                             f"matching token ids {ids.shape} and loss mask {lm.shape}")
        t = feats.detach().to("cpu", self.dtype).contiguous()
        if self.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        self._f.write(t.numpy().tobytes())
        self._offsets.append(self._offsets[-1] + ids.shape[0])
        self._tokens.append(ids)
        self._mask.append(lm)
        self._conv.append(int(conv_id))

    def close(self) -> None:
        self._f.close()
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
        np.savez(os.path.join(self.path, "index.npz"), offsets=np.asarray(self._offsets, np.int64),
                 tokens=cat(self._tokens, np.int64), loss_mask=cat(self._mask, bool),
                 conv_ids=np.asarray(self._conv, np.int64))
        meta = dict(self.meta, dim=self.dim, dtype=self.dtype_name, num_rows=int(self._offsets[-1]),
                    num_conversations=len(self._conv))
        with open(os.path.join(self.path, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)


class FeatureStore:
    """Read-only view of a feature directory (memory-mapped).

    Attributes: meta (dict from meta.json), dim, offsets [n+1], tokens [num_rows], loss_mask [num_rows],
    conv_ids [n]. `len(store)` = number of conversations.
    Errors: FileNotFoundError for a missing directory/file; ValueError when the file size does not
    match meta.json.
    """

    def __init__(self, path: str):
        self.path = path
        with open(os.path.join(path, "meta.json")) as f:
            self.meta = json.load(f)
        self.dim = int(self.meta["dim"])
        self.torch_dtype, np_dtype = _DTYPES[self.meta["dtype"]]
        rows = int(self.meta["num_rows"])
        fn = os.path.join(path, "features.bin")
        expected = rows * self.dim * np.dtype(np_dtype).itemsize
        if os.path.getsize(fn) != expected:
            raise ValueError(f"{fn}: {os.path.getsize(fn)} bytes, meta.json says {expected}")
        self._mm = (np.memmap(fn, dtype=np_dtype, mode="r", shape=(rows, self.dim)) if rows
                    else np.zeros((0, self.dim), np_dtype))
        with np.load(os.path.join(path, "index.npz")) as z:
            self.offsets, self.tokens = z["offsets"], z["tokens"]
            self.loss_mask, self.conv_ids = z["loss_mask"], z["conv_ids"]

    def __len__(self) -> int:
        return int(self.conv_ids.shape[0])

    def __getstate__(self):
        # pickled by path (a data-pipeline worker started by spawn / forkserver reopens the memory map)
        # instead of by value (np.memmap pickles as a full in-memory copy of the features)
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def corpus(self):
        """The stored conversations as a `megatron_splitkv.data.sharegpt.TokenizedCorpus`, so that
        `ShareGPTLoader(corpus=store.corpus())` packs them; `PackedBatch.source` then holds indices
        into this store."""
        return TokenizedCorpus(self.tokens, self.loss_mask, self.offsets)

    def rows(self, source, kv_seq, kv_pos, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Features of one CP rank's context tokens.

        Args:
            source: [n_seq] store indices of the packed batch's sequences (`PackedBatch.source`).
            kv_seq, kv_pos: [T_r] sequence ids (into `source`) and positions of this rank's tokens
                (`shard_batch(...)["kv_seq"/"kv_pos"]`).
            out: optional contiguous CPU tensor [T_r, dim] of the stored dtype (`torch_dtype`) to read into
                (the data pipeline reads straight into its shared buffer); returned.
        Returns: [T_r, dim] tensor in the stored dtype (CPU); reads only these rows.
        Raises: IndexError when a position lies beyond its conversation (or is negative); ValueError for an
            `out` of the wrong shape, dtype or device, or not contiguous.
        """
        src = np.asarray(source, dtype=np.int64)
        seq = np.asarray(kv_seq.cpu() if torch.is_tensor(kv_seq) else kv_seq, dtype=np.int64)
        pos = np.asarray(kv_pos.cpu() if torch.is_tensor(kv_pos) else kv_pos, dtype=np.int64)
        conv = src[seq]
        if np.any(pos >= self.offsets[conv + 1] - self.offsets[conv]) or np.any(pos < 0):
            raise IndexError("a context position lies beyond its stored conversation")
        idx = self.offsets[conv] + pos
        if out is not None:
            if (tuple(out.shape) != (idx.shape[0], self.dim) or out.dtype != self.torch_dtype
                    or out.device.type != "cpu" or not out.is_contiguous()):
                raise ValueError(f"out must be a contiguous CPU tensor [{idx.shape[0]}, {self.dim}] of "
                                 f"{self.torch_dtype}, got {tuple(out.shape)} {out.dtype} on {out.device}")
            dst = out.view(torch.uint8).numpy().view(self._mm.dtype).reshape(idx.shape[0], self.dim)
            np.take(self._mm, idx, axis=0, out=dst, mode="clip")  # indices checked above; "clip" is unbuffered
            return out
        out = torch.from_numpy(np.ascontiguousarray(self._mm[idx]))
        return out.view(torch.bfloat16) if self.torch_dtype == torch.bfloat16 else out


def write_features(provider, conversations, path: str, *, cp_group=None, dtype=torch.bfloat16,
                   meta: Optional[dict] = None, progress=None) -> Optional[str]:
    """Run the frozen target over conversations and store the tapped features (offline extraction).

    Args:
        provider: `TargetFeatureProvider` (the target on this rank's device).
        conversations: iterable of (conv_id, token_ids [S], loss_mask [S]), the same on every CP rank.
        path: output directory (written by CP rank 0 only).
        cp_group: context-parallel group: each conversation is split over its ranks (contiguous
            planner layout) and the features are all-gathered to rank 0; None = single process.
        dtype: stored dtype. meta: extra meta.json fields. progress: optional callable(i, n_tokens).
    Returns: `path` on CP rank 0, None elsewhere.
    """
    P = dist.get_world_size(cp_group) if cp_group is not None else 1
    rank = dist.get_rank(cp_group) if cp_group is not None else 0
    dev = next(provider.parameters()).device
    writer = None
    for i, (conv_id, ids, lm) in enumerate(conversations):
        ids = np.asarray(ids, dtype=np.int64)
        plan = plan_context_parallel([ids.shape[0]], [np.zeros(0, np.int64)], block_size=1, cp_size=P,
                                     strategy="contiguous")
        shard = shard_batch({"input_ids": torch.as_tensor(ids)}, plan, rank)
        f = provider(shard["input_ids"].to(dev), shard["kv_seq"].to(dev), shard["kv_pos"].to(dev))
        if P > 1:
            n_max = max(plan.token_index(r).shape[0] for r in range(P))
            pad = torch.zeros(n_max, f.shape[1], dtype=f.dtype, device=f.device)
            pad[: f.shape[0]] = f
            parts = [torch.empty_like(pad) for _ in range(P)]
            dist.all_gather(parts, pad, group=cp_group)
            full = torch.empty(ids.shape[0], f.shape[1], dtype=f.dtype, device=f.device)
            for r in range(P):
                idx = torch.as_tensor(plan.token_index(r), device=f.device)
                full[idx] = parts[r][: idx.shape[0]]
            f = full
        if rank == 0:
            if writer is None:
                writer = FeatureWriter(path, f.shape[1], dtype, meta)
            writer.append(conv_id, ids, lm, f)
            if progress is not None:
                progress(i, int(ids.shape[0]))
    if rank == 0:
        if writer is None:
            writer = FeatureWriter(path, int(provider.feature_dim), dtype, meta)
        writer.close()
        return path
    return None
