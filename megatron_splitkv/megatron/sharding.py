"""Planner-driven replacement of Megatron's `get_batch_on_this_cp_rank` for DFlash drafter batches.

Megatron-Core's `get_batch_on_this_cp_rank` cuts every sequence into 2P zigzag pieces. For the drafter
the cost of a context token depends on the anchors after it, so Split-KV shards context with the LPT
planner instead (`megatron_splitkv.planning.plan_context_parallel`) and hands each CP rank its context
tokens with GLOBAL positions and sequence ids plus an equal share of the query blocks
(`megatron_splitkv.data.sharding.shard_batch`). The plan is deterministic, so every CP rank computes the
same plan from the same global batch (Megatron loads the identical micro-batch on all CP ranks) and no
communication is needed.

`prefetch_planned_batches` does the same planning and sharding (plus the draft blocks and the feature rows)
in the data pipeline: DataLoader worker processes prepare each batch ahead of the training step
(`megatron_splitkv.data.pipeline`, `--dflash-data-workers`), so the step only uploads pinned tensors.

Source: DESIGN.md section 3; arXiv 2611.05926 ("LPT load balancing").
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..data.pipeline import MetadataSpec, PrefetchedBatches
from ..data.sharding import shard_batch
from ..planning import plan_context_parallel
from .arguments import check_attention_heads, data_prefetch_from_args, data_workers_from_args, \
    planner_cost_model_from_args
from .attention import DFlashPackedSeqParams

__all__ = ["get_batch_on_this_cp_rank_splitkv", "planner_kwargs_from_args", "prefetch_planned_batches",
           "splitkv_metadata_spec"]


def splitkv_metadata_spec(config, *, tp_size: Optional[int] = None, kernel_backend: str = "auto",
                          cuda: Optional[bool] = None, num_chunks: Optional[int] = None,
                          cp_ranks_per_node: Optional[int] = None, splitkv_config=None, layer_attention=None):
    """The `data.pipeline.MetadataSpec` of the drafter's Split-KV core attention, derived from its
    `TransformerConfig` exactly as Megatron's `Attention` splits the heads over tensor parallelism: Hq =
    num_attention_heads / TP, Hkv = num_query_groups (None: num_attention_heads) / TP, head_dim =
    kv_channels (None: hidden_size / num_attention_heads), dtype = params_dtype (the activations' dtype
    under --bf16 / --fp16 / fp32).

    Args:
        config: the drafter's TransformerConfig. tp_size: TP size (default: config.tensor_model_parallel_size).
        kernel_backend: `--splitkv-kernel`; the FlexAttention block tables are built on the host (the first
            layer's flex call then builds no BlockMask) for auto / flex / staircase on CUDA.
        cuda: whether the model runs on CUDA (default: torch.cuda.is_available()).
        num_chunks, cp_ranks_per_node: as the core attention's prepare (None: splitkv_config's fields).
        splitkv_config: the core attention's `SplitKVConfig` (None: the defaults), carried by the metadata.
        layer_attention: the layers' (window, causal) (`arguments.layer_attention_from_args`; None: all full):
            the metadata is built for the first layer's kind; layers of other kinds derive theirs from it in
            the step without a collective (`DFlashPackedSeqParams.op_metadata`, `with_attention_type`).
    Raises SplitKVArgumentError (`arguments.check_attention_heads`) when the heads do not split over TP.
    """
    tp = int(tp_size if tp_size is not None else getattr(config, "tensor_model_parallel_size", 1) or 1)
    heads = int(config.num_attention_heads)
    groups = int(config.num_query_groups or heads)
    check_attention_heads(heads, groups, tp)
    head_dim = int(config.kv_channels or config.hidden_size // heads)
    cuda = torch.cuda.is_available() if cuda is None else bool(cuda)
    window, causal = tuple(layer_attention)[0] if layer_attention else (None, False)
    return MetadataSpec(window=window, causal=bool(causal), num_heads_q=heads // tp, num_heads_kv=groups // tp, head_dim=head_dim,
                        dtype=config.params_dtype, num_chunks=num_chunks, cp_ranks_per_node=cp_ranks_per_node,
                        flex_block_masks=cuda and kernel_backend in ("auto", "flex", "staircase", "fa4"),
                        config=splitkv_config)


def planner_kwargs_from_args(args) -> dict:
    """`chunk_size`, `strategy`, `block_size`, `cost_model` for `get_batch_on_this_cp_rank_splitkv` from parsed
    Megatron args (`--cp-chunk-size`, `--cp-balance`, `--dflash-block-size`; the cost model's layer windows
    from `--dflash-layer-types` / `--dflash-sliding-window`, None = the default cost: `planner_cost_model_from_args`)."""

    return {
        "chunk_size": getattr(args, "cp_chunk_size", None),
        "strategy": getattr(args, "cp_balance", "lpt") or "lpt",
        "block_size": int(getattr(args, "dflash_block_size", 16) or 16),
        "cost_model": planner_cost_model_from_args(args),
    }


def _cp_rank_size(cp_group, pg_collection):
    if cp_group is None and pg_collection is not None:
        cp_group = getattr(pg_collection, "cp", None)
    if cp_group is None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return (
                parallel_state.get_context_parallel_rank(),
                parallel_state.get_context_parallel_world_size(),
            )
        return 0, 1
    return dist.get_rank(cp_group), dist.get_world_size(cp_group)


def get_batch_on_this_cp_rank_splitkv(
    batch: dict,
    *,
    seq_lens,
    anchors,
    block_size: int,
    chunk_size: Optional[int] = None,
    strategy: str = "lpt",
    cp_group=None,
    pg_collection=None,
    cp_rank: Optional[int] = None,
    cp_size: Optional[int] = None,
    plan=None,
    qkv_format: str = "sbhd",
    **planner_kwargs,
):
    """This CP rank's share of a packed drafter batch, planned by LPT (or a baseline strategy).

    Args:
        batch: global packed batch, identical on every CP rank: per-token entries with leading dim
            T = sum(seq_lens) ("input_ids" required, "loss_mask", context features e.g.
            "hidden_states" [T, n_taps*hidden], ...); see `megatron_splitkv.data.sharding`.
        seq_lens: [n_seq] context length of each packed sequence.
        anchors: n_seq sorted int arrays, the sampled anchors of each sequence.
        block_size: B. chunk_size: planner chunk (None = auto). strategy: "lpt" | "contiguous" |
            "zigzag" | "hypergraph" (`--cp-balance`).
        cp_group / pg_collection: CP group (default parallel_state's); or pass cp_rank and cp_size.
        plan: a precomputed `Plan` (skips planning). qkv_format: of the returned params.
        planner_kwargs: forwarded to `plan_context_parallel`.

    Returns:
        (local, params, plan): `local` the `shard_batch` dict (per local context token entries,
        "kv_seq"/"kv_pos", and "q_*" per local query block: "q_seq", "q_anchor", "q_labels",
        "q_label_mask", ...); `params` a `DFlashPackedSeqParams` built from it (int64, on the device of
        batch["input_ids"]) to pass as `packed_seq_params=` to the DFlash TransformerBlock; `plan`.

    Raises ValueError from the planner/sharder for inconsistent inputs, and when `plan.cp_size`
    differs from the CP group size.
    """
    if cp_rank is None or cp_size is None:
        r, p = _cp_rank_size(cp_group, pg_collection)
        cp_rank = r if cp_rank is None else cp_rank
        cp_size = p if cp_size is None else cp_size
    if plan is None:
        plan = plan_context_parallel(
            seq_lens, anchors, block_size=block_size, cp_size=cp_size, chunk_size=chunk_size,
            strategy=strategy, **planner_kwargs,
        )
    if plan.cp_size != cp_size:
        raise ValueError(f"plan.cp_size={plan.cp_size} != context-parallel size {cp_size}")
    local = shard_batch(batch, plan, cp_rank)

    def as_i64(x):
        return torch.as_tensor(x).to(torch.int64)

    params = DFlashPackedSeqParams(
        qkv_format=qkv_format,
        q_seq=as_i64(local["q_seq"]),
        q_anchor=as_i64(local["q_anchor"]),
        kv_seq=as_i64(local["kv_seq"]),
        kv_pos=as_i64(local["kv_pos"]),
        block_size=int(plan.block_size),
    )
    return local, params, plan


def prefetch_planned_batches(batches, args, *, mask_token_id: int, gamma: Optional[float] = None,
                             feature_store=None, cp_group=None, pg_collection=None, cp_rank: Optional[int] = None,
                             cp_size: Optional[int] = None, num_workers: Optional[int] = None,
                             prefetch: Optional[int] = None, pin_memory: Optional[bool] = None,
                             metadata=None):
    """The data pipeline of a DFlash drafter job: an iterator of `megatron_splitkv.data.pipeline.PlannedBatch`
    (plan, this CP rank's shard, draft blocks, kv_seq / kv_pos, feature rows), prepared in DataLoader worker
    processes ahead of the step; in forward_step `item = next(it); dev = item.to(device)` (non_blocking).

    Args:
        batches: zero-argument callable returning this DP rank's packed-batch iterator (e.g.
            `functools.partial(megatron_splitkv.data.pipeline.data_parallel_batches, loader, dp, dp_rank, skip)`).
        args: parsed Megatron args: `--cp-balance`, `--cp-chunk-size`, `--dflash-block-size`, the layer types
            (`planner_kwargs_from_args`), `--dflash-data-workers`, `--dflash-data-prefetch`.
        mask_token_id, gamma: of `dflash.build_draft_blocks`. feature_store: a `models.FeatureStore` or None.
        cp_group / pg_collection / cp_rank / cp_size: the CP group (default parallel_state's).
        num_workers, prefetch, pin_memory: override the flags / the default (pinned on CUDA).
        metadata: a `data.pipeline.MetadataSpec` (`splitkv_metadata_spec(config, ...)`): each item also carries
            this rank's unbound Split-KV metadata (`PlannedBatch.metadata`; `--dflash-host-metadata`); None: no.
    Returns `megatron_splitkv.data.pipeline.PrefetchedBatches` (0 workers: synchronous, in the step).
    Raises SplitKVArgumentError naming `--dflash-data-workers` / `--dflash-data-prefetch` for bad values.
    """
    if cp_rank is None or cp_size is None:
        r, p = _cp_rank_size(cp_group, pg_collection)
        cp_rank = r if cp_rank is None else cp_rank
        cp_size = p if cp_size is None else cp_size
    kw = planner_kwargs_from_args(args)
    workers = data_workers_from_args(args) if num_workers is None else num_workers
    depth = data_prefetch_from_args(args) if prefetch is None else prefetch
    return PrefetchedBatches(batches, num_workers=workers, prefetch=depth, pin_memory=pin_memory, cp_size=cp_size,
                             cp_rank=cp_rank, block_size=kw["block_size"], chunk_size=kw["chunk_size"],
                             strategy=kw["strategy"], cost_model=kw["cost_model"], mask_token_id=int(mask_token_id), gamma=gamma,
                             feature_store=feature_store, metadata=metadata)
