"""The drafter's data pipeline: plan and shard every packed batch in DataLoader worker processes, ahead of the
training step (framework level: torch, numpy; no Megatron import).

Per packed global batch (identical on every CP rank of a data-parallel rank) a training step needs the LPT
plan (`planning.plan_context_parallel`), this CP rank's shard (`data.shard_batch`), its draft blocks
(`dflash.build_draft_blocks`), the context tokens' sequence ids and GLOBAL positions (kv_seq, kv_pos) and,
with offline features, this rank's feature rows. All of it depends on the batch only, so `plan_batch` does it
on the host and `PrefetchedBatches` runs it in `torch.utils.data.DataLoader` worker processes (an
`IterableDataset`, `batch_size=None`, pinned memory on CUDA) while the GPU runs the previous steps: the step
itself only uploads pinned host tensors (`PlannedBatch.to(device, non_blocking=True)`). With 0 workers the
same `plan_batch` runs in the training process when the step asks for the batch (the synchronous path).

Determinism: worker w of N prepares the batches k = w, w + N, ... of the stream (every worker iterates the
same deterministic stream and skips the others' batches); the DataLoader hands its workers' items out round
robin, and `PrefetchedBatches` checks each item's index, so the items come out in stream order and equal
what 0 workers produce (same batches, plans, shards, blocks, features). Errors raised in a worker are raised
in the training process by the DataLoader with the worker's traceback; a worker that dies is reported too.

Source: DESIGN.md sections 1 and 3 (the plan is a data-sharding hook); docs/megatron.md "Data pipeline".
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from torch.multiprocessing import reductions

from .._ints import as_int
from ..config import SplitKVConfig
from ..dflash import DraftBlocks, build_draft_blocks
from ..ops.host_metadata import from_recipe, pack_recipe, prepare_splitkv_metadata_from_plan
from ..ops.packing import apply_split, compile_split, split_views, unique_tensors
from ..planning import plan_context_parallel
from .sharding import shard_batch

__all__ = ["MetadataSpec", "PlannedBatch", "plan_batch", "PlannedBatchDataset", "PrefetchedBatches",
           "data_parallel_batches"]


_ALIGN = 64  # byte alignment of each tensor in a packed buffer (any dtype's view is aligned)
_BLOCK_FIELDS = ("input_ids", "position_ids", "q_seq", "q_anchor", "block_keep", "labels", "loss_weight")


def _nbytes(dtype, shape) -> int:
    return math.prod(shape) * dtype.itemsize


def _layout(specs, start: int = 0):
    """[(name, dtype, shape)] -> ([(name, dtype, shape, byte offset)], end), offsets _ALIGN-aligned from
    `start` (itself aligned); end = the aligned byte after the last tensor."""
    out, off = [], start
    for name, dtype, shape in specs:
        out.append((name, dtype, tuple(int(d) for d in shape), off))
        off += -(-_nbytes(dtype, shape) // _ALIGN) * _ALIGN
    return out, off


class _ItemBuffer:
    """The ONE flat uint8 buffer of a `PlannedBatch` built in a DataLoader worker, as it crosses to the training
    process. With torch's `ForkingPickler` (the DataLoader's queues) it travels as one shared-memory segment
    opened BY NAME (`_reduce_item_buffer`: torch's "file_system" sharing for this buffer only, whatever
    `torch.multiprocessing`'s strategy is), so the receiver does not wait on the worker: torch's default
    "file_descriptor" sharing fetches every segment's descriptor from a thread of the sending worker, which
    needs that worker's GIL while it plans the next batch (up to the 5 ms switch interval per segment).
    A plain `pickle` copies the bytes (`__reduce__`)."""

    __slots__ = ("tensor", "by_name")

    def __init__(self, tensor: torch.Tensor, by_name: bool = False):
        self.tensor, self.by_name = tensor, by_name

    def __reduce__(self):
        return (_ItemBuffer, (self.tensor,))


def _reduce_item_buffer(buf: _ItemBuffer):
    t = buf.tensor
    if not buf.by_name or t.device.type != "cpu" or t.storage_offset() != 0:
        return (_ItemBuffer, (t,))  # torch's own tensor sharing (its strategy)
    storage = t.untyped_storage()
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # kept alive for the receiver, which drops this reference once it has mapped it
    reductions.shared_cache[handle] = reductions.StorageWeakRef(storage)
    return (_open_item_buffer, (manager, handle, size, int(t.numel())))


def _open_item_buffer(manager, handle, size, numel):
    storage = reductions.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size)
    return _ItemBuffer(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (numel,)), by_name=True)


def _register_reducer():
    ForkingPickler.register(_ItemBuffer, _reduce_item_buffer)


_register_reducer()


def _new_bytes(n: int, shared: bool) -> tuple:
    """(an uninitialised uint8 buffer of n bytes, allocated by name): in shared memory from the start when
    `shared` (a DataLoader worker: the buffer then travels to the training process as one shared segment,
    without a copy), preferably one opened by name (`_ItemBuffer`; torch's shared-memory manager), else
    torch's default shared memory."""
    if shared:
        try:
            storage = torch.UntypedStorage._new_using_filename_cpu(max(n, 1))
            by_name = True
        except (RuntimeError, AttributeError):  # no torch_shm_manager: torch's default sharing
            storage, by_name = torch.UntypedStorage._new_shared(max(n, 1)), False
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,)), by_name
    return torch.empty(n, dtype=torch.uint8), False


#: id(layout) -> (layout, its names, its `ops.packing.compile_split` plan); the layout object is held, so its
#: id is not reused while the entry lives (an item's layouts are the same objects through unpickle, pin, to)
_COMPILED: dict = {}
_COMPILED_MAX = 256


def _compiled(layout, plan=None) -> tuple:
    """(layout, names, `compile_split` plan) of a layout object: cached by identity; `plan` (the plan that
    came with the layout from a worker) is taken as is instead of compiling."""
    hit = _COMPILED.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit
    if plan is None:
        plan = compile_split([(dt, shape, off) for _, dt, shape, off in layout])
    hit = (layout, tuple(x[0] for x in layout), plan)
    if len(_COMPILED) >= _COMPILED_MAX:
        _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[id(layout)] = hit
    return hit


def _views(buf: torch.Tensor, layout) -> dict:
    """{name: view of the uint8 `buf` (any device)} for a `_layout` layout [(name, dtype, shape, byte offset)]
    (offsets relative to `buf`): one `split_with_sizes` per dtype (`ops.packing.apply_split`, the plan
    compiled once per layout object), no copy. Raises ValueError when `buf` is too short for the layout."""
    _, names, plan = _compiled(layout)
    return dict(zip(names, apply_split(buf, plan)))


def _fill(views: dict, tensors: dict) -> None:
    for k, t in tensors.items():
        if t.numel():
            views[k].copy_(t)


@dataclass(frozen=True)
class MetadataSpec:
    """The attention shapes for which `plan_batch` also builds this CP rank's Split-KV metadata
    (`ops.prepare_splitkv_metadata_from_plan`, on the host, no process group): what the drafter's core
    attention would prepare on the step's first layer (`DFlashPackedSeqParams.op_metadata`).

    Attributes:
        num_heads_q, num_heads_kv: query / key-value heads PER TENSOR-PARALLEL RANK (what the core attention
            sees: `num_attention_heads // tp`, `num_query_groups // tp`).
        head_dim: D (`kv_channels`). dtype: the attention's activations' dtype (the model's params_dtype).
        num_chunks, cp_ranks_per_node, chunk_axis, config: as `prepare_splitkv_metadata` (None:
            the config's fields; config None: `SplitKVConfig()`); the metadata carries the config.
        flex_block_masks: also build the FlexAttention block tables on the host (the first layer's flex call
            then builds no BlockMask); for a FlexAttention (or auto) kernel on CUDA.
        window, causal: the attention kind the metadata is built for (`prepare_splitkv_metadata`'s; default:
            full, non-causal); a drafter layer of another kind derives its own from it in the step
            (`SplitKVMetadata.with_attention_type`, no collective).
    The block size is `plan_batch`'s. Picklable (a DataLoader worker gets it with the dataset).
    """

    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    dtype: torch.dtype
    num_chunks: Optional[int] = None
    cp_ranks_per_node: Optional[int] = None
    flex_block_masks: bool = False
    chunk_axis: Optional[str] = None
    config: Optional[SplitKVConfig] = None
    window: Optional[int] = None
    causal: bool = False

    def build(self, plan, cp_rank: int, block_size: int):
        """`prepare_splitkv_metadata_from_plan(plan, cp_rank, ...)` with these shapes: unbound, CPU."""
        return prepare_splitkv_metadata_from_plan(
            plan, cp_rank, block_size=block_size, num_heads_q=self.num_heads_q, num_heads_kv=self.num_heads_kv,
            head_dim=self.head_dim, dtype=self.dtype, num_chunks=self.num_chunks,
            cp_ranks_per_node=self.cp_ranks_per_node, flex_block_masks=self.flex_block_masks,
            chunk_axis=self.chunk_axis, config=self.config, window=self.window, causal=self.causal)


def _meta_on(recipe, upload: torch.Tensor, layout):
    """The unbound metadata of `recipe` (`ops.host_metadata.pack_recipe`) on the "metadata" region of the flat
    upload buffer `upload` (views, no copy; its `host_build.buffer` is that region)."""
    for name, _, shape, off in layout:
        if name == "metadata":
            return from_recipe(upload[off:off + shape[0]], recipe)
    raise ValueError("the upload layout has no metadata region")


class _PendingMetadata:
    """Metadata not built yet: its recipe and the upload buffer it will be views of (`_meta_on` on first
    access of `PlannedBatch.metadata`), so that unpickling, pinning and `to` rebuild none of it."""

    __slots__ = ("recipe", "upload", "layout")

    def __init__(self, recipe, upload, layout):
        self.recipe, self.upload, self.layout = recipe, upload, layout


class _LazyMetadata:
    """The `PlannedBatch.metadata` field: stores a value or a `_PendingMetadata`, builds the latter (once) when
    read. Default None."""

    def __get__(self, obj, objtype=None):
        if obj is None:
            return None  # the dataclass default
        v = obj.__dict__.get("_metadata")
        if type(v) is _PendingMetadata:
            v = obj.__dict__["_metadata"] = _meta_on(v.recipe, v.upload, v.layout)
        return v

    def __set__(self, obj, value):
        obj.__dict__["_metadata"] = None if isinstance(value, _LazyMetadata) else value  # the default: None


def _raw_metadata(item):
    """`item.metadata` without building it (None, a `_PendingMetadata` or the metadata)."""
    return item.__dict__.get("_metadata")


@dataclass
class PlannedBatch:
    """One packed batch, planned and sharded for one CP rank (host tensors; `to` uploads them).

    Attributes:
        index: position in the batch stream (0 = the first batch after the skipped ones).
        cp_rank: the CP rank it was sharded for.
        plan: the `planning.Plan` of the global batch (the same on every CP rank).
        shard: `shard_batch(batch.to_dict(), plan, cp_rank)` as CPU tensors (per local context token entries,
            "kv_seq" / "kv_pos", and the "q_*" per local query block entries).
        blocks: this rank's `dflash.DraftBlocks` (`build_draft_blocks` over `plan.query_slice(cp_rank)`).
        kv_seq, kv_pos: [T_r] int64 sequence ids and GLOBAL positions of this rank's context tokens.
        input_ids: [T_r] int64 their token ids (the online target's input).
        features: [T_r, dim] this rank's rows of the feature store, or None without one.
        source: [n_seq] int64 conversation ids of the packed sequences (`PackedBatch.source`).
        num_tokens: context tokens of the global batch.
        metadata: with a `MetadataSpec`: this rank's UNBOUND Split-KV metadata
            (`ops.prepare_splitkv_metadata_from_plan(plan, cp_rank, ...)`); the step binds it to the CP group
            (`item.to(device).metadata.bind(cp_group, device)`) and passes it to the model. None without.

    Storage: everything is a view of ONE flat uint8 buffer (`plan_batch` packs it): first the upload set
    (blocks, kv_seq, kv_pos, input_ids, features, then the metadata's tensors: the metadata region, its
    `host_build.buffer`), then the shard and source. `buffers` = (upload region, its layout, host region, its
    layout), each layout [(name, dtype, shape, byte offset)]. A worker hands an item to the training process
    as that one buffer (ONE shared-memory segment, opened by name: `_ItemBuffer`) plus a small header of
    Python values (the layouts, the metadata's `ops.host_metadata.pack_recipe`) and the plan; the receiver
    rebuilds every field as a view (one `split_with_sizes` per dtype), the metadata included. The
    pin-memory thread pins the upload region with one copy, `to` uploads it with one host-to-device copy,
    and `bind` only wraps the device views (no second copy).
    """

    index: int
    cp_rank: int
    plan: object
    shard: dict
    blocks: object
    kv_seq: torch.Tensor
    kv_pos: torch.Tensor
    input_ids: torch.Tensor
    features: Optional[torch.Tensor]
    source: torch.Tensor
    num_tokens: int
    metadata: Optional[object] = dataclasses.field(default=_LazyMetadata(), repr=False, compare=False)
    # (upload region, its layout, host region, its layout): what the tensors above are views of
    buffers: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)
    # (the whole flat buffer as an `_ItemBuffer`, the metadata's `_pack_recipe` or None): `plan_batch`'s packing
    packing: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def imbalance(self) -> float:
        """The plan's load imbalance, max/mean - 1 (what pretrain_dflash.py logs as planner-imbalance)."""
        return float(self.plan.imbalance)

    @staticmethod
    def _upload_fields(upload, layout, block_size) -> dict:
        """The upload set's fields as views of the flat buffer `upload` (on any device)."""
        u = _views(upload, layout)  # with the metadata region's uint8 view (one split piece), unused here
        blocks = DraftBlocks(**{f: u["blocks." + f] for f in _BLOCK_FIELDS}, block_size=int(block_size))
        return dict(blocks=blocks, kv_seq=u["kv_seq"], kv_pos=u["kv_pos"], input_ids=u["input_ids"],
                    features=u.get("features"))

    @classmethod
    def _from_buffers(cls, index, cp_rank, plan, num_tokens, upload, upload_layout, host, host_layout,
                      recipe=None, packing=None):
        h = _views(host, host_layout)
        source = h.pop("source")
        shard = {k[len("shard."):]: v for k, v in h.items()}
        meta = None if recipe is None else _PendingMetadata(recipe, upload, upload_layout)
        return cls(index=int(index), cp_rank=int(cp_rank), plan=plan, shard=shard, source=source,
                   num_tokens=int(num_tokens), buffers=(upload, upload_layout, host, host_layout), metadata=meta,
                   packing=packing, **cls._upload_fields(upload, upload_layout, plan.block_size))

    def _recipe(self):
        return None if _raw_metadata(self) is None or self.packing is None else self.packing[1]

    def __reduce__(self):
        # to another process: the flat buffer(s) (shared memory) and small Python values; the plan without its
        # per-rank index caches (rebuilt on demand); the metadata as its recipe (its tensors are in the buffer)
        if self.buffers is None or (_raw_metadata(self) is not None and self.packing is None):  # built by hand
            return (PlannedBatch, tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        plan = dataclasses.replace(self.plan, _cache={}) if hasattr(self.plan, "_cache") else self.plan
        upload, ul, host, hl = self.buffers
        whole = None if self.packing is None else self.packing[0]
        if whole is not None and _views_of(whole.tensor, upload, host):
            # THE path of a worker's item: one buffer, one header
            base = whole.tensor.storage_offset()
            header = (self.index, self.cp_rank, self.num_tokens, upload.storage_offset() - base, upload.numel(), ul,
                      _compiled(ul)[2], host.storage_offset() - base, host.numel(), hl, _compiled(hl)[2],
                      self._recipe())
            return (_rebuild_packed_batch, (header, whole, plan))
        return (_rebuild_planned_batch, (self.index, self.cp_rank, plan, self.num_tokens, upload, ul, host, hl,
                                         self._recipe()))

    def _with_upload(self, upload_fn, pinning: bool = False) -> "PlannedBatch":
        if self.buffers is None:  # built by hand: tensor by tensor (the metadata: pinned by its own method)
            blocks = self.blocks.__class__(**{f: upload_fn(getattr(self.blocks, f)) for f in _BLOCK_FIELDS},
                                           block_size=self.blocks.block_size)
            meta = self.metadata
            if meta is not None and pinning:
                meta = meta.pin_memory()
            return dataclasses.replace(self, blocks=blocks, kv_seq=upload_fn(self.kv_seq),
                                       kv_pos=upload_fn(self.kv_pos), input_ids=upload_fn(self.input_ids),
                                       features=None if self.features is None else upload_fn(self.features),
                                       metadata=meta)
        upload, ul, host, hl = self.buffers
        upload = upload_fn(upload)
        recipe = self._recipe()
        # the metadata's tensors follow the buffer (still unbound: `bind` attaches the group)
        meta = None if recipe is None else _PendingMetadata(recipe, upload, ul)
        return dataclasses.replace(self, buffers=(upload, ul, host, hl), metadata=meta,
                                   **self._upload_fields(upload, ul, self.blocks.block_size))

    def pin_memory(self, device=None) -> "PlannedBatch":
        """The upload set (with the metadata's region) in page-locked memory, one copy (the DataLoader's
        pin-memory thread calls this); the other fields stay views of the shared buffer."""
        return self._with_upload(lambda t: t.pin_memory(), pinning=True)

    def to(self, device, non_blocking: bool = True) -> "PlannedBatch":
        """A copy whose upload set lives on `device` (one host-to-device copy of the upload buffer; plan, shard
        and source stay on the host). From pinned memory with non_blocking=True the copy is queued on the
        current stream without a host wait. The metadata (unbound) comes along on `device`: its
        `bind(cp_group, device)` then copies nothing."""
        return self._with_upload(lambda t: t.to(device, non_blocking=non_blocking))


def _views_of(whole: torch.Tensor, *parts) -> bool:
    """True when every tensor of `parts` is a view of `whole`'s storage (same device)."""
    ptr = whole.untyped_storage().data_ptr()
    return all(p.device == whole.device and p.untyped_storage().data_ptr() == ptr for p in parts)


def _rebuild_planned_batch(index, cp_rank, plan, num_tokens, upload, upload_layout, host, host_layout,
                           recipe=None):
    return PlannedBatch._from_buffers(index, cp_rank, plan, num_tokens, upload, upload_layout, host, host_layout,
                                      recipe, packing=(None, recipe))


def _rebuild_packed_batch(header, whole: _ItemBuffer, plan):
    """A worker's item in the receiving process: every field a view of the one buffer `whole`."""
    index, cp_rank, num_tokens, up_off, up_n, ul, ul_plan, host_off, host_n, hl, hl_plan, recipe = header
    _compiled(ul, ul_plan)  # the worker's view plans: nothing to compile here
    _compiled(hl, hl_plan)
    t = whole.tensor
    return PlannedBatch._from_buffers(index, cp_rank, plan, num_tokens, t[up_off:up_off + up_n], ul,
                                      t[host_off:host_off + host_n], hl, recipe,
                                      packing=(whole, recipe))


def plan_batch(batch, *, cp_size: int, cp_rank: int, block_size: int, mask_token_id: int,
               chunk_size: Optional[int] = None, strategy: str = "lpt", gamma: Optional[float] = None,
               feature_store=None, index: int = 0, metadata: Optional[MetadataSpec] = None,
               cost_model=None) -> PlannedBatch:
    """Plan, shard, draft blocks and (optionally) feature rows of one packed batch for one CP rank.

    Args:
        batch: a `data.sharegpt.PackedBatch` (seq_lens, anchors, input_ids, loss_mask, source, to_dict()).
        cp_size, cp_rank: the CP group size and this rank (0 <= cp_rank < cp_size).
        block_size: B; mask_token_id: the MASK id; gamma: loss decay (None: `dflash.default_gamma(B)`).
        chunk_size, strategy, cost_model: the planner's (`--cp-chunk-size`, `--cp-balance`, the `CostModel`
            with the drafter's layer windows; None: the default).
        feature_store: an object with `rows(source, kv_seq, kv_pos) -> [T_r, dim] tensor`
            (`megatron.models.FeatureStore`, which also has `dim`, `torch_dtype` and `rows(..., out=)`: the
            rows are then read straight into the item's buffer), or None.
        index: stored in the result (stream position).
        metadata: a `MetadataSpec` (the attention's shapes): also build this rank's unbound Split-KV metadata
            (`PlannedBatch.metadata`, packed into the upload region); None (default): no metadata.
    Returns: `PlannedBatch` (CPU tensors, all views of one flat uint8 buffer; in a DataLoader worker in shared
        memory). Raises TypeError for a `metadata` that is not a MetadataSpec, and what the planner,
        `shard_batch`, `build_draft_blocks`, the feature store or `prepare_splitkv_metadata_from_plan` raise
        for inconsistent inputs.
    """
    if metadata is not None and not isinstance(metadata, MetadataSpec):
        raise TypeError(f"metadata must be a MetadataSpec or None, got {type(metadata).__name__}")
    plan = plan_context_parallel(batch.seq_lens, batch.anchors, block_size=block_size, cp_size=cp_size,
                                 chunk_size=chunk_size, strategy=strategy, cost_model=cost_model)
    shard = shard_batch(batch.to_dict(), plan, cp_rank)
    sl = plan.query_slice(cp_rank)
    blocks = build_draft_blocks(batch.input_ids, batch.seq_lens, plan.q_seq[sl], plan.q_anchor[sl],
                                block_size=block_size, mask_token_id=mask_token_id, loss_mask=batch.loss_mask,
                                gamma=gamma)
    host_t = {"shard." + k: torch.as_tensor(v) for k, v in shard.items()}
    host_t["source"] = torch.as_tensor(np.asarray(batch.source, dtype=np.int64))
    kv_seq = host_t["shard.kv_seq"].to(torch.int64)
    kv_pos = host_t["shard.kv_pos"].to(torch.int64)
    up_t = {"blocks." + f: getattr(blocks, f) for f in _BLOCK_FIELDS}
    up_t.update(kv_seq=kv_seq, kv_pos=kv_pos, input_ids=host_t["shard.input_ids"].to(torch.int64))
    up_specs = [(k, t.dtype, t.shape) for k, t in up_t.items()]
    direct = feature_store is not None and hasattr(feature_store, "dim") and hasattr(feature_store, "torch_dtype")
    if feature_store is not None:
        if direct:  # read the rows straight into the buffer below
            up_specs.append(("features", feature_store.torch_dtype, (kv_seq.shape[0], int(feature_store.dim))))
        else:
            up_t["features"] = feature_store.rows(batch.source, kv_seq, kv_pos)
            up_specs.append(("features", up_t["features"].dtype, up_t["features"].shape))
    meta = recipe = None
    if metadata is not None:
        meta = metadata.build(plan, cp_rank, block_size)
        recipe = pack_recipe(meta)
        up_specs.append(("metadata", torch.uint8, (recipe[1],)))
    up_layout, up_n = _layout(up_specs)
    host_layout, host_n = _layout([(k, t.dtype, t.shape) for k, t in host_t.items()])
    host_end = up_n + host_n
    whole, by_name = _new_bytes(host_end, torch.utils.data.get_worker_info() is not None)
    upload, host = whole[:up_n], whole[up_n:host_end]
    _fill(_views(upload, [x for x in up_layout if x[0] != "metadata"]), up_t)
    _fill(_views(host, host_layout), host_t)
    if meta is not None:  # the metadata's tensors into their region (the recipe's layout)
        (_, _, _, moff), = [x for x in up_layout if x[0] == "metadata"]
        region = upload[moff:moff + recipe[1]]
        for dst, src in zip(split_views(region, recipe[0]), unique_tensors(meta)):
            if src.numel():
                dst.copy_(src)
    item = PlannedBatch._from_buffers(index, cp_rank, plan, batch.num_tokens, upload, up_layout, host, host_layout,
                                      recipe, packing=(_ItemBuffer(whole, by_name), recipe))
    if direct:
        feature_store.rows(batch.source, kv_seq, kv_pos, out=item.features)
    return item


class PlannedBatchDataset(torch.utils.data.IterableDataset):
    """`plan_batch` over a stream of packed batches, split over DataLoader workers by stream position.

    Args:
        batches: a zero-argument callable returning an iterator of packed batches (the same deterministic
            stream on every call; picklable, e.g. a `functools.partial` of `data_parallel_batches`, when the
            DataLoader's workers are not forked).
        plan_kwargs: keyword arguments of `plan_batch` (cp_size, cp_rank, block_size, mask_token_id, ...).
    Worker w of N yields the `PlannedBatch` of stream positions k = w, w + N, ...; in the training process
    (no worker) every position.
    """

    def __init__(self, batches: Callable[[], Iterator], **plan_kwargs):
        super().__init__()
        if not callable(batches):
            raise TypeError(f"batches must be a zero-argument callable returning an iterator, got {type(batches)}")
        self.batches, self.plan_kwargs = batches, plan_kwargs

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        n, w = (1, 0) if info is None else (info.num_workers, info.id)
        for k, batch in enumerate(self.batches()):
            if k % n == w:
                yield plan_batch(batch, index=k, **self.plan_kwargs)


def _identity(item):
    return item


def _check_count(value, name: str, minimum: int) -> int:
    return as_int(value, name, minimum=minimum, what=f"an integer >= {minimum}")


class PrefetchedBatches:
    """Iterator of `PlannedBatch` items, prepared ahead of the step in DataLoader worker processes.

    Args:
        batches: zero-argument callable returning the packed-batch iterator (see `PlannedBatchDataset`).
        num_workers: worker processes (`--dflash-data-workers`); 0 = synchronous: `plan_batch` runs in this
            process when `next` is called (the behaviour before the pipeline existed).
        prefetch: items each worker prepares ahead (the DataLoader's prefetch_factor, >= 1); the host holds up
            to about num_workers * prefetch + 2 items (with offline features mostly their rows).
        pin_memory: page-lock the upload set (default: with workers, when CUDA is available).
        multiprocessing_context: the DataLoader's (default: torch's, fork on Linux).
        plan_kwargs: `plan_batch`'s keyword arguments (cp_size, cp_rank, block_size, mask_token_id, ...).
    Raises ValueError for a negative num_workers or a prefetch < 1. `next` re-raises a worker's exception
    (the DataLoader's wrapper: same type, the worker's traceback in the message) and raises RuntimeError
    when a worker died or an item arrives out of stream order.
    """

    def __init__(self, batches: Callable[[], Iterator], *, num_workers: int = 1, prefetch: int = 2,
                 pin_memory: Optional[bool] = None, multiprocessing_context=None, **plan_kwargs):
        self.num_workers = _check_count(num_workers, "num_workers", 0)
        self.prefetch = _check_count(prefetch, "prefetch", 1)
        self.dataset = PlannedBatchDataset(batches, **plan_kwargs)
        self.pin_memory = bool(torch.cuda.is_available() if pin_memory is None else pin_memory) and self.num_workers > 0
        self._next_index = 0
        self.loader = None
        if self.num_workers == 0:
            self._it = iter(self.dataset)
        else:
            self.loader = torch.utils.data.DataLoader(
                self.dataset, batch_size=None, collate_fn=_identity, num_workers=self.num_workers,
                prefetch_factor=self.prefetch, pin_memory=self.pin_memory,
                multiprocessing_context=multiprocessing_context, in_order=True, worker_init_fn=_worker_init)
            self._it = iter(self.loader)  # starts the workers, which start preparing

    def __iter__(self):
        return self

    def __next__(self) -> PlannedBatch:
        if self._it is None:
            raise StopIteration
        item = next(self._it)
        if item.index != self._next_index:
            raise RuntimeError(f"data pipeline: got batch {item.index} of the stream, expected {self._next_index} "
                               "(the DataLoader returned its workers' items out of order)")
        self._next_index += 1
        return item

    def close(self) -> None:
        """Stop the workers (also done when the iterator is garbage collected or the process exits), then free
        the shared-memory segments of the items they had sent that this process never received
        (`_free_unreceived`; items already received, held or not, are left to their owners)."""
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            pids = [w.pid for w in getattr(it, "_workers", ()) if w.pid is not None]
            shutdown()
            _free_unreceived(pids)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _worker_init(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: end the worker process as a forked one ends, without the interpreter's
    finalisation. A worker started by spawn / forkserver returns through `sys.exit`, and in the finalisation
    that follows (C++ static destructors, after every Python frame is gone) it aborted in about 1 of 30 to 1 of
    5 runs on a loaded 2-core CPU ("terminate called without an active exception", SIGABRT; the DataLoader
    then raises "DataLoader worker ... is killed by signal: Aborted" in the training process while closing:
    tests/test_data_pipeline.py's spawned-worker test flaked with it, also at bec9358). A forked worker never
    runs that finalisation (multiprocessing ends it with os._exit) and never aborted. So an atexit handler,
    run after the worker loop and multiprocessing's own exit work, flushes stdio and calls os._exit(0). The
    worker loop sends its errors through the DataLoader's queue; a worker that dies before its data is done is
    still reported by the DataLoader ("exited unexpectedly")."""
    atexit.register(_exit_worker)


def _exit_worker() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


def _free_unreceived(pids) -> None:
    """Unlink the shared-memory segments that the (exited) DataLoader workers `pids` created and this process
    does not hold: the `_ItemBuffer`s of items sent but never received. Each sent item keeps a reference for
    its receiver (`_reduce_item_buffer`), dropped when the receiver opens it; an item left in the queue at
    shutdown is never opened, so its segment would stay in /dev/shm until this process exits (torch's
    shared-memory manager unlinks it then). The segments are torch's "/torch_<pid>_..." names (libshm); the
    ones this process opened are in `torch.multiprocessing.reductions.shared_cache` while alive and are kept.
    Linux (/dev/shm) only; best effort (a segment already gone is skipped)."""
    shm = "/dev/shm"
    if not pids or not os.path.isdir(shm):
        return
    alive = set()
    for handle, ref in list(reductions.shared_cache.items()):
        if not ref.expired():
            alive.add((handle.decode() if isinstance(handle, bytes) else str(handle)).lstrip("/"))
    prefixes = tuple(f"torch_{int(pid)}_" for pid in pids)
    try:
        names = os.listdir(shm)
    except OSError:
        return
    for name in names:
        if name.startswith(prefixes) and name not in alive:
            try:
                os.unlink(os.path.join(shm, name))
            except OSError:
                pass


def _check_epoch_len(n: int, dp_size: int, epoch: int) -> None:
    if n == 0:
        raise ValueError(f"the loader has no batches in epoch {epoch} (empty corpus?)")
    if n < dp_size:
        raise ValueError(f"the loader has {n} batches in epoch {epoch}, fewer than dp_size = {dp_size}: "
                         "data-parallel ranks would get no batch (use a larger corpus / smaller batches, or "
                         "fewer data-parallel ranks)")


def data_parallel_batches(loader, dp_size: int, dp_rank: int, skip: int = 0):
    """This data-parallel rank's packed batches, endless and deterministic: epoch e = 0, 1, ... of `loader`
    (`set_epoch(e)`), the batches i with i % dp_size == dp_rank, the first `skip` of them left out.

    `loader` is a `data.sharegpt.ShareGPTLoader` (or anything with `set_epoch(epoch, start=)`, `len()` after
    set_epoch, and iteration from `start`). Resume does not build the skipped batches: whole epochs are
    counted with `len`, then the resumed epoch starts at its batch (a batch depends only on the seed, the
    epoch and its index). Raises ValueError when the loader has no batches (the stream would be empty), or
    fewer batches than data-parallel ranks in an epoch (`len(loader) < dp_size`: some rank would get no batch
    of that epoch, and one that never gets any would loop forever looking for one while the others wait for
    it in the gradient all-reduce). `len(loader)` depends only on the loader's seed and the epoch, so every
    rank raises the same error at the same epoch, without communicating.
    """
    dp_size = _check_count(dp_size, "dp_size", 1)
    dp_rank = _check_count(dp_rank, "dp_rank", 0)
    skip = _check_count(skip, "skip", 0)
    if dp_rank >= dp_size:
        raise ValueError(f"dp_rank must be < dp_size = {dp_size}, got {dp_rank}")
    epoch, start = 0, dp_rank
    while True:  # whole epochs already consumed
        loader.set_epoch(epoch)
        n = len(loader)
        _check_epoch_len(n, dp_size, epoch)
        mine = max(0, math.ceil((n - dp_rank) / dp_size))
        if skip < mine:
            start = dp_rank + skip * dp_size
            break
        skip -= mine
        epoch += 1
    while True:
        loader.set_epoch(epoch, start=start)
        _check_epoch_len(len(loader), dp_size, epoch)
        for j, batch in enumerate(loader):
            if (start + j) % dp_size == dp_rank:
                yield batch
        epoch, start = epoch + 1, 0
